"""The filter box at the top of each tab: typing part of a label, an option name or a --flag shows only the
matching options, across all groups, and opens the groups they are in. It runs in the browser (no server round
trip per keystroke for ~300 controls). A closed group's controls are not in the page yet, so the tab's index of
(option, label, the group and sub-group it is in) is embedded in the script: it opens the groups first (a
sub-group once its group is drawn), then hides what does not match once their controls exist. Controls carry
elem_id "<tab>-<option>" (actions.elem_id), groups "<tab>-acc-<group>"."""

from __future__ import annotations

import json

from .. import params as P
from . import actions as A

FILTER_JS = """(query) => {
  const tab = %s, index = %s;
  const q = (query || '').trim().toLowerCase().replace(/^-+/, '');
  const hits = new Set(), groups = new Set();
  for (const [name, label, path] of index) {
    if (q && (name.includes(q) || label.includes(q))) { hits.add(name); path.forEach((g) => groups.add(g)); }
  }
  const apply = () => {
    document.querySelectorAll(`[id^="${tab}-acc-"]`).forEach((acc) => {
      const group = acc.id.slice(tab.length + 5);
      acc.style.display = (!q || groups.has(group)) ? '' : 'none';
      const head = acc.querySelector('.label-wrap');
      if (q && groups.has(group) && head && !head.classList.contains('open')) head.click();
    });
    for (const [name] of index) {
      const el = document.getElementById(`${tab}-${name}`);
      if (el) el.style.display = (!q || hits.has(name)) ? '' : 'none';
    }
  };
  apply();
  setTimeout(apply, 200);  // controls of the groups just opened appear after a moment
  setTimeout(apply, 800);
  return query;
}"""


def _search_text(p) -> str:
    """What the filter matches: the label and the --flag (a network-type field: "network_args key=")."""
    flag = f"network_args {p.network_arg}=" if p.network_arg else f"--{p.name}"
    return f"{p.label} {flag}".lower()


def filter_js(tab: str, params) -> str:
    """The filter script of a tab; `params`: its controls (registry Params)."""
    index = [[A.elem_id(tab, p).removeprefix(f"{tab}-"), _search_text(p),
              list(dict.fromkeys([P.top_group(p.accordion), p.accordion]))] for p in params]
    return FILTER_JS % (json.dumps(tab), json.dumps(index))

"""The filter box at the top of each tab: typing part of a label, an option name or a --flag shows only the
matching options (every word typed is in the label or flag), across all groups, and opens the groups they are in;
the line under the box says when nothing matches, or when a match is only for another model family. It runs in
the browser (no server round trip per keystroke for ~300 controls). A closed group's controls are not in the page yet, so the tab's index of
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
  const words = q.split(/\\s+/).filter(Boolean);
  const familyBox = document.querySelector(`#${tab}-family input`);
  const family = familyBox ? familyBox.value : '';
  const hits = new Set(), groups = new Set(), elsewhere = [];
  for (const [name, text, path, families, label] of index) {
    if (!words.length || !words.every((w) => text.includes(w) || name.includes(w))) continue;
    if (!family || families.includes(family)) { hits.add(name); path.forEach((g) => groups.add(g)); }
    else elsewhere.push(`${label} (${families.join(', ')} only)`);
  }
  const hint = document.getElementById(`${tab}-filter-hint`);
  if (hint) {
    let text = '';
    if (q && !hits.size && !elsewhere.length) text = `No option matches "${query.trim()}".`;
    else if (q && !hits.size) {
      text = `No option of ${family} matches; of other model families: ${elsewhere.join('; ')}.`;
    }
    else if (q && elsewhere.length) text = `Also for other model families: ${elsewhere.join('; ')}.`;
    hint.textContent = text;
    hint.style.display = text ? '' : 'none';
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
    """The filter script of a tab; `params`: its controls (registry Params). Each entry: the control's id, what
    the filter matches (every typed word must be in it), its groups, the model families it is for and its label
    (for the hint under the box: "no match", or the families a match is only for)."""
    index = [[A.elem_id(tab, p).removeprefix(f"{tab}-"), _search_text(p),
              list(dict.fromkeys([P.top_group(p.accordion), p.accordion])),
              [f for f in P.FAMILIES if p.applies(tab, f)], p.label] for p in params]
    return FILTER_JS % (json.dumps(tab), json.dumps(index))

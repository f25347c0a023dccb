"""The filter box at the top of each tab: typing part of a label, an option name or a --flag shows only the
matching options, across all groups, and opens the groups they are in. It runs in the browser (no server round
trip per keystroke for ~230 controls). A closed group's controls are not in the page yet, so the tab's index of
(option, label, group) is embedded in the script: it opens the groups first, then hides what does not match
once their controls exist. Controls carry elem_id "<tab>-<option>", groups "<tab>-acc-<group>"."""

from __future__ import annotations

import json

FILTER_JS = """(query) => {
  const tab = %s, index = %s;
  const q = (query || '').trim().toLowerCase().replace(/^-+/, '');
  const hits = new Set(), groups = new Set();
  for (const [name, label, group] of index) {
    if (q && (name.includes(q) || label.includes(q))) { hits.add(name); groups.add(group); }
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


def filter_js(tab: str, params) -> str:
    """The filter script of a tab; `params`: its controls (registry Params)."""
    index = [[p.name, f"{p.label} --{p.name}".lower(), p.accordion] for p in params]
    return FILTER_JS % (json.dumps(tab), json.dumps(index))

"""Which controls and groups a tab shows for its model family (and, for the LoRA tab's network-type fields, for its
network module), done in the page: each control and group carries CSS classes naming the families (and modules)
it is for, the page's script puts the tab's family and effective network module on <body> when they change, and
one style sheet hides what does not apply. A family change then costs the browser no Gradio update at all (a
Gradio update per control made each family change redraw ~300 controls). The facts stay params.py's
(`Param.applies`, `Param.modules`, `accordion_visible`, `network_module`); this module only turns them into classes.

Before the page's script first runs (the first moments of a page load), the tab element's start classes (the form
it was built with) select the same rules."""

from __future__ import annotations

import functools
import json
import re

from .. import params as P


def slug(name: str) -> str:
    """A family or network module as a CSS class word ("SD1.x" -> "sd1-x", "lycoris.kohya" -> "lycoris-kohya")."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _hidden_families(tab: str, shown) -> list[str]:
    return [f for f in P.tab_families(tab) if not shown(f)]


def _shown_for_family(tab: str, p: P.Param, family: str) -> bool:
    """Shown for the family with some network module (the module part is the kg-net / kg-mod- classes)."""
    return any(P.visible(p, tab, family, m) for m in (sorted(p.modules) if p.network_arg else [""]))


def control_shown_somewhere(tab: str, p: P.Param) -> bool:
    """False for a control no family of the tab shows (it is never drawn)."""
    return len(_hidden_families(tab, lambda f: _shown_for_family(tab, p, f))) < len(P.tab_families(tab))


def control_classes(tab: str, p: P.Param) -> list[str]:
    """kg-hide-<family> for each family of the tab that does not show it; a network-type field: kg-net and
    kg-mod-<module> for each network module that reads its key."""
    out = [f"kg-hide-{slug(f)}" for f in _hidden_families(tab, lambda f: _shown_for_family(tab, p, f))]
    if p.network_arg:
        out += ["kg-net", *(f"kg-mod-{slug(m)}" for m in _modules() if p.shown_for(m))]
    return out


def group_shown_somewhere(tab: str, key: str) -> bool:
    return key == "model" or len(group_classes(tab, key)) < len(P.tab_families(tab))


def group_classes(tab: str, key: str) -> list[str]:
    if key == "model":
        return []
    return [f"kg-hide-{slug(f)}" for f in _hidden_families(tab, lambda f: P.accordion_visible(key, tab, f))]


def row_classes(tab: str, params: list[P.Param]) -> list[str]:
    """A row of controls is hidden for the families none of its controls is for (an empty row keeps its frame)."""
    common = set.intersection(*(set(control_classes(tab, p)) for p in params)) if params else set()
    return sorted(c for c in common if c.startswith("kg-hide-"))


@functools.cache
def _modules() -> list[str]:
    """Every network module some network-type field is for."""
    return sorted({m for p in P.CONTROL_PARAMS if p.network_arg for m in p.modules})


def effective_module(family: str, module: str) -> str:
    """The module whose fields show: the field's value, or the family's LoRA when empty; "" when no field is for
    it (a module typed by the user)."""
    m = P.network_module(module, family)
    return m if m in _modules() else ""


def per_family_html(tab: str, text_of) -> str:
    """One span per family of the tab, each shown only for its family (text_of(family) -> HTML)."""
    families = P.tab_families(tab)
    return "".join('<span class="%s">%s</span>' % (" ".join(f"kg-hide-{slug(o)}" for o in families if o != f),
                                                    text_of(f)) for f in families)


def start_classes(tab: str, family: str, module: str = "") -> list[str]:
    """The tab element's classes for the form it is built with."""
    return [f"kg-start-{slug(family)}", f"kg-startmod-{slug(effective_module(family, module)) or 'none'}"]


def css() -> str:
    """The rules for every tab, family and network module."""
    rules = []
    hide = "{display: none !important;}"
    for tab in P.TABS:
        body, mod = f"data-kg-{tab}-family", f"data-kg-{tab}-module"
        for f in P.tab_families(tab):
            s = slug(f)
            rules.append(f"body:not([{body}]) #tab-{tab}.kg-start-{s} .kg-hide-{s}, "
                         f"body[{body}={json.dumps(f)}] #tab-{tab} .kg-hide-{s} {hide}")
        if not any(p.network_arg and tab in p.tabs for p in P.CONTROL_PARAMS):
            continue
        for m in _modules():
            s = slug(m)
            rules.append(f"body:not([{mod}]) #tab-{tab}.kg-startmod-{s} .kg-net:not(.kg-mod-{s}), "
                         f"body[{mod}={json.dumps(m)}] #tab-{tab} .kg-net:not(.kg-mod-{s}) {hide}")
        rules.append(f"body:not([{mod}]) #tab-{tab}.kg-startmod-none .kg-net, body[{mod}=\"\"] #tab-{tab} .kg-net "
                     f"{hide}")
    return "\n".join(rules) + "\n"


FOLLOW_JS = """(family, module) => {
  const tab = %s, defaults = %s, modules = %s;
  document.body.setAttribute(`data-kg-${tab}-family`, family || '');
  const m = module || defaults[family] || '';
  document.body.setAttribute(`data-kg-${tab}-module`, modules.includes(m) ? m : '');
}"""


def follow_js(tab: str) -> str:
    """The script a tab's family and network module changes run: (family, module) -> the <body> attributes."""
    defaults = {f: P.network_module("", f) for f in P.tab_families(tab)}
    return FOLLOW_JS % (json.dumps(tab), json.dumps(defaults), json.dumps(_modules()))

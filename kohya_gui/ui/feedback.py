"""Feedback where the user looks, and a form that survives a refresh or a restart.

- Message areas (`message_area`) sit right under the buttons whose results they show (Open/Save under the
  configuration bar, Start/Stop/Print under the run buttons); errors (actions.error_md, a block quote) are red;
  after a click the area is scrolled into view when it is outside the window (`follow`).
- The run panel: the settings file of the run (`settings_html`), and after a Start click that did not start a run
  the previous run's result is hidden (`NOTICE`), so that an old failure is not read as the answer.
- Each tab's settings are remembered (kohya_gui.last_settings) on every edit, Start, Print, Save and Open, and put
  back into the form on each page load (`restore_on_load`): during a run, its tab shows the run's settings."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from .. import config_file, last_settings, presets
from .. import params as P
from . import actions as A
from .run_notice import NOTICE, StartNotice, not_started_html, settings_html  # noqa: F401  (re-exported)

CSS = """
.kg-msg blockquote {color: var(--error-text-color); background: var(--error-background-fill);
  border-left: 4px solid var(--error-border-color); padding: 6px 10px; margin: 4px 0;}
.kg-msg blockquote * {color: var(--error-text-color);}
.kg-run-settings {font-size: 0.9em; opacity: 0.85; margin-top: 4px;}
"""


def message_area(elem_id: str) -> gr.Markdown:
    return gr.Markdown(elem_id=elem_id, elem_classes="kg-msg")


def follow(event, elem_id: str):
    """After `event`, scrolls its message area into view if it is outside the window (a long form: the button
    can be at the bottom edge of the window)."""
    # after the message is drawn (it grows the area), and centred so that a few more lines still fit
    js = ("() => setTimeout(() => { const e = document.getElementById(%r); if (!e) return;"
          " const r = e.getBoundingClientRect();"
          " if (r.top < 0 || r.bottom > window.innerHeight) e.scrollIntoView({block: 'center'}); }, 100)" % elem_id)
    return event.then(None, js=js)


# ---- the run panel: kohya_gui.ui.run_notice (actions uses it too) -----------------------------------------

# ---- remembering and restoring the form ------------------------------------------------------------------------

@dataclass
class Shown:
    """What a tab's form shows: family, values, the configuration file box, a note for the status line."""
    family: str
    values: dict[str, Any]
    path: str
    note: str = ""

    def same_form(self, other: "Shown") -> bool:
        return (self.family, self.values, self.path) == (other.family, other.values, other.path)


def _preset(tab: str) -> config_file.Config:
    try:
        return config_file.load(presets.preset_path(tab, presets.DEFAULT_PRESET), tab)
    except (FileNotFoundError, config_file.ConfigError):
        return config_file.Config(tab, "SDXL", P.defaults(tab))


def remembered(tab: str) -> Shown:
    """The tab's last used settings, or the default preset (with a note when the kept file is unusable)."""
    cfg, path, note = last_settings.load(tab)
    if cfg is None:
        cfg = _preset(tab)
        note = A.error_md(note) if note else ""
    else:  # the preset box still names the preset: say what the form shows
        note = A.ok_md(f"Reopened the last used settings of this tab (kept in `{last_settings.path(tab)}`); "
                       "pick a preset to start from it instead.")
    return Shown(cfg.family, cfg.values, path or presets.user_config_path(tab, presets.DEFAULT_PRESET), note)


def running_config(tab: str) -> config_file.Config | None:
    """The settings of the active run when it belongs to this tab."""
    s = A.RUNNER.snapshot()
    if not s.running or not s.config_path:
        return None
    try:
        cfg = config_file.load(s.config_path)
    except config_file.ConfigError:
        return None
    return cfg if cfg.tab == tab else None


def on_page_load(tab: str) -> Shown:
    remembered_form = remembered(tab)
    cfg = running_config(tab)
    if cfg is None:
        return remembered_form
    note = A.ok_md(f"Showing the settings of the running training (`{A.RUNNER.snapshot().config_path}`).")
    return Shown(cfg.family, cfg.values, remembered_form.path, note)


def remember(tab: str, path: str, family: str, *ui_values) -> None:
    """Keeps the form's settings; a field whose value cannot be read now keeps its last kept value."""
    previous = None
    values = {}
    for p, v in zip(A.tab_params(tab), ui_values, strict=True):
        try:
            values[p.name] = A.from_ui(p, v, tab)
        except ValueError:
            if previous is None:
                cfg, _, _ = last_settings.load(tab)
                previous = cfg.values if cfg is not None else _preset(tab).values
            values[p.name] = previous.get(p.name, p.default_for(tab))
    if family in P.FAMILIES:
        last_settings.save(tab, family, values, (path or "").strip() or None)


@dataclass
class TabForm:
    """A tab's components that a page load fills: [path, status, family, *controls] (what is shown follows the
    family in the page: ui/visibility.py)."""
    tab: str
    built: Shown
    outputs: list = field(default_factory=list)

    def load_updates(self) -> list:
        shown = on_page_load(self.tab)
        if shown.same_form(self.built) and shown.note == self.built.note:
            return [gr.skip() for _ in self.outputs]  # the page shows it already (and nothing races the user)
        return [gr.update(value=shown.path), gr.update(value=shown.note), gr.update(value=shown.family),
                *A.value_updates(self.tab, shown.values)]


def wire_tab(tab: str, built: Shown, *, path, status, family, inputs: list, clicks: list, loads: list) -> TabForm:
    """Remembers the form whenever the user changes a value (typed, pasted, picked; a burst of edits is one write
    or two: always_last), on the `clicks` (Start, Print, Save ...) and after the `loads` (Open, a preset) filled
    it. Not on every `.change`: a preset changes ~100 controls, and an event per control cost the browser 30 s.
    Returns what restore_on_load needs."""
    both = [path, family, *inputs]
    keep = dict(fn=functools.partial(remember, tab), inputs=both, show_progress="hidden", queue=False)
    edits = [c.input for c in both] + [c.blur for c in both if hasattr(c, "blur")]  # blur: a mouse paste
    gr.on(triggers=edits + [b.click for b in clicks], trigger_mode="always_last", **keep)
    for load in loads:
        load.then(**keep)
    return TabForm(tab, built, [path, status, family, *inputs])


def restore_on_load(app: gr.Blocks, forms: list[TabForm], tabs=None) -> None:
    """On each page load: every tab shows its remembered settings, the running job's tab its settings (and is
    selected)."""

    def load():
        out = []
        for form in forms:
            out += form.load_updates()
        if tabs is not None:
            s = A.RUNNER.snapshot()
            running = next((f.tab for f in forms if running_config(f.tab) is not None), None) if s.running else None
            out.append(gr.update(selected=running) if running else gr.skip())
        return out

    outputs = [c for form in forms for c in form.outputs] + ([tabs] if tabs is not None else [])
    # then the page says the form is its own: what is typed from here on is not replaced (browser tests wait for it)
    app.load(load, outputs=outputs, show_progress="hidden").then(
        None, js="() => { document.body.dataset.formRestored = '1'; }")

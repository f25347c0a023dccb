"""The Gradio Blocks, built from the registry: one tab per training kind, one accordion per registry accordion,
one control per parameter. Visibility follows the family in the page (ui/visibility.py); the handlers live in
actions.py.

Each Gradio event costs the browser time in proportion to its outputs and to the components that have a progress
status: an event's outputs get one (show_progress_on narrows it) and keep it for the page's life (gradio 6 gives the
inputs of a completed event one too: a form-wide event such as Print adds the tab's ~300 controls), and every later
event's status change updates all of them, each found by a walk of the ~2,400-block tree. So the events here update
only what they change, and the events whose progress is hidden have no progress targets (build_app)."""

from __future__ import annotations

import functools

import gradio as gr

from .. import presets, quoting
from .. import params as P
from ..secret_options import SECRET_OPTIONS
from . import actions as A
from . import feedback, utilities
from . import visibility as V
from .option_filter import filter_js

CSS = """
.kg-progress {padding: 6px 2px;}
.kg-bar {height: 10px; background: var(--neutral-200); border-radius: 5px; overflow: hidden; margin-bottom: 6px;}
.kg-bar > div {height: 100%; background: var(--color-accent); transition: width .4s;}
.kg-stats {font-size: 0.95em;}
.kg-state {font-weight: 600; margin-right: 4px;}
.kg-state::first-letter {text-transform: uppercase;}
.kg-note {opacity: 0.8; font-size: 0.9em;}
.kg-ranks {font-size: 0.9em; margin-top: 4px;} .kg-ranks td, .kg-ranks th {padding: 1px 10px 1px 0;}
.kg-rank-off {color: var(--error-text-color, #c00); font-weight: 600;}
#kg-log textarea {font-family: var(--font-mono); font-size: 12px;}
.kg-config-buttons {align-self: flex-end; padding-bottom: 6px;}
"""


# Keeps the log scrolled to its end, unless the user scrolled up to read (mouse wheel / touch / keys). Installed
# once at page load and run by the page's own timer: every Gradio event costs the browser time in proportion to
# the ~1000 components of the page, so the run panel makes one event per second, not two.
FOLLOW_LOG_JS = """() => {
  setInterval(() => {
    const t = document.querySelector('#kg-log textarea');
    if (!t) return;
    if (!t.dataset.follow) {
      t.dataset.follow = '1';
      const check = () => setTimeout(() => {
        t.dataset.follow = (t.scrollTop + t.clientHeight >= t.scrollHeight - 40) ? '1' : '0';
      }, 50);
      ['wheel', 'touchmove', 'keyup', 'mouseup'].forEach(e => t.addEventListener(e, check));
    }
    if (t.dataset.follow === '1' && t.dataset.seen !== String(t.value.length)) {
      t.dataset.seen = String(t.value.length);
      t.scrollTop = t.scrollHeight;
    }
  }, 500);
}"""


def make_control(tab: str, p: P.Param, value):
    kw = dict(label=p.label, info=p.help or None, visible=V.control_shown_somewhere(tab, p),
              elem_id=A.elem_id(tab, p), elem_classes=V.control_classes(tab, p))
    v = A.to_ui(p, value)
    if p.kind == "bool":
        return gr.Checkbox(value=bool(v), **kw)
    if A.optional_number(p):
        return gr.Textbox(value=v, placeholder="not set", **kw)
    if p.kind in ("int", "float"):
        # no minimum here: out-of-range values get the registry's message, which names the field
        return gr.Number(value=v, precision=0 if p.kind == "int" else None, step=1 if p.kind == "int" else 0.0001,
                         **kw)
    if p.kind == "choice":
        choices = [(p.choice_labels.get(c, c), c) for c in p.choices_for(tab)]
        return gr.Dropdown(choices=choices, value=v, allow_custom_value=p.open_choices, **kw)
    if p.name in SECRET_OPTIONS:  # shown as dots; never written to a file (kohya_gui.secret_options)
        return gr.Textbox(value=v, type="password", placeholder=f"or set ${SECRET_OPTIONS[p.name]}", **kw)
    placeholder = {"path": "path to a file", "dir": "path to a folder", "list": "key=value key2=value2"}
    return gr.Textbox(value=v, placeholder=placeholder.get(p.kind), **kw)


def _runs(params: list) -> list[list]:
    """Splits params into runs of checkboxes and runs of other controls, keeping their order."""
    runs: list[list] = []
    for p in params:
        if runs and (runs[-1][0].kind == "bool") == (p.kind == "bool"):
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def build_tab(tab: str) -> dict:
    built = feedback.remembered(tab)  # last used settings, else the preset
    family0, values0 = built.family, built.values
    names = presets.dropdown_choices(tab)
    with gr.Row(equal_height=True):
        preset = gr.Dropdown(choices=names, value=presets.DEFAULT_PRESET if presets.DEFAULT_PRESET in names else None,
                             label="Preset", scale=2, elem_id=f"{tab}-preset")
        path = gr.Textbox(label="Configuration file", scale=4, elem_id=f"{tab}-config-path",
                          value=built.path, placeholder="configs/my-run.toml",
                          info="Type the path of a saved TOML, or of a kohya_ss GUI configuration (.json, imported "
                               "with a report of every key), and press Open.")
        with gr.Column(scale=2, min_width=260, elem_classes="kg-config-buttons"):
            with gr.Row():
                open_btn = gr.Button("Open", size="md", elem_id=f"{tab}-open", min_width=70)
                save_btn = gr.Button("Save", size="md", elem_id=f"{tab}-save", min_width=70)
                save_as_btn = gr.Button("Save as", size="md", elem_id=f"{tab}-save-as", min_width=70)
    status = gr.Markdown(built.note, elem_id=f"{tab}-status", elem_classes="kg-msg")
    option_filter = gr.Textbox(label="Find an option", placeholder="part of a label, an option name or a --flag",
                               elem_id=f"{tab}-filter", max_lines=1)
    gr.HTML("", elem_id=f"{tab}-filter-hint", elem_classes="kg-note")  # the filter script writes into it
    option_filter.change(None, inputs=option_filter, js=filter_js(tab, A.tab_params(tab)))

    controls, accordions = {}, {}
    compile_note = None

    def fill(key: str) -> None:
        """The group's own controls (registry order; text/number fields in rows of 3, checkboxes in rows of 4),
        then its sub-groups as accordions inside it."""
        for group in _runs([p for p in A.tab_params(tab) if p.accordion == key]):
            per_row = 4 if group[0].kind == "bool" else 3
            for i in range(0, len(group), per_row):
                with gr.Row(elem_classes=V.row_classes(tab, group[i:i + per_row])):
                    for p in group[i:i + per_row]:
                        controls[p.name] = make_control(tab, p, values0.get(p.name, p.default_for(tab)))
        for sub in A.tab_accordions(tab):
            if P.SUBGROUPS.get(sub, ("", ""))[1] == key:
                with gr.Accordion(P.group_title(sub), open=False, visible=V.group_shown_somewhere(tab, sub),
                                  elem_id=f"{tab}-acc-{sub}", elem_classes=V.group_classes(tab, sub)) as acc:
                    accordions[sub] = acc
                    fill(sub)

    for key in A.tab_accordions(tab):
        if key in P.SUBGROUPS:
            continue
        with gr.Accordion(P.group_title(key), open=P.ACCORDIONS[key][1], visible=V.group_shown_somewhere(tab, key),
                          elem_id=f"{tab}-acc-{key}", elem_classes=V.group_classes(tab, key)) as acc:
            accordions[key] = acc
            if key == "model":
                with gr.Row():
                    family = gr.Dropdown(choices=P.tab_families(tab), value=family0, label="Model family",
                                         elem_id=f"{tab}-family", scale=1)
                    # the script of each family; the page shows the family's own (ui/visibility.py)
                    gr.HTML(V.per_family_html(tab, functools.partial(A.script_note, tab)), elem_classes="kg-note",
                            elem_id=f"{tab}-script-note")
            fill(key)
            if key == "compile":  # what auto chose in this tab's last run (actions.compile_auto_notes)
                compile_note = gr.Markdown("", elem_id=f"{tab}-compile-auto", elem_classes="kg-note")

    with gr.Row():
        start_btn = gr.Button("Start training", variant="primary", elem_id=f"{tab}-start")
        queue_btn = gr.Button("Add to queue", elem_id=f"{tab}-queue")
        stop_btn = gr.Button("Stop training (save)", variant="stop", elem_id=f"{tab}-stop")
        stop_now_btn = gr.Button("Stop now (no save)", variant="stop", elem_id=f"{tab}-stop-now")
        save_now_btn = gr.Button("Save now", elem_id=f"{tab}-save-now")
        sample_now_btn = gr.Button("Sample now", elem_id=f"{tab}-sample-now")
        print_btn = gr.Button("Print training command", elem_id=f"{tab}-print")
        tensorboard_btn = gr.Button("TensorBoard", elem_id=f"{tab}-tensorboard")
    run_status = feedback.message_area(f"{tab}-run-status")  # Start / Stop / Print results, next to the buttons
    with gr.Row():
        cmd = gr.Textbox(label="Training command (what Start training runs)", lines=3, max_lines=6,
                         interactive=False, buttons=["copy"], elem_id=f"{tab}-command")
        standalone = gr.Textbox(label="Stand-alone command (every setting as a flag, no TOML needed)", lines=3,
                                max_lines=6, interactive=False, buttons=["copy"], elem_id=f"{tab}-standalone")
    other = quoting.SHELL_LABELS[quoting.other_shell(quoting.native_shell())]
    with gr.Accordion(f"The same commands for {other}", open=False, elem_id=f"{tab}-other-shell"):
        with gr.Row():
            other_cmd = gr.Textbox(label=f"Training command, {other}", lines=3, max_lines=6, interactive=False,
                                   buttons=["copy"], elem_id=f"{tab}-command-other")
            other_standalone = gr.Textbox(label=f"Stand-alone command, {other}", lines=3, max_lines=6,
                                          interactive=False, buttons=["copy"], elem_id=f"{tab}-standalone-other")

    inputs = [controls[p.name] for p in A.tab_params(tab)]

    # what the page shows follows the family and the network module (the LoRA tab's network-type fields) in the
    # page itself, whoever changed them (the user, Open, a preset, the page load)
    shown_by = [family] + ([controls["network_module"]] if "network_module" in controls else [])
    for box in shown_by:
        box.change(None, inputs=shown_by, js=V.follow_js(tab))
    # a family picked by the user (not by an opened file) brings its own defaults where its script has them
    if A.family_default_params(tab):  # none: no server event at all
        family.input(functools.partial(A.family_value_updates, tab), inputs=family,
                     outputs=[controls[p.name] for p in A.family_default_params(tab)], show_progress="hidden")
    # Open and a preset set every value (and the family); their progress shows on the status line only
    opened = open_btn.click(functools.partial(A.open_from_box, tab), inputs=[path, family],
                            outputs=[status, family, *inputs, path, preset], show_progress_on=status)
    picked = preset.input(functools.partial(A.open_preset, tab), inputs=[preset, family],
                          outputs=[path, status, family, *inputs], show_progress_on=status)
    saved = save_btn.click(functools.partial(A.save_config, tab), inputs=[path, family, *inputs], outputs=status)
    saved_as = save_as_btn.click(functools.partial(A.save_config, tab, overwrite=False),
                                 inputs=[path, family, *inputs], outputs=status)
    command_outputs = [cmd, standalone, run_status, other_cmd, other_standalone]  # actions.commands' order
    printed = print_btn.click(functools.partial(A.print_command, tab), inputs=[family, *inputs],
                              outputs=command_outputs)
    started = start_btn.click(functools.partial(A.start_training, tab), inputs=[family, *inputs],
                              outputs=command_outputs)
    queued = queue_btn.click(functools.partial(A.add_to_queue, tab), inputs=[family, *inputs], outputs=run_status)
    stopped = stop_btn.click(A.stop_training, outputs=run_status)
    stopped_now = stop_now_btn.click(functools.partial(A.stop_training, now=True), outputs=run_status)
    saved_now = save_now_btn.click(functools.partial(A.request_now, "save"), outputs=run_status)
    sampled_now = sample_now_btn.click(functools.partial(A.request_now, "sample"), outputs=run_status)
    tensorboard_opened = tensorboard_btn.click(A.open_tensorboard, inputs=controls["logging_dir"], outputs=run_status)
    for event, area in [(opened, status), (picked, status), (saved, status), (saved_as, status), (printed, run_status),
                        (started, run_status), (queued, run_status), (stopped, run_status), (stopped_now, run_status),
                        (saved_now, run_status), (sampled_now, run_status), (tensorboard_opened, run_status)]:
        feedback.follow(event, area.elem_id)
    form = feedback.wire_tab(tab, built, path=path, status=status, family=family, inputs=inputs,
                             clicks=[save_btn, save_as_btn, print_btn, start_btn, queue_btn], loads=[opened, picked])
    return {"controls": controls, "accordions": accordions, "family": family, "status": status, "command": cmd,
            "run_status": run_status, "form": form, "compile_note": compile_note,
            "start_classes": V.start_classes(tab, family0, values0.get("network_module") or "")}


def build_app() -> gr.Blocks:
    with gr.Blocks(title="Kohya compile GUI") as app:
        gr.Markdown("## Kohya training GUI &nbsp;<span class='kg-note'>SD1.x · SD2.x · SDXL · FLUX.1, "
                    "with torch.compile</span>")
        forms, compile_notes = [], []
        with gr.Tabs() as tabs:
            for tab in P.TABS:
                with gr.Tab(P.TAB_LABELS[tab], id=tab, elem_id=f"tab-{tab}") as tab_item:
                    built = build_tab(tab)
                    tab_item.elem_classes = built["start_classes"]  # ui/visibility.py: the form it is built with
                    forms.append(built["form"])
                    compile_notes.append(built["compile_note"] or gr.Markdown(visible=False))
            with gr.Tab("Utilities", id="utilities", elem_id="tab-utilities") as util_tab:
                util = utilities.build_tab(util_tab.select)
        feedback.restore_on_load(app, forms, tabs)
        with gr.Accordion("Training run", open=True, elem_id="run-panel"):
            progress = gr.HTML(A.progress_html(A.RUNNER.snapshot()), elem_id="run-progress")
            with gr.Row():
                loss_plot = gr.LinePlot(x="step", y="value", color="series", title="Loss", height=260,
                                        visible=False, elem_id="run-loss")
                lr_plot = gr.LinePlot(x="step", y="value", color="series", title="Learning rate", height=260,
                                      visible=False, elem_id="run-lr")
            gallery = gr.Gallery(label="Sample images", columns=4, height="auto", visible=False,
                                 elem_id="run-samples")
            result = gr.Markdown(elem_id="run-result")
            files = gr.Markdown(elem_id="run-files")
            utilities.build_lora_shortcuts(tabs, util)  # the result's "resize" / "merge into model"
            log = gr.Textbox(label="Log", lines=14, max_lines=14, autoscroll=True, interactive=False,
                             elem_id="kg-log", buttons=["copy"])
        with gr.Accordion("Queue", open=False, elem_id="run-queue"):
            queue_list = gr.Markdown(A.queue_md([]), elem_id="queue-list")
            with gr.Row():
                queue_pick = gr.Dropdown(label="Entry", choices=[], scale=3, elem_id="queue-pick")
                up_btn = gr.Button("Up", elem_id="queue-up", min_width=60)
                down_btn = gr.Button("Down", elem_id="queue-down", min_width=60)
                remove_btn = gr.Button("Remove", elem_id="queue-remove", min_width=60)
            with gr.Row():
                q = A.run_queue()
                queue_run = gr.Checkbox(value=not q.paused, label="Run the queue",
                                        info="Unticked: queued runs wait. Stop ends one run; the queue goes on.",
                                        elem_id="queue-run")
                queue_stop = gr.Checkbox(value=q.stop_on_failure, label="Stop the queue when a run fails",
                                         elem_id="queue-stop-on-failure")
            queue_status = feedback.message_area("queue-status")
        for btn, action in ((up_btn, "up"), (down_btn, "down"), (remove_btn, "remove")):
            btn.click(functools.partial(A.queue_change, action), inputs=[queue_pick, queue_run, queue_stop],
                      outputs=[queue_status, queue_list, queue_pick])
        for box in (queue_run, queue_stop):
            box.input(functools.partial(A.queue_change, "options", None), inputs=[queue_run, queue_stop],
                      outputs=[queue_status, queue_list, queue_pick])
        seen = gr.State(None)
        timer = gr.Timer(A.TICK_IDLE_S)
        # queue=False: a plain request, lighter for the browser than a queued event
        timer.tick(A.run_tick, inputs=seen, outputs=[progress, log, result, loss_plot, lr_plot, gallery, files,
                                                     queue_list, queue_pick, *compile_notes, timer, seen],
                   queue=False, show_progress="hidden")
    for fn in app.fns.values():
        # gradio puts the API description, with every control's default value, even into the login page of a
        # password-protected GUI; our events are the page's own, not a documented API
        fn.api_visibility = "undocumented"
        if fn.show_progress == "hidden" and fn.show_progress_on is None:
            fn.show_progress_on = []  # no progress status on its outputs: see the module's docstring
    return app


def launch_kwargs() -> dict:
    return {"css": CSS + feedback.CSS + V.css(), "theme": gr.themes.Soft(), "js": FOLLOW_LOG_JS}

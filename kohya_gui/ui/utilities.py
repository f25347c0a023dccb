"""The Utilities tab (after Fine-tune): Captioning (the captioning tools, a preview and the caption editor),
Dataset preparation (the N_name folder builder, balancing, the dataset TOML editor and the dataset tools) and LoRA
tools (the tool scripts, and a LoRA file's metadata). The tool forms are built from kohya_gui.tools (each
script's `--dump_options`); a tool runs through the training runner, so the run panel under the tabs shows its
progress, log and result, Stop stops it and the queue takes it. The handlers are plain functions (tests call
them)."""

from __future__ import annotations

import functools
import html
import shlex
import time
from pathlib import Path
from typing import Any

import gradio as gr

from .. import captions_edit as C
from .. import config_file, dataset_prep, dataset_toml, tools
from ..runner import RunnerBusy
from . import actions as A
from . import feedback

SUBTABS = {"captioning": "util-captioning", "dataset": "util-dataset", "lora": "util-lora"}


def elem(tool_key: str, option: str) -> str:
    return f"tool-{tool_key}-{option}"


# ---- tool forms --------------------------------------------------------------------------------------------------

def to_ui(o: tools.Option) -> Any:
    if o.kind == "bool":
        return bool(o.default)
    if o.default is None:
        return None if _number_box(o) else ""
    if o.is_list:
        return shlex.join(str(v) for v in o.default)
    return o.default if _number_box(o) or o.choices else str(o.default)


def _number_box(o: tools.Option) -> bool:
    return o.kind in ("int", "float") and not o.is_list and not o.choices and o.default is not None


def make_control(t: tools.Tool, o: tools.Option, fills: dict, drawn: int = 0):
    """A control for option o, holding fills[o.name] if given; `drawn` tells forms with other fills apart (the same
    key in a later drawing of the form keeps the value the user typed)."""
    value = fills.get(o.name, to_ui(o))
    kw = dict(label=t.label_of(o) + ("" if o.positional else f" ({o.flag})"), info=o.help or None,
              elem_id=elem(t.key, o.name), key=f"{elem(t.key, o.name)}-{drawn}",
              interactive=True)  # drawn later than the page: the page does not know they are inputs
    if o.kind == "bool":
        return gr.Checkbox(value=bool(value), **kw)
    if o.choices and not o.is_list:
        choices = ([("(not set)", "")] if o.default is None else []) + [(str(c), c) for c in o.choices]
        return gr.Dropdown(choices=choices, value=value, **kw)
    if _number_box(o):
        return gr.Number(value=value, precision=0 if o.kind == "int" else None, **kw)
    folder = o.name in t.folders
    placeholder = "not set" if o.default is None else None
    if o.is_list:
        placeholder = "values separated by spaces (quote one with spaces)"
    elif o.name in t.outputs or o.positional:
        placeholder = "path to a folder" if folder else "path to a file"
    return gr.Textbox(value=value, placeholder=placeholder, max_lines=1, **kw)


def _rows(t: tools.Tool, options: list[tools.Option], fills: dict, drawn: int, controls: list) -> None:
    """Text and number fields three to a row, checkboxes four to a row, in the given order."""
    runs: list[list[tools.Option]] = []
    for o in options:
        if runs and (runs[-1][0].kind == "bool") == (o.kind == "bool"):
            runs[-1].append(o)
        else:
            runs.append([o])
    for run in runs:
        per_row = 4 if run[0].kind == "bool" else 3
        for i in range(0, len(run), per_row):
            with gr.Row():
                for o in run[i:i + per_row]:
                    controls.append(make_control(t, o, fills, drawn))


def form_options(t: tools.Tool) -> list[tools.Option]:
    """A tool form's controls, in the order the handlers receive their values (the order on screen)."""
    first, more = t.ordered()
    return first + more


def build_form(t: tools.Tool, fills: dict, drawn: int = 0) -> list:
    """The tool's form (main options, the others under "More options"), `fills` ({option: value}) put in;
    returns its controls in form_options order."""
    gr.Markdown(f"{t.about} Runs `sd-scripts/{t.script}`.", elem_classes="kg-note", elem_id=f"tool-{t.key}")
    first, more = t.ordered()
    controls: list = []
    _rows(t, first, fills, drawn, controls)
    if more:
        with gr.Accordion("More options", open=False, elem_id=f"tool-{t.key}-more"):
            _rows(t, more, fills, drawn, controls)
    return controls


def tool_values(key: str, ui_values) -> tuple[tools.Tool, dict[str, Any]]:
    """The tool and its controls' values by option name."""
    t = tools.tool(key)
    return t, {o.name: v for o, v in zip(form_options(t), ui_values, strict=True)}


def _checked(key: str, ui_values) -> tuple[tools.Tool | None, dict, str]:
    """(tool, values, error message or "")."""
    if not key:
        return None, {}, A.error_md("Choose a tool first.")
    t, raw = tool_values(key, ui_values)
    values, errors = tools.values_from_ui(t, raw)
    if errors:
        return t, values, A.error_md(f"Fix these first ({t.label}):\n" + "\n".join(f"- {e}" for e in errors))
    return t, values, ""


def print_tool(key: str, overwrite: bool, *ui_values) -> tuple[str, str]:
    """(command, message): the command Run runs, and what must be fixed before it can."""
    t, values, error = _checked(key, ui_values)
    if error:
        return gr.update(), error
    command = tools.printable(tools.argv(t, tools.with_overwrite(t, values, overwrite)))
    problems = tools.validation_errors(t, values, overwrite)
    if problems:
        return command, A.error_md("The command is shown, but these must be fixed before a run:\n"
                                   + "\n".join(f"- {p}" for p in problems))
    return command, A.ok_md(f"Run runs this command; its log goes to `{tools.log_path(t)}`.")


def run_tool(key: str, overwrite: bool, *ui_values) -> tuple[str, str]:
    """(command, message): starts the tool with the training runner (the run panel shows it)."""
    t, values, error = _checked(key, ui_values)
    if error:
        return gr.update(), error
    try:
        argv = tools.start(A.RUNNER, t, values, overwrite)
    except (tools.ToolError, RunnerBusy) as e:
        return gr.update(), A.error_md(str(e))
    return tools.printable(argv), A.ok_md(f"{t.label} started: the run panel below shows its progress and log "
                                          f"(`{tools.log_path(t)}`).")


def queue_tool(key: str, overwrite: bool, *ui_values) -> str:
    t, values, error = _checked(key, ui_values)
    if error:
        return error
    try:
        entry = A.run_queue().add_tool(t, values, overwrite)
    except tools.ToolError as e:
        return A.error_md(str(e))
    return A.ok_md(f"Queued {t.label} (`{entry.name}`); it starts when no other run is active. The queue is under "
                   "the run panel.")


def stop_tool() -> str:
    """Stops the running tool (a tool has nothing to save: SIGTERM, then SIGKILL after the grace time). A training
    run is left alone: its tab's Stop saves it."""
    s = A.RUNNER.snapshot()
    if not s.running:
        return A.error_md("No tool is running.")
    if not tools.is_tool_run(s.commands):
        return A.error_md("The active run is a training run: stop it with its tab's Stop buttons (Stop saves it).")
    A.RUNNER.stop(now=True)
    return A.ok_md("Stopped the tool.")


def shortcut_fills(key: str, fills: dict) -> dict:
    """A shortcut's values for a tool's form; each time a new dict (drawn: when), so the form is drawn with them."""
    return {"key": key, "values": dict(fills), "drawn": time.monotonic_ns()}


def build_tool_group(group: str, shown_on: list) -> dict:
    """A group's tool picker, the chosen tool's form and the shared buttons. The form is drawn by the server when
    it is needed (`shown_on`: its tab is opened; a tool is picked; a shortcut fills it), not at page load and not
    one per tool: every component costs the page time on each event."""
    group_tools = tools.in_group(group)
    picker = gr.Dropdown(choices=[(t.label, t.key) for t in group_tools], value=group_tools[0].key, label="Tool",
                         elem_id=f"util-{group}-tool")
    filled = gr.State(None)  # the last shortcut's values (shortcut_fills), for its tool's form

    @gr.render(inputs=[picker, filled], triggers=[picker.input, filled.change, *shown_on], show_progress="hidden")
    def form(key: str, shortcut: dict | None):  # runs after the page is built: the buttons below exist by then
        t = tools.tool(key or group_tools[0].key)
        fills, drawn = (shortcut["values"], shortcut["drawn"]) if shortcut and shortcut["key"] == t.key else ({}, 0)
        args = [overwrite, *build_form(t, fills, drawn)]
        for event in (run_btn.click(functools.partial(run_tool, t.key), inputs=args, outputs=[command, status]),
                      print_btn.click(functools.partial(print_tool, t.key), inputs=args, outputs=[command, status]),
                      queue_btn.click(functools.partial(queue_tool, t.key), inputs=args, outputs=status)):
            feedback.follow(event, status.elem_id)

    with gr.Row():
        run_btn = gr.Button("Run", variant="primary", elem_id=f"util-{group}-run")
        queue_btn = gr.Button("Add to queue", elem_id=f"util-{group}-queue")
        stop_btn = gr.Button("Stop", variant="stop", elem_id=f"util-{group}-stop")
        print_btn = gr.Button("Print command", elem_id=f"util-{group}-print")
        overwrite = gr.Checkbox(False, label="Overwrite existing results", elem_id=f"util-{group}-overwrite",
                                info="files the tool would write over (its --overwrite)")
    status = feedback.message_area(f"util-{group}-status")
    command = gr.Textbox(label="Command (what Run runs)", lines=2, max_lines=6, interactive=False, buttons=["copy"],
                         elem_id=f"util-{group}-command")
    feedback.follow(stop_btn.click(stop_tool, outputs=status), status.elem_id)
    return {"picker": picker, "filled": filled, "status": status, "command": command}


# ---- captioning: preview and caption editor ------------------------------------------------------------------------

def load_folder(folder: str, ext: str) -> tuple:
    """(message, image choices update, gallery update, first image, its caption, current image)."""
    try:
        images = C.list_images(folder)
    except C.CaptionError as e:
        return A.error_md(str(e)), gr.update(choices=[], value=None), gr.update(value=[]), None, "", None
    if not images:
        return (A.error_md(f"No images in {folder}"), gr.update(choices=[], value=None), gr.update(value=[]), None,
                "", None)
    with_caption = sum(C.caption_path(p, ext).is_file() for p in images)
    tags = C.tag_counts(folder, ext)[:15]
    note = (f"{len(images)} images, {with_caption} with a `{C.caption_extension(ext)}` caption."
            + (" Most used tags: " + ", ".join(f"{html.escape(t)} ({n})" for t, n in tags) if tags else ""))
    first = str(images[0])
    return (A.ok_md(note), gr.update(choices=[(p.name, str(p)) for p in images], value=first),
            gr.update(value=C.preview(folder, ext)), first, C.read_caption(first, ext), first)


def pick_image(ext: str, current: str | None, text: str, picked: str | None) -> tuple:
    """(message, picker update, image, caption, current): refuses to leave an image whose caption has unsaved
    changes (Save or Discard first)."""
    if current and picked != current and (text or "") != C.read_caption(current, ext):
        return (A.error_md(f"{Path(current).name}: the caption has unsaved changes; Save caption or Discard "
                           "changes first."), gr.update(value=current), gr.update(), gr.update(), current)
    if not picked:
        return "", gr.update(), None, "", None
    return "", gr.update(), picked, C.read_caption(picked, ext), picked


def step_image(ext: str, current: str | None, text: str, choices_folder: str, delta: int) -> tuple:
    """Previous / Next: the neighbour of the current image in the folder."""
    try:
        images = [str(p) for p in C.list_images(choices_folder)]
    except C.CaptionError as e:
        return A.error_md(str(e)), gr.update(), gr.update(), gr.update(), current
    if not images:
        return "", gr.update(), gr.update(), gr.update(), current
    i = images.index(current) if current in images else -1
    target = images[max(0, min(len(images) - 1, i + delta))]
    out = pick_image(ext, current, text, target)
    if out[0]:  # refused
        return out
    return "", gr.update(value=target), *out[2:]


def save_caption(ext: str, current: str | None, text: str) -> str:
    if not current:
        return A.error_md("Load a folder and choose an image first.")
    path = C.write_caption(current, ext, text or "")
    return A.ok_md(f"Saved `{path}`.")


def discard_changes(ext: str, current: str | None) -> tuple[str, str]:
    return ("", C.read_caption(current, ext)) if current else ("", "")


def replace_tags(folder: str, ext: str, find: str, replace: str, whole_tag: bool, apply: bool) -> tuple[str, Any]:
    """(message, backup folder or gr.skip()): Count shows how many files would change; Replace changes them
    (their originals go to a backup first, which Undo puts back)."""
    try:
        report = C.find_replace(folder, ext, find, replace, whole_tag=whole_tag, apply=apply)
    except C.CaptionError as e:
        return A.error_md(str(e)), gr.skip()
    what = f"`{find.strip()}` -> `{replace.strip()}`" if replace.strip() else f"removing `{find.strip()}`"
    names = ", ".join(p.name for p in report.changed[:10]) + (" ..." if len(report.changed) > 10 else "")
    if not apply:
        return A.ok_md(f"{what}: {len(report.changed)} of {report.files} caption files would change "
                       f"({report.replacements} replacements){': ' + names if names else ''}."), gr.skip()
    if not report.changed:
        return A.ok_md(f"{what}: no caption file has it; nothing changed."), gr.skip()
    return A.ok_md(f"{what}: changed {len(report.changed)} of {report.files} caption files "
                   f"({report.replacements} replacements): {names}. The originals are in `{report.backup}` "
                   "(Undo puts them back)."), str(report.backup)


def undo_replace(backup: str | None) -> tuple[str, Any]:
    if not backup:
        return A.error_md("No find/replace to undo."), gr.skip()
    try:
        n = C.undo_replace(backup)
    except C.CaptionError as e:
        return A.error_md(str(e)), gr.skip()
    return A.ok_md(f"Put back {n} caption files from `{backup}`."), None


def build_caption_editor() -> dict:
    with gr.Row():
        folder = gr.Textbox(label="Image folder", placeholder="path to a folder", scale=4, max_lines=1,
                            elem_id="cap-folder")
        ext = gr.Textbox(".txt", label="Caption extension", scale=1, max_lines=1, elem_id="cap-ext")
        load_btn = gr.Button("Load", scale=1, elem_id="cap-load")
    message = feedback.message_area("cap-status")
    gallery = gr.Gallery(label="Preview (the first images and their captions)", columns=8, height="auto",
                         elem_id="cap-preview")
    current = gr.State(None)
    with gr.Row():
        with gr.Column(scale=1):
            picker = gr.Dropdown(label="Image", choices=[], elem_id="cap-image-pick")
            image = gr.Image(type="filepath", interactive=False, height=260, label="Image", elem_id="cap-image")
        with gr.Column(scale=2):
            caption = gr.Textbox(label="Caption", lines=6, elem_id="cap-text")
            with gr.Row():
                prev_btn = gr.Button("Previous", elem_id="cap-prev")
                next_btn = gr.Button("Next", elem_id="cap-next")
                save_btn = gr.Button("Save caption", variant="primary", elem_id="cap-save")
                discard_btn = gr.Button("Discard changes", elem_id="cap-discard")
    with gr.Accordion("Find / replace a tag in every caption of the folder", open=True, elem_id="cap-replace-acc"):
        with gr.Row():
            find = gr.Textbox(label="Find", max_lines=1, elem_id="cap-find")
            repl = gr.Textbox(label="Replace with (empty: remove the tag)", max_lines=1, elem_id="cap-replace")
            whole = gr.Checkbox(True, label="Whole tags (comma-separated)", elem_id="cap-whole")
        with gr.Row():
            count_btn = gr.Button("Count", elem_id="cap-count")
            replace_btn = gr.Button("Replace in all files", variant="primary", elem_id="cap-replace-all")
            undo_btn = gr.Button("Undo the last replace", elem_id="cap-undo")
        replace_msg = feedback.message_area("cap-replace-status")
    backup = gr.State(None)
    view = [picker, image, caption, current]
    load_btn.click(load_folder, inputs=[folder, ext], outputs=[message, picker, gallery, image, caption, current])
    picker.input(pick_image, inputs=[ext, current, caption, picker], outputs=[message, *view])
    for btn, delta in ((prev_btn, -1), (next_btn, 1)):
        btn.click(lambda e, c, t, f, d=delta: step_image(e, c, t, f, d), inputs=[ext, current, caption, folder],
                  outputs=[message, *view])
    save_btn.click(save_caption, inputs=[ext, current, caption], outputs=message)
    discard_btn.click(discard_changes, inputs=[ext, current], outputs=[message, caption])
    count_btn.click(functools.partial(replace_tags, apply=False), inputs=[folder, ext, find, repl, whole],
                    outputs=[replace_msg, backup])
    replace_btn.click(functools.partial(replace_tags, apply=True), inputs=[folder, ext, find, repl, whole],
                      outputs=[replace_msg, backup])
    undo_btn.click(undo_replace, inputs=backup, outputs=[replace_msg, backup])
    return {"folder": folder, "caption": caption}


# ---- dataset preparation -------------------------------------------------------------------------------------------

def build_folders(root, source, name, repeats, reg_source, reg_name, reg_repeats) -> tuple[str, str, str]:
    """(message, training folder, regularisation folder): the last two fill the TOML editor's folder fields."""
    try:
        built = dataset_prep.build(root, source, name, repeats, reg_source, reg_name, reg_repeats)
    except dataset_prep.PrepError as e:
        return A.error_md(str(e)), gr.skip(), gr.skip()
    lines = [f"- `{b.folder}`: {b.images} images, {b.captions} caption files" for b in built]
    train_dir = str(Path(root) / "img")
    reg_dir = str(Path(root) / "reg") if len(built) > 1 else ""
    use = f"Image folder (train_data_dir): `{train_dir}`" + (f", regularisation folder: `{reg_dir}`" if reg_dir else "")
    return A.ok_md("Built:\n" + "\n".join(lines) + f"\n\n{use}"), train_dir, reg_dir


def balance_folders(train_dir: str, per_epoch, apply: bool) -> str:
    try:
        plan = (dataset_prep.balance if apply else dataset_prep.balance_plan)(train_dir, per_epoch)
    except (dataset_prep.PrepError, C.CaptionError, OSError) as e:
        return A.error_md(str(e))
    rows = "\n".join(f"| `{r.old.name}` | {r.images} | `{r.new.name}` | {r.images * r.repeats} |" for r in plan)
    head = "Renamed:" if apply else "Balance would rename (nothing changed yet):"
    return A.ok_md(f"{head}\n\n| folder | images | new name | images per epoch |\n|---|---|---|---|\n{rows}")


SUMMARY_HEADERS = ["dataset", "resolution", "batch size", "image folder", "repeats", "regularisation", "images"]


def _toml_result(text: str, path: str, note: str) -> tuple:
    try:
        rows = dataset_toml.summary(text, str(Path(path).parent) if (path or "").strip() else None)
    except dataset_toml.DatasetTomlError as e:
        return text, A.error_md(str(e)), gr.skip()
    return text, A.ok_md(note), rows


def toml_open(path: str) -> tuple:
    try:
        text = dataset_toml.open_file(path)
    except dataset_toml.DatasetTomlError as e:
        return gr.skip(), A.error_md(str(e)), gr.skip()
    return _toml_result(text, path, f"Opened `{path}`.")


def toml_save(path: str, text: str, overwrite: bool = True) -> tuple:
    try:
        target = dataset_toml.save_file(path, text, overwrite)
    except (dataset_toml.DatasetTomlError, OSError) as e:
        return gr.skip(), A.error_md(str(e)), gr.skip()
    return _toml_result(text, path, f"Saved `{target}`: the trainers read it as `dataset_config` (Folders).")


def toml_add_subset(text, path, image_dir, repeats, resolution, batch, class_tokens, is_reg, ext) -> tuple:
    try:
        text = dataset_toml.add_subset(text or dataset_toml.TEMPLATE, image_dir, repeats, resolution, batch,
                                       class_tokens, is_reg, ext)
    except dataset_toml.DatasetTomlError as e:
        return gr.skip(), A.error_md(str(e)), gr.skip()
    return _toml_result(text, path, f"Added `{image_dir}` (not saved yet).")


def toml_from_folders(text, path, train_dir, reg_dir, resolution, batch) -> tuple:
    try:
        text = dataset_toml.from_folders(train_dir, reg_dir, resolution, batch, text)
    except dataset_toml.DatasetTomlError as e:
        return gr.skip(), A.error_md(str(e)), gr.skip()
    return _toml_result(text, path, "Added a subset per N_name folder (not saved yet).")


def toml_check(text: str, path: str, family: str) -> str:
    try:
        ok, lines = dataset_toml.check(text, family, path)
    except dataset_toml.DatasetTomlError as e:
        return A.error_md(str(e))
    body = "\n".join(f"- {html.escape(ln.strip())}" for ln in lines)
    if ok:
        return A.ok_md(f"The {family} trainer accepts this dataset:\n\n{body}")
    return A.error_md(f"The {family} trainer refuses this dataset:\n{body}")


def build_dataset_prep() -> dict:
    with gr.Accordion("Build kohya's folder layout (N_name = N repeats)", open=True, elem_id="prep-acc"):
        with gr.Row():
            root = gr.Textbox(label="Destination folder", placeholder="path to a folder (img/ and reg/ go in it)",
                              max_lines=1, elem_id="prep-root")
            source = gr.Textbox(label="Images: source folder", placeholder="path to a folder", max_lines=1,
                                elem_id="prep-source")
            name = gr.Textbox(label="Images: name (class tokens)", placeholder="sks dog", max_lines=1,
                              elem_id="prep-name")
            repeats = gr.Number(10, label="Images: repeats", precision=0, elem_id="prep-repeats")
        with gr.Row():
            reg_source = gr.Textbox(label="Regularisation: source folder (optional)", placeholder="path to a folder",
                                    max_lines=1, elem_id="prep-reg-source")
            reg_name = gr.Textbox(label="Regularisation: class name", placeholder="dog", max_lines=1,
                                  elem_id="prep-reg-name")
            reg_repeats = gr.Number(1, label="Regularisation: repeats", precision=0, elem_id="prep-reg-repeats")
        build_btn = gr.Button("Build the folders (copies; never overwrites)", elem_id="prep-build")
        build_msg = feedback.message_area("prep-status")
    with gr.Accordion("Balance the concepts (renames the N_name folders)", open=False, elem_id="balance-acc"):
        with gr.Row():
            bal_dir = gr.Textbox(label="Training image folder", placeholder="path to a folder with N_name folders",
                                 max_lines=1, elem_id="balance-dir")
            per_epoch = gr.Number(100, label="Images per concept per epoch", precision=0, elem_id="balance-target")
            bal_preview = gr.Button("Preview", elem_id="balance-preview")
            bal_apply = gr.Button("Balance", elem_id="balance-apply")
        bal_msg = feedback.message_area("balance-status")
    with gr.Accordion("Dataset TOML editor (dataset_config: several subsets and resolutions)", open=True,
                      elem_id="dstoml-acc"):
        with gr.Row():
            path = gr.Textbox(label="Dataset TOML file", placeholder="datasets/my-dataset.toml", scale=4,
                              max_lines=1, elem_id="dstoml-path")
            open_btn = gr.Button("Open", elem_id="dstoml-open", min_width=70)
            save_btn = gr.Button("Save", elem_id="dstoml-save", min_width=70)
            save_as_btn = gr.Button("Save as", elem_id="dstoml-save-as", min_width=70)
        text = gr.Code(dataset_toml.TEMPLATE, language=None, label="dataset_config TOML", lines=12,
                       interactive=True, elem_id="dstoml-text")
        with gr.Row():
            sub_dir = gr.Textbox(label="Subset: image folder", max_lines=1, elem_id="dstoml-sub-dir")
            sub_repeats = gr.Number(1, label="Repeats", precision=0, elem_id="dstoml-sub-repeats")
            sub_reso = gr.Textbox("1024", label="Resolution (size or width,height)", max_lines=1,
                                  elem_id="dstoml-sub-reso")
            sub_batch = gr.Number(1, label="Batch size", precision=0, elem_id="dstoml-sub-batch")
        with gr.Row():
            sub_tokens = gr.Textbox(label="Class tokens", max_lines=1, elem_id="dstoml-sub-tokens")
            sub_ext = gr.Textbox(label="Caption extension (empty: [general]'s)", max_lines=1,
                                 elem_id="dstoml-sub-ext")
            sub_reg = gr.Checkbox(False, label="Regularisation images", elem_id="dstoml-sub-reg")
            add_btn = gr.Button("Add subset", elem_id="dstoml-add")
        with gr.Row():
            train_dir = gr.Textbox(label="Training image folder (N_name folders)", max_lines=1,
                                   elem_id="dstoml-train-dir")
            reg_dir = gr.Textbox(label="Regularisation folder (N_name folders)", max_lines=1,
                                 elem_id="dstoml-reg-dir")
            folders_btn = gr.Button("Add a subset per N_name folder", elem_id="dstoml-from-folders")
        with gr.Row():
            family = gr.Dropdown(choices=list(dataset_toml.CHECK_SCRIPTS), value="SDXL", label="Check for family",
                                 elem_id="dstoml-family")
            check_btn = gr.Button("Check with the trainer (--validate_only)", elem_id="dstoml-check")
        toml_msg = feedback.message_area("dstoml-status")
        table = gr.Dataframe(headers=SUMMARY_HEADERS, value=None, interactive=False, label="Subsets",
                             elem_id="dstoml-summary")
    build_btn.click(build_folders, inputs=[root, source, name, repeats, reg_source, reg_name, reg_repeats],
                    outputs=[build_msg, train_dir, reg_dir])
    bal_preview.click(functools.partial(balance_folders, apply=False), inputs=[bal_dir, per_epoch], outputs=bal_msg)
    bal_apply.click(functools.partial(balance_folders, apply=True), inputs=[bal_dir, per_epoch], outputs=bal_msg)
    toml_out = [text, toml_msg, table]
    open_btn.click(toml_open, inputs=path, outputs=toml_out)
    save_btn.click(toml_save, inputs=[path, text], outputs=toml_out)
    save_as_btn.click(functools.partial(toml_save, overwrite=False), inputs=[path, text], outputs=toml_out)
    add_btn.click(toml_add_subset, inputs=[text, path, sub_dir, sub_repeats, sub_reso, sub_batch, sub_tokens, sub_reg,
                                           sub_ext], outputs=toml_out)
    folders_btn.click(toml_from_folders, inputs=[text, path, train_dir, reg_dir, sub_reso, sub_batch],
                      outputs=toml_out)
    check = check_btn.click(toml_check, inputs=[text, path, family], outputs=toml_msg)
    feedback.follow(check, "dstoml-status")
    return {"text": text}


# ---- LoRA metadata ---------------------------------------------------------------------------------------------------

def show_metadata(path: str) -> str:
    """A safetensors file's metadata (ss_* training settings, modelspec) and its tensor count."""
    from safetensors import safe_open
    from safetensors import SafetensorError

    path = (path or "").strip()
    if not path or not Path(path).is_file():
        return A.error_md(f"LoRA file: {path or '(empty)'} is not a file")
    try:
        with safe_open(path, framework="numpy") as f:
            metadata, keys = f.metadata() or {}, list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        return A.error_md(f"{path} is not a safetensors file: {e}")
    rows = "\n".join(f"| `{html.escape(k)}` | {html.escape(v[:300]).replace('|', '&#124;')} |"
                     for k, v in sorted(metadata.items()))
    return A.ok_md(f"`{path}`: {len(keys)} tensors, {len(metadata)} metadata entries."
                   + (f"\n\n| key | value |\n|---|---|\n{rows}" if rows else ""))


# ---- the tab ------------------------------------------------------------------------------------------------------

def build_tab(opened) -> dict:
    """`opened`: the Utilities tab's select event (the Captioning sub-tab is the one shown then)."""
    handles: dict = {}
    with gr.Tabs(elem_id="util-tabs") as sub:
        handles["subtabs"] = sub
        with gr.Tab("Captioning", id=SUBTABS["captioning"], elem_id="tab-util-captioning") as tab:
            if tools.in_group("captioning"):
                handles["captioning"] = build_tool_group("captioning", [opened, tab.select])
            gr.Markdown("### Caption editor")
            handles["editor"] = build_caption_editor()
        with gr.Tab("Dataset preparation", id=SUBTABS["dataset"], elem_id="tab-util-dataset") as tab:
            handles["prep"] = build_dataset_prep()
            if tools.in_group("dataset"):
                gr.Markdown("### Dataset tools")
                handles["dataset"] = build_tool_group("dataset", [tab.select])
        with gr.Tab("LoRA tools", id=SUBTABS["lora"], elem_id="tab-util-lora") as tab:
            if tools.in_group("lora"):
                handles["lora"] = build_tool_group("lora", [tab.select])
            with gr.Accordion("Show a LoRA's metadata", open=not tools.in_group("lora"), elem_id="meta-acc"):
                with gr.Row():
                    meta_path = gr.Textbox(label="LoRA file", placeholder="path to a .safetensors file", scale=4,
                                           max_lines=1, elem_id="meta-path")
                    meta_btn = gr.Button("Show metadata", scale=1, elem_id="meta-show")
                meta_out = feedback.message_area("meta-status")
            meta_btn.click(show_metadata, inputs=meta_path, outputs=meta_out)
            handles["meta_path"] = meta_path
    return handles


# ---- the run panel's shortcuts: the last run's LoRA into the LoRA tools ---------------------------------------------

MERGE_TOOLS = {"SD1.x": ("merge_lora", "sd_model"), "SD2.x": ("merge_lora", "sd_model"),
               "SDXL": ("sdxl_merge_lora", "sd_model"), "FLUX.1": ("flux_merge_lora", "flux_model")}


def _free_name(path: Path) -> Path:
    """path, or path with -2, -3 ... before the suffix when it exists (a shortcut never fills in an existing file)."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def last_lora() -> tuple[Path, Any]:
    """(the last run's newest .safetensors result, its run settings or None). Raises ValueError with the reason."""
    s = A.RUNNER.snapshot()
    if s.running:
        raise ValueError("A run is active: wait until it has finished.")
    results = [Path(p) for p in s.outputs if p.endswith(".safetensors") and not Path(p).parent.name.endswith("-state")]
    if not results:
        raise ValueError("The last run wrote no .safetensors file.")
    settings = None
    if s.config_path:
        try:
            settings = config_file.load(s.config_path)
        except config_file.ConfigError:
            settings = None
    return results[-1], settings


def lora_fills(action: str) -> tuple[str, dict[str, Any], str]:
    """(tool key, {option: control value}, message) for "resize" / "merge" of the last run's LoRA."""
    lora, settings = last_lora()
    if action == "resize":
        return "resize_lora", {"model": str(lora),
                               "save_to": str(_free_name(lora.with_name(f"{lora.stem}-resized.safetensors")))}, \
            f"Resize `{lora.name}`: choose the new rank, then Run."
    if settings is None or settings.tab != "lora":
        raise ValueError(f"{lora.name} is not from a LoRA training run of this GUI: choose the merge tool and its "
                         "model yourself.")
    key, model_option = MERGE_TOOLS[settings.family]
    fills = {model_option: settings.values.get("pretrained_model_name_or_path") or "", "models": shlex.quote(str(lora)),
             "ratios": "1", "save_to": str(_free_name(lora.with_name(f"{lora.stem}-merged.safetensors")))}
    if settings.family == "SD2.x":
        fills["v2"] = True
    return key, fills, f"Merge `{lora.name}` into its {settings.family} model: check the paths, then Run."


SHORTCUT_TOOLS = {"resize": ("resize_lora",), "merge": tuple(key for key, _ in MERGE_TOOLS.values())}


def lora_shortcut(action: str) -> list:
    """[outer tabs, sub-tabs, LoRA tool picker, the LoRA form's shortcut values (shortcut_fills), message]."""
    try:
        key, fills, note = lora_fills(action)
        tools.tool(key)
    except (ValueError, tools.ToolError) as e:
        return [gr.skip(), gr.skip(), gr.skip(), gr.skip(), A.error_md(str(e))]
    return [gr.Tabs(selected="utilities"), gr.Tabs(selected=SUBTABS["lora"]), gr.update(value=key),
            shortcut_fills(key, fills), A.ok_md(note)]


def build_lora_shortcuts(outer_tabs, handles: dict) -> None:
    """Under the run panel's output files: "Resize this LoRA" / "Merge it into its model", when those tools exist."""
    lora = handles.get("lora")
    labels = {"resize": "Resize this LoRA", "merge": "Merge it into its model"}
    present = {t.key for t in tools.in_group("lora")}
    actions = [a for a in labels if lora and present & set(SHORTCUT_TOOLS[a])]
    if not actions:
        return
    with gr.Row():
        for action in actions:
            btn = gr.Button(f"{labels[action]} (the last run's result)", size="sm", elem_id=f"run-lora-{action}")
            btn.click(functools.partial(lora_shortcut, action),
                      outputs=[outer_tabs, handles["subtabs"], lora["picker"], lora["filled"], lora["status"]],
                      show_progress="hidden")

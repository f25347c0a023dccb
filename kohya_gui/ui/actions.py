"""What the buttons do, as plain functions of (tab, family, control values). app.py wires them to components;
tests call them directly. Control values always come in `tab_params(tab)` order."""

from __future__ import annotations

import functools
import html
import shlex
import time
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from .. import (command, compile_auto, config_file, importer, presets, quoting, run_requests, secret_options,
               trainer_check, training)
from .. import params as P
from ..run_queue import QueueError, QueueWorker, RunQueue
from ..runner import Runner, RunnerBusy, format_eta, new_outputs, rank_status
from ..tensorboard import TensorBoard, TensorBoardError
from . import run_notice

RUNNER = Runner()  # one training at a time for the whole app
TENSORBOARD = TensorBoard()  # one TensorBoard server, a child of the GUI


def tab_params(tab: str) -> list[P.Param]:
    """The controls of a tab, in page order (group order, sub-groups after their group, then registry order)."""
    order = P.GROUP_ORDER
    return sorted((p for p in P.CONTROL_PARAMS if tab in p.tabs), key=lambda p: order.index(p.accordion))


@functools.cache
def tab_accordions(tab: str) -> tuple[str, ...]:
    """The tab's groups and sub-groups, in page order."""
    used = {k for p in tab_params(tab) for k in (p.accordion, P.top_group(p.accordion))}
    return tuple(k for k in P.GROUP_ORDER if k in used or k == "model")


# ---- values <-> controls -------------------------------------------------------------------------------------

def optional_number(p: P.Param) -> bool:
    """Numbers whose default is "not set" get a text box: empty = not set (a number box cannot be empty)."""
    return p.kind in ("int", "float") and p.default is None


def to_ui(p: P.Param, value: Any) -> Any:
    if optional_number(p):
        return "" if value is None else (str(int(value)) if p.kind == "int" else P.format_number(value))
    if p.kind == "list":
        return shlex.join(value or [])
    if p.kind in ("str", "path", "dir"):
        return value or ""
    return value


def from_ui(p: P.Param, value: Any, tab: str | None = None) -> Any:
    """A control's value as the registry type (raises ValueError with the reason)."""
    if p.kind in ("int", "float"):
        if isinstance(value, str):
            value = value.strip()
        if value is None or value == "":
            return None if p.default is None else p.check(None)
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected {p.type_words()}, got {value!r}") from None
        if p.kind == "int":
            if number != int(number):
                raise ValueError(f"expected a whole number, got {value!r}")
            return p.check(int(number))
        return p.check(number)
    if p.kind == "list":
        try:
            return shlex.split(value or "")
        except ValueError as e:
            raise ValueError(f"cannot split {value!r}: {e}") from e
    if p.kind in ("str", "path", "dir"):
        return (value or "").strip()
    return p.check(value, tab)


def values_from_ui(tab: str, ui_values) -> tuple[dict[str, Any], list[str]]:
    """(values, errors): every control of the tab, converted; errors name the control."""
    values, errors = {}, []
    for p, v in zip(tab_params(tab), ui_values, strict=True):
        try:
            values[p.name] = from_ui(p, v, tab)
        except ValueError as e:
            errors.append(f"{p.label} ({p.name}): {e}")
            values[p.name] = p.default_for(tab)
    return values, errors


def family_default_params(tab: str) -> list[P.Param]:
    """The tab's controls whose default depends on the family (P.Param.family_defaults), in page order."""
    return [p for p in tab_params(tab) if p.family_defaults]


def family_value_updates(tab: str, family: str) -> list:
    """When the user picks a family: the fields whose default is that family's own (Lumina 2's flow-matching
    options: family_default_params) take it; every other field is left as it is."""
    return [gr.update(value=to_ui(p, p.default_for(tab, family))) for p in family_default_params(tab)]


def elem_id(tab: str, p: P.Param) -> str:
    """The control's HTML id: "<tab>-<option>" (a network-type field's dot becomes "-", for CSS selectors)."""
    return f"{tab}-{p.name.replace('.', '-')}"


def network_fields(tab: str) -> list[P.Param]:
    """The tab's network-type fields (--network_args keys), in page order."""
    return [p for p in tab_params(tab) if p.network_arg]


def value_updates(tab: str, values: dict[str, Any]) -> list:
    """The value of each control (what the page shows follows the family and network module: ui/visibility.py)."""
    return [gr.update(value=to_ui(p, values.get(p.name, p.default_for(tab)))) for p in tab_params(tab)]


def script_note(tab: str, family: str) -> str:
    return f"Runs <code>sd-scripts/{html.escape(P.script_for(tab, family))}</code>"


def no_change(tab: str) -> list:
    return [gr.update() for _ in tab_params(tab)]


# ---- open / save ----------------------------------------------------------------------------------------------

def open_config(tab: str, path: str, family: str) -> list:
    """Returns [status, family update, *control updates]; on any error the status says why and nothing else
    changes."""
    return _open(tab, path, family)[0]


def open_from_box(tab: str, path: str, family: str) -> list:
    """Open: open_config's updates, then the configuration path box (a kohya_ss JSON: where Save writes our TOML)
    and the preset box (cleared: the form is no longer the preset)."""
    out, target = _open(tab, path, family)
    if out[1] == gr.update():  # not opened
        return [*out, gr.update(), gr.update()]
    return [*out, gr.update(value=target) if target else gr.update(), gr.update(value=None)]


def import_target(tab: str, json_path: str) -> Path:
    """Where Save puts an imported kohya_ss configuration (and where its side files go): configs/<tab>/<stem>.toml,
    as for presets."""
    return Path(presets.user_config_path(tab, Path(json_path).stem))


def _open(tab: str, path: str, family: str) -> tuple[list, str | None]:
    """(open_config's updates, the TOML path Save should use for an imported file, else None)."""
    path = (path or "").strip()
    if not path:
        return [error_md("Enter the path of a configuration file to open."), gr.update(), *no_change(tab)], None
    if path.lower().endswith(".json"):  # a kohya_ss GUI configuration: imported, with a report of every key
        try:
            imp = importer.load(path)
            if (imp.tab == "lora") == (tab == "lora") and imp.tab != tab:
                imp = importer.load(path, tab)  # DreamBooth and Fine-tune files open in either tab
        except importer.ImportError_ as e:
            return [error_md(str(e)), gr.update(), *no_change(tab)], None
        if imp.tab != tab:
            return [error_md(f"{path} is a {P.TAB_LABELS[imp.tab]} configuration; open it in that tab"),
                    gr.update(), *no_change(tab)], None
        target = import_target(tab, path)
        try:  # kohya_ss makes these files before a run: written now, so the form (and Save) has their paths
            if imp.side_files:
                target.parent.mkdir(parents=True, exist_ok=True)
                imp.write_side_files(target, free_names=True)
        except OSError as e:
            return [error_md(f"{path}: cannot write the files kohya_ss makes before a run beside {target}: {e}"),
                    gr.update(), *no_change(tab)], None
        return [ok_md(import_report_md(path, imp, target)), gr.update(value=imp.family),
                *value_updates(tab, imp.values)], str(target)
    try:
        cfg = config_file.load(path, tab, family)
    except config_file.ConfigError as e:
        return [error_md(str(e)), gr.update(), *no_change(tab)], None
    return [ok_md(f"Opened {path}"), gr.update(value=cfg.family), *value_updates(tab, cfg.values)], None


def import_report_md(path: str, imp, target: Path) -> str:
    counts = {w: sum(1 for _, what, _ in imp.report if what == w) for w in ("mapped", "converted", "dropped")}
    lines = "\n".join(f"- `{k}`: {what}" + (f" ({why})" if why else "") for k, what, why in imp.report)
    files = "".join(f" The file kohya_ss makes before a run is written to `{imp.values[name]}` ({name})."
                    for name in imp.side_files)
    notes = "".join(f" Note: {n}." for n in imp.notes)
    return (f"Imported the kohya_ss configuration {path} ({imp.family}): {counts['mapped']} keys mapped, "
            f"{counts['converted']} converted, {counts['dropped']} dropped. Save writes it as our TOML to "
            f"`{target}`.{files}{notes}\n\n<details><summary>Import report</summary>\n\n{lines}\n\n</details>")


def open_preset(tab: str, name: str, family: str) -> list:
    """Like open_config for presets/<tab>/<name>.toml; also puts a user path into the config path box."""
    if not name:
        return [gr.update(), gr.update(), gr.update(), *no_change(tab)]
    try:
        path = presets.preset_path(tab, name)
    except FileNotFoundError as e:
        return [gr.update(), error_md(str(e)), gr.update(), *no_change(tab)]
    out, target = _open(tab, str(path), family)
    if out[1] != gr.update():  # opened
        report = f"\n\n{out[0]}" if name.startswith(presets.KOHYA_SS) else ""  # the import report
        out[0] = ok_md(f"Loaded preset **{name}**. Save writes to the path above; the preset stays as it is."
                       + report)
        return [gr.update(value=target or presets.user_config_path(tab, name)), *out]
    return [gr.update(), *out]


def save_config(tab: str, path: str, family: str, *ui_values, overwrite: bool = True) -> str:
    path = (path or "").strip()
    if not path:
        return error_md("Enter a path for the configuration file (e.g. configs/my-lora.toml).")
    if not path.endswith(".toml"):
        path += ".toml"
    if not overwrite and Path(path).exists():
        return error_md(f"{path} already exists. Save as never overwrites; choose a new name, or use Save.")
    values, errors = values_from_ui(tab, ui_values)
    if errors:
        return error_md("Not saved:\n" + "\n".join(f"- {e}" for e in errors))
    try:
        config_file.save(path, tab, family, values)
    except (config_file.ConfigError, OSError) as e:
        return error_md(f"Not saved: {e}")
    return ok_md(f"Saved {path}" + _secrets_note(values))


def _secrets_note(values: dict) -> str:
    text = secret_options.note(values)
    return f"\n\n{text}" if text else ""


# ---- command, start, stop ----------------------------------------------------------------------------------

def commands(argv: list[str], standalone: list[str], status: str) -> tuple[str, str, str, str, str]:
    """(command, stand-alone command, status, the two again for the other shell): this machine's shell first (what
    a Windows user pastes into cmd or PowerShell, a Linux user into bash), the other one under it."""
    native, other = quoting.native_shell(), quoting.other_shell(quoting.native_shell())
    return (command.printable(argv, native), command.printable(standalone, native), status,
            command.printable(argv, other), command.printable(standalone, other))


def print_command(tab: str, family: str, *ui_values) -> tuple[str, str, str, str, str]:
    """(command Start runs, stand-alone command with every setting as a flag, status, then both commands for the
    other shell: see `commands`)."""
    values, errors = values_from_ui(tab, ui_values)
    if errors:
        return (gr.update(), gr.update(), error_md("Fix these first:\n" + "\n".join(f"- {e}" for e in errors)),
                gr.update(), gr.update())
    errors = command.validation_errors(tab, family, values)
    errors = errors or trainer_check.problems(tab, family, values)  # the trainer's own checks (--validate_only)
    argv = command.build_argv(tab, family, values)
    standalone = command.standalone_argv(tab, family, values)
    note = ok_md(f"Start training writes the settings to `{command.run_config_path(values)}` and runs the first "
                 "command; the second is the same run with every setting as a flag, for another machine."
                 + _secrets_note(values))
    if errors:
        note = error_md("The command is shown, but these must be fixed before a run:\n"
                        + "\n".join(f"- {e}" for e in errors))
    return commands(argv, standalone, note)


def start_training(tab: str, family: str, *ui_values) -> tuple[str, str, str, str, str]:
    """(command, stand-alone command, status, both commands for the other shell)."""
    values, errors = values_from_ui(tab, ui_values)
    if errors:
        run_notice.NOTICE.start_failed(RUNNER.snapshot())
        return (gr.update(), gr.update(), error_md("Cannot start training:\n" + "\n".join(f"- {e}" for e in errors)),
                gr.update(), gr.update())
    try:
        argv = training.start(RUNNER, tab, family, values)
    except (training.RunError, RunnerBusy) as e:
        run_notice.NOTICE.start_failed(RUNNER.snapshot())
        return gr.update(), gr.update(), error_md(str(e)), gr.update(), gr.update()
    return commands(argv, command.standalone_argv(tab, family, values),
                    ok_md(f"Training started; log: `{command.log_path(values)}`" + _secrets_note(values)))


def stop_training(now: bool = False) -> str:
    """Stop: the trainer finishes its step and saves (it may take a while); Stop now: kills it, nothing saved."""
    if RUNNER.stop(now=now):
        return ok_md("Training stopped." if now else f"Training stopped: {RUNNER.snapshot().message}")
    return error_md("No training is running.")


# ---- the queue -------------------------------------------------------------------------------------------------

@functools.cache
def run_queue() -> RunQueue:
    """The app's queue, made on first use (its folder follows XDG_CONFIG_HOME at that time)."""
    return RunQueue()


def start_queue_worker() -> QueueWorker:
    """gui.py: runs the queued entries one after another while the GUI runs."""
    return QueueWorker(run_queue(), RUNNER).start()


def add_to_queue(tab: str, family: str, *ui_values) -> str:
    values, errors = values_from_ui(tab, ui_values)
    if errors:
        return error_md("Cannot queue this run:\n" + "\n".join(f"- {e}" for e in errors))
    try:
        entry = run_queue().add(tab, family, values)
    except (QueueError, config_file.ConfigError) as e:
        return error_md(str(e))
    waiting = sum(e.state == "queued" for e in run_queue().snapshot()[1])
    return ok_md(f"Queued `{entry.name}` ({waiting} waiting); it starts when no other run is active. "
                 "The queue is under the training run panel.")


def queue_md(entries) -> str:
    if not entries:
        return "The queue is empty: **Add to queue** beside Start training puts the tab's settings here."
    rows = [f"| {i} | `{e.name}` | {P.TAB_LABELS.get(e.tab, 'Utilities')} {e.family} | {e.state} | "
            f"{e.message.splitlines()[0][:120] if e.message else ''} |" for i, e in enumerate(entries, 1)]
    return "| # | output name | tab | state | note |\n|---|---|---|---|---|\n" + "\n".join(rows)


def queue_choices(entries) -> list[tuple[str, str]]:
    return [(f"{i}. {e.name} ({e.state})", e.id) for i, e in enumerate(entries, 1)]


def queue_change(action: str, entry_id: str | None, run: bool, stop_on_failure: bool) -> tuple:
    """Up / Down / Remove for the chosen entry, or the two options ("options"): (message, list, entry choices)."""
    q = run_queue()
    message = ""
    try:
        if action == "options":
            q.set_options(run=run, stop_on_failure=stop_on_failure)
        elif not entry_id:
            message = error_md("Choose a queue entry first.")
        else:
            {"up": lambda: q.move(entry_id, -1), "down": lambda: q.move(entry_id, 1),
             "remove": lambda: q.remove(entry_id)}[action]()
    except QueueError as e:
        message = error_md(str(e))
    entries = q.snapshot()[1]
    kept = entry_id if any(e.id == entry_id for e in entries) else None
    return message, queue_md(entries), gr.update(choices=queue_choices(entries), value=kept)


def request_now(request: str) -> str:
    """Save now / Sample now: the trainer acts on it after its current step (kohya_gui.run_requests)."""
    s = RUNNER.snapshot()
    if not s.running or not s.output_dir:
        return error_md("No training is running.")
    try:
        run_requests.send(request, s.output_dir)
    except run_requests.RequestError as e:
        return error_md(str(e))
    what = {"save": "save the network / model", "sample": "draw the sample images"}[request]
    return ok_md(f"Asked the trainer to {what} after its current step; the log shows when it does.")


# ---- the run panel ---------------------------------------------------------------------------------------------

def run_panel(seen: int = -1) -> tuple:
    """(progress HTML, log text, result markdown, version) for the current or last run; parts that did not
    change since version `seen` are skipped so the page keeps its scroll position."""
    version = RUNNER.version + run_notice.NOTICE.version
    s = RUNNER.snapshot()
    if version == seen:
        return (progress_html(s) if s.running else gr.skip()), gr.skip(), gr.skip(), version
    if run_notice.NOTICE.hides(s):  # the last Start click failed: the previous run's result is not the answer
        return run_notice.not_started_html(), RUNNER.log_tail(300), "", version
    return progress_html(s), RUNNER.log_tail(300), result_md(s), version


TICK_RUNNING_S, TICK_IDLE_S = 1.0, 3.0


def run_tick(seen=None) -> tuple:
    """The run panel's one timer event: run_panel's and run_charts' outputs, the queue list and its entry
    choices, each tab's line of what the compile settings' auto chose (compile_auto_notes), the timer's interval
    (each event costs the browser time in proportion to the page's ~1000 components, so the panel asks every
    second only during a run), then what was seen of all."""
    panel_seen, charts_seen, queue_seen, auto_seen, interval = seen or (-1, None, None, None, None)
    *panel, panel_seen = run_panel(panel_seen)
    *charts, charts_seen = run_charts(charts_seen)
    version, entries = run_queue().snapshot()
    queue = (gr.skip(), gr.skip()) if version == queue_seen else (
        queue_md(entries), gr.update(choices=queue_choices(entries)))
    *notes, auto_seen = compile_auto_notes(RUNNER.snapshot(), auto_seen)
    wanted = TICK_RUNNING_S if RUNNER.running else TICK_IDLE_S
    timer = gr.Timer(value=wanted) if wanted != interval else gr.skip()
    return (*panel, *charts, *queue, *notes, timer, [panel_seen, charts_seen, version, auto_seen, wanted])


def run_tab(s) -> str | None:
    """The tab whose settings the current or last run was started with (its run TOML), or None."""
    if not s.config_path:
        return None
    try:
        return config_file.load(s.config_path).tab
    except (config_file.ConfigError, OSError):
        return None


def compile_auto_notes(s, seen=None) -> tuple:
    """For each tab (P.TABS order), the Torch Compile Settings' line of what `auto` chose in the current or last
    run, read from its log (kohya_gui.compile_auto), on that run's tab only (the others keep theirs), then what was
    seen; all skipped while nothing changed."""
    key = [s.started, sorted(s.auto_choices.items())]
    if key == seen:
        return (*(gr.skip() for _ in P.TABS), seen)
    tab = run_tab(s) if s.started is not None else None
    return (*(compile_auto.markdown(s.auto_choices, P.TAB_LABELS[t]) if t == tab else gr.skip() for t in P.TABS),
            key)


def progress_html(s) -> str:
    if s.started is None:
        return "<div class='kg-progress'><span class='kg-state'>No training run yet.</span></div>"
    pr = s.progress or {}
    step, total = pr.get("step"), pr.get("total")
    frac = (step / total) if step is not None and total else 0.0
    if not s.running and s.returncode == 0:
        frac = 1.0
    state = s.message or ("running" if s.running else "")
    parts = [f"<span class='kg-state'>{state}</span>"]
    if step is not None:
        parts.append(f"step <b>{step}</b> / {total}")
    if pr.get("loss") is not None:
        parts.append(f"loss <b>{pr['loss']:.4f}</b>")
    if pr.get("its"):
        parts.append(f"<b>{pr['its']:.2f}</b> it/s")
    if s.running and pr.get("eta_s") is not None:
        parts.append(f"ETA <b>{format_eta(pr['eta_s'])}</b>")
    elapsed = (s.ended or time.time()) - s.started
    parts.append(f"elapsed {format_eta(elapsed)}")
    return (f"<div class='kg-progress'><div class='kg-bar'><div style='width:{frac * 100:.1f}%'></div></div>"
            f"<div class='kg-stats'>{' &middot; '.join(parts)}</div>{ranks_html(s)}{run_notice.settings_html(s)}</div>")


def ranks_html(s) -> str:
    """One row per process of a multi-process run (the trainers' rank lines, kohya_gui.runner.parse_rank): its
    step, step time, peak memory and state, so a rank that falls behind, goes silent or ends is seen by name."""
    if len(s.ranks) < 2:
        return ""
    now = time.time()
    rows = []
    for rank, info in sorted(s.ranks.items()):
        memory = f"{info['memory_gib']:.2f} GiB" + (" RSS" if info.get("memory_kind") == "RSS" else "") \
            if info.get("memory_gib") is not None else "-"
        status = rank_status(info, now, s.running)
        flag = " class='kg-rank-off'" if status.startswith(("ended", "silent")) else ""
        rows.append(f"<tr{flag}><td>rank {rank}</td><td>{info['step']} / {info['total']}</td>"
                    f"<td>{info['step_s']:.3f} s</td><td>{memory}</td><td>{status}</td></tr>")
    return ("<table class='kg-ranks'><tr><th>process</th><th>step</th><th>s/step</th><th>peak memory</th>"
            f"<th>state</th></tr>{''.join(rows)}</table>")


def result_md(s) -> str:
    if s.started is None or s.running:
        return ""
    status = s.returncode if s.returncode is not None else "-"
    parts = [f"**Run {s.message}**" + ("" if "exit status" in s.message else f" (exit status {status})")]
    if s.error_lines:
        parts.append("Last error lines:\n\n```\n" + "\n".join(s.error_lines) + "\n```")
    if s.log_path:
        parts.append(f"Log: `{s.log_path}`")
    return "\n\n".join(parts)


def run_charts(seen=None) -> tuple:
    """(loss chart, learning-rate chart, sample gallery, output files, seen) for the current or last run; all
    skipped while nothing changed since `seen`, so the page redraws them only when a point, a sample or a file
    comes."""
    version, history = RUNNER.history_snapshot()
    s = RUNNER.snapshot()
    files = files_md(s)
    key = [version, files]
    if seen == key:
        return gr.skip(), gr.skip(), gr.skip(), gr.skip(), seen
    loss, lr = history.loss_rows(), history.lr_rows()
    return (gr.update(value=pd.DataFrame(loss, columns=["step", "value", "series"]), visible=bool(loss)),
            gr.update(value=pd.DataFrame(lr, columns=["step", "value", "series"]), visible=bool(lr)),
            gr.update(value=[(path, caption) for path, caption in history.samples if Path(path).is_file()],
                      visible=bool(history.samples)),
            files, key)


def files_md(s) -> str:
    """The run's output files with their sizes (found while it runs, the final list after)."""
    paths = s.outputs if not s.running else new_outputs(s.output_dir, s.started)
    rows = []
    for path in paths:
        try:
            rows.append(f"- `{path}` ({format_size(Path(path).stat().st_size)})")
        except OSError:
            continue
    return "Output files:\n\n" + "\n".join(rows) if rows else ""


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def open_tensorboard(logdir: str, request: gr.Request = None) -> str:
    """Starts (or reuses) TensorBoard on the tab's log folder; the link uses the host the page came from."""
    try:
        port = TENSORBOARD.start((logdir or "").strip())
    except TensorBoardError as e:
        return error_md(str(e))
    host = "127.0.0.1"
    if request is not None and request.headers.get("host"):
        host = request.headers["host"].rsplit(":", 1)[0]
    url = f"http://{host}:{port}/"
    return ok_md(f"TensorBoard for `{logdir.strip()}`: [{url}]({url})")


def ok_md(text: str) -> str:
    return text


def error_md(text: str) -> str:
    lines = text.split("\n")
    head, rest = lines[0], lines[1:]
    body = "\n".join(f"> {ln}" if not ln.startswith("- ") else f"> {ln}" for ln in rest)
    return f"> **Error:** {head}" + ("\n>\n" + body if body else "")

"""Feedback where the user looks and a form that survives a refresh (issue 13, items 3 and 5), without a
browser: the run panel says "compiling" while the trainer's compile steps run and names the run's settings file,
a failed Start hides the previous run's result, errors render red, and each tab's last settings are kept in the
user's config folder and put back on a page load (the running job's settings during a run)."""

from __future__ import annotations

import logging
import sys
import textwrap
import time
from argparse import Namespace

import gradio as gr
import pytest

from kohya_gui import config_file, last_settings, presets
from kohya_gui import params as P
from kohya_gui.runner import Runner, RunState
from kohya_gui.ui import actions as A
from kohya_gui.ui import feedback

from gui_helpers import ui_values
from test_gui_runner import wait_for


@pytest.fixture(autouse=True)
def user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("APPDATA", raising=False)
    return tmp_path / "xdg" / "kohya_gui"


# ---- "compiling" ---------------------------------------------------------------------------------------------

def shape_log_line(caplog, mode: str) -> str:
    """The line the trainers log before a step that compiles (library.compile.regional.ShapeLog), as printed."""
    import torch
    from library.compile import regional

    args = Namespace(compile=True, compile_backend="inductor", compile_mode=mode)
    with caplog.at_level(logging.INFO, logger=regional.logger.name):
        assert regional.ShapeLog(args).see({"latents": torch.zeros(1, 4, 8, 8)})
    record = caplog.records[-1]
    return f"2026-01-01 00:00:00 INFO {record.name}: {record.getMessage()}"


# prints the compile line, then one progress line per gate file the test creates
GATED = textwrap.dedent("""
    import os, sys, time
    print(sys.argv[2], flush=True)
    for step in (1, 2, 3, 4):
        while not os.path.exists(os.path.join(sys.argv[1], f"gate{step}")):
            time.sleep(0.02)
        print(f"steps: {step}/4 loss=0.1 it/s=1.00 eta=0:00:01", flush=True)
""")


@pytest.mark.parametrize("mode,compiling_steps", [("default", 1), ("reduce-overhead", 2)])
def test_run_panel_says_compiling_until_the_compiled_steps_are_done(tmp_path, caplog, mode, compiling_steps):
    script = tmp_path / "gated.py"
    script.write_text(GATED)
    runner = Runner()
    runner.start([[sys.executable, str(script), str(tmp_path), shape_log_line(caplog, mode)]], tmp_path / "run.log")
    assert wait_for(lambda: runner.snapshot().message.startswith("compiling")), runner.log_tail()
    assert "1x4x8x8" in runner.snapshot().message
    assert "<span class='kg-state'>compiling" in A.progress_html(runner.snapshot())
    for step in (1, 2, 3):
        (tmp_path / f"gate{step}").touch()
        assert wait_for(lambda: (runner.snapshot().progress or {}).get("step") == step), runner.log_tail()
        expected = "compiling" if step < compiling_steps else "running"
        assert runner.snapshot().message.split(" ")[0] == expected, (step, runner.snapshot().message)
    (tmp_path / "gate4").touch()
    state = runner.wait(20)
    assert state.returncode == 0 and state.message == "finished"


# ---- the run panel -------------------------------------------------------------------------------------------

class FakeRunner:
    def __init__(self, state: RunState, version: int = 5):
        self.state, self.version = state, version

    @property
    def running(self):
        return self.state.running

    def snapshot(self):
        return self.state

    def log_tail(self, n=200):
        return "old log"


def test_panel_names_the_settings_file_of_the_run(tmp_path):
    s = RunState(running=True, started=time.time(), message="running", config_path="outputs/x/my <run>.toml",
                 progress={"step": 1, "total": 4, "loss": 0.1, "its": 1.0, "eta_s": 3})
    assert "Settings of this run: <code>outputs/x/my &lt;run&gt;.toml</code>" in A.progress_html(s)
    assert "Settings of this run" not in A.progress_html(RunState(running=True, started=time.time()))


def test_a_failed_start_hides_the_previous_result_until_a_new_run(monkeypatch):
    monkeypatch.setattr(feedback, "NOTICE", feedback.StartNotice())
    old = RunState(started=100.0, ended=110.0, returncode=1, message="failed (exit status 1)",
                   error_lines=["RuntimeError: boom"])
    fake = FakeRunner(old)
    monkeypatch.setattr(A, "RUNNER", fake)
    progress, _, result, seen = A.run_panel(-1)
    assert "boom" in result
    bad = ui_values("lora", P.defaults("lora"))
    bad[[p.name for p in A.tab_params("lora")].index("network_dim")] = "x"
    out = A.start_training("lora", "SDXL", *bad)
    assert out[2].startswith("> **Error:** Cannot start training")
    progress, log, result, seen2 = A.run_panel(seen)
    assert seen2 != seen and result == "" and "Not started" in progress and "boom" not in progress
    assert A.run_panel(seen2)[2] == gr.skip() and A.run_panel(-1)[2] == ""  # stays hidden, also after a refresh
    # a new run shows normally
    fake.state = RunState(running=True, started=200.0, message="running")
    fake.version += 1
    assert "Not started" not in A.run_panel(seen2)[0]
    # a click that fails because a run is active does not hide that run's result
    feedback.NOTICE.start_failed(fake.state)
    fake.state = RunState(started=200.0, ended=210.0, returncode=0, message="finished")
    fake.version += 1
    assert "Run finished" in A.run_panel(-1)[2]


def test_errors_are_block_quotes_the_message_areas_paint_red():
    # the red is CSS on .kg-msg blockquote (the browser test checks the colour); error_md must stay a quote
    assert A.error_md("bad\n- x").startswith("> **Error:** bad")
    assert ".kg-msg blockquote" in feedback.CSS and "--error-text-color" in feedback.CSS


# ---- last used settings ----------------------------------------------------------------------------------------

def test_last_settings_round_trip_in_the_user_config_folder(user_config):
    values = {**P.defaults("lora"), "network_dim": 13, "output_name": "kept"}
    assert last_settings.save("lora", "SD1.x", values, "configs/mine.toml")
    assert last_settings.path("lora") == user_config / "last_lora.toml"
    cfg, path, note = last_settings.load("lora")
    assert (cfg.family, cfg.values["network_dim"], cfg.values["output_name"]) == ("SD1.x", 13, "kept")
    assert path == "configs/mine.toml" and note is None
    assert config_file.load(user_config / "last_lora.toml").values["network_dim"] == 13  # Open reads it too
    shown = feedback.remembered("lora")
    assert (shown.family, shown.values["network_dim"], shown.path) == ("SD1.x", 13, "configs/mine.toml")
    assert shown.note.startswith("Reopened the last used settings") and "last_lora.toml" in shown.note
    assert feedback.remembered("dreambooth").values == config_file.load(
        presets.preset_path("dreambooth", presets.DEFAULT_PRESET)).values  # nothing kept: the preset


@pytest.mark.parametrize("content", [b"[network]\nnetwork_dimm = 3\n", b"not toml [[[", b"\xff\xfe\x00bad"])
def test_an_unusable_file_falls_back_to_the_preset_with_a_note(user_config, content):
    user_config.mkdir(parents=True)
    (user_config / "last_lora.toml").write_bytes(content)
    assert last_settings.load("lora")[:2] == (None, None)
    shown = feedback.remembered("lora")
    assert shown.values == config_file.load(presets.preset_path("lora", presets.DEFAULT_PRESET)).values
    assert shown.note.startswith("> **Error:** The last used settings") and "last_lora.toml" in shown.note


def test_an_unwritable_folder_does_not_break_anything(user_config):
    user_config.parent.mkdir(parents=True)
    user_config.write_text("a file where the folder should be")
    assert last_settings.save("lora", "SDXL", P.defaults("lora")) is False


def test_remember_keeps_the_last_good_value_of_a_field_being_edited(user_config):
    values = {**P.defaults("lora"), "network_dim": 13}
    feedback.remember("lora", "configs/a.toml", "SDXL", *ui_values("lora", values))
    assert last_settings.load("lora")[0].values["network_dim"] == 13
    names = [p.name for p in A.tab_params("lora")]
    bad = ui_values("lora", {**values, "output_name": "changed"})
    bad[names.index("network_dim")] = "1x"  # half typed
    feedback.remember("lora", "configs/b.toml", "SDXL", *bad)
    cfg, path, _ = last_settings.load("lora")
    assert (cfg.values["network_dim"], cfg.values["output_name"], path) == (13, "changed", "configs/b.toml")


def test_page_load_shows_the_remembered_form_and_during_a_run_the_runs_settings(user_config, tmp_path, monkeypatch):
    built = feedback.remembered("lora")
    form = feedback.TabForm("lora", built, outputs=[None] * (3 + len(A.value_updates("lora", {}))))
    assert all(u == gr.skip() for u in form.load_updates())  # nothing changed since the page was built
    values = {**built.values, "network_dim": 21}
    last_settings.save("lora", "SDXL", values, "configs/c.toml")
    out = form.load_updates()
    dim = out[3 + [p.name for p in A.tab_params("lora")].index("network_dim")]
    assert out[0]["value"] == "configs/c.toml" and dim["value"] == "21"
    # a run of this tab is active: its settings file wins
    run_toml = tmp_path / "run.toml"
    config_file.save(run_toml, "lora", "SD1.x", {**values, "network_dim": 7})
    monkeypatch.setattr(A, "RUNNER", FakeRunner(RunState(running=True, started=1.0, config_path=str(run_toml))))
    out = form.load_updates()
    dim = out[3 + [p.name for p in A.tab_params("lora")].index("network_dim")]
    assert dim["value"] == "7" and out[2]["value"] == "SD1.x" and str(run_toml) in out[1]["value"]
    assert feedback.running_config("dreambooth") is None  # other tabs keep their own


def test_page_load_selects_the_running_jobs_tab(tmp_path, monkeypatch):
    class App:
        def load(self, fn, outputs, show_progress):
            self.fn, self.outputs = fn, outputs
            return self

        def then(self, fn, js):  # the page marks its form as restored after the load's updates
            self.then_js = js

    forms = [feedback.TabForm(tab, feedback.remembered(tab),
                              outputs=[None] * (3 + len(A.value_updates(tab, {})))) for tab in P.TABS]
    app = App()
    feedback.restore_on_load(app, forms, tabs="tabs")
    assert app.outputs[-1] == "tabs" and len(app.outputs) == sum(len(f.outputs) for f in forms) + 1
    assert app.fn()[-1] == gr.skip()  # no run: the page keeps the tab the user is on
    assert "formRestored" in app.then_js
    run_toml = tmp_path / "run.toml"
    config_file.save(run_toml, "dreambooth", "SDXL", config_file.load(
        presets.preset_path("dreambooth", presets.DEFAULT_PRESET)).values)
    monkeypatch.setattr(A, "RUNNER", FakeRunner(RunState(running=True, started=1.0, config_path=str(run_toml))))
    out = app.fn()
    assert out[-1] == gr.update(selected="dreambooth")
    assert "running training" in out[len(forms[0].outputs) + 1]["value"]  # the DreamBooth tab's status
    assert out[1] == gr.skip()  # the LoRA tab keeps its own form


# takes SIGTERM as the trainers do: finishes (here: waits for a gate file), then exits
SAVES_ON_SIGTERM = textwrap.dedent("""
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *a: None)
    print("steps: 1/4 loss=0.1", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.02)
    print("stopped at step 1, saved out.safetensors", flush=True)
""")


def test_panel_says_stopping_while_the_trainer_saves(tmp_path):
    import threading

    script = tmp_path / "saves.py"
    script.write_text(SAVES_ON_SIGTERM)
    runner = Runner()
    runner.start([[sys.executable, str(script), str(tmp_path / "saved")]], tmp_path / "run.log")
    assert wait_for(lambda: runner.snapshot().progress is not None)
    stopper = threading.Thread(target=runner.stop)
    stopper.start()
    assert wait_for(lambda: runner.snapshot().message.startswith("stopping"))
    assert "<span class='kg-state'>stopping: the trainer finishes its step and saves" in \
        A.progress_html(runner.snapshot())
    (tmp_path / "saved").touch()
    stopper.join(30)
    assert runner.snapshot().message == "stopped at step 1, saved out.safetensors"

"""gui.py launch flags and the exposure warning; `python -m kohya_gui print-command` (exact and stand-alone);
the command is an argv list that quotes paths safely; Start refuses bad settings and never overwrites a result."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

import psutil
import pytest
from gui_helpers import ui_values

import gui
from kohya_gui import REPO, command, config_file, presets, training
from kohya_gui import params as P
from kohya_gui.runner import Runner
from kohya_gui.ui import actions as A


def test_launch_flags_and_warning():
    a = gui.parse_args([])
    assert (a.listen, a.server_port, a.share, a.inbrowser, a.headless) == ("127.0.0.1", 7860, False, False, False)
    assert gui.exposure_warning(a) is None
    a = gui.parse_args(["--listen", "--server_port", "7999", "--headless", "--inbrowser"])
    assert a.listen == "0.0.0.0" and a.server_port == 7999 and a.headless and a.inbrowser
    assert "0.0.0.0:7999 without a password" in gui.exposure_warning(a)
    assert gui.exposure_warning(gui.parse_args(["--listen", "--username", "u", "--password", "p"])) is None
    assert "public share link" in gui.exposure_warning(gui.parse_args(["--share"]))
    assert gui.exposure_warning(gui.parse_args(["--listen", "127.0.0.1"])) is None
    with pytest.raises(SystemExit):
        gui.parse_args(["--username", "u"])


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "kohya_gui", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_print_command_cli_matches_the_gui(tmp_path):
    preset = presets.preset_path("lora", "sdxl-lora-12gb")
    out = run_cli("print-command", str(preset))
    assert out.returncode == 0, out.stderr
    cfg = config_file.load(preset)
    assert shlex.split(out.stdout) == command.build_argv(cfg.tab, cfg.family, cfg.values)
    gui_cmd, gui_standalone, _ = A.print_command("lora", cfg.family, *ui_values("lora", cfg.values))
    assert out.stdout.strip() == gui_cmd
    out = run_cli("print-command", "--standalone", str(preset))
    argv = shlex.split(out.stdout)
    assert out.stdout.strip() == gui_standalone
    assert argv[:2] == ["accelerate", "launch"] and "--compile" in argv and "--config_file" not in argv
    assert argv[argv.index("--compile_mode") + 1] == "reduce-overhead"
    bad = tmp_path / "bad.toml"
    bad.write_text("[parameters]\nlearning_rat = 0.1\n")
    out = run_cli("print-command", str(bad))
    assert out.returncode == 2 and "learning_rat" in out.stderr and "learning_rate" in out.stderr


def test_paths_with_spaces_and_quotes_stay_one_argument():
    values = {**P.defaults("lora"), "output_dir": "/tmp/my out", "output_name": "it's; rm -rf ~"}
    argv = command.build_argv("lora", "SDXL", values)
    assert argv[-1] == "/tmp/my out/it's; rm -rf ~.toml"
    assert shlex.split(command.printable(argv)) == argv


def test_start_refuses_bad_settings_and_existing_results(tmp_path):
    runner = Runner()
    with pytest.raises(training.RunError, match="pretrained_model_name_or_path.*required"):
        training.start(runner, "lora", "SDXL", P.defaults("lora"))
    values = {**P.defaults("lora"), "pretrained_model_name_or_path": "m.safetensors", "train_data_dir": "d",
              "output_dir": str(tmp_path), "output_name": "done"}
    (tmp_path / "done.safetensors").write_bytes(b"earlier result")
    (tmp_path / "done.toml").write_text("earlier settings")
    with pytest.raises(training.RunError, match="already exists"):
        training.start(runner, "lora", "SDXL", values)
    assert (tmp_path / "done.toml").read_text() == "earlier settings"
    assert not runner.running
    cmd, standalone, status = A.start_training("lora", "SDXL", *ui_values("lora", values))
    assert "already exists" in status and "Overwrite existing result" in status


def test_cpu_with_several_processes_is_refused():
    # accelerate launch --cpu starts one process whatever --num_processes says: say so before a run starts
    values = {**P.defaults("lora"), "pretrained_model_name_or_path": "m.safetensors", "train_data_dir": "d",
              "output_dir": "out", "output_name": "x", "cpu": True, "num_processes": 2}
    errors = command.validation_errors("lora", "SDXL", values)
    assert any("cpu" in e and "num_processes" in e and "2" in e for e in errors), errors
    assert not command.validation_errors("lora", "SDXL", {**values, "num_processes": 1})
    assert not command.validation_errors("lora", "SDXL", {**values, "cpu": False})


HARNESS = """
import sys, time
import gui
from kohya_gui.runner import Runner
runner = Runner()
gui.stop_run_on_exit(runner)
runner.start([[sys.executable, "-c", "import time; time.sleep(600)"]], sys.argv[1])
while runner.pid is None:
    time.sleep(0.05)
print("RUN", runner.pid, flush=True)
time.sleep(600)
"""


def test_closing_the_gui_stops_its_run(tmp_path):
    """SIGTERM to the GUI process ends the training run it started (no orphaned training process)."""
    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run.log")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        run_pid = None
        for line in proc.stdout:
            if line.startswith("RUN "):
                run_pid = int(line.split()[1])
                break
        assert run_pid and psutil.pid_exists(run_pid)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
        assert "stopping the training run" in rest
        assert not psutil.pid_exists(run_pid) or psutil.Process(run_pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()


def test_train_cli_refuses_incomplete_settings(tmp_path):
    cfg = tmp_path / "incomplete.toml"
    cfg.write_text('[gui]\ntab = "lora"\nfamily = "SDXL"\n[folders]\noutput_dir = "out"\n')
    out = run_cli("train", str(cfg))
    assert out.returncode == 2
    assert "pretrained_model_name_or_path" in out.stderr and "is required" in out.stderr
    assert "train_data_dir" in out.stderr
    assert not (REPO / "out").exists()

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


@pytest.mark.slow
def test_print_command_cli_matches_the_gui(tmp_path):
    preset = presets.preset_path("lora", "sdxl-lora-12gb")
    out = run_cli("print-command", str(preset))
    assert out.returncode == 0, out.stderr
    cfg = config_file.load(preset)
    assert shlex.split(out.stdout) == command.build_argv(cfg.tab, cfg.family, cfg.values)
    gui_cmd, gui_standalone, _, windows_cmd, windows_standalone = A.print_command("lora", cfg.family,
                                                                                 *ui_values("lora", cfg.values))
    assert out.stdout.strip() == gui_cmd
    # this machine's shell first, the Windows form under it (on Windows the other way round)
    out = run_cli("print-command", "--shell", "windows", str(preset))
    assert out.returncode == 0 and out.stdout.strip() == windows_cmd
    assert ms_split(windows_cmd) == command.build_argv(cfg.tab, cfg.family, cfg.values)
    assert ms_split(windows_standalone) == shlex.split(gui_standalone)
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
    assert shlex.split(command.printable(argv, "posix")) == argv
    assert ms_split(command.printable(argv, "windows")) == argv
    assert command.printable(argv) == command.printable(argv, "windows" if os.name == "nt" else "posix")
    with pytest.raises(ValueError, match="shell must be one of posix, windows; got 'fish'"):
        command.printable(argv, "fish")


def ms_split(line: str) -> list[str]:
    """How the Microsoft C runtime (python.exe, accelerate.exe) splits a command line: white space separates
    arguments outside quotes; 2n backslashes before a quote are n and the quote opens or closes, 2n+1 are n and a
    literal quote; other backslashes are literal. (Written from the documented rules, not from our quoting.)"""
    args, cur, quoted, have, i = [], [], False, False, 0
    while i < len(line):
        ch = line[i]
        if ch == "\\":
            n = len(line[i:]) - len(line[i:].lstrip("\\"))
            if i + n < len(line) and line[i + n] == '"':
                cur.append("\\" * (n // 2))
                if n % 2:
                    cur.append('"')
                    i += n + 1
                else:
                    i += n  # the quote toggles below
                have = True
                continue
            cur.append("\\" * n)
            i += n
            have = True
            continue
        if ch == '"':
            quoted, have = not quoted, True
        elif ch in " \t" and not quoted:
            if have:
                args.append("".join(cur))
            cur, have = [], False
        else:
            cur.append(ch)
            have = True
        i += 1
    if have:
        args.append("".join(cur))
    return args


TRICKY = [
    r"C:\Program Files\My Models\sdxl base.safetensors",
    "D:\\train data\\",  # a folder with its trailing backslash: doubled before the closing quote
    r"\\nas\share\lora out\\",
    r"C:\plain\path\model.safetensors",  # nothing to quote: left as it is
    "it's mine",
    'say "hi"',
    r'C:\dir\"quoted\\"',
    "",
    "a&b",
    "x|y>z<w^v",
    "50%off",
    "betas=0.9,0.99",
    "(1)",
    "$HOME",
    "#tag",
    "--output_dir=C:\\out dir\\",
    "Ünïcode 模型",
]


@pytest.mark.parametrize("arg", TRICKY)
def test_windows_form_round_trips_and_is_safe_in_cmd_and_powershell(arg):
    from kohya_gui import quoting

    argv = ["accelerate", "launch", "--config_file", arg, "--x", arg]
    line = command.printable(argv, "windows")
    assert ms_split(line) == argv
    quoted = quoting.windows_quote(arg)
    if any(c in arg for c in " \t") or not arg:  # what list2cmdline quotes, it quotes the same way
        assert quoted == subprocess.list2cmdline([arg])
    if arg == r"C:\plain\path\model.safetensors":
        assert quoted == arg
    if '"' not in arg:
        # cmd.exe toggles its quote state at every ": its own and PowerShell's special characters stay inside
        inside = False
        for ch in quoted:
            if ch == '"':
                inside = not inside
            elif ch in "&|<>^()%!;,'{}@$#` \t":
                assert inside, (arg, quoted)
        assert not inside


@pytest.mark.parametrize("arg, printed", [
    (r"C:\models\sdxl.safetensors", r"C:\models\sdxl.safetensors"),
    (r"C:\Program Files\sd\x.safetensors", r'"C:\Program Files\sd\x.safetensors"'),
    ("D:\\train data\\", r'"D:\train data\\"'),  # else \" would escape the closing quote
    ('say "hi" \\', r'"say \"hi\" \\"'),
    ("a&b", '"a&b"'),
    ("0.9,0.99", '"0.9,0.99"'),  # PowerShell: a bare comma makes two arguments
    ("", '""'),
])
def test_windows_quoting_as_written_by_hand(arg, printed):
    assert command.printable(["python", arg], "windows") == f"python {printed}"


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
    cmd, standalone, status, _, _ = A.start_training("lora", "SDXL", *ui_values("lora", values))
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


@pytest.mark.slow
def test_a_failing_trainer_is_one_line_without_the_launchers_traceback(tmp_path):
    """The launch options carry --quiet: a trainer's one-line error is not followed by accelerate's
    CalledProcessError traceback (issue 26 item 3)."""
    values = {**P.defaults("lora"), "pretrained_model_name_or_path": str(tmp_path / "missing.safetensors"),
              "train_data_dir": str(tmp_path), "output_dir": str(tmp_path / "out"), "output_name": "x"}
    argv = command.build_argv("lora", "SD1.x", values, tmp_path / "run.toml")
    assert argv[:3] == ["accelerate", "launch", "--quiet"]
    config_file.save(tmp_path / "run.toml", "lora", "SD1.x", values)
    argv[0:2] = [sys.executable, "-m", "accelerate.commands.launch"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, env=training.run_env())
    assert proc.returncode != 0
    assert "CalledProcessError" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")], proc.stderr[-2000:]

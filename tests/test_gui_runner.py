"""The runner: streams output into memory and a log file, parses progress, runs one training at a time, and
Stop ends the whole process tree (children and grandchildren, also ones that ignore SIGTERM)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from kohya_gui.runner import Runner, RunnerBusy, format_eta, parse_progress
from gui_helpers import alive, wait_for

# A parent that starts a child, which starts a grandchild that ignores SIGTERM; all print their pids, then the
# parent prints progress lines until killed.
TREE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    level = int(sys.argv[1])
    if level == 2:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"pid{level}={os.getpid()}", flush=True)
    if level < 2:
        subprocess.Popen([sys.executable, __file__, str(level + 1)])
    step = 0
    while True:
        step += 1
        if level == 0:
            print(f"steps: {step}/1000 loss=0.{step:04d} it/s=2.00 eta=0:08:{step % 60:02d}", flush=True)
        time.sleep(0.2)
""")


def test_stop_kills_the_whole_tree_and_runs_one_at_a_time(tmp_path):
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    log = tmp_path / "out" / "run.log"
    runner = Runner()
    runner.start([[sys.executable, str(script), "0"]], log, output_dir=tmp_path / "out")
    assert wait_for(lambda: len(re.findall(r"pid\d=", runner.log_tail())) == 3 and runner.snapshot().progress)
    pids = [int(x) for x in re.findall(r"pid\d=(\d+)", runner.log_tail())]
    assert all(alive(p) for p in pids)
    with pytest.raises(RunnerBusy, match="already active"):
        runner.start([[sys.executable, "-c", "print(1)"]], tmp_path / "other.log")

    prog = runner.snapshot().progress
    assert prog["total"] == 1000 and prog["step"] >= 1 and prog["its"] == 2.0 and prog["loss"] is not None
    # no "stopped at step" line comes (the grandchild ignores SIGTERM): the tree is killed after save_timeout
    assert runner.stop(grace=1.0, save_timeout=2.0) is True
    state = runner.snapshot()
    assert not state.running and state.stopped and state.message == "stopped"
    assert wait_for(lambda: not any(alive(p) for p in pids), 10), [p for p in pids if alive(p)]
    text = log.read_text()
    assert "pid0=" in text and "steps: 1/1000" in text and text.rstrip().endswith("# stopped")
    assert runner.stop() is False  # nothing running any more


# `accelerate launch` (dies on SIGTERM) over a trainer that answers SIGTERM by saving (library.stop_signal)
LAUNCHER = "import subprocess, sys; subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]]).wait()"
TRAINER = textwrap.dedent("""
    import os, signal, sys, time
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    step = 0
    while not stop:
        step += 1
        print(f"steps: {step}/1000 loss=0.1", flush=True)
        time.sleep(0.2)
    time.sleep(1.5)  # the save
    with open(sys.argv[1], "w") as f:
        f.write("saved")
    print(f"stopped at step {step}, saved {sys.argv[1]}", flush=True)
    time.sleep(30)  # lingers after its line: killed `grace` seconds later
""")


@pytest.mark.parametrize("now", [False, True])
def test_stop_waits_for_the_save_and_stop_now_does_not(tmp_path, now):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    result = tmp_path / "out" / "x.safetensors"
    runner = Runner()
    runner.start([[sys.executable, "-c", LAUNCHER, str(trainer), str(result)]], tmp_path / "out" / "run.log")
    assert wait_for(lambda: runner.snapshot().progress)
    pids = [runner.pid, *(p.pid for p in psutil.Process(runner.pid).children(recursive=True))]
    started = time.time()
    assert runner.stop(grace=1.0, now=now) is True
    state = runner.snapshot()
    assert state.stopped and not any(alive(p) for p in pids)
    if now:
        assert state.message == "stopped" and not result.exists()
    else:
        assert state.message == f"stopped at step {state.progress['step']}, saved {result}"
        assert result.read_text() == "saved" and time.time() - started < 15


def test_finished_and_failed_runs_report_status_outputs_and_errors(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    make = ("import pathlib, sys; pathlib.Path(sys.argv[1], 'lora.safetensors').write_bytes(b'x'); "
            "print('steps: 2/2 loss=0.5 it/s=4.0 eta=0:00:00')")
    runner = Runner()
    runner.start([[sys.executable, "-c", "print('first command')"], [sys.executable, "-c", make, str(out)]],
                 out / "a.log", output_dir=out)
    state = runner.wait(60)
    assert state.returncode == 0 and state.message == "finished" and not state.error_lines
    assert state.outputs == [str(out / "lora.safetensors")]
    assert "first command" in runner.log_tail() and state.progress["step"] == 2

    fail = "import sys; print('loading'); print('ValueError: --network_dim must be positive', file=sys.stderr); sys.exit(3)"
    runner.start([[sys.executable, "-c", fail], [sys.executable, "-c", "print('never')"]], out / "b.log",
                 output_dir=out)
    state = runner.wait(60)
    assert state.returncode == 3 and state.message == "failed (exit status 3)"
    assert state.error_lines == ["ValueError: --network_dim must be positive"]
    assert "never" not in (out / "b.log").read_text()


def test_progress_parser():
    p = parse_progress("steps: 12/100 loss=0.1234 it/s=2.35 avr_loss=0.1300 lr=1.00e-04 epoch=1/5 eta=0:00:37")
    assert p == {"step": 12, "total": 100, "loss": 0.13, "its": 2.35, "eta_s": 37.0}
    p = parse_progress("steps:  12%|##  | 12/100 [00:05<00:40,  2.15it/s, avr_loss=0.123]")
    assert p == {"step": 12, "total": 100, "loss": 0.123, "its": 2.15, "eta_s": 40.0}
    p = parse_progress("steps: 3/10 loss=nan 2.00s/it")
    assert p["its"] == 0.5 and p["eta_s"] == 14.0 and p["loss"] != p["loss"]
    assert parse_progress("loading model from x.safetensors") is None
    assert format_eta(3725) == "1:02:05" and format_eta(37) == "00:37" and format_eta(None) == "-"


@pytest.mark.skipif(not hasattr(os, "getpgid"), reason="POSIX process groups")
def test_stop_signals_each_process_once():
    """Stop's SIGTERM goes to the run's process group; only descendants outside that group get their own (a
    second SIGTERM is the trainer's "stop now")."""
    import psutil

    from kohya_gui.proc_tree import outside_group

    same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        procs = [psutil.Process(same.pid), psutil.Process(other.pid)]
        assert [p.pid for p in outside_group(procs, os.getpgid(0))] == [other.pid]
    finally:
        for p in (same, other):
            p.kill()
            p.wait()


# ---- without POSIX process groups (Windows): psutil ends the tree, the request file asks for the save ----------

@pytest.fixture
def no_process_groups(monkeypatch):
    """The runner as on Windows: os.killpg and signal.SIGKILL deleted from the modules it uses (copies of os and
    signal: psutil itself needs the real SIGKILL on this POSIX machine), and the real os.killpg made to fail the
    test if anything still calls it."""
    import signal
    import types

    from kohya_gui import proc_tree, runner

    def module_without(module, name):
        copy = types.ModuleType(module.__name__)
        copy.__dict__.update(module.__dict__)
        delattr(copy, name)
        return copy

    def tripwire(*args):
        raise AssertionError(f"os.killpg{args} called without process groups")

    for mod in (proc_tree, runner):
        monkeypatch.setattr(mod, "os", module_without(os, "killpg"))
        if hasattr(mod, "signal"):
            monkeypatch.setattr(mod, "signal", module_without(signal, "SIGKILL"))
    monkeypatch.setattr(os, "killpg", tripwire)
    assert not proc_tree.groups() and proc_tree.popen_kwargs() == {"creationflags": 0}


@pytest.mark.parametrize("now", [False, True])
def test_without_process_groups_stop_leaves_no_process(tmp_path, no_process_groups, now):
    """The TREE (a grandchild that ignores SIGTERM, no request reader): Stop waits `save_timeout` for a save
    that never comes, Stop now does not; either way psutil finds none of the three processes afterwards."""
    script = tmp_path / "tree.py"
    script.write_text(TREE)
    runner = Runner()
    runner.start([[sys.executable, str(script), "0"]], tmp_path / "run.log", output_dir=tmp_path)
    assert wait_for(lambda: len(re.findall(r"pid\d=", runner.log_tail())) == 3 and runner.snapshot().progress)
    pids = [int(x) for x in re.findall(r"pid\d=(\d+)", runner.log_tail())]
    assert os.getpgid(pids[0]) == os.getpgid(0)  # no group of its own to signal here
    started = time.time()
    assert runner.stop(grace=1.0, now=now, save_timeout=2.0) is True
    assert not [p for p in pids if alive(p)]
    assert time.time() - started < (3.0 if now else 10.0)
    state = runner.snapshot()
    assert not state.running and state.stopped and state.message == "stopped"


def test_without_process_groups_stop_before_any_step_ends_the_tree_at_once(tmp_path, no_process_groups):
    """Before the first progress line the trainer's loop is not running, so nothing reads the request file and
    nothing is to be saved: Stop does not wait `save_timeout`."""
    script = tmp_path / "quiet.py"
    script.write_text(TREE.replace("if level == 0:", "if False:"))
    runner = Runner()
    runner.start([[sys.executable, str(script), "0"]], tmp_path / "run.log", output_dir=tmp_path)
    assert wait_for(lambda: len(re.findall(r"pid\d=", runner.log_tail())) == 3)
    pids = [int(x) for x in re.findall(r"pid\d=(\d+)", runner.log_tail())]
    started = time.time()
    assert runner.stop(grace=1.0, save_timeout=60.0) is True
    assert time.time() - started < 10 and not [p for p in pids if alive(p)]


# a trainer that stops the way sd-scripts' loop does: library.stop_signal's flag and library.run_requests, asked
# once per step
REQUEST_TRAINER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[2])
    from library.run_requests import RunRequests
    from library.stop_signal import StopRequest
    requests = RunRequests(os.path.dirname(sys.argv[1]))
    requests.clear_stale()
    stop = StopRequest().install()
    step = 0
    while "stop" not in requests.take(stop_flag=stop.flag):
        step += 1
        print(f"steps: {step}/1000 loss=0.1", flush=True)
        time.sleep(0.2)
    time.sleep(1.0)  # the save
    with open(sys.argv[1], "w") as f:
        f.write(stop.signal_name or "request")
    print(f"stopped at step {step}, saved {sys.argv[1]}", flush=True)
""")


@pytest.mark.parametrize("groups", [True, False])
def test_stop_and_save_with_and_without_process_groups(tmp_path, request, groups):
    """The same trainer saves on Stop with process groups (SIGTERM) and without them (the "stop" request in the
    output folder's request file; the launcher above it is not signalled and ends when its child does)."""
    from kohya_gui import REPO

    if not groups:
        request.getfixturevalue("no_process_groups")
    trainer = tmp_path / "trainer.py"
    trainer.write_text(REQUEST_TRAINER)
    result = tmp_path / "out" / "x.safetensors"
    result.parent.mkdir()
    runner = Runner()
    runner.start([[sys.executable, "-c", LAUNCHER.replace("sys.argv[2]]", "sys.argv[2], sys.argv[3]]"),
                   str(trainer), str(result), str(REPO / "sd-scripts")]], tmp_path / "out" / "run.log",
                 output_dir=result.parent)
    assert wait_for(lambda: runner.snapshot().progress)
    pids = [runner.pid, *(p.pid for p in psutil.Process(runner.pid).children(recursive=True))]
    assert len(pids) == 2
    assert runner.stop(grace=1.0, save_timeout=60.0) is True
    state = runner.snapshot()
    assert state.message == f"stopped at step {state.progress['step']}, saved {result}"
    assert result.read_text() == ("SIGTERM" if groups else "request")
    assert not [p for p in pids if alive(p)]
    assert not (result.parent / ".train_requests").exists()  # taken by the trainer (none written with groups)

"""Issue 26 items 8 and 9 (the GUI side): a run outlives the GUI that started it (its output goes to its log file,
not through a pipe), a GUI started later takes it over (panel, Stop, Save now; Start refused), Stop leaves
`accelerate launch` alone so the run ends with the trainer's exit status, and Stop now says what it does."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import gui
from kohya_gui import REPO, run_requests
from kohya_gui.runner import Runner, RunnerBusy
from gui_helpers import alive, wait_for

# `accelerate launch`: starts the trainer, forwards no signal, ends with the trainer's exit status
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.Popen([sys.executable, *sys.argv[1:]]).wait())"
# prints a progress line every 0.2 s; SIGTERM or a "stop" request: saves and prints the trainer's stopped line;
# a "save" request: writes a step save
TRAINER = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[1]
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append("SIGTERM"))
    step = 0
    while not stop:
        step += 1
        print(f"steps: {step}/100000 loss=0.1", flush=True)
        req = os.path.join(out, ".train_requests")
        if os.path.exists(req):
            words = open(req).read().split()
            os.remove(req)
            if "save" in words:
                open(os.path.join(out, f"x-step{step}.safetensors"), "w").write("step save")
            if "stop" in words:
                stop.append("request")
        time.sleep(0.2)
    time.sleep(0.5)  # the save
    result = os.path.join(out, "x.safetensors")
    open(result, "w").write(stop[0])
    print(f"stopped at step {step}, saved {result}", flush=True)
""")

HARNESS = """
import sys, time
import gui
from kohya_gui.runner import Runner
runner = Runner()
gui.follow_runs(runner)
runner.start([[sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]]], sys.argv[4], output_dir=sys.argv[3])
while not runner.snapshot().progress:
    time.sleep(0.05)
print("RUN", runner.pid, flush=True)
time.sleep(600)
"""


def _tree(pid):
    return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]


def test_a_run_outlives_a_killed_gui_and_a_new_gui_takes_it_over(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "trainer.py").write_text(TRAINER)
    (tmp_path / "harness.py").write_text(HARNESS)
    log = out / "x.log"
    log.write_text("an earlier run's line\n")
    first_gui = subprocess.Popen([sys.executable, str(tmp_path / "harness.py"), LAUNCHER, str(tmp_path / "trainer.py"),
                                  str(out), str(log)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
    pids = []
    try:
        line = first_gui.stdout.readline()
        assert line.startswith("RUN "), line
        pids = _tree(int(line.split()[1]))
        assert len(pids) == 2  # the launcher and its trainer
        first_gui.send_signal(signal.SIGKILL)
        first_gui.wait(10)
        size = log.stat().st_size
        time.sleep(2.0)  # the old pipe: the trainer's next print to the dead GUI ended it here
        assert all(alive(p) for p in pids) and log.stat().st_size > size  # still training, into its log file

        runner = Runner()
        gui.follow_runs(runner)  # the restarted GUI
        s = runner.snapshot()
        assert s.running and s.output_dir == str(out) and s.log_path == str(log)
        assert wait_for(lambda: runner.snapshot().progress and runner.snapshot().progress["step"] > 5)
        assert "steps: 1/100000" in runner.log_tail(100000)  # this run's lines from its start ...
        assert "an earlier run's line" not in runner.log_tail(100000)  # ... not the earlier run's
        with pytest.raises(RunnerBusy):
            runner.start([[sys.executable, "-c", "print(1)"]], tmp_path / "other.log", output_dir=out)
        run_requests.send("save", str(out))  # Save now
        assert wait_for(lambda: list(out.glob("x-step*.safetensors")))
        assert runner.stop(grace=1.0, save_timeout=30) is True  # Stop: the request file (not our child)
        s = runner.snapshot()
        assert not s.running and s.stopped and s.message.startswith("stopped at step ")
        assert (out / "x.safetensors").exists()
        assert wait_for(lambda: not any(alive(p) for p in pids), 10)
        assert not (tmp_path / "cfg" / "kohya_gui" / "active_run.json").exists()
        again = Runner()
        gui.follow_runs(again)
        assert not again.running  # nothing to take over any more
    finally:
        first_gui.kill()
        for p in pids:
            if alive(p):
                psutil.Process(p).kill()


def test_a_note_of_an_ended_run_or_a_reused_pid_is_dropped(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    note = tmp_path / "kohya_gui" / "active_run.json"
    note.parent.mkdir()
    me = psutil.Process()
    note.write_text(json.dumps({"pid": me.pid, "create_time": me.create_time() - 100, "log_path": "x.log"}))
    runner = Runner()
    gui.follow_runs(runner)
    assert not runner.running and not note.exists()


def _training(tmp_path):
    """A runner with the LAUNCHER over the TRAINER, once its first step line has come."""
    (tmp_path / "trainer.py").write_text(TRAINER)
    out = tmp_path / "out"
    out.mkdir()
    runner = Runner()
    runner.start([[sys.executable, "-c", LAUNCHER, str(tmp_path / "trainer.py"), str(out)]], out / "x.log",
                 output_dir=out)
    assert wait_for(lambda: runner.snapshot().progress)
    return runner, out


def test_stop_ends_with_the_trainers_exit_status(tmp_path):
    """`accelerate launch` is not signalled: it waits for the trainer's save and exits 0 with it (a SIGTERM to
    the launcher gave -15, which `python -m kohya_gui train` turned into exit status 241)."""
    runner, out = _training(tmp_path)
    assert runner.stop(grace=1.0, save_timeout=30) is True
    s = runner.snapshot()
    assert s.returncode == 0 and s.message.startswith("stopped at step ")
    assert (out / "x.safetensors").read_text() == "SIGTERM"


def test_stop_now_says_it_saves_nothing(tmp_path):
    runner, out = _training(tmp_path)
    pids = _tree(runner.pid)
    started = time.time()
    assert runner.stop(grace=5.0, now=True) is True
    assert time.time() - started < 5 and not any(alive(p) for p in pids)
    text = (out / "x.log").read_text()
    assert "Stop now: ending the run's processes at once; nothing is saved" in text
    assert "stopped at step" not in text and not (out / "x.safetensors").exists()


def test_the_queue_entry_of_a_run_taken_over_stays_running_and_is_noted_when_it_ends(tmp_path):
    from kohya_gui import config_file, presets
    from kohya_gui.run_queue import QueueWorker, RunQueue
    from kohya_gui.runner import RunState

    cfg = config_file.load(presets.resolve("demo-sdxl-tiny"))
    q = RunQueue(tmp_path)
    entry = q.add(cfg.tab, cfg.family, dict(cfg.values, output_name="taken"))
    q.mark(entry.id, "running")

    class TakenOver:  # the runner after gui.follow_runs took the earlier GUI's run over
        state = RunState(running=True, started=5.0)

        def snapshot(self):
            return self.state

    runner = TakenOver()
    worker = QueueWorker(RunQueue(tmp_path), runner, poll_s=60)
    worker.queue.set_options(run=False, stop_on_failure=False)  # nothing new starts here
    worker.start()
    try:
        assert worker.queue.snapshot()[1][0].state == "running"
        runner.state = RunState(running=False, started=5.0, stopped=True, message="stopped at step 3, saved x")
        worker.step()
        assert worker.queue.snapshot()[1][0].state == "stopped"
    finally:
        worker.stop()

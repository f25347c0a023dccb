"""Every rank of a multi-process run in the GUI's run panel: the trainers' per-rank line
(library.run.events.RankProgress), the runner's rows of it (kohya_gui.runner.parse_rank, RunState.ranks: step, step
time, memory, and a rank that ends or goes silent, by name), the panel's table (ui.actions.ranks_html), and Stop on
a real 2-process gloo run: every rank stops after the save."""
from __future__ import annotations

import os
import sys
import textwrap
import time
import types
from pathlib import Path

import psutil
import pytest

from gui_helpers import alive, wait_for
from kohya_gui.runner import Runner, parse_rank, rank_status

REPO = Path(__file__).resolve().parent.parent


def test_rank_progress_line_every_rank_first_and_last_step_and_not_between():
    from library.run import events

    class Bar:
        def __init__(self):
            self.lines = []

        def write(self, text, file=None):
            self.lines.append(text)

    bar = Bar()
    accelerator = types.SimpleNamespace(process_index=1, num_processes=2)
    state = types.SimpleNamespace(accelerator=accelerator, at_epoch_end=False, global_step=1, max_train_steps=3,
                                  device=types.SimpleNamespace(type="cpu"),
                                  timer=types.SimpleNamespace(durations=[0.5]))
    event = events.RankProgress(bar)
    assert event.due(state)
    event.run(state)
    state.global_step, state.timer.durations = 2, [0.5, 0.25]
    event.run(state)  # within the interval: nothing
    state.global_step, state.timer.durations = 3, [0.5, 0.25, 0.75]
    event.run(state)  # the last step: always
    assert len(bar.lines) == 2, bar.lines
    first, last = (parse_rank(line) for line in bar.lines)
    assert (first["rank"], first["world"], first["pid"], first["step"], first["total"], first["step_s"]) == \
        (1, 2, os.getpid(), 1, 3, 0.5)
    assert (last["step"], last["step_s"]) == (3, 0.5)  # the mean of the steps since the last line
    if sys.platform != "win32":
        assert last["memory_kind"] == "RSS" and last["memory_gib"] > 0
    assert not event.due(types.SimpleNamespace(**{**vars(state), "accelerator": types.SimpleNamespace(
        process_index=0, num_processes=1)}))  # one process: its progress line says it all


# Two "ranks" (sleeping children) whose lines a launcher prints; rank 1 is killed, then the launcher reports it as
# torch's launcher does and fails.
FAKE_LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    for step in (1, 2):
        print(f"steps: {step}/10 loss=0.5000 it/s=4.00 avr_loss=0.5000 lr=1.00e-04 epoch=1/1 eta=0:00:02", flush=True)
        for rank, p in enumerate(ranks):
            print(f"rank {rank}/2 (pid {p.pid}): step {step}/10, 0.{rank + 2}50 s/step, peak GPU memory 1.{rank}0 GiB",
                  flush=True)
    ranks[1].kill()
    ranks[1].wait()
    open(sys.argv[1], "w").close()
    time.sleep(30)  # until the test has seen rank 1 end (it removes the file)
    print("2026-11-26 01:00:00 INFO library.data_parallel: process 0/2 finished 2 steps, last loss 0.5000, weights "
          "checksum 1.0e+00", flush=True)
    ranks[0].kill()
    print("Root Cause (first observed failure):\\n[0]:\\n  time      : 2026-11-26_01:00:00\\n  host      : localhost\\n"
          "  rank      : 1 (local_rank: 1)\\n  exitcode  : -9 (pid: 1)\\n  error_file: <N/A>", flush=True)
    sys.exit(1)
""")


def test_runner_shows_every_rank_and_names_the_one_that_ended(tmp_path):
    from kohya_gui.ui.actions import progress_html, ranks_html

    script, killed = tmp_path / "launcher.py", tmp_path / "killed"
    script.write_text(FAKE_LAUNCHER)
    runner = Runner()
    runner.start([[sys.executable, str(script), str(killed)]], tmp_path / "run.log")
    try:
        assert wait_for(lambda: killed.exists() and runner.snapshot().ranks.get(1, {}).get("ended"), 30)
        s = runner.snapshot()
        assert sorted(s.ranks) == [0, 1] and s.ranks[1]["ended"] == "ended" and not s.ranks[0].get("ended")
        assert rank_status(s.ranks[0], time.time(), True) == "training"
        assert (s.ranks[0]["step"], s.ranks[0]["step_s"], s.ranks[0]["memory_gib"]) == (2, 0.25, 1.0)
        assert (s.ranks[1]["step_s"], s.ranks[1]["memory_gib"]) == (0.35, 1.1)
        # rank lines are not the run's progress: rank 0's ordinary line is
        assert s.progress["step"] == 2 and s.progress["loss"] == 0.5
        html = progress_html(s)
        assert "<td>rank 0</td><td>2 / 10</td><td>0.250 s</td><td>1.00 GiB</td><td>training</td>" in html, html
        assert "<tr class='kg-rank-off'><td>rank 1</td>" in html and "<td>ended</td>" in html, html
        s.ranks[0]["seen"] -= 95  # a rank that stops printing while the run goes on
        assert rank_status(s.ranks[0], time.time(), True) == "silent for 01:35"
        assert "silent for" in ranks_html(s)
    finally:
        killed.unlink(missing_ok=True)
        runner.stop(now=True)
    s = runner.wait(30)
    assert not s.running


def test_runner_after_a_rank_failed_names_it_in_the_rows_and_the_message(tmp_path):
    script, killed = tmp_path / "launcher.py", tmp_path / "killed"
    script.write_text(FAKE_LAUNCHER.replace("time.sleep(30)", "time.sleep(1)"))
    runner = Runner()
    runner.start([[sys.executable, str(script), str(killed)]], tmp_path / "run.log")
    s = runner.wait(60)
    assert s.returncode == 1
    assert s.message.startswith("failed: process rank 1 (host localhost) ended first with exit code -9"), s.message
    assert s.ranks[1]["ended"] == "ended first (exit code -9)" and s.ranks[0]["ended"] == "finished 2 steps"


# ---- a real 2-process run (gloo) under the runner -----------------------------------------------------------


@pytest.mark.slow
def test_two_process_run_shows_both_ranks_and_stop_ends_both_after_the_save(tmp_path, tiny_sd1_single_file,
                                                                             tiny_dataset_dir):
    from test_fsdp import launch_command, launch_env

    out = tmp_path / "out"
    argv = launch_command(2, "train_network.py", [
        "--pretrained_model_name_or_path", tiny_sd1_single_file, "--tokenizer_cache_dir",
        tiny_sd1_single_file.parent / "tokenizers", "--train_data_dir", tiny_dataset_dir, "--caption_extension", ".txt",
        "--resolution", 64, "--output_dir", out, "--output_name", "lora", "--max_train_steps", 2000,
        "--max_data_loader_n_workers", 0, "--network_module", "networks.lora", "--network_dim", 4, "--seed", 3])
    runner = Runner()
    runner.start([argv], out / "run.log", cwd=REPO, env=launch_env(), output_dir=out)
    try:
        assert wait_for(lambda: len(runner.snapshot().ranks) == 2 or not runner.running, 300), runner.log_tail(40)
        s = runner.snapshot()
        assert {r: (i["world"], i["total"]) for r, i in s.ranks.items()} == {0: (2, 2000), 1: (2, 2000)}
        assert all(i["step"] >= 1 and i["step_s"] > 0 and i["memory_kind"] == "RSS" for i in s.ranks.values())
        assert wait_for(lambda: (runner.snapshot().progress or {}).get("total") == 2000, 60)  # rank 0's own line
        pids = [runner.pid, *(p.pid for p in psutil.Process(runner.pid).children(recursive=True))]
        assert len([p for p in pids if "train_network.py" in " ".join(psutil.Process(p).cmdline())]) >= 2
    finally:
        runner.stop(grace=60.0, save_timeout=240)  # (the processes take seconds to exit after the save)
    s = runner.wait(60)
    assert s.returncode == 0 and s.stopped, runner.log_tail(40)
    assert s.message.startswith("stopped at step ") and s.message.endswith(f"saved {out / 'lora.safetensors'}"), \
        s.message
    step = int(s.message.split()[3].rstrip(","))
    assert (out / "lora.safetensors").is_file()
    assert {r: i["ended"] for r, i in s.ranks.items()} == {0: f"finished {step} steps", 1: f"finished {step} steps"}
    assert not [p for p in pids if alive(p)]

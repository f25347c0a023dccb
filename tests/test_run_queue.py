"""The queue of runs (issue 14 item 4): entries are saved TOMLs run one after another, kept on disk (a GUI restart
shows them and goes on), reordered and removed; a failed run does not stop the queue unless asked."""
from __future__ import annotations

import sys
import time

import pytest

from kohya_gui import config_file, presets
from kohya_gui.run_queue import QueueError, QueueWorker, RunQueue
from kohya_gui.runner import Runner


def demo_values(name: str, steps: int = 1) -> tuple[str, str, dict]:
    cfg = config_file.load(presets.resolve("demo-sdxl-tiny"))
    values = dict(cfg.values, output_name=name, max_train_steps=steps, sample_prompts="", sample_every_n_steps=None)
    return cfg.tab, cfg.family, values


def test_entries_keep_order_and_state_on_disk(tmp_path):
    q = RunQueue(tmp_path)
    a, b, c = (q.add(*demo_values(n)) for n in ("a", "b", "c"))
    assert config_file.load(a.config).values["output_name"] == "a"  # each entry is an ordinary settings file
    q.move(c.id, -1)
    q.move(a.id, +5)  # past the end: last
    q.set_options(run=True, stop_on_failure=True)
    again = RunQueue(tmp_path)  # what a restarted GUI reads
    assert [e.name for e in again.snapshot()[1]] == ["c", "b", "a"] and again.stop_on_failure
    again.mark(b.id, "running")
    again.recover()
    assert again.snapshot()[1][1].state == "interrupted"
    assert again.next_queued().name == "c"
    again.mark(c.id, "failed", "exit status 1")
    assert again.next_queued() is None  # stop on failure
    again.set_options(run=True, stop_on_failure=False)
    assert again.next_queued().name == "a"
    again.set_options(run=False, stop_on_failure=False)
    assert again.next_queued() is None  # paused
    again.remove(a.id)
    assert not (tmp_path / f"{a.id}.toml").exists()
    again.mark(c.id, "running")
    with pytest.raises(QueueError, match="is running: stop it first"):
        again.remove(c.id)
    with pytest.raises(QueueError, match="not in the queue"):
        again.move("nope", 1)


def test_settings_that_cannot_run_are_not_queued(tmp_path):
    tab, family, values = demo_values("x")
    values["output_dir"] = ""
    with pytest.raises(QueueError, match=r"Output folder \(output_dir\) is required"):
        RunQueue(tmp_path).add(tab, family, values)
    assert RunQueue(tmp_path).snapshot()[1] == []


def test_a_failed_run_is_noted_and_the_queue_goes_on(tmp_path):
    q = RunQueue(tmp_path)
    first, second = q.add(*demo_values("first")), q.add(*demo_values("second"))
    started = []

    def fake_start(runner, tab, family, values):  # the real one checks and writes files; here: a short process
        started.append(values["output_name"])
        code = "raise SystemExit(3)" if values["output_name"] == "first" else "pass"
        runner.start([[sys.executable, "-c", code]], tmp_path / f"{values['output_name']}.log")

    runner = Runner()
    worker = QueueWorker(q, runner, start=fake_start)
    for _ in range(200):
        worker.step()
        if q.snapshot()[1][1].state == "finished":
            break
        time.sleep(0.05)
    states = [(e.name, e.state) for e in q.snapshot()[1]]
    assert started == ["first", "second"] and states == [("first", "failed"), ("second", "finished")]
    assert "exit status 3" in q.snapshot()[1][0].message


@pytest.mark.slow
def test_two_demo_runs_in_order_across_a_gui_restart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo writes cache/ and outputs/ here
    q = RunQueue(tmp_path / "queue")
    for name in ("first", "second"):
        q.add(*demo_values(name))
    runner = Runner()
    worker = QueueWorker(q, runner, poll_s=0.2).start()
    try:
        deadline = time.time() + 300
        while q.snapshot()[1][0].state == "queued" and time.time() < deadline:
            time.sleep(0.1)
        q.set_options(run=False, stop_on_failure=False)  # hold the queue while the first runs
        while q.snapshot()[1][0].state == "running" and time.time() < deadline:
            time.sleep(0.2)
    finally:
        worker.stop()  # then the GUI closes
    first, second = RunQueue(tmp_path / "queue").snapshot()[1]
    assert (first.state, second.state) == ("finished", "queued"), first.message
    assert (tmp_path / "outputs/demo-sdxl-tiny/first.safetensors").is_file()
    again = RunQueue(tmp_path / "queue")  # a new GUI shows the queue; the user lets it run again
    again.set_options(run=True, stop_on_failure=False)
    worker = QueueWorker(again, Runner(), poll_s=0.2).start()
    try:
        deadline = time.time() + 300
        while again.snapshot()[1][1].state in ("queued", "running") and time.time() < deadline:
            time.sleep(0.2)
    finally:
        worker.stop()
    assert [e.state for e in again.snapshot()[1]] == ["finished", "finished"]
    assert (tmp_path / "outputs/demo-sdxl-tiny/second.safetensors").is_file()

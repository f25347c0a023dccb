"""Of two simultaneous Starts (two tabs, two clients) one runs with exactly its own settings and the other is
refused without touching any file (issue 14: the run TOML used to be written before the busy check)."""
from __future__ import annotations

import threading
import time

import pytest

from kohya_gui import config_file, training, trainer_check
from kohya_gui import params as P
from kohya_gui.runner import Runner, RunnerBusy


def test_two_simultaneous_starts_ten_times(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_check, "problems", lambda *a: [])  # the trainer's check: its own tests
    slow_save = config_file.save

    def save(*a, **k):  # widen the window between the checks and the start
        time.sleep(0.05)
        return slow_save(*a, **k)

    monkeypatch.setattr(config_file, "save", save)

    def fake_run(self, commands, log_path, cwd, env):  # no training process: the run ends at once
        time.sleep(0.05)
        with self._lock:
            self.state.running = False
            self.state.returncode = 0

    monkeypatch.setattr(Runner, "_run", fake_run)
    runner = Runner()
    for i in range(10):
        values = {name: dict(P.defaults("lora"), pretrained_model_name_or_path="m.safetensors",
                             train_data_dir="data", output_dir=str(tmp_path / f"{i}-{name}"), output_name=name,
                             learning_rate=lr)
                  for name, lr in (("a", 1e-4), ("b", 5e-4))}
        barrier, outcome = threading.Barrier(2), {}

        def click(name):
            barrier.wait()
            try:
                training.start(runner, "lora", "SDXL", values[name])
                outcome[name] = "started"
            except RunnerBusy:
                outcome[name] = "refused"

        threads = [threading.Thread(target=click, args=(n,)) for n in values]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcome.values()) == ["refused", "started"], outcome
        started = next(n for n, o in outcome.items() if o == "started")
        refused = next(n for n, o in outcome.items() if o == "refused")
        assert not (tmp_path / f"{i}-{refused}").exists()  # the refused click touched no file
        run = config_file.load(runner.snapshot().config_path)
        assert run.values["output_name"] == started and run.values["learning_rate"] == values[started][
            "learning_rate"]
        runner.wait(timeout=10)

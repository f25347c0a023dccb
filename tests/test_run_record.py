"""Issue 26 item 4: Save configuration never replaces a run's TOML (the record of what that run trains), also
while its trainer is still starting and has not read it yet."""
from __future__ import annotations

from gui_helpers import ui_values

from kohya_gui import config_file, training, trainer_check
from kohya_gui import params as P
from kohya_gui.runner import Runner
from kohya_gui.ui import actions as A


def test_save_never_replaces_a_runs_toml(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_check, "problems", lambda *a: [])  # the trainer's check: its own tests
    monkeypatch.setattr(Runner, "start", lambda self, *a, **k: None)  # the trainer has not read its TOML yet
    values = {**P.defaults("lora"), "pretrained_model_name_or_path": "m.safetensors", "train_data_dir": "data",
              "output_dir": str(tmp_path / "out"), "output_name": "run", "max_train_steps": 12, "learning_rate": 1e-3}
    training.start(Runner(), "lora", "SDXL", values)
    record = tmp_path / "out" / "run.toml"
    before = record.read_bytes()
    assert config_file.is_run_record(record)

    changed = {**values, "max_train_steps": 99, "learning_rate": 0.5}
    msg = A.save_config("lora", str(record), "SDXL", *ui_values("lora", changed))
    assert "Not saved" in msg and "record of a training run" in msg and "another name" in msg
    assert record.read_bytes() == before
    run = config_file.load(record)  # what the trainer reads: Start's values
    assert run.values["max_train_steps"] == 12 and run.values["learning_rate"] == 1e-3

    other = tmp_path / "mine.toml"
    assert "Saved" in A.save_config("lora", str(other), "SDXL", *ui_values("lora", changed))
    assert not config_file.is_run_record(other)  # a saved configuration is an ordinary file
    assert "Saved" in A.save_config("lora", str(other), "SDXL", *ui_values("lora", values))  # and stays one

    # a new Start (Overwrite existing result) writes its own record
    training.start(Runner(), "lora", "SDXL", {**changed, "overwrite_output": True})
    assert config_file.load(record).values["max_train_steps"] == 99

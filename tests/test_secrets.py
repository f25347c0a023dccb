"""Issue 26 item 10: tokens and API keys never reach a file or a printed command; the run gets them in its
environment (HF_TOKEN, WANDB_API_KEY), which huggingface_hub and wandb read by themselves."""
from __future__ import annotations

import pytest

from kohya_gui import __main__ as cli, command, config_file, last_settings, secret_options, training, trainer_check
from kohya_gui import params as P
from kohya_gui.runner import Runner

HF, WANDB = "hf_TOPSECRET_1234", "wandb_TOPSECRET_5678"


def _values(tmp_path, **extra):
    return {**P.defaults("lora"), "pretrained_model_name_or_path": "m.safetensors", "train_data_dir": "data",
            "output_dir": str(tmp_path / "out"), "output_name": "run", "huggingface_token": HF,
            "wandb_api_key": WANDB, "log_with": "wandb", **extra}


def _no_secret_in(text: str) -> bool:
    return HF not in text and WANDB not in text


def test_secrets_are_in_no_file_and_no_command_but_in_the_runs_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setattr(trainer_check, "problems", lambda *a: [])  # the trainer's check: its own tests
    values = _values(tmp_path)
    assert _no_secret_in(config_file.to_toml("lora", "SDXL", values))
    saved = config_file.save(tmp_path / "saved.toml", "lora", "SDXL", values)
    assert _no_secret_in(saved.read_text())
    assert last_settings.save("lora", "SDXL", values, str(saved))
    assert _no_secret_in(last_settings.path("lora").read_text())
    for argv in (command.build_argv("lora", "SDXL", values), command.standalone_argv("lora", "SDXL", values)):
        assert _no_secret_in(command.printable(argv))
    assert "--log_with" in command.standalone_argv("lora", "SDXL", values)  # the rest is all there

    started = {}
    monkeypatch.setattr(Runner, "start", lambda self, commands, log_path, **kw: started.update(kw, commands=commands))
    argv = training.start(Runner(), "lora", "SDXL", values)
    assert _no_secret_in(" ".join(argv) + " ".join(map(" ".join, started["commands"])))
    assert started["env"]["HF_TOKEN"] == HF and started["env"]["WANDB_API_KEY"] == WANDB
    out = tmp_path / "out"
    for f in out.iterdir():
        assert _no_secret_in(f.read_text()), f
    assert {"run.toml", "run.command.txt"} <= {f.name for f in out.iterdir()}
    assert "HF_TOKEN" in secret_options.note(values) and secret_options.note(P.defaults("lora")) == ""


def test_a_secret_flag_in_additional_parameters_is_refused(tmp_path):
    values = _values(tmp_path, additional_parameters=f"--huggingface_token={HF} --max_train_steps 3")
    errors = command.validation_errors("lora", "SDXL", values)
    assert any("--huggingface_token would be written" in e and "$HF_TOKEN" in e for e in errors), errors


def test_a_config_with_a_token_prints_none(tmp_path, capsys):
    path = tmp_path / "mine.toml"
    text = config_file.to_toml("lora", "SDXL", _values(tmp_path))
    assert "[huggingface]" not in text
    path.write_text(text.rstrip() + f'\n\n[huggingface]\nhuggingface_token = "{HF}"\n')
    assert config_file.load(path).values["huggingface_token"] == HF  # read (the run gets it) ...
    for flags in ([], ["--standalone"]):
        assert cli.main(["print-command", *flags, str(path)]) == 0
        assert _no_secret_in(capsys.readouterr().out)  # ... never printed


@pytest.mark.parametrize("name", sorted(secret_options.SECRET_OPTIONS))
def test_every_secret_option_is_a_trainer_option(name):
    assert name in P.BY_NAME  # a renamed option would silently be written again

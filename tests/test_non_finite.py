"""Issue 26 item 7: NaN / inf option values refused with one line; an output folder that cannot be written, and a
--resume of a state with another network, are one line before training; a loss that becomes NaN / inf stops the
run at once without saving it (the earlier saves stay, all finite)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from lora_checks import read_lora
from test_sdxl_lora_training import base_argv

REPO = Path(__file__).resolve().parent.parent


def _parser(script):
    sys.path.insert(0, str(REPO / "sd-scripts"))
    return __import__(script).setup_parser()


@pytest.mark.parametrize("flags", [["--guidance_scale", "nan"], ["--learning_rate", "inf"],
                                   ["--guidance_scale=-inf", "--learning_rate", "nan"]])
def test_non_finite_options_are_refused(flags):
    from library import train_util

    with pytest.raises(train_util.ConfigError) as e:
        train_util.parse_args(_parser("flux_train"), flags)
    message = str(e.value)
    assert len(message.splitlines()) == 1 and "must be a finite number" in message
    for flag in flags:
        if flag.startswith("--"):
            assert flag.split("=")[0] in message


def test_non_finite_values_in_a_config_file_are_refused(tmp_path):
    from library import train_util

    cfg = tmp_path / "c.toml"
    cfg.write_text("guidance_scale = nan\nnoise_offset = -0.1\n")
    with pytest.raises(train_util.ConfigError, match=r"--guidance_scale nan: must be a finite number"):
        train_util.parse_args(_parser("flux_train"), ["--config_file", str(cfg)])
    cfg.write_text("noise_offset = -0.1\nnetwork_alpha = -4\n")  # negative values: accepted, as upstream does
    args = train_util.parse_args(_parser("flux_train_network"), ["--config_file", str(cfg)])
    assert args.noise_offset == -0.1 and args.network_alpha == -4


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path):
    from library import train_util

    with pytest.raises(train_util.ConfigError) as e:
        train_util.check_outputs_free("/proc/kohya/out", "x", ".safetensors", False, False)
    assert str(e.value).startswith("--output_dir /proc/kohya/out: cannot write files in /proc")
    (tmp_path / "file").write_text("x")
    with pytest.raises(train_util.ConfigError, match="is a file, not a folder"):
        train_util.check_outputs_free(str(tmp_path / "file" / "out"), "x", ".safetensors", False, False)
    train_util.check_outputs_free(str(tmp_path / "new" / "out"), "x", ".safetensors", False, False)
    assert not (tmp_path / "new").exists()  # checked, not made


def test_a_resume_into_another_network_shape_is_one_line():
    from library import state_folders
    from library.network_trainer import TrainingError

    class Accelerator:
        def load_state(self, folder):  # what accelerate raises: the model's load_state_dict
            torch.nn.Linear(320, 8).load_state_dict(torch.nn.Linear(320, 4).state_dict())

    with pytest.raises(TrainingError) as e:
        state_folders.load_state(Accelerator(), "out/x-state")
    message = str(e.value)
    assert len(message.splitlines()) == 1 and message.startswith("--resume out/x-state: the state was saved by a run")
    assert "size mismatch for weight" in message


def test_a_finite_loss_passes_and_a_nan_stops_naming_the_last_save(tmp_path):
    import argparse

    from library import finite_guard

    args = argparse.Namespace(output_dir=str(tmp_path), output_name="x")
    finite_guard.check_losses(args, 1, [0.5, 0.25])
    (tmp_path / "x-step00000002.safetensors").write_bytes(b"x")
    with pytest.raises(finite_guard.NonFiniteLoss) as e:
        finite_guard.check_losses(args, 3, [0.5, float("nan")])
    assert e.value.exit_code == 2 and "the loss became nan at step 3" in str(e.value)
    assert str(e.value).endswith(f"the last save is {tmp_path / 'x-step00000002.safetensors'}")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_run_whose_loss_becomes_nan_stops_without_saving_it(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    import sdxl_train_network
    from library import network_trainer

    out = tmp_path / "out"
    argv = base_argv(tiny_sdxl_single_file, out, tiny_dataset_dir, "blowup", steps=30,
                     extra=["--network_train_unet_only", "--save_every_n_steps", "1", "--optimizer_type", "SGD"])
    argv[argv.index("--learning_rate") + 1] = "1e30"
    trainer = sdxl_train_network.trainer()
    with pytest.raises(SystemExit) as e:
        network_trainer.run(trainer, sdxl_train_network.setup_parser(), argv)
    message = str(e.value.__cause__)
    assert e.value.code == 2 and message.startswith("the loss became")
    assert not (out / "blowup.safetensors").exists()  # no final save of NaN weights
    saves = sorted(out.glob("blowup-step*.safetensors"))
    for path in saves:  # every save kept holds finite weights
        sd, _ = read_lora(path)
        assert all(torch.isfinite(t).all() for t in sd.values()), path
    assert saves and message.endswith(f"the last save is {saves[-1]}")


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_resume_with_another_network_dim_exits_2_with_one_line(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    import sdxl_train_network
    from library import network_trainer

    out = tmp_path / "out"
    network_trainer.run(sdxl_train_network.trainer(), sdxl_train_network.setup_parser(),
                        base_argv(tiny_sdxl_single_file, out, tiny_dataset_dir, "first", steps=1,
                                  extra=["--network_train_unet_only", "--save_state"]))
    argv = base_argv(tiny_sdxl_single_file, out, tiny_dataset_dir, "second", steps=2,
                     extra=["--network_train_unet_only", "--resume", str(out / "first-state")])
    argv[argv.index("--network_dim") + 1] = "8"
    with pytest.raises(SystemExit) as e:
        network_trainer.run(sdxl_train_network.trainer(), sdxl_train_network.setup_parser(), argv)
    assert e.value.code == 2
    cause = e.value.__cause__
    assert cause is not None and "the state was saved by a run with another network" in str(cause)
    assert len(str(cause).splitlines()) == 1

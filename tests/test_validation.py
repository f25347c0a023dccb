"""library.validation: the split (CLI and dataset TOML), the fixed timesteps, the cadence, the progress line,
and one tiny end-to-end LoRA run whose validation loss reaches TensorBoard and the progress line (its model is an
SD2 diffusers folder whose scheduler says v_prediction: the metadata must say so too)."""
from __future__ import annotations

import argparse
import logging
import re

import pytest
import train_network

from library import config_util, train_util, validation
from library.datasets import DatasetError
from library.network_trainer import setup_parser

pytestmark = pytest.mark.usefixtures("one_thread")


def test_split_is_disjoint_seeded_and_rounded():
    items = [object() for _ in range(10)]
    train, val = validation.split_images(items, 0.25, 3)
    assert len(val) == round(10 * 0.25) and len(train) == 8
    assert {id(x) for x in train}.isdisjoint(id(x) for x in val) and len(train) + len(val) == 10
    assert [id(x) for x in train] == [id(x) for x in items if x not in val]  # training order kept
    again = validation.split_images(items, 0.25, 3)[1]
    assert [id(x) for x in again] == [id(x) for x in val]  # same seed, same images
    assert any([id(x) for x in validation.split_images(items, 0.25, s)[1]] != [id(x) for x in val]
               for s in range(4, 10))
    assert validation.split_images(items, 0.0, 3) == (items, [])


def _args(**kw):
    args = setup_parser().parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_split_from_cli_and_dataset_config(tiny_dataset_dir, tmp_path):
    group, val = config_util.build_dataset_groups(_args(train_data_dir=str(tiny_dataset_dir), resolution="64",
                                                        validation_split=0.25, seed=1), "sd1")
    assert group.num_train_images == 3 * 2 and val.num_train_images == 1 * 2  # 4 images x 2 repeats
    held = {info.path for _, info in val.all_images()}
    assert held.isdisjoint(info.path for _, info in group.all_images())
    assert config_util.build_dataset_groups(_args(train_data_dir=str(tiny_dataset_dir), resolution="64"),
                                            "sd1")[1] is None

    reg = tmp_path / "reg"
    (reg / "1_reg").mkdir(parents=True)
    for p in (tiny_dataset_dir / "2_demo").glob("img_*.png"):
        (reg / "1_reg" / p.name).write_bytes(p.read_bytes())
    cfg = tmp_path / "ds.toml"
    cfg.write_text(f"""[general]
resolution = 64
validation_seed = 5
[[datasets]]
validation_split = 0.5
[[datasets.subsets]]
image_dir = "{(tiny_dataset_dir / '2_demo').as_posix()}"
num_repeats = 1
[[datasets.subsets]]
image_dir = "{(reg / '1_reg').as_posix()}"
is_reg = true
""")
    group, val = config_util.build_dataset_groups(_args(dataset_config=str(cfg)), "sd1")
    assert val.num_train_images == 2 and val.num_reg_images == 0  # reg images are never validated
    assert group.num_train_images == 2 and group.num_reg_images == 2  # reg balanced to the remaining 2
    cfg.write_text(cfg.read_text().replace("validation_split = 0.5", "validation_split = 1.5"))
    with pytest.raises(DatasetError, match="validation_split"):
        config_util.build_dataset_groups(_args(dataset_config=str(cfg)), "sd1")
    cfg.write_text(cfg.read_text().replace("num_repeats = 1", "num_repeats = 1\nvalidation_split = 0.1"))
    with pytest.raises(DatasetError, match="'validation_split' in .* is a dataset setting"):
        config_util.build_dataset_groups(_args(dataset_config=str(cfg)), "sd1")


def test_fixed_timesteps_and_cadence():
    assert validation.validation_timesteps(argparse.Namespace(min_timestep=None, max_timestep=None)) == \
        [200, 400, 600, 800]
    assert validation.validation_timesteps(argparse.Namespace(min_timestep=100, max_timestep=500)) == \
        [180, 260, 340, 420]
    v = validation.Validator(_args(validate_every_n_steps=3, validate_every_n_epochs=2), [0] * 5, seed=1)
    assert v.max_batches == 5 and v.seed == 1
    assert [s for s in range(1, 10) if v.due_after_step(s)] == [3, 6, 9]
    assert [e for e in range(1, 6) if v.due_after_epoch(e)] == [2, 4]
    v = validation.Validator(_args(max_validation_steps=2, validation_seed=9), [0] * 5, seed=1)
    assert v.max_batches == 2 and v.seed == 9 and not v.due_after_step(3) and v.due_after_epoch(1)


@pytest.mark.parametrize("flag, value", [("--validation_split", "1.0"), ("--validate_every_n_steps", "0"),
                                         ("--max_validation_steps", "-1")])
def test_bad_validation_options_named(tiny_dataset_dir, tmp_path, capsys, flag, value):
    import train_network
    from library.network_trainer import run

    with pytest.raises(SystemExit) as e:
        run(train_network.trainer(), train_network.setup_parser(),
            ["--pretrained_model_name_or_path", "none.safetensors", "--train_data_dir", str(tiny_dataset_dir),
             "--output_dir", str(tmp_path), "--network_module", "networks.lora", flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_progress_line_with_val_loss_still_parses():
    from kohya_gui.runner import parse_progress

    text = train_util.ProgressLine(10, 1).format(3, 0.5, 0.25, 1e-4, 1, val_loss=0.125)
    assert "avr_loss=0.2500 val_loss=0.1250 lr=" in text
    assert parse_progress(text)["loss"] == 0.25 and parse_progress(text)["step"] == 3


def test_validation_loss_logged_end_to_end(tmp_path_factory, tmp_path, tiny_dataset_dir, capsys, caplog):
    import train_network
    from safetensors import safe_open
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from library.network_trainer import run
    from library.tiny_models import make_tiny_sd

    model = make_tiny_sd(tmp_path_factory.mktemp("tiny_sd2_diffusers"), "sd2", "diffusers")
    caplog.set_level(logging.INFO)
    trainer = train_network.trainer()
    path = run(trainer, train_network.setup_parser(), [
        "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(tiny_dataset_dir),
        "--output_dir", str(tmp_path), "--output_name", "val", "--network_module", "networks.lora",
        "--network_dim", "4", "--resolution", "64", "--learning_rate", "1e-3", "--max_train_steps", "2",
        "--max_data_loader_n_workers", "0", "--seed", "3", "--v2", "--network_train_unet_only",
        "--validation_split", "0.25", "--validate_every_n_steps", "1", "--max_validation_steps", "1",
        "--logging_dir", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("steps: 2/2")]
    assert lines and re.search(r"avr_loss=\d+\.\d{4} val_loss=\d+\.\d{4} lr=", lines[-1]), out
    assert "validation after step 1: val_loss=" in caplog.text and "validation after epoch 1: val_loss=" in caplog.text
    assert "held out" in caplog.text

    events = EventAccumulator(str(next((tmp_path / "logs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    step_avg = events.Scalars("loss/validation/step_average")
    assert [e.step for e in step_avg] == [1, 2] and all(e.value > 0 for e in step_avg)
    assert [e.step for e in events.Scalars("loss/validation/epoch_average")] == [1]
    assert "loss/validation/step_divergence" in events.Tags()["scalars"]

    with safe_open(path, "pt") as f:
        md = f.metadata()
    assert md["ss_num_validation_images"] == "2" and md["ss_validation_split"] == "0.25"
    assert md["ss_num_train_images"] == "6"
    # the model's scheduler config says v_prediction: it trained as v, and the metadata says so
    assert md["ss_base_model_version"] == "sd_v2_v"


def test_validator_run_is_isolated_from_training():
    """No gradients, eval mode, seeded noise (the same every pass); the training RNGs and modes come back."""
    import random

    import torch

    class Acc:
        device = torch.device("cpu")
        num_processes = 1

    class Trainer:
        noise_generator = torch.Generator().manual_seed(123)

    net = torch.nn.Linear(2, 2)
    net.train()
    seen = []

    def loss_fn(batch, t):
        assert not torch.is_grad_enabled() and not net.training
        seen.append(t)
        return torch.randn((), generator=trainer.noise_generator) ** 2 + torch.rand(()) + random.random()

    trainer = Trainer()
    train_gen = trainer.noise_generator
    v = validation.Validator(_args(validation_seed=4), ["a", "b", "c"], seed=0)
    torch.manual_seed(99)
    random.seed(99)
    first = v.run(loss_fn, [net], trainer, Acc)
    after = (torch.rand(()).item(), random.random())
    torch.manual_seed(99)
    random.seed(99)
    assert (torch.rand(()).item(), random.random()) == after  # global RNG streams untouched
    assert v.run(loss_fn, [net], trainer, Acc) == first == v.last_loss  # same noise every pass
    assert seen == [200, 400, 600, 800] * 6 and net.training and trainer.noise_generator is train_gen

"""train_util: --config_file (flat / sectioned, CLI wins, GUI tables skipped, named errors), --output_config,
atomic saving, hashes, the progress line, steps/epochs."""
from __future__ import annotations

import hashlib
import re

import pytest
import torch

from library import train_util
from library.train_util import ConfigError, OutputExistsError


@pytest.fixture(scope="module")
def parser():
    import sdxl_train_network

    return sdxl_train_network.setup_parser()


def test_every_script_has_setup_parser():
    import sdxl_train_network
    import train_network

    sd = {a.dest for a in train_network.setup_parser()._actions}
    sdxl = {a.dest for a in sdxl_train_network.setup_parser()._actions}
    assert {"v2", "v_parameterization", "network_dim", "optimizer_type", "config_file", "cache_latents"} <= sd
    # compile flags belong to the SDXL (and FLUX) scripts only
    assert "compile" in sdxl and "compile_backend" in sdxl and "compile" not in sd


def test_config_flat_and_sectioned_merge_order(tmp_path, parser):
    flat = tmp_path / "flat.toml"
    flat.write_text('network_dim = 16\nlearning_rate = 0.0005\ncompile = true\noptimizer_args = ["weight_decay=0.1"]\n'
                    'output_dir = "out"\n')
    args = train_util.parse_args(parser, ["--config_file", str(flat), "--network_dim", "8"])
    assert args.network_dim == 8  # command line wins
    assert args.learning_rate == 0.0005 and args.compile is True and args.optimizer_args == ["weight_decay=0.1"]
    assert args.network_alpha == 1  # parser default where neither sets it

    sectioned = tmp_path / "sectioned.toml"
    sectioned.write_text('[accelerate]\nnum_processes = 2\nmixed_precision = "bf16"\n[gui]\ntab = "lora"\n'
                         '[model]\npretrained_model_name_or_path = "m.safetensors"\n'
                         '[training]\nmax_train_steps = 7\nlearning_rate = 1\n[training.compile]\ncompile_mode = "reduce-overhead"\n')
    args = train_util.parse_args(parser, ["--config_file", str(sectioned)])
    assert args.pretrained_model_name_or_path == "m.safetensors" and args.max_train_steps == 7
    assert args.learning_rate == 1.0 and isinstance(args.learning_rate, float)
    assert args.compile_mode == "reduce-overhead"
    assert args.mixed_precision == "no"  # [accelerate] is the launcher's, not the trainer's
    # kohya accepts the file name without .toml
    args = train_util.parse_args(parser, ["--config_file", str(sectioned)[:-5]])
    assert args.max_train_steps == 7


@pytest.mark.parametrize("text, match", [
    ("netwrk_dim = 4\n", r"unknown key 'netwrk_dim' \(did you mean 'network_dim'\?\)"),
    ("[training]\ncompile_mod = 'default'\n", r"unknown key 'compile_mod' \(did you mean 'compile_mode'\?\)"),
    ("network_dim = 'four'\n", r"network_dim = 'four' must be an integer"),
    ("compile = 2\n", r"compile = 2 must be true or false"),  # 0/1 are read as false/true (kohya_ss GUI)
    ("mixed_precision = 'fp8'\n", r"mixed_precision = 'fp8' is not allowed; allowed values: no, fp16, bf16"),
    ("learning_rate = [1, 2]\n", r"learning_rate = \[1, 2\] must be a single value"),
    ("[a]\nseed = 1\n[b]\nseed = 2\n", r"key 'seed' is set twice"),
    ("config_file = 'x.toml'\n", r"'config_file' cannot be set inside a config file"),
    ("seed = \n", r"not valid TOML"),
])
def test_config_errors_name_the_key(tmp_path, parser, text, match):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        train_util.parse_args(parser, ["--config_file", str(cfg)])
    assert str(cfg) in str(e.value)


def test_config_file_missing(parser, tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        train_util.parse_args(parser, ["--config_file", str(tmp_path / "nope.toml")])


def test_output_config_and_run_config_round_trip(tmp_path, parser):
    target = tmp_path / "saved.toml"
    args = train_util.parse_args(parser, ["--config_file", str(target), "--output_config", "--network_dim", "12",
                                          "--optimizer_args", "betas=0.9,0.99", "--compile", "--output_dir", "o"])
    assert train_util.write_output_config(args) == str(target)
    back = train_util.parse_args(parser, ["--config_file", str(target)])
    for key, value in vars(args).items():
        if key not in ("config_file", "output_config"):
            assert getattr(back, key) == value, key
    with pytest.raises(OutputExistsError):  # never over an existing file
        train_util.write_output_config(args)


def test_train_length():
    import argparse

    args = argparse.Namespace(gradient_accumulation_steps=2, max_train_steps=7, max_train_epochs=None)
    assert train_util.resolve_train_length(args, 5) == (3, 7, 3)
    args.max_train_epochs = 4
    assert train_util.resolve_train_length(args, 5) == (3, 12, 4)


def test_atomic_save_and_hashes(tmp_path):
    tensors = {"a.lora_down.weight": torch.randn(4, 8), "a.alpha": torch.tensor(2.0)}
    md = {"ss_network_dim": "4", "other": "not hashed"}
    model_hash, legacy = train_util.model_hashes(tensors, md)
    path = tmp_path / "x.safetensors"
    train_util.save_safetensors_atomic(tensors, path, {k: v for k, v in md.items() if k.startswith("ss_")})
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    assert model_hash == hashlib.sha256(blob[8 + n:]).hexdigest()
    assert legacy == hashlib.sha256(blob[0x100000:0x110000]).hexdigest()[:8]
    # non-ss_ metadata does not change the hash
    assert train_util.model_hashes(tensors, {"ss_network_dim": "4"})[0] == model_hash
    with pytest.raises(OutputExistsError, match="--overwrite_output"):
        train_util.save_safetensors_atomic(tensors, path)
    train_util.save_safetensors_atomic({"b": torch.zeros(1)}, path, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temp file left


def test_output_names():
    assert train_util.epoch_file_name("lora", 1, ".safetensors") == "lora-000001.safetensors"
    assert train_util.step_file_name("lora", 10, ".safetensors") == "lora-step00000010.safetensors"
    assert train_util.state_dir_name("lora", step=10) == "lora-step00000010-state"
    assert train_util.state_dir_name("lora", epoch=2) == "lora-000002-state"
    assert train_util.state_dir_name("lora") == "lora-state"


def test_progress_line_format():
    line = train_util.ProgressLine(max_steps=100, num_epochs=5)
    text = line.format(12, 0.1234, 0.13, 1e-4, 1)
    assert re.fullmatch(r"steps: 12/100 loss=0\.1234 it/s=\d+\.\d\d avr_loss=0\.1300 lr=1\.00e-04 epoch=1/5 "
                        r"eta=(\d\d:\d\d:\d\d|\?)", text), text
    assert line.should_print(1) and line.should_print(100)

"""Upstream's defaults and types for options we share, and the behaviour that follows from them."""
from __future__ import annotations

import argparse

import pytest
import train_network

from library import network_trainer, train_util


def _lora_parser(script: str):
    import importlib

    return importlib.import_module(script).setup_parser()


@pytest.mark.parametrize("script", ["train_network", "sdxl_train_network", "flux_train_network"])
def test_lora_scripts_take_upstreams_defaults(script):
    args = _lora_parser(script).parse_args([])
    assert args.learning_rate == 2e-6  # upstream's default (we used 1e-4 before)
    assert args.text_encoder_lr is None
    if script == "flux_train_network":
        assert args.blocks_to_swap is None


def test_text_encoder_lr_is_a_list_one_value_for_all_text_encoders(tmp_path):
    parser = _lora_parser("sdxl_train_network")
    assert parser.parse_args(["--text_encoder_lr", "1e-5", "2e-5"]).text_encoder_lr == [1e-5, 2e-5]
    cfg = tmp_path / "c.toml"
    cfg.write_text("text_encoder_lr = 5e-5\n")  # the GUI (and old upstream configs) write one number
    args = train_util.parse_args(parser, ["--config_file", str(cfg)])
    assert args.text_encoder_lr == [5e-5]
    cfg.write_text("text_encoder_lr = [5e-5, 1e-5]\n")  # the kohya_ss GUI writes a list
    args = train_util.parse_args(parser, ["--config_file", str(cfg)])
    assert args.text_encoder_lr == [5e-5, 1e-5]
    # a network with one text-encoder learning rate (networks.lora) takes the first value, as upstream
    assert network_trainer.text_encoder_lr(args) == 5e-5
    assert network_trainer.text_encoder_lr(argparse.Namespace(text_encoder_lr=[])) is None
    assert network_trainer.text_encoder_lr(argparse.Namespace(text_encoder_lr=None)) is None
    assert network_trainer.text_encoder_lr(argparse.Namespace(text_encoder_lr=3e-5)) == 3e-5


# -- seed: none given = a random one, logged and in the metadata (upstream); the data order follows it ------

def _epoch_order(data_dir, seed, epoch=1):
    from library import config_util

    parser = _lora_parser("train_network")
    args = parser.parse_args(["--train_data_dir", str(data_dir), "--resolution", "64"]
                             + (["--seed", str(seed)] if seed is not None else []))
    group = config_util.build_dataset_group(args, "sd1")
    group.set_current_epoch(epoch)
    return [tuple(group[i]["image_paths"]) for i in range(len(group))]


def test_without_seed_each_run_draws_its_own_and_the_data_order_follows(tiny_dataset_dir, caplog):
    import logging

    chosen = []
    with caplog.at_level(logging.INFO, logger="library.train_util"):
        for _ in range(2):
            args = argparse.Namespace(seed=None)
            chosen.append(train_util.prepare_seed(args))
            assert args.seed == chosen[-1]  # kept for ss_seed and the run's TOML
    assert chosen[0] != chosen[1]
    assert f"seed: {chosen[0]} (random" in caplog.text and f"seed: {chosen[1]} (random" in caplog.text
    # the two runs' data orders differ; the same seed repeats its order (and so does a seeded run)
    assert _epoch_order(tiny_dataset_dir, chosen[0]) != _epoch_order(tiny_dataset_dir, chosen[1])
    assert _epoch_order(tiny_dataset_dir, chosen[0]) == _epoch_order(tiny_dataset_dir, chosen[0])
    args = argparse.Namespace(seed=42)
    assert train_util.prepare_seed(args) == 42 and args.seed == 42
    import torch

    a = torch.rand(3)
    train_util.prepare_seed(argparse.Namespace(seed=42))
    assert torch.equal(a, torch.rand(3))  # the seeded state is reproducible


@pytest.mark.usefixtures("one_thread")
def test_unseeded_run_writes_its_seed(tmp_path, tiny_sd1_single_file, tiny_dataset_dir, caplog):
    import logging
    import re

    import train_network
    from lora_checks import read_lora

    argv = ["--pretrained_model_name_or_path", str(tiny_sd1_single_file), "--tokenizer_cache_dir",
            str(tiny_sd1_single_file.parent / "tokenizers"), "--train_data_dir", str(tiny_dataset_dir),
            "--output_dir", str(tmp_path), "--network_module", "networks.lora", "--resolution", "64",
            "--max_train_steps", "1", "--max_data_loader_n_workers", "0"]
    with caplog.at_level(logging.INFO):
        path = network_trainer.run(train_network.trainer(), train_network.setup_parser(), argv)
    seed = int(re.search(r"seed: (\d+) \(random", caplog.text).group(1))
    _, md = read_lora(path)
    assert md["ss_seed"] == str(seed)
    assert f"seed = {seed}" in (tmp_path / "last_config.toml").read_text()  # the run can be repeated


def test_ddp_timeout_reaches_the_process_group(tmp_path):
    from datetime import timedelta

    from library import data_parallel

    parser = _lora_parser("sdxl_train_network")
    args = parser.parse_args(["--ddp_timeout", "30", "--output_dir", str(tmp_path)])
    (handler,) = data_parallel.accelerator_kwargs_handlers(args)
    # only the timeout is passed on (accelerate keeps choosing the backend: gloo on CPU, nccl on GPUs)
    assert handler.to_kwargs() == {"timeout": timedelta(minutes=30)}
    accelerator = train_network.trainer().make_accelerator(args)
    assert accelerator.init_handler.timeout == timedelta(minutes=30)
    assert data_parallel.accelerator_kwargs_handlers(parser.parse_args(["--ddp_static_graph"])) == []

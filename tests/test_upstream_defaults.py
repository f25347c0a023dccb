"""Upstream's defaults and types for options we share, and the behaviour that follows from them."""
from __future__ import annotations

import argparse

import pytest

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

"""LoRA training for Lumina Image 2.0, kohya-ss/sd-scripts CLI (its lumina_train_network.py).

    accelerate launch sd-scripts/lumina_train_network.py --pretrained_model_name_or_path lumina_2.safetensors \
        --gemma2 gemma_2_2b_fp16.safetensors --ae ae.safetensors --network_module networks.lora_lumina \
        --network_dim 16 --train_data_dir data --output_dir out --mixed_precision bf16 --gradient_checkpointing

or `--config_file cfg.toml` (flags on the command line win). A diffusers Lumina2Pipeline folder works as
--pretrained_model_name_or_path without --gemma2/--ae. The LoRA file has upstream's keys (lora_unet_layers_N_...,
lora_te_layers_N_...).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import network_trainer, safetensors_io  # noqa: E402
from library.compile import options as compile_options  # noqa: E402
from library.families.lumina import Lumina, add_lumina_arguments  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.lora import LoRA  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = network_trainer.setup_parser()
    add_lumina_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    return parser


def trainer(args=None) -> Trainer:
    return Trainer(Lumina(), LoRA())


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer, setup_parser(), argv)


if __name__ == "__main__":
    main()

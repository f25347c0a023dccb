"""LoRA training for SDXL, kohya-ss/sd-scripts CLI, with regional torch.compile (`--compile ...`).

    accelerate launch sd-scripts/sdxl_train_network.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors \
        --train_data_dir data --output_dir out --output_name mylora --network_module networks.lora \
        --network_dim 32 --network_alpha 16 --resolution 1024,1024 --max_train_steps 1000 --learning_rate 1e-4 \
        --mixed_precision bf16 --gradient_checkpointing --cache_latents --compile --compile_mode reduce-overhead

or `--config_file cfg.toml` (flags on the command line win).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import network_trainer, safetensors_io  # noqa: E402
from library.families.sdxl import SDXL  # noqa: E402
from library.compile import options as compile_options  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.lora import LoRA  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = network_trainer.setup_parser()
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    return parser


def trainer() -> Trainer:
    return Trainer(SDXL(), LoRA())


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

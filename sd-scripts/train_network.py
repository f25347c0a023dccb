"""LoRA training for Stable Diffusion 1.x / 2.x (`--v2`, `--v_parameterization`), kohya-ss/sd-scripts CLI.

    accelerate launch sd-scripts/train_network.py --pretrained_model_name_or_path model.safetensors \
        --train_data_dir data --output_dir out --output_name mylora --network_module networks.lora \
        --network_dim 32 --network_alpha 16 --resolution 512,512 --max_train_steps 1000 --learning_rate 1e-4

or `--config_file cfg.toml` (flags on the command line win). The loop is library.network_trainer.NetworkTrainer.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import network_trainer  # noqa: E402
from library.network_trainer import NetworkTrainer  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    return network_trainer.setup_parser()


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(NetworkTrainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

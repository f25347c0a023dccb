"""LoRA training for Stable Diffusion 1.x / 2.x (`--v2`, `--v_parameterization`), kohya-ss/sd-scripts CLI.

    accelerate launch sd-scripts/train_network.py --pretrained_model_name_or_path model.safetensors \
        --train_data_dir data --output_dir out --output_name mylora --network_module networks.lora \
        --network_dim 32 --network_alpha 16 --resolution 512,512 --max_train_steps 1000 --learning_rate 1e-4

or `--config_file cfg.toml` (flags on the command line win). The training core is library.run (family: library.families.sd, target: library.targets.lora).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import network_trainer  # noqa: E402
from library.families.sd import SD  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.lora import LoRA  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    return network_trainer.setup_parser()


def trainer() -> Trainer:
    return Trainer(SD(), LoRA())


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

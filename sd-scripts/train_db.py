"""DreamBooth for Stable Diffusion 1.x / 2.x (`--v2`, `--v_parameterization`): the full UNet, optionally the
text encoder, kohya-ss/sd-scripts CLI.

    accelerate launch sd-scripts/train_db.py --pretrained_model_name_or_path v1-5.safetensors \
        --train_data_dir data --reg_data_dir reg --prior_loss_weight 1.0 --output_dir out --output_name mymodel \
        --resolution 512,512 --max_train_steps 1600 --learning_rate 1e-6 --train_text_encoder \
        --mixed_precision fp16 --gradient_checkpointing --save_model_as safetensors

`--train_data_dir` holds `N_identifier class` folders (N = repeats), `--reg_data_dir` `N_class` folders of
regularisation images; or `--dataset_config` with `is_reg` subsets. Unlike kohya's train_db.py the text
encoder is trained only with `--train_text_encoder` (rate `--learning_rate_te`), as in the GUI.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import full_trainer  # noqa: E402
from library.full_trainer import FullTrainer  # noqa: E402
from library.network_trainer import NetworkTrainer  # noqa: E402


class DreamBoothTrainer(FullTrainer, NetworkTrainer):
    """SD1.x / SD2.x family hooks with the full-model training of library.full_trainer."""

    tracker_name = "dreambooth"


def setup_parser() -> argparse.ArgumentParser:
    return full_trainer.setup_parser(text_encoders=1)


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return full_trainer.run(DreamBoothTrainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

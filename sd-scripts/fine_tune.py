"""Fine-tuning of Stable Diffusion 1.x / 2.x (`--v2`, `--v_parameterization`): the full UNet, optionally the
text encoder, kohya-ss/sd-scripts CLI.

    python sd-scripts/finetune/merge_captions_to_metadata.py images meta.json
    accelerate launch sd-scripts/fine_tune.py --pretrained_model_name_or_path v1-5.safetensors \
        --in_json meta.json --train_data_dir images --output_dir out --output_name mymodel \
        --resolution 512,512 --max_train_steps 10000 --learning_rate 5e-6 --train_text_encoder \
        --mixed_precision fp16 --gradient_checkpointing --cache_latents --save_model_as safetensors

Captions can also sit next to the images (`--train_data_dir` with `N_name` folders, `--caption_extension`),
or come from a `--dataset_config`. The training core is library.full_trainer, shared with train_db.py.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import config_util, full_trainer  # noqa: E402
from library.full_trainer import FullTrainer  # noqa: E402
from library.network_trainer import NetworkTrainer  # noqa: E402


class FineTuneTrainer(FullTrainer, NetworkTrainer):
    """SD1.x / SD2.x family hooks with the full-model training of library.full_trainer."""

    tracker_name = "finetuning"
    dataset_kinds = (config_util.FINETUNING,)  # upstream: --dataset_config subsets need metadata_file here


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=1)
    full_trainer.add_diffusers_xformers_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return full_trainer.run(FineTuneTrainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

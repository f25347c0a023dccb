"""Fine-tuning of Stable Diffusion 1.x / 2.x (`--v2`, `--v_parameterization`): the full UNet, optionally the
text encoder, kohya-ss/sd-scripts CLI.

    python sd-scripts/finetune/merge_captions_to_metadata.py images meta.json
    accelerate launch sd-scripts/fine_tune.py --pretrained_model_name_or_path v1-5.safetensors \
        --in_json meta.json --train_data_dir images --output_dir out --output_name mymodel \
        --resolution 512,512 --max_train_steps 10000 --learning_rate 5e-6 --train_text_encoder \
        --mixed_precision fp16 --gradient_checkpointing --cache_latents --save_model_as safetensors

Captions can also sit next to the images (`--train_data_dir` with `N_name` folders, `--caption_extension`),
or come from a `--dataset_config`. The training core is library.run (family: library.families.sd, target: library.targets.full).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import config_util, full_trainer, network_trainer  # noqa: E402
from library.families.sd import SD  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.full import Full  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=1)
    full_trainer.add_diffusers_xformers_argument(parser)
    return parser


def trainer() -> Trainer:
    # upstream: --dataset_config subsets need metadata_file here
    return Trainer(SD(), Full(tracker_name="finetuning", dataset_kinds=(config_util.FINETUNING,)))


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

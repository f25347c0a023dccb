"""DreamBooth for Stable Diffusion 1.x / 2.x (`--v2`, `--v_parameterization`): the full UNet and the text
encoder, kohya-ss/sd-scripts CLI.

    accelerate launch sd-scripts/train_db.py --pretrained_model_name_or_path v1-5.safetensors \
        --train_data_dir data --reg_data_dir reg --prior_loss_weight 1.0 --output_dir out --output_name mymodel \
        --resolution 512,512 --max_train_steps 1600 --learning_rate 1e-6 --stop_text_encoder_training 800 \
        --mixed_precision fp16 --gradient_checkpointing --save_model_as safetensors

`--train_data_dir` holds `N_identifier class` folders (N = repeats), `--reg_data_dir` `N_class` folders of
regularisation images; or `--dataset_config` with `is_reg` subsets. As in kohya's train_db.py the text
encoder is trained by default (rate `--learning_rate_te`, default `--learning_rate`; 0 keeps it frozen);
`--stop_text_encoder_training N` freezes it after N steps, a negative N from the start. `--train_text_encoder`
is accepted and changes nothing.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import captions, full_trainer, masks, network_trainer  # noqa: E402
from library.families.sd import SD  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets import full  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=1)
    parser.add_argument("--stop_text_encoder_training", type=int, default=None,
                        help="freeze the text encoder after this many steps; negative: never train it "
                             "(default: trained for the whole run)")
    captions.add_no_token_padding_argument(parser)
    masks.add_masked_loss_arguments(parser)
    return parser


def trainer() -> Trainer:
    return Trainer(SD(), full.dreambooth())


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

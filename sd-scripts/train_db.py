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
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import captions, config_util, full_trainer, masks  # noqa: E402
from library.full_trainer import FullTrainer  # noqa: E402
from library.network_trainer import NetworkTrainer  # noqa: E402
from library.train_util import ConfigError  # noqa: E402

logger = logging.getLogger(__name__)


class DreamBoothTrainer(FullTrainer, NetworkTrainer):
    """SD1.x / SD2.x family hooks with the full-model training of library.full_trainer."""

    tracker_name = "dreambooth"
    dataset_kinds = (config_util.DREAMBOOTH,)  # upstream: no fine-tuning (metadata_file) subsets here

    def trains_text_encoder(self, args) -> bool:
        stop = args.stop_text_encoder_training
        return (stop is None or stop >= 0) and any(self.text_encoder_lrs(args))

    def check_args(self, args) -> None:
        if (args.cache_text_encoder_outputs or args.cache_text_encoder_outputs_to_disk) \
                and self.trains_text_encoder(args):
            raise ConfigError("--cache_text_encoder_outputs needs a frozen text encoder, and train_db.py trains it "
                              "by default: add --stop_text_encoder_training -1 or drop the caching")
        super().check_args(args)

    def keep_training_text_encoder(self, args, global_step: int) -> bool:
        stop = args.stop_text_encoder_training
        if stop is None or global_step < stop:
            return True
        logger.info("stop text encoder training at step %d", global_step)
        self.components.text_encoders[0].requires_grad_(False).eval()
        return False


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=1)
    parser.add_argument("--stop_text_encoder_training", type=int, default=None,
                        help="freeze the text encoder after this many steps; negative: never train it "
                             "(default: trained for the whole run)")
    captions.add_no_token_padding_argument(parser)
    masks.add_masked_loss_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return full_trainer.run(DreamBoothTrainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

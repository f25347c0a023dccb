"""SDXL DreamBooth and fine-tuning (the full UNet, optionally both text encoders), kohya-ss/sd-scripts CLI,
with regional torch.compile (`--compile ...`).

    accelerate launch sd-scripts/sdxl_train.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors \
        --train_data_dir data --reg_data_dir reg --prior_loss_weight 1.0 --output_dir out --output_name mymodel \
        --resolution 1024,1024 --max_train_steps 2000 --learning_rate 1e-5 --optimizer_type Adafactor \
        --optimizer_args scale_parameter=False relative_step=False warmup_init=False --fused_backward_pass \
        --mixed_precision bf16 --full_bf16 --gradient_checkpointing --cache_latents \
        --cache_text_encoder_outputs --save_model_as safetensors --compile

Fine-tune with kohya's metadata JSON: `--in_json meta.json --train_data_dir images` (see
finetune/merge_captions_to_metadata.py). `--train_text_encoder` with `--learning_rate_te1/--learning_rate_te2`
also trains the text encoders. Or `--config_file cfg.toml` (flags on the command line win).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import compile_utils, full_trainer  # noqa: E402
from library.full_trainer import FullTrainer  # noqa: E402
from sdxl_train_network import SDXLNetworkTrainer  # noqa: E402


class SDXLTrainer(FullTrainer, SDXLNetworkTrainer):
    """The SDXL family hooks (two text encoders, size conditioning, regional compile after
    accelerator.prepare) with the full-model training of library.full_trainer."""

    tracker_name = "sdxl_finetuning"

    def text_encoder_lrs(self, args) -> list[float | None]:
        def rate(value):
            return args.learning_rate if value is None else value

        return [rate(args.learning_rate_te1), rate(args.learning_rate_te2)]


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=2)
    compile_utils.add_compile_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return full_trainer.run(SDXLTrainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

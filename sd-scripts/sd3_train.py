"""Full fine-tune of SD3 / SD3.5 (the MMDiT, optionally CLIP-L/CLIP-G and T5-XXL), kohya-ss/sd-scripts CLI.

    accelerate launch sd-scripts/sd3_train.py --pretrained_model_name_or_path sd3.5_medium.safetensors \
        --clip_l clip_l.safetensors --clip_g clip_g.safetensors --t5xxl t5xxl_fp16.safetensors \
        --train_data_dir data --output_dir out --output_name mysd3 --mixed_precision bf16 --full_bf16 \
        --optimizer_type Adafactor --fused_backward_pass --gradient_checkpointing

The result is upstream's layout: the SAI single file (``model.diffusion_model.*`` + ``first_stage_model.*``) that
ComfyUI, our loader and diffusers' SD3Transformer2DModel.from_single_file read; with --train_text_encoder the
trained encoders beside it (``<name>_clip_l.safetensors``, ``_clip_g``, ``_t5xxl`` with --train_t5xxl).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import (flux_train_utils, full_trainer, masks, network_trainer,  # noqa: E402
                     offload_checkpointing, safetensors_io, train_util)
from library.compile import options as compile_options  # noqa: E402
from library.families import sd3  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.full import Full  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=2)
    sd3.add_sd3_arguments(parser)
    parser.add_argument("--learning_rate_te3", type=float, default=None,
                        help="learning rate of text encoder 3 (T5-XXL); default --learning_rate, 0 = frozen")
    parser.add_argument("--train_t5xxl", action="store_true", help="also train T5-XXL (with --train_text_encoder)")
    parser.add_argument("--use_t5xxl_cache_only", action="store_true",
                        help="not supported here (upstream: cache T5-XXL's outputs only): refused")
    parser.add_argument("--num_last_block_to_freeze", type=int, default=None,
                        help="the last N joint blocks of the MMDiT are not trained")
    full_trainer.add_fused_optimizer_groups_argument(parser)
    full_trainer.add_blockwise_arguments(parser)
    masks.add_masked_loss_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    offload_checkpointing.add_cpu_offload_checkpointing_argument(parser)
    train_util.add_normaliser(parser, sd3.normalise_full_args)
    return parser


def trainer(args=None) -> Trainer:
    return Trainer(sd3.SD3(bucket_reso_steps_multiple=16), Full(
        text_encoder_lrs=sd3.full_text_encoder_lrs, check=sd3.check_full_args,
        fused_groups=flux_train_utils.blockwise_fused, optimizer_groups=flux_train_utils.blockwise_optimizer_groups,
        place=sd3.place_for_full_training))


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer, setup_parser(), argv)


if __name__ == "__main__":
    main()

"""Full fine-tune / DreamBooth of the FLUX.1 transformer, kohya-ss/sd-scripts CLI, with regional torch.compile.

    accelerate launch sd-scripts/flux_train.py --pretrained_model_name_or_path flux1-dev.safetensors \
        --clip_l clip_l.safetensors --t5xxl t5xxl_fp16.safetensors --ae ae.safetensors \
        --train_data_dir data --output_dir out --output_name myflux --mixed_precision bf16 --full_bf16 \
        --optimizer_type Adafactor --fused_backward_pass --gradient_checkpointing --compile

The result is a BFL-layout single file (`double_blocks.N...`, `single_blocks.N...`) that ComfyUI/Forge, our
loader and diffusers' FluxTransformer2DModel.from_single_file read. `--train_blocks single|double` trains only
those blocks (everything else stays bit-identical to the base). The text encoders and the AE stay frozen.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import (flux_train_utils, full_trainer, masks, network_trainer,  # noqa: E402
                     offload_checkpointing, safetensors_io, saving, train_util)
from library.families.chroma import family_for  # noqa: E402
from library.compile import options as compile_options  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.full import Full  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=1)
    flux_train_utils.add_flux_arguments(parser)
    saving.add_mem_eff_save_argument(parser)
    parser.add_argument("--train_blocks", type=str, default="all", choices=flux_train_utils.TRAIN_BLOCKS,
                        help="which transformer blocks are trained: all (the whole transformer), single or double")
    full_trainer.add_fused_optimizer_groups_argument(parser)
    full_trainer.add_blockwise_arguments(parser)
    masks.add_masked_loss_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    offload_checkpointing.add_cpu_offload_checkpointing_argument(parser)
    for name in ("double_blocks_to_swap", "single_blocks_to_swap"):
        parser.add_argument(f"--{name}", type=int, default=None, help="deprecated upstream: use --blocks_to_swap")
    train_util.add_normaliser(parser, flux_train_utils.normalise_full_args)
    return parser


def trainer(args=None) -> Trainer:
    """FLUX.1, or Chroma with --model_type chroma."""
    return Trainer(family_for(args, bucket_reso_steps_multiple=16), Full(
        check=flux_train_utils.check_full_args, fused_groups=flux_train_utils.blockwise_fused,
        optimizer_groups=flux_train_utils.blockwise_optimizer_groups, place=flux_train_utils.place_for_full_training,
        extra_metadata=lambda args: {"ss_train_blocks": args.train_blocks}))


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer, setup_parser(), argv)


if __name__ == "__main__":
    main()

"""LoRA training for FLUX.1 (dev and schnell), kohya-ss/sd-scripts CLI, with regional torch.compile and block swap.

    accelerate launch sd-scripts/flux_train_network.py --pretrained_model_name_or_path flux1-dev.safetensors \
        --clip_l clip_l.safetensors --t5xxl t5xxl_fp16.safetensors --ae ae.safetensors \
        --network_module networks.lora_flux --network_dim 16 --train_data_dir data --output_dir out \
        --mixed_precision bf16 --gradient_checkpointing --fp8_base --blocks_to_swap 8 --compile

or `--config_file cfg.toml` (flags on the command line win). A diffusers FluxPipeline folder works as
--pretrained_model_name_or_path without --clip_l/--t5xxl/--ae. Chroma: `--model_type chroma --apply_t5_attn_mask`
with the Chroma single file (or a ChromaPipeline folder), --t5xxl and --ae, no --clip_l.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import flux_train_utils, network_trainer, safetensors_io, train_util  # noqa: E402
from library.families.chroma import family_for  # noqa: E402
from library.compile import options as compile_options  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.lora import LoRA  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = network_trainer.setup_parser()
    flux_train_utils.add_flux_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    parser.add_argument("--split_mode", action="store_true",
                        help="deprecated upstream: same as --blocks_to_swap 18 (ignored when --blocks_to_swap is set)")
    train_util.add_normaliser(parser, flux_train_utils.map_split_mode)
    return parser


def trainer(args=None) -> Trainer:
    """FLUX.1, or Chroma with --model_type chroma."""
    return Trainer(family_for(args), LoRA())


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer, setup_parser(), argv)


if __name__ == "__main__":
    main()

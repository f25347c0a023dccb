"""Full fine-tune / DreamBooth of the Lumina Image 2.0 DiT, kohya-ss/sd-scripts CLI (its lumina_train.py).

    accelerate launch sd-scripts/lumina_train.py --pretrained_model_name_or_path lumina_2.safetensors \
        --gemma2 gemma_2_2b_fp16.safetensors --ae ae.safetensors --train_data_dir data --output_dir out \
        --output_name mylumina --mixed_precision bf16 --full_bf16 --optimizer_type Adafactor \
        --fused_backward_pass --gradient_checkpointing

The result is a single file in upstream's layout (Alpha-VLLM keys: `layers.N.attention.qkv.weight` ...), which
upstream's scripts, ComfyUI and our loader read. Gemma 2 and the AE stay frozen, as upstream.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import (flux_train_utils, full_trainer, masks, network_trainer,  # noqa: E402
                     offload_checkpointing, safetensors_io, saving, train_util)
from library.compile import options as compile_options  # noqa: E402
from library.families import lumina  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.full import Full  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=1)
    lumina.add_lumina_arguments(parser)
    saving.add_mem_eff_save_argument(parser)
    full_trainer.add_fused_optimizer_groups_argument(parser)
    full_trainer.add_blockwise_arguments(parser)
    masks.add_masked_loss_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    offload_checkpointing.add_cpu_offload_checkpointing_argument(parser)
    train_util.add_normaliser(parser, flux_train_utils.normalise_dit_full_args)
    return parser


def trainer(args=None) -> Trainer:
    return Trainer(lumina.Lumina(), Full(check=lumina.check_full_args, fused_groups=flux_train_utils.blockwise_fused,
                                        optimizer_groups=lumina.blockwise_optimizer_groups))


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer, setup_parser(), argv)


if __name__ == "__main__":
    main()

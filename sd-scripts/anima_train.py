"""Full fine-tune of the Anima DiT (with its LLM adapter), kohya-ss/sd-scripts CLI (its anima_train.py).

    accelerate launch sd-scripts/anima_train.py --pretrained_model_name_or_path anima-preview.safetensors \
        --qwen3 qwen_3_06b_base.safetensors --vae qwen_image_vae.safetensors --train_data_dir data \
        --output_dir out --output_name myanima --mixed_precision bf16 --full_bf16 --optimizer_type Adafactor \
        --fused_backward_pass --gradient_checkpointing --self_attn_lr 1e-5 --llm_adapter_lr 0

Each part of the DiT can have its own learning rate (--self_attn_lr, --cross_attn_lr, --mlp_lr, --mod_lr,
--llm_adapter_lr; unset = --learning_rate, 0 = frozen), as upstream. Qwen3 and the VAE stay frozen. The result is
upstream's single file (`net.` + the DiT's keys, metadata format=pt) that upstream's scripts, ComfyUI and our loader
read.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import (full_trainer, masks, network_trainer, offload_checkpointing, safetensors_io,  # noqa: E402
                     train_util)
from library.compile import options as compile_options  # noqa: E402
from library.families import anima  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.full import Full  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=1)
    anima.add_anima_arguments(parser)
    full_trainer.add_skip_latents_validity_check_argument(parser)
    masks.add_masked_loss_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    offload_checkpointing.add_cpu_offload_checkpointing_argument(parser)
    train_util.add_normaliser(parser, anima.normalise_full_args)
    return parser


def trainer(args=None) -> Trainer:
    return Trainer(anima.Anima(), Full(check=anima.check_full_args, place=anima.place_for_full_training,
                                       extra_metadata=anima.full_metadata))


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer, setup_parser(), argv)


if __name__ == "__main__":
    main()

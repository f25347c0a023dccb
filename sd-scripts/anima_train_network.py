"""LoRA training for Anima, kohya-ss/sd-scripts CLI (its anima_train_network.py).

    accelerate launch sd-scripts/anima_train_network.py --pretrained_model_name_or_path anima-preview.safetensors \
        --qwen3 qwen_3_06b_base.safetensors --vae qwen_image_vae.safetensors --network_module networks.lora_anima \
        --network_dim 16 --train_data_dir data --output_dir out --mixed_precision bf16 --gradient_checkpointing

or `--config_file cfg.toml` (flags on the command line win). The Qwen3 and T5 tokenizers come from the --qwen3 folder
/ --t5_tokenizer_path, else --tokenizer_cache_dir (qwen3/, t5/), else the hub. The LoRA file has upstream's keys
(lora_unet_blocks_N_self_attn_q_proj ..., lora_te_layers_N_self_attn_q_proj ...).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import network_trainer, safetensors_io, train_util  # noqa: E402
from library.compile import options as compile_options  # noqa: E402
from library.families.anima import Anima, add_anima_arguments, normalise_args  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.lora import LoRA  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = network_trainer.setup_parser()
    add_anima_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    train_util.add_normaliser(parser, normalise_args)
    return parser


def trainer(args=None) -> Trainer:
    return Trainer(Anima(), LoRA())


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer, setup_parser(), argv)


if __name__ == "__main__":
    main()

"""LoRA training for HunyuanImage 2.1, kohya-ss/sd-scripts CLI (its hunyuan_image_train_network.py).

    accelerate launch sd-scripts/hunyuan_image_train_network.py --pretrained_model_name_or_path hunyuanimage2.1.safetensors \
        --text_encoder qwen_2.5_vl_7b.safetensors --byt5 byt5_small_glyphxl_fp16.safetensors \
        --vae hunyuan_image_2.1_vae_fp16.safetensors --network_module networks.lora_hunyuan_image \
        --network_dim 16 --network_train_unet_only --train_data_dir data --output_dir out --mixed_precision bf16 \
        --gradient_checkpointing

or `--config_file cfg.toml` (flags on the command line win). The LoRA file has upstream's keys
(lora_unet_double_blocks_N_img_attn_qkv ..., lora_unet_single_blocks_N_linear1 ...).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import network_trainer, safetensors_io  # noqa: E402
from library.compile import options as compile_options  # noqa: E402
from library.families.hunyuan_image import HunyuanImage, add_hunyuan_image_arguments  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.lora import LoRA  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = network_trainer.setup_parser()
    add_hunyuan_image_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    return parser


def trainer(args=None) -> Trainer:
    return Trainer(HunyuanImage(), LoRA())


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer, setup_parser(), argv)


if __name__ == "__main__":
    main()

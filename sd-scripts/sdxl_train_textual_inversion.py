"""Textual inversion for SDXL, kohya-ss/sd-scripts CLI, with regional torch.compile of the UNet (`--compile ...`):
new token embeddings are trained in both frozen text encoders; the result is upstream's SDXL embedding file
(`clip_l` and `clip_g`), which ComfyUI, the web UIs and diffusers' `load_textual_inversion` (once per encoder) read.

    accelerate launch sd-scripts/sdxl_train_textual_inversion.py --pretrained_model_name_or_path \
        sd_xl_base_1.0.safetensors --train_data_dir data --output_dir out --token_string mychar --init_word girl \
        --num_vectors_per_token 4 --resolution 1024,1024 --max_train_steps 1000 --learning_rate 5e-6 \
        --mixed_precision bf16 --save_model_as safetensors --use_object_template --cache_latents

Or `--config_file cfg.toml` (flags on the command line win).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import masks, network_trainer, safetensors_io  # noqa: E402
from library.compile import options as compile_options  # noqa: E402
from library.families.sdxl import SDXL  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets import embedding  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = network_trainer.base_parser()
    masks.add_masked_loss_arguments(parser)
    embedding.add_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    return parser


def trainer() -> Trainer:
    return Trainer(SDXL(), embedding.Embedding(embedding.FILE_KEYS_SDXL))


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

"""Textual inversion for Stable Diffusion 1.x / 2.x (`--v2`, `--v_parameterization`), kohya-ss/sd-scripts CLI:
new token embeddings are trained in the frozen text encoder; the result is upstream's embedding file
(`emb_params`, .pt by default or .safetensors), which the web UIs and diffusers' `load_textual_inversion` read.

    accelerate launch sd-scripts/train_textual_inversion.py --pretrained_model_name_or_path v1-5.safetensors \
        --train_data_dir data --output_dir out --token_string mychar --init_word girl --num_vectors_per_token 4 \
        --resolution 512,512 --max_train_steps 1000 --learning_rate 5e-6 --mixed_precision fp16 \
        --save_model_as safetensors --use_object_template

Captions mention the token string (`a photo of mychar`), or `--use_object_template` / `--use_style_template` use
upstream's templates instead; `--weights` continues from an embedding. Or `--config_file cfg.toml`.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import masks, network_trainer  # noqa: E402
from library.families.sd import SD  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets import embedding  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = network_trainer.base_parser()
    masks.add_masked_loss_arguments(parser)
    embedding.add_arguments(parser)
    return parser


def trainer() -> Trainer:
    return Trainer(SD(), embedding.Embedding(embedding.FILE_KEYS_SD))


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

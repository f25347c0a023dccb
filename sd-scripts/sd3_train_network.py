"""LoRA training for SD3 / SD3.5 (medium, large), kohya-ss/sd-scripts CLI, with regional torch.compile and block swap.

    accelerate launch sd-scripts/sd3_train_network.py --pretrained_model_name_or_path sd3.5_medium.safetensors \
        --clip_l clip_l.safetensors --clip_g clip_g.safetensors --t5xxl t5xxl_fp16.safetensors \
        --network_module networks.lora_sd3 --network_dim 16 --train_data_dir data --output_dir out \
        --mixed_precision bf16 --gradient_checkpointing --weighting_scheme logit_normal

or `--config_file cfg.toml` (flags on the command line win). A checkpoint with the text encoders inside, or a
diffusers StableDiffusion3Pipeline folder, needs no --clip_l/--clip_g/--t5xxl.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import network_trainer, safetensors_io  # noqa: E402
from library.compile import options as compile_options  # noqa: E402
from library.families.sd3 import SD3, add_sd3_arguments  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.lora import LoRA  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = network_trainer.setup_parser()
    add_sd3_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    return parser


def trainer(args=None) -> Trainer:
    return Trainer(SD3(), LoRA())


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer, setup_parser(), argv)


if __name__ == "__main__":
    main()

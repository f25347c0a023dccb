"""Merge LoRAs into an SD1.x/SD2.x model, or several LoRAs into one (kohya-ss/sd-scripts' networks/merge_lora.py,
same options and files):

    python sd-scripts/networks/merge_lora.py --sd_model model.safetensors --save_to merged.safetensors \
        --models a.safetensors b.safetensors --ratios 0.8 0.5
    python sd-scripts/networks/merge_lora.py --save_to ab.safetensors --models a.safetensors b.safetensors \
        --ratios 1 1 [--concat]

Into a model: W += ratio * up x down * alpha / rank for each LoRA module (the model as the trainers read it:
single file or diffusers folder; written as one SGM/LDM file). LoRAs into one: the matrices of LoRAs of the same
ranks are added after scaling (upstream's rule), or concatenated along the rank with --concat.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library import lora_tools  # noqa: E402


def merge(args: argparse.Namespace) -> None:
    lora_tools.run_sd_merge(args, "sd2" if args.v2 else "sd1")


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Merge LoRAs into an SD1.x/SD2.x model, or into one LoRA")
    parser.add_argument("--v2", action="store_true", help="the model is Stable Diffusion 2.x")
    lora_tools.add_sd_merge_arguments(parser, lbws=False)
    lora_tools.add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return lora_tools.run_tool(setup_parser(), merge, argv)


if __name__ == "__main__":
    raise SystemExit(main())

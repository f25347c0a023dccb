"""Merge LoRAs (or OFT files) into an SDXL model, or several LoRAs into one (kohya-ss/sd-scripts'
networks/sdxl_merge_lora.py, same options and files):

    python sd-scripts/networks/sdxl_merge_lora.py --sd_model sdxl.safetensors --save_to merged.safetensors \
        --models a.safetensors --ratios 0.8 [--lbws "[1,1,1,1,1,1,1,1,1,1,1,1]"]
    python sd-scripts/networks/sdxl_merge_lora.py --save_to ab.safetensors --models a.safetensors b.safetensors \
        --ratios 1 1 [--concat]

--lbws: layer-block weights per LoRA (a JSON list of 12 or 20 numbers for SDXL: upstream's LBW presets).
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library import lora_tools  # noqa: E402


def merge(args: argparse.Namespace) -> None:
    lora_tools.run_sd_merge(args, "sdxl")


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Merge LoRAs into an SDXL model, or into one LoRA")
    lora_tools.add_sd_merge_arguments(parser, lbws=True)
    lora_tools.add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return lora_tools.run_tool(setup_parser(), merge, argv)


if __name__ == "__main__":
    raise SystemExit(main())

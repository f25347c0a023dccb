"""Convert a FLUX.1 LoRA between kohya's layout (sd-scripts, ComfyUI) and diffusers' (ai-toolkit, diffusers'
FluxPipeline.load_lora_weights) (kohya-ss/sd-scripts' networks/convert_flux_lora.py, same options):

    python sd-scripts/networks/convert_flux_lora.py --src sd-scripts --dst ai-toolkit \
        --src_path kohya.safetensors --dst_path diffusers.safetensors
    python sd-scripts/networks/convert_flux_lora.py --src ai-toolkit --dst sd-scripts \
        --src_path diffusers.safetensors --dst_path kohya.safetensors

kohya -> diffusers: alpha / rank folded into the matrices, fused qkv / linear1 modules split into their
q, k, v (and proj_mlp) parts, CLIP-L modules as text_encoder.*; diffusers -> kohya: the parts fused again
(block-diagonal up, alpha = rank). The file's metadata is kept.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library import lora_tools  # noqa: E402

logger = lora_tools.logger
FORMATS = ("ai-toolkit", "sd-scripts")


def convert(args: argparse.Namespace) -> None:
    if args.src_path is None or args.dst_path is None:
        raise lora_tools.ToolError("--src_path and --dst_path are required")
    if args.src == args.dst or args.src not in FORMATS or args.dst not in FORMATS:
        raise lora_tools.ToolError(f"--src {args.src} --dst {args.dst}: converts between {' and '.join(FORMATS)} "
                                   "(one each way)")
    lora_tools.output_path(args.dst_path, "--dst_path", args.overwrite, suffixes=(".safetensors",))
    logger.info("Loading source file %s", args.src_path)
    sd, metadata = lora_tools.load_lora(args.src_path)
    diffusers_in = lora_tools.is_diffusers_flux_lora(sd)
    if args.src == "ai-toolkit" and not diffusers_in:
        raise lora_tools.ToolError(f"{args.src_path}: not a diffusers / ai-toolkit FLUX.1 LoRA (no lora_A/lora_B "
                                   "keys); is it --src sd-scripts?")
    if args.src == "sd-scripts" and lora_tools.lora_family(sd) != "flux":
        raise lora_tools.ToolError(f"{args.src_path}: not a kohya FLUX.1 LoRA (no lora_unet_double_blocks_ / "
                                   "lora_unet_single_blocks_ keys)")
    logger.info("Converting %s to %s format", args.src, args.dst)
    out = lora_tools.flux_lora_from_diffusers(sd) if args.src == "ai-toolkit" else lora_tools.flux_lora_to_diffusers(sd)
    lora_tools.save_lora(args.dst_path, out, metadata, overwrite=args.overwrite, hashes=False)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Convert a FLUX.1 LoRA between kohya's and diffusers' layouts")
    parser.add_argument("--src", type=str, default="ai-toolkit", help="source format, ai-toolkit or sd-scripts")
    parser.add_argument("--dst", type=str, default="sd-scripts", help="destination format, ai-toolkit or sd-scripts")
    parser.add_argument("--src_path", type=str, default=None, help="source path")
    parser.add_argument("--dst_path", type=str, default=None, help="destination path")
    lora_tools.add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return lora_tools.run_tool(setup_parser(), convert, argv)


if __name__ == "__main__":
    raise SystemExit(main())

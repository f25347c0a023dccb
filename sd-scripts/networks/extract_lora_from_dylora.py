"""Split a DyLoRA into LoRAs of fixed ranks (kohya-ss/sd-scripts' networks/extract_lora_from_dylora.py, same
options and files):

    python sd-scripts/networks/extract_lora_from_dylora.py --model dylora.safetensors --save_to lora.safetensors \
        --unit 4

writes lora-0004.safetensors, lora-0008.safetensors, ... (ranks unit, 2 * unit, ... below the DyLoRA's rank):
each keeps the first rank rows of lora_down and columns of lora_up (a DyLoRA is trained so that every such
prefix is a LoRA) and the file's alphas and metadata.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library import lora_tools  # noqa: E402

logger = lora_tools.logger


def split_lora_model(lora_sd: dict, unit: int) -> tuple[int, list[tuple[dict, int]]]:
    """(the DyLoRA's largest rank, [(state dict, rank) for rank = unit, 2 * unit, ... < that rank])."""
    max_rank = max((v.shape[0] for k, v in lora_sd.items() if "lora_down" in k), default=0)
    logger.info("Max rank: %s", max_rank)
    out = []
    for rank in range(unit, max_rank, unit):
        logger.info("Splitting rank %s", rank)
        sd = {}
        for key, value in lora_sd.items():
            if "lora_down" in key:
                sd[key] = value[:rank].contiguous()
            elif "lora_up" in key:
                sd[key] = value[:, :rank].contiguous()
            else:
                sd[key] = value
        out.append((sd, rank))
    return max_rank, out


def split(args: argparse.Namespace) -> None:
    if args.model is None:
        raise lora_tools.ToolError("--model is required: the DyLoRA file to split")
    if args.unit is None or args.unit < 1:
        raise lora_tools.ToolError("--unit is required: the rank step of the LoRAs to write (e.g. 4), at least 1")
    lora_tools.output_path(args.save_to, "--save_to", True)
    lora_sd, metadata = lora_tools.load_lora(args.model)
    original_rank, models = split_lora_model(lora_sd, args.unit)
    if not models:
        raise lora_tools.ToolError(f"{args.model}: rank {original_rank}; --unit {args.unit} leaves no smaller rank "
                                   "to write")
    base, ext = os.path.splitext(args.save_to)
    names = [f"{base}-{rank:04d}{ext}" for _, rank in models]
    existing = [n for n in names if os.path.exists(n)]
    if existing and not args.overwrite:
        raise lora_tools.ToolError(f"--save_to: {existing[0]} already exists; choose another name or pass --overwrite")
    comment = metadata.get("ss_training_comment", "")
    for (state_dict, rank), name in zip(models, names):
        md = dict(metadata)
        md["ss_training_comment"] = f"split from DyLoRA, rank {original_rank} to {rank}; {comment}"
        md["ss_network_dim"] = str(rank)
        logger.info("saving model to: %s", name)
        lora_tools.save_lora(name, state_dict, md, overwrite=args.overwrite)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Split a DyLoRA into LoRAs of fixed ranks")
    parser.add_argument("--unit", type=int, default=None, help="rank step of the LoRAs to write (e.g. 4)")
    parser.add_argument("--save_to", type=str, default=None,
                        help="output base name: .safetensors or .ckpt; -<rank> is added for each LoRA")
    parser.add_argument("--model", type=str, default=None, help="DyLoRA file: .safetensors or .ckpt")
    lora_tools.add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return lora_tools.run_tool(setup_parser(), split, argv)


if __name__ == "__main__":
    raise SystemExit(main())

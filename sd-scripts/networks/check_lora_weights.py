"""Print a LoRA file's weights, one line per tensor (kohya-ss/sd-scripts' networks/check_lora_weights.py, same
options and output):

    python sd-scripts/networks/check_lora_weights.py lora.safetensors [--show_all_keys]

`key,(shape),mean |value|,min |value|` for each LoRA matrix (lora_up/lora_down, lora_A/lora_B, OFT blocks); a
matrix whose mean is 0 was never trained (e.g. an up matrix still at its zero init).
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library import lora_tools  # noqa: E402

LORA_KEY_PARTS = ("lora_up", "lora_down", "lora_A", "lora_B", "oft_")


def report(sd: dict, show_all_keys: bool) -> list[str]:
    keys = [k for k in sd if any(p in k for p in LORA_KEY_PARTS)]
    lines = [f"number of LoRA modules: {len(keys)}"]
    if show_all_keys:
        keys += [k for k in sd if k not in keys]
        lines.append(f"number of all modules: {len(keys)}")
    for key in keys:
        v = sd[key].to(torch.float32)
        shape = str(tuple(v.size())).replace(", ", "-")
        lines.append(f"{key},{shape},{torch.mean(torch.abs(v))},{torch.min(torch.abs(v))}")
    return lines


def check(args: argparse.Namespace) -> None:
    lora_tools.logger.info("loading: %s", args.file)
    sd, _ = lora_tools.load_lora(args.file)
    print("\n".join(report(sd, args.show_all_keys)))


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Print a LoRA file's weights (mean and min of |value|)")
    parser.add_argument("file", type=str, help="LoRA file to check: .safetensors or .ckpt")
    parser.add_argument("-s", "--show_all_keys", action="store_true", help="show all keys, not only LoRA matrices")
    from library.option_dump import add_dump_options_argument

    add_dump_options_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return lora_tools.run_tool(setup_parser(), check, argv)


if __name__ == "__main__":
    raise SystemExit(main())

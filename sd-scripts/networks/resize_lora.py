"""Resize a LoRA to another rank (kohya-ss/sd-scripts' networks/resize_lora.py, same options and file):

    python sd-scripts/networks/resize_lora.py --model in.safetensors --save_to out.safetensors --new_rank 8
    python sd-scripts/networks/resize_lora.py --model in.safetensors --save_to out.safetensors --new_rank 32 \
        --dynamic_method sv_fro --dynamic_param 0.9 --verbose

Each module's up x down is decomposed (SVD) and cut to --new_rank (--new_conv_rank for conv layers), or to the
rank the dynamic method picks from the singular values (sv_ratio: largest / smallest kept <= param; sv_fro:
Frobenius norm retained >= param; sv_cumulative: sum retained >= param), --new_rank being the upper bound;
alpha keeps the module's scale (alpha / rank). The SVDs run batched in float32 on the GPU when there is one.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library import lora_tools  # noqa: E402

logger = lora_tools.logger


def resize_lora_model(lora_sd: dict, new_rank: int, new_conv_rank: int, save_dtype: torch.dtype, device,
                      dynamic_method: str | None, dynamic_param: float | None, verbose: bool
                      ) -> tuple[dict, int | None, float | None, str]:
    """(resized state dict, largest old rank, the last module's new alpha, verbose report) as upstream's
    resize_lora_model; keys that are no LoRA matrix are kept."""
    if dynamic_method:
        logger.info("Dynamically determining new alphas and dims based off %s: %s, max rank is %s",
                    dynamic_method, dynamic_param, new_rank)
    mods = lora_tools.lora_modules(lora_sd)
    factors = {name: (m.up.float().reshape(m.up.shape[0], -1), m.down.float().reshape(m.rank, -1))
               for name, m in mods.items()}
    out = dict(lora_sd)
    report, fro_list = ["\n"], []
    max_old_rank, new_alpha = None, None
    results = {}
    with torch.no_grad():
        for name, U, S, Vh in lora_tools.svd_of_products(factors, device, desc="resizing"):
            m = mods[name]
            full_len = min(m.up.shape[0], factors[name][1].shape[1])
            choice = lora_tools.choose_rank(lora_tools.pad_singular_values(S, full_len),
                                            new_conv_rank if m.is_conv else new_rank, dynamic_method, dynamic_param,
                                            m.scale)
            up, down = lora_tools.truncate(U, S, Vh, choice.rank)
            if m.is_conv:
                up, down = up.reshape(*up.shape, 1, 1), down.reshape(choice.rank, *m.down.shape[1:])
            results[name] = (up.cpu(), down.cpu(), choice)
    for name, m in mods.items():  # the file's order, for the report and max/last values as upstream
        up, down, choice = results[name]
        max_old_rank = max(max_old_rank or 0, m.rank)
        if verbose:
            if choice.fro_retained == choice.fro_retained:  # not NaN
                fro_list.append(choice.fro_retained)
            line = (f"{name:75} | sum(S) retained: {choice.sum_retained:.1%}, fro retained: "
                    f"{choice.fro_retained:.1%}, max(S) ratio: {choice.max_ratio:0.1f}")
            if dynamic_method:
                line += f", dynamic | dim: {choice.rank}, alpha: {choice.alpha}"
            report.append(line + "\n")
        new_alpha = choice.alpha
        out[m.down_key] = down.to(save_dtype).contiguous()
        out[m.up_key] = up.to(save_dtype).contiguous()
        out[name + ".alpha"] = torch.tensor(choice.alpha).to(save_dtype)
    text = ""
    if verbose:
        import numpy as np

        text = "".join(report) + (f"Average Frobenius norm retention: {np.mean(fro_list):.2%} | std: "
                                  f"{np.std(fro_list):0.3f}")
    logger.info("resizing complete")
    return out, max_old_rank, new_alpha, text


def resize(args: argparse.Namespace) -> None:
    lora_tools.output_path(args.save_to, "--save_to", args.overwrite)
    lora_tools.check_inputs([args.model], "--model")
    if args.model is None:
        raise lora_tools.ToolError("--model is required: the LoRA file to resize")
    if args.dynamic_method and not args.dynamic_param:
        raise lora_tools.ToolError(f"--dynamic_method {args.dynamic_method} needs --dynamic_param (a ratio for "
                                   "sv_ratio, a fraction 0-1 for sv_fro / sv_cumulative)")
    if args.new_rank < 1 or (args.new_conv_rank is not None and args.new_conv_rank < 1):
        raise lora_tools.ToolError("--new_rank / --new_conv_rank must be at least 1")
    new_conv_rank = args.new_conv_rank if args.new_conv_rank is not None else args.new_rank
    save_dtype = lora_tools.str_to_dtype(args.save_precision) or torch.float32
    device = lora_tools.pick_device(args.device)

    logger.info("loading Model...")
    lora_sd, metadata = lora_tools.load_lora(args.model, torch.float32)
    if not lora_tools.lora_modules(lora_sd):
        raise lora_tools.ToolError(f"{args.model}: no LoRA modules (lora_down/lora_up, lora_A/lora_B or down/up "
                                   "weights) found")
    logger.info("Resizing Lora on %s...", device)
    state_dict, old_dim, new_alpha, report = resize_lora_model(
        lora_sd, args.new_rank, new_conv_rank, save_dtype, device, args.dynamic_method, args.dynamic_param,
        args.verbose)
    if report:
        print(report)

    comment = metadata.get("ss_training_comment", "")
    if not args.dynamic_method:
        conv_desc = "" if args.new_rank == new_conv_rank else f" (conv: {new_conv_rank})"
        metadata["ss_training_comment"] = f"dimension is resized from {old_dim} to {args.new_rank}{conv_desc}; {comment}"
        metadata["ss_network_dim"] = str(args.new_rank)
        metadata["ss_network_alpha"] = str(new_alpha)
    else:
        metadata["ss_training_comment"] = (f"Dynamic resize with {args.dynamic_method}: {args.dynamic_param} from "
                                           f"{old_dim}; {comment}")
        metadata["ss_network_dim"] = "Dynamic"
        metadata["ss_network_alpha"] = "Dynamic"
    state_dict = lora_tools.cast_floats(state_dict, save_dtype)
    logger.info("saving model to: %s", args.save_to)
    lora_tools.save_lora(args.save_to, state_dict, metadata, overwrite=args.overwrite)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Resize a LoRA to a lower rank (fixed or dynamic)")
    parser.add_argument("--save_precision", type=str, default=None, choices=[None, "float", "fp16", "bf16"],
                        help="precision in saving, float if omitted")
    parser.add_argument("--new_rank", type=int, default=4,
                        help="rank of the output LoRA (the upper bound with --dynamic_method)")
    parser.add_argument("--new_conv_rank", type=int, default=None,
                        help="rank of the output LoRA for Conv2d layers (default: --new_rank)")
    parser.add_argument("--save_to", type=str, default=None, help="output file: .safetensors, .ckpt, .pt or .pth")
    parser.add_argument("--model", type=str, default=None, help="LoRA to resize: .safetensors or .ckpt/.pt")
    lora_tools.add_device_argument(parser)
    parser.add_argument("--verbose", action="store_true",
                        help="print each module's retained sum(S), Frobenius norm and max(S) ratio")
    parser.add_argument("--dynamic_method", type=str, default=None, choices=[None, *lora_tools.DYNAMIC_METHODS],
                        help="pick each module's rank from its singular values; --new_rank is the upper bound")
    parser.add_argument("--dynamic_param", type=float, default=None,
                        help="target of --dynamic_method (sv_ratio: max ratio of kept singular values, e.g. 8; "
                             "sv_fro / sv_cumulative: the fraction to keep, e.g. 0.9)")
    lora_tools.add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return lora_tools.run_tool(setup_parser(), resize, argv)


if __name__ == "__main__":
    raise SystemExit(main())

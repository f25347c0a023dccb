"""Merge LoRAs into one LoRA of a chosen rank by SVD (kohya-ss/sd-scripts' networks/svd_merge_lora.py, same
options and file):

    python sd-scripts/networks/svd_merge_lora.py --save_to ab.safetensors --models a.safetensors b.safetensors \
        --ratios 0.7 0.5 --new_rank 32 [--new_conv_rank 16] [--lbws "[...]" "[...]"]

Each module's sum of ratio * up x down * alpha / rank over the LoRAs is decomposed and cut to --new_rank
(--new_conv_rank for 3x3 convs; at most the layer's size), alpha = rank, the values clamped at their 0.99
quantile (upstream's rule). The LoRAs may have different ranks. The SVDs run batched in float32 on the GPU when
there is one.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library import lora_tools  # noqa: E402

logger = lora_tools.logger
CLAMP_QUANTILE = 0.99


def merge_lora_models(models, ratios, lbws, new_rank: int, new_conv_rank: int, device, merge_dtype):
    """(state dict, minimum metadata, ss_v2 == "True", ss_base_model_version) as upstream's merge_lora_models."""
    logger.info("new rank: %s, new conv rank: %s", new_rank, new_conv_rank)
    weights, is_sdxl, targets = lora_tools.parse_lbws(lbws) if lbws else ([None] * len(models), False, [])
    ups: dict[str, list[torch.Tensor]] = {}
    downs: dict[str, list[torch.Tensor]] = {}
    shapes: dict[str, tuple] = {}
    v2 = base_model = family = None
    for path, ratio, lbw in zip(models, ratios, weights):
        logger.info("loading: %s", path)
        sd, md = lora_tools.load_lora(path, merge_dtype)
        fam = lora_tools.lora_family(sd)
        if fam is not None and family is not None and fam != family:
            raise lora_tools.ToolError(f"{path}: {lora_tools.A_FAMILY[fam]} LoRA, the LoRAs before it are "
                                       f"{lora_tools.FAMILY_NAMES[family]}")
        family = family or fam
        v2 = md.get("ss_v2") if v2 is None else v2
        base_model = md.get("ss_base_model_version") if base_model is None else base_model
        layer_w = lora_tools.lbw_layer_weights(lbw, targets) if lbw is not None else None
        for name, m in lora_tools.lora_modules(sd).items():
            shape = (m.up.shape[0], *m.down.shape[1:])
            if shapes.setdefault(name, shape) != shape:
                raise lora_tools.ToolError(f"{path}: module {name} is for a layer of shape {shape}, the LoRAs "
                                           f"before it for {shapes[name]}: LoRAs of different models")
            factor = ratio * m.scale * lora_tools.lbw_factor(name, layer_w, targets, is_sdxl)
            ups.setdefault(name, []).append(m.up.reshape(m.up.shape[0], -1).float() * factor)
            downs.setdefault(name, []).append(m.down.reshape(m.rank, -1).float())
    # the summed weights as full matrices and upstream's full SVD of them: the 0.99 clamp below depends on the
    # signs the SVD gives its vectors, and the same decomposition gives upstream's signs
    mats = {n: torch.cat(ups[n], dim=1).to(device) @ torch.cat(downs[n], dim=0).to(device) for n in ups}
    out = {}
    logger.info("extract new lora...")
    with torch.no_grad():
        results = {}
        for name, U, S, Vh in lora_tools.svd_many(mats, device, desc="svd merge"):
            shape = shapes[name]
            conv3 = len(shape) == 4 and tuple(shape[2:]) != (1, 1)
            rank = min(new_conv_rank if conv3 else new_rank, shape[0], shape[1])
            up, down = lora_tools.truncate(U, S, Vh, rank)
            up, down = lora_tools.clamp_quantile(up, down, CLAMP_QUANTILE)
            results[name] = lora_tools.to_lora_shapes(up.cpu(), down.cpu(), shape) + (rank,)
        for name in mats:
            up, down, rank = results[name]
            out[name + ".lora_up.weight"] = up.contiguous()
            out[name + ".lora_down.weight"] = down.contiguous()
            out[name + ".alpha"] = torch.tensor(rank)  # an integer tensor, as upstream writes it
    md = lora_tools.minimum_metadata(v2, base_model, "networks.lora", str(new_rank), str(new_rank),
                                     {"conv_dim": new_conv_rank, "conv_alpha": new_conv_rank})
    return out, md, v2 == "True", base_model


def merge(args: argparse.Namespace) -> None:
    lora_tools.check_models_ratios(args.models, args.ratios, args.lbws)
    lora_tools.output_path(args.save_to, "--save_to", args.overwrite)
    if args.new_rank < 1 or (args.new_conv_rank is not None and args.new_conv_rank < 1):
        raise lora_tools.ToolError("--new_rank / --new_conv_rank must be at least 1")
    merge_dtype = lora_tools.str_to_dtype(args.precision, "--precision")
    save_dtype = lora_tools.str_to_dtype(args.save_precision) or merge_dtype
    new_conv_rank = args.new_conv_rank if args.new_conv_rank is not None else args.new_rank
    state_dict, md, v2, base_model = merge_lora_models(args.models, args.ratios, args.lbws or None, args.new_rank,
                                                       new_conv_rank, lora_tools.pick_device(args.device),
                                                       merge_dtype)
    state_dict = lora_tools.cast_floats(state_dict, save_dtype)
    if not args.no_metadata:
        is_sdxl = base_model is not None and base_model.lower().startswith("sdxl")
        family = "sdxl" if is_sdxl else "sd2" if v2 else "sd1"
        if base_model is not None and base_model.lower().startswith("flux"):
            family = "flux"
        md.update(lora_tools.modelspec(family, lora=True, title=Path(args.save_to).stem,
                                       merged=lora_tools.merged_from(args.models), v_prediction=v2,
                                       flux_variant="dev" if family == "flux" else None))
        if v2:
            logger.warning("Cannot determine if LoRA is for v-prediction, so save metadata as v-prediction")
    logger.info("saving model to: %s", args.save_to)
    lora_tools.save_lora(args.save_to, state_dict, md, overwrite=args.overwrite)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Merge LoRAs into one LoRA of a chosen rank (SVD)")
    lora_tools.add_precision_arguments(parser)
    parser.add_argument("--save_to", type=str, default=None, help="output file: .safetensors, .ckpt or .pt")
    lora_tools.add_models_arguments(parser, lbws=True)
    parser.add_argument("--new_rank", type=int, default=4, help="rank of the output LoRA")
    parser.add_argument("--new_conv_rank", type=int, default=None,
                        help="rank of the output LoRA for 3x3 convs (default: --new_rank)")
    lora_tools.add_device_argument(parser)
    lora_tools.add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return lora_tools.run_tool(setup_parser(), merge, argv)


if __name__ == "__main__":
    raise SystemExit(main())

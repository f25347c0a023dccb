"""Extract a LoRA from the difference of two SD1.x/SD2.x/SDXL models (kohya-ss/sd-scripts'
networks/extract_lora_from_models.py, same options and file):

    python sd-scripts/networks/extract_lora_from_models.py --sdxl --model_org base.safetensors \
        --model_tuned tuned.safetensors --save_to lora.safetensors --dim 32 [--conv_dim 16]

Each target layer's weight difference (tuned - original) is decomposed by SVD and cut to --dim (--conv_dim for
3x3 convs; convs are extracted only with --conv_dim), alpha = rank, values clamped at --clamp_quantile. The text
encoders are extracted only when they differ by more than --min_diff. Models are read as the trainers read them
(single file or diffusers folder) in --load_precision onto --load_original_model_to / --load_tuned_model_to (default:
the GPU when there is one); the top singular triplets come from each difference's Gram matrix in float64 there
(lora_tools.top_svd_many: upstream's full SVD's within float32 noise).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from library import lora_tools  # noqa: E402

logger = lora_tools.logger


def svd(args: argparse.Namespace) -> None:
    if args.v2 and args.sdxl:
        raise lora_tools.ToolError("--v2 and --sdxl cannot be given together (SD2.x or SDXL)")
    lora_tools.check_inputs([args.model_org], "--model_org")
    lora_tools.check_inputs([args.model_tuned], "--model_tuned")
    lora_tools.output_path(args.save_to, "--save_to", args.overwrite)
    lora_tools.check_extract_arguments(args)
    family = "sdxl" if args.sdxl else "sd2" if args.v2 else "sd1"
    v_parameterization = args.v2 if args.v_parameterization is None else args.v_parameterization
    load_dtype = lora_tools.str_to_dtype(args.load_precision, "--load_precision")
    save_dtype = lora_tools.str_to_dtype(args.save_precision)
    device = lora_tools.pick_device(args.device)
    org_device = torch.device(args.load_original_model_to) if args.load_original_model_to else device
    tuned_device = torch.device(args.load_tuned_model_to) if args.load_tuned_model_to else device

    logger.info("loading original %s model: %s", lora_tools.FAMILY_NAMES[family], args.model_org)
    org = lora_tools.load_sd_model(args.model_org, family, load_dtype or lora_tools.stored_dtype(args.model_org),
                                   org_device)
    logger.info("loading tuned %s model: %s", lora_tools.FAMILY_NAMES[family], args.model_tuned)
    tuned = lora_tools.load_sd_model(args.model_tuned, family,
                                     load_dtype or lora_tools.stored_dtype(args.model_tuned), tuned_device)
    conv = args.conv_dim is not None
    layers_o = lora_tools.sd_layer_map(org.text_encoders, org.unet, conv=conv)
    layers_t = lora_tools.sd_layer_map(tuned.text_encoders, tuned.unet, conv=conv)
    if set(layers_o) != set(layers_t) or any(layers_o[n].weight.shape != layers_t[n].weight.shape for n in layers_o):
        raise lora_tools.ToolError(f"{args.model_org} and {args.model_tuned} are different architectures "
                                   "(e.g. SD1.x and SD2.x): a LoRA is extracted from two models of one kind")
    diffs, ranks = {}, {}
    te_different = False
    with torch.no_grad():
        for name in layers_o:
            diff = layers_t[name].weight.to(device, torch.float32) - layers_o[name].weight.to(device, torch.float32)
            if name.startswith("lora_te"):
                if not te_different and float(diff.abs().max()) > args.min_diff:
                    te_different = True
                    logger.info("Text encoder is different. %s > %s", float(diff.abs().max()), args.min_diff)
            conv3 = diff.dim() == 4 and tuple(diff.shape[2:]) != (1, 1)
            diffs[name] = diff
            ranks[name] = args.conv_dim if conv3 and conv else args.dim
    if not te_different:
        logger.warning("Text encoder is same. Extract U-Net only.")
        diffs = {n: d for n, d in diffs.items() if not n.startswith("lora_te")}
    del org, tuned, layers_o, layers_t
    logger.info("calculating by svd on %s", device)
    lora_sd = lora_tools.extract_from_diffs(diffs, ranks, device, args.clamp_quantile, save_dtype)

    net_kwargs = {}
    if conv:
        net_kwargs = {"conv_dim": str(args.conv_dim), "conv_alpha": str(float(args.conv_dim))}
    base_model = lora_tools.BASE_MODEL_VERSIONS["sdxl"] if args.sdxl else \
        "sd" + ("_v2" if args.v2 else "_v1") + ("_v" if v_parameterization else "")
    metadata = {"ss_v2": str(args.v2), "ss_base_model_version": base_model, "ss_network_module": "networks.lora",
                "ss_network_dim": str(args.dim), "ss_network_alpha": str(float(args.dim)),
                "ss_network_args": json.dumps(net_kwargs)}
    if not args.no_metadata:
        metadata.update(lora_tools.modelspec(family, lora=True, title=Path(args.save_to).stem,
                                             v_prediction=bool(v_parameterization)))
    lora_tools.save_lora(args.save_to, lora_sd, metadata, overwrite=args.overwrite)
    logger.info("LoRA weights are saved to: %s", args.save_to)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Extract a LoRA from the difference of two SD/SDXL models")
    parser.add_argument("--v2", action="store_true", help="the models are Stable Diffusion 2.x")
    parser.add_argument("--v_parameterization", action="store_true", default=None,
                        help="write the LoRA's metadata for v-parameterization (default: same as --v2)")
    parser.add_argument("--sdxl", action="store_true", help="the models are SDXL")
    parser.add_argument("--load_precision", type=str, default=None, choices=[None, "float", "fp16", "bf16"],
                        help="precision the models are loaded in (default: as stored; a diffusers folder: float)")
    parser.add_argument("--model_org", type=str, default=None, required=True,
                        help="original model: single file (.safetensors/.ckpt) or diffusers folder")
    parser.add_argument("--model_tuned", type=str, default=None, required=True,
                        help="tuned model (the LoRA is the difference original -> tuned): single file or folder")
    parser.add_argument("--save_to", type=str, default=None, required=True,
                        help="output file: .safetensors, .ckpt or .pt")
    lora_tools.add_extract_arguments(parser)
    parser.add_argument("--conv_dim", type=int, default=None,
                        help="rank of the LoRA for 3x3 convs (convs are extracted only when given)")
    parser.add_argument("--min_diff", type=float, default=0.01,
                        help="text encoders that differ by at most this much are left out of the LoRA")
    parser.add_argument("--load_original_model_to", type=str, default=None,
                        help="device the original model is loaded to (default: --device)")
    parser.add_argument("--load_tuned_model_to", type=str, default=None,
                        help="device the tuned model is loaded to (default: --device)")
    lora_tools.add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return lora_tools.run_tool(setup_parser(), svd, argv)


if __name__ == "__main__":
    raise SystemExit(main())

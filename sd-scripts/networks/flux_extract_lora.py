"""Extract a LoRA from the difference of two FLUX.1 transformers (kohya-ss/sd-scripts'
networks/flux_extract_lora.py, same options and file):

    python sd-scripts/networks/flux_extract_lora.py --model_org flux1-dev.safetensors \
        --model_tuned tuned.safetensors --save_to lora.safetensors --dim 16

Every Linear weight of the double and single blocks (not biases or norms) is differenced and decomposed by SVD,
cut to --dim (alpha = rank) and clamped at --clamp_quantile; the keys are kohya's FLUX.1 names
(lora_unet_double_blocks_0_img_attn_qkv, ...), as networks.lora_flux writes them. BFL single files are read
tensor by tensor (straight onto --device); a diffusers folder is converted to BFL names. Only the top --dim
singular triplets are computed, from the eigendecomposition of each difference's 3072 x 3072 Gram matrix in
float64 on the GPU when there is one (lora_tools.top_svd_many: upstream's full SVD's within float32 noise).
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


class _Weights:
    """Tensors of a BFL file read one at a time (safetensors' safe_open, straight onto the device), or of a
    diffusers folder converted to BFL keys."""

    def __init__(self, path: str, flag: str, device: torch.device):
        self.path, self.device = path, device
        if os.path.isdir(path):
            self.sd, _ = lora_tools.flux_transformer_state_dict(path, flag, "cpu")
            self.keys = list(self.sd)
            self.file = None
        else:
            if not os.path.isfile(path):
                raise lora_tools.ToolError(f"{flag}: not found: {path}")
            from safetensors import safe_open

            try:
                self.file = safe_open(path, framework="pt", device=str(device))
            except Exception as e:  # noqa: BLE001
                raise lora_tools.ToolError(f"{flag} {path}: cannot read it as safetensors ({e})") from e
            self.keys = list(self.file.keys())
            self.sd = None
        if not any("double_blocks." in k or "single_blocks." in k for k in self.keys):
            raise lora_tools.ToolError(f"{flag} {path}: no FLUX.1 transformer (no double_blocks / single_blocks "
                                       "weights)")

    def shape(self, key: str) -> tuple:
        return tuple(self.file.get_slice(key).get_shape()) if self.file is not None else tuple(self.sd[key].shape)

    def get(self, key: str) -> torch.Tensor:
        return (self.file.get_tensor(key) if self.file is not None else self.sd[key]).to(self.device)


def _target(key: str) -> bool:
    return ("single_block" in key or "double_block" in key) and ".bias" not in key and "norm" not in key


def svd(args: argparse.Namespace) -> None:
    lora_tools.output_path(args.save_to, "--save_to", args.overwrite, suffixes=(".safetensors",))
    lora_tools.check_extract_arguments(args)
    save_dtype = lora_tools.str_to_dtype(args.save_precision)
    device = lora_tools.pick_device(args.device)
    org = _Weights(args.model_org, "--model_org", device)
    tuned = _Weights(args.model_tuned, "--model_tuned", device)
    org_names = lora_tools.lora_name_map([k for k in org.keys if _target(k)], "lora_unet")
    tuned_names = lora_tools.lora_name_map([k for k in tuned.keys if _target(k)], "lora_unet")
    if set(org_names) != set(tuned_names):
        raise lora_tools.ToolError(f"{args.model_org} and {args.model_tuned} have different blocks: a LoRA is "
                                   "extracted from two models of one architecture")
    # same-shaped weights together, as much as one batch takes, so the models are never whole in memory
    names = sorted(org_names, key=lambda n: org.shape(org_names[n]))
    lora_sd: dict[str, torch.Tensor] = {}
    chunk: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal chunk, size
        if chunk:
            lora_sd.update(lora_tools.extract_from_diffs(chunk, dict.fromkeys(chunk, args.dim), device,
                                                         args.clamp_quantile, save_dtype, desc=None,
                                                         alpha_dtype=torch.int64))  # as upstream writes it
        chunk, size = {}, 0

    for name in lora_tools.progress(names, "extracting"):
        o, t = org.get(org_names[name]), tuned.get(tuned_names[name])
        if o.shape != t.shape:
            raise lora_tools.ToolError(f"{org_names[name]}: shape {tuple(o.shape)} in --model_org, "
                                       f"{tuple(t.shape)} in --model_tuned: different models")
        chunk[name] = t.to(torch.float32) - o.to(torch.float32)
        size += chunk[name].numel()
        if size >= lora_tools.SVD_BATCH_ELEMENTS:
            flush()
    flush()
    metadata = {"ss_v2": "False", "ss_base_model_version": lora_tools.BASE_MODEL_VERSIONS["flux"],
                "ss_network_module": "networks.lora_flux", "ss_network_dim": str(args.dim),
                "ss_network_alpha": str(float(args.dim)), "ss_network_args": json.dumps({})}
    if not args.no_metadata:
        metadata.update(lora_tools.modelspec("flux", lora=True, title=Path(args.save_to).stem, flux_variant="dev"))
    lora_tools.save_lora(args.save_to, lora_sd, metadata, overwrite=args.overwrite)
    logger.info("LoRA weights saved to %s", args.save_to)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Extract a LoRA from the difference of two FLUX.1 models")
    parser.add_argument("--model_org", type=str, default=None, required=True,
                        help="original model: BFL .safetensors file or diffusers folder")
    parser.add_argument("--model_tuned", type=str, default=None, required=True,
                        help="tuned model (the LoRA is the difference original -> tuned): file or folder")
    parser.add_argument("--mem_eff_safe_open", action="store_true",
                        help="accepted for compatibility: the files are always read one tensor at a time")
    parser.add_argument("--save_to", type=str, default=None, required=True, help="output file: .safetensors")
    lora_tools.add_extract_arguments(parser)
    lora_tools.add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return lora_tools.run_tool(setup_parser(), svd, argv)


if __name__ == "__main__":
    raise SystemExit(main())

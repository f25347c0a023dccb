"""LoRA for HunyuanImage 2.1 in kohya-ss/sd-scripts' key format (its networks.lora_hunyuan_image).

Every Linear of the DiT's MMDoubleStreamBlock / MMSingleStreamBlock modules (library.hunyuan_image_models, whose
module paths are upstream's): `lora_unet_double_blocks_N_img_attn_qkv`, `..._img_mod_linear`, `..._img_mlp_fc1`,
`..._txt_attn_proj` ..., `lora_unet_single_blocks_N_linear1` / `linear2` / `modulation_linear` (ComfyUI-loadable, as
upstream). No text-encoder LoRA (upstream has none).

``--network_args`` (upstream's names): ``network_reg_dims`` / ``network_reg_lrs`` (``regex=value,...`` on the LoRA
names), ``rank_dropout``, ``module_dropout``, ``ggpo_sigma`` / ``ggpo_beta``, ``verbose``, LoRA+ ratios,
``conv_dim`` / ``conv_alpha`` (accepted: the blocks have no convolutions), networks.lora's ``dora_wd`` /
``wd_on_output``, ``split_qkv`` (one LoRA each for q, k, v (and the single blocks' MLP rows) of the fused
``img_attn_qkv`` / ``txt_attn_qkv`` / ``linear1`` layers, saved fused as upstream).
"""
from __future__ import annotations

import logging
import re
from typing import Any

from torch import nn

from networks import lora as lora_sd
from networks.lora_flux import FluxLoRAModule, LoRANetworkFlux, parse_regex_values

logger = logging.getLogger(__name__)

FAMILIES = ("hunyuan_image",)
LORA_PREFIX_HUNYUAN_IMAGE_DIT = "lora_unet"
TARGET_REPLACE_MODULES = ("MMDoubleStreamBlock", "MMSingleStreamBlock")

NETWORK_ARGS: dict[str, Any] = {
    "rank_dropout": float, "module_dropout": float, "conv_dim": int, "conv_alpha": float,
    "split_qkv": lora_sd.arg_bool, "verbose": lora_sd.arg_bool, "network_reg_dims": str, "network_reg_lrs": str,
    "ggpo_sigma": float, "ggpo_beta": float,
    **{name: float for name in lora_sd.LORAPLUS_ARGS},
    **lora_sd.DORA_ARGS,
}


class LoRANetworkHunyuanImage(LoRANetworkFlux):
    """The LoRA module, DoRA, GGPO, LoRA+ and training methods are networks.lora_flux's; only the modules (upstream's
    DiT blocks) are HunyuanImage's."""

    TE_PREFIXES = ()

    def __init__(self, dit: nn.Module, multiplier: float = 1.0, lora_dim: int = 4, alpha: float = 1.0,
                 dropout: float | None = None, rank_dropout: float | None = None,
                 module_dropout: float | None = None, modules_dim: dict[str, int] | None = None,
                 modules_alpha: dict[str, float] | None = None, reg_dims: dict[str, int] | None = None,
                 reg_lrs: dict[str, float] | None = None, ggpo_sigma: float | None = None,
                 ggpo_beta: float | None = None, split_qkv: bool = False, verbose: bool = False):
        nn.Module.__init__(self)
        self._set_options(multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout)
        self.is_sdxl = False
        self.train_blocks, self.split_qkv, self.train_t5xxl, self.reg_lrs = "all", split_qkv, False, reg_lrs
        skipped: list[str] = []
        self.text_encoder_loras: list[FluxLoRAModule] = []
        self.unet_loras: list[FluxLoRAModule] = []
        for path, child in lora_sd.target_layers(dit, TARGET_REPLACE_MODULES):
            if not isinstance(child, nn.Linear):
                continue
            name = f"{LORA_PREFIX_HUNYUAN_IMAGE_DIT}_{path}".replace(".", "_")
            if modules_dim is not None:
                dim, a = lora_sd.file_dim_alpha(name, modules_dim, modules_alpha) or (None, None)
            else:
                dim, a = next(((d, alpha) for rx, d in (reg_dims or {}).items() if re.search(rx, name)),
                              (lora_dim, alpha))
            if not dim:
                if modules_dim is None:
                    skipped.append(name)
                continue
            self.unet_loras.append(FluxLoRAModule(name, [child], multiplier, dim, a, dropout, rank_dropout,
                                                  module_dropout, ggpo_sigma=ggpo_sigma, ggpo_beta=ggpo_beta,
                                                  split=split_qkv, pieces=qkv_pieces(name, child)))
        self._check_unique_names()
        logger.info("LoRA for HunyuanImage 2.1: %d modules", len(self.unet_loras))
        if verbose:
            for m in self.unet_loras:
                logger.info("\t%-50s dim %d, alpha %s", m.lora_name, m.lora_dim, float(m.alpha))
            if skipped:
                logger.info("%d modules skipped (dim 0): %s", len(skipped), ", ".join(skipped))


def qkv_pieces(name: str, layer: nn.Linear) -> list[int] | None:
    """split_qkv's row widths, as upstream splits them: a double block's qkv into q, k, v; a single block's linear1
    into q, k, v and the MLP input."""
    width = layer.in_features
    if "double" in name and "qkv" in name:
        return [width] * 3
    if "single" in name and "linear1" in name:
        return [width] * 3 + [layer.out_features - 3 * width]
    return None


def parse_network_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Typed --network_args, checked before any model loads."""
    out = lora_sd.parse_network_kwargs(kwargs, NETWORK_ARGS, "networks.lora_hunyuan_image")
    for key, cast in (("network_reg_dims", int), ("network_reg_lrs", float)):
        if key in out:
            parse_regex_values(key, out[key], cast)
    return out


def _regex(opts, key, cast):
    return parse_regex_values(key, opts[key], cast) if key in opts else None


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, vae, text_encoders, dit,
                   neuron_dropout: float | None = None, **kwargs) -> LoRANetworkHunyuanImage:
    """kohya's entry point; kwargs are --network_args."""
    opts = parse_network_kwargs(kwargs)
    network = LoRANetworkHunyuanImage(
        dit, multiplier=multiplier, lora_dim=network_dim or 4, alpha=1.0 if network_alpha is None else network_alpha,
        dropout=neuron_dropout, rank_dropout=opts.get("rank_dropout"), module_dropout=opts.get("module_dropout"),
        reg_dims=_regex(opts, "network_reg_dims", int), reg_lrs=_regex(opts, "network_reg_lrs", float),
        ggpo_sigma=opts.get("ggpo_sigma"), ggpo_beta=opts.get("ggpo_beta"), split_qkv=opts.get("split_qkv", False),
        verbose=opts.get("verbose", False))
    lora_sd.apply_loraplus_and_dora(network, opts)
    return network


def create_network_from_weights(multiplier: float, file: str | None, vae, text_encoders, dit,
                                weights_sd: dict | None = None, for_inference: bool = False,
                                neuron_dropout: float | None = None, **kwargs):
    """A network shaped like a LoRA file (its modules, dims and alphas)."""
    return lora_sd.network_from_weights(
        lambda shape, opts, sd: LoRANetworkHunyuanImage(dit, reg_lrs=_regex(opts, "network_reg_lrs", float), **shape),
        file, weights_sd, kwargs, parse_network_kwargs, multiplier=multiplier, neuron_dropout=neuron_dropout)

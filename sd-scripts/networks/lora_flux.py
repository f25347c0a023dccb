"""LoRA for FLUX.1 in kohya-ss/sd-scripts' FLUX key format.

The model is diffusers' FluxTransformer2DModel, but the LoRA is shaped and named after the BFL modules, which is
what kohya, ComfyUI, Forge and diffusers' kohya-FLUX converter expect:

- ``lora_unet_double_blocks_N_{img,txt}_attn_qkv``: ONE down (in -> r) and ONE up (r -> 3 x width) for the fused
  BFL qkv; here the up is split row-wise over diffusers' to_q/to_k/to_v (add_*_proj for txt), which is the
  same function;
- ``lora_unet_double_blocks_N_{img,txt}_attn_proj``, ``..._{img,txt}_mlp_{0,2}``;
- ``lora_unet_single_blocks_N_linear1`` (up split over to_q/to_k/to_v/proj_mlp) and ``..._linear2``;
- modulation layers (``img_mod``/``txt_mod``/``modulation``) are left out, as in sd-scripts;
- ``lora_te1_text_model_encoder_layers_N_{self_attn_{q,k,v,out}_proj,mlp_fc{1,2}}`` for CLIP-L when the text
  encoder is trained (no ``--network_train_unet_only``). T5-XXL is never trained.

``--network_args``: ``train_blocks=all|single|double`` (which transformer blocks get LoRA; default all),
``rank_dropout``, ``module_dropout``.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from library import flux_models
from library.model_util import text_encoder_hf_module_names
from networks import lora as lora_sd
from networks.lora import NetworkArgsError, load_lora_state_dict

logger = logging.getLogger(__name__)

LORA_PREFIX_FLUX = "lora_unet"
LORA_PREFIX_CLIP_L = "lora_te1"
TRAIN_BLOCKS = ("all", "single", "double")
EXCLUDED_BFL_MODULES = ("img_mod", "txt_mod", "modulation")
NETWORK_ARGS = {"train_blocks": str, "rank_dropout": float, "module_dropout": float}


class FluxLoRAModule(lora_sd.LoRABase):
    """LoRA over one BFL Linear that diffusers may hold as several Linear layers fed the same input.

    org_i(x) + up[rows of part i](down(x)) * multiplier * alpha / dim, for each diffusers part i."""

    def __init__(self, lora_name: str, org_modules: list[nn.Linear], multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: float | None = 1.0, dropout: float | None = None, rank_dropout: float | None = None,
                 module_dropout: float | None = None):
        in_dims = {m.in_features for m in org_modules}
        if len(in_dims) != 1:
            raise ValueError(f"{lora_name}: parts have different input widths {sorted(in_dims)}")
        split = [m.out_features for m in org_modules]
        super().__init__(lora_name, nn.Linear(in_dims.pop(), lora_dim, bias=False),
                         nn.Linear(lora_dim, sum(split), bias=False), multiplier, lora_dim, alpha, dropout,
                         rank_dropout, module_dropout)
        self.split = split
        self._orgs = list(org_modules)  # plain list: not submodules, the network holds only LoRA weights
        self._org_forwards: list | None = None
        self._offsets = [sum(self.split[:i]) for i in range(len(self.split))]

    def apply_to(self) -> None:
        self._org_forwards = [m.forward for m in self._orgs]
        for i, m in enumerate(self._orgs):
            m.forward = self._part_forward(i)

    def restore(self) -> None:
        if self._org_forwards is not None:
            for m, f in zip(self._orgs, self._org_forwards):
                m.forward = f
            self._org_forwards = None

    def _part_forward(self, i: int):
        def forward(x, *args, **kwargs):
            return self.forward_part(i, x, *args, **kwargs)

        return forward

    def forward_part(self, i: int, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        org = self._org_forwards[i](x, *args, **kwargs)
        up = None
        if len(self.split) > 1:
            up = self.lora_up.weight[self._offsets[i]: self._offsets[i] + self.split[i]]
        return self.add_lora(org, x, up)


class LoRANetworkFlux(lora_sd.LoRANetwork):
    """kohya FLUX LoRA network; training/saving/loading methods are networks.lora's."""

    def __init__(self, text_encoders: list[nn.Module], flux: nn.Module, multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: float = 1.0, dropout: float | None = None, rank_dropout: float | None = None,
                 module_dropout: float | None = None, train_blocks: str = "all",
                 modules_dim: dict[str, int] | None = None, modules_alpha: dict[str, float] | None = None):
        nn.Module.__init__(self)
        if train_blocks not in TRAIN_BLOCKS:
            raise NetworkArgsError(f"--network_args train_blocks={train_blocks}: allowed: {', '.join(TRAIN_BLOCKS)}")
        self._set_options(multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout)
        self.train_blocks = train_blocks

        def dim_alpha(name):
            if modules_dim is None:
                return lora_dim, alpha
            return lora_sd.file_dim_alpha(name, modules_dim, modules_alpha)

        def new(name, parts):
            da = dim_alpha(name)
            if da is None:
                return None
            return FluxLoRAModule(name, parts, multiplier, da[0], da[1], dropout, rank_dropout, module_dropout)

        # CLIP-L (text encoder 1), named after the canonical HF paths ("text_model.encoder...") as kohya does
        self.text_encoder_loras: list[FluxLoRAModule] = []
        if text_encoders:
            clip = text_encoders[0]
            te_names = text_encoder_hf_module_names(clip)
            for path, child in lora_sd.target_layers(clip, lora_sd.TEXT_ENCODER_TARGET_MODULES):
                if not isinstance(child, nn.Linear):
                    continue
                m = new(f"{LORA_PREFIX_CLIP_L}_{te_names.get(path, path)}".replace(".", "_"), [child])
                if m is not None:
                    self.text_encoder_loras.append(m)

        # FLUX transformer, named after the BFL modules
        cfg = flux.config
        mapping = flux_models.bfl_linear_map(cfg.num_layers, cfg.num_single_layers, cfg.guidance_embeds)
        modules = dict(flux.named_modules())
        self.unet_loras: list[FluxLoRAModule] = []
        for bfl, parts in mapping.items():
            is_double, is_single = bfl.startswith("double_blocks."), bfl.startswith("single_blocks.")
            if not (is_double or is_single):
                continue
            if (train_blocks == "single" and is_double) or (train_blocks == "double" and is_single):
                continue
            if any(x in bfl for x in EXCLUDED_BFL_MODULES):
                continue
            m = new(f"{LORA_PREFIX_FLUX}_{bfl}".replace(".", "_"), [modules[p] for p in parts])
            if m is not None:
                self.unet_loras.append(m)
        logger.info("LoRA for FLUX: %d modules for CLIP-L, %d for the transformer (train_blocks=%s)",
                    len(self.text_encoder_loras), len(self.unet_loras), train_blocks)


def parse_network_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = lora_sd.parse_network_kwargs(kwargs, NETWORK_ARGS, "networks.lora_flux")
    if out.get("train_blocks", "all") not in TRAIN_BLOCKS:
        raise NetworkArgsError(f"--network_args train_blocks={out['train_blocks']}: allowed: {', '.join(TRAIN_BLOCKS)}")
    return out


def _text_encoders(text_encoder) -> list:
    """kohya passes [clip_l, t5xxl]; only CLIP-L gets LoRA."""
    if text_encoder is None:
        return []
    tes = list(text_encoder) if isinstance(text_encoder, (list, tuple)) else [text_encoder]
    return [t for t in tes[:1] if t is not None]


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, ae, text_encoders,
                   flux, neuron_dropout: float | None = None, **kwargs) -> LoRANetworkFlux:
    """kohya's entry point; kwargs are --network_args."""
    opts = parse_network_kwargs(kwargs)
    return LoRANetworkFlux(_text_encoders(text_encoders), flux, multiplier=multiplier, lora_dim=network_dim or 4,
                           alpha=1.0 if network_alpha is None else network_alpha, dropout=neuron_dropout,
                           rank_dropout=opts.get("rank_dropout"), module_dropout=opts.get("module_dropout"),
                           train_blocks=opts.get("train_blocks", "all"))


def create_network_from_weights(multiplier: float, file: str | None, ae, text_encoders, flux,
                                weights_sd: dict | None = None, for_inference: bool = False, **kwargs):
    """A network shaped like a LoRA file (dims and alphas per module)."""
    if weights_sd is None:
        weights_sd = load_lora_state_dict(file)
    modules_dim, modules_alpha = lora_sd.dims_from_weights(weights_sd)
    opts = parse_network_kwargs(kwargs)
    network = LoRANetworkFlux(_text_encoders(text_encoders), flux, multiplier=multiplier, modules_dim=modules_dim,
                              modules_alpha=modules_alpha, rank_dropout=opts.get("rank_dropout"),
                              module_dropout=opts.get("module_dropout"))
    return network, weights_sd

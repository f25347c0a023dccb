"""OFT for the FLUX.1 transformer, as kohya-ss/sd-scripts' networks.oft_flux: networks.oft's rotation on each part.

Targets, named after the BFL modules as upstream: the attention projections of the double blocks
(`double_blocks.N.{img,txt}_attn.{qkv,proj}`, upstream's `SelfAttention`); with `--network_args
enable_all_linear=True` every Linear of the double and single blocks (modulation, MLP, linear1/linear2 too).
A fused BFL layer is rotated per part as upstream splits it: qkv in q, k, v; a single block's linear1 in q, k, v and
the MLP input (diffusers' separate layers here). Keys: `oft_unet_<BFL path with _>.oft_blocks.<part>` (dim x n x n,
n = the part's outputs / dim) and `.alpha`; the constraint of a part is alpha * its outputs. --network_dim = the
number of blocks (default 4), --network_alpha = the constraint (1e-3 when not given). The text encoders get no OFT.

Different on purpose: enable_all_linear takes true/false (upstream: any value enables); the part sizes come from
the model (upstream hard-codes FLUX.1's 3072 / 12288, so only full-size FLUX.1 works there).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from library import flux_models
from networks import lora, oft
from networks.lora import NetworkArgsError, load_lora_state_dict

logger = logging.getLogger(__name__)

NETWORK_ARGS = {"enable_all_linear": lora.arg_bool}
FAMILIES = ("flux",)  # sd1/sd2/sdxl: networks.oft
ATTN_PARTS = (".img_attn.", ".txt_attn.")  # upstream's SelfAttention modules (double blocks only)


class FluxOFTModule(nn.Module):
    """One BFL layer: a networks.oft module per diffusers part; saved in upstream's layout (`oft_blocks.<part>`,
    one `alpha`)."""

    def __init__(self, oft_name: str, parts: list[nn.Linear], multiplier: float = 1.0, dim: int = 4,
                 alpha: float | torch.Tensor = 1e-3):
        super().__init__()
        self.oft_name = self.lora_name = oft_name
        self.parts = nn.ModuleList([oft.OFTModule(f"{oft_name} (part {i})", p, multiplier, dim, alpha)
                                    for i, p in enumerate(parts)])
        self.register_state_dict_post_hook(_to_file_layout)
        self.register_load_state_dict_pre_hook(_from_file_layout)

    @property
    def multiplier(self) -> float:
        return self.parts[0].multiplier

    @multiplier.setter
    def multiplier(self, value: float) -> None:
        for p in self.parts:
            p.multiplier = value

    @property
    def oft_blocks(self) -> list[nn.Parameter]:
        return [p.oft_blocks for p in self.parts]

    def apply_to(self) -> None:
        for p in self.parts:
            p.apply_to()

    def restore(self) -> None:
        for p in self.parts:
            p.restore()

    def merge_to_org(self) -> None:
        for p in self.parts:
            p.merge_to_org()


def _to_file_layout(module, state_dict, prefix, local_metadata):
    for i in range(len(module.parts)):
        state_dict[f"{prefix}oft_blocks.{i}"] = state_dict.pop(f"{prefix}parts.{i}.oft_blocks")
        alpha = state_dict.pop(f"{prefix}parts.{i}.alpha")
        if i == 0:
            state_dict[f"{prefix}alpha"] = alpha


def _from_file_layout(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    alpha = state_dict.pop(f"{prefix}alpha", None)
    for i in range(len(module.parts)):
        if f"{prefix}oft_blocks.{i}" in state_dict:
            state_dict[f"{prefix}parts.{i}.oft_blocks"] = state_dict.pop(f"{prefix}oft_blocks.{i}")
        if alpha is not None:
            state_dict[f"{prefix}parts.{i}.alpha"] = alpha


class OFTNetworkFlux(oft.OFTNetwork):
    """networks.oft's network (apply, multiplier, merge, load) over the transformer's BFL layers."""

    def __init__(self, flux: nn.Module, multiplier: float = 1.0, dim: int = 4, alpha: float = 1e-3,
                 enable_all_linear: bool = False, names: set[str] | None = None):
        nn.Module.__init__(self)
        self.multiplier, self.dim, self.alpha = multiplier, dim, alpha
        cfg = flux.config
        modules = dict(flux.named_modules())
        self.unet_ofts: list[FluxOFTModule] = []
        for bfl, parts in flux_models.bfl_linear_map(cfg.num_layers, cfg.num_single_layers,
                                                     cfg.get("guidance_embeds", False)).items():
            name = f"{oft.OFT_PREFIX_UNET}_{bfl}".replace(".", "_")
            if not bfl.startswith(("double_blocks.", "single_blocks.")) or any(p not in modules for p in parts):
                continue  # Chroma's blocks have no modulation layers
            if names is not None:
                if name not in names:
                    continue
            elif not enable_all_linear and not any(t in f".{bfl}" for t in ATTN_PARTS):
                continue
            self.unet_ofts.append(FluxOFTModule(name, [modules[p] for p in parts], multiplier, dim, alpha))
        self.text_encoder_loras: list = []
        self.unet_loras = self.unet_ofts
        logger.info("OFT for FLUX.1: %d modules, %d blocks each, constraint %s (all linear %s)",
                    len(self.unet_ofts), dim, alpha, enable_all_linear)

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr, default_lr):
        self.requires_grad_(True)
        return [{"params": self.get_trainable_params(), "lr": default_lr if unet_lr is None else unet_lr}]

    def get_trainable_params(self):
        return [b for o in self.unet_ofts for b in o.oft_blocks]


def parse_network_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return lora.parse_network_kwargs(kwargs, NETWORK_ARGS, "networks.oft_flux")


def create_network(multiplier, network_dim, network_alpha, ae, text_encoders, flux, neuron_dropout=None, **kwargs):
    opts = parse_network_kwargs(kwargs)
    network_alpha = oft.constraint(network_alpha)
    if not hasattr(getattr(flux, "config", None), "num_single_layers"):
        raise NetworkArgsError("networks.oft_flux is for FLUX.1 (flux_train_network.py); use networks.oft for "
                               "SD1.x/SD2.x/SDXL")
    return OFTNetworkFlux(flux, multiplier, network_dim or 4, network_alpha, opts.get("enable_all_linear", False))


def create_network_from_weights(multiplier, file, ae, text_encoders, flux, weights_sd=None, for_inference=False,
                                **kwargs):
    """Blocks and constraint from the file; the targets are the file's modules."""
    if weights_sd is None:
        weights_sd = load_lora_state_dict(file)
    blocks = next(v for k, v in weights_sd.items() if ".oft_blocks." in k)
    alpha = float(next(v for k, v in weights_sd.items() if k.endswith(".alpha")))
    names = {k.split(".")[0] for k in weights_sd}
    return OFTNetworkFlux(flux, multiplier, blocks.shape[0], alpha, names=names), weights_sd

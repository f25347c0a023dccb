"""OFT (orthogonal fine-tuning, https://arxiv.org/abs/2306.07280) of the SD1.x/SD2.x/SDXL UNet in sd-scripts'
format (its networks.oft): each targeted layer's weight W (out rows) is rotated block-wise, W' = R^T W per block,
R = (I + Q)(I - Q)^-1 (Cayley) with Q = B - B^T from the trained blocks B, |Q| clamped to alpha * out.

- --network_dim = the number of blocks (out features must be divisible by it), --network_alpha = the constraint
  (default 1e-3 when unset; sd-scripts warns when it is >= 1);
- targets: the attention layers (sd-scripts' CrossAttention = diffusers' Attention: to_q/to_k/to_v/to_out.0);
  `--network_args enable_all_linear=True`: every Linear / 1x1 conv of the transformer blocks;
  `enable_conv=True`: also the ResNet / sampler convolutions. The text encoders get no OFT;
- keys `oft_unet_<kohya module path>.oft_blocks` [blocks, size, size] and `.alpha` (SGM paths for SDXL).

Deliberate differences: `enable_all_linear=False` / `enable_conv=False` mean False (sd-scripts' bool("False") is
True); the identity is a buffer, so compiled blocks do not see a Python attribute change.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from networks import lora
from networks.lora import NetworkArgsError, _kohya_unet_path, _unet_name_map, load_lora_state_dict

logger = logging.getLogger(__name__)

FAMILIES = ("sd1", "sd2", "sdxl")  # flux_train_network.py refuses it before anything loads
FOR_FLUX = "networks.oft_flux"

OFT_PREFIX_UNET = "oft_unet"
ATTN_TARGETS = ("Attention", "CrossAttention")
ALL_LINEAR_TARGETS = ("Transformer2DModel",)
CONV_TARGETS = lora.UNET_CONV_TARGET_MODULES


NETWORK_ARGS = {"enable_all_linear": lora.arg_bool, "enable_conv": lora.arg_bool}


class OFTModule(lora.WrapsLayer, nn.Module):
    def __init__(self, oft_name: str, org_module: nn.Module, multiplier: float = 1.0, dim: int = 4,
                 alpha: float = 1e-3):
        super().__init__()
        self.oft_name = self.lora_name = oft_name
        out_dim = org_module.out_channels if isinstance(org_module, nn.Conv2d) else org_module.out_features
        if out_dim % dim:
            raise NetworkArgsError(f"--network_dim {dim}: OFT needs it to divide the output size of every layer "
                                   f"({oft_name} has {out_dim})")
        alpha = float(alpha.detach().float().item() if isinstance(alpha, torch.Tensor) else alpha)
        self.num_blocks, self.block_size, self.out_dim = dim, out_dim // dim, out_dim
        self.register_buffer("alpha", torch.tensor(alpha))
        self.oft_blocks = nn.Parameter(torch.zeros(dim, self.block_size, self.block_size))
        self.register_buffer("eye", torch.eye(self.block_size).expand(dim, -1, -1).clone(), persistent=False)
        self.multiplier = multiplier
        self._org = [org_module]

    def rotation(self, multiplier: float | None = None) -> torch.Tensor:
        """R per block, moved towards I by the multiplier: multiplier * (R - I) + I."""
        multiplier = self.multiplier if multiplier is None else multiplier
        q = self.oft_blocks - self.oft_blocks.transpose(1, 2)
        norm = q.flatten().norm()
        q = q * ((norm.clamp(max=self.alpha * self.out_dim) + 1e-8) / (norm + 1e-8))
        eye = self.eye.to(q.device)
        r = (eye + q) @ torch.linalg.inv((eye - q).float()).to(q.dtype)
        return multiplier * (r - eye) + eye

    def rotated_weight(self, weight: torch.Tensor, multiplier: float | None = None) -> torch.Tensor:
        r = self.rotation(multiplier).float()
        w = weight.float().reshape(self.num_blocks, self.block_size, -1)
        return torch.einsum("knm,knp->kmp", r, w).reshape(weight.shape)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.multiplier == 0:
            return self.org_forward(x, *args, **kwargs)
        m = self.org_module
        w = self.rotated_weight(m.weight).to(x.dtype)
        bias = None if m.bias is None else m.bias.to(x.dtype)
        if isinstance(m, nn.Conv2d):
            return F.conv2d(x, w, bias, m.stride, m.padding, m.dilation, m.groups)
        return F.linear(x, w, bias)

    @torch.no_grad()
    def merge_to_org(self) -> None:
        w = self.org_module.weight
        w.data = self.rotated_weight(w.data).to(w.dtype)


class OFTNetwork(nn.Module):
    def __init__(self, unet: nn.Module, multiplier: float = 1.0, dim: int = 4, alpha: float = 1e-3,
                 enable_all_linear: bool = False, enable_conv: bool = False, unet_name_map=None,
                 names: set[str] | None = None):
        super().__init__()
        self.multiplier, self.dim, self.alpha = multiplier, dim, alpha
        targets = ALL_LINEAR_TARGETS if enable_all_linear else ATTN_TARGETS
        if enable_conv:
            targets = targets + CONV_TARGETS
        self.unet_ofts: list[OFTModule] = []
        seen = set()
        for path, child in lora.target_layers(unet, targets):
            is_1x1 = isinstance(child, nn.Linear) or tuple(child.kernel_size) == (1, 1)
            if not (is_1x1 or enable_conv):
                continue
            name = f"{OFT_PREFIX_UNET}_{_kohya_unet_path(path, unet_name_map)}".replace(".", "_")
            if name in seen or (names is not None and name not in names):
                continue
            seen.add(name)
            self.unet_ofts.append(OFTModule(name, child, multiplier, dim, alpha))
        self.text_encoder_loras: list = []
        self.unet_loras = self.unet_ofts  # the trainer's and sampler's view
        logger.info("OFT: %d UNet modules, %d blocks each, constraint %s (all linear %s, conv %s)",
                    len(self.unet_ofts), dim, alpha, enable_all_linear, enable_conv)

    def apply_to(self, text_encoders, unet, apply_text_encoder: bool = True, apply_unet: bool = True) -> None:
        if not apply_unet:
            raise NetworkArgsError("networks.oft trains the UNet only: drop --network_train_text_encoder_only")
        for oft in self.unet_ofts:
            oft.apply_to()
            self.add_module(oft.oft_name, oft)

    def remove_from(self) -> None:
        for oft in self.unet_ofts:
            oft.restore()

    def set_multiplier(self, multiplier: float) -> None:
        self.multiplier = multiplier
        for oft in self.unet_ofts:
            oft.multiplier = multiplier

    def is_mergeable(self) -> bool:
        return True

    @torch.no_grad()
    def merge_to(self, text_encoders, unet, weights_sd, dtype=None, device=None) -> None:
        for oft in self.unet_ofts:
            prefix = oft.oft_name + "."
            sd = {k[len(prefix):]: v for k, v in weights_sd.items() if k.startswith(prefix)}
            if sd:
                oft.load_state_dict(sd, strict=False)
                oft.merge_to_org()

    def load_weights(self, file: str):
        sd = load_lora_state_dict(file)
        own = self.state_dict()
        for k, v in sd.items():
            if k in own and v.shape != own[k].shape:
                raise lora.NetworkWeightsError(f"--network_weights {file}: {k} has shape {tuple(v.shape)}, this "
                                               f"network has {tuple(own[k].shape)} (different --network_dim?)")
        return self.load_state_dict(sd, strict=False)

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr, default_lr):
        self.requires_grad_(True)
        return [{"params": [o.oft_blocks for o in self.unet_ofts], "lr": default_lr if unet_lr is None else unet_lr}]

    def prepare_grad_etc(self, text_encoders, unet) -> None:
        self.requires_grad_(True)

    def on_epoch_start(self, text_encoders, unet) -> None:
        self.train()

    def get_trainable_params(self):
        return [o.oft_blocks for o in self.unet_ofts]


def parse_network_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return lora.parse_network_kwargs(kwargs, NETWORK_ARGS, "networks.oft")


def constraint(network_alpha: float | None) -> float:
    """--network_alpha as OFT reads it (networks.oft_flux too): 1e-3 when unset, a warning from 1 up."""
    if network_alpha is None:
        logger.info("network_alpha is not set: OFT uses the constraint 1e-3")
        return 1e-3
    if network_alpha >= 1:
        logger.warning("--network_alpha %s is large for OFT (it is the constraint); consider 1e-3", network_alpha)
    return network_alpha


def create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout=None, **kwargs):
    opts = parse_network_kwargs(kwargs)
    network_alpha = constraint(network_alpha)
    return OFTNetwork(unet, multiplier, network_dim or 4, network_alpha, opts.get("enable_all_linear", False),
                      opts.get("enable_conv", False), _unet_name_map(unet, text_encoder))


def create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None, for_inference=False,
                                **kwargs):
    """Blocks and constraint from the file; the targets are the file's modules."""
    if weights_sd is None:
        weights_sd = load_lora_state_dict(file)
    blocks = next(v for k, v in weights_sd.items() if k.endswith(".oft_blocks"))
    alpha = float(next(v for k, v in weights_sd.items() if k.endswith(".alpha")))
    names = {k.split(".")[0] for k in weights_sd}
    network = OFTNetwork(unet, multiplier, blocks.shape[0], alpha, enable_all_linear=True, enable_conv=True,
                         unet_name_map=_unet_name_map(unet, text_encoder), names=names)
    return network, weights_sd



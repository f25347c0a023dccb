"""DyLoRA (https://arxiv.org/abs/2210.07558) in sd-scripts' format (its networks.dylora): a LoRA of rank `dim` in
which every training forward draws a rank r (a multiple of `unit`), trains only the `unit` rank rows [r, r+unit)
of down/up (the others keep their values and get no gradient) and scales the LoRA by sqrt(dim / (r + unit)). The
file is a plain LoRA file (`lora_down.weight`, `lora_up.weight`, `alpha`) whose leading ranks can be cut out
(networks/extract_lora_from_dylora.py in sd-scripts).

--network_args: `unit` (default 1; dim must be a multiple), `conv_dim` (must equal --network_dim: the 3x3
convolutions get LoRA at that rank and --network_alpha), `conv_alpha` (accepted, unused as in sd-scripts),
`loraplus_lr_ratio`, `loraplus_unet_lr_ratio`, `loraplus_text_encoder_lr_ratio`.

Deliberate differences: the rank is drawn with torch's generator as a tensor, so a compiled block keeps one
graph (sd-scripts toggles requires_grad per rank with Python's `random`); outside training (sample images) the
full rank is used with no extra scale, which is what the saved file means (sd-scripts draws a rank there too);
SDXL's two text encoders are named lora_te1_/lora_te2_ as in networks.lora (sd-scripts' dylora names both
lora_te_, so the second overwrites the first).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from networks import lora
from networks.lora import NetworkArgsError

FAMILIES = ("sd1", "sd2", "sdxl")  # flux_train_network.py refuses it before anything loads
FOR_FLUX = "networks.lora_flux (upstream has no FLUX.1 DyLoRA)"

NETWORK_ARGS = {"unit": int, "conv_dim": int, "conv_alpha": float,
                **{k: float for k in lora.LORAPLUS_ARGS}}


class DyLoRAModule(lora.LoRAModule):
    unit = 1

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        org = self.org_forward(x, *args, **kwargs)
        down, up = self.lora_down.weight, self.lora_up.weight
        factor = 1.0
        if self.training:
            r = torch.randint(0, self.lora_dim, (), device=down.device)
            r = r - r % self.unit
            rank = torch.arange(self.lora_dim, device=down.device)
            live = ((rank >= r) & (rank < r + self.unit)).to(down.dtype)
            # values unchanged, gradient only for the drawn rank rows
            down = down.detach() + (down - down.detach()) * live.view(-1, *([1] * (down.dim() - 1)))
            up = up.detach() + (up - up.detach()) * live.view(1, -1, *([1] * (up.dim() - 2)))
            factor = torch.sqrt(self.lora_dim / (r + self.unit).to(torch.float32))
        x_in = x.to(down.dtype) if not torch.is_autocast_enabled(x.device.type) else x
        if self.is_conv:
            lx = F.conv2d(x_in, down, None, self.lora_down.stride, self.lora_down.padding)
            lx = F.conv2d(lx, up)
        else:
            lx = F.linear(F.linear(x_in, down), up)
        return org + (lx * (self.multiplier * self.scale * factor)).to(org.dtype)


def _module_class(unit: int):
    return type("DyLoRAModule", (DyLoRAModule,), {"unit": unit})


def parse_network_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return lora.parse_network_kwargs(kwargs, NETWORK_ARGS, "networks.dylora")


def create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout=None, **kwargs):
    opts = parse_network_kwargs(kwargs)
    dim = network_dim or 4
    alpha = 1.0 if network_alpha is None else network_alpha
    unit = opts.pop("unit", 1)
    if unit < 1 or dim % unit:
        raise NetworkArgsError(f"--network_args unit={unit}: --network_dim ({dim}) must be a multiple of it")
    if opts.get("conv_dim") is not None:
        if opts["conv_dim"] != dim:
            raise NetworkArgsError(f"--network_args conv_dim={opts['conv_dim']}: networks.dylora needs conv_dim "
                                   f"equal to --network_dim ({dim})")
        opts["conv_alpha"] = alpha  # sd-scripts' dylora uses network_alpha for the convolutions too
    # sd-scripts' DyLoRA has no dropouts
    return lora.build_network(multiplier, dim, alpha, text_encoder, unet, None, opts, None, _module_class(unit))


def create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None, for_inference=False,
                                neuron_dropout=None, **kwargs):
    opts = parse_network_kwargs(kwargs)
    unit = opts.pop("unit", 1)
    return lora.build_network_from_weights(multiplier, file, text_encoder, unet, weights_sd, None, opts, None,
                                           _module_class(unit))

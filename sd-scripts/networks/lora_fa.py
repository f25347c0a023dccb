"""LoRA-FA (https://arxiv.org/abs/2308.03303) in sd-scripts' format (its networks.lora_fa): a LoRA whose down
projection (A) is drawn from N(0, 2 / (in + dim)) and frozen; only the up projection (B) trains.

Targets, names, keys (`lora_down.weight`, `lora_up.weight`, `alpha`: a LoRA-FA file is a LoRA file) and
--network_args are networks.lora's without the LoRA+ ratios (sd-scripts' lora_fa is a copy of an older lora.py
with these two changes, from before LoRA+: it ignores loraplus_*, here they are refused as unknown; so is
networks.lora's dora_wd).
"""
from __future__ import annotations

import math
from typing import Any

from torch import nn

from networks import lora
from networks.lora import NetworkArgsError  # noqa: F401  (the trainer's error type)

NETWORK_ARGS = {k: v for k, v in lora.NETWORK_ARGS.items() if k not in lora.LORAPLUS_ARGS and k not in lora.DORA_ARGS}

FAMILIES = ("sd1", "sd2", "sdxl")  # flux_train_network.py refuses it before anything loads
FOR_FLUX = "networks.lora_flux (upstream has no FLUX.1 LoRA-FA)"


class LoRAFAModule(lora.LoRAModule):
    def __init__(self, lora_name, org_module, multiplier=1.0, lora_dim=4, alpha=1.0, dropout=None,
                 rank_dropout=None, module_dropout=None):
        super().__init__(lora_name, org_module, multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout)
        in_dim = org_module.in_channels if isinstance(org_module, nn.Conv2d) else org_module.in_features
        nn.init.normal_(self.lora_down.weight, std=math.sqrt(2.0 / (in_dim + lora_dim)))
        self.lora_down.weight.requires_grad_(False)

    def requires_grad_(self, requires_grad: bool = True):
        self.lora_up.requires_grad_(requires_grad)
        self.lora_down.requires_grad_(False)
        return self


class LoRAFANetwork(lora.LoRANetwork):
    def prepare_optimizer_params(self, text_encoder_lr, unet_lr, default_lr):
        """networks.lora's groups without the frozen down weights."""
        groups, descriptions = super().prepare_optimizer_params(text_encoder_lr, unet_lr, default_lr)
        frozen = {id(m.lora_down.weight) for m in self.text_encoder_loras + self.unet_loras}
        kept = []
        for group, desc in zip(groups, descriptions):
            params = [p for p in group["params"] if id(p) not in frozen]
            if params:
                kept.append(({**group, "params": params}, desc))
        for m in self.text_encoder_loras + self.unet_loras:
            m.lora_down.weight.requires_grad_(False)
        return [g for g, _ in kept], [d for _, d in kept]

    def prepare_grad_etc(self, text_encoders, unet) -> None:
        for m in self.text_encoder_loras + self.unet_loras:
            m.requires_grad_(True)

    def get_trainable_params(self):
        return [m.lora_up.weight for m in self.text_encoder_loras + self.unet_loras]


def parse_network_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return lora.parse_network_kwargs(kwargs, NETWORK_ARGS, "networks.lora_fa")


def create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout=None, **kwargs):
    return lora.build_network(multiplier, network_dim, network_alpha, text_encoder, unet, neuron_dropout,
                              parse_network_kwargs(kwargs), LoRAFANetwork, LoRAFAModule)


def create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None, for_inference=False,
                                neuron_dropout=None, **kwargs):
    return lora.build_network_from_weights(multiplier, file, text_encoder, unet, weights_sd, neuron_dropout,
                                           parse_network_kwargs(kwargs), LoRAFANetwork, LoRAFAModule)

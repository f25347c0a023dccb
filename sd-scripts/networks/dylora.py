"""DyLoRA (https://arxiv.org/abs/2210.07558) in sd-scripts' format (its networks.dylora): a LoRA of rank `dim` in
which every training forward draws a rank r (a multiple of `unit`), trains only the `unit` rank rows [r, r+unit)
of down/up (the others keep their values and get no gradient) and scales the LoRA by sqrt(dim / (r + unit)). The
file is a plain LoRA file (`lora_down.weight`, `lora_up.weight`, `alpha`) whose leading ranks can be cut out
(networks/extract_lora_from_dylora.py in sd-scripts).

--network_args: `unit` (default 1; dim must be a multiple), `conv_dim` (must equal --network_dim: the 3x3
convolutions get LoRA at that rank and --network_alpha), `conv_alpha` (accepted, unused as in sd-scripts),
`loraplus_lr_ratio`, `loraplus_unet_lr_ratio`, `loraplus_text_encoder_lr_ratio`.

As upstream, each module keeps one Parameter per rank (`RankRows`): the ranks a step did not draw get no gradient,
so the optimizer leaves them alone (no momentum, no weight decay); the file holds the stacked weights.

Deliberate differences: the rank is drawn with torch's generator (a gradient-checkpointing recompute draws the
same rank; sd-scripts uses Python's `random`), and the LoRA term runs outside a compiled graph (the draw would
recompile it; one graph break per module); outside training (sample images) the
full rank is used with no extra scale, which is what the saved file means (sd-scripts draws a rank there too);
SDXL's two text encoders are named lora_te1_/lora_te2_ as in networks.lora (sd-scripts' dylora names both
lora_te_, so the second overwrites the first).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from networks import lora
from networks.lora import NetworkArgsError

FAMILIES = ("sd1", "sd2", "sdxl")  # flux_train_network.py refuses it before anything loads
FOR_FLUX = "networks.lora_flux (upstream has no FLUX.1 DyLoRA)"

NETWORK_ARGS = {"unit": int, "conv_dim": int, "conv_alpha": float,
                **{k: float for k in lora.LORAPLUS_ARGS}}


# which dimension of each weight counts the ranks
RANK_DIM = {"lora_down": 0, "lora_up": 1}


class RankRows(nn.Module):
    """A LoRA layer (Linear, or Conv2d with the wrapped layer's kernel) kept as one Parameter per rank, as upstream's
    DyLoRA keeps it; `weight` is the whole weight (ranks stacked)."""

    def __init__(self, layer: nn.Module, rank_dim: int):
        super().__init__()
        self.rank_dim = rank_dim
        self.conv = (layer.stride, layer.padding) if isinstance(layer, nn.Conv2d) else None
        self.rows = nn.ParameterList([nn.Parameter(r.detach().clone()) for r in layer.weight.split(1, rank_dim)])

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat(tuple(self.rows), self.rank_dim)

    def forward(self, x: torch.Tensor, first: int = 0, count: int | None = None) -> torch.Tensor:
        """The layer with ranks first..first+count-1 trainable, the others detached (count None: all trainable)."""
        w = torch.cat([r if count is None or first <= i < first + count else r.detach()
                       for i, r in enumerate(self.rows)], self.rank_dim)
        return F.conv2d(x, w, None, *self.conv) if self.conv else F.linear(x, w)


class DyLoRAModule(lora.LoRAModule):
    unit = 1
    eager_in_compile = True  # _delta runs outside compiled graphs (library.compile.regional's log names it)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # networks.lora's layers and initialisation, then split into ranks
        self.lora_down = RankRows(self.lora_down, RANK_DIM["lora_down"])
        self.lora_up = RankRows(self.lora_up, RANK_DIM["lora_up"])

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        org = self.org_forward(x, *args, **kwargs)
        return org + self._delta(x).to(org.dtype)

    @torch.compiler.disable  # a rank drawn per call: a compiled block would recompile for every draw
    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            r = int(torch.randint(0, self.lora_dim, ()).item())
            first, count = r - r % self.unit, self.unit
            factor = math.sqrt(self.lora_dim / (first + self.unit))
        else:  # the file's meaning: the full rank, no extra scale
            first, count, factor = 0, None, 1.0
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.lora_down.rows[0].dtype)
        lx = self.lora_up(self.lora_down(x, first, count), first, count)
        return lx * (self.multiplier * self.scale * factor)


class DyLoRANetwork(lora.LoRANetwork):
    """networks.lora's network of DyLoRA modules; files hold the stacked weights (a plain LoRA file)."""

    apply_max_norm_regularization = None  # upstream's DyLoRA has none: --scale_weight_norms is ignored (warning)

    def _own_to_file(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out, rows = {}, {}
        for key, value in sd.items():
            name, _, rest = key.partition(".")
            part, _, index = rest.partition(".rows.")
            if index:
                rows.setdefault(f"{name}.{part}", {})[int(index)] = value
            else:
                out[key] = value
        for prefix, by_index in rows.items():
            part = prefix.rsplit(".", 1)[1]
            out[f"{prefix}.weight"] = torch.cat([by_index[i] for i in range(len(by_index))], RANK_DIM[part])
        return out

    def merge_to(self, text_encoders, unet, weights_sd, dtype=None, device=None) -> None:
        super().merge_to(text_encoders, unet, self._file_to_own(weights_sd), dtype, device)

    def _file_to_own(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dims = {m.lora_name: m.lora_dim for m in self.text_encoder_loras + self.unet_loras}
        out = {}
        for key, value in sd.items():
            name, _, rest = key.partition(".")
            part = rest[:-len(".weight")] if rest.endswith(".weight") else None
            if part not in RANK_DIM or name not in dims:
                out[key] = value
                continue
            if value.shape[RANK_DIM[part]] != dims[name]:
                raise lora.NetworkWeightsError(f"{key} has rank {value.shape[RANK_DIM[part]]}, this network has "
                                               f"{dims[name]} (different --network_dim?)")
            for i, row in enumerate(value.split(1, RANK_DIM[part])):
                out[f"{name}.{part}.rows.{i}"] = row
        return out


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
    return lora.build_network(multiplier, dim, alpha, text_encoder, unet, None, opts, DyLoRANetwork,
                              _module_class(unit))


def create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None, for_inference=False,
                                neuron_dropout=None, **kwargs):
    """--dim_from_weights: a DyLoRA network shaped like the file; --base_weights (for_inference): networks.lora's
    network, which merges the file as the LoRA it is."""
    opts = parse_network_kwargs(kwargs)
    unit = opts.pop("unit", 1)
    if for_inference:
        return lora.create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd, True)
    return lora.build_network_from_weights(multiplier, file, text_encoder, unet, weights_sd, None, opts,
                                           DyLoRANetwork, _module_class(unit))

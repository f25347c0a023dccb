"""LoRA for SD1.x / SD2.x / SDXL in kohya-ss/sd-scripts' format.

Targets (sd-scripts' default LoRA): every Linear and 1x1 Conv2d inside the UNet's Transformer2DModel blocks
(attention q/k/v/out, feed-forward, proj_in/proj_out) and the Linear layers of the CLIP text encoders' attention
and MLP. With `--network_args conv_dim=N` also the 3x3 convolutions of the ResNet and up/down-sampling blocks.

Keys: `<lora_name>.lora_down.weight`, `<lora_name>.lora_up.weight`, `<lora_name>.alpha`, where lora_name is
`lora_unet_<module path with _>` (SGM module names for SDXL, e.g. `lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`,
diffusers names for SD1.x/SD2.x), `lora_te1_*` / `lora_te2_*` for SDXL's two text encoders, `lora_te_*` for SD1.x/SD2.x.

`--network_args dora_wd=True` (not in sd-scripts; LyCORIS' name, as kohya_ss writes it) makes it a DoRA: a trained
magnitude per output feature (`wd_on_output=False`: per input feature), saved as `<lora_name>.dora_scale` the way
LyCORIS saves it and ComfyUI reads it (see LoRABase's DoRA section).

The LoRA is applied by replacing the wrapped layer's `forward` (the layer stays where it is, so state_dict
keys of the model do not change and a compiled block traces the LoRA inside its graph).
"""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from networks import lora_blocks
from library.errors import NetworkArgsError, NetworkWeightsError  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

UNET_TARGET_MODULES = ("Transformer2DModel",)
UNET_CONV_TARGET_MODULES = ("ResnetBlock2D", "Downsample2D", "Upsample2D")
TEXT_ENCODER_TARGET_MODULES = ("CLIPAttention", "CLIPMLP")
LORA_PREFIX_UNET = "lora_unet"
LORA_PREFIX_TEXT_ENCODER = "lora_te"

# every --network_args key of sd-scripts' networks.lora, with its type
NETWORK_ARGS = {
    "conv_dim": int, "conv_alpha": float, "rank_dropout": float, "module_dropout": float,
    "loraplus_lr_ratio": float, "loraplus_unet_lr_ratio": float, "loraplus_text_encoder_lr_ratio": float,
    "block_dims": str, "block_alphas": str, "conv_block_dims": str, "conv_block_alphas": str,
    "down_lr_weight": str, "mid_lr_weight": str, "up_lr_weight": str, "block_lr_zero_threshold": float,
}
LORAPLUS_ARGS = ("loraplus_lr_ratio", "loraplus_unet_lr_ratio", "loraplus_text_encoder_lr_ratio")


def arg_bool(value) -> bool:
    """A boolean --network_args value: True/true/1/yes or False/false/0/no (sd-scripts takes only "True")."""
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise ValueError(value)


arg_bool.__name__ = "bool (True/False)"

# DoRA (weight-decomposed LoRA), with LyCORIS' names as kohya_ss writes them: dora_wd=True turns it on,
# wd_on_output=False puts the magnitude on the input features instead of the output features
DORA_ARGS = {"dora_wd": arg_bool, "wd_on_output": arg_bool}
NETWORK_ARGS.update(DORA_ARGS)


def _layers(module: nn.Module) -> list[nn.Module]:
    """The layer itself, or the layers of a ModuleList (a LoRA split into parts)."""
    return list(module) if isinstance(module, nn.ModuleList) else [module]


class LoRABase(nn.Module):
    """What every LoRA module here shares (networks.lora_flux builds on it too): alpha and scale, the
    dropouts, and out = org + up(down(x)) * multiplier * alpha / dim. Subclasses make the two layers."""

    is_conv = False

    def __init__(self, lora_name: str, lora_down: nn.Module, lora_up: nn.Module, multiplier: float, lora_dim: int,
                 alpha: float | torch.Tensor | None, dropout: float | None, rank_dropout: float | None,
                 module_dropout: float | None):
        super().__init__()
        self.lora_name = lora_name
        self.lora_down = lora_down
        self.lora_up = lora_up
        for layer in _layers(lora_down):
            nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5))
        for layer in _layers(lora_up):
            nn.init.zeros_(layer.weight)
        if alpha is None or alpha == 0:
            alpha = lora_dim
        alpha = float(alpha.detach().float().item() if isinstance(alpha, torch.Tensor) else alpha)
        self.lora_dim = lora_dim
        self.scale = alpha / lora_dim
        self.register_buffer("alpha", torch.tensor(alpha))
        self.multiplier = multiplier
        self.dropout = dropout
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout
        self.register_parameter("dora_scale", None)  # DoRA's magnitude once enable_dora made it

    def add_lora(self, org: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """org (the wrapped layer's output for x) plus the LoRA of x."""
        if self.module_dropped():
            return org
        lx, scale = self.down_with_dropout(x)
        return org + (self.lora_up(lx) * (self.multiplier * scale)).to(org.dtype)

    def module_dropped(self) -> bool:
        """module_dropout: this forward leaves the LoRA out (one draw)."""
        return bool(self.module_dropout and self.training and torch.rand(()) < self.module_dropout)

    def down_with_dropout(self, x: torch.Tensor, down: nn.Module | None = None) -> tuple[torch.Tensor, float]:
        """(down(x) with --network_dropout and rank_dropout applied, the scale that goes with it); `down`
        replaces lora_down (one part of a split LoRA)."""
        down = self.lora_down if down is None else down
        lx = down(x.to(down.weight.dtype) if not torch.is_autocast_enabled(x.device.type) else x)
        if self.dropout and self.training:
            lx = F.dropout(lx, p=self.dropout)
        scale = self.scale
        if self.rank_dropout and self.training:
            if self.is_conv:
                shape = (lx.size(0), self.lora_dim, 1, 1)
            else:
                shape = (lx.size(0),) + (1,) * (lx.dim() - 2) + (self.lora_dim,)
            mask = (torch.rand(shape, device=lx.device) > self.rank_dropout).to(lx.dtype)
            lx = lx * mask
            scale = scale / (1.0 - self.rank_dropout)
        return lx, scale

    def delta_weight(self) -> torch.Tensor:
        """up @ down * alpha / dim in float32, shaped like the wrapped layer's weight (all parts stacked)."""
        down, up = self.lora_down.weight.float(), self.lora_up.weight.float()
        if down.dim() == 2:
            w = up @ down
        elif down.shape[2:] == (1, 1):
            w = (up.flatten(1) @ down.flatten(1))[:, :, None, None]
        else:  # k x k down, 1x1 up
            w = F.conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)
        return w * self.scale

    def weight_parts(self) -> list[tuple[nn.Module, slice]]:
        """(wrapped layer, rows of delta_weight() that belong to it)."""
        raise NotImplementedError

    # -- DoRA ----------------------------------------------------------------------------------------------
    # W' = W + multiplier * (m * V / |V| - W), V = W + scale * up @ down: m (`dora_scale`, trained) is one
    # magnitude per output feature (|V| the norm of each output row, as the DoRA paper's code and peft) or, with
    # wd_on_output=False, per input feature (the norm of each input column over all output rows). Files hold
    # m as `<name>.dora_scale`, shaped (out, 1[, 1, 1]) or (1, in[, 1, 1]) as LyCORIS writes it and ComfyUI reads
    # it (its axis from the shape). |V| is detached as in peft (DoRA paper, section 4.3). ComfyUI applies the
    # input-axis form exactly; its output-axis branch divides by |W| instead of |V| (Comfy-Org/ComfyUI#15458 open),
    # as it does for LyCORIS' wd_on_output files: close to |V| while the LoRA is small, not equal.
    dora_on_output = True

    @torch.no_grad()
    def enable_dora(self, on_output: bool = True) -> None:
        """Adds the magnitude, initialised to the norms of the wrapped weight (so W' = W before training)."""
        weight = torch.cat([m.weight.float() for m, _ in self.weight_parts()])
        self.dora_on_output = on_output
        self.dora_scale = nn.Parameter(_dora_norm(weight, on_output))

    def _dora_weights(self, part: nn.Module, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """(the part's base weight, the part's rows of V) in float32; the input axis needs every row: V whole."""
        delta = self.delta_weight()
        if self.dora_on_output:
            return part.weight.float(), part.weight.float() + delta[rows]
        base = torch.cat([m.weight.float() for m, _ in self.weight_parts()])
        return part.weight.float(), base + delta

    def dora_output(self, org: torch.Tensor, out: torch.Tensor, x: torch.Tensor, part: nn.Module,
                    rows: slice) -> torch.Tensor:
        """The layer's DoRA output from org = W x + b and out = org + the LoRA term (multiplier * scale *
        up(down(x)), with its dropouts); out is org when module dropout left the LoRA out."""
        if out is org or self.dora_scale is None:
            return out
        base, v = self._dora_weights(part, rows)
        norm = _dora_norm(v, self.dora_on_output).detach()
        if self.dora_on_output:
            gain = (self.dora_scale[rows] / norm).flatten()
            if org.dim() == 4:  # conv: channels on dim 1
                gain = gain.view(1, -1, 1, 1)
            gain = gain.to(org.dtype)
            bias = part.bias
            wx = org if bias is None else org - (bias.view(1, -1, 1, 1) if org.dim() == 4 else bias).to(org.dtype)
            return org + self.multiplier * (gain - 1) * wx + gain * (out - org)
        # input axis: W' = V * m / |V| (columns), its rows of this part; the LoRA's dropouts are left out here
        # (as LyCORIS' DoRA does), module dropout is not
        weight = v * (self.dora_scale / norm)
        delta = (weight[rows] if weight.shape[0] != base.shape[0] else weight) - base
        if isinstance(part, nn.Conv2d):
            extra = F.conv2d(x, (self.multiplier * delta).to(x.dtype), None, part.stride, part.padding,
                             part.dilation, part.groups)
        else:
            extra = F.linear(x, (self.multiplier * delta).to(x.dtype))
        return org + extra.to(org.dtype)

    @torch.no_grad()
    def merged_weight(self, part: nn.Module, rows: slice) -> torch.Tensor:
        """The part's weight with this LoRA (and DoRA) merged in, float32."""
        if self.dora_scale is None:
            return part.weight.float() + self.delta_weight()[rows].to(part.weight.device) * self.multiplier
        base, v = self._dora_weights(part, rows)
        weight = v * (self.dora_scale.to(v.device) / _dora_norm(v, self.dora_on_output))
        if weight.shape[0] != base.shape[0]:
            weight = weight[rows]
        return base + self.multiplier * (weight - base)

    @torch.no_grad()
    def apply_max_norm(self, max_norm: float, device) -> tuple[bool, float]:
        """--scale_weight_norms: scales up and down by sqrt(max_norm / |delta|) when the norm of the delta weight
        is over max_norm; returns (scaled, norm after scaling)."""
        norm = self.delta_weight().to(device).norm()
        ratio = (norm.clamp(min=max_norm / 2).clamp(max=max_norm) / norm.clamp(min=max_norm / 2)).item()
        if ratio != 1:
            for p in list(self.lora_down.parameters()) + list(self.lora_up.parameters()):
                p.mul_(ratio ** 0.5)
        return ratio != 1, norm.item() * ratio

    @torch.no_grad()
    def merge_to_org(self) -> None:
        """Adds multiplier * delta weight to the wrapped layer(s) (--base_weights)."""
        merged = [(module.weight, self.merged_weight(module, rows)) for module, rows in self.weight_parts()]
        for w, new in merged:
            w.data = new.to(w.device, w.dtype)


class WrapsLayer:
    """apply_to / restore for a module that replaces one layer's forward with its own; the layer is kept in a
    plain list (not a submodule: the network's state_dict holds only the adapter's weights)."""

    _org: list
    org_forward = None

    @property
    def org_module(self) -> nn.Module:
        return self._org[0]

    def apply_to(self) -> None:
        self.org_forward = self.org_module.forward
        self.org_module.forward = self.forward

    def restore(self) -> None:
        if self.org_forward is not None:
            self.org_module.forward = self.org_forward
            self.org_forward = None


class LoRAModule(WrapsLayer, LoRABase):
    """out = org(x) + up(down(x)) * multiplier * alpha / dim."""

    def __init__(self, lora_name: str, org_module: nn.Module, multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: float | None = 1.0, dropout: float | None = None, rank_dropout: float | None = None,
                 module_dropout: float | None = None):
        if isinstance(org_module, nn.Conv2d):
            in_dim, out_dim = org_module.in_channels, org_module.out_channels
            lora_down = nn.Conv2d(in_dim, lora_dim, org_module.kernel_size, org_module.stride,
                                  org_module.padding, bias=False)
            lora_up = nn.Conv2d(lora_dim, out_dim, (1, 1), (1, 1), bias=False)
        else:
            in_dim, out_dim = org_module.in_features, org_module.out_features
            lora_down = nn.Linear(in_dim, lora_dim, bias=False)
            lora_up = nn.Linear(lora_dim, out_dim, bias=False)
        super().__init__(lora_name, lora_down, lora_up, multiplier, lora_dim, alpha, dropout, rank_dropout,
                         module_dropout)
        self.is_conv = isinstance(org_module, nn.Conv2d)
        self._org = [org_module]

    def weight_parts(self) -> list[tuple[nn.Module, slice]]:
        return [(self.org_module, slice(None))]

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        org = self.org_forward(x, *args, **kwargs)
        out = self.add_lora(org, x)
        return out if self.dora_scale is None else self.dora_output(org, out, x, self.org_module, slice(None))


def _dora_norm(weight: torch.Tensor, on_output: bool) -> torch.Tensor:
    """Norm of each output row (shape (out, 1, ...)) or of each input column (shape (1, in, ...))."""
    ones = [1] * (weight.dim() - 1)
    if on_output:
        return weight.flatten(1).norm(dim=1).reshape(weight.shape[0], *ones)
    return weight.transpose(0, 1).flatten(1).norm(dim=1).reshape(1, weight.shape[1], *ones[1:]) \
        if weight.dim() > 2 else weight.norm(dim=0, keepdim=True)


def apply_loraplus_and_dora(network, opts: dict[str, Any], weights_sd: dict | None = None) -> None:
    """The --network_args every kohya LoRA network takes on top of its shape: LoRA+ ratios, then DoRA."""
    if any(opts.get(k) is not None for k in LORAPLUS_ARGS):
        network.set_loraplus_lr_ratio(*(opts.get(k) for k in LORAPLUS_ARGS))
    enable_dora(network, opts, weights_sd)


def enable_dora(network, opts: dict[str, Any], weights_sd: dict | None = None) -> None:
    """`dora_wd=True` (wd_on_output as given, default True), or a file with `dora_scale` keys (its axis from
    their shape): a magnitude on every module of the network."""
    on_output = opts.get("wd_on_output", True)
    scales = [v for k, v in (weights_sd or {}).items() if k.endswith(".dora_scale")]
    if scales:
        on_output = all(v.shape[0] != 1 or v.shape[1] == 1 for v in scales)
    elif not opts.get("dora_wd"):
        return
    for lora in network.text_encoder_loras + network.unet_loras:
        lora.enable_dora(on_output)
    logger.info("DoRA: a trained magnitude per %s feature on %d modules", "output" if on_output else "input",
                len(network.text_encoder_loras + network.unet_loras))


def _kohya_unet_path(module_path: str, name_map: dict[str, str] | None) -> str:
    """Diffusers module path -> the path kohya names the LoRA after (SGM for SDXL via `name_map`)."""
    if not name_map:
        return module_path
    if module_path in name_map:
        return name_map[module_path]
    # longest mapped prefix, then the rest of the path as it is
    parts = module_path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in name_map:
            return name_map[prefix] + "." + ".".join(parts[i:])
    raise KeyError(f"no SGM name for UNet module {module_path!r}")


def _text_encoder_names(te: nn.Module) -> dict[str, str]:
    """Module path -> the canonical HF path ("text_model.encoder.layers.0...") kohya names are built from
    (transformers >= 5.6 flattened CLIPTextModel and dropped the "text_model." level)."""
    from library.model_util import text_encoder_hf_module_names

    return text_encoder_hf_module_names(te)


def target_layers(root: nn.Module, targets: tuple[str, ...]) -> Iterator[tuple[str, nn.Module]]:
    """(module path, layer) of every Linear / Conv2d inside the modules of `root` whose class is in `targets`."""
    for name, module in root.named_modules():
        if module.__class__.__name__ not in targets:
            continue
        for child_name, child in module.named_modules():
            if isinstance(child, (nn.Linear, nn.Conv2d)):
                yield (f"{name}.{child_name}" if child_name else name), child


def assemble_param_groups(loras: list, lr: float | None, plus_ratio: float | None, label: str,
                          reg_lrs: dict[str, float] | None = None, reg_match=None) -> tuple[list[dict], list[str]]:
    """Optimizer param groups of `loras` as sd-scripts builds them: with a LoRA+ ratio the lora_up weights get
    their own group at lr * ratio ("<label> plus"); with `reg_lrs` (regex -> lr, networks.lora_flux) the modules
    whose name matches a regex (first match wins; `reg_match(regex, lora)` decides instead when given) get that
    lr, in groups "<label> reg_lr_<i>" placed first.
    Groups whose lr is 0 or None are left out (their weights are not trained)."""
    import re

    regs = list((reg_lrs or {}).items())
    buckets: dict[tuple, list] = {}
    for lora in loras:
        reg = next((i for i, (rx, _) in enumerate(regs)
                    if (reg_match(rx, lora) if reg_match else re.search(rx, lora.lora_name))), None)
        for name, p in lora.named_parameters():
            plus = plus_ratio is not None and "lora_up" in name
            buckets.setdefault((reg, plus), []).append(p)
    groups, descriptions = [], []
    order = sorted(buckets, key=lambda k: (k[0] is None, k[0] or 0, k[1]))
    for reg, plus in order:
        group_lr = lr if reg is None else regs[reg][1]
        if group_lr is not None and plus:
            group_lr = group_lr * plus_ratio
        if not group_lr:
            continue
        desc = label + ("" if reg is None else f" reg_lr_{reg}") + (" plus" if plus else "")
        groups.append({"params": buckets[(reg, plus)], "lr": group_lr})
        descriptions.append(desc)
    return groups, descriptions


def max_norm_regularization(loras: list, max_norm_value: float, device) -> tuple[int, float, float]:
    """--scale_weight_norms over the modules: (number of modules scaled, mean and max norm after scaling)."""
    keys_scaled, norms = 0, []
    for lora in loras:
        scaled, norm = lora.apply_max_norm(max_norm_value, device)
        keys_scaled += int(scaled)
        norms.append(norm)
    if not norms:
        return 0, 0.0, 0.0
    return keys_scaled, sum(norms) / len(norms), max(norms)


class LoRANetwork(nn.Module):
    def __init__(self, text_encoders: list[nn.Module], unet: nn.Module, multiplier: float = 1.0,
                 lora_dim: int = 4, alpha: float = 1.0, dropout: float | None = None,
                 rank_dropout: float | None = None, module_dropout: float | None = None,
                 conv_lora_dim: int | None = None, conv_alpha: float | None = None,
                 unet_name_map: dict[str, str] | None = None, modules_dim: dict[str, int] | None = None,
                 modules_alpha: dict[str, float] | None = None, block_dims: list[int] | None = None,
                 block_alphas: list[float] | None = None, conv_block_dims: list[int] | None = None,
                 conv_block_alphas: list[float] | None = None, is_sdxl: bool = False,
                 module_class: type | None = None):
        super().__init__()
        module_class = module_class or LoRAModule
        self._set_options(multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout, conv_lora_dim,
                          conv_alpha)
        self.is_sdxl = is_sdxl
        skipped: list[str] = []

        def dim_alpha(lora_name: str, is_unet: bool, is_linear_like: bool):
            """(dim, alpha) of a target layer; dim None/0 = no LoRA. The rules of sd-scripts' networks.lora:
            file dims (--dim_from_weights) > block dims (UNet) > network_dim / conv_dim."""
            if modules_dim is not None:
                return file_dim_alpha(lora_name, modules_dim, modules_alpha) or (None, None)
            if is_unet and block_dims is not None:
                idx = lora_blocks.block_index(lora_name, is_sdxl)
                if is_linear_like:
                    return block_dims[idx], block_alphas[idx]
                if conv_block_dims is not None:
                    return conv_block_dims[idx], conv_block_alphas[idx]
                return None, None
            if is_linear_like:
                return lora_dim, alpha
            if conv_lora_dim:
                return conv_lora_dim, conv_alpha
            return None, None

        def make(prefix: str, root: nn.Module, targets: tuple[str, ...], name_map=None) -> list[LoRAModule]:
            loras = []
            is_unet = prefix == LORA_PREFIX_UNET
            te_names = _text_encoder_names(root) if not is_unet else {}
            for path, child in target_layers(root, targets):
                is_linear = isinstance(child, nn.Linear)
                is_1x1 = not is_linear and tuple(child.kernel_size) == (1, 1)
                path = _kohya_unet_path(path, name_map) if is_unet else te_names.get(path, path)
                lora_name = f"{prefix}_{path}".replace(".", "_")
                dim, a = dim_alpha(lora_name, is_unet, is_linear or is_1x1)
                if not dim:
                    if dim == 0 or modules_dim is None and (is_linear or is_1x1):
                        skipped.append(lora_name)
                    continue
                loras.append(module_class(lora_name, child, multiplier, dim, a, dropout, rank_dropout,
                                          module_dropout))
            return loras

        self.text_encoder_loras: list[LoRAModule] = []
        for i, te in enumerate(text_encoders):
            prefix = LORA_PREFIX_TEXT_ENCODER if len(text_encoders) == 1 else f"{LORA_PREFIX_TEXT_ENCODER}{i + 1}"
            self.text_encoder_loras += make(prefix, te, TEXT_ENCODER_TARGET_MODULES)
        unet_targets = UNET_TARGET_MODULES
        if conv_lora_dim or modules_dim is not None or conv_block_dims is not None:
            unet_targets = UNET_TARGET_MODULES + UNET_CONV_TARGET_MODULES
        self.unet_loras: list[LoRAModule] = make(LORA_PREFIX_UNET, unet, unet_targets, unet_name_map)
        self._check_unique_names()
        if block_dims is not None:
            logger.info("LoRA block dims %s, alphas %s; conv block dims %s, alphas %s", block_dims, block_alphas,
                        conv_block_dims, conv_block_alphas)
        if skipped:
            logger.info("%d LoRA modules skipped (block lr weight or dim 0), e.g. %s", len(skipped), skipped[:3])
        logger.info("LoRA: %d modules for the text encoder(s), %d for the UNet", len(self.text_encoder_loras),
                    len(self.unet_loras))

    def _check_unique_names(self) -> None:
        names = set()
        for lora in self.text_encoder_loras + self.unet_loras:
            if lora.lora_name in names:
                raise ValueError(f"duplicated LoRA name {lora.lora_name}")
            names.add(lora.lora_name)

    def _set_options(self, multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout, conv_lora_dim=None,
                     conv_alpha=None) -> None:
        self.multiplier = multiplier
        self.lora_dim = lora_dim
        self.alpha = alpha
        self.conv_lora_dim = conv_lora_dim
        self.conv_alpha = conv_alpha
        self.dropout = dropout
        self.rank_dropout = rank_dropout
        self.module_dropout = module_dropout
        self.loraplus_lr_ratio = self.loraplus_unet_lr_ratio = self.loraplus_text_encoder_lr_ratio = None
        self.block_lr_weight: list[float] | None = None

    # -- applying -------------------------------------------------------------------------------------
    def apply_to(self, text_encoders, unet, apply_text_encoder: bool = True, apply_unet: bool = True) -> None:
        if not apply_text_encoder:
            self.text_encoder_loras = []
        if not apply_unet:
            self.unet_loras = []
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.apply_to()
            self.add_module(lora.lora_name, lora)

    def remove_from(self) -> None:
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.restore()

    def set_multiplier(self, multiplier: float) -> None:
        self.multiplier = multiplier
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.multiplier = multiplier

    def is_mergeable(self) -> bool:
        return True

    @torch.no_grad()
    def merge_to(self, text_encoders, unet, weights_sd: dict[str, torch.Tensor], dtype=None, device=None) -> None:
        """Adds the LoRA of `weights_sd` (times this network's multiplier) into the wrapped layers' weights
        (--base_weights); a network made by create_network_from_weights has exactly the file's modules."""
        for lora in self.text_encoder_loras + self.unet_loras:
            prefix = lora.lora_name + "."
            sd = {k[len(prefix):]: v for k, v in weights_sd.items() if k.startswith(prefix)}
            if not sd:
                continue
            lora.load_state_dict(sd, strict=False)
            lora.scale = float(lora.alpha) / lora.lora_dim
            lora.merge_to_org()
        logger.info("merged %d LoRA modules into the model", len(self.text_encoder_loras) + len(self.unet_loras))

    # -- training -------------------------------------------------------------------------------------
    def set_loraplus_lr_ratio(self, loraplus_lr_ratio, loraplus_unet_lr_ratio, loraplus_text_encoder_lr_ratio):
        self.loraplus_lr_ratio = loraplus_lr_ratio
        self.loraplus_unet_lr_ratio = loraplus_unet_lr_ratio
        self.loraplus_text_encoder_lr_ratio = loraplus_text_encoder_lr_ratio
        logger.info("LoRA+ lr ratio: UNet %s, text encoder %s", loraplus_unet_lr_ratio or loraplus_lr_ratio,
                    loraplus_text_encoder_lr_ratio or loraplus_lr_ratio)

    def set_block_lr_weight(self, block_lr_weight: list[float] | None) -> None:
        self.block_lr_weight = block_lr_weight

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr: float | None,
                                 default_lr: float) -> tuple[list[dict[str, Any]], list[str]]:
        """(param groups, their descriptions) as sd-scripts makes them: text encoder, then UNet (one group per
        block with block lr weights), LoRA+ up weights in " plus" groups; a group whose lr is 0 is left out
        (its weights are frozen). `text_encoder_lr` may be a list (sd-scripts' nargs="*"): its first value."""
        if isinstance(text_encoder_lr, (list, tuple)):
            text_encoder_lr = text_encoder_lr[0] if text_encoder_lr else None
        self.requires_grad_(True)
        groups, descriptions = [], []

        def add(loras, lr, ratio, label):
            g, d = assemble_param_groups(loras, lr, ratio, label)
            groups.extend(g)
            descriptions.extend(d)

        if self.text_encoder_loras:
            add(self.text_encoder_loras, default_lr if text_encoder_lr is None else text_encoder_lr,
                self.loraplus_text_encoder_lr_ratio or self.loraplus_lr_ratio, "textencoder")
        if self.unet_loras:
            lr = default_lr if unet_lr is None else unet_lr
            ratio = self.loraplus_unet_lr_ratio or self.loraplus_lr_ratio
            if self.block_lr_weight is None:
                add(self.unet_loras, lr, ratio, "unet")
            else:
                by_block: dict[int, list] = {}
                for lora in self.unet_loras:
                    by_block.setdefault(lora_blocks.block_index(lora.lora_name, self.is_sdxl), []).append(lora)
                for idx, loras in by_block.items():
                    add(loras, lr * self.block_lr_weight[idx], ratio, f"unet_block{idx}")
        in_groups = {id(p) for g in groups for p in g["params"]}
        for p in self.parameters():
            if id(p) not in in_groups:
                p.requires_grad_(False)
        return groups, descriptions

    def prepare_grad_etc(self, text_encoders, unet) -> None:
        self.requires_grad_(True)

    def on_epoch_start(self, text_encoders, unet) -> None:
        self.train()

    def get_trainable_params(self):
        return [p for p in self.parameters() if p.requires_grad]

    def apply_max_norm_regularization(self, max_norm_value: float, device) -> tuple[int, float, float]:
        """--scale_weight_norms: (modules scaled, mean norm, max norm), as sd-scripts logs them."""
        return max_norm_regularization(self.text_encoder_loras + self.unet_loras, max_norm_value, device)

    # -- files ----------------------------------------------------------------------------------------
    def load_weights(self, file: str) -> None:
        """Loads a kohya LoRA file into this network (`--network_weights`). As upstream (load_state_dict with
        strict=False), keys this network lacks are skipped with a warning and training goes on; a key whose
        shape differs is an error."""
        sd = self._file_to_own(load_lora_state_dict(file))
        own = self.state_dict()
        unexpected = sorted(set(sd) - set(own))
        if unexpected:
            logger.warning("--network_weights %s: %d keys do not belong to this network and are ignored "
                           "(different targets or text-encoder/UNet selection?), e.g. %s",
                           file, len(unexpected), unexpected[:3])
            sd = {k: v for k, v in sd.items() if k in own}
        for k, v in sd.items():
            if v.shape != own[k].shape:
                raise NetworkWeightsError(f"--network_weights {file}: {k} has shape {tuple(v.shape)}, this network "
                                          f"has {tuple(own[k].shape)} (different --network_dim?)")
        missing = sorted(set(own) - set(sd))
        if missing:
            logger.warning("--network_weights %s: %d keys missing, kept at their initial values (e.g. %s)",
                           file, len(missing), missing[:3])
        self.load_state_dict(sd, strict=False)
        # alpha may differ from --network_alpha: the module scale follows the file
        for lora in self.text_encoder_loras + self.unet_loras:
            lora.scale = float(lora.alpha) / lora.lora_dim
        logger.info("loaded LoRA weights from %s", file)

    def _file_to_own(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """File layout -> this network's state_dict layout (networks.lora_flux splits qkv LoRAs here)."""
        return sd

    def _own_to_file(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return sd

    def lora_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        from library.compile.regional import strip_orig_mod

        sd = self._own_to_file(strip_orig_mod(self.state_dict()))
        out = {}
        for k, v in sd.items():
            v = v.detach().clone().to("cpu")
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
            out[k] = v
        return out

    def save_weights(self, file: str, dtype: torch.dtype | None, metadata: dict[str, str] | None,
                     overwrite: bool = False) -> None:
        """Atomic save; .safetensors gets `metadata` plus sshs_model_hash / sshs_legacy_hash."""
        from library import files, metadata as metadata_util

        sd = self.lora_state_dict(dtype)
        if os.path.splitext(file)[1] == ".safetensors":
            metadata = dict(metadata or {})
            if metadata:
                model_hash, legacy_hash = metadata_util.model_hashes(sd, metadata)
                metadata["sshs_model_hash"] = model_hash
                metadata["sshs_legacy_hash"] = legacy_hash
            files.save_safetensors(sd, file, metadata or None, overwrite=overwrite)
        else:
            files.save_torch(sd, file, overwrite=overwrite)


def load_lora_state_dict(file: str) -> dict[str, torch.Tensor]:
    from library.compile.regional import strip_orig_mod

    if not os.path.isfile(file):
        raise FileNotFoundError(f"LoRA file not found: {file}")
    if os.path.splitext(file)[1] == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(file)
    else:
        sd = torch.load(file, map_location="cpu", weights_only=True)
    return strip_orig_mod(sd)


def file_dim_alpha(lora_name: str, modules_dim: dict[str, int],
                   modules_alpha: dict[str, float] | None) -> tuple[int, float] | None:
    """(dim, alpha) of a module in a LoRA file (alpha defaults to dim), None when the file has no such module."""
    if lora_name not in modules_dim:
        return None
    return modules_dim[lora_name], (modules_alpha or {}).get(lora_name, modules_dim[lora_name])


def dims_from_weights(weights_sd: dict[str, torch.Tensor]) -> tuple[dict[str, int], dict[str, float]]:
    """Per-module dims and alphas of a LoRA state dict (`--dim_from_weights`)."""
    modules_dim, modules_alpha = {}, {}
    for key, value in weights_sd.items():
        name = key.split(".")[0]
        if key.endswith("lora_down.weight"):
            modules_dim[name] = value.shape[0]
        elif key.endswith(".alpha"):
            modules_alpha[name] = float(value)
    return modules_dim, modules_alpha


def network_from_weights(build, file: str | None, weights_sd: dict | None, kwargs: dict[str, Any], parse, *,
                         multiplier: float, neuron_dropout: float | None):
    """The shared part of the DiT networks' create_network_from_weights: the LoRA file's state dict (read from `file`
    unless given), `build(shape, opts, weights_sd)` makes the network (`shape`: multiplier, the file's per-module dims
    and alphas and the dropouts, as constructor keywords; `opts`: `parse(kwargs)`), then LoRA+ / DoRA. Returns
    (network, weights_sd)."""
    if weights_sd is None:
        weights_sd = load_lora_state_dict(file)
    modules_dim, modules_alpha = dims_from_weights(weights_sd)
    opts = parse(kwargs)
    shape = {"multiplier": multiplier, "modules_dim": modules_dim, "modules_alpha": modules_alpha,
             "dropout": neuron_dropout, "rank_dropout": opts.get("rank_dropout"),
             "module_dropout": opts.get("module_dropout")}
    network = build(shape, opts, weights_sd)
    apply_loraplus_and_dora(network, opts, weights_sd)
    return network, weights_sd


def text_encoder_list(text_encoders) -> list:
    """kohya's entry points get one text encoder, a list of them or None: the list without the Nones."""
    if text_encoders is None:
        return []
    items = text_encoders if isinstance(text_encoders, (list, tuple)) else [text_encoders]
    return [t for t in items if t is not None]


def parse_network_kwargs(kwargs: dict[str, Any], allowed: dict[str, type] = NETWORK_ARGS,
                         module: str = "networks.lora") -> dict[str, Any]:
    """`--network_args` values (text) -> typed values; keys not in `allowed` (of network `module`) are an
    error, and so are dropout rates outside [0, 1) and block lists that do not parse (checked before any model
    loads; the number of block values is checked when the network is made, it depends on the model)."""
    out = {}
    for key, value in kwargs.items():
        if key not in allowed:
            raise NetworkArgsError(f"--network_args {key}={value}: unknown for {module}; "
                                   f"allowed: {', '.join(allowed)}")
        if value is None or value == "None":
            continue
        try:
            out[key] = allowed[key](value)
        except (TypeError, ValueError) as e:
            raise NetworkArgsError(f"--network_args {key}={value}: not a {allowed[key].__name__}") from e
    for key in ("rank_dropout", "module_dropout"):
        if key in out and not 0 <= out[key] < 1:
            raise NetworkArgsError(f"--network_args {key}={out[key]}: must be in [0, 1)")
    try:
        for is_sdxl in (False, True):
            lora_blocks.block_lr_weights(is_sdxl, out, quiet=True)
    except lora_blocks.BlockArgsError as e:
        raise NetworkArgsError(str(e)) from e
    return out


def _unet_name_map(unet: nn.Module, text_encoders) -> dict[str, str] | None:
    """SDXL (two text encoders) names its UNet LoRA modules after the SGM layout."""
    if _is_sdxl(text_encoders):
        from library.model_util import unet_sgm_module_names

        return unet_sgm_module_names(unet)
    return None


def _is_sdxl(text_encoders) -> bool:
    return isinstance(text_encoders, (list, tuple)) and len(text_encoders) == 2


def _training_options(network: LoRANetwork, opts: dict[str, Any], block_lr: list[float] | None) -> None:
    """LoRA+ ratios and block lr weights (also for a network made from a file: they only shape the optimizer)."""
    if any(opts.get(k) is not None for k in LORAPLUS_ARGS):
        network.set_loraplus_lr_ratio(*(opts.get(k) for k in LORAPLUS_ARGS))
    if block_lr is not None:
        network.set_block_lr_weight(block_lr)


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, vae, text_encoder,
                   unet, neuron_dropout: float | None = None, **kwargs) -> LoRANetwork:
    """kohya's entry point: `text_encoder` is one model or a list (two for SDXL); kwargs are --network_args."""
    return build_network(multiplier, network_dim, network_alpha, text_encoder, unet, neuron_dropout,
                         parse_network_kwargs(kwargs))


def build_network(multiplier: float, network_dim: int | None, network_alpha: float | None, text_encoder, unet,
                  neuron_dropout: float | None, opts: dict[str, Any], network_class: type = None,
                  module_class: type | None = None) -> LoRANetwork:
    """create_network with typed options; networks.lora_fa / networks.dylora pass their own classes."""
    network_class = network_class or LoRANetwork
    text_encoders = list(text_encoder) if isinstance(text_encoder, (list, tuple)) else [text_encoder]
    is_sdxl = _is_sdxl(text_encoder)
    network_dim = network_dim or 4
    network_alpha = 1.0 if network_alpha is None else network_alpha
    conv_dim = opts.get("conv_dim")
    conv_alpha = opts.get("conv_alpha", 1.0) if conv_dim else None
    block_lr = lora_blocks.block_lr_weights(is_sdxl, opts)
    blocks = {}
    if opts.get("block_dims") is not None or block_lr is not None:
        try:
            dims, alphas, conv_dims, conv_alphas = lora_blocks.block_dims_alphas(
                is_sdxl, opts, network_dim, network_alpha, conv_dim, conv_alpha, block_lr)
        except lora_blocks.BlockArgsError as e:
            raise NetworkArgsError(str(e)) from e
        blocks = dict(block_dims=dims, block_alphas=alphas, conv_block_dims=conv_dims, conv_block_alphas=conv_alphas)
    network = network_class(text_encoders, unet, multiplier=multiplier, lora_dim=network_dim, alpha=network_alpha,
                            dropout=neuron_dropout, rank_dropout=opts.get("rank_dropout"),
                            module_dropout=opts.get("module_dropout"), conv_lora_dim=conv_dim,
                            conv_alpha=conv_alpha, unet_name_map=_unet_name_map(unet, text_encoder), is_sdxl=is_sdxl,
                            module_class=module_class, **blocks)
    _training_options(network, opts, block_lr)
    enable_dora(network, opts)
    return network


def create_network_from_weights(multiplier: float, file: str | None, vae, text_encoder, unet,
                                weights_sd: dict | None = None, for_inference: bool = False,
                                neuron_dropout: float | None = None, **kwargs):
    """A network shaped like a LoRA file (dims and alphas per module): `--dim_from_weights`, `--base_weights`.
    Unlike sd-scripts (which applies only the block lr weights here), the dropouts and LoRA+ ratios of
    --network_args apply too: they shape training, not the file."""
    return build_network_from_weights(multiplier, file, text_encoder, unet, weights_sd, neuron_dropout,
                                      parse_network_kwargs(kwargs))


def build_network_from_weights(multiplier: float, file: str | None, text_encoder, unet, weights_sd: dict | None,
                               neuron_dropout: float | None, opts: dict[str, Any], network_class: type = None,
                               module_class: type | None = None):
    network_class = network_class or LoRANetwork
    text_encoders = list(text_encoder) if isinstance(text_encoder, (list, tuple)) else [text_encoder]
    if weights_sd is None:
        weights_sd = load_lora_state_dict(file)
    modules_dim, modules_alpha = dims_from_weights(weights_sd)
    is_sdxl = _is_sdxl(text_encoder)
    network = network_class(text_encoders, unet, multiplier=multiplier, modules_dim=modules_dim,
                            modules_alpha=modules_alpha, dropout=neuron_dropout,
                            rank_dropout=opts.get("rank_dropout"), module_dropout=opts.get("module_dropout"),
                            unet_name_map=_unet_name_map(unet, text_encoder), is_sdxl=is_sdxl,
                            module_class=module_class)
    _training_options(network, opts, lora_blocks.block_lr_weights(is_sdxl, opts))
    enable_dora(network, opts, weights_sd)
    return network, weights_sd

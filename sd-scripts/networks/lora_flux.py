"""LoRA for FLUX.1 in kohya-ss/sd-scripts' FLUX key format (its networks.lora_flux).

The model is diffusers' FluxTransformer2DModel, but the LoRA is shaped and named after the BFL modules, which is
what sd-scripts, ComfyUI, Forge and diffusers' kohya-FLUX converter expect. Default modules (as sd-scripts):
every Linear of the double blocks (``img_mod_lin``, ``img_attn_qkv``, ``img_attn_proj``, ``img_mlp_{0,2}`` and
the ``txt_*`` ones) and of the single blocks (``linear1``, ``linear2``, ``modulation_lin``), plus CLIP-L's
attention/MLP Linears (``lora_te1_text_model_encoder_layers_N_...``) when the text encoder is trained:
376 modules on FLUX.1-dev. One BFL Linear can be several diffusers Linears fed the same input (qkv ->
to_q/to_k/to_v, linear1 -> to_q/to_k/to_v/proj_mlp): ONE down and ONE up as in the BFL file, the up split
row-wise over the parts, which is the same function.

``--network_args`` (sd-scripts' names and meaning): ``train_blocks=all|single|double``,
``train_double_block_indices`` / ``train_single_block_indices`` (``all``, ``none``, ``0,2,5-7``),
``img_attn_dim``, ``txt_attn_dim``, ``img_mlp_dim``, ``txt_mlp_dim``, ``img_mod_dim``, ``txt_mod_dim``,
``single_dim``, ``single_mod_dim`` (0 = no LoRA there), ``in_dims=[img,time,vector,guidance,txt]`` (LoRA on the
input layers), ``network_reg_dims`` / ``network_reg_lrs`` (``regex=value,...`` on the LoRA names),
``split_qkv`` (one LoRA per q/k/v(/mlp) part; saved in the fused layout), ``train_t5xxl`` (``lora_te3_*`` on
T5-XXL), ``ggpo_sigma`` / ``ggpo_beta`` (LoRA-GGPO weight perturbation), ``verbose``, ``rank_dropout``,
``module_dropout``, ``loraplus_lr_ratio``, ``loraplus_unet_lr_ratio``, ``loraplus_text_encoder_lr_ratio``,
``conv_dim`` / ``conv_alpha`` (accepted as sd-scripts does; FLUX has no convolutions); ``dora_wd`` /
``wd_on_output`` (DoRA, networks.lora's: the magnitude covers the whole fused BFL layer, ``dora_scale`` in the file).

Block counts come from the model (19/38 on the real FLUX.1), so the same rules work on any depth.
"""
from __future__ import annotations

import logging
import math
import re
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
LORA_PREFIX_T5XXL = "lora_te3"
TRAIN_BLOCKS = ("all", "single", "double")
T5_TARGET_MODULES = ("T5Attention", "T5DenseGatedActDense")
# type dims, in sd-scripts' order: the first whose substrings are all in the LoRA name decides
TYPE_DIM_ARGS = (("img_attn_dim", ("img_attn",)), ("txt_attn_dim", ("txt_attn",)), ("img_mlp_dim", ("img_mlp",)),
                 ("txt_mlp_dim", ("txt_mlp",)), ("img_mod_dim", ("img_mod",)), ("txt_mod_dim", ("txt_mod",)),
                 ("single_dim", ("single_blocks", "linear")), ("single_mod_dim", ("modulation",)))
# in_dims order and the BFL input layers each entry names (by substring of the LoRA name)
IN_DIM_FILTERS = ("_img_in", "_time_in", "_vector_in", "_guidance_in", "_txt_in")


NETWORK_ARGS: dict[str, Any] = {
    "train_blocks": str, "rank_dropout": float, "module_dropout": float, "conv_dim": int, "conv_alpha": float,
    "split_qkv": lora_sd.arg_bool, "train_t5xxl": lora_sd.arg_bool, "verbose": lora_sd.arg_bool, "in_dims": str,
    "train_double_block_indices": str, "train_single_block_indices": str, "network_reg_dims": str,
    "network_reg_lrs": str, "ggpo_sigma": float, "ggpo_beta": float,
    **{name: int for name, _ in TYPE_DIM_ARGS},
    **{name: float for name in lora_sd.LORAPLUS_ARGS},
    **lora_sd.DORA_ARGS,
}
NETWORK_ARG_CHOICES = {"train_blocks": TRAIN_BLOCKS}


def parse_block_selection(key: str, text: str, total: int) -> list[bool]:
    """`all`, `none`/empty, or comma-separated indices and ranges (`0,2,5-7`) -> which of `total` blocks."""
    text = text.strip()
    if text == "all":
        return [True] * total
    if text in ("none", ""):
        return [False] * total
    selected = [False] * total
    for part in text.split(","):
        try:
            start, _, end = part.strip().partition("-")
            lo, hi = int(start), int(end) if end else int(start)
        except ValueError as e:
            raise NetworkArgsError(f"--network_args {key}={text}: 'all', 'none' or indices like 0,2,5-7") from e
        if not (0 <= lo <= hi < total):
            raise NetworkArgsError(f"--network_args {key}={text}: {part.strip()} is outside 0-{total - 1}")
        for i in range(lo, hi + 1):
            selected[i] = True
    return selected


def parse_in_dims(text: str) -> list[int]:
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    try:
        dims = [int(d) for d in body.split(",")]
    except ValueError as e:
        raise NetworkArgsError(f"--network_args in_dims={text}: five integers [img,time,vector,guidance,txt]") from e
    if len(dims) != 5:
        raise NetworkArgsError(f"--network_args in_dims={text}: five integers [img,time,vector,guidance,txt]")
    return dims


def parse_regex_values(key: str, text: str, cast) -> dict[str, float]:
    """`regex=value,regex=value` (network_reg_dims / network_reg_lrs); the regexes must compile."""
    out = {}
    for pair in text.split(","):
        pair = pair.strip()
        if not pair:
            continue
        rx, sep, value = pair.partition("=")
        try:
            if not sep:
                raise ValueError(pair)
            re.compile(rx.strip())
            out[rx.strip()] = cast(value.strip())
        except (ValueError, re.error) as e:
            raise NetworkArgsError(f"--network_args {key}={text}: {pair!r} is not regex={cast.__name__}") from e
    return out


class FluxLoRAModule(lora_sd.LoRABase):
    """LoRA over one BFL Linear that diffusers may hold as several Linear layers fed the same input.

    org_i(x) + up[rows of part i](down(x)) * multiplier * alpha / dim, for each diffusers part i. With `split`
    (split_qkv) each part has its own down and up; the file still holds one fused down (n*dim rows) and a
    block-diagonal up, with alpha * n so that the file means what was trained."""

    def __init__(self, lora_name: str, org_modules: list[nn.Linear], multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: float | None = 1.0, dropout: float | None = None, rank_dropout: float | None = None,
                 module_dropout: float | None = None, split: bool = False, ggpo_sigma: float | None = None,
                 ggpo_beta: float | None = None, pieces: list[int] | None = None):
        in_dims = {m.in_features for m in org_modules}
        if len(in_dims) != 1:
            raise ValueError(f"{lora_name}: parts have different input widths {sorted(in_dims)}")
        in_dim = in_dims.pop()
        split_dims = [m.out_features for m in org_modules]
        # split_qkv: one LoRA per diffusers part, or per `pieces` (row widths) of one fused Linear (HunyuanImage)
        pieces = list(pieces) if pieces and len(org_modules) == 1 else split_dims
        self.split = split and len(pieces) > 1
        if self.split:
            down = nn.ModuleList([nn.Linear(in_dim, lora_dim, bias=False) for _ in pieces])
            up = nn.ModuleList([nn.Linear(lora_dim, d, bias=False) for d in pieces])
        else:
            down, up = nn.Linear(in_dim, lora_dim, bias=False), nn.Linear(lora_dim, sum(split_dims), bias=False)
        super().__init__(lora_name, down, up, multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout)
        self.split_dims = split_dims
        self._orgs = list(org_modules)  # plain list: not submodules, the network holds only LoRA weights
        self._org_forwards: list | None = None
        self._pending: tuple | None = None  # (x, {part: its LoRA output}) until the other parts take theirs
        self._offsets = [sum(split_dims[:i]) for i in range(len(split_dims))]
        self.piece_dims, self._piece_offsets = pieces, [sum(pieces[:i]) for i in range(len(pieces))]
        self.ggpo_sigma, self.ggpo_beta = ggpo_sigma, ggpo_beta
        self.grad_norms = self.weight_norms = self.combined_weight_norms = None
        if self.uses_ggpo:
            self._init_norm_estimate()

    # -- parts -------------------------------------------------------------------------------------------
    def weight_parts(self) -> list[tuple[nn.Module, slice]]:
        return [(m, slice(o, o + d)) for m, o, d in zip(self._orgs, self._offsets, self.split_dims)]

    def delta_weight(self) -> torch.Tensor:
        if not self.split:
            return super().delta_weight()
        return torch.cat([u.weight.float() @ d.weight.float() for d, u in zip(self.lora_down, self.lora_up)]) \
            * self.scale

    def apply_to(self) -> None:
        self._org_forwards = [m.forward for m in self._orgs]
        for i, m in enumerate(self._orgs):
            m.forward = self._part_forward(i)

    def restore(self) -> None:
        if self._org_forwards is not None:
            for m, f in zip(self._orgs, self._org_forwards):
                m.forward = f
            self._org_forwards = None
        self._pending = None

    def _part_forward(self, i: int):
        def forward(x, *args, **kwargs):
            return self.forward_part(i, x, *args, **kwargs)

        return forward

    def forward_part(self, i: int, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        org = self._org_forwards[i](x, *args, **kwargs)
        rows = slice(self._offsets[i], self._offsets[i] + self.split_dims[i])
        delta = self._part_delta(i, x)
        out = org if delta is None else org + delta.to(org.dtype)
        out = self.dora_output(org, out, x, self._orgs[i], rows)  # DoRA (networks.lora), when enabled
        if self.training and self.uses_ggpo and self.combined_weight_norms is not None \
                and self.grad_norms is not None:
            out = out + self._perturbation(x, rows).to(out.dtype)
        return out

    def _part_delta(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        """Part i's share of the fused layer's LoRA output for x (None: module dropout left it out). The parts
        of a fused layer are called one after another with the same x: the first call computes every part's
        share with one set of dropout draws (as sd-scripts' one BFL Linear does), the others take theirs. With
        nothing to draw, each part computes its own share (_one_part_delta)."""
        if len(self.split_dims) == 1:
            return self._fused_deltas(x)[0]
        if not self._draws_random():
            return self._one_part_delta(i, x)
        pending = self._pending
        if pending is not None and pending[0] is x and i in pending[1]:
            delta = pending[1].pop(i)
            if not pending[1]:
                self._pending = None
            return delta
        deltas = self._fused_deltas(x)
        self._pending = (x, {j: d for j, d in enumerate(deltas) if j != i})
        return deltas[i]

    def _draws_random(self) -> bool:
        return self.training and bool(self.dropout or self.rank_dropout or self.module_dropout)

    def _one_part_delta(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Part i's share with nothing drawn at random: computed on its own, keeping no state between the parts'
        calls. State written in forward is a side effect that torch.compile cannot put inside a checkpointed
        region: it would run every checkpointed FLUX.1 block eagerly."""
        if self.split:
            lx, scale = self.down_with_dropout(x, self.lora_down[i])
            return self.lora_up[i](lx) * (self.multiplier * scale)
        lx, scale = self.down_with_dropout(x)
        rows = self.lora_up.weight[self._offsets[i]:self._offsets[i] + self.split_dims[i]]
        return torch.nn.functional.linear(lx, rows) * (self.multiplier * scale)

    def _fused_deltas(self, x: torch.Tensor) -> list[torch.Tensor | None]:
        """Each part's LoRA output for x: module dropout drawn once, the down projection computed once (each
        part's own down with split_qkv), dropout and rank dropout drawn once per down output."""
        if self.module_dropped():
            return [None] * len(self.split_dims)
        if self.split:
            deltas = []
            for down, up in zip(self.lora_down, self.lora_up):
                lx, scale = self.down_with_dropout(x, down)
                deltas.append(up(lx) * (self.multiplier * scale))
            return deltas if len(self._orgs) > 1 else [torch.cat(deltas, dim=-1)]
        lx, scale = self.down_with_dropout(x)
        out = self.lora_up(lx) * (self.multiplier * scale)
        return list(out.split(self.split_dims, dim=-1)) if len(self.split_dims) > 1 else [out]

    # -- LoRA-GGPO ---------------------------------------------------------------------------------------
    @property
    def uses_ggpo(self) -> bool:
        return self.ggpo_sigma is not None and self.ggpo_beta is not None

    @torch.no_grad()
    def _init_norm_estimate(self) -> None:
        """Mean row norm of the wrapped weight from up to 1000 random rows (as sd-scripts estimates it)."""
        weight = torch.cat([m.weight for m in self._orgs])
        self.out_features = weight.shape[0]
        if weight.device.type == "meta":
            self.org_weight_norm_estimate = torch.zeros((), device="meta")
            return
        rows = torch.randperm(weight.shape[0])[:min(1000, weight.shape[0])]
        self.org_weight_norm_estimate = weight[rows].float().norm(dim=1).mean()

    @torch.no_grad()
    def _perturbation(self, x: torch.Tensor, rows: slice) -> torch.Tensor:
        """x @ noise.T with noise ~ N(0, 1) per weight row scaled by (sigma * |W + dW|_row + beta * |grad|_row^2)
        / sqrt(out features): GGPO's gradient-guided perturbation of the wrapped weight."""
        scale = (self.ggpo_sigma * self.combined_weight_norms + self.ggpo_beta * self.grad_norms ** 2)[rows]
        scale = scale.to(x.device) / math.sqrt(self.out_features)
        noise = torch.randn(scale.shape[0], x.shape[-1], device=x.device, dtype=x.dtype) * scale.to(x.dtype)
        return x @ noise.T

    @torch.no_grad()
    def update_norms(self) -> None:
        if not self.uses_ggpo or not self.training:
            return
        # sd-scripts uses the unscaled up @ down here
        w = self.delta_weight() / self.scale
        self.weight_norms = w.norm(dim=1, keepdim=True)
        est = self.org_weight_norm_estimate.to(w.device)
        self.combined_weight_norms = torch.sqrt(est ** 2 + (w ** 2).sum(dim=1, keepdim=True))

    @torch.no_grad()
    def update_grad_norms(self) -> None:
        if not self.uses_ggpo or not self.training or self.split:
            return
        down, up = self.lora_down.weight, self.lora_up.weight
        if down.grad is None or up.grad is None:
            return
        approx = self.scale * (up.float() @ down.grad.float() + up.grad.float() @ down.float())
        self.grad_norms = approx.norm(dim=1, keepdim=True)


class LoRANetworkFlux(lora_sd.LoRANetwork):
    """kohya FLUX LoRA network; training/saving/loading/merging methods are networks.lora's."""

    def __init__(self, text_encoders: list[nn.Module], flux: nn.Module, multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: float = 1.0, dropout: float | None = None, rank_dropout: float | None = None,
                 module_dropout: float | None = None, train_blocks: str = "all",
                 modules_dim: dict[str, int] | None = None, modules_alpha: dict[str, float] | None = None,
                 split_qkv: bool = False, train_t5xxl: bool = False, type_dims: dict[str, int] | None = None,
                 in_dims: list[int] | None = None, train_double_block_indices: list[bool] | None = None,
                 train_single_block_indices: list[bool] | None = None, reg_dims: dict[str, int] | None = None,
                 reg_lrs: dict[str, float] | None = None, ggpo_sigma: float | None = None,
                 ggpo_beta: float | None = None, verbose: bool = False):
        nn.Module.__init__(self)
        if train_blocks not in TRAIN_BLOCKS:
            raise NetworkArgsError(f"--network_args train_blocks={train_blocks}: allowed: {', '.join(TRAIN_BLOCKS)}")
        self._set_options(multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout)
        self.is_sdxl = False
        self.train_blocks, self.split_qkv, self.train_t5xxl = train_blocks, split_qkv, train_t5xxl
        self.reg_lrs = reg_lrs
        type_dims = type_dims or {}
        if modules_dim is not None:
            in_dims = [0] * 5  # from a file: the input layers the file has
        skipped: list[str] = []

        def dim_alpha(name: str, is_flux: bool, default_dim: int | None = None):
            """sd-scripts' precedence: file dims > network_reg_dims > (in_dims / network_dim, then type dims,
            then the block selections)."""
            if modules_dim is not None:
                return lora_sd.file_dim_alpha(name, modules_dim, modules_alpha) or (None, None)
            for rx, d in (reg_dims or {}).items():
                if re.search(rx, name):
                    return d, alpha
            dim = lora_dim if default_dim is None else default_dim
            if is_flux:
                for key, ids in TYPE_DIM_ARGS:
                    if type_dims.get(key) is not None and all(i in name for i in ids):
                        dim = type_dims[key]
                        break
                if dim and ("double" in name or "single" in name):
                    index = int(name.split("_")[4])  # lora_unet_{double,single}_blocks_<i>_...
                    sel = train_double_block_indices if "double" in name else train_single_block_indices
                    if sel is not None and not sel[index]:
                        dim = 0
            return dim, alpha

        def new(name: str, parts: list[nn.Linear], is_flux: bool, default_dim: int | None = None):
            dim, a = dim_alpha(name, is_flux, default_dim)
            if not dim:
                if modules_dim is None:
                    skipped.append(name)
                return None
            return FluxLoRAModule(name, parts, multiplier, dim, a, dropout, rank_dropout, module_dropout,
                                  split=split_qkv and is_flux, ggpo_sigma=ggpo_sigma, ggpo_beta=ggpo_beta)

        # text encoders: CLIP-L (lora_te1, canonical "text_model..." paths) and, with train_t5xxl, T5-XXL (lora_te3)
        self.text_encoder_loras: list[FluxLoRAModule] = []
        for te in text_encoders:  # told apart by type: Chroma has T5-XXL only
            if te is None or (_is_t5(te) and not train_t5xxl):
                continue
            prefix, targets = ((LORA_PREFIX_T5XXL, T5_TARGET_MODULES) if _is_t5(te)
                               else (LORA_PREFIX_CLIP_L, lora_sd.TEXT_ENCODER_TARGET_MODULES))
            names = text_encoder_hf_module_names(te) if prefix == LORA_PREFIX_CLIP_L else {}
            for path, child in lora_sd.target_layers(te, targets):
                if isinstance(child, nn.Linear):
                    m = new(f"{prefix}_{names.get(path, path)}".replace(".", "_"), [child], False)
                    if m is not None:
                        self.text_encoder_loras.append(m)

        # the transformer, named after the BFL modules
        cfg = flux.config
        modules = dict(flux.named_modules())
        mapping = {bfl: parts for bfl, parts in flux_models.bfl_linear_map(
            cfg.num_layers, cfg.num_single_layers, cfg.get("guidance_embeds", False)).items()
            if all(p in modules for p in parts)}  # Chroma: no modulation, time/vector/guidance layers
        self.unet_loras: list[FluxLoRAModule] = []
        for bfl, parts in mapping.items():
            is_double, is_single = bfl.startswith("double_blocks."), bfl.startswith("single_blocks.")
            if not ((is_double and train_blocks != "single") or (is_single and train_blocks != "double")):
                continue
            m = new(f"{LORA_PREFIX_FLUX}_{bfl}".replace(".", "_"), [modules[p] for p in parts], True)
            if m is not None:
                self.unet_loras.append(m)
        if in_dims:
            for flt, in_dim in zip(IN_DIM_FILTERS, in_dims):
                for bfl, parts in mapping.items():
                    name = f"{LORA_PREFIX_FLUX}_{bfl}".replace(".", "_")
                    if flt in name:
                        m = new(name, [modules[p] for p in parts], True, default_dim=in_dim)
                        if m is not None:
                            self.unet_loras.append(m)
        self._check_unique_names()
        if ggpo_sigma is not None and ggpo_beta is not None:
            logger.info("LoRA-GGPO: sigma %s, beta %s", ggpo_sigma, ggpo_beta)
        logger.info("LoRA for FLUX: %d modules for the text encoder(s), %d for the transformer (train_blocks=%s%s)",
                    len(self.text_encoder_loras), len(self.unet_loras), train_blocks,
                    ", split qkv" if split_qkv else "")
        if verbose:
            for m in self.text_encoder_loras + self.unet_loras:
                logger.info("\t%-50s dim %d, alpha %s", m.lora_name, m.lora_dim, float(m.alpha))
            if skipped:
                logger.info("%d modules skipped (dim 0): %s", len(skipped), ", ".join(skipped))

    # -- files: split_qkv modules are saved in the fused layout --------------------------------------------
    def _split_modules(self) -> dict[str, FluxLoRAModule]:
        return {m.lora_name: m for m in self.text_encoder_loras + self.unet_loras if getattr(m, "split", False)}

    def _own_to_file(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        split = self._split_modules()
        if not split:
            return sd
        out = {k: v for k, v in sd.items() if k.split(".")[0] not in split}
        for name, m in split.items():
            n, r = len(m.piece_dims), m.lora_dim
            downs = [sd[f"{name}.lora_down.{i}.weight"] for i in range(n)]
            up = torch.zeros(sum(m.piece_dims), n * r, dtype=downs[0].dtype, device=downs[0].device)
            for i, (o, d) in enumerate(zip(m._piece_offsets, m.piece_dims)):
                up[o:o + d, i * r:(i + 1) * r] = sd[f"{name}.lora_up.{i}.weight"]
            out[f"{name}.lora_down.weight"] = torch.cat(downs)
            out[f"{name}.lora_up.weight"] = up
            out[f"{name}.alpha"] = sd[f"{name}.alpha"] * n  # alpha / (n * r) == part alpha / r
            if f"{name}.dora_scale" in sd:
                out[f"{name}.dora_scale"] = sd[f"{name}.dora_scale"]
        return out

    def _file_to_own(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        split = self._split_modules()
        if not split:
            return sd
        out = {k: v for k, v in sd.items() if k.split(".")[0] not in split}
        for name, m in split.items():
            if f"{name}.lora_down.weight" not in sd:
                continue
            n = len(m.piece_dims)
            down, up = sd[f"{name}.lora_down.weight"], sd[f"{name}.lora_up.weight"]
            r = down.shape[0] // n
            for i, (o, d) in enumerate(zip(m._piece_offsets, m.piece_dims)):
                out[f"{name}.lora_down.{i}.weight"] = down[i * r:(i + 1) * r]
                out[f"{name}.lora_up.{i}.weight"] = up[o:o + d, i * r:(i + 1) * r]
            if f"{name}.alpha" in sd:
                out[f"{name}.alpha"] = sd[f"{name}.alpha"] / n
            if f"{name}.dora_scale" in sd:
                out[f"{name}.dora_scale"] = sd[f"{name}.dora_scale"]
        return out

    # -- training ----------------------------------------------------------------------------------------
    TE_PREFIXES = (LORA_PREFIX_CLIP_L, LORA_PREFIX_T5XXL)  # one optimizer group (and lr) per text encoder
    reg_lr_match = None  # network_reg_lrs: a regex found in the LoRA name (lora_anima: its own rule)

    @staticmethod
    def text_encoder_lrs(text_encoder_lr, default_lr) -> list:
        """[CLIP-L, T5-XXL]: text encoder lr one value or a list (the last value for T5-XXL)."""
        if text_encoder_lr is None or (isinstance(text_encoder_lr, (list, tuple)) and not text_encoder_lr):
            return [default_lr, default_lr]
        if isinstance(text_encoder_lr, (list, tuple)):
            return [text_encoder_lr[0], text_encoder_lr[-1]]
        return [text_encoder_lr, text_encoder_lr]

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr, default_lr):
        """sd-scripts' prepare_optimizer_params_with_multiple_te_lrs: text_encoder_lrs per TE_PREFIXES;
        network_reg_lrs groups first; LoRA+ " plus" groups."""
        te_lrs = self.text_encoder_lrs(text_encoder_lr, default_lr)
        self.requires_grad_(True)
        groups, descriptions = [], []

        def add(loras, lr, ratio, label):
            g, d = lora_sd.assemble_param_groups(loras, lr, ratio, label, self.reg_lrs, self.reg_lr_match)
            groups.extend(g)
            descriptions.extend(d)

        te_ratio = self.loraplus_text_encoder_lr_ratio or self.loraplus_lr_ratio
        for i, prefix in enumerate(self.TE_PREFIXES):
            loras = [m for m in self.text_encoder_loras if m.lora_name.startswith(prefix + "_")]
            if loras:
                add(loras, te_lrs[i], te_ratio, f"textencoder {i + 1}")
        if self.unet_loras:
            add(self.unet_loras, default_lr if unet_lr is None else unet_lr,
                self.loraplus_unet_lr_ratio or self.loraplus_lr_ratio, "unet")
        in_groups = {id(p) for g in groups for p in g["params"]}
        for p in self.parameters():
            if id(p) not in in_groups:
                p.requires_grad_(False)
        return groups, descriptions

    prepare_optimizer_params_with_multiple_te_lrs = prepare_optimizer_params

    # LoRA-GGPO
    def _all(self):
        return self.text_encoder_loras + self.unet_loras

    def update_norms(self) -> None:
        for m in self._all():
            m.update_norms()

    def update_grad_norms(self) -> None:
        for m in self._all():
            m.update_grad_norms()

    def _stacked(self, attr: str) -> torch.Tensor | None:
        values = [getattr(m, attr).mean(dim=0) for m in self._all() if getattr(m, attr, None) is not None]
        return torch.stack(values) if values else None

    def weight_norms(self) -> torch.Tensor | None:
        return self._stacked("weight_norms")

    def grad_norms(self) -> torch.Tensor | None:
        return self._stacked("grad_norms")

    def combined_weight_norms(self) -> torch.Tensor | None:
        return self._stacked("combined_weight_norms")


def parse_network_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Typed --network_args; every value is checked before any model loads (block index ranges need the
    model's depth and are checked when the network is made)."""
    out = lora_sd.parse_network_kwargs(kwargs, NETWORK_ARGS, "networks.lora_flux")
    if out.get("train_blocks", "all") not in TRAIN_BLOCKS:
        raise NetworkArgsError(f"--network_args train_blocks={out['train_blocks']}: allowed: {', '.join(TRAIN_BLOCKS)}")
    if "in_dims" in out:
        parse_in_dims(out["in_dims"])
    for key, cast in (("network_reg_dims", int), ("network_reg_lrs", float)):
        if key in out:
            parse_regex_values(key, out[key], cast)
    for key in ("train_double_block_indices", "train_single_block_indices"):
        if key in out:
            parse_block_selection(key, out[key], 10 ** 6)
    return out


def _is_t5(module) -> bool:
    return type(module).__name__.startswith("T5")


def _text_encoders(text_encoder) -> list:
    """kohya passes [clip_l, t5xxl]."""
    if text_encoder is None:
        return []
    return list(text_encoder) if isinstance(text_encoder, (list, tuple)) else [text_encoder]


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, ae, text_encoders,
                   flux, neuron_dropout: float | None = None, **kwargs) -> LoRANetworkFlux:
    """kohya's entry point; kwargs are --network_args."""
    opts = parse_network_kwargs(kwargs)
    cfg = flux.config
    selections = {}
    for key, total in (("train_double_block_indices", cfg.num_layers),
                       ("train_single_block_indices", cfg.num_single_layers)):
        if key in opts:
            selections[key] = parse_block_selection(key, opts[key], total)
    network = LoRANetworkFlux(
        _text_encoders(text_encoders), flux, multiplier=multiplier, lora_dim=network_dim or 4,
        alpha=1.0 if network_alpha is None else network_alpha, dropout=neuron_dropout,
        rank_dropout=opts.get("rank_dropout"), module_dropout=opts.get("module_dropout"),
        train_blocks=opts.get("train_blocks", "all"), split_qkv=opts.get("split_qkv", False),
        train_t5xxl=opts.get("train_t5xxl", False),
        type_dims={k: opts[k] for k, _ in TYPE_DIM_ARGS if k in opts},
        in_dims=parse_in_dims(opts["in_dims"]) if "in_dims" in opts else None,
        reg_dims=parse_regex_values("network_reg_dims", opts["network_reg_dims"], int)
        if "network_reg_dims" in opts else None,
        reg_lrs=parse_regex_values("network_reg_lrs", opts["network_reg_lrs"], float)
        if "network_reg_lrs" in opts else None,
        ggpo_sigma=opts.get("ggpo_sigma"), ggpo_beta=opts.get("ggpo_beta"), verbose=opts.get("verbose", False),
        **selections)
    lora_sd.apply_loraplus_and_dora(network, opts)
    return network


def create_network_from_weights(multiplier: float, file: str | None, ae, text_encoders, flux,
                                weights_sd: dict | None = None, for_inference: bool = False,
                                neuron_dropout: float | None = None, **kwargs):
    """A network shaped like a LoRA file (dims and alphas per module; T5-XXL modules when the file has
    lora_te3_ keys)."""
    if weights_sd is None:
        weights_sd = load_lora_state_dict(file)
    modules_dim, modules_alpha = lora_sd.dims_from_weights(weights_sd)
    opts = parse_network_kwargs(kwargs)
    network = LoRANetworkFlux(_text_encoders(text_encoders), flux, multiplier=multiplier, modules_dim=modules_dim,
                              modules_alpha=modules_alpha, dropout=neuron_dropout,
                              rank_dropout=opts.get("rank_dropout"), module_dropout=opts.get("module_dropout"),
                              train_t5xxl=any(k.startswith(LORA_PREFIX_T5XXL + "_") for k in weights_sd),
                              reg_lrs=parse_regex_values("network_reg_lrs", opts["network_reg_lrs"], float)
                              if "network_reg_lrs" in opts else None)
    lora_sd.apply_loraplus_and_dora(network, opts, weights_sd)
    return network, weights_sd

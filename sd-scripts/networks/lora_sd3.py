"""LoRA for SD3 / SD3.5 in kohya-ss/sd-scripts' format (its networks.lora_sd3).

The model is diffusers' SD3Transformer2DModel, but the LoRA is shaped and named after the SAI MMDiT modules, as
upstream writes it and ComfyUI reads it: ``lora_unet_joint_blocks_N_{x,context}_block_{attn_qkv,attn_proj,
mlp_fc1,mlp_fc2,adaLN_modulation_1}`` (+ ``x_block_attn2_*`` on SD3.5 medium), text encoders ``lora_te1_*``
(CLIP-L), ``lora_te2_*`` (CLIP-G) and with ``train_t5xxl`` ``lora_te3_*`` (T5-XXL). One SAI qkv Linear is three
diffusers Linears fed the same input: one down and one up as in the file, the up split row-wise
(networks.lora_flux.FluxLoRAModule).

``--network_args`` (upstream's names and meaning): ``context_attn_dim``, ``context_mlp_dim``, ``context_mod_dim``,
``x_attn_dim``, ``x_mlp_dim``, ``x_mod_dim`` (0 = no LoRA there), ``emb_dims=[context,t,x,y,final_mod,
final_linear]`` (LoRA on the embedders; x must be 0 here: the patch convolution, see docs/PARITY.md),
``train_block_indices`` (``all``, ``none``, ``0,2,5-7``), ``split_qkv``, ``train_t5xxl``, ``verbose``,
``rank_dropout``, ``module_dropout``, ``loraplus_lr_ratio`` / ``loraplus_unet_lr_ratio`` /
``loraplus_text_encoder_lr_ratio``, ``conv_dim`` / ``conv_alpha`` (accepted; the trained layers are Linear).
"""
from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from library import sd3_models
from library.model_util import text_encoder_hf_module_names
from networks import lora as lora_sd
from networks.lora import NetworkArgsError
from networks.lora_flux import FluxLoRAModule, LoRANetworkFlux, parse_block_selection

logger = logging.getLogger(__name__)

FAMILIES = ("sd3",)  # SD/SDXL/FLUX.1 models: networks.lora / networks.lora_flux
LORA_PREFIX_SD3 = "lora_unet"
TE_PREFIXES = ("lora_te1", "lora_te2", "lora_te3")  # CLIP-L, CLIP-G, T5-XXL
T5_TARGET_MODULES = ("T5Attention", "T5DenseGatedActDense")
# upstream's type dims: the first whose substrings are all in the LoRA name decides
TYPE_DIM_ARGS = (("context_attn_dim", ("context_block", "attn")), ("context_mlp_dim", ("context_block", "mlp")),
                 ("context_mod_dim", ("context_block", "adaLN_modulation")), ("x_attn_dim", ("x_block", "attn")),
                 ("x_mlp_dim", ("x_block", "mlp")), ("x_mod_dim", ("x_block", "adaLN_modulation")))
# emb_dims order and the SAI layers each entry names (by substring of the LoRA name, as upstream)
EMB_DIM_FILTERS = ("context_embedder", "_t_embedder", "x_embedder", "y_embedder", "final_layer_adaLN_modulation",
                   "final_layer_linear")
NETWORK_ARGS: dict[str, Any] = {
    "rank_dropout": float, "module_dropout": float, "conv_dim": int, "conv_alpha": float, "split_qkv": lora_sd.arg_bool,
    "train_t5xxl": lora_sd.arg_bool, "verbose": lora_sd.arg_bool, "emb_dims": str, "train_block_indices": str,
    **{name: int for name, _ in TYPE_DIM_ARGS},
    **{name: float for name in lora_sd.LORAPLUS_ARGS},
    **lora_sd.DORA_ARGS,
}


def parse_emb_dims(text: str) -> list[int]:
    body = text.strip().removeprefix("[").removesuffix("]")
    try:
        dims = [int(d) for d in body.split(",")]
    except ValueError:
        dims = []
    if len(dims) != 6:
        raise NetworkArgsError(f"--network_args emb_dims={text}: six integers [context,t,x,y,final_mod,final_linear]")
    if dims[2]:
        raise NetworkArgsError(f"--network_args emb_dims={text}: x_embedder (the patch convolution) takes no LoRA "
                               "here; set it to 0")
    return dims


class SwappedLoRAModule(FluxLoRAModule):
    """LoRA over an SAI Linear that diffusers holds with its two output halves swapped (the last joint block's
    context adaLN, the final adaLN): the file's up rows are in SAI order, the output is swapped to diffusers'."""

    def _fused_deltas(self, x):
        out = super()._fused_deltas(x)[0]
        return [None if out is None else torch.cat(out.chunk(2, dim=-1)[::-1], dim=-1)]

    def delta_weight(self) -> torch.Tensor:
        w = super().delta_weight()
        return torch.cat(w.chunk(2, dim=0)[::-1], dim=0)


class LoRANetworkSD3(LoRANetworkFlux):
    """kohya SD3 LoRA network; the fused-layer module, file layout (split_qkv), optimizer groups and training
    methods are networks.lora_flux's, with upstream's three text-encoder learning rates."""

    def __init__(self, text_encoders: list, mmdit: nn.Module, multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: float = 1.0, dropout: float | None = None, rank_dropout: float | None = None,
                 module_dropout: float | None = None, modules_dim: dict[str, int] | None = None,
                 modules_alpha: dict[str, float] | None = None, split_qkv: bool = False, train_t5xxl: bool = False,
                 type_dims: dict[str, int] | None = None, emb_dims: list[int] | None = None,
                 train_block_indices: list[bool] | None = None, verbose: bool = False):
        nn.Module.__init__(self)
        self._set_options(multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout)
        self.is_sdxl = False
        self.split_qkv, self.train_t5xxl, self.reg_lrs = split_qkv, train_t5xxl, None
        self.train_blocks = "all"
        type_dims = type_dims or {}
        if modules_dim is not None:
            emb_dims = [0] * 6  # from a file: the embedders the file has
        skipped: list[str] = []
        swapped = {f"{LORA_PREFIX_SD3}_{sai}".replace(".", "_") for sai in sd3_models.sai_swapped_linears(
            mmdit.config.num_layers)}

        def new(name: str, parts: list[nn.Linear], is_mmdit: bool, default_dim: int | None = None):
            if modules_dim is not None:
                dim, a = lora_sd.file_dim_alpha(name, modules_dim, modules_alpha) or (None, None)
            else:
                dim, a = (lora_dim if default_dim is None else default_dim), alpha
                if is_mmdit:
                    for key, ids in TYPE_DIM_ARGS:
                        if type_dims.get(key) is not None and all(i in name for i in ids):
                            dim = type_dims[key]
                            break
                    if dim and train_block_indices is not None and "joint_blocks" in name:
                        if not train_block_indices[int(name.split("_")[4])]:  # lora_unet_joint_blocks_<i>_...
                            dim = 0
            if not dim:
                if modules_dim is None:
                    skipped.append(name)
                return None
            cls = SwappedLoRAModule if name in swapped else FluxLoRAModule
            return cls(name, parts, multiplier, dim, a, dropout, rank_dropout, module_dropout,
                       split=split_qkv and is_mmdit)

        self.text_encoder_loras: list[FluxLoRAModule] = []
        for index, te in enumerate(text_encoders):
            if te is None or (index >= 2 and not train_t5xxl):
                continue
            is_t5 = type(te).__name__.startswith("T5")
            targets = T5_TARGET_MODULES if is_t5 else lora_sd.TEXT_ENCODER_TARGET_MODULES
            names = {} if is_t5 else text_encoder_hf_module_names(te)
            for path, child in lora_sd.target_layers(te, targets):
                if isinstance(child, nn.Linear):
                    m = new(f"{TE_PREFIXES[index]}_{names.get(path, path)}".replace(".", "_"), [child], False)
                    if m is not None:
                        self.text_encoder_loras.append(m)

        cfg = mmdit.config
        modules = dict(mmdit.named_modules())
        mapping = sd3_models.sai_linear_map(cfg.num_layers, tuple(cfg.dual_attention_layers or ()))
        mapping.update({sai: [d] for sai, d in sd3_models.sai_swapped_linears(cfg.num_layers).items()})
        self.unet_loras: list[FluxLoRAModule] = []
        for sai, parts in mapping.items():
            if sai.startswith("joint_blocks."):
                m = new(f"{LORA_PREFIX_SD3}_{sai}".replace(".", "_"), [modules[p] for p in parts], True)
                if m is not None:
                    self.unet_loras.append(m)
        if emb_dims:
            for flt, dim in zip(EMB_DIM_FILTERS, emb_dims):
                for sai, parts in mapping.items():
                    name = f"{LORA_PREFIX_SD3}_{sai}".replace(".", "_")
                    if flt in name and not sai.startswith("joint_blocks."):
                        m = new(name, [modules[p] for p in parts], True, default_dim=dim)
                        if m is not None:
                            self.unet_loras.append(m)
        self._check_unique_names()
        logger.info("LoRA for SD3: %d modules for the text encoders, %d for the MMDiT%s",
                    len(self.text_encoder_loras), len(self.unet_loras), " (split qkv)" if split_qkv else "")
        if verbose:
            for m in self.text_encoder_loras + self.unet_loras:
                logger.info("\t%-50s dim %d, alpha %s", m.lora_name, m.lora_dim, float(m.alpha))
            if skipped:
                logger.info("%d modules skipped (dim 0): %s", len(skipped), ", ".join(skipped))

    TE_PREFIXES = TE_PREFIXES

    @staticmethod
    def text_encoder_lrs(text_encoder_lr, default_lr) -> list:
        """Upstream's [CLIP-L, CLIP-G, T5-XXL]: one value for all, or a list (two values: the second for CLIP-G and
        T5-XXL)."""
        if text_encoder_lr is None or (isinstance(text_encoder_lr, (list, tuple)) and not text_encoder_lr):
            return [default_lr] * 3
        if isinstance(text_encoder_lr, (list, tuple)):
            return (list(text_encoder_lr) + [text_encoder_lr[-1]] * 3)[:3]
        return [text_encoder_lr] * 3


def parse_network_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Typed --network_args, checked before any model loads."""
    out = lora_sd.parse_network_kwargs(kwargs, NETWORK_ARGS, "networks.lora_sd3")
    if "emb_dims" in out:
        parse_emb_dims(out["emb_dims"])
    if "train_block_indices" in out:
        parse_block_selection("train_block_indices", out["train_block_indices"], 10 ** 6)
    return out


def _text_encoders(text_encoders) -> list:
    if text_encoders is None:
        return []
    return list(text_encoders) if isinstance(text_encoders, (list, tuple)) else [text_encoders]


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, vae, text_encoders,
                   mmdit, neuron_dropout: float | None = None, **kwargs) -> LoRANetworkSD3:
    """kohya's entry point; kwargs are --network_args."""
    opts = parse_network_kwargs(kwargs)
    network = LoRANetworkSD3(
        _text_encoders(text_encoders), mmdit, multiplier=multiplier, lora_dim=network_dim or 4,
        alpha=1.0 if network_alpha is None else network_alpha, dropout=neuron_dropout,
        rank_dropout=opts.get("rank_dropout"), module_dropout=opts.get("module_dropout"),
        split_qkv=opts.get("split_qkv", False), train_t5xxl=opts.get("train_t5xxl", False),
        type_dims={k: opts[k] for k, _ in TYPE_DIM_ARGS if k in opts},
        emb_dims=parse_emb_dims(opts["emb_dims"]) if "emb_dims" in opts else None,
        train_block_indices=parse_block_selection("train_block_indices", opts["train_block_indices"],
                                                  mmdit.config.num_layers) if "train_block_indices" in opts else None,
        verbose=opts.get("verbose", False))
    lora_sd.apply_loraplus_and_dora(network, opts)
    return network


def create_network_from_weights(multiplier: float, file: str | None, vae, text_encoders, mmdit,
                                weights_sd: dict | None = None, for_inference: bool = False,
                                neuron_dropout: float | None = None, **kwargs):
    """A network shaped like a LoRA file (dims and alphas per module; T5-XXL modules when it has lora_te3_ keys)."""
    def build(shape, opts, sd):
        split = any(re.search(r"\.lora_down\.\d+\.weight$", k) for k in sd)
        return LoRANetworkSD3(_text_encoders(text_encoders), mmdit, split_qkv=split or opts.get("split_qkv", False),
                              train_t5xxl=any(k.startswith(TE_PREFIXES[2] + "_") for k in sd), **shape)

    return lora_sd.network_from_weights(build, file, weights_sd, kwargs, parse_network_kwargs, multiplier=multiplier,
                                        neuron_dropout=neuron_dropout)


def to_diffusers(weights_sd: dict) -> dict:
    """A kohya SD3 LoRA state dict -> diffusers' PEFT keys (``transformer.transformer_blocks.N.attn.to_q.lora_A
    .weight``, ``text_encoder.`` / ``text_encoder_2.`` for CLIP-L / CLIP-G), which StableDiffusion3Pipeline's
    load_lora_weights reads (diffusers has no converter for kohya's SD3 keys). alpha / rank is folded into lora_B;
    fused qkv ups are split over the diffusers parts; T5-XXL modules (lora_te3_*) are left out (the pipeline's
    loader takes none)."""
    modules_dim, modules_alpha = lora_sd.dims_from_weights(weights_sd)
    blocks = {int(m.group(1)) for name in modules_dim if (m := re.match(r"lora_unet_joint_blocks_(\d+)_", name))}
    attn2 = {int(m.group(1)) for name in modules_dim if (m := re.match(r"lora_unet_joint_blocks_(\d+)_x_block_attn2", name))}
    n = max(blocks) + 1 if blocks else 0
    by_kohya = {f"{LORA_PREFIX_SD3}_{sai}".replace(".", "_"): parts
                for sai, parts in sd3_models.sai_linear_map(n, attn2).items()}
    swapped = {f"{LORA_PREFIX_SD3}_{sai}".replace(".", "_"): [d] for sai, d in sd3_models.sai_swapped_linears(n).items()}
    by_kohya.update(swapped)
    te_roots = {"lora_te1_": "text_encoder.", "lora_te2_": "text_encoder_2."}
    out = {}
    for name, dim in modules_dim.items():
        down = weights_sd[f"{name}.lora_down.weight"]
        up = weights_sd[f"{name}.lora_up.weight"]
        scale = float(modules_alpha.get(name, dim)) / dim
        if name in by_kohya:
            parts = [f"transformer.{p}" for p in by_kohya[name]]
        elif name[:9] in te_roots:  # text_model_encoder_layers_N_{self_attn_q_proj,mlp_fc1,...}
            m = re.fullmatch(r"text_model_encoder_layers_(\d+)_(self_attn|mlp)_(\w+)", name[9:])
            if m is None:
                continue
            parts = [f"{te_roots[name[:9]]}text_model.encoder.layers.{m.group(1)}.{m.group(2)}.{m.group(3)}"]
        else:
            continue
        if name in swapped:
            up = torch.cat(up.chunk(2, dim=0)[::-1], dim=0)
        ups = torch.chunk(up, len(parts), dim=0)
        for p, u in zip(parts, ups):
            out[f"{p}.lora_A.weight"] = down.float().contiguous()
            out[f"{p}.lora_B.weight"] = (u.float() * scale).contiguous()
    return out

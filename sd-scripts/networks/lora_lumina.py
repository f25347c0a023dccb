"""LoRA for Lumina Image 2.0 in kohya-ss/sd-scripts' key format (its networks.lora_lumina).

The model is diffusers' Lumina2Transformer2DModel; the LoRA is named and shaped after upstream's NextDiT modules
(library.lumina_models.linear_map): every Linear of the JointTransformerBlocks (`layers_N`, `noise_refiner_N`,
`context_refiner_N`: `attention_qkv` (one LoRA over diffusers' to_q/to_k/to_v, as networks.lora_flux does FLUX's
qkv), `attention_out`, `feed_forward_w1/w2/w3`, `adaLN_modulation_1`) and of the final layer (`final_layer_linear`,
`final_layer_adaLN_modulation_1`): keys `lora_unet_layers_0_attention_qkv.lora_down.weight` ...; Gemma 2's
attention and MLP Linears as `lora_te_layers_N_self_attn_q_proj` ... unless --network_train_unet_only.

``--network_args`` (upstream's names): ``train_blocks=all|transformer|refiners|noise_refiner|context_refiner``,
``attn_dim``, ``mlp_dim``, ``mod_dim``, ``refiner_dim`` (the first type whose name part is in the LoRA name decides,
as upstream; mlp_dim names the feed-forward layers, which upstream's "mlp" substring never matches),
``embedder_dims=[x,t,cap]`` (LoRA on x_embedder, t_embedder.mlp.0/2, cap_embedder.1), ``split_qkv``,
``rank_dropout``, ``module_dropout``, ``verbose``, LoRA+ ratios, ``conv_dim``/``conv_alpha`` (accepted, no
convolutions), and networks.lora's ``dora_wd``/``wd_on_output``.
"""
from __future__ import annotations

import logging
from typing import Any

from torch import nn

from library import lumina_models
from networks import lora as lora_sd
from networks.lora import NetworkArgsError
from networks.lora_flux import FluxLoRAModule, LoRANetworkFlux

logger = logging.getLogger(__name__)

FAMILIES = ("lumina",)
LORA_PREFIX_LUMINA = "lora_unet"
LORA_PREFIX_TEXT_ENCODER = "lora_te"
TEXT_ENCODER_TARGET_MODULES = ("Gemma2Attention", "Gemma2MLP")
TRAIN_BLOCKS = ("all", "transformer", "refiners", "noise_refiner", "context_refiner")
# the substring of the LoRA name each block choice keeps (upstream's filters)
BLOCK_FILTERS = {"all": None, "transformer": ("layers_",), "refiners": ("noise_refiner", "context_refiner"),
                 "noise_refiner": ("noise_refiner",), "context_refiner": ("context_refiner",)}
TYPE_DIM_ARGS = (("attn_dim", "attention"), ("mlp_dim", "feed_forward"), ("mod_dim", "modulation"),
                 ("refiner_dim", "refiner"))
EMBEDDERS = ("x_embedder", "t_embedder", "cap_embedder")

NETWORK_ARGS: dict[str, Any] = {
    "train_blocks": str, "rank_dropout": float, "module_dropout": float, "conv_dim": int, "conv_alpha": float,
    "split_qkv": lora_sd.arg_bool, "verbose": lora_sd.arg_bool, "embedder_dims": str,
    **{name: int for name, _ in TYPE_DIM_ARGS},
    **{name: float for name in lora_sd.LORAPLUS_ARGS},
    **lora_sd.DORA_ARGS,
}
NETWORK_ARG_CHOICES = {"train_blocks": TRAIN_BLOCKS}


def parse_embedder_dims(text: str) -> list[int]:
    body = text.strip().removeprefix("[").removesuffix("]")
    try:
        dims = [int(d) for d in body.split(",")]
    except ValueError:
        dims = []
    if len(dims) != 3:
        raise NetworkArgsError(f"--network_args embedder_dims={text}: three integers [x_embedder,t_embedder,cap_embedder]")
    return dims


class LoRANetworkLumina(LoRANetworkFlux):
    """The fused-qkv module, split_qkv file layout, DoRA and training methods are networks.lora_flux's; only the
    module names (upstream's NextDiT / Gemma 2) and the parameter groups are Lumina's."""

    def __init__(self, text_encoders: list[nn.Module], dit: nn.Module, multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: float = 1.0, dropout: float | None = None, rank_dropout: float | None = None,
                 module_dropout: float | None = None, train_blocks: str = "all",
                 modules_dim: dict[str, int] | None = None, modules_alpha: dict[str, float] | None = None,
                 split_qkv: bool = False, type_dims: dict[str, int] | None = None,
                 embedder_dims: list[int] | None = None, verbose: bool = False):
        nn.Module.__init__(self)
        if train_blocks not in TRAIN_BLOCKS:
            raise NetworkArgsError(f"--network_args train_blocks={train_blocks}: allowed: {', '.join(TRAIN_BLOCKS)}")
        self._set_options(multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout)
        self.is_sdxl = False
        self.train_blocks, self.split_qkv, self.train_t5xxl, self.reg_lrs = train_blocks, split_qkv, False, None
        type_dims = type_dims or {}
        skipped: list[str] = []

        def new(name: str, parts: list[nn.Linear], is_dit: bool, default_dim: int | None = None):
            if modules_dim is not None:
                dim, a = lora_sd.file_dim_alpha(name, modules_dim, modules_alpha) or (None, None)
            else:
                dim, a = (lora_dim if default_dim is None else default_dim), alpha
                for key, part in TYPE_DIM_ARGS if is_dit else ():
                    if type_dims.get(key) is not None and part in name:
                        dim = type_dims[key]
                        break
            if not dim:
                if modules_dim is None:
                    skipped.append(name)
                return None
            return FluxLoRAModule(name, parts, multiplier, dim, a, dropout, rank_dropout, module_dropout,
                                  split=split_qkv and is_dit)

        self.text_encoder_loras: list[FluxLoRAModule] = []
        for te in text_encoders:
            for path, child in lora_sd.target_layers(te, TEXT_ENCODER_TARGET_MODULES):
                if isinstance(child, nn.Linear):
                    m = new(f"{LORA_PREFIX_TEXT_ENCODER}_{path}".replace(".", "_"), [child], False)
                    if m is not None:
                        self.text_encoder_loras.append(m)

        modules = dict(dit.named_modules())
        keep = BLOCK_FILTERS[train_blocks]
        self.unet_loras: list[FluxLoRAModule] = []
        for upstream, parts in lumina_models.linear_map(dit.config).items():
            name = f"{LORA_PREFIX_LUMINA}_{upstream}".replace(".", "_")
            embedder = next((i for i, e in enumerate(EMBEDDERS) if upstream.startswith(e)), None)
            if embedder is not None:
                if modules_dim is None and not embedder_dims:
                    continue
                m = new(name, [modules[p] for p in parts], True,
                        default_dim=embedder_dims[embedder] if modules_dim is None else None)
            elif modules_dim is None and keep is not None and not any(k in name for k in keep):
                continue
            else:
                m = new(name, [modules[p] for p in parts], True)
            if m is not None:
                self.unet_loras.append(m)
        self._check_unique_names()
        logger.info("LoRA for Lumina 2: %d modules for Gemma 2, %d for the DiT (train_blocks=%s%s)",
                    len(self.text_encoder_loras), len(self.unet_loras), train_blocks, ", split qkv" if split_qkv else "")
        if verbose:
            for m in self.text_encoder_loras + self.unet_loras:
                logger.info("\t%-50s dim %d, alpha %s", m.lora_name, m.lora_dim, float(m.alpha))
            if skipped:
                logger.info("%d modules skipped (dim 0): %s", len(skipped), ", ".join(skipped))

    def prepare_optimizer_params(self, text_encoder_lr, unet_lr, default_lr):
        """Gemma 2's LoRA at the text encoder lr (one value or the first of a list), the DiT's at --unet_lr;
        LoRA+ "plus" groups as upstream."""
        if isinstance(text_encoder_lr, (list, tuple)):
            text_encoder_lr = text_encoder_lr[0] if text_encoder_lr else None
        self.requires_grad_(True)
        groups, descriptions = [], []
        for loras, lr, ratio, label in (
                (self.text_encoder_loras, default_lr if text_encoder_lr is None else text_encoder_lr,
                 self.loraplus_text_encoder_lr_ratio or self.loraplus_lr_ratio, "textencoder"),
                (self.unet_loras, default_lr if unet_lr is None else unet_lr,
                 self.loraplus_unet_lr_ratio or self.loraplus_lr_ratio, "unet")):
            if loras:
                g, d = lora_sd.assemble_param_groups(loras, lr, ratio, label)
                groups.extend(g)
                descriptions.extend(d)
        in_groups = {id(p) for g in groups for p in g["params"]}
        for p in self.parameters():
            if id(p) not in in_groups:
                p.requires_grad_(False)
        return groups, descriptions

    prepare_optimizer_params_with_multiple_te_lrs = prepare_optimizer_params


def parse_network_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Typed --network_args, checked before any model loads."""
    out = lora_sd.parse_network_kwargs(kwargs, NETWORK_ARGS, "networks.lora_lumina")
    if out.get("train_blocks", "all") not in TRAIN_BLOCKS:
        raise NetworkArgsError(f"--network_args train_blocks={out['train_blocks']}: allowed: {', '.join(TRAIN_BLOCKS)}")
    if "embedder_dims" in out:
        parse_embedder_dims(out["embedder_dims"])
    return out


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, ae, text_encoders, dit,
                   neuron_dropout: float | None = None, **kwargs) -> LoRANetworkLumina:
    """kohya's entry point; kwargs are --network_args."""
    opts = parse_network_kwargs(kwargs)
    network = LoRANetworkLumina(
        lora_sd.text_encoder_list(text_encoders), dit, multiplier=multiplier, lora_dim=network_dim or 4,
        alpha=1.0 if network_alpha is None else network_alpha, dropout=neuron_dropout,
        rank_dropout=opts.get("rank_dropout"), module_dropout=opts.get("module_dropout"),
        train_blocks=opts.get("train_blocks", "all"), split_qkv=opts.get("split_qkv", False),
        type_dims={k: opts[k] for k, _ in TYPE_DIM_ARGS if k in opts},
        embedder_dims=parse_embedder_dims(opts["embedder_dims"]) if "embedder_dims" in opts else None,
        verbose=opts.get("verbose", False))
    lora_sd.apply_loraplus_and_dora(network, opts)
    return network


def create_network_from_weights(multiplier: float, file: str | None, ae, text_encoders, dit,
                                weights_sd: dict | None = None, for_inference: bool = False,
                                neuron_dropout: float | None = None, **kwargs):
    """A network shaped like a LoRA file (its modules, dims and alphas)."""
    return lora_sd.network_from_weights(
        lambda shape, opts, sd: LoRANetworkLumina(lora_sd.text_encoder_list(text_encoders), dit, **shape),
        file, weights_sd, kwargs, parse_network_kwargs, multiplier=multiplier, neuron_dropout=neuron_dropout)

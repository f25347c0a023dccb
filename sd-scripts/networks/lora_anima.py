"""LoRA for Anima in kohya-ss/sd-scripts' key format (its networks.lora_anima).

Every Linear inside the DiT's `Block`, `PatchEmbed`, `TimestepEmbedding` and `FinalLayer` modules (and the LLM
adapter's `LLMAdapterTransformerBlock`s with ``train_llm_adapter=true``), named by its module path as upstream:
`lora_unet_blocks_0_self_attn_q_proj`, `lora_unet_blocks_0_mlp_layer1`, `lora_unet_llm_adapter_blocks_0_...`; the
AdaLN modulations, norms, embedders and the final layer are excluded by default (upstream's pattern
``.*(_modulation|_norm|_embedder|final_layer).*``); Qwen3's attention and MLP Linears as
`lora_te_layers_N_self_attn_q_proj` ... unless --network_train_unet_only.

``--network_args`` (upstream's): ``train_llm_adapter``, ``exclude_patterns`` / ``include_patterns`` (Python lists of
regular expressions, full match on the module path), ``network_reg_dims`` / ``network_reg_lrs``
(``regex=value,...``, full match, first wins), ``rank_dropout``, ``module_dropout``, ``verbose``, LoRA+ ratios; and
networks.lora's ``dora_wd`` / ``wd_on_output``.
"""
from __future__ import annotations

import ast
import logging
import re
from typing import Any

from torch import nn

from networks import lora as lora_sd
from networks.lora import NetworkArgsError
from networks.lora_flux import FluxLoRAModule, LoRANetworkFlux, parse_regex_values

logger = logging.getLogger(__name__)

FAMILIES = ("anima",)
LORA_PREFIX_ANIMA = "lora_unet"  # ComfyUI's name for the DiT
LORA_PREFIX_TEXT_ENCODER = "lora_te"
DIT_TARGET_MODULES = ("Block", "PatchEmbed", "TimestepEmbedding", "FinalLayer")
ADAPTER_TARGET_MODULES = ("LLMAdapterTransformerBlock",)
TEXT_ENCODER_TARGET_MODULES = ("Qwen3Attention", "Qwen3MLP", "Qwen3SdpaAttention", "Qwen3FlashAttention2")
DEFAULT_EXCLUDE = r".*(_modulation|_norm|_embedder|final_layer).*"

NETWORK_ARGS: dict[str, Any] = {
    "train_llm_adapter": lora_sd.arg_bool, "exclude_patterns": str, "include_patterns": str,
    "rank_dropout": float, "module_dropout": float, "verbose": lora_sd.arg_bool,
    "network_reg_dims": str, "network_reg_lrs": str,
    **{name: float for name in lora_sd.LORAPLUS_ARGS},
    **lora_sd.DORA_ARGS,
}


def parse_patterns(key: str, text: str | None) -> list[re.Pattern]:
    """A Python list (or one string) of regular expressions, as upstream's ast.literal_eval reads it."""
    if text is None:
        return []
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise NetworkArgsError(f"--network_args {key}={text}: a Python list of regular expressions, e.g. "
                               "[\".*mlp.*\"]") from e
    values = value if isinstance(value, list) else [value]
    try:
        return [re.compile(str(v)) for v in values]
    except re.error as e:
        raise NetworkArgsError(f"--network_args {key}: invalid regular expression ({e})") from e


class LoRANetworkAnima(LoRANetworkFlux):
    """networks.lora_flux's module and training methods (its parameter groups: Qwen3's LoRA at the first text encoder
    lr, the DiT's at --unet_lr, network_reg_lrs groups first); upstream's Anima module selection and names."""

    TE_PREFIXES = (LORA_PREFIX_TEXT_ENCODER,)
    reg_lr_match = staticmethod(lambda rx, lora: re.fullmatch(rx, lora.original_name))  # upstream: the module path

    def __init__(self, text_encoders: list[nn.Module], dit: nn.Module, multiplier: float = 1.0, lora_dim: int = 4,
                 alpha: float = 1.0, dropout: float | None = None, rank_dropout: float | None = None,
                 module_dropout: float | None = None, modules_dim: dict[str, int] | None = None,
                 modules_alpha: dict[str, float] | None = None, train_llm_adapter: bool = False,
                 exclude_patterns: list[re.Pattern] | None = None, include_patterns: list[re.Pattern] | None = None,
                 reg_dims: dict[str, int] | None = None, reg_lrs: dict[str, float] | None = None,
                 verbose: bool = False):
        nn.Module.__init__(self)
        self._set_options(multiplier, lora_dim, alpha, dropout, rank_dropout, module_dropout)
        self.is_sdxl = False
        self.train_blocks, self.split_qkv, self.train_t5xxl = "all", False, False
        self.train_llm_adapter, self.reg_lrs = train_llm_adapter, reg_lrs
        exclude = [*(exclude_patterns or []), re.compile(DEFAULT_EXCLUDE)]
        include = include_patterns or []
        skipped: list[str] = []

        def make(prefix: str, root: nn.Module, targets: tuple[str, ...]) -> list[FluxLoRAModule]:
            loras = []
            for path, child in lora_sd.target_layers(root, targets):
                if not isinstance(child, nn.Linear):
                    continue
                name = f"{prefix}_{path}".replace(".", "_")
                if any(p.fullmatch(path) for p in exclude) and not any(p.fullmatch(path) for p in include):
                    if verbose:
                        logger.info("exclude: %s", path)
                    continue
                if modules_dim is not None:
                    dim, a = lora_sd.file_dim_alpha(name, modules_dim, modules_alpha) or (None, None)
                else:
                    dim = next((d for rx, d in (reg_dims or {}).items() if re.fullmatch(rx, path)), lora_dim)
                    a = alpha
                if not dim:
                    if modules_dim is None:
                        skipped.append(name)
                    continue
                m = FluxLoRAModule(name, [child], multiplier, dim, a, dropout, rank_dropout, module_dropout)
                m.original_name = path
                loras.append(m)
            return loras

        self.text_encoder_loras = [m for te in text_encoders
                                   for m in make(LORA_PREFIX_TEXT_ENCODER, te, TEXT_ENCODER_TARGET_MODULES)]
        targets = DIT_TARGET_MODULES + (ADAPTER_TARGET_MODULES if train_llm_adapter else ())
        self.unet_loras = make(LORA_PREFIX_ANIMA, dit, targets)
        self._check_unique_names()
        logger.info("LoRA for Anima: %d modules for Qwen3, %d for the DiT%s", len(self.text_encoder_loras),
                    len(self.unet_loras), " (LLM adapter included)" if train_llm_adapter else "")
        if verbose:
            for m in self.text_encoder_loras + self.unet_loras:
                logger.info("\t%-60s dim %d, alpha %s", m.lora_name, m.lora_dim, float(m.alpha))
            if skipped:
                logger.info("%d modules skipped (dim 0): %s", len(skipped), ", ".join(skipped))


def parse_network_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Typed --network_args, checked before any model loads."""
    out = lora_sd.parse_network_kwargs(kwargs, NETWORK_ARGS, "networks.lora_anima")
    for key in ("exclude_patterns", "include_patterns"):
        parse_patterns(key, out.get(key))
    parse_regex_values("network_reg_dims", out.get("network_reg_dims") or "", int)
    parse_regex_values("network_reg_lrs", out.get("network_reg_lrs") or "", float)
    return out


def create_network(multiplier: float, network_dim: int | None, network_alpha: float | None, vae, text_encoders, dit,
                   neuron_dropout: float | None = None, **kwargs) -> LoRANetworkAnima:
    """kohya's entry point; kwargs are --network_args."""
    opts = parse_network_kwargs(kwargs)
    network = LoRANetworkAnima(
        lora_sd.text_encoder_list(text_encoders), dit, multiplier=multiplier, lora_dim=network_dim or 4,
        alpha=1.0 if network_alpha is None else network_alpha, dropout=neuron_dropout,
        rank_dropout=opts.get("rank_dropout"), module_dropout=opts.get("module_dropout"),
        train_llm_adapter=opts.get("train_llm_adapter", False),
        exclude_patterns=parse_patterns("exclude_patterns", opts.get("exclude_patterns")),
        include_patterns=parse_patterns("include_patterns", opts.get("include_patterns")),
        reg_dims=parse_regex_values("network_reg_dims", opts.get("network_reg_dims") or "", int) or None,
        reg_lrs=parse_regex_values("network_reg_lrs", opts.get("network_reg_lrs") or "", float) or None,
        verbose=opts.get("verbose", False))
    lora_sd.apply_loraplus_and_dora(network, opts)
    return network


def create_network_from_weights(multiplier: float, file: str | None, vae, text_encoders, dit,
                                weights_sd: dict | None = None, for_inference: bool = False,
                                neuron_dropout: float | None = None, **kwargs):
    """A network shaped like a LoRA file (its modules, dims and alphas; the LLM adapter's when it has them)."""
    return lora_sd.network_from_weights(
        lambda shape, opts, sd: LoRANetworkAnima(
            lora_sd.text_encoder_list(text_encoders), dit,
            train_llm_adapter=any("llm_adapter" in name for name in shape["modules_dim"]),
            include_patterns=[re.compile(".*")], **shape),  # a file's modules are all kept, excluded by default or not
        file, weights_sd, kwargs, parse_network_kwargs, multiplier=multiplier, neuron_dropout=neuron_dropout)

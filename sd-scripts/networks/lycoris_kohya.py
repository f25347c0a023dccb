"""`--network_module lycoris.kohya`: LyCORIS (the `lycoris-lora` package, install extra `lycoris`) on our diffusers
models, with the module set and key names sd-scripts + LyCORIS produce on sd-scripts' own UNets.

LyCORIS names a module `lora_unet_<module path>` / `lora_te[N]_<module path>` after the model it walks. sd-scripts
hands it its own UNet classes: for SDXL those use SGM paths (`input_blocks_4_1_transformer_blocks_0_attn1_to_q`)
and have no `conv_in` / `conv_out` / `time_embedding` / `add_embedding` (its embeddings are plain Sequentials),
and CLIP paths start with `text_model.`. So here, around LyCORIS' own create_network / create_network_from_weights:

- the preset's targets are adjusted to what sd-scripts' UNets have: for SDXL the TimestepEmbedding class and the
  conv_in/conv_out/time_embedding names are dropped; a layer that a preset reaches both through its class and
  its name gets one module (LyCORIS 4.1 would stop on the duplicate name); `CrossAttention` (sd-scripts' class)
  also targets diffusers' `Attention`;
- module names are translated before the network registers them (SGM names for SDXL, canonical CLIP paths), so
  the file's keys are sd-scripts' and files made there load here (`--network_weights`, `--dim_from_weights`,
  `--base_weights`).

- DyLoRA: the random rank draw runs eagerly inside compiled blocks (a graph break per DyLoRA module), and its
  files load back (LyCORIS 4.1 saves lora_down/lora_up but loads only its per-block lists); `load_weights` warns about keys that
  do not fit instead of dropping them silently.

FLUX.1: LyCORIS on sd-scripts walks the BFL model (its presets target `DoubleStreamBlock` / `SingleStreamBlock`)
and names modules after BFL paths (`lora_unet_double_blocks_0_img_attn_qkv`, `lora_te1_...` for CLIP-L): the
names ComfyUI maps onto its own (BFL) FLUX weights. Our transformer is diffusers', where one BFL Linear can be
several Linears fed the same input (qkv -> to_q/to_k/to_v; linear1 -> to_q/to_k/to_v/proj_mlp). So LyCORIS
walks a stand-in tree with the BFL paths and classes (`flux_standin`), whose Linears read their weight from the
diffusers parts, and each diffusers part adds its rows of the LyCORIS weight difference (`FluxPart`): inside the
compiled blocks, as for SD/SDXL. Files load back here and in ComfyUI.

Everything else (algos, presets, dora_wd, factor, conv_dim, dropouts, LoRA+, max norm, saving of the tensors) is
LyCORIS' own.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import types

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

MODULE_NAME = "lycoris.kohya"
EXTRA = "lycoris"
# the --network_args keys LyCORIS' kohya.create_network reads (lycoris-lora 4.x), with how it reads them: for the
# GUI's fields (--dump_options); LyCORIS itself ignores other keys
NETWORK_ARGS = {
    "algo": str, "preset": str, "conv_dim": int, "conv_alpha": float, "dropout": float, "rank_dropout": float,
    "module_dropout": float, "use_tucker": bool, "use_scalar": bool, "factor": int,
    "decompose_both": bool, "block_size": int, "constraint": float, "rescaled": bool, "train_norm": bool,
    "dora_wd": bool, "wd_on_output": bool, "full_matrix": bool, "bypass_mode": bool, "rs_lora": bool,
    "unbalanced_factorization": bool, "loraplus_lr_ratio": float, "loraplus_unet_lr_ratio": float,
    "loraplus_text_encoder_lr_ratio": float,
}
# LyCORIS' algorithms and built-in presets (a preset may also be a TOML file path)
NETWORK_ARG_CHOICES = {"algo": ("lora", "locon", "loha", "lokr", "dylora", "glora", "full", "diag-oft", "boft", "ia3"),
                       "preset": ("full", "full-lin", "attn-mlp", "attn-only", "unet-only", "unet-transformer-only",
                                  "unet-convblock-only", "ia3")}
NETWORK_ARG_ANY_VALUE = ("preset",)  # the choices are suggestions: a preset can also be a TOML file
# diffusers UNet layers LyCORIS presets name that sd-scripts' SDXL UNet does not have under these names
_SDXL_ABSENT = ("conv_in", "conv_out", "time_embedding", "add_embedding")


def import_lycoris():
    """lycoris.kohya, or OptionalPackageError naming the package and the install extra."""
    try:
        return importlib.import_module(MODULE_NAME)
    except ImportError as e:
        from library.errors import OptionalPackageError

        raise OptionalPackageError(
            f"--network_module {MODULE_NAME} needs the Python package 'lycoris-lora', which is not installed "
            f"(pip install lycoris-lora, or install this project with the '{EXTRA}' extra)") from e


def _as_lycoris_text_encoders(text_encoder):
    """sd-scripts passes one CLIP model for SD1.x/2.x (names lora_te_*) and a list for SDXL (lora_te1_/te2_)."""
    if isinstance(text_encoder, (list, tuple)):
        tes = [t for t in text_encoder if t is not None]
        return tes[0] if len(tes) == 1 else tes
    return text_encoder


def _is_sdxl(text_encoder, unet: nn.Module | None = None) -> bool:
    """Two text encoders, or (none passed) a UNet with SDXL's size/crop conditioning."""
    if isinstance(text_encoder, (list, tuple)) and len([t for t in text_encoder if t is not None]) == 2:
        return True
    config = getattr(unet, "config", None)
    return getattr(config, "addition_embed_type", None) == "text_time"


def kohya_names(text_encoder, unet: nn.Module) -> dict[str, str]:
    """LyCORIS' name of every module (walking our models) -> the name it has on sd-scripts' models."""
    from library.model_util import text_encoder_hf_module_names
    from networks.lora import _kohya_unet_path

    out = {}
    name_map = None
    if _is_sdxl(text_encoder, unet):
        from library.model_util import unet_sgm_module_names

        name_map = unet_sgm_module_names(unet)
    for path, _ in unet.named_modules():
        if not path:
            continue
        try:
            kohya = _kohya_unet_path(path, name_map)
        except KeyError:
            continue
        out[f"lora_unet_{path}".replace(".", "_")] = f"lora_unet_{kohya}".replace(".", "_")
    tes = _as_lycoris_text_encoders(text_encoder)
    tes = tes if isinstance(tes, list) else [tes]
    for i, te in enumerate(tes):
        if te is None:
            continue
        prefix = "lora_te" if len(tes) == 1 else f"lora_te{i + 1}"
        for path, canonical in text_encoder_hf_module_names(te).items():
            out[f"{prefix}_{path}".replace(".", "_")] = f"{prefix}_{canonical}".replace(".", "_")
    return out


@contextlib.contextmanager
def _targets_as_sd_scripts(lk, unet: nn.Module, is_sdxl: bool):
    """Adjusts the class-level targets LyCORIS' apply_preset sets (see the module docstring); restored after."""
    cls = lk.LycorisNetworkKohya
    original = cls.__dict__["apply_preset"]

    def apply_preset(klass, preset):
        original.__func__(klass, preset)
        modules = list(klass.UNET_TARGET_REPLACE_MODULE)
        if "CrossAttention" in modules and "Attention" not in modules:
            modules.append("Attention")
        if is_sdxl:
            modules = [m for m in modules if m != "TimestepEmbedding"]
        names = [n for n in klass.UNET_TARGET_REPLACE_NAME
                 if not (is_sdxl and n.split(".")[0] in _SDXL_ABSENT)]
        covered = {path for path, m in unet.named_modules() if type(m).__name__ in modules}
        names = [n for n in names if not any(n == c or n.startswith(c + ".") for c in covered)]
        klass.UNET_TARGET_REPLACE_MODULE, klass.UNET_TARGET_REPLACE_NAME = modules, names
        return klass

    cls.apply_preset = classmethod(apply_preset)
    try:
        yield
    finally:
        cls.apply_preset = original


def _rename_modules(network, names: dict[str, str]) -> None:
    for lora in network.text_encoder_loras + network.unet_loras:
        lora.lora_name = names.get(lora.lora_name, lora.lora_name)


def _compile_friendly(network) -> None:
    """LyCORIS DyLoRA draws its rank with Python's `random` and slices by it, which a compiled block cannot trace:
    the draw runs eagerly (a graph break at each DyLoRA module, named so in the compile log). The blocks below the
    drawn one then get no gradient at all, as in LyCORIS, so the optimizer (momentum, weight decay) leaves them
    alone -- a tensor-masked draw inside the graph would give them zero gradients instead."""
    for m in network.text_encoder_loras + network.unet_loras:
        if type(m).__name__ == "DyLoraModule":
            m.get_random_rank_weight = torch._dynamo.disable(m.get_random_rank_weight)
            m.eager_in_compile = True


def _bypass_in_layer_dtype(network) -> None:
    """In bypass mode LyCORIS adds its difference, computed in the adapter's float32, to the layer's output: for IA3,
    and for Diag-OFT where a block is 1x1 (the einsum is then a plain product, which autocast does not cast), the
    sum is float32 where the layer alone gives the autocast dtype. That float32 stream reaches a bf16 LayerNorm,
    which CPU autocast does not cast ("mixed dtype (CPU)" at step 1; on CUDA a float32 stream). So the module
    returns what its layer returns: the autocast dtype where autocast is on, else the input's dtype."""
    for m in network.text_encoder_loras + network.unet_loras:
        if getattr(m, "bypass_mode", False):
            m.bypass_forward = _in_layer_dtype(m.bypass_forward)


def _in_layer_dtype(bypass_forward):
    def forward(x, *args, **kwargs):
        out = bypass_forward(x, *args, **kwargs)
        device = x.device.type
        return out.to(torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype)

    return forward


def _dylora_file_to_lists(network, sd: dict) -> dict:
    """LyCORIS 4.1 saves a DyLoRA module as lora_down/lora_up but loads only its down_list/up_list blocks (its own
    files do not load back): split the file's tensors into the blocks."""
    sd = dict(sd)
    for m in network.text_encoder_loras + network.unet_loras:
        if type(m).__name__ != "DyLoraModule" or f"{m.lora_name}.lora_down.weight" not in sd:
            continue
        down = sd.pop(f"{m.lora_name}.lora_down.weight").reshape(m.lora_dim, -1)
        up = sd.pop(f"{m.lora_name}.lora_up.weight").reshape(-1, m.lora_dim)
        for i in range(m.block_count):
            rows = slice(i * m.block_size, (i + 1) * m.block_size)
            sd[f"{m.lora_name}.down_list.{i}"] = down[rows]
            sd[f"{m.lora_name}.up_list.{i}"] = up[:, rows]
    return sd


def _load_weights(self, file):
    """--network_weights for a LyCORIS network: LyCORIS' own loading, DyLoRA files made loadable, and a warning
    naming what did not fit (LyCORIS only returns it)."""
    from networks.lora import load_lora_state_dict

    missing, unexpected = self.load_state_dict(_dylora_file_to_lists(self, load_lora_state_dict(file)), strict=False)
    if unexpected:
        logger.warning("--network_weights %s: %d keys do not belong to this LyCORIS network (other algo or "
                       "targets?), e.g. %s", file, len(unexpected), unexpected[:3])
    if missing:
        logger.warning("--network_weights %s: %d keys of the network are not in the file, e.g. %s", file,
                       len(missing), missing[:3])
    return {"missing keys": missing, "unexpected keys": unexpected}


def create_network(multiplier, network_dim, network_alpha, vae, text_encoder, unet, neuron_dropout=None, **kwargs):
    lk = import_lycoris()
    if is_flux(unet):
        network = create_flux_network(lk, multiplier, network_dim, network_alpha, vae, text_encoder, unet, **kwargs)
        _log_modules(network)
        return network
    is_sdxl = _is_sdxl(text_encoder, unet)
    with _targets_as_sd_scripts(lk, unet, is_sdxl):
        network = lk.create_network(multiplier, network_dim, network_alpha, vae,
                                    _as_lycoris_text_encoders(text_encoder), unet, **kwargs)
    _rename_modules(network, kohya_names(text_encoder, unet))
    _compile_friendly(network)
    _bypass_in_layer_dtype(network)
    network.load_weights = types.MethodType(_load_weights, network)
    _log_modules(network)
    return network


def _log_modules(network) -> None:
    logger.info("LyCORIS: %d text-encoder and %d UNet modules (%s)", len(network.text_encoder_loras),
                len(network.unet_loras), ", ".join(sorted({type(m).__name__ for m in network.unet_loras})))


def create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None, for_inference=False,
                                **kwargs):
    """A LyCORIS network shaped like the file (sd-scripts' names), made by LyCORIS from the file's tensors."""
    lk = import_lycoris()
    from networks.lora import load_lora_state_dict

    if weights_sd is None:
        weights_sd = load_lora_state_dict(file)
    if is_flux(unet):
        return create_flux_network_from_weights(lk, multiplier, weights_sd, vae, text_encoder, unet, for_inference,
                                                **kwargs), weights_sd
    names = kohya_names(text_encoder, unet)
    to_lycoris = {v: k for k, v in names.items()}

    def lyco_key(key):
        module, _, rest = key.partition(".")
        return f"{to_lycoris.get(module, module)}.{rest}" if rest else key

    network, _ = lk.create_network_from_weights(multiplier, None, vae, _as_lycoris_text_encoders(text_encoder), unet,
                                                weights_sd={lyco_key(k): v for k, v in weights_sd.items()},
                                                for_inference=for_inference, **kwargs)
    _rename_modules(network, names)
    _compile_friendly(network)
    _bypass_in_layer_dtype(network)
    network.load_weights = types.MethodType(_load_weights, network)
    return network, weights_sd


# -- FLUX.1 (see the module docstring) ---------------------------------------------------------------------------
# classes of the BFL modules LyCORIS' presets select by name (DoubleStreamBlock, SingleStreamBlock, SelfAttention)
_BFL_BLOCK_CLASSES = {"double_blocks": "DoubleStreamBlock", "single_blocks": "SingleStreamBlock"}
_BFL_CLASSES = {"img_attn": "SelfAttention", "txt_attn": "SelfAttention", "img_mod": "Modulation",
                "txt_mod": "Modulation", "modulation": "Modulation", "img_mlp": "Sequential", "txt_mlp": "Sequential",
                "time_in": "MLPEmbedder", "vector_in": "MLPEmbedder", "guidance_in": "MLPEmbedder",
                "final_layer": "LastLayer", "double_blocks": "ModuleList", "single_blocks": "ModuleList"}
_standin_classes: dict[str, type] = {}


def _standin_class(name: str) -> type:
    if name not in _standin_classes:
        _standin_classes[name] = type(name, (nn.Module,), {"__module__": __name__})
    return _standin_classes[name]


class Linear(nn.Linear):
    """A BFL Linear that diffusers holds as parts fed the same input: its weight and bias are the parts' rows,
    joined when read. (Named Linear: LyCORIS treats other Linear classes as quantized layers.)"""

    def __init__(self, parts: list[nn.Linear]):
        nn.Module.__init__(self)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.__dict__["parts"] = list(parts)  # not submodules: the network holds only LyCORIS weights
        self.__dict__["offsets"] = [sum(p.out_features for p in parts[:i]) for i in range(len(parts))]

    @property
    def weight(self):
        return torch.cat([p.weight for p in self.parts]) if len(self.parts) > 1 else self.parts[0].weight

    @property
    def bias(self):
        if any(p.bias is None for p in self.parts):
            return None
        return torch.cat([p.bias for p in self.parts]) if len(self.parts) > 1 else self.parts[0].bias

    def forward(self, x):  # never called: the parts run in the model
        return torch.nn.functional.linear(x, self.weight, self.bias)


def is_flux(unet) -> bool:
    return hasattr(getattr(unet, "config", None), "num_single_layers")


def flux_standin(transformer: nn.Module) -> nn.Module:
    """The BFL module tree of a diffusers FLUX transformer, for LyCORIS to walk: BFL paths and classes, Linears
    over the diffusers parts (flux_models.bfl_linear_map)."""
    from library import flux_models

    cfg = transformer.config
    layers = dict(transformer.named_modules())
    root = _standin_class("Flux")()
    for bfl, parts in flux_models.bfl_linear_map(cfg.num_layers, cfg.num_single_layers, cfg.guidance_embeds).items():
        node, path = root, bfl.split(".")
        for i, name in enumerate(path[:-1]):
            if name not in node._modules:
                cls = _BFL_BLOCK_CLASSES.get(path[i - 1]) if i else None
                node.add_module(name, _standin_class(cls or _BFL_CLASSES.get(name, "Module"))())
            node = node._modules[name]
        node.add_module(path[-1], Linear([layers[p] for p in parts]))
    return root


def _forward_diff(m) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight (and bias) difference of the whole layer at multiplier 1, as the module's own training forward
    computes it (LyCORIS 4.1's get_diff_weight scales LoKr/LoHa by alpha/rank twice; its forward and ComfyUI once)."""
    kind = type(m).__name__
    if kind == "FullModule":  # the difference itself is the trained tensor here (see _flux_full_module)
        return m.weight, m.bias
    if kind == "LoConModule":
        return m.make_weight(m.lora_down.weight.device) * m.scale, None
    return m.get_weight(m.shape) * m.scalar, None


def _part_delta_weight(m, whole: Linear, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Part i's rows of (LyCORIS' merged weight - the base weight) and of its bias difference (algo full)."""
    from lycoris.functional.general import weight_decompose

    part = whole.parts[i]
    rows = slice(whole.offsets[i], whole.offsets[i] + part.out_features)
    diff, diff_b = _forward_diff(m)
    diff = diff.reshape(whole.out_features, whole.in_features)
    if getattr(m, "wd", False):  # DoRA: the norm per output row (wd_on_output, the default) or per input column
        if m.wd_on_out:
            base = part.weight.detach().to(diff.dtype)
            merged = weight_decompose(base + diff[rows], m.dora_scale[rows], m.multiplier, True)
        else:
            full = whole.weight.detach().to(diff.dtype)
            base = full[rows]
            merged = weight_decompose(full + diff, m.dora_scale, m.multiplier, False)[rows]
        delta = merged - base
    else:
        delta = diff[rows] * m.multiplier
    return delta, None if diff_b is None else diff_b[rows] * m.multiplier


def _locon_rows(m, x: torch.Tensor, rows: slice) -> torch.Tensor:
    """LoRA/LoCon without DoRA: up[rows](down(x)), as LyCORIS' bypass path (rank dropout on the rank axis)."""
    mid = F.linear(x, m.lora_down.weight.to(x))
    if m.rank_dropout and m.training:
        drop = (torch.rand(m.lora_dim, device=mid.device) > m.rank_dropout).to(mid.dtype)
        if m.rank_dropout_scale:
            drop = drop / drop.mean()
        mid = mid * drop
    out = F.linear(mid, m.lora_up.weight[rows].to(x))
    return m.dropout(out * (m.scale * m.multiplier) * m.scalar.to(out))


def _install_parts(m) -> None:
    """Each diffusers part of the LyCORIS module's BFL Linear adds its rows of the module's difference."""
    whole: Linear = m.org_module[0]
    plain_lora = type(m).__name__ == "LoConModule" and not m.wd and not m.tucker and m.module_type == "linear"
    m.__dict__["_flux_parts"] = []
    for i, part in enumerate(whole.parts):
        org = part.forward
        rows = slice(whole.offsets[i], whole.offsets[i] + part.out_features)

        def forward(x, *args, _org=org, _i=i, _rows=rows, **kwargs):
            base = _org(x, *args, **kwargs)
            if m.module_dropout and m.training and torch.rand(1) < m.module_dropout:
                return base
            if plain_lora:
                return base + _locon_rows(m, x, _rows)
            delta, bias = _part_delta_weight(m, whole, _i)
            return base + F.linear(x, delta.to(x.dtype), None if bias is None else bias.to(x.dtype))

        forward.__qualname__ = f"{type(m).__name__}.forward"  # the compile log names the adapter by it
        part.forward = forward
        m._flux_parts.append((part, org))


def _flux_full_module(m) -> None:
    """LyCORIS' full algo keeps the difference as its weight here (it is never folded into the parts); its file
    holds `diff` / `diff_b` as LyCORIS writes them."""
    m._org_weight = [None]  # LyCORIS' CPU copy of the base weight is not needed here
    m.org_bias = None

    def custom_state_dict():
        sd = {"diff": m.weight.data.cpu()}
        if m.bias is not None:
            sd["diff_b"] = m.bias.data.cpu()
        return sd

    m.custom_state_dict = custom_state_dict


def _flux_apply_to(self, text_encoder, unet, apply_text_encoder=None, apply_unet=None):
    if not apply_text_encoder:
        self.text_encoder_loras = []
    if not apply_unet:
        self.unet_loras = []
    self.loras = self.text_encoder_loras + self.unet_loras
    for lora in self.text_encoder_loras:
        lora.apply_to()
    for lora in self.unet_loras:
        _install_parts(lora)
    for lora in self.loras:
        self.add_module(lora.lora_name, lora)
    if self.weights_sd:
        self.load_state_dict(self.weights_sd, False)


@torch.no_grad()
def _flux_merge_to(self, text_encoder, unet, weights_sd, dtype, device):
    """--base_weights: the differences added to the model's weights (the diffusers parts row by row)."""
    for lora in self.text_encoder_loras:
        lora.merge_to(1)
    for m in self.unet_loras:
        m.to(device)
        whole = m.org_module[0]
        for i, part in enumerate(whole.parts):
            delta, bias = _part_delta_weight(m, whole, i)
            part.weight.add_(delta.to(part.weight))
            if bias is not None and part.bias is not None:
                part.bias.add_(bias.to(part.bias))


def _flux_te_names(text_encoders: list) -> dict[str, str]:
    """LyCORIS' names of CLIP-L's modules (walking transformers' model) -> canonical `lora_te1_text_model_...`."""
    from library.model_util import text_encoder_hf_module_names

    out = {}
    for i, te in enumerate(text_encoders):
        if te is not None and i == 0:
            for path, canonical in text_encoder_hf_module_names(te).items():
                out[f"lora_te{i + 1}_{path}".replace(".", "_")] = f"lora_te{i + 1}_{canonical}".replace(".", "_")
    return out


FLUX_ALGOS = ("lora", "locon", "loha", "lokr", "full")


def _flux_network_methods(network, standin) -> None:
    network.__dict__["flux_standin"] = standin  # not a submodule: it holds no weights
    network.apply_to = types.MethodType(_flux_apply_to, network)
    network.merge_to = types.MethodType(_flux_merge_to, network)
    network.load_weights = types.MethodType(_load_weights, network)
    for m in network.unet_loras:
        if type(m).__name__ == "FullModule":
            _flux_full_module(m)


def _flux_text_encoders(text_encoder) -> list:
    return [t for t in (text_encoder if isinstance(text_encoder, (list, tuple)) else [text_encoder])] \
        if text_encoder is not None else []


def check_flux_algo(network_args: dict, error=None) -> None:
    """The algos whose modules run on FLUX.1's diffusers parts here; others are one line naming the allowed ones."""
    from networks.lora import NetworkArgsError

    algo = str(network_args.get("algo", "lora") or "lora").lower()
    if algo not in FLUX_ALGOS:
        raise (error or NetworkArgsError)(f"--network_args algo={algo}: on FLUX.1 allowed: {', '.join(FLUX_ALGOS)}")


def create_flux_network(lk, multiplier, network_dim, network_alpha, vae, text_encoder, flux, **kwargs):
    check_flux_algo(kwargs)
    tes = _flux_text_encoders(text_encoder)
    standin = flux_standin(flux)
    network = lk.create_network(multiplier, network_dim, network_alpha, vae, tes or None, standin, **kwargs)
    _rename_modules(network, _flux_te_names(tes))
    _flux_network_methods(network, standin)
    _bypass_in_layer_dtype(network)
    return network


def create_flux_network_from_weights(lk, multiplier, weights_sd, vae, text_encoder, flux, for_inference, **kwargs):
    tes = _flux_text_encoders(text_encoder)
    names = _flux_te_names(tes)
    to_lycoris = {v: k for k, v in names.items()}

    def lyco_key(key):
        module, _, rest = key.partition(".")
        return f"{to_lycoris.get(module, module)}.{rest}" if rest else key

    standin = flux_standin(flux)
    network, _ = lk.create_network_from_weights(multiplier, None, vae, tes or None, standin,
                                                weights_sd={lyco_key(k): v for k, v in weights_sd.items()},
                                                for_inference=for_inference, **kwargs)
    _rename_modules(network, names)
    _flux_network_methods(network, standin)
    _bypass_in_layer_dtype(network)
    return network

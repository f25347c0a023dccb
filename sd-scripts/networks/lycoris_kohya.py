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

Everything else (algos, presets, dora_wd, factor, conv_dim, dropouts, LoRA+, max norm, saving of the tensors) is
LyCORIS' own. FLUX.1 is not supported with LyCORIS here (diffusers' FLUX blocks are not the BFL classes LyCORIS
targets): flux_train_network.py refuses it.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import types

import torch
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
    is_sdxl = _is_sdxl(text_encoder, unet)
    with _targets_as_sd_scripts(lk, unet, is_sdxl):
        network = lk.create_network(multiplier, network_dim, network_alpha, vae,
                                    _as_lycoris_text_encoders(text_encoder), unet, **kwargs)
    _rename_modules(network, kohya_names(text_encoder, unet))
    _compile_friendly(network)
    network.load_weights = types.MethodType(_load_weights, network)
    logger.info("LyCORIS: %d text-encoder and %d UNet modules (%s)", len(network.text_encoder_loras),
                len(network.unet_loras), ", ".join(sorted({type(m).__name__ for m in network.unet_loras})))
    return network


def create_network_from_weights(multiplier, file, vae, text_encoder, unet, weights_sd=None, for_inference=False,
                                **kwargs):
    """A LyCORIS network shaped like the file (sd-scripts' names), made by LyCORIS from the file's tensors."""
    lk = import_lycoris()
    from networks.lora import load_lora_state_dict

    if weights_sd is None:
        weights_sd = load_lora_state_dict(file)
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
    network.load_weights = types.MethodType(_load_weights, network)
    return network, weights_sd

"""SD1.x / SD2.x / SDXL model loading and saving.

Inputs: a single file (.safetensors / .ckpt) in the LDM (SD1/SD2) or SGM (SDXL) key layout that A1111, ComfyUI
and kohya's sd-scripts write, a diffusers folder, or a hub id (the only case that touches the network).
The architecture comes from the configs shipped in ``library/configs/<family>/<component>/config.json``; sizes
(channels, depths, vocab, ...) are read from the weights' shapes, so smaller models of the same layout load too.

LDM -> diffusers uses diffusers' own conversion functions (``diffusers.loaders.single_file_utils``);
diffusers -> LDM/SGM (needed to save) is our own mapping below, proven by round-trip tests.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from library import files
from library.compile.regional import strip_orig_mod  # noqa: F401 - the one shared helper; re-exported
from library.errors import ModelLoadError  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

SD_FAMILIES = ("sd1", "sd2", "sdxl")
FAMILY_LABELS = {"sd1": "SD1.x", "sd2": "SD2.x", "sdxl": "SDXL", "flux": "FLUX.1"}
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_COMPONENTS = {
    "sd1": ("unet", "vae", "text_encoder"),
    "sd2": ("unet", "vae", "text_encoder"),
    "sdxl": ("unet", "vae", "text_encoder", "text_encoder_2"),
}

# Key prefixes of the single-file layouts.
UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
SD1_TE_PREFIX = "cond_stage_model.transformer."  # HF CLIP keys follow ("text_model.…")
SD2_TE_PREFIX = "cond_stage_model.model."  # open_clip keys follow
SDXL_TE1_PREFIX = "conditioner.embedders.0.transformer."  # HF CLIP keys follow
SDXL_TE2_PREFIX = "conditioner.embedders.1.model."  # open_clip keys follow

# Where tokenizers come from when the model itself has none (kohya's defaults). With --tokenizer_cache_dir they are
# looked up (and, when downloaded, saved) at <cache>/<hub id with "/" -> "_">, as kohya's sd-scripts do.
TOKENIZER_SOURCES = {
    "sd1": [("openai/clip-vit-large-patch14", None)],
    "sd2": [("stabilityai/stable-diffusion-2", "tokenizer")],
    "sdxl": [("openai/clip-vit-large-patch14", None), ("laion/CLIP-ViT-bigG-14-laion2B-39B-b160k", None)],
}
TOKENIZER_MAX_LENGTH = 77


def add_sd_model_arguments(parser) -> None:
    """The SD1.x/2.x/SDXL model flags (train_util.add_sd_models_arguments adds them)."""
    parser.add_argument("--v2", action="store_true", help="the model is Stable Diffusion 2.x")
    parser.add_argument("--v_parameterization", action="store_true", help="v-prediction model (SD2.x 768-v)")
    parser.add_argument("--pretrained_model_name_or_path", type=str, default=None,
                        help="single-file checkpoint (.safetensors/.ckpt) or diffusers folder (or a hub id)")
    parser.add_argument("--tokenizer_cache_dir", type=str, default=None,
                        help="folder with (or to keep) the tokenizers, for offline use")
    parser.add_argument("--vae", type=str, default=None, help="VAE to use instead of the checkpoint's")


@dataclass
class SDComponents:
    family: str
    unet: object
    vae: object
    text_encoders: list  # sd1/sd2: [CLIPTextModel]; sdxl: [CLIPTextModel, CLIPTextModelWithProjection]
    tokenizers: list  # one per text encoder
    prediction_type: str = "epsilon"  # "epsilon" | "v_prediction"
    source: str = ""  # path or hub id it came from
    # Single-file weights that have no place in the diffusers modules (SD2's last open_clip layer and
    # text_projection, logit_scale). Kept so that saving a single file writes them back unchanged.
    extra_state: dict = field(default_factory=dict)

    # the neutral names the training core (library.run, library.targets) uses
    @property
    def denoiser(self):
        return self.unet

    @property
    def autoencoder(self):
        return self.vae


# --------------------------------------------------------------------------------------------------------------
# shipped configs


def load_arch_config(family: str, component: str) -> dict:
    """The shipped architecture config (diffusers/transformers config.json) of a model family's component."""
    _check_family(family)
    if component not in _COMPONENTS[family]:
        raise ValueError(f"unknown component {component!r} for {family}; allowed: {', '.join(_COMPONENTS[family])}")
    with open(CONFIG_DIR / family / component / "config.json", encoding="utf-8") as f:
        return json.load(f)


def _check_family(family: str) -> None:
    if family not in SD_FAMILIES:
        raise ValueError(f"unknown model family {family!r}; allowed: {', '.join(SD_FAMILIES)}")


def _clip_class(cfg: dict):
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection if "WithProjection" in cfg.get("architectures", [""])[0] else CLIPTextModel


def _clip_config(cfg: dict):
    from transformers import CLIPTextConfig

    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    return CLIPTextConfig(**cfg)


def clip_num_heads(hidden_size: int) -> int:
    """CLIP text encoders use 64-dim heads (the convention this loader assumes for files of any size)."""
    return max(1, hidden_size // 64)


def unet_attention_head_dim(family: str, block_out_channels) -> int | list:
    """diffusers' ``attention_head_dim`` (really the head count): SD1 uses 8 heads, SD2/SDXL 64-dim heads."""
    if family == "sd1":
        return 8
    return [max(1, c // 64) for c in block_out_channels]


# --------------------------------------------------------------------------------------------------------------
# reading files


def _load_ckpt(path: Path) -> dict:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - old Lightning checkpoints pickle extra objects
        logger.warning(
            "%s: not loadable with torch.load(weights_only=True) (%s); loading it as a full pickle. "
            "Only do this with files you trust; prefer .safetensors.", path, type(e).__name__)
        sd = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise ModelLoadError(f"{path}: not a checkpoint (expected a dict of tensors, got {type(sd).__name__})")
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def load_state_dict_file(path) -> dict:
    """All tensors of a .safetensors / .ckpt / .pt / .bin file, on the CPU, ``_orig_mod.`` stripped."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        from library.safetensors_io import load_file

        try:
            sd = load_file(path, device="cpu")
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"{path}: not a readable .safetensors file ({e})") from e
    elif suffix in (".ckpt", ".pt", ".pth", ".bin"):
        try:
            sd = _load_ckpt(path)
        except ModelLoadError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"{path}: not a readable checkpoint ({e})") from e
    else:
        raise ModelLoadError(f"{path}: unsupported file type {suffix!r}; allowed: .safetensors, .ckpt")
    return strip_orig_mod(sd)


def _read_keys(path: Path) -> list[str]:
    if path.suffix.lower() == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    return list(load_state_dict_file(path).keys())


def _family_from_keys(keys) -> str | None:
    keys = set(keys)
    if any(k.startswith("conditioner.embedders.1.") for k in keys):
        return "sdxl"
    if any(k.startswith(SD2_TE_PREFIX) for k in keys):
        return "sd2"
    if any(k.startswith("cond_stage_model.transformer.") for k in keys):
        return "sd1"
    if any(k.startswith("add_embedding.") for k in keys) or any(k.startswith("label_emb.") for k in keys):
        return "sdxl"
    if any(k.startswith(("double_blocks.", "model.diffusion_model.double_blocks.")) for k in keys):
        return "flux"
    return None


def _describe_other(keys) -> str:
    """What a file that is no full SD checkpoint looks like, for the error message."""
    keys = list(keys)
    if any(k.startswith(("lora_unet_", "lora_te")) for k in keys):
        return "it looks like a LoRA (load it with --network_weights)"
    if any(k.startswith("conditioner.embedders.0.model.") for k in keys):
        return "it looks like the SDXL refiner, which is not supported"
    if any("joint_blocks." in k for k in keys):
        return "it looks like an SD3 model, which is not supported"
    if keys and all(k.startswith(("encoder.", "decoder.", "quant_conv.", "post_quant_conv.", VAE_PREFIX)) for k in keys):
        return "it looks like a VAE alone (pass it with --vae)"
    if any(k.startswith(UNET_PREFIX) for k in keys):
        return "it has a UNet but no text encoders"
    return "is this a full SD1.x/SD2.x/SDXL checkpoint?"


def _family_from_diffusers_folder(folder: Path) -> str | None:
    index = folder / "model_index.json"
    if index.is_file():
        cls = json.loads(index.read_text(encoding="utf-8")).get("_class_name", "")
        if "XL" in cls:
            return "sdxl"
    if (folder / "text_encoder_2").is_dir():
        return "sdxl"
    te_cfg = folder / "text_encoder" / "config.json"
    if te_cfg.is_file():
        act = json.loads(te_cfg.read_text(encoding="utf-8")).get("hidden_act")
        return "sd1" if act == "quick_gelu" else "sd2"
    return None


def _is_diffusers_folder(path: Path) -> bool:
    return path.is_dir() and ((path / "model_index.json").is_file() or (path / "unet" / "config.json").is_file())


def detect_family(path) -> str | None:
    """"sd1" / "sd2" / "sdxl" from a single file's keys or a diffusers folder's configs ("flux" for a FLUX.1 file,
    so that callers can say which script to use); None when unknown."""
    path = Path(path)
    if path.is_file():
        try:
            return _family_from_keys(_read_keys(path))
        except Exception:  # noqa: BLE001
            return None
    if _is_diffusers_folder(path):
        return _family_from_diffusers_folder(path)
    return None


def _check_detected_family(path, detected: str | None, family: str) -> None:
    if detected is not None and detected != family:
        hint = {"sdxl": "use the SDXL script (sdxl_train*.py)", "sd2": "add --v2 (SD2.x)",
                "sd1": "leave out --v2 (SD1.x)", "flux": "use the FLUX.1 script (flux_train*.py)"}[detected]
        raise ModelLoadError(
            f"{path}: this is {'a' if detected == 'flux' else 'an'} {FAMILY_LABELS[detected]} model (detected from its weights), but "
            f"{FAMILY_LABELS[family]} was requested; {hint}")


# --------------------------------------------------------------------------------------------------------------
# architecture from shapes (LDM/SGM keys, prefixes removed)


def _sub(sd: dict, prefix: str) -> dict:
    n = len(prefix)
    return {k[n:]: v for k, v in sd.items() if k.startswith(prefix)}


def _count(sd: dict, prefix: str) -> int:
    """Number of consecutive integer children ``prefix{i}.`` present in the keys."""
    ids = {int(k[len(prefix):].split(".", 1)[0]) for k in sd if k.startswith(prefix) and k[len(prefix):].split(".", 1)[0].isdigit()}
    return max(ids) + 1 if ids else 0


def infer_unet_config(family: str, ldm_unet: dict, pooled_dim: int | None = None) -> dict:
    """UNet2DConditionModel config: the family's shipped config with sizes read from the LDM UNet weights."""
    cfg = load_arch_config(family, "unet")
    try:
        conv_in = ldm_unet["input_blocks.0.0.weight"]
        n_out = _count(ldm_unet, "output_blocks.")
        n_in = _count(ldm_unet, "input_blocks.")
        ops = sorted(i for i in range(n_in) if f"input_blocks.{i}.0.op.weight" in ldm_unet)
        layers = ops[0] - 1 if ops else n_in - 1
        levels = n_out // (layers + 1)
        channels, has_attn, depth = [], [], []
        for lvl in range(levels):
            first = 1 + lvl * (layers + 1)
            channels.append(ldm_unet[f"input_blocks.{first}.0.out_layers.3.weight"].shape[0])
            attn = f"input_blocks.{first}.1."
            has_attn.append(any(k.startswith(attn) for k in ldm_unet))
            depth.append(_count(ldm_unet, attn + "transformer_blocks.") or 1)
        attn_keys = [k for k in ldm_unet if k.endswith("attn2.to_k.weight")]
        proj_in = [k for k in ldm_unet if k.endswith(".proj_in.weight")]
    except (KeyError, IndexError, ValueError) as e:
        raise ModelLoadError(f"the UNet weights do not have the {FAMILY_LABELS[family]} layout (missing {e})") from e
    cfg.update(
        in_channels=conv_in.shape[1],
        out_channels=ldm_unet["out.2.weight"].shape[0],
        block_out_channels=channels,
        layers_per_block=layers,
        down_block_types=["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in has_attn],
        up_block_types=["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(has_attn)],
        attention_head_dim=unet_attention_head_dim(family, channels),
    )
    if family != "sd1":
        cfg["transformer_layers_per_block"] = depth
    if attn_keys:
        cfg["cross_attention_dim"] = ldm_unet[attn_keys[0]].shape[1]
    if proj_in:
        cfg["use_linear_projection"] = ldm_unet[proj_in[0]].ndim == 2
    time_dim = ldm_unet["time_embed.0.weight"].shape[0]
    if time_dim != channels[0] * 4:
        cfg["time_embedding_dim"] = time_dim
    if cfg.get("addition_embed_type") == "text_time":
        if "label_emb.0.0.weight" not in ldm_unet:
            raise ModelLoadError("the UNet has no SDXL size/crop conditioning (label_emb); it is not an SDXL UNet")
        in_dim = ldm_unet["label_emb.0.0.weight"].shape[1]
        cfg["projection_class_embeddings_input_dim"] = in_dim
        if pooled_dim is not None:
            cfg["addition_time_embed_dim"] = (in_dim - pooled_dim) // 6
    return cfg


def infer_vae_config(family: str, ldm_vae: dict) -> dict:
    cfg = load_arch_config(family, "vae")
    try:
        levels = _count(ldm_vae, "encoder.down.")
        cfg.update(
            in_channels=ldm_vae["encoder.conv_in.weight"].shape[1],
            out_channels=ldm_vae["decoder.conv_out.weight"].shape[0],
            latent_channels=ldm_vae["decoder.conv_in.weight"].shape[1],
            block_out_channels=[ldm_vae[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] for i in range(levels)],
            layers_per_block=_count(ldm_vae, "encoder.down.0.block."),
            down_block_types=["DownEncoderBlock2D"] * levels,
            up_block_types=["UpDecoderBlock2D"] * levels,
        )
    except KeyError as e:
        raise ModelLoadError(f"the VAE weights do not have the LDM layout (missing {e})") from e
    return cfg


def infer_clip_config(base: dict, hf_sd: dict) -> dict:
    """CLIP text config from the shipped one with sizes read from HF-layout weights ("text_model.…" keys)."""
    cfg = dict(base)
    tok = hf_sd["text_model.embeddings.token_embedding.weight"]
    cfg.update(
        vocab_size=tok.shape[0],
        hidden_size=tok.shape[1],
        max_position_embeddings=hf_sd["text_model.embeddings.position_embedding.weight"].shape[0],
        intermediate_size=hf_sd["text_model.encoder.layers.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=_count(hf_sd, "text_model.encoder.layers."),
        num_attention_heads=clip_num_heads(tok.shape[1]),
    )
    if "text_projection.weight" in hf_sd:
        cfg["projection_dim"] = hf_sd["text_projection.weight"].shape[0]
    return cfg


# --------------------------------------------------------------------------------------------------------------
# CLIP state dicts: "text_model.…" is the canonical HF layout (transformers >= 5.6 flattened CLIPTextModel)


def clip_state_dict(te) -> dict:
    """A CLIP text encoder's weights with canonical HF keys ("text_model.…", "text_projection.weight")."""
    te = _unwrap(te)
    sd = strip_orig_mod(te.state_dict())
    if hasattr(te, "text_model"):
        return sd
    return {("text_model." + k): v for k, v in sd.items()}


def text_encoder_hf_module_names(te) -> dict[str, str]:
    """module path in this transformers version -> canonical HF path ("text_model.encoder.layers.0.…"), the names
    kohya LoRA keys (lora_te1_text_model_…) are built from."""
    te = _unwrap(te)
    prefix = "" if hasattr(te, "text_model") else "text_model."
    return {n: (prefix + n if prefix else n) for n, _ in te.named_modules() if n}


def _load_clip_weights(te, hf_sd: dict, what: str) -> None:
    if not hasattr(te, "text_model"):
        hf_sd = {k.removeprefix("text_model."): v for k, v in hf_sd.items()}
    hf_sd = {k: v for k, v in hf_sd.items() if not k.endswith("position_ids")}
    missing, unexpected = te.load_state_dict(hf_sd, strict=False, assign=True)
    if missing or unexpected:
        raise ModelLoadError(f"{what}: weights do not fit the text encoder (missing {missing[:5]}, unexpected {unexpected[:5]})")


def _as_dtype(sd: dict, dtype) -> dict:
    """The floating-point tensors of `sd` in `dtype` (None: as they are)."""
    if dtype is None:
        return sd
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()}


def _build_clip(cfg: dict, hf_sd: dict, dtype, what: str):
    with torch.device("meta"):
        te = _clip_class(cfg)(_clip_config(cfg))
    _load_clip_weights(te, _as_dtype(hf_sd, dtype), what)  # the file's tensors become the parameters: no copy
    _init_position_ids(te)
    return te.eval()


def _init_position_ids(te) -> None:
    # position_ids is a non-persistent buffer: not in the file, still on the meta device.
    for m in te.modules():
        if isinstance(getattr(m, "position_ids", None), torch.Tensor):
            m.position_ids = torch.arange(m.position_ids.shape[-1]).expand(m.position_ids.shape).contiguous()


def _hf_clip_from_ldm(sd: dict, prefix: str) -> dict:
    """HF-layout CLIP weights stored under ``prefix`` (SD1 / SDXL te1); older files lack "text_model."."""
    from diffusers.loaders.single_file_utils import convert_ldm_clip_checkpoint

    out = convert_ldm_clip_checkpoint(sd, remove_prefix=prefix)
    out = {k: v for k, v in out.items() if k.startswith(("text_model.", "embeddings.", "encoder.", "final_layer_norm.", "text_projection."))}
    return {(k if k.startswith(("text_model.", "text_projection.")) else "text_model." + k): v for k, v in out.items()}


def _hf_clip_from_open_clip(sd: dict, prefix: str, hidden: int) -> dict:
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

    class _Cfg:  # convert_open_clip_checkpoint only reads config.hidden_size
        class config:
            hidden_size = hidden

    out = convert_open_clip_checkpoint(_Cfg, sd, prefix=prefix)
    # SD2's CLIPTextModel has no projection (diffusers skips it); the file's text_projection stays in extra_state
    if prefix == SD2_TE_PREFIX:
        out.pop("text_projection.weight", None)
    return out


def _hf_clip_to_open_clip(hf_sd: dict) -> dict:
    """canonical HF CLIP keys -> open_clip keys (without prefix); q/k/v are concatenated into in_proj."""
    out = {}
    for k, v in hf_sd.items():
        if k.endswith("position_ids"):
            continue
        if k == "text_projection.weight":
            out["text_projection"] = v.t().contiguous()
            continue
        if k == "text_model.embeddings.token_embedding.weight":
            out["token_embedding.weight"] = v
            continue
        if k == "text_model.embeddings.position_embedding.weight":
            out["positional_embedding"] = v
            continue
        if k.startswith("text_model.final_layer_norm."):
            out["ln_final." + k.rsplit(".", 1)[1]] = v
            continue
        if not k.startswith("text_model.encoder.layers."):
            raise ValueError(f"unexpected CLIP key {k}")
        rest = k[len("text_model.encoder.layers."):]
        idx, name = rest.split(".", 1)
        base = f"transformer.resblocks.{idx}."
        if name.startswith("self_attn.") and name.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
            continue  # joined below
        name = (name.replace("self_attn.out_proj", "attn.out_proj").replace("layer_norm1", "ln_1")
                .replace("layer_norm2", "ln_2").replace("mlp.fc1", "mlp.c_fc").replace("mlp.fc2", "mlp.c_proj"))
        out[base + name] = v
    n_layers = _count(hf_sd, "text_model.encoder.layers.")
    for i in range(n_layers):
        for kind in ("weight", "bias"):
            parts = [hf_sd[f"text_model.encoder.layers.{i}.self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[f"transformer.resblocks.{i}.attn.in_proj_{kind}"] = torch.cat(parts, 0)
    return out


# --------------------------------------------------------------------------------------------------------------
# diffusers -> LDM/SGM


def _unwrap(model):
    """The plain model under torch.compile's OptimizedModule and DistributedDataParallel wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


_DTYPES = {"float": torch.float32, "fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


def as_dtype(dtype):
    """torch dtype from a dtype or kohya's --save_precision names (float, fp16, bf16); None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).lower() in _DTYPES:
        return _DTYPES[str(dtype).lower()]
    raise ValueError(f"unknown precision {dtype!r}; allowed: {', '.join(_DTYPES)}")


_RESNET_LDM = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1",
               "norm2": "out_layers.0", "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def _unet_block_map(unet) -> dict[str, str]:
    """diffusers block prefix -> LDM/SGM block prefix, from the UNet's structure."""
    cfg = unet.config
    layers = cfg.layers_per_block
    if not isinstance(layers, int):
        raise ValueError("per-block layers_per_block lists are not supported by the single-file layout")
    m = {"conv_in": "input_blocks.0.0", "time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
         "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
         "conv_norm_out": "out.0", "conv_out": "out.2"}
    for i, block in enumerate(unet.down_blocks):
        for j in range(layers):
            idx = 1 + i * (layers + 1) + j
            m[f"down_blocks.{i}.resnets.{j}"] = f"input_blocks.{idx}.0"
            if getattr(block, "attentions", None) is not None:
                m[f"down_blocks.{i}.attentions.{j}"] = f"input_blocks.{idx}.1"
        if block.downsamplers is not None:
            m[f"down_blocks.{i}.downsamplers.0.conv"] = f"input_blocks.{1 + i * (layers + 1) + layers}.0.op"
    m["mid_block.resnets.0"] = "middle_block.0"
    if getattr(unet.mid_block, "attentions", None) is not None:
        m["mid_block.attentions.0"] = "middle_block.1"
        m["mid_block.resnets.1"] = "middle_block.2"
    else:
        m["mid_block.resnets.1"] = "middle_block.1"
    for i, block in enumerate(unet.up_blocks):
        has_attn = getattr(block, "attentions", None) is not None
        for j in range(layers + 1):
            idx = i * (layers + 1) + j
            m[f"up_blocks.{i}.resnets.{j}"] = f"output_blocks.{idx}.0"
            if has_attn:
                m[f"up_blocks.{i}.attentions.{j}"] = f"output_blocks.{idx}.1"
        if block.upsamplers is not None:
            m[f"up_blocks.{i}.upsamplers.0.conv"] = f"output_blocks.{i * (layers + 1) + layers}.{2 if has_attn else 1}.conv"
    return m


def _translate(name: str, block_map: dict[str, str]) -> str | None:
    """diffusers module/param path -> LDM path using the longest matching block prefix; None if unmapped."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in block_map:
            rest = parts[cut:]
            if "resnets" in parts[:cut] and rest and rest[0] in _RESNET_LDM:
                rest = _RESNET_LDM[rest[0]].split(".") + rest[1:]
            return ".".join([block_map[head]] + rest)
    return None


def unet_sgm_module_names(unet) -> dict[str, str]:
    """diffusers module path -> SGM/LDM module path for every mapped module of the UNet, e.g.
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q" -> "input_blocks.4.1.transformer_blocks.0.attn1.to_q"
    (SDXL). ``_orig_mod.`` (torch.compile) is removed from the names."""
    base = _unwrap(unet)
    block_map = _unet_block_map(base)
    out = {}
    for name, _ in unet.named_modules():
        clean = name.replace("_orig_mod.", "").removeprefix("_orig_mod")
        if not clean:
            continue
        ldm = _translate(clean, block_map)
        if ldm is not None:
            out[clean] = ldm
    return out


def unet_to_ldm_state_dict(unet) -> dict:
    """The UNet's weights with LDM/SGM keys (no "model.diffusion_model." prefix)."""
    base = _unwrap(unet)
    block_map = _unet_block_map(base)
    out = {}
    for k, v in strip_orig_mod(base.state_dict()).items():
        ldm = _translate(k, block_map)
        if ldm is None:
            raise ValueError(f"UNet weight {k} has no place in the single-file layout")
        out[ldm] = v
    return out


_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def vae_to_ldm_state_dict(vae) -> dict:
    """The VAE's weights with LDM keys (no "first_stage_model." prefix); attention projections as 1x1 convs."""
    base = _unwrap(vae)
    n = len(base.config.block_out_channels)
    m = {"encoder.conv_norm_out": "encoder.norm_out", "decoder.conv_norm_out": "decoder.norm_out"}
    for i in range(n):
        m[f"encoder.down_blocks.{i}.resnets"] = f"encoder.down.{i}.block"
        m[f"encoder.down_blocks.{i}.downsamplers.0.conv"] = f"encoder.down.{i}.downsample.conv"
        m[f"decoder.up_blocks.{i}.resnets"] = f"decoder.up.{n - 1 - i}.block"
        m[f"decoder.up_blocks.{i}.upsamplers.0.conv"] = f"decoder.up.{n - 1 - i}.upsample.conv"
    for side in ("encoder", "decoder"):
        m[f"{side}.mid_block.resnets.0"] = f"{side}.mid.block_1"
        m[f"{side}.mid_block.resnets.1"] = f"{side}.mid.block_2"
        for d, l in _VAE_ATTN.items():
            m[f"{side}.mid_block.attentions.0.{d}"] = f"{side}.mid.attn_1.{l}"
    out = {}
    for k, v in strip_orig_mod(base.state_dict()).items():
        new = k
        for d in sorted(m, key=len, reverse=True):
            if k.startswith(d + "."):
                new = m[d] + k[len(d):]
                break
        new = new.replace(".conv_shortcut.", ".nin_shortcut.")
        if ".mid.attn_1." in new and new.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # LDM stores these as 1x1 convolutions
        out[new] = v
    return out


def components_to_ldm_state_dict(comps: SDComponents) -> dict:
    """The whole model in the single-file layout: SGM for SDXL, LDM for SD1/SD2 (with prefixes)."""
    sd = {UNET_PREFIX + k: v for k, v in unet_to_ldm_state_dict(comps.unet).items()}
    sd.update({VAE_PREFIX + k: v for k, v in vae_to_ldm_state_dict(comps.vae).items()})
    te_sds = [clip_state_dict(te) for te in comps.text_encoders]
    if comps.family == "sd1":
        sd.update({SD1_TE_PREFIX + k: v for k, v in te_sds[0].items() if not k.endswith("position_ids")})
    elif comps.family == "sdxl":
        sd.update({SDXL_TE1_PREFIX + k: v for k, v in te_sds[0].items() if not k.endswith("position_ids")})
        sd.update({SDXL_TE2_PREFIX + k: v for k, v in _hf_clip_to_open_clip(te_sds[1]).items()})
    else:
        oc = _hf_clip_to_open_clip(te_sds[0])
        sd.update({SD2_TE_PREFIX + k: v for k, v in oc.items()})
        # SD2 uses the penultimate open_clip layer: diffusers has one layer fewer than the file.
        n = _count(te_sds[0], "text_model.encoder.layers.")
        last = f"{SD2_TE_PREFIX}transformer.resblocks.{n}."
        if not any(k.startswith(last) for k in comps.extra_state):
            for k, v in oc.items():  # no original last layer known: write a copy of the previous one
                if k.startswith(f"transformer.resblocks.{n - 1}."):
                    sd[last + k[len(f'transformer.resblocks.{n - 1}.'):]] = v.clone()
        if SD2_TE_PREFIX + "text_projection" not in comps.extra_state:
            hidden = te_sds[0]["text_model.final_layer_norm.weight"].shape[0]
            sd[SD2_TE_PREFIX + "text_projection"] = torch.eye(hidden, dtype=te_sds[0]["text_model.final_layer_norm.weight"].dtype)
    for k, v in comps.extra_state.items():
        sd.setdefault(k, v)
    return sd


# --------------------------------------------------------------------------------------------------------------
# loading


def _components_from_single_file(path: Path, family: str, dtype) -> tuple[object, object, list, dict]:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint

    sd = load_state_dict_file(path)
    detected = _family_from_keys(sd.keys())
    if detected is None:
        raise ModelLoadError(
            f"{path}: no Stable Diffusion text encoder weights found (expected keys starting with "
            f"'cond_stage_model.' or 'conditioner.embedders.'); {_describe_other(sd.keys())}")
    _check_detected_family(path, detected, family)
    if not any(k.startswith(UNET_PREFIX) for k in sd):
        raise ModelLoadError(f"{path}: no UNet weights (keys starting with '{UNET_PREFIX}')")
    if not any(k.startswith(VAE_PREFIX) for k in sd):
        raise ModelLoadError(f"{path}: no VAE weights (keys starting with '{VAE_PREFIX}'); pass a VAE with --vae")

    extra = {}
    text_encoders = []
    if family == "sd1":
        hf = _hf_clip_from_ldm(sd, SD1_TE_PREFIX)
        text_encoders.append(_build_clip(infer_clip_config(load_arch_config(family, "text_encoder"), hf), hf, dtype, f"{path} (text encoder)"))
    elif family == "sdxl":
        hf1 = _hf_clip_from_ldm({k: v for k, v in sd.items() if k.startswith(SDXL_TE1_PREFIX)}, SDXL_TE1_PREFIX)
        text_encoders.append(_build_clip(infer_clip_config(load_arch_config(family, "text_encoder"), hf1), hf1, dtype, f"{path} (text encoder 1)"))
        hidden2 = sd[SDXL_TE2_PREFIX + "token_embedding.weight"].shape[1]
        hf2 = _hf_clip_from_open_clip(sd, SDXL_TE2_PREFIX, hidden2)
        text_encoders.append(_build_clip(infer_clip_config(load_arch_config(family, "text_encoder_2"), hf2), hf2, dtype, f"{path} (text encoder 2)"))
        if SDXL_TE2_PREFIX + "logit_scale" in sd:
            extra[SDXL_TE2_PREFIX + "logit_scale"] = sd[SDXL_TE2_PREFIX + "logit_scale"]
    else:
        hidden = sd[SD2_TE_PREFIX + "token_embedding.weight"].shape[1]
        hf = _hf_clip_from_open_clip(sd, SD2_TE_PREFIX, hidden)
        # SD2 conditions on the penultimate open_clip layer: the file holds one layer more than the diffusers
        # text encoder. The last one is kept aside (extra_state) and written back on save.
        n_file = _count(sd, SD2_TE_PREFIX + "transformer.resblocks.")
        if n_file < 2:
            raise ModelLoadError(f"{path}: the SD2 text encoder needs at least 2 layers, found {n_file}")
        hf = {k: v for k, v in hf.items() if not k.startswith(f"text_model.encoder.layers.{n_file - 1}.")}
        last = f"{SD2_TE_PREFIX}transformer.resblocks.{n_file - 1}."
        extra.update({k: v for k, v in sd.items() if k.startswith(last)})
        for k in ("text_projection", "logit_scale"):
            if SD2_TE_PREFIX + k in sd:
                extra[SD2_TE_PREFIX + k] = sd[SD2_TE_PREFIX + k]
        text_encoders.append(_build_clip(infer_clip_config(load_arch_config(family, "text_encoder"), hf), hf, dtype, f"{path} (text encoder)"))

    pooled_dim = text_encoders[-1].config.projection_dim if family == "sdxl" else None
    ldm_unet = _sub(sd, UNET_PREFIX)
    unet_cfg = infer_unet_config(family, ldm_unet, pooled_dim)
    unet_sd = convert_ldm_unet_checkpoint(sd, unet_cfg)
    unet = _build_diffusers(UNet2DConditionModel, unet_cfg, unet_sd, dtype, f"{path} (UNet)")

    vae_cfg = infer_vae_config(family, _sub(sd, VAE_PREFIX))
    vae_sd = convert_ldm_vae_checkpoint(sd, vae_cfg)
    vae = _build_diffusers(AutoencoderKL, vae_cfg, vae_sd, dtype, f"{path} (VAE)")
    return unet, vae, text_encoders, _as_dtype(extra, dtype)


def _build_diffusers(cls, cfg: dict, sd: dict, dtype, what: str):
    with torch.device("meta"):
        model = cls.from_config(cfg)
    missing = set(model.state_dict()) - set(sd)
    unexpected = set(sd) - set(model.state_dict())
    if missing or unexpected:
        raise ModelLoadError(f"{what}: weights do not fit the architecture (missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]})")
    model.load_state_dict(_as_dtype(sd, dtype), strict=True, assign=True)
    return model.eval()


def load_vae(path, family: str, dtype=torch.float32):
    """A VAE from a single file (LDM keys, with or without "first_stage_model.", or diffusers keys), a diffusers
    VAE folder (config.json), a diffusers model folder (vae/), or a hub id."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    p = Path(path)
    if p.is_dir():
        if (p / "config.json").is_file():
            return AutoencoderKL.from_pretrained(str(p), torch_dtype=dtype).eval()
        if (p / "vae" / "config.json").is_file():
            return AutoencoderKL.from_pretrained(str(p), subfolder="vae", torch_dtype=dtype).eval()
        raise ModelLoadError(f"--vae {p}: folder has no config.json (nor vae/config.json)")
    if p.is_file():
        sd = load_state_dict_file(p)
        if any(k.startswith(VAE_PREFIX) for k in sd):
            sd = _sub(sd, VAE_PREFIX)
        if "encoder.down_blocks.0.resnets.0.conv1.weight" in sd:  # diffusers-layout file
            ldm = None
        elif "encoder.down.0.block.0.conv1.weight" in sd:
            ldm = sd
        else:
            raise ModelLoadError(f"--vae {p}: no VAE weights found (expected LDM 'encoder.down.…' or diffusers "
                                 f"'encoder.down_blocks.…' keys)")
        if ldm is not None:
            cfg = infer_vae_config(family, ldm)
            dsd = convert_ldm_vae_checkpoint(ldm, cfg)
        else:
            cfg = load_arch_config(family, "vae")
            n = _count(sd, "encoder.down_blocks.")
            cfg.update(block_out_channels=[sd[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"].shape[0] for i in range(n)],
                       layers_per_block=_count(sd, "encoder.down_blocks.0.resnets."),
                       down_block_types=["DownEncoderBlock2D"] * n, up_block_types=["UpDecoderBlock2D"] * n,
                       latent_channels=sd["decoder.conv_in.weight"].shape[1])
            dsd = sd
        return _build_diffusers(AutoencoderKL, cfg, dsd, dtype, f"--vae {p}")
    if _looks_like_hub_id(str(path)):
        _require_online(f"--vae {path}")
        return AutoencoderKL.from_pretrained(str(path), torch_dtype=dtype).eval()
    raise ModelLoadError(f"--vae {path}: no such file or folder")


def _looks_like_hub_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "~")) and Path(s).suffix.lower() not in (
        ".safetensors", ".ckpt", ".pt", ".bin")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def _require_online(what: str) -> None:
    if _offline():
        raise ModelLoadError(f"{what}: not found locally, and the hub is offline (HF_HUB_OFFLINE is set); "
                             f"give a local file or folder")


def load_tokenizers(family: str, *, model_dir=None, tokenizer_cache_dir=None) -> list:
    """The family's tokenizer(s): from the diffusers folder, from --tokenizer_cache_dir, or from the hub (then
    saved into --tokenizer_cache_dir when given)."""
    from transformers import CLIPTokenizer

    _check_family(family)
    subdirs = ["tokenizer", "tokenizer_2"]
    out = []
    for i, (hub_id, hub_sub) in enumerate(TOKENIZER_SOURCES[family]):
        candidates = []
        if model_dir is not None:
            candidates.append(Path(model_dir) / subdirs[i])
        if tokenizer_cache_dir is not None:
            cache = Path(tokenizer_cache_dir)
            candidates += [cache / hub_id.replace("/", "_"), cache / subdirs[i]]
            if i == 0:
                candidates.append(cache)
        tok = None
        for c in candidates:
            if (c / "vocab.json").is_file() or (c / "tokenizer.json").is_file():
                tok = CLIPTokenizer.from_pretrained(str(c))
                break
        if tok is None:
            tried = ", ".join(str(c) for c in candidates) or "(no local folder given)"
            if _offline():
                raise ModelLoadError(
                    f"{FAMILY_LABELS[family]} tokenizer {i + 1} not found (looked in: {tried}) and the hub is offline; "
                    f"pass --tokenizer_cache_dir with a folder that holds '{hub_id.replace('/', '_')}' or "
                    f"'{subdirs[i]}' (a saved CLIPTokenizer), or go online once with --tokenizer_cache_dir set")
            try:
                tok = CLIPTokenizer.from_pretrained(hub_id, subfolder=hub_sub) if hub_sub else CLIPTokenizer.from_pretrained(hub_id)
            except Exception as e:  # noqa: BLE001
                raise ModelLoadError(f"could not get tokenizer {hub_id} from the hub ({e}); pass --tokenizer_cache_dir "
                                     f"with a local copy (looked in: {tried})") from e
            if family == "sdxl" and i == 1:
                tok.pad_token = "!"  # SDXL's second tokenizer pads with "!" (id 0), as in the diffusers SDXL repo
            if tokenizer_cache_dir is not None:
                tok.save_pretrained(str(Path(tokenizer_cache_dir) / hub_id.replace("/", "_")))
        tok.model_max_length = TOKENIZER_MAX_LENGTH
        out.append(tok)
    return out


def _from_subfolder(cls, folder: Path, sub: str, **kwargs):
    """cls.from_pretrained(folder, subfolder=sub) in eval mode; a file that cannot be read (truncated, damaged)
    is a ModelLoadError naming the folder instead of a traceback."""
    try:
        return cls.from_pretrained(str(folder), subfolder=sub, **kwargs).eval()
    except Exception as e:  # noqa: BLE001 - any failure to read a diffusers component is a broken model folder
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ModelLoadError(f"{folder / sub}: cannot load the weights ({reason}); a file there may be truncated "
                             "or damaged (an interrupted download or copy?)") from e


def _load_diffusers_folder(folder: Path, family: str, dtype):
    from diffusers import AutoencoderKL, UNet2DConditionModel

    detected = _family_from_diffusers_folder(folder)
    _check_detected_family(folder, detected, family)
    for sub in _COMPONENTS[family]:
        if not (folder / sub / "config.json").is_file():
            raise ModelLoadError(f"{folder}: diffusers folder has no {sub}/config.json")
    unet = _from_subfolder(UNet2DConditionModel, folder, "unet", torch_dtype=dtype)
    vae = _from_subfolder(AutoencoderKL, folder, "vae", torch_dtype=dtype)
    tes = []
    for sub in _COMPONENTS[family][2:]:
        cfg = json.loads((folder / sub / "config.json").read_text(encoding="utf-8"))
        tes.append(_from_subfolder(_clip_class(cfg), folder, sub, dtype=dtype))
    prediction = None
    sched = folder / "scheduler" / "scheduler_config.json"
    if sched.is_file():
        prediction = json.loads(sched.read_text(encoding="utf-8")).get("prediction_type")
    return unet, vae, tes, prediction


def _download(hub_id: str) -> Path:
    from huggingface_hub import snapshot_download

    _require_online(hub_id)
    patterns = ["model_index.json", "*/config.json", "scheduler/*", "tokenizer*/*",
                "unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                "text_encoder*/model.safetensors"]
    try:
        return Path(snapshot_download(hub_id, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"{hub_id}: could not download from the hub ({e})") from e


def load_sd_components(path, family, *, vae=None, tokenizer_cache_dir=None, dtype=torch.float32,
                       v_parameterization=False, tokenizers=True) -> SDComponents:
    """Load an SD1.x / SD2.x / SDXL model from a single file, a diffusers folder or a hub id.

    ``vae``: optional VAE to use instead of the model's (file, diffusers folder or hub id).
    ``v_parameterization``: the model predicts v (SD2 768-v); a diffusers folder's scheduler can also say so.
    ``tokenizers=False``: no tokenizers (`.tokenizers` is []): the LoRA tools need weights only.
    ``dtype=None``: a single file's tensors as it stores them, uncopied (diffusers folders and hub ids load in
    float32).
    """
    _check_family(family)
    if path is None or str(path).strip() == "":
        raise ModelLoadError("--pretrained_model_name_or_path is empty; give a checkpoint file, a diffusers folder or a hub id")
    p = Path(str(path)).expanduser()
    extra = {}
    if p.is_file():
        try:
            unet, vae_model, tes, extra = _components_from_single_file(p, family, dtype)
        except KeyError as e:
            raise ModelLoadError(f"{p}: incomplete {FAMILY_LABELS[family]} checkpoint (missing weight {e})") from e
        model_dir, prediction = None, None
    elif p.is_dir():
        if not _is_diffusers_folder(p):
            raise ModelLoadError(f"{p}: a folder, but not a diffusers model (no model_index.json or unet/config.json)")
        unet, vae_model, tes, prediction = _load_diffusers_folder(p, family, dtype or torch.float32)
        model_dir = p
    elif _looks_like_hub_id(str(path)):
        if _offline():
            raise ModelLoadError(f"model not found: {path} is not a local file or folder, and the hub is offline "
                                 f"(HF_HUB_OFFLINE is set)")
        model_dir = _download(str(path))
        unet, vae_model, tes, prediction = _load_diffusers_folder(model_dir, family, dtype or torch.float32)
    else:
        raise ModelLoadError(f"model file not found: {p}")

    if vae is not None and str(vae).strip():
        vae_model = load_vae(vae, family, dtype or torch.float32)
    tokenizers = load_tokenizers(family, model_dir=model_dir, tokenizer_cache_dir=tokenizer_cache_dir) if tokenizers else []
    prediction_type = "v_prediction" if v_parameterization or prediction == "v_prediction" else "epsilon"
    logger.info("loaded %s model from %s (prediction: %s)", FAMILY_LABELS[family], path, prediction_type)
    return SDComponents(family=family, unet=unet, vae=vae_model, text_encoders=tes, tokenizers=tokenizers,
                        prediction_type=prediction_type, source=str(path), extra_state=extra)


# --------------------------------------------------------------------------------------------------------------
# saving


def _cast(sd: dict, dtype) -> dict:
    dtype = as_dtype(dtype)
    # cast where the tensor is (a GPU copies half the bytes of fp32 to fp16 over the bus, and casts faster)
    return {k: (v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()).to("cpu").contiguous()
            for k, v in sd.items()}


def save_sd_checkpoint(path, comps: SDComponents, *, save_dtype=None, metadata=None, overwrite=False) -> Path:
    """Write the model as one file in the SGM (SDXL) / LDM (SD1/SD2) key layout (.safetensors or .ckpt).

    Written to a temporary name and renamed when complete; an existing file is an error unless overwrite=True."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".safetensors", ".ckpt"):
        raise ValueError(f"{path}: unsupported checkpoint type {suffix!r}; allowed: .safetensors, .ckpt")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} already exists; not overwriting it (choose another name, or overwrite=True)")
    sd = components_to_ldm_state_dict(comps)
    if suffix == ".safetensors":
        from library import safetensors_io

        meta = {str(k): str(v) for k, v in (metadata or {}).items()}
        meta.setdefault("format", "pt")
        save_dtype = as_dtype(save_dtype)
        if safetensors_io.can_stream(sd, save_dtype):  # no copy of the model (a GPU casts, the bytes stream from there)
            safetensors_io.save_file_streamed(sd, path, meta, float_dtype=save_dtype, overwrite=True)
        else:
            files.save_safetensors(_cast(sd, save_dtype), path, meta, overwrite=True)
    else:
        files.save_torch({"state_dict": _cast(sd, save_dtype)}, path, overwrite=True)
    return path


def make_scheduler(prediction_type: str = "epsilon"):
    """The noise scheduler the SD families were trained with (1000 steps, scaled_linear 0.00085..0.012)."""
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                  beta_schedule="scaled_linear", prediction_type=prediction_type,
                                  steps_offset=1, timestep_spacing="leading")


def make_pipeline(comps: SDComponents, scheduler=None):
    """A diffusers StableDiffusionPipeline / StableDiffusionXLPipeline over the components (no copies)."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    scheduler = scheduler or make_scheduler(comps.prediction_type)
    unet, vae = _unwrap(comps.unet), _unwrap(comps.vae)
    tes = [_unwrap(t) for t in comps.text_encoders]
    if comps.family == "sdxl":
        return StableDiffusionXLPipeline(vae=vae, text_encoder=tes[0], text_encoder_2=tes[1], tokenizer=comps.tokenizers[0],
                                         tokenizer_2=comps.tokenizers[1], unet=unet, scheduler=scheduler)
    return StableDiffusionPipeline(vae=vae, text_encoder=tes[0], tokenizer=comps.tokenizers[0], unet=unet,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


def save_sd_diffusers(folder, comps: SDComponents, *, save_dtype=None, overwrite=False) -> Path:
    """Write a diffusers folder (model_index.json, unet/, vae/, text_encoder*/, tokenizer*/, scheduler/) that
    StableDiffusionPipeline / StableDiffusionXLPipeline.from_pretrained loads. Built in a temporary folder and
    renamed when complete; an existing non-empty folder is an error unless overwrite=True."""
    from safetensors.torch import save_file

    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())) and not overwrite:
        raise FileExistsError(f"{folder} already exists; not overwriting it (choose another name, or overwrite=True)")
    with files.atomic_target(folder) as tmp:
        tmp = Path(tmp)
        pipe = make_pipeline(comps)
        pipe.save_config(str(tmp))  # model_index.json
        pipe.scheduler.save_pretrained(str(tmp / "scheduler"))
        for name, model in (("unet", pipe.unet), ("vae", pipe.vae)):
            (tmp / name).mkdir(parents=True)
            model.save_config(str(tmp / name))
            save_file(_cast(strip_orig_mod(model.state_dict()), save_dtype), str(tmp / name / "diffusion_pytorch_model.safetensors"),
                      metadata={"format": "pt"})
        for i, te in enumerate(comps.text_encoders):
            te = _unwrap(te)
            sub = "text_encoder" if i == 0 else "text_encoder_2"
            # weights under their canonical "text_model." keys (transformers >= 5.6 would drop the prefix, which
            # upstream's pinned transformers 4.x and other tools need), config.json beside them
            te.config.architectures = [type(te).__name__]
            te.config.save_pretrained(str(tmp / sub))
            save_file(_cast(clip_state_dict(te), save_dtype), str(tmp / sub / "model.safetensors"),
                      metadata={"format": "pt"})
            cfg_path = tmp / sub / "config.json"
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            dtype = as_dtype(save_dtype) or next(te.parameters()).dtype
            cfg["dtype"] = cfg["torch_dtype"] = str(dtype).removeprefix("torch.")  # 5.x and 4.x names
            cfg_path.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
            comps.tokenizers[i].save_pretrained(str(tmp / ("tokenizer" if i == 0 else "tokenizer_2")))
    return folder

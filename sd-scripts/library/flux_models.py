"""FLUX.1 model loading and saving.

Reads what FLUX users have on disk:
- the BFL single-file transformer (``double_blocks.N.img_attn.qkv.weight``, ``single_blocks.N.linear1.weight``, ...;
  bf16/fp16/fp32 or float8-e4m3 weights; dev has ``guidance_in``, schnell has not), optionally with ComfyUI's
  ``model.diffusion_model.`` prefix;
- single-file CLIP-L (transformers ``CLIPTextModel`` keys, with or without ``text_model.``), T5-XXL encoder
  (``T5EncoderModel`` keys) and the BFL ``ae.safetensors``;
- diffusers folders in the ``FluxPipeline`` layout (transformer/, text_encoder/, text_encoder_2/, vae/,
  tokenizer/, tokenizer_2/), or a hub id when the user gave one and is online.

The transformer is always a diffusers ``FluxTransformer2DModel``; its size (depth, width, heads = width / 128,
text/pooled widths, guidance) is read from the state dict so tiny test files load exactly like the real one.
BFL -> diffusers uses diffusers' own converter; diffusers -> BFL (for saving full fine-tunes) is ours, driven by
the module map below that ``networks.lora_flux`` also uses to name LoRA keys.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# the fp8 base mechanism is shared with SD/SDXL (library.precision); its names stay importable from here
from library.precision import FP8_DTYPE, apply_fp8_base  # noqa: F401
from library.errors import FluxModelError  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

AE_SCALING_FACTOR = 0.3611
AE_SHIFT_FACTOR = 0.1159
HEAD_DIM = 128  # every FLUX.1 checkpoint: width = heads * 128, rope axes 16 + 56 + 56
ROPE_AXES = (16, 56, 56)
CLIP_L_HUB_ID = "openai/clip-vit-large-patch14"
T5XXL_HUB_ID = "google/t5-v1_1-xxl"
_BFL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


# ----------------------------------------------------------------------------------------------------------------
# BFL <-> diffusers module map (one source of truth for conversion and LoRA key names)


def bfl_linear_map(num_double: int, num_single: int, guidance: bool = True) -> dict[str, list[str]]:
    """BFL Linear module name -> the diffusers Linear module(s) it corresponds to (concatenated along out dim).

    ``final_layer.adaLN_modulation.1`` is not listed: its two halves are swapped (scale/shift), see
    ``diffusers_to_bfl``."""
    m: dict[str, list[str]] = {
        "img_in": ["x_embedder"],
        "txt_in": ["context_embedder"],
        "time_in.in_layer": ["time_text_embed.timestep_embedder.linear_1"],
        "time_in.out_layer": ["time_text_embed.timestep_embedder.linear_2"],
        "vector_in.in_layer": ["time_text_embed.text_embedder.linear_1"],
        "vector_in.out_layer": ["time_text_embed.text_embedder.linear_2"],
        "final_layer.linear": ["proj_out"],
    }
    if guidance:
        m["guidance_in.in_layer"] = ["time_text_embed.guidance_embedder.linear_1"]
        m["guidance_in.out_layer"] = ["time_text_embed.guidance_embedder.linear_2"]
    for i in range(num_double):
        b, d = f"double_blocks.{i}.", f"transformer_blocks.{i}."
        m.update(
            {
                b + "img_mod.lin": [d + "norm1.linear"],
                b + "txt_mod.lin": [d + "norm1_context.linear"],
                b + "img_attn.qkv": [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"],
                b + "txt_attn.qkv": [d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"],
                b + "img_attn.proj": [d + "attn.to_out.0"],
                b + "txt_attn.proj": [d + "attn.to_add_out"],
                b + "img_mlp.0": [d + "ff.net.0.proj"],
                b + "img_mlp.2": [d + "ff.net.2"],
                b + "txt_mlp.0": [d + "ff_context.net.0.proj"],
                b + "txt_mlp.2": [d + "ff_context.net.2"],
            }
        )
    for i in range(num_single):
        b, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}."
        m.update(
            {
                b + "modulation.lin": [d + "norm.linear"],
                b + "linear1": [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v", d + "proj_mlp"],
                b + "linear2": [d + "proj_out"],
            }
        )
    return m


def _bfl_norm_map(num_double: int, num_single: int) -> dict[str, str]:
    """BFL RMSNorm scale key -> diffusers key."""
    m = {}
    for i in range(num_double):
        b, d = f"double_blocks.{i}.", f"transformer_blocks.{i}.attn."
        m[b + "img_attn.norm.query_norm.scale"] = d + "norm_q.weight"
        m[b + "img_attn.norm.key_norm.scale"] = d + "norm_k.weight"
        m[b + "txt_attn.norm.query_norm.scale"] = d + "norm_added_q.weight"
        m[b + "txt_attn.norm.key_norm.scale"] = d + "norm_added_k.weight"
    for i in range(num_single):
        b, d = f"single_blocks.{i}.", f"single_transformer_blocks.{i}.attn."
        m[b + "norm.query_norm.scale"] = d + "norm_q.weight"
        m[b + "norm.key_norm.scale"] = d + "norm_k.weight"
    return m


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    a, b = w.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _count_blocks(keys, prefix: str) -> int:
    idx = {int(m.group(1)) for k in keys if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(idx) + 1 if idx else 0


def strip_bfl_prefix(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        for p in _BFL_PREFIXES:
            if k.startswith(p):
                k = k[len(p):]
                break
        out[k] = v
    return out


def infer_transformer_config(bfl_sd: dict, source: str = "state dict") -> dict:
    """FluxTransformer2DModel config read from a BFL state dict (sizes only, no file needed)."""
    need = ("img_in.weight", "txt_in.weight", "vector_in.in_layer.weight", "final_layer.linear.weight")
    missing = [k for k in need if k not in bfl_sd]
    if missing:
        raise FluxModelError(
            f"{source}: not a FLUX.1 transformer in BFL layout (missing {', '.join(missing)}); expected keys like "
            "'double_blocks.0.img_attn.qkv.weight' and 'single_blocks.0.linear1.weight'"
        )
    width, in_channels = bfl_sd["img_in.weight"].shape
    if width % HEAD_DIM:
        raise FluxModelError(f"{source}: transformer width {width} is not a multiple of the head size {HEAD_DIM}")
    num_double = _count_blocks(bfl_sd, "double_blocks.")
    num_single = _count_blocks(bfl_sd, "single_blocks.")
    mlp_key = "double_blocks.0.img_mlp.0.weight" if num_double else "single_blocks.0.linear1.weight"
    if num_double and bfl_sd[mlp_key].shape[0] != 4 * width:
        raise FluxModelError(f"{source}: MLP width {bfl_sd[mlp_key].shape[0]} is not 4 x {width} (FLUX.1 mlp_ratio)")
    return {
        "patch_size": 1,
        "in_channels": int(in_channels),
        "out_channels": int(bfl_sd["final_layer.linear.weight"].shape[0]),
        "num_layers": num_double,
        "num_single_layers": num_single,
        "attention_head_dim": HEAD_DIM,
        "num_attention_heads": int(width) // HEAD_DIM,
        "joint_attention_dim": int(bfl_sd["txt_in.weight"].shape[1]),
        "pooled_projection_dim": int(bfl_sd["vector_in.in_layer.weight"].shape[1]),
        "guidance_embeds": "guidance_in.in_layer.weight" in bfl_sd,
        "axes_dims_rope": list(ROPE_AXES),
    }


def bfl_to_diffusers(bfl_sd: dict, source: str = "state dict") -> dict:
    """BFL transformer state dict -> diffusers FluxTransformer2DModel state dict (tensors are not copied).

    Uses diffusers' ``convert_flux_transformer_checkpoint_to_diffusers``. That converter splits
    ``single_blocks.N.linear1`` with FLUX's real width (3072) hard-coded, so we split linear1 by the width we read
    from the file and hand the converter free placeholders of the shape it expects (meta tensors, no memory)."""
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    sd = strip_bfl_prefix(bfl_sd)
    cfg = infer_transformer_config(sd, source)
    width = cfg["num_attention_heads"] * HEAD_DIM
    linear1 = {}
    for i in range(cfg["num_single_layers"]):
        for kind in ("weight", "bias"):
            key = f"single_blocks.{i}.linear1.{kind}"
            t = sd.pop(key)
            # own storage per part: views would share one version counter (in-place updates of one part, as a
            # fused optimizer step does, would invalidate the others' saved tensors)
            linear1[(i, kind)] = [x.clone() for x in torch.split(t, [width, width, width, t.shape[0] - 3 * width])]
            shape = (7 * 3072,) + tuple(t.shape[1:])
            sd[key] = torch.empty(shape, dtype=t.dtype, device="meta")
    out = convert_flux_transformer_checkpoint_to_diffusers(sd)
    if sd:
        raise FluxModelError(f"{source}: unexpected keys in the FLUX transformer: {', '.join(sorted(sd)[:10])}")
    for (i, kind), parts in linear1.items():
        d = f"single_transformer_blocks.{i}."
        for name, t in zip(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), parts):
            out[f"{d}{name}.{kind}"] = t
    return out


def _diffusers_to_bfl_plan(keys) -> dict[str, tuple[list[str], str]]:
    """BFL key -> (the diffusers keys it is made of, how: "cat" along dim 0 / "swap" the halves)."""
    keys = set(keys)
    num_double = _count_blocks(keys, "transformer_blocks.")
    num_single = _count_blocks(keys, "single_transformer_blocks.")
    guidance = any(k.startswith("time_text_embed.guidance_embedder.") for k in keys)
    plan: dict[str, tuple[list[str], str]] = {}
    for bfl, parts in bfl_linear_map(num_double, num_single, guidance).items():
        for kind in ("weight", "bias"):
            plan[f"{bfl}.{kind}"] = ([f"{p}.{kind}" for p in parts], "cat")
    for bfl, d in _bfl_norm_map(num_double, num_single).items():
        plan[bfl] = ([d], "cat")
    for kind in ("weight", "bias"):
        plan[f"final_layer.adaLN_modulation.1.{kind}"] = ([f"norm_out.linear.{kind}"], "swap")
    unknown = keys - {k for parts, _ in plan.values() for k in parts}
    if unknown:
        raise FluxModelError(f"cannot save as BFL: unknown transformer keys {', '.join(sorted(unknown)[:10])}")
    return plan


def _make_bfl_tensor(ts: list, how: str) -> torch.Tensor:
    if how == "swap":
        return _swap_halves(ts[0])
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)


def diffusers_to_bfl(dsd: dict) -> dict:
    """diffusers FluxTransformer2DModel state dict -> BFL single-file layout (the inverse of ``bfl_to_diffusers``)."""
    return {bfl: _make_bfl_tensor([dsd[k] for k in parts], how)
            for bfl, (parts, how) in _diffusers_to_bfl_plan(dsd).items()}


def diffusers_to_bfl_entries(dsd: dict, dtype: torch.dtype | None = None) -> list:
    """The BFL tensors of ``diffusers_to_bfl`` as library.saving.TensorEntry items, each made (on the CPU, in
    `dtype`) only when it is written: for saving without a second copy of the model (--mem_eff_save)."""
    from library.saving import TensorEntry

    entries = []
    for bfl, (parts, how) in _diffusers_to_bfl_plan(dsd).items():
        ts = [dsd[k] for k in parts]
        shape = (sum(t.shape[0] for t in ts), *ts[0].shape[1:])

        def make(ts=ts, how=how):
            return _make_bfl_tensor([t.detach().to("cpu", dtype or t.dtype) for t in ts], how)

        entries.append(TensorEntry(bfl, shape, dtype or ts[0].dtype, make))
    return entries


# ----------------------------------------------------------------------------------------------------------------
# file helpers


def read_safetensors(path: str | os.PathLike, what: str) -> dict:
    from library.safetensors_io import load_file

    p = Path(path)
    if not p.is_file():
        raise FluxModelError(f"{what}: file not found: {path}")
    if p.suffix.lower() != ".safetensors":
        raise FluxModelError(f"{what}: {path} is not a .safetensors file (FLUX.1 files are safetensors)")
    try:
        return load_file(str(p))
    except Exception as e:  # corrupt or truncated file
        raise FluxModelError(f"{what}: cannot read {path}: {e}") from e


def save_safetensors_atomic(sd: dict, path: str | os.PathLike, metadata: dict | None = None) -> None:
    """Written through library.files' atomic writer: a failed save never leaves a broken file."""
    from library import files

    files.save_safetensors(sd, path, metadata, overwrite=True)


def _check_exists(path: str, flag: str) -> None:
    """A path that names a model file must exist (otherwise it would be taken for a hub id)."""
    if path.lower().endswith((".safetensors", ".sft", ".ckpt", ".pt", ".bin")) and not os.path.exists(path):
        raise FluxModelError(f"{flag}: file not found: {path}")


def _is_hub_id(s: str) -> bool:
    return not os.path.exists(s) and re.fullmatch(r"[\w.\-]+/[\w.\-]+", s) is not None


def _load_assign(model_cls_factory, sd: dict, source: str):
    """Build a model on the meta device and adopt the state dict's tensors (no second copy of big weights)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = model_cls_factory()
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    if missing or unexpected:
        raise FluxModelError(
            f"{source}: state dict does not match the model; missing: {', '.join(missing[:8]) or '-'}; "
            f"unexpected: {', '.join(unexpected[:8]) or '-'}"
        )
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if still_meta:
        raise FluxModelError(f"{source}: no weights for {', '.join(still_meta[:8])}")
    return model


# ----------------------------------------------------------------------------------------------------------------
# transformer


def _diffusers_subfolder(path: str, sub: str) -> str | None:
    """``path/sub`` when path is a FluxPipeline-style diffusers folder that has it."""
    p = Path(path)
    if p.is_dir() and (p / sub / "config.json").is_file():
        return str(p / sub)
    return None


def is_diffusers_folder(path: str) -> bool:
    return Path(path).is_dir() and (Path(path) / "model_index.json").is_file()


def load_flux_transformer(path: str, dtype: torch.dtype = torch.bfloat16, fp8_base: bool = False):
    """FluxTransformer2DModel from a BFL single file, a diffusers folder (pipeline or transformer/), or a hub id.

    Weights come in ``dtype`` (fp8 weights in the file are upcast) unless ``fp8_base``: then the Linear weights
    are kept in float8_e4m3fn."""
    from diffusers import FluxTransformer2DModel

    path = str(path)
    _check_exists(path, "--pretrained_model_name_or_path")
    if os.path.isfile(path):
        sd = strip_bfl_prefix(read_safetensors(path, "FLUX transformer (--pretrained_model_name_or_path)"))
        cfg = infer_transformer_config(sd, path)
        sd = bfl_to_diffusers(sd, source=path)

        def cast(k, v):  # with fp8_base the Linear weights (all 2-D weights) go to fp8 directly, no bf16 copy
            if not v.is_floating_point():
                return v
            if fp8_base and v.ndim == 2 and k.endswith(".weight"):
                return v.to(FP8_DTYPE)
            return v.to(dtype)

        sd = {k: cast(k, v) for k, v in sd.items()}
        model = _load_assign(lambda: FluxTransformer2DModel(**cfg), sd, path)
    else:
        folder = _diffusers_subfolder(path, "transformer")
        if folder is None and Path(path).is_dir() and (Path(path) / "config.json").is_file():
            folder = path
        if folder is None and not _is_hub_id(path):
            raise FluxModelError(
                f"--pretrained_model_name_or_path: {path} is neither a FLUX.1 .safetensors file, a diffusers folder "
                "with transformer/, nor a hub id"
            )
        try:
            model = FluxTransformer2DModel.from_pretrained(folder or path, subfolder=None if folder else "transformer",
                                                           torch_dtype=dtype)
        except Exception as e:  # noqa: BLE001 - e.g. a truncated weight file (safetensors' own error type)
            raise FluxModelError(f"--pretrained_model_name_or_path: cannot load {path}: {_first_line(e)}; a weight "
                                 "file may be truncated or damaged (an interrupted download or copy?)") from e
    model.requires_grad_(False)
    if fp8_base:
        n = apply_fp8_base(model)
        logger.info(f"fp8 base: {n} Linear layers of the FLUX transformer kept in float8_e4m3fn")
    return model


def save_flux_transformer_bfl(model, path: str, dtype: torch.dtype | None = None, metadata: dict | None = None):
    """Save a FluxTransformer2DModel as a BFL single file (atomic). ``dtype`` None keeps the weights' dtype."""
    sd = {k.replace("_orig_mod.", ""): v.detach().to("cpu") for k, v in model.state_dict().items()}
    bfl = diffusers_to_bfl(sd)
    if dtype is not None:
        bfl = {k: v.to(dtype) for k, v in bfl.items()}
    save_safetensors_atomic(bfl, path, metadata=metadata)


# ----------------------------------------------------------------------------------------------------------------
# text encoders


def _strip(sd: dict, prefixes) -> dict:
    for p in prefixes:
        if any(k.startswith(p) for k in sd):
            return {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}
    return sd


def load_clip_l(path: str, dtype: torch.dtype = torch.float32, tokenizer=None):
    """CLIP-L text encoder from a single file (CLIPTextModel keys, with or without ``text_model.``), a folder, or a
    hub id. ``tokenizer`` supplies the special token ids the pooled output needs."""
    from transformers import CLIPTextConfig, CLIPTextModel

    path = str(path)
    if not os.path.isfile(path):
        return _from_pretrained(CLIPTextModel, path, "text_encoder", dtype, "--clip_l")
    sd = read_safetensors(path, "CLIP-L (--clip_l)")
    sd = _strip(sd, ("text_encoders.clip_l.transformer.", "cond_stage_model.transformer.", "transformer."))
    # files carry transformers' classic "text_model." prefix or none; transformers 5 models have none
    sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not k.endswith("position_ids") and not k.startswith("text_projection")}
    if "embeddings.token_embedding.weight" not in sd:
        raise FluxModelError(f"--clip_l: {path} is not a CLIP text encoder (no embeddings.token_embedding.weight)")
    vocab, hidden = sd["embeddings.token_embedding.weight"].shape
    cfg = dict(
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(sd["encoder.layers.0.mlp.fc1.weight"].shape[0]),
        num_hidden_layers=_count_blocks(sd, "encoder.layers."),
        num_attention_heads=max(1, int(hidden) // 64),
        max_position_embeddings=int(sd["embeddings.position_embedding.weight"].shape[0]),
        projection_dim=int(hidden),
        hidden_act="quick_gelu",
    )
    if tokenizer is not None:
        cfg.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    sd = {k: v.to(dtype) for k, v in sd.items()}
    model = _load_assign(lambda: CLIPTextModel(CLIPTextConfig(**cfg)), sd, path)
    return model.requires_grad_(False)


def load_t5xxl(path: str, dtype: torch.dtype = torch.bfloat16):
    """T5-XXL encoder from a single file (T5EncoderModel keys; fp16/bf16/fp8 weights), a folder, or a hub id."""
    from transformers import T5Config, T5EncoderModel

    path = str(path)
    if not os.path.isfile(path):
        return _from_pretrained(T5EncoderModel, path, "text_encoder_2", dtype, "--t5xxl")
    sd = read_safetensors(path, "T5-XXL (--t5xxl)")
    sd = _strip(sd, ("text_encoders.t5xxl.transformer.",))
    if "shared.weight" not in sd and "encoder.embed_tokens.weight" in sd:
        sd["shared.weight"] = sd["encoder.embed_tokens.weight"]
    rel = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    if "shared.weight" not in sd or rel not in sd:
        raise FluxModelError(f"--t5xxl: {path} is not a T5 encoder (expected shared.weight and {rel})")
    sd.pop("encoder.embed_tokens.weight", None)
    vocab, d_model = sd["shared.weight"].shape
    buckets, heads = sd[rel].shape
    gated = "encoder.block.0.layer.1.DenseReluDense.wi_0.weight" in sd
    wi = "wi_0" if gated else "wi"
    cfg = T5Config(
        vocab_size=int(vocab),
        d_model=int(d_model),
        d_kv=int(sd["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0]) // int(heads),
        d_ff=int(sd[f"encoder.block.0.layer.1.DenseReluDense.{wi}.weight"].shape[0]),
        num_layers=_count_blocks(sd, "encoder.block."),
        num_heads=int(heads),
        relative_attention_num_buckets=int(buckets),
        feed_forward_proj="gated-gelu" if gated else "relu",
        is_encoder_decoder=False,
        use_cache=False,
    )
    sd = {k: v.to(dtype) for k, v in sd.items()}
    sd["encoder.embed_tokens.weight"] = sd["shared.weight"]
    model = _load_assign(lambda: T5EncoderModel(cfg), sd, path)
    return model.requires_grad_(False)


def _from_pretrained(cls, path: str, subfolder: str, dtype, flag: str):
    _check_exists(path, flag)
    sub = _diffusers_subfolder(path, subfolder)
    if sub is None and not (Path(path).is_dir() and (Path(path) / "config.json").is_file()) and not _is_hub_id(path):
        raise FluxModelError(f"{flag}: {path} is not a .safetensors file, a model folder, or a hub id")
    try:
        return cls.from_pretrained(sub or path, torch_dtype=dtype).requires_grad_(False)
    except Exception as e:  # noqa: BLE001 - e.g. a truncated weight file (safetensors' own error type)
        raise FluxModelError(f"{flag}: cannot load {path}: {_first_line(e)}; a weight file may be truncated or "
                             "damaged (an interrupted download or copy?)") from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


# ----------------------------------------------------------------------------------------------------------------
# autoencoder


def infer_ae_config(sd: dict, source: str) -> dict:
    if "encoder.conv_in.weight" not in sd or "decoder.conv_out.weight" not in sd:
        raise FluxModelError(f"--ae: {source} is not a FLUX autoencoder in BFL layout (no encoder.conv_in.weight)")
    num_levels = _count_blocks(sd, "encoder.down.")
    channels = [int(sd[f"encoder.down.{i}.block.0.conv1.weight"].shape[0]) for i in range(num_levels)]
    return {
        "in_channels": int(sd["encoder.conv_in.weight"].shape[1]),
        "out_channels": int(sd["decoder.conv_out.weight"].shape[0]),
        "down_block_types": ["DownEncoderBlock2D"] * num_levels,
        "up_block_types": ["UpDecoderBlock2D"] * num_levels,
        "block_out_channels": channels,
        "layers_per_block": _count_blocks(sd, "encoder.down.0.block."),
        "latent_channels": int(sd["encoder.conv_out.weight"].shape[0]) // 2,
        "norm_num_groups": 32,
        "scaling_factor": AE_SCALING_FACTOR,
        "shift_factor": AE_SHIFT_FACTOR,
        "use_quant_conv": "quant_conv.weight" in sd,
        "use_post_quant_conv": "post_quant_conv.weight" in sd,
        "mid_block_add_attention": True,
    }


def load_ae(path: str, dtype: torch.dtype = torch.float32):
    """FLUX AE (16 latent channels) as diffusers AutoencoderKL from BFL ae.safetensors, a folder, or a hub id."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    path = str(path)
    _check_exists(path, "--ae")
    if not os.path.isfile(path):
        return _from_pretrained(AutoencoderKL, path, "vae", dtype, "--ae")
    sd = _strip(read_safetensors(path, "AE (--ae)"), ("first_stage_model.", "vae."))
    cfg = infer_ae_config(sd, path)
    converted = convert_ldm_vae_checkpoint(sd, cfg)
    converted = {k: v.to(dtype) for k, v in converted.items()}
    model = _load_assign(lambda: AutoencoderKL(**cfg), converted, path)
    return model.requires_grad_(False)


# ----------------------------------------------------------------------------------------------------------------
# tokenizers


def load_tokenizers(pretrained: str | None, tokenizer_cache_dir: str | None = None):
    """(CLIP tokenizer, T5 tokenizer) from the diffusers folder, ``--tokenizer_cache_dir`` (tokenizer/ and
    tokenizer_2/ inside), or the hub (then saved into the cache dir). Offline with none of these is an error."""
    from transformers import AutoTokenizer

    for base in (pretrained, tokenizer_cache_dir):
        if base and (Path(base) / "tokenizer").is_dir() and (Path(base) / "tokenizer_2").is_dir():
            return (AutoTokenizer.from_pretrained(str(Path(base) / "tokenizer")),
                    AutoTokenizer.from_pretrained(str(Path(base) / "tokenizer_2")))
    if pretrained and _is_hub_id(pretrained):
        hub = [(pretrained, "tokenizer"), (pretrained, "tokenizer_2")]
    else:
        hub = [(CLIP_L_HUB_ID, None), (T5XXL_HUB_ID, None)]
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        where = f" or in --tokenizer_cache_dir {tokenizer_cache_dir}" if tokenizer_cache_dir else ""
        raise FluxModelError(
            "FLUX tokenizers not found: a single-file model has no tokenizers, none are in the diffusers folder"
            f"{where}, and HF_HUB_OFFLINE is set so {hub[0][0]} / {hub[1][0]} cannot be downloaded. Put a FluxPipeline"
            " folder's tokenizer/ and tokenizer_2/ into a folder and pass it as --tokenizer_cache_dir."
        )
    toks = []
    for repo, sub in hub:
        try:
            toks.append(AutoTokenizer.from_pretrained(repo, subfolder=sub) if sub else AutoTokenizer.from_pretrained(repo))
        except OSError as e:
            raise FluxModelError(f"cannot load the FLUX tokenizer {repo}: {e}; pass --tokenizer_cache_dir") from e
    if tokenizer_cache_dir:
        toks[0].save_pretrained(str(Path(tokenizer_cache_dir) / "tokenizer"))
        toks[1].save_pretrained(str(Path(tokenizer_cache_dir) / "tokenizer_2"))
    return toks[0], toks[1]


# ----------------------------------------------------------------------------------------------------------------
# everything a trainer needs


@dataclass
class FluxComponents:
    transformer: torch.nn.Module
    clip_l: torch.nn.Module
    t5xxl: torch.nn.Module
    ae: torch.nn.Module
    clip_tokenizer: object
    t5_tokenizer: object

    @property
    def is_schnell(self) -> bool:
        return not self.transformer.config.guidance_embeds

    # the neutral names the training core (library.run, library.targets) uses
    @property
    def denoiser(self):
        return self.transformer

    @property
    def autoencoder(self):
        return self.ae

    @property
    def text_encoders(self) -> list:
        return [self.clip_l, self.t5xxl]

    @property
    def tokenizers(self) -> list:
        return [self.clip_tokenizer, self.t5_tokenizer]


def load_flux_components(
    pretrained: str,
    clip_l: str | None = None,
    t5xxl: str | None = None,
    ae: str | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    te_dtype: torch.dtype | None = None,
    ae_dtype: torch.dtype = torch.float32,
    fp8_base: bool = False,
    tokenizer_cache_dir: str | None = None,
) -> FluxComponents:
    """Load the four FLUX models and two tokenizers. With a single-file transformer, --clip_l, --t5xxl and --ae
    are required; with a diffusers folder they default to its text_encoder, text_encoder_2 and vae."""
    te_dtype = te_dtype or dtype
    folder = pretrained if (is_diffusers_folder(pretrained) or _is_hub_id(pretrained)) else None
    missing = [flag for flag, v in (("--clip_l", clip_l), ("--t5xxl", t5xxl), ("--ae", ae)) if not v and not folder]
    if missing:
        raise FluxModelError(
            f"{', '.join(missing)} required: --pretrained_model_name_or_path {pretrained} is a single-file transformer "
            "(only a diffusers FluxPipeline folder carries its own text encoders and AE)"
        )
    clip_tok, t5_tok = load_tokenizers(folder, tokenizer_cache_dir)
    transformer = load_flux_transformer(pretrained, dtype=dtype, fp8_base=fp8_base)
    clip = load_clip_l(clip_l or folder, te_dtype, tokenizer=clip_tok)
    t5 = load_t5xxl(t5xxl or folder, te_dtype)
    vae = load_ae(ae or folder, ae_dtype)
    return FluxComponents(transformer, clip, t5, vae, clip_tok, t5_tok)



def ae_diffusers_to_bfl(dsd: dict) -> dict:
    """diffusers AutoencoderKL state dict -> BFL ``ae.safetensors`` layout (the inverse of diffusers'
    ``convert_ldm_vae_checkpoint``; attention projections become 1x1 convolutions as in the original file)."""
    num_up = _count_blocks(dsd, "decoder.up_blocks.")
    out = {}
    for k, v in dsd.items():
        n = k
        n = re.sub(r"^encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", n)
        n = re.sub(r"^encoder\.down_blocks\.(\d+)\.downsamplers\.0\.", r"encoder.down.\1.downsample.", n)
        n = re.sub(r"^decoder\.up_blocks\.(\d+)\.", lambda m: f"decoder.up_blocks.{num_up - 1 - int(m.group(1))}.", n)
        n = re.sub(r"^decoder\.up_blocks\.(\d+)\.resnets\.", r"decoder.up.\1.block.", n)
        n = re.sub(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.", r"decoder.up.\1.upsample.", n)
        n = re.sub(r"\.mid_block\.resnets\.(\d+)\.", lambda m: f".mid.block_{int(m.group(1)) + 1}.", n)
        n = n.replace(".mid_block.attentions.0.", ".mid.attn_1.")
        n = n.replace(".conv_shortcut.", ".nin_shortcut.").replace(".conv_norm_out.", ".norm_out.")
        is_attn = ".mid.attn_1." in n
        if is_attn:
            n = (n.replace(".group_norm.", ".norm.").replace(".to_q.", ".q.").replace(".to_k.", ".k.")
                 .replace(".to_v.", ".v.").replace(".to_out.0.", ".proj_out."))
            if v.ndim == 2:
                v = v[:, :, None, None]
        out[n] = v
    return out

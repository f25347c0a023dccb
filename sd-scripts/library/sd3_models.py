"""SD3 / SD3.5 (medium, large): loading, saving and tiny random models. The denoiser is diffusers'
SD3Transformer2DModel, the text encoders transformers' CLIPTextModelWithProjection (CLIP-L, CLIP-G) and
T5EncoderModel, the 16-channel VAE diffusers' AutoencoderKL.

Layouts read: the Stability AI single file (``model.diffusion_model.*`` MMDiT, ``first_stage_model.*`` VAE and,
in the files that carry them, ``text_encoders.{clip_l,clip_g,t5xxl}.transformer.*``), separate text-encoder files
(``--clip_l`` / ``--clip_g`` / ``--t5xxl``), and diffusers StableDiffusion3Pipeline folders. Saves are upstream's
layout: ``model.diffusion_model.`` + ``first_stage_model.`` in one file; trained text encoders beside it as
``<name>_clip_l.safetensors`` / ``_clip_g`` / ``_t5xxl`` (upstream's sd3_train_utils.save_models).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

MMDIT_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
TE_PREFIXES = {"clip_l": "text_encoders.clip_l.transformer.", "clip_g": "text_encoders.clip_g.transformer.",
               "t5xxl": "text_encoders.t5xxl.transformer."}
VAE_SCALING_FACTOR = 1.5305
VAE_SHIFT_FACTOR = 0.0609
HEAD_DIM = 64
# the hub tokenizers upstream loads (library/strategy_sd3.py), used only when no local copy is given
TOKENIZER_HUB_IDS = ("openai/clip-vit-large-patch14", "laion/CLIP-ViT-bigG-14-laion2B-39B-b160k", "google/t5-v1_1-xxl")
TOKENIZER_FOLDERS = ("tokenizer", "tokenizer_2", "tokenizer_3")  # the StableDiffusion3Pipeline / cache-dir layout


class SD3ModelError(ValueError):
    """A model file or folder that is not what SD3 training needs (one line for the user)."""


# ----------------------------------------------------------------------------------------------------------------
# SAI (MMDiT) <-> diffusers key plan: one source for conversion and LoRA names


def sai_linear_map(num_layers: int, attn2_layers=()) -> dict[str, list[str]]:
    """SAI Linear module name -> the diffusers Linear module(s) it is (concatenated along the output dim).
    The last block's context adaLN and the final adaLN are not listed: diffusers holds their halves swapped."""
    m: dict[str, list[str]] = {
        "context_embedder": ["context_embedder"],
        "t_embedder.mlp.0": ["time_text_embed.timestep_embedder.linear_1"],
        "t_embedder.mlp.2": ["time_text_embed.timestep_embedder.linear_2"],
        "y_embedder.mlp.0": ["time_text_embed.text_embedder.linear_1"],
        "y_embedder.mlp.2": ["time_text_embed.text_embedder.linear_2"],
        "final_layer.linear": ["proj_out"],
    }
    for i in range(num_layers):
        b, d = f"joint_blocks.{i}.", f"transformer_blocks.{i}."
        last = i == num_layers - 1
        m.update({
            b + "x_block.attn.qkv": [d + "attn.to_q", d + "attn.to_k", d + "attn.to_v"],
            b + "x_block.attn.proj": [d + "attn.to_out.0"],
            b + "x_block.mlp.fc1": [d + "ff.net.0.proj"],
            b + "x_block.mlp.fc2": [d + "ff.net.2"],
            b + "x_block.adaLN_modulation.1": [d + "norm1.linear"],
            b + "context_block.attn.qkv": [d + "attn.add_q_proj", d + "attn.add_k_proj", d + "attn.add_v_proj"],
        })
        if not last:  # the last context block is "pre only": no output projection, no MLP
            m.update({
                b + "context_block.attn.proj": [d + "attn.to_add_out"],
                b + "context_block.mlp.fc1": [d + "ff_context.net.0.proj"],
                b + "context_block.mlp.fc2": [d + "ff_context.net.2"],
                b + "context_block.adaLN_modulation.1": [d + "norm1_context.linear"],
            })
        if i in attn2_layers:  # SD3.5 medium's second image self-attention
            m.update({b + "x_block.attn2.qkv": [d + "attn2.to_q", d + "attn2.to_k", d + "attn2.to_v"],
                      b + "x_block.attn2.proj": [d + "attn2.to_out.0"]})
    return m


def sai_swapped_linears(num_layers: int) -> dict[str, str]:
    """SAI Linear -> the diffusers Linear holding it with its two output halves swapped (shift/scale)."""
    return {f"joint_blocks.{num_layers - 1}.context_block.adaLN_modulation.1":
            f"transformer_blocks.{num_layers - 1}.norm1_context.linear",
            "final_layer.adaLN_modulation.1": "norm_out.linear"}


def _count(keys, prefix: str) -> int:
    idx = {int(m.group(1)) for k in keys if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(idx) + 1 if idx else 0


def _attn2_layers(keys, prefix: str) -> list[int]:
    return sorted({int(m.group(1)) for k in keys if (m := re.match(re.escape(prefix) + r"(\d+)\.attn2\.", k))})


def _plan(dkeys) -> dict[str, tuple[list[str], str]]:
    """SAI key -> (the diffusers keys it is made of, "cat" along dim 0 or "swap" the two halves)."""
    dkeys = set(dkeys)
    n = _count(dkeys, "transformer_blocks.")
    plan: dict[str, tuple[list[str], str]] = {}
    for sai, parts in sai_linear_map(n, _attn2_layers(dkeys, "transformer_blocks.")).items():
        for kind in ("weight", "bias"):
            if all(f"{p}.{kind}" in dkeys for p in parts):
                plan[f"{sai}.{kind}"] = ([f"{p}.{kind}" for p in parts], "cat")
    plan["pos_embed"] = (["pos_embed.pos_embed"], "cat")
    for kind in ("weight", "bias"):
        plan[f"x_embedder.proj.{kind}"] = ([f"pos_embed.proj.{kind}"], "cat")
        plan[f"final_layer.adaLN_modulation.1.{kind}"] = ([f"norm_out.linear.{kind}"], "swap")
        plan[f"joint_blocks.{n - 1}.context_block.adaLN_modulation.1.{kind}"] = (
            [f"transformer_blocks.{n - 1}.norm1_context.linear.{kind}"], "swap")
    for i in range(n):
        b, d = f"joint_blocks.{i}.", f"transformer_blocks.{i}.attn"
        for sai, ours in (("x_block.attn.ln_q", ".norm_q"), ("x_block.attn.ln_k", ".norm_k"),
                          ("context_block.attn.ln_q", ".norm_added_q"), ("context_block.attn.ln_k", ".norm_added_k"),
                          ("x_block.attn2.ln_q", "2.norm_q"), ("x_block.attn2.ln_k", "2.norm_k")):
            if f"{d}{ours}.weight" in dkeys:
                plan[f"{b}{sai}.weight"] = ([f"{d}{ours}.weight"], "cat")
    unknown = dkeys - {k for parts, _ in plan.values() for k in parts}
    if unknown:
        raise SD3ModelError(f"SD3 transformer: unknown keys {', '.join(sorted(unknown)[:10])}")
    return plan


def _swap(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def diffusers_to_sai(dsd: dict) -> dict:
    """SD3Transformer2DModel state dict -> the SAI MMDiT layout (no prefix)."""
    out = {}
    for sai, (parts, how) in _plan(dsd).items():
        ts = [dsd[p] for p in parts]
        out[sai] = _swap(ts[0]) if how == "swap" else ts[0] if len(ts) == 1 else torch.cat(ts, dim=0)
    return out


def infer_config(sd: dict, source: str) -> dict:
    """SD3Transformer2DModel config read from an SAI MMDiT state dict (no prefix)."""
    need = ("x_embedder.proj.weight", "pos_embed", "context_embedder.weight", "y_embedder.mlp.0.weight")
    missing = [k for k in need if k not in sd]
    if missing:
        raise SD3ModelError(f"{source}: not an SD3 checkpoint (missing {', '.join(MMDIT_PREFIX + k for k in missing)})")
    width, in_channels, patch = sd["x_embedder.proj.weight"].shape[:3]
    qk_norm = "joint_blocks.0.x_block.attn.ln_q.weight" in sd
    return {
        "sample_size": 128, "patch_size": int(patch), "in_channels": int(in_channels),
        "num_layers": _count(sd, "joint_blocks."), "attention_head_dim": HEAD_DIM,
        "num_attention_heads": int(width) // HEAD_DIM, "joint_attention_dim": int(sd["context_embedder.weight"].shape[1]),
        "caption_projection_dim": int(width), "pooled_projection_dim": int(sd["y_embedder.mlp.0.weight"].shape[1]),
        "out_channels": int(sd["final_layer.linear.weight"].shape[0]) // int(patch) ** 2,
        "pos_embed_max_size": round(sd["pos_embed"].shape[1] ** 0.5),
        "dual_attention_layers": tuple(sorted({int(m.group(1)) for k in sd
                                               if (m := re.match(r"joint_blocks\.(\d+)\.x_block\.attn2\.", k))})),
        "qk_norm": "rms_norm" if qk_norm else None,
    }


def sai_to_diffusers(sd: dict, config: dict) -> dict:
    """SAI MMDiT state dict -> SD3Transformer2DModel's (fused qkv split by the model's own shapes)."""
    from accelerate import init_empty_weights
    from diffusers import SD3Transformer2DModel

    with init_empty_weights():
        shapes = {k: v.shape for k, v in SD3Transformer2DModel(**config).state_dict().items()}
    plan = _plan(shapes)
    extra = set(sd) - set(plan)
    if extra:
        raise SD3ModelError(f"SD3 transformer: unexpected keys {', '.join(sorted(extra)[:10])}")
    out = {}
    for key, (parts, how) in plan.items():
        if key not in sd:
            raise SD3ModelError(f"SD3 transformer: missing {MMDIT_PREFIX}{key}")
        t = sd[key]
        if how == "swap":
            out[parts[0]] = _swap(t)
        elif len(parts) == 1:
            out[parts[0]] = t
        else:  # own storage per part
            for p, piece in zip(parts, torch.split(t, [shapes[p][0] for p in parts])):
                out[p] = piece.clone()
    return out


def model_type(config) -> str:
    """Upstream's SD3 model type (what follows "stable-diffusion-3-" in modelspec.architecture)."""
    if config.get("qk_norm"):
        return "5-medium" if config.get("dual_attention_layers") else "5-large"
    return "medium"


# ----------------------------------------------------------------------------------------------------------------
# reading


def read_safetensors(path, what: str) -> dict:
    from library.safetensors_io import load_file

    p = Path(path)
    if not p.is_file():
        raise SD3ModelError(f"{what}: file not found: {path}")
    if p.suffix.lower() not in (".safetensors", ".sft"):
        raise SD3ModelError(f"{what}: {path} is not a .safetensors file")
    try:
        return load_file(str(p))
    except Exception as e:  # noqa: BLE001 - a corrupt or truncated file
        raise SD3ModelError(f"{what}: cannot read {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def _sub(sd: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def _load_assign(factory, sd: dict, source: str):
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = factory()
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise SD3ModelError(f"{source}: weights do not fit the model; missing: {', '.join(missing[:6]) or '-'}; "
                            f"unexpected: {', '.join(unexpected[:6]) or '-'}")
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:  # non-persistent buffers (CLIP position ids) are made again
            owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            owner.register_buffer(name.rpartition(".")[2], torch.arange(buf.shape[-1]).expand(buf.shape).clone(),
                                  persistent=False)
    return model


def is_diffusers_folder(path) -> bool:
    return Path(path).is_dir() and (Path(path) / "model_index.json").is_file()


def _from_folder(cls, folder: str, sub: str, dtype, flag: str):
    try:
        return cls.from_pretrained(str(Path(folder) / sub), torch_dtype=dtype).requires_grad_(False)
    except Exception as e:  # noqa: BLE001
        raise SD3ModelError(f"{flag}: cannot load {folder}/{sub}: {str(e).splitlines()[0] if str(e) else e}") from e


def load_transformer(sd: dict, source: str, dtype: torch.dtype, fp8_base: bool = False):
    from diffusers import SD3Transformer2DModel

    from library.flux_models import apply_fp8_base

    cfg = infer_config(sd, source)
    dsd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sai_to_diffusers(sd, cfg).items()}
    model = _load_assign(lambda: SD3Transformer2DModel(**cfg), dsd, source).requires_grad_(False)
    if fp8_base:
        apply_fp8_base(model)
    return model


def load_clip(sd: dict, which: str, dtype: torch.dtype, source: str, tokenizer=None):
    """CLIPTextModelWithProjection (CLIP-L: quick_gelu; CLIP-G: gelu) from HF-layout weights (``text_model.`` or
    none, ``text_projection.weight``)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    sd = {k.removeprefix("text_model."): v for k, v in sd.items() if not k.endswith("position_ids")}
    if "embeddings.token_embedding.weight" not in sd or "text_projection.weight" not in sd:
        raise SD3ModelError(f"--{which}: {source} is not a CLIP text encoder with projection (expected "
                            "text_model.embeddings.token_embedding.weight and text_projection.weight)")
    vocab, hidden = sd["embeddings.token_embedding.weight"].shape
    cfg = dict(vocab_size=int(vocab), hidden_size=int(hidden),
               intermediate_size=int(sd["encoder.layers.0.mlp.fc1.weight"].shape[0]),
               num_hidden_layers=_count(sd, "encoder.layers."), num_attention_heads=max(1, int(hidden) // 64),
               max_position_embeddings=int(sd["embeddings.position_embedding.weight"].shape[0]),
               projection_dim=int(sd["text_projection.weight"].shape[0]),
               hidden_act="quick_gelu" if which == "clip_l" else "gelu")
    if tokenizer is not None:
        cfg.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    hf = {("" if k == "text_projection.weight" else "text_model.") + k: v.to(dtype) for k, v in sd.items()}
    return _load_assign(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**cfg)), hf, source).requires_grad_(False)


def load_t5(sd: dict, dtype: torch.dtype, source: str):
    from transformers import T5Config, T5EncoderModel

    if "shared.weight" not in sd and "encoder.embed_tokens.weight" in sd:
        sd["shared.weight"] = sd["encoder.embed_tokens.weight"]
    rel = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    if "shared.weight" not in sd or rel not in sd:
        raise SD3ModelError(f"--t5xxl: {source} is not a T5 encoder (expected shared.weight and {rel})")
    sd = {k: v for k, v in sd.items() if k != "encoder.embed_tokens.weight"}
    vocab, d_model = sd["shared.weight"].shape
    buckets, heads = sd[rel].shape
    cfg = T5Config(vocab_size=int(vocab), d_model=int(d_model),
                   d_kv=int(sd["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0]) // int(heads),
                   d_ff=int(sd["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0]),
                   num_layers=_count(sd, "encoder.block."), num_heads=int(heads),
                   relative_attention_num_buckets=int(buckets), feed_forward_proj="gated-gelu",
                   is_encoder_decoder=False, use_cache=False)
    sd = {k: v.to(dtype) for k, v in sd.items()}
    sd["encoder.embed_tokens.weight"] = sd["shared.weight"]
    return _load_assign(lambda: T5EncoderModel(cfg), sd, source).requires_grad_(False)


def vae_config(ldm: dict) -> dict:
    n = _count(ldm, "encoder.down.")
    return dict(in_channels=int(ldm["encoder.conv_in.weight"].shape[1]),
                out_channels=int(ldm["decoder.conv_out.weight"].shape[0]),
                latent_channels=int(ldm["decoder.conv_in.weight"].shape[1]),
                block_out_channels=[int(ldm[f"encoder.down.{i}.block.0.conv1.weight"].shape[0]) for i in range(n)],
                layers_per_block=_count(ldm, "encoder.down.0.block."), down_block_types=["DownEncoderBlock2D"] * n,
                up_block_types=["UpDecoderBlock2D"] * n, norm_num_groups=32, scaling_factor=VAE_SCALING_FACTOR,
                shift_factor=VAE_SHIFT_FACTOR, use_quant_conv=False, use_post_quant_conv=False, sample_size=1024)


def load_vae(sd: dict, dtype: torch.dtype, source: str):
    """AutoencoderKL from LDM-layout weights (``encoder.down.N...``) or diffusers-layout ones."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    if "encoder.down.0.block.0.conv1.weight" in sd:
        cfg = vae_config(sd)
        dsd = convert_ldm_vae_checkpoint(sd, cfg)
    elif "encoder.down_blocks.0.resnets.0.conv1.weight" in sd:
        n = _count(sd, "encoder.down_blocks.")
        cfg = vae_config({"encoder.conv_in.weight": sd["encoder.conv_in.weight"],
                          "decoder.conv_out.weight": sd["decoder.conv_out.weight"],
                          "decoder.conv_in.weight": sd["decoder.conv_in.weight"],
                          **{f"encoder.down.{i}.block.0.conv1.weight": sd[f"encoder.down_blocks.{i}.resnets.0.conv1.weight"]
                             for i in range(n)}})
        cfg["layers_per_block"] = _count(sd, "encoder.down_blocks.0.resnets.")
        dsd = sd
    else:
        raise SD3ModelError(f"--vae: {source} has no SD3 VAE weights (expected {VAE_PREFIX}encoder.down.0...)")
    dsd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in dsd.items()}
    return _load_assign(lambda: AutoencoderKL(**cfg), dsd, source).eval().requires_grad_(False)


def load_tokenizers(folder: str | None, tokenizer_cache_dir: str | None) -> list:
    """[CLIP-L, CLIP-G, T5] tokenizers: a diffusers folder's tokenizer/ tokenizer_2/ tokenizer_3/, the same in
    --tokenizer_cache_dir, else upstream's hub ids (then saved into the cache dir). CLIP-G pads with id 0, as
    upstream."""
    from transformers import AutoTokenizer

    toks = None
    for base in (folder, tokenizer_cache_dir):
        if base and all((Path(base) / sub).is_dir() for sub in TOKENIZER_FOLDERS):
            toks = [AutoTokenizer.from_pretrained(str(Path(base) / sub)) for sub in TOKENIZER_FOLDERS]
            break
    if toks is None:
        if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
            raise SD3ModelError("SD3 tokenizers not found: no tokenizer/ tokenizer_2/ tokenizer_3/ in a diffusers "
                                "folder or in --tokenizer_cache_dir, and HF_HUB_OFFLINE is set")
        try:
            toks = [AutoTokenizer.from_pretrained(hub) for hub in TOKENIZER_HUB_IDS]
        except OSError as e:
            raise SD3ModelError(f"cannot load the SD3 tokenizers: {e}; pass --tokenizer_cache_dir") from e
        if tokenizer_cache_dir:
            for tok, sub in zip(toks, TOKENIZER_FOLDERS):
                tok.save_pretrained(str(Path(tokenizer_cache_dir) / sub))
    toks[1].pad_token = toks[1].convert_ids_to_tokens(0)  # upstream: clip_g.pad_token_id = 0
    return toks


@dataclass
class SD3Components:
    transformer: torch.nn.Module
    clip_l: torch.nn.Module | None
    clip_g: torch.nn.Module | None
    t5xxl: torch.nn.Module | None
    vae: torch.nn.Module
    tokenizer_list: list

    @property
    def model_type(self) -> str:
        return model_type(self.transformer.config)

    # the neutral names the training core uses
    @property
    def denoiser(self):
        return self.transformer

    @property
    def autoencoder(self):
        return self.vae

    @property
    def text_encoders(self) -> list:
        return [self.clip_l, self.clip_g, self.t5xxl]

    @property
    def tokenizers(self) -> list:
        return list(self.tokenizer_list)


def load_sd3_components(pretrained: str, clip_l: str | None = None, clip_g: str | None = None,
                        t5xxl: str | None = None, vae: str | None = None, *, dtype: torch.dtype = torch.bfloat16,
                        te_dtype: torch.dtype | None = None, t5_dtype: torch.dtype | None = None,
                        vae_dtype: torch.dtype = torch.float32, fp8_base: bool = False,
                        tokenizer_cache_dir: str | None = None) -> SD3Components:
    """The MMDiT, CLIP-L, CLIP-G, T5-XXL, VAE and tokenizers. A file given by --clip_l / --clip_g / --t5xxl / --vae
    wins over what the checkpoint carries; CLIP-L and CLIP-G are required, T5-XXL may be absent (zeros, as
    upstream)."""
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    te_dtype = te_dtype or dtype
    pretrained = str(pretrained)
    folder = pretrained if is_diffusers_folder(pretrained) else None
    if folder is None and not os.path.isfile(pretrained):
        raise SD3ModelError(f"--pretrained_model_name_or_path: {pretrained} is neither an SD3 .safetensors file nor "
                            "a diffusers StableDiffusion3Pipeline folder (model_index.json)")
    toks = load_tokenizers(folder, tokenizer_cache_dir)
    sd = {} if folder else read_safetensors(pretrained, "--pretrained_model_name_or_path")

    def separate(path, what):
        return read_safetensors(path, f"--{what}") if path else None

    def text_encoder(which, path, sub, load):
        own = separate(path, which)
        if own is not None:
            for p in (TE_PREFIXES[which], "transformer."):
                if any(k.startswith(p) for k in own):
                    own = _sub(own, p)
            return load(own, path)
        if folder:
            if not (Path(folder) / sub / "config.json").is_file():
                return None
            cls = T5EncoderModel if which == "t5xxl" else CLIPTextModelWithProjection
            return _from_folder(cls, folder, sub, t5_dtype or te_dtype if which == "t5xxl" else te_dtype,
                                "--pretrained_model_name_or_path")
        inside = _sub(sd, TE_PREFIXES[which])
        return load(inside, pretrained) if inside else None

    c_l = text_encoder("clip_l", clip_l, "text_encoder",
                       lambda s, src: load_clip(s, "clip_l", te_dtype, src, toks[0]))
    c_g = text_encoder("clip_g", clip_g, "text_encoder_2",
                       lambda s, src: load_clip(s, "clip_g", te_dtype, src, toks[1]))
    t5 = text_encoder("t5xxl", t5xxl, "text_encoder_3", lambda s, src: load_t5(s, t5_dtype or te_dtype, src))
    missing = [flag for flag, m in (("--clip_l", c_l), ("--clip_g", c_g)) if m is None]
    if missing:
        raise SD3ModelError(f"{' and '.join(missing)} required: {pretrained} does not carry "
                            f"{' and '.join(f[2:].replace('_', '-').upper() for f in missing)}")
    if vae:
        v = load_vae(_vae_weights(separate(vae, "vae"), vae), vae_dtype, vae)
    elif folder:
        from diffusers import AutoencoderKL

        v = _from_folder(AutoencoderKL, folder, "vae", vae_dtype, "--pretrained_model_name_or_path").eval()
    else:
        v = load_vae(_vae_weights(sd, pretrained), vae_dtype, pretrained)
    if folder:
        from diffusers import SD3Transformer2DModel

        transformer = _from_folder(SD3Transformer2DModel, folder, "transformer", dtype,
                                   "--pretrained_model_name_or_path")
        if fp8_base:
            from library.flux_models import apply_fp8_base

            apply_fp8_base(transformer)
    else:
        mmdit = _sub(sd, MMDIT_PREFIX)
        if not mmdit:
            raise SD3ModelError(f"--pretrained_model_name_or_path: {pretrained} has no {MMDIT_PREFIX}* weights "
                                "(not an SD3 checkpoint)")
        transformer = load_transformer(mmdit, pretrained, dtype, fp8_base)
    return SD3Components(transformer, c_l, c_g, t5, v, toks)


def _vae_weights(sd: dict, source: str) -> dict:
    inner = _sub(sd, VAE_PREFIX)
    if inner:
        return inner
    if any(k.startswith("encoder.") for k in sd):
        return sd
    raise SD3ModelError(f"{source}: no VAE inside ({VAE_PREFIX}*): pass --vae")


# ----------------------------------------------------------------------------------------------------------------
# saving (upstream's layout)


def checkpoint_entries(transformer, vae, dtype: torch.dtype | None = None) -> list:
    """``model.diffusion_model.*`` (SAI MMDiT) and ``first_stage_model.*`` (LDM VAE) as library.saving.TensorEntry
    items, each made when written."""
    from library.compile.regional import strip_orig_mod
    from library.model_util import vae_to_ldm_state_dict
    from library.saving import TensorEntry

    dsd = strip_orig_mod(transformer.state_dict())
    entries = []
    for sai, (parts, how) in _plan(dsd).items():
        ts = [dsd[p] for p in parts]

        def make(ts=ts, how=how):
            t = [x.detach().to("cpu", dtype or x.dtype) for x in ts]
            return _swap(t[0]) if how == "swap" else t[0] if len(t) == 1 else torch.cat(t, dim=0)

        entries.append(TensorEntry(MMDIT_PREFIX + sai, (sum(t.shape[0] for t in ts), *ts[0].shape[1:]),
                                   dtype or ts[0].dtype, make))
    for k, v in vae_to_ldm_state_dict(vae).items():
        entries.append(TensorEntry(VAE_PREFIX + k, tuple(v.shape), v.dtype,
                                   lambda v=v: v.detach().to("cpu").contiguous()))
    return entries


def text_encoder_state_dict(model, dtype: torch.dtype | None = None) -> dict:
    """A text encoder's weights as upstream saves them (transformers' keys; T5's shared weight copied)."""
    sd = {k: v.detach().to("cpu", dtype or v.dtype).clone() for k, v in model.state_dict().items()
          if not k.endswith("position_ids")}
    sd.pop("encoder.embed_tokens.weight", None)
    return sd


# ----------------------------------------------------------------------------------------------------------------
# tiny random SD3 (tests, GUI demo; nothing downloaded)


def tiny_transformer(*, width=64, num_layers=2, joint_dim=64, pooled_dim=64, qk_norm=False, attn2_layers=(),
                     pos_embed_max_size=16, seed=0):
    from diffusers import SD3Transformer2DModel

    from library.flux_tiny import _randomize

    model = SD3Transformer2DModel(  # built for real: the positional-embedding buffer is computed, not left empty
        sample_size=pos_embed_max_size, patch_size=2, in_channels=16, num_layers=num_layers,
        attention_head_dim=HEAD_DIM, num_attention_heads=width // HEAD_DIM, joint_attention_dim=joint_dim,
        caption_projection_dim=width, pooled_projection_dim=pooled_dim, out_channels=16,
        pos_embed_max_size=pos_embed_max_size, dual_attention_layers=tuple(attn2_layers),
        qk_norm="rms_norm" if qk_norm else None)
    return _randomize(model, seed, std=0.5 / width ** 0.5)


def tiny_clip(tokenizer, which: str, hidden=32, seed=1):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=1, max_position_embeddings=77, projection_dim=hidden,
                         hidden_act="quick_gelu" if which == "clip_l" else "gelu", bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return CLIPTextModelWithProjection(cfg).eval()


def tiny_vae(seed=3):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                         up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[32] * 4, layers_per_block=1,
                         latent_channels=16, norm_num_groups=32, scaling_factor=VAE_SCALING_FACTOR,
                         shift_factor=VAE_SHIFT_FACTOR, use_quant_conv=False, use_post_quant_conv=False).eval()


def make_tiny_sd3(dest, *, large: bool = False, text_encoders_inside: bool = True, diffusers_folder: bool = False,
                  seed: int = 0) -> dict:
    """A tiny SD3 set under ``dest``: ``sd3.safetensors`` (the SAI single file; with ``text_encoders_inside`` also
    ``text_encoders.*``), ``clip_l.safetensors``, ``clip_g.safetensors``, ``t5xxl.safetensors``, ``tokenizers/``
    (tokenizer/, tokenizer_2/, tokenizer_3/: the --tokenizer_cache_dir layout) and with ``diffusers_folder`` a
    StableDiffusion3Pipeline folder ``diffusers/``. ``large``: SD3.5-large-like (RMS qk norm, no attn2); else
    SD3.5-medium-like (qk norm and attn2 in block 0)."""
    from safetensors.torch import save_file

    from library import flux_tiny
    from library.model_util import vae_to_ldm_state_dict

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok_dir = dest / "tokenizers"
    tok_l = flux_tiny.make_clip_tokenizer(tok_dir / "tokenizer")
    tok_g = flux_tiny.make_clip_tokenizer(tok_dir / "tokenizer_2")
    tok_t5 = flux_tiny.make_t5_tokenizer(tok_dir / "tokenizer_3")
    clip_l, clip_g = tiny_clip(tok_l, "clip_l", seed=seed + 1), tiny_clip(tok_g, "clip_g", seed=seed + 2)
    t5 = flux_tiny.tiny_t5(len(tok_t5), d_model=64, seed=seed + 3)
    vae = tiny_vae(seed + 4)
    transformer = tiny_transformer(joint_dim=64, pooled_dim=64, qk_norm=True, attn2_layers=() if large else (0,),
                                   seed=seed)
    paths = {"tokenizer_cache_dir": str(tok_dir), "transformer": str(dest / "sd3.safetensors")}
    sd = {MMDIT_PREFIX + k: v for k, v in diffusers_to_sai(transformer.state_dict()).items()}
    sd.update({VAE_PREFIX + k: v for k, v in vae_to_ldm_state_dict(vae).items()})
    te_sds = {"clip_l": text_encoder_state_dict(clip_l), "clip_g": text_encoder_state_dict(clip_g),
              "t5xxl": text_encoder_state_dict(t5)}
    if text_encoders_inside:
        for which, te_sd in te_sds.items():
            sd.update({TE_PREFIXES[which] + k: v for k, v in te_sd.items()})
    save_file({k: v.contiguous() for k, v in sd.items()}, paths["transformer"])
    for which, te_sd in te_sds.items():
        paths[which] = str(dest / f"{which}.safetensors")
        save_file({k: v.contiguous() for k, v in te_sd.items()}, paths[which])
    if diffusers_folder:
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=flow_match_scheduler(), vae=vae,
                                        text_encoder=clip_l, tokenizer=tok_l, text_encoder_2=clip_g, tokenizer_2=tok_g,
                                        text_encoder_3=t5, tokenizer_3=tok_t5)
        paths["diffusers"] = str(dest / "diffusers")
        pipe.save_pretrained(paths["diffusers"])
    return paths


def flow_match_scheduler(shift: float = 3.0):
    """SD3's sampling schedule (upstream's sampler: the discrete flow with shift 3.0)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)

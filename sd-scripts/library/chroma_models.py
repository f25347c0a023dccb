"""Chroma (lodestones/Chroma: FLUX.1-schnell's blocks without CLIP-L and without per-block modulation layers; one
"distilled guidance" approximator MLP makes every block's modulation from the timestep and guidance): loading,
saving and tiny random models. The transformer is diffusers' ChromaTransformer2DModel.

Layouts read: the single file as distributed (BFL-like keys ``double_blocks.N...``, ``single_blocks.N...``,
``distilled_guidance_layer...``; a ``model.diffusion_model.`` prefix is fine) and diffusers ChromaPipeline folders
(transformer/, text_encoder/ = T5, tokenizer/, vae/) or a transformer folder. Saves are the single-file layout.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from library import flux_models
from library.flux_models import FluxModelError

APPROXIMATOR = "distilled_guidance_layer."


def is_chroma_state_dict(keys) -> bool:
    return any(k.endswith(APPROXIMATOR + "in_proj.weight") for k in keys)


def _plan(keys) -> dict[str, list[str]]:
    """Single-file key -> the diffusers keys it is made of (concatenated along dim 0); FLUX.1's block map without
    the modulation layers Chroma does not have, plus the approximator."""
    keys = set(keys)
    num_double = flux_models._count_blocks(keys, "transformer_blocks.")
    num_single = flux_models._count_blocks(keys, "single_transformer_blocks.")
    plan: dict[str, list[str]] = {}
    for bfl, parts in flux_models.bfl_linear_map(num_double, num_single, guidance=False).items():
        for kind in ("weight", "bias"):
            if all(f"{p}.{kind}" in keys for p in parts):
                plan[f"{bfl}.{kind}"] = [f"{p}.{kind}" for p in parts]
    for bfl, d in flux_models._bfl_norm_map(num_double, num_single).items():
        plan[bfl] = [d]
    for i in range(flux_models._count_blocks(keys, APPROXIMATOR + "layers.")):
        for ours, theirs in (("in_layer", "linear_1"), ("out_layer", "linear_2")):
            for kind in ("weight", "bias"):
                plan[f"{APPROXIMATOR}layers.{i}.{ours}.{kind}"] = [f"{APPROXIMATOR}layers.{i}.{theirs}.{kind}"]
        plan[f"{APPROXIMATOR}norms.{i}.scale"] = [f"{APPROXIMATOR}norms.{i}.weight"]
    for name in ("in_proj", "out_proj"):
        for kind in ("weight", "bias"):
            plan[f"{APPROXIMATOR}{name}.{kind}"] = [f"{APPROXIMATOR}{name}.{kind}"]
    unknown = keys - {k for parts in plan.values() for k in parts}
    if unknown:
        raise FluxModelError(f"cannot save Chroma: unknown transformer keys {', '.join(sorted(unknown)[:10])}")
    return plan


def diffusers_to_single_file(dsd: dict) -> dict:
    """ChromaTransformer2DModel state dict -> the distributed single-file layout."""
    return {k: parts_[0] if len(parts_) == 1 else torch.cat(parts_, dim=0)
            for k, parts_ in ((k, [dsd[p] for p in parts]) for k, parts in _plan(dsd).items())}


def infer_config(sd: dict, source: str) -> dict:
    """ChromaTransformer2DModel config read from a single-file state dict."""
    need = ("img_in.weight", "txt_in.weight", "final_layer.linear.weight", APPROXIMATOR + "in_proj.weight")
    missing = [k for k in need if k not in sd]
    if missing:
        raise FluxModelError(f"{source}: not a Chroma transformer (missing {', '.join(missing)}); expected keys like "
                             "'double_blocks.0.img_attn.qkv.weight' and 'distilled_guidance_layer.in_proj.weight'")
    width, in_channels = sd["img_in.weight"].shape
    if width % flux_models.HEAD_DIM:
        raise FluxModelError(f"{source}: transformer width {width} is not a multiple of {flux_models.HEAD_DIM}")
    hidden, approx_in = sd[APPROXIMATOR + "in_proj.weight"].shape
    return {
        "patch_size": 1, "in_channels": int(in_channels),
        "out_channels": int(sd["final_layer.linear.weight"].shape[0]),
        "num_layers": flux_models._count_blocks(sd, "double_blocks."),
        "num_single_layers": flux_models._count_blocks(sd, "single_blocks."),
        "attention_head_dim": flux_models.HEAD_DIM, "num_attention_heads": int(width) // flux_models.HEAD_DIM,
        "joint_attention_dim": int(sd["txt_in.weight"].shape[1]), "axes_dims_rope": list(flux_models.ROPE_AXES),
        "approximator_num_channels": int(approx_in), "approximator_hidden_dim": int(hidden),
        "approximator_layers": flux_models._count_blocks(sd, APPROXIMATOR + "layers."),
    }


def single_file_to_diffusers(sd: dict, config: dict) -> dict:
    """Single-file state dict -> ChromaTransformer2DModel's (fused layers split by the model's own shapes)."""
    from accelerate import init_empty_weights
    from diffusers import ChromaTransformer2DModel

    with init_empty_weights():
        shapes = {k: v.shape for k, v in ChromaTransformer2DModel(**config).state_dict().items()}
    out = {}
    for key, parts in _plan(shapes).items():
        if key not in sd:
            raise FluxModelError(f"Chroma transformer: missing {key}")
        t = sd[key]
        if len(parts) == 1:
            out[parts[0]] = t
        else:  # own storage per part (in-place updates of one part must not touch the others' version counter)
            for p, piece in zip(parts, torch.split(t, [shapes[p][0] for p in parts])):
                out[p] = piece.clone()
    extra = set(sd) - set(_plan(shapes))
    if extra:
        raise FluxModelError(f"Chroma transformer: unexpected keys {', '.join(sorted(extra)[:10])}")
    return out


def load_chroma_transformer(path: str, dtype: torch.dtype = torch.bfloat16, fp8_base: bool = False):
    """ChromaTransformer2DModel from the distributed single file, a diffusers folder (pipeline or transformer/)."""
    from diffusers import ChromaTransformer2DModel

    path = str(path)
    flux_models._check_exists(path, "--pretrained_model_name_or_path")
    if os.path.isfile(path):
        sd = flux_models.strip_bfl_prefix(flux_models.read_safetensors(path, "Chroma (--pretrained_model_name_or_path)"))
        if not is_chroma_state_dict(sd):
            raise FluxModelError(f"--model_type chroma: {path} is not a Chroma checkpoint (no "
                                 f"{APPROXIMATOR}in_proj.weight; a FLUX.1 file needs --model_type flux)")
        cfg = infer_config(sd, path)
        sd = {k: (v.to(flux_models.FP8_DTYPE) if fp8_base and v.ndim == 2 and k.endswith(".weight") else v.to(dtype))
              if v.is_floating_point() else v for k, v in single_file_to_diffusers(sd, cfg).items()}
        model = flux_models._load_assign(lambda: ChromaTransformer2DModel(**cfg), sd, path)
    else:
        folder = flux_models._diffusers_subfolder(path, "transformer")
        if folder is None and Path(path).is_dir() and (Path(path) / "config.json").is_file():
            folder = path
        if folder is None:
            raise FluxModelError(f"--pretrained_model_name_or_path: {path} is neither a Chroma .safetensors file nor a "
                                 "diffusers folder with transformer/")
        try:
            model = ChromaTransformer2DModel.from_pretrained(folder, torch_dtype=dtype)
        except Exception as e:  # noqa: BLE001 - a FLUX folder, or a damaged file
            raise FluxModelError(f"--model_type chroma: cannot load {path} as a Chroma transformer: "
                                 f"{flux_models._first_line(e)}") from e
    model.requires_grad_(False)
    if fp8_base:
        flux_models.apply_fp8_base(model)
    return model


@dataclass
class ChromaComponents:
    transformer: torch.nn.Module
    t5xxl: torch.nn.Module
    ae: torch.nn.Module
    t5_tokenizer: object
    clip_l = None  # Chroma has no CLIP-L

    # the neutral names the training core (library.run, library.targets) uses
    @property
    def denoiser(self):
        return self.transformer

    @property
    def autoencoder(self):
        return self.ae

    @property
    def text_encoders(self) -> list:
        return [self.t5xxl]

    @property
    def tokenizers(self) -> list:
        return [self.t5_tokenizer]


def load_t5_tokenizer(folder: str | None, tokenizer_cache_dir: str | None):
    """T5 tokenizer: the ChromaPipeline folder's tokenizer/, or --tokenizer_cache_dir's tokenizer_2/ (the FLUX.1
    layout), else the hub (not offline)."""
    from transformers import AutoTokenizer

    if folder and (Path(folder) / "tokenizer" / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(Path(folder) / "tokenizer"))
    if tokenizer_cache_dir and (Path(tokenizer_cache_dir) / "tokenizer_2").is_dir():
        return AutoTokenizer.from_pretrained(str(Path(tokenizer_cache_dir) / "tokenizer_2"))
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        raise FluxModelError("Chroma's T5 tokenizer not found: no tokenizer/ in a diffusers folder, no tokenizer_2/ in "
                             "--tokenizer_cache_dir, and HF_HUB_OFFLINE is set")
    tok = AutoTokenizer.from_pretrained(flux_models.T5XXL_HUB_ID)
    if tokenizer_cache_dir:
        tok.save_pretrained(str(Path(tokenizer_cache_dir) / "tokenizer_2"))
    return tok


def load_chroma_components(pretrained: str, t5xxl: str | None = None, ae: str | None = None, *,
                           dtype: torch.dtype = torch.bfloat16, te_dtype: torch.dtype | None = None,
                           ae_dtype: torch.dtype = torch.float32, fp8_base: bool = False,
                           tokenizer_cache_dir: str | None = None) -> ChromaComponents:
    """Transformer, T5-XXL, AE and T5 tokenizer. A single file needs --t5xxl and --ae (the FLUX.1 ones); a
    ChromaPipeline folder carries its own (text_encoder/, vae/, tokenizer/)."""
    folder = pretrained if flux_models.is_diffusers_folder(pretrained) else None
    missing = [flag for flag, v in (("--t5xxl", t5xxl), ("--ae", ae)) if not v and not folder]
    if missing:
        raise FluxModelError(f"{', '.join(missing)} required: --pretrained_model_name_or_path {pretrained} is a "
                             "single-file Chroma transformer (only a diffusers ChromaPipeline folder carries its own)")
    tok = load_t5_tokenizer(folder, tokenizer_cache_dir)
    transformer = load_chroma_transformer(pretrained, dtype=dtype, fp8_base=fp8_base)
    if t5xxl:
        t5 = flux_models.load_t5xxl(t5xxl, te_dtype or dtype)
    else:
        from transformers import T5EncoderModel

        t5 = flux_models._from_pretrained(T5EncoderModel, folder, "text_encoder", te_dtype or dtype, "--t5xxl")
    vae = flux_models.load_ae(ae or folder, ae_dtype)
    return ChromaComponents(transformer, t5, vae, tok)


def save_single_file_entries(dsd: dict, dtype: torch.dtype | None = None) -> list:
    """The single-file tensors as library.saving.TensorEntry items, each made only when written (--mem_eff_save)."""
    from library.saving import TensorEntry

    entries = []
    for key, parts in _plan(dsd).items():
        ts = [dsd[p] for p in parts]

        def make(ts=ts):
            t = [x.detach().to("cpu", dtype or x.dtype) for x in ts]
            return t[0] if len(t) == 1 else torch.cat(t, dim=0)

        entries.append(TensorEntry(key, (sum(t.shape[0] for t in ts), *ts[0].shape[1:]), dtype or ts[0].dtype, make))
    return entries


# ----------------------------------------------------------------------------------------------------------------
# tiny random Chroma (tests, GUI demo; nothing downloaded)


def tiny_chroma_transformer(width=128, num_double=1, num_single=1, t5_dim=32, seed=0, dtype=torch.float32):
    from accelerate import init_empty_weights
    from diffusers import ChromaTransformer2DModel

    from library.flux_tiny import _randomize

    with init_empty_weights():
        model = ChromaTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=num_double, num_single_layers=num_single,
            attention_head_dim=flux_models.HEAD_DIM, num_attention_heads=width // flux_models.HEAD_DIM,
            joint_attention_dim=t5_dim, axes_dims_rope=list(flux_models.ROPE_AXES), approximator_num_channels=64,
            approximator_hidden_dim=64, approximator_layers=2)
    model = model.to(dtype).to_empty(device="cpu")
    return _randomize(model, seed, std=0.5 / width**0.5)


def make_tiny_chroma(dest: str | Path, *, width: int = 128, num_double: int = 1, num_single: int = 1,
                     prefix: bool = False, diffusers_folder: bool = False, seed: int = 0) -> dict:
    """A tiny Chroma set under ``dest``: ``chroma.safetensors`` (the distributed single-file layout; ``prefix``
    adds ``model.diffusion_model.``), ``t5xxl.safetensors``, ``ae.safetensors``, ``tokenizers/`` (tokenizer_2/ =
    T5, the --tokenizer_cache_dir layout) and with ``diffusers_folder`` a ChromaPipeline folder ``diffusers/``."""
    from safetensors.torch import save_file

    from library import flux_tiny

    dest = Path(dest)
    paths = flux_tiny.make_tiny_flux(dest, width=width, num_double=num_double, num_single=num_single, seed=seed)
    t5 = flux_models.load_t5xxl(paths["t5xxl"], torch.float32)
    transformer = tiny_chroma_transformer(width, num_double, num_single, t5.config.d_model, seed)
    sd = diffusers_to_single_file(transformer.state_dict())
    paths["transformer"] = str(dest / "chroma.safetensors")
    save_file({("model.diffusion_model." if prefix else "") + k: v.contiguous() for k, v in sd.items()},
              paths["transformer"])
    for stale in ("clip_l", "diffusers"):
        paths.pop(stale, None)
    if diffusers_folder:
        from diffusers import ChromaPipeline
        from transformers import AutoTokenizer

        pipe = ChromaPipeline(scheduler=flux_tiny.flow_match_scheduler(), vae=flux_models.load_ae(paths["ae"]),
                              text_encoder=t5, tokenizer=AutoTokenizer.from_pretrained(
                                  str(Path(paths["tokenizer_cache_dir"]) / "tokenizer_2")),
                              transformer=transformer)
        paths["diffusers"] = str(dest / "diffusers")
        pipe.save_pretrained(paths["diffusers"])
    return paths

"""Lumina Image 2.0 models: the NextDiT transformer (diffusers' Lumina2Transformer2DModel), the Gemma 2 text encoder
(transformers' Gemma2Model) and FLUX.1's 16-channel AE, loaded from the files users have: upstream's single file for
the DiT (Alpha-VLLM keys, `model.diffusion_model.` prefix fine), a Lumina2Pipeline folder, `--gemma2` as a single
file or a folder, `--ae` as FLUX.1's ae.safetensors. The DiT is saved in upstream's layout (what upstream's
lumina_train.py writes and its loader reads). Tiny random sets for tests and the GUI demo (nothing downloaded)."""
from __future__ import annotations

import os
import string
from dataclasses import dataclass
from pathlib import Path

import torch

from library import flux_models
from library.errors import ModelLoadError

GEMMA_ID = "google/gemma-2-2b"  # upstream's tokenizer
GEMMA_HEAD_DIM = 256  # Gemma 2 2B: 8 heads of 256, 4 key/value heads
SINGLE_FILE_PREFIXES = ("model.diffusion_model.",)  # ComfyUI / Neta-Lumina files
GEMMA_PREFIXES = ("text_encoders.gemma2_2b.transformer.model.", "model.")
BLOCK_LISTS = ("layers", "noise_refiner", "context_refiner")
# Alpha-VLLM name -> diffusers name, inside a block (context_refiner blocks have no modulation: norm1 is a plain norm)
_BLOCK_KEYS = {"attention.out.weight": "attn.to_out.0.weight", "attention.q_norm.weight": "attn.norm_q.weight",
               "attention.k_norm.weight": "attn.norm_k.weight", "feed_forward.w1.weight": "feed_forward.linear_1.weight",
               "feed_forward.w2.weight": "feed_forward.linear_2.weight",
               "feed_forward.w3.weight": "feed_forward.linear_3.weight", "attention_norm2.weight": "norm2.weight",
               "ffn_norm1.weight": "ffn_norm1.weight", "ffn_norm2.weight": "ffn_norm2.weight",
               "adaLN_modulation.1.weight": "norm1.linear.weight", "adaLN_modulation.1.bias": "norm1.linear.bias"}
_TOP_KEYS = {"x_embedder.weight": "x_embedder.weight", "x_embedder.bias": "x_embedder.bias",
             "t_embedder.mlp.0.weight": "time_caption_embed.timestep_embedder.linear_1.weight",
             "t_embedder.mlp.0.bias": "time_caption_embed.timestep_embedder.linear_1.bias",
             "t_embedder.mlp.2.weight": "time_caption_embed.timestep_embedder.linear_2.weight",
             "t_embedder.mlp.2.bias": "time_caption_embed.timestep_embedder.linear_2.bias",
             "cap_embedder.0.weight": "time_caption_embed.caption_embedder.0.weight",
             "cap_embedder.1.weight": "time_caption_embed.caption_embedder.1.weight",
             "cap_embedder.1.bias": "time_caption_embed.caption_embedder.1.bias",
             "final_layer.linear.weight": "norm_out.linear_2.weight",
             "final_layer.linear.bias": "norm_out.linear_2.bias",
             "final_layer.adaLN_modulation.1.weight": "norm_out.linear_1.weight",
             "final_layer.adaLN_modulation.1.bias": "norm_out.linear_1.bias"}
QKV = ("attn.to_q.weight", "attn.to_k.weight", "attn.to_v.weight")


def _count(keys, prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in keys if k.startswith(prefix)})


def _strip(sd: dict, prefixes) -> dict:
    for p in prefixes:
        if any(k.startswith(p) for k in sd):
            return {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}
    return sd


def linear_map(config) -> dict[str, list[str]]:
    """Upstream's Linear layers (Alpha-VLLM names, which name the LoRA modules) -> the diffusers Linears they
    are (the fused qkv is to_q/to_k/to_v)."""
    out = {}
    for blocks, n in (("layers", config["num_layers"]), ("noise_refiner", config["num_refiner_layers"]),
                      ("context_refiner", config["num_refiner_layers"])):
        for i in range(n):
            p = f"{blocks}.{i}."
            out[p + "attention.qkv"] = [p + q[:-len(".weight")] for q in QKV]
            out[p + "attention.out"] = [p + "attn.to_out.0"]
            for j in (1, 2, 3):
                out[p + f"feed_forward.w{j}"] = [p + f"feed_forward.linear_{j}"]
            if blocks != "context_refiner":
                out[p + "adaLN_modulation.1"] = [p + "norm1.linear"]
    out["final_layer.linear"] = ["norm_out.linear_2"]
    out["final_layer.adaLN_modulation.1"] = ["norm_out.linear_1"]
    out["x_embedder"] = ["x_embedder"]
    out["t_embedder.mlp.0"] = ["time_caption_embed.timestep_embedder.linear_1"]
    out["t_embedder.mlp.2"] = ["time_caption_embed.timestep_embedder.linear_2"]
    out["cap_embedder.1"] = ["time_caption_embed.caption_embedder.1"]
    return out


def _key_plan(keys) -> dict[str, list[str]]:
    """Alpha-VLLM key -> the diffusers keys it is made of (several for the fused qkv)."""
    plan = dict((k, [v]) for k, v in _TOP_KEYS.items())
    for blocks in BLOCK_LISTS:
        for i in range(_count(keys, f"{blocks}.")):
            p = f"{blocks}.{i}."
            plan[p + "attention.qkv.weight"] = [p + q for q in QKV]
            norm1 = "norm1.weight" if blocks == "context_refiner" else "norm1.norm.weight"
            plan[p + "attention_norm1.weight"] = [p + norm1]
            for a, d in _BLOCK_KEYS.items():
                if blocks != "context_refiner" or not a.startswith("adaLN"):
                    plan[p + a] = [p + d]
    return plan


def infer_config(sd: dict, source: str) -> dict:
    """Lumina2Transformer2DModel's config from an Alpha-VLLM state dict (the 2B model and smaller test models)."""
    try:
        dim, patch_in = sd["x_embedder.weight"].shape
        head_dim = sd["layers.0.attention.q_norm.weight"].shape[0]
        qkv_rows = sd["layers.0.attention.qkv.weight"].shape[0]
        ffn = sd["layers.0.feed_forward.w1.weight"].shape[0]
        cap_dim = sd["cap_embedder.0.weight"].shape[0]
    except KeyError as e:
        raise ModelLoadError(f"{source}: not a Lumina 2 (NextDiT) checkpoint: no {e.args[0]}") from e
    heads = dim // head_dim
    in_channels = sd["final_layer.linear.weight"].shape[0] // 4
    default_ffn = ((int(2 * 4 * dim / 3) + 255) // 256) * 256
    cfg = dict(patch_size=2, in_channels=in_channels, hidden_size=dim, num_layers=_count(sd, "layers."),
               num_refiner_layers=_count(sd, "noise_refiner."), num_attention_heads=heads,
               num_kv_heads=(qkv_rows - dim) // 2 // head_dim, multiple_of=256 if ffn == default_ffn else ffn,
               ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0,
               axes_dim_rope=(head_dim // 3,) * 3, axes_lens=(300, 512, 512), cap_feat_dim=cap_dim)
    if patch_in != 4 * in_channels or head_dim % 3 or (ffn != default_ffn and ffn < int(8 * dim / 3)):
        raise ModelLoadError(f"{source}: a NextDiT of a shape this loader does not know (width {dim}, head "
                             f"{head_dim}, feed-forward {ffn})")
    return cfg


def single_file_to_diffusers(sd: dict, config: dict) -> dict:
    sd = dict(sd)
    sd.pop("norm_final.weight", None)  # upstream's NextDiT has an unused norm_final; diffusers has none
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    splits = [config["hidden_size"], config["num_kv_heads"] * head_dim, config["num_kv_heads"] * head_dim]
    out = {}
    for key, parts in _key_plan(sd).items():
        if key not in sd:
            continue
        t = sd.pop(key)
        for part, piece in zip(parts, torch.split(t, splits) if len(parts) == 3 else [t]):
            out[part] = piece
    if sd:
        raise ModelLoadError(f"Lumina 2 checkpoint: unexpected keys {', '.join(sorted(sd)[:8])}")
    return out


def diffusers_to_single_file_entries(dsd: dict, dtype: torch.dtype | None = None, norm_final=None) -> list:
    """The Alpha-VLLM single file as library.saving.TensorEntry items (each made only when written), with
    upstream's unused norm_final (ones, or the loaded file's)."""
    from library.saving import TensorEntry

    entries = []
    plan = _key_plan(dsd)
    plan["norm_final.weight"] = []
    for key, parts in plan.items():
        if not parts:
            dim = dsd["x_embedder.weight"].shape[0]
            t = norm_final if norm_final is not None else torch.ones(dim)
            entries.append(TensorEntry(key, tuple(t.shape), dtype or t.dtype, lambda t=t: t.to("cpu", dtype or t.dtype)))
            continue
        if not all(p in dsd for p in parts):
            continue
        ts = [dsd[p] for p in parts]

        def make(ts=ts):
            t = [x.detach().to("cpu", dtype or x.dtype) for x in ts]
            return t[0] if len(t) == 1 else torch.cat(t, dim=0)

        entries.append(TensorEntry(key, (sum(t.shape[0] for t in ts), *ts[0].shape[1:]), dtype or ts[0].dtype, make))
    return entries


def diffusers_to_single_file(dsd: dict) -> dict:
    return {e.name: e.make() for e in diffusers_to_single_file_entries(dsd)}


def read_safetensors(path: str, what: str) -> dict:
    try:
        return flux_models.read_safetensors(path, what)
    except flux_models.FluxModelError as e:
        raise ModelLoadError(str(e)) from e


def load_transformer(path: str, dtype: torch.dtype = torch.bfloat16, fp8_base: bool = False):
    """Lumina2Transformer2DModel from upstream's single file or a diffusers folder (Lumina2Pipeline or its
    transformer/). Returns (model, norm_final weight or None) — the single file's unused tensor, saved back."""
    from diffusers import Lumina2Transformer2DModel

    path = str(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"--pretrained_model_name_or_path: not found: {path}")
    norm_final = None
    if os.path.isfile(path):
        sd = _strip(read_safetensors(path, "Lumina 2 (--pretrained_model_name_or_path)"), SINGLE_FILE_PREFIXES)
        cfg = infer_config(sd, path)
        norm_final = sd.get("norm_final.weight")
        sd = {k: (v.to(flux_models.FP8_DTYPE) if fp8_base and v.ndim == 2 and k.endswith(".weight") else v.to(dtype))
              for k, v in single_file_to_diffusers(sd, cfg).items()}
        try:
            model = flux_models._load_assign(lambda: Lumina2Transformer2DModel(**cfg), sd, path)
        except flux_models.FluxModelError as e:
            raise ModelLoadError(str(e)) from e
    else:
        folder = path if (Path(path) / "config.json").is_file() else str(Path(path) / "transformer")
        if not (Path(folder) / "config.json").is_file():
            raise ModelLoadError(f"--pretrained_model_name_or_path: {path} is neither a Lumina 2 .safetensors file nor "
                                 "a diffusers folder with transformer/")
        try:
            model = Lumina2Transformer2DModel.from_pretrained(folder, torch_dtype=dtype)
        except Exception as e:  # noqa: BLE001 - another model's folder or a damaged file
            raise ModelLoadError(f"cannot load {path} as a Lumina 2 transformer: {flux_models._first_line(e)}") from e
    model.requires_grad_(False)
    if fp8_base:
        flux_models.apply_fp8_base(model)
    return model, norm_final


def gemma2_config(sd: dict):
    """Upstream's Gemma 2 2B config with the sizes of the state dict (so smaller test encoders load too)."""
    from transformers import Gemma2Config

    hidden = sd["embed_tokens.weight"].shape[1]
    return Gemma2Config(
        vocab_size=sd["embed_tokens.weight"].shape[0], hidden_size=hidden,
        intermediate_size=sd["layers.0.mlp.gate_proj.weight"].shape[0], num_hidden_layers=_count(sd, "layers."),
        num_attention_heads=sd["layers.0.self_attn.q_proj.weight"].shape[0] // GEMMA_HEAD_DIM,
        num_key_value_heads=sd["layers.0.self_attn.k_proj.weight"].shape[0] // GEMMA_HEAD_DIM,
        head_dim=GEMMA_HEAD_DIM, query_pre_attn_scalar=GEMMA_HEAD_DIM, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_theta=10000.0,
        sliding_window=4096, max_position_embeddings=8192, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        attn_implementation="eager")


def load_gemma2(path: str, dtype: torch.dtype = torch.bfloat16):
    """Gemma2Model from a single file (transformers keys, `model.` or Neta-Lumina's prefix fine) or a folder."""
    from transformers import Gemma2Model

    path = str(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"--gemma2: not found: {path}")
    if os.path.isdir(path):
        folder = path if (Path(path) / "config.json").is_file() else str(Path(path) / "text_encoder")
        try:
            return Gemma2Model.from_pretrained(folder, torch_dtype=dtype, attn_implementation="eager").requires_grad_(False)
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"--gemma2: cannot load {path} as Gemma 2: {flux_models._first_line(e)}") from e
    sd = _strip(read_safetensors(path, "Gemma 2 (--gemma2)"), GEMMA_PREFIXES)
    sd.pop("lm_head.weight", None)
    if "embed_tokens.weight" not in sd or "layers.0.mlp.gate_proj.weight" not in sd:
        raise ModelLoadError(f"--gemma2: {path} is not a Gemma 2 checkpoint (no embed_tokens / layers.0.mlp)")
    cfg = gemma2_config(sd)
    sd = {k: v.to(dtype) for k, v in sd.items()}
    try:
        model = flux_models._load_assign(lambda: Gemma2Model(cfg), sd, path)
    except flux_models.FluxModelError as e:
        raise ModelLoadError(str(e)) from e
    return model.requires_grad_(False)


def load_tokenizer(gemma2: str | None, tokenizer_cache_dir: str | None):
    """Gemma's tokenizer (right padding): beside --gemma2 when it is a folder, in --tokenizer_cache_dir (a saved
    tokenizer, or the hub cache upstream keeps there), else the hub ({GEMMA_ID}, a gated repository)."""
    from transformers import AutoTokenizer

    candidates = []
    if gemma2 and os.path.isdir(gemma2):
        candidates += [Path(gemma2), Path(gemma2) / "tokenizer"]
    if tokenizer_cache_dir:
        candidates += [Path(tokenizer_cache_dir), Path(tokenizer_cache_dir) / "gemma2"]
    for c in candidates:
        if (c / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(c))
            break
    else:
        try:
            tok = AutoTokenizer.from_pretrained(GEMMA_ID, cache_dir=tokenizer_cache_dir)
        except Exception as e:  # noqa: BLE001 - offline, or no access to the gated repository
            raise ModelLoadError(f"Gemma 2 tokenizer not found: no tokenizer in --gemma2's folder or "
                                 f"--tokenizer_cache_dir, and {GEMMA_ID} cannot be loaded ({flux_models._first_line(e)})"
                                 ) from e
    tok.padding_side = "right"
    return tok


@dataclass
class LuminaComponents:
    transformer: torch.nn.Module
    gemma2: torch.nn.Module
    ae: torch.nn.Module
    tokenizer: object
    norm_final: torch.Tensor | None = None  # upstream's unused tensor, written back into full saves

    @property
    def denoiser(self):
        return self.transformer

    @property
    def autoencoder(self):
        return self.ae

    @property
    def text_encoders(self) -> list:
        return [self.gemma2]

    @property
    def tokenizers(self) -> list:
        return [self.tokenizer]


def load_lumina_components(pretrained: str, gemma2: str | None, ae: str | None, *, dtype=torch.bfloat16,
                           te_dtype=None, ae_dtype=torch.float32, fp8_base=False,
                           tokenizer_cache_dir: str | None = None) -> LuminaComponents:
    """DiT, Gemma 2, AE, tokenizer. A single-file DiT needs --gemma2 and --ae (a Lumina2Pipeline folder carries
    text_encoder/ and vae/)."""
    folder = pretrained if flux_models.is_diffusers_folder(pretrained) else None
    missing = [flag for flag, v in (("--gemma2", gemma2), ("--ae", ae)) if not v and not folder]
    if missing:
        raise ModelLoadError(f"{', '.join(missing)} required: --pretrained_model_name_or_path {pretrained} is a "
                             "single-file Lumina 2 DiT (only a diffusers Lumina2Pipeline folder carries its own)")
    tok = load_tokenizer(gemma2 or folder, tokenizer_cache_dir)
    transformer, norm_final = load_transformer(pretrained, dtype, fp8_base)
    te = load_gemma2(gemma2 or folder, te_dtype or dtype)
    try:
        vae = flux_models.load_ae(ae or folder, ae_dtype)
    except flux_models.FluxModelError as e:
        raise ModelLoadError(str(e)) from e
    return LuminaComponents(transformer, te, vae, tok, norm_final)


# ----------------------------------------------------------------------------------------------------------------
# tiny random Lumina 2 (tests, GUI demo; nothing downloaded)


def make_gemma_tokenizer(dest: str | Path):
    """A Gemma-style tokenizer (pad 0, eos 1, bos 2, unk 3; <bos> first) over ASCII characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pieces = [("<pad>", 0.0), ("<eos>", 0.0), ("<bos>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += [("\u2581" + c, -2.5) for c in string.ascii_lowercase]
    backend = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                           special_tokens=[("<bos>", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                  unk_token="<unk>", model_max_length=8192, padding_side="right")
    tok.save_pretrained(str(dest))
    return tok


def tiny_transformer(width: int = 48, num_layers: int = 2, num_refiner_layers: int = 1, cap_dim: int = 32,
                     seed: int = 0, dtype=torch.float32):
    """A random Lumina2Transformer2DModel (heads of 24: rope axes 8+8+8; 2 heads, 1 key/value head)."""
    from accelerate import init_empty_weights
    from diffusers import Lumina2Transformer2DModel

    from library.flux_tiny import _randomize

    with init_empty_weights():
        model = Lumina2Transformer2DModel(
            hidden_size=width, num_layers=num_layers, num_refiner_layers=num_refiner_layers,
            num_attention_heads=width // 24, num_kv_heads=1, axes_dim_rope=(8, 8, 8), cap_feat_dim=cap_dim)
    model = model.to(dtype).to_empty(device="cpu")
    return _randomize(model, seed, std=0.5 / width ** 0.5)


def tiny_gemma2(vocab_size: int, hidden: int = 32, seed: int = 2):
    from transformers import Gemma2Model

    cfg = gemma2_config({"embed_tokens.weight": torch.empty(vocab_size, hidden),
                         "layers.0.mlp.gate_proj.weight": torch.empty(2 * hidden, hidden),
                         "layers.0.self_attn.q_proj.weight": torch.empty(2 * GEMMA_HEAD_DIM, hidden),
                         "layers.0.self_attn.k_proj.weight": torch.empty(GEMMA_HEAD_DIM, hidden),
                         "layers.0.x": None, "layers.1.x": None})
    torch.manual_seed(seed)
    return Gemma2Model(cfg).eval()


def make_tiny_lumina(dest: str | Path, *, width: int = 48, num_layers: int = 2, prefix: bool = False,
                     diffusers_folder: bool = False, seed: int = 0) -> dict:
    """A tiny Lumina 2 set under ``dest``: ``lumina.safetensors`` (upstream's single-file layout; ``prefix``
    adds ``model.diffusion_model.``), ``gemma2.safetensors``, ``ae.safetensors`` (FLUX.1's layout) and
    ``tokenizer/`` (the --tokenizer_cache_dir layout); with ``diffusers_folder`` a Lumina2Pipeline folder
    ``diffusers/``. Returns the paths ("transformer", "gemma2", "ae", "tokenizer_cache_dir"[, "diffusers"])."""
    from safetensors.torch import save_file

    from library import flux_tiny

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok = make_gemma_tokenizer(dest / "tokenizer")
    gemma = tiny_gemma2(len(tok), seed=seed + 2)
    save_file({k: v.contiguous() for k, v in gemma.state_dict().items()}, str(dest / "gemma2.safetensors"))
    ae = flux_tiny.tiny_ae(seed + 3)
    save_file({k: v.contiguous() for k, v in flux_models.ae_diffusers_to_bfl(ae.state_dict()).items()},
              str(dest / "ae.safetensors"))
    transformer = tiny_transformer(width, num_layers, cap_dim=gemma.config.hidden_size, seed=seed)
    sd = diffusers_to_single_file(transformer.state_dict())
    save_file({("model.diffusion_model." if prefix else "") + k: v.contiguous() for k, v in sd.items()},
              str(dest / "lumina.safetensors"))
    paths = {"transformer": str(dest / "lumina.safetensors"), "gemma2": str(dest / "gemma2.safetensors"),
             "ae": str(dest / "ae.safetensors"), "tokenizer_cache_dir": str(dest / "tokenizer")}
    if diffusers_folder:
        from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline

        pipe = Lumina2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=ae, text_encoder=gemma,
                               tokenizer=tok, transformer=transformer)
        paths["diffusers"] = str(dest / "diffusers")
        pipe.save_pretrained(paths["diffusers"])
    return paths

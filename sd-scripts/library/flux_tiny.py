"""Tiny, randomly initialised FLUX.1-shaped models, written exactly as users' files are laid out.

Used by the tests and by the GUI's FLUX demo: a FLUX transformer (BFL single file, bf16/fp32 or fp8-e4m3,
dev with guidance or schnell without), CLIP-L (single file), T5 encoder (single file), the 16-channel AE
(BFL ae.safetensors), tokenizers, and the same set as a diffusers FluxPipeline folder. Nothing is downloaded:
the tokenizers are built here from a character vocabulary.
"""
from __future__ import annotations

import string
from pathlib import Path

import torch

from library import flux_models

DEFAULT_WIDTH = 128  # one 128-wide attention head; the real model is 3072 (24 heads)


def make_clip_tokenizer(dest: str | Path):
    """A CLIP BPE tokenizer over printable ASCII characters (one token per character; end-of-word variants)."""
    from transformers import CLIPTokenizer

    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)  # highest id, as in the real CLIP vocabulary
    tok = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    tok.save_pretrained(str(dest))
    return tok


def make_t5_tokenizer(dest: str | Path):
    """A T5-style Unigram tokenizer (pad 0, </s> 1, <unk> 2, sentencepiece word marks) over ASCII."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += [("\u2581" + c, -2.5) for c in string.ascii_lowercase]
    backend = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    tok = T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0,
                          model_max_length=512)
    tok.save_pretrained(str(dest))
    return tok


def _randomize(model: torch.nn.Module, seed: int, std: float = 0.05) -> torch.nn.Module:
    """Small random weights everywhere (diffusers zero-initialises some layers; a test model must not be inert).

    Drawing 500M random numbers for a 3072-wide test model takes tens of seconds on a busy CPU, so parameters
    are tiled from one pool of random values whose prime length keeps rows from repeating in step."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(1_000_003, generator=g) * std
    norm_pool = 1.0 + 0.1 * torch.randn(4099, generator=g)
    offset = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = norm_pool if (p.ndim == 1 and "norm" in name and name.endswith(".weight")) else pool
            flat = p.view(-1)
            n = flat.numel()
            start = 0
            while start < n:
                o = offset % src.numel()
                k = min(n - start, src.numel() - o)
                flat[start: start + k] = src[o: o + k]
                start += k
                offset += k + 7919  # shift the phase for every chunk
    return model


def tiny_transformer(width=DEFAULT_WIDTH, num_double=1, num_single=1, t5_dim=32, clip_dim=64, guidance=True, seed=0,
                     dtype: torch.dtype = torch.float32):
    """A random FluxTransformer2DModel; built on the meta device and filled in place (width 3072 costs no init)."""
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    with init_empty_weights():
        model = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=num_double, num_single_layers=num_single,
        attention_head_dim=flux_models.HEAD_DIM, num_attention_heads=width // flux_models.HEAD_DIM,
        joint_attention_dim=t5_dim, pooled_projection_dim=clip_dim, guidance_embeds=guidance,
        axes_dims_rope=list(flux_models.ROPE_AXES),
    )
    model = model.to(dtype).to_empty(device="cpu")
    return _randomize(model, seed, std=0.5 / width**0.5)


def tiny_clip_l(vocab_size: int, bos: int, eos: int, pad: int, hidden=64, seed=1):
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=max(1, hidden // 64), max_position_embeddings=77, projection_dim=hidden,
                         hidden_act="quick_gelu", bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(seed)
    return CLIPTextModel(cfg).eval()


def tiny_t5(vocab_size: int, d_model=32, seed=2):
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=16, d_ff=2 * d_model, num_layers=2, num_heads=2,
                   feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
    torch.manual_seed(seed)
    return T5EncoderModel(cfg).eval()


def tiny_ae(seed=3):
    """The FLUX AE's shape (16 latent channels, 8x downsampling: four levels) with 32 channels per level."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[32, 32, 32, 32], layers_per_block=1,
        latent_channels=16, norm_num_groups=32, scaling_factor=flux_models.AE_SCALING_FACTOR,
        shift_factor=flux_models.AE_SHIFT_FACTOR, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()


def make_tiny_flux(
    dest: str | Path,
    *,
    width: int = DEFAULT_WIDTH,
    num_double: int = 1,
    num_single: int = 1,
    guidance: bool = True,
    transformer_dtype: torch.dtype = torch.float32,
    clip_prefix: bool = True,
    diffusers_folder: bool = False,
    seed: int = 0,
) -> dict:
    """Write a tiny FLUX.1 set under ``dest`` and return its paths.

    Single files (always): ``flux.safetensors`` (BFL transformer in ``transformer_dtype``, e.g. torch.bfloat16 or
    torch.float8_e4m3fn), ``clip_l.safetensors``, ``t5xxl.safetensors``, ``ae.safetensors`` and the tokenizers in
    ``tokenizers/`` (tokenizer/ + tokenizer_2/, the layout ``--tokenizer_cache_dir`` reads). With
    ``diffusers_folder`` also ``diffusers/``: the same weights as a FluxPipeline folder."""
    from safetensors.torch import save_file

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    clip_tok = make_clip_tokenizer(dest / "tokenizers" / "tokenizer")
    t5_tok = make_t5_tokenizer(dest / "tokenizers" / "tokenizer_2")
    clip = tiny_clip_l(len(clip_tok), clip_tok.bos_token_id, clip_tok.eos_token_id, clip_tok.pad_token_id)
    t5 = tiny_t5(len(t5_tok))
    ae = tiny_ae()
    transformer = tiny_transformer(width, num_double, num_single, t5.config.d_model, clip.config.hidden_size,
                                   guidance, seed)

    paths = {"tokenizer_cache_dir": str(dest / "tokenizers")}
    paths["transformer"] = str(dest / "flux.safetensors")
    bfl = flux_models.diffusers_to_bfl(transformer.state_dict())
    save_file({k: v.to(transformer_dtype).contiguous() for k, v in bfl.items()}, paths["transformer"])
    clip_sd = {("text_model." if clip_prefix else "") + k.removeprefix("text_model."): v
               for k, v in clip.state_dict().items()}
    paths["clip_l"] = str(dest / "clip_l.safetensors")
    save_file({k: v.contiguous() for k, v in clip_sd.items()}, paths["clip_l"])
    paths["t5xxl"] = str(dest / "t5xxl.safetensors")
    t5_sd = {k: v for k, v in t5.state_dict().items() if k != "encoder.embed_tokens.weight"}  # tied to shared
    save_file({k: v.contiguous() for k, v in t5_sd.items()}, paths["t5xxl"])
    paths["ae"] = str(dest / "ae.safetensors")
    save_file({k: v.contiguous() for k, v in flux_models.ae_diffusers_to_bfl(ae.state_dict()).items()}, paths["ae"])

    if diffusers_folder:
        from diffusers import FluxPipeline

        pipe = FluxPipeline(
            scheduler=flow_match_scheduler(), vae=ae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
            tokenizer_2=t5_tok, transformer=transformer,
        )
        paths["diffusers"] = str(dest / "diffusers")
        pipe.save_pretrained(paths["diffusers"])
    return paths


def flow_match_scheduler():
    """FLUX.1-dev's scheduler configuration (resolution-dependent shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )

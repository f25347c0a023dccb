"""Tiny random SD1.x / SD2.x / SDXL models, a small real CLIP tokenizer and captioned image sets, all made locally.

Used by the tests and by the GUI's demo: nothing is downloaded. The models keep the structure that matters
(SDXL: two text encoders, text_time size conditioning, transformer blocks in down/mid/up blocks; real diffusers
and transformers classes; the shipped architecture configs with small sizes), so they load, train, save and
compile through the same code paths as full-size checkpoints, fast on a CPU.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from library import model_util
from library.model_util import SDComponents, load_arch_config

# Sizes of the tiny models (channels are multiples of 32 for the GroupNorm(32) layers).
TINY = {
    "sd1": dict(unet_channels=[32, 64, 64], attn=[True, True, False], depth=[1, 1, 1], te_hidden=[32]),
    "sd2": dict(unet_channels=[32, 64, 64], attn=[True, True, False], depth=[1, 1, 1], te_hidden=[64]),
    "sdxl": dict(unet_channels=[32, 64, 64], attn=[False, True, True], depth=[1, 1, 2], te_hidden=[32, 64]),
}
TINY_VAE_CHANNELS = [32, 64, 64, 64]  # four levels: latents are 1/8 of the image, as in the real VAE
TINY_TE_LAYERS = 2
TINY_TIME_EMBED_DIM = 8  # SDXL addition_time_embed_dim (256 in the real model)

_CORPUS = (
    "a photo of a dog cat person man woman girl boy sks toy bottle car house tree flower sky cloud sun moon "
    "red green blue yellow orange purple pink black white gray brown dark light bright colorful "
    "circle square triangle ellipse rectangle star shape shapes stripe stripes gradient pattern texture "
    "on in with and the of at by over under next to background foreground center left right top bottom "
    "painting drawing sketch portrait landscape style art artwork illustration render rendering digital "
    "high quality detailed simple small large big tiny soft sharp smooth rough highly masterpiece best "
    "standing sitting running looking smiling wearing holding outdoors indoors night day sunset beach "
    "mountain river forest city street room window door table chair book lamp"
)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2/CLIP)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _learn_merges(words: list[str], n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE on a word list (CLIP style: the last symbol of a word carries "</w>")."""
    seqs = Counter(tuple(w[:-1]) + (w[-1] + "</w>",) for w in words if w)
    merges = []
    for _ in range(n_merges):
        pairs = Counter()
        for seq, n in seqs.items():
            for a, b in zip(seq, seq[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        new = Counter()
        for seq, n in seqs.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    out.append(seq[i] + seq[i + 1])
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            new[tuple(out)] += n
        seqs = new
    return merges


def make_tiny_tokenizer(dest_dir, pad_token: str = "<|endoftext|>") -> Path:
    """A small real CLIPTokenizer (byte-level BPE vocab + merges learned here on a caption corpus), max length 77.
    <|endoftext|> has the highest id, as in CLIP (the text encoders pool at the highest id)."""
    from transformers import CLIPTokenizer

    dest_dir = Path(dest_dir)
    if (dest_dir / "vocab.json").is_file() and (dest_dir / "tokenizer.json").is_file():
        return dest_dir
    base = list(_bytes_to_unicode().values())
    vocab_list = base + [c + "</w>" for c in base]
    merges = _learn_merges(_CORPUS.split(), 2000)  # stops when every corpus word is one token
    vocab_list += [a + b for a, b in merges]
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(vocab_list))}
    tok = CLIPTokenizer(vocab=vocab, merges=[tuple(m) for m in merges], pad_token=pad_token, model_max_length=77)
    tmp = dest_dir.with_name(f".{dest_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tok.save_pretrained(str(tmp))
    # also the classic vocab.json + merges.txt pair, for tools that read CLIP tokenizers that way
    (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (tmp / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    dest_dir.parent.mkdir(parents=True, exist_ok=True)
    if dest_dir.exists():
        shutil.rmtree(dest_dir)
    os.replace(tmp, dest_dir)
    return dest_dir


def _tiny_clip(family: str, component: str, hidden: int, vocab_size: int):
    cfg = load_arch_config(family, component)
    cfg.update(hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=TINY_TE_LAYERS,
               num_attention_heads=model_util.clip_num_heads(hidden), vocab_size=vocab_size,
               projection_dim=hidden)
    return model_util._clip_class(cfg)(model_util._clip_config(cfg)).eval()


def build_tiny_components(family: str, tokenizer_dirs: list, seed: int = 0) -> SDComponents:
    """Tiny random components of a family, in memory (tokenizers loaded from ``tokenizer_dirs``)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTokenizer

    model_util._check_family(family)
    t = TINY[family]
    tokenizers = [CLIPTokenizer.from_pretrained(str(d)) for d in tokenizer_dirs]
    torch.manual_seed(seed)
    comps = ["text_encoder", "text_encoder_2"][: len(t["te_hidden"])]
    tes = [_tiny_clip(family, c, h, len(tok)) for c, h, tok in zip(comps, t["te_hidden"], tokenizers)]

    ch = t["unet_channels"]
    ucfg = load_arch_config(family, "unet")
    ucfg.update(
        block_out_channels=ch, layers_per_block=1,
        down_block_types=["CrossAttnDownBlock2D" if a else "DownBlock2D" for a in t["attn"]],
        up_block_types=["CrossAttnUpBlock2D" if a else "UpBlock2D" for a in reversed(t["attn"])],
        attention_head_dim=model_util.unet_attention_head_dim(family, ch),
        cross_attention_dim=sum(t["te_hidden"]),
    )
    if family != "sd1":
        ucfg["transformer_layers_per_block"] = t["depth"]
    if family == "sdxl":
        ucfg["addition_time_embed_dim"] = TINY_TIME_EMBED_DIM
        ucfg["projection_class_embeddings_input_dim"] = tes[1].config.projection_dim + 6 * TINY_TIME_EMBED_DIM
    unet = UNet2DConditionModel.from_config(ucfg).eval()

    vcfg = load_arch_config(family, "vae")
    n = len(TINY_VAE_CHANNELS)
    vcfg.update(block_out_channels=TINY_VAE_CHANNELS, layers_per_block=1,
                down_block_types=["DownEncoderBlock2D"] * n, up_block_types=["UpDecoderBlock2D"] * n)
    vae = AutoencoderKL.from_config(vcfg).eval()
    prediction = "v_prediction" if family == "sd2" else "epsilon"
    return SDComponents(family=family, unet=unet, vae=vae, text_encoders=tes, tokenizers=tokenizers,
                        prediction_type=prediction, source=f"tiny-{family}")


def make_tiny_sd(dest_dir, family: str, layout: str = "single_file", seed: int = 0) -> Path:
    """A tiny random model of ``family`` under ``dest_dir``, plus its tokenizer folder(s) at
    ``dest_dir/tokenizers/{tokenizer,tokenizer_2}`` (pass ``dest_dir/tokenizers`` as --tokenizer_cache_dir).

    layout "single_file": returns ``dest_dir/tiny_<family>.safetensors`` (SGM/LDM keys);
    layout "diffusers": returns the folder ``dest_dir/tiny_<family>_diffusers``.
    The same seed gives the same weights in both layouts. An existing result is returned as it is."""
    if layout not in ("single_file", "diffusers"):
        raise ValueError(f"unknown layout {layout!r}; allowed: single_file, diffusers")
    model_util._check_family(family)
    dest_dir = Path(dest_dir)
    target = dest_dir / (f"tiny_{family}.safetensors" if layout == "single_file" else f"tiny_{family}_diffusers")
    if target.exists():
        return target
    tok_dirs = [make_tiny_tokenizer(dest_dir / "tokenizers" / "tokenizer")]
    if family == "sdxl":
        tok_dirs.append(make_tiny_tokenizer(dest_dir / "tokenizers" / "tokenizer_2", pad_token="!"))
    comps = build_tiny_components(family, tok_dirs, seed)
    if layout == "single_file":
        model_util.save_sd_checkpoint(target, comps, metadata={"modelspec.title": f"tiny random {family}"})
    else:
        model_util.save_sd_diffusers(target, comps)
    return target


_COLORS = {"red": (220, 40, 40), "green": (40, 180, 70), "blue": (40, 80, 220), "yellow": (235, 210, 40),
           "purple": (140, 60, 180), "orange": (240, 140, 30), "white": (245, 245, 245), "black": (20, 20, 20)}
_SHAPES = ("circle", "square", "triangle", "stripes")


def make_captioned_images(dest_dir, n: int = 4, size=(64, 64), repeats: int = 1, name: str = "demo") -> Path:
    """``n`` images with captions in kohya's layout: ``dest_dir/{repeats}_{name}/img_{i}.png`` + ``img_{i}.txt``.

    Each image is a colored shape on a two-color gradient (real structure for a VAE and a UNet to learn);
    the caption says what is drawn. Returns ``dest_dir`` (pass it as --train_data_dir)."""
    from PIL import Image, ImageDraw

    if n < 1 or repeats < 1:
        raise ValueError(f"n and repeats must be at least 1 (got n={n}, repeats={repeats})")
    w, h = size
    sub = Path(dest_dir) / f"{repeats}_{name}"
    sub.mkdir(parents=True, exist_ok=True)
    names = list(_COLORS)
    for i in range(n):
        rng = np.random.default_rng(i)
        c1, c2, fg = (names[j] for j in rng.choice(len(names), 3, replace=False))
        shape = _SHAPES[i % len(_SHAPES)]
        t = np.linspace(0.0, 1.0, h if i % 2 == 0 else w)[:, None]
        grad = (1 - t) * np.array(_COLORS[c1]) + t * np.array(_COLORS[c2])
        img = np.broadcast_to(grad[:, None, :], (h, w, 3)) if i % 2 == 0 else np.broadcast_to(grad[None, :, :], (h, w, 3))
        img = img + rng.normal(0, 6, (h, w, 3))  # a little texture
        im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(im)
        cx, cy = rng.integers(w // 3, 2 * w // 3 + 1), rng.integers(h // 3, 2 * h // 3 + 1)
        r = int(min(w, h) * rng.uniform(0.18, 0.3))
        if shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=_COLORS[fg])
        elif shape == "square":
            draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=_COLORS[fg])
        elif shape == "triangle":
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=_COLORS[fg])
        else:
            for x in range(0, w, max(2, w // 8)):
                draw.rectangle([x, 0, x + max(1, w // 16), h], fill=_COLORS[fg])
        direction = "vertical" if i % 2 == 0 else "horizontal"
        caption = f"a {fg} {shape} on a {c1} to {c2} {direction} gradient background"
        im.save(sub / f"img_{i}.png")
        (sub / f"img_{i}.txt").write_text(caption + "\n", encoding="utf-8")
    return Path(dest_dir)

"""HunyuanImage 2.1 models in upstream's (kohya-ss/sd-scripts hunyuan_image_*.py, Tencent's) file layouts.

- The DiT (`HunyuanImageDiT`): our own module whose parameter names are the checkpoint's
  (`double_blocks.N.img_attn_qkv.weight`, `single_blocks.N.linear1.weight`, `txt_in.individual_token_refiner...`,
  `byt5_in.fc1...`), so upstream's file loads as it is and LoRA names are upstream's module paths. diffusers'
  HunyuanImageTransformer2DModel splits the fused qkv / linear1 layers and does not read this layout.
  The sizes come from the file (upstream's: width 3584, 28 heads, 20 double + 40 single blocks).
- The VAE: diffusers' AutoencoderKLHunyuanImage (32x spatial, 64 latent channels) loaded from upstream's layout
  (`encoder.down.N.block.M`, `encoder.mid.attn_1.q` ...) by renaming its keys.
- Text encoders through transformers: Qwen2.5-VL's language model (`model.*` keys of upstream's single file; the
  vision tower and lm_head are not needed for text) and byT5-small's encoder (`encoder.*` + `shared.weight`).
"""
from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from library.errors import ModelLoadError

logger = logging.getLogger(__name__)

MODEL_VERSION = "hunyuan-image-2.1"  # upstream's MODEL_VERSION_2_1 (ss_base_model_version)
LATENT_SCALING_FACTOR = 0.75289
LATENT_CHANNELS = 64
SPATIAL_COMPRESSION = 32
ROPE_THETA = 256.0
QWEN_ID = "Qwen/Qwen2.5-VL-7B-Instruct"  # upstream's tokenizer source
QWEN_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                 "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                 "<|im_end|>")
QWEN_DROP_TOKENS = 34  # upstream's PROMPT_TEMPLATE_ENCODE_START_IDX: the template's tokens before the prompt
QWEN_MAX_TOKENS = 1024
QWEN_HIDDEN_LAYER = -3  # upstream encodes with the third-last hidden state
BYT5_MAX_TOKENS = 128
BYT5_WIDTH = 1472


# ----------------------------------------------------------------------------------------------------------------
# DiT


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_2d(head_dim: int, h: int, w: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [h*w, head_dim]: half the head for rows, half for columns, pairs interleaved (upstream's layout)."""
    half = head_dim // 2
    freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, half, 2, dtype=torch.float32, device=device)[: half // 2] / half))
    rows = torch.arange(h, dtype=torch.float32, device=device).repeat_interleave(w)
    cols = torch.arange(w, dtype=torch.float32, device=device).repeat(h)
    angles = torch.cat([torch.outer(rows, freqs), torch.outer(cols, freqs)], dim=1).repeat_interleave(2, dim=1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, L, H, D]; rotates each (even, odd) pair."""
    xf = x.float()
    pairs = xf.reshape(*xf.shape[:-1], -1, 2)
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return (xf * cos[None, :, None, :] + rotated * sin[None, :, None, :]).to(x.dtype)


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def attention(q, k, v, key_mask: torch.Tensor | None, split: bool = False) -> torch.Tensor:
    """q, k, v [B, L, H, D]; key_mask [B, L] (True = attend) or None; -> [B, L, H*D]. `split` (--split_attn):
    one sample at a time, trimmed to its valid tokens (the padded queries' rows stay zero)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if split and key_mask is not None:
        out = torch.zeros_like(q)
        for i in range(q.shape[0]):
            n = int(key_mask[i].sum())
            out[i:i + 1, :, :n] = F.scaled_dot_product_attention(q[i:i + 1, :, :n], k[i:i + 1, :, :n],
                                                                 v[i:i + 1, :, :n])
    else:
        mask = None if key_mask is None else key_mask[:, None, None, :].bool()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).flatten(2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: nn.Module):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.act = act
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TimestepEmbedder(nn.Module):
    def __init__(self, width: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t):
        return self.mlp(timestep_embedding(t, self.freq_dim).to(self.mlp[0].weight.dtype))


class ModulateDiT(nn.Module):
    def __init__(self, width: int, factor: int):
        super().__init__()
        self.act = nn.SiLU()
        self.linear = nn.Linear(width, factor * width)

    def forward(self, x):
        return self.linear(self.act(x))


class TextProjection(nn.Module):
    def __init__(self, in_dim: int, width: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, width)
        self.act_1 = nn.SiLU()
        self.linear_2 = nn.Linear(width, width)

    def forward(self, x):
        return self.linear_2(self.act_1(self.linear_1(x)))


class IndividualTokenRefinerBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.self_attn_qkv = nn.Linear(width, 3 * width)
        self.self_attn_proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = MLP(width, int(width * mlp_ratio), nn.SiLU())
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x, c, mask, split):
        gate_msa, gate_mlp = self.adaLN_modulation(c).chunk(2, dim=1)
        q, k, v = self.self_attn_qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).unbind(2)
        x = x + self.self_attn_proj(attention(q, k, v, mask, split)) * gate_msa.unsqueeze(1)
        return x + self.mlp(self.norm2(x)) * gate_mlp.unsqueeze(1)


class IndividualTokenRefiner(nn.Module):
    def __init__(self, width: int, heads: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList([IndividualTokenRefinerBlock(width, heads) for _ in range(depth)])


class SingleTokenRefiner(nn.Module):
    """The text tokens refined with the timestep and the mean of the valid tokens (upstream's txt_in)."""

    def __init__(self, in_dim: int, width: int, heads: int, depth: int):
        super().__init__()
        self.input_embedder = nn.Linear(in_dim, width)
        self.t_embedder = TimestepEmbedder(width)
        self.c_embedder = TextProjection(in_dim, width)
        self.individual_token_refiner = IndividualTokenRefiner(width, heads, depth)

    def forward(self, x, t, mask, split):
        m = mask.to(x.dtype).unsqueeze(-1)
        context = (x * m).sum(1) / m.sum(1).clamp(min=1)
        c = self.t_embedder(t) + self.c_embedder(context)
        x = self.input_embedder(x)
        for block in self.individual_token_refiner.blocks:
            x = block(x, c, mask, split)
        return x


class ByT5Mapper(nn.Module):
    def __init__(self, in_dim: int, hidden: int, out_dim: int, width: int):
        super().__init__()
        self.layernorm = nn.LayerNorm(in_dim)
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, out_dim)
        self.fc3 = nn.Linear(out_dim, width)
        self.act_fn = nn.GELU()

    def forward(self, x):
        return self.fc3(self.act_fn(self.fc2(self.act_fn(self.fc1(self.layernorm(x))))))


class PatchEmbed2D(nn.Module):
    def __init__(self, in_channels: int, width: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, width, kernel_size=1)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class MMDoubleStreamBlock(nn.Module):
    """Image and text streams, each with its own weights, attending jointly (RoPE on the image tokens)."""

    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.heads = heads
        head_dim, hidden = width // heads, int(width * mlp_ratio)
        for s in ("img", "txt"):
            self.add_module(f"{s}_mod", ModulateDiT(width, 6))
            self.add_module(f"{s}_norm1", nn.LayerNorm(width, elementwise_affine=False, eps=1e-6))
            self.add_module(f"{s}_attn_qkv", nn.Linear(width, 3 * width))
            self.add_module(f"{s}_attn_q_norm", RMSNorm(head_dim))
            self.add_module(f"{s}_attn_k_norm", RMSNorm(head_dim))
            self.add_module(f"{s}_attn_proj", nn.Linear(width, width))
            self.add_module(f"{s}_norm2", nn.LayerNorm(width, elementwise_affine=False, eps=1e-6))
            self.add_module(f"{s}_mlp", MLP(width, hidden, nn.GELU(approximate="tanh")))

    def _qkv(self, s: str, x, shift, scale):
        qkv = getattr(self, f"{s}_attn_qkv")(modulate(getattr(self, f"{s}_norm1")(x), shift, scale))
        q, k, v = qkv.unflatten(-1, (3, self.heads, -1)).unbind(2)
        return getattr(self, f"{s}_attn_q_norm")(q).to(v), getattr(self, f"{s}_attn_k_norm")(k).to(v), v

    def forward(self, img, txt, vec, rope, key_mask, split):
        im = self.img_mod(vec).chunk(6, dim=-1)
        tm = self.txt_mod(vec).chunk(6, dim=-1)
        iq, ik, iv = self._qkv("img", img, im[0], im[1])
        iq, ik = apply_rope(iq, *rope), apply_rope(ik, *rope)
        tq, tk, tv = self._qkv("txt", txt, tm[0], tm[1])
        n = img.shape[1]
        attn = attention(torch.cat([iq, tq], 1), torch.cat([ik, tk], 1), torch.cat([iv, tv], 1), key_mask, split)
        img = img + self.img_attn_proj(attn[:, :n]) * im[2].unsqueeze(1)
        img = img + self.img_mlp(modulate(self.img_norm2(img), im[3], im[4])) * im[5].unsqueeze(1)
        txt = txt + self.txt_attn_proj(attn[:, n:]) * tm[2].unsqueeze(1)
        txt = txt + self.txt_mlp(modulate(self.txt_norm2(txt), tm[3], tm[4])) * tm[5].unsqueeze(1)
        return img, txt


class MMSingleStreamBlock(nn.Module):
    """Image + text tokens together: one Linear for q, k, v and the MLP's input, one for the output."""

    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.width, self.heads, self.mlp_hidden = width, heads, int(width * mlp_ratio)
        self.linear1 = nn.Linear(width, 3 * width + self.mlp_hidden)
        self.linear2 = nn.Linear(width + self.mlp_hidden, width)
        self.q_norm = RMSNorm(width // heads)
        self.k_norm = RMSNorm(width // heads)
        self.pre_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = ModulateDiT(width, 3)

    def forward(self, x, vec, rope, key_mask, split, img_len: int):
        shift, scale, gate = self.modulation(vec).chunk(3, dim=-1)
        qkv, mlp = self.linear1(modulate(self.pre_norm(x), shift, scale)).split(
            [3 * self.width, self.mlp_hidden], dim=-1)
        q, k, v = qkv.unflatten(-1, (3, self.heads, -1)).unbind(2)
        q, k = self.q_norm(q).to(v), self.k_norm(k).to(v)
        q = torch.cat([apply_rope(q[:, :img_len], *rope), q[:, img_len:]], 1)
        k = torch.cat([apply_rope(k[:, :img_len], *rope), k[:, img_len:]], 1)
        out = self.linear2(torch.cat([attention(q, k, v, key_mask, split), self.mlp_act(mlp)], dim=2))
        return x + out * gate.unsqueeze(1)


class FinalLayer(nn.Module):
    def __init__(self, width: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(width, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


@dataclass(frozen=True)
class DiTConfig:
    width: int = 3584
    heads: int = 28
    double_blocks: int = 20
    single_blocks: int = 40
    refiner_blocks: int = 2
    in_channels: int = LATENT_CHANNELS
    text_dim: int = 3584
    byt5_dim: int = BYT5_WIDTH
    byt5_hidden: int = 2048
    byt5_out: int = 2048
    mlp_ratio: float = 4.0


class HunyuanImageDiT(nn.Module):
    """HunyuanImage 2.1's transformer: latents [B, 64, h, w] (1x1 patches), Qwen2.5-VL tokens [B, L, 3584] and
    byT5 glyph tokens [B, 128, 1472] with their masks; returns [B, 64, h, w] (upstream's forward)."""

    def __init__(self, config: DiTConfig = DiTConfig()):
        super().__init__()
        c = self.config = config
        self.byt5_in = ByT5Mapper(c.byt5_dim, c.byt5_hidden, c.byt5_out, c.width)
        self.img_in = PatchEmbed2D(c.in_channels, c.width)
        self.txt_in = SingleTokenRefiner(c.text_dim, c.width, c.heads, c.refiner_blocks)
        self.time_in = TimestepEmbedder(c.width)
        self.double_blocks = nn.ModuleList([MMDoubleStreamBlock(c.width, c.heads, c.mlp_ratio)
                                            for _ in range(c.double_blocks)])
        self.single_blocks = nn.ModuleList([MMSingleStreamBlock(c.width, c.heads, c.mlp_ratio)
                                            for _ in range(c.single_blocks)])
        self.final_layer = FinalLayer(c.width, c.in_channels)
        self.split_attn = False
        self.gradient_checkpointing = False

    @property
    def device(self):
        return next(self.parameters()).device

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    _repeated_blocks = ("MMDoubleStreamBlock", "MMSingleStreamBlock")  # regional compile (library.compile)

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None):
        """Each double/single block checkpointed (upstream's); `gradient_checkpointing_func(block, *inputs)` as
        diffusers' models take it (--cpu_offload_checkpointing)."""
        self.gradient_checkpointing = True
        self._checkpoint = gradient_checkpointing_func

    def disable_gradient_checkpointing(self):
        self.gradient_checkpointing = False

    def _run(self, block, *args):
        if self.gradient_checkpointing and self.training:
            if getattr(self, "_checkpoint", None) is not None:
                return self._checkpoint(block, *args)
            return torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=False)
        return block(*args)

    def forward(self, latents, timesteps, text, text_mask, byt5, byt5_mask):
        b, _, h, w = latents.shape
        rope = rope_2d(self.config.width // self.config.heads, h, w, latents.device)
        img = self.img_in(latents)
        vec = self.time_in(timesteps)
        text_mask = text_mask.bool()
        txt = self.txt_in(text, timesteps, text_mask, self.split_attn)
        txt, txt_mask = join_text(self.byt5_in(byt5), byt5_mask.bool(), txt, text_mask)
        key_mask = torch.cat([torch.ones(b, img.shape[1], dtype=torch.bool, device=img.device), txt_mask], 1)
        if bool(txt_mask.all()):  # nothing to mask (one sample, or as long as the longest): SDPA's flash kernel, and
            key_mask = None       # no per-sample token count read inside a compiled block (a graph break)
        for block in self.double_blocks:
            img, txt = self._run(block, img, txt, vec, rope, key_mask, self.split_attn)
        n = img.shape[1]
        x = torch.cat([img, txt], 1)
        for block in self.single_blocks:
            x = self._run(block, x, vec, rope, key_mask, self.split_attn, n)
        out = self.final_layer(x[:, :n], vec)
        return out.reshape(b, h, w, -1).permute(0, 3, 1, 2)


def join_text(byt5, byt5_mask, txt, txt_mask):
    """Upstream's reorder_txt_token: per sample the valid byT5 tokens, then the valid Qwen tokens, then the padding;
    trimmed to the longest valid length in the batch. Returns (tokens, mask)."""
    rows, lens = [], []
    for i in range(txt.shape[0]):
        nb, nt = int(byt5_mask[i].sum()), int(txt_mask[i].sum())
        rows.append(torch.cat([byt5[i, :nb], txt[i, :nt], byt5[i, nb:], txt[i, nt:]]))
        lens.append(nb + nt)
    longest = max(lens)
    # each row trimmed before stacking: one contiguous tensor, the layout the double blocks hand on (a compiled
    # block's guards see strides; a slice of the stacked rows would give the first double block a graph of its own)
    joined = torch.stack([row[:longest] for row in rows])
    mask = torch.arange(joined.shape[1], device=joined.device)[None] < torch.tensor(lens, device=joined.device)[:, None]
    return joined, mask


def infer_dit_config(sd: dict, source: str) -> DiTConfig:
    try:
        width, in_ch = sd["img_in.proj.weight"].shape[:2]
        head_dim = sd["double_blocks.0.img_attn_q_norm.weight"].shape[0]
        return DiTConfig(
            width=width, heads=width // head_dim, double_blocks=_count(sd, "double_blocks."),
            single_blocks=_count(sd, "single_blocks."),
            refiner_blocks=_count(sd, "txt_in.individual_token_refiner.blocks."), in_channels=in_ch,
            text_dim=sd["txt_in.input_embedder.weight"].shape[1], byt5_dim=sd["byt5_in.fc1.weight"].shape[1],
            byt5_hidden=sd["byt5_in.fc1.weight"].shape[0], byt5_out=sd["byt5_in.fc2.weight"].shape[0],
            mlp_ratio=sd["double_blocks.0.img_mlp.fc1.weight"].shape[0] / width)
    except KeyError as e:
        raise ModelLoadError(f"{source} is not a HunyuanImage 2.1 DiT (no {e.args[0]})") from None


def _count(sd: dict, prefix: str) -> int:
    ids = {int(k[len(prefix):].split(".")[0]) for k in sd if k.startswith(prefix)}
    return max(ids) + 1 if ids else 0


def read_safetensors(path: str, what: str, keep=None) -> dict:
    """A safetensors file whatever its suffix (upstream's text encoders are often `.sft`); `keep(key)`: only those."""
    from library.safetensors_io import load_file

    try:
        return load_file(str(path), keep=keep)
    except Exception as e:  # noqa: BLE001 - not safetensors, corrupt or truncated
        raise ModelLoadError(f"{what}: cannot read {path} as a safetensors file: {e}") from e


def _assign(build, sd: dict, path: str):
    from library import flux_models

    try:
        return flux_models._load_assign(build, sd, path)
    except flux_models.FluxModelError as e:
        raise ModelLoadError(str(e)) from e


DIT_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def load_dit(path: str, dtype=torch.bfloat16, fp8_base: bool = False) -> HunyuanImageDiT:
    """Upstream's DiT file (hunyuanimage2.1.safetensors: the layout above; a ComfyUI `model.diffusion_model.`
    prefix is fine)."""
    from library import flux_models

    path = str(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"--pretrained_model_name_or_path: not a file: {path} (HunyuanImage 2.1 DiT .safetensors)")
    sd = read_safetensors(path, "HunyuanImage 2.1 DiT (--pretrained_model_name_or_path)")
    for p in DIT_PREFIXES:
        if any(k.startswith(p) for k in sd):
            sd = {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}
            break
    cfg = infer_dit_config(sd, path)
    sd = {k: (v.to(flux_models.FP8_DTYPE) if fp8_base and v.ndim == 2 and k.endswith(".weight")
              and k.startswith(("double_blocks.", "single_blocks.")) else v.to(dtype)) for k, v in sd.items()}
    model = _assign(lambda: HunyuanImageDiT(cfg), sd, path).requires_grad_(False)
    if fp8_base:  # the double/single blocks' Linear weights (upstream's fp8 targets), upcast per layer
        for block in list(model.double_blocks) + list(model.single_blocks):
            flux_models.apply_fp8_base(block)
    return model


# ----------------------------------------------------------------------------------------------------------------
# VAE: diffusers' AutoencoderKLHunyuanImage from upstream's key layout


def vae_upstream_to_diffusers(sd: dict, layers_per_block: int) -> dict:
    """`encoder.down.{i}.block.{j}` -> `encoder.down_blocks.{flat}` (the downsample after a level's blocks),
    `decoder.up.{i}.block.{j}` -> `decoder.up_blocks.{flat}`, `mid.block_1/attn_1/block_2` -> `mid_block.resnets.0
    /attentions.0/resnets.1`, attention `q/k/v/proj_out` -> `to_q/to_k/to_v/proj`, `nin_shortcut` -> `conv_shortcut`."""
    out = {}
    for key, value in sd.items():
        k = key
        m = re.match(r"(encoder\.down|decoder\.up)\.(\d+)\.(block\.(\d+)|downsample|upsample)\.(.*)", k)
        if m:
            side, i, rest = m.group(1), int(m.group(2)), m.group(5)
            per_level = layers_per_block + (0 if side == "encoder.down" else 1)
            flat = i * (per_level + 1) + (int(m.group(4)) if m.group(4) is not None else per_level)
            k = f"{'encoder.down_blocks' if side == 'encoder.down' else 'decoder.up_blocks'}.{flat}.{rest}"
        k = (k.replace(".mid.block_1.", ".mid_block.resnets.0.").replace(".mid.block_2.", ".mid_block.resnets.1.")
             .replace(".mid.attn_1.", ".mid_block.attentions.0."))
        k = re.sub(r"attentions\.0\.(q|k|v)\.", lambda mm: f"attentions.0.to_{mm.group(1)}.", k)
        k = k.replace("attentions.0.proj_out.", "attentions.0.proj.").replace(".nin_shortcut.", ".conv_shortcut.")
        out[k] = value
    return out


def vae_diffusers_to_upstream(sd: dict, layers_per_block: int) -> dict:
    """The inverse of vae_upstream_to_diffusers (tests write upstream's layout with it)."""
    return dict(zip(_vae_upstream_keys(sd, layers_per_block), sd.values()))


def _vae_upstream_keys(dsd: dict, layers_per_block: int) -> list[str]:
    """The upstream name of each diffusers key, in order."""
    keys = []
    for k in dsd:
        m = re.match(r"(encoder\.down_blocks|decoder\.up_blocks)\.(\d+)\.(.*)", k)
        if m:
            enc = m.group(1) == "encoder.down_blocks"
            per_level = layers_per_block + (0 if enc else 1)
            i, j = divmod(int(m.group(2)), per_level + 1)
            part = f"block.{j}" if j < per_level else ("downsample" if enc else "upsample")
            k = f"{'encoder.down' if enc else 'decoder.up'}.{i}.{part}.{m.group(3)}"
        k = (k.replace(".mid_block.resnets.0.", ".mid.block_1.").replace(".mid_block.resnets.1.", ".mid.block_2.")
             .replace(".mid_block.attentions.0.", ".mid.attn_1."))
        k = re.sub(r"attn_1\.to_(q|k|v)\.", lambda mm: f"attn_1.{mm.group(1)}.", k)
        keys.append(k.replace("attn_1.proj.", "attn_1.proj_out.").replace(".conv_shortcut.", ".nin_shortcut."))
    return keys


def vae_config(sd: dict) -> dict:
    """AutoencoderKLHunyuanImage's config from upstream's VAE keys (upstream's VAE: 128..1024 channels, 2 resnets
    a level, 32x)."""
    levels = _count(sd, "encoder.down.")
    channels = [sd[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] for i in range(levels)]
    return dict(in_channels=sd["encoder.conv_in.weight"].shape[1], out_channels=sd["decoder.conv_out.weight"].shape[0],
                latent_channels=sd["decoder.conv_in.weight"].shape[1], block_out_channels=tuple(channels),
                layers_per_block=_count(sd, "encoder.down.0.block."),
                spatial_compression_ratio=2 ** sum(1 for i in range(levels) if f"encoder.down.{i}.downsample.conv.weight" in sd),
                sample_size=384, scaling_factor=LATENT_SCALING_FACTOR)


def load_vae(path: str, dtype=torch.float16):
    from diffusers import AutoencoderKLHunyuanImage

    path = str(path or "")
    if not os.path.isfile(path):
        raise ModelLoadError(f"--vae: not a file: {path or '(not given)'} (HunyuanImage 2.1 VAE .safetensors)")
    sd = read_safetensors(path, "HunyuanImage 2.1 VAE (--vae)")
    if "encoder.conv_in.weight" not in sd or "encoder.down.0.block.0.conv1.weight" not in sd:
        raise ModelLoadError(f"--vae: {path} is not a HunyuanImage 2.1 VAE in upstream's layout")
    cfg = vae_config(sd)
    dsd = {k: v.to(dtype) for k, v in vae_upstream_to_diffusers(sd, cfg["layers_per_block"]).items()}
    return _assign(lambda: AutoencoderKLHunyuanImage(**cfg), dsd, path).requires_grad_(False).eval()


# ----------------------------------------------------------------------------------------------------------------
# text encoders


def qwen_config(sd: dict):
    """Upstream's Qwen2.5-VL-7B text config with the sizes of the state dict (smaller test encoders load too)."""
    from transformers import Qwen2_5_VLTextConfig

    vocab, hidden = sd["embed_tokens.weight"].shape
    heads_kv_dim = sd["layers.0.self_attn.k_proj.weight"].shape[0]
    head_dim = 128 if hidden % 128 == 0 else 16
    cfg = Qwen2_5_VLTextConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=sd["layers.0.mlp.gate_proj.weight"].shape[0], num_hidden_layers=_count(sd, "layers."),
        num_attention_heads=hidden // head_dim, num_key_value_heads=heads_kv_dim // head_dim, rms_norm_eps=1e-6,
        max_position_embeddings=128000, hidden_act="silu", bos_token_id=151643 if vocab > 151645 else None,
        eos_token_id=151645 if vocab > 151645 else None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": _mrope_section(head_dim)})
    cfg._attn_implementation = "sdpa"
    return cfg


def _mrope_section(head_dim: int) -> list[int]:
    """Upstream's [16, 24, 24] for head 128; the same proportions for a test's smaller heads."""
    half = head_dim // 2
    a = half // 4
    return [a, (half - a) // 2, half - a - (half - a) // 2]


def load_qwen(path: str, dtype=torch.bfloat16):
    """Qwen2.5-VL's language model from upstream's single file (`model.*`; `visual.*` and `lm_head` unused)."""
    from transformers import Qwen2_5_VLTextModel

    path = str(path or "")
    if not os.path.isfile(path):
        raise ModelLoadError(f"--text_encoder: not a file: {path or '(not given)'} (Qwen2.5-VL .safetensors)")
    raw = read_safetensors(path, "Qwen2.5-VL (--text_encoder)",
                           keep=lambda k: k.startswith("model.") and not k.startswith("model.visual."))
    sd = {}
    for k, v in raw.items():
        for p in ("model.language_model.", "model."):
            if k.startswith(p) and not k.startswith("model.visual."):
                sd[k[len(p):]] = v.to(dtype)
                break
    if "embed_tokens.weight" not in sd or "layers.0.mlp.gate_proj.weight" not in sd:
        raise ModelLoadError(f"--text_encoder: {path} is not a Qwen2.5-VL checkpoint (no model.embed_tokens / layers)")
    cfg = qwen_config(sd)
    return _assign(lambda: Qwen2_5_VLTextModel(cfg), sd, path).requires_grad_(False).eval()


def byt5_config(sd: dict):
    from transformers import T5Config

    d_model = sd["shared.weight"].shape[1]
    heads = sd["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].shape[1]
    return T5Config(vocab_size=sd["shared.weight"].shape[0], d_model=d_model,
                    d_kv=sd["encoder.block.0.layer.0.SelfAttention.q.weight"].shape[0] // heads,
                    d_ff=sd["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"].shape[0],
                    num_layers=_count(sd, "encoder.block."), num_heads=heads, feed_forward_proj="gated-gelu",
                    relative_attention_num_buckets=32, layer_norm_epsilon=1e-6, dropout_rate=0.1,
                    is_encoder_decoder=False, use_cache=False, tie_word_embeddings=False)


def load_byt5(path: str, dtype=torch.float16):
    """byT5-small's encoder from upstream's file (`encoder.*` + `shared.weight`; the glyph model's enlarged
    vocabulary is kept as the file has it)."""
    from transformers import T5EncoderModel

    path = str(path or "")
    if not os.path.isfile(path):
        raise ModelLoadError(f"--byt5: not a file: {path or '(not given)'} (byT5 .safetensors)")
    raw = read_safetensors(path, "byT5 (--byt5)")
    sd = {k: v.to(dtype) for k, v in raw.items() if k.startswith(("encoder.", "shared."))}
    if "shared.weight" not in sd or "encoder.block.0.layer.0.SelfAttention.q.weight" not in sd:
        raise ModelLoadError(f"--byt5: {path} is not a byT5 encoder (no shared.weight / encoder.block.0)")
    sd.setdefault("encoder.embed_tokens.weight", sd["shared.weight"])
    cfg = byt5_config(sd)
    return _assign(lambda: T5EncoderModel(cfg), sd, path).requires_grad_(False).eval()


def load_qwen_tokenizer(tokenizer_cache_dir: str | None):
    """Qwen2.5-VL's tokenizer (right padding): a saved tokenizer in --tokenizer_cache_dir (or its `qwen/`), else the
    hub ({QWEN_ID}) cached there, as upstream."""
    from transformers import AutoTokenizer

    for c in ([Path(tokenizer_cache_dir), Path(tokenizer_cache_dir) / "qwen"] if tokenizer_cache_dir else []):
        if (c / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(c))
            break
    else:
        try:
            tok = AutoTokenizer.from_pretrained(QWEN_ID, cache_dir=tokenizer_cache_dir)
        except Exception as e:  # noqa: BLE001 - offline
            from library.flux_models import _first_line

            raise ModelLoadError(f"Qwen2.5-VL tokenizer not found: none saved in --tokenizer_cache_dir and {QWEN_ID} "
                                 f"cannot be loaded ({_first_line(e)})") from e
    tok.padding_side = "right"
    return tok


def byt5_tokenizer():
    """byT5's byte tokenizer (google/byt5-small's: 3 special tokens + 256 bytes + 125 extra ids; it needs no
    files)."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


@dataclass
class HunyuanImageComponents:
    transformer: torch.nn.Module
    qwen: torch.nn.Module
    byt5: torch.nn.Module
    vae: torch.nn.Module
    qwen_tokenizer: object
    byt5_tokenizer: object

    @property
    def denoiser(self):
        return self.transformer

    @property
    def autoencoder(self):
        return self.vae

    @property
    def text_encoders(self) -> list:
        return [self.qwen, self.byt5]

    @property
    def tokenizers(self) -> list:
        return [self.qwen_tokenizer, self.byt5_tokenizer]


def load_components(dit: str, text_encoder: str | None, byt5: str | None, vae: str | None, *, dtype=torch.bfloat16,
                    fp8_base=False, vae_dtype=torch.float16,
                    tokenizer_cache_dir: str | None = None) -> HunyuanImageComponents:
    """Upstream's dtypes: Qwen2.5-VL bf16, byT5 fp16, VAE fp16 (the DiT in the training dtype)."""
    missing = [flag for flag, v in (("--text_encoder", text_encoder), ("--byt5", byt5), ("--vae", vae)) if not v]
    if missing:
        raise ModelLoadError(f"{', '.join(missing)} required: HunyuanImage 2.1 needs the Qwen2.5-VL, byT5 and VAE files")
    tok = load_qwen_tokenizer(tokenizer_cache_dir)
    return HunyuanImageComponents(load_dit(dit, dtype, fp8_base), load_qwen(text_encoder, torch.bfloat16),
                                  load_byt5(byt5, torch.float16), load_vae(vae, vae_dtype), tok, byt5_tokenizer())


# ----------------------------------------------------------------------------------------------------------------
# prompts


def glyph_text(prompt: str) -> str | None:
    """Upstream's byT5 input: the quoted parts of the prompt ("...", ‘...’, “...”) as `Text "x". Text "y". `."""
    found = re.findall(r"\"(.*?)\"", prompt) + re.findall(r"‘(.*?)’", prompt) + re.findall(r"“(.*?)”", prompt)
    return "".join(f'Text "{t}". ' for t in found) if found else None


@torch.no_grad()
def encode_prompts(components, prompts: list[str]) -> dict:
    """{"vlm_embed" [B, L, D], "vlm_mask" [B, L], "byt5_embed" [B, 128, 1472], "byt5_mask" [B, 128], "ocr_mask" [B]}
    as upstream's HunyuanImageTextEncodingStrategy (its cache keys)."""
    qwen, tok = components.qwen, components.qwen_tokenizer
    t = tok([QWEN_TEMPLATE.format(p) for p in prompts], max_length=QWEN_MAX_TOKENS + QWEN_DROP_TOKENS,
            padding=True, truncation=True, return_tensors="pt")
    mask = t.attention_mask.to(qwen.device)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.autocast(qwen.device.type, dtype=torch.bfloat16, enabled=qwen.dtype == torch.bfloat16):
        out = qwen(input_ids=t.input_ids.to(qwen.device), attention_mask=mask, position_ids=positions,
                   output_hidden_states=True)
    vlm = out.hidden_states[QWEN_HIDDEN_LAYER][:, QWEN_DROP_TOKENS:]
    vlm_mask = mask[:, QWEN_DROP_TOKENS:]
    byt5, btok = components.byt5, components.byt5_tokenizer
    embeds, masks, ocr = [], [], []
    for p in prompts:
        glyph = glyph_text(p)
        if glyph is None:
            embeds.append(torch.zeros(1, BYT5_MAX_TOKENS, byt5.config.d_model, device=byt5.device))
            masks.append(torch.zeros(1, BYT5_MAX_TOKENS, dtype=torch.long, device=byt5.device))
            ocr.append(False)
            continue
        b = btok(glyph, padding="max_length", max_length=BYT5_MAX_TOKENS, truncation=True, return_tensors="pt")
        bm = b.attention_mask.to(byt5.device)
        with torch.autocast(byt5.device.type, dtype=byt5.dtype, enabled=byt5.dtype != torch.float32):
            embeds.append(byt5(b.input_ids.to(byt5.device), attention_mask=bm.float())[0].float())
        masks.append(bm)
        ocr.append(True)
    return {"vlm_embed": vlm, "vlm_mask": vlm_mask, "byt5_embed": torch.cat(embeds).float(),
            "byt5_mask": torch.cat(masks), "ocr_mask": torch.tensor(ocr)}


# ----------------------------------------------------------------------------------------------------------------
# tiny random HunyuanImage 2.1 (tests, GUI demo; nothing downloaded)

TINY_WORDS = ("system user Describe the image by detailing color shape size texture quantity text spatial "
              "relationships of objects and background a an red green blue circle square photo demo sign with on "
              "in is picture drawing , . : ! ? \" ' \n").split(" ")


def make_qwen_tokenizer(dest: str | Path):
    """A word-level tokenizer with Qwen's chat tokens that splits upstream's template like Qwen's does (the 34 tokens
    before the prompt; checked by the tests), saved for --tokenizer_cache_dir."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(special + [w for w in TINY_WORDS if w.strip() or w == "\n"]))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"[^\w\n]"), behavior="isolated")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"], padding_side="right")
    tok.save_pretrained(str(dest))
    return tok


def tiny_qwen(vocab_size: int, hidden: int = 32, layers: int = 3, seed: int = 1):
    from transformers import Qwen2_5_VLTextModel

    cfg = qwen_config({"embed_tokens.weight": torch.empty(vocab_size, hidden),
                       "layers.0.mlp.gate_proj.weight": torch.empty(2 * hidden, hidden),
                       "layers.0.self_attn.k_proj.weight": torch.empty(16, hidden),
                       **{f"layers.{i}.x": None for i in range(layers)}})
    torch.manual_seed(seed)
    return Qwen2_5_VLTextModel(cfg).eval()


def tiny_byt5(width: int = 32, seed: int = 2):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(T5Config(vocab_size=384, d_model=width, d_kv=8, d_ff=2 * width, num_layers=2, num_heads=4,
                                   feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)).eval()


def tiny_vae(latent_channels: int = 16, seed: int = 3):
    """AutoencoderKLHunyuanImage with upstream's 32x layout (6 levels, 5 downsamples) at 32 channels a level."""
    from diffusers import AutoencoderKLHunyuanImage

    torch.manual_seed(seed)
    return AutoencoderKLHunyuanImage(in_channels=3, out_channels=3, latent_channels=latent_channels,
                                     block_out_channels=(32,) * 6, layers_per_block=1, spatial_compression_ratio=32,
                                     sample_size=384, scaling_factor=LATENT_SCALING_FACTOR).eval()


def tiny_dit(text_dim: int, byt5_dim: int, latent_channels: int = 16, width: int = 32, seed: int = 0):
    from library.flux_tiny import _randomize

    cfg = DiTConfig(width=width, heads=2, double_blocks=2, single_blocks=2, refiner_blocks=1,
                    in_channels=latent_channels, text_dim=text_dim, byt5_dim=byt5_dim, byt5_hidden=width,
                    byt5_out=width)
    return _randomize(HunyuanImageDiT(cfg), seed, std=0.5 / width ** 0.5)


def make_tiny_hunyuan_image(dest: str | Path, *, prefix: bool = False, seed: int = 0) -> dict:
    """A tiny HunyuanImage 2.1 set under ``dest`` in upstream's file layouts: ``dit.safetensors`` (``prefix`` adds
    ``model.diffusion_model.``), ``qwen.safetensors`` (``model.*`` keys), ``byt5.safetensors`` (``encoder.*`` +
    ``shared.weight``), ``vae.safetensors`` and ``tokenizer/`` (for --tokenizer_cache_dir). Returns the paths
    ("dit", "text_encoder", "byt5", "vae", "tokenizer_cache_dir")."""
    from safetensors.torch import save_file

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok = make_qwen_tokenizer(dest / "tokenizer")
    qwen = tiny_qwen(len(tok), seed=seed + 1)
    save_file({f"model.{k}": v.contiguous() for k, v in qwen.state_dict().items()}, str(dest / "qwen.safetensors"))
    byt5 = tiny_byt5(seed=seed + 2)
    save_file({k: v.contiguous() for k, v in byt5.state_dict().items() if k != "encoder.embed_tokens.weight"},
              str(dest / "byt5.safetensors"))
    vae = tiny_vae(seed=seed + 3)
    save_file({k: v.contiguous() for k, v in vae_diffusers_to_upstream(vae.state_dict(), 1).items()},
              str(dest / "vae.safetensors"))
    dit = tiny_dit(qwen.config.hidden_size, byt5.config.d_model, seed=seed)
    save_file({("model.diffusion_model." if prefix else "") + k: v.contiguous() for k, v in dit.state_dict().items()},
              str(dest / "dit.safetensors"))
    return {"dit": str(dest / "dit.safetensors"), "text_encoder": str(dest / "qwen.safetensors"),
            "byt5": str(dest / "byt5.safetensors"), "vae": str(dest / "vae.safetensors"),
            "tokenizer_cache_dir": str(dest / "tokenizer")}

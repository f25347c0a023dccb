"""Anima models (upstream's anima_train_network.py): the DiT (NVIDIA's Cosmos-Predict2 "MiniTrainDIT" with the
Anima LLM adapter), the Qwen3-0.6B text encoder (transformers' Qwen3Model), the T5 tokenizer whose ids the adapter
embeds, and the Qwen-Image / Wan 2.1 VAE (diffusers' AutoencoderKLQwenImage).

The DiT is our own module laid out as upstream's checkpoint (`net.` prefix fine): diffusers' Cosmos transformer has
other module names and no LLM adapter, and upstream's LoRA keys are the module names of this layout
(`lora_unet_blocks_0_self_attn_q_proj`). The VAE reads diffusers' keys (upstream's "official" layout) and ComfyUI's
Wan layout (diffusers' converter). Tiny random sets for tests and the GUI demo (nothing downloaded)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from library import flux_models
from library.errors import ModelLoadError

SINGLE_FILE_PREFIXES = ("net.", "model.diffusion_model.")  # upstream saves with `net.` (ComfyUI's layout)
QWEN3_PREFIXES = ("model.",)
QWEN3_ID = "Qwen/Qwen3-0.6B"  # upstream's configs/qwen3_06b
T5_TOKENIZER_ID = "google/t5-v1_1-xxl"  # upstream's configs/t5_old
LATENT_CHANNELS = 16
# upstream's fixed DiT settings (anima_utils.load_anima_model); the sizes are read from the file
ROPE_EXTRAPOLATION = (4.0, 4.0, 1.0)  # h, w, t
MAX_LATENT_SIZE = 512  # max_img_h / max_img_w
MAX_FRAMES = 128


class RMSNorm(nn.Module):
    """The DiT's RMSNorm: normalised in float32, cast back, times the weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    """Self- (RoPE on q/k) or cross-attention with RMS-normalised q and k."""

    def __init__(self, dim: int, context_dim: int | None, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.is_self = context_dim is None
        context_dim = context_dim or dim
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim)
        self.k_proj = nn.Linear(context_dim, dim, bias=False)
        self.k_norm = RMSNorm(self.head_dim)
        self.v_proj = nn.Linear(context_dim, dim, bias=False)
        self.output_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, context=None, rope=None):
        context = x if context is None else context
        b = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(b, -1, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(context).view(b, -1, self.heads, self.head_dim))
        v = self.v_proj(context).view(b, -1, self.heads, self.head_dim)
        if self.is_self and rope is not None:  # rope: [L, D] angles
            cos, sin = rope.cos()[None, :, None].to(q.dtype), rope.sin()[None, :, None].to(q.dtype)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        if q.dtype != v.dtype:
            q, k = q.to(v.dtype), k.to(v.dtype)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.output_proj(out.transpose(1, 2).reshape(b, -1, self.heads * self.head_dim))


class GPT2FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.layer1 = nn.Linear(dim, hidden, bias=False)
        self.activation = nn.GELU()
        self.layer2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.layer2(self.activation(self.layer1(x)))


def modulation(dim: int, adaln_lora_dim: int | None, chunks: int) -> nn.Sequential:
    """AdaLN modulation: SiLU, then one Linear, or two through the AdaLN-LoRA bottleneck (upstream's layout)."""
    if adaln_lora_dim:
        return nn.Sequential(nn.SiLU(), nn.Linear(dim, adaln_lora_dim, bias=False),
                             nn.Linear(adaln_lora_dim, chunks * dim, bias=False))
    return nn.Sequential(nn.SiLU(), nn.Linear(dim, chunks * dim, bias=False))


class Block(nn.Module):
    """Self-attention, cross-attention and MLP, each x + gate * f(norm(x) * (1 + scale) + shift)."""

    def __init__(self, dim: int, context_dim: int, heads: int, mlp_ratio: float, adaln_lora_dim: int | None):
        super().__init__()
        self.layer_norm_self_attn = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.self_attn = Attention(dim, None, heads)
        self.layer_norm_cross_attn = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.cross_attn = Attention(dim, context_dim, heads)
        self.layer_norm_mlp = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = GPT2FeedForward(dim, int(dim * mlp_ratio))
        self.adaln_modulation_self_attn = modulation(dim, adaln_lora_dim, 3)
        self.adaln_modulation_cross_attn = modulation(dim, adaln_lora_dim, 3)
        self.adaln_modulation_mlp = modulation(dim, adaln_lora_dim, 3)

    def forward(self, x, emb, context, rope, adaln_lora):
        """x: [B, T, H, W, D]; emb: [B, T, D]; adaln_lora: [B, T, 3D] or None."""
        b, t, h, w, d = x.shape

        def mod(layer):
            m = layer(emb) if adaln_lora is None else layer(emb) + adaln_lora
            return [c[:, :, None, None] for c in m.chunk(3, dim=-1)]

        def sub(x, norm, layer, f):
            shift, scale, gate = mod(layer)
            y = f((norm(x) * (1 + scale) + shift).reshape(b, t * h * w, d))
            return x + gate * y.reshape(b, t, h, w, d)

        x = sub(x, self.layer_norm_self_attn, self.adaln_modulation_self_attn, lambda y: self.self_attn(y, rope=rope))
        x = sub(x, self.layer_norm_cross_attn, self.adaln_modulation_cross_attn,
                lambda y: self.cross_attn(y, context=context))
        return sub(x, self.layer_norm_mlp, self.adaln_modulation_mlp, self.mlp)


class PatchEmbed(nn.Module):
    """(B, C, T, H, W) -> (B, T, H/p, W/p, D); `proj.1` is the Linear, as upstream's Sequential(Rearrange, Linear)."""

    def __init__(self, patch: int, in_channels: int, dim: int):
        super().__init__()
        self.patch = patch
        self.proj = nn.Sequential(nn.Identity(), nn.Linear(in_channels * patch * patch, dim, bias=False))

    def forward(self, x):
        b, c, t, h, w = x.shape
        p = self.patch
        x = x.view(b, c, t, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6)  # b t h w c m n
        return self.proj(x.reshape(b, t, h // p, w // p, c * p * p))


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, adaln_lora: bool):
        super().__init__()
        self.adaln_lora = adaln_lora
        self.linear_1 = nn.Linear(dim, dim, bias=not adaln_lora)
        self.activation = nn.SiLU()
        self.linear_2 = nn.Linear(dim, 3 * dim if adaln_lora else dim, bias=False)

    def forward(self, sample):
        emb = self.linear_2(self.activation(self.linear_1(sample)))
        return (sample, emb) if self.adaln_lora else (emb, None)


class Timesteps(nn.Module):
    """Sinusoidal features [cos, sin] of the timestep (sigma in [0, 1], as upstream feeds it)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, t):  # [B, T]
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angles = t.flatten().float()[:, None] * freqs[None]
        emb = torch.cat([angles.cos(), angles.sin()], dim=-1).to(t.dtype)
        return emb.view(t.shape[0], t.shape[1], self.dim)


class FinalLayer(nn.Module):
    def __init__(self, dim: int, patch: int, out_channels: int, adaln_lora_dim: int | None):
        super().__init__()
        self.dim = dim
        self.layer_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch * patch * out_channels, bias=False)
        self.adaln_modulation = modulation(dim, adaln_lora_dim, 2)

    def forward(self, x, emb, adaln_lora):
        m = self.adaln_modulation(emb)
        if adaln_lora is not None:
            m = m + adaln_lora[:, :, : 2 * self.dim]
        shift, scale = (c[:, :, None, None] for c in m.chunk(2, dim=-1))
        return self.linear(self.layer_norm(x) * (1 + scale) + shift)


def rope_angles(head_dim: int, t: int, h: int, w: int, device, extrapolation=ROPE_EXTRAPOLATION) -> torch.Tensor:
    """Upstream's 3D RoPE (VideoRopePosition3DEmb, no fps modulation): [t*h*w, head_dim] angles, the axes' halves
    (t, h, w) twice."""
    dim_h = head_dim // 6 * 2
    dim_t = head_dim - 2 * dim_h

    def freqs(dim, ratio):
        theta = 10000.0 * ratio ** (dim / (dim - 2))
        return 1.0 / theta ** (torch.arange(0, dim, 2, device=device)[: dim // 2].float() / dim)

    eh = torch.outer(torch.arange(h, device=device).float(), freqs(dim_h, extrapolation[0]))
    ew = torch.outer(torch.arange(w, device=device).float(), freqs(dim_h, extrapolation[1]))
    et = torch.outer(torch.arange(t, device=device).float(), freqs(dim_t, extrapolation[2]))
    parts = [et[:, None, None].expand(t, h, w, -1), eh[None, :, None].expand(t, h, w, -1),
             ew[None, None, :].expand(t, h, w, -1)]
    return torch.cat(parts * 2, dim=-1).reshape(t * h * w, head_dim)


# -- the LLM adapter: Qwen3 hidden states -> the T5-like context the DiT was trained on ---------------------------


class AdapterRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


def adapter_rope(x, positions: int, head_dim: int):
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=x.device).float() / head_dim)
    f = torch.outer(torch.arange(positions, device=x.device).float(), inv)
    emb = torch.cat((f, f), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class AdapterAttention(nn.Module):
    def __init__(self, dim: int, context_dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.q_norm = AdapterRMSNorm(self.head_dim)
        self.k_proj = nn.Linear(context_dim, dim, bias=False)
        self.k_norm = AdapterRMSNorm(self.head_dim)
        self.v_proj = nn.Linear(context_dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask=None, context=None, rope_q=None, rope_k=None):
        context = x if context is None else context
        b = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(b, -1, self.heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(context).view(b, -1, self.heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(context).view(b, -1, self.heads, self.head_dim).transpose(1, 2)
        if rope_q is not None:
            q = q * rope_q[0] + rotate_half(q) * rope_q[1]
            k = k * rope_k[0] + rotate_half(k) * rope_k[1]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, -1, self.heads * self.head_dim))


class LLMAdapterTransformerBlock(nn.Module):
    def __init__(self, source_dim: int, dim: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm_self_attn = AdapterRMSNorm(dim)
        self.self_attn = AdapterAttention(dim, dim, heads)
        self.norm_cross_attn = AdapterRMSNorm(dim)
        self.cross_attn = AdapterAttention(dim, source_dim, heads)
        self.norm_mlp = AdapterRMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, int(dim * mlp_ratio)), nn.GELU(), nn.Linear(int(dim * mlp_ratio), dim))

    def forward(self, x, context, target_mask, source_mask, rope_x, rope_context):
        x = x + self.self_attn(self.norm_self_attn(x), mask=target_mask, rope_q=rope_x, rope_k=rope_x)
        x = x + self.cross_attn(self.norm_cross_attn(x), mask=source_mask, context=context, rope_q=rope_x,
                                rope_k=rope_context)
        return x + self.mlp(self.norm_mlp(x))


class LLMAdapter(nn.Module):
    """T5 token ids (embedded) cross-attend to Qwen3's hidden states; out: [B, L_t5, target_dim]."""

    def __init__(self, source_dim: int, target_dim: int, dim: int, layers: int, heads: int, vocab: int = 32128):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, target_dim)
        self.in_proj = nn.Linear(target_dim, dim) if dim != target_dim else nn.Identity()
        self.blocks = nn.ModuleList([LLMAdapterTransformerBlock(source_dim, dim, heads) for _ in range(layers)])
        self.out_proj = nn.Linear(dim, target_dim)
        self.norm = AdapterRMSNorm(target_dim)

    def forward(self, source, target_ids, target_mask=None, source_mask=None):
        def as_mask(m):
            return None if m is None else m.to(torch.bool)[:, None, None, :]

        x = self.in_proj(self.embed(target_ids))
        head_dim = x.shape[-1] // self.heads
        rope_x = adapter_rope(x, x.shape[1], head_dim)
        rope_c = adapter_rope(x, source.shape[1], head_dim)
        for block in self.blocks:
            x = block(x, source, as_mask(target_mask), as_mask(source_mask), rope_x, rope_c)
        return self.norm(self.out_proj(x))


@dataclass
class AnimaConfig:
    model_channels: int = 2048
    num_blocks: int = 28
    num_heads: int = 16
    in_channels: int = LATENT_CHANNELS
    out_channels: int = LATENT_CHANNELS
    patch_spatial: int = 2
    crossattn_emb_channels: int = 1024
    mlp_ratio: float = 4.0
    adaln_lora_dim: int | None = 256
    adapter_source_dim: int | None = 1024  # None: no LLM adapter
    adapter_target_dim: int = 1024
    adapter_dim: int = 1024
    adapter_layers: int = 6
    adapter_heads: int = 16
    adapter_vocab: int = 32128


class Anima(nn.Module):
    """The Anima DiT in upstream's layout (x_embedder, t_embedder, t_embedding_norm, llm_adapter, blocks,
    final_layer); forward(latents [B, C, 1, H, W], sigmas [B], Qwen3 hidden states, t5 ids, masks)."""

    _repeated_blocks = ("Block",)  # regional compilation (library.compile.regional)

    def __init__(self, config: AnimaConfig):
        super().__init__()
        c = self.config = config
        self.x_embedder = PatchEmbed(c.patch_spatial, c.in_channels + 1, c.model_channels)  # + the padding mask
        self.t_embedder = nn.Sequential(Timesteps(c.model_channels),
                                        TimestepEmbedding(c.model_channels, c.adaln_lora_dim is not None))
        self.t_embedding_norm = RMSNorm(c.model_channels)
        if c.adapter_source_dim is not None:
            self.llm_adapter = LLMAdapter(c.adapter_source_dim, c.adapter_target_dim, c.adapter_dim, c.adapter_layers,
                                          c.adapter_heads, c.adapter_vocab)
        self.blocks = nn.ModuleList([Block(c.model_channels, c.crossattn_emb_channels, c.num_heads, c.mlp_ratio,
                                           c.adaln_lora_dim) for _ in range(c.num_blocks)])
        self.final_layer = FinalLayer(c.model_channels, c.patch_spatial, c.out_channels, c.adaln_lora_dim)
        self.gradient_checkpointing = False
        self._checkpoint = None

    @property
    def dtype(self):
        return self.final_layer.linear.weight.dtype

    def context(self, hidden, attn_mask, t5_ids, t5_mask):
        """Upstream's _preprocess_text_embeds: the adapter's output with T5 padding zeroed."""
        if t5_ids is None or not hasattr(self, "llm_adapter"):
            return hidden
        ctx = self.llm_adapter(hidden, t5_ids, target_mask=t5_mask, source_mask=attn_mask)
        return ctx * t5_mask.to(ctx.dtype)[..., None]

    def forward(self, x, timesteps, hidden, attn_mask=None, t5_ids=None, t5_mask=None):
        c = self.config
        context = self.context(hidden, attn_mask, t5_ids, t5_mask)
        b, _, t, h, w = x.shape
        padding = torch.zeros(b, 1, t, h, w, dtype=x.dtype, device=x.device)
        x = self.x_embedder(torch.cat([x, padding], dim=1))
        _, tt, hh, ww, _ = x.shape
        rope = rope_angles(c.model_channels // c.num_heads, tt, hh, ww, x.device)
        emb, adaln_lora = self.t_embedder(timesteps.reshape(b, 1))
        emb = self.t_embedding_norm(emb)
        for block in self.blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = self._checkpoint(block, x, emb, context, rope, adaln_lora)
            else:
                x = block(x, emb, context, rope, adaln_lora)
        x = self.final_layer(x, emb, adaln_lora)
        p = c.patch_spatial  # unpatchify "B T H W (p1 p2 C) -> B C T (H p1) (W p2)"
        x = x.view(b, tt, hh, ww, p, p, c.out_channels).permute(0, 6, 1, 2, 4, 3, 5)
        return x.reshape(b, c.out_channels, tt, hh * p, ww * p)

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None):
        """Each block checkpointed (diffusers' signature: offload_checkpointing passes its function)."""
        from functools import partial

        self._checkpoint = gradient_checkpointing_func or partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        self.gradient_checkpointing = True


def _count(keys, prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in keys if k.startswith(prefix)})


def _strip(sd: dict, prefixes) -> dict:
    for p in prefixes:
        if any(k.startswith(p) for k in sd):
            return {k[len(p):]: v for k, v in sd.items() if k.startswith(p)}
    return sd


def infer_config(sd: dict, source: str) -> AnimaConfig:
    """The sizes of an upstream-layout state dict (upstream fixes them: 2048 wide, 28 blocks, 16 heads)."""
    try:
        patch_in = sd["x_embedder.proj.1.weight"]
        dim = patch_in.shape[0]
        head_dim = sd["blocks.0.self_attn.q_norm.weight"].shape[0]
        lora2 = sd.get("blocks.0.adaln_modulation_self_attn.2.weight")
        cfg = AnimaConfig(
            model_channels=dim, num_blocks=_count(sd, "blocks."), num_heads=dim // head_dim,
            in_channels=patch_in.shape[1] // 4 - 1, out_channels=sd["final_layer.linear.weight"].shape[0] // 4,
            crossattn_emb_channels=sd["blocks.0.cross_attn.k_proj.weight"].shape[1],
            mlp_ratio=sd["blocks.0.mlp.layer1.weight"].shape[0] / dim,
            adaln_lora_dim=sd["blocks.0.adaln_modulation_self_attn.1.weight"].shape[0] if lora2 is not None else None,
            adapter_source_dim=None)
        if "llm_adapter.embed.weight" in sd:
            vocab, target = sd["llm_adapter.embed.weight"].shape
            adim = sd["llm_adapter.blocks.0.self_attn.q_proj.weight"].shape[0]
            cfg.adapter_source_dim = sd["llm_adapter.blocks.0.cross_attn.k_proj.weight"].shape[1]
            cfg.adapter_target_dim, cfg.adapter_dim, cfg.adapter_vocab = target, adim, vocab
            cfg.adapter_layers = _count(sd, "llm_adapter.blocks.")
            cfg.adapter_heads = adim // sd["llm_adapter.blocks.0.self_attn.q_norm.weight"].shape[0]
    except KeyError as e:
        raise ModelLoadError(f"{source} is not an Anima DiT checkpoint (no {e.args[0]})") from e
    return cfg


BUFFER_KEYS = ("pos_embedder.", "extra_pos_embedder.")  # upstream's RoPE tables (computed here)


def read_safetensors(path: str, what: str) -> dict:
    try:
        return flux_models.read_safetensors(path, what)
    except flux_models.FluxModelError as e:
        raise ModelLoadError(str(e)) from e


def load_dit(path: str, dtype=torch.bfloat16, llm_adapter_path: str | None = None, fp8_base: bool = False) -> Anima:
    """The DiT from upstream's single file (`net.` prefix fine); --llm_adapter_path: the adapter from its own file
    (keys with or without `llm_adapter.`), else the DiT file's."""
    if not os.path.isfile(str(path)):
        raise ModelLoadError(f"--pretrained_model_name_or_path: not an Anima DiT .safetensors file: {path}")
    sd = _strip(read_safetensors(path, "Anima DiT (--pretrained_model_name_or_path)"), SINGLE_FILE_PREFIXES)
    sd = {k: v for k, v in sd.items() if not k.startswith(BUFFER_KEYS)}
    if llm_adapter_path:
        if not os.path.isfile(llm_adapter_path):
            raise ModelLoadError(f"--llm_adapter_path: file not found: {llm_adapter_path}")
        adapter = _strip(read_safetensors(llm_adapter_path, "LLM adapter (--llm_adapter_path)"), SINGLE_FILE_PREFIXES)
        adapter = {k.removeprefix("llm_adapter."): v for k, v in adapter.items()}
        sd = {k: v for k, v in sd.items() if not k.startswith("llm_adapter.")}
        sd.update({"llm_adapter." + k: v for k, v in adapter.items()})
    if "llm_adapter.embed.weight" not in sd:
        raise ModelLoadError(f"{path} has no LLM adapter (llm_adapter.*): pass its file as --llm_adapter_path")
    cfg = infer_config(sd, str(path))

    def cast(k, v):
        if fp8_base and v.ndim == 2 and k.startswith("blocks.") and k.endswith(".weight"):
            return v.to(flux_models.FP8_DTYPE)
        return v.to(dtype)

    sd = {k: cast(k, v) for k, v in sd.items()}
    try:
        model = flux_models._load_assign(lambda: Anima(cfg), sd, str(path))
    except flux_models.FluxModelError as e:
        raise ModelLoadError(str(e)) from e
    model.requires_grad_(False)
    if fp8_base:
        flux_models.apply_fp8_base(model)
    return model


def qwen3_config(sd: dict):
    """Qwen3-0.6B's config with the sizes of the state dict (so smaller test encoders load too)."""
    from transformers import Qwen3Config

    head_dim = sd["layers.0.self_attn.q_norm.weight"].shape[0]
    hidden = sd["embed_tokens.weight"].shape[1]
    return Qwen3Config(
        vocab_size=sd["embed_tokens.weight"].shape[0], hidden_size=hidden,
        intermediate_size=sd["layers.0.mlp.gate_proj.weight"].shape[0], num_hidden_layers=_count(sd, "layers."),
        num_attention_heads=sd["layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
        num_key_value_heads=sd["layers.0.self_attn.k_proj.weight"].shape[0] // head_dim, head_dim=head_dim,
        hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, attention_bias=False, use_cache=False)


def load_qwen3(path: str, dtype=torch.bfloat16):
    """Qwen3Model from a single file (transformers keys, `model.` prefix fine) or a folder (a Qwen3ForCausalLM's
    .model, as upstream)."""
    from transformers import AutoModelForCausalLM, Qwen3Model

    path = str(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"--qwen3: not found: {path}")
    if os.path.isdir(path):
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).model
        except Exception as e:  # noqa: BLE001 - another model's folder or a damaged file
            raise ModelLoadError(f"--qwen3: cannot load {path} as Qwen3: {flux_models._first_line(e)}") from e
        return model.requires_grad_(False)
    sd = _strip(read_safetensors(path, "Qwen3 (--qwen3)"), QWEN3_PREFIXES)
    sd.pop("lm_head.weight", None)
    if "embed_tokens.weight" not in sd or "layers.0.self_attn.q_norm.weight" not in sd:
        raise ModelLoadError(f"--qwen3: {path} is not a Qwen3 checkpoint (no embed_tokens / layers.0.self_attn.q_norm)")
    cfg = qwen3_config(sd)
    sd = {k: v.to(dtype) for k, v in sd.items()}
    try:
        model = flux_models._load_assign(lambda: Qwen3Model(cfg), sd, path)
    except flux_models.FluxModelError as e:
        raise ModelLoadError(str(e)) from e
    return model.requires_grad_(False)


def _tokenizer(flag: str, candidates: list, hub_id: str, tokenizer_cache_dir: str | None, cls_name: str):
    import transformers

    cls = getattr(transformers, cls_name)
    for c in candidates:
        if c is not None and (Path(c) / "tokenizer_config.json").is_file():
            return cls.from_pretrained(str(c), local_files_only=True)
    try:
        return cls.from_pretrained(hub_id, cache_dir=tokenizer_cache_dir)
    except Exception as e:  # noqa: BLE001 - offline, or not on the hub
        raise ModelLoadError(f"{flag}: the tokenizer was not found locally and {hub_id} cannot be loaded "
                             f"({flux_models._first_line(e)}); pass a folder that holds it") from e


def load_qwen3_tokenizer(qwen3: str | None, tokenizer_cache_dir: str | None):
    """Beside --qwen3 when it is a folder, in --tokenizer_cache_dir (or its qwen3/), else the hub ({QWEN3_ID})."""
    base = [Path(qwen3)] if qwen3 and os.path.isdir(qwen3) else []
    cache = [Path(tokenizer_cache_dir), Path(tokenizer_cache_dir) / "qwen3"] if tokenizer_cache_dir else []
    tok = _tokenizer("--qwen3", base + cache, QWEN3_ID, tokenizer_cache_dir, "AutoTokenizer")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_t5_tokenizer(t5_tokenizer_path: str | None, tokenizer_cache_dir: str | None):
    """--t5_tokenizer_path, else --tokenizer_cache_dir's t5/, else the hub ({T5_TOKENIZER_ID})."""
    if t5_tokenizer_path and not os.path.isdir(t5_tokenizer_path):
        raise ModelLoadError(f"--t5_tokenizer_path: not a folder: {t5_tokenizer_path}")
    candidates = [Path(t5_tokenizer_path)] if t5_tokenizer_path else []
    if tokenizer_cache_dir:
        candidates.append(Path(tokenizer_cache_dir) / "t5")
    return _tokenizer("--t5_tokenizer_path", candidates, T5_TOKENIZER_ID, tokenizer_cache_dir, "T5TokenizerFast")


def vae_from_state_dict(sd: dict, dtype=torch.float32):
    """diffusers' AutoencoderKLQwenImage (its default config is upstream's) from diffusers keys or ComfyUI's Wan 2.1
    layout (`conv1`, `encoder.downsamples...`: diffusers' converter)."""
    from diffusers import AutoencoderKLQwenImage

    if "conv1.bias" in sd or "encoder.conv1.weight" in sd:
        from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

        sd = convert_wan_vae_to_diffusers(sd)
    base_dim = sd["encoder.conv_in.weight"].shape[0]
    ups = _count(sd, "decoder.up_blocks.")
    cfg = {}
    if base_dim != 96 or ups != 4:  # a small (test) VAE: its sizes; the real one is diffusers' default
        cfg = dict(base_dim=base_dim, dim_mult=_dim_mult(sd, base_dim), num_res_blocks=_res_blocks(sd),
                   temperal_downsample=[False] * (ups - 1))
    sd = {k: v.to(dtype) for k, v in sd.items()}
    try:
        return flux_models._load_assign(lambda: AutoencoderKLQwenImage(**cfg), sd, "VAE (--vae)").requires_grad_(False)
    except flux_models.FluxModelError as e:
        raise ModelLoadError(str(e)) from e


def _dim_mult(sd: dict, base_dim: int) -> list[int]:
    """Channel multipliers of the decoder's up blocks (highest first), as the encoder's config lists them."""
    ups = _count(sd, "decoder.up_blocks.")
    outs = [sd[f"decoder.up_blocks.{i}.resnets.0.conv2.weight"].shape[0] for i in range(ups)]
    return [o // base_dim for o in reversed(outs)]


def _res_blocks(sd: dict) -> int:
    return _count(sd, "decoder.up_blocks.0.resnets.") - 1


def load_vae(path: str, dtype=torch.float32):
    if not path:
        raise ModelLoadError("--vae is required: the Qwen-Image VAE (qwen_image_vae.safetensors)")
    if not os.path.isfile(path):
        raise ModelLoadError(f"--vae: file not found: {path}")
    return vae_from_state_dict(read_safetensors(path, "VAE (--vae)"), dtype)


def encode_pixels(vae, images: torch.Tensor) -> torch.Tensor:
    """Upstream's encode_pixels_to_latents: images in [-1, 1] -> the posterior's mode, (z - mean) / std; [B, 16, h, w]."""
    cfg = vae.config
    z = vae.encode(images.to(vae.device, vae.dtype)[:, :, None]).latent_dist.mode()
    mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    return ((z - mean) / std)[:, :, 0]


def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Upstream's decode_to_pixels: [B, 16, h, w] -> images in [-1, 1]."""
    cfg = vae.config
    z = latents.to(vae.device, vae.dtype)[:, :, None]
    mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
    return vae.decode(z * std + mean).sample[:, :, 0].clamp(-1, 1)


@dataclass
class AnimaComponents:
    transformer: torch.nn.Module
    qwen3: torch.nn.Module
    vae: torch.nn.Module
    qwen3_tokenizer: object
    t5_tokenizer: object

    @property
    def denoiser(self):
        return self.transformer

    @property
    def autoencoder(self):
        return self.vae

    @property
    def text_encoders(self) -> list:
        return [self.qwen3]

    @property
    def tokenizers(self) -> list:
        return [self.qwen3_tokenizer, self.t5_tokenizer]


def load_anima_components(pretrained: str, qwen3: str | None, vae: str | None, *, llm_adapter_path=None,
                          t5_tokenizer_path=None, dtype=torch.bfloat16, te_dtype=None, vae_dtype=torch.float32,
                          fp8_base=False, tokenizer_cache_dir: str | None = None) -> AnimaComponents:
    if not qwen3:
        raise ModelLoadError("--qwen3 is required: the Qwen3-0.6B text encoder (a .safetensors file or a folder)")
    qwen3_tok = load_qwen3_tokenizer(qwen3, tokenizer_cache_dir)
    t5_tok = load_t5_tokenizer(t5_tokenizer_path, tokenizer_cache_dir)
    ae = load_vae(vae, vae_dtype)
    dit = load_dit(pretrained, dtype, llm_adapter_path, fp8_base)
    te = load_qwen3(qwen3, te_dtype or dtype)
    return AnimaComponents(dit, te, ae, qwen3_tok, t5_tok)


def save_dit(path: str, state_dict: dict, metadata: dict | None, dtype=None) -> None:
    """Upstream's layout: `net.` + the DiT's keys, metadata format=pt (as the official file)."""
    sd = {"net." + k: (v.detach().to("cpu", dtype) if dtype else v.detach().cpu()).contiguous()
          for k, v in state_dict.items()}
    flux_models.save_safetensors_atomic(sd, path, {**(metadata or {}), "format": "pt"})


# ----------------------------------------------------------------------------------------------------------------
# tiny random Anima (tests, GUI demo; nothing downloaded)


def make_qwen3_tokenizer(dest: str | Path):
    """A byte-level BPE tokenizer with Qwen's special tokens (<|endoftext|> pads), over ASCII characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", eos_token="<|endoftext|>",
                                  model_max_length=131072, padding_side="right")
    tok.save_pretrained(str(dest))
    return tok


def tiny_qwen3(vocab_size: int, hidden: int = 32, seed: int = 2):
    from transformers import Qwen3Model

    cfg = qwen3_config({"embed_tokens.weight": torch.empty(vocab_size, hidden),
                        "layers.0.self_attn.q_norm.weight": torch.empty(16),
                        "layers.0.mlp.gate_proj.weight": torch.empty(2 * hidden, hidden),
                        "layers.0.self_attn.q_proj.weight": torch.empty(32, hidden),
                        "layers.0.self_attn.k_proj.weight": torch.empty(16, hidden),
                        "layers.0.x": None, "layers.1.x": None})
    torch.manual_seed(seed)
    return Qwen3Model(cfg).eval()


def tiny_vae(seed: int = 3):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage(base_dim=8, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                  temperal_downsample=[False, False, False]).eval()


def tiny_dit(width: int = 64, blocks: int = 2, heads: int = 2, qwen_dim: int = 32, adapter_dim: int = 32,
             vocab: int = 256, seed: int = 0) -> Anima:
    from library.flux_tiny import _randomize

    cfg = AnimaConfig(model_channels=width, num_blocks=blocks, num_heads=heads, crossattn_emb_channels=adapter_dim,
                      adaln_lora_dim=16, adapter_source_dim=qwen_dim, adapter_target_dim=adapter_dim,
                      adapter_dim=adapter_dim, adapter_layers=1, adapter_heads=2, adapter_vocab=vocab)
    return _randomize(Anima(cfg), seed, std=0.5 / width ** 0.5)


def make_tiny_anima(dest: str | Path, *, width: int = 64, blocks: int = 2, seed: int = 0) -> dict:
    """A tiny Anima set under ``dest``: ``anima.safetensors`` (upstream's layout, `net.` prefix), ``qwen3/`` (a
    Qwen3ForCausalLM folder with its tokenizer) and ``qwen3.safetensors`` (the single file), ``vae.safetensors``
    (diffusers keys) and ``tokenizers/`` (``qwen3/`` and ``t5/``: the --tokenizer_cache_dir layout). Returns the
    paths."""
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    from library.flux_tiny import make_t5_tokenizer

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    qtok = make_qwen3_tokenizer(dest / "qwen3")
    qtok.save_pretrained(str(dest / "tokenizers" / "qwen3"))
    t5tok = make_t5_tokenizer(dest / "tokenizers" / "t5")
    qwen = tiny_qwen3(len(qtok), seed=seed + 2)
    save_file({k: v.contiguous() for k, v in qwen.state_dict().items()}, str(dest / "qwen3.safetensors"))
    lm = Qwen3ForCausalLM(qwen.config)
    lm.model = qwen
    lm.lm_head.weight = qwen.embed_tokens.weight  # tied, as Qwen3-0.6B
    lm.save_pretrained(str(dest / "qwen3"))
    save_file({k: v.contiguous() for k, v in tiny_vae(seed + 3).state_dict().items()}, str(dest / "vae.safetensors"))
    dit = tiny_dit(width, blocks, qwen_dim=qwen.config.hidden_size, vocab=len(t5tok), seed=seed)
    save_dit(str(dest / "anima.safetensors"), dit.state_dict(), None)
    return {"dit": str(dest / "anima.safetensors"), "qwen3": str(dest / "qwen3.safetensors"),
            "qwen3_folder": str(dest / "qwen3"), "vae": str(dest / "vae.safetensors"),
            "tokenizer_cache_dir": str(dest / "tokenizers"), "t5_tokenizer": str(dest / "tokenizers" / "t5")}

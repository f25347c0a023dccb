"""HunyuanImage 2.1 (upstream's hunyuan_image_train_network.py): flow matching on the 32x VAE's 64-channel latents
(scaled by 0.75289), Qwen2.5-VL (third-last hidden state, upstream's chat template) + byT5 glyph conditioning (the
quoted text of the caption), the MM-DiT of library.hunyuan_image_models, bucket multiple 32; samples with upstream's
Euler steps and its CFG that turns into adaptive projected guidance after the first steps. The text encoders are
never trained (as upstream)."""
from __future__ import annotations

import logging
import os

import torch

from library import flux_train_utils, hunyuan_image_models as models, latent_cache, offload_checkpointing, te_cache
from library.families import dit_family
from library.objectives import flow_matching

logger = logging.getLogger(__name__)

TIMESTEP_SAMPLING = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")  # upstream's choices
ATTN_MODES = ("torch", "xformers", "flash", "sageattn", "sdpa")
ATTN_PACKAGES = {"xformers": "xformers", "flash": "flash_attn"}
LATENT_FORMAT = latent_cache.LatentCacheFormat("_hi.npz", models.LATENT_SCALING_FACTOR, multi_resolution=True,
                                               legacy_name=False, stride=models.SPATIAL_COMPRESSION)
TE_KEYS = ("vlm_embed", "vlm_mask", "byt5_embed", "byt5_mask", "ocr_mask")
SAMPLE_DEFAULTS = {"sample_steps": 20, "scale": 3.5}  # upstream's sampler defaults (--s, --l)


def add_hunyuan_image_arguments(parser) -> None:
    """Upstream's hunyuan_image_train_network.py options (with its defaults) plus the DiT memory options."""
    from library import dit_options

    g = parser.add_argument_group("HunyuanImage 2.1")
    g.add_argument("--text_encoder", type=str, default=None, help="Qwen2.5-VL 7B (.safetensors, bfloat16)")
    g.add_argument("--byt5", type=str, default=None, help="byT5 glyph encoder (.safetensors, float16)")
    flow_matching.add_timestep_arguments(g, sampling_default="sigma", discrete_flow_shift=5.0,
                                         model_prediction_type="raw", sampling_choices=TIMESTEP_SAMPLING)
    g.add_argument("--fp8_scaled", action="store_true",
                   help="fp8 weights for the DiT's blocks (here: fp8 storage computed in the training dtype)")
    g.add_argument("--fp8_vl", action="store_true", help="fp8 weights for Qwen2.5-VL (computed in bfloat16)")
    g.add_argument("--text_encoder_cpu", action="store_true", help="run the text encoders on the CPU")
    g.add_argument("--vae_chunk_size", type=int, default=None,
                   help="VAE in tiles to save memory (upstream: chunked convolutions; 16 is its suggestion)")
    g.add_argument("--attn_mode", type=str, default=None, choices=ATTN_MODES,
                   help="attention: torch (default; sdpa is the same), xformers, flash (need their packages), "
                        "sageattn (inference only: refused for training)")
    g.add_argument("--split_attn", action="store_true",
                   help="attention one sample at a time over its own tokens (less memory)")
    dit_options.add_memory_arguments(g)


def check_hunyuan_image_args(args, error_cls) -> None:
    if not getattr(args, "network_train_unet_only", True):
        raise error_cls("--network_train_unet_only is required: HunyuanImage 2.1 trains no text-encoder LoRA "
                        "(Qwen2.5-VL and byT5 stay frozen, as upstream's guide says)")
    if args.blocks_to_swap is not None and args.blocks_to_swap < 0:
        raise error_cls(f"--blocks_to_swap must be 0 or more, got {args.blocks_to_swap}")
    if args.vae_chunk_size is not None and args.vae_chunk_size < 1:
        raise error_cls(f"--vae_chunk_size must be 1 or more, got {args.vae_chunk_size}")
    if args.attn_mode == "sageattn":
        raise error_cls("--attn_mode sageattn: Sage Attention does not support training (upstream: inference "
                        "only); allowed for training: torch, sdpa, xformers, flash")
    package = ATTN_PACKAGES.get(args.attn_mode or "")
    if package:
        try:
            __import__(package)
        except ImportError as e:
            raise error_cls(f"--attn_mode {args.attn_mode} needs the {package} package, which is not installed; "
                            "use --attn_mode torch") from e
    flow_matching.check_args(args, error_cls)
    offload_checkpointing.check_args(args, error_cls)
    dit_family.check_resolution_multiple(args, error_cls, 32, "HunyuanImage 2.1")


def upstream_blocks_to_swap(n: int) -> int:
    """Upstream swaps n // 2 double blocks and 2 * (n - n // 2) single blocks; here as many blocks are swapped,
    counted from the end of the execution order."""
    return n // 2 + 2 * (n - n // 2)


class HunyuanImage:
    label = "HunyuanImage 2.1"

    def __init__(self):
        dit_family.init(self, 32)

    def name(self, args) -> str:
        return "hunyuan_image"

    def check_args(self, args) -> None:
        dit_family.check_args(args, check_hunyuan_image_args, self.label, "networks.lora_hunyuan_image")
        if args.mixed_precision == "fp16":
            logger.warning("mixed_precision bf16 is recommended for HunyuanImage 2.1 (as upstream)")
        if args.fp8_base or getattr(args, "fp8_base_unet", False):
            logger.info("--fp8_base: the DiT's blocks in fp8 (upstream asks for --fp8_scaled; both do that here)")

    def load(self, args, weight_dtype, fp8_denoiser: bool):
        c = models.load_components(args.pretrained_model_name_or_path, args.text_encoder, args.byt5, args.vae,
                                   dtype=weight_dtype, fp8_base=fp8_denoiser or args.fp8_scaled,
                                   vae_dtype=torch.float32 if args.no_half_vae else torch.float16,
                                   tokenizer_cache_dir=args.tokenizer_cache_dir)
        c.transformer.split_attn = bool(args.split_attn)
        if args.vae_chunk_size:
            c.vae.enable_tiling()
        if args.fp8_vl:
            from library import precision

            precision.apply_fp8_to_components([False, True], None, [c.qwen])
        cfg = c.transformer.config
        logger.info("HunyuanImage 2.1: %d double + %d single blocks, width %d; Qwen2.5-VL width %d, byT5 width %d",
                    cfg.double_blocks, cfg.single_blocks, cfg.width, c.qwen.config.hidden_size, c.byt5.config.d_model)
        return c

    def lora_text_encoders(self, components) -> list:
        return []  # upstream trains neither Qwen2.5-VL nor byT5

    def encode_images(self, args, components, images, generator):
        vae = components.vae
        with torch.no_grad(), torch.autocast(vae.device.type, dtype=vae.dtype, enabled=vae.dtype != torch.float32):
            lat = vae.encode(images.to(vae.device, vae.dtype)).latent_dist.sample(generator=generator)
        return lat.float() * models.LATENT_SCALING_FACTOR

    def encode_prompts(self, args, components, captions, with_grad=False, **_) -> dict:
        device = "cpu" if args.text_encoder_cpu else None
        if device is not None:
            for te in components.text_encoders:
                te.to(device)
        return models.encode_prompts(components, list(captions))

    def prediction_type(self, args, components) -> str:
        return "epsilon"  # flow matching

    def predict(self, args, components, noisy_latents, timesteps, te_outputs, batch, weight_dtype):
        return dit_forward(components.transformer, noisy_latents, timesteps, te_outputs, weight_dtype)

    def enable_gradient_checkpointing(self, args, components, text_encoders: list) -> None:
        from library.families import sd

        sd.enable_gradient_checkpointing(args, components.denoiser, [])

    def place_denoiser(self, args, components, device, weight_dtype, fp8: bool) -> None:
        t = components.transformer
        n = upstream_blocks_to_swap(args.blocks_to_swap) if args.blocks_to_swap else 0
        dit_family.place_denoiser(self, components, device, weight_dtype, fp8 or args.fp8_scaled, n,
                                  list(t.double_blocks) + list(t.single_blocks))

    def apply_fp8(self, args, components, fp8_targets) -> None:
        pass  # the loader stored the DiT's block weights in fp8 (--fp8_base / --fp8_scaled); the encoders stay

    def set_attention_backend(self, args, components) -> None:
        pass  # PyTorch's SDPA (it picks its flash / memory-efficient kernels itself)

    def compile(self, args, components) -> None:
        from library.families import flux

        # the text is trimmed to each batch's longest caption (hunyuan_image_models.join_text)
        self.compiled_blocks = flux.compile_denoiser(args, components, self.label, text_length_varies=True)

    def sample(self, args, components, accelerator, *, epoch, steps, networks, prediction_type) -> None:
        sample_images(args, components, device=accelerator.device, epoch=epoch, steps=steps,
                      autocast=accelerator.autocast, networks=networks)

    def base_model_version(self, args) -> str:
        return models.MODEL_VERSION

    def metadata(self, args, fp8_targets) -> dict[str, str]:
        return dit_family.metadata(self, args, {"ss_fp8_base": str(bool(fp8_targets[0] or args.fp8_scaled))})

    def modelspec_variant(self) -> str | None:
        return None

    def latent_cache_format(self, args, components) -> latent_cache.LatentCacheFormat:
        return LATENT_FORMAT  # upstream's <stem>_<w>x<h>_hi.npz, the unscaled VAE sample

    def te_cache_format(self, args, components) -> te_cache.TeCacheFormat:
        return TE_FORMAT

    def cache_signature(self, args, what: str) -> str:
        if what == "te":
            return (f"hunyuan_image:te:{os.path.basename(str(args.text_encoder or ''))}:"
                    f"{os.path.basename(str(args.byt5 or ''))}")
        return f"hunyuan_image:{what}:{os.path.basename(str(args.vae or ''))}"

    def full_output_format(self, args) -> tuple[str, str]:
        return "single", ".safetensors"

    def save_full_model(self, args, components, path: str, metadata, save_dtype) -> None:
        from library.errors import ConfigError

        raise ConfigError("HunyuanImage 2.1 has no full fine-tune script upstream; train a LoRA")


def _te_to_file(o: dict) -> dict:
    return {k: te_cache._numpy(o[k]) for k in TE_KEYS}


def _te_from_file(a: dict) -> dict:
    return {k: torch.from_numpy(a[k]) for k in TE_KEYS}


# upstream's <stem>_hi_te.npz (keys vlm_embed, vlm_mask, byt5_embed, byt5_mask, ocr_mask; one caption each)
TE_FORMAT = te_cache.TeCacheFormat("_hi_te.npz", TE_KEYS, _te_to_file, _te_from_file)


def dit_forward(transformer, noisy: torch.Tensor, sigmas: torch.Tensor, te: dict, dtype) -> torch.Tensor:
    """The DiT at noise level sigma: upstream's integer timesteps floor(sigma * 1000)."""
    timesteps = (sigmas * 1000).to(torch.int64)
    dev = noisy.device
    return transformer(noisy.to(dtype), timesteps, te["vlm_embed"].to(dev, dtype), te["vlm_mask"].to(dev),
                       te["byt5_embed"].to(dev, dtype), te["byt5_mask"].to(dev))


class ProjectedGuidance:
    """Upstream's AdaptiveProjectedGuidance as its sampler sets it up: scale 10, momentum -0.5, the guidance vector's
    norm limited to 10, only its part orthogonal to the conditional prediction kept (eta 0)."""

    def __init__(self, scale: float = 10.0, momentum: float = -0.5, norm_threshold: float = 10.0):
        self.scale, self.momentum, self.norm_threshold = scale, momentum, norm_threshold
        self.running = 0

    def __call__(self, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        self.running = (cond - uncond) + self.momentum * self.running
        diff = self.running
        dims = list(range(1, diff.ndim))
        norm = diff.norm(p=2, dim=dims, keepdim=True)
        diff = diff * torch.minimum(torch.ones_like(norm), self.norm_threshold / norm)
        unit = torch.nn.functional.normalize(cond.double(), dim=dims)
        parallel = (diff.double() * unit).sum(dim=dims, keepdim=True) * unit
        return uncond + self.scale * (diff - parallel.type_as(diff))


def guided(step: int, cond, uncond, scale: float, ocr: bool, guider: ProjectedGuidance):
    """Upstream's apply_classifier_free_guidance: plain CFG up to step 5 (38 for a prompt with quoted text), then
    the projected guidance; the guider follows every step."""
    apg = guider(cond, uncond)
    return uncond + scale * (cond - uncond) if step <= (38 if ocr else 5) else apg


@torch.no_grad()
def denoise(transformer, latents, cond: dict, uncond: dict | None, *, steps: int, scale: float, shift: float,
            dtype=torch.float32) -> torch.Tensor:
    """Upstream's sampler: sigmas 1 -> 0 in `steps` Euler steps, shifted by the flow shift."""
    sigmas = torch.linspace(1, 0, steps + 1)
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    guider = ProjectedGuidance()
    ocr = bool(cond["ocr_mask"].any())
    for i in range(steps):
        t = (sigmas[i] * 1000).expand(latents.shape[0]).to(latents.device)
        pred = transformer(latents.to(dtype), t.to(torch.int64), cond["vlm_embed"].to(latents.device, dtype),
                           cond["vlm_mask"].to(latents.device), cond["byt5_embed"].to(latents.device, dtype),
                           cond["byt5_mask"].to(latents.device)).float()
        if uncond is not None:
            un = transformer(latents.to(dtype), t.to(torch.int64), uncond["vlm_embed"].to(latents.device, dtype),
                             uncond["vlm_mask"].to(latents.device), uncond["byt5_embed"].to(latents.device, dtype),
                             uncond["byt5_mask"].to(latents.device)).float()
            pred = guided(i, pred, un, scale, ocr, guider)
        latents = latents.float() - (sigmas[i] - sigmas[i + 1]) * pred
    return latents


def sample_images(args, components, *, device, epoch, steps, autocast=None, networks=()) -> list[str]:
    """HunyuanImage samples: kohya prompt lines (--n, --w, --h, --s steps (default 20), --l CFG scale (default 3.5;
    1 = no negative pass), --d, --fs flow shift (default 5.0)); sizes rounded down to multiples of 16."""
    from PIL import Image

    def draw(_, p, generator):
        dev = torch.device(device)
        cond = models.encode_prompts(components, [p["prompt"]])
        scale = p.get("scale", 3.5)
        uncond = models.encode_prompts(components, [p.get("negative_prompt") or ""]) if scale != 1.0 else None
        h = max(64, p.get("height", 512) - p.get("height", 512) % 16) // models.SPATIAL_COMPRESSION
        w = max(64, p.get("width", 512) - p.get("width", 512) % 16) // models.SPATIAL_COMPRESSION
        t = components.transformer
        noise = torch.randn(1, t.config.in_channels, h, w, generator=generator).to(dev)
        dtype = t.dtype if t.dtype not in (torch.float8_e4m3fn,) else torch.bfloat16
        latents = denoise(t, noise, cond, uncond, steps=p.get("sample_steps", 20), scale=scale,
                          shift=p.get("flow_shift") or 5.0, dtype=dtype)
        vae = components.vae
        image = vae.decode((latents / models.LATENT_SCALING_FACTOR).to(vae.dtype)).sample.clamp(-1, 1)
        array = ((image[0].permute(1, 2, 0).float().cpu() + 1) * 127.5).round().to(torch.uint8).numpy()
        return Image.fromarray(array)

    return flux_train_utils.sample_with_pipeline(args, dit_family.NoPipeline,
                                                 (components.vae, components.qwen, components.byt5), draw,
                                                 device=device, epoch=epoch, steps=steps, autocast=autocast,
                                                 networks=networks, prompt_defaults=SAMPLE_DEFAULTS)

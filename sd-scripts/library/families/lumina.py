"""Lumina Image 2.0 (upstream's lumina_train_network.py / lumina_train.py): flow matching on FLUX.1's AE latents,
Gemma 2 conditioning (the second-to-last hidden state, upstream's system prompt + `<Prompt Start>`), the NextDiT
transformer (diffusers' Lumina2Transformer2DModel, library.lumina_models), bucket multiple 16, samples with
upstream's CFG truncation and renormalisation. The DiT's time runs the other way (t = 1 - sigma, it predicts
latents - noise); predict() turns its output into our objective's convention so every loss equals upstream's."""
from __future__ import annotations

import logging

import torch

from library import dit_options, flux_train_utils, latent_cache, lumina_models, offload_checkpointing, te_cache
from library.families import dit_family, flux
from library.objectives import flow_matching

logger = logging.getLogger(__name__)

TIMESTEP_SAMPLING = ("sigma", "uniform", "sigmoid", "shift", "nextdit_shift", "flux_shift")  # upstream's order
PROMPT_START = "<Prompt Start>"
DEFAULT_TOKENS = 256
LATENT_FORMAT = latent_cache.LatentCacheFormat("_lumina.npz", 1.0, multi_resolution=True, legacy_name=False)


def add_lumina_arguments(parser) -> None:
    """Upstream's add_lumina_train_arguments (with its defaults) plus --blocks_to_swap / --ae from the DiT options."""
    g = parser.add_argument_group("Lumina 2")
    g.add_argument("--gemma2", type=str, default=None,
                   help="Gemma 2 2B text encoder (.safetensors, or a folder); not needed for a diffusers folder")
    dit_options.add_ae_argument(g)
    g.add_argument("--gemma2_max_token_length", type=int, default=None, help="Gemma 2 tokens (default 256)")
    flow_matching.add_timestep_arguments(g, sampling_default="shift", discrete_flow_shift=6.0,
                                         model_prediction_type="raw", sampling_choices=TIMESTEP_SAMPLING)
    g.add_argument("--use_flash_attn", action="store_true",
                   help="FlashAttention (needs the flash-attn package; PyTorch's SDPA runs its flash kernel)")
    g.add_argument("--use_sage_attn", action="store_true",
                   help="Sage Attention: inference only upstream; training here keeps PyTorch's SDPA")
    g.add_argument("--system_prompt", type=str, default="",
                   help="system prompt put before every caption (and sample prompt) with ' <Prompt Start> '")
    g.add_argument("--sample_batch_size", type=int, default=None,
                   help="accepted as upstream (batch of sample prompts); samples are drawn one prompt at a time")
    dit_options.add_memory_arguments(g)


def check_lumina_args(args, error_cls) -> None:
    if args.gemma2_max_token_length is not None and args.gemma2_max_token_length < 1:
        raise error_cls(f"--gemma2_max_token_length must be 1 or more, got {args.gemma2_max_token_length}")
    if args.blocks_to_swap is not None and args.blocks_to_swap < 0:
        raise error_cls(f"--blocks_to_swap must be 0 or more, got {args.blocks_to_swap}")
    if args.use_flash_attn:
        try:
            import flash_attn  # noqa: F401
        except ImportError as e:
            raise error_cls("--use_flash_attn needs the flash-attn package (pip install flash-attn), which is not "
                            "installed; leave it off to use PyTorch's scaled-dot-product attention") from e
        logger.info("--use_flash_attn: attention runs through PyTorch's SDPA, which uses FlashAttention kernels")
    if args.use_sage_attn:
        logger.warning("--use_sage_attn is ignored for training (upstream: Sage Attention supports inference only)")
    flow_matching.check_args(args, error_cls)
    offload_checkpointing.check_args(args, error_cls)
    dit_family.check_resolution_multiple(args, error_cls, 16, "Lumina 2")


class Lumina:
    label = "Lumina 2"

    def __init__(self):
        dit_family.init(self, 16)
        self.max_length = DEFAULT_TOKENS

    def name(self, args) -> str:
        return "lumina"

    def check_args(self, args) -> None:
        dit_family.check_args(args, check_lumina_args, self.label, "networks.lora_lumina")
        self.max_length = args.gemma2_max_token_length or DEFAULT_TOKENS

    def load(self, args, weight_dtype, fp8_denoiser: bool):
        c = lumina_models.load_lumina_components(
            args.pretrained_model_name_or_path, args.gemma2, args.ae, dtype=weight_dtype, te_dtype=weight_dtype,
            ae_dtype=torch.float32 if args.no_half_vae else weight_dtype, fp8_base=fp8_denoiser,
            tokenizer_cache_dir=args.tokenizer_cache_dir)
        cfg = c.transformer.config
        logger.info("Lumina 2: %d layers + %d refiner layers, width %d; Gemma 2 width %d", cfg.num_layers,
                    cfg.num_refiner_layers, cfg.hidden_size, c.gemma2.config.hidden_size)
        return c

    def lora_text_encoders(self, components) -> list:
        return [components.gemma2]

    def encode_images(self, args, components, images, generator):
        return flux_train_utils.encode_latents(components.ae, images, generator)

    def encode_prompts(self, args, components, captions, with_grad=False, **_) -> dict:
        """{"hidden_state": [B, L, D] (Gemma 2's second-to-last layer), "attention_mask", "input_ids"} (upstream's
        cache keys); L = --gemma2_max_token_length rounded up to a multiple of 8, right padding."""
        return encode_prompts(components, [with_system_prompt(args, c) for c in captions], self.max_length, with_grad)

    def prediction_type(self, args, components) -> str:
        return "epsilon"  # flow matching (modelspec says epsilon for Lumina, as upstream)

    def predict(self, args, components, noisy_latents, timesteps, te_outputs, batch, weight_dtype):
        out = dit_forward(components.transformer, noisy_latents, timesteps, te_outputs, weight_dtype)
        return upstream_convention(args, out.float(), noisy_latents.float(), timesteps)

    def enable_gradient_checkpointing(self, args, components, text_encoders: list) -> None:
        flux.enable_gradient_checkpointing(args, components, text_encoders)

    def place_denoiser(self, args, components, device, weight_dtype, fp8: bool) -> None:
        dit_family.place_denoiser(self, components, device, weight_dtype, fp8, args.blocks_to_swap or 0,
                                  list(components.transformer.layers))

    def apply_fp8(self, args, components, fp8_targets) -> None:
        flux.apply_fp8(components, fp8_targets)

    def set_attention_backend(self, args, components) -> None:
        flux.set_attention_backend(args, components)

    def compile(self, args, components) -> None:
        # the layers' tokens: the image's and each batch's longest caption's
        self.compiled_blocks = flux.compile_denoiser(args, components, self.label, text_length_varies=True)

    def sample(self, args, components, accelerator, *, epoch, steps, networks, prediction_type) -> None:
        sample_images(args, components, self.max_length, device=accelerator.device, epoch=epoch, steps=steps,
                      autocast=accelerator.autocast, networks=networks)

    def base_model_version(self, args) -> str:
        return "lumina2"  # upstream's MODEL_VERSION_LUMINA_V2

    def metadata(self, args, fp8_targets) -> dict[str, str]:
        return dit_family.metadata(self, args, {"ss_system_prompt": args.system_prompt,
                                                "ss_gemma2_max_token_length": str(self.max_length),
                                                "ss_fp8_base": str(fp8_targets[0])})

    def modelspec_variant(self) -> str | None:
        return None

    def latent_cache_format(self, args, components) -> latent_cache.LatentCacheFormat:
        return LATENT_FORMAT  # upstream's <stem>_<w>x<h>_lumina.npz, the AE output shifted and scaled

    def te_cache_format(self, args, components) -> te_cache.TeCacheFormat:
        return TE_FORMAT

    def cache_signature(self, args, what: str) -> str:
        import os

        if what == "te":
            return f"lumina:te:{os.path.basename(str(args.gemma2 or ''))}:{self.max_length}:{args.system_prompt}"
        return f"lumina:{what}:{os.path.basename(str(args.ae or args.pretrained_model_name_or_path))}"

    def full_output_format(self, args) -> tuple[str, str]:
        return "single", ".safetensors"  # upstream's layout, whatever --save_model_as says (as upstream)

    def save_full_model(self, args, components, path: str, metadata, save_dtype) -> None:
        from library import saving

        sd = dit_family.trained_state_dict(self, components)
        saving.save_safetensors_streaming(
            path, lumina_models.diffusers_to_single_file_entries(sd, save_dtype, components.norm_final), metadata,
            overwrite=args.overwrite_output)


def _te_to_file(o: dict) -> dict:
    return {k: te_cache._numpy(o[k]) for k in ("hidden_state", "attention_mask", "input_ids")}


def _te_from_file(a: dict) -> dict:
    return {k: torch.from_numpy(a[k]) for k in ("hidden_state", "attention_mask", "input_ids")}


TE_FORMAT = te_cache.TeCacheFormat("_lumina_te.npz", ("hidden_state", "attention_mask", "input_ids"), _te_to_file,
                                   _te_from_file)


def with_system_prompt(args, caption: str) -> str:
    """Upstream: `<system prompt> <Prompt Start> <caption>` when --system_prompt is set (not for negatives)."""
    return f"{args.system_prompt} {PROMPT_START} {caption}" if args.system_prompt else caption


def encode_prompts(components, texts: list[str], max_length: int, with_grad: bool = False) -> dict:
    gemma, tok = components.gemma2, components.tokenizer
    with torch.set_grad_enabled(with_grad):
        t = tok(texts, max_length=max_length, padding="max_length", truncation=True, pad_to_multiple_of=8,
                return_tensors="pt")
        mask = t.attention_mask.to(gemma.device)
        out = gemma(input_ids=t.input_ids.to(gemma.device), attention_mask=mask, output_hidden_states=True)
    return {"hidden_state": out.hidden_states[-2], "attention_mask": mask, "input_ids": t.input_ids}


def dit_forward(transformer, noisy: torch.Tensor, sigmas: torch.Tensor, te: dict, dtype) -> torch.Tensor:
    """The NextDiT on latents [B, 16, h, w] at noise level sigma (its time is 1 - sigma); its raw output."""
    hidden = te["hidden_state"].to(noisy.device, dtype)
    mask = te["attention_mask"].to(noisy.device).bool()
    return transformer(hidden_states=noisy.to(dtype), timestep=(1 - sigmas).to(dtype), encoder_hidden_states=hidden,
                       encoder_attention_mask=mask, return_dict=False)[0]


def upstream_convention(args, out: torch.Tensor, noisy: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """Upstream trains the DiT's output o towards latents - noise after its --model_prediction_type step m(o);
    our objective compares m(p) with noise - latents. p is chosen so that m(p) = -m_upstream(o): the same loss."""
    if args.model_prediction_type == "additive":
        return -out - 2 * noisy
    if args.model_prediction_type == "sigma_scaled":
        return -out + 2 * noisy / sigmas.view(-1, 1, 1, 1)
    return -out


def guided(cond: torch.Tensor, uncond: torch.Tensor, scale: float, renorm: float) -> torch.Tensor:
    """Upstream's CFG with renormalisation: a guided prediction whose norm exceeds renorm * the conditional one's is
    scaled down to it (renorm <= 0: no limit)."""
    pred = uncond + scale * (cond - uncond)
    if renorm > 0:
        dims = tuple(range(1, cond.ndim))
        limit = torch.linalg.vector_norm(cond, dim=dims, keepdim=True) * renorm
        norm = torch.linalg.vector_norm(pred, dim=dims, keepdim=True)
        pred = torch.where(norm >= limit, pred * (limit / norm), pred)
    return pred


@torch.no_grad()
def denoise(transformer, latents, cond: dict, uncond: dict, *, steps: int, scale: float, cfg_trunc_ratio: float,
            renorm_cfg: float, shift: float = 6.0, dtype=torch.float32) -> torch.Tensor:
    """Upstream's sampler: Euler on FlowMatchEulerDiscreteScheduler(shift=6); the unconditional pass only while
    the DiT's time (1 - sigma) is below --ctr (cfg_trunc_ratio)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    scheduler.set_timesteps(steps, device=latents.device)
    for t in scheduler.timesteps:
        sigma = (t / 1000).expand(latents.shape[0]).to(latents.device)
        pred = dit_forward(transformer, latents, sigma, cond, dtype).float()
        if 1 - float(sigma[0]) < cfg_trunc_ratio:
            pred = guided(pred, dit_forward(transformer, latents, sigma, uncond, dtype).float(), scale, renorm_cfg)
        latents = scheduler.step(-pred, t, latents, return_dict=False)[0]
    return latents


def sample_images(args, components, max_length: int, *, device, epoch, steps, autocast=None, networks=()) -> list[str]:
    """Lumina samples: kohya prompt lines (--n, --w, --h, --s, --l CFG scale, --d, --ctr cfg_trunc_ratio, --rcfg
    renorm_cfg as upstream); the system prompt goes before the prompt, not the negative one."""
    from PIL import Image

    def draw(_, p, generator):
        dev = torch.device(device)
        cond = encode_prompts(components, [with_system_prompt(args, p["prompt"])], max_length)
        uncond = encode_prompts(components, [p.get("negative_prompt") or ""], max_length)
        h, w = p.get("height", 512) // 8, p.get("width", 512) // 8
        noise = torch.randn(1, 16, h, w, generator=generator).to(dev)
        dtype = next(components.transformer.parameters()).dtype
        if dtype == torch.float8_e4m3fn:
            dtype = torch.bfloat16
        latents = denoise(components.transformer, noise, cond, uncond, steps=p.get("sample_steps", 30),
                          scale=p.get("scale", 3.5), cfg_trunc_ratio=p.get("cfg_trunc_ratio", 0.25),
                          renorm_cfg=p.get("renorm_cfg", 1.0), dtype=dtype)
        ae = components.ae
        from library import flux_models

        z = latents / flux_models.AE_SCALING_FACTOR + flux_models.AE_SHIFT_FACTOR
        image = ae.decode(z.to(ae.dtype)).sample.clamp(-1, 1)
        array = ((image[0].permute(1, 2, 0).float().cpu() + 1) * 127.5).round().to(torch.uint8).numpy()
        return Image.fromarray(array)

    return flux_train_utils.sample_with_pipeline(args, dit_family.NoPipeline, (components.ae, components.gemma2), draw,
                                                 device=device, epoch=epoch, steps=steps, autocast=autocast,
                                                 networks=networks)


# lumina_train.py (full fine-tune of the DiT; Gemma 2 and the AE stay frozen, as upstream)


def check_full_args(args, target) -> None:
    from library import optimizers
    from library.errors import ConfigError

    if args.train_text_encoder:
        raise ConfigError("--train_text_encoder: lumina_train.py trains the DiT only (Gemma 2 stays frozen, as "
                          "upstream); train a Gemma 2 LoRA with lumina_train_network.py instead")
    if args.blocks_to_swap:
        raise ConfigError("--blocks_to_swap: lumina_train.py does not swap blocks here yet; use it with "
                          "lumina_train_network.py, or leave it unset")
    if args.save_model_as not in (None, "safetensors"):
        logger.warning("--save_model_as %s: lumina_train.py writes a .safetensors single file (as upstream)",
                       args.save_model_as)
    if flux_train_utils.blockwise_fused(args) and optimizers.is_schedulefree(args):
        raise ConfigError("--blockwise_fused_optimizers cannot be used with a schedule-free optimizer "
                          f"({optimizers.optimizer_type(args)}), as upstream")
    if args.fused_optimizer_groups:
        logger.warning("--fused_optimizer_groups has no effect in lumina_train.py (upstream: \"this option is not "
                       "working\"); use --blockwise_fused_optimizers")


def blockwise_optimizer_groups(args, components) -> list[list[dict]]:
    """--blockwise_fused_optimizers: one optimizer per main layer, one for both refiners, one for the rest
    (upstream's grouping)."""
    groups: dict[tuple[str, int], list] = {}
    for name, p in components.transformer.named_parameters():
        if not p.requires_grad:
            continue
        head = name.split(".")[0]
        key = (("main", int(name.split(".")[1])) if head == "layers" else
               ("refiner", -1) if head in ("noise_refiner", "context_refiner") else ("other", -1))
        groups.setdefault(key, []).append(p)
    return [[{"params": params, "lr": args.learning_rate}] for params in groups.values()]

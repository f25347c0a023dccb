"""FLUX.1 training pieces shared by flux_train_network.py (LoRA) and flux_train.py (full fine-tune).

Flow matching: noisy = (1 - sigma) * latents + sigma * noise, the transformer predicts the velocity
noise - latents (the target for every --model_prediction_type, as in sd-scripts). Latents are the AE's
(mean - 0.1159) * 0.3611, packed 2x2 into tokens of 64 channels; text conditioning is T5-XXL's hidden states
plus CLIP-L's pooled output; dev models also get the guidance scale.
"""
from __future__ import annotations

import logging
import math
import os

import torch

from library import flux_models

logger = logging.getLogger(__name__)

TIMESTEP_SAMPLING = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
MODEL_TYPES = ("flux", "chroma")  # upstream's --model_type choices; chroma is refused (check_flux_args)
MODEL_PREDICTION_TYPES = ("raw", "additive", "sigma_scaled")
# SD3-paper weighting schemes (upstream's choices): logit_normal / mode change which sigmas --timestep_sampling
# sigma draws; sigma_sqrt / cosmap weight the loss (with --model_prediction_type sigma_scaled); none / uniform: neither
WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform")


def add_flux_arguments(parser) -> None:
    g = parser.add_argument_group("FLUX.1")
    g.add_argument("--clip_l", type=str, default=None, help="CLIP-L text encoder (.safetensors); not needed for a diffusers folder")
    g.add_argument("--t5xxl", type=str, default=None, help="T5-XXL encoder (.safetensors); not needed for a diffusers folder")
    g.add_argument("--ae", type=str, default=None, help="FLUX autoencoder ae.safetensors; not needed for a diffusers folder")
    g.add_argument("--t5xxl_max_token_length", type=int, default=None,
                   help="T5-XXL tokens (default 512 for dev, 256 for schnell)")
    g.add_argument("--apply_t5_attn_mask", action="store_true", help="mask T5 padding in the encoder and zero its outputs")
    g.add_argument("--guidance_scale", type=float, default=3.5, help="guidance embedded into FLUX.1-dev while training")
    g.add_argument("--timestep_sampling", type=str, default="sigma", choices=TIMESTEP_SAMPLING,
                   help="how sigmas are drawn: sigma (uniform over the shifted schedule), uniform, sigmoid "
                        "(sigmoid of a normal), shift (sigmoid + --discrete_flow_shift), flux_shift (resolution-dependent shift)")
    g.add_argument("--sigmoid_scale", type=float, default=1.0, help="scale of the normal in sigmoid/shift/flux_shift sampling")
    g.add_argument("--discrete_flow_shift", type=float, default=3.0, help="shift of the flow schedule (sigma, shift)")
    g.add_argument("--weighting_scheme", type=str, default="uniform", choices=WEIGHTING_SCHEMES,
                   help="SD3 weighting: logit_normal / mode shape the sigmas drawn by --timestep_sampling sigma; "
                        "sigma_sqrt / cosmap weight the loss (with --model_prediction_type sigma_scaled)")
    g.add_argument("--logit_mean", type=float, default=0.0, help="mean of the logit_normal weighting scheme")
    g.add_argument("--logit_std", type=float, default=1.0, help="standard deviation of the logit_normal scheme")
    g.add_argument("--mode_scale", type=float, default=1.29, help="scale of the mode weighting scheme")
    g.add_argument("--model_prediction_type", type=str, default="sigma_scaled", choices=MODEL_PREDICTION_TYPES,
                   help="raw: the output as it is; additive: output + noisy input; sigma_scaled: -sigma * output + noisy input")
    g.add_argument("--blocks_to_swap", type=int, default=None,
                   help="transformer blocks kept off the GPU and swapped in around their forward/backward (saves "
                        "memory; default none)")
    g.add_argument("--text_encoder_batch_size", type=int, default=None,
                   help="batch size for caching text encoder outputs (default: the training batch size)")
    g.add_argument("--model_type", type=str, default="flux", choices=MODEL_TYPES,
                   help="flux (FLUX.1 dev/schnell); chroma is not supported here")
    g.add_argument("--controlnet_model_name_or_path", type=str, default=None,
                   help="ignored, as in upstream's LoRA and fine-tune scripts (only its ControlNet trainer reads it)")


def check_flux_args(args, error_cls) -> None:
    if args.model_type == "chroma":
        raise error_cls("--model_type chroma: Chroma (FLUX.1-schnell derivative without CLIP-L, with its own "
                        "modulation network) is not supported by these trainers; allowed here: flux")
    if args.controlnet_model_name_or_path:
        logger.warning("--controlnet_model_name_or_path is ignored: upstream reads it only in its FLUX ControlNet "
                       "trainer (flux_train_control_net.py), which this project does not have")
    if args.blocks_to_swap is not None and args.blocks_to_swap < 0:
        raise error_cls(f"--blocks_to_swap must be 0 or more, got {args.blocks_to_swap}")
    if args.t5xxl_max_token_length is not None and not 1 <= args.t5xxl_max_token_length <= 512:
        raise error_cls(f"--t5xxl_max_token_length must be between 1 and 512, got {args.t5xxl_max_token_length}")
    if args.sigmoid_scale <= 0:
        raise error_cls(f"--sigmoid_scale must be positive, got {args.sigmoid_scale}")
    if getattr(args, "logit_std", 1.0) <= 0:
        raise error_cls(f"--logit_std must be positive, got {args.logit_std}")
    if args.discrete_flow_shift <= 0:
        raise error_cls(f"--discrete_flow_shift must be positive, got {args.discrete_flow_shift}")
    if args.fp8_base and not hasattr(torch, "float8_e4m3fn"):
        raise error_cls("--fp8_base needs torch >= 2.1 (float8_e4m3fn)")
    res = getattr(args, "resolution", None)
    if isinstance(res, str):
        for v in res.replace("x", ",").split(","):
            if v.strip().isdigit() and int(v) % 16:
                raise error_cls(f"--resolution {res}: FLUX needs sides that are multiples of 16")


def t5_max_length(args, components) -> int:
    if args.t5xxl_max_token_length:
        return args.t5xxl_max_token_length
    return 256 if components.is_schnell else 512


# ---------------------------------------------------------------------------------------------------------------
# conditioning


def encode_prompts(clip, t5, clip_tok, t5_tok, captions: list[str], t5_len: int, apply_t5_mask: bool) -> dict:
    """{"t5_out": [B, L, D], "pooled": [B, 768], "t5_attn_mask": [B, L]} (what is cached, too)."""
    dev_c, dev_t = clip.device, t5.device
    ids = clip_tok(captions, padding="max_length", max_length=clip_tok.model_max_length if clip_tok.model_max_length
                   < 1000 else 77, truncation=True, return_tensors="pt").input_ids.to(dev_c)
    pooled = clip(ids, output_hidden_states=False).pooler_output
    t = t5_tok(captions, padding="max_length", max_length=t5_len, truncation=True, return_tensors="pt")
    mask = t.attention_mask.to(dev_t)
    out = t5(t.input_ids.to(dev_t), attention_mask=mask if apply_t5_mask else None).last_hidden_state
    if apply_t5_mask:
        out = out * mask.unsqueeze(-1).to(out.dtype)
    return {"t5_out": out, "pooled": pooled, "t5_attn_mask": mask}


def encode_latents(ae, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        lat = ae.encode(images.to(ae.device, ae.dtype)).latent_dist.sample()
    return (lat - flux_models.AE_SHIFT_FACTOR) * flux_models.AE_SCALING_FACTOR


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, C*4] (2x2 patches, the order FLUX and diffusers use)."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, d = x.shape
    c = d // 4
    x = x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """Rope positions of the packed latent tokens: (0, row, column)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device, dtype)


# ---------------------------------------------------------------------------------------------------------------
# noise


def _time_shift(mu: float, sigma: float, t: torch.Tensor) -> torch.Tensor:
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


def _flux_mu(image_seq_len: int, x1=256, y1=0.5, x2=4096, y2=1.15) -> float:
    m = (y2 - y1) / (x2 - x1)
    return m * image_seq_len + (y1 - m * x1)


def timestep_density(args, batch_size: int, device) -> torch.Tensor:
    """u in [0, 1) per sample by --weighting_scheme (SD3 paper, sec. 3.1): logit_normal = sigmoid(N(logit_mean,
    logit_std)); mode = 1 - u - mode_scale * (cos^2(pi u / 2) - 1 + u) of a uniform u; else uniform."""
    scheme = getattr(args, "weighting_scheme", "uniform")
    if scheme == "logit_normal":
        return torch.sigmoid(torch.randn(batch_size, device=device) * args.logit_std + args.logit_mean)
    u = torch.rand(batch_size, device=device)
    if scheme == "mode":
        u = 1 - u - args.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def loss_weighting(args, sigmas: torch.Tensor) -> torch.Tensor | None:
    """The loss weight per sample ([B, 1, 1, 1]) of --weighting_scheme sigma_sqrt (sigma^-2) or cosmap
    (2 / (pi (1 - 2 sigma + 2 sigma^2))), used with --model_prediction_type sigma_scaled (as upstream);
    None = weight 1 (no multiply)."""
    scheme = getattr(args, "weighting_scheme", "uniform")
    if args.model_prediction_type != "sigma_scaled" or scheme not in ("sigma_sqrt", "cosmap"):
        return None
    s = sigmas.view(-1, 1, 1, 1).float()
    if scheme == "sigma_sqrt":
        return s ** -2.0
    return 2 / (math.pi * (1 - 2 * s + 2 * s ** 2))


def sample_sigmas(args, batch_size: int, h: int, w: int, device) -> torch.Tensor:
    """sigma in (0, 1] per sample, by --timestep_sampling (h, w: latent size)."""
    mode = args.timestep_sampling
    if mode == "uniform":
        s = torch.rand(batch_size, device=device)
    elif mode == "sigmoid":
        s = torch.sigmoid(args.sigmoid_scale * torch.randn(batch_size, device=device))
    elif mode == "shift":
        s = torch.sigmoid(args.sigmoid_scale * torch.randn(batch_size, device=device))
        shift = args.discrete_flow_shift
        s = (s * shift) / (1 + (shift - 1) * s)
    elif mode == "flux_shift":
        s = torch.sigmoid(args.sigmoid_scale * torch.randn(batch_size, device=device))
        s = _time_shift(_flux_mu((h // 2) * (w // 2)), 1.0, s)
    else:  # "sigma": one of the 1000 training timesteps of the shifted flow schedule
        shift = args.discrete_flow_shift
        if getattr(args, "weighting_scheme", "uniform") in ("logit_normal", "mode"):
            # upstream indexes the schedule's descending timesteps with u * 1000 (u -> 1 is the least noise)
            index = (timestep_density(args, batch_size, device) * 1000).long().clamp(0, 999)
            t = (1000 - index).float() / 1000.0
        else:  # uniform u: the same distribution, drawn as before these schemes existed
            t = torch.randint(1, 1001, (batch_size,), device=device).float() / 1000.0
        s = shift * t / (1 + (shift - 1) * t)
    return s.clamp(1e-5, 1.0)


def apply_model_prediction_type(args, pred, noisy, sigmas):
    if args.model_prediction_type == "additive":
        return pred + noisy
    if args.model_prediction_type == "sigma_scaled":
        return pred * (-sigmas.view(-1, 1, 1, 1)) + noisy
    return pred


def flux_forward(transformer, noisy: torch.Tensor, sigmas: torch.Tensor, te: dict, guidance: float | None,
                 dtype: torch.dtype, apply_t5_attn_mask: bool = False) -> torch.Tensor:
    """Run the transformer on unpacked latents [B, 16, h, w]; returns the prediction in the same layout.
    apply_t5_attn_mask: T5 padding tokens are masked out of the joint attention (te["t5_attn_mask"])."""
    b, _, h, w = noisy.shape
    t5_out = te["t5_out"].to(noisy.device, dtype)
    kwargs = None
    if apply_t5_attn_mask and te.get("t5_attn_mask") is not None:
        txt = te["t5_attn_mask"].to(noisy.device).bool()
        img = torch.ones(b, (h // 2) * (w // 2), dtype=torch.bool, device=noisy.device)
        kwargs = {"attention_mask": torch.cat([txt, img], dim=1)[:, None, None, :]}
    g = None
    if transformer.config.guidance_embeds:
        g = torch.full((b,), float(guidance if guidance is not None else 1.0), device=noisy.device, dtype=dtype)
    out = transformer(
        hidden_states=pack_latents(noisy).to(dtype),
        encoder_hidden_states=t5_out,
        pooled_projections=te["pooled"].to(noisy.device, dtype),
        timestep=sigmas.to(dtype),
        img_ids=image_ids(h, w, noisy.device, dtype),
        txt_ids=torch.zeros(t5_out.shape[1], 3, device=noisy.device, dtype=dtype),
        guidance=g,
        joint_attention_kwargs=kwargs,
        return_dict=False,
    )[0]
    return unpack_latents(out, h, w)


def noisy_input_pred_target(args, transformer, latents, te, dtype, autocast, fixed_timestep: int | None = None):
    """One flow-matching training forward: returns (prediction, target, sigmas, loss weighting or None).
    --ip_noise_gamma perturbs the noise of the input only; fixed_timestep t: every sigma is t / 1000 (validation)."""
    from library.noise import input_perturbation

    noise = torch.randn_like(latents)
    b, _, h, w = latents.shape
    if fixed_timestep is None:
        sigmas = sample_sigmas(args, b, h, w, latents.device)
    else:
        sigmas = torch.full((b,), fixed_timestep / 1000.0, device=latents.device)
    s = sigmas.view(-1, 1, 1, 1)
    noisy = (1.0 - s) * latents + s * input_perturbation(args, noise)
    with autocast():
        pred = flux_forward(transformer, noisy, sigmas, te, args.guidance_scale, dtype, args.apply_t5_attn_mask)
    pred = apply_model_prediction_type(args, pred.float(), noisy, sigmas)
    return pred, noise - latents, sigmas, loss_weighting(args, sigmas)


# ---------------------------------------------------------------------------------------------------------------
# sample images


def build_pipeline(components):
    from diffusers import FluxPipeline

    from library.flux_tiny import flow_match_scheduler

    return FluxPipeline(scheduler=flow_match_scheduler(), vae=components.vae, text_encoder=components.clip_l,
                        tokenizer=components.clip_tokenizer, text_encoder_2=components.t5xxl,
                        tokenizer_2=components.t5_tokenizer, transformer=components.transformer)


@torch.no_grad()
def sample_images(args, components, *, device, epoch, steps, autocast=None, networks=()) -> list[str]:
    """FLUX samples (flow-matching Euler, FluxPipeline over the live models): kohya prompt lines with --g for the
    embedded guidance and --l with --n for true CFG. Saved under <output_dir>/sample/; RNG states restored."""
    from library.sample_prompts import parse_prompt_file
    from library.sampling import sampling_state, save_sample_image

    prompts = parse_prompt_file(args.sample_prompts)
    if not prompts:
        return []
    os.makedirs(os.path.join(args.output_dir, "sample"), exist_ok=True)
    paths = []
    with sampling_state(networks):
        moved = []
        for m in (components.vae, components.clip_l, components.t5xxl):
            if m.device != torch.device(device):
                moved.append((m, m.device))
                m.to(device)
        try:
            pipe = build_pipeline(components)
            pipe.set_progress_bar_config(disable=True)
            for i, p in enumerate(prompts):
                seed = p.get("seed")
                gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
                neg = p.get("negative_prompt") or None
                kwargs = dict(prompt=p["prompt"], width=p.get("width", 512), height=p.get("height", 512),
                              num_inference_steps=p.get("sample_steps", 20),
                              guidance_scale=p.get("guidance_scale", 3.5), generator=gen,
                              max_sequence_length=t5_max_length(args, components))
                if neg:
                    kwargs.update(negative_prompt=neg, true_cfg_scale=p.get("scale", 1.0))
                ctx = autocast() if autocast is not None else torch.autocast(torch.device(device).type,
                                                                             enabled=False)
                with ctx:
                    image = pipe(**kwargs).images[0]
                paths.append(save_sample_image(image, args, epoch=epoch, steps=steps, index=i, seed=seed,
                                               prompt=p["prompt"]))
        finally:
            for m, d in moved:
                m.to(d)
    return paths


def place_transformer(transformer, device, dtype, fp8_base: bool, blocks_to_swap: int):
    """Cast the frozen transformer to the training dtype (fp8 weights stay fp8) and put it on the device; with
    block swap only the resident blocks go there. Returns the BlockSwapper or None."""
    for t in list(transformer.parameters()) + list(transformer.buffers()):
        if t.is_floating_point() and t.dtype != flux_models.FP8_DTYPE and t.dtype != dtype:
            t.data = t.data.to(dtype)
    if blocks_to_swap:
        from library.block_swap import place_with_block_swap

        return place_with_block_swap(transformer, blocks_to_swap, device)
    for t in list(transformer.parameters()) + list(transformer.buffers()):
        t.data = t.data.to(device)
    return None


def cache_signature(args, what: str) -> str:
    return (f"flux:{os.path.basename(str(args.pretrained_model_name_or_path))}:{os.path.basename(str(args.ae or ''))}:"
            f"{what}:{args.t5xxl_max_token_length}:{args.apply_t5_attn_mask}")


"""Training noise and timesteps of the DDPM families (SD1.x / SD2.x / SDXL), as kohya-ss/sd-scripts defines them
(our own code, upstream's formulas and order of random draws):

    noise = randn                                       (the target of eps-prediction)
    + offset * randn[B, C, 1, 1]                        --noise_offset; offset = rand * noise_offset with
                                                        --noise_offset_random_strength; + |mean_hw(latents)| *
                                                        --adaptive_noise_scale (clamped >= 0)
    -> pyramid (multires) noise                         --multires_noise_iterations / --multires_noise_discount
    t ~ U[min_timestep, max_timestep)                   (t = max_timestep when min >= max)
    noisy = add_noise(latents, noise + g * randn, t)    --ip_noise_gamma g (input perturbation: the target
                                                        keeps the unperturbed noise); g = rand * gamma with
                                                        --ip_noise_gamma_random_strength
    --zero_terminal_snr rescales the betas so that abar_T = 0 (Lin et al. 2023).

Random numbers come from the trainer's noise generator (saved with --save_state), so a resumed run continues
the same stream. With every option off this draws exactly `randn` then `randint`, as before these options.
FLUX (flow matching) uses only the input perturbation (flux_train_utils); the other options have no effect
there, as upstream.
"""
from __future__ import annotations

import argparse
import logging
import random

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# options without an effect on flow matching (upstream's FLUX trainers ignore them)
DDPM_ONLY_OPTIONS = ("noise_offset", "noise_offset_random_strength", "multires_noise_iterations",
                     "adaptive_noise_scale", "zero_terminal_snr", "min_timestep", "max_timestep")


def add_noise_arguments(parser: argparse.ArgumentParser) -> None:
    """Every trainer (upstream: all seven scripts)."""
    g = parser.add_argument_group("noise and timesteps")
    g.add_argument("--noise_offset", type=float, default=None, help="noise offset (around 0.1 is recommended)")
    g.add_argument("--noise_offset_random_strength", action="store_true",
                   help="use a random offset strength between 0 and --noise_offset")
    g.add_argument("--multires_noise_iterations", type=int, default=None,
                   help="multires (pyramid) noise with this many iterations (6-10 is recommended)")
    g.add_argument("--multires_noise_discount", type=float, default=0.3,
                   help="discount of each multires noise level (only with --multires_noise_iterations)")
    g.add_argument("--adaptive_noise_scale", type=float, default=None,
                   help="add |latent mean| x this value to the noise offset (needs --noise_offset)")
    g.add_argument("--ip_noise_gamma", type=float, default=None,
                   help="input perturbation noise (around 0.1 is recommended, arxiv.org/abs/2301.11706)")
    g.add_argument("--ip_noise_gamma_random_strength", action="store_true",
                   help="use a random perturbation strength between 0 and --ip_noise_gamma")
    g.add_argument("--zero_terminal_snr", action="store_true",
                   help="rescale the noise schedule's betas to a zero terminal SNR (use with v-prediction)")
    g.add_argument("--min_timestep", type=int, default=None, help="smallest timestep sampled (0-999, default 0)")
    g.add_argument("--max_timestep", type=int, default=None,
                   help="largest timestep sampled + 1 (1-1000, default 1000)")


def check_noise_args(args, error_cls, *, flow_matching: bool = False) -> None:
    """Before any model loads."""
    if args.adaptive_noise_scale is not None and args.noise_offset is None:
        raise error_cls("--adaptive_noise_scale needs --noise_offset")
    t_min = 0 if args.min_timestep is None else args.min_timestep
    t_max = 1000 if args.max_timestep is None else args.max_timestep
    # min == max trains at that one timestep (upstream), which must then exist (0-999)
    if not 0 <= t_min <= t_max <= 1000 or t_min == t_max == 1000:
        raise error_cls(f"--min_timestep/--max_timestep must satisfy 0 <= min < max <= 1000 (or min = max <= 999), "
                        f"got {t_min}, {t_max}")
    if args.multires_noise_iterations is not None and args.multires_noise_iterations < 0:
        raise error_cls(f"--multires_noise_iterations must be 0 or more, got {args.multires_noise_iterations}")
    if flow_matching:
        warn_flow_matching_ignores(args)
        return
    if args.zero_terminal_snr and not args.v_parameterization:
        logger.warning("--zero_terminal_snr without --v_parameterization: training will be unexpected")


def warn_flow_matching_ignores(args) -> None:
    """Upstream's FLUX trainers accept the DDPM-only noise options and the SNR loss weights and ignore them:
    so do we, with a warning naming the ones that were set."""
    from library.losses import SNR_WEIGHT_OPTIONS

    given = [f"--{n}" for n in DDPM_ONLY_OPTIONS + SNR_WEIGHT_OPTIONS if getattr(args, n, None)]
    if given:
        logger.warning("%s: no effect on FLUX (flow matching), ignored as kohya-ss/sd-scripts does", ", ".join(given))


# ---------------------------------------------------------------------------------------------------------------
# the noise schedule


def zero_terminal_snr_betas(betas: torch.Tensor) -> torch.Tensor:
    """Betas whose sqrt(abar) is shifted to 0 at the last step and rescaled to keep the first step's value."""
    abar_sqrt = torch.cumprod(1.0 - betas, dim=0).sqrt()
    first, last = abar_sqrt[0].clone(), abar_sqrt[-1].clone()
    abar_sqrt = (abar_sqrt - last) * (first / (first - last))
    abar = abar_sqrt ** 2
    alphas = torch.cat([abar[:1], abar[1:] / abar[:-1]])
    return 1.0 - alphas


def prepare_noise_scheduler(noise_scheduler, zero_terminal_snr: bool = False):
    """Keeps the schedule's SNR table (`all_snr`, read by the loss weights) and, with --zero_terminal_snr,
    rescales its betas afterwards (as upstream: the weights keep the original SNR)."""
    from library.losses import snr_table

    noise_scheduler.all_snr = snr_table(noise_scheduler.alphas_cumprod)
    if zero_terminal_snr:
        logger.info("zero terminal SNR: rescaling the noise schedule's betas (arxiv.org/abs/2305.08891)")
        betas = zero_terminal_snr_betas(noise_scheduler.betas)
        noise_scheduler.betas = betas
        noise_scheduler.alphas = 1.0 - betas
        noise_scheduler.alphas_cumprod = torch.cumprod(noise_scheduler.alphas, dim=0)
    return noise_scheduler


# ---------------------------------------------------------------------------------------------------------------
# noise


def _rand(generator, device, dtype=torch.float32) -> torch.Tensor:
    return torch.rand(1, generator=generator, device=device, dtype=dtype)


def offset_noise(args, latents: torch.Tensor, noise: torch.Tensor, generator=None) -> torch.Tensor:
    """noise + offset * randn[B, C, 1, 1] (see the module doc); `noise` unchanged without --noise_offset."""
    if not args.noise_offset:
        return noise
    offset = args.noise_offset
    if getattr(args, "noise_offset_random_strength", False):
        offset = _rand(generator, latents.device, latents.dtype) * offset
    if getattr(args, "adaptive_noise_scale", None) is not None:
        mean = latents.mean(dim=(2, 3), keepdim=True).abs()
        offset = torch.clamp(offset + args.adaptive_noise_scale * mean, min=0.0)
    return noise + offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1), generator=generator,
                                        device=latents.device, dtype=latents.dtype)


def pyramid_noise(noise: torch.Tensor, iterations: int, discount: float, generator=None) -> torch.Tensor:
    """Multi-resolution noise: levels of random noise at sizes / r^i (r ~ U[2, 4) per level), upsampled
    bilinearly and weighted discount^i, added to `noise`; then rescaled to unit standard deviation.
    r comes from Python's `random`, as upstream: a device draw would need a sync per level."""
    b, c, h, w = noise.shape
    out = noise.clone()
    for i in range(iterations):
        r = random.random() * 2 + 2
        hn, wn = max(1, int(h / (r ** i))), max(1, int(w / (r ** i)))
        level = torch.randn((b, c, hn, wn), generator=generator, device=noise.device, dtype=noise.dtype)
        out = out + F.interpolate(level, size=(h, w), mode="bilinear") * discount ** i
        if hn == 1 or wn == 1:
            break  # the coarsest level is 1 pixel wide
    return out / out.std()


def make_noise(args, latents: torch.Tensor, generator=None) -> torch.Tensor:
    """The training noise of a batch (the eps target): randn, offset, multires."""
    noise = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
    noise = offset_noise(args, latents, noise, generator)
    if getattr(args, "multires_noise_iterations", None):
        noise = pyramid_noise(noise, args.multires_noise_iterations, args.multires_noise_discount, generator)
    return noise


def input_perturbation(args, noise: torch.Tensor, generator=None) -> torch.Tensor:
    """noise + gamma * randn (--ip_noise_gamma): what is added to the latents; the target stays `noise`."""
    gamma = getattr(args, "ip_noise_gamma", None)
    if not gamma:
        return noise
    if getattr(args, "ip_noise_gamma_random_strength", False):
        gamma = _rand(generator, noise.device, noise.dtype) * gamma
    return noise + gamma * torch.randn(noise.shape, generator=generator, device=noise.device, dtype=noise.dtype)


def sample_timesteps(args, batch_size: int, num_train_timesteps: int, device, generator=None,
                     fixed: int | None = None) -> torch.Tensor:
    """t ~ U[--min_timestep, --max_timestep) per sample (t = max when min >= max); `fixed`: every sample gets
    that timestep (validation)."""
    if fixed is not None:
        return torch.full((batch_size,), int(fixed), device=device, dtype=torch.long)
    t_min = args.min_timestep or 0
    t_max = args.max_timestep if args.max_timestep is not None else num_train_timesteps
    if t_min >= t_max:
        return torch.full((batch_size,), t_max, device=device, dtype=torch.long)
    return torch.randint(t_min, t_max, (batch_size,), generator=generator, device=device).long()


def metadata(args) -> dict:
    """The ss_* keys upstream writes for these options."""
    return {
        "ss_noise_offset": args.noise_offset,
        "ss_noise_offset_random_strength": bool(args.noise_offset_random_strength),
        "ss_multires_noise_iterations": args.multires_noise_iterations,
        "ss_multires_noise_discount": args.multires_noise_discount,
        "ss_adaptive_noise_scale": args.adaptive_noise_scale,
        "ss_zero_terminal_snr": bool(args.zero_terminal_snr),
        "ss_ip_noise_gamma": args.ip_noise_gamma,
        "ss_ip_noise_gamma_random_strength": bool(args.ip_noise_gamma_random_strength),
    }

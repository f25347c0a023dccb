"""Rectified flow matching (FLUX.1): noisy = (1 - sigma) * latents + sigma * noise, the target is the velocity
noise - latents (for every --model_prediction_type, as upstream). Sigmas by --timestep_sampling and the SD3
--weighting_scheme; every draw comes from the run's generator (saved with --save_state, so a resumed run continues
the same random stream)."""
from __future__ import annotations

import math

import torch

from library import losses, noise

# the flow-matching options, declared, checked and written to metadata here for every flow-matching family
# (FLUX.1 / Chroma, SD3, Lumina); each family's parser picks its defaults as upstream's script has them
TIMESTEP_SAMPLING = ("sigma", "uniform", "sigmoid", "shift", "flux_shift")
MODEL_PREDICTION_TYPES = ("raw", "additive", "sigma_scaled")
# SD3-paper weighting schemes (upstream's choices): logit_normal / mode change which timesteps are drawn;
# sigma_sqrt / cosmap weight the loss (FLUX.1: with --model_prediction_type sigma_scaled); none / uniform: neither
WEIGHTING_SCHEMES = ("sigma_sqrt", "logit_normal", "mode", "cosmap", "none", "uniform")


def add_weighting_arguments(group) -> None:
    """--weighting_scheme, --logit_mean, --logit_std, --mode_scale (the SD3 paper's; same defaults everywhere)."""
    group.add_argument("--weighting_scheme", type=str, default="uniform", choices=WEIGHTING_SCHEMES,
                       help="SD3 weighting: logit_normal / mode shape the timesteps drawn (FLUX.1: with "
                            "--timestep_sampling sigma); sigma_sqrt / cosmap weight the loss (FLUX.1: with "
                            "--model_prediction_type sigma_scaled)")
    group.add_argument("--logit_mean", type=float, default=0.0, help="mean of the logit_normal weighting scheme")
    group.add_argument("--logit_std", type=float, default=1.0,
                       help="standard deviation of the logit_normal scheme")
    group.add_argument("--mode_scale", type=float, default=1.29, help="scale of the mode weighting scheme")


def add_timestep_arguments(group, *, sampling_default: str, discrete_flow_shift: float,
                           model_prediction_type: str | None, sampling_choices: tuple[str, ...] = TIMESTEP_SAMPLING
                           ) -> None:
    """--timestep_sampling, --sigmoid_scale, --discrete_flow_shift, the weighting options and
    --model_prediction_type (FLUX.1 / Chroma, Lumina; None: the script has none, as Anima's), with the script's
    upstream defaults."""
    group.add_argument("--timestep_sampling", type=str, default=sampling_default, choices=sampling_choices,
                       help="how sigmas are drawn: sigma (uniform over the shifted schedule), uniform, sigmoid "
                            "(sigmoid of a normal), shift (sigmoid + --discrete_flow_shift), flux_shift "
                            "(resolution-dependent shift)")
    group.add_argument("--sigmoid_scale", type=float, default=1.0,
                       help="scale of the normal in sigmoid/shift/flux_shift sampling")
    group.add_argument("--discrete_flow_shift", type=float, default=discrete_flow_shift,
                       help="shift of the flow schedule (sigma, shift)")
    add_weighting_arguments(group)
    if model_prediction_type is None:
        return
    group.add_argument("--model_prediction_type", type=str, default=model_prediction_type,
                       choices=MODEL_PREDICTION_TYPES,
                       help="raw: the output as it is; additive: output + noisy input; sigma_scaled: -sigma * "
                            "output + noisy input")


def check_args(args, error_cls) -> None:
    """The flow-matching options a script has must be in range."""
    for name in ("sigmoid_scale", "logit_std", "discrete_flow_shift", "training_shift"):
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise error_cls(f"--{name} must be positive, got {value}")


def metadata(args) -> dict[str, str]:
    """ss_* of the flow-matching options the script has (upstream's keys)."""
    md = {}
    for name in ("timestep_sampling", "sigmoid_scale", "discrete_flow_shift", "model_prediction_type",
                 "weighting_scheme", "logit_mean", "logit_std", "mode_scale", "training_shift"):
        if hasattr(args, name):
            md[f"ss_{name}"] = str(getattr(args, name))
    return md


class FlowMatching:
    flow_matching = True  # no DDPM schedule: noise.DDPM_ONLY_OPTIONS and the SNR weights do nothing

    def noise_scheduler(self, args, prediction_type: str):
        return None  # sigmas are drawn by sample_sigmas

    def num_train_timesteps(self, noise_scheduler) -> int:
        return 1000  # validation's fixed timesteps t are sigma = t / 1000

    def noisy_input_pred_target(self, args, noise_scheduler, latents: torch.Tensor, predict, generator,
                                fixed_timestep: int | None = None):
        """One flow-matching forward: (prediction, target, sigmas, loss weighting or None). --ip_noise_gamma
        perturbs the noise of the input only; fixed_timestep t: every sigma is t / 1000 (validation)."""
        eps = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        b, _, h, w = latents.shape
        if fixed_timestep is None:
            sigmas = sample_sigmas(args, b, h, w, latents.device, generator)
        else:
            sigmas = torch.full((b,), fixed_timestep / 1000.0, device=latents.device)
        s = sigmas.view(-1, 1, 1, 1)
        noisy = (1.0 - s) * latents + s * noise.input_perturbation(args, eps, generator)
        pred = apply_model_prediction_type(args, predict(noisy, sigmas).float(), noisy, sigmas)
        return pred, eps - latents, sigmas, loss_weighting(args, sigmas)

    def huber_threshold(self, args, timesteps, noise_scheduler):
        return losses.huber_threshold(args, timesteps * 1000, 1000)  # upstream's FLUX timesteps are sigma * 1000

    def weight_loss(self, loss, args, timesteps, noise_scheduler):
        return loss  # the weighting scheme's weights come with the prediction (loss_weighting)


class SD3FlowMatching(FlowMatching):
    """SD3 / SD3.5 as upstream's sd3_train_network.py: t = the --weighting_scheme density shifted by
    --training_shift, scaled into [--min_timestep, --max_timestep) and floored; sigma = t / 1000; noisy = sigma *
    noise + (1 - sigma) * latents; the prediction preconditioned to -sigma * output + noisy and compared with the
    latents, weighted by sigma_sqrt / cosmap."""

    def noisy_input_pred_target(self, args, noise_scheduler, latents: torch.Tensor, predict, generator,
                                fixed_timestep: int | None = None):
        eps = torch.randn(latents.shape, generator=generator, device=latents.device, dtype=latents.dtype)
        b = latents.shape[0]
        if fixed_timestep is None:
            timesteps = sd3_timesteps(args, b, latents.device, generator)
        else:
            timesteps = torch.full((b,), float(fixed_timestep), device=latents.device)
        sigmas = (timesteps / 1000.0).view(-1, 1, 1, 1)
        noisy = sigmas * eps + (1.0 - sigmas) * latents
        pred = predict(noisy, timesteps).float() * (-sigmas) + noisy
        return pred, latents, timesteps, sd3_loss_weighting(args, sigmas)

    def huber_threshold(self, args, timesteps, noise_scheduler):
        return losses.huber_threshold(args, timesteps, 1000)


def sd3_timesteps(args, batch_size: int, device, generator=None) -> torch.Tensor:
    """Upstream's get_noisy_model_input_and_timesteps: integer-valued timesteps in [t_min, t_max)."""
    u = timestep_density(args, batch_size, device, generator)
    shift = args.training_shift
    u = (u * shift) / (1 + (shift - 1) * u)
    t_min = args.min_timestep if args.min_timestep is not None else 0
    t_max = args.max_timestep if args.max_timestep is not None else 1000
    return (u * (t_max - t_min) + t_min).long().float()


def sd3_loss_weighting(args, sigmas: torch.Tensor) -> torch.Tensor | None:
    """sigma_sqrt: sigma^-2; cosmap: 2 / (pi (1 - 2 sigma + 2 sigma^2)); other schemes: None (weight 1)."""
    if args.weighting_scheme == "sigma_sqrt":
        return sigmas.float() ** -2.0
    if args.weighting_scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas.float() + 2 * sigmas.float() ** 2))
    return None


def add_sd3_arguments(group) -> None:
    """SD3's flow-matching options: the weighting options and --training_shift (upstream's defaults)."""
    add_weighting_arguments(group)
    group.add_argument("--training_shift", type=float, default=1.0,
                       help="shift of the training timestep distribution, applied on top of the weighting scheme "
                            "(> 1: noisier timesteps, overall structure; < 1: less noisy, details)")


def _time_shift(mu: float, sigma: float, t: torch.Tensor) -> torch.Tensor:
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


def _flux_mu(image_seq_len: int, x1=256, y1=0.5, x2=4096, y2=1.15) -> float:
    m = (y2 - y1) / (x2 - x1)
    return m * image_seq_len + (y1 - m * x1)


def timestep_density(args, batch_size: int, device, generator=None) -> torch.Tensor:
    """u in [0, 1) per sample by --weighting_scheme (SD3 paper, sec. 3.1): logit_normal = sigmoid(N(logit_mean,
    logit_std)); mode = 1 - u - mode_scale * (cos^2(pi u / 2) - 1 + u) of a uniform u; else uniform."""
    scheme = getattr(args, "weighting_scheme", "uniform")
    if scheme == "logit_normal":
        return torch.sigmoid(torch.randn(batch_size, device=device, generator=generator) * args.logit_std
                             + args.logit_mean)
    u = torch.rand(batch_size, device=device, generator=generator)
    if scheme == "mode":
        u = 1 - u - args.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


def loss_weighting(args, sigmas: torch.Tensor) -> torch.Tensor | None:
    """The loss weight per sample ([B, 1, 1, 1]) of --weighting_scheme sigma_sqrt (sigma^-2) or cosmap
    (2 / (pi (1 - 2 sigma + 2 sigma^2))), used with --model_prediction_type sigma_scaled (as upstream);
    None = weight 1 (no multiply)."""
    scheme = getattr(args, "weighting_scheme", "uniform")
    # Anima's script has no --model_prediction_type: its weighting always applies (upstream's anima_train_network)
    if getattr(args, "model_prediction_type", "sigma_scaled") != "sigma_scaled" or scheme not in ("sigma_sqrt", "cosmap"):
        return None
    s = sigmas.view(-1, 1, 1, 1).float()
    if scheme == "sigma_sqrt":
        return s ** -2.0
    return 2 / (math.pi * (1 - 2 * s + 2 * s ** 2))


def sample_sigmas(args, batch_size: int, h: int, w: int, device, generator=None) -> torch.Tensor:
    """sigma in (0, 1] per sample, by --timestep_sampling (h, w: latent size)."""
    mode = args.timestep_sampling

    def normal():
        return torch.randn(batch_size, device=device, generator=generator)

    if mode == "uniform":
        s = torch.rand(batch_size, device=device, generator=generator)
    elif mode == "sigmoid":
        s = torch.sigmoid(args.sigmoid_scale * normal())
    elif mode == "shift":
        s = torch.sigmoid(args.sigmoid_scale * normal())
        shift = args.discrete_flow_shift
        s = (s * shift) / (1 + (shift - 1) * s)
    elif mode == "flux_shift":
        s = torch.sigmoid(args.sigmoid_scale * normal())
        s = _time_shift(_flux_mu((h // 2) * (w // 2)), 1.0, s)
    elif mode == "nextdit_shift":  # Lumina 2: the resolution-dependent shift of a uniform draw
        s = torch.rand(batch_size, device=device, generator=generator).clamp(min=1e-7)
        s = _time_shift(_flux_mu((h // 2) * (w // 2)), 1.0, s)
    else:  # "sigma": one of the 1000 training timesteps of the shifted flow schedule
        shift = args.discrete_flow_shift
        if getattr(args, "weighting_scheme", "uniform") in ("logit_normal", "mode"):
            # upstream indexes the schedule's descending timesteps with u * 1000 (u -> 1 is the least noise)
            index = (timestep_density(args, batch_size, device, generator) * 1000).long().clamp(0, 999)
            t = (1000 - index).float() / 1000.0
        else:  # uniform u: the same distribution, drawn as before these schemes existed
            t = torch.randint(1, 1001, (batch_size,), device=device, generator=generator).float() / 1000.0
        s = shift * t / (1 + (shift - 1) * t)
    return s.clamp(1e-5, 1.0)


def apply_model_prediction_type(args, pred, noisy, sigmas):
    """raw (or a script without the option): the output as it is; additive: output + noisy input; sigma_scaled:
    -sigma * output + noisy input."""
    kind = getattr(args, "model_prediction_type", "raw")
    if kind == "additive":
        return pred + noisy
    if kind == "sigma_scaled":
        return pred * (-sigmas.view(-1, 1, 1, 1)) + noisy
    return pred

"""Loss functions and loss weights, as kohya-ss/sd-scripts defines them (our own code, upstream's formulas):

- `--loss_type l1|l2|huber|smooth_l1` with a Huber threshold per sample from `--huber_schedule`
  (constant: c * scale; exponential: exp(-t * (-ln c) / T) * scale; snr: (1 - c) / (1 + sigma_t)^2 + c, where
  sigma_t = sqrt((1 - abar_t) / abar_t); upstream's snr schedule ignores --huber_scale, and so do we);
- per-sample weights of noise-prediction models (after the per-sample mean, in this order): Min-SNR-gamma,
  `--scale_v_pred_loss_like_noise_pred`, `--v_pred_like_loss`, `--debiased_estimation_loss`.

The SNR table is the one of the schedule *before* `--zero_terminal_snr` rescales it (upstream computes
`all_snr` first and fixes the betas afterwards), so these weights never divide by the zero terminal SNR.
FLUX (flow matching) uses only the loss type: upstream's FLUX trainers ignore the SNR weights (so do we, with a
warning: noise.warn_flow_matching_ignores).
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F


LOSS_TYPES = ("l1", "l2", "huber", "smooth_l1")
HUBER_TYPES = ("huber", "smooth_l1")
HUBER_SCHEDULES = ("constant", "exponential", "snr")
# options that weight the loss by the DDPM SNR: no meaning for flow matching (upstream's FLUX ignores them)
SNR_WEIGHT_OPTIONS = ("min_snr_gamma", "scale_v_pred_loss_like_noise_pred", "v_pred_like_loss",
                      "debiased_estimation_loss")
SNR_CAP = 1000.0  # upstream caps the SNR at 1000 in the v-pred scale and the debiased weight (t = 0 is ~inf)


def add_loss_arguments(parser: argparse.ArgumentParser) -> None:
    """Every trainer (upstream: all seven scripts)."""
    g = parser.add_argument_group("loss")
    g.add_argument("--loss_type", type=str, default="l2", choices=list(LOSS_TYPES),
                   help="loss function: l1, l2 (default), huber or smooth_l1")
    g.add_argument("--huber_schedule", type=str, default="snr", choices=list(HUBER_SCHEDULES),
                   help="how the Huber threshold depends on the timestep (huber / smooth_l1 only): constant, "
                        "exponential or snr (default)")
    g.add_argument("--huber_c", type=float, default=0.1,
                   help="Huber threshold / decay parameter (huber / smooth_l1 only), default 0.1")
    g.add_argument("--huber_scale", type=float, default=1.0,
                   help="scale of the Huber threshold (constant and exponential schedules), default 1.0")
    g.add_argument("--min_snr_gamma", type=float, default=None,
                   help="Min-SNR weighting gamma (5 is recommended by the paper)")
    g.add_argument("--scale_v_pred_loss_like_noise_pred", action="store_true",
                   help="scale the v-prediction loss like a noise-prediction loss (needs --v_parameterization)")
    g.add_argument("--v_pred_like_loss", type=float, default=None,
                   help="add a v-prediction-like loss multiplied by this value (noise-prediction models)")
    g.add_argument("--debiased_estimation_loss", action="store_true", help="debiased estimation loss weighting")


def check_loss_args(args, error_cls, *, flow_matching: bool = False) -> None:
    """Before any model loads. Upstream's own refusals (scale_v_pred without v, v_pred_like with v) plus values
    its formulas cannot use (a Huber threshold <= 0; the snr schedule on a flow-matching model)."""
    if args.loss_type in HUBER_TYPES:
        if args.huber_c <= 0:
            raise error_cls(f"--huber_c must be above 0 with --loss_type {args.loss_type}, got {args.huber_c}")
        if flow_matching and args.huber_schedule == "snr":
            raise error_cls(f"--loss_type {args.loss_type} with --huber_schedule snr needs a DDPM noise schedule; "
                            "FLUX trains with flow matching: use --huber_schedule constant or exponential")
    if flow_matching:
        return  # the SNR weights are ignored there (noise.warn_flow_matching_ignores)
    if args.scale_v_pred_loss_like_noise_pred and not args.v_parameterization:
        raise error_cls("--scale_v_pred_loss_like_noise_pred can be used only with --v_parameterization")
    if args.v_pred_like_loss and args.v_parameterization:
        raise error_cls("--v_pred_like_loss cannot be used with --v_parameterization (it adds a v-prediction-like "
                        "loss to a noise-prediction model)")


# ---------------------------------------------------------------------------------------------------------------
# loss type


def huber_threshold(args, timesteps: torch.Tensor, num_train_timesteps: int = 1000,
                    alphas_cumprod: torch.Tensor | None = None) -> torch.Tensor | None:
    """The Huber threshold c per sample [B], or None when the loss type has none. `alphas_cumprod` (the
    training schedule) is needed by the snr schedule only."""
    if args.loss_type not in HUBER_TYPES:
        return None
    schedule = args.huber_schedule
    if schedule == "exponential":
        alpha = -math.log(args.huber_c) / num_train_timesteps
        return torch.exp(-alpha * timesteps) * args.huber_scale
    if schedule == "snr":
        if alphas_cumprod is None:
            raise ValueError("--huber_schedule snr needs a DDPM noise schedule")
        abar = alphas_cumprod.to(timesteps.device)[timesteps]
        sigmas = ((1.0 - abar) / abar) ** 0.5
        return (1 - args.huber_c) / (1 + sigmas) ** 2 + args.huber_c
    return torch.full((timesteps.shape[0],), args.huber_c * args.huber_scale, device=timesteps.device)


def conditional_loss(pred: torch.Tensor, target: torch.Tensor, loss_type: str,
                     huber_c: torch.Tensor | None = None) -> torch.Tensor:
    """The element-wise loss (no reduction). huber: 2c(sqrt(d^2 + c^2) - c); smooth_l1: 2(sqrt(d^2 + c^2) - c)."""
    if loss_type == "l2":
        return F.mse_loss(pred, target, reduction="none")
    if loss_type == "l1":
        return F.l1_loss(pred, target, reduction="none")
    if loss_type not in HUBER_TYPES:
        raise ValueError(f"unknown loss type {loss_type!r}; allowed: {', '.join(LOSS_TYPES)}")
    c = huber_c.view(-1, *([1] * (pred.ndim - 1)))
    loss = torch.sqrt((pred - target) ** 2 + c ** 2) - c
    return 2 * c * loss if loss_type == "huber" else 2 * loss


# ---------------------------------------------------------------------------------------------------------------
# SNR weights (noise-prediction models)


def snr_table(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """SNR(t) = abar_t / (1 - abar_t) for every training timestep."""
    return alphas_cumprod / (1.0 - alphas_cumprod)


def snr_at(noise_scheduler, timesteps: torch.Tensor) -> torch.Tensor:
    """SNR of each sample's timestep, from the schedule's `all_snr` (set by noise.prepare_noise_scheduler;
    computed from alphas_cumprod when absent). The table is moved to the device once and kept there."""
    table = getattr(noise_scheduler, "all_snr", None)
    if table is None:
        table = snr_table(noise_scheduler.alphas_cumprod)
    if table.device != timesteps.device:
        table = table.to(timesteps.device)
        try:
            noise_scheduler.all_snr = table
        except AttributeError:  # pragma: no cover - a scheduler that refuses attributes
            pass
    return table[timesteps].float()


def min_snr_weight(snr: torch.Tensor, gamma: float, v_prediction: bool) -> torch.Tensor:
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1.0) if v_prediction else clipped / snr


def v_pred_scale(snr: torch.Tensor) -> torch.Tensor:
    """snr / (snr + 1) with the SNR capped at 1000: a v-prediction loss scaled like a noise-prediction loss."""
    snr = torch.clamp(snr, max=SNR_CAP)
    return snr / (snr + 1.0)


def debiased_weight(snr: torch.Tensor, v_prediction: bool) -> torch.Tensor:
    snr = torch.clamp(snr, max=SNR_CAP)
    return 1.0 / (snr + 1.0) if v_prediction else 1.0 / torch.sqrt(snr)


def needs_snr_weights(args) -> bool:
    return any(getattr(args, n, None) for n in SNR_WEIGHT_OPTIONS)


def apply_snr_weights(loss: torch.Tensor, args, timesteps: torch.Tensor, noise_scheduler,
                      v_prediction: bool) -> torch.Tensor:
    """Per-sample loss [B] weighted in upstream's order: Min-SNR, v-pred scale, v-pred-like, debiased."""
    if not needs_snr_weights(args):
        return loss
    snr = snr_at(noise_scheduler, timesteps)
    if args.min_snr_gamma:
        loss = loss * min_snr_weight(snr, args.min_snr_gamma, v_prediction)
    if args.scale_v_pred_loss_like_noise_pred:
        loss = loss * v_pred_scale(snr)
    if args.v_pred_like_loss:
        loss = loss + loss / v_pred_scale(snr) * args.v_pred_like_loss
    if args.debiased_estimation_loss:
        loss = loss * debiased_weight(snr, v_prediction)
    return loss


def metadata(args) -> dict:
    """The ss_* keys upstream writes for these options."""
    return {
        "ss_loss_type": args.loss_type,
        "ss_huber_schedule": args.huber_schedule,
        "ss_huber_scale": args.huber_scale,
        "ss_huber_c": args.huber_c,
        "ss_min_snr_gamma": args.min_snr_gamma,
        "ss_debiased_estimation": bool(args.debiased_estimation_loss),
    }

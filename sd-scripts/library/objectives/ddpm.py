"""DDPM noise prediction (SD1.x / SD2.x / SDXL): eps or v targets on the scaled-linear 1000-step schedule, with
the noise options of library.noise and the SNR loss weights of library.losses."""
from __future__ import annotations

import torch

from library import losses, noise


class DDPM:
    flow_matching = False  # noise.DDPM_ONLY_OPTIONS and the SNR weights apply

    def noise_scheduler(self, args, prediction_type: str):
        from diffusers import DDPMScheduler

        # the training schedule of SD1.x/SD2.x/SDXL (scaled linear betas, 1000 steps)
        scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                  num_train_timesteps=1000, clip_sample=False, prediction_type=prediction_type)
        return noise.prepare_noise_scheduler(scheduler, getattr(args, "zero_terminal_snr", False))

    def num_train_timesteps(self, noise_scheduler) -> int:
        return noise_scheduler.config.num_train_timesteps

    def noisy_input_pred_target(self, args, noise_scheduler, latents: torch.Tensor, predict, generator,
                                fixed_timestep: int | None = None):
        """Noise, timesteps and the perturbed input drawn from `generator` in upstream's order; `predict(noisy,
        timesteps)` is the family's model call. Returns (prediction, target, timesteps, loss weighting or None)."""
        eps = noise.make_noise(args, latents, generator)
        timesteps = noise.sample_timesteps(args, latents.shape[0], noise_scheduler.config.num_train_timesteps,
                                           latents.device, generator, fixed=fixed_timestep)
        noisy = noise_scheduler.add_noise(latents, noise.input_perturbation(args, eps, generator), timesteps)
        pred = predict(noisy, timesteps)
        if noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, eps, timesteps)
        else:
            target = eps
        return pred, target, timesteps, None

    def huber_threshold(self, args, timesteps, noise_scheduler):
        return losses.huber_threshold(args, timesteps, noise_scheduler.config.num_train_timesteps,
                                      noise_scheduler.alphas_cumprod)

    def weight_loss(self, loss, args, timesteps, noise_scheduler):
        """The per-sample loss times the SNR weights (--min_snr_gamma, --debiased_estimation_loss ...)."""
        v = noise_scheduler.config.prediction_type == "v_prediction"
        return losses.apply_snr_weights(loss, args, timesteps, noise_scheduler, v)

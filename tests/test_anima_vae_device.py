"""Anima's VAE takes images and latents on its own device (run82: ours cached latents from CPU images into the CUDA
VAE and stopped, on the first GPU run). The VAE sits on the meta device here, so that a CPU test sees a device
mismatch as a GPU would."""
import torch

from library import anima_models


def test_encode_and_decode_move_their_inputs_to_the_vae():
    vae = anima_models.tiny_vae().to("meta")
    latents = anima_models.encode_pixels(vae, torch.rand(1, 3, 64, 64) * 2 - 1)  # images from the CPU data loader
    assert latents.device.type == "meta" and latents.shape == (1, anima_models.LATENT_CHANNELS, 8, 8)
    images = anima_models.decode_latents(vae, torch.randn(1, anima_models.LATENT_CHANNELS, 8, 8))
    assert images.device.type == "meta" and images.shape == (1, 3, 64, 64)

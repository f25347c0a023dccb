"""Masked loss (`--masked_loss`, dataset `alpha_mask` / `conditioning_data_dir`) with kohya-ss/sd-scripts' meaning.

The mask of an image is its alpha channel (`alpha_mask`: 0 = transparent = ignored, 1 = opaque = trained) or the
red channel of the same-named image in `conditioning_data_dir` (0 = ignored, 255 = trained). The dataset carries it
through the same resize, crop and flip as the pixels (and into the latent cache); the loss is multiplied by the mask
shrunk to the latent size with area interpolation, before the mean (upstream's `apply_masked_loss`). Masked pixels
add nothing to the loss, and the mean still divides by every pixel, as upstream.
"""
from __future__ import annotations

import argparse
import glob
import os
from typing import Optional

import torch

from library.dataset_files import IMAGE_EXTENSIONS


def add_masked_loss_arguments(parser: argparse.ArgumentParser) -> None:
    """Upstream's `add_masked_loss_arguments` (not in fine_tune.py)."""
    parser.add_argument("--conditioning_data_dir", type=str, default=None,
                        help="folder of mask images named like the training images (the red channel is the mask); "
                             "with --masked_loss it gives the --train_data_dir images their masks")
    parser.add_argument("--masked_loss", action="store_true",
                        help="multiply the loss by each image's mask (alpha_mask or conditioning_data_dir)")


def find_conditioning_image(cond_dir: str, image_path: str) -> Optional[str]:
    """The image in cond_dir with the same stem as image_path (upstream globs `<dir>/<stem>.*`)."""
    stem = os.path.splitext(os.path.basename(image_path))[0]
    for path in sorted(glob.glob(os.path.join(glob.escape(cond_dir), glob.escape(stem) + ".*"))):
        if os.path.splitext(path)[1].lower() in IMAGE_EXTENSIONS:
            return path
    return None


def apply_masked_loss(loss: torch.Tensor, masks: Optional[torch.Tensor]) -> torch.Tensor:
    """loss [B,C,h,w] (per element) * masks [B,H,W] in 0..1 resized to (h, w) by area averaging."""
    if masks is None:
        return loss
    m = masks.to(device=loss.device, dtype=loss.dtype).unsqueeze(1)
    m = torch.nn.functional.interpolate(m, size=loss.shape[2:], mode="area")
    return loss * m

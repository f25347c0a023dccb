"""Latent cache files (`--cache_latents_to_disk`) in kohya-ss/sd-scripts' format, so that either program reuses the
other's files: the same names and npz keys per family (upstream's `LatentsCachingStrategy` subclasses).

- SD1.x/2.x `<stem>_<WWWW>x<HHHH>_sd.npz`, SDXL `..._sdxl.npz` (W, H = the image's size), or an existing `<stem>.npz`
  (upstream's older name, still read and updated by upstream). Keys `latents` [C,h,w] (the VAE sample *before* the
  scaling factor), `original_size` (w, h), `crop_ltrb` (upstream's fit-inside box, see buckets.crop_ltrb),
  `latents_flipped` with flip_aug, `alpha_mask` [H,W] in 0..1 with alpha_mask.
- FLUX.1 `<stem>_<WWWW>x<HHHH>_flux.npz` holding several resolutions: each key ends in `_<h>x<w>` (the latent size),
  latents already shifted and scaled (the AE output).
- SD3 `<stem>_<WWWW>x<HHHH>_sd3.npz`, FLUX.1's multi-resolution keys, the raw VAE sample (before shift and scale).

We add `signature` (which model encoded it); upstream ignores extra keys and keeps them when it
updates a file. A file without a signature (upstream's) is trusted like upstream trusts it.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

logger = logging.getLogger(__name__)

SIGNATURE_KEY = "signature"


@dataclass(frozen=True)
class LatentCacheFormat:
    suffix: str = "_sd.npz"
    scale: float = 1.0  # our latents are `file latents * scale` (SD/SDXL files hold the unscaled VAE sample)
    multi_resolution: bool = False  # FLUX: keys carry the latent size
    legacy_name: bool = True  # SD/SDXL: reuse an existing `<stem>.npz`
    stride: int = 8  # pixels per latent
    shift: float = 0.0  # SD3: our latents are `(file latents - shift) * scale` (upstream caches the raw VAE sample)

    def npz_path(self, image_path: str, image_size: tuple[int, int]) -> str:
        stem = os.path.splitext(image_path)[0]
        if self.legacy_name and os.path.exists(stem + ".npz"):
            return stem + ".npz"
        return f"{stem}_{image_size[0]:04d}x{image_size[1]:04d}{self.suffix}"

    def key(self, name: str, bucket: tuple[int, int]) -> str:
        if not self.multi_resolution:
            return name
        return f"{name}_{bucket[1] // self.stride}x{bucket[0] // self.stride}"

    def is_expected(self, path: str, bucket: tuple[int, int], flip_aug: bool, alpha_mask: bool, *,
                    skip_check: bool = False, signature: str = "", image_path: Optional[str] = None) -> bool:
        """Upstream's `is_disk_cached_latents_expected` (keys present; only the file's existence with
        --skip_cache_check), plus our checks where the file tells: latent shape, signature, not older than the image."""
        if not os.path.isfile(path):
            return False
        if skip_check:
            return True
        if image_path is not None and os.path.getmtime(path) < os.path.getmtime(image_path):
            return False
        try:
            with np.load(path) as npz:
                lat_key = self.key("latents", bucket)
                if lat_key not in npz:
                    return False
                if flip_aug and self.key("latents_flipped", bucket) not in npz:
                    return False
                if alpha_mask and self.key("alpha_mask", bucket) not in npz:
                    return False
                if tuple(npz[lat_key].shape[-2:]) != (bucket[1] // self.stride, bucket[0] // self.stride):
                    return False
                sig_key = self.key(SIGNATURE_KEY, bucket)
                stored = str(npz[sig_key]) if sig_key in npz else None
                return stored is None or stored == signature
        except (OSError, ValueError, EOFError) as e:
            logger.warning("ignoring unreadable latent cache %s (%s); encoding again", path, e)
            return False

    def load(self, path: str, bucket: tuple[int, int]):
        """-> (latents, original_size, crop_ltrb, latents_flipped|None, alpha_mask|None), tensors in our scale."""
        with np.load(path) as npz:
            lat_key = self.key("latents", bucket)
            if lat_key not in npz:
                from library.dataset_files import DatasetError

                raise DatasetError(f"latent cache {path} has no {lat_key!r}: delete it to encode the image again")
            latents = (torch.from_numpy(npz[lat_key].astype(np.float32)) - self.shift) * self.scale
            flip_key, mask_key = self.key("latents_flipped", bucket), self.key("alpha_mask", bucket)
            flipped = (torch.from_numpy(npz[flip_key].astype(np.float32)) - self.shift) * self.scale \
                if flip_key in npz else None
            mask = torch.from_numpy(npz[mask_key].astype(np.float32)) if mask_key in npz else None
            original_size = tuple(npz[self.key("original_size", bucket)].tolist())
            ltrb = tuple(npz[self.key("crop_ltrb", bucket)].tolist())
        return latents, original_size, ltrb, flipped, mask

    def save(self, path: str, bucket: tuple[int, int], latents: torch.Tensor, original_size, ltrb,
             flipped: Optional[torch.Tensor] = None, alpha_mask: Optional[torch.Tensor] = None,
             signature: Optional[str] = "") -> None:
        """Writes (or updates, keeping the other resolutions' keys as upstream does) the npz atomically; signature
        None writes none (finetune/prepare_buckets_latents.py: trusted by any trainer, as upstream's files)."""
        arrays = {}
        if os.path.isfile(path):
            try:
                with np.load(path) as npz:
                    arrays = {k: npz[k] for k in npz.files}
            except (OSError, ValueError, EOFError):
                arrays = {}
        arrays[self.key("latents", bucket)] = _unscaled(latents, self.scale) + self.shift
        arrays[self.key("original_size", bucket)] = np.array(original_size)
        arrays[self.key("crop_ltrb", bucket)] = np.array(ltrb)
        if flipped is not None:
            arrays[self.key("latents_flipped", bucket)] = _unscaled(flipped, self.scale) + self.shift
        if alpha_mask is not None:
            arrays[self.key("alpha_mask", bucket)] = alpha_mask.detach().float().cpu().numpy()
        if signature is not None:
            arrays[self.key(SIGNATURE_KEY, bucket)] = np.array(signature)
        else:
            arrays.pop(self.key(SIGNATURE_KEY, bucket), None)
        save_npz_atomic(path, arrays)


def save_npz_atomic(path: str, arrays: dict) -> None:
    from library import files

    with files.atomic_target(path) as tmp, open(tmp, "wb") as f:  # each process its own temporary name
        np.savez(f, **arrays)


def _unscaled(t: torch.Tensor, scale: float) -> np.ndarray:
    t = t.detach().to("cpu", torch.float32)
    return (t / scale if scale != 1.0 else t).numpy()


# Per model family, as upstream names and scales them (SD/SDXL scale = the VAE's scaling factor; trainers pass
# the loaded VAE's own factor, see library.families.sd.sd_latent_cache_format).
FAMILY_FORMATS = {
    "sd1": LatentCacheFormat("_sd.npz", 0.18215),
    "sd2": LatentCacheFormat("_sd.npz", 0.18215),
    "sdxl": LatentCacheFormat("_sdxl.npz", 0.13025),
    "flux": LatentCacheFormat("_flux.npz", 1.0, multi_resolution=True, legacy_name=False),
    "sd3": LatentCacheFormat("_sd3.npz", 1.5305, multi_resolution=True, legacy_name=False, shift=0.0609),
}

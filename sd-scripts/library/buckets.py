"""Aspect-ratio buckets with kohya-ss/sd-scripts' rules (upstream `BucketManager`, `make_bucket_resolutions`,
`trim_and_resize_if_required`): which bucket an image goes to, the size it is resized to before the crop, and the
SDXL crop conditioning upstream feeds the UNet (the "fit-inside" offset, not where the crop really is).

Pure functions on sizes; no torch, no images (datasets.py applies them to pixels).
"""
from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

Size = tuple[int, int]  # (width, height)


def make_bucket_resolutions(max_reso: Size, min_size: int = 256, max_size: int = 1024, divisible: int = 64
                            ) -> list[Size]:
    """Upstream's predefined buckets: the square of the resolution's area (floored to `divisible`), plus for every
    width in [min_size, max_size] (step `divisible`) the tallest height with area <= max area, and its transpose."""
    max_area = max_reso[0] * max_reso[1]
    resos = set()
    side = int(math.sqrt(max_area) // divisible) * divisible
    resos.add((side, side))
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += divisible
    return sorted(resos)


def adjust_min_max_bucket_reso(min_reso: int, max_reso: int, steps: int) -> tuple[int, int]:
    """Upstream rounds min_bucket_reso down and max_bucket_reso up to a multiple of bucket_reso_steps (with a
    warning) instead of refusing them."""
    if min_reso % steps:
        adjusted = min_reso - min_reso % steps
        logger.warning("min_bucket_reso %d adjusted to %d (a multiple of bucket_reso_steps %d)", min_reso, adjusted,
                       steps)
        min_reso = adjusted
    if max_reso % steps:
        adjusted = max_reso + steps - max_reso % steps
        logger.warning("max_bucket_reso %d adjusted to %d (a multiple of bucket_reso_steps %d)", max_reso, adjusted,
                       steps)
        max_reso = adjusted
    return min_reso, max_reso


def round_to_steps(x: float, steps: int) -> int:
    x = int(x + 0.5)
    return x - x % steps


@dataclass
class BucketSelector:
    """Chooses (bucket, resized_size) per image. `predefined` buckets (enable_bucket without no_upscale, or the one
    fixed resolution without buckets) or, with `no_upscale`, a bucket from the image's own size."""

    max_reso: Size
    reso_steps: int = 64
    no_upscale: bool = False
    predefined: Optional[list[Size]] = None

    def __post_init__(self):
        if self.predefined is not None:
            self._predefined_set = set(self.predefined)
            self._ratios = [w / h for w, h in self.predefined]

    def select(self, width: int, height: int) -> tuple[Size, Size, float]:
        """-> (bucket (w, h), resized size (w, h) before the crop, aspect-ratio error bucket - image)."""
        aspect = width / height
        if not self.no_upscale:
            reso = (width, height)
            if reso not in self._predefined_set:
                # the first bucket with the smallest |ratio error| (numpy argmin order)
                errors = [abs(r - aspect) for r in self._ratios]
                reso = self.predefined[errors.index(min(errors))]
            if aspect > reso[0] / reso[1]:  # wider than the bucket: match heights
                scale = reso[1] / height
            else:
                scale = reso[0] / width
            resized = (int(width * scale + 0.5), int(height * scale + 0.5))
        else:
            max_area = self.max_reso[0] * self.max_reso[1]
            if width * height > max_area:
                # shrink to the max area keeping the aspect; round the side that keeps the aspect best
                rw = math.sqrt(max_area * aspect)
                rh = max_area / rw
                bw = round_to_steps(rw, self.reso_steps)
                bh_in_w = round_to_steps(bw / aspect, self.reso_steps)
                bh = round_to_steps(rh, self.reso_steps)
                bw_in_h = round_to_steps(bh * aspect, self.reso_steps)
                ar_w = bw / bh_in_w if bh_in_w else math.inf
                ar_h = bw_in_h / bh if bh else math.inf
                if abs(ar_w - aspect) < abs(ar_h - aspect):
                    resized = (bw, int(bw / aspect + 0.5))
                else:
                    resized = (int(bh * aspect + 0.5), bh)
            else:
                resized = (width, height)  # never upscaled
            reso = (resized[0] - resized[0] % self.reso_steps, resized[1] - resized[1] % self.reso_steps)
        # a side below the step is an empty bucket: the dataset refuses it with the image's name
        return reso, resized, (reso[0] / reso[1] - aspect) if min(reso) > 0 else math.inf


def trim_box(resized: Size, bucket: Size, rng: Optional[random.Random] = None) -> tuple[int, int, int, int]:
    """The crop (l, t, r, b) of the resized image to the bucket: centred, or random with `rng` (random_crop)."""
    left = top = 0
    if resized[0] > bucket[0]:
        extra = resized[0] - bucket[0]
        left = rng.randint(0, extra) if rng is not None else extra // 2
    if resized[1] > bucket[1]:
        extra = resized[1] - bucket[1]
        top = rng.randint(0, extra) if rng is not None else extra // 2
    return left, top, left + bucket[0], top + bucket[1]


def crop_ltrb(bucket: Size, image_size: Size) -> tuple:
    """Upstream's `get_crop_ltrb` (Stability AI's preprocessing): the offsets of the image *fitted inside* the
    bucket, whatever was really cropped. Values may be floats (as upstream writes them to the .npz)."""
    bucket_ar = bucket[0] / bucket[1]
    image_ar = image_size[0] / image_size[1]
    if bucket_ar > image_ar:
        rw, rh = bucket[1] * image_ar, bucket[1]
    else:
        rw, rh = bucket[0], bucket[0] / image_ar
    left = (bucket[0] - rw) // 2
    top = (bucket[1] - rh) // 2
    return left, top, left + rw, top + rh


def crop_top_left(ltrb, target_width: int, flipped: bool) -> tuple[int, int]:
    """SDXL `crop_top_lefts` entry (top, left) as upstream computes it; a flipped image uses width - right."""
    left = target_width - ltrb[2] if flipped else ltrb[0]
    return int(ltrb[1]), int(left)

"""Pixels with kohya-ss/sd-scripts' rules: loading (RGB, or RGBA for alpha masks), resizing (`--resize_interpolation`:
shrinking defaults to OpenCV's INTER_AREA, enlarging to PIL's LANCZOS, as upstream's `resize_image`), the face-centred
crop of `--face_crop_aug_range` and upstream's colour augmentation. Images are HxWxC uint8 numpy arrays here.
"""
from __future__ import annotations

import os
import random
from typing import Optional

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from library.dataset_files import DatasetError

# --resize_interpolation choices (upstream's argparse list); the dataset config also takes "box"
# (upstream's validate_interpolation_fn), which upstream resizes with PIL's BOX filter.
RESIZE_INTERPOLATIONS = ("lanczos", "nearest", "bilinear", "linear", "bicubic", "cubic", "area")
CONFIG_RESIZE_INTERPOLATIONS = RESIZE_INTERPOLATIONS + ("box",)

_PIL_FILTERS = {"lanczos": Image.Resampling.LANCZOS, "box": Image.Resampling.BOX}


def _cv2():
    try:
        import cv2
    except ImportError as e:  # a dependency of the project; only a broken install lacks it
        raise DatasetError("resizing images needs OpenCV: pip install opencv-python-headless") from e
    return cv2


def _cv2_flag(name: str) -> int:
    cv2 = _cv2()
    return {
        "nearest": cv2.INTER_NEAREST_EXACT, "bilinear": cv2.INTER_LINEAR, "linear": cv2.INTER_LINEAR,
        "bicubic": cv2.INTER_CUBIC, "cubic": cv2.INTER_CUBIC, "area": cv2.INTER_AREA,
    }[name]


def check_interpolation(value: Optional[str], where: str) -> Optional[str]:
    if value is not None and value not in CONFIG_RESIZE_INTERPOLATIONS:
        raise DatasetError(f"{where}: resize_interpolation must be one of {', '.join(CONFIG_RESIZE_INTERPOLATIONS)}, "
                           f"got {value!r}")
    return value


def choose_interpolation(src: tuple[int, int], dst: tuple[int, int], interpolation: Optional[str]) -> str:
    """Upstream's default: "area" when neither side grows, else "lanczos"."""
    if interpolation is not None:
        return interpolation
    return "area" if src[0] >= dst[0] and src[1] >= dst[1] else "lanczos"


def resize_image(image: np.ndarray, size: tuple[int, int], interpolation: Optional[str] = None) -> np.ndarray:
    """HxW[xC] uint8 -> size (w, h). lanczos and box go through PIL (RGBA with premultiplied alpha, as upstream),
    the others through cv2.resize."""
    h, w = image.shape[:2]
    size = (int(size[0]), int(size[1]))
    if (w, h) == size:
        return image
    name = choose_interpolation((w, h), size, interpolation)
    if name in _PIL_FILTERS:
        return np.asarray(Image.fromarray(image).resize(size, resample=_PIL_FILTERS[name]))
    return _cv2().resize(image, size, interpolation=_cv2_flag(name))


def load_image(path: str, alpha: bool = False) -> np.ndarray:
    """HxWx3 (RGB) or, with alpha, HxWx4 (RGBA; opaque images get alpha 255) uint8; EXIF orientation applied."""
    try:
        with Image.open(path) as img:
            img = ImageOps.exif_transpose(img)
            mode = "RGBA" if alpha else "RGB"
            return np.asarray(img if img.mode == mode else img.convert(mode)).copy()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise DatasetError(f"cannot read image {path}: {e}") from e


def to_tensor(image: np.ndarray):
    """HxWx3 uint8 -> FloatTensor[3, H, W] in [-1, 1]."""
    import torch

    return torch.from_numpy(np.require(image[:, :, :3], requirements=["C", "W"])).permute(2, 0, 1).float() / 127.5 - 1.0


# ----------------------------------------------------------------------------- face crop


def face_info_from_name(path: str) -> tuple[int, int, int, int]:
    """Upstream's face position in the file name: `<name>_<cx>_<cy>_<w>_<h>.<ext>`; zeros when absent."""
    tokens = os.path.splitext(os.path.basename(path))[0].split("_")
    if len(tokens) >= 5:
        try:
            return tuple(int(t) for t in tokens[-4:])
        except ValueError:
            pass  # upstream raises here; a name that merely has underscores has no face info
    return 0, 0, 0, 0


def face_crop_plan(image_size: tuple[int, int], target: tuple[int, int], face: tuple[int, int, int, int],
                   aug_range: tuple[float, float], random_crop: bool, rng: random.Random
                   ) -> tuple[tuple[int, int], tuple[int, int, int, int]]:
    """Upstream's `crop_target` as a plan -> (resized size (w, h), crop box (l, t, r, b)): scale so that the face
    spans 1/aug_range[1]..1/aug_range[0] of the shorter target side (never enlarging, except an image smaller than
    the target, which upstream refuses and we enlarge to cover), then cut `target` (w, h) around the face."""
    tw, th = target
    width, height = image_size
    if (width, height) == (tw, th):
        return (width, height), (0, 0, tw, th)
    face_cx, face_cy, face_w, face_h = face
    face_size = max(face_w, face_h)
    size = min(th, tw)
    cover = max(th / height, tw / width)
    min_scale = min(1.0, max(cover, size / (face_size * aug_range[1])))
    max_scale = min(1.0, max(min_scale, size / (face_size * aug_range[0])))
    scale = min_scale if min_scale >= max_scale else rng.uniform(min_scale, max_scale)
    scale = max(scale, cover)
    nw, nh = int(width * scale + 0.5), int(height * scale + 0.5)
    face_cx, face_cy = int(face_cx * scale + 0.5), int(face_cy * scale + 0.5)
    start = []
    for t, length, p in ((th, nh, face_cy), (tw, nw, face_cx)):
        p1 = p - t // 2  # the face in the middle
        if random_crop:
            span = max(length - p, p)  # include background: shift by a triangular -span..+span
            p1 = p1 + (rng.randint(0, span) + rng.randint(0, span)) - span
        elif aug_range[0] != aug_range[1] and face_size > size // 10 and face_size >= 40:
            p1 = p1 + rng.randint(-face_size // 20, face_size // 20)
        start.append(max(0, min(p1, length - t)))
    top, left = start
    return (nw, nh), (left, top, left + tw, top + th)


def parse_face_crop_aug_range(value, where: str) -> Optional[tuple[float, float]]:
    """'2.0,4.0' (CLI) or [2.0, 4.0] (TOML) -> (2.0, 4.0); None stays None."""
    if value is None or value == "":
        return None
    try:
        if isinstance(value, str):
            parts = tuple(float(v) for v in value.split(","))
        elif isinstance(value, (list, tuple)) and not any(isinstance(v, bool) for v in value):
            parts = tuple(float(v) for v in value)
        else:
            raise ValueError
    except ValueError:
        parts = ()
    if len(parts) != 2 or parts[0] > parts[1] or parts[0] <= 0:
        raise DatasetError(f"{where}: face_crop_aug_range must be two positive numbers 'low,high' with low <= high "
                           f"(like 2.0,4.0), got {value!r}")
    return parts


# ----------------------------------------------------------------------------- colour augmentation


def color_aug(image: np.ndarray, rng: random.Random) -> np.ndarray:
    """Upstream's `--color_aug`: a third of the time, either a hue shift of up to +-8 (of OpenCV's 180) or a gamma
    of 0.95..1.05, on the RGB channels."""
    if rng.random() > 0.33:
        return image
    cv2 = _cv2()
    rgb = np.ascontiguousarray(image[:, :, :3])
    if rng.random() > 0.5:
        # upstream hands RGB pixels to a BGR conversion; the same here, so the same hues move the same way
        hsv = cv2.cvtColor(rgb, cv2.COLOR_BGR2HSV)
        shift = rng.uniform(-8, 8)
        if shift < 0:
            shift = 180 + shift
        hsv[:, :, 0] = (hsv[:, :, 0] + shift) % 180
        rgb = cv2.cvtColor(hsv, cv2.COLOR_HSV2BGR)
    else:
        gamma = rng.uniform(0.95, 1.05)
        rgb = np.clip(rgb.astype(np.float64) ** gamma, 0, 255).astype(np.uint8)
    out = image.copy()
    out[:, :, :3] = rgb
    return out

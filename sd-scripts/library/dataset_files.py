"""Image files (no torch here, so command-line tools start fast); caption files: library/captions.py."""
from __future__ import annotations

import logging
import os
from typing import Optional

from PIL import Image, UnidentifiedImageError
from library.errors import DatasetError  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_EXIF_ORIENTATION = 0x0112


def is_image_file(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def list_images(directory: str, recursive: bool = False) -> list[str]:
    """Image files in a directory, sorted (hidden files skipped)."""
    if not os.path.isdir(directory):
        raise DatasetError(f"image folder does not exist: {directory}")
    found = []
    if recursive:
        for root, dirs, files in os.walk(directory):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            found.extend(os.path.join(root, f) for f in files if is_image_file(f) and not f.startswith("."))
    else:
        for f in os.listdir(directory):
            p = os.path.join(directory, f)
            if is_image_file(f) and not f.startswith(".") and os.path.isfile(p):
                found.append(p)
    return sorted(found)


def read_image_size(path: str) -> tuple[int, int]:
    """(w, h) as the image will be seen (EXIF orientation applied), reading only the header."""
    try:
        with Image.open(path) as img:
            w, h = img.size
            orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise DatasetError(f"cannot read image {path}: {e}") from e
    if w <= 0 or h <= 0:
        raise DatasetError(f"image has no pixels: {path}")
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)

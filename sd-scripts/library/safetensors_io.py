"""Reading .safetensors model files, with kohya-ss/sd-scripts' `--disable_mmap_load_safetensors`.

By default safetensors memory-maps the file and the tensors are paged in as they are read. With the option the
whole file is read into memory in one go and the tensors are built from those bytes (upstream's remedy for slow
memory-mapped reads on WSL and some network drives). Single-file models (SD/SDXL checkpoints, the FLUX.1
transformer, CLIP-L, T5-XXL, AE) are read through `load_file`; diffusers folders are read by diffusers.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os

logger = logging.getLogger(__name__)

_mmap = True


def add_mmap_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--disable_mmap_load_safetensors", action="store_true",
                        help="read .safetensors model files into memory in one go instead of memory-mapping them "
                             "(faster on WSL and some network drives)")


@contextlib.contextmanager
def mmap_setting(args):
    """The models loaded inside follow the run's --disable_mmap_load_safetensors."""
    global _mmap
    saved = _mmap
    _mmap = not getattr(args, "disable_mmap_load_safetensors", False)
    if not _mmap:
        logger.info("--disable_mmap_load_safetensors: model files are read into memory without mmap")
    try:
        yield
    finally:
        _mmap = saved


def load_file(path: str | os.PathLike, device: str = "cpu", keep=None) -> dict:
    """safetensors.torch.load_file, or (mmap off) the file's bytes read at once and parsed. `keep(key)`: only those
    tensors (with mmap the others are never read: HunyuanImage's Qwen2.5-VL file carries a vision tower)."""
    import safetensors.torch

    if _mmap and keep is not None:
        from safetensors import safe_open

        with safe_open(str(path), "pt", device=device) as f:
            return {k: f.get_tensor(k) for k in f.keys() if keep(k)}
    if keep is not None:
        return {k: v for k, v in load_file(path, device).items() if keep(k)}
    if _mmap:
        return safetensors.torch.load_file(str(path), device=device)
    with open(path, "rb") as f:
        data = f.read()
    sd = safetensors.torch.load(data)
    return sd if device == "cpu" else {k: v.to(device) for k, v in sd.items()}

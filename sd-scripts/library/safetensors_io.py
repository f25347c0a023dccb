"""Reading .safetensors model files, with kohya-ss/sd-scripts' `--disable_mmap_load_safetensors`; writing one
without a copy of the model, from the GPU or the CPU, atomically (`save_file_streamed`).

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


# torch dtype (its name without "torch.") -> safetensors name, in the library's Dtype order (its writer puts the
# larger ones first, so that each tensor stays aligned); both writers here and library.saving's use it
_ST_DTYPES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
              "int16": "I16", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "float32": "F32",
              "float64": "F64", "int64": "I64"}
_ST_RANK = {name: i for i, name in enumerate(_ST_DTYPES)}


def dtype_name(dtype) -> str | None:
    """The safetensors name of a torch dtype (F16, BF16, F8_E4M3...), None where the format cannot store it."""
    return _ST_DTYPES.get(str(dtype).removeprefix("torch."))


def header_bytes(items, metadata: dict[str, str] | None = None) -> bytes:
    """A .safetensors file's start (its 8-byte length and JSON header, padded so the data starts 8-byte aligned)
    for (name, torch dtype, shape) items stored in that order."""
    import json
    import math
    import struct

    import torch

    header, offset = ({"__metadata__": dict(metadata)} if metadata else {}), 0
    for name, dtype, shape in items:
        if dtype_name(dtype) is None:
            raise ValueError(f"{name}: dtype {dtype} cannot be stored in safetensors")
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def can_stream(tensors: dict, float_dtype=None) -> bool:
    """save_file_streamed writes these dtypes."""
    out = [float_dtype if float_dtype is not None and v.is_floating_point() else v.dtype for v in tensors.values()]
    return all(dtype_name(d) is not None for d in out)


def save_file_streamed(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None, *,
                       float_dtype=None, chunk_bytes: int = 64 << 20, overwrite: bool = True) -> None:
    """safetensors.torch.save_file without a copy of the whole model (floating tensors cast to `float_dtype` where
    they are, on a GPU there): the library's file layout (its tensor order and header), the bytes passing through
    two reusable buffers (pinned for a GPU), a thread writing one while the other fills. save_file needs the
    tensors on the CPU and copies every byte once more before the write.

    Written to a temporary file beside `path` and renamed over it when complete (library.files.atomic_target): a
    model memory-mapped from `path` itself (safetensors' load_file) reads its old bytes throughout, and a save
    that fails leaves `path` as it was."""
    from library import files

    with files.atomic_target(path, overwrite=overwrite) as tmp:
        _write_streamed(tensors, tmp, metadata, float_dtype, chunk_bytes)


def _write_streamed(tensors: dict, path: str, metadata: dict[str, str] | None, float_dtype, chunk_bytes: int) -> None:
    import queue
    import threading

    import torch

    def out_dtype(v):
        return float_dtype if float_dtype is not None and v.is_floating_point() else v.dtype

    # the library's order (its Dtype order, larger first: each tensor stays aligned), then by name
    items = sorted(tensors.items(), key=lambda kv: (-_ST_RANK[str(out_dtype(kv[1])).removeprefix("torch.")], kv[0]))
    head = header_bytes([(name, out_dtype(v), v.shape) for name, v in items], metadata)
    pin = torch.cuda.is_available() and any(v.is_cuda for v in tensors.values())
    free: queue.Queue = queue.Queue()
    full: queue.Queue = queue.Queue()
    for _ in range(2):
        free.put(torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=pin))
    failed: list[BaseException] = []

    with open(path, "wb") as f:
        def write():
            while (item := full.get()) is not None:
                buf, n = item
                try:
                    if not failed:
                        f.write(buf[:n].numpy())
                except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                    failed.append(e)
                free.put(buf)

        f.write(head)
        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            buf, filled = free.get(), 0  # small tensors share a buffer: one write for many
            for _, v in items:
                flat = v.detach().to(out_dtype(v)).contiguous().reshape(-1).view(torch.uint8)
                start = 0
                while start < flat.numel():
                    n = min(chunk_bytes - filled, flat.numel() - start)
                    buf[filled:filled + n].copy_(flat[start:start + n])
                    filled, start = filled + n, start + n
                    if filled == chunk_bytes:
                        full.put((buf, filled))
                        buf, filled = free.get(), 0
                        if failed:
                            raise failed[0]
            if filled:
                full.put((buf, filled))
        finally:
            full.put(None)
            writer.join()
        if failed:
            raise failed[0]

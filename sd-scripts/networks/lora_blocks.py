"""Per-block LoRA ranks and learning rates of the SD1.x/SD2.x/SDXL UNet (`networks.lora` --network_args
`block_dims`, `block_alphas`, `conv_block_dims`, `conv_block_alphas`, `down_lr_weight`, `mid_lr_weight`,
`up_lr_weight`, `block_lr_zero_threshold`), following sd-scripts' numbering of the blocks:

- SD1.x/SD2.x (diffusers module names): 25 blocks. `down_blocks_i_{resnets,attentions}_j` is block 1 + 3i + j,
  `down_blocks_i_downsamplers_0` block 1 + 3i + 2, the same for `up_blocks` from 13, `mid_block` is 12
  (block 0 exists in the lists but holds no LoRA).
- SDXL (SGM module names): 23 blocks. `input_blocks_N` is 1 + N, `middle_block_N` 10 + N, `output_blocks_N`
  13 + N; 0 (time/label embedding) and 22 (out) hold no LoRA in the default targets.

The lr weight lists are down (12 or 9 values, shallow to deep), mid (1 or 3), up (12 or 9, deep to shallow); a
down/up weight may also be a curve name `cosine`, `sine`, `linear`, `reverse_linear`, `zeros`, optionally
`+<base>` (e.g. `sine+0.5`). A block whose weight is 0 (or at most `block_lr_zero_threshold`) gets no LoRA.
"""
from __future__ import annotations

import logging
import math
import re
from library.errors import BlockArgsError  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

SD_BLOCKS_PER_SIDE, SD_MID_BLOCKS = 12, 1
SDXL_BLOCKS_PER_SIDE, SDXL_MID_BLOCKS = 9, 3
LR_WEIGHT_CURVES = ("cosine", "sine", "linear", "reverse_linear", "zeros")

_SD_UPDOWN = re.compile(r"(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_")


def sizes(is_sdxl: bool) -> tuple[int, int]:
    """(blocks per side, mid blocks)."""
    return (SDXL_BLOCKS_PER_SIDE, SDXL_MID_BLOCKS) if is_sdxl else (SD_BLOCKS_PER_SIDE, SD_MID_BLOCKS)


def num_blocks(is_sdxl: bool) -> int:
    """Entries of block_dims / block_alphas: 23 for SDXL (embedding + 9 + 3 + 9 + out), 25 for SD."""
    side, mid = sizes(is_sdxl)
    return side * 2 + mid + (2 if is_sdxl else 0)


def block_index(lora_name: str, is_sdxl: bool) -> int:
    """The block a UNet LoRA module belongs to; -1 when the name is not in a numbered block."""
    if is_sdxl:
        if not lora_name.startswith("lora_unet_"):
            return -1
        name = lora_name[len("lora_unet_"):]
        for prefix, base in (("input_blocks_", 1), ("middle_block_", 10), ("output_blocks_", 13)):
            if name.startswith(prefix):
                return base + int(name[len(prefix):].split("_")[0])
        if name.startswith(("time_embed_", "label_emb_")):
            return 0
        if name.startswith("out_"):
            return 22
        return -1
    m = _SD_UPDOWN.search(lora_name)
    if m:
        side, i, kind, j = m.group(1), int(m.group(2)), m.group(3), int(m.group(4))
        idx = 3 * i + (2 if kind in ("upsamplers", "downsamplers") else j)
        return 1 + idx if side == "down" else SD_BLOCKS_PER_SIDE + 1 + idx
    if "mid_block_" in lora_name:
        return SD_BLOCKS_PER_SIDE
    return -1


def _floats(key: str, text: str, empty_as_zero: bool = False) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part and empty_as_zero:
            out.append(0.0)
            continue
        try:
            out.append(float(part))
        except ValueError as e:
            raise BlockArgsError(f"--network_args {key}={text}: {part!r} is not a number") from e
    return out


def _ints(key: str, text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",")]
    except ValueError as e:
        raise BlockArgsError(f"--network_args {key}={text}: comma-separated integers expected") from e


def _curve(key: str, text: str, n: int) -> list[float]:
    """`sine+0.5` -> n values of the curve (shallow to deep) plus the base."""
    name, _, base_text = text.partition("+")
    try:
        base = float(base_text) if base_text else 0.0
    except ValueError as e:
        raise BlockArgsError(f"--network_args {key}={text}: the part after + must be a number") from e
    steps = [i / (n - 1) for i in range(n)]
    curves = {
        "cosine": [math.sin(math.pi * s / 2) for s in reversed(steps)],
        "sine": [math.sin(math.pi * s / 2) for s in steps],
        "linear": steps,
        "reverse_linear": list(reversed(steps)),
        "zeros": [0.0] * n,
    }
    if name not in curves:
        raise BlockArgsError(f"--network_args {key}={text}: a comma-separated list of numbers or one of "
                             f"{', '.join(LR_WEIGHT_CURVES)} (optionally +base, e.g. sine+0.5)")
    return [v + base for v in curves[name]]


def _fit(key: str, values: list[float], n: int, quiet: bool) -> list[float]:
    """Too long: cut; too short: filled with 1.0 (as sd-scripts does, with a warning)."""
    if len(values) > n:
        if not quiet:
            logger.warning("%s has %d values; only the first %d are used", key, len(values), n)
        return values[:n]
    if len(values) < n:
        if not quiet:
            logger.warning("%s has %d values; the missing %d are 1.0", key, len(values), n - len(values))
        return values + [1.0] * (n - len(values))
    return values


def block_lr_weights(is_sdxl: bool, kwargs: dict, quiet: bool = False) -> list[float] | None:
    """The lr multiplier of every block (num_blocks(is_sdxl) values), or None when no *_lr_weight is given.
    The list is indexed by block_index: down value i belongs to block i (sd-scripts' IN00..IN11, where IN00
    holds no LoRA), mid to 12 (SDXL 10-12), up value i to 13 + i."""
    down, mid, up = (kwargs.get(k) for k in ("down_lr_weight", "mid_lr_weight", "up_lr_weight"))
    if down is None and mid is None and up is None:
        return None
    side, n_mid = sizes(is_sdxl)
    threshold = float(kwargs.get("block_lr_zero_threshold") or 0.0)

    def side_weights(key, text):
        if text is None:
            return [1.0] * side
        values = _floats(key, text, empty_as_zero=True) if "," in text else _curve(key, text, side)
        return [w if w > threshold else 0.0 for w in _fit(key, values, side, quiet)]

    mid_w = [1.0] * n_mid if mid is None else [
        w if w > threshold else 0.0 for w in _fit("mid_lr_weight", _floats("mid_lr_weight", mid, True), n_mid, quiet)]
    weights = side_weights("down_lr_weight", down) + mid_w + side_weights("up_lr_weight", up)
    if is_sdxl:
        weights = [1.0] + weights + [1.0]  # embedding and out blocks
    if not quiet:
        logger.info("block lr weights (down shallow->deep, mid, up deep->shallow): %s", weights)
    return weights


def block_dims_alphas(is_sdxl: bool, kwargs: dict, dim: int, alpha: float, conv_dim: int | None,
                      conv_alpha: float | None, lr_weights: list[float] | None):
    """(block_dims, block_alphas, conv_block_dims or None, conv_block_alphas or None); blocks whose lr weight
    is 0 get dim 0 (no LoRA)."""
    n = num_blocks(is_sdxl)

    def exact(key, values):
        if len(values) != n:
            raise BlockArgsError(f"--network_args {key}: {n} values expected for this model, got {len(values)}")
        return values

    dims = exact("block_dims", _ints("block_dims", kwargs["block_dims"])) if kwargs.get("block_dims") else [dim] * n
    alphas = exact("block_alphas", _floats("block_alphas", kwargs["block_alphas"])) \
        if kwargs.get("block_alphas") else [alpha] * n
    conv_dims = conv_alphas = None
    if kwargs.get("conv_block_dims"):
        conv_dims = exact("conv_block_dims", _ints("conv_block_dims", kwargs["conv_block_dims"]))
        conv_alphas = exact("conv_block_alphas", _floats("conv_block_alphas", kwargs["conv_block_alphas"])) \
            if kwargs.get("conv_block_alphas") else [conv_alpha if conv_alpha is not None else 1.0] * n
    elif conv_dim:
        conv_dims, conv_alphas = [conv_dim] * n, [conv_alpha] * n
    if lr_weights is not None:
        for i, w in enumerate(lr_weights):
            if w == 0:
                dims[i] = 0
                if conv_dims is not None:
                    conv_dims[i] = 0
    return dims, alphas, conv_dims, conv_alphas

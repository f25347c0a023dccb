"""Text-encoder output cache files (`--cache_text_encoder_outputs_to_disk`) in kohya-ss/sd-scripts' format where
upstream has one, so that either program reuses the other's files:

- SDXL `<stem>_te_outputs.npz`: `hidden_state1` [L, 768] (CLIP-L), `hidden_state2` [L, 1280] (OpenCLIP-G), `pool2`;
- FLUX.1 `<stem>_flux_te.npz`: `l_pooled`, `t5_out`, `txt_ids` (zeros [L, 3]), `t5_attn_mask`, `apply_t5_attn_mask`;
- SD1.x/2.x (upstream caches none): `<stem>_te_outputs.npz` with the trainer's own output names.

We add `__caption__` and `__signature__`, so our files are encoded again when the caption or the model changes;
upstream's files lack them and are trusted as upstream trusts them (it checks the keys only).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from library.latent_cache import save_npz_atomic

logger = logging.getLogger(__name__)

CAPTION_KEY, SIGNATURE_KEY = "__caption__", "__signature__"


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().to("cpu")
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()


@dataclass(frozen=True)
class TeCacheFormat:
    suffix: str = "_te_outputs.npz"
    required: tuple = ()  # keys upstream's reader needs; () = our own layout (output names as keys)
    to_file: Optional[Callable[[dict], dict]] = None  # one caption's outputs -> arrays
    from_file: Optional[Callable[[dict], dict]] = None  # arrays -> outputs
    fixed: dict = field(default_factory=dict)  # keys whose stored value must equal this (FLUX apply_t5_attn_mask)

    def npz_path(self, image_path: str) -> str:
        return os.path.splitext(image_path)[0] + self.suffix

    def is_expected(self, path: str, caption: str, signature: str, skip_check: bool = False) -> bool:
        if not os.path.isfile(path):
            return False
        if skip_check:
            return True
        try:
            with np.load(path) as npz:
                if self.required:
                    if any(k not in npz for k in self.required):
                        return False
                elif CAPTION_KEY not in npz:  # our own layout is always written with the caption
                    return False
                if any(k not in npz or npz[k].item() != v for k, v in self.fixed.items()):
                    return False
                if CAPTION_KEY in npz and str(npz[CAPTION_KEY]) != caption:
                    return False
                return SIGNATURE_KEY not in npz or str(npz[SIGNATURE_KEY]) == signature
        except (OSError, ValueError, EOFError) as e:
            logger.warning("ignoring unreadable text encoder cache %s (%s); encoding again", path, e)
            return False

    def save(self, path: str, outputs: dict, caption: str, signature: str) -> None:
        arrays = self.to_file(outputs) if self.to_file else {k: _numpy(v) for k, v in outputs.items()}
        arrays.update({k: np.array(v) for k, v in self.fixed.items()})
        arrays[CAPTION_KEY] = np.array(caption)
        arrays[SIGNATURE_KEY] = np.array(signature)
        save_npz_atomic(path, arrays)

    def load(self, path: str) -> dict:
        with np.load(path) as npz:
            arrays = {k: npz[k] for k in npz.files if not k.startswith("__") and k not in self.fixed}
        if self.from_file:
            return self.from_file(arrays)
        return {k: torch.from_numpy(v) for k, v in arrays.items()}


def sdxl_format(te1_width: int) -> TeCacheFormat:
    """Our SDXL outputs are {"encoder_hidden_states": [L, w1 + w2] (both encoders concatenated), "pooled"}."""
    def to_file(o):
        h = _numpy(o["encoder_hidden_states"])
        return {"hidden_state1": h[..., :te1_width], "hidden_state2": h[..., te1_width:], "pool2": _numpy(o["pooled"])}

    def from_file(a):
        h = np.concatenate([a["hidden_state1"], a["hidden_state2"]], axis=-1)
        return {"encoder_hidden_states": torch.from_numpy(h), "pooled": torch.from_numpy(a["pool2"])}

    return TeCacheFormat("_te_outputs.npz", ("hidden_state1", "hidden_state2", "pool2"), to_file, from_file)


def flux_format(apply_t5_attn_mask: bool) -> TeCacheFormat:
    """Our FLUX outputs are {"t5_out": [L, D], "pooled": [768], "t5_attn_mask": [L]}."""
    def to_file(o):
        t5 = _numpy(o["t5_out"])
        return {"l_pooled": _numpy(o["pooled"]), "t5_out": t5, "txt_ids": np.zeros((t5.shape[0], 3), np.float32),
                "t5_attn_mask": _numpy(o["t5_attn_mask"])}

    def from_file(a):
        return {"t5_out": torch.from_numpy(a["t5_out"]), "pooled": torch.from_numpy(a["l_pooled"]),
                "t5_attn_mask": torch.from_numpy(a["t5_attn_mask"])}

    return TeCacheFormat("_flux_te.npz", ("l_pooled", "t5_out", "txt_ids", "t5_attn_mask"), to_file, from_file,
                         {"apply_t5_attn_mask": bool(apply_t5_attn_mask)})

"""SD1.x / SD2.x / SDXL model loading and saving (single-file SGM/LDM layout and diffusers folders)."""
from __future__ import annotations

import json
from pathlib import Path

SD_FAMILIES = ("sd1", "sd2", "sdxl")
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_COMPONENTS = {
    "sd1": ("unet", "vae", "text_encoder"),
    "sd2": ("unet", "vae", "text_encoder"),
    "sdxl": ("unet", "vae", "text_encoder", "text_encoder_2"),
}


def load_arch_config(family: str, component: str) -> dict:
    """The shipped architecture config (diffusers/transformers config.json) of a model family's component."""
    if family not in _COMPONENTS:
        raise ValueError(f"unknown model family {family!r}; allowed: {', '.join(SD_FAMILIES)}")
    if component not in _COMPONENTS[family]:
        raise ValueError(f"unknown component {component!r} for {family}; allowed: {', '.join(_COMPONENTS[family])}")
    with open(CONFIG_DIR / family / component / "config.json", encoding="utf-8") as f:
        return json.load(f)

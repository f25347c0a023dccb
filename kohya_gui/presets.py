"""presets/<tab>/*.toml: the same format as Save configuration."""

from __future__ import annotations

from pathlib import Path

from . import PRESETS

DEFAULT_PRESET = "demo-sdxl-tiny"  # what each tab opens with


def preset_dir(tab: str) -> Path:
    return PRESETS / tab


def list_presets(tab: str) -> list[str]:
    """Preset names (file stems) of a tab, demos first, then alphabetical."""
    names = [p.stem for p in preset_dir(tab).glob("*.toml")]
    return sorted(names, key=lambda n: (not n.startswith("demo"), n))


def preset_path(tab: str, name: str) -> Path:
    path = preset_dir(tab) / f"{name}.toml"
    if not path.is_file():
        raise FileNotFoundError(f"no preset {name!r} for the {tab} tab; available: {', '.join(list_presets(tab))}")
    return path


def user_config_path(tab: str, name: str) -> str:
    """Where Save puts a configuration that started from a preset (presets themselves stay untouched)."""
    return str(Path("configs") / tab / f"{name}.toml")

"""presets/<tab>/*.toml: the same format as Save configuration."""

from __future__ import annotations

from pathlib import Path

from . import PRESETS

DEFAULT_PRESET = "demo-sdxl-tiny"  # what each tab opens with
KOHYA_SS = "kohya_ss: "  # dropdown entries of kohya_ss' own presets (presets/kohya_ss/<tab>/*.json, imported)
SAVED = "saved: "  # dropdown entries of the user's saved configurations (configs/<tab>/*.toml)


def preset_dir(tab: str) -> Path:
    return PRESETS / tab


def list_presets(tab: str) -> list[str]:
    """Preset names (file stems) of a tab, demos first, then alphabetical."""
    names = [p.stem for p in preset_dir(tab).glob("*.toml")]
    return sorted(names, key=lambda n: (not n.startswith("demo"), n))


def dropdown_choices(tab: str) -> list[str]:
    """The preset dropdown: our presets, kohya_ss' presets (imported when chosen) and the user's saved configs."""
    kohya = sorted(p.stem for p in (PRESETS / "kohya_ss" / tab).glob("*.json"))
    saved = sorted(p.stem for p in (Path("configs") / tab).glob("*.toml"))
    return list_presets(tab) + [KOHYA_SS + n for n in kohya] + [SAVED + n for n in saved]


def preset_path(tab: str, name: str) -> Path:
    if name.startswith(KOHYA_SS):
        path = PRESETS / "kohya_ss" / tab / f"{name.removeprefix(KOHYA_SS)}.json"
    elif name.startswith(SAVED):
        path = Path("configs") / tab / f"{name.removeprefix(SAVED)}.toml"
    else:
        path = preset_dir(tab) / f"{name}.toml"
    if not path.is_file():
        raise FileNotFoundError(f"no preset {name!r} for the {tab} tab; available: {', '.join(list_presets(tab))}")
    return path


def user_config_path(tab: str, name: str) -> str:
    """Where Save puts a configuration that started from a preset (presets themselves stay untouched)."""
    return str(Path("configs") / tab / f"{name.removeprefix(KOHYA_SS).removeprefix(SAVED)}.toml")


def resolve(arg: str) -> Path:
    """A configuration argument of the command line: a file, a preset name (`demo-sdxl-tiny`: the first tab that
    has it, LoRA first) or `<tab>/<name>` (`dreambooth/demo-sdxl-tiny`). FileNotFoundError names the choices."""
    from .params import TABS

    path = Path(arg)
    if path.is_file() or path.suffix == ".toml" or len(path.parts) > 2:
        return path  # a path (a missing one is reported by the loader, with its name)
    tab, _, name = arg.rpartition("/")
    for t in ([tab] if tab in TABS else TABS if not tab else []):
        candidate = preset_dir(t) / f"{name}.toml"
        if candidate.is_file():
            return candidate
    known = ", ".join(f"{t}/{n}" for t in TABS for n in list_presets(t))
    raise FileNotFoundError(f"{arg}: not a file and not a preset; presets: {known}")

"""Shared helpers for the GUI tests (not a test module)."""

from __future__ import annotations

import time

import psutil

from kohya_gui import params as P
from kohya_gui.ui import actions as A

NON_DEFAULT_TEXT = {
    "resolution": "768,640",
    "caption_extension": ".txt",
    "gpu_ids": "0,1",
    "main_process_ip": "10.0.0.2",
    "output_name": "my lora 'quoted'",
    "additional_parameters": "--validate_only",  # a flag of every script that no registry option sets
}


def non_default(p: P.Param, tab: str | None = None):
    """A valid value different from the parameter's default."""
    default = p.default_for(tab)
    if p.kind == "bool":
        return not default
    if p.kind in ("int", "float") and p.choices:
        return next(c for c in p.choices if c != default)
    if p.kind == "int":
        base = default if default is not None else int(p.minimum or 1)
        return base + 3
    if p.kind == "float":
        return 0.25 if default is None else float(default) * 2 + 0.5
    if p.kind == "choice":
        return next(c for c in reversed(p.choices_for(tab)) if c != default)
    if p.kind == "list":
        return ["0.5", "0.25"] if p.item_kind != "str" else ["alpha=1", "beta=0.9,0.99"]
    if p.kind == "path":
        return f"/data/models dir/{p.name}.safetensors"
    if p.kind == "dir":
        return f"/data/folder with spaces/{p.name}"
    return NON_DEFAULT_TEXT.get(p.name, f"value-{p.name}")


def all_non_default(tab: str, family: str) -> dict:
    values = P.defaults(tab)
    for p in P.params_for(tab, family):
        if p.has_control:
            values[p.name] = non_default(p, tab)
    return values


def ui_values(tab: str, values: dict) -> list:
    """What the controls would send for these values (tab_params order)."""
    return [A.to_ui(p, values.get(p.name, p.default)) for p in A.tab_params(tab)]


def ui_values_from_updates(tab: str, updates: list) -> list:
    """Control values out of open_config's updates ([status, family, *controls, ...])."""
    n = len(A.tab_params(tab))
    return [u["value"] for u in updates[2:2 + n]]


def wait_for(cond, timeout: float = 60.0) -> bool:
    """Polls `cond` until it is true (True) or `timeout` seconds pass (False)."""
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

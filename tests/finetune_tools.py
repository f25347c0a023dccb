"""Loads a sd-scripts/finetune/ tool as a module (its `cli(argv)` runs it in-process, returning the exit code)."""
from __future__ import annotations

import importlib.util

from kohya_gui import REPO

FINETUNE = REPO / "sd-scripts" / "finetune"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, FINETUNE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

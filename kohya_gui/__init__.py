"""Gradio GUI over the bundled sd-scripts trainers. Talks to them only through the command line and TOML files."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRESETS = REPO / "presets"

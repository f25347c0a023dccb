"""Options that hold secrets (access tokens, API keys): never written into a file or a printed command.

A value typed into the GUI (or read from a TOML that has one) stays in memory: Save configuration, the run's TOML,
the last used settings, queue entries and the printed commands leave it out, and a run gets it in its environment
under the name its library reads by itself (HF_TOKEN for huggingface_hub, WANDB_API_KEY for wandb). The usual
way is to set that variable before starting the GUI, or to log in once with `huggingface-cli login` / `wandb login`
(both keep the key in a file only you can read).
"""

from __future__ import annotations

import shlex
from typing import Any

# option -> the environment variable its library reads
SECRET_OPTIONS = {"huggingface_token": "HF_TOKEN", "wandb_api_key": "WANDB_API_KEY"}


def without_secrets(values: dict[str, Any]) -> dict[str, Any]:
    """The values with every secret option emptied (what files and printed commands get)."""
    return {k: ("" if k in SECRET_OPTIONS and v else v) for k, v in values.items()}


def given(values: dict[str, Any]) -> list[str]:
    return [k for k in SECRET_OPTIONS if values.get(k)]


def secret_env(values: dict[str, Any]) -> dict[str, str]:
    """The environment entries that hand the run the secrets set in `values`."""
    return {SECRET_OPTIONS[k]: str(values[k]) for k in given(values)}


def note(values: dict[str, Any]) -> str:
    """A line for the user when secrets were left out of what was written or printed ("" when none)."""
    names = given(values)
    if not names:
        return ""
    return ("Not written or printed: " + ", ".join(f"{k} (the run gets it as ${SECRET_OPTIONS[k]})" for k in names)
            + ". Set the variable before starting the GUI, or log in with `huggingface-cli login` / `wandb login`, "
              "to keep it across restarts.")


def flags_in(additional_parameters: str) -> list[str]:
    """Secret flags typed into "Additional parameters" (they would be written and printed)."""
    try:
        tokens = shlex.split(additional_parameters or "")
    except ValueError:
        return []
    return [t.split("=", 1)[0] for t in tokens if t.split("=", 1)[0] in {f"--{k}" for k in SECRET_OPTIONS}]


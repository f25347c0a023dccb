"""Start and Print ask the trainer itself whether a run can work: `<script> <flags> --validate_only`.

The script checks its options, config files, paths, dataset, compile settings and optional packages and exits
without loading a model (sd-scripts/library/validate_only.py). Going through the command line keeps the rule that
the GUI never imports sd-scripts, and the checks are exactly the ones a real run makes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from . import REPO, command, demo
from .runner import run_env

TIMEOUT_S = 180


def problems(tab: str, family: str, values: dict[str, Any]) -> list[str]:
    """The trainer's problems with these settings (empty when it says ok). Paths that the embedded demo makes on
    the run's first start are not problems yet."""
    argv = [sys.executable, str(REPO / "sd-scripts" / command.P.script_for(tab, family)),
            *command.trainer_args(tab, family, values), "--validate_only"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=run_env(),
                              cwd=os.getcwd())
    except subprocess.TimeoutExpired:
        return [f"the trainer's check (--validate_only) did not answer within {TIMEOUT_S} s"]
    if proc.returncode == 0:
        return []
    found = parse_errors(proc.stderr) or [f"the trainer's check failed (exit status {proc.returncode}): "
                                          + (proc.stderr.strip().splitlines() or ["no message"])[-1]]
    made_by_demo = tuple(f"--{name}:" for name in demo.missing_demo_paths(family, values))
    return [p for p in found if not (made_by_demo and p.startswith(made_by_demo))]


def parse_errors(stderr: str) -> list[str]:
    """The problems in the trainer's `error: ...` output: one line, or a list of `- ` lines under a heading."""
    lines = stderr.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("error: "):
            rest = [ln[2:] for ln in lines[i + 1:] if ln.startswith("- ")]
            return rest or [line[len("error: "):]]
    return []

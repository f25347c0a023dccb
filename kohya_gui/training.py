"""Starting a run from registry values: the GUI's Start button and `python -m kohya_gui train` share this."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import command, config_file, demo, secret_options, trainer_check
from .runner import Runner, run_env, training_env  # noqa: F401  (run_env re-exported)


class RunError(ValueError):
    """Settings that cannot be run; the message says what to fix."""


def start(runner: Runner, tab: str, family: str, values: dict[str, Any]) -> list[str]:
    """Validates, writes the run's TOML into the output folder, starts the run. Returns the argv it runs.
    Raises RunError (bad settings) or RunnerBusy (a run is active)."""
    errors = command.validation_errors(tab, family, values)
    if errors:
        raise RunError("Cannot start training:\n" + "\n".join(f"- {e}" for e in errors))
    with runner.reserved():  # RunnerBusy before any file is touched
        return _checked_start(runner, tab, family, values)


def _checked_start(runner: Runner, tab: str, family: str, values: dict[str, Any]) -> list[str]:
    existing = command.existing_result(values)
    if existing and not values.get("overwrite_output"):
        raise RunError(f"{existing} already exists; change the output name, or tick 'Overwrite existing result'")
    problems = trainer_check.problems(tab, family, values)
    if problems:
        raise RunError("Cannot start training: the trainer found these problems:\n"
                       + "\n".join(f"- {p}" for p in problems))
    config_path = command.run_config_path(values)
    try:
        config_file.save(config_path, tab, family, values, run_record=True)
    except (OSError, config_file.ConfigError) as e:
        raise RunError(f"Cannot write the run configuration {config_path}: {e}") from e
    argv = command.build_argv(tab, family, values, config_path)
    (Path(config_path).with_suffix(".command.txt")).write_text(command.printable(argv) + "\n", encoding="utf-8")
    commands = demo.prepare_commands(family, values, config_path) + [argv]
    env = {**run_env(), **secret_options.secret_env(values)}  # never in the TOML or the command
    runner.start(commands, command.log_path(values), env=env, output_dir=values.get("output_dir"),
                 cwd=os.getcwd(), config_path=config_path)
    return argv

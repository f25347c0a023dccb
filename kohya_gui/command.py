"""Registry values -> the training command (an argv list, never a shell string).

The command is ``accelerate launch <launch options> sd-scripts/<script>.py --config_file <run TOML>``; the run
TOML (same format as Save configuration) is written into the output folder when a run starts, so every result
sits next to the exact settings that made it. The printable command is the same argv quoted for a POSIX shell
(``shlex.join``) or for Windows cmd.exe / PowerShell (kohya_gui.quoting), the machine's own by default.
"""

from __future__ import annotations

import difflib
import os
import shlex
from pathlib import Path
from typing import Any

from . import REPO, quoting, secret_options
from . import params as P


def run_config_path(values: dict[str, Any]) -> Path:
    """Where a run's TOML goes: <output_dir>/<output_name>.toml."""
    return Path(values.get("output_dir") or ".") / f"{values.get('output_name') or 'last'}.toml"


def log_path(values: dict[str, Any]) -> Path:
    return Path(values.get("output_dir") or ".") / f"{values.get('output_name') or 'last'}.log"


def existing_result(values: dict[str, Any]) -> Path | None:
    """The final result of an earlier run with the same output name, if there is one."""
    base = Path(values.get("output_dir") or ".") / (values.get("output_name") or "last")
    for candidate in (base.with_name(base.name + ext) for ext in (".safetensors", ".ckpt", ".pt")):
        if candidate.exists():
            return candidate
    return base if base.is_dir() else None


def script_path(tab: str, family: str) -> str:
    """The script, relative to the current folder when the repository is (or contains) it."""
    path = REPO / "sd-scripts" / P.script_for(tab, family)
    try:
        return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd().resolve()) else str(path)
    except ValueError:  # other drive on Windows
        return str(path)


def launch_args(values: dict[str, Any]) -> list[str]:
    """accelerate launch options. Processes, machines and precision are always given so accelerate does
    not fall back to a local accelerate config; dynamo is off because the trainer compiles the blocks. --quiet:
    a trainer that stops with its one-line error (exit 2) is not followed by the launcher's own
    CalledProcessError traceback (accelerate then exits 1)."""
    out = [
        "--quiet",
        "--num_processes", str(values.get("num_processes") or 1),
        "--num_machines", str(values.get("num_machines") or 1),
        "--mixed_precision", str(values.get("mixed_precision") or "no"),
        "--num_cpu_threads_per_process", str(values.get("num_cpu_threads_per_process") or 2),
        "--dynamo_backend", "no",
    ]
    for p in P.PARAMS:
        if p.target == "launch" and p.name not in ("num_processes", "num_machines", "num_cpu_threads_per_process"):
            value = values.get(p.name, p.default)
            if not p.is_default(value):
                out += p.cli_args(value)
    return out


def additional_args(values: dict[str, Any]) -> list[str]:
    """The "Additional parameters" text as argv (appended after everything else, so it wins)."""
    return shlex.split(values.get("additional_parameters") or "")


def additional_errors(tab: str, family: str, values: dict[str, Any]) -> list[str]:
    """Flags in "Additional parameters" that the script does not have (values are the trainer's to check)."""
    try:
        tokens = additional_args(values)
    except ValueError as e:
        return [f"Additional parameters (additional_parameters): cannot split it into arguments: {e}"]
    script = P.script_for(tab, family)
    known = P.script_flags(script)
    errors = []
    for token in tokens:
        flag = token.split("=", 1)[0]
        if flag.startswith("--") and flag not in known:
            close = difflib.get_close_matches(flag, sorted(known), n=1)
            errors.append(f"Additional parameters (additional_parameters): {flag} is not an option of {script}"
                          + (f" (did you mean {close[0]}?)" if close else ""))
    return errors


def build_argv(tab: str, family: str, values: dict[str, Any], config_path: str | os.PathLike | None = None) -> list[str]:
    config_path = config_path if config_path is not None else run_config_path(values)
    return ["accelerate", "launch", *launch_args(values), script_path(tab, family), "--config_file", str(config_path),
            *additional_args(values)]


def trainer_args(tab: str, family: str, values: dict[str, Any]) -> list[str]:
    """Every trainer option that is not at its default, as command-line flags (family-implied ones always).
    Secrets are left out: the run gets them in its environment (kohya_gui.secret_options)."""
    out = []
    values = P.fold_network_args(tab, family, secret_options.without_secrets(values))
    for p in P.params_for(tab, family):
        if p.target in ("launch", "gui") or p.network_arg:
            continue
        if p.fixed:
            out += p.cli_args(p.fixed[family])
            continue
        value = p.effective(p.check(values.get(p.name, p.default_for(tab, family)), tab), family)
        if not p.is_default(value, tab) or family in p.written_for:
            out += p.cli_args(value)
    return out + additional_args(values)


def standalone_argv(tab: str, family: str, values: dict[str, Any]) -> list[str]:
    """The same run with every setting as a flag: for another machine, no TOML file needed."""
    return ["accelerate", "launch", *launch_args(values), script_path(tab, family), *trainer_args(tab, family, values)]


def printable(argv: list[str], shell: str | None = None) -> str:
    """`shell`: "posix" or "windows" (None: this machine's)."""
    return quoting.join(argv, shell)


def machine_errors(values: dict[str, Any]) -> list[str]:
    """Several machines (accelerate launch on each, same settings but the machine rank; docs/MULTI_GPU.md)."""
    machines, rank = values.get("num_machines") or 1, values.get("machine_rank") or 0
    processes = values.get("num_processes") or 1
    if not (isinstance(machines, int) and isinstance(rank, int) and isinstance(processes, int)) or machines == 1:
        return []
    errors = []
    if not values.get("main_process_ip"):
        errors.append(f"Number of machines (num_machines) is {machines}: give the main machine's address in Main "
                      "process IP (main_process_ip), the same on every machine")
    if rank >= machines:
        errors.append(f"Machine rank (machine_rank) {rank} must be below Number of machines (num_machines) "
                      f"{machines}: 0 on the main machine, 1 ... {machines - 1} on the others")
    if processes % machines:
        errors.append(f"Number of processes (num_processes) counts all machines' processes: {processes} does not "
                      f"divide over {machines} machines")
    return errors


def validation_errors(tab: str, family: str, values: dict[str, Any]) -> list[str]:
    """What must be fixed before a run: empty required fields and values the registry rejects."""
    errors = []
    for p in P.params_for(tab, family):
        if p.fixed:
            continue
        value = values.get(p.name, p.default_for(tab))
        try:
            value = p.check(value, tab)
        except ValueError as e:
            errors.append(f"{p.label} ({p.name}): {e}")
            continue
        if p.required and p.is_default(value, tab):
            errors.append(f"{p.label} ({p.name}) is required")
    errors += additional_errors(tab, family, values) + P.network_arg_clashes(tab, family, values)
    for flag in secret_options.flags_in(values.get("additional_parameters") or ""):
        errors.append(f"Additional parameters (additional_parameters): {flag} would be written into the run's TOML "
                      f"and command; use its own field or ${secret_options.SECRET_OPTIONS[flag[2:]]}")
    if not (values.get("train_data_dir") or values.get("dataset_config") or values.get("in_json")):
        errors.append("Give an image folder (train_data_dir) or a dataset config (dataset_config)")
    errors += machine_errors(values)
    processes = values.get("num_processes") or 1
    if values.get("cpu") and isinstance(processes, int) and processes > 1:
        # accelerate launch --cpu starts a single process whatever --num_processes says
        errors.append(f"CPU only (cpu) runs one process; Number of processes (num_processes) is {processes}: "
                      "set it to 1 (several CPU processes: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu)")
    return errors

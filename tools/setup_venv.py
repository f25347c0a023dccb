"""Creates .venv if missing and installs the project into it; setup.sh (Linux, macOS), gui.bat and gui.ps1 (Windows)
all run this, with the interpreter named by the PYTHON environment variable (python3 / python by default).

    python tools/setup_venv.py [--test]     # --test adds the test dependencies

TORCH_SPEC picks the torch build (default torch==2.13.0, CPU here); on a CUDA machine for example
TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130". The install runs again only when
pyproject.toml is newer than the stamp file it leaves in .venv. Standard library only: it runs before .venv exists.
"""
from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIN_PYTHON = (3, 11)  # pyproject.toml requires-python: tomllib is 3.11+
DEFAULT_TORCH = "torch==2.13.0"


def venv_python(root: Path) -> Path:
    return root / ".venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def stamp_path(root: Path, test: bool) -> Path:
    return root / ".venv" / (".installed[test]" if test else ".installed")


def needs_install(root: Path, test: bool) -> bool:
    stamp = stamp_path(root, test)
    return not stamp.exists() or (root / "pyproject.toml").stat().st_mtime > stamp.stat().st_mtime


def install_commands(python: Path, test: bool, torch_spec: str) -> list[list[str]]:
    pip = [str(python), "-m", "pip", "install", "-q"]
    # TORCH_SPEC is split on white space, as setup.sh always did (`pip install ${TORCH_SPEC}`)
    return [pip + ["--upgrade", "pip"], pip + torch_spec.split(), pip + ["-e", ".[test]" if test else "."]]


def step_messages(test: bool, torch_spec: str) -> list[str]:
    """What each install command does, printed before it runs (the first run takes minutes)."""
    return ["[1/3] updating pip ...",
            f"[2/3] installing {torch_spec} (a download of several hundred MB; a CUDA build: a few GB) ...",
            "[3/3] installing the project and its packages (diffusers, transformers, gradio ...)"
            + (" and the test packages" if test else "") + " ..."]


def quiet_run(cmd: list[str], cwd: Path) -> None:
    """Runs one install command; its output (pip's and the build backend's notes) is shown only when it fails."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def main(argv: list[str] | None = None, root: Path = ROOT, run=quiet_run) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--test"]):
        print(f"error: unknown arguments {' '.join(argv)}; the only option is --test", file=sys.stderr)
        return 2
    if sys.version_info < MIN_PYTHON:
        print(f"error: Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer is needed, this is {sys.version.split()[0]} "
              f"({sys.executable}); set PYTHON to a newer interpreter", file=sys.stderr)
        return 2
    test = argv == ["--test"]
    python = venv_python(root)
    if not python.exists():
        print(f"creating {root / '.venv'} ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(root / ".venv")
    if needs_install(root, test):
        torch_spec = os.environ.get("TORCH_SPEC") or DEFAULT_TORCH
        print("installing the project into .venv: the first time takes 3-10 minutes, depending on the network; "
              "later starts skip this", flush=True)
        try:
            for message, cmd in zip(step_messages(test, torch_spec), install_commands(python, test, torch_spec)):
                print(message, flush=True)
                run(cmd, cwd=root)
        except subprocess.CalledProcessError as e:
            print(f"error: {' '.join(e.cmd)} failed with exit status {e.returncode}", file=sys.stderr)
            return 1
        stamp_path(root, test).touch()
        print("installed. The optional optimizers and networks (bitsandbytes for AdamW8bit, Prodigy, Lion, "
              f"D-Adaptation, schedule-free, LyCORIS) are an extra: {python} -m pip install -e '.[extras]'",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

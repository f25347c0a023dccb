#!/usr/bin/env bash
# Creates .venv if missing and installs the project into it (tools/setup_venv.py, which gui.bat and gui.ps1 run
# too). --test adds the test dependencies. PYTHON picks the interpreter (3.11 or newer; default python3),
# TORCH_SPEC the torch build (default torch==2.13.0; on a CUDA box e.g. TORCH_SPEC="torch --index-url ...").
set -euo pipefail
cd "$(dirname "$0")"
exec "${PYTHON:-python3}" tools/setup_venv.py "$@"

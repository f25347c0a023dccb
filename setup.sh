#!/usr/bin/env bash
# Creates .venv if missing and installs the project into it. --test adds the test dependencies.
# TORCH_SPEC picks the torch build (default torch==2.13.0; on a CUDA box e.g. TORCH_SPEC="torch --index-url ...").
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
stamp=".venv/.installed$extra"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q ${TORCH_SPEC:-torch==2.13.0}
  .venv/bin/python -m pip install -q -e ".$extra"
  touch "$stamp"
fi

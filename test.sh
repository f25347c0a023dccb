#!/usr/bin/env bash
# Runs the whole test suite from nothing: creates .venv, installs the project and its pinned test
# dependencies (CPU torch 2.13.0), installs Debian's chromium (apt-get, as root only) for the browser tests, then
# runs pytest: 20-45 minutes on 2 CPU cores. Arguments go to pytest, e.g. the quick run:
#   ./test.sh -m "not slow and not browser"
# Tests that read ../shared/parity/ (kohya_ss presets, upstream option tables) are skipped without it.
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh --test
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null || echo "warning: could not install chromium; browser tests will be skipped"
fi
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.venv/inductor-cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 GRADIO_ANALYTICS_ENABLED=False
exec .venv/bin/python -m pytest -q "$@"

#!/usr/bin/env bash
# Runs the test suite from nothing: creates .venv, installs the project and its pinned test dependencies (CPU torch
# 2.13.0), then runs pytest, offline.
#   ./test.sh            the quick run: leaves out the tests marked slow (train or compile) and browser
#   ./test.sh --all      the whole suite (CI runs this); as root it first installs Debian's chromium with apt-get
#                        for the browser tests (they are skipped without it)
# Other arguments go to pytest after the quick run's marks, so a -m of your own replaces them:
#   ./test.sh -m browser, ./test.sh tests/test_kohya_ss_import.py
# Tests that read ../shared/parity/ (kohya_ss presets, upstream option tables) are skipped without it.
set -euo pipefail
cd "$(dirname "$0")"
marks=(-m "not slow and not browser")
if [ "${1:-}" = "--all" ]; then
  marks=()
  shift
fi
./setup.sh --test
if { [ ${#marks[@]} = 0 ] || [[ " $* " == *browser* ]]; } && ! command -v chromium >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null || echo "warning: could not install chromium; browser tests will be skipped"
fi
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.venv/inductor-cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 GRADIO_ANALYTICS_ENABLED=False
exec .venv/bin/python -m pytest -q "${marks[@]}" "$@"

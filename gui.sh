#!/usr/bin/env bash
# First run sets up .venv; then starts the GUI on 127.0.0.1:7860. Extra flags go to gui.py
# (--listen --server_port --share --inbrowser --headless --username --password).
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh
exec .venv/bin/python gui.py "$@"

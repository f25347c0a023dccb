"""Shared test setup: sd-scripts on sys.path, offline hub, one inductor cache for the session."""
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SD_SCRIPTS = REPO / "sd-scripts"
if str(SD_SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SD_SCRIPTS))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".venv" / "inductor-cache"))

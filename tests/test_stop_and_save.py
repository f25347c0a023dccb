"""Runs that never lose work (issue 14): SIGTERM = finish the step, save, exit 0 (library.stop_signal); state
folders written atomically and stale temporary ones removed (library.saving); --resume refuses taken names
before any model loads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lora_checks import read_lora
from test_sdxl_lora_training import base_argv

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM is not deliverable on Windows (see stop_signal)")
def test_sigterm_saves_and_exits_zero(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    out = tmp_path / "out"
    max_steps = 500
    argv = base_argv(tiny_sdxl_single_file, out, tiny_dataset_dir, "stopped", steps=max_steps,
                     extra=["--network_train_unet_only", "--save_state"])
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "sd-scripts/sdxl_train_network.py", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("steps: "):
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + rest
    assert proc.returncode == 0, text[-3000:]
    lora = out / "stopped.safetensors"
    stopped = [ln for ln in text.splitlines() if ln.startswith("stopped at step ")]
    assert len(stopped) == 1, text[-3000:]
    step = int(stopped[0].split()[3].rstrip(","))
    assert stopped[0] == f"stopped at step {step}, saved {lora}"
    assert 1 <= step < max_steps
    sd, md = read_lora(lora)
    assert sd and md["ss_steps"] == str(step)
    state = out / "stopped-state"
    assert state.is_dir() and any(p.name.startswith("custom_checkpoint") for p in state.iterdir())
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temporary files left behind"

"""CPU smoke run of tools/bench_shipped.py: it prepares a model and a dataset, runs the shipped SDXL LoRA
trainer and reads both timings (the trainer's summary line and the progress lines)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_tiny_eager_phase_reports_trainer_and_outside_timings(tmp_path, tiny_sdxl_single_file):
    tool = [sys.executable, str(REPO / "tools" / "bench_shipped.py")]
    common = ["--workdir", str(tmp_path / "w"), "--resolution", "64", "--images", "2"]
    subprocess.run(tool + ["prepare", "--checkpoint", str(tiny_sdxl_single_file)] + common, check=True, timeout=300, capture_output=True)
    out = tmp_path / "r.json"
    proc = subprocess.run(tool + ["run", "--phases", "eager", "--steps", "6", "--warmup", "1", "--network_dim", "4",
                                  "--json_out", str(out)] + common + ["--", "--mixed_precision", "no"],
                          timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    (r,) = json.loads(out.read_text())
    assert r["phase"] == "eager" and r["rc"] == 0
    assert r["trainer_summary"]["median_ms"] > 0 and r["trainer_summary"]["steps"] == "4-6"
    # the progress line prints at most once a second, but always on the first and the last step
    assert r["outside_ms_per_step"] > 0 and r["outside_steps"].endswith("-6")

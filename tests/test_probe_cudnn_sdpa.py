"""tools/probe_cudnn_sdpa.py: each case runs in a process of its own, so one that fails (an illegal memory access
on a GPU; here, no CUDA) is reported and the next case still runs."""
import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "probe_cudnn_sdpa.py"


def _probe():
    spec = importlib.util.spec_from_file_location("probe_cudnn_sdpa", TOOL)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_a_failing_case_is_reported_and_the_probe_goes_on(capsys):
    probe = _probe()
    assert probe.main(["--lengths", "64", "128", "--heads", "2", "--head_dim", "16", "--iters", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "cudnn" in lines[0] and len(lines) == 3
    for line, length in zip(lines[1:], (64, 128)):
        assert line["length"] == length and line["ok"] is False and line["error"]


@pytest.mark.slow
def test_flux_blocks_report_the_phase_each_case_reached(capsys):
    """--flux_blocks: each case runs the trainers' FLUX.1 forward and backward in a process of its own and says how
    far it got (here a 128-wide model on the CPU, eager and compiled with aot_eager; no cuDNN)."""
    probe = _probe()
    assert probe.main(["--flux_blocks", "--tiny", "--backend", "aot_eager", "--cases", "eager:64", "compiled:64"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["flux_blocks"] == ["eager:64", "compiled:64"]
    for line, mode in zip(lines[1:], ("eager", "compiled")):
        assert line["mode"] == mode and line["ok"] is True and line["nan"] is False, line
        assert line["phases"][-2:] == ["forward", "backward"]
        assert line["rel_diff_vs_eager_flash"]["out"] < 1e-5  # the same math as the eager reference here

"""tools/probe_cudnn_sdpa.py: each case runs in a process of its own, so one that fails (an illegal memory access
on a GPU; here, no CUDA) is reported and the next case still runs."""
import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "probe_cudnn_sdpa.py"


def test_a_failing_case_is_reported_and_the_probe_goes_on(capsys):
    spec = importlib.util.spec_from_file_location("probe_cudnn_sdpa", TOOL)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.main(["--lengths", "64", "128", "--heads", "2", "--head_dim", "16", "--iters", "1"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "cudnn" in lines[0] and len(lines) == 3
    for line, length in zip(lines[1:], (64, 128)):
        assert line["length"] == length and line["ok"] is False and line["error"]

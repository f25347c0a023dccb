"""tools/bench_multi_gpu.py: the launch and trainer lines of its rows, and the figures it reads from a run's log
(the whole script runs on the CPU with TINY=1 gpu/run.sh; the slow test here runs one 2-process row)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("bench_multi_gpu", REPO / "tools" / "bench_multi_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_rows_launch_as_users_do(tmp_path):
    tool = _tool()
    fsdp = tool.ROWS["flux_ft_fsdp"]
    assert tool.launch_argv(fsdp, tiny=False)[:4] == ["launch", "--multi_gpu", "--num_processes", "2"]
    assert "--multi_gpu" not in tool.launch_argv(tool.ROWS["flux_ft_swap"], tiny=False)
    argv = tool.trainer_argv(tool.ROWS["flux_ft_swap"], tmp_path, 12, False, tmp_path / "o")
    assert argv[argv.index("--blocks_to_swap") + 1] == "22" and "--fused_backward_pass" in argv
    assert argv[argv.index("--optimizer_type") + 1] == "Adafactor" and "--full_bf16" in argv
    argv = tool.trainer_argv(fsdp, tmp_path, 12, False, tmp_path / "o")
    assert argv[argv.index("--fsdp") + 1] == "full_shard" and "--fused_backward_pass" not in argv
    assert argv[argv.index("--resolution") + 1] == "1024,1024" and "--gradient_checkpointing" in argv
    lora = tool.trainer_argv(tool.ROWS["sdxl_lora_dp2"], tmp_path, 12, False, tmp_path / "o")
    assert lora[lora.index("--train_batch_size") + 1] == "4" and "networks.lora" in lora


def test_figures_read_from_a_two_process_log():
    tool = _tool()
    lines = [(1.0, "INFO --fsdp full_shard: the parameters of the FluxTransformer2DModel (11901.4M, 57 blocks) are "
                   "sharded over 2 processes"),
             (30.0, "steps: 1/12 loss=0.1"),
             (60.0, "median step 1500.0 ms (steps 7-12); first step 9.5 s, second step 1.6 s; peak GPU memory 30.12 GiB"),
             (60.1, "2026 INFO library.data_parallel: process 0/2 finished 12 steps, last loss 0.1234, weights checksum "
                    "1.2345678901e+05, peak GPU memory 30.12 GiB"),
             (60.2, "2026 INFO library.data_parallel: process 1/2 finished 12 steps, last loss 0.1200, weights checksum "
                    "1.2345678901e+05, peak GPU memory 29.50 GiB")]
    r = tool.read_lines(lines, tool.ROWS["flux_ft_fsdp"])
    assert r["sharded"] == {"model": "FluxTransformer2DModel", "params_m": 11901.4, "blocks": 57, "processes": 2}
    assert r["ranks"] == {"0": {"steps": 12, "checksum": 123456.78901, "peak_gib": 30.12},
                          "1": {"steps": 12, "checksum": 123456.78901, "peak_gib": 29.5}}
    assert r["trainer_summary"]["median_ms"] == 1500.0 and r["trainer_summary"]["first_step_s"] == 9.5
    assert r["samples_per_s"] == round(2 / 1.5, 3) and r["launch_to_first_progress_s"] == 30.0
    cpu = tool.read_lines([(1.0, "process 1/2 finished 4 steps, last loss 0.1, weights checksum 3.1e+01")],
                          tool.ROWS["sdxl_lora_dp2"])
    assert cpu["ranks"] == {"1": {"steps": 4, "checksum": 31.0, "peak_gib": None}}


@pytest.mark.slow
def test_tiny_data_parallel_row_on_two_cpu_processes(tmp_path):
    tool = [sys.executable, str(REPO / "tools" / "bench_multi_gpu.py")]
    work = tmp_path / "w"
    subprocess.run(tool + ["prepare", "--workdir", str(work), "--family", "sdxl", "--tiny"], check=True, timeout=300,
                   capture_output=True)
    out = tmp_path / "r.json"
    proc = subprocess.run(tool + ["run", "sdxl_lora_dp2", "--workdir", str(work), "--tiny", "--steps", "4",
                                  "--json_out", str(out), "--timeout", "300"], capture_output=True, text=True,
                          timeout=320)
    r = json.loads(out.read_text())
    assert proc.returncode == 0 and r["ok"], (proc.stdout[-2000:], r.get("log_tail"))
    assert set(r["ranks"]) == {"0", "1"} and r["samples_per_s"] > 0 and r["trainer_summary"]["steps"] == "3-4"
    assert r["launch"].startswith("accelerate launch --multi_gpu --num_processes 2 ")


def test_report_sets_the_step_graph_on_against_off(tmp_path):
    tool = _tool()
    paths = []
    for graph, ms, checksum in (("off", 100.0, 2.0), ("on", 90.0, 2.0002)):
        name = f"sdxl_lora_bs1_2gpu_compiled_graph_{graph}"
        row = {"row": name, "what": tool.ROWS[name].what, "gpus": 2, "ok": True, "rc": 0, "samples_per_s": 2 / ms,
               "trainer_summary": {"median_ms": ms},
               "ranks": {"0": {"steps": 12, "checksum": checksum, "peak_gib": 9.0}}}
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(row))
    text = tool.report([str(p) for p in paths])
    assert "sdxl_lora_bs1_2gpu_compiled: step graph on 90.0 ms / off 100.0 ms = 0.900" in text
    assert "weights checksum on/off - 1 = 1.00e-04" in text

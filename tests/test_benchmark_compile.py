"""tools/benchmark_compile.py on the CPU: tiny shapes, eager and compiled phases in one process, the ratio."""
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

SCRIPT = REPO / "tools" / "benchmark_compile.py"


def _run(*argv, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_tiny_sdxl_eager_and_compiled_phases_and_their_ratio(tmp_path):
    out = tmp_path / "r.json"
    r = _run("--family", "sdxl", "--tiny", "--device", "cpu", "--resolution", "64", "--steps", "1", "--warmup", "1",
             "--compile_backend", "aot_eager", "--compile_mode", "default",
             "--compile_cache_dir", str(tmp_path / "cache"),
             "--inductor_config", "triton.slow_path_cudagraph_asserts=False", "--json_out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["family"] == "sdxl" and res["resolution"] == 64 and res["optimizer"] == "AdamW fused"
    assert res["inductor_config"] == ["triton.slow_path_cudagraph_asserts=False"]
    for phase in ("eager", "compiled"):
        assert len(res[phase]["step_s"]) == 2 and res[phase]["loss_finite"] and res[phase]["step_ms_median"] > 0
    assert res["compiled_blocks"] > 0 and f"Compiled {res['compiled_blocks']} blocks of SDXL UNet" in r.stderr
    assert res["speedup"] == res["eager"]["step_ms_median"] / res["compiled"]["step_ms_median"]
    assert "speedup (eager / compiled):" in r.stdout


@pytest.fixture(scope="module")
def bench():
    """The script imported as a module (its functions, without running main)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark_compile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_inductor_config_sets_the_key_and_names_the_flag_on_bad_input(bench):
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"triton.slow_path_cudagraph_asserts": True}):
        bench.apply_inductor_config(["triton.slow_path_cudagraph_asserts=False"])
        assert inductor_config.triton.slow_path_cudagraph_asserts is False
    for bad, needle in (("triton.no_such_option=1", "KEY=VALUE with KEY in torch._inductor.config"),
                        ("no_such_group.x=1", "KEY=VALUE with KEY in torch._inductor.config"),
                        ("triton.slow_path_cudagraph_asserts", "KEY=VALUE"),
                        ("triton.slow_path_cudagraph_asserts=Flase", "VALUE must be a Python literal")):
        with pytest.raises(SystemExit, match=needle):
            bench.apply_inductor_config([bad])


def test_attention_only_lora_keeps_the_attention_projections(bench):
    base = ["--family", "sdxl", "--tiny", "--device", "cpu"]
    found = {}
    for extra in ([], ["--attention_only_lora"]):
        args = bench.parse_args(base + extra)
        model = bench.build_sdxl_unet(args)
        _, params = bench.apply_lora(model, args)
        # kohya LoRA replaces the adapted layer's forward with the LoRA module's bound forward
        adapted = [n for n, m in model.named_modules() if hasattr(getattr(m.forward, "__self__", None), "lora_name")]
        found[bool(extra)] = (sum(p.numel() for p in params), adapted)
    (full_params, full), (attn_params, attn) = found[False], found[True]
    assert 0 < attn_params < full_params and 0 < len(attn) < len(full)
    assert all(n.endswith((".to_q", ".to_k", ".to_v", ".to_out.0")) for n in attn)
    assert any(n.endswith(".ff.net.2") for n in full) and any(n.endswith(".proj_in") for n in full)
    with pytest.raises(SystemExit):
        bench.parse_args(base + ["--attention_only_lora", "--lora_impl", "peft"])

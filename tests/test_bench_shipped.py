"""CPU smoke run of tools/bench_shipped.py: it prepares a model and a dataset, runs the shipped SDXL LoRA
trainer and reads both timings (the trainer's summary line and the progress lines)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sdxl", "sd15", "sd21"])
def test_tiny_eager_phase_reports_trainer_and_outside_timings(tmp_path, family, request):
    """SDXL through sdxl_train_network.py, SD1.5 (--family sd15) and SD2.1 v (--family sd21) through train_network.py."""
    if family == "sd21":
        from library.tiny_models import make_tiny_sd

        checkpoint = make_tiny_sd(tmp_path / "tiny_sd2", "sd2")
    else:
        checkpoint = request.getfixturevalue("tiny_sdxl_single_file" if family == "sdxl" else "tiny_sd1_single_file")
    tool = [sys.executable, str(REPO / "tools" / "bench_shipped.py")]
    common = ["--workdir", str(tmp_path / "w"), "--resolution", "64", "--images", "2", "--family", family]
    subprocess.run(tool + ["prepare", "--checkpoint", str(checkpoint), "--repeats", "3"] + common,
                   check=True, timeout=300, capture_output=True)
    assert (tmp_path / "w" / f"{family}.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "w" / "data" / "3_bench").glob("*.png")) == ["img_0.png", "img_1.png"]
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


TINY_FLUX = {
    "transformer": dict(width=128, num_double=1, num_single=1, t5_dim=32, clip_dim=64, guidance=True),
    "clip_l": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                   max_position_embeddings=77, projection_dim=64, hidden_act="quick_gelu"),
    "t5xxl": dict(vocab_size=256, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                  feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False),
    "ae": dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
               up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[32] * 4, layers_per_block=1,
               latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False),
}


@pytest.mark.slow
def test_flux_set_in_users_layout_trains_with_the_shipped_flux_script(tmp_path):
    """The FLUX.1 half: prepare_flux writes the four files in BFL / transformers layouts (here at small sizes) and
    `run --family flux` times flux_train_network.py on them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_shipped", REPO / "tools" / "bench_shipped.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    work = tmp_path / "w"
    bench.prepare_flux(work / "flux", TINY_FLUX)
    bench.make_images(work, 2, 64)
    assert {p.name for p in (work / "flux").iterdir()} == {"flux.safetensors", "clip_l.safetensors",
                                                          "t5xxl.safetensors", "ae.safetensors", "tokenizers"}
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "bench_shipped.py"), "run", "--family", "flux",
                           "--workdir", str(work), "--resolution", "64", "--phases", "eager", "--steps", "4",
                           "--warmup", "1", "--network_dim", "4", "--json_out", str(out), "--",
                           "--mixed_precision", "no"], timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    (r,) = json.loads(out.read_text())
    assert r["family"] == "flux" and r["rc"] == 0 and r["trainer_summary"]["median_ms"] > 0


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_shipped", REPO / "tools" / "bench_shipped.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bucketed_run_figures_read_from_the_trainer_log():
    """What a bucketed compiled run reports: new shapes with their steps, torch's recompiles by shapes seen, the
    setup steps' total from the summary, the graph timers, and the compile line to step 2 done."""
    log = [
        (10.0, "INFO Compiling SDXL UNet with torch.compile: backend=inductor, mode=reduce-overhead, dynamic=None"),
        (11.0, "INFO torch.compile: new input shape 1x4x128x128 at step 1 (1 so far): this step compiles and ..."),
        (25.0, "V1124 [0/1] [__recompiles] Recompiling function _checkpointed_forward in compile_utils.py:446"),
        (40.0, "steps: 1/24 loss=0.1 it/s=0.1"),
        (52.5, "steps: 2/24 loss=0.1 it/s=0.1"),
        (53.0, "INFO torch.compile: new input shape 1x4x112x144 at step 4 (2 so far): this step compiles and ..."),
        (60.0, "V1124 [0/2] [__recompiles] Recompiling function _checkpointed_forward in compile_utils.py:446"),
        (70.0, "steps: 12/24 loss=0.1 it/s=0.1"),
        (72.0, "steps: 24/24 loss=0.1 it/s=0.1"),
        (72.1, "median step 166.7 ms (steps 13-24); first step 29.0 s, second step 12.5 s; 2 input shapes: 4 setup "
               "steps (compile, graph recording) 58.2 s in all; peak GPU memory 7.11 GiB"),
        (75.0, 'graph_timing: {"capture": [280, 4.5], "record_function": [280, 9.25]}'),
    ]
    r = _bench().read_log(log, warmup=10)
    assert r["new_shapes"] == [{"shape": "1x4x128x128", "step": 1, "at_s": 11.0},
                               {"shape": "1x4x112x144", "step": 4, "at_s": 53.0}]
    assert r["recompiles"] == 2 and r["recompiles_by_shapes_seen"] == {"1": 1, "2": 1}
    assert r["setup"] == {"shapes": 2, "steps": 4, "what": "compile, graph recording", "seconds": 58.2}
    assert r["trainer_summary"]["median_ms"] == 166.7 and r["trainer_summary"]["steps"] == "13-24"
    assert r["trainer_summary"]["peak_gib"] == 7.11
    assert r["graph_timing"] == {"capture": [280, 4.5], "record_function": [280, 9.25]}
    assert r["compile_line_to_step2_done_s"] == 30.0
    assert r["outside_ms_per_step"] == 166.7 and r["outside_steps"] == "12-24"


def test_warm_restart_breakdown_read_from_the_trainer_log():
    """Where a (warm) start's time to step 2 goes: the stages' first lines since the process started, torch's cache
    counters and its compile-time table (both printed by tools/graph_timing.py at exit), lines as a run printed them."""
    log = [
        (5.5, "graph_timing: variant shipped (pool checks False)"),
        (5.9, "2026-11-26 08:30:53 INFO library.train_util: seed: 0"),
        (9.1, "2026-11-26 08:30:56 INFO library.model_util: loaded SDXL model from /w/sdxl.safetensors (prediction: "
              "epsilon)"),
        (9.1, "2026-11-26 08:30:56 INFO library.datasets: caching latents: 4 images to encode, 0 reused from disk"),
        (11.7, "2026-11-26 08:30:58 INFO library.datasets: caching text encoder outputs: 4 captions to encode"),
        (12.0, "2026-11-26 08:30:59 INFO library.compile.regional: Compiling SDXL UNet with torch.compile: backend=x"),
        (19.3, "steps: 1/4 loss=0.1"),
        (19.5, "median step 59.8 ms (steps 3-4); first step 7.2 s, second step 0.1 s"),
        (19.6, 'graph_timing: {"gc_collect": [2, 0.003]}'),
        (19.6, 'graph_timing counters: {"stats": {"unique_graphs": 2}, "inductor": {"fxgraph_cache_hit": 4}, '
               '"aot_autograd": {"total": 2, "autograd_cache_hit": 2}}'),
        (19.6, "compile_times:"),
        (19.6, "TorchDynamo compilation metrics:"),
        (19.6, "Function, Runtimes (s)"),
        (19.6, "_compile.compile_inner, 4.3692"),
        (19.6, "bytecode_tracing, 2.0276"),
        (19.6, "AOTAutogradCache.inductor_load, 1.6457"),
    ]
    r = _bench().read_log(log, warmup=1)
    assert r["timeline_s"] == {"first_log_line": 5.9, "model_loaded": 9.1, "caching_latents": 9.1,
                               "caching_text": 11.7, "compile_line": 12.0, "step2_done": 19.3}
    assert r["compile_counters"]["aot_autograd"]["autograd_cache_hit"] == 2
    assert r["compile_counters"]["inductor"] == {"fxgraph_cache_hit": 4}
    assert r["compile_times"] == {"_compile.compile_inner": 4.3692, "bytecode_tracing": 2.0276,
                                  "AOTAutogradCache.inductor_load": 1.6457}
    assert r["compile_line_to_step2_done_s"] == 7.3


def test_bucket_images_and_trainer_flags(tmp_path):
    bench = _bench()
    sys.path.insert(0, str(REPO / "sd-scripts"))
    data = bench.make_bucket_images(tmp_path, 2, sizes=((64, 64), (48, 80)))
    from PIL import Image

    sizes = sorted(Image.open(p).size for p in data.glob("*/*.png"))
    assert sizes == [(48, 80), (48, 80), (64, 64), (64, 64)] and len(list(data.glob("*/*.txt"))) == 4
    args = bench.argparse.Namespace(tag="after", cache_tag="before", family="sdxl", network_dim=None, resolution=1024,
                                    steps=4, batch_size=1, gradient_checkpointing=True, buckets=True,
                                    compile_mode="reduce-overhead", extra=[])
    argv = bench.trainer_argv(args, "compiled", tmp_path)
    assert argv[argv.index("--train_data_dir") + 1] == str(tmp_path / "data_buckets")
    assert argv[argv.index("--min_bucket_reso") + 1] == "832" and argv[argv.index("--max_bucket_reso") + 1] == "1216"
    assert "--enable_bucket" in argv and argv[argv.index("--compile_cache_dir") + 1].endswith("compile_cache_before")
    # SD1.5: train_network.py compiles with upstream's --torch_compile (it has no --compile flags)
    args.family = "sd15"
    argv = bench.trainer_argv(args, "compiled", tmp_path)
    assert "--torch_compile" in argv and "--compile" not in argv and "--compile_cache_dir" not in argv
    assert argv[argv.index("--pretrained_model_name_or_path") + 1] == str(tmp_path / "sd15.safetensors")
    assert "--v2" not in argv
    args.family = "sd21"  # SD2.1 768-v: the same script and switch, v-prediction
    argv = bench.trainer_argv(args, "compiled", tmp_path)
    assert "--torch_compile" in argv and {"--v2", "--v_parameterization"} <= set(argv)


def test_report_puts_default_and_best_side_by_side(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import bench_shipped

    log = ["INFO --cuda_graph_step auto: on (forward, backward and clipping as one CUDA graph, the optimizer step "
           "inside the graph)",
           "INFO Compiled 70 blocks of SDXL UNet (BasicTransformerBlock), static shapes (--compile_dynamic auto: the "
           "dataset has one bucket shape)"]
    assert bench_shipped.auto_choices(log) == "step graph on, static"
    assert bench_shipped.auto_choices(["x, image-size dimensions of their inputs dynamic (bucket shapes ...)"]) == \
        "inputs dynamic"
    assert bench_shipped.auto_choices(["INFO --compile_checkpoint_keep auto: attention (batch size 1: ...)"]) == \
        "keep attention"
    runs = [dict(workload="SDXL bs1 + GC", tag="before", extra=[], auto_chose="", rc=0,
                 trainer_summary={"median_ms": 154.7, "peak_gib": 7.05,
                                  "first_steps": "first step 17.1 s, second step 0.3 s; peak GPU memory 7.05 GiB"},
                 outside_ms_per_step=160.0, compile_line_to_step2_done_s=19.5,
                 compile_counters={"inductor": {"fxgraph_cache_hit": 3, "fxgraph_cache_miss": 1},
                                   "aot_autograd": {"total": 2, "autograd_cache_hit": 2, "ok": 2}}),
            dict(workload="SDXL bs1 + GC", tag="after", extra=[], auto_chose="step graph on, static", rc=0,
                 trainer_summary={"median_ms": 119.4, "peak_gib": 7.1}),
            dict(workload="SDXL bs1 + GC", tag="after", extra=["--optimizer_type", "Prodigy"], auto_chose="", rc=1,
                 trainer_summary=None)]
    (tmp_path / "r.json").write_text(json.dumps(runs))
    rows = bench_shipped.report([str(tmp_path / "r.json")]).splitlines()
    assert rows[2] == "| SDXL bs1 + GC | --optimizer_type Prodigy | after |  | failed (rc 1) |  |  |  |  |  |"
    assert rows[3] == "| SDXL bs1 + GC | default | after | step graph on, static | **119.4 ms** | 7.1 GiB |  |  |  |  |"
    assert rows[4] == ("| SDXL bs1 + GC | default | before |  | 154.7 ms | 7.05 GiB | 160.0 ms | 17.1 / 0.3 s | 19.5 s "
                       "| FX 3/4, AOT 2/2 |")


def test_bytecode_cache_only_where_torch_has_none(tmp_path, monkeypatch):
    """Where torch was installed with its .pyc files (pip's way, this test's venv) the trainers' environment is left
    as it is; where it was not, one compileall fills a cache under the workdir for the packages and the scripts,
    and a later phase finds it filled."""
    bench = _bench()
    assert bench.installed_without_bytecode() is False
    assert bench.bytecode_env(tmp_path / "w0", [str(tmp_path)]) == {}
    assert not (tmp_path / "w0").exists()

    scripts = tmp_path / "scripts"
    (scripts / "library").mkdir(parents=True)
    (scripts / "train.py").write_text("import library.util\n")
    (scripts / "library" / "util.py").write_text("X = 1\n")
    monkeypatch.setattr(bench, "installed_without_bytecode", lambda: True)
    monkeypatch.setattr(bench, "BYTECODE_PACKAGES", ("tomlkit",))
    work = tmp_path / "w1"
    env = bench.bytecode_env(work, [str(scripts)])
    prefix = work / "pycache"
    assert env == {"PYTHONPYCACHEPREFIX": str(prefix)}
    compiled = {p.name.split(".")[0] for p in prefix.rglob("*.pyc")}
    assert {"train", "util", "toml_file"} <= compiled  # the scripts and the package (tomlkit/toml_file.py)
    filled = (prefix / "filled.txt").read_text()
    assert str(scripts) in filled and "tomlkit" in filled
    before = sorted(p.stat().st_mtime_ns for p in prefix.rglob("*.pyc"))
    assert bench.bytecode_env(work, [str(scripts)]) == env
    assert sorted(p.stat().st_mtime_ns for p in prefix.rglob("*.pyc")) == before  # nothing compiled again

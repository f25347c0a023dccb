"""tools/bench_shipped.py's parts for the families after FLUX.1 (issue 28 item 6) that need no GPU: reading
upstream's tqdm progress bar, the report rows, the trainer flags of each side and the tokenizer folders both sides
load offline."""
import io
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "sd-scripts"))

import bench_shipped  # noqa: E402


def test_output_split_at_carriage_returns_as_tqdm_redraws():
    raw = (b"INFO loading\nsteps:   0%|          | 0/3 [00:00<?, ?it/s]\rsteps:  33%|###3      | 1/3 "
           b"[00:01<00:02,  1.20s/it]\r\nepoch 1/1\r\n\rsteps:  67%|######6   | 2/3 [00:02<00:01]\rtail")
    lines = list(bench_shipped.split_output(io.BufferedReader(io.BytesIO(raw)), chunk=7))
    assert lines == ["INFO loading", "steps:   0%|          | 0/3 [00:00<?, ?it/s]",
                     "steps:  33%|###3      | 1/3 [00:01<00:02,  1.20s/it]", "epoch 1/1",
                     "steps:  67%|######6   | 2/3 [00:02<00:01]", "tail"]


def test_upstream_tqdm_bar_gives_median_and_first_step():
    bar = "steps: {p:3d}%|#####     | {s}/30 [00:10<00:10,  1.00s/it{post}]"
    log = [(40.0, bar.format(p=0, s=0, post=""))]
    t = 52.0  # the first step (compile-free, but allocation and cuDNN warm-up) takes 12 s
    for s in range(1, 31):
        log.append((t, bar.format(p=s * 100 // 30, s=s, post="")))
        log.append((t + 0.01, bar.format(p=s * 100 // 30, s=s, post=", avr_loss=0.1")))  # set_postfix redraw
        t += 11.0 if s == 20 else 1.0  # one slow step (a pause): in the mean, not in the median
    r = bench_shipped.read_log(log, warmup=10, bar=True)
    assert r["first_step_s"] == 12.0 and r["start_to_step1_shown_s"] == 52.0
    assert r["outside_steps"] == "10-30" and r["outside_ms_per_step"] == 1500.0
    assert r["outside_median_ms"] == 1000.0
    assert "trainer_summary" not in r or r["trainer_summary"] is None


def test_ours_progress_lines_give_no_bar_figures():
    log = [(30.0, "steps: 0/20 loss=0"), (30.1, "steps:   0%|          | 0/20 [00:00<?, ?it/s]"),
           (45.0, "steps:   5%|5         | 1/20 [00:15<04:45, 15.0s/it]"),  # ours' bar: a step late, in bursts
           (45.0, "steps:  10%|#         | 2/20 [00:15<02:15,  7.5s/it]"), (45.0, "steps: 1/20 loss=0.1 it/s=0.1"),
           (50.0, "steps: 10/20 loss=0.1 it/s=1"), (52.0, "steps: 20/20 loss=0.1 it/s=5")]
    r = bench_shipped.read_log(log, warmup=10)
    assert r["outside_ms_per_step"] == 200.0 and r["start_to_step1_shown_s"] == 45.0
    assert "outside_median_ms" not in r and "first_step_s" not in r  # a step late, at most once a second


def _run(family, phase, **kw):
    return {"family": family, "phase": phase, "rc": 0, "resolution": 1024, "trainer_summary": None, **kw}


def test_family_report_compares_each_run_with_upstream(tmp_path):
    runs = [_run("sd3-large", "eager", trainer_summary={"median_ms": 900.0, "peak_gib": 30.5,
                                                         "first_steps": "first step 3.1 s, second step 0.9 s"},
                 smi_peak_mib=34816, smi_loop_peak_mib=33792, start_to_step1_shown_s=60.4),
            _run("sd3-large", "upstream", outside_median_ms=1500.0, first_step_s=2.5, smi_peak_mib=40960,
                 smi_loop_peak_mib=40960, start_to_step1_shown_s=70.0),
            _run("sd3-large", "compiled", trainer_summary={"median_ms": 600.0, "peak_gib": 28.0,
                                                            "first_steps": "first step 50.2 s, second step 9.0 s"}),
            _run("chroma", "compiled", rc=-9, timed_out_after_s=200.0),
            _run("chroma", "compiled", extra=["--compile_checkpoint_keep", "inputs"],
                 trainer_summary={"median_ms": 476.7, "peak_gib": 19.63})]
    (tmp_path / "r.json").write_text(json.dumps(runs))
    rows = bench_shipped.report([str(tmp_path / "r.json")]).splitlines()
    assert rows[2] == "| sd3-large 1024 px | ours, Enable torch.compile | 600.0 ms | 2.50x | 28.00 GiB |  | 50.2 s |  |"
    assert rows[3] == ("| sd3-large 1024 px | ours, eager | 900.0 ms | 1.67x | 30.50 GiB | 33.00 GiB (run 34.00) | 3.1 s "
                       "| 60 s |")
    assert rows[4] == "| sd3-large 1024 px | upstream | 1500.0 ms |  |  | 40.00 GiB (run 40.00) | 2.5 s | 70 s |"
    assert rows[5] == "| chroma 1024 px | ours, Enable torch.compile | failed (rc -9, stopped at 200 s) |  |  |  |  |  |"
    assert rows[6] == ("| chroma 1024 px | ours, Enable torch.compile, `--compile_checkpoint_keep inputs` | 476.7 ms |  "
                       "| 19.63 GiB |  |  |  |")  # a run with more flags names them


def test_both_sides_get_the_same_workload_and_each_its_own_flags(tmp_path):
    args = bench_shipped.argparse.Namespace(tag="chroma", cache_tag=None, family="chroma", network_dim=None,
                                            resolution=1024, steps=25, batch_size=1, gradient_checkpointing=True,
                                            buckets=False, compile_mode="reduce-overhead", extra=[])
    up = bench_shipped.trainer_argv(args, "upstream", tmp_path)
    compiled = bench_shipped.trainer_argv(args, "compiled", tmp_path)
    assert "--overwrite_output" not in up and "--compile" not in up  # upstream has neither
    assert compiled[compiled.index("--compile"):][:3] == ["--compile", "--compile_mode", "reduce-overhead"]
    assert "--compile_cache_dir" not in compiled  # what ticking Enable torch.compile gives, nothing more
    common = [a for a in compiled if a not in ("--compile", "--compile_mode", "reduce-overhead", "--overwrite_output")]
    assert [a.replace("_compiled", "_upstream") for a in common] == up
    assert up[up.index("--model_type") + 1] == "chroma" and up[up.index("--network_dim") + 1] == "16"
    assert up[up.index("--network_module") + 1] == "networks.lora_flux"


def test_tokenizer_folders_load_offline_for_ours_and_in_upstreams_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from library import lumina_models, sd3_models

    bench_shipped.make_family_tokenizers(tmp_path / "sd3", ("clip_l", "clip_g", "t5xxl"))
    toks = sd3_models.load_tokenizers(None, str(tmp_path / "sd3"))
    assert [len(t("a cat").input_ids) > 1 for t in toks] == [True] * 3
    clip_l = tmp_path / "sd3" / "openai_clip-vit-large-patch14"  # upstream: <cache dir>/<hub id with / -> _>
    assert json.loads((clip_l / "vocab.json").read_text())["<|endoftext|>"] == len(toks[0]) - 1
    assert (clip_l / "merges.txt").is_file()
    for d in ("openai_clip-vit-large-patch14", "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k", "google_t5-v1_1-xxl"):
        cfg = json.loads((tmp_path / "sd3" / d / "tokenizer_config.json").read_text())
        assert "extra_special_tokens" not in cfg and "backend" not in cfg  # transformers 4.x reads it

    bench_shipped.make_family_tokenizers(tmp_path / "lumina", ("gemma2",))
    from transformers import AutoTokenizer

    hub = AutoTokenizer.from_pretrained(lumina_models.GEMMA_ID, cache_dir=str(tmp_path / "lumina"))  # upstream's call
    ours = lumina_models.load_tokenizer(None, str(tmp_path / "lumina"))
    for tok in (hub, ours):  # <bos> first, every id inside the vocabulary the random Gemma's embedding has
        ids = tok("a cat").input_ids
        assert ids[0] == 2 and len(ids) > 2 and max(ids) < len(ours)


def test_nvidia_smi_peak_of_the_whole_run_and_of_the_training_loop():
    samples = [(1.0, 500), (20.0, 21000), (30.0, 3000), (41.0, 15000), (60.0, 16000)]  # caching T5 at 20 s
    lines = [(10.0, "INFO caching"), (40.0, "steps:   0%|          | 0/20 [00:00<?, ?it/s]"), (70.0, "done")]
    assert bench_shipped.memory_figures(samples, lines) == {"smi_peak_mib": 21000, "smi_loop_peak_mib": 16000}
    assert bench_shipped.memory_figures(samples, lines[:1]) == {"smi_peak_mib": 21000}  # it never reached the loop
    assert bench_shipped.memory_figures([], lines) == {"smi_peak_mib": None}  # no nvidia-smi (this CPU)


def test_memory_poll_reads_nvidia_smi_lines(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"  # prints what `--query-gpu=memory.used --format=csv,noheader,nounits -lms` does
    fake.write_text("#!/bin/sh\nprintf '100\\n20500\\n300\\n'\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    import time

    poll = bench_shipped.GpuMemoryPoll(time.perf_counter())
    for _ in range(100):
        if len(poll.samples) == 3:
            break
        time.sleep(0.05)
    assert [m for _, m in poll.stop()] == [100, 20500, 300]


def test_hunyuan_image_and_anima_runs_name_upstreams_files_and_flags_on_both_sides(tmp_path):
    args = bench_shipped.argparse.Namespace(tag="t", cache_tag=None, family="hunyuan-image", network_dim=None,
                                            resolution=1024, steps=20, batch_size=1, gradient_checkpointing=True,
                                            buckets=False, compile_mode="reduce-overhead", extra=[])
    up = bench_shipped.trainer_argv(args, "upstream", tmp_path)
    ours = [a.replace("_eager", "_upstream") for a in bench_shipped.trainer_argv(args, "eager", tmp_path)]
    assert [a for a in ours if a != "--overwrite_output"] == up
    d = tmp_path / "hunyuan-image"
    assert up[up.index("--text_encoder") + 1] == str(d / "qwen_2.5_vl_7b.safetensors")
    assert {"--split_attn", "--cache_text_encoder_outputs_to_disk", "--network_train_unet_only"} <= set(up)
    assert up[up.index("--network_module") + 1] == "networks.lora_hunyuan_image"
    args.family = "anima"
    up = bench_shipped.trainer_argv(args, "upstream", tmp_path)
    assert up[up.index("--t5_tokenizer_path") + 1] == str(tmp_path / "anima" / "tokenizers" / "t5")
    assert up[up.index("--qwen3") + 1] == str(tmp_path / "anima" / "qwen3.safetensors")
    assert bench_shipped.SCRIPTS["anima"] == "anima_train_network.py"


def test_hub_snapshot_is_what_from_pretrained_reads_offline(tmp_path, monkeypatch):
    """Upstream's HunyuanImage loads its tokenizers by hub id with no cache dir: HF_HUB_CACHE points at this."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = bench_shipped._hub_snapshot(tmp_path / "hub", "google/byt5-small")
    (snap / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer", "extra_ids": 125}))
    (snap / "config.json").write_text(json.dumps({"model_type": "t5"}))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained("google/byt5-small", cache_dir=str(tmp_path / "hub"))
    assert type(tok).__name__ == "ByT5Tokenizer" and tok("ab").input_ids == [100, 101, 1]

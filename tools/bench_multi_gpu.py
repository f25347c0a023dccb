"""The 2-GPU figures of issue 30: the shipped full trainers sharded with --fsdp against one GPU, and LoRA data
parallel 1 -> 2 GPUs, each started the way a user starts it (`accelerate launch [--multi_gpu --num_processes 2]`).

    python tools/bench_multi_gpu.py prepare --workdir W [--family sdxl|flux|both] [--tiny]
    python tools/bench_multi_gpu.py run ROW --workdir W [--steps 12] [--timeout S] [--json_out F] [--log_out F]
           [--tiny] [-- more trainer flags]
    python tools/bench_multi_gpu.py report F.json ...   # a markdown table of the rows

Rows (ROWS): `flux_ft_fsdp` / `flux_ft_swap` (flux_train.py 1024 px bs1 + GC, Adafactor with --full_bf16 as the
shipped preset presets/finetune/flux-finetune-24gb.toml: 2 GPUs `--fsdp full_shard` against 1 GPU
`--fused_backward_pass --blocks_to_swap 22`, the preset's count), `sdxl_ft_fsdp` / `sdxl_ft_1gpu` (sdxl_train.py
1024 bs1 + GC, Adafactor --full_bf16 as presets/finetune/sdxl-finetune-24gb.toml; 1 GPU with the preset's
--fused_backward_pass; `sdxl_ft_fsdp_adamw`: the FSDP row with torch's AdamW, whose steps on sharded weights
are foreach kernels, against Adafactor's per-weight steps on DTensors), `sdxl_lora_dp1` / `sdxl_lora_dp2` (sdxl_train_network.py LoRA r32, AdamW, bs4 + GC). All
eager, bf16, cached latents and text-encoder outputs (to disk: the main process caches, the other reads).

Random full-size weights come from tools/bench_shipped.py (`prepare`: SDXL W/sdxl/sdxl.safetensors; FLUX.1 W/flux/
with the dev transformer, CLIP-L, AE and a 2-layer T5-XXL: the T5's width and output are the real ones, but with
cached text-encoder outputs it only encodes the captions once before the timed loop, and 22 more layers would cost
~9 GB of writes and reads). `--tiny` makes small models of the same kinds (the CPU check).

A row's figures: the trainer's summary line (main process: median step of the steps after the warm-up, first
step, peak allocated memory since the loop began), every process's own "finished" line (its peak allocated
memory, library.data_parallel.log_process_done), the --fsdp "sharded over N processes" line, samples/s
(processes x batch / median step) and, on CUDA, the most memory nvidia-smi showed on each GPU during the run
(context and allocator reserve included, model loading too). Once every process has said it finished, every
process of the run is killed (the final save of a 24 GB model is not what is measured) unless --save.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SD_SCRIPTS = REPO / "sd-scripts"


def _bench_shipped():
    spec = importlib.util.spec_from_file_location("bench_shipped", REPO / "tools" / "bench_shipped.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench_shipped()

FINISHED = re.compile(r"process (\d+)/(\d+) finished (\d+) steps, last loss \S+, weights checksum (\S+?)"
                      r"(?:, peak GPU memory ([\d.]+) GiB)?$")
SHARDED = re.compile(r"--fsdp \w+: the parameters of the (\w+) \(([\d.]+)M, (\d+) blocks\) are sharded over (\d+) "
                     r"processes")

# a T5-XXL of 2 layers (see the docstring); the tiny set for the CPU check
T5_2_LAYERS = {**bench.T5_XXL, "num_layers": 2}
TINY_FLUX = {
    "transformer": dict(width=128, num_double=2, num_single=4, t5_dim=32, clip_dim=64, guidance=True),
    "clip_l": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=1,
                   max_position_embeddings=77, projection_dim=64, hidden_act="quick_gelu"),
    "t5xxl": dict(vocab_size=256, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                  feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False),
    "ae": dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
               up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[32] * 4, layers_per_block=1,
               latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False),
}
IMAGES = 4
REPEATS = 40  # 160 images an epoch: the timed steps stay inside the first epoch (2 processes x bs4 = 8 a step)

# the full fine-tune presets' optimizer (presets/finetune/*-24gb.toml)
ADAFACTOR = ["--optimizer_type", "Adafactor", "--optimizer_args", "scale_parameter=False", "relative_step=False",
             "warmup_init=False", "--mixed_precision", "bf16", "--full_bf16", "--save_precision", "bf16"]
CACHED = ["--cache_latents", "--cache_latents_to_disk", "--cache_text_encoder_outputs",
          "--cache_text_encoder_outputs_to_disk"]
FLUX_PRESET = ["--guidance_scale", "1.0", "--timestep_sampling", "shift", "--discrete_flow_shift", "3.1582",
               "--model_prediction_type", "raw"]
FLUX_SWAP = 22  # presets/finetune/flux-finetune-24gb.toml (upstream users: 22 on a 24 GB card)


COMPILED = ["--compile", "--compile_mode", "reduce-overhead"]  # the GUI's Enable torch.compile


@dataclass
class Row:
    family: str
    script: str
    gpus: int
    batch: int
    args: list = field(default_factory=list)
    what: str = ""


ROWS = {
    "flux_ft_fsdp": Row("flux", "flux_train.py", 2, 1, ADAFACTOR + FLUX_PRESET + ["--learning_rate", "5e-6",
                        "--fsdp", "full_shard"], "FLUX.1-dev full fine-tune 1024 bs1 + GC, --fsdp full_shard"),
    "flux_ft_swap": Row("flux", "flux_train.py", 1, 1, ADAFACTOR + FLUX_PRESET + ["--learning_rate", "5e-6",
                        "--fused_backward_pass", "--blocks_to_swap", "SWAP"],
                        "FLUX.1-dev full fine-tune 1024 bs1 + GC, --fused_backward_pass --blocks_to_swap"),
    "sdxl_ft_fsdp": Row("sdxl", "sdxl_train.py", 2, 1, ADAFACTOR + ["--learning_rate", "1e-5", "--fsdp", "full_shard"],
                        "SDXL full fine-tune 1024 bs1 + GC, --fsdp full_shard"),
    "sdxl_ft_1gpu": Row("sdxl", "sdxl_train.py", 1, 1, ADAFACTOR + ["--learning_rate", "1e-5", "--fused_backward_pass"],
                        "SDXL full fine-tune 1024 bs1 + GC, --fused_backward_pass"),
    "sdxl_ft_fsdp_adamw": Row("sdxl", "sdxl_train.py", 2, 1, [a for a in ADAFACTOR if a not in ADAFACTOR[:6]] + [
        "--optimizer_type", "AdamW", "--learning_rate", "1e-5", "--fsdp", "full_shard"],
        "SDXL full fine-tune 1024 bs1 + GC, --fsdp full_shard, AdamW (the optimizer's share of the FSDP step)"),
    "sdxl_lora_dp1": Row("sdxl", "sdxl_train_network.py", 1, 4, [], "SDXL LoRA r32 bs4 + GC, AdamW"),
    "sdxl_lora_dp2": Row("sdxl", "sdxl_train_network.py", 2, 4, [], "SDXL LoRA r32 bs4 + GC, AdamW, data parallel"),
    # --cuda_graph_step on several GPUs (issue 25 item 2): bs1 + GC, compiled as the GUI's Enable torch.compile
    # (off: the blocks record their own CUDA graphs, what auto does on 2 processes) and eager
    **{f"sdxl_lora_bs1_{n}gpu_{how}_graph_{g}": Row(
        "sdxl", "sdxl_train_network.py", n, 1, (COMPILED if how == "compiled" else []) + ["--cuda_graph_step", g],
        f"SDXL LoRA r32 bs1 + GC, AdamW, {how}, {n} GPU{'s' if n > 1 else ''}, step graph {g}")
       for n in (1, 2) for how in ("compiled", "eager") for g in ("off", "on")},
}
LORA = ["--network_module", "networks.lora", "--network_dim", "32", "--network_alpha", "16", "--network_train_unet_only",
        "--optimizer_type", "AdamW", "--learning_rate", "1e-4", "--mixed_precision", "bf16"]


def prepare(workdir: Path, family: str, tiny: bool) -> None:
    sys.path.insert(0, str(SD_SCRIPTS))
    from library import tiny_models

    resolution = 64 if tiny else 1024
    if family in ("sdxl", "both"):
        d = workdir / "sdxl"
        if tiny:
            ckpt = tiny_models.make_tiny_sd(workdir / "tiny_sdxl", "sdxl", "single_file")
            bench.prepare(d, IMAGES, resolution, checkpoint=str(ckpt), repeats=REPEATS)
        else:
            bench.prepare(d, IMAGES, resolution, repeats=REPEATS)
    if family in ("flux", "both"):
        bench.prepare_flux(workdir / "flux", TINY_FLUX if tiny else {"t5xxl": T5_2_LAYERS})
        bench.make_images(workdir / "flux", IMAGES, resolution, REPEATS)


def trainer_argv(row: Row, workdir: Path, steps: int, tiny: bool, out: Path) -> list[str]:
    d = workdir / row.family
    resolution = 64 if tiny else 1024
    args = [str(2 if tiny else FLUX_SWAP) if a == "SWAP" else a for a in row.args]
    if row.family == "flux":
        model = bench.model_argv("flux", workdir)[:10]  # the four files and the tokenizers, no LoRA module
    else:
        model = ["--pretrained_model_name_or_path", str(d / "sdxl.safetensors"),
                 "--tokenizer_cache_dir", str(d / "tokenizers")]
    return model + [
        "--train_data_dir", str(d / "data"), "--caption_extension", ".txt", "--resolution",
        f"{resolution},{resolution}", "--output_dir", str(out), "--output_name", "bench", "--overwrite_output",
        "--train_batch_size", str(row.batch), "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0",
        "--seed", "0", "--gradient_checkpointing", *CACHED,
        *(LORA if row.script == "sdxl_train_network.py" else []), *args]


def launch_argv(row: Row, tiny: bool) -> list[str]:
    """`accelerate launch` as a user types it (after the program name)."""
    several = ["--multi_gpu"] if row.gpus > 1 else []
    return ["launch", *several, "--num_processes", str(row.gpus), "--num_machines", "1",
            "--mixed_precision", "bf16", "--dynamo_backend", "no",
            *(["--num_cpu_threads_per_process", "1"] if tiny else [])]


class GpuMemory:
    """The most memory nvidia-smi shows on each GPU while it runs (MiB); nothing without nvidia-smi."""

    def __init__(self):
        self.peak: dict[int, int] = {}
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                          "-lms", "250"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                index, used = (int(x) for x in line.split(","))
            except ValueError:
                continue
            self.peak[index] = max(self.peak.get(index, 0), used)

    def stop(self) -> dict:
        if self.proc:
            self.proc.terminate()
            self.proc.wait()
        return {str(k): round(v / 1024, 2) for k, v in sorted(self.peak.items())}


def read_lines(lines: list[tuple[float, str]], row: Row) -> dict:
    """A row's figures from the trainer's timestamped output lines."""
    result: dict = {"trainer_summary": None}
    finished, first_progress = {}, None
    for t, line in lines:
        line = line.rstrip()
        if m := bench.SUMMARY.match(line):
            s = {"median_ms": float(m.group(1)), "steps": f"{m.group(2)}-{m.group(3)}", "rest": m.group(4) or ""}
            if p := bench.PEAK.search(s["rest"]):
                s["peak_gib"] = float(p.group(1))
            if f := re.search(r"first step ([\d.]+) s", s["rest"]):
                s["first_step_s"] = float(f.group(1))
            result["trainer_summary"] = s
        elif m := FINISHED.search(line):
            finished[m.group(1)] = {"steps": int(m.group(3)), "checksum": float(m.group(4)),
                                    "peak_gib": float(m.group(5)) if m.group(5) else None}
        elif m := SHARDED.search(line):
            result["sharded"] = {"model": m.group(1), "params_m": float(m.group(2)), "blocks": int(m.group(3)),
                                 "processes": int(m.group(4))}
        elif first_progress is None and bench.PROGRESS.match(line):
            first_progress = t
    if finished:
        result["ranks"] = dict(sorted(finished.items()))
    if first_progress is not None:
        result["launch_to_first_progress_s"] = round(first_progress, 1)
    summary = result["trainer_summary"]
    if summary:
        result["samples_per_s"] = round(row.gpus * row.batch / (summary["median_ms"] / 1000), 3)
    return result


def run_row(name: str, workdir: Path, steps: int, tiny: bool, timeout: float, save: bool, extra: list,
            log_out: str | None) -> dict:
    row = ROWS[name]
    out = workdir / f"out_{name}"
    argv = trainer_argv(row, workdir, steps, tiny, out) + extra
    launch = launch_argv(row, tiny)
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", *launch, str(SD_SCRIPTS / row.script), *argv]
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    if tiny:
        env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1")
    memory = GpuMemory()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(REPO),
                            start_new_session=True)  # its own process group: stopped as a whole
    stopped_early, timed_out = False, False

    def stop_all():
        """Every process of the run, the launcher's workers included, killed now and waited for (a worker left
        saving a 24 GB model would hold its GPU during the next row)."""
        import psutil

        try:
            tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        psutil.wait_procs(tree, timeout=30)

    def on_timeout():
        nonlocal timed_out
        timed_out = True
        stop_all()

    timer = threading.Timer(timeout, on_timeout) if timeout else None
    if timer:
        timer.start()
    lines = []
    log = open(log_out, "a") if log_out else None
    if log:
        log.write(f"==== {name}: accelerate {' '.join(launch)} sd-scripts/{row.script} {' '.join(argv)}\n")
    done = set()
    for line in proc.stdout:
        now = time.perf_counter() - t0
        lines.append((now, line))
        if log:
            log.write(f"{now:8.2f} {line}")
            log.flush()
        if m := FINISHED.search(line.rstrip()):
            done.add(m.group(1))
            if len(done) == row.gpus and not save:  # every process has its figures: the save is not measured
                stopped_early = True
                stop_all()
    rc = proc.wait()
    if timer:
        timer.cancel()
    if log:
        log.close()
    result = {"row": name, "what": row.what, "family": row.family, "script": row.script, "gpus": row.gpus,
              "batch": row.batch, "steps": steps, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
              "stopped_after_figures": stopped_early, "timed_out": timed_out,
              "launch": f"accelerate {' '.join(launch)} sd-scripts/{row.script} " + " ".join(argv),
              "gpu_memory_used_gib_max": memory.stop()}
    result.update(read_lines(lines, row))
    ok = result["trainer_summary"] is not None and len(result.get("ranks", {})) == row.gpus
    result["ok"] = ok and (rc == 0 or stopped_early) and not timed_out
    if not result["ok"]:
        result["log_tail"] = [ln.rstrip() for _, ln in lines[-40:]]
    if save and rc == 0:
        saved = sorted(p.name for p in out.iterdir()) if out.exists() else []
        result["saved"] = {n: (out / n).stat().st_size for n in saved if (out / n).is_file()}
    return result


def report(paths: list[str]) -> str:
    rows = [json.loads(Path(p).read_text()) for p in paths]
    lines = ["| row | GPUs | median step | samples/s | first step | peak allocated per GPU (each rank) | "
             "nvidia-smi max per GPU | ok |", "|---|---|---|---|---|---|---|---|"]
    by, medians, checksums = {}, {}, {}
    for r in rows:
        s = r.get("trainer_summary") or {}
        ranks = r.get("ranks") or {}
        peaks = ", ".join(f"{v['peak_gib']} GiB" if v.get("peak_gib") is not None else "-" for v in ranks.values())
        smi = ", ".join(f"{v} GiB" for v in (r.get("gpu_memory_used_gib_max") or {}).values())
        lines.append(f"| {r['what']} | {r['gpus']} | {s.get('median_ms', '-')} ms | {r.get('samples_per_s', '-')} | "
                     f"{s.get('first_step_s', '-')} s | {peaks} | {smi} | {'yes' if r['ok'] else 'no (rc %s)' % r['rc']} |")
        by[r["row"]] = r.get("samples_per_s")
        medians[r["row"]] = s.get("median_ms")
        checksums[r["row"]] = next(iter(ranks.values()), {}).get("checksum")
    for a, b, label in (("sdxl_lora_dp1", "sdxl_lora_dp2", "SDXL LoRA bs4 + GC, 2 GPUs / 1 GPU samples/s"),
                        ("sdxl_ft_1gpu", "sdxl_ft_fsdp", "SDXL full FT, FSDP 2 GPUs / 1 GPU samples/s"),
                        ("flux_ft_swap", "flux_ft_fsdp", "FLUX.1 full FT, FSDP 2 GPUs / 1 GPU + swap samples/s")):
        if by.get(a) and by.get(b):
            lines.append(f"\n{label}: {by[b] / by[a]:.2f}x")
    for off in sorted(k for k in medians if k.endswith("_graph_off")):  # --cuda_graph_step on against off
        on = off[:-len("off")] + "on"
        if medians.get(off) and medians.get(on):
            same = ""
            if checksums.get(off) is not None and checksums.get(on) is not None:
                same = f", weights checksum on/off - 1 = {checksums[on] / checksums[off] - 1:.2e}"
            lines.append(f"\n{on[:-len('_graph_on')]}: step graph on {medians[on]} ms / off {medians[off]} ms = "
                         f"{medians[on] / medians[off]:.3f}{same}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        print(report(argv[1:]))
        return 0
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("prepare", "run"))
    p.add_argument("row", nargs="?", choices=sorted(ROWS))
    p.add_argument("--workdir", default="/tmp/bench_multi_gpu")
    p.add_argument("--family", choices=("sdxl", "flux", "both"), default="both", help="prepare: which models")
    p.add_argument("--tiny", action="store_true", help="small models, 64 px, CPU processes (gloo)")
    p.add_argument("--steps", type=int, default=12, help="the summary's median is over the last half (up to 10 "
                                                         "warm-up steps left out)")
    p.add_argument("--timeout", type=float, default=0, help="stop the run after this many seconds (0: never)")
    p.add_argument("--save", action="store_true", help="let the trainer save its model (not stopped early)")
    p.add_argument("--json_out", default=None)
    p.add_argument("--log_out", default=None, help="append the trainer's output, each line timestamped, here")
    args = p.parse_args(argv[:len(argv) - len(extra) - (1 if "--" in argv else 0)])
    workdir = Path(args.workdir).resolve()
    if args.action == "prepare":
        prepare(workdir, args.family, args.tiny)
        return 0
    if not args.row:
        p.error("run needs a ROW: " + ", ".join(sorted(ROWS)))
    result = run_row(args.row, workdir, args.steps, args.tiny, args.timeout, args.save, extra, args.log_out)
    text = json.dumps(result, indent=1)
    if args.json_out:
        Path(args.json_out).write_text(text)
    summary = {k: result.get(k) for k in ("row", "ok", "rc", "wall_s", "samples_per_s", "ranks",
                                          "gpu_memory_used_gib_max")}
    summary["median_ms"] = (result["trainer_summary"] or {}).get("median_ms")
    print(json.dumps(summary), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

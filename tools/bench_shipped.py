"""Times the SHIPPED trainers (what users run) on a random full-size SDXL checkpoint, eager and compiled.

    python tools/bench_shipped.py prepare --workdir W                 # random full-size SDXL + 1024 px images
    python tools/bench_shipped.py run --workdir W --steps 60 [--gradient_checkpointing] [--batch_size 4]
           [--phases eager,compiled] [--compile_mode reduce-overhead] [--scripts_dir OTHER/sd-scripts]

`prepare` writes `W/sdxl.safetensors` (SGM keys, bf16, random weights: nothing is downloaded), tokenizers
and a kohya image folder. `run` starts `sdxl_train_network.py` once per phase (LoRA r32, bf16, AdamW, cached
latents and text-encoder outputs) and reports two figures per phase:
- the trainer's own summary line ("median step ... ms"; library/step_timer.py), and
- a measurement from outside: the time between the progress lines the trainer prints (at most one a second)
  after the warm-up steps. It needs nothing from the trainer but its progress line, so it also times older
  versions of the scripts (`--scripts_dir`), for before/after comparisons in one call.
Run it on a CUDA machine; the figures go to docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SD_SCRIPTS = REPO / "sd-scripts"

PROGRESS = re.compile(r"^steps: (\d+)/(\d+) ")
SUMMARY = re.compile(r"^median step ([\d.]+) ms \(steps (\d+)-(\d+)\)(?:; (.*))?$")


def prepare(workdir: Path, images: int, resolution: int, checkpoint: str | None = None) -> None:
    sys.path.insert(0, str(SD_SCRIPTS))
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTokenizer

    from library import flux_tiny, model_util, tiny_models
    from library.model_util import SDComponents, load_arch_config

    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = workdir / "sdxl.safetensors"
    if checkpoint and not ckpt.exists():  # an SDXL single file (tokenizers beside it), e.g. the tests' tiny one
        os.symlink(Path(checkpoint).resolve(), ckpt)
        os.symlink(Path(checkpoint).resolve().parent / "tokenizers", workdir / "tokenizers")
    if not ckpt.exists():
        tok_dirs = [tiny_models.make_tiny_tokenizer(workdir / "tokenizers" / "tokenizer"),
                    tiny_models.make_tiny_tokenizer(workdir / "tokenizers" / "tokenizer_2", pad_token="!")]
        t0 = time.perf_counter()

        def random(module_fn, seed):  # full size, built without init and filled from a random pool
            with init_empty_weights():
                m = module_fn()
            return flux_tiny._randomize(m.to(torch.bfloat16).to_empty(device="cpu"), seed, std=0.02)

        tes = [random(lambda c=c: model_util._clip_class(load_arch_config("sdxl", c))(
            model_util._clip_config(load_arch_config("sdxl", c))), i)
            for i, c in enumerate(("text_encoder", "text_encoder_2"))]
        unet = random(lambda: UNet2DConditionModel.from_config(load_arch_config("sdxl", "unet")), 2)
        vae = random(lambda: AutoencoderKL.from_config(load_arch_config("sdxl", "vae")), 3)
        comps = SDComponents(family="sdxl", unet=unet, vae=vae, text_encoders=tes,
                             tokenizers=[CLIPTokenizer.from_pretrained(str(d)) for d in tok_dirs],
                             prediction_type="epsilon", source="random full-size sdxl")
        model_util.save_sd_checkpoint(ckpt, comps, save_dtype=torch.bfloat16)
        print(f"wrote {ckpt} ({ckpt.stat().st_size / 2**30:.1f} GiB) in {time.perf_counter() - t0:.0f} s")
    if not (workdir / "data").exists():
        tiny_models.make_captioned_images(workdir / "data", n=images, size=(resolution, resolution), repeats=1,
                                          name="bench")


def trainer_argv(args, phase: str, workdir: Path) -> list[str]:
    out = workdir / f"out_{phase}"
    argv = [
        "--pretrained_model_name_or_path", str(workdir / "sdxl.safetensors"),
        "--tokenizer_cache_dir", str(workdir / "tokenizers"), "--train_data_dir", str(workdir / "data"),
        "--resolution", f"{args.resolution},{args.resolution}", "--output_dir", str(out), "--output_name", "bench",
        "--overwrite_output", "--network_module", "networks.lora", "--network_dim", str(args.network_dim),
        "--network_alpha", str(args.network_dim / 2), "--network_train_unet_only",
        "--max_train_steps", str(args.steps), "--learning_rate", "1e-4", "--optimizer_type", "AdamW",
        "--mixed_precision", "bf16", "--cache_latents", "--cache_text_encoder_outputs",
        "--train_batch_size", str(args.batch_size), "--max_data_loader_n_workers", "0", "--seed", "0",
    ]
    if args.gradient_checkpointing:
        argv.append("--gradient_checkpointing")
    if phase == "compiled":
        argv += ["--compile", "--compile_mode", args.compile_mode,
                 "--compile_cache_dir", str(workdir / f"compile_cache_{args.tag}")]
    return argv + args.extra


def run_phase(args, phase: str, workdir: Path) -> dict:
    scripts_dir = Path(args.scripts_dir).resolve()
    script = scripts_dir / "sdxl_train_network.py"
    cmd = [sys.executable, str(script)] + trainer_argv(args, phase, workdir)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    points, summary, tail = [], None, []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(scripts_dir.parent))
    for line in proc.stdout:
        now = time.perf_counter() - t0
        line = line.rstrip("\n")
        tail = (tail + [line])[-40:]
        if m := PROGRESS.match(line):
            points.append((int(m.group(1)), now))
        elif m := SUMMARY.match(line):
            summary = {"median_ms": float(m.group(1)), "steps": f"{m.group(2)}-{m.group(3)}",
                       "first_steps": m.group(4)}
    rc = proc.wait()
    result = {"phase": phase, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "trainer_summary": summary}
    if rc != 0:
        result["log_tail"] = tail
        return result
    later = [(s, t) for s, t in points if s >= args.warmup]
    if len(later) >= 2 and later[-1][0] > later[0][0]:
        (s0, t0_), (s1, t1) = later[0], later[-1]
        result["outside_ms_per_step"] = round((t1 - t0_) / (s1 - s0) * 1000, 1)
        result["outside_steps"] = f"{s0}-{s1}"
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("prepare", "run"))
    p.add_argument("--workdir", default="bench_work")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the outside measurement")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--network_dim", type=int, default=32)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--phases", default="eager,compiled")
    p.add_argument("--compile_mode", default="reduce-overhead")
    p.add_argument("--scripts_dir", default=str(SD_SCRIPTS), help="the sd-scripts folder to time (default: ours)")
    p.add_argument("--tag", default="main", help="names the run in the output and its compile cache")
    p.add_argument("--checkpoint", default=None,
                   help="prepare: use this SDXL single file (tokenizers/ beside it) instead of a random full-size one")
    p.add_argument("--json_out", default=None)
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # more trainer flags, after --
    args = p.parse_args(argv[:len(argv) - len(extra) - (1 if extra else 0)])
    args.extra = extra
    workdir = Path(args.workdir).resolve()
    if args.action == "prepare":
        prepare(workdir, args.images, args.resolution, args.checkpoint)
        return 0
    results = []
    for phase in args.phases.split(","):
        r = run_phase(args, phase, workdir)
        r.update(tag=args.tag, batch_size=args.batch_size, gradient_checkpointing=args.gradient_checkpointing)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

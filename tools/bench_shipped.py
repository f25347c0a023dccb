"""Times the SHIPPED trainers (what users run) on random full-size SDXL or FLUX.1 checkpoints, eager and compiled.

    python tools/bench_shipped.py prepare --workdir W [--family flux] [--buckets]  # random full-size models + images
    python tools/bench_shipped.py run --workdir W --steps 60 [--family flux] [--gradient_checkpointing]
           [--batch_size 4] [--phases eager,compiled] [--compile_mode reduce-overhead] [--scripts_dir OTHER/sd-scripts]
           [--buckets] [--recompiles] [--time_graphs] [--cache_tag T] [--timeout S] [--log_out FILE]
           [--json_out FILE] [-- more trainer flags]
    python tools/bench_shipped.py report FILE.json ...  # the runs' --json_out files -> default-vs-best table

`prepare` writes random weights in users' file layouts (nothing is downloaded): SDXL `W/sdxl.safetensors` (SGM
keys, bf16); FLUX.1 `W/flux/` with the BFL dev transformer, CLIP-L, T5-XXL (bf16) and the AE, all full size. Plus
tokenizers and a kohya image folder (its images repeated `--repeats` times, so that the timed steps fall inside
one epoch, as on a user's dataset). `run` starts `sdxl_train_network.py` (LoRA r32) or `flux_train_network.py`
(LoRA r16) once per phase (bf16, AdamW, cached latents and text-encoder outputs) and reports two figures per phase:
- the trainer's own summary line ("median step ... ms"; library/step_timer.py), and
- a measurement from outside: the time between the progress lines the trainer prints (at most one a second)
  after the warm-up steps. It needs nothing from the trainer but its progress line, so it also times older
  versions of the scripts (`--scripts_dir`), for before/after comparisons in one call.
Run it on a CUDA machine; the figures go to docs/BENCHMARKS.md.

Bucketed datasets (`prepare --buckets`, `run --buckets`): `W/data_buckets` holds --bucket_images images of each of
BUCKET_SIZES (four 1024 px-area buckets), trained with --enable_bucket, so the compiled trainer meets four input
shapes in a shuffled order. A run then also reports, from the trainer's log: each new input shape and the step it
came at, the setup steps (compile, CUDA-graph recording) and their total time from the trainer's summary, and with
--recompiles (TORCH_LOGS=recompiles) torch's recompiles, counted by how many shapes had been seen when each came.
Every compiled run reports `compile_line_to_step2_done_s`: from the trainer's "Compiling ... with torch.compile"
line to its progress line for step 1, which it prints once step 2 has run (the loss is read a step late); step 3
done (issue 15's warm-restart target) is one more step, whose time the summary's median gives. `--cache_tag` runs on the compile
cache of another tag (a warm restart); `--time_graphs` runs the trainer through tools/graph_timing.py.
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
PEAK = re.compile(r"peak GPU memory ([\d.]+) GiB")
SETUP = re.compile(r"(\d+) input shapes: (\d+) setup steps \(([^)]*)\) ([\d.]+) s in all")
NEW_SHAPE = re.compile(r"torch\.compile: new input shape (\S+)(?: at step (\d+))? \((\d+) so far\)")
COMPILING = re.compile(r"Compiling .* with torch\.compile")
RECOMPILE = "Recompiling function"
GRAPH_TIMING = re.compile(r"^graph_timing: (\{.*\})$")

# the image folder's repeats: an epoch longer than a run's steps, as on a user's dataset (an epoch's end waits for
# the GPU; a one-batch epoch would do that every step)
REPEATS = 40

# (width, height) of the bucketed set: four buckets of about 1024x1024 pixels, as SDXL users train
BUCKET_SIZES = ((1024, 1024), (896, 1152), (1152, 896), (832, 1216))


def prepare(workdir: Path, images: int, resolution: int, checkpoint: str | None = None, family: str = "sdxl",
            bucket_images: int = 0, repeats: int = REPEATS) -> None:
    sys.path.insert(0, str(SD_SCRIPTS))
    if bucket_images:
        make_bucket_images(workdir, bucket_images)
    if family == "flux":
        prepare_flux(workdir / "flux")
        return make_images(workdir, images, resolution, repeats)
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
    make_images(workdir, images, resolution, repeats)


# FLUX.1-dev's shapes (black-forest-labs/FLUX.1-dev): transformer, CLIP-L and T5-XXL v1.1 encoder, AE
FLUX_DEV = dict(width=3072, num_double=19, num_single=38, t5_dim=4096, clip_dim=768, guidance=True)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
FLUX_AE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
               up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
               latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False)


def prepare_flux(dest: Path, shapes: dict | None = None) -> None:
    """The four FLUX.1 files a user passes (--pretrained_model_name_or_path, --clip_l, --t5xxl, --ae) with random
    weights, plus tokenizers (character vocabularies; ids stay inside the real vocabularies). `shapes` overrides
    the model sizes (the CPU test makes a small set)."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from library import flux_models, flux_tiny

    shapes = {"transformer": FLUX_DEV, "clip_l": CLIP_L, "t5xxl": T5_XXL, "ae": FLUX_AE, **(shapes or {})}
    if (dest / "ae.safetensors").exists():
        return
    dest.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    flux_tiny.make_clip_tokenizer(dest / "tokenizers" / "tokenizer")
    flux_tiny.make_t5_tokenizer(dest / "tokenizers" / "tokenizer_2")

    def random(module_fn, seed, dtype):
        with init_empty_weights():
            m = module_fn()
        return flux_tiny._randomize(m.to(dtype).to_empty(device="cpu"), seed, std=0.02)

    def write(name, sd):
        save_file({k: v.contiguous() for k, v in sd.items()}, str(dest / name))
        print(f"wrote {dest / name} ({(dest / name).stat().st_size / 2**30:.1f} GiB) "
              f"at {time.perf_counter() - t0:.0f} s", flush=True)

    transformer = flux_tiny.tiny_transformer(**shapes["transformer"], dtype=torch.bfloat16)
    write("flux.safetensors", flux_models.diffusers_to_bfl(transformer.state_dict()))
    del transformer
    clip = random(lambda: CLIPTextModel(CLIPTextConfig(**shapes["clip_l"])), 1, torch.bfloat16)
    write("clip_l.safetensors", {"text_model." + k.removeprefix("text_model."): v
                                 for k, v in clip.state_dict().items()})
    t5 = random(lambda: T5EncoderModel(T5Config(**shapes["t5xxl"])), 2, torch.bfloat16)
    write("t5xxl.safetensors", {k: v for k, v in t5.state_dict().items() if k != "encoder.embed_tokens.weight"})
    del t5
    ae = random(lambda: AutoencoderKL(**shapes["ae"], scaling_factor=flux_models.AE_SCALING_FACTOR,
                                      shift_factor=flux_models.AE_SHIFT_FACTOR), 3, torch.float32)
    write("ae.safetensors", flux_models.ae_diffusers_to_bfl(ae.state_dict()))


def make_images(workdir: Path, images: int, resolution: int, repeats: int = REPEATS) -> None:
    from library import tiny_models

    if not (workdir / "data").exists():
        tiny_models.make_captioned_images(workdir / "data", n=images, size=(resolution, resolution), repeats=repeats,
                                          name="bench")


def make_bucket_images(workdir: Path, per_size: int, sizes=BUCKET_SIZES) -> Path:
    """`per_size` captioned images of each (width, height) in `sizes`, one kohya folder per size, in W/data_buckets."""
    from library import tiny_models

    dest = workdir / "data_buckets"
    if not dest.exists():
        for w, h in sizes:
            tiny_models.make_captioned_images(dest, n=per_size, size=(w, h), repeats=1, name=f"b{w}x{h}")
    return dest


SCRIPTS = {"sdxl": "sdxl_train_network.py", "flux": "flux_train_network.py"}


def model_argv(family: str, workdir: Path) -> list[str]:
    if family == "flux":
        d = workdir / "flux"
        return ["--pretrained_model_name_or_path", str(d / "flux.safetensors"), "--clip_l", str(d / "clip_l.safetensors"),
                "--t5xxl", str(d / "t5xxl.safetensors"), "--ae", str(d / "ae.safetensors"),
                "--tokenizer_cache_dir", str(d / "tokenizers"), "--network_module", "networks.lora_flux"]
    return ["--pretrained_model_name_or_path", str(workdir / "sdxl.safetensors"),
            "--tokenizer_cache_dir", str(workdir / "tokenizers"), "--network_module", "networks.lora"]


def trainer_argv(args, phase: str, workdir: Path) -> list[str]:
    out = workdir / f"out_{args.tag}_{phase}"
    dim = args.network_dim or (16 if args.family == "flux" else 32)
    argv = model_argv(args.family, workdir) + [
        "--train_data_dir", str(workdir / ("data_buckets" if args.buckets else "data")),
        "--resolution", f"{args.resolution},{args.resolution}", "--output_dir", str(out), "--output_name", "bench",
        "--overwrite_output", "--network_dim", str(dim),
        "--network_alpha", str(dim / 2), "--network_train_unet_only",
        "--max_train_steps", str(args.steps), "--learning_rate", "1e-4", "--optimizer_type", "AdamW",
        "--mixed_precision", "bf16", "--cache_latents", "--cache_text_encoder_outputs",
        "--train_batch_size", str(args.batch_size), "--max_data_loader_n_workers", "0", "--seed", "0",
    ]
    if args.gradient_checkpointing:
        argv.append("--gradient_checkpointing")
    if args.buckets:
        sides = [side for size in BUCKET_SIZES for side in size]
        argv += ["--enable_bucket", "--min_bucket_reso", str(min(sides)), "--max_bucket_reso", str(max(sides))]
    if phase == "compiled":
        argv += ["--compile", "--compile_mode", args.compile_mode,
                 "--compile_cache_dir", str(workdir / f"compile_cache_{args.cache_tag or args.tag}")]
    return argv + args.extra


def read_log(lines: list[tuple[float, str]], warmup: int) -> dict:
    """The figures a run's timestamped output lines give (see the module's docstring)."""
    result: dict = {}
    points, shapes, recompiles = [], [], {}
    compiling = graph_timing = None
    for t, line in lines:
        if m := PROGRESS.match(line):
            points.append((int(m.group(1)), t))
        elif m := SUMMARY.match(line):
            result["trainer_summary"] = {"median_ms": float(m.group(1)), "steps": f"{m.group(2)}-{m.group(3)}",
                                         "first_steps": m.group(4)}
            if m.group(4) and (p := PEAK.search(m.group(4))):
                result["trainer_summary"]["peak_gib"] = float(p.group(1))
            if m.group(4) and (s := SETUP.search(m.group(4))):
                result["setup"] = {"shapes": int(s.group(1)), "steps": int(s.group(2)), "what": s.group(3),
                                   "seconds": float(s.group(4))}
        elif m := GRAPH_TIMING.match(line):
            graph_timing = json.loads(m.group(1))
        if compiling is None and COMPILING.search(line):
            compiling = t
        if m := NEW_SHAPE.search(line):
            shapes.append({"shape": m.group(1), "step": int(m.group(2)) if m.group(2) else None, "at_s": round(t, 1)})
        if RECOMPILE in line:
            recompiles[len(shapes)] = recompiles.get(len(shapes), 0) + 1
    if shapes:
        result["new_shapes"] = shapes
    if recompiles or shapes:
        # shapes seen when each recompile came -> how many: {"1": 1} is one recompile during the first shape's steps
        result["recompiles"] = sum(recompiles.values())
        result["recompiles_by_shapes_seen"] = {str(k): v for k, v in sorted(recompiles.items())}
    if graph_timing is not None:
        result["graph_timing"] = graph_timing
    if compiling is not None:
        step1 = [t for s, t in points if s == 1]  # always printed, once step 2 has run (the loss is read late)
        if step1:
            result["compile_line_to_step2_done_s"] = round(step1[0] - compiling, 1)
    later = [(s, t) for s, t in points if s >= warmup]
    if len(later) >= 2 and later[-1][0] > later[0][0]:
        (s0, t0_), (s1, t1) = later[0], later[-1]
        result["outside_ms_per_step"] = round((t1 - t0_) / (s1 - s0) * 1000, 1)
        result["outside_steps"] = f"{s0}-{s1}"
    return result


def run_phase(args, phase: str, workdir: Path) -> dict:
    scripts_dir = Path(args.scripts_dir).resolve()
    script = scripts_dir / SCRIPTS[args.family]
    runner = [str(REPO / "tools" / "graph_timing.py")] if args.time_graphs else []
    cmd = [sys.executable] + runner + [str(script)] + trainer_argv(args, phase, workdir)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.recompiles:
        env["TORCH_LOGS"] = ",".join(filter(None, [env.get("TORCH_LOGS"), "recompiles"]))
    t0 = time.perf_counter()
    lines, timed_out = [], False
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(scripts_dir.parent))
    timer = None
    if args.timeout:
        import threading

        def stop():
            nonlocal timed_out
            timed_out = True
            proc.kill()

        timer = threading.Timer(args.timeout, stop)
        timer.start()
    log = open(args.log_out, "a") if args.log_out else None
    for line in proc.stdout:
        now = time.perf_counter() - t0
        line = line.rstrip("\n")
        lines.append((now, line))
        if log:
            log.write(f"{now:8.2f} {line}\n")
    rc = proc.wait()
    if timer:
        timer.cancel()
    if log:
        log.close()
    result = {"phase": phase, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "trainer_summary": None}
    if timed_out:
        result["timed_out_after_s"] = args.timeout
    result.update(read_log(lines, args.warmup))
    result["auto_chose"] = auto_choices([line for _, line in lines])
    if rc != 0:
        result["log_tail"] = [line for _, line in lines[-40:]]
    return result


# what the trainer's log says auto chose (library.compile.graphs.resolve, library.compile.regional)
AUTO_CHOICE = re.compile(r"--cuda_graph_step auto: (on|off)")
STATIC = "static shapes (--compile_dynamic auto"


def auto_choices(lines: list[str]) -> str:
    """A few words on what the trainer's auto settings chose, from its log lines."""
    words = []
    for line in lines:
        if m := AUTO_CHOICE.search(line):
            words.append(f"step graph {m.group(1)}")
        if STATIC in line:
            words.append("static")
        if "image-size dimensions of their inputs dynamic" in line:
            words.append("inputs dynamic")
    return ", ".join(dict.fromkeys(words))


def report(paths: list[str]) -> str:
    """One markdown row per run of the --json_out files: the workload, the trainer flags beyond the defaults, the
    scripts (their tag), what auto chose, the median step and peak memory; rows of one workload and flags side by
    side, the fastest in bold."""
    runs = [r for path in paths for r in json.loads(Path(path).read_text())]

    def key(r) -> tuple[str, str]:
        return r["workload"], " ".join(r.get("extra") or []) or "default"

    best: dict[tuple, float] = {}
    for r in runs:
        ms = (r.get("trainer_summary") or {}).get("median_ms")
        if ms is not None:
            best[key(r)] = min(best.get(key(r), ms), ms)
    rows = ["| workload | flags | scripts | auto chose | median step | peak | outside |", "|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (*key(r), r["tag"])):
        summary = r.get("trainer_summary") or {}
        ms = summary.get("median_ms")
        shown = "failed (rc %s)" % r["rc"] if ms is None else (f"**{ms} ms**" if ms == best[key(r)] else f"{ms} ms")
        peak = f"{summary['peak_gib']} GiB" if "peak_gib" in summary else ""
        outside = f"{r['outside_ms_per_step']} ms" if "outside_ms_per_step" in r else ""
        rows.append(f"| {key(r)[0]} | {key(r)[1]} | {r['tag']} | {r.get('auto_chose') or ''} | {shown} | {peak} | "
                    f"{outside} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        print(report(argv[1:]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("prepare", "run"))
    p.add_argument("--workdir", default="bench_work")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=REPEATS, help="prepare: the image folder's repeats")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the outside measurement")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--family", choices=sorted(SCRIPTS), default="sdxl")
    p.add_argument("--network_dim", type=int, default=None, help="default: 32 (SDXL), 16 (FLUX.1)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--phases", default="eager,compiled")
    p.add_argument("--compile_mode", default="reduce-overhead")
    p.add_argument("--scripts_dir", default=str(SD_SCRIPTS), help="the sd-scripts folder to time (default: ours)")
    p.add_argument("--tag", default="main", help="names the run in the output and its compile cache")
    p.add_argument("--checkpoint", default=None,
                   help="prepare: use this SDXL single file (tokenizers/ beside it) instead of a random full-size one")
    p.add_argument("--json_out", default=None)
    p.add_argument("--buckets", action="store_true",
                   help="prepare: also write the bucketed image set; run: train on it (--enable_bucket)")
    p.add_argument("--bucket_images", type=int, default=2, help="prepare --buckets: images of each bucket size")
    p.add_argument("--recompiles", action="store_true", help="count torch's recompiles (TORCH_LOGS=recompiles)")
    p.add_argument("--time_graphs", action="store_true",
                   help="run the trainer through tools/graph_timing.py (CUDA-graph recording and compile timers)")
    p.add_argument("--cache_tag", default=None, help="use the compile cache of this tag (default: --tag)")
    p.add_argument("--timeout", type=float, default=0, help="stop a phase after this many seconds (0: never)")
    p.add_argument("--log_out", default=None, help="append the trainer's output, each line timestamped, here")
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # more trainer flags, after --
    args = p.parse_args(argv[:len(argv) - len(extra) - (1 if extra else 0)])
    args.extra = extra
    workdir = Path(args.workdir).resolve()
    if args.action == "prepare":
        prepare(workdir, args.images, args.resolution, args.checkpoint, args.family,
                args.bucket_images if args.buckets else 0, args.repeats)
        return 0
    results = []
    for phase in args.phases.split(","):
        r = run_phase(args, phase, workdir)
        r.update(workload=f"{args.family.upper()} bs{args.batch_size}" + (" + GC" if args.gradient_checkpointing else "")
                 + (" buckets" if args.buckets else "") + ("" if phase == "compiled" else f" {phase}"),
                 extra=args.extra, tag=args.tag, family=args.family, batch_size=args.batch_size,
                 gradient_checkpointing=args.gradient_checkpointing, buckets=args.buckets,
                 cache_tag=args.cache_tag or args.tag, scripts_dir=args.scripts_dir)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

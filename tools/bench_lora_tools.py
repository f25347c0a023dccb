"""Wall time of the LoRA tools on random full-size weights, ours and (with --upstream) kohya-ss/sd-scripts' on the
same files: FLUX.1 extract, SDXL LoRA resize (fixed and sv_fro), SDXL merge into the model, SDXL extract.

    python tools/bench_lora_tools.py --work_dir /tmp/lora_bench --device cuda \
        [--upstream /path/to/kohya-ss/sd-scripts --upstream_python /path/to/its/venv/bin/python]
    python tools/bench_lora_tools.py --work_dir /tmp/lora_bench --size tiny --device cpu    # a quick check

Inputs are made once under --work_dir (full size: SDXL checkpoint fp16 ~7 GB, SDXL LoRA rank 32 with 3x3 convs at
16, two FLUX.1-dev-shaped transformers in bf16 ~24 GB each, the tuned one = the original + full-rank noise) and
reused; with bf16 FLUX files and upstream's outputs too it needs ~70 GB of disk (--flux_dtype fp8: ~45 GB). Each
command runs in its own process (model loading included: what a user waits for); the table goes to
stdout and --json. Print the commands without running them with --dry_run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "sd-scripts"))

SIZES = {"full": {"flux": (3072, 19, 38), "sdxl": None, "lora_dim": 32, "conv_dim": 16},
         "tiny": {"flux": (128, 1, 2), "sdxl": "tiny", "lora_dim": 8, "conv_dim": 4}}


def _flux_entries(width: int, n_double: int, n_single: int, seed: int, noise: float, dtype=None):
    """(name, shape, make) of a FLUX.1 BFL transformer: shapes from diffusers' model on the meta device, values
    drawn per tensor (seeded by name), the tuned copy = the same values + noise * full-rank Gaussian."""
    import zlib

    import torch
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    from library import flux_models
    from library.saving import TensorEntry

    with init_empty_weights():
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=n_double, num_single_layers=n_single,
                                       attention_head_dim=flux_models.HEAD_DIM,
                                       num_attention_heads=width // flux_models.HEAD_DIM, joint_attention_dim=4096,
                                       pooled_projection_dim=768, guidance_embeds=True,
                                       axes_dims_rope=list(flux_models.ROPE_AXES))
    shapes = {k: tuple(v.shape) for k, v in flux_models.diffusers_to_bfl(model.state_dict()).items()}

    def make(name, shape):
        def draw():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            w = torch.randn(shape, generator=g) * (0.5 / width ** 0.5)
            if noise:
                w += torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * noise / width ** 0.5
            return w.to(dtype)
        return draw

    dtype = dtype or torch.bfloat16
    return [TensorEntry(k, s, dtype, make(k, s)) for k, s in shapes.items()]


def make_inputs(work: Path, size: str, flux_dtype: str = "bf16") -> dict[str, str]:
    import torch

    from library import lora_tools, model_util, tiny_models
    from library.saving import save_safetensors_streaming
    from networks import lora

    cfg = SIZES[size]
    work.mkdir(parents=True, exist_ok=True)
    paths = {"sdxl": str(work / "sdxl.safetensors"), "sdxl_lora": str(work / "sdxl_lora.safetensors"),
             "flux_org": str(work / "flux_org.safetensors"), "flux_tuned": str(work / "flux_tuned.safetensors")}
    for key, noise in (("flux_org", 0.0), ("flux_tuned", 0.01)):
        if not os.path.exists(paths[key]):
            print(f"making {paths[key]}", flush=True)
            dtype = torch.float8_e4m3fn if flux_dtype == "fp8" else torch.bfloat16
            save_safetensors_streaming(paths[key], _flux_entries(*cfg["flux"], seed=1, noise=noise, dtype=dtype))
    if not os.path.exists(paths["sdxl"]):
        print(f"making {paths['sdxl']}", flush=True)
        if cfg["sdxl"] == "tiny":
            made = tiny_models.make_tiny_sd(work / "tiny_sdxl", "sdxl", "single_file")
            os.link(made, paths["sdxl"])
        else:
            comps = full_sdxl_components()
            model_util.save_sd_checkpoint(paths["sdxl"], comps, save_dtype=torch.float16)
    if not os.path.exists(paths["sdxl_lora"]):
        print(f"making {paths['sdxl_lora']}", flush=True)
        comps = model_util.load_sd_components(paths["sdxl"], "sdxl", dtype=torch.float16, tokenizers=False)
        net = lora.create_network(1.0, cfg["lora_dim"], cfg["lora_dim"] / 2, None, comps.text_encoders, comps.unet,
                                  conv_dim=cfg["conv_dim"], conv_alpha=cfg["conv_dim"] / 2)
        net.apply_to(comps.text_encoders, comps.unet)
        g = torch.Generator().manual_seed(0)
        for p in net.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.02
        lora_tools.save_lora(paths["sdxl_lora"], net.lora_state_dict(torch.float16),
                             {"ss_base_model_version": "sdxl_base_v1-0", "ss_network_dim": str(cfg["lora_dim"])},
                             overwrite=False)
    return paths


def full_sdxl_components():
    """SDXL base-shaped UNet / VAE / text encoders (the shipped configs) with small random weights, fp16."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from library import model_util

    def rand(module):
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02).to(p.dtype))
        return module.eval()

    unet = rand(UNet2DConditionModel.from_config(model_util.load_arch_config("sdxl", "unet")).to(torch.float16))
    vae = rand(AutoencoderKL.from_config(model_util.load_arch_config("sdxl", "vae")).to(torch.float16))
    tes = []
    for name in ("text_encoder", "text_encoder_2"):
        cfg = model_util.load_arch_config("sdxl", name)
        tes.append(rand(model_util._clip_class(cfg)(model_util._clip_config(cfg)).to(torch.float16)))
    # logit_scale: in every SDXL base file, and upstream's loader reads it
    extra = {model_util.SDXL_TE2_PREFIX + "logit_scale": torch.tensor(4.6052, dtype=torch.float16)}
    return model_util.SDComponents(family="sdxl", unet=unet, vae=vae, text_encoders=tes, tokenizers=[],
                                   extra_state=extra)


def commands(root: str, python: str, paths: dict, out: Path, device: str, cfg: dict, ours: bool) -> dict[str, list]:
    net = f"{root}/networks"
    extra = ["--overwrite"] if ours else []
    half = str(cfg["lora_dim"] // 2)
    return {
        "flux_extract": [python, f"{net}/flux_extract_lora.py", "--model_org", paths["flux_org"], "--model_tuned",
                         paths["flux_tuned"], "--save_to", str(out / "flux_extracted.safetensors"), "--dim", "16",
                         "--device", device, *extra],
        "sdxl_resize": [python, f"{net}/resize_lora.py", "--model", paths["sdxl_lora"], "--save_to",
                        str(out / "resized.safetensors"), "--new_rank", half, "--device", device, *extra],
        "sdxl_resize_sv_fro": [python, f"{net}/resize_lora.py", "--model", paths["sdxl_lora"], "--save_to",
                               str(out / "resized_fro.safetensors"), "--new_rank", str(cfg["lora_dim"]),
                               "--dynamic_method", "sv_fro", "--dynamic_param", "0.9", "--device", device, *extra],
        "sdxl_merge": [python, f"{net}/sdxl_merge_lora.py", "--sd_model", paths["sdxl"], "--models",
                       paths["sdxl_lora"], "--ratios", "1", "--save_to", str(out / "merged.safetensors"),
                       "--save_precision", "fp16", *extra],
        "sdxl_extract": [python, f"{net}/extract_lora_from_models.py", "--sdxl", "--model_org", paths["sdxl"],
                         "--model_tuned", str(out / "merged.safetensors"), "--save_to",
                         str(out / "sdxl_extracted.safetensors"), "--dim", str(cfg["lora_dim"]), "--conv_dim",
                         str(cfg["conv_dim"]), "--device", device, *extra],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work_dir", type=Path, required=True)
    ap.add_argument("--size", choices=list(SIZES), default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--flux_dtype", choices=("bf16", "fp8"), default="bf16",
                    help="dtype of the two FLUX.1 files (bf16: 2 x 24 GB, fp8: 2 x 12 GB)")
    ap.add_argument("--upstream", help="a kohya-ss/sd-scripts checkout to time on the same inputs")
    ap.add_argument("--upstream_python", default=sys.executable, help="the Python of upstream's environment")
    ap.add_argument("--only", nargs="*", help="run only these benchmarks (flux_extract, sdxl_resize, ...)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args(argv)
    cfg = SIZES[a.size]
    paths = {k: str(a.work_dir / f) for k, f in (("sdxl", "sdxl.safetensors"), ("sdxl_lora", "sdxl_lora.safetensors"),
                                                  ("flux_org", "flux_org.safetensors"),
                                                  ("flux_tuned", "flux_tuned.safetensors"))}
    if not a.dry_run:
        paths = make_inputs(a.work_dir, a.size, a.flux_dtype)
    runs = [("ours", commands(str(REPO / "sd-scripts"), sys.executable, paths, a.work_dir / "out_ours", a.device,
                              cfg, True))]
    if a.upstream:
        runs.append(("upstream", commands(a.upstream, a.upstream_python, paths, a.work_dir / "out_upstream",
                                          a.device, cfg, False)))
    results = []
    for who, cmds in runs:
        (a.work_dir / f"out_{who}").mkdir(parents=True, exist_ok=True)
        for name, cmd in cmds.items():
            if a.only and name not in a.only:
                continue
            print(f"[{who}] {name}: {' '.join(cmd)}", flush=True)
            if a.dry_run:
                continue
            env = dict(os.environ, PYTHONPATH=a.upstream) if who == "upstream" else None
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  cwd=a.upstream if who == "upstream" else None)
            wall = time.perf_counter() - start
            results.append({"who": who, "bench": name, "seconds": round(wall, 2), "rc": proc.returncode})
            print(f"  {wall:.1f} s, exit {proc.returncode}", flush=True)
            if proc.returncode:
                print("  " + "\n  ".join(proc.stderr.strip().splitlines()[-5:]), flush=True)
    if results:
        print("\n| benchmark | who | seconds | exit |\n|---|---|---|---|")
        for r in results:
            print(f"| {r['bench']} | {r['who']} | {r['seconds']} | {r['rc']} |")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 1 if any(r["rc"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Wall time of the LoRA tools and the WD14 tagger on random full-size inputs, ours and (with --upstream)
kohya-ss/sd-scripts' scripts on the same files: SDXL LoRA resize (rank 64 -> 16, and sv_fro), SDXL and SD1.5 merge
into the model (ours once more under cProfile), FLUX.1 extract, WD14 images/s; the outputs of both sides are
compared. gpu_save: the trainers' save of a model on the GPU (save_file_streamed) against a CPU copy + save_file.

    python tools/bench_lora_tools.py --work_dir /tmp/lora_bench --device cuda \
        [--upstream /path/to/kohya-ss/sd-scripts --upstream_python /path/to/its/venv/bin/python]
    python tools/bench_lora_tools.py --work_dir /tmp/lora_bench --size tiny --device cpu    # a quick check

Inputs are made under --work_dir on --device (full size: SDXL checkpoint fp16 ~7 GB, SDXL LoRA rank 64 with 3x3
convs at 32, two FLUX.1-dev-shaped transformers, the tuned one = the original + a rank-16 difference, bf16 ~24 GB
each or fp8 ~12 GB each with --flux_dtype fp8; a ViT-B/16 448 px ONNX tagger with 10861 tags, the shape of
SmilingWolf/wd-vit-tagger-v3, random weights, and random 1024 px JPEGs). Each command runs in its own process
(model loading included: what a user waits for); --budget_s bounds the whole run and --cap_s each command (a command
still running then is stopped and its progress bar's last count recorded). The FLUX.1 files are made last (after
the SDXL and WD14 runs, which leave --reserve_s for them) and deleted at the end (--keep_inputs keeps them).
Upstream's scripts run through `--upstream_launch` (as `python script` would; under transformers 5 it answers
transformers.CLIPFeatureExtractor, removed there, which upstream imports for a type of its lpw pipeline; its
SDXL loader still needs upstream's pinned transformers 4.x: pass it with --upstream_pythonpath). The table goes to
stdout and --json; --dry_run prints the commands.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "sd-scripts"))

# flux: (width, double blocks, single blocks); wd14: (image side, patch, width, layers, tags, few / many images)
SIZES = {"full": {"flux": (3072, 19, 38), "sdxl": "full", "lora_dim": 64, "conv_dim": 32, "new_rank": 16,
                  "extract_dim": 16, "wd14": (448, 16, 768, 12, 10861, 8, 88), "image_side": 1024},
         "tiny": {"flux": (128, 1, 2), "sdxl": "tiny", "lora_dim": 8, "conv_dim": 4, "new_rank": 4,
                  "extract_dim": 4, "wd14": (448, 64, 32, 1, 300, 4, 12), "image_side": 96}}  # upstream: 448 px only
INPUT_FILES = {"sdxl": "sdxl.safetensors", "sdxl_lora": "sdxl_lora.safetensors",
               "sdxl_lora2": "sdxl_lora2.safetensors", "sd15": "sd15.safetensors", "sd15_lora": "sd15_lora.safetensors",
               "flux_org": "flux_org.safetensors",
               "flux_tuned": "flux_tuned.safetensors", "wd14_model_dir": "wd14_models"}
WD14_REPO = "SmilingWolf/wd-vit-tagger-v3"


def _generator(device, seed: int):
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def _free_device_memory():  # the tools run in their own processes: leave them the GPU
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _flux_entries(width: int, n_double: int, n_single: int, rank: int, tuned: bool, dtype, device):
    """(name, shape, dtype, make) of a FLUX.1 BFL transformer: shapes from diffusers' model on the meta device,
    values drawn on `device` per tensor (seeded by name); the tuned copy adds a rank-`rank` difference with singular
    values 1 .. 0.5 (times a scale) to every block Linear weight, so the extracted LoRA is well defined."""
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
            seed = zlib.crc32(name.encode())
            w = torch.randn(shape, generator=_generator(device, seed), device=device) / width ** 0.5
            if tuned and len(shape) == 2 and _flux_target(name):
                g = _generator(device, seed + 1)
                a = torch.randn(shape[0], rank, generator=g, device=device)
                b = torch.randn(rank, shape[1], generator=g, device=device)
                s = torch.linspace(1.0, 0.5, rank, device=device)
                w += (a * s) @ b * (0.5 / width ** 0.5 / rank ** 0.5)
            return w.to(dtype)
        return draw

    return [TensorEntry(k, s, dtype, make(k, s)) for k, s in shapes.items()]


def _flux_target(key: str) -> bool:  # the weights both extract scripts decompose
    return ("single_block" in key or "double_block" in key) and ".bias" not in key and "norm" not in key


def make_flux_inputs(work: Path, size: str, flux_dtype: str, device: str) -> None:
    import torch

    from library.saving import save_safetensors_streaming

    cfg = SIZES[size]
    dtype = torch.float8_e4m3fn if flux_dtype == "fp8" else torch.bfloat16
    for key, tuned in (("flux_org", False), ("flux_tuned", True)):
        path = work / INPUT_FILES[key]
        if not path.exists():
            print(f"making {path}", flush=True)
            save_safetensors_streaming(path, _flux_entries(*cfg["flux"], rank=cfg["extract_dim"], tuned=tuned,
                                                           dtype=dtype, device=device))
    _free_device_memory()


def make_sd_inputs(work: Path, size: str, device: str, family: str = "sdxl") -> None:
    """The SDXL (family sdxl: two LoRAs) or SD1.5 (sd1: one LoRA) checkpoint, fp16, and LoRAs on it (text encoders
    and UNet, 3x3 convs; random, seeds 0 and 1), made on `device`."""
    import torch

    from library import lora_tools, model_util, tiny_models
    from networks import lora

    cfg = SIZES[size]
    work.mkdir(parents=True, exist_ok=True)
    key = "sdxl" if family == "sdxl" else "sd15"
    model = work / INPUT_FILES[key]
    loras = [work / INPUT_FILES[k] for k in ((key + "_lora", key + "_lora2") if family == "sdxl" else (key + "_lora",))]
    if model.exists() and all(p.exists() for p in loras):
        return
    print(f"making {model}", flush=True)
    if cfg["sdxl"] == "tiny":
        made = tiny_models.make_tiny_sd(work / f"tiny_{family}", family, "single_file")
        os.replace(made, model)
        comps = model_util.load_sd_components(str(model), family, dtype=torch.float16, tokenizers=False)
    else:
        comps = full_sd_components(family, device)
        model_util.save_sd_checkpoint(model, comps, save_dtype=torch.float16)
    net = lora.create_network(1.0, cfg["lora_dim"], cfg["lora_dim"] / 2, None, comps.text_encoders, comps.unet,
                              conv_dim=cfg["conv_dim"], conv_alpha=cfg["conv_dim"] / 2)
    net.apply_to(comps.text_encoders, comps.unet)
    version = "sdxl_base_v1-0" if family == "sdxl" else "sd_v1"
    for seed, path in enumerate(loras):
        print(f"making {path}", flush=True)
        g = torch.Generator().manual_seed(seed)
        for p in net.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.02
        lora_tools.save_lora(str(path), net.lora_state_dict(torch.float16),
                             {"ss_base_model_version": version, "ss_network_dim": str(cfg["lora_dim"])},
                             overwrite=True)
    del comps, net
    _free_device_memory()


def full_sd_components(family: str = "sdxl", device: str = "cpu", dtype=None):
    """SDXL base / SD1.5-shaped UNet / VAE / text encoders (the shipped configs) with small random weights, fp16
    (or `dtype`), made on `device` (a GPU makes the 3.5 G values in seconds) and returned on the CPU."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from library import model_util

    dtype = dtype or torch.float16

    def rand(module):
        g = _generator(device, 0)
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g, device=device).mul_(0.02).to(p.dtype))
        return module.eval().to("cpu")

    with torch.device(device):
        unet = rand(UNet2DConditionModel.from_config(model_util.load_arch_config(family, "unet")).to(dtype))
        vae = rand(AutoencoderKL.from_config(model_util.load_arch_config(family, "vae")).to(dtype))
        tes = []
        for name in ("text_encoder", "text_encoder_2") if family == "sdxl" else ("text_encoder",):
            cfg = model_util.load_arch_config(family, name)
            tes.append(rand(model_util._clip_class(cfg)(model_util._clip_config(cfg)).to(dtype)))
    # logit_scale: in every SDXL base file, and upstream's loader reads it
    extra = {model_util.SDXL_TE2_PREFIX + "logit_scale": torch.tensor(4.6052, dtype=dtype)} if family == "sdxl" else {}
    return model_util.SDComponents(family=family, unet=unet, vae=vae, text_encoders=tes, tokenizers=[],
                                   extra_state=extra)


def time_gpu_save(work: Path, size: str, device: str) -> dict:
    """The trainers' save of a model on the GPU (model_util.save_sd_checkpoint: cast there, streamed through
    pinned buffers by safetensors_io.save_file_streamed) against the route before it (every tensor cast and copied
    to the CPU, then safetensors.torch.save_file), for bf16 and fp16 from an fp32 model (a trainer's weights):
    seconds each, and whether the streamed file holds exactly the model's tensors in that dtype and the same data
    bytes as the library's file."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from library import model_util

    cfg = SIZES[size]
    if cfg["sdxl"] == "tiny":
        from library import tiny_models

        made = tiny_models.make_tiny_sd(work / "tiny_save", "sdxl", "single_file")
        comps = model_util.load_sd_components(str(made), "sdxl", dtype=torch.float32, tokenizers=False)
    else:
        comps = full_sd_components("sdxl", device, dtype=torch.float32)
    for m in [comps.unet, comps.vae, *comps.text_encoders]:
        m.to(device)
    comps.extra_state = {k: v.to(device) for k, v in comps.extra_state.items()}
    sd = model_util.components_to_ldm_state_dict(comps)
    meta = {"modelspec.title": "gpu save check", "format": "pt"}

    def same_data(a, b):  # the bytes after the headers (the metadata keys' order may differ)
        with open(a, "rb") as fa, open(b, "rb") as fb:
            for f in (fa, fb):
                f.seek(8 + int.from_bytes(f.read(8), "little"))
            while True:
                ca, cb = fa.read(64 << 20), fb.read(64 << 20)
                if ca != cb:
                    return False
                if not ca:
                    return True

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    out = {"tensors": len(sd), "gib_fp32": round(sum(v.numel() * v.element_size() for v in sd.values()) / 2**30, 2)}

    def streamed(path, dtype):
        model_util.save_sd_checkpoint(path, comps, save_dtype=dtype, metadata=meta, overwrite=True)

    def cpu_copy_save_file(path, dtype):  # save_sd_checkpoint's route before save_file_streamed
        cpu = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).to("cpu").contiguous()
               for k, v in model_util.components_to_ldm_state_dict(comps).items()}
        save_file(cpu, str(path), metadata=meta)

    for name, dtype, first in (("bf16", torch.bfloat16, "streamed"), ("fp16", torch.float16, "save_file")):
        ours, lib = work / f"save_streamed_{name}.safetensors", work / f"save_cpu_copy_{name}.safetensors"
        runs = [("streamed", streamed, ours), ("save_file", cpu_copy_save_file, lib)]
        seconds = {}
        for who, fn, path in sorted(runs, key=lambda r: r[0] != first):  # each order once (the page cache's writeback)
            sync()
            t = time.perf_counter()
            fn(path, dtype)
            seconds[who] = time.perf_counter() - t
        t_ours, t_lib = seconds["streamed"], seconds["save_file"]
        equal, worst = 0, None
        with safe_open(str(ours), "pt", device=device) as f:
            keys = set(f.keys())
            for k, v in sd.items():
                back = f.get_tensor(k)
                expected = v.detach().to(dtype) if v.is_floating_point() else v.detach()
                if back.dtype == expected.dtype and back.shape == expected.shape and torch.equal(back, expected):
                    equal += 1
                elif worst is None:
                    worst = k
        same = same_data(ours, lib)
        out[name] = {"streamed_s": round(t_ours, 2), "cpu_copy_save_file_s": round(t_lib, 2),
                     "gb_written": round(ours.stat().st_size / 1e9, 2), "tensors_equal": f"{equal}/{len(sd)}",
                     "keys_equal": keys == set(sd), "first_unequal": worst, "data_bytes_equal_to_save_file": same}
        print(f"gpu save {name}: streamed {t_ours:.2f} s, CPU copy + save_file {t_lib:.2f} s, "
              f"tensors equal {equal}/{len(sd)}, data bytes equal to save_file's: {same}", flush=True)
        ours.unlink()
        lib.unlink()
    del comps, sd
    _free_device_memory()
    return out


# ----------------------------------------------------------------------------------------------------------
# WD14: a ViT tagger of SmilingWolf's v3 shape (NHWC BGR 0-255 input, sigmoid output), random weights


def _vit_tagger(side: int, patch: int, width: int, layers: int, n_tags: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width, eps=1e-6), nn.LayerNorm(width, eps=1e-6)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            self.heads = max(1, width // 64)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, width))
            return x + self.mlp(self.norm2(x))

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Conv2d(3, width, patch, patch)
            self.cls = nn.Parameter(torch.randn(1, 1, width) * 0.02)
            self.pos = nn.Parameter(torch.randn(1, (side // patch) ** 2 + 1, width) * 0.02)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.norm, self.head = nn.LayerNorm(width, eps=1e-6), nn.Linear(width, n_tags)
            with torch.no_grad():  # a few tags per image, as a trained tagger gives
                self.head.bias.fill_(-3.0)

        def forward(self, x):  # (b, side, side, 3) BGR 0-255
            x = self.patch((x / 127.5 - 1.0).permute(0, 3, 1, 2)).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
            return torch.sigmoid(self.head(self.norm(self.blocks(x))[:, 0]))

    torch.manual_seed(0)
    return Tagger().eval()


def make_wd14_inputs(work: Path, size: str) -> None:
    """model_dir/SmilingWolf_wd-vit-tagger-v3/{model.onnx, selected_tags.csv} (upstream's layout) and two image
    folders per side (few / many random JPEGs) so images/s leaves process start and model load out."""
    import csv

    import numpy as np
    import torch
    from PIL import Image

    side, patch, width, layers, n_tags, few, many = SIZES[size]["wd14"]
    folder = work / INPUT_FILES["wd14_model_dir"] / WD14_REPO.replace("/", "_")
    if not (folder / "model.onnx").exists():
        print(f"making {folder}", flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "selected_tags.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["tag_id", "name", "category", "count"])
            for i in range(n_tags):  # 4 ratings, then general tags, the last quarter characters
                cat = 9 if i < 4 else 4 if i >= n_tags * 3 // 4 else 0
                name = ("general", "sensitive", "questionable", "explicit")[i] if i < 4 else \
                    f"char_{i}_(series_{i % 7})" if cat == 4 else f"tag_{i}"
                w.writerow([i, name, cat, 1000])
        model = _vit_tagger(side, patch, width, layers, n_tags)
        with torch.no_grad():
            torch.onnx.export(model, (torch.zeros(1, side, side, 3),), str(folder / "model.onnx"), dynamo=False,
                              input_names=["input"], output_names=["output"], opset_version=17,
                              dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
    rng = np.random.default_rng(0)
    base = [rng.integers(0, 256, (SIZES[size]["image_side"], SIZES[size]["image_side"], 3), dtype=np.uint8)
            for _ in range(8)]
    for who in ("ours", "upstream"):
        for n in (few, many):
            d = work / f"wd14_{who}_{n}"
            if d.exists():
                shutil.rmtree(d)  # fresh: no caption files from an earlier run
            d.mkdir()
            for i in range(n):
                Image.fromarray(base[i % len(base)]).save(d / f"{i:04d}.jpg", quality=92)


# ----------------------------------------------------------------------------------------------------------
# commands


def commands(root: str, python: str, paths: dict, out: Path, device: str, cfg: dict, ours: bool) -> dict[str, list]:
    net = f"{root}/networks"
    # upstream's scripts run through this file's --upstream_launch (see the docstring)
    launch = [python] if ours else [python, str(Path(__file__).resolve()), "--upstream_launch"]
    extra = ["--overwrite"] if ours else []
    cmds = {
        "sdxl_resize": [*launch, f"{net}/resize_lora.py", "--model", paths["sdxl_lora"], "--save_to",
                        str(out / "resized.safetensors"), "--new_rank", str(cfg["new_rank"]), "--device", device,
                        *extra],
        "sdxl_resize_sv_fro": [*launch, f"{net}/resize_lora.py", "--model", paths["sdxl_lora"], "--save_to",
                               str(out / "resized_fro.safetensors"), "--new_rank", str(cfg["lora_dim"]),
                               "--dynamic_method", "sv_fro", "--dynamic_param", "0.9", "--device", device, *extra],
        "sdxl_merge": [*launch, f"{net}/sdxl_merge_lora.py", "--sd_model", paths["sdxl"], "--models",
                       paths["sdxl_lora"], "--ratios", "1", "--save_to", str(out / "merged.safetensors"),
                       "--save_precision", "fp16", *extra],
        "sd_merge": [*launch, f"{net}/merge_lora.py", "--sd_model", paths["sd15"], "--models", paths["sd15_lora"],
                     "--ratios", "1", "--save_to", str(out / "merged_sd15.safetensors"), "--save_precision", "fp16",
                     *extra],
        "sdxl_merge_loras": [*launch, f"{net}/sdxl_merge_lora.py", "--models", paths["sdxl_lora"],
                             paths["sdxl_lora2"], "--ratios", "0.7", "0.5", "--save_to",
                             str(out / "merged_loras.safetensors"), "--save_precision", "fp16", *extra],
        "sdxl_extract": [*launch, f"{net}/extract_lora_from_models.py", "--sdxl", "--model_org", paths["sdxl"],
                         "--model_tuned", str(out / "merged.safetensors"), "--save_to",
                         str(out / "sdxl_extracted.safetensors"), "--dim", str(cfg["lora_dim"]), "--conv_dim",
                         str(cfg["conv_dim"]), "--device", device, *extra],
        "flux_extract": [*launch, f"{net}/flux_extract_lora.py", "--model_org", paths["flux_org"], "--model_tuned",
                         paths["flux_tuned"], "--save_to", str(out / "flux_extracted.safetensors"), "--dim",
                         str(cfg["extract_dim"]), "--device", device, *extra],
    }
    if ours:  # our SDXL merge once more under cProfile (where its seconds go), into its own file
        cmds["sdxl_merge_profile"] = [python, "-m", "cProfile", "-o", str(out / "sdxl_merge.prof"),
                                      f"{net}/sdxl_merge_lora.py", "--sd_model", paths["sdxl"], "--models",
                                      paths["sdxl_lora"], "--ratios", "1", "--save_to",
                                      str(out / "merged_profiled.safetensors"), "--save_precision", "fp16", *extra]
    who = "ours" if ours else "upstream"
    for n in cfg["wd14"][5:]:
        cmds[f"wd14_{n}"] = [*launch, f"{root}/finetune/tag_images_by_wd14_tagger.py",
                             str(Path(paths["work"]) / f"wd14_{who}_{n}"), "--onnx", "--repo_id", WD14_REPO,
                             "--model_dir", paths["wd14_model_dir"], "--batch_size", "16",
                             "--max_data_loader_n_workers", "4", "--thresh", "0.35", "--caption_extension", ".txt"]
    return cmds


def upstream_launch(argv: list[str]) -> None:
    """Run upstream's script `argv[0]` as `python script args` would, under transformers 5: it imports
    CLIPFeatureExtractor (library/lpw_stable_diffusion.py, a type in a pipeline the tools never build), removed in
    transformers 5; the name is answered on the transformers module (also after transformers re-creates it)."""
    import runpy

    from transformers.utils import import_utils

    class CLIPFeatureExtractor:  # only named by upstream's import
        pass

    lazy_getattr = import_utils._LazyModule.__getattr__

    def getattr_with_alias(self, name):
        if name == "CLIPFeatureExtractor" and self.__name__ == "transformers":
            return CLIPFeatureExtractor
        return lazy_getattr(self, name)

    import_utils._LazyModule.__getattr__ = getattr_with_alias
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(script)  # as `python script`: upstream's sdxl_merge_lora imports `lora`
    runpy.run_path(script, run_name="__main__")


def time_svd_methods(device: str, width: int, rank: int, count: int = 3) -> dict:
    """Milliseconds a matrix for FLUX.1's commonest extract shape (width x 4 width, an MLP weight difference of
    rank `rank` plus noise): upstream's full SVD (torch.linalg.svd, full_matrices, float32), the reduced batched SVD
    (svd_many) and the Gram route (top_svd_many); and how far the latter two's rank-`rank` products are from the
    full SVD's (largest relative Frobenius difference)."""
    import torch

    from library import lora_tools

    dev = torch.device(device)
    g = _generator(dev, 0)
    shape = (width, 4 * width)
    mats = {f"m{i}": (torch.randn(shape[0], rank, generator=g, device=dev)
                      @ torch.randn(rank, shape[1], generator=g, device=dev) * 0.01
                      + torch.randn(shape, generator=g, device=dev) * 1e-3) for i in range(count)}

    def product(U, S, Vh):
        return (U[:, :rank] * S[:rank]) @ Vh[:rank]

    def timed(fn):
        fn()  # warm-up (cuSOLVER handles, workspaces)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return round((time.perf_counter() - start) * 1000 / count, 1), out

    full_ms, full = timed(lambda: {n: product(*torch.linalg.svd(m, full_matrices=True)) for n, m in mats.items()})
    reduced_ms, reduced = timed(lambda: {n: product(U, S, Vh) for n, U, S, Vh in lora_tools.svd_many(mats, dev, None)})
    gram_ms, gram = timed(lambda: {n: product(U, S, Vh) for n, U, S, Vh in
                                   lora_tools.top_svd_many(mats, dict.fromkeys(mats, rank), dev, None)})

    def worst(got):
        return max(float((got[n] - full[n]).norm() / full[n].norm()) for n in mats)

    return {"shape": list(shape), "rank": rank, "ms_full_svd": full_ms, "ms_reduced_svd": reduced_ms,
            "ms_gram_eigh_f64": gram_ms, "rel_diff_reduced": worst(reduced), "rel_diff_gram": worst(gram)}


# ----------------------------------------------------------------------------------------------------------
# agreement of the two sides' outputs


def compare_loras(a: str, b: str, svd_signs: bool = False, device: str = "cpu") -> dict:
    """Per module: equal rank, and the effective weights' (up x down x alpha / rank) relative Frobenius difference.
    svd_signs (extracted LoRAs): also that difference with a's singular pairs turned to b's signs and both clamped at
    the smaller of the two clamp thresholds (each side's largest |value|): the SVD's signs are arbitrary and the
    extract's quantile clamp depends on them, so this compares the decompositions themselves. Computed on
    `device` (FLUX.1's 304 effective weights take half a minute on the CPU)."""
    import torch

    from library import lora_tools

    ma, mb = (lora_tools.lora_modules(lora_tools.load_lora(p)[0]) for p in (a, b))
    worst, worst_aligned, ranks_equal = 0.0, 0.0, 0
    for name in set(ma) & set(mb):
        for m in (ma[name], mb[name]):
            m.up, m.down = m.up.to(device), m.down.to(device)
        ranks_equal += ma[name].rank == mb[name].rank
        wa, wb = lora_tools.effective_weight(ma[name]), lora_tools.effective_weight(mb[name])
        worst = max(worst, float((wa - wb).norm() / wb.norm().clamp_min(1e-12)))
        if svd_signs and ma[name].rank == mb[name].rank:
            (ua, da), (ub, db) = ((m.up.float().flatten(1), m.down.float().flatten(1)) for m in (ma[name], mb[name]))
            sign = torch.where((ua * ub).sum(0) < 0, -1.0, 1.0)
            ua, da = ua * sign, da * sign[:, None]
            h = min(float(torch.cat([ua.flatten(), da.flatten()]).abs().max()),
                    float(torch.cat([ub.flatten(), db.flatten()]).abs().max()))
            pa, pb = ua.clamp(-h, h) @ da.clamp(-h, h), ub.clamp(-h, h) @ db.clamp(-h, h)
            worst_aligned = max(worst_aligned, float((pa - pb).norm() / pb.norm().clamp_min(1e-12)))
    out = {"modules": [len(ma), len(mb)], "common": len(set(ma) & set(mb)), "ranks_equal": ranks_equal,
           "max_rel_diff": worst}
    return out | ({"max_rel_diff_svd_signs_aligned": worst_aligned} if svd_signs else {})


def compare_models(a: str, b: str, device: str = "cpu") -> dict:
    """Tensors of two model files: keys in common, and the largest relative Frobenius difference."""
    from safetensors import safe_open

    worst, worst_key = 0.0, None
    with safe_open(a, "pt", device=device) as fa, safe_open(b, "pt", device=device) as fb:
        ka, kb = set(fa.keys()), set(fb.keys())
        for k in ka & kb:
            ta, tb = fa.get_tensor(k).float(), fb.get_tensor(k).float()
            if ta.shape != tb.shape:
                return {"shape_mismatch": k}
            d = float((ta - tb).norm() / tb.norm().clamp_min(1e-12))
            if d > worst:
                worst, worst_key = d, k
    return {"keys": [len(ka), len(kb)], "common": len(ka & kb), "max_rel_diff": worst, "worst_key": worst_key}


def profile_summary(prof: Path, log: Path) -> dict:
    """A cProfile file's functions with the most cumulative time (the phases) and the most own time (where the
    seconds are spent); the longer lists go to `log`."""
    import io
    import pstats

    def top(order: str, n: int) -> tuple[str, list[str]]:
        text = io.StringIO()
        pstats.Stats(str(prof), stream=text).sort_stats(order).print_stats(n)
        rows = [line.split() for line in text.getvalue().splitlines()
                if re.match(r"\s*\d+(/\d+)?\s+\d", line) and not re.search(r"<frozen|__import__|import_module", line)]
        key = 3 if order == "cumulative" else 1  # ncalls tottime percall cumtime percall function
        return text.getvalue(), [f"{r[key]} s {' '.join(r[5:])[-110:]}" for r in rows]

    cum_text, cum = top("cumulative", 80)
    own_text, own = top("tottime", 30)
    log.write_text(cum_text + "\n" + own_text)
    return {"cumulative": cum[:28], "own_time": own[:12]}


def compare_captions(a: Path, b: Path) -> dict:
    names = sorted(p.name for p in a.glob("*.txt"))
    same = sum((a / n).read_text() == (b / n).read_text() for n in names if (b / n).exists())
    return {"captions": [len(names), len(list(b.glob("*.txt")))], "identical": same}


# ----------------------------------------------------------------------------------------------------------
# running


def _progress(text: str) -> str | None:
    """The last 'n/total' of a tqdm bar in a command's output (where it was when stopped)."""
    found = re.findall(r"(\d+)/(\d+) \[", text)
    return f"{found[-1][0]}/{found[-1][1]}" if found else None


def _providers(text: str) -> str | None:
    found = re.findall(r"providers: *(\[[^\]]*\])", text)
    return found[-1] if found else None


def time_command(who: str, name: str, cmd: list, cwd: str | None, env: dict | None, timeout: float, log: Path) -> dict:
    print(f"[{who}] {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                  env=dict(env or os.environ, COLUMNS="400"),  # rich logs: one line a record
                                  timeout=max(1.0, timeout))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - start
    text = log.read_text(errors="replace")
    result = {"who": who, "bench": name, "seconds": round(wall, 2), "rc": rc}
    if rc == "timeout" and _progress(text):
        result["progress"] = _progress(text)
        done, total = map(int, result["progress"].split("/"))
        if done:  # the whole run at the rate so far (loading included in both)
            result["estimated_total_s"] = round(wall * total / done, 1)
    if _providers(text):
        result["onnx_providers"] = _providers(text)
    print(f"  {wall:.1f} s, exit {rc}" + (f" at {result.get('progress')}" if rc == "timeout" else ""), flush=True)
    if rc:
        print("  " + "\n  ".join(text.strip().splitlines()[-5:]), flush=True)
    return result


def summary(results: list[dict], checks: dict) -> list[str]:
    """Markdown rows per benchmark: our and upstream's seconds (a stopped command: its progress and estimate) and the
    output check; WD14 as images/s of each side."""
    def cell(r):
        if r is None:
            return "-"
        if r.get("skipped"):
            return f"skipped ({r['skipped']})"
        if r["rc"] == "timeout":
            est = f", est. {r['estimated_total_s']} s" if r.get("estimated_total_s") else ""
            return f"stopped at {r['seconds']} s ({r.get('progress') or 'no progress'}{est})"
        if r["seconds"] is None:
            return str(r["rc"])  # no time left
        return f"{r['seconds']} s" if r["rc"] == 0 else f"{r['seconds']} s, exit {r['rc']}"

    def check(name):
        c = checks.get(name)
        if not isinstance(c, dict) or "max_rel_diff" not in c:  # no comparison (a profile, an error)
            return "-"
        if "ranks_equal" in c:
            aligned = c.get("max_rel_diff_svd_signs_aligned")
            return (f"ranks equal {c['ranks_equal']}/{c['common']}, max rel. diff {c['max_rel_diff']:.1e}"
                    + (f" ({aligned:.1e} with the SVD's signs aligned)" if aligned is not None else ""))
        return f"max rel. diff {c['max_rel_diff']:.1e} over {c['common']} tensors"

    rows = ["| tool | ours | upstream | outputs |", "|---|---|---|---|"]
    by = {(r["bench"], r["who"]): r for r in results}
    for name in dict.fromkeys(r["bench"] for r in results):
        if not name.startswith("wd14_"):
            rows.append(f"| {name} | {cell(by.get((name, 'ours')))} | {cell(by.get((name, 'upstream')))} | "
                        f"{check(name)} |")
    for name, c in (checks.get("gpu_save") or {}).items():
        if isinstance(c, dict):
            rows.append(f"| gpu_save {name} (streamed / CPU copy + save_file) | {c['streamed_s']} s | "
                        f"{c['cpu_copy_save_file_s']} s | tensors equal {c['tensors_equal']}, data bytes equal: "
                        f"{c['data_bytes_equal_to_save_file']} |")
    if any(k.startswith("wd14_images_per_s") for k in checks):
        cap = checks.get("wd14_captions", {})
        rows.append(f"| wd14 images/s | {checks.get('wd14_images_per_s_ours', '-')} | "
                    f"{checks.get('wd14_images_per_s_upstream', '-')} | "
                    f"identical captions {cap.get('identical', '-')}/{(cap.get('captions') or ['-'])[0]} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--upstream_launch"]:
        upstream_launch(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work_dir", type=Path, required=True)
    ap.add_argument("--size", choices=list(SIZES), default="full")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--flux_dtype", choices=("bf16", "fp8"), default="bf16",
                    help="dtype of the two FLUX.1 files (bf16: 2 x 24 GB, fp8: 2 x 12 GB)")
    ap.add_argument("--upstream", help="a kohya-ss/sd-scripts checkout to time on the same inputs")
    ap.add_argument("--upstream_python", default=sys.executable, help="the Python of upstream's environment")
    ap.add_argument("--upstream_pythonpath", default="",
                    help="extra PYTHONPATH entries for upstream's commands (e.g. its pinned packages)")
    ap.add_argument("--only", nargs="*", help="run only these benchmarks (sdxl_resize, sdxl_resize_sv_fro, "
                    "sdxl_merge, sdxl_merge_profile (ours under cProfile), sdxl_merge_loras, sdxl_extract, sd_merge "
                    "(SD1.5), gpu_save (the trainers' save from the GPU), wd14, svd_methods, flux_extract)")
    ap.add_argument("--budget_s", type=float, default=1e9, help="stop commands still running after this many "
                    "seconds from the start (their progress is recorded)")
    ap.add_argument("--cap_s", type=float, default=1e9, help="stop any one command after this many seconds (its "
                    "progress bar's count is recorded); our FLUX.1 extract has only --budget_s")
    ap.add_argument("--reserve_s", type=float, default=0.0, help="seconds of --budget_s kept for the FLUX.1 extract "
                    "(made and run last): the SDXL and WD14 commands stop earlier")
    ap.add_argument("--keep_inputs", action="store_true", help="keep the FLUX.1 files (else deleted at the end)")
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg = SIZES[a.size]
    work = a.work_dir.resolve()
    paths = {k: str(work / f) for k, f in INPUT_FILES.items()} | {"work": str(work)}
    want = (lambda name: not a.only or name in a.only or name.split("_")[0] in a.only)
    sides = {"ours": commands(str(REPO / "sd-scripts"), sys.executable, paths, work / "out_ours", a.device, cfg,
                              True)}
    if a.upstream:
        sides["upstream"] = commands(a.upstream, a.upstream_python, paths, work / "out_upstream", a.device, cfg,
                                     False)
    if a.dry_run:
        for who, cmds in sides.items():
            for name, cmd in cmds.items():
                if want(name):
                    print(f"[{who}] {name}: {' '.join(cmd)}")
        return 0
    work.mkdir(parents=True, exist_ok=True)
    gen_device = a.device
    results, checks = [], {}
    envs = {"ours": None, "upstream": dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (a.upstream, a.upstream_pythonpath, os.environ.get("PYTHONPATH", "")) if p))}

    def run(name, reserve=0.0, uncapped=(), order=("ours", "upstream")):
        for who in [w for w in order if w in sides]:
            cmds = sides[who]
            (work / f"out_{who}").mkdir(exist_ok=True)
            left = a.budget_s - reserve - (time.perf_counter() - t0)
            left = left if who in uncapped else min(a.cap_s, left)
            if name not in cmds:
                continue
            if who == "upstream" and name in ("sdxl_merge", "sd_merge") and a.size == "tiny":
                # upstream's sdxl_model_util builds the SDXL base architecture only; the full size runs it
                results.append({"who": who, "bench": name, "seconds": None, "rc": 0, "skipped": "tiny SDXL"})
                continue
            if left < 5:
                results.append({"who": who, "bench": name, "seconds": None, "rc": "no time left"})
                continue
            results.append(time_command(who, name, cmds[name], a.upstream if who == "upstream" else None, envs[who],
                                        left, work / f"out_{who}" / f"{name}.log"))

    def both(file):
        pair = [work / f"out_{who}" / file for who in ("ours", "upstream")]
        return [str(p) for p in pair] if a.upstream and all(p.exists() for p in pair) else None

    reserve = a.reserve_s if want("flux_extract") else 0.0  # FLUX.1 runs last, in the time kept for it

    def guarded(label, fn, *args, **kw):  # one call: a phase that breaks is recorded, the others still run
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001
            checks[f"error_{label}"] = f"{type(e).__name__}: {e}"[:500]
            print(f"{label} failed: {type(e).__name__}: {e}", flush=True)

    def check_pair(name, file, compare, **kw):
        out = both(file)
        if out:
            checks[name] = guarded(name, compare, *out, **kw)

    sdxl = [n for n in ("sdxl_resize", "sdxl_resize_sv_fro", "sdxl_merge", "sdxl_merge_loras", "sdxl_extract")
            if want(n)]
    if sdxl:
        guarded("sdxl_inputs", make_sd_inputs, work, a.size, gen_device, "sdxl")
    if sdxl and "error_sdxl_inputs" not in checks:
        outputs = {"sdxl_resize": "resized.safetensors", "sdxl_resize_sv_fro": "resized_fro.safetensors",
                   "sdxl_merge": "merged.safetensors", "sdxl_merge_loras": "merged_loras.safetensors",
                   "sdxl_extract": "sdxl_extracted.safetensors"}
        for name in sdxl:
            run(name, reserve)
            check_pair(name, outputs[name], compare_models if name == "sdxl_merge" else compare_loras,
                       **({"device": a.device} if name == "sdxl_merge" else {}))
        if want("sdxl_merge_profile") and "sdxl_merge" in sdxl:
            run("sdxl_merge_profile", reserve)
            checks["sdxl_merge_profile"] = guarded("sdxl_merge_profile", profile_summary,
                                                   work / "out_ours" / "sdxl_merge.prof",
                                                   work / "out_ours" / "sdxl_merge_profile_stats.log")
    for who in ("ours", "upstream"):  # 7 GB each (disk)
        for f in ("merged.safetensors", "merged_profiled.safetensors"):
            (work / f"out_{who}" / f).unlink(missing_ok=True)
    if want("sd_merge"):
        guarded("sd15_inputs", make_sd_inputs, work, a.size, gen_device, "sd1")
        if "error_sd15_inputs" not in checks:
            run("sd_merge", reserve)
            check_pair("sd_merge", "merged_sd15.safetensors", compare_models, device=a.device)
        for who in ("ours", "upstream"):
            (work / f"out_{who}" / "merged_sd15.safetensors").unlink(missing_ok=True)
    if want("gpu_save"):
        checks["gpu_save"] = guarded("gpu_save", time_gpu_save, work, a.size, a.device)
    if want("wd14"):
        guarded("wd14_inputs", make_wd14_inputs, work, a.size)
    if want("wd14") and "error_wd14_inputs" not in checks:
        try:
            import onnxruntime

            checks["onnxruntime"] = f"{onnxruntime.__version__}, available: {onnxruntime.get_available_providers()}"
        except ImportError:
            pass
        for n in cfg["wd14"][5:]:
            run(f"wd14_{n}", reserve)
        few, many = cfg["wd14"][5:]
        for who in sides:
            t = {r["bench"]: r["seconds"] for r in results if r["who"] == who and r["rc"] == 0}
            if f"wd14_{few}" in t and f"wd14_{many}" in t and t[f"wd14_{many}"] > t[f"wd14_{few}"]:
                checks[f"wd14_images_per_s_{who}"] = round((many - few) / (t[f"wd14_{many}"] - t[f"wd14_{few}"]), 2)
        if a.upstream:
            checks["wd14_captions"] = guarded("wd14_captions", compare_captions, work / f"wd14_ours_{many}",
                                              work / f"wd14_upstream_{many}")
    if want("svd_methods"):
        checks["svd_methods"] = guarded("svd_methods", time_svd_methods, a.device, cfg["flux"][0], cfg["extract_dim"])
    if want("flux_extract"):
        guarded("flux_inputs", make_flux_inputs, work, a.size, a.flux_dtype, gen_device)
        if "error_flux_inputs" not in checks:
            # ours, then upstream's in what is left (stopped at the budget: its progress gives its rate)
            run("flux_extract", uncapped=("ours", "upstream"))
            check_pair("flux_extract", "flux_extracted.safetensors", compare_loras, svd_signs=True, device=a.device)
        if not a.keep_inputs:
            for key in ("flux_org", "flux_tuned"):
                Path(paths[key]).unlink(missing_ok=True)
    if a.json:
        a.json.write_text(json.dumps({"results": results, "checks": checks, "size": a.size, "device": a.device,
                                      "flux_dtype": a.flux_dtype, "total_s": round(time.perf_counter() - t0, 1)},
                                     indent=1))
    print("\n| benchmark | who | seconds | exit |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['bench']} | {r['who']} | {r['seconds']} | {r['rc']}"
              + (f" at {r['progress']}" if r.get("progress") else "") + " |")
    for name, c in checks.items():
        if name == "sdxl_merge_profile" and isinstance(c, dict):
            for order, lines in c.items():
                print(f"{name} ({order}):\n  " + "\n  ".join(lines))
        else:
            print(f"{name}: {c}")
    print("\n" + "\n".join(summary(results, checks)))
    return 1 if any(isinstance(r["rc"], int) and r["rc"] for r in results) else 0  # not for a cap or budget stop


if __name__ == "__main__":
    raise SystemExit(main())

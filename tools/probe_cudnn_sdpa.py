"""Checks the cuDNN SDPA backend against flash attention on FLUX.1 / SDXL attention shapes (GPU only).

    python tools/probe_cudnn_sdpa.py [--lengths 1536 4608 ...] [--iters 5]
    python tools/probe_cudnn_sdpa.py --flux_blocks [--cases eager:512 eager:1024 compiled:512 compiled:1024]

--flux_blocks: the attention as FLUX.1 training hands it to SDPA: one double and one single block of FLUX.1-dev's
width (3072, 24 heads x 128) with random bf16 weights, run through the trainers' forward (flux_train_utils:
packed latents, rotary embeddings, 512 T5 tokens), eager or compiled the trainers' way (regional compile,
inductor, checkpoint inside the blocks with --compile_checkpoint_keep projections), at 512 or 1024 px, forward then
backward with cuDNN attention the only SDPA backend, compared with eager flash attention on the same inputs. One
process a case; each prints the phase it reached (forward, backward) and whether it crashed. Where the eager 512
px FLUX.1 run crashed in the trainer (docs/BENCHMARKS.md run49, run57), this says whether the block alone does.

--grad_layouts: the cause of those crashes. Two attention backward calls in one process, q/k/v in the same layout,
the output's gradient either a slice of a wider tensor (as a FLUX.1 single block hands it back: its attention
output is concatenated with the MLP branch) or contiguous (a double block's). torch's cuDNN backward caches its
plan by the q/k/v layout, so the second call runs on the first call's plan: each call's dQ/dK/dV are compared
with flash attention's on the same inputs. Orders: slice,contiguous (FLUX.1's backward order),
contiguous,slice, and one (the slice made contiguous first, as library.families.flux.one_attention_grad_layout
does in training).

Each case (sequence length, heads, head dim) runs in its own process, since an illegal memory access ends the
process's CUDA context: forward and backward with the layout diffusers' attention processors give SDPA (q, k, v
and the output's gradient are (B, L, H, D) tensors seen as (B, H, L, D)), compared with flash attention on the
same inputs, and both timed. Prints one JSON line per case: ok / crashed, the relative differences (norm of
cuDNN's result minus flash's over the norm of flash's) of the output and of dQ, dK, dV, the median ms.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys


def run_case(length: int, heads: int, head_dim: int, iters: int, batch: int) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    dev = "cuda"
    shape = (batch, length, heads, head_dim)

    def blhd(*s):
        return torch.randn(*s, device=dev, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, L, D) view

    q, k, v, grad_out = (blhd(*shape) for _ in range(4))
    results = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        times = []
        with sdpa_kernel([backend]):
            for _ in range(iters):
                for t in (qs, ks, vs):
                    t.grad = None
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs)
                out.backward(grad_out)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
        results[name] = (out.detach().float(), *(t.grad.float() for t in (qs, ks, vs)), sorted(times)[len(times) // 2])

    def rel(a, b):
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    f, c = results["flash"], results["cudnn"]
    return {
        "length": length, "heads": heads, "head_dim": head_dim, "batch": batch, "ok": True,
        "rel_diff": {n: round(rel(c[i], f[i]), 5) for i, n in enumerate(("out", "dq", "dk", "dv"))},
        "ms_flash": round(f[4], 3), "ms_cudnn": round(c[4], 3),
        "nan": any(bool(torch.isnan(t).any()) for t in c[:4]),
    }


GRAD_LAYOUT_ORDERS = {"slice,contiguous": ("slice", "contiguous"), "contiguous,slice": ("contiguous", "slice"),
                      "one": ("slice_made_contiguous", "contiguous")}


def run_layout_case(order: str, length: int, heads: int, head_dim: int) -> dict:
    """One --grad_layouts case: two backward calls whose output gradients have the layouts `order` names."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    dev, width = "cuda", heads * head_dim

    def blhd(last: int = width):  # (B, L, last) as diffusers hands it, seen as (B, H, L, D)
        t = torch.randn(1, length, last, device=dev, dtype=torch.bfloat16)
        return t[..., :width].unflatten(-1, (heads, head_dim)).transpose(1, 2)

    def grad(kind: str):
        if kind == "contiguous":
            return blhd()
        g = blhd(5 * width)  # a single block's: the attention part of attention + MLP (3072 + 12288 wide)
        return g.transpose(1, 2).contiguous().transpose(1, 2) if kind == "slice_made_contiguous" else g

    def rel(a, b):
        return round(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)), 5)

    calls = []
    for i, kind in enumerate(GRAD_LAYOUT_ORDERS[order]):
        q, k, v = blhd(), blhd(), blhd()
        g = grad(kind)
        grads = {}
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
            print(json.dumps({"phase": f"call {i + 1} ({kind}) {name}"}), flush=True)
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(qs, ks, vs).backward(g)
            torch.cuda.synchronize()
            grads[name] = (qs.grad, ks.grad, vs.grad)
        calls.append({"grad_out": kind, "grad_out_stride": list(g.stride()),
                      "rel_diff_vs_flash": {n: rel(c, f) for n, c, f in zip(("dq", "dk", "dv"), grads["cudnn"],
                                                                             grads["flash"])}})
    worst = max(d for c in calls for d in c["rel_diff_vs_flash"].values())
    return {"grad_layouts": order, "length": length, "ok": worst < 0.05, "worst_rel_diff": worst, "calls": calls}


def run_flux_case(mode: str, resolution: int, tiny: bool, backend: str, one_grad_layout: bool = False) -> dict:
    """One --flux_blocks case (see the module's docstring); prints the phase before each, so a crash names it."""
    import argparse as _argparse
    import time

    import torch

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "sd-scripts"))
    from library import flux_tiny, flux_train_utils

    cuda = torch.cuda.is_available()
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = dict(width=128, t5_dim=32, clip_dim=64) if tiny else dict(width=3072, t5_dim=4096, clip_dim=768)
    model = flux_tiny.tiny_transformer(**shape, num_double=1, num_single=1, guidance=True, dtype=dtype).to(dev)
    model.requires_grad_(False)
    if one_grad_layout:
        from library.families import flux

        flux.one_attention_grad_layout(model)
    g = torch.Generator(device="cpu").manual_seed(0)
    h = w = resolution // 8
    noisy = (torch.randn(1, 16, h, w, generator=g)).to(dev, dtype)
    te = {"t5_out": torch.randn(1, 512, shape["t5_dim"], generator=g).to(dev, dtype),
          "pooled": torch.randn(1, shape["clip_dim"], generator=g).to(dev, dtype)}
    sigmas = torch.tensor([0.5], device=dev)
    grad_out = torch.randn(1, 16, h, w, generator=g).to(dev, dtype)

    def step(m):
        x = noisy.clone().requires_grad_()
        print(json.dumps({"phase": "forward"}), flush=True)
        out = flux_train_utils.flux_forward(m, x, sigmas, te, 3.5, dtype)
        if cuda:
            torch.cuda.synchronize()
        print(json.dumps({"phase": "backward"}), flush=True)
        out.backward(grad_out)
        if cuda:
            torch.cuda.synchronize()
        return out.detach().float(), x.grad.float()

    def only(cudnn: bool):
        if cuda:
            b = torch.backends.cuda
            b.enable_flash_sdp(not cudnn), b.enable_mem_efficient_sdp(False), b.enable_math_sdp(False)
            b.enable_cudnn_sdp(cudnn)

    only(False)
    reference = step(model)  # eager, flash attention
    only(True)
    if mode == "compiled":
        from library.compile import regional

        cargs = _argparse.Namespace(compile=True, compile_backend=backend, compile_mode="default",
                                    compile_dynamic="false", compile_fullgraph=False,
                                    compile_checkpoint_keep="projections", cuda_graph_step="off")
        regional.compile_model_blocks(model, cargs, model_name="FLUX probe", gradient_checkpointing=True)
    t0 = time.perf_counter()
    got = step(model)  # compiles here when compiled
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = step(model)
    second_s = time.perf_counter() - t0

    def rel(a, b):
        return round(float((a - b).norm() / b.norm().clamp_min(1e-12)), 5)

    return {"mode": mode, "resolution": resolution, "ok": True, "cudnn": cuda, "one_grad_layout": one_grad_layout,
            "rel_diff_vs_eager_flash": {"out": rel(got[0], reference[0]), "d_latents": rel(got[1], reference[1])},
            "nan": any(bool(torch.isnan(t).any()) for t in got), "first_s": round(first_s, 1),
            "second_s": round(second_s, 3)}


def flux_blocks(cases: list[str], tiny: bool, backend: str, one_grad_layout: bool = False) -> None:
    import torch

    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                      "flux_blocks": cases}), flush=True)
    for case in cases:
        mode, resolution = case.split(":")
        cmd = [sys.executable, __file__, "--flux_case", case, "--backend", backend] + (["--tiny"] if tiny else [])
        cmd += ["--one_grad_layout"] if one_grad_layout else []
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        phases = [json.loads(line)["phase"] for line in lines if '"phase"' in line]
        if proc.returncode == 0 and lines:
            print(json.dumps({**json.loads(lines[-1]), "phases": phases}), flush=True)
        else:
            err = [line for line in proc.stderr.strip().splitlines() if "Error" in line or "error" in line]
            print(json.dumps({"mode": mode, "resolution": int(resolution), "ok": False,
                              "one_grad_layout": one_grad_layout,
                              "crashed_in": phases[-1] if phases else "setup", "rc": proc.returncode,
                              "error": (err or proc.stderr.strip().splitlines()[-1:] or ["?"])[-1][:400]}), flush=True)


def grad_layouts(orders: list[str], lengths: list[int], heads: int, head_dim: int) -> None:
    import torch

    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}), flush=True)
    for length in lengths:
        for order in orders:
            cmd = [sys.executable, __file__, "--layout_case", order, "--case", str(length), "--heads", str(heads),
                   "--head_dim", str(head_dim)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            phases = [json.loads(line)["phase"] for line in lines if '"phase"' in line]
            if proc.returncode == 0 and lines:
                print(lines[-1], flush=True)
            else:
                err = [line for line in proc.stderr.strip().splitlines() if "Error" in line or "error" in line]
                print(json.dumps({"grad_layouts": order, "length": length, "ok": False,
                                  "crashed_in": phases[-1] if phases else "setup", "rc": proc.returncode,
                                  "error": (err or proc.stderr.strip().splitlines()[-1:] or ["?"])[-1][:400]}),
                      flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # FLUX.1: 512 px (1024 + 512 text tokens), 768, 1024 px and two 1024 px-area buckets; SDXL self-attention
    p.add_argument("--lengths", type=int, nargs="*", default=[1536, 2816, 3584, 4464, 4608, 4672])
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)  # one case, in a child process
    p.add_argument("--flux_blocks", action="store_true", help="probe FLUX.1 blocks as training runs them")
    p.add_argument("--cases", nargs="*", default=["eager:512", "eager:1024", "compiled:512", "compiled:1024"],
                   help="--flux_blocks: mode:resolution, mode eager or compiled")
    p.add_argument("--tiny", action="store_true", help="--flux_blocks: a 128-wide model (a CPU check of the tool)")
    p.add_argument("--backend", default="inductor", help="--flux_blocks: the compile backend")
    p.add_argument("--flux_case", default=None, help=argparse.SUPPRESS)  # one --flux_blocks case, in a child
    p.add_argument("--grad_layouts", nargs="*", default=None, choices=sorted(GRAD_LAYOUT_ORDERS),
                   help="probe torch's cuDNN backward plan cache with these orders of gradient layouts")
    p.add_argument("--layout_case", default=None, help=argparse.SUPPRESS)  # one --grad_layouts case, in a child
    p.add_argument("--one_grad_layout", action="store_true",
                   help="--flux_blocks: the blocks hand attention one gradient layout (as the trainers do)")
    args = p.parse_args(argv)
    if args.layout_case is not None:
        print(json.dumps(run_layout_case(args.layout_case, args.case, args.heads, args.head_dim)))
        return 0
    if args.grad_layouts is not None:
        grad_layouts(args.grad_layouts or list(GRAD_LAYOUT_ORDERS), args.lengths, args.heads, args.head_dim)
        return 0
    if args.flux_case is not None:
        mode, resolution = args.flux_case.split(":")
        print(json.dumps(run_flux_case(mode, int(resolution), args.tiny, args.backend, args.one_grad_layout)))
        return 0
    if args.flux_blocks:
        flux_blocks(args.cases, args.tiny, args.backend, args.one_grad_layout)
        return 0
    if args.case is not None:
        print(json.dumps(run_case(args.case, args.heads, args.head_dim, args.iters, args.batch)))
        return 0
    import torch

    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}))
    for length in args.lengths:
        cmd = [sys.executable, __file__, "--case", str(length), "--heads", str(args.heads),
               "--head_dim", str(args.head_dim), "--iters", str(args.iters), "--batch", str(args.batch)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            print(proc.stdout.strip().splitlines()[-1])
        else:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(json.dumps({"length": length, "heads": args.heads, "head_dim": args.head_dim, "ok": False,
                              "error": tail[:300]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

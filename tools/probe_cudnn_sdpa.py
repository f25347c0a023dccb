"""Checks the cuDNN SDPA backend against flash attention on FLUX.1 / SDXL attention shapes (GPU only).

    python tools/probe_cudnn_sdpa.py [--lengths 1536 4608 ...] [--iters 5]

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # FLUX.1: 512 px (1024 + 512 text tokens), 768, 1024 px and two 1024 px-area buckets; SDXL self-attention
    p.add_argument("--lengths", type=int, nargs="*", default=[1536, 2816, 3584, 4464, 4608, 4672])
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)  # one case, in a child process
    args = p.parse_args(argv)
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

#!/usr/bin/env python
"""Estimate the GPU memory of one FLUX.1 LoRA training step without a GPU (FakeTensorMode: no real memory).

Builds the full-size FLUX.1-dev transformer as tools/benchmark_compile.py does (fp8 base via
library.flux_models.apply_fp8_base, the project's networks.lora_flux, AdamW, bf16 autocast, diffusers' gradient
checkpointing, cached-latent shaped random inputs), runs two eager steps on fake tensors and tracks the peak of live
tensor storage. Block swap is added by arithmetic from the real block sizes: with k blocks swapped
(library.block_swap swaps the LAST k of double + single blocks), the peak loses those k blocks' weights but one
of them is in flight. --compiled_delta_gib adds what the compiled step measured above eager on a GPU
(docs/BENCHMARKS.md: 27.70 - 25.90 GiB for bf16 rank 32 at 1024 px with gradient checkpointing).

An estimate of torch.cuda.max_memory_allocated, not a measurement: the CUDA context (~0.5-1 GiB) and the caching
allocator's reserve (max_memory_reserved) come on top. Checked against the GPU: bf16 base, rank 32, 1024 px, eager:
estimated 26.31 GiB, measured 25.90 GiB.

    python tools/estimate_flux_memory.py --rank 16 --fp8_base --blocks_to_swap 0 24 44
"""
from __future__ import annotations

import argparse
import sys
import weakref
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_compile as bc  # noqa: E402  (also puts sd-scripts on sys.path)

GIB = 2**30


class PeakStorage(TorchDispatchMode):
    """Peak bytes of the storages created by ops run under this mode (views share their storage)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage key -> [nbytes, tensors alive]
        self.cur = self.peak = 0

    def _release(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.cur -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = st._cdata
                if key in self.live:
                    self.live[key][1] += 1
                else:
                    self.live[key] = [st.nbytes(), 1]
                    self.cur += st.nbytes()
                    self.peak = max(self.peak, self.cur)
                weakref.finalize(t, self._release, key)
        return out


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def estimate(rank: int, fp8_base: bool, resolution: int, tiny: bool = False) -> dict:
    argv = ["--family", "flux", "--device", "cpu", "--rank", str(rank), "--gradient_checkpointing",
            "--resolution", str(resolution)] + (["--fp8_base"] if fp8_base else []) + (["--tiny"] if tiny else [])
    args = bc.parse_args(argv)
    from diffusers import FluxTransformer2DModel

    import networks.lora_flux as lora_flux
    from library import flux_models
    from library.block_swap import flux_blocks

    cfg = dict(bc.FLUX_DEV_CONFIG)
    if tiny:
        cfg.update(bc.FLUX_TINY_OVERRIDES)
    with FakeTensorMode(allow_non_fake_inputs=True):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # build in bf16 directly (Module.to cannot swap fake params)
        try:
            model = FluxTransformer2DModel(**cfg)
        finally:
            torch.set_default_dtype(prev)
        if fp8_base:
            flux_models.apply_fp8_base(model)
        model.train()
        model.enable_gradient_checkpointing()
        model.requires_grad_(False)
        network = lora_flux.create_network(1.0, rank, rank, None, [], model)  # fp32 LoRA weights
        network.apply_to([], model, apply_text_encoder=False, apply_unet=True)
        network.requires_grad_(True)
        params = [p for p in network.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        batch = bc.make_inputs(args, n_sets=1)[0]
        resident = _nbytes(list(model.parameters()) + list(model.buffers()) + params + list(batch.values()))
        tracker = PeakStorage()
        with tracker:
            for _ in range(2):  # the second step has the optimizer state
                loss = bc.loss_fn(model, batch, args)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        block_bytes = [_nbytes(b.parameters()) for b in flux_blocks(model)]
    return dict(resident=resident, step_peak=tracker.peak, block_bytes=block_bytes, lora_params=sum(p.numel() for p in params))


def swap_saving(block_bytes: list[int], k: int) -> int:
    swapped = block_bytes[len(block_bytes) - k:] if k else []
    return sum(swapped) - max(swapped, default=0)  # one swapped block may be in flight


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--fp8_base", action="store_true")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--blocks_to_swap", type=int, nargs="*", default=[0])
    p.add_argument("--compiled_delta_gib", type=float, default=27.70 - 25.90)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test of this script)")
    a = p.parse_args(argv)
    r = estimate(a.rank, a.fp8_base, a.resolution, a.tiny)
    eager = (r["resident"] + r["step_peak"]) / GIB
    print(f"FLUX LoRA r{a.rank} ({r['lora_params'] / 1e6:.1f} M) {a.resolution}px bs1 +GC, base "
          f"{'fp8' if a.fp8_base else 'bf16'}: resident {r['resident'] / GIB:.2f} GiB, step tensors "
          f"{r['step_peak'] / GIB:.2f} GiB, eager peak {eager:.2f} GiB; blocks {len(r['block_bytes'])} "
          f"(first {r['block_bytes'][0] / GIB:.3f} GiB, last {r['block_bytes'][-1] / GIB:.3f} GiB)")
    for k in a.blocks_to_swap:
        est = eager - swap_saving(r["block_bytes"], k) / GIB
        print(f"blocks_to_swap {k:>2}: eager {est:.2f} GiB, compiled {est + a.compiled_delta_gib:.2f} GiB "
              f"(max_memory_allocated estimate)")


if __name__ == "__main__":
    main()

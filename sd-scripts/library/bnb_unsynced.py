"""bitsandbytes' 8-bit / 32-bit optimizers (AdamW8bit, Lion8bit, SGDNesterov8bit, ...) without a GPU synchronize after
every parameter.

bitsandbytes (0.50.2) ends each parameter's update in `Optimizer8bit.step` with `sync_gpu(p)`, a
`torch.cuda.synchronize()`: 1,444 waits for the GPU per step with an SDXL LoRA, so the host can never run ahead of
the GPU (docs/BENCHMARKS.md run64: SDXL bs1 + GC with AdamW8bit 239 ms against AdamW's 130 ms). The waits are there
for paged optimizer state (its pages move asynchronously); without paging, every kernel of the step runs in order on
the current stream anyway. So the step here is bitsandbytes' own loop, the same calls in the same order, without the
per-parameter wait; paged optimizers keep bitsandbytes' step unchanged.
"""
from __future__ import annotations

import functools

import torch


def _unsynced_step(self, closure=None):
    """bitsandbytes' Optimizer8bit.step without its per-parameter GPU synchronize (not for paged state)."""
    if self.is_paged:
        return self._bnb_step(closure)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    if not self.initialized:
        self.check_overrides()
        self.to_gpu()
        self.initialized = True
    for gindex, group in enumerate(self.param_groups):
        for pindex, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            state = self.state[p]
            if len(state) == 0:
                self.init_state(group, p, gindex, pindex)
            self.prefetch_state(p)
            self.update_step(group, p, gindex, pindex)
    return loss


@functools.cache
def unsynced(cls: type) -> type:
    """A subclass of the bitsandbytes optimizer class `cls` whose step does not wait for the GPU per parameter (the
    class keeps its name: the run's metadata names bitsandbytes' class all the same)."""
    return type(cls.__name__, (cls,), {
        "__doc__": f"{cls.__module__}.{cls.__name__} without the per-parameter synchronize (library.bnb_unsynced)",
        "__module__": __name__,
        "_bnb_step": cls.step,
        "step": torch.no_grad()(_unsynced_step),
    })


def is_bnb_optimizer(cls: type) -> bool:
    """Whether `cls` is one of bitsandbytes' optimizers with the per-parameter synchronize (Optimizer8bit's step)."""
    if not cls.__module__.startswith("bitsandbytes."):
        return False
    try:
        from bitsandbytes.optim.optimizer import Optimizer8bit
    except ImportError:  # another layout of bitsandbytes: its own step
        return False
    return issubclass(cls, Optimizer8bit) and all(
        hasattr(Optimizer8bit, name) for name in ("check_overrides", "to_gpu", "init_state", "prefetch_state",
                                                  "update_step"))

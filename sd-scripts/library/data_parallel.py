"""Data-parallel training over the processes of `accelerate launch` (one per GPU, or `--cpu` with gloo).

The trainers do not wrap their trained modules in DistributedDataParallel: a LoRA network runs inside the
UNet's forward (the network's own forward is never called, so DDP would never synchronise it), and the
full-model trainers step the optimizer per parameter inside backward with `--fused_backward_pass`. Instead,
each process trains on its shard of the batches (accelerate's prepared dataloader) and the gradients are
averaged here before the optimizer step, so every process holds the same weights after every step.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# gradients are averaged in flat buckets of about this many bytes (one collective per bucket)
BUCKET_BYTES = 64 * 1024 * 1024


def is_distributed(accelerator) -> bool:
    return accelerator.num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()


def check_launch(accelerator) -> None:
    """Several processes launched but accelerate did not join them (e.g. `--multi_gpu` on a machine without
    GPUs): each would train alone and write the same files. Stop with the way out instead."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1 and accelerator.num_processes == 1:
        raise RuntimeError(
            f"{world} processes were launched (WORLD_SIZE={world}) but accelerate set up no distributed training "
            "(no GPU found?). For data-parallel training on the CPU set ACCELERATE_USE_CPU=1 with "
            "`accelerate launch --multi_gpu --num_processes N`; otherwise launch a single process.")


class GradientAverager:
    """Averages `.grad` of `params` over all processes, overlapping the communication with backward.

    The parameters are cut into buckets of about BUCKET_BYTES, in reverse order (the order backward usually
    produces their gradients). On a step armed with `start(sync=True)`, a hook counts each gradient as autograd
    accumulates it; once a bucket is complete it is flattened and all-reduced asynchronously, while backward
    goes on. `finish()` reduces the buckets that never completed (a parameter without a gradient counts as zero,
    so every process runs the same collectives, in the same order), waits, and writes the averages back.
    In a single process it does nothing."""

    def __init__(self, params, accelerator):
        self.world = accelerator.num_processes
        self.enabled = is_distributed(accelerator)
        self.buckets: list[list[torch.nn.Parameter]] = []
        self._armed = False
        if not self.enabled:
            return
        open_buckets: dict[tuple, list] = {}
        sizes: dict[tuple, int] = {}
        for p in reversed(list(params)):
            key = (p.dtype, p.device)
            bucket = open_buckets.setdefault(key, [])
            bucket.append(p)
            sizes[key] = sizes.get(key, 0) + p.numel() * p.element_size()
            if sizes[key] >= BUCKET_BYTES:
                self.buckets.append(open_buckets.pop(key))
                sizes[key] = 0
        self.buckets.extend(b for b in open_buckets.values() if b)
        self._bucket_of = {}
        for i, bucket in enumerate(self.buckets):
            for p in bucket:
                self._bucket_of[p] = i
                p.register_post_accumulate_grad_hook(self._on_grad)
        self._reset()

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._pending: dict[int, tuple] = {}  # bucket index -> (async work, flat averaged buffer)

    def start(self, sync: bool) -> None:
        """Call before backward: sync=True on the step whose gradients are averaged (accelerator.sync_gradients)."""
        self._armed = self.enabled and sync

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._armed:
            return  # an accumulation micro-step: gradients are averaged once, on the sync step
        i = self._bucket_of[p]
        self._ready[i] += 1
        if self._ready[i] == len(self.buckets[i]):
            self._launch(i)

    def _launch(self, i: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.buckets[i]]
        flat = torch.cat([g.reshape(-1) for g in grads])
        work = torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM, async_op=True)
        self._pending[i] = (work, flat)

    def finish(self) -> None:
        """Call after backward, before clipping and the optimizer step."""
        if not self._armed:
            return
        for i in range(len(self.buckets)):  # same order on every process
            if i not in self._pending:
                self._launch(i)
        for i, bucket in enumerate(self.buckets):
            work, flat = self._pending[i]
            work.wait()
            flat.div_(self.world)
            offset = 0
            for p in bucket:
                n = p.numel()
                avg = flat[offset:offset + n].view_as(p)
                offset += n
                if p.grad is not None:
                    p.grad.copy_(avg)
                elif avg.any():  # unused here, used elsewhere
                    p.grad = avg.clone()
                # unused on every process (e.g. SDXL's last CLIP-L layer): no gradient, as before
        self._armed = False
        self._reset()


def all_reduce_gradient(grad: torch.Tensor, accelerator) -> None:
    """Averages one gradient over all processes, in place (the fused backward pass, per parameter)."""
    if is_distributed(accelerator):
        torch.distributed.all_reduce(grad, op=torch.distributed.ReduceOp.SUM)
        grad.div_(accelerator.num_processes)


def log_process(accelerator, num_batches: int) -> None:
    """One line per process, so a multi-process run shows that every rank trains."""
    logger.info("process %d/%d (%s) trains %d batches per epoch", accelerator.process_index,
                accelerator.num_processes, accelerator.device, num_batches)


def weights_checksum(params) -> float:
    """Sum of all trained weights: equal on every process when their gradients were averaged."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in params))


def log_process_done(accelerator, steps: int, last_loss: float, params) -> None:
    logger.info("process %d/%d finished %d steps, last loss %.4f, weights checksum %.10e", accelerator.process_index,
                accelerator.num_processes, steps, last_loss, weights_checksum(params))

"""Data-parallel training over the processes of `accelerate launch` (one per GPU, or `--cpu` with gloo).

The trainers do not wrap their trained modules in DistributedDataParallel: a LoRA network runs inside the
UNet's forward (the network's own forward is never called, so DDP would never synchronise it), and the
full-model trainers step the optimizer per parameter inside backward with `--fused_backward_pass`. Instead,
each process trains on its shard of the batches (accelerate's prepared dataloader) and the gradients are
averaged here before the optimizer step, so every process holds the same weights after every step.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils.weak import WeakIdKeyDictionary

logger = logging.getLogger(__name__)

# gradients are averaged in flat buckets of about this many bytes (one collective per bucket)
BUCKET_BYTES = 64 * 1024 * 1024


def add_ddp_arguments(parser) -> None:
    """Upstream's DDP options. The timeout applies to the process group; the two DDP-wrapper options are
    accepted for upstream compatibility and change nothing, since nothing is wrapped in DDP here."""
    parser.add_argument("--ddp_timeout", type=int, default=None,
                        help="timeout of the multi-process group in minutes (default: accelerate's)")
    parser.add_argument("--ddp_gradient_as_bucket_view", action="store_true",
                        help="accepted for compatibility; no effect (the trained modules are not wrapped in DDP)")
    parser.add_argument("--ddp_static_graph", action="store_true",
                        help="accepted for compatibility; no effect (the trained modules are not wrapped in DDP)")


def accelerator_kwargs_handlers(args) -> list:
    """The accelerate kwargs handlers for the DDP options (upstream: a timeout of --ddp_timeout minutes)."""
    handlers = []
    if getattr(args, "ddp_timeout", None):
        from datetime import timedelta

        from accelerate.utils import InitProcessGroupKwargs

        handlers.append(InitProcessGroupKwargs(timeout=timedelta(minutes=args.ddp_timeout)))
    if getattr(args, "ddp_gradient_as_bucket_view", False) or getattr(args, "ddp_static_graph", False):
        logger.info("--ddp_gradient_as_bucket_view/--ddp_static_graph have no effect here: the trained modules "
                    "are not wrapped in DistributedDataParallel (gradients are averaged by data_parallel)")
    return handlers


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


def all_reduce_gradients(params, accelerator) -> None:
    """Averages `.grad` of `params` over all processes, in place (nothing to do in a single process).
    A parameter without a gradient counts as a zero gradient, so every process runs the same collectives.

    It also runs inside the captured step of --cuda_graph_step (library.compile.step_graph), whose replays launch
    the same collectives: there it reads nothing back to the host, so whether a parameter no process used keeps
    no gradient is taken from the ordinary steps before the capture (_UNUSED_EVERYWHERE)."""
    if not is_distributed(accelerator) or getattr(accelerator, "distributed_type", None) == "DEEPSPEED":
        return  # (the DeepSpeed engine reduces them in its backward)
    params = [p for p in params if not _is_sharded(p)]  # --fsdp reduced those in backward (library.sharding)
    world = accelerator.num_processes
    buckets: dict[tuple, list[torch.Tensor]] = {}
    sizes: dict[tuple, int] = {}
    no_grad = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
            no_grad.append(p)
        key = (p.grad.dtype, p.grad.device)
        buckets.setdefault(key, []).append(p.grad)
        sizes[key] = sizes.get(key, 0) + p.grad.numel() * p.grad.element_size()
        if sizes[key] >= BUCKET_BYTES:
            _reduce_bucket(buckets.pop(key), world)
            sizes[key] = 0
    for grads in buckets.values():
        _reduce_bucket(grads, world)
    capturing = _capturing()
    if not capturing:
        _UNUSED_EVERYWHERE.clear()  # what this step finds, the same on every process (read from the averages)
    for p in no_grad:  # unused on every process (e.g. SDXL's last CLIP-L layer): no gradient, as before
        if capturing:
            unused = p in _UNUSED_EVERYWHERE
        else:
            unused = not p.grad.any()
            if unused:
                _UNUSED_EVERYWHERE[p] = True
        if unused:
            p.grad = None


# the parameters that the last ordinary step found unused on every process (a capture follows the steps before it)
_UNUSED_EVERYWHERE = WeakIdKeyDictionary()


def _capturing() -> bool:
    """Whether this runs inside a CUDA graph capture, where nothing may be read back to the host."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _is_sharded(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _reduce_bucket(grads: list[torch.Tensor], world: int) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    flat.div_(world)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def all_reduce_gradient(grad: torch.Tensor, accelerator) -> None:
    """Averages one gradient over all processes, in place (the fused backward pass, per parameter)."""
    if is_distributed(accelerator):
        torch.distributed.all_reduce(grad, op=torch.distributed.ReduceOp.SUM)
        grad.div_(accelerator.num_processes)


@contextlib.contextmanager
def main_process_first(accelerator, to_disk: bool, what: str):
    """Around a dataset cache call. Disk caches: the main process fills them first while the others wait
    (accelerator.wait_for_everyone), then the others run the same call, which finds and reuses its files; no two
    processes encode or write the same file. Caches in memory: every process encodes its own copy at once.

    Afterwards every process takes the main process's global torch (and CUDA) RNG state: only the main process
    drew the VAE's latent samples, and the trained weights are initialised from these generators later, which must
    give every process the same weights (nothing broadcasts them: no DDP wrapper here)."""
    if not to_disk or accelerator.num_processes == 1:
        yield
        return
    rank, world = accelerator.process_index, accelerator.num_processes
    with accelerator.main_process_first():
        if accelerator.is_main_process:
            logger.info("process %d/%d caches the %s to disk; the other processes wait for it", rank, world, what)
        else:
            logger.info("process %d/%d reads the %s the main process cached", rank, world, what)
        yield
    from accelerate.utils import synchronize_rng_states

    synchronize_rng_states(["torch", "cuda"] if accelerator.device.type == "cuda" else ["torch"])


def log_process(accelerator, num_batches: int) -> None:
    """One line per process, so a multi-process run shows that every rank trains."""
    logger.info("process %d/%d (%s) trains %d batches per epoch", accelerator.process_index,
                accelerator.num_processes, accelerator.device, num_batches)


def weights_checksum(params) -> float:
    """Sum of all trained weights: equal on every process when their gradients were averaged."""
    with torch.no_grad():  # a sharded (--fsdp) weight is gathered first: a collective, every process calls this
        return float(sum((p.full_tensor() if _is_sharded(p) else p).detach().double().sum().item() for p in params))


def log_process_done(accelerator, steps: int, last_loss: float, params) -> None:
    """On a GPU the line ends with this process's peak of allocated memory since the loop began (each rank's own:
    with --fsdp they differ from the main process's summary line)."""
    peak = ""
    if accelerator.device.type == "cuda":
        peak = f", peak GPU memory {torch.cuda.max_memory_allocated(accelerator.device) / 2**30:.2f} GiB"
    logger.info("process %d/%d finished %d steps, last loss %.4f, weights checksum %.10e%s", accelerator.process_index,
                accelerator.num_processes, steps, last_loss, weights_checksum(params), peak)

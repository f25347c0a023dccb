"""`--cpu_offload_checkpointing` (kohya-ss/sd-scripts name): gradient checkpointing whose kept activations live
in CPU memory.

With gradient checkpointing each checkpointed block keeps only its inputs for the backward pass and recomputes
the rest. With this option those inputs are copied to the CPU in forward, and copied back to the GPU when the
block is recomputed in backward, so the GPU holds no activations of the checkpointed blocks between forward and
backward (upstream does this for its FLUX blocks; here it works for every diffusers model, SD/SDXL UNets and the
FLUX transformer: it is diffusers' `gradient_checkpointing_func`). It costs two PCIe copies per block and step.

Upstream's rules: it acts only with --gradient_checkpointing (flux_train.py turns that on, with a warning), and
not with --blocks_to_swap. With --compile the compiled blocks run inside this (eager) checkpoint, which is
recomputed in backward: that cannot replay CUDA graphs, so the CUDA-graph compile modes are refused
(library.compile.options.validate_compile_args).
"""
from __future__ import annotations

import argparse
import logging

import torch
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

OFFLOAD_DEVICE = torch.device("cpu")


def add_cpu_offload_checkpointing_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu_offload_checkpointing", action="store_true",
                        help="with --gradient_checkpointing: keep the checkpointed blocks' inputs in CPU memory "
                             "between forward and backward (less GPU memory, slower); not with --blocks_to_swap")


def check_args(args, error_cls) -> None:
    """Upstream's rule, before any model loads: not with block swap."""
    if getattr(args, "cpu_offload_checkpointing", False) and (getattr(args, "blocks_to_swap", None) or 0) > 0:
        raise error_cls(f"--cpu_offload_checkpointing cannot be used with --blocks_to_swap {args.blocks_to_swap} "
                        "(both move data between CPU and GPU around the blocks); use one of them")


def enabled(args) -> bool:
    return bool(getattr(args, "cpu_offload_checkpointing", False)) and bool(args.gradient_checkpointing)


def _move(x, device):
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_move(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _move(v, device) for k, v in x.items()}
    return x


def _device_of(args) -> torch.device | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            d = _device_of(a)
            if d is not None:
                return d
    return None


def offloading_checkpoint(module, *args):
    """diffusers' gradient_checkpointing_func(module, *args): non-reentrant checkpoint of `module` that keeps its
    inputs on the CPU. The copies are differentiable, so gradients flow back to the device tensors."""
    device = _device_of(args)
    if device is None:
        return checkpoint(module.__call__, *args, use_reentrant=False)

    def run(*cpu_args):
        return module(*_move(cpu_args, device))

    return checkpoint(run, *_move(args, OFFLOAD_DEVICE), use_reentrant=False)


def enable(model: torch.nn.Module) -> None:
    """diffusers' gradient checkpointing of `model` with the offloading checkpoint function."""
    model.enable_gradient_checkpointing(gradient_checkpointing_func=offloading_checkpoint)
    logger.info("gradient checkpointing of %s with its activations kept in CPU memory (--cpu_offload_checkpointing)",
                type(model).__name__)

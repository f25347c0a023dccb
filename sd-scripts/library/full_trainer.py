"""Full-model training (DreamBooth and fine-tune): the options the full trainers share and the fused backward
pass. What is trained and how it is saved is library.targets.full; the loop is library.run.

`--fused_backward_pass` (Adafactor): each parameter is stepped by the optimizer as soon as its gradient is
complete (a post-accumulate-grad hook), then the gradient is freed, so the full set of gradients never exists.
`--fused_optimizer_groups` / `--blockwise_fused_optimizers`: several optimizers, each stepped inside backward once
all its tensors have gradients.
"""
from __future__ import annotations

import argparse
import logging
import math

import torch

from library import data_parallel, metadata, network_trainer, saving, sharding

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# arguments


def add_full_training_arguments(parser: argparse.ArgumentParser, *, text_encoders: int) -> None:
    """Flags of the full trainers (kohya-ss/sd-scripts names); `text_encoders` = 2 gives SDXL's te1/te2 rates."""
    parser.add_argument("--train_text_encoder", action="store_true", help="also train the text encoder(s)")
    if text_encoders == 2:
        parser.add_argument("--learning_rate_te1", type=float, default=None,
                            help="learning rate of text encoder 1 (CLIP-L); default --learning_rate, 0 = frozen")
        parser.add_argument("--learning_rate_te2", type=float, default=None,
                            help="learning rate of text encoder 2 (OpenCLIP bigG); default --learning_rate, "
                                 "0 = frozen")
    else:
        parser.add_argument("--learning_rate_te", type=float, default=None,
                            help="learning rate of the text encoder; default --learning_rate, 0 = frozen")
    saving.add_sd_saving_arguments(parser)  # --save_model_as (default: as the input model), --use_safetensors
    metadata.add_comment_arguments(parser, lora=False)  # --no_metadata --training_comment
    sharding.add_fsdp_arguments(parser)  # --fsdp, --fsdp_cpu_offload


def add_diffusers_xformers_argument(parser: argparse.ArgumentParser) -> None:
    """fine_tune.py / sdxl_train.py."""
    parser.add_argument("--diffusers_xformers", action="store_true",
                        help="xformers attention through diffusers in the UNet and the VAE (if installed)")


def setup_parser(*, text_encoders: int) -> argparse.ArgumentParser:
    """The flags every full trainer shares; scripts add family flags (e.g. compile) on top."""
    parser = network_trainer.base_parser()
    add_full_training_arguments(parser, text_encoders=text_encoders)
    return parser


# ----------------------------------------------------------------------------------------------------------
# fused backward pass


def copy_stochastic_(target: torch.Tensor, source: torch.Tensor) -> None:
    """float32 `source` into bfloat16 `target`, each value rounded down or up at random with the odds of its
    distance to the two (unbiased), so updates smaller than a bfloat16 step still add up over many steps."""
    bits = source.contiguous().view(torch.int32)
    noisy = bits + torch.randint_like(bits, 0, 1 << 16)  # random low 16 bits: carries into the kept bits or not
    target.copy_(noisy.bitwise_and_(-65536).view(torch.float32))  # keep the high 16 bits (bfloat16's)


def step_one_parameter(optimizer: torch.optim.Optimizer, param: torch.Tensor, group: dict) -> None:
    """optimizer.step() for one parameter of `group` (its state and the group's current lr are used).
    A bfloat16 weight is stepped in float32 and written back with stochastic rounding, as upstream's fused
    Adafactor does (round-to-nearest would drop every update below half a bfloat16 step)."""
    saved = optimizer.param_groups
    optimizer.param_groups = [{**group, "params": [param]}]
    low = param.data if param.dtype == torch.bfloat16 else None
    if low is not None:
        param.data = low.float()
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = saved
        if low is not None:
            full, param.data = param.data, low
            copy_stochastic_(low, full)


def register_fused_backward(args, accelerator, optimizer) -> int:
    """Hooks that average (multi-process), clip (per tensor) and apply each gradient as soon as it is
    complete, then free it. Returns the number of hooked parameters."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    n = 0
    for group in inner.param_groups:
        for param in group["params"]:
            if not param.requires_grad:
                continue

            def hook(tensor: torch.Tensor, group=group) -> None:
                data_parallel.all_reduce_gradient(tensor.grad, accelerator)
                if args.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_([tensor], args.max_grad_norm)
                step_one_parameter(inner, tensor, group)
                tensor.grad = None

            param.register_post_accumulate_grad_hook(hook)
            n += 1
    logger.info("fused backward pass: the optimizer steps %d parameters during backward", n)
    return n


def register_grouped_fused_backward(args, accelerator, optimizers: list) -> list[int]:
    """Upstream's fused optimizer groups (sdxl_train --fused_optimizer_groups, flux_train
    --blockwise_fused_optimizers): each optimizer steps, inside backward, as soon as every parameter it holds has
    its gradient (each gradient averaged over the processes and clipped on its own first), then frees them.
    Returns the per-optimizer counters; `reset_counts` empties them at the start of each step, as upstream."""
    counts = [0] * len(optimizers)
    sizes = [0] * len(optimizers)
    for i, optimizer in enumerate(optimizers):
        inner = getattr(optimizer, "optimizer", optimizer)
        for group in inner.param_groups:
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                sizes[i] += 1

                def hook(tensor: torch.Tensor, i=i) -> None:
                    if accelerator.sync_gradients:
                        data_parallel.all_reduce_gradient(tensor.grad, accelerator)
                        if args.max_grad_norm:
                            torch.nn.utils.clip_grad_norm_([tensor], args.max_grad_norm)
                    counts[i] += 1
                    if counts[i] == sizes[i]:
                        # accelerate's optimizer steps (and zeroes) only when gradients are synchronised
                        optimizers[i].step()
                        optimizers[i].zero_grad(set_to_none=True)

                param.register_post_accumulate_grad_hook(hook)
    logger.info("fused optimizer groups: %d optimizers step during backward (%s parameters each)", len(optimizers),
                ", ".join(map(str, sizes)))
    return counts


def add_fused_optimizer_groups_argument(parser: argparse.ArgumentParser) -> None:
    """sdxl_train.py and flux_train.py (flux_train: accepted, no effect, as upstream)."""
    parser.add_argument("--fused_optimizer_groups", type=int, default=None,
                        help="number of optimizers that step inside backward, each over a part of the parameters "
                             "(saves the memory of all gradients, any optimizer)")


def add_blockwise_arguments(parser: argparse.ArgumentParser) -> None:
    """flux_train.py, sd3_train.py and lumina_train.py: --blockwise_fused_optimizers, and the deprecated
    --skip_latents_validity_check."""
    parser.add_argument("--blockwise_fused_optimizers", action="store_true",
                        help="one optimizer per transformer block, each stepped inside backward as soon as its "
                             "block's gradients are complete (any optimizer; saves the memory of all gradients)")
    add_skip_latents_validity_check_argument(parser)


def add_skip_latents_validity_check_argument(parser: argparse.ArgumentParser) -> None:
    """The DiT full trainers' deprecated flag (anima_train.py has it without the blockwise optimizers)."""
    parser.add_argument("--skip_latents_validity_check", action="store_true",
                        help="[deprecated] the same as --skip_cache_check")


def split_param_groups(param_groups: list[dict], n: int) -> list[dict]:
    """Upstream's --fused_optimizer_groups split: about len/n tensors per group, in order, and a new group
    wherever the learning rate changes (so there can be more than n)."""
    total = sum(len(g["params"]) for g in param_groups)
    per_group = math.ceil(total / n)
    out: list[dict] = []
    current: list = []
    current_lr = None
    for group in param_groups:
        for param in group["params"]:
            if current and group["lr"] != current_lr:
                out.append({"params": current, "lr": current_lr})
                current = []
            current_lr = group["lr"]
            current.append(param)
            if len(current) == per_group:
                out.append({"params": current, "lr": current_lr})
                current = []
    if current:
        out.append({"params": current, "lr": current_lr})
    return out


def run(trainer, parser: argparse.ArgumentParser, argv: list[str] | None = None) -> str | None:
    """Parse (with --config_file) and train; clear errors exit with status 2 (network_trainer.run)."""
    return network_trainer.run(trainer, parser, argv)

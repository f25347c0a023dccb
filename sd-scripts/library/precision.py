"""Precision options of the base model (kohya-ss/sd-scripts names): `--fp8_base`, `--fp8_base_unet`,
`--fp16_master_weights_and_gradients`, and the fp8 mechanism itself (shared by SD/SDXL and FLUX.1).

fp8 base (LoRA trainers): the frozen weights of every Linear layer are stored in float8_e4m3fn and upcast per
layer, in forward, to the compute dtype (autocast's, else the input's). `--fp8_base` does it for the UNet / DiT
and the text encoders, `--fp8_base_unet` for the UNet / DiT only (upstream's split). Upstream casts whole models
and relies on autocast to upcast; here only Linear weights are converted (convolutions, norms and embeddings stay
in the training dtype) and the upcast is explicit, so it also trains without --mixed_precision and on the CPU.
LoRA modules wrap the patched forward, so apply fp8 BEFORE the network is applied. The full trainers accept
--fp8_base and ignore it, as upstream does (their weights are trained).
"""
from __future__ import annotations

import argparse
import logging
import types

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn


def add_mixed_precision_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"],
                        help="mixed precision")
    parser.add_argument("--full_fp16", action="store_true", help="fp16 training including the gradients")
    parser.add_argument("--full_bf16", action="store_true", help="bf16 training including the gradients")


def add_vae_and_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no_half_vae", action="store_true", help="keep the VAE in float32 under mixed precision")
    parser.add_argument("--lowram", action="store_true", help="accepted for compatibility")
    parser.add_argument("--highvram", action="store_true", help="accepted for compatibility")


def add_fp8_base_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp8_base", action="store_true",
                        help="keep the frozen base model's Linear weights in float8_e4m3fn (UNet/DiT and text "
                             "encoders; LoRA trainers only, ignored by full fine-tuning)")


def add_fp8_base_unet_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp8_base_unet", action="store_true",
                        help="float8 Linear weights for the UNet/DiT only; the text encoders keep the training dtype")


def add_fp16_master_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp16_master_weights_and_gradients", action="store_true",
                        help="DeepSpeed ZeRO-2 option (fp16 master weights with CPU optimizer offload); "
                             "DeepSpeed is not used here, so it has no effect")


def check_precision_args(args) -> None:
    """Before models load: --full_fp16 / --full_bf16 with their --mixed_precision; warnings for options that
    change nothing here (as upstream, no error)."""
    from library.errors import ConfigError

    if getattr(args, "full_fp16", False) and getattr(args, "full_bf16", False):
        raise ConfigError("--full_fp16 and --full_bf16 exclude each other")
    if getattr(args, "full_fp16", False) and args.mixed_precision != "fp16":
        raise ConfigError("--full_fp16 needs --mixed_precision fp16")
    if getattr(args, "full_bf16", False) and args.mixed_precision != "bf16":
        raise ConfigError("--full_bf16 needs --mixed_precision bf16")
    if getattr(args, "fp16_master_weights_and_gradients", False):
        # upstream reads it only in its DeepSpeed plugin (ZeRO-2 + CPU optimizer offload)
        logger.warning("--fp16_master_weights_and_gradients applies only to DeepSpeed ZeRO-2 with the optimizer "
                       "offloaded to the CPU, which this trainer does not use: ignored")


def fp8_targets(args) -> tuple[bool, bool]:
    """(UNet/DiT in fp8, text encoders in fp8) for a LoRA run."""
    unet_only = bool(getattr(args, "fp8_base_unet", False))
    base = bool(getattr(args, "fp8_base", False))
    return base or unet_only, base and not unet_only


# ----------------------------------------------------------------------------------------------------------
# the mechanism


class _FP8Linear(torch.autograd.Function):
    """y = x W^T + b with W stored in fp8 and frozen: backward keeps the fp8 W (not an upcast copy per layer,
    which would cost as much memory as a bf16 base) and upcasts it again for grad_x."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return F.linear(x, weight.to(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight.to(grad.dtype), None, None


def _fp8_linear_forward(self, x):
    # upcast straight to the compute dtype (autocast's when it is on), never to a wider one than needed
    dt = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    bias = None if self.bias is None else self.bias.to(dt)
    with torch.autocast(x.device.type, enabled=False):
        return _FP8Linear.apply(x.to(dt), self.weight, bias)


def apply_fp8_base(model: torch.nn.Module) -> int:
    """Store every Linear weight of a frozen model in float8_e4m3fn and upcast it per layer in forward.

    Halves the memory of a bf16 base; LoRA modules wrap the patched forward, so they still see full-precision
    inputs and outputs. Returns the number of Linear layers converted."""
    # T5's feed-forward casts its input to wo's weight dtype before calling wo (transformers keeps wo in fp32
    # for 8-bit models): with an fp8 wo the hidden states would be rounded to fp8, so wo keeps its dtype
    keep = {id(m.wo) for m in model.modules() if type(m).__name__ in ("T5DenseActDense", "T5DenseGatedActDense")}
    n = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and id(module) not in keep:
            module.weight.requires_grad_(False)
            module.weight.data = module.weight.data.to(FP8_DTYPE)
            module.forward = types.MethodType(_fp8_linear_forward, module)
            n += 1
    return n


def has_fp8(module: torch.nn.Module) -> bool:
    return any(p.dtype == FP8_DTYPE for p in module.parameters())


def to_device_dtype(module: torch.nn.Module, device, dtype: torch.dtype) -> None:
    """module.to(device, dtype) that leaves fp8 weights in fp8 (Module.to would upcast them)."""
    if not has_fp8(module):
        module.to(device, dtype=dtype)
        return
    for t in list(module.parameters()) + list(module.buffers()):
        cast = t.is_floating_point() and t.dtype not in (FP8_DTYPE, dtype)
        t.data = t.data.to(device, dtype=dtype) if cast else t.data.to(device)


def apply_fp8_to_components(targets: tuple[bool, bool], unet, text_encoders) -> None:
    """fp8_targets' (UNet, text encoders) on a loaded model: `unet` is the UNet/DiT (None when the loader already
    made it fp8)."""
    fp8_unet, fp8_te = targets
    if fp8_unet and unet is not None:
        n = apply_fp8_base(unet)
        logger.info("fp8 base: %d Linear layers of the %s kept in float8_e4m3fn", n, type(unet).__name__)
    if fp8_te:
        for te in text_encoders:
            n = apply_fp8_base(te)
            logger.info("fp8 base: %d Linear layers of text encoder %s kept in float8_e4m3fn", n,
                        type(te).__name__)

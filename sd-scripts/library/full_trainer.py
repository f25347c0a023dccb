"""Full-model training (DreamBooth and fine-tune): the model's own weights are trained, not a LoRA.

`FullTrainer` is a mixin put in front of a family's `NetworkTrainer` subclass, so the full trainers share the
LoRA loop (network_trainer.NetworkTrainer.train: data, caching, optimizer, data-parallel gradients, saving
cadence, --save_state/--resume, sampling, progress) and the family hooks (text encoding, UNet call, noise,
compile), and change only what is trained and how it is saved:

    class SDXLTrainer(FullTrainer, SDXLNetworkTrainer): ...        # sdxl_train.py
    class SDTrainer(FullTrainer, NetworkTrainer): ...               # train_db.py, fine_tune.py

A family adapts it with these hooks (defaults fit SD1.x / SD2.x / SDXL):

    trains_text_encoder(args) -> bool                 text encoder(s) trained from the start (--train_text_encoder)
    text_encoder_lrs(args) -> list[float | None]     per text encoder, None = frozen (SDXL: te1, te2)
    trained_model(components) -> the denoiser        (components.unet; FLUX: its transformer)
    save_full_model(args, components, path, metadata, save_dtype)   single file / diffusers folder
    modelspec_variant() -> str | None                 FLUX: "dev" / "schnell" (modelspec architecture)

`--fused_backward_pass` (Adafactor): each parameter is stepped by the optimizer as soon as its gradient is
complete (a post-accumulate-grad hook), then the gradient is freed, so the full set of gradients never exists.
"""
from __future__ import annotations

import argparse
import logging
import math
import time
from typing import Any

import torch

from library import data_parallel, network_trainer, saving, train_util
from library import metadata as metadata_util
from library.network_trainer import Trainable
from library.train_util import ConfigError

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
    parser.add_argument("--no_metadata", action="store_true", help="write no ss_*/modelspec metadata")
    parser.add_argument("--training_comment", type=str, default=None, help="ss_training_comment metadata")


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


# ----------------------------------------------------------------------------------------------------------


class FullTrainer:
    """Mixin: trains the denoiser (and optionally the text encoders) of the family trainer it precedes."""

    default_output_name = "last"
    tracker_name = "finetuning"
    fuses_backward = True  # --fused_backward_pass steps each parameter inside backward (register_fused_backward)

    # -- family hooks ------------------------------------------------------------------------------------
    def fp8_targets(self, args) -> tuple[bool, bool]:
        return False, False  # the weights are trained (check_args warns about --fp8_base)

    def trains_text_encoder(self, args) -> bool:
        """Whether the text encoder(s) are trained from the first step: --train_text_encoder (train_db.py:
        unless --stop_text_encoder_training is negative)."""
        return bool(args.train_text_encoder)

    def text_encoder_lrs(self, args) -> list[float | None]:
        """Learning rate per text encoder when --train_text_encoder (None or 0 = frozen)."""
        lr = args.learning_rate_te if args.learning_rate_te is not None else args.learning_rate
        return [lr]

    def trained_model(self, components):
        return components.unet

    def save_full_model(self, args, components, path: str, metadata: dict[str, str] | None, save_dtype) -> None:
        from library import model_util

        if self.output_format(args)[0] == "diffusers":
            model_util.save_sd_diffusers(path, components, save_dtype=save_dtype, overwrite=args.overwrite_output)
        else:
            model_util.save_sd_checkpoint(path, components, save_dtype=save_dtype, metadata=metadata,
                                          overwrite=args.overwrite_output)

    # -- checks ------------------------------------------------------------------------------------------
    def check_args(self, args) -> None:
        train_util.verify_training_args(args)
        self.check_objective_args(args)
        if getattr(args, "fp8_base", False):
            logger.warning("--fp8_base is for LoRA training (a frozen base); a full fine-tune trains the weights, "
                           "so it is ignored, as upstream does")
        if not args.pretrained_model_name_or_path:
            raise ConfigError("--pretrained_model_name_or_path is required")
        caching_te = args.cache_text_encoder_outputs or args.cache_text_encoder_outputs_to_disk
        train_te = self.trains_text_encoder(args)
        if caching_te and train_te:
            raise ConfigError("--cache_text_encoder_outputs cannot be used with --train_text_encoder (a trained "
                              "text encoder changes its outputs); drop one of them")
        lrs = self.text_encoder_lrs(args)
        for name in ("learning_rate_te", "learning_rate_te1", "learning_rate_te2"):
            value = getattr(args, name, None)
            if value is not None and value < 0:
                raise ConfigError(f"--{name} must be 0 or more, got {value}")
        given = [n for n in ("learning_rate_te", "learning_rate_te1", "learning_rate_te2") if getattr(args, n, None)]
        if given and not train_te:
            logger.warning("%s given without --train_text_encoder: the text encoders stay frozen",
                           ", ".join("--" + n for n in given))
        if train_te and not any(lrs):
            raise ConfigError("--train_text_encoder with every text-encoder learning rate 0: nothing of the text "
                              "encoders would be trained; drop --train_text_encoder or give a rate above 0")
        # (optimizers.check_optimizer_args, run by verify_training_args, has upstream's Adafactor-only and
        # no-accumulation rules)
        fused_flag = "--fused_backward_pass" if args.fused_backward_pass else \
            "--fused_optimizer_groups" if getattr(args, "fused_optimizer_groups", None) else \
            "--blockwise_fused_optimizers" if getattr(args, "blockwise_fused_optimizers", False) else None
        if fused_flag and args.mixed_precision == "fp16":
            # (upstream lets it run; its GradScaler would unscale and update once per group, not once per step)
            raise ConfigError(f"{fused_flag} cannot be used with --mixed_precision fp16 (the loss scaler needs "
                              "all gradients before a step); use --mixed_precision bf16")
        if getattr(args, "fused_optimizer_groups", None) is not None and args.fused_optimizer_groups < 0:
            raise ConfigError(f"--fused_optimizer_groups must be 1 or more (0 = off), got {args.fused_optimizer_groups}")
        if args.fused_backward_pass and fused_flag and (getattr(args, "fused_optimizer_groups", None) or
                                                       getattr(args, "blockwise_fused_optimizers", False)):
            logger.warning("--fused_backward_pass is used; the fused optimizer groups are not (as upstream)")
        self.assert_extra_args(args)

    def output_format(self, args) -> tuple[str, str]:
        """("single", ".safetensors" | ".ckpt") or ("diffusers", ""): --save_model_as, unset = as the input
        model (library.saving.full_model_format)."""
        return saving.full_model_format(args.save_model_as, getattr(args, "use_safetensors", False),
                                        args.pretrained_model_name_or_path)

    def output_ext(self, args) -> str:
        return self.output_format(args)[1]

    # -- what is trained ---------------------------------------------------------------------------------
    def setup_trainable(self, args, accelerator, components, weight_dtype, caching_te: bool) -> Trainable:
        device = accelerator.device
        # master weights in float32 under mixed precision; --full_bf16/--full_fp16 train in that dtype
        train_dtype = weight_dtype if (args.full_bf16 or args.full_fp16) else torch.float32
        self.components = components
        model = self.trained_model(components)
        model.requires_grad_(True)
        model.to(device, dtype=train_dtype)
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": args.learning_rate}]
        models = [model]
        trained_tes = []
        if self.trains_text_encoder(args):
            for i, (te, lr) in enumerate(zip(components.text_encoders, self.text_encoder_lrs(args))):
                if not lr:
                    logger.info("text encoder %d: learning rate 0, kept frozen", i + 1)
                    continue
                te.requires_grad_(True)
                te.to(device, dtype=train_dtype)
                te.train()
                groups.append({"params": [p for p in te.parameters() if p.requires_grad], "lr": lr})
                models.append(te)
                trained_tes.append(i + 1)
        train_text_encoder = bool(trained_tes)
        if args.gradient_checkpointing:
            self.enable_gradient_checkpointing(args, components, train_text_encoder)
        model.train()
        if not caching_te:
            for te in components.text_encoders:
                te.to(device)
        n_params = sum(p.numel() for g in groups for p in g["params"])
        logger.info("training the %s%s: %.1fM parameters in %s", self.model_label,
                    f" and text encoder(s) {trained_tes}" if trained_tes else "", n_params / 1e6,
                    str(train_dtype).removeprefix("torch."))
        return Trainable(models=models, param_groups=groups, train_text_encoder=train_text_encoder)

    def fused_optimizer_groups(self, args) -> bool:
        """Several optimizers stepped inside backward (--fused_optimizer_groups N; FLUX: blockwise)."""
        return bool(getattr(args, "fused_optimizer_groups", None)) and not args.fused_backward_pass

    def steps_in_backward(self, args) -> bool:
        return bool(args.fused_backward_pass) or self.fused_optimizer_groups(args)

    def optimizer_param_groups(self, args, trainable: Trainable) -> list[list[dict]]:
        if self.fused_optimizer_groups(args):
            return [[g] for g in split_param_groups(trainable.param_groups, args.fused_optimizer_groups)]
        return [trainable.param_groups]

    def after_prepare(self, args, accelerator, trainable: Trainable, optimizer) -> None:
        if args.fused_backward_pass:  # upstream: it wins over the optimizer groups
            register_fused_backward(args, accelerator, optimizer)
        elif self.fused_optimizer_groups(args):
            self.fused_counts = register_grouped_fused_backward(args, accelerator, self.optimizers)

    def on_step_start(self, args) -> None:
        for i in range(len(getattr(self, "fused_counts", []))):
            self.fused_counts[i] = 0
        super().on_step_start(args)

    def on_epoch_start(self, args, trainable: Trainable, components) -> None:
        pass

    # -- outputs -----------------------------------------------------------------------------------------
    def build_metadata(self, *a, **kw) -> dict[str, str]:
        md = super().build_metadata(*a, **kw)
        return {k: v for k, v in md.items() if k not in metadata_util.NETWORK_KEYS}

    def method_metadata(self, args) -> dict[str, Any]:
        md: dict[str, Any] = {
            "ss_train_text_encoder": self.trains_text_encoder(args),
            "ss_fused_backward_pass": bool(args.fused_backward_pass),
        }
        for name in ("learning_rate_te", "learning_rate_te1", "learning_rate_te2"):
            if getattr(args, name, None) is not None:
                md["ss_" + name] = getattr(args, name)
        return md

    def save_model(self, args, accelerator, trainable: Trainable, metadata, path, epoch, step) -> None:
        """The whole model (main process only), written to a temporary name and renamed when complete."""
        train_util.ensure_can_write(path, args.overwrite_output)
        md = None
        if not args.no_metadata and self.output_format(args)[0] != "diffusers":
            md = dict(metadata)
            md["ss_training_finished_at"] = str(time.time())
            md["ss_steps"] = str(step)
            md["ss_epoch"] = str(epoch)
            md.update(self.modelspec(args, lora=False))
        self.save_full_model(args, self.components, path, md, train_util.save_dtype_for(args))
        logger.info("saved %s", path)


def run(trainer, parser: argparse.ArgumentParser, argv: list[str] | None = None) -> str | None:
    """Parse (with --config_file) and train; clear errors exit with status 2 (network_trainer.run)."""
    return network_trainer.run(trainer, parser, argv)

"""The full-model target (train_db.py, fine_tune.py, sdxl_train.py, flux_train.py): the denoiser's own weights
(and optionally the text encoders) are trained; saved as a whole model in the family's format.

What the four scripts do differently is given to `Full` as plain functions (`text_encoder_lrs`, `trains_text_encoder`,
`keep_training_text_encoder`, `check`, `param_groups`, `optimizer_groups`, `place`, `extra_metadata`); the defaults
fit SD1.x / SD2.x. The fused backward pass and the fused optimizer groups are library.full_trainer's.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from library import config_util, full_trainer, sharding, train_util
from library import metadata as metadata_util
from library.network_trainer import Trainable
from library.errors import ConfigError

logger = logging.getLogger(__name__)


def default_text_encoder_lrs(args) -> list[float | None]:
    """--learning_rate_te (default --learning_rate) for the one text encoder; 0 = frozen."""
    return [args.learning_rate_te if args.learning_rate_te is not None else args.learning_rate]


class Full:
    default_output_name = "last"
    lora = False  # modelspec: a whole model

    def __init__(self, *, tracker_name: str = "finetuning",
                 dataset_kinds=(config_util.DREAMBOOTH, config_util.FINETUNING),
                 text_encoder_lrs: Callable = default_text_encoder_lrs,
                 trains_text_encoder: Callable | None = None,
                 keep_training_text_encoder: Callable | None = None,
                 check: Callable | None = None,
                 te_cache_partial: Callable | None = None,
                 param_groups: Callable | None = None,
                 fused_groups: Callable | None = None,
                 optimizer_groups: Callable | None = None,
                 place: Callable | None = None,
                 extra_metadata: Callable | None = None):
        self.tracker_name, self.dataset_kinds = tracker_name, dataset_kinds
        self.text_encoder_lrs = text_encoder_lrs
        self._trains_text_encoder = trains_text_encoder
        self._keep_training_text_encoder = keep_training_text_encoder
        self._check, self._param_groups, self._place = check, param_groups, place
        self._te_cache_partial = te_cache_partial
        self._fused_groups, self._optimizer_groups = fused_groups, optimizer_groups
        self._extra_metadata = extra_metadata
        self.fused_counts: list = []

    def trains_text_encoder(self, args) -> bool:
        """Whether the text encoder(s) are trained from the first step (--train_text_encoder by default)."""
        if self._trains_text_encoder is not None:
            return self._trains_text_encoder(args)
        return bool(args.train_text_encoder)

    def te_cache_partial(self, args) -> bool:
        """Whether cached text-encoder outputs are completed each step by live (possibly trained) encoders
        (sd3_train.py --use_t5xxl_cache_only: T5-XXL cached, CLIP live)."""
        return self._te_cache_partial is not None and self._te_cache_partial(args)

    def check_args(self, args, family_name: str) -> None:
        if self._check is not None:
            self._check(args, self)
        if getattr(args, "fp8_base", False):
            logger.warning("--fp8_base is for LoRA training (a frozen base); a full fine-tune trains the weights, "
                           "so it is ignored, as upstream does")
        if not args.pretrained_model_name_or_path:
            raise ConfigError("--pretrained_model_name_or_path is required")
        self._check_text_encoders(args)
        self._check_fused(args)
        sharding.check_fsdp_args(args, ConfigError)

    def _check_text_encoders(self, args) -> None:
        caching_te = args.cache_text_encoder_outputs or args.cache_text_encoder_outputs_to_disk
        train_te = self.trains_text_encoder(args)
        if caching_te and train_te and not self.te_cache_partial(args):
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

    def _check_fused(self, args) -> None:
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

    def fp8_targets(self, args) -> tuple[bool, bool]:
        return False, False  # the weights are trained (check_args warns about --fp8_base)

    def output_ext(self, args, family) -> str:
        return family.full_output_format(args)[1]

    def fused_optimizer_groups(self, args) -> bool:
        """Several optimizers stepped inside backward (--fused_optimizer_groups N; FLUX: blockwise)."""
        if self._fused_groups is not None:
            return self._fused_groups(args)
        return bool(getattr(args, "fused_optimizer_groups", None)) and not args.fused_backward_pass

    def steps_in_backward(self, args) -> bool:
        return bool(args.fused_backward_pass) or self.fused_optimizer_groups(args)

    def merge_base_weights(self, args, family, components) -> None:
        pass  # --base_weights is a LoRA-script option

    def setup_trainable(self, args, accelerator, family, components, weight_dtype, caching_te: bool) -> Trainable:
        device = accelerator.device
        # master weights in float32 under mixed precision; --full_bf16/--full_fp16 train in that dtype
        train_dtype = weight_dtype if (args.full_bf16 or args.full_fp16) else torch.float32
        if self._place is not None:  # the script places and selects what is trained (flux_train.py)
            trainable = self._place(args, accelerator, family, components, train_dtype)
        else:
            denoiser_device = None if sharding.shards(args, accelerator) else device  # fully_shard places it
            trainable = self._denoiser_and_text_encoders(args, device, denoiser_device, family, components,
                                                         train_dtype)
        if not caching_te or self.te_cache_partial(args):
            for te in components.text_encoders:
                te.to(device)
        trainable = sharding.shard(args, accelerator, trainable, components.denoiser, weight_dtype)  # --fsdp
        if self._param_groups is not None:  # e.g. sdxl_train.py's --block_lr
            self._param_groups(args, components, trainable, self.fused_optimizer_groups(args))
        return trainable

    def _denoiser_and_text_encoders(self, args, device, denoiser_device, family, components, train_dtype) -> Trainable:
        model = components.denoiser
        model.requires_grad_(True)
        model.to(denoiser_device, dtype=train_dtype)
        groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": args.learning_rate}]
        models, trained_tes = [model], []
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
        if args.gradient_checkpointing:
            family.enable_gradient_checkpointing(
                args, components, family.lora_text_encoders(components) if trained_tes else [])
        model.train()
        n_params = sum(p.numel() for g in groups for p in g["params"])
        logger.info("training the %s%s: %.1fM parameters in %s", family.label,
                    f" and text encoder(s) {trained_tes}" if trained_tes else "", n_params / 1e6,
                    str(train_dtype).removeprefix("torch."))
        return Trainable(models=models, param_groups=groups, train_text_encoder=bool(trained_tes))

    def prepare_dataset(self, args, groups: list) -> None:
        pass  # captions as they are (textual inversion rewrites them)

    def sample_args(self, args):
        return args  # sample prompts as they are

    def optimizer_param_groups(self, args, family, components, trainable: Trainable) -> list[list[dict]]:
        if not self.fused_optimizer_groups(args):
            return [trainable.param_groups]
        if self._optimizer_groups is not None:  # flux_train.py: one optimizer per block
            return self._optimizer_groups(args, components)
        return [[g] for g in full_trainer.split_param_groups(trainable.param_groups, args.fused_optimizer_groups)]

    def after_prepare(self, args, accelerator, trainable: Trainable, optimizers: list) -> None:
        if args.fused_backward_pass:  # upstream: it wins over the optimizer groups
            full_trainer.register_fused_backward(args, accelerator, optimizers[0])
        elif self.fused_optimizer_groups(args):
            self.fused_counts = full_trainer.register_grouped_fused_backward(args, accelerator, optimizers)

    def on_step_start(self, args) -> None:
        for i in range(len(self.fused_counts)):
            self.fused_counts[i] = 0

    def on_epoch_start(self, args, family, trainable: Trainable, components) -> None:
        pass

    def keep_training_text_encoder(self, args, global_step: int, components) -> bool:
        """False freezes the text encoder from this step on (train_db.py: --stop_text_encoder_training)."""
        if self._keep_training_text_encoder is None:
            return True
        return self._keep_training_text_encoder(args, global_step, components)

    def metadata(self, args, md: dict[str, str]) -> dict[str, str]:
        """The shared ss_* keys without the LoRA network's."""
        return {k: v for k, v in md.items() if k not in metadata_util.NETWORK_KEYS}

    def method_metadata(self, args) -> dict[str, Any]:
        md: dict[str, Any] = {
            "ss_train_text_encoder": self.trains_text_encoder(args),
            "ss_fused_backward_pass": bool(args.fused_backward_pass),
        }
        for name in ("learning_rate_te", "learning_rate_te1", "learning_rate_te2"):
            if getattr(args, name, None) is not None:
                md["ss_" + name] = getattr(args, name)
        if self._extra_metadata is not None:
            md.update(self._extra_metadata(args))
        return md

    def save_model(self, args, accelerator, trainable: Trainable, family, components, metadata, path, epoch, step,
                   modelspec) -> None:
        """The whole model (main process only), written to a temporary name and renamed when complete."""
        train_util.ensure_can_write(path, args.overwrite_output)
        md = None
        if not args.no_metadata and family.full_output_format(args)[0] != "diffusers":
            md = dict(metadata)
            md["ss_training_finished_at"] = str(time.time())
            md["ss_steps"] = str(step)
            md["ss_epoch"] = str(epoch)
            md.update(modelspec)
        family.save_full_model(args, components, path, md, train_util.save_dtype_for(args))
        logger.info("saved %s", path)


# ----------------------------------------------------------------------------------------------------------
# train_db.py: kohya's DreamBooth trains the text encoder by default, up to --stop_text_encoder_training


def dreambooth_trains_text_encoder(args) -> bool:
    stop = args.stop_text_encoder_training
    return (stop is None or stop >= 0) and any(default_text_encoder_lrs(args))


def dreambooth_keep_training_text_encoder(args, global_step: int, components) -> bool:
    stop = args.stop_text_encoder_training
    if stop is None or global_step < stop:
        return True
    logger.info("stop text encoder training at step %d", global_step)
    components.text_encoders[0].requires_grad_(False).eval()
    return False


def dreambooth_check(args, target) -> None:
    if (args.cache_text_encoder_outputs or args.cache_text_encoder_outputs_to_disk) \
            and dreambooth_trains_text_encoder(args):
        raise ConfigError("--cache_text_encoder_outputs needs a frozen text encoder, and train_db.py trains it "
                          "by default: add --stop_text_encoder_training -1 or drop the caching")


def dreambooth(tracker_name: str = "dreambooth") -> Full:
    return Full(tracker_name=tracker_name, dataset_kinds=(config_util.DREAMBOOTH,),
                trains_text_encoder=dreambooth_trains_text_encoder,
                keep_training_text_encoder=dreambooth_keep_training_text_encoder, check=dreambooth_check)

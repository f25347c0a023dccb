"""The options every trainer shares (`base_parser`), the LoRA scripts' (`setup_parser`), the LoRA helpers
(network module import, network args, saving another module's network), the run's error types and `run`, which
parses the options and trains with a composed trainer (library.run.trainer.Trainer: a model family from
library.families, a target from library.targets)."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from dataclasses import dataclass

import torch

from library import (config_util, data_parallel, huggingface_util, losses, masks, noise, optimizers, parity,
                     saving, schedulers, sharding, train_util, validation)
from library import ema, metadata as metadata_util
from library.compile import graphs as compile_graphs
from library.errors import ConfigError, TrainingError, UserError  # noqa: F401  (re-exported)
from library.network_options import parse_network_args  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# arguments


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--network_module", type=str, default=None, help="network module, e.g. networks.lora")
    parser.add_argument("--network_dim", type=int, default=None, help="LoRA rank (default 4)")
    parser.add_argument("--network_alpha", type=float, default=1, help="LoRA alpha (scale = alpha / dim)")
    parser.add_argument("--network_dropout", type=float, default=None, help="dropout on the LoRA down output")
    parser.add_argument("--network_args", type=str, default=None, nargs="*",
                        help="network options as key=value, e.g. conv_dim=4 conv_alpha=1")
    parser.add_argument("--network_weights", type=str, default=None, help="LoRA file to continue training from")
    parser.add_argument("--dim_from_weights", action="store_true", help="take the dims from --network_weights")
    parser.add_argument("--network_train_unet_only", action="store_true", help="train only the UNet LoRA")
    parser.add_argument("--network_train_text_encoder_only", action="store_true",
                        help="train only the text encoder LoRA")
    parser.add_argument("--unet_lr", type=float, default=None, help="UNet LoRA learning rate")
    parser.add_argument("--text_encoder_lr", type=float, default=None, nargs="*",
                        help="text encoder LoRA learning rate: one value for all text encoders, or one per text "
                             "encoder where the network module supports it (upstream: networks with "
                             "prepare_optimizer_params_with_multiple_te_lrs); default --learning_rate")
    saving.add_save_model_as_argument(parser, lora=True)
    metadata_util.add_comment_arguments(parser, lora=True)  # --no_metadata --training_comment
    from library.network_options import add_network_option_arguments

    add_network_option_arguments(parser)  # --scale_weight_norms --base_weights --base_weights_multiplier


def base_parser() -> argparse.ArgumentParser:
    """The arguments of every trainer, LoRA and full (models, dataset, training, optimizer, --config_file)."""
    from library import console_log, option_dump, precision, trackers, validate_only
    from library.compile import options as compile_options

    parser = argparse.ArgumentParser(allow_abbrev=False)
    train_util.add_sd_models_arguments(parser)
    config_util.add_dataset_arguments(parser)
    train_util.add_training_arguments(parser)
    noise.add_noise_arguments(parser)
    losses.add_loss_arguments(parser)
    optimizers.add_optimizer_arguments(parser)
    schedulers.add_scheduler_arguments(parser)
    train_util.add_config_arguments(parser)
    parity.add_refused_arguments(parser)
    sharding.add_deepspeed_arguments(parser)  # upstream's DeepSpeed options
    data_parallel.add_ddp_arguments(parser)
    saving.add_saving_arguments(parser)
    metadata_util.add_metadata_arguments(parser)
    huggingface_util.add_huggingface_arguments(parser)
    console_log.add_console_log_arguments(parser)
    trackers.add_tracker_arguments(parser)
    precision.add_fp8_base_argument(parser)
    precision.add_fp16_master_argument(parser)
    ema.add_ema_arguments(parser)
    compile_options.add_torch_compile_arguments(parser)
    validate_only.add_validate_only_argument(parser)
    option_dump.add_dump_options_argument(parser)
    return parser


def setup_parser() -> argparse.ArgumentParser:
    """The arguments every LoRA trainer shares; scripts add family flags (e.g. compile) on top."""
    from library import offload_checkpointing, precision

    parser = base_parser()
    add_network_arguments(parser)
    validation.add_validation_arguments(parser)
    saving.add_initial_step_arguments(parser)
    masks.add_masked_loss_arguments(parser)
    precision.add_fp8_base_unet_argument(parser)
    offload_checkpointing.add_cpu_offload_checkpointing_argument(parser)
    compile_graphs.add_arguments(parser)
    return parser


def text_encoder_lr(args) -> float | None:
    """`--text_encoder_lr` for a network with one text-encoder learning rate: the first value (upstream reads
    the list this way, for config files that wrote one number too); None = --learning_rate."""
    value = getattr(args, "text_encoder_lr", None)  # the full trainers have none
    if value is None or isinstance(value, (int, float)):
        return value
    return value[0] if value else None


def import_network_module(name: str):
    """The --network_module; `lycoris.kohya` goes through networks.lycoris_kohya (sd-scripts' module set and
    names on our diffusers models; a clear error when the lycoris-lora package is missing)."""
    from networks import lycoris_kohya

    if name == lycoris_kohya.MODULE_NAME:
        lycoris_kohya.import_lycoris()
        return lycoris_kohya
    return importlib.import_module(name)


def save_network_state_dict(network, path: str, dtype, metadata: dict | None, overwrite: bool) -> None:
    """A network's state_dict (``_orig_mod.`` removed, cast to `dtype`) as .safetensors (metadata + hashes) or
    torch file, atomically."""
    from library.compile.regional import strip_orig_mod

    sd = {k: v.detach().to("cpu", dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
          for k, v in strip_orig_mod(network.state_dict()).items()}
    if os.path.splitext(path)[1] == ".safetensors":
        md = dict(metadata or {})
        if md:
            md["sshs_model_hash"], md["sshs_legacy_hash"] = train_util.model_hashes(sd, md)
        train_util.save_safetensors_atomic({k: v.contiguous() for k, v in sd.items()}, path, md or None,
                                           overwrite=overwrite)
    else:
        train_util.save_torch_atomic(sd, path, overwrite=overwrite)


@dataclass
class Trainable:
    """What a trainer trains: `models` are registered for --save_state, accumulate gradients and have them
    averaged over the processes; `param_groups` go to the optimizer."""

    models: list
    param_groups: list
    train_text_encoder: bool
    lr_descriptions: list | None = None  # names of the param groups in the lr logs (lr/unet, lr/unet plus, ...)


# ----------------------------------------------------------------------------------------------------------


def diff_output_preservation_indices(batch: dict) -> list[int]:
    """Samples whose subset has custom_attributes.diff_output_preservation = true (upstream's DOP)."""
    return [i for i, a in enumerate(batch.get("custom_attributes") or []) if a.get("diff_output_preservation")]


def base_model_prediction(networks: list, forward, generator, device) -> torch.Tensor:
    """forward()'s prediction with the networks' multiplier at 0 (the base model), without gradients, drawing the
    same noise and timesteps as the forward() that follows (the RNG states are put back afterwards).
    Deliberately the whole batch (upstream predicts only the preserved samples): one code path for every family."""
    state = generator.get_state() if generator is not None else None
    saved = [m.multiplier for m in networks]
    devices = [device] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for m in networks:
                m.set_multiplier(0.0)
            prior = forward()[0].detach().clone()  # clone: a CUDA-graph output is overwritten by the next run
    finally:
        for m, value in zip(networks, saved):
            m.set_multiplier(value)
        if state is not None:
            generator.set_state(state)
    return prior


def run(trainer, parser: argparse.ArgumentParser, argv: list[str] | None = None) -> str | None:
    """Parse (with --config_file) and train; clear errors exit with status 2 instead of a traceback. `trainer` is
    a Trainer or a function of the parsed args that returns one (a script whose family follows an option:
    --model_type on the FLUX.1 scripts)."""
    train_util.setup_logging()
    try:
        args = train_util.parse_args(parser, argv)
        if not hasattr(trainer, "train"):
            trainer = trainer(args)
        return trainer.train(args)
    except UserError as e:
        _close_progress_bars()  # so the message starts its own line
        logger.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from e


def _close_progress_bars() -> None:
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def expected_errors() -> tuple:
    """The errors that mean bad settings or inputs (exit 2 with their message, no traceback): library.errors'
    one base class."""
    return (UserError,)

"""When and how results are saved, kept and resumed, with kohya-ss/sd-scripts' options and rules.

    add_save_arguments(parser)           --save_precision --save_every_n_* --save_last_n_* --save_state
                                         --save_state_on_train_end --resume (every script)
    save_dtype_for(args)                 --save_precision as a dtype
    add_saving_arguments(parser)         --save_n_epoch_ratio --save_last_n_epochs_state --save_last_n_steps_state
    add_initial_step_arguments(parser)   --initial_epoch --initial_step --skip_until_initial_step (LoRA trainers)
    add_sd_saving_arguments(parser)      --save_model_as (None = the input model's format) --use_safetensors
                                         (full trainers)
    add_mem_eff_save_argument(parser)    --mem_eff_save (flux_train.py)
    apply_save_n_epoch_ratio(args, num_epochs)
    remove_epoch_no / remove_step_no     which earlier save a keep-last-N option removes now
    state_keep_last(args, by_step)       --save_last_n_*_state, else --save_last_n_*
    full_model_format(save_model_as, use_safetensors, input_path) -> ("single", ".safetensors"|".ckpt")
                                         | ("diffusers", "")
    start_position(args, steps_per_epoch, ...) -> StartPosition   where --resume / --initial_* start the loop
    save_safetensors_streaming(path, entries, metadata)   one tensor in memory at a time (--mem_eff_save)
    explained_save_errors(path)          a disk that refuses a save (full, read-only) -> SaveError, one line

Names of the files (`name-000001`, `name-step00000010`, `-state`) live in train_util.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from library import files, safetensors_io
from library.errors import SaveError  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

# --save_model_as of the full trainers (None = as the input model)
SD_SAVE_FORMATS = (None, "ckpt", "safetensors", "diffusers", "diffusers_safetensors")


def add_save_arguments(parser: argparse.ArgumentParser) -> None:
    """Every script's save flags (train_util.add_training_arguments adds them in upstream's place)."""
    parser.add_argument("--save_precision", type=str, default=None, choices=[None, "float", "fp16", "bf16"],
                        help="dtype of the saved weights (default: as trained)")
    parser.add_argument("--save_every_n_epochs", type=int, default=None, help="save every N epochs")
    parser.add_argument("--save_every_n_steps", type=int, default=None, help="save every N steps")
    parser.add_argument("--save_last_n_epochs", type=int, default=None, help="keep only the last N epoch saves")
    parser.add_argument("--save_last_n_steps", type=int, default=None,
                        help="keep only the step saves of the last N steps")
    parser.add_argument("--save_state", action="store_true",
                        help="also save the training state (optimizer, scheduler, RNG, step) at every save")
    parser.add_argument("--save_state_on_train_end", action="store_true", help="save the state at the end only")
    parser.add_argument("--resume", type=str, default=None, help="state folder to resume from")


def save_dtype_for(args) -> torch.dtype | None:
    """--save_precision as a dtype (None: as trained)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16, "float": torch.float32}.get(args.save_precision)


def add_saving_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--save_n_epoch_ratio", type=int, default=None,
                        help="save every floor(epochs / N) epochs, so that about N epoch saves are made "
                             "(sets --save_every_n_epochs)")
    parser.add_argument("--save_last_n_epochs_state", type=int, default=None,
                        help="keep only the state folders of the last N epoch saves (default: --save_last_n_epochs)")
    parser.add_argument("--save_last_n_steps_state", type=int, default=None,
                        help="keep only the state folders of the last N steps (default: --save_last_n_steps)")


def add_initial_step_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--initial_epoch", type=int, default=None,
                        help="start at this epoch (1 = the first, as without it); the LR scheduler still starts "
                             "at 0 unless --resume")
    parser.add_argument("--initial_step", type=int, default=None,
                        help="start at this step counted over all epochs (0 = the first); overrides --initial_epoch")
    parser.add_argument("--skip_until_initial_step", action="store_true",
                        help="with --initial_step/--initial_epoch: also skip the batches of the steps before it "
                             "(otherwise the start epoch is trained from its first batch)")


def add_save_model_as_argument(parser: argparse.ArgumentParser, *, lora: bool) -> None:
    """--save_model_as: a LoRA file's format (LoRA scripts), or the full model's format (full scripts)."""
    if lora:
        parser.add_argument("--save_model_as", type=str, default="safetensors",
                            choices=[None, "ckpt", "pt", "safetensors"], help="file format of the LoRA")
    else:
        parser.add_argument("--save_model_as", type=str, default=None, choices=list(SD_SAVE_FORMATS),
                            help="ckpt / safetensors (single file), diffusers / diffusers_safetensors (folder); "
                                 "default: as the input model")


def add_embedding_save_model_as_argument(parser: argparse.ArgumentParser) -> None:
    """--save_model_as of the textual-inversion scripts (upstream's default: pt)."""
    parser.add_argument("--save_model_as", type=str, default="pt", choices=[None, "ckpt", "pt", "safetensors"],
                        help="file format of the embedding: pt (default, also read by the A1111 web UI), ckpt or "
                             "safetensors")


def add_sd_saving_arguments(parser: argparse.ArgumentParser) -> None:
    add_save_model_as_argument(parser, lora=False)
    parser.add_argument("--use_safetensors", action="store_true",
                        help="without --save_model_as: save a single file as .safetensors")


def add_mem_eff_save_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mem_eff_save", action="store_true",
                        help="write the model one tensor at a time, without a second full copy in memory")


# ----------------------------------------------------------------------------------------------------------
# cadence and keep-last-N (upstream's formulas)


def validate_saving_args(args) -> None:
    """Before anything loads: counts must be positive, the start step not negative, a local --resume folder
    must exist."""
    from library.errors import ConfigError

    for name in ("save_every_n_epochs", "save_every_n_steps", "save_last_n_epochs", "save_last_n_steps",
                 "save_last_n_epochs_state", "save_last_n_steps_state", "initial_epoch"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{name} must be 1 or more, got {value}")
    if getattr(args, "initial_step", None) is not None and args.initial_step < 0:
        raise ConfigError(f"--initial_step must be 0 or more, got {args.initial_step}")
    resume = getattr(args, "resume", None)
    if resume and not getattr(args, "resume_from_huggingface", False) and not os.path.isdir(resume):
        raise ConfigError(f"--resume: state folder not found: {resume}")


def apply_save_n_epoch_ratio(args, num_epochs: int) -> None:
    """--save_n_epoch_ratio N > 0 sets --save_every_n_epochs to floor(epochs / N), at least 1."""
    ratio = getattr(args, "save_n_epoch_ratio", None)
    if ratio is not None and ratio > 0:
        args.save_every_n_epochs = math.floor(num_epochs / ratio) or 1
        logger.info("--save_n_epoch_ratio %d: saving every %d epochs", ratio, args.save_every_n_epochs)


def remove_epoch_no(epoch: int, every: int, last_n: int | None) -> int | None:
    """The epoch save that keeping the last `last_n` epoch saves removes after saving `epoch`."""
    if last_n is None:
        return None
    old = epoch - every * last_n
    return old if old >= 0 else None


def remove_step_no(step: int, every: int, last_n: int | None) -> int | None:
    """The step save that keeping the saves of the last `last_n` steps removes after saving `step`: the newest
    multiple of `every` that is more than `last_n` steps old (e.g. every 10, last 30: step 50 removes 10)."""
    if last_n is None:
        return None
    old = step - last_n - 1
    old -= old % every
    return old if old >= 0 else None


def state_keep_last(args, by_step: bool) -> int | None:
    if by_step:
        return getattr(args, "save_last_n_steps_state", None) or args.save_last_n_steps
    return getattr(args, "save_last_n_epochs_state", None) or args.save_last_n_epochs


# ----------------------------------------------------------------------------------------------------------
# full-model file format


def full_model_format(save_model_as: str | None, use_safetensors: bool, input_path) -> tuple[str, str]:
    """-> ("single", ".safetensors" | ".ckpt") or ("diffusers", "").

    Unset: a single file for a single-file input, else a diffusers folder. The single file keeps the input's
    serialization (.safetensors stays .safetensors; upstream's code writes .ckpt there unless --use_safetensors,
    although its help says "same as the original"); --use_safetensors asks for .safetensors."""
    if save_model_as is None:
        path = str(input_path or "")
        if os.path.isfile(path):
            safe = use_safetensors or path.lower().endswith(".safetensors")
            return "single", ".safetensors" if safe else ".ckpt"
        return "diffusers", ""
    if save_model_as in ("diffusers", "diffusers_safetensors"):
        return "diffusers", ""
    return "single", ".safetensors" if use_safetensors or save_model_as == "safetensors" else ".ckpt"


# ----------------------------------------------------------------------------------------------------------
# where the loop starts


@dataclass
class StartPosition:
    global_step: int      # steps counted as done
    epoch: int            # 0-based epoch the loop starts in
    skip_batches: int     # batches of that epoch not trained again


def initial_step(args, steps_per_epoch: int) -> int | None:
    """--initial_step, else the first step of --initial_epoch (1-based); None when neither is given."""
    if getattr(args, "initial_step", None) is not None:
        return args.initial_step
    if getattr(args, "initial_epoch", None) is not None:
        return (args.initial_epoch - 1) * steps_per_epoch
    return None


def start_position(args, steps_per_epoch: int, resumed_step: int, max_train_steps: int) -> StartPosition:
    """The resumed state continues exactly where it stopped. --initial_step/--initial_epoch override it (as
    upstream, the state's step count is then ignored): the loop starts in the epoch of that step; with
    --skip_until_initial_step the batches of the earlier steps of that epoch are skipped and counting goes on
    from the step, otherwise that epoch is trained from its first batch and counted from its first step."""
    from library.errors import ConfigError

    ga = args.gradient_accumulation_steps
    start = initial_step(args, steps_per_epoch)
    if start is None:
        return StartPosition(resumed_step, resumed_step // steps_per_epoch,
                             (resumed_step % steps_per_epoch) * ga)
    if start < 0:
        raise ConfigError(f"--initial_step/--initial_epoch must not point before the first step, got step {start}")
    if resumed_step:
        logger.warning("the step count of the resumed state (%d) is ignored: --initial_step/--initial_epoch "
                       "gives step %d", resumed_step, start)
    if start > 0 and start >= max_train_steps:
        raise ConfigError(f"--initial_step/--initial_epoch start at step {start}, which is not before the last "
                          f"step ({max_train_steps}); raise --max_train_steps / --max_train_epochs")
    epoch = start // steps_per_epoch
    if not getattr(args, "skip_until_initial_step", False):
        return StartPosition(epoch * steps_per_epoch, epoch, 0)
    if not args.resume:
        logger.info("--initial_step without --resume: the LR scheduler starts from its beginning")
    logger.info("skipping %d steps", start)
    return StartPosition(start, epoch, (start % steps_per_epoch) * ga)


# ----------------------------------------------------------------------------------------------------------
# streaming safetensors writer (--mem_eff_save)


@dataclass
class TensorEntry:
    """A tensor to write: its shape and dtype, and a function that makes it (on the CPU) only when written."""

    name: str
    shape: tuple
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


def save_safetensors_streaming(path: str | os.PathLike, entries: Iterable[TensorEntry],
                               metadata: dict[str, str] | None = None, *, overwrite: bool = False) -> None:
    """A .safetensors file written one tensor at a time: the header comes from the shapes and dtypes, then each
    tensor is made, written and dropped, so memory holds one tensor beyond the model (not a second copy of
    it). Written to a temporary name beside `path` and renamed when complete, like every other save."""
    path = os.fspath(path)
    files.ensure_can_write(path, overwrite)
    entries = list(entries)
    raw = safetensors_io.header_bytes([(e.name, e.dtype, e.shape) for e in entries], metadata)
    with files.atomic_target(path, overwrite=overwrite) as tmp, open(tmp, "wb") as f:
        f.write(raw)
        for e in entries:
            t = e.make().detach().to("cpu", e.dtype).contiguous()
            if tuple(t.shape) != tuple(e.shape):
                raise ValueError(f"{e.name}: made shape {tuple(t.shape)}, announced {tuple(e.shape)}")
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)  # no copy of the bytes
            del t
        f.flush()
        os.fsync(f.fileno())


def explained_save_errors(path: str):
    """A save the disk refuses (full, read-only, no permission) -> SaveError naming the path (library.files). The
    atomic writers have removed their temporary files by then, and the earlier saves are untouched (every save has
    its own name)."""
    return files.explained_write_errors(path)

"""Pieces every trainer shares: argparse groups, `--config_file` TOML reading, output naming, atomic saving,
`ss_*` metadata and hashes, the plain progress line, the run's TOML (optimizers: library.optimizers, LR
schedulers: library.schedulers).

Full-model trainers (sdxl_train.py, train_db.py, fine_tune.py) reuse these as they are; the LoRA loop lives
in `network_trainer.py`.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import io
import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from library import files, parity
from library.errors import ConfigError, OptionalPackageError, OutputExistsError  # noqa: F401  (re-exported)
from library.files import atomic_target, ensure_can_write  # noqa: F401  (re-exported)
from library.metadata import model_hashes  # noqa: F401  (re-exported)
from library.files import write_bytes as atomic_write_bytes, write_text as atomic_write_text  # noqa: F401

logger = logging.getLogger(__name__)

# Tables of a config TOML that belong to the GUI / launcher, never to the trainer.
GUI_ONLY_TABLES = ("accelerate", "gui")
# Args never written into a run's TOML (they describe how the TOML itself is handled).
_NOT_IN_RUN_CONFIG = ("config_file", "output_config")


def setup_logging(level: int = logging.INFO) -> None:
    """The default console log (stdout); `--console_log_*` change it (library.console_log)."""
    from library import console_log

    console_log.setup_logging(level)


# ----------------------------------------------------------------------------------------------------------
# argparse groups (kohya-ss/sd-scripts flag names and defaults)




def add_sd_models_arguments(parser: argparse.ArgumentParser) -> None:
    """The SD1.x/2.x/SDXL model flags (library.model_util)."""
    from library import model_util

    model_util.add_sd_model_arguments(parser)


def add_optimizer_arguments(parser: argparse.ArgumentParser) -> None:
    """The optimizer and LR-scheduler flags (library.optimizers, library.schedulers)."""
    from library import optimizers, schedulers

    optimizers.add_optimizer_arguments(parser)
    schedulers.add_scheduler_arguments(parser)


# moved to their concern modules; these names still work from here
_MOVED = {"LEARNING_RATE_OPTIONS": "optimizers", "SAMPLER_CHOICES": "sampling", "save_dtype_for": "saving",
          "get_optimizer": "optimizers", "parse_optimizer_args": "optimizers", "optimizer_name": "optimizers",
          "OPTIMIZER_NAMES": "optimizers", "_can_fuse": "optimizers", "get_scheduler": "schedulers",
          "SCHEDULER_NAMES": "schedulers", "int_or_float": "schedulers"}


def __getattr__(name: str):
    if name in _MOVED:
        return getattr(importlib.import_module(f"library.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Output, steps and text-encoder flags, then each concern's own group from the module that owns it (saving,
    precision, trackers, sampling), in upstream's order (the dataset flags, including --train_batch_size and the
    data loader workers, come from config_util.add_dataset_arguments; noise and timesteps from library.noise,
    the loss from library.losses)."""
    from library import precision, sampling, saving, trackers

    parser.add_argument("--output_dir", type=str, default=None, help="folder for the results")
    parser.add_argument("--output_name", type=str, default=None, help="base name of the result files")
    parser.add_argument("--overwrite_output", action="store_true",
                        help="allow replacing existing result files of the same name (off: such a run stops)")
    saving.add_save_arguments(parser)  # --save_precision ... --resume
    parser.add_argument("--max_token_length", type=int, default=None, choices=[None, 150, 225],
                        help="max token length of the text encoder (default 75)")
    parser.add_argument("--mem_eff_attn", action="store_true", help="accepted for compatibility (SDPA is used)")
    parser.add_argument("--xformers", action="store_true", help="use xformers attention if installed (else SDPA)")
    parser.add_argument("--sdpa", action="store_true", help="use PyTorch scaled-dot-product attention (default)")
    parser.add_argument("--max_train_steps", type=int, default=1600, help="training steps")
    parser.add_argument("--max_train_epochs", type=int, default=None, help="training epochs (overrides steps)")
    parser.add_argument("--seed", type=int, default=None, help="random seed")
    parser.add_argument("--gradient_checkpointing", action="store_true", help="trade compute for memory")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1, help="steps to accumulate")
    precision.add_mixed_precision_arguments(parser)  # --mixed_precision --full_fp16 --full_bf16
    parser.add_argument("--clip_skip", type=int, default=None, help="use the output of the N-th last CLIP layer")
    trackers.add_logging_arguments(parser)  # --logging_dir --log_with --log_prefix --log_tracker_name
    precision.add_vae_and_memory_arguments(parser)  # --no_half_vae --lowram --highvram
    sampling.add_sample_arguments(parser)  # --sample_every_n_steps ... --sample_at_first


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config_file", type=str, default=None,
                        help="TOML with the options (flat or in sections); flags on the command line win")
    parser.add_argument("--output_config", action="store_true",
                        help="write the options to --config_file and exit")




# ----------------------------------------------------------------------------------------------------------
# --config_file


def _option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest != "help" and a.option_strings}


def _flatten_config(data: dict, path: str) -> dict[str, Any]:
    """Top-level keys and keys of (nested) tables, minus the GUI-only tables. A key twice is an error."""
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}

    def walk(table: dict, section: str) -> None:
        for key, value in table.items():
            if isinstance(value, dict):
                if not section and key in GUI_ONLY_TABLES:
                    continue
                walk(value, f"{section}.{key}" if section else key)
                continue
            if key in flat and flat[key] != value:
                raise ConfigError(f"{path}: key {key!r} is set twice with different values "
                                  f"(in [{where[key] or 'top level'}] and [{section or 'top level'}])")
            flat[key] = value
            where[key] = section

    walk(data, "")
    return flat


def _coerce_config_value(key: str, value: Any, action: argparse.Action, path: str) -> Any:
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{path}: {key} = {value!r} must be {expected}")

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            return bool(value)  # the kohya_ss GUI writes e.g. persistent_data_loader_workers = int(checkbox)
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        return [_coerce_scalar(key, v, action, path) for v in items]
    if isinstance(value, list):
        raise bad("a single value, not a list")
    return _coerce_scalar(key, value, action, path)


def _coerce_scalar(key: str, value: Any, action: argparse.Action, path: str) -> Any:
    typ = action.type
    if isinstance(value, bool) and typ is not None and typ is not bool:
        raise ConfigError(f"{path}: {key} = {value!r} must be a {getattr(typ, '__name__', 'value')}, not true/false")
    if typ is int and not isinstance(value, int):
        raise ConfigError(f"{path}: {key} = {value!r} must be an integer")
    if typ is float:
        if not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: {key} = {value!r} must be a number")
        value = float(value)
    elif typ is str and not isinstance(value, str):
        value = str(value)  # numbers written for a text option (e.g. a resolution of 1024)
    elif typ is not None and typ not in (int, str) and isinstance(value, str):
        try:
            value = typ(value)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{path}: {key} = {value!r} is not valid: {e}") from e
    if action.choices is not None and value not in action.choices:
        allowed = ", ".join(str(c) for c in action.choices if c is not None)
        raise ConfigError(f"{path}: {key} = {value!r} is not allowed; allowed values: {allowed}")
    return value


def load_config_file(path: str | os.PathLike, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Reads a config TOML against `parser`: flattened, GUI tables skipped, each key checked and typed."""
    path = str(path)
    if not os.path.isfile(path):
        # kohya accepts the name without .toml
        if os.path.isfile(path + ".toml"):
            path = path + ".toml"
        else:
            raise ConfigError(f"config file not found: {path}")
    from library.input_files import MAX_PROBLEMS, InputFileError, capped, load_toml

    try:
        data = load_toml(path)  # any file: one line (binary, too large, nested too deep, ...)
    except InputFileError as e:
        raise ConfigError(str(e)) from None
    actions = _option_actions(parser)
    values, problems, skipped = {}, [], []
    # every bad key is reported, in one message
    for key, value in _flatten_config(data, path).items():
        if key in _NOT_IN_RUN_CONFIG:
            problems.append(f"{key!r} cannot be set inside a config file")
            continue
        action = actions.get(key)
        if action is None and key in parity.KOHYA_SS_GUI_KEYS:
            skipped.append(key)
            continue
        aliases = parity.CONFIG_VALUE_ALIASES.get(key, {})
        if action is not None and isinstance(value, (int, float, str)) and value in aliases \
                and isinstance(value, bool) == any(isinstance(k, bool) for k in aliases):
            values[key] = aliases[value]
            continue
        if action is None:
            close = difflib.get_close_matches(key, list(actions), n=1) if len(problems) < MAX_PROBLEMS else None
            problems.append(f"unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            continue
        try:
            values[key] = _coerce_config_value(key, value, action, path)
        except ConfigError as e:
            problems.append(str(e).removeprefix(f"{path}: "))
    if skipped:
        logger.info("%s: skipped keys of the kohya_ss GUI that are no trainer options (upstream ignores them too): "
                    "%s", path, ", ".join(skipped))
    if len(problems) == 1:
        raise ConfigError(f"{path}: {problems[0]}")
    if problems:
        raise ConfigError(f"{path}: {len(problems)} bad keys: " + "; ".join(capped(problems)))
    return values


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parses the command line; with `--config_file` the file's values are the defaults and the command
    line wins. With `--output_config` the options are written to the `--config_file` path instead."""
    from library import option_dump

    option_dump.dump_if_asked(parser, argv)
    args = parser.parse_args(argv)
    if args.config_file and not args.output_config:
        values = load_config_file(args.config_file, parser)
        args = parser.parse_args(argv, namespace=argparse.Namespace(**values))
    refused = parity.refusal_message(args)
    if refused:
        raise ConfigError(refused)
    from library.finite_guard import non_finite_options

    if bad := non_finite_options(args):  # one line per option
        raise ConfigError("; ".join(bad))
    return normalise_args(args, getattr(parser, "normalisers", ()))


def add_normaliser(parser: argparse.ArgumentParser, normalise) -> None:
    """A script's own normalisation (deprecated spellings of its own options), run by normalise_args after the
    shared ones: the script registers it on its parser, so this module imports no script or family module."""
    parser.normalisers = [*getattr(parser, "normalisers", ()), normalise]


def normalise_args(args: argparse.Namespace, normalisers=()) -> argparse.Namespace:
    """The one step that changes options after parsing, before anything checks or reads them (the checks never
    change args): deprecated spellings and aliases become the options they stand for."""
    from library import captions
    from library.compile import options as compile_options

    captions.resolve_caption_extension_alias(args)
    compile_options.apply_torch_compile_alias(args)
    for normalise in normalisers:
        normalise(args)
    return args


def args_to_config(args: argparse.Namespace) -> dict[str, Any]:
    """The options as TOML-ready values: None left out, paths as text, secrets (tokens, API keys) left out."""
    from library.trackers import SENSITIVE_ARGS

    out = {}
    for key, value in sorted(vars(args).items()):
        if key in _NOT_IN_RUN_CONFIG or key in SENSITIVE_ARGS or value is None or key.startswith("_"):
            continue
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


def dumps_config(args: argparse.Namespace) -> str:
    import tomlkit

    doc = tomlkit.document()
    for key, value in args_to_config(args).items():
        doc[key] = value
    return tomlkit.dumps(doc)


def write_output_config(args: argparse.Namespace) -> str:
    """`--output_config`: writes the options to the `--config_file` path (never over an existing file)."""
    if not args.config_file:
        raise ConfigError("--output_config needs --config_file: the path to write the options to")
    path = args.config_file if args.config_file.endswith(".toml") else args.config_file + ".toml"
    if os.path.exists(path):
        raise OutputExistsError(f"--output_config: {path} already exists; choose another --config_file")
    atomic_write_text(path, dumps_config(args))
    logger.info("wrote the options to %s", path)
    return path


# ----------------------------------------------------------------------------------------------------------
# checks done before any model loads


def check_output_dir(output_dir: str) -> None:
    """The results can be written there: a folder (or a path that can become one) we may write to, tried with a
    temporary file (permissions alone miss /proc, a read-only disk, root on a read-only mount). Nothing is created."""
    import tempfile

    path = os.path.abspath(output_dir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--output_dir {output_dir} is a file, not a folder")
    existing = path
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"--output_dir {output_dir} cannot be created: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        raise ConfigError(f"--output_dir {output_dir} {what}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"--output_dir {output_dir}: cannot write files in {existing} ({e.strerror or e})") \
            from None


def verify_training_args(args: argparse.Namespace) -> None:
    """Option combinations that cannot work, with the flag names in the message."""
    if not args.output_dir:
        raise ConfigError("--output_dir is required: the folder for the results")
    check_output_dir(args.output_dir)
    name = getattr(args, "output_name", None)
    if name and (os.sep in name or "/" in name or (os.altsep and os.altsep in name) or name in (".", "..")):
        raise ConfigError(f"--output_name {name!r} must be a file name without a folder; put the folder in "
                          "--output_dir")
    for name in ("gradient_accumulation_steps", "max_train_steps", "max_train_epochs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be 1 or more, got {getattr(args, name)}")
    from library import huggingface_util, optimizers, sampling, saving, schedulers

    saving.validate_saving_args(args)
    huggingface_util.validate_huggingface_args(args)
    sampling.check_sample_args(args)
    optimizers.check_optimizer_args(args)  # a missing optimizer package is reported now, not after models load
    schedulers.check_scheduler_args(args)


# ----------------------------------------------------------------------------------------------------------
# steps / epochs


def resolve_train_length(args: argparse.Namespace, num_batches_per_epoch: int) -> tuple[int, int, int]:
    """-> (update steps per epoch, max_train_steps, num_epochs); `--max_train_epochs` overrides steps."""
    steps_per_epoch = max(1, math.ceil(num_batches_per_epoch / args.gradient_accumulation_steps))
    max_steps = args.max_train_steps
    if args.max_train_epochs:
        max_steps = args.max_train_epochs * steps_per_epoch
    num_epochs = math.ceil(max_steps / steps_per_epoch)
    return steps_per_epoch, max_steps, num_epochs


def weight_dtype_for(args: argparse.Namespace) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.mixed_precision, torch.float32)




# ----------------------------------------------------------------------------------------------------------
# output names and atomic writing


def default_output_name(args: argparse.Namespace, fallback: str) -> str:
    return args.output_name or fallback


def epoch_file_name(output_name: str, epoch: int, ext: str) -> str:
    return f"{output_name}-{epoch:06d}{ext}"


def step_file_name(output_name: str, step: int, ext: str) -> str:
    return f"{output_name}-step{step:08d}{ext}"


def last_file_name(output_name: str, ext: str) -> str:
    return f"{output_name}{ext}"


def state_dir_name(output_name: str, epoch: int | None = None, step: int | None = None) -> str:
    if step is not None:
        return f"{output_name}-step{step:08d}-state"
    if epoch is not None:
        return f"{output_name}-{epoch:06d}-state"
    return f"{output_name}-state"


def check_outputs_free(output_dir: str, output_name: str, ext: str, overwrite: bool, resuming: bool) -> None:
    """Before any model loads: the output folder can be written, and the results this run will write must not exist
    yet (the final file, and without --resume also epoch/step saves and state folders of an earlier run with the
    same name)."""
    check_output_dir(output_dir)
    if overwrite or not os.path.isdir(output_dir):
        return
    final = os.path.join(output_dir, last_file_name(output_name, ext))
    ensure_can_write(final, overwrite)
    if resuming:
        return
    pattern = re.compile(re.escape(output_name) + r"-(step)?\d+(" + re.escape(ext) + r"|-state)$")
    found = sorted(n for n in os.listdir(output_dir) if pattern.fullmatch(n))
    if found:
        raise OutputExistsError(f"{output_dir} already holds results of an earlier run named {output_name!r} "
                                f"({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}); choose another "
                                "--output_name / --output_dir, --resume it, or pass --overwrite_output to replace them")


def save_safetensors_atomic(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                            metadata: dict[str, str] | None = None, *, overwrite: bool = False) -> None:
    """library.files.save_safetensors (the one atomic writer)."""
    files.save_safetensors(tensors, path, metadata, overwrite=overwrite)


def save_torch_atomic(obj: Any, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    files.save_torch(obj, path, overwrite=overwrite)


# ----------------------------------------------------------------------------------------------------------
# metadata and hashes (the hashes A1111's additional-networks and kohya write as sshs_*)


def metadata_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value)
    return str(value)


def file_model_name(path: str | None) -> str:
    if not path:
        return ""
    p = Path(path)
    return p.name if p.exists() else path


# ----------------------------------------------------------------------------------------------------------
# progress


class ProgressLine:
    """The plain progress line the GUI parses (also shown by the tqdm bar):

        steps: 12/100 loss=0.1234 it/s=2.35 avr_loss=0.1300 lr=1.00e-04 epoch=1/5 eta=0:00:37

    With a validation loss (library.validation) the line also carries the last one, `val_loss=0.1400`, after
    avr_loss. Printed to stdout on the first step, the last step, and at most once per `interval` seconds between.
    """

    def __init__(self, max_steps: int, num_epochs: int, interval: float = 1.0, start_step: int = 0):
        self.max_steps = max_steps
        self.num_epochs = num_epochs
        self.interval = interval
        self.start_step = start_step
        self.start_time = time.perf_counter()
        self.last_print = 0.0

    def its(self, step: int) -> float:
        elapsed = time.perf_counter() - self.start_time
        done = step - self.start_step
        return done / elapsed if elapsed > 0 and done > 0 else 0.0

    def format(self, step: int, loss: float, avr_loss: float, lr: float, epoch: int,
               val_loss: float | None = None) -> str:
        its = self.its(step)
        remaining = self.max_steps - step
        eta = time.strftime("%H:%M:%S", time.gmtime(remaining / its)) if its > 0 else "?"
        val = f" val_loss={val_loss:.4f}" if val_loss is not None else ""
        return (f"steps: {step}/{self.max_steps} loss={loss:.4f} it/s={its:.2f} avr_loss={avr_loss:.4f}{val} "
                f"lr={lr:.2e} epoch={epoch}/{self.num_epochs} eta={eta}")

    def should_print(self, step: int) -> bool:
        now = time.perf_counter()
        if step <= self.start_step + 1 or step >= self.max_steps or now - self.last_print >= self.interval:
            self.last_print = now
            return True
        return False


# ----------------------------------------------------------------------------------------------------------
# misc


def prepare_seed(args: argparse.Namespace, accelerator=None) -> int:
    """Seeds python, numpy and torch with `--seed`; without it, as upstream, with a random seed, which is then
    set in args (the metadata's ss_seed and the run's TOML carry it, so the run can be repeated). Every process
    of a multi-GPU run gets the main process's seed (they must agree on the data order)."""
    import random

    from accelerate.utils import broadcast_object_list, set_seed

    if args.seed is None:
        drawn = [random.SystemRandom().randint(0, 2**32 - 1)]
        if accelerator is not None and accelerator.num_processes > 1:
            broadcast_object_list(drawn)
        args.seed = drawn[0]
        logger.info("seed: %d (random: no --seed given)", args.seed)
    else:
        logger.info("seed: %d", args.seed)
    set_seed(args.seed)
    return args.seed


def noise_scheduler_for(prediction_type: str):
    """The training noise schedule of SD1.x/SD2.x/SDXL (scaled linear betas, 1000 steps)."""
    from diffusers import DDPMScheduler

    return DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                         num_train_timesteps=1000, clip_sample=False, prediction_type=prediction_type)

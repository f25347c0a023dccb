"""Experiment trackers (TensorBoard / wandb through accelerate) with kohya-ss/sd-scripts' options:

- `--wandb_run_name NAME`: the wandb run's name (init kwargs `{"wandb": {"name": NAME}}`);
- `--log_tracker_config FILE.toml`: the init kwargs of every tracker, per tracker name, e.g.
  `[wandb]` / `name = "run 1"` / `tags = ["sdxl"]`; as upstream, the file replaces what `--wandb_run_name` set;
- `--wandb_api_key KEY`: `wandb.login(key=KEY)` before the run when wandb logs (`--log_with wandb|all`);
- `--log_config`: the run's options go to the trackers as their config (hparams), without keys and absolute-path
  options that could identify the user (upstream's list). Off: no config is sent.
"""
from __future__ import annotations

import argparse
import logging
import os
import tomllib

from library.errors import ConfigError, OptionalPackageError

logger = logging.getLogger(__name__)

# upstream's lists: never sent to a tracker with --log_config
SENSITIVE_ARGS = ("wandb_api_key", "huggingface_token")
SENSITIVE_PATH_ARGS = ("pretrained_model_name_or_path", "vae", "tokenizer_cache_dir", "train_data_dir",
                       "conditioning_data_dir", "reg_data_dir", "output_dir", "logging_dir")


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """Every script's log folder and tracker choice (train_util.add_training_arguments adds them in upstream's
    place)."""
    parser.add_argument("--logging_dir", type=str, default=None, help="TensorBoard log folder")
    parser.add_argument("--log_with", type=str, default=None, choices=["tensorboard", "wandb", "all"],
                        help="tracker (default tensorboard when --logging_dir is set)")
    parser.add_argument("--log_prefix", type=str, default=None, help="prefix of the log folder's run name")
    parser.add_argument("--log_tracker_name", type=str, default=None, help="tracker project name")


def add_tracker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wandb_run_name", type=str, default=None, help="name of the wandb run")
    parser.add_argument("--log_tracker_config", type=str, default=None,
                        help="TOML with the init arguments of each tracker ([wandb], [tensorboard] tables)")
    parser.add_argument("--wandb_api_key", type=str, default=None,
                        help="wandb API key to log in with before training (better in the --config_file than on "
                             "the command line; empty: wandb uses WANDB_API_KEY from the environment or its own "
                             "stored login)")
    parser.add_argument("--log_config", action="store_true",
                        help="send the run's options to the trackers (keys and data paths left out)")


def log_with(args) -> str | None:
    """The trackers of a run: --log_with, or tensorboard when only --logging_dir is given."""
    return args.log_with or ("tensorboard" if args.logging_dir else None)


def uses_wandb(args) -> bool:
    return log_with(args) in ("wandb", "all")


def read_tracker_config(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"--log_tracker_config: file not found: {path}") from e
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--log_tracker_config {path}: not a readable TOML file ({e})") from e
    bad = [k for k, v in data.items() if not isinstance(v, dict)]
    if bad:
        raise ConfigError(f"--log_tracker_config {path}: {', '.join(bad)} must be tables named after the tracker, "
                          "e.g. [wandb]")
    return data


def check_tracker_args(args) -> None:
    """Before any model loads: the tracker TOML reads, and wandb is installed when it is asked for."""
    if getattr(args, "log_tracker_config", None):
        read_tracker_config(args.log_tracker_config)
    if uses_wandb(args):
        try:
            import wandb  # noqa: F401
        except ImportError as e:
            raise OptionalPackageError(f"--log_with {args.log_with} needs the Python package 'wandb', which is not "
                                       "installed (pip install wandb)") from e


def init_kwargs(args) -> dict:
    """accelerate's init_kwargs, as upstream builds them."""
    kwargs: dict = {}
    if getattr(args, "wandb_run_name", None):
        kwargs["wandb"] = {"name": args.wandb_run_name}
    if getattr(args, "log_tracker_config", None):
        kwargs = read_tracker_config(args.log_tracker_config)
    return kwargs


def sanitized_config(args) -> dict | None:
    """The options sent as the trackers' config with --log_config (None without it): sensitive keys and the
    path options dropped, every value a bool/int/float/str/None (lists and other objects as text)."""
    if not getattr(args, "log_config", False):
        return None
    skip = set(SENSITIVE_ARGS) | set(SENSITIVE_PATH_ARGS)
    out = {}
    for key, value in vars(args).items():
        if key in skip or key.startswith("_"):
            continue
        out[key] = value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
    return out


def prepare_wandb(args, logging_dir: str | None) -> None:
    """Before the accelerator starts: wandb writes under the log folder, and logs in with --wandb_api_key."""
    if not uses_wandb(args):
        return
    import wandb

    if logging_dir is not None:
        os.makedirs(logging_dir, exist_ok=True)
        os.environ["WANDB_DIR"] = logging_dir
    if getattr(args, "wandb_api_key", None):
        wandb.login(key=args.wandb_api_key)


def init_trackers(accelerator, args, default_name: str) -> None:
    """Main process only (as accelerate's own init_trackers)."""
    if not accelerator.is_main_process:
        return
    accelerator.init_trackers(args.log_tracker_name or default_name, config=sanitized_config(args),
                              init_kwargs=init_kwargs(args))

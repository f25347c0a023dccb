"""Learning-rate schedulers: kohya-ss/sd-scripts' `--lr_scheduler` names, `--lr_scheduler_type` (any importable
scheduler class) with `--lr_scheduler_args`, and how the scheduler is stepped.

`SCHEDULERS` (name -> factory) is the one list of names (help text, checks, later the GUI). The schedules are
transformers' (and diffusers' piecewise_constant), called with upstream's arguments:

    total steps T = max_train_steps * num_processes           (as upstream's get_scheduler_fix)
    warmup W, decay D = --lr_warmup_steps / --lr_decay_steps: an int is steps, a float below 1 (or "5%") a ratio of T
    stable S = T - W - D                                       (warmup_stable_decay)
    cosine_with_min_lr / warmup_stable_decay: num_cycles = --lr_scheduler_num_cycles / 2, --lr_scheduler_min_lr_ratio
    inverse_sqrt: --lr_scheduler_timescale (default: W, or 10000 without warmup: transformers' rule)
    --lr_scheduler_args key=value go to the schedule function too (piecewise_constant: step_rules="1:10,0.1")

Stepping (`step`) is accelerate's AcceleratedScheduler rule, which upstream gets from accelerator.prepare: only
when the gradients were synchronised (an optimizer step), not when the fp16 GradScaler skipped that step, and
then `num_processes` times (upstream's Accelerator never splits batches). A schedule-free optimizer gets no
schedule at all (a scheduler that only reports the optimizer's rates), as upstream.
"""
from __future__ import annotations

import argparse
import importlib
import logging

import torch

from library.errors import ConfigError

logger = logging.getLogger(__name__)


# name -> does it take a warmup?  (the factories are in _build; the order is the GUI's)
SCHEDULERS: dict[str, bool] = {
    "constant": False,
    "constant_with_warmup": True,
    "linear": True,
    "cosine": True,
    "cosine_with_restarts": True,
    "polynomial": True,
    "inverse_sqrt": True,
    "cosine_with_min_lr": True,
    "warmup_stable_decay": True,
    "piecewise_constant": False,
    "adafactor": False,
}
SCHEDULER_NAMES = list(SCHEDULERS)
# transformers names upstream's get_scheduler_fix cannot build (they end in a TypeError there)
_REFUSED = {
    "reduce_lr_on_plateau": "it needs a validation metric at every step, which the training loop does not have",
    "cosine_warmup_with_min_lr": "upstream passes it arguments it does not take; use cosine_with_min_lr",
}


def int_or_float(value) -> int | float:
    """Upstream's --lr_warmup_steps / --lr_decay_steps type: `100` steps, `0.05` or `5%` a ratio of the total."""
    if isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"{value!r} is not an int or float")
    if isinstance(value, (int, float)):
        return int(value) if value >= 1 else value
    text = str(value).strip()
    try:
        if text.endswith("%"):
            return float(text[:-1]) / 100.0
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of steps, a ratio below 1 or a percentage")
    if number >= 1:
        if number != int(number):
            raise argparse.ArgumentTypeError(f"{value!r}: steps must be a whole number (a ratio must be below 1)")
        return int(number)
    return number


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lr_scheduler", type=str, default="constant",
                        help=f"one of {', '.join(SCHEDULER_NAMES)}")
    parser.add_argument("--lr_scheduler_type", type=str, default="",
                        help="any scheduler class: a torch.optim.lr_scheduler name (CosineAnnealingLR) or a full "
                             "class path; its arguments come from --lr_scheduler_args")
    parser.add_argument("--lr_scheduler_args", type=str, default=None, nargs="*",
                        help='extra scheduler arguments as key=value, e.g. "T_max=100"')
    parser.add_argument("--lr_warmup_steps", type=int_or_float, default=0,
                        help="warmup steps, or a ratio of the total steps when below 1 (or a percentage, 5%%)")
    parser.add_argument("--lr_decay_steps", type=int_or_float, default=0,
                        help="decay steps of warmup_stable_decay, or a ratio of the total steps when below 1")
    parser.add_argument("--lr_scheduler_num_cycles", type=int, default=1,
                        help="restarts of cosine_with_restarts (cosine_with_min_lr/warmup_stable_decay: half-waves)")
    parser.add_argument("--lr_scheduler_power", type=float, default=1,
                        help="power of the polynomial scheduler")
    parser.add_argument("--lr_scheduler_timescale", type=int, default=None,
                        help="timescale of inverse_sqrt (default: the warmup steps)")
    parser.add_argument("--lr_scheduler_min_lr_ratio", type=float, default=None,
                        help="the lowest learning rate as a ratio of the initial one (cosine_with_min_lr, "
                             "warmup_stable_decay)")


def parse_scheduler_args(args: argparse.Namespace) -> dict:
    from library.optimizers import parse_key_values

    return parse_key_values(args.lr_scheduler_args, "--lr_scheduler_args")


def effective_name(args: argparse.Namespace) -> str:
    """The scheduler that runs: Adafactor with relative_step always gets `adafactor` (upstream switches to it)."""
    from library import optimizers

    if optimizers.adafactor_relative_step(args):
        return "adafactor"
    return "adafactor" if args.lr_scheduler.startswith("adafactor:") else args.lr_scheduler


def metadata_value(args: argparse.Namespace) -> str:
    """ss_lr_scheduler as upstream writes it: `adafactor:<initial lr>` when Adafactor sets its own step size."""
    from library import optimizers

    if optimizers.adafactor_relative_step(args) and not args.lr_scheduler.startswith("adafactor:"):
        return f"adafactor:{args.learning_rate}"
    return args.lr_scheduler


def step_counts(args: argparse.Namespace, max_train_steps: int, num_processes: int = 1) -> tuple[int, int, int, int]:
    """-> (total, warmup, decay, stable) scheduler steps, as upstream counts them."""
    total = max_train_steps * num_processes

    def steps(value) -> int:
        value = value or 0
        return int(value * total) if isinstance(value, float) else int(value)

    warmup, decay = steps(args.lr_warmup_steps), steps(getattr(args, "lr_decay_steps", 0))
    return total, warmup, decay, total - warmup - decay


def scheduler_class(path: str):
    from library.optimizers import _import

    module_name, class_name = path.rsplit(".", 1) if "." in path else ("torch.optim.lr_scheduler", path)
    cls = getattr(_import(module_name, f"--lr_scheduler_type {path}"), class_name, None)
    if cls is None:
        raise ConfigError(f"--lr_scheduler_type {path}: {module_name} has no {class_name}")
    return cls


def check_scheduler_args(args: argparse.Namespace) -> None:
    """Before any model loads: a known name (or an importable --lr_scheduler_type), the options it needs."""
    from library import optimizers

    parse_scheduler_args(args)
    name = effective_name(args)
    if args.lr_warmup_steps is not None and args.lr_warmup_steps < 0:
        raise ConfigError(f"--lr_warmup_steps must be 0 or more, got {args.lr_warmup_steps}")
    if optimizers.is_schedulefree(args):
        return  # no schedule (the optimizer's own warmup_steps argument warms up)
    if args.lr_scheduler_type:
        scheduler_class(args.lr_scheduler_type)
        _no_warmup(args, f"--lr_scheduler_type {args.lr_scheduler_type}")
        return
    if name in _REFUSED:
        raise ConfigError(f"--lr_scheduler {name} is not supported: {_REFUSED[name]}")
    if name not in SCHEDULERS:
        raise ConfigError(f"--lr_scheduler {args.lr_scheduler!r} is not supported; allowed: "
                          f"{', '.join(SCHEDULER_NAMES)}, or any class with --lr_scheduler_type")
    if name == "adafactor" and optimizers.canonical_name(optimizers.optimizer_type(args)) != "AdaFactor":
        raise ConfigError("--lr_scheduler adafactor works only with --optimizer_type Adafactor")
    if name in ("constant", "adafactor"):
        _no_warmup(args, f"--lr_scheduler {name}")
    if name == "cosine_with_min_lr" and args.lr_scheduler_min_lr_ratio is None:
        raise ConfigError("--lr_scheduler cosine_with_min_lr needs --lr_scheduler_min_lr_ratio (e.g. 0.1)")
    if name == "piecewise_constant" and "step_rules" not in parse_scheduler_args(args):
        raise ConfigError('--lr_scheduler piecewise_constant needs --lr_scheduler_args step_rules="1:10,0.1:20,0.01" '
                          "(multiplier:until_step, ..., last multiplier)")


def _no_warmup(args, what: str) -> None:
    if args.lr_warmup_steps:
        raise ConfigError(f"{what} takes no warmup: set --lr_warmup_steps 0 (or use constant_with_warmup)")


class ConstantLRReporter:
    """A schedule-free optimizer's 'scheduler': nothing to step, reports the optimizer's rates (upstream's dummy)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, *args, **kwargs) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def get_scheduler(args: argparse.Namespace, optimizer: torch.optim.Optimizer, max_train_steps: int,
                  num_processes: int = 1):
    """The scheduler of `optimizer` (not an accelerate-prepared one: step it with `step`)."""
    from library import optimizers

    check_scheduler_args(args)
    if optimizers.is_schedulefree(args):
        return ConstantLRReporter(optimizer)
    kwargs = parse_scheduler_args(args)
    name = effective_name(args)
    if name != args.lr_scheduler.split(":")[0] and not args.lr_scheduler_type:
        logger.info("Adafactor with relative_step=True: the adafactor scheduler is used instead of %s",
                    args.lr_scheduler)
    try:
        if args.lr_scheduler_type:
            cls = scheduler_class(args.lr_scheduler_type)
            logger.info("lr scheduler %s.%s %s", cls.__module__, cls.__name__, kwargs)
            return cls(optimizer, **kwargs)
        return _build(name, args, optimizer, max_train_steps, num_processes, kwargs)
    except TypeError as e:
        what = args.lr_scheduler_type or name
        raise ConfigError(f"--lr_scheduler_args {kwargs} not accepted by {what}: {e}") from e


def _build(name, args, optimizer, max_train_steps, num_processes, kwargs):
    from transformers import optimization as tr

    total, warmup, decay, stable = step_counts(args, max_train_steps, num_processes)
    if name == "adafactor":
        initial = args.lr_scheduler.split(":", 1)[1] if args.lr_scheduler.startswith("adafactor:") else None
        return tr.AdafactorSchedule(optimizer, float(initial) if initial else args.learning_rate)
    if name == "piecewise_constant":
        from diffusers.optimization import get_piecewise_constant_schedule

        return get_piecewise_constant_schedule(optimizer, **kwargs)
    if name == "constant":
        return tr.get_constant_schedule(optimizer, **kwargs)
    if name == "constant_with_warmup":
        return tr.get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup, **kwargs)
    if name == "inverse_sqrt":
        return tr.get_inverse_sqrt_schedule(optimizer, num_warmup_steps=warmup,
                                            timescale=args.lr_scheduler_timescale, **kwargs)
    both = {"num_warmup_steps": warmup, "num_training_steps": total}
    if name == "cosine_with_restarts":
        return tr.get_cosine_with_hard_restarts_schedule_with_warmup(
            optimizer, **both, num_cycles=args.lr_scheduler_num_cycles, **kwargs)
    if name == "polynomial":
        return tr.get_polynomial_decay_schedule_with_warmup(optimizer, **both, power=args.lr_scheduler_power,
                                                            **kwargs)
    if name == "cosine_with_min_lr":
        return tr.get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, **both, num_cycles=args.lr_scheduler_num_cycles / 2,
            min_lr_rate=args.lr_scheduler_min_lr_ratio, **kwargs)
    if name == "linear":
        return tr.get_linear_schedule_with_warmup(optimizer, **both, **kwargs)
    if name == "cosine":
        return tr.get_cosine_schedule_with_warmup(optimizer, **both, **kwargs)
    if name == "warmup_stable_decay":
        return tr.get_wsd_schedule(optimizer, num_warmup_steps=warmup, num_stable_steps=stable,
                                   num_decay_steps=decay, num_cycles=args.lr_scheduler_num_cycles / 2,
                                   min_lr_ratio=args.lr_scheduler_min_lr_ratio or 0.0, **kwargs)
    raise ConfigError(f"--lr_scheduler {name!r} is not supported; allowed: {', '.join(SCHEDULER_NAMES)}")


class SchedulerGroup:
    """The schedulers of several optimizers (fused optimizer groups), stepped and saved together."""

    def __init__(self, schedulers: list):
        self.schedulers = schedulers

    def step(self, *args, **kwargs) -> None:
        for s in self.schedulers:
            s.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return [lr for s in self.schedulers for lr in s.get_last_lr()]

    def state_dict(self) -> dict:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: dict) -> None:
        for s, sd in zip(self.schedulers, state["schedulers"], strict=True):
            s.load_state_dict(sd)


def group(lr_schedulers: list):
    """One scheduler as it is (its saved state keeps its format), several as a SchedulerGroup."""
    return lr_schedulers[0] if len(lr_schedulers) == 1 else SchedulerGroup(lr_schedulers)


def step(lr_scheduler, optimizers, *, num_processes: int, sync_gradients: bool = True) -> int:
    """Steps `lr_scheduler` as accelerate's AcceleratedScheduler does; returns how many times it stepped.

    Not synchronised (gradient accumulation): no step (accelerate only bumps `_step_count`). An optimizer whose
    step the fp16 GradScaler skipped (`step_was_skipped`): no step. Otherwise `num_processes` steps, but a
    scheduler with `total_steps` (OneCycleLR) never past them."""
    if isinstance(lr_scheduler, SchedulerGroup):
        return sum(step(s, optimizers, num_processes=num_processes, sync_gradients=sync_gradients)
                   for s in lr_scheduler.schedulers)
    inner = getattr(lr_scheduler, "scheduler", lr_scheduler)
    if not sync_gradients:
        if hasattr(inner, "_step_count"):
            inner._step_count += 1
        return 0
    opts = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    if any(getattr(o, "step_was_skipped", False) for o in opts):
        return 0
    n = 0
    for _ in range(num_processes):
        if hasattr(inner, "total_steps") and inner._step_count > inner.total_steps:
            continue
        inner.step()
        n += 1
    return n


"""Optimizers: kohya-ss/sd-scripts' `--optimizer_type` names, any importable `module.Class`, `--optimizer_args`.

`OPTIMIZERS` (name -> where the class lives) is the one list of names: the trainers' help text and checks and,
later, the GUI's choices read it. Names are matched case-insensitively, as upstream does; a name that is not in
the table is a class of `torch.optim` (no dot, matched exactly: `RAdam`, `SGD`) or a full class path
(`pytorch_optimizer.CAME`, `bitsandbytes.optim.AdEMAMix8bit`).

The optional packages are install extras of the project (`pip install -e '.[lion]'`): a missing one stops the
run before any model loads with a message naming the package and the extra (exit 2).

Upstream's rules kept here: SGDNesterov(8bit) is nesterov with momentum 0.9 unless given; Adafactor defaults to
`relative_step=True` (its own step size, the `adafactor` scheduler, group learning rates dropped), and
`warmup_init=True` turns relative_step on; D-Adaptation / Prodigy warn about a learning rate below 0.1 and about
several rates (only the first counts); an optimizer with `train()` is put in train mode when made, and the
schedule-free ones (`...ScheduleFree`) are switched to eval mode for sampling and saving (`eval_mode`).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from library.errors import ConfigError, OptionalPackageError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OptimizerSpec:
    module: str
    cls: str
    defaults: dict[str, Any] = field(default_factory=dict)   # set when --optimizer_args does not give them
    forced: dict[str, Any] = field(default_factory=dict)     # always passed (upstream passes them explicitly)


# top-level module -> (pip package, install extra of this project)
OPTIONAL_PACKAGES = {
    "bitsandbytes": ("bitsandbytes", "bitsandbytes"),
    "lion_pytorch": ("lion-pytorch", "lion"),
    "dadaptation": ("dadaptation", "dadaptation"),
    "prodigyopt": ("prodigyopt", "prodigy"),
    "schedulefree": ("schedulefree", "schedulefree"),
    "pytorch_optimizer": ("pytorch-optimizer", "pytorch-optimizer"),
    "prodigyplus": ("prodigy-plus-schedule-free", "prodigy-plus"),  # prodigyplus.ProdigyPlusScheduleFree
}

_NESTEROV = {"defaults": {"momentum": 0.9}, "forced": {"nesterov": True}}
_BNB = "bitsandbytes.optim"
_DADAPT = "dadaptation"
_DADAPT_EXP = "dadaptation.experimental"
_SF = "schedulefree"

# upstream's names, in the order of its --optimizer_type help (kept as the GUI's order)
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "AdamW": OptimizerSpec("torch.optim", "AdamW"),
    "AdamW8bit": OptimizerSpec(_BNB, "AdamW8bit"),
    "PagedAdamW": OptimizerSpec(_BNB, "PagedAdamW"),
    "PagedAdamW8bit": OptimizerSpec(_BNB, "PagedAdamW8bit"),
    "PagedAdamW32bit": OptimizerSpec(_BNB, "PagedAdamW32bit"),
    "Lion": OptimizerSpec("lion_pytorch", "Lion"),
    "Lion8bit": OptimizerSpec(_BNB, "Lion8bit"),
    "PagedLion8bit": OptimizerSpec(_BNB, "PagedLion8bit"),
    "SGDNesterov": OptimizerSpec("torch.optim", "SGD", **_NESTEROV),
    "SGDNesterov8bit": OptimizerSpec(_BNB, "SGD8bit", **_NESTEROV),
    "DAdaptation": OptimizerSpec(_DADAPT_EXP, "DAdaptAdamPreprint"),
    "DAdaptAdaGrad": OptimizerSpec(_DADAPT, "DAdaptAdaGrad"),
    "DAdaptAdam": OptimizerSpec(_DADAPT, "DAdaptAdam"),
    "DAdaptAdan": OptimizerSpec(_DADAPT, "DAdaptAdan"),
    "DAdaptAdanIP": OptimizerSpec(_DADAPT_EXP, "DAdaptAdanIP"),
    "DAdaptLion": OptimizerSpec(_DADAPT, "DAdaptLion"),
    "DAdaptSGD": OptimizerSpec(_DADAPT, "DAdaptSGD"),
    "AdaFactor": OptimizerSpec("transformers.optimization", "Adafactor", defaults={"relative_step": True}),
    "Prodigy": OptimizerSpec("prodigyopt", "Prodigy"),
    "RAdamScheduleFree": OptimizerSpec(_SF, "RAdamScheduleFree"),
    "AdamWScheduleFree": OptimizerSpec(_SF, "AdamWScheduleFree"),
    "SGDScheduleFree": OptimizerSpec(_SF, "SGDScheduleFree"),
}
OPTIMIZER_NAMES = list(OPTIMIZERS)
_ALIASES = {"dadaptadampreprint": "DAdaptation"}  # upstream: "DAdaptation(DAdaptAdamPreprint)"
_BY_LOWER = {name.lower(): name for name in OPTIMIZERS} | _ALIASES


def add_optimizer_arguments(parser: argparse.ArgumentParser) -> None:
    """Upstream's optimizer flags (the scheduler flags are library.schedulers.add_scheduler_arguments)."""
    parser.add_argument("--optimizer_type", type=str, default="",
                        help=f"one of {', '.join(OPTIMIZER_NAMES)} (any case; default AdamW), a torch.optim class "
                             "(RAdam) or a full class path (pytorch_optimizer.CAME)")
    parser.add_argument("--use_8bit_adam", action="store_true", help="same as --optimizer_type AdamW8bit")
    parser.add_argument("--use_lion_optimizer", action="store_true", help="same as --optimizer_type Lion")
    parser.add_argument("--learning_rate", type=float, default=2.0e-6, help="learning rate")
    parser.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (0 = off)")
    parser.add_argument("--optimizer_args", type=str, default=None, nargs="*",
                        help='extra optimizer arguments as key=value, e.g. "weight_decay=0.01 betas=0.9,0.999"')
    parser.add_argument("--fused_backward_pass", action="store_true",
                        help="Adafactor only: step each parameter during backward and free its gradient (full "
                             "trainers; the LoRA scripts accept and check it as upstream, the LoRA loop is unchanged)")


# ----------------------------------------------------------------------------------------------------------
# names and arguments


def optimizer_type(args: argparse.Namespace) -> str:
    """The optimizer the flags ask for, as typed (default AdamW); --use_8bit_adam / --use_lion_optimizer as
    upstream (they exclude each other and --optimizer_type)."""
    typed = args.optimizer_type or ""
    eight, lion = bool(getattr(args, "use_8bit_adam", False)), bool(getattr(args, "use_lion_optimizer", False))
    if eight and lion:
        raise ConfigError("--use_8bit_adam and --use_lion_optimizer exclude each other")
    if (eight or lion) and typed:
        flag = "--use_8bit_adam" if eight else "--use_lion_optimizer"
        raise ConfigError(f"{flag} and --optimizer_type {typed} exclude each other; keep one")
    if eight:
        return "AdamW8bit"
    if lion:
        return "Lion"
    return typed or "AdamW"


# kept for callers of the old train_util API
optimizer_name = optimizer_type


def canonical_name(name: str) -> str | None:
    """The table's spelling of a known name (any case), else None."""
    return _BY_LOWER.get(name.lower())


def is_schedulefree(args: argparse.Namespace) -> bool:
    """Upstream's rule: the optimizer name ends with "schedulefree" (any case)."""
    return optimizer_type(args).lower().endswith("schedulefree")


def _literal(raw: str) -> Any:
    if raw.lower() in ("true", "false"):  # upstream needs True/False; a lower-case word would be a truthy str
        return raw.lower() == "true"
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw  # a plain word (e.g. a mode name)


def parse_key_values(items: Iterable[str] | None, option: str = "--optimizer_args") -> dict[str, Any]:
    """`key=value` pairs; values are Python literals (numbers, True, lists, `0.9,0.999` = a tuple) or text."""
    out: dict[str, Any] = {}
    if isinstance(items, str):
        items = [items]
    # a config file may hold them as one string ("a=1 b=2") or with an empty entry; a space inside a value
    # ("betas=(0.9, 0.99)") stays
    split = [part for item in items or [] for part in re.split(r"\s+(?=[A-Za-z_]\w*=)", item.strip()) if part]
    for item in split:
        if "=" not in item:
            raise ConfigError(f"{option}: {item!r} must be key=value")
        key, raw = item.split("=", 1)
        out[key.strip()] = _literal(raw.strip())
    return out


def parse_optimizer_args(items: Iterable[str] | None) -> dict[str, Any]:
    return parse_key_values(items, "--optimizer_args")


def _import(module_name: str, what: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        root = module_name.split(".")[0]
        if root in OPTIONAL_PACKAGES:
            package, extra = OPTIONAL_PACKAGES[root]
            raise OptionalPackageError(
                f"{what} needs the Python package '{package}', which is not installed: pip install {package} "
                f"(or this project's extra: pip install -e '.[{extra}]')") from e
        raise ConfigError(f"{what}: cannot import {module_name} ({e})") from e


def optimizer_class(name: str):
    """The class for an --optimizer_type value; OptionalPackageError / ConfigError when it cannot be had."""
    what = f"--optimizer_type {name}"
    known = canonical_name(name)
    if known is not None:
        spec = OPTIMIZERS[known]
        module_name, class_name = spec.module, spec.cls
    elif "." in name:
        module_name, class_name = name.rsplit(".", 1)
    else:
        module_name, class_name = "torch.optim", name
    module = _import(module_name, what)
    cls = getattr(module, class_name, None)
    if cls is None:
        if known is not None:
            raise OptionalPackageError(f"{what}: {module_name} has no {class_name}: the installed version is too "
                                       "old, upgrade it")
        raise ConfigError(f"{what} is not supported; allowed: {', '.join(OPTIMIZER_NAMES)}, a torch.optim class "
                          "or a full class path like pytorch_optimizer.CAME")
    return cls


# every learning-rate option of the seven scripts (each may be absent from a given parser)
LEARNING_RATE_OPTIONS = ("learning_rate", "unet_lr", "text_encoder_lr", "learning_rate_te", "learning_rate_te1",
                         "learning_rate_te2")


def check_optimizer_args(args: argparse.Namespace) -> None:
    """Before any model loads: learning rates and --max_grad_norm not negative, the name resolves to an
    importable class, --optimizer_args parse, --fused_backward_pass is used as upstream allows."""
    if getattr(args, "max_grad_norm", None) is not None and args.max_grad_norm < 0:
        # a negative norm would flip the gradients' sign in clip_grad_norm_
        raise ConfigError(f"--max_grad_norm must be 0 (no clipping) or more, got {args.max_grad_norm}")
    for lr_name in LEARNING_RATE_OPTIONS:
        value = getattr(args, lr_name, None)
        values = value if isinstance(value, list) else [value]
        if any(v is not None and (v < 0 or not math.isfinite(v)) for v in values):
            raise ConfigError(f"--{lr_name} must be 0 or more, got {value}")
    name = optimizer_type(args)
    optimizer_class(name)
    parse_optimizer_args(args.optimizer_args)
    if getattr(args, "fused_backward_pass", False):
        if canonical_name(name) != "AdaFactor":
            raise ConfigError(f"--fused_backward_pass works only with --optimizer_type Adafactor, got {name}")
        if args.gradient_accumulation_steps > 1:
            raise ConfigError("--fused_backward_pass applies each gradient during backward, so it cannot "
                              f"accumulate gradients: drop --gradient_accumulation_steps "
                              f"{args.gradient_accumulation_steps} or --fused_backward_pass")


def resolved_optimizer_args(args: argparse.Namespace) -> dict[str, Any]:
    """--optimizer_args with upstream's additions: SGDNesterov(8bit) momentum 0.9, Adafactor relative_step=True
    unless given (and turned on by warmup_init=True). Upstream writes these into ss_optimizer."""
    kwargs = parse_optimizer_args(args.optimizer_args)
    known = canonical_name(optimizer_type(args))
    if known:
        for key, value in OPTIMIZERS[known].defaults.items():
            kwargs.setdefault(key, value)
    if known == "AdaFactor" and kwargs.get("warmup_init", False):
        kwargs["relative_step"] = True
    return kwargs


def adafactor_relative_step(args: argparse.Namespace) -> bool:
    """Upstream's Adafactor: relative_step defaults to True, and warmup_init=True turns it on."""
    if canonical_name(optimizer_type(args)) != "AdaFactor":
        return False
    return bool(resolved_optimizer_args(args)["relative_step"])


def metadata_value(class_path: str, args: argparse.Namespace) -> str:
    """ss_optimizer as upstream writes it: `module.Class(key=value,key=value)` (the arguments with upstream's
    additions; our fused=True for AdamW is not one)."""
    kwargs = resolved_optimizer_args(args)
    return class_path + (f"({','.join(f'{k}={v}' for k, v in kwargs.items())})" if kwargs else "")


# ----------------------------------------------------------------------------------------------------------
# building


def _group_lrs(params, lr) -> list:
    if isinstance(params, list) and params and isinstance(params[0], dict):
        return [g.get("lr", lr) for g in params]
    return [lr]


def _can_fuse(cls, params, kwargs: dict) -> bool:
    """torch's AdamW/Adam on CUDA (or CPU) float tensors, with no fused/foreach choice in --optimizer_args."""
    if cls not in (torch.optim.AdamW, torch.optim.Adam) or {"fused", "foreach", "differentiable"} & kwargs.keys():
        return False
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    return bool(tensors) and all(t.device.type in ("cuda", "cpu") and t.is_floating_point() for t in tensors)


def _faster_step(cls):
    """The class to build for `cls`: the same optimizer with a step of fewer kernel launches where one exists
    (transformers' Adafactor: library.grouped_adafactor; prodigyopt's Prodigy: library.foreach_prodigy;
    lion-pytorch's Lion: library.foreach_lion; dadaptation's DAdaptAdam: library.foreach_dadapt; bitsandbytes'
    optimizers: library.bnb_unsynced; each keeps the weights and state of the original step), else `cls`."""
    path = f"{cls.__module__}.{cls.__name__}"
    if path == "transformers.optimization.Adafactor":
        from library.grouped_adafactor import GroupedAdafactor

        return GroupedAdafactor
    if path == "prodigyopt.prodigy.Prodigy":
        from library.foreach_prodigy import ForeachProdigy

        return ForeachProdigy
    if path == "dadaptation.dadapt_adam.DAdaptAdam":
        from library.foreach_dadapt import ForeachDAdaptAdam

        return ForeachDAdaptAdam
    if path == "lion_pytorch.lion_pytorch.Lion":
        from library.foreach_lion import ForeachLion

        return ForeachLion
    from library import bnb_unsynced

    if bnb_unsynced.is_bnb_optimizer(cls):  # AdamW8bit, Lion8bit, ...: no GPU wait after each parameter
        return bnb_unsynced.unsynced(cls)
    return cls


def get_optimizer(args: argparse.Namespace, params) -> tuple[str, str, torch.optim.Optimizer]:
    """-> (name as asked, "module.Class" for metadata, optimizer). `params`: param groups or tensors."""
    name = optimizer_type(args)
    known = canonical_name(name) or ""
    cls = optimizer_class(name)
    given = parse_optimizer_args(args.optimizer_args)
    kwargs = resolved_optimizer_args(args)
    for key in kwargs.keys() - given.keys():
        logger.info("%s: %s=%s (upstream's default)", known, key, kwargs[key])
    if given.get("relative_step") is False and kwargs.get("relative_step"):
        logger.info("Adafactor: warmup_init=True needs relative_step=True; turning it on (as upstream)")
    if known:
        kwargs.update(OPTIMIZERS[known].forced)
    lr = args.learning_rate

    if known.startswith("DAdapt") or known == "Prodigy":
        lrs = _group_lrs(params, lr)
        if lrs[0] is not None and lrs[0] <= 0.1:
            logger.warning("learning rate %s is low for %s: D-Adaptation and Prodigy expect about 1.0", lrs[0], known)
        if len(set(lrs)) > 1:
            logger.warning("%s uses only the first learning rate (%s) of the %d given", known, lrs[0], len(set(lrs)))

    if known == "AdaFactor":
        if kwargs["relative_step"]:
            # Adafactor computes its own step size: the learning rates are not used (the adafactor scheduler
            # reports the rate it uses, see library.schedulers)
            logger.info("Adafactor with relative_step=True: --learning_rate %s is only the initial value logged; "
                        "the adafactor scheduler is used", lr)
            lr = None
            if isinstance(params, list) and params and isinstance(params[0], dict):
                if any("lr" in g for g in params):
                    logger.warning("Adafactor with relative_step=True ignores the per-group learning rates "
                                   "(unet_lr, text_encoder_lr, ...)")
                params = [{k: v for k, v in g.items() if k != "lr"} for g in params]
        else:
            if args.max_grad_norm:
                logger.warning("Adafactor: --max_grad_norm %s clips the gradients; 0 turns clipping off",
                               args.max_grad_norm)
            if kwargs.get("clip_threshold", 1.0) != 1.0:
                logger.warning("Adafactor: clip_threshold=1.0 is the usual value")

    if _can_fuse(cls, params, kwargs):
        # a few kernels for all tensors: with torch's default (foreach) a compiled SDXL LoRA step on an H100
        # took 161 ms instead of 113 ms (docs/BENCHMARKS.md, run13); the update is the same
        kwargs["fused"] = True
    build = _faster_step(cls)
    try:
        optimizer = build(params, lr=lr, **kwargs) if lr is not None else build(params, **kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--optimizer_args {kwargs} not accepted by {cls.__module__}.{cls.__name__}: {e}") from e
    if callable(getattr(optimizer, "train", None)):
        optimizer.train()  # schedule-free optimizers start in train mode (upstream does the same)
    logger.info("optimizer %s.%s, lr %s, args %s", cls.__module__, cls.__name__, lr, kwargs)
    return name, f"{cls.__module__}.{cls.__name__}", optimizer


class LateValue:
    """A number on the device, copied to the host without waiting and read (float()) once that copy is done:
    library.foreach_prodigy keeps d on the GPU, and reading it right away would wait for the step in flight."""

    def __init__(self, value: torch.Tensor):
        self.host = torch.empty((), dtype=torch.float64, pin_memory=value.is_cuda)
        self.host.copy_(value.detach(), non_blocking=True)
        self.event = None
        if value.is_cuda:
            self.event = torch.cuda.Event()
            self.event.record()

    def __float__(self) -> float:
        if self.event is not None:
            self.event.synchronize()  # this copy only, not the steps queued after it
        return float(self.host)


def d_lr_logs(optimizers, names: list[str] | None = None) -> dict[str, float | LateValue]:
    """`lr/d*lr/<group>`: the step size D-Adaptation and Prodigy actually use (their `d` times the rate), which
    upstream logs next to `lr/<group>`; a LateValue (float() it when logging) where d is a device tensor."""
    groups = [g for o in optimizers for g in _unwrap(o).param_groups]
    return {f"lr/d*lr/{names[i] if names and i < len(names) else f'group{i}'}":
            LateValue(g["d"] * g["lr"]) if isinstance(g["d"], torch.Tensor) else g["d"] * g["lr"]
            for i, g in enumerate(groups) if "d" in g and g.get("lr") is not None}


# ----------------------------------------------------------------------------------------------------------
# schedule-free: eval mode (the averaged weights) for sampling and saving


def _unwrap(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


def train_eval_fns(optimizers, args: argparse.Namespace) -> tuple[Callable[[], None], Callable[[], None]]:
    """(train, eval) functions: the optimizers' own for a schedule-free optimizer, no-ops otherwise."""
    if not is_schedulefree(args):
        return (lambda: None), (lambda: None)
    opts = [_unwrap(o) for o in (optimizers if isinstance(optimizers, (list, tuple)) else [optimizers])]

    def train() -> None:
        for o in opts:
            o.train()

    def evaluate() -> None:
        for o in opts:
            o.eval()

    return train, evaluate


@contextlib.contextmanager
def eval_mode(optimizers, args: argparse.Namespace):
    """The model holds a schedule-free optimizer's evaluation weights inside the block (sampling, saving)."""
    train, evaluate = train_eval_fns(optimizers, args)
    evaluate()
    try:
        yield
    finally:
        train()

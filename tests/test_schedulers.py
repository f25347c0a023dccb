"""library.schedulers: each --lr_scheduler's curve against upstream's formula (written here from upstream's
get_scheduler_fix and the transformers/diffusers schedules it calls), warmup/decay ratios, the option checks,
--lr_scheduler_type with a class path and --lr_scheduler_args, and accelerate's stepping rule (fp16 skip,
num_processes steps per optimizer step, accumulation)."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from library import schedulers
from library.train_util import ConfigError, OptionalPackageError


@pytest.fixture(scope="module")
def parser():
    import sdxl_train_network

    return sdxl_train_network.setup_parser()


def curve(parser, argv, max_steps=20, num_processes=1):
    """LR (first group) before each optimizer step, stepped as the training loop steps it."""
    args = parser.parse_args(["--learning_rate", "1.0", *argv])
    schedulers.check_scheduler_args(args)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = schedulers.get_scheduler(args, opt, max_steps, num_processes)
    out = []
    for _ in range(max_steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        schedulers.step(sched, opt, num_processes=num_processes)
    return out


# upstream's formulas, s = scheduler step, T total, W warmup ---------------------------------------------------
def warm(s, W):
    return s / max(1, W)


def linear(s, T, W):
    return warm(s, W) if s < W else max(0.0, (T - s) / max(1, T - W))


def cosine(s, T, W, cycles=0.5, floor=0.0):
    if s < W:
        return warm(s, W)
    p = (s - W) / max(1, T - W)
    f = max(0.0, 0.5 * (1 + math.cos(math.pi * 2 * cycles * p)))
    return f * (1 - floor) + floor


def restarts(s, T, W, n):
    if s < W:
        return warm(s, W)
    p = (s - W) / max(1, T - W)
    return 0.0 if p >= 1 else max(0.0, 0.5 * (1 + math.cos(math.pi * ((n * p) % 1.0))))


def polynomial(s, T, W, power, end=1e-7):
    if s < W:
        return warm(s, W)
    if s > T:
        return end
    return (1 - end) * (1 - (s - W) / (T - W)) ** power + end


def inverse_sqrt(s, W, timescale):
    if s < W:
        return warm(s, W)
    return 1 / math.sqrt((s + timescale - W) / timescale)


def wsd(s, W, S, D, floor, cycles=0.5):
    if s < W:
        return warm(s, W) * (1 - floor) + floor
    if s < W + S:
        return 1.0
    if s < W + S + D:
        p = (s - W - S) / max(1, D)
        return max(0.0, 0.5 * (1 + math.cos(math.pi * cycles * 2 * p)) * (1 - floor) + floor)
    return floor


CASES = [
    (["--lr_scheduler", "constant"], lambda s, T: 1.0),
    (["--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "4"], lambda s, T: min(1.0, warm(s, 4))),
    (["--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "0.25"],  # ratio of T: int(0.25 * T)
     lambda s, T: min(1.0, warm(s, int(0.25 * T)))),
    (["--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "10%"], lambda s, T: min(1.0, warm(s, T // 10))),
    (["--lr_scheduler", "linear", "--lr_warmup_steps", "3"], lambda s, T: linear(s, T, 3)),
    (["--lr_scheduler", "cosine", "--lr_warmup_steps", "0.1"], lambda s, T: cosine(s, T, int(0.1 * T))),
    (["--lr_scheduler", "cosine_with_restarts", "--lr_scheduler_num_cycles", "3"], lambda s, T: restarts(s, T, 0, 3)),
    (["--lr_scheduler", "polynomial", "--lr_scheduler_power", "2", "--lr_warmup_steps", "2"],
     lambda s, T: polynomial(s, T, 2, 2.0)),
    (["--lr_scheduler", "inverse_sqrt", "--lr_warmup_steps", "4"], lambda s, T: inverse_sqrt(s, 4, 4)),
    (["--lr_scheduler", "inverse_sqrt", "--lr_warmup_steps", "4", "--lr_scheduler_timescale", "10"],
     lambda s, T: inverse_sqrt(s, 4, 10)),
    (["--lr_scheduler", "cosine_with_min_lr", "--lr_scheduler_min_lr_ratio", "0.2", "--lr_warmup_steps", "2"],
     lambda s, T: cosine(s, T, 2, cycles=0.5, floor=0.2)),
    (["--lr_scheduler", "cosine_with_min_lr", "--lr_scheduler_min_lr_ratio", "0.1", "--lr_scheduler_num_cycles", "2"],
     lambda s, T: cosine(s, T, 0, cycles=1.0, floor=0.1)),
    (["--lr_scheduler", "warmup_stable_decay", "--lr_warmup_steps", "0.1", "--lr_decay_steps", "0.3",
      "--lr_scheduler_min_lr_ratio", "0.1"],
     lambda s, T: wsd(s, int(0.1 * T), T - int(0.1 * T) - int(0.3 * T), int(0.3 * T), 0.1)),
    (["--lr_scheduler", "warmup_stable_decay", "--lr_warmup_steps", "2", "--lr_decay_steps", "5"],
     lambda s, T: wsd(s, 2, T - 7, 5, 0.0)),
    (["--lr_scheduler", "piecewise_constant", "--lr_scheduler_args", "step_rules=1:3,0.5:7,0.1"],
     lambda s, T: 1.0 if s < 3 else 0.5 if s < 7 else 0.1),
]


@pytest.mark.parametrize("argv,formula", CASES, ids=[" ".join(c[0][1:]) for c in CASES])
def test_curve_matches_upstream_formula(parser, argv, formula):
    T = 20
    assert curve(parser, argv, T) == pytest.approx([formula(s, T) for s in range(T)], abs=1e-9)


def test_every_upstream_scheduler_name_is_listed():
    assert set(schedulers.SCHEDULER_NAMES) == {
        "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt",
        "cosine_with_min_lr", "warmup_stable_decay", "piecewise_constant", "adafactor"}
    for name in schedulers.SCHEDULER_NAMES:
        assert name in parser_help()


def parser_help():
    import sdxl_train_network

    return sdxl_train_network.setup_parser().format_help().replace("\n", " ").replace("  ", " ")


def test_lr_scheduler_args_reach_named_schedulers(parser):
    # upstream passes --lr_scheduler_args to the named schedule too (here polynomial's lr_end)
    out = curve(parser, ["--lr_scheduler", "polynomial", "--lr_scheduler_args", "lr_end=0.5"], 10)
    assert out == pytest.approx([polynomial(s, 10, 0, 1.0, end=0.5) for s in range(10)])


def test_multi_process_steps_like_accelerate(parser):
    """Upstream: T = max_train_steps * num_processes, and accelerate steps the scheduler num_processes times per
    optimizer step; integer warmup counts scheduler steps (so with 2 processes it lasts half the optimizer steps)."""
    T, N = 10, 2
    out = curve(parser, ["--lr_scheduler", "linear", "--lr_warmup_steps", "4"], T, num_processes=N)
    assert out == pytest.approx([linear(N * k, N * T, 4) for k in range(T)])
    out = curve(parser, ["--lr_scheduler", "cosine", "--lr_warmup_steps", "0.2"], T, num_processes=N)
    assert out == pytest.approx([cosine(N * k, N * T, int(0.2 * N * T)) for k in range(T)])
    assert schedulers.step_counts(parser.parse_args(["--lr_warmup_steps", "0.1", "--lr_decay_steps", "3"]), 50, 4) \
        == (200, 20, 3, 177)


class _Opt:
    def __init__(self, skipped):
        self.step_was_skipped = skipped


def test_fp16_skipped_step_and_accumulation_do_not_step():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    assert schedulers.step(sched, [_Opt(True)], num_processes=1) == 0  # GradScaler skipped the optimizer step
    assert sched.last_epoch == 0 and sched.get_last_lr() == [1.0]
    count = sched._step_count
    assert schedulers.step(sched, [_Opt(False)], num_processes=3, sync_gradients=False) == 0  # accumulating
    assert sched.last_epoch == 0 and sched._step_count == count + 1  # accelerate's adjust_scheduler bump
    assert schedulers.step(sched, [_Opt(False), _Opt(False)], num_processes=3) == 3
    assert sched.last_epoch == 3 and sched.get_last_lr() == [0.25]
    assert schedulers.step(sched, [_Opt(False), _Opt(True)], num_processes=3) == 0  # any optimizer skipped


def test_one_cycle_never_steps_past_total_steps(parser):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=5)
    for _ in range(4):
        opt.step()
        schedulers.step(sched, opt, num_processes=2)  # without the guard OneCycleLR raises past total_steps
    assert sched._step_count == 6


def test_lr_scheduler_type_class_path_and_args(parser):
    out = curve(parser, ["--lr_scheduler_type", "torch.optim.lr_scheduler.StepLR", "--lr_scheduler_args",
                         "step_size=3", "gamma=0.5"], 9)
    assert out == pytest.approx([0.5 ** (s // 3) for s in range(9)])
    # no dot: a torch.optim.lr_scheduler class (upstream's rule); it wins over --lr_scheduler
    out = curve(parser, ["--lr_scheduler", "linear", "--lr_scheduler_type", "CosineAnnealingLR",
                         "--lr_scheduler_args", "T_max=8"], 8)
    assert out == pytest.approx([0.5 * (1 + math.cos(math.pi * s / 8)) for s in range(8)])
    with pytest.raises(ConfigError, match="takes no warmup"):
        curve(parser, ["--lr_scheduler_type", "StepLR", "--lr_scheduler_args", "step_size=3",
                       "--lr_warmup_steps", "2"])
    with pytest.raises(ConfigError, match="torch.optim.lr_scheduler has no NoSuchLR"):
        curve(parser, ["--lr_scheduler_type", "NoSuchLR"])
    with pytest.raises(ConfigError, match="not accepted by StepLR"):
        curve(parser, ["--lr_scheduler_type", "StepLR", "--lr_scheduler_args", "step_size=3", "colour=1"])


def test_lr_scheduler_type_from_missing_package(parser, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)
    with pytest.raises(OptionalPackageError, match=r"'pytorch-optimizer'.*\.\[pytorch-optimizer\]"):
        schedulers.check_scheduler_args(parser.parse_args(["--lr_scheduler_type", "pytorch_optimizer.REXScheduler"]))


@pytest.mark.parametrize("argv,match", [
    (["--lr_scheduler", "constant", "--lr_warmup_steps", "5"], "takes no warmup"),
    (["--lr_scheduler", "cosine_with_min_lr"], "needs --lr_scheduler_min_lr_ratio"),
    (["--lr_scheduler", "piecewise_constant"], "needs --lr_scheduler_args step_rules"),
    (["--lr_scheduler", "reduce_lr_on_plateau"], "needs a validation metric"),
    (["--lr_scheduler", "cosine_warmup_with_min_lr"], "use cosine_with_min_lr"),
    (["--lr_scheduler", "cosin"], "not supported; allowed: constant, constant_with_warmup"),
    (["--lr_scheduler", "adafactor"], "works only with --optimizer_type Adafactor"),
    (["--optimizer_type", "Adafactor", "--lr_warmup_steps", "10"], "adafactor takes no warmup"),
    (["--lr_scheduler_args", "T_max"], "--lr_scheduler_args: 'T_max' must be key=value"),
])
def test_option_errors(parser, argv, match):
    with pytest.raises(ConfigError, match=match):
        schedulers.check_scheduler_args(parser.parse_args(argv))


def test_int_or_float_as_upstream():
    f = schedulers.int_or_float
    assert f("100") == 100 and isinstance(f("100"), int) and f("0.05") == 0.05 and f("5%") == 0.05
    assert f("1.0") == 1 and isinstance(f("1.0"), int) and f(0.5) == 0.5 and f(3) == 3
    for bad in ("abc", "1.5", "x%"):
        with pytest.raises(argparse.ArgumentTypeError):
            f(bad)


def test_verify_training_args_runs_the_checks(parser, tmp_path):
    from library import train_util

    args = parser.parse_args(["--output_dir", str(tmp_path), "--lr_scheduler", "cosine_with_min_lr"])
    with pytest.raises(ConfigError, match="needs --lr_scheduler_min_lr_ratio"):
        train_util.verify_training_args(args)

"""A run whose loss becomes NaN or infinite stops at once, with one line, before it saves anything more: its
weights are ruined from that step on, and training on (or a final save) would only replace good files with
NaN ones. The earlier saves stay as they are; the line names the newest one.

    finite_guard.check_losses(args, step, values)   # where each step's losses are read (the loop's report of
                                                    # the late losses, which runs before every save): no extra
                                                    # GPU sync, a few float checks

The loss is what reveals it: NaN / inf weights give a NaN loss at the next forward, and the loss of a step is read
(library.late_loss) before the step's saves. `NonFiniteLoss` is a TrainingError: the script's run() prints its
one line and exits 2; the final save is skipped.
"""
from __future__ import annotations

import glob
import math
import os

from library.errors import TrainingError


class NonFiniteLoss(TrainingError):
    """The loss became NaN or infinite; the message names the step and the last save."""


def check_losses(args, step: int, values) -> None:
    """`values`: the losses of optimizer step `step` (host floats). Raises NonFiniteLoss when one is NaN / inf."""
    bad = next((v for v in values if not math.isfinite(v)), None)
    if bad is None:
        return
    last = newest_save(getattr(args, "output_dir", None), getattr(args, "output_name", None))
    message = (f"the loss became {bad} at step {step}: the weights are no longer finite, so the run stops "
               "without saving (try a lower --learning_rate, --max_grad_norm, or bf16 instead of fp16); "
               + (f"the last save is {last}" if last else "nothing was saved before it"))
    raise NonFiniteLoss(message)


def newest_save(output_dir: str | None, output_name: str | None) -> str | None:
    """The newest result of this run's name in its output folder (a step / epoch save or a state folder)."""
    if not output_dir or not output_name:
        return None
    pattern = os.path.join(glob.escape(output_dir), glob.escape(output_name) + "*")
    found = [p for p in glob.glob(pattern)
             if p.endswith((".safetensors", ".ckpt", ".pt", "-state")) or os.path.isdir(p)]
    return max(found, key=os.path.getmtime) if found else None


def non_finite_options(args) -> list[str]:
    """The options given NaN or an infinity (argparse's float() and TOML take "nan" / "inf"): no option means
    anything with them, and a NaN guidance scale or learning rate trains a model of NaNs."""
    bad = []
    for key, value in sorted(vars(args).items()):
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            bad.append(f"--{key} {value!r}: must be a finite number (not nan or inf)")
    return bad

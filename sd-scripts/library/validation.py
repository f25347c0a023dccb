"""Validation loss, as kohya-ss/sd-scripts' LoRA trainers compute it (our own code, upstream's rules):

- `validation_split` (dataset config, [general] or [[datasets]]; `--validation_split` is its fallback) holds
  round(n * split) images of each image_dir subset out of training (shuffled with `validation_seed`, else the
  training seed); regularization subsets are never split and never validated;
- every `--validate_every_n_steps` steps and after every epoch (or every `--validate_every_n_epochs`), the
  trained modules go to eval mode and, without gradients, each validation batch (at most
  `--max_validation_steps` batches) is scored at 4 fixed timesteps, evenly inside [min_timestep, max_timestep]
  (200, 400, 600, 800 by default; FLUX: sigma = t / 1000), with noise from a generator seeded by
  `--validation_seed` (else `--seed`): the same noise every time, so the curve shows the model, not the noise;
- the mean is logged as `loss/validation/step_average` + `loss/validation/step_divergence` (minus the training
  average) at the step, or `loss/validation/epoch_average` + `..._divergence` at the epoch (TensorBoard step =
  epoch, as upstream), and shown as `val_loss=` on the progress line.

Deliberate differences: the training and validation images are disjoint (upstream's rounding can put one image
in both); each logged average is that of one validation pass (upstream's first epoch averages all passes so far);
FLUX validates at the fixed timesteps (upstream's FLUX path ignores them and draws random sigmas); a metadata_file
(fine-tune) subset is not split (upstream validates on the whole of it).
"""
from __future__ import annotations

import argparse
import logging
import random

import numpy as np
import torch

logger = logging.getLogger(__name__)

NUM_VALIDATION_TIMESTEPS = 4


def add_validation_arguments(parser: argparse.ArgumentParser) -> None:
    """The LoRA trainers (upstream: train_network.py, sdxl_train_network.py, flux_train_network.py)."""
    g = parser.add_argument_group("validation")
    g.add_argument("--validation_seed", type=int, default=None,
                   help="seed of the validation split and of the validation noise (default: --seed)")
    g.add_argument("--validation_split", type=float, default=0.0,
                   help="share of the training images held out for the validation loss (0 = none)")
    g.add_argument("--validate_every_n_steps", type=int, default=None,
                   help="compute the validation loss every N steps (besides every epoch)")
    g.add_argument("--validate_every_n_epochs", type=int, default=None,
                   help="compute the validation loss every N epochs (default: every epoch)")
    g.add_argument("--max_validation_steps", type=int, default=None,
                   help="at most this many validation batches per validation (default: all)")


def check_validation_args(args, error_cls) -> None:
    if not hasattr(args, "validate_every_n_steps"):
        return
    if not 0.0 <= args.validation_split < 1.0:
        raise error_cls(f"--validation_split must be at least 0 and below 1, got {args.validation_split}")
    for name in ("validate_every_n_steps", "validate_every_n_epochs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise error_cls(f"--{name} must be 1 or more, got {value}")
    if args.max_validation_steps is not None and args.max_validation_steps < 0:
        raise error_cls(f"--max_validation_steps must be 0 or more, got {args.max_validation_steps}")


# ---------------------------------------------------------------------------------------------------------------
# the split (called by config_util while it scans the dataset)


def split_images(images: list, split: float, seed: int | None) -> tuple[list, list]:
    """(train, validation): round(n * split) images, picked by a shuffle seeded with `seed`, are held out;
    the training images keep their order."""
    if not split or not images:
        return images, []
    order = list(images)
    random.Random(seed).shuffle(order)
    n_val = round(len(order) * split)
    held = {id(im) for im in order[len(order) - n_val:]}
    return [im for im in images if id(im) not in held], [im for im in order if id(im) in held]


# ---------------------------------------------------------------------------------------------------------------
# the validation loss


def validation_timesteps(args, num_train_timesteps: int = 1000) -> list[int]:
    t_min = args.min_timestep if getattr(args, "min_timestep", None) is not None else 0
    t_max = args.max_timestep if getattr(args, "max_timestep", None) is not None else num_train_timesteps
    return [int(t) for t in np.linspace(t_min, t_max, NUM_VALIDATION_TIMESTEPS + 2, dtype=int)[1:-1]]


class Validator:
    """Runs the validation passes of one training run (on every process: the dataloader is sharded)."""

    def __init__(self, args, dataloader, seed: int, num_train_timesteps: int = 1000):
        self.args = args
        self.dataloader = dataloader
        n = len(dataloader)
        self.max_batches = min(args.max_validation_steps, n) if args.max_validation_steps is not None else n
        self.timesteps = validation_timesteps(args, num_train_timesteps)
        self.seed = args.validation_seed if args.validation_seed is not None else seed
        self.last_loss: float | None = None

    def due_after_step(self, global_step: int) -> bool:
        every = self.args.validate_every_n_steps
        return bool(every) and self.max_batches > 0 and global_step % every == 0

    def due_after_epoch(self, epoch: int) -> bool:
        every = self.args.validate_every_n_epochs
        return self.max_batches > 0 and (every is None or epoch % every == 0)

    def run(self, loss_fn, models, trainer, accelerator) -> float:
        """loss_fn(batch, timestep) -> scalar loss; called without gradients, `models` in eval mode, the
        trainer's noise generator and the global RNGs seeded with the validation seed (all restored after)."""
        device = accelerator.device
        modes = [m.training for m in models]
        saved_generator = trainer.noise_generator
        py_state = random.getstate()
        total = torch.zeros((), device=device)
        count = 0
        cuda = [device] if device.type == "cuda" else []
        try:
            for m in models:
                m.eval()
            with torch.random.fork_rng(devices=cuda), torch.no_grad():
                torch.manual_seed(self.seed)
                random.seed(self.seed)
                trainer.noise_generator = torch.Generator(device=device).manual_seed(self.seed)
                for i, batch in enumerate(self.dataloader):
                    if i >= self.max_batches:
                        break
                    for t in self.timesteps:
                        total += loss_fn(batch, t).detach().float()
                        count += 1
        finally:
            trainer.noise_generator = saved_generator
            random.setstate(py_state)
            for m, mode in zip(models, modes):
                m.train(mode)
        stats = torch.stack([total, torch.tensor(float(count), device=device)])
        if accelerator.num_processes > 1:
            stats = accelerator.reduce(stats, "sum")
        self.last_loss = float((stats[0] / stats[1].clamp(min=1)).item())
        return self.last_loss

    def report(self, accelerator, loss: float, train_average: float, *, global_step: int, epoch: int,
               at_epoch_end: bool) -> None:
        """Logs the pass (log line and trackers)."""
        kind = "epoch" if at_epoch_end else "step"
        logger.info("validation after %s %d: val_loss=%.4f (%d batches x %d timesteps)", kind,
                    epoch if at_epoch_end else global_step, loss, self.max_batches, len(self.timesteps))
        logs = {f"loss/validation/{kind}_average": loss, f"loss/validation/{kind}_divergence": loss - train_average}
        log_to_trackers(accelerator, logs, epoch if at_epoch_end else global_step, global_step, epoch)


def log_to_trackers(accelerator, logs: dict, step_value: int, global_step: int, epoch: int) -> None:
    """upstream's accelerator_logging: TensorBoard (and others) at `step_value`; wandb without a step, with
    global_step and epoch in the record (its step must only grow)."""
    if not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            tracker.log({**logs, "global_step": global_step, "epoch": epoch})
        else:
            tracker.log(logs, step=step_value)


def build_validator(args, val_group, accelerator, make_loader, seed: int, num_train_timesteps: int = 1000):
    """The Validator of a run, or None (no --validation_split, nothing held out, or a trainer without the
    validation options: upstream's full trainers split the dataset config's images but never validate)."""
    if val_group is None or len(val_group) == 0:
        return None
    if not hasattr(args, "validate_every_n_steps"):
        logger.warning("validation_split holds %d images out of training; this script computes no validation "
                       "loss (as kohya-ss/sd-scripts)", val_group.num_train_images)
        return None
    val_group.set_current_epoch(1)  # the same batches at every validation
    loader = accelerator.prepare(make_loader(val_group))
    logger.info("validation: %d images with repeats, %d batches, timesteps %s", val_group.num_train_images,
                len(loader), validation_timesteps(args, num_train_timesteps))
    return Validator(args, loader, seed, num_train_timesteps)


def metadata(args, val_group) -> dict:
    """The ss_* keys upstream writes for validation (LoRA trainers)."""
    if not hasattr(args, "validate_every_n_steps"):
        return {}
    return {
        "ss_num_validation_images": val_group.num_train_images if val_group is not None else 0,
        "ss_validation_seed": args.validation_seed,
        "ss_validation_split": args.validation_split,
        "ss_max_validation_steps": args.max_validation_steps,
        "ss_validate_every_n_epochs": args.validate_every_n_epochs,
        "ss_validate_every_n_steps": args.validate_every_n_steps,
    }

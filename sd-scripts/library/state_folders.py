"""`-state` folders (--save_state) that a kill can never leave half-written, and --resume checks made before any
model loads (issue 14; upstream writes the folder in place and checks nothing).

    write_state(accelerator, path, overwrite)       accelerate's save_state into library.files' work folder beside
                                                    `path`, renamed to `path` when complete; an existing folder is
                                                    replaced only then
    remove_stale(output_dir, output_name)           work folders of killed writers (at the start of a run)
    check_resume(args, ext)                         before loading: --resume is a state folder, and the names the
                                                    resumed run will write are free (else OutputExistsError)
    resumed_position(folder) -> (step, epoch) | None   read from the folder's step counter, without the models
"""
from __future__ import annotations

import glob
import logging
import os
import re
import shutil

from library import files, train_util

logger = logging.getLogger(__name__)


def write_state(accelerator, path: str, overwrite: bool, save=None) -> None:
    """Every process calls it (each writes its RNG file into the same temporary folder, library.files' work
    folder with a name every process knows); the main process renames it into place when all are done.
    `save(accelerator, folder)` writes the state instead of accelerate's save_state (--fsdp: library.sharding)."""
    work = files.work_folder(path, shared=True)
    tmp = os.path.join(work, os.path.basename(os.path.normpath(path)))
    if accelerator.is_main_process:
        files.ensure_can_write(path, overwrite)
        shutil.rmtree(work, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        with files.explained_write_errors(path):
            save(accelerator, tmp) if save is not None else accelerator.save_state(tmp)
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                files.commit(tmp, path, work)
    finally:  # a failed or stopped save (second Ctrl+C) leaves the earlier folder and no partial one
        if accelerator.is_main_process:
            shutil.rmtree(work, ignore_errors=True)
    accelerator.wait_for_everyone()


def remove_stale(output_dir: str, output_name: str) -> None:
    """What a killed run of `output_name` left in `output_dir` and its sample folder: library.files' work folders
    of its results (model files or folders, step / epoch saves, state folders, run TOMLs, samples; not those of
    another run such as `<output_name>_v2`); a state folder that was being replaced when the kill came is put
    back."""
    name = re.escape(output_name)
    results = re.compile(name + r"(-(step)?\d+)?(-state|_config\.toml|\.\w+)?")
    samples = re.compile(name + r"_e?\d+_\d+_\d+(_\d+)?\.png")
    for folder, ours in ((output_dir, results), (os.path.join(output_dir, "sample"), samples)):
        for path in files.remove_stale(folder, ours):
            logger.info("removed %s (left by a killed run)", path)


def resumed_position(folder: str) -> tuple[int, int] | None:
    """The step counter (library.run.state.TrainState) is the last checkpoint object registered, so accelerate
    writes it as the custom_checkpoint_<highest>.pkl; None when that is not it."""
    import torch

    found = glob.glob(os.path.join(glob.escape(folder), "custom_checkpoint_*.pkl"))
    if not found:
        return None
    last = max(found, key=lambda p: int(re.search(r"_(\d+)\.pkl$", p).group(1)))
    try:
        state = torch.load(last, map_location="cpu", weights_only=True)
        return int(state["global_step"]), int(state["epoch"])
    except Exception:  # noqa: BLE001 - not our step counter: no position
        return None


def check_resume(args, ext: str) -> None:
    """Before any model loads. A local --resume folder (train_util checks it exists) must hold our step counter;
    without --overwrite_output the names the resumed run will write must be free: the final `-state` folder (with
    --save_state / --save_state_on_train_end) and the step / epoch saves after the resumed position."""
    from library.errors import TrainingError

    if not args.resume or getattr(args, "resume_from_huggingface", False):
        return
    position = resumed_position(args.resume)
    if position is None:
        raise TrainingError(f"--resume {args.resume}: not a training state folder written with --save_state "
                            "(no step counter in it)")
    from library import sharding

    kind_problem = sharding.check_resume(args, args.resume)
    if kind_problem:
        raise TrainingError(kind_problem)
    if args.overwrite_output or not os.path.isdir(args.output_dir):
        return
    step, epoch = position
    name, out = args.output_name, args.output_dir
    saves_state = bool(args.save_state)
    taken = []
    if saves_state or getattr(args, "save_state_on_train_end", False):
        taken.append(train_util.state_dir_name(name))
    pattern = re.compile(re.escape(name) + r"-(step)?(\d+)(" + re.escape(ext) + r"|-state)")
    for n in sorted(os.listdir(out)):
        m = pattern.fullmatch(n)
        if not m or (m.group(3) == "-state" and not saves_state):
            continue
        no = int(m.group(2))
        every = args.save_every_n_steps if m.group(1) else args.save_every_n_epochs
        if every and no % every == 0 and no > (step if m.group(1) else epoch):
            taken.append(n)
    taken = [n for n in taken if os.path.exists(os.path.join(out, n))]
    if taken:
        raise train_util.OutputExistsError(
            f"--resume would write {', '.join(taken[:3])}{', ...' if len(taken) > 3 else ''} in {out}, which "
            "already exist; choose another --output_name / --output_dir, or pass --overwrite_output to replace them")


# the global RNG states as --resume restored them, until the first resumed step (restore_resumed_rng)
_resumed_rng: list = []


def _rng_states() -> tuple:
    import random

    import numpy as np
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def restore_resumed_rng() -> None:
    """At the start of each step (a no-op but the first after --resume): the global RNG states (what dropout,
    rank / module dropout draw from) as the state folder holds them. accelerate restores them in load_state, but
    the resumed run then draws from them before its first step (the resumed epoch's data loader takes a seed)
    where the saved run did not, so the dropout masks would differ from the uninterrupted run's."""
    if not _resumed_rng:
        return
    import random

    import numpy as np
    import torch

    cpu, cuda, py, np_state = _resumed_rng.pop()
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(np_state)


def load_state(accelerator, folder: str, steps_per_epoch: int | None = None, load=None) -> None:
    """--resume: accelerate's load_state; a state saved in the middle of an epoch has its RNG states set again at
    the first resumed step (restore_resumed_rng; at an epoch's end the saved run drew the next epoch's data loader
    seed after the save, as the resumed run does). A state saved by a run with another network (its --network_dim,
    --conv_dim, --network_module or --network_args) is one line naming the first difference, not a traceback.
    `load(accelerator, folder)` reads it instead of accelerate's load_state (--fsdp: library.sharding)."""
    from library.errors import TrainingError

    try:
        load(accelerator, folder) if load is not None else accelerator.load_state(folder)
        position = resumed_position(folder)
        mid_epoch = bool(steps_per_epoch) and position is not None and position[0] % steps_per_epoch != 0
        _resumed_rng[:] = [_rng_states()] if mid_epoch else []
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines()]
        first = next((ln for ln in lines if ln.startswith(("size mismatch", "Missing key", "Unexpected key"))), None)
        if first is None:
            raise
        raise TrainingError(f"--resume {folder}: the state was saved by a run with another network (--network_dim, "
                            f"--conv_dim, --network_module or --network_args differ): {first[:300]}; resume with "
                            "that run's network options") from None

"""The training loop: epochs and steps. Setup (library.run.setup) builds the run state; each micro-step is
library.run.step; after each optimizer step and each epoch the step events (library.run.events) that are due
run; the end saves the result."""
from __future__ import annotations

import logging
import os
import sys

import torch

from library import data_parallel, huggingface_util, saving, state_folders, stop_signal, train_util
from library.late_loss import LateLosses
from library.run import events, setup
from library.run.step import MicroStep
from library.step_timer import StepTimer

logger = logging.getLogger(__name__)


def train(trainer, args) -> str | None:
    """Runs the training; returns the path of the final result. SIGTERM / Ctrl+C during the loop stop it after
    the current step, with the results saved (library.stop_signal)."""
    stop = stop_signal.StopRequest()
    startup = setup.Startup(stop=stop)
    try:
        state = setup.prepare(trainer, args, startup)
        if isinstance(state, setup.Done):
            return state.result
        state.stop = stop
        trainer.state = state  # tests and benchmarks read the run's losses here
        run_epochs(state, lambda: startup.__setattr__("training_started", True))
        return finish(state)
    except BaseException:
        path = startup.run_config_path
        if path and not startup.training_started and os.path.exists(path):
            os.remove(path)  # a run that never trained leaves no settings file behind
        raise
    finally:
        stop.restore()  # the handlers before this run (callers in the same process are unaffected)


def run_epochs(state, started) -> None:
    from tqdm.auto import tqdm

    args, accelerator = state.args, state.accelerator
    bar = tqdm(total=state.max_train_steps, initial=state.global_step, smoothing=0,
               disable=not accelerator.is_local_main_process, desc="steps", file=sys.stderr)
    late = LateLosses(state.device)
    micro_step = MicroStep(state, late)
    state.timer = StepTimer(state.global_step, setup_steps_per_shape=micro_step.setup_steps_per_shape(args))
    after = events.step_events(bar, train_util.ProgressLine(state.max_train_steps, state.num_epochs,
                                                            start_step=state.global_step), late)
    state.reporter = next(e for e in after if isinstance(e, events.Progress))
    if args.sample_at_first:
        events.sample_images(state, epoch=None)
    if state.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(state.device)  # the summary's peak: the loop's, not loading's
    state.stop.install()
    started()
    for epoch in range(state.first_epoch, state.num_epochs):
        if state.global_step >= state.max_train_steps or state.stopping:
            break
        state.epoch = epoch
        start_epoch(state)
        for batch in epoch_batches(state):
            state_folders.restore_resumed_rng()  # --resume: dropout's RNG as saved at a mid-epoch state
            if not micro_step(state, batch):
                continue
            state.global_step += 1
            for g in state.groups:  # for the batches loaded from now on (token warm-up)
                g.set_current_step(state.global_step)
            state.checkpoint.global_step, state.checkpoint.epoch = state.global_step, epoch
            run_due(after, state, at_epoch_end=False)
            if state.global_step >= state.max_train_steps or state.stopping:
                break
        state.pause()
        if state.stopping:
            break  # mid-epoch: no epoch-end save, sample or validation
        state.checkpoint.epoch = state.done_epoch
        run_due(after, state, at_epoch_end=True)
    bar.close()
    micro_step.graphs = None  # the step graphs go now, before the process group (NCCL cannot destroy a communicator
    # that live CUDA graphs captured) and before the final save (their memory pool)


def start_epoch(state) -> None:
    state.group.set_current_epoch(state.epoch + 1)
    for g in state.groups:
        g.set_current_step(state.global_step)
    trainer = state.trainer
    trainer.target.on_epoch_start(state.args, trainer.family, state.trainable, state.components)
    state.timer.restart()  # epoch-end saves and samples are not step time


def epoch_batches(state):
    """The epoch's batches; a resumed run skips those of its first epoch that were trained."""
    if not state.skip_batches:
        return state.dataloader
    from accelerate import skip_first_batches

    skip, state.skip_batches = state.skip_batches, 0
    return skip_first_batches(state.dataloader, skip)


def run_due(after: list, state, *, at_epoch_end: bool) -> None:
    state.at_epoch_end = at_epoch_end
    for event in after:
        if event.due(state):
            event.run(state)
    state.asked, state.paused = set(), False


def finish(state) -> str:
    """The summary line, the final save (+ -state), the uploads, the stop line."""
    args, accelerator, trainer = state.args, state.accelerator, state.trainer
    on_gpu = state.device.type == "cuda"
    summary = state.timer.summary(torch.cuda.max_memory_allocated(state.device) if on_gpu else None)
    if summary and accelerator.is_main_process:
        print(summary, flush=True)  # stdout, under the last progress line
    data_parallel.log_process_done(accelerator, state.global_step, state.last_loss, state.trained_params)
    final_epoch = max(state.checkpoint.epoch, 1)
    final_path = state.final_path
    accelerator.wait_for_everyone()
    with trainer.eval_weights(state):
        with trainer.full_weights(state):
            if accelerator.is_main_process:
                with saving.explained_save_errors(final_path):
                    trainer.save_model(state, final_path, final_epoch, state.global_step)
        if accelerator.is_main_process:
            huggingface_util.upload(args, final_path, os.path.basename(final_path), force_sync=True)
        if args.save_state or args.save_state_on_train_end:
            trainer.save_state(args, accelerator, train_util.state_dir_name(args.output_name))
    huggingface_util.wait_for_uploads()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    logger.info("model saved: %s", final_path)
    events.stopped(state)
    return final_path

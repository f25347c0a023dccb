"""After-a-step and after-an-epoch events. Each is an object with `due(state) -> bool` and `run(state)`; the loop
(library.run.loop) asks every event of its list in order after each optimizer step (`state.at_epoch_end` False)
and after each epoch (True). A new after-a-step feature is a new class here, added to `step_events()`.

Events that do work outside the step (validation, saving, sampling) read every pending loss first
(`state.pause()`) and restart the step timer after (`state.resume()`), so the summary's step times stay step times.
"""
from __future__ import annotations

import logging
import os
import sys
import time

from library import finite_guard, optimizers, stop_signal
from library.ema import EMAUpdate

logger = logging.getLogger(__name__)


class StepTiming:
    """The step's wall-clock time (library.step_timer), with the input shapes of its micro-steps."""

    def due(self, state) -> bool:
        return not state.at_epoch_end

    def run(self, state) -> None:
        state.timer.step_done(state.step_shapes)
        state.step_shapes = []


class CompileReport:
    """With --compile, one log line after the run's second step (the compile, and with CUDA graphs their
    recording, are done by then): the graphs dynamo traced and how many the persistent compile cache served
    (library.compile.environment.compile_cache_report), so a warm restart shows whether it was warm."""

    def __init__(self):
        self.done = False

    def due(self, state) -> bool:
        return (not self.done and not state.at_epoch_end and bool(getattr(state.args, "compile", False))
                and state.timer is not None and len(state.timer.durations) >= 2)

    def run(self, state) -> None:
        from library.compile.environment import compile_cache_report

        self.done = True
        accelerator = getattr(state, "accelerator", None)
        if accelerator is not None and not accelerator.is_main_process:  # one line a run, as the progress
            return
        if report := compile_cache_report():
            logger.info("torch.compile after step %d: %s", state.global_step, report)


class Progress:
    """The progress line, bar and tracker logs of each step, written once the step's loss is read (a step
    later: library.late_loss), under the step's own number and with its learning rates."""

    def __init__(self, progress_bar, line, late):
        self.bar, self.line, self.late = progress_bar, line, late

    def due(self, state) -> bool:
        return not state.at_epoch_end

    def run(self, state) -> None:
        self.bar.update(1)
        logs = dict(state.norm_logs)
        if state.log_with:  # this step's learning rates, logged with its loss once that is read
            names = state.trainable.lr_descriptions
            for i, g_lr in enumerate(state.lr_scheduler.get_last_lr()):
                logs[f"lr/{names[i]}" if names and i < len(names) else f"lr/group{i}"] = g_lr
            logs.update(optimizers.d_lr_logs(state.optimizers, names))
        record = (state.global_step, state.epoch, state.lr_scheduler.get_last_lr()[0], state.norm_postfix, logs)
        self.report(state, self.late.step_done(record))

    def report(self, state, ready) -> None:
        args, accelerator = state.args, state.accelerator
        for (step, step_epoch, lr, postfix, logs), values in ready:
            finite_guard.check_losses(args, step, values)  # a NaN / inf loss: stop, no save (issue 26)
            state.losses.extend(values)
            state.last_loss = values[-1]
            window = state.losses[-state.steps_per_epoch * args.gradient_accumulation_steps:]
            state.avr_loss = sum(window) / len(window)
            self.bar.set_postfix(loss=f"{state.last_loss:.4f}", avr_loss=f"{state.avr_loss:.4f}", lr=f"{lr:.2e}",
                                 **postfix)
            if accelerator.is_main_process and self.line.should_print(step):
                validation = state.validator.last_loss if state.validator else None
                self.bar.write(self.line.format(step, state.last_loss, state.avr_loss, lr, step_epoch + 1, validation),
                               file=sys.stdout)
                sys.stdout.flush()
            if state.log_with:
                logs = {k: float(v) if isinstance(v, optimizers.LateValue) else v for k, v in logs.items()}
                accelerator.log({"loss/current": state.last_loss, "loss/average": state.avr_loss, **logs}, step=step)

    def flush(self, state) -> None:
        """Reads every pending loss (waits for the GPU); the wait is the last step's time, not the pause's."""
        self.report(state, self.late.flush())
        state.timer.waited()


class RankProgress:
    """With several processes, every process (rank 0 too) prints its own line, besides rank 0's usual progress line
    (unchanged), so a run's panel shows each rank and which one falls behind or ends (kohya_gui.runner parses it):

        rank 1/2 (pid 4242): step 12/100, 0.532 s/step, peak GPU memory 7.11 GiB

    On the first and the last step and at most once per INTERVAL_S between. The step time is the mean of the steps
    since the rank's last line (library.step_timer: pauses for saves and samples left out); the memory is the
    loop's peak of allocated GPU memory, or the process's peak resident memory (RSS) on the CPU."""

    INTERVAL_S = 5.0

    def __init__(self, progress_bar):
        self.bar = progress_bar
        self.last_print, self.timed = None, 0  # when the last line was printed; durations it covered

    def due(self, state) -> bool:
        return not state.at_epoch_end and state.accelerator.num_processes > 1

    def run(self, state) -> None:
        now = time.monotonic()
        step, last = state.global_step, state.global_step >= state.max_train_steps
        if self.last_print is not None and not last and now - self.last_print < self.INTERVAL_S:
            return
        self.last_print = now
        durations = state.timer.durations[self.timed:]
        self.timed = len(state.timer.durations)
        step_s = sum(durations) / len(durations) if durations else 0.0
        self.bar.write(self.line(state.accelerator, step, state.max_train_steps, step_s, state.device),
                       file=sys.stdout)
        sys.stdout.flush()

    @staticmethod
    def line(accelerator, step: int, total: int, step_s: float, device) -> str:
        memory = ""
        if device.type == "cuda":
            import torch

            memory = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
        else:
            try:
                import resource  # POSIX; ru_maxrss in KiB on Linux, bytes on macOS

                rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                memory = f", peak RSS {rss / (2**30 if sys.platform == 'darwin' else 2**20):.2f} GiB"
            except ImportError:
                pass
        return (f"rank {accelerator.process_index}/{accelerator.num_processes} (pid {os.getpid()}): step {step}/{total}, "
                f"{step_s:.3f} s/step{memory}")


class Validate:
    """Validation loss (library.validation) every --validate_every_n_steps / _epochs."""

    def due(self, state) -> bool:
        v = state.validator
        if v is None:
            return False
        return v.due_after_epoch(state.done_epoch) if state.at_epoch_end else v.due_after_step(state.global_step)

    def run(self, state) -> None:
        if not state.at_epoch_end:
            state.pause()
        loss = state.trainer.validation_loss(state)
        state.validator.report(state.accelerator, loss, state.avr_loss, global_step=state.global_step,
                               epoch=state.done_epoch, at_epoch_end=state.at_epoch_end)
        if not state.at_epoch_end:
            state.resume()


class TakeRequests:
    """Save now / Sample now / Stop from outside (library.run_requests; a stop signal counts as "stop"), once per
    step on every rank (the ranks agree on the answer)."""

    def due(self, state) -> bool:
        return not state.at_epoch_end

    def run(self, state) -> None:
        state.asked = state.requests.take(state.accelerator, stop_flag=state.stop.flag)


class Save:
    """The step / epoch saves (--save_every_n_steps / _epochs, old ones pruned by --save_last_n_*) and Save now
    (not pruned)."""

    def due(self, state) -> bool:
        args = state.args
        if state.at_epoch_end:
            return bool(args.save_every_n_epochs) and state.done_epoch % args.save_every_n_epochs == 0 \
                and state.done_epoch < state.num_epochs and state.global_step < state.max_train_steps
        return self._scheduled(state) or "save" in state.asked

    @staticmethod
    def _scheduled(state) -> bool:
        every = state.args.save_every_n_steps  # the last step too, as upstream
        return bool(every) and state.global_step % every == 0

    def run(self, state) -> None:
        if state.at_epoch_end:
            save_checkpoint(state, by_step=False)
            return
        state.pause()
        scheduled = self._scheduled(state)
        if not scheduled:
            logger.info("save requested: saving at step %d", state.global_step)
        save_checkpoint(state, by_step=True, prune=scheduled)
        state.resume()


class Sample:
    """Sample images (--sample_every_n_steps / _epochs) and Sample now."""

    def due(self, state) -> bool:
        return self._scheduled(state) or (not state.at_epoch_end and "sample" in state.asked)

    @staticmethod
    def _scheduled(state) -> bool:
        from library.sampling import should_sample

        if state.at_epoch_end:
            return should_sample(state.args, epoch=state.done_epoch, steps=state.global_step)
        return should_sample(state.args, epoch=None, steps=state.global_step)

    def run(self, state) -> None:
        epoch = state.done_epoch if state.at_epoch_end else None
        if state.at_epoch_end:
            sample_images(state, epoch=epoch)
            return
        state.pause()
        if not self._scheduled(state):
            logger.info("sample requested: sampling at step %d" if state.args.sample_prompts else
                        "sample requested at step %d, but there is no --sample_prompts file", state.global_step)
        sample_images(state, epoch=epoch)
        state.resume()


class Stop:
    """A Stop request (or signal): the run stops after this step and saves the usual final names. Not at the last
    step, which ends the run anyway."""

    def due(self, state) -> bool:
        return not state.at_epoch_end and "stop" in state.asked and state.global_step < state.max_train_steps

    def run(self, state) -> None:
        if not state.stop.flag:
            logger.warning("stop requested: stopping after step %d and saving", state.global_step)
        state.stop.flag = state.stopping = True


class StopAfterPause:
    """A stop signal that came while this step's save, samples or validation paused the loop (seconds): the ranks
    agree on it now, so the run stops after this step, not one step later."""

    def due(self, state) -> bool:
        return not state.at_epoch_end and state.paused

    def run(self, state) -> None:
        if state.requests.stop_agreed(state.accelerator, state.stop.flag):
            state.asked.add("stop")


class EpochLoss:
    """The tracker's loss/epoch: the mean loss of the epoch's batches."""

    def due(self, state) -> bool:
        return state.at_epoch_end and bool(state.log_with)

    def run(self, state) -> None:
        last = state.losses[-state.num_batches:]
        state.accelerator.log({"loss/epoch": sum(last) / max(1, len(last))}, step=state.global_step)


def save_checkpoint(state, *, by_step: bool, prune: bool = True) -> None:
    state.trainer.save_checkpoint(state, state.done_epoch, state.global_step, by_step=by_step, prune=prune)


def sample_images(state, *, epoch: int | None) -> None:
    state.trainer.sample_images(state, epoch=epoch)


def step_events(progress_bar, line, late) -> list:
    """The events of a run, in the order they run: timing and progress first (the step's record), then the work
    that pauses training, then Stop (it ends the loop after the step, once the rest has run)."""
    return [StepTiming(), CompileReport(), Progress(progress_bar, line, late), RankProgress(progress_bar), EMAUpdate(), Validate(), EpochLoss(), TakeRequests(),
            Save(), Sample(), StopAfterPause(), Stop()]


def stopped(state) -> None:
    """The `stopped at step N, saved <path>` line the GUI waits for (main process)."""
    if state.stop.flag and state.accelerator.is_main_process:
        line = stop_signal.stopped_line(state.global_step, state.final_path)
        logger.info("%s", line)
        print(line, flush=True)

"""Stop = save and stop: SIGTERM / Ctrl+C during training ask the loop to finish its current step, save the
results under their usual final names and exit 0 (not in upstream, which dies and loses the steps since the last
save; kohya_ss#244).

    stop = StopRequest()               # at the start of train(): a signal from now on ends the run before it
                                       # trains (StoppedBeforeTraining: exit 0, nothing saved; the run's settings
                                       # file is removed on the way out)
    stop.install()                     # at the start of the training loop: from now on a signal = stop and save
    ... if stop.flag: break                        # once per optimizer step (the ranks agree through
                                                   # library.run_requests, with the other requests)
    stop.restore()                     # the previous handlers again (in-process callers are unaffected)

A second signal (stop now) raises KeyboardInterrupt where the run is, also in the middle of a save: every result
goes through a temporary name and a rename (train_util.atomic_target, library.state_folders), so an aborted save
leaves the earlier files and no broken one. A repeat within REPEAT_WINDOW_S of the first is the same stop
reaching the process twice (a tree-wide SIGTERM plus the one a launcher forwards) and is ignored. A first signal
during the final save only lets it finish.

`accelerate launch` does not forward signals: SIGTERM to the launcher alone ends it and leaves the trainer
orphaned. So a trainer started by it (ACCELERATE_DYNAMO_BACKEND in its environment, which `accelerate launch` sets)
notes its parent process when the run starts, and `flag` turns on once its parent has changed (one getppid call per
read): the launcher ended, the trainer stops and saves as for a signal.

Windows: Ctrl+C (SIGINT) and Ctrl+Break (SIGBREAK) are handled; SIGTERM is not delivered there (another process
ending it calls TerminateProcess, which cannot be caught), so a stop from outside a console has to send
CTRL_BREAK_EVENT to a process started with CREATE_NEW_PROCESS_GROUP.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)

# At exit the interpreter's garbage collection over everything a trainer loaded (torch, transformers, the models'
# modules) took 5-10 s after the last line (2-core machine); Stop waits for the processes to end and kills what is
# left `grace` seconds after the stop line. Frozen objects are skipped by it; memory is released at exit anyway.
atexit.register(gc.freeze)

# a second signal sooner than this after the first is taken as the same stop, delivered twice
REPEAT_WINDOW_S = 2.0

# the signals that mean "stop and save"; SIGBREAK exists only on Windows
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGBREAK") if hasattr(signal, name))

# set by `accelerate launch` for the processes it starts
LAUNCHER_ENV = "ACCELERATE_DYNAMO_BACKEND"


class StoppedBeforeTraining(SystemExit):
    """A stop signal before the training loop: nothing to save; the run ends with exit status 0."""

    def __init__(self, signal_name: str):
        super().__init__(0)
        self.signal_name = signal_name


class StopRequest:
    def __init__(self, environ=os.environ):
        self._flag = False
        self.signal_name: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._parent = os.getppid() if LAUNCHER_ENV in environ and hasattr(os, "getppid") else None
        self._held: list | None = None  # inside held(): the stop signals that came, answered at its end
        self._set_handlers(self._handle_before_training)

    @property
    def flag(self) -> bool:
        """A stop was asked: a signal, or the launcher that started this process has ended."""
        if not self._flag and self._parent is not None and os.getppid() != self._parent:
            self._flag = True
            self._first_at = time.monotonic()
            self.signal_name = "launcher ended"
            logger.warning("the launcher (accelerate launch, process %d) has ended: stopping after the current "
                           "step and saving", self._parent)
        return self._flag

    @flag.setter
    def flag(self, value: bool) -> None:
        self._flag = value

    def install(self) -> "StopRequest":
        """From now on (the training loop) a signal = stop after the current step and save."""
        self._set_handlers(self._handle)
        return self

    @contextlib.contextmanager
    def held(self):
        """Before training: a stop signal that comes inside this block is answered at its end, so that what the block
        writes is known to the caller's clean-up (the settings file is written and its path kept as one step)."""
        self._held = []
        try:
            yield
        finally:
            came, self._held = self._held, None
            if came:
                self._handle_before_training(came[0], None)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _set_handlers(self, handler) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works only there (a GUI thread running a trainer keeps its handlers)
        for sig in STOP_SIGNALS:
            try:
                previous = signal.signal(sig, handler)
            except (OSError, ValueError):  # pragma: no cover - a signal this platform refuses
                continue
            self._previous.setdefault(sig, previous)

    def _handle_before_training(self, signum, frame) -> None:
        if self._held is not None:
            self._held.append(signum)
            return
        name = signal.Signals(signum).name
        logger.warning("%s received before training started: stopping; nothing trained, nothing saved", name)
        print(f"stopped before training started ({name}): nothing saved", flush=True)
        raise StoppedBeforeTraining(name)

    def _handle(self, signum, frame) -> None:
        if self._flag:
            if time.monotonic() - self._first_at < REPEAT_WINDOW_S:
                return  # the same stop delivered twice
            raise KeyboardInterrupt  # stop now; the atomic writers remove their temporary files on the way out
        self._flag = True
        self._first_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name
        logger.warning("%s received: stopping after the current step and saving (send it again to stop at once)",
                       self.signal_name)


def stopped_line(step: int, path: str) -> str:
    return f"stopped at step {step}, saved {path}"

"""Stop = save and stop: SIGTERM / Ctrl+C during training ask the loop to finish its current step, save the
results under their usual final names and exit 0 (not in upstream, which dies and loses the steps since the last
save; kohya_ss#244).

    stop = StopRequest().install()     # at the start of the training loop (main thread only; else a no-op)
    ... if stop.flag: break                        # once per optimizer step (the ranks agree through
                                                   # library.run_requests, with the other requests)
    stop.restore()                     # the previous handlers again (in-process callers are unaffected)

A second signal (stop now) raises KeyboardInterrupt where the run is, also in the middle of a save: every result
goes through a temporary name and a rename (train_util.atomic_target, library.state_folders), so an aborted save
leaves the earlier files and no broken one. A repeat within REPEAT_WINDOW_S of the first is the same stop
reaching the process twice (a tree-wide SIGTERM plus the one a launcher forwards) and is ignored. Before the loop starts the default handlers are in place (nothing to
save yet); a first signal during the final save only lets it finish.

Windows: Ctrl+C (SIGINT) and Ctrl+Break (SIGBREAK) are handled; SIGTERM is not delivered there (another process
ending it calls TerminateProcess, which cannot be caught), so a stop from outside a console has to send
CTRL_BREAK_EVENT to a process started with CREATE_NEW_PROCESS_GROUP.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

logger = logging.getLogger(__name__)

# a second signal sooner than this after the first is taken as the same stop, delivered twice
REPEAT_WINDOW_S = 2.0

# the signals that mean "stop and save"; SIGBREAK exists only on Windows
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGBREAK") if hasattr(signal, name))


class StopRequest:
    def __init__(self):
        self.flag = False
        self.signal_name: str | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def install(self) -> "StopRequest":
        if threading.current_thread() is not threading.main_thread():
            return self  # signal.signal works only there (a GUI thread running a trainer keeps its handlers)
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except (OSError, ValueError):  # pragma: no cover - a signal this platform refuses
                pass
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.flag:
            if time.monotonic() - self._first_at < REPEAT_WINDOW_S:
                return  # the same stop delivered twice
            raise KeyboardInterrupt  # stop now; the atomic writers remove their temporary files on the way out
        self.flag = True
        self._first_at = time.monotonic()
        self.signal_name = signal.Signals(signum).name
        logger.warning("%s received: stopping after the current step and saving (send it again to stop at once)",
                       self.signal_name)


def stopped_line(step: int, path: str) -> str:
    return f"stopped at step {step}, saved {path}"

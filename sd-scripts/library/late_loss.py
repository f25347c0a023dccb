"""Each step's loss is read one step late, so the host never waits for the GPU between steps.

`loss.item()` right after a step makes the host wait until the GPU has finished that step; only then does it load
the next batch and launch its kernels, and the GPU idles for all of the host's per-step work. Here each micro-step's
loss is copied to pinned host memory without blocking, behind an event, and read after the NEXT step has been
queued: by then that copy finished long ago, so reading it does not wait for the step in flight.

Nothing the user sees is lost or relabelled: every value reaches the progress line, the trackers and
`trainer.losses` under its own step number, one step later in time. `flush()` reads everything still pending;
the loop calls it before validation, saving, sampling, an epoch's end and the end of training.
"""
from __future__ import annotations

from collections import deque
from typing import Any

import torch


class LateLosses:
    def __init__(self, device: torch.device | str, lag: int = 1):
        self.cuda = torch.device(device).type == "cuda"
        self.lag = lag
        self._micro: list = []  # (host value, event) of the micro-steps of the step in progress
        self._pending: deque = deque()  # (record, [(host value, event), ...]) per finished step
        self._free: list[torch.Tensor] = []  # pinned buffers to reuse (allocating pinned memory is slow)

    def add(self, loss: torch.Tensor) -> None:
        """One micro-step's loss (a scalar tensor); nothing waits here."""
        value = loss.detach()
        if not self.cuda:
            self._micro.append((value.to("cpu", torch.float32, copy=True), None))
            return
        host = self._free.pop() if self._free else torch.empty((), dtype=torch.float32, pin_memory=True)
        host.copy_(value, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._micro.append((host, event))

    def step_done(self, record: Any) -> list[tuple[Any, list[float]]]:
        """Closes the step (its micro-steps' losses belong to `record`); returns the (record, losses) of the steps
        that are now `lag` steps old, oldest first."""
        self._pending.append((record, self._micro))
        self._micro = []
        ready = []
        while len(self._pending) > self.lag:
            ready.append(self._read(*self._pending.popleft()))
        return ready

    def flush(self) -> list[tuple[Any, list[float]]]:
        """Every finished step still pending, oldest first (waits for the GPU)."""
        ready = [self._read(*item) for item in self._pending]
        self._pending.clear()
        return ready

    def _read(self, record, entries) -> tuple[Any, list[float]]:
        values = []
        for host, event in entries:
            if event is not None:
                event.synchronize()
                self._free.append(host)
            values.append(float(host))
        return record, values

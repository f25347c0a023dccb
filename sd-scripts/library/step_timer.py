"""Wall-clock time of each optimizer step, and the summary line every run ends with.

    median step 118.2 ms (steps 11-200); first step 24.1 s, second step 13.0 s

The first step holds the compile (and model warm-up), the second the CUDA-graph recording of the
reduce-overhead modes, so they are reported on their own; the median is taken over the steps after the
warm-up. The loop already waits for each step's loss, so the time between two step ends is the step's time.
"""
from __future__ import annotations

import statistics
import time

# steps left out of the median: the compile, the graph recording and a few steps of allocator warm-up
WARMUP_STEPS = 10


class StepTimer:
    def __init__(self, start_step: int = 0):
        self.start_step = start_step
        self.durations: list[float] = []  # seconds, one per finished step
        self._last = time.perf_counter()

    def restart(self) -> None:
        """Call after work between steps that is not a step (sample images, saving, validation)."""
        self._last = time.perf_counter()

    def step_done(self) -> None:
        now = time.perf_counter()
        self.durations.append(now - self._last)
        self._last = now

    def summary(self) -> str | None:
        n = len(self.durations)
        if n == 0:
            return None
        # leave out the warm-up, but keep at least half of a short run
        skip = min(WARMUP_STEPS, n // 2)
        timed = self.durations[skip:]
        first = self.start_step + skip + 1
        parts = [f"median step {statistics.median(timed) * 1000:.1f} ms (steps {first}-{self.start_step + n})"]
        firsts = [f"{name} step {d:.1f} s" for name, d in zip(("first", "second"), self.durations[:min(2, skip)])]
        if firsts:
            parts.append(", ".join(firsts))
        return "; ".join(parts)

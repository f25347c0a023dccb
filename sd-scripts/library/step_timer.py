"""Wall-clock time of each optimizer step, and the summary line every run ends with.

    median step 118.2 ms (steps 11-200); first step 24.1 s, second step 13.0 s

The first step holds the compile (and model warm-up), the second the CUDA-graph recording of the
reduce-overhead modes, so they are reported on their own; the median is taken over the steps after the
warm-up. The loop reads each step's loss a step late, so the time between two step ends is the step's time; where
it waits for the GPU outside a step (every pending loss read before an epoch ends, a save, a sample), the wait is
added to the last step, whose GPU work it is, before the pause is left out.

With several input shapes (aspect-ratio buckets) each new shape has setup steps of its own: its first step
compiles (or, with shape-generic graphs, runs CUDA graphs' warm-up) and, with CUDA graphs, its second step
records them. The summary then adds their count and total time, and the median is taken over the steps after the
last of them (after the warm-up too):

    median step 171.0 ms (steps 21-40); first step 30.1 s, second step 0.4 s; 4 input shapes: 8 setup steps
    (compile, graph recording) 85.3 s in all

On a GPU the line ends with the training loop's peak of allocated memory ("peak GPU memory 7.11 GiB":
torch.cuda.max_memory_allocated since the loop began, so model loading and caching are not in it; the CUDA
context and the allocator's reserve come on top, as nvidia-smi shows them).
"""
from __future__ import annotations

import statistics
import time
from typing import Hashable, Iterable

# steps left out of the median: the compile, the graph recording and a few steps of allocator warm-up
WARMUP_STEPS = 10


class StepTimer:
    def __init__(self, start_step: int = 0, setup_steps_per_shape: int = 2):
        """setup_steps_per_shape: how many steps at a new input shape are setup (compile, CUDA-graph recording):
        2 with CUDA graphs (warm-up run, then recording), else 1."""
        self.start_step = start_step
        self.setup_steps_per_shape = setup_steps_per_shape
        self.durations: list[float] = []  # seconds, one per finished step
        self.setup: list[bool] = []  # per finished step: one of a shape's setup steps
        self.seen: dict[Hashable, int] = {}  # input shape -> steps that had it
        self._last = time.perf_counter()

    def restart(self) -> None:
        """Call after work between steps that is not a step (sample images, saving, validation)."""
        self._last = time.perf_counter()

    def waited(self) -> None:
        """Call after waiting for the GPU between steps (reading the pending losses): the wait goes to the last step,
        whose GPU work it is (with short epochs, or a step graph that queues a step in a few ms, it is most of it)."""
        now = time.perf_counter()
        if self.durations:
            self.durations[-1] += now - self._last
        self._last = now

    def step_done(self, shapes: Iterable[Hashable] = ()) -> None:
        """shapes: the input shapes of the step's batches (its micro-steps); none when not tracked."""
        now = time.perf_counter()
        self.durations.append(now - self._last)
        self._last = now
        setup = False
        for shape in set(shapes):
            count = self.seen.get(shape, 0)
            setup = setup or count < self.setup_steps_per_shape
            self.seen[shape] = count + 1
        self.setup.append(setup)

    def summary(self, peak_memory_bytes: int | None = None) -> str | None:
        n = len(self.durations)
        if n == 0:
            return None
        # leave out the warm-up, but keep at least half of a short run
        skip = min(WARMUP_STEPS, n // 2)
        setup = self.setup + [False] * (n - len(self.setup))  # durations set directly (tests) carry no shapes
        start = skip
        if len(self.seen) > 1:  # several shapes: the median once every shape has had its setup steps
            last_setup = max((i for i, s in enumerate(setup) if s), default=-1)
            if last_setup + 1 < n:
                start = max(skip, last_setup + 1)
        timed = self.durations[start:]
        first = self.start_step + start + 1
        parts = [f"median step {statistics.median(timed) * 1000:.1f} ms (steps {first}-{self.start_step + n})"]
        firsts = [f"{name} step {d:.1f} s" for name, d in zip(("first", "second"), self.durations[:min(2, skip)])]
        if firsts:
            parts.append(", ".join(firsts))
        if len(self.seen) > 1:
            kinds = "compile, graph recording" if self.setup_steps_per_shape > 1 else "compile"
            setup_times = [d for d, s in zip(self.durations, setup) if s]
            parts.append(f"{len(self.seen)} input shapes: {len(setup_times)} setup steps ({kinds}) "
                         f"{sum(setup_times):.1f} s in all")
        if peak_memory_bytes is not None:
            parts.append(f"peak GPU memory {peak_memory_bytes / 2**30:.2f} GiB")
        return "; ".join(parts)

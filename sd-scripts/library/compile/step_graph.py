"""--cuda_graph_step: the whole training step (forward, loss, backward, gradient clipping, optimizer step) as one
CUDA graph, captured once per batch shape after a few ordinary steps and replayed from then on.

At batch 1-4 an SDXL LoRA step is host-bound: the Python work of a step (the compiled blocks' call wrappers, the
eager layers between them, autograd, clipping and the optimizer's loops over 1,444 tensors) takes longer than the
GPU's work (docs/BENCHMARKS.md). A replayed graph launches all of it with one call, so the step costs what the GPU
needs. With --compile the blocks are compiled as usual, without CUDA graphs of their own (the step graph holds
them).

What a captured graph cannot see is kept equal or out of it:
- the batch's tensors are copied into the graph's own input tensors before each replay; a batch whose tensor
  shapes, dtypes or network multiplier differ gets a graph of its own (up to LIMIT, later ones run uncaptured);
- the learning rates: the optimizer reads them from tensors that are filled from its param groups before each
  replay, so schedulers work as they do without the graph;
- torch's fused AdamW/Adam step inside the graph; other optimizers step after it (most read host values each step:
  bitsandbytes' step counter, Prodigy's and D-Adaptation's adaptive rates, Adafactor's relative step; a Prodigy
  with its numbers on the device was 3x slower inside the graph, docs/BENCHMARKS.md run83): the graph then holds
  forward, backward and clipping, and their step runs the ordinary way after each replay, on the gradients the
  graph wrote (the parameters' .grad are pointed at them again if something cleared them; an optimizer that gives
  a parameter new storage ends the step graphs, since the graph would go on reading the old one);
- the random numbers: the noise generator is registered with each graph, so each replay draws new ones;
- gradient accumulation: a micro-step that ends the window (the optimizer step) and one that does not are two
  graphs of a batch shape, sharing one memory pool; both add into gradient tensors the graphs do not own (made
  before the first capture, .grad pointed at them), which the step zeroes after the optimizer step, in the graph
  or after it;
- a step that cannot be captured (an operation that waits for the host) is run the ordinary way, and the run
  goes on without step graphs after a warning that says why.

On several processes (data parallel) the captured step holds the gradients' all-reduce
(library.data_parallel.all_reduce_gradients, between backward and clipping), so each replay averages them with
the same collectives as an ordinary step: every process runs one step's collectives per step, replayed or not.
"""
from __future__ import annotations

import functools
import logging
from collections import Counter
from typing import Callable

import torch

logger = logging.getLogger(__name__)

WARMUP = 2  # ordinary steps of a batch shape before its capture (compiles, cuBLAS/cuDNN set-up)
LIMIT = 4  # batch shapes with a graph of their own: each keeps its activations' memory for the rest of the run


def _walk(value, key: str = ""):
    """(dotted key, leaf) of a batch: dicts are walked, everything else is a leaf."""
    if isinstance(value, dict):
        for k in sorted(value):
            yield from _walk(value[k], f"{key}.{k}" if key else k)
    else:
        yield key, value


def signature(batch: dict) -> tuple | None:
    """What a captured graph holds fixed about a batch: its tensors' keys, shapes and dtypes, which entries are
    None, and the network multiplier (a float the LoRA modules read on the host). None for a batch that no graph
    may take: samples of differential output preservation (a second forward with the network off)."""
    if any(a.get("diff_output_preservation") for a in batch.get("custom_attributes") or []):
        return None
    parts = []
    for key, value in _walk(batch):
        if isinstance(value, torch.Tensor):
            parts.append((key, tuple(value.shape), value.dtype))
        elif value is None:
            parts.append((key, None))
    multipliers = batch.get("network_multipliers")
    parts.append(("network_multiplier", float(multipliers[0]) if multipliers is not None and len(multipliers)
                  else None))
    return tuple(parts)


def _static_copy(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device, copy=True)
    if isinstance(value, dict):
        return {k: _static_copy(v, device) for k, v in value.items()}
    return value


def _load(static, batch) -> None:
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            static[k].copy_(v, non_blocking=True)
        elif isinstance(v, dict):
            _load(static[k], v)


class _Captured:
    def __init__(self, graph, batch: dict, loss: torch.Tensor, grads: list):
        self.graph, self.batch, self.loss = graph, batch, loss
        self.grads = grads  # (parameter, its storage's address, the gradient the graph writes) with the step after it


def _skip_step(*args, **kwargs):
    return None


def fuses_into_graph(optimizer) -> bool:
    """torch's fused AdamW/Adam (library.optimizers fuses them where it can): they read the learning rate from a
    tensor and nothing from the host; other optimizers step after the graph."""
    return type(optimizer) in (torch.optim.AdamW, torch.optim.Adam) and bool(optimizer.defaults.get("fused"))


def _cuda_capture(run: Callable[[], torch.Tensor], generators: list, pool=None) -> tuple:
    """Captures run() into a new CUDA graph with a pool of its own (or `pool`, shared) -> (graph, loss). Nothing
    runs until replay."""
    graph = torch.cuda.CUDAGraph()
    for g in generators:
        graph.register_generator_state(g)
    torch.cuda.synchronize()
    # several processes: the collectives of the gradients' all-reduce are captured too (their communicator was set up
    # by the ordinary steps before); NCCL's watchdog thread queries its earlier work meanwhile, which a capture in
    # the default "global" mode would refuse
    mode = "thread_local" if torch.distributed.is_available() and torch.distributed.is_initialized() else "global"
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
        loss = run()
    return graph, loss


def _reset_generators(generators: list, device) -> None:
    """After a failed capture the generators it registered (and the device's default one) still count as
    capturing, and the next random draw fails: give each a fresh copy of its seed and offset."""
    if device.type != "cuda":
        return
    default = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    for g in [*generators, default]:
        g.graphsafe_set_state(g.clone_state())


class StepGraphs:
    """Runs each optimizer step: the ordinary way for a batch shape's first WARMUP steps, then captured once and
    replayed. `run_step(batch)` is the step from forward to the optimizer step (no zero_grad) and returns the loss.
    `capture(run, generators) -> (graph, loss)` is _cuda_capture unless a test gives another. With
    accumulation_steps > 1, `step(batch, run_step, sync)` is one micro-step; sync: it ends the window (accelerate's
    sync_gradients), and run_step then steps the optimizer."""

    def __init__(self, optimizers: list, device, generators=(), capture=_cuda_capture, accumulation_steps: int = 1):
        self.optimizers = [getattr(o, "optimizer", o) for o in optimizers]  # accelerate's wrapper -> torch's
        self.device = torch.device(device)
        self.generators = [g for g in generators if g is not None and g.device.type == "cuda"]
        self.capture = capture
        self.optimizer_in_graph = all(fuses_into_graph(o) for o in self.optimizers)
        self.seen: Counter = Counter()
        self.graphs: dict[tuple, _Captured] = {}
        self.lrs: list[torch.Tensor] | None = None
        self.off: str | None = None  # why the run goes on without step graphs
        self.uncaptured_logged = False
        self.accumulating = accumulation_steps > 1
        self.with_grads: list = []  # accumulating: the parameters an ordinary micro-step gave a gradient
        self.static_grads: list | None = None  # accumulating: (parameter, the gradient tensor every step adds into)
        self.pools: dict = {}  # accumulating: batch signature -> the memory pool its two graphs share

    @property
    def groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self, batch: dict, run_step: Callable[[dict], torch.Tensor], sync: bool = True) -> torch.Tensor:
        shape = None if self.off else signature(batch)
        key = shape if shape is None or not self.accumulating else (shape, sync)
        captured = self.graphs.get(key) if key is not None else None
        if captured is None and key is not None:
            self.seen[key] += 1
            if self.seen[key] > WARMUP:
                shapes = {k[0] for k in self.graphs} if self.accumulating else set(self.graphs)
                if shape in shapes or len(shapes) < LIMIT:
                    captured = self._capture(key, batch, run_step, sync)
                elif not self.uncaptured_logged:
                    self.uncaptured_logged = True
                    logger.info("step graph: %d batch shapes have graphs; further shapes run without one", LIMIT)
        if captured is None:
            self._point_grads()
            loss = run_step(batch)
            if self.accumulating and self.static_grads is None:
                self.with_grads = [p for g in self.groups for p in g["params"] if p.grad is not None]
            if sync:
                self._clear_grads()
            # detached, so that no autograd node of this step outlives it: a capture that found the parameters'
            # AccumulateGrad nodes of an ordinary step would sync with their stream, which capture does not allow
            return loss.detach()
        _load(captured.batch, batch)
        self._point_grads()
        if self.optimizer_in_graph and sync:
            self._load_lrs()
        captured.graph.replay()
        if sync and not self.optimizer_in_graph:
            self._step_after(captured)
        return captured.loss

    def _point_grads(self) -> None:
        """accumulating: .grad is the tensor the graphs add into (something may have set it to None)."""
        for p, grad in self.static_grads or ():
            if p.grad is not grad:
                p.grad = grad

    def _clear_grads(self) -> None:
        """After an optimizer step: zero the gradients the graphs add into, else drop them."""
        if self.static_grads is not None:
            torch._foreach_zero_([g for _, g in self.static_grads])
        else:
            for o in self.optimizers:
                o.zero_grad(set_to_none=True)

    def _step_after(self, captured: _Captured) -> None:
        for p, _, grad in captured.grads:
            if p.grad is not grad:
                p.grad = grad
        for o in self.optimizers:
            o.step()
        if self.static_grads is not None:
            self._clear_grads()
        moved = next((p for p, ptr, _ in captured.grads if p.data_ptr() != ptr), None)
        if moved is not None:
            self.off = f"{type(self.optimizers[0]).__name__} gave a parameter new storage in its step"
            self.graphs.clear()
            logger.warning("step graph: %s, which a replayed graph cannot follow; training goes on without "
                           "--cuda_graph_step", self.off)
            self.static_grads = None
            for o in self.optimizers:
                o.zero_grad(set_to_none=True)

    def _load_lrs(self) -> None:
        for t, g in zip(self.lrs, self.groups):
            t.fill_(float(g["lr"]))

    def _capture(self, key: tuple, batch: dict, run_step, sync: bool = True) -> _Captured | None:
        static = _static_copy(batch, self.device)
        groups = self.groups
        in_graph = self.optimizer_in_graph
        if in_graph and self.lrs is None:
            self.lrs = [torch.tensor(float(g["lr"]), dtype=torch.float32, device=self.device) for g in groups]
        if in_graph:
            self._load_lrs()
        saved = [(g["lr"], g.get("capturable", False)) for g in groups]
        steps = [o.__dict__.get("step") for o in self.optimizers]  # an instance's own step (a scheduler's wrapper)
        capture, run = self.capture, (lambda: run_step(static))
        if self.accumulating:
            self._make_static_grads()  # the graphs add into them, across micro-steps and graphs
            if in_graph and sync:
                zero = [g for _, g in self.static_grads]

                def run():  # the optimizer step inside the graph, then the window's gradients start again at 0
                    loss = run_step(static)
                    torch._foreach_zero_(zero)
                    return loss
            if capture is _cuda_capture:
                pool = self.pools.setdefault(key[0], torch.cuda.graph_pool_handle())
                capture = functools.partial(_cuda_capture, pool=pool)
        else:
            for o in self.optimizers:
                o.zero_grad(set_to_none=True)  # the graph's backward makes the gradients, in its own memory
        try:
            if in_graph:
                for g, lr in zip(groups, self.lrs):
                    g["lr"], g["capturable"] = lr, True  # the optimizer reads the rate from the tensor on replay
            else:
                for o in self.optimizers:
                    o.step = _skip_step  # run_step's optimizer step is left out of the graph: it runs after replay
            graph, loss = capture(run, self.generators)
        except Exception as e:  # an operation capture does not allow: the step runs the ordinary way instead
            self.off = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            logger.warning("step graph: the training step could not be captured (%s); training goes on without "
                           "--cuda_graph_step", self.off)
            if self.accumulating:  # the window's gradients so far stay (a capture runs nothing)
                self.static_grads = None
            else:
                for o in self.optimizers:
                    o.zero_grad(set_to_none=True)
            _reset_generators(self.generators, self.device)
            return None
        finally:
            for g, (lr, capturable) in zip(groups, saved):
                g["lr"], g["capturable"] = lr, capturable
            for o, step in zip(self.optimizers, steps):
                if step is None:
                    o.__dict__.pop("step", None)
                else:
                    o.step = step
        grads = [] if in_graph else [(p, p.data_ptr(), p.grad) for g in groups for p in g["params"]
                                     if p.grad is not None]
        captured = _Captured(graph, static, loss, grads)
        self.graphs[key] = captured
        shape = key[0] if self.accumulating else key
        shapes = ", ".join(f"{k} {'x'.join(map(str, s))}" for k, s, *_ in shape if isinstance(s, tuple) and
                           k in ("latents", "images"))
        count = len({k[0] for k in self.graphs}) if self.accumulating else len(self.graphs)
        logger.info("step graph: captured the training %s for batch %s (%d of at most %d graphs)%s",
                    "step" if sync else "micro-step that accumulates gradients", shapes or "shape", count, LIMIT,
                    "" if in_graph or not sync else
                    f"; the {type(self.optimizers[0]).__name__} step runs after each replay")
        return captured

    def _make_static_grads(self) -> None:
        """accumulating: the gradient tensors every micro-step adds into, for the parameters that got gradients in
        the ordinary micro-steps (a window's partial sums are kept)."""
        if self.static_grads is not None:
            return
        for p in self.with_grads:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.static_grads = [(p, p.grad) for p in self.with_grads]

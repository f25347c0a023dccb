"""bitsandbytes' 8-bit / 32-bit optimizers (AdamW8bit, Lion8bit, SGDNesterov8bit, ...) without a GPU synchronize after
every parameter, and with one update call for many parameters.

bitsandbytes (0.50.2) ends each parameter's update in `Optimizer8bit.step` with `sync_gpu(p)`, a
`torch.cuda.synchronize()`: 1,444 waits for the GPU per step with an SDXL LoRA, so the host can never run ahead of
the GPU (docs/BENCHMARKS.md run64: SDXL bs1 + GC with AdamW8bit 239 ms against AdamW's 130 ms). The waits are there
for paged optimizer state (its pages move asynchronously); without paging, every kernel of the step runs in order on
the current stream anyway. Paged optimizers keep bitsandbytes' step unchanged.

Without the waits the step was still 1,444 update calls of a few microseconds of GPU work each, about 100 ms of host
time (run71: 203.9 ms against AdamW's 100.1 ms). The update is elementwise, and the 8-bit state is quantized per
block of BLOCK elements with the block's absolute maximum. So the parameters of a group are laid out in one flat
run, each at an offset that is a multiple of BLOCK: their states (and absmax) become views into flat buffers, and
one call of bitsandbytes' update over the flat run (gradients and weights copied in, weights copied back) computes
what the per-parameter calls compute. The padding between parameters is zero (state codes that dequantize to 0,
zero gradients and weights), stays zero, and never raises a block's absmax. One difference is possible in principle:
bitsandbytes' CUDA kernel reads the missing tail of a parameter's last block as state code 128 (5.5e-7 of the old
absmax), the flat run as 0; the two agree unless every new value of that block is smaller than that (tests check bit
equality with bitsandbytes' own step). A parameter without a gradient, a per-parameter override
(GlobalOptimManager), unequal step counts or an optimizer with per-tensor norms (LAMB, LARS, max_unorm, AdEMAMix)
take bitsandbytes' per-parameter calls, which the views serve as well.
"""
from __future__ import annotations

import functools

import torch

BLOCK = 256  # bitsandbytes' blockwise state block (Optimizer2State/1State.init_state)
CHUNK_ELEMENTS = 1 << 24  # weights and gradients are copied in runs of at most this many elements (64 MiB fp32)
FLAT_OPTIMIZERS = ("adam", "momentum", "rmsprop", "adagrad", "lion")  # elementwise updates (no per-tensor norm)


class _Chunk:
    """Parameters [start, end) of a run, elements [lo, hi) of its flat buffers, with views into the scratch."""

    def __init__(self, params: list, offsets: list[int], lo: int, hi: int, scratch: tuple):
        self.params, self.lo, self.hi = params, lo, hi
        g_buf, p_buf = (t[:hi - lo] for t in scratch)
        self.g_buf, self.p_buf = g_buf, p_buf
        self.g_views = [g_buf[o - lo:o - lo + p.numel()] for p, o in zip(params, offsets)]
        self.p_views = [p_buf[o - lo:o - lo + p.numel()] for p, o in zip(params, offsets)]
        self.padded = sum(p.numel() for p in params) != hi - lo


class _Run:
    """The parameters of one group with one kind of state (8-bit or 32-bit) and one dtype and device, their state
    moved into flat buffers (each parameter's state entries become views)."""

    def __init__(self, optimizer, gindex: int, pindex: int, params: list, scratch_for):
        self.gindex, self.pindex, self.params = gindex, pindex, params  # pindex: the first parameter's (its config)
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-p.numel() // BLOCK) * BLOCK
        first = optimizer.state[params[0]]
        self.eight_bit = first["state1"].dtype == torch.uint8
        self.keys = [k for k in ("state1", "state2") if k in first] + \
            ([k for k in ("absmax1", "absmax2") if k in first] if self.eight_bit else [])
        self.flat = {}
        for key in self.keys:
            t = first[key]
            if key.startswith("absmax"):
                flat = torch.zeros(total // BLOCK, dtype=t.dtype, device=t.device)
                views = [flat[o // BLOCK:o // BLOCK + optimizer.state[p][key].numel()] for p, o in zip(params, offsets)]
            else:
                # the padding holds the code of 0 (the signed map's 0 is code 127, not 0)
                zero = _zero_code(first["qmap1" if key == "state1" else "qmap2"]) if self.eight_bit else 0
                flat = torch.full((total,), zero, dtype=t.dtype, device=t.device)
                views = [flat[o:o + p.numel()] for p, o in zip(params, offsets)]
            for p, view in zip(params, views):
                state = optimizer.state[p]
                view.copy_(state[key].reshape(-1))
                state[key] = view.view(state[key].shape)
            self.flat[key] = flat
        # chunks of whole parameters, each at most CHUNK_ELEMENTS unless one parameter is larger
        n, bounds, start = len(params), [], 0
        for i in range(n):
            end = offsets[i + 1] if i + 1 < n else total
            if i > start and end - offsets[start] > CHUNK_ELEMENTS:
                bounds.append((start, i))
                start = i
        bounds.append((start, n))
        his = [offsets[e] if e < n else total for _, e in bounds]
        longest = max(hi - offsets[s] for (s, _), hi in zip(bounds, his))
        scratch = scratch_for(params[0].dtype, params[0].device, longest)
        self.chunks = [_Chunk(params[s:e], offsets[s:e], offsets[s], hi, scratch) for (s, e), hi in zip(bounds, his)]

    def owns_its_state(self, optimizer) -> bool:
        """Whether the parameters' states are still the views (not replaced by a load)."""
        state = optimizer.state[self.params[0]]
        return state.get("state1") is not None and state["state1"].untyped_storage().data_ptr() == \
            self.flat["state1"].untyped_storage().data_ptr()


def _zero_code(qmap: torch.Tensor) -> int | None:
    """The code that dequantizes to exactly 0 (padding stays 0 only with one), else None."""
    zeros = (qmap == 0).nonzero()
    return int(zeros[0, 0]) if zeros.numel() else None


def _has_zero_codes(state: dict, known: dict) -> bool:
    """8-bit state: whether its maps have a code of exact 0 (`known`: the answer per map, the maps are shared)."""
    if state["state1"].dtype != torch.uint8:
        return True
    maps = [state[q] for q in ("qmap1", "qmap2") if state.get(q) is not None]
    for m in maps:
        if id(m) not in known:
            known[id(m)] = _zero_code(m) is not None
    return all(known[id(m)] for m in maps)


def _flat_groups(self) -> dict:
    """gindex -> the runs of that group (built once all its parameters with a gradient have state)."""
    if getattr(self, "_flat_runs", None) is not None:
        return self._flat_runs
    runs: dict[int, list[_Run]] = {}
    mng, zero_codes = self.mng, {}
    for gindex, group in enumerate(self.param_groups):
        if self.optimizer_name not in FLAT_OPTIMIZERS or type(self).update_step not in _plain_updates():
            continue
        config = self.get_config(gindex, 0, group) if group["params"] else None
        if config is None or config.get("t_alpha") or config.get("t_beta3") or config["max_unorm"] > 0:
            continue
        by_kind: dict[tuple, list] = {}
        for pindex, p in enumerate(group["params"]):
            state = self.state.get(p)
            if (gindex, pindex) in mng.index2config or id(p) in mng.pid2config:
                continue
            if not state or "state1" not in state or not p.is_contiguous() or not _has_zero_codes(state, zero_codes):
                continue
            by_kind.setdefault((state["state1"].dtype, p.dtype, p.device), []).append((pindex, p))
        runs[gindex] = [_Run(self, gindex, kind[0][0], [p for _, p in kind], functools.partial(_scratch, self))
                        for kind in by_kind.values() if len(kind) > 1]
    self._flat_runs = runs
    return runs


def _scratch(self, dtype, device, elements: int) -> tuple:
    """Two buffers (gradients, weights) of at least `elements`, shared by the runs of one dtype and device."""
    cache = self.__dict__.setdefault("_flat_scratch", {})
    key = (dtype, device)
    if key not in cache or cache[key][0].numel() < elements:
        cache[key] = tuple(torch.zeros(elements, dtype=dtype, device=device) for _ in range(2))
    return cache[key]


def _update_run(self, run: _Run, group: dict) -> None:
    """One bitsandbytes update call per chunk of the run, with the arguments of update_step."""
    from bitsandbytes import functional as F

    config = self.get_config(run.gindex, run.pindex, group)
    step = 0
    for p in run.params:
        state = self.state[p]
        state["step"] += 1
        step = state["step"]
    betas = config["betas"]
    two = "state2" in run.flat
    for chunk in run.chunks:
        if chunk.padded:
            chunk.g_buf.zero_()
            chunk.p_buf.zero_()
        torch._foreach_copy_(chunk.g_views, [p.grad.reshape(-1) for p in chunk.params])
        torch._foreach_copy_(chunk.p_views, [p.reshape(-1) for p in chunk.params])
        lo, hi = chunk.lo, chunk.hi
        s1 = run.flat["state1"][lo:hi]
        s2 = run.flat["state2"][lo:hi] if two else None
        if run.eight_bit:
            a1 = run.flat["absmax1"][lo // BLOCK:hi // BLOCK]
            a2 = run.flat["absmax2"][lo // BLOCK:hi // BLOCK] if two else None
            first = self.state[chunk.params[0]]
            F.optimizer_update_8bit_blockwise(
                self.optimizer_name, chunk.g_buf, chunk.p_buf, s1, s2, betas[0], betas[1],
                (betas[2] if len(betas) >= 3 else 0.0) if two else 0.0, config.get("alpha", 0.0) if two else 0.0,
                config["eps"], step, config["lr"], first["qmap1"], first.get("qmap2") if two else None, a1, a2,
                config["weight_decay"], gnorm_scale=1.0, skip_zeros=config["skip_zeros"])
        else:
            F.optimizer_update_32bit(
                self.optimizer_name, chunk.g_buf, chunk.p_buf, s1, betas[0], config["eps"], step, config["lr"], s2,
                betas[1], (betas[2] if len(betas) >= 3 else 0.0) if two else 0.0,
                config.get("alpha", 0.0) if two else 0.0, config["weight_decay"], 1.0, None, max_unorm=0.0,
                skip_zeros=config["skip_zeros"])
        torch._foreach_copy_([p.view(-1) for p in chunk.params], chunk.p_views)


def _unsynced_step(self, closure=None):
    """bitsandbytes' Optimizer8bit.step without its per-parameter GPU synchronize (not for paged state), with one
    update call per flat run of parameters where the update allows it."""
    if self.is_paged:
        return self._bnb_step(closure)
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    if not self.initialized:
        self.check_overrides()
        self.to_gpu()
        self.initialized = True
    fresh = False
    for gindex, group in enumerate(self.param_groups):
        for pindex, p in enumerate(group["params"]):
            if p.grad is not None and len(self.state[p]) == 0:
                self.init_state(group, p, gindex, pindex)
                fresh = True
    runs = getattr(self, "_flat_runs", None)
    if runs is not None and (fresh or any(not r.owns_its_state(self) for rs in runs.values() for r in rs)):
        self._flat_runs = None  # new state (a parameter's first gradient, a load): lay the runs out again
    runs = _flat_groups(self)
    for gindex, group in enumerate(self.param_groups):
        done = set()
        for run in runs.get(gindex, ()):
            if all(p.grad is not None and p.grad.dtype == p.dtype for p in run.params) and \
                    len({self.state[p]["step"] for p in run.params}) == 1:
                _update_run(self, run, group)
                done.update(id(p) for p in run.params)
        for pindex, p in enumerate(group["params"]):
            if p.grad is None or id(p) in done:
                continue
            self.update_step(group, p, gindex, pindex)
    return loss


def _forget_runs(load):
    def load_state_dict(self, *args, **kwargs):
        self._flat_runs = None
        return load(self, *args, **kwargs)
    return load_state_dict


@functools.cache
def unsynced(cls: type) -> type:
    """A subclass of the bitsandbytes optimizer class `cls` whose step does not wait for the GPU per parameter and
    updates flat runs of parameters with one call (the class keeps its name: the run's metadata names bitsandbytes'
    class all the same)."""
    return type(cls.__name__, (cls,), {
        "__doc__": f"{cls.__module__}.{cls.__name__} without the per-parameter synchronize (library.bnb_unsynced)",
        "__module__": __name__,
        "_bnb_step": cls.step,
        "step": torch.no_grad()(_unsynced_step),
        "load_state_dict": _forget_runs(cls.load_state_dict),
    })


@functools.cache
def _plain_updates() -> tuple:
    """bitsandbytes' own update_step of the one- and two-state optimizers (a subclass with its own, such as
    AdEMAMix, keeps the per-parameter calls)."""
    from bitsandbytes.optim.optimizer import Optimizer1State, Optimizer2State

    return (Optimizer1State.update_step, Optimizer2State.update_step)


def is_bnb_optimizer(cls: type) -> bool:
    """Whether `cls` is one of bitsandbytes' optimizers with the per-parameter synchronize (Optimizer8bit's step)."""
    if not cls.__module__.startswith("bitsandbytes."):
        return False
    try:
        from bitsandbytes.optim.optimizer import Optimizer8bit
    except ImportError:  # another layout of bitsandbytes: its own step
        return False
    return issubclass(cls, Optimizer8bit) and all(
        hasattr(Optimizer8bit, name) for name in ("check_overrides", "to_gpu", "init_state", "prefetch_state",
                                                  "update_step"))

"""prodigyopt's Prodigy with the same math in a few large kernels and no read back to the host
(--optimizer_type Prodigy).

prodigyopt's step loops over the parameters in Python and reads two numbers back to the host for each (the dot
product of its d estimate and the sum of |s|): with a LoRA's 1,444 tensors that is 2,888 waits for the GPU a step
(docs/BENCHMARKS.md run64: SDXL bs1 + GC 461 ms against AdamW's 130 ms). Multi-tensor (_foreach) forms of its
operations still cost ~15 ms of GPU time a step there (run95): each of their ~10 passes is split into launches of a
few dozen small tensors; this form's step adds 7.1 ms after queued GPU work against their 32.9 ms (run103, H100). Here the state of each param group's stepped parameters (exp_avg, exp_avg_sq, s, p0, the
step counts) lives in one flat buffer a kind, and the per-parameter state prodigyopt saves and loads is views of
them; the gradients and weights are copied into a scratch buffer a chunk of parameters at a time, so every update,
dot product and |s| sum is one kernel over the chunk. The numbers prodigyopt keeps on the host (d, d_max,
d_numerator, d_hat, d_denom, the step count k) are float64 tensors on the device (library.device_scalars), updated
with its formulas (its `if`s as `torch.where`), so nothing waits for the GPU. The learning rates stay host numbers,
so the step runs after the step graph's replay (library.compile.graphs.AFTER_GRAPH_OPTIMIZERS). state_dict() gives
prodigyopt's layout, so --save_state / --resume work across the two. FSDP, parameters on several devices and MPS
(no float64) use prodigyopt's own step.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch
from prodigyopt import Prodigy

from library.device_scalars import DeviceScalars

CHUNK_VALUES = 1 << 23  # values a chunk: the scratch is two buffers of this many (32 MiB each in float32)


@dataclass
class _Run:
    """Consecutive parameters [lo, hi) of a layout that step together (a chunk, or the part of one that has
    gradients): their values [a, b) in the flat buffers, at `at` in the scratch buffers, their sliced values [sa, sb)
    in s, of which the first `full` have a p0 (at the same place in the p0 buffer: those parameters come first)."""
    lo: int
    hi: int
    a: int
    b: int
    at: int
    sa: int
    sb: int
    full: int
    scratch_a: list  # views of the scratch buffers in the parameters' shapes
    scratch_b: list
    sliced_a: list  # strided views of the scratch buffers (each parameter's flatten()[::slice_p])
    sliced_b: list
    exp_avgs: list  # the parameters' exp_avg state views


class _Layout:
    """One param group's parameters of one dtype, end to end: first those whose p0 is kept, then those that started
    at zero (prodigyopt keeps a zero scalar as their p0). Made from the state they have (a loaded or an earlier
    layout's) or, for a parameter without one, prodigyopt's initial state; their state dicts then hold views of the
    layout's buffers. A step runs over chunks of about CHUNK_VALUES values, or over the parts of them whose
    parameters have gradients (LoRA's module dropout leaves some without). The scratch buffers are float32 at least
    (bfloat16 weights: the arithmetic in float32, as prodigyopt's kernels do it)."""

    def __init__(self, opt: Prodigy, params: list, slice_p: int, beta1: float):
        self.slice_p = slice_p
        device, dtype = params[0].device, params[0].dtype
        new = [p for p in params if "step" not in opt.state[p]]
        started = dict(zip(map(id, new), torch.stack([p.any() for p in new]).tolist())) if new else {}

        def keeps_p0(p):
            return started[id(p)] if id(p) in started else opt.state[p]["p0"].dim() > 0

        self.params = [p for p in params if keeps_p0(p)] + [p for p in params if not keeps_p0(p)]
        self.position = {id(p): i for i, p in enumerate(self.params)}
        sizes = [p.numel() for p in self.params]
        sliced = [-(-n // slice_p) for n in sizes]
        self.offsets, self.sliced_offsets = [0], [0]
        for n, m in zip(sizes, sliced):
            self.offsets.append(self.offsets[-1] + n)
            self.sliced_offsets.append(self.sliced_offsets[-1] + m)
        self.n_full = sum(m for p, m in zip(self.params, sliced) if keeps_p0(p))
        self.exp_avg = torch.zeros(self.offsets[-1], dtype=dtype, device=device) if beta1 > 0 else None
        self.exp_avg_sq = torch.zeros(self.offsets[-1], dtype=dtype, device=device)
        self.s = torch.zeros(self.sliced_offsets[-1], dtype=dtype, device=device)
        self.p0 = torch.empty(self.n_full, dtype=dtype, device=device)
        self.steps = torch.zeros(len(self.params), dtype=torch.int64, device=device)
        self.dtype = torch.promote_types(dtype, torch.float32)  # the scratch's and the coefficients'

        self.chunk_starts = self._chunk_starts(sizes)  # the first parameter of each chunk
        bounds = list(zip(self.chunk_starts, self.chunk_starts[1:] + [len(self.params)]))
        width = max(self.offsets[j] - self.offsets[i] for i, j in bounds)
        self.scratch = [torch.empty(width, dtype=self.dtype, device=device) for _ in "ab"]
        self.views: dict[str, list] = {"scratch_a": [], "scratch_b": [], "sliced_a": [], "sliced_b": [],
                                       "exp_avgs": []}
        for index, p in enumerate(self.params):
            self._take_state(opt, index, keeps_p0(p))
        self.scratch_sliced = [torch.empty(max(self.sliced_offsets[j] - self.sliced_offsets[i] for i, j in bounds),
                                           dtype=self.dtype, device=device) for _ in ("ab" if slice_p > 1 else "")]
        self.chunks = [self._run(i, j) for i, j in bounds]
        self.first = opt.state[self.params[0]]["exp_avg_sq"]

    def _take_state(self, opt: Prodigy, index: int, keeps_p0: bool) -> None:
        """Parameter `index`'s state becomes views of the buffers (holding the values it had, or prodigyopt's initial
        ones), and its scratch views are made (where it sits in its chunk's scratch)."""
        p = self.params[index]
        o, so, n, m = self.offsets[index], self.sliced_offsets[index], p.numel(), -(-p.numel() // self.slice_p)
        at = self._in_chunk(index)
        state = opt.state[p]
        views = {"exp_avg_sq": self.exp_avg_sq[o:o + n].view(p.shape), "s": self.s[so:so + m],
                 "step": self.steps[index]}
        if self.exp_avg is not None:
            views["exp_avg"] = self.exp_avg[o:o + n].view(p.shape)
        if keeps_p0:
            views["p0"] = self.p0[so:so + m]
        for name, view in views.items():
            if isinstance(state.get(name), torch.Tensor):  # a loaded state, or an earlier layout's
                view.copy_(state[name])
            elif name in state:
                view.fill_(state[name])  # a step count saved as a number
            elif name == "p0":  # prodigyopt's initial state: zeros, and p0 the weights as they start
                view.copy_(p.detach().flatten()[::self.slice_p])
        if not keeps_p0:
            views["p0"] = state["p0"] if "p0" in state else torch.tensor(0, device=p.device, dtype=p.dtype)
        state.update(views)
        self.views["exp_avgs"].append(views.get("exp_avg"))
        for scratch, half in zip(self.scratch, "ab"):
            self.views[f"scratch_{half}"].append(scratch[at:at + n].view(p.shape))
            self.views[f"sliced_{half}"].append(scratch[at:at + n:self.slice_p])

    @staticmethod
    def _chunk_starts(sizes: list[int]) -> list[int]:
        """The first parameter of each run of consecutive parameters of about CHUNK_VALUES values (at least one)."""
        starts, total = [0], 0
        for i, n in enumerate(sizes):
            if total and total + n > CHUNK_VALUES:
                starts.append(i)
                total = 0
            total += n
        return starts

    def _in_chunk(self, index: int) -> int:
        """Where parameter `index`'s values start in its chunk (and so in the scratch buffers)."""
        return self.offsets[index] - self.offsets[self.chunk_starts[bisect.bisect_right(self.chunk_starts, index) - 1]]

    def _run(self, i: int, j: int) -> _Run:
        """Parameters [i, j) of one chunk."""
        so = self.sliced_offsets
        parts = {name: views[i:j] for name, views in self.views.items()}
        return _Run(i, j, self.offsets[i], self.offsets[j], self._in_chunk(i), so[i], so[j],
                    max(0, min(so[j], self.n_full) - so[i]), **parts)

    def holds(self, opt: Prodigy, params: list) -> bool:
        """Whether this layout still holds the state of these parameters (a load replaces the state)."""
        return all(id(p) in self.position for p in params) and \
            opt.state[self.params[0]].get("exp_avg_sq") is self.first

    def runs(self, params: list) -> list[_Run]:
        """The chunks, or where some of the layout's parameters have no gradient this step, the parts of them
        that do. params: this step's, all held by this layout (`holds`)."""
        if len(params) == len(self.params):
            return self.chunks
        stepping = sorted(self.position[id(p)] for p in params)
        runs, start = [], stepping[0]
        for prev, index in zip(stepping, stepping[1:] + [None]):
            if index != prev + 1 or index in self.chunk_starts:
                runs.append(self._run(start, prev + 1))
                start = index
        return runs

    def gather(self, run: _Run, tensors: list, into: int) -> torch.Tensor:
        """Copies the run's `tensors` (its parameters' weights or gradients, in layout order) into scratch buffer
        `into`; -> that buffer's part."""
        torch._foreach_copy_((run.scratch_a, run.scratch_b)[into], tensors[run.lo:run.hi])
        return self.scratch[into][run.at:run.at + run.b - run.a]

    def sliced(self, run: _Run, flat: torch.Tensor, into: int) -> torch.Tensor:
        """The run's gathered values as prodigyopt slices them (each parameter's flatten()[::slice_p])."""
        if self.slice_p == 1:
            return flat
        views = (run.sliced_a, run.sliced_b)[into]
        return torch.cat(views, out=self.scratch_sliced[into][:run.sb - run.sa])


class ForeachProdigy(DeviceScalars, Prodigy):
    """Prodigy whose step runs as a few kernels over flat buffers on the device (see the module's docstring)."""

    SCALARS = ("d", "d_max", "d_numerator", "d_hat", "d_denom", "k")  # prodigyopt's per-group numbers

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._flat: dict[int, list[_Layout]] = {}  # param group index -> its layouts

    def _initial(self, group: dict, key: str) -> float:
        return group.get(key, group["d"] if key == "d_hat" else 0.0)  # before its first step: no d_hat / d_denom

    def _own_step(self, params: list) -> bool:
        return any(g["fsdp_in_use"] for g in self.param_groups) or any(hasattr(p, "_fsdp_flattened") for p in params) \
            or len({p.device for p in params}) > 1 or (bool(params) and params[0].device.type == "mps")

    def _layouts(self, index: int, params: list, beta1: float) -> list[tuple[_Layout, list[_Run]]]:
        """The group's layouts, one a dtype, each with this step's runs; a layout is made again (over the parameters
        it held and these, in the group's order) where a parameter is new to it or a load replaced the state."""
        by_dtype: dict = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        layouts = {layout.params[0].dtype: layout for layout in self._flat.get(index, [])}
        out = []
        for dtype, stepping in by_dtype.items():
            layout = layouts.get(dtype)
            if layout is None or not layout.holds(self, stepping):
                members = {*(layout.position if layout else ()), *map(id, stepping)}
                group = self.param_groups[index]
                layout = _Layout(self, [p for p in group["params"] if id(p) in members], group["slice_p"], beta1)
                layouts[dtype] = layout
            out.append((layout, layout.runs(stepping)))
        self._flat[index] = list(layouts.values())
        return out

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._flat = {}  # the loaded state replaced the layouts' views

    def _device_step(self, device: torch.device, sc: dict) -> None:
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        beta3 = group["beta3"] if group["beta3"] is not None else math.sqrt(beta2)
        d, d_max, k = sc["d"], sc["d_max"], sc["k"]
        lr, dlr = self._rate(d, k)
        decouple = group["decouple"]

        # the first pass, per group: the dot product for d's numerator, the EMAs and s, the sum of |s|
        delta_numerator, d_denom, stepped_groups = [], [], []
        for index, g in enumerate(self.param_groups):
            params, _ = self._with_grads(g, coupled_decay=not decouple)
            if not params:
                continue
            layouts = self._layouts(index, params, beta1)
            stepped_groups.append((g, layouts))
            if not g["lr"] > 0.0:
                continue
            s_scale = (d if g["safeguard_warmup"] else dlr) / g["d0"]  # s grows by the gradient * d * this
            dots, sums = [], []
            for layout, runs in layouts:
                scale, s_coef = d.to(layout.dtype), s_scale.to(layout.dtype)
                grads = [p.grad for p in layout.params]
                for r in runs:
                    grad = layout.gather(r, grads, 0)
                    weight = layout.gather(r, layout.params, 1)
                    sliced_grad, sliced_weight = layout.sliced(r, grad, 0), layout.sliced(r, weight, 1)
                    full = r.full
                    if full:  # p0 - p in the weights' scratch (not needed after this)
                        p0_minus_p = torch.sub(layout.p0[r.sa:r.sa + full], sliced_weight[:full],
                                               out=sliced_weight[:full])
                        dots.append(torch.dot(sliced_grad[:full], p0_minus_p))
                    if full < r.sb - r.sa:  # p0 is zero: g . (0 - p)
                        dots.append(-torch.dot(sliced_grad[full:], sliced_weight[full:]))
                    grad.mul_(scale)  # d * g
                    if sliced_grad is not grad:
                        sliced_grad.mul_(scale)
                    if layout.exp_avg is not None:
                        layout.exp_avg[r.a:r.b].mul_(beta1).add_(grad, alpha=1 - beta1)
                    layout.exp_avg_sq[r.a:r.b].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    s_part = layout.s[r.sa:r.sb]
                    s_part.mul_(beta3).addcmul_(sliced_grad, s_coef)
                    sums.append(torch.linalg.vector_norm(s_part, 1, dtype=layout.dtype))
            d_denom.append(torch.stack(sums).sum(dtype=torch.float64))
            if dots:
                delta_numerator.append(torch.stack(dots).sum(dtype=torch.float64) * (d / g["d0"]) * dlr)
        if not lr > 0.0:
            return  # prodigyopt: no |s| (d_denom 0), so it returns here

        # prodigyopt's update of d; where it would return early (no |s| yet) nothing below changes
        d_numerator = sc["d_numerator"] * beta3 + (sum(delta_numerator) if delta_numerator else 0.0)
        denom = sum(d_denom) if d_denom else torch.zeros((), dtype=torch.float64, device=device)
        ok = denom > 0
        d_hat = group["d_coef"] * d_numerator / torch.where(ok, denom, 1.0)
        d_new = torch.where(d == self.param_groups[-1]["d0"], torch.maximum(d, d_hat), d)  # its loop's last group
        d_max_new = torch.maximum(d_max, d_hat)
        d_new = torch.minimum(d_max_new, d_new * group["growth_rate"])
        for key, value in (("d_numerator", d_numerator), ("d_denom", denom), ("d", d_new), ("d_max", d_max_new),
                           ("d_hat", d_hat)):
            sc[key].copy_(torch.where(ok, value, sc[key]))
        step_rate = dlr * ok  # 0 where prodigyopt returns early: the weights stay
        rate = step_rate * d if beta1 == 0 else step_rate  # prodigyopt: without exp_avg, the gradient times dlr * d
        counted = ok.long()

        # the second pass: the step itself (every group with gradients, as prodigyopt; d is the new one from here)
        for g, layouts in stepped_groups:
            decay = g["weight_decay"] if decouple else 0.0
            for layout, runs in layouts:
                eps, neg_rate = (d * g["eps"]).to(layout.dtype), (-rate).to(layout.dtype)
                keep = (1 - decay * step_rate).to(layout.dtype)
                in_place = decay == 0 and layout.dtype == layout.s.dtype  # else weights via the scratch
                grads = [p.grad for p in layout.params] if layout.exp_avg is None else None  # the step's numerators
                for r in runs:
                    layout.steps[r.lo:r.hi].add_(counted)
                    params = layout.params[r.lo:r.hi]
                    denom = torch.sqrt(layout.exp_avg_sq[r.a:r.b], out=layout.scratch[1][r.at:r.at + r.b - r.a])
                    denom.add_(eps).div_(neg_rate)  # p - rate * a / denom as p + a / (denom / -rate)
                    if in_place:
                        numerators = r.exp_avgs if layout.exp_avg is not None else grads[r.lo:r.hi]
                        torch._foreach_addcdiv_(params, numerators, r.scratch_b)
                        continue
                    if layout.exp_avg is None:
                        denom.reciprocal_().mul_(layout.gather(r, grads, 0))  # grad / (denom / -rate)
                    weight = layout.gather(r, layout.params, 0).mul_(keep)
                    if layout.exp_avg is None:
                        weight.add_(denom)
                    else:
                        weight.addcdiv_(layout.exp_avg[r.a:r.b], denom)
                    torch._foreach_copy_(params, r.scratch_a)
        k.add_(counted)

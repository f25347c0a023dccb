"""transformers' Adafactor with the same math in far fewer kernel launches (--optimizer_type AdaFactor).

transformers' step is a Python loop over the parameters with about twenty small kernels each: a LoRA of SDXL has
1,444 tensors, so its step was ~440 ms of host time on an H100 (docs/BENCHMARKS.md run64: 571 against AdamW's 130
ms at bs1 + GC). Here the parameters of one shape are stacked and updated as one batch, and the per-parameter
state (exp_avg_sq_row / _col / exp_avg_sq / exp_avg, step, RMS) is kept in transformers' layout, so --save_state
and --resume see the same optimizer state. The formulas are transformers' (elementwise the same operations in the
same order; the row / column means and norms are the same reductions over a batch), and `max(eps, RMS)` becomes
a clamp on the device, so scale_parameter=True reads nothing back to the host.
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
from transformers.optimization import Adafactor


BATCH_ELEMENTS = 1 << 22  # at most this many elements a batch (16 MiB in fp32): large weights are stepped alone


def _batch(tensors: list) -> torch.Tensor:
    """The tensors stacked on a new first dim; one tensor is viewed, not copied (updated in place)."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def _write_back(targets: list, batch: torch.Tensor) -> None:
    """Copy the batch's rows into `targets` unless the batch is a view of the one target."""
    if len(targets) == 1 and batch.data_ptr() == targets[0].data_ptr() and batch.dtype == targets[0].dtype:
        return
    torch._foreach_copy_(targets, list(batch.unbind(0)))


class GroupedAdafactor(Adafactor):
    """Adafactor whose step batches the parameters of one shape, dtype and step count (see the module's docstring)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            loss = closure()
        for group in self.param_groups:
            batches = defaultdict(list)
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Adafactor does not support sparse gradients.")
                state = self.state[p]
                if len(state) == 0:
                    self._init_state(group, p, state)
                state["step"] += 1
                batches[(tuple(p.shape), p.dtype, p.device, state["step"])].append(p)
            for (shape, _dtype, _device, step), params in batches.items():
                per_batch = max(1, BATCH_ELEMENTS // max(1, math.prod(shape)))  # a bounded extra copy
                for i in range(0, len(params), per_batch):
                    self._step_batch(group, params[i:i + per_batch], len(shape) >= 2, step)
        return loss

    def _init_state(self, group, p, state) -> None:
        grad = p.grad.float() if p.grad.dtype in (torch.float16, torch.bfloat16) else p.grad
        shape = grad.shape
        state["step"] = 0
        if group["beta1"] is not None:
            state["exp_avg"] = torch.zeros_like(grad)
        if len(shape) >= 2:
            state["exp_avg_sq_row"] = torch.zeros(shape[:-1]).to(grad)
            state["exp_avg_sq_col"] = torch.zeros(shape[:-2] + shape[-1:]).to(grad)
        else:
            state["exp_avg_sq"] = torch.zeros_like(grad)
        state["RMS"] = 0

    def _step_batch(self, group, params: list, factored: bool, step: int) -> None:
        states = [self.state[p] for p in params]
        grads = _batch([p.grad for p in params]).float()  # as transformers: bf16/fp16 gradients in fp32
        weights = _batch(params).float()  # a copy for bf16/fp16 weights (or several), else the weight itself
        dims = tuple(range(1, weights.ndim))
        numel = params[0].numel()
        rms = torch.linalg.vector_norm(weights, 2, dim=dims) / (numel ** 0.5)
        for i, state in enumerate(states):
            state["RMS"] = rms[i]
        lr = self._batch_lr(group, step, rms)  # a float, or one value per parameter (scale_parameter)
        beta2t = 1.0 - math.pow(step, group["decay_rate"])
        update = (grads ** 2) + group["eps"][0]
        if factored:
            rows = _batch([s["exp_avg_sq_row"] for s in states])
            cols = _batch([s["exp_avg_sq_col"] for s in states])
            rows.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
            cols.mul_(beta2t).add_(update.mean(dim=-2), alpha=(1.0 - beta2t))
            _write_back([s["exp_avg_sq_row"] for s in states], rows)
            _write_back([s["exp_avg_sq_col"] for s in states], cols)
            r_factor = (rows / rows.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            c_factor = cols.unsqueeze(-2).rsqrt()
            update = torch.mul(r_factor, c_factor)
            update.mul_(grads)
        else:
            sq = _batch([s["exp_avg_sq"] for s in states])
            sq.mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
            _write_back([s["exp_avg_sq"] for s in states], sq)
            update = sq.rsqrt().mul_(grads)
        per_param = (-1,) + (1,) * (update.ndim - 1)
        update_rms = torch.linalg.vector_norm(update, 2, dim=dims) / (numel ** 0.5)
        update.div_((update_rms / group["clip_threshold"]).clamp_(min=1.0).view(per_param))
        update.mul_(lr if isinstance(lr, float) else lr.view(per_param))
        if group["beta1"] is not None:
            avg = _batch([s["exp_avg"] for s in states])
            avg.mul_(group["beta1"]).add_(update, alpha=(1 - group["beta1"]))
            _write_back([s["exp_avg"] for s in states], avg)
            update = avg
        if group["weight_decay"] != 0:
            decay = -group["weight_decay"] * lr
            if isinstance(decay, float):
                weights.add_(weights, alpha=decay)
            else:
                weights.add_(weights * decay.view(per_param))
        weights.add_(-update)
        _write_back(params, weights)

    @staticmethod
    def _batch_lr(group, step: int, rms: torch.Tensor):
        """transformers' _get_lr for a batch: the relative step from the (shared) step count; with scale_parameter
        max(eps[1], RMS) per parameter, as a clamp on the device."""
        rel_step_sz = group["lr"]
        if group["relative_step"]:
            min_step = 1e-6 * step if group["warmup_init"] else 1e-2
            rel_step_sz = min(min_step, 1.0 / math.sqrt(step))
        if group["scale_parameter"]:
            return rms.clamp(min=group["eps"][1]) * rel_step_sz
        return 1.0 * rel_step_sz

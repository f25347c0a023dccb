"""prodigyopt's Prodigy with the same math in a few multi-tensor operations, no read back to the host, and a step that
a CUDA graph can hold (--optimizer_type Prodigy).

prodigyopt's step loops over the parameters in Python and reads two numbers back to the host for each (the dot
product of its d estimate and the sum of |s|): with a LoRA's 1,444 tensors that is 2,888 waits for the GPU a step
(docs/BENCHMARKS.md run64: SDXL bs1 + GC 461 ms against AdamW's 130 ms). Here the elementwise updates are torch's
multi-tensor (_foreach) forms of the same operations, and the scalars prodigyopt keeps on the host (d, d_max,
d_numerator, d_hat, d_denom, the step count k) are float64 tensors on the device, shared by the param groups, updated
in place with prodigyopt's formulas (its `if`s as `torch.where`). So nothing waits for the GPU, and with learning
rates given as tensors (library.compile.step_graph does this) the whole step can be captured in the training step's
CUDA graph. The gradients are scaled by d in place first (prodigyopt multiplies its coefficients by d instead): the
weights agree with prodigyopt's to float32 rounding, and `.grad` holds d * grad after the step.

The state (exp_avg, exp_avg_sq, s, p0, step; the group's d, d_max, d_numerator, k...) is prodigyopt's; state_dict()
gives the scalars as Python numbers, as prodigyopt saves them, so --save_state / --resume work across the two.
FSDP-flattened parameters and devices without float64 (MPS) use prodigyopt's own step.
"""
from __future__ import annotations

import math

import torch
from prodigyopt import Prodigy

from library.device_scalars import DeviceScalars, cat_sum


class ForeachProdigy(DeviceScalars, Prodigy):
    """Prodigy whose step runs as a few multi-tensor operations on the device (see the module's docstring)."""

    capturable_step = True  # library.compile.step_graph: the step may be captured, with lr tensors
    SCALARS = ("d", "d_max", "d_numerator", "d_hat", "d_denom", "k")  # prodigyopt's per-group numbers

    def _initial(self, group: dict, key: str) -> float:
        return group.get(key, group["d"] if key == "d_hat" else 0.0)  # before its first step: no d_hat / d_denom

    def _own_step(self) -> bool:
        params = [p for g in self.param_groups for p in g["params"]]
        return any(g["fsdp_in_use"] for g in self.param_groups) or any(hasattr(p, "_fsdp_flattened") for p in params) \
            or (bool(params) and params[0].device.type == "mps")

    def _rates(self, device):
        """-> (lr, per group: True / False / a device bool tensor whether it steps). prodigyopt's `lr` is the
        largest group rate; groups with another rate than it or 0 are refused, as prodigyopt does."""
        lrs = [g["lr"] for g in self.param_groups]
        if not any(isinstance(v, torch.Tensor) for v in lrs):
            lr = max(lrs)
            if any(v not in [lr, 0.0] for v in lrs):
                raise RuntimeError("Setting different lr values in different parameter groups is only supported for "
                                   "values of 0")
            buf = self.__dict__.get("_lr_buffer")
            if buf is None or buf.device != device:
                buf = self._lr_buffer = torch.zeros((), dtype=torch.float64, device=device)
            buf.fill_(lr)
            return buf, [v > 0.0 for v in lrs]
        rates = [torch.as_tensor(v, device=device).to(torch.float64) for v in lrs]
        lr = torch.stack(rates).max() if len(rates) > 1 else rates[0]
        return lr, [r > 0 for r in rates]

    @torch.no_grad()
    def step(self, closure=None):
        if self._own_step():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not stepped:
            return loss
        device = stepped[0].device
        sc = self._scalars(device)
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        beta3 = group["beta3"] if group["beta3"] is not None else math.sqrt(beta2)
        d, d_max, k = sc["d"], sc["d_max"], sc["k"]
        lr, actives = self._rates(device)
        if group["use_bias_correction"]:
            bias_correction = ((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1))
        else:
            bias_correction = 1.0
        dlr = d * lr * bias_correction
        growth_rate = group["growth_rate"]
        decouple = group["decouple"]

        # the first pass: the gradients scaled by d, the EMAs and s per group, and the two sums, all on the device
        delta_numerator, d_denom = [], []
        for g, active in zip(self.param_groups, actives):
            d0, slice_p = g["d0"], g["slice_p"]
            params, grads = self._with_grads(g, coupled_decay=not decouple)
            if not params:
                continue
            for p in params:
                self._init_state(p, slice_p, beta1, device)
            masked = active is not True and active is not False  # a device flag: contributions are times it
            # d * grad (times the flag where only the first pass reads the gradients: beta1 > 0)
            torch._foreach_mul_(grads, (d * active).float() if masked and beta1 > 0 else d.float())
            if active is False:
                continue
            contrib = torch._foreach_mul(grads, active.float()) if masked and beta1 == 0 else grads
            states = [self.state[p] for p in params]
            sliced = [gr.flatten()[::slice_p] for gr in contrib]
            # sum of dot(d * grad, p0 - p): p0 is a zero scalar for a parameter that started at zero
            full = [i for i, s in enumerate(states) if s["p0"].dim() > 0]
            zero = [i for i, s in enumerate(states) if s["p0"].dim() == 0]
            dot = 0.0
            if full:
                diffs = torch._foreach_sub([states[i]["p0"] for i in full],
                                           [params[i].flatten()[::slice_p] for i in full])
                torch._foreach_mul_(diffs, [sliced[i] for i in full])
                dot = cat_sum(diffs)
                del diffs
            if zero:
                prods = torch._foreach_mul([sliced[i] for i in zero], [params[i].flatten()[::slice_p] for i in zero])
                dot = dot - cat_sum(prods)
                del prods
            delta_numerator.append(dot * (dlr / d0))
            keep1 = torch.where(active, beta1, 1.0).float() if masked else beta1
            keep2 = torch.where(active, beta2, 1.0).float() if masked else beta2
            keep3 = torch.where(active, beta3, 1.0).float() if masked else beta3
            if beta1 > 0:
                exp_avgs = [s["exp_avg"] for s in states]
                torch._foreach_mul_(exp_avgs, keep1)
                torch._foreach_add_(exp_avgs, contrib, alpha=1 - beta1)
            exp_avg_sqs = [s["exp_avg_sq"] for s in states]
            torch._foreach_mul_(exp_avg_sqs, keep2)
            torch._foreach_addcmul_(exp_avg_sqs, contrib, contrib, value=1 - beta2)
            ss = [s["s"] for s in states]
            torch._foreach_mul_(ss, keep3)
            s_scale = ((d / d0) if g["safeguard_warmup"] else (dlr / d0)).float()  # times the d in the gradients
            torch._foreach_add_(ss, torch._foreach_mul(sliced, s_scale))
            s_sum = torch.stack(torch._foreach_norm(ss, 1)).sum(dtype=torch.float64)
            d_denom.append(s_sum * active if masked else s_sum)

        # prodigyopt's update of d; where it would return early (no |s| yet) nothing below changes
        d_numerator = sc["d_numerator"] * beta3 + (sum(delta_numerator) if delta_numerator else 0.0)
        denom = sum(d_denom) if d_denom else torch.zeros((), dtype=torch.float64, device=device)
        ok = denom > 0
        d_hat = group["d_coef"] * d_numerator / torch.where(ok, denom, 1.0)
        d_new = torch.where(d == self.param_groups[-1]["d0"], torch.maximum(d, d_hat), d)
        d_max_new = torch.maximum(d_max, d_hat)
        d_new = torch.minimum(d_max_new, d_new * growth_rate)
        # beta1 = 0 steps with the gradient times the new d; the gradients hold the old one
        grad_rate = (dlr * ok * torch.where(ok, d_new, d) / d).float() if beta1 == 0 else None
        for key, value in (("d_numerator", d_numerator), ("d_denom", denom), ("d", d_new), ("d_max", d_max_new),
                           ("d_hat", d_hat)):
            sc[key].copy_(torch.where(ok, value, sc[key]))
        step_rate = (dlr * ok).float()  # 0 where prodigyopt returns early: the weights stay

        # the second pass: the step itself (every group, as prodigyopt)
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if not params:
                continue
            states, denoms = self._counted_roots(params, ok)
            torch._foreach_add_(denoms, (d * g["eps"]).float())
            if g["weight_decay"] != 0 and decouple:
                torch._foreach_mul_(params, 1 - g["weight_decay"] * step_rate)
            # p - rate * a / denom as p + a / (denom / -rate): a rate of 0 leaves p as it is
            torch._foreach_div_(denoms, -step_rate if beta1 > 0 else -grad_rate)
            torch._foreach_addcdiv_(params, [s["exp_avg"] for s in states] if beta1 > 0 else [p.grad for p in params],
                                    denoms)
        k.add_(ok.to(k.dtype))
        return loss

    def _init_state(self, p, slice_p: int, beta1: float, device) -> None:
        state = self.state[p]
        if "step" in state:
            self._step_counter(state, device)
            return
        state["step"] = torch.zeros((), dtype=torch.int64, device=device)
        state["s"] = torch.zeros_like(p.data.flatten()[::slice_p]).detach()
        if p.any():
            state["p0"] = p.flatten()[::slice_p].detach().clone()
        else:  # all zero (a LoRA up matrix): prodigyopt keeps a zero scalar
            state["p0"] = torch.tensor(0, device=p.device, dtype=p.dtype)
        if beta1 > 0:
            state["exp_avg"] = torch.zeros_like(p.data).detach()
        state["exp_avg_sq"] = torch.zeros_like(p.data).detach()

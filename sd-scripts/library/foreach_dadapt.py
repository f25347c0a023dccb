"""dadaptation's DAdaptAdam with the same math in a few multi-tensor operations and no read back to the host
(--optimizer_type DAdaptAdam).

dadaptation's step loops over the parameters in Python and reads two numbers back to the host for each (a dot
product for its d estimate and the sum of |s|): 2,888 waits for the GPU a step with an SDXL LoRA, as prodigyopt
had (library.foreach_prodigy). Here the elementwise updates are torch's multi-tensor (_foreach) forms of the same
operations, d, numerator_weighted and k are float64 device tensors (library.device_scalars) updated with
dadaptation's formulas (its `if`s as `torch.where`), and nothing waits for the GPU. The gradients are scaled by
d's step size in place after the second-moment update (dadaptation multiplies its coefficients instead): the weights
agree with dadaptation's to float32 rounding. The learning rates stay host numbers, so the step runs after the step
graph's replay (library.compile.graphs.AFTER_GRAPH_OPTIMIZERS). FSDP, log_every > 0 and MPS (no float64) use
dadaptation's own step.
"""
from __future__ import annotations

import torch
from dadaptation import DAdaptAdam

from library.device_scalars import DeviceScalars, cat_sum


class ForeachDAdaptAdam(DeviceScalars, DAdaptAdam):
    """DAdaptAdam whose step runs as a few multi-tensor operations on the device (see the module's docstring)."""

    SCALARS = ("d", "numerator_weighted", "k")
    LR_ERROR = DeviceScalars.LR_ERROR + (". To scale the learning rate differently for each layer, set the "
                                         "'layer_scale' value instead.")

    def _own_step(self, params: list) -> bool:
        return any(g["fsdp_in_use"] or g["log_every"] > 0 for g in self.param_groups) or \
            any(hasattr(p, "_fsdp_flattened") for p in params) or (bool(params) and params[0].device.type == "mps")

    def _device_step(self, device: torch.device, sc: dict) -> None:
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        d, k = sc["d"], sc["k"]
        lr, dlr = self._rate(d, k)
        sqrt_beta2 = beta2 ** 0.5
        decouple = group["decouple"]

        # the first pass, per group: the dot product with s / denom, the EMAs and s, the sum of |s|
        numerator_acum, sk_l1 = [], []
        for g in self.param_groups:
            eps, r = g["eps"], g["layer_scale"]
            params, grads = self._with_grads(g, coupled_decay=not decouple)
            if not params:
                continue
            for p in params:
                self._init_state(p, device)
            if not g["lr"] > 0.0:
                continue
            states = [self.state[p] for p in params]
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_sqs = [s["exp_avg_sq"] for s in states]
            ss = [s["s"] for s in states]
            ratios = torch._foreach_sqrt(exp_avg_sqs)  # s / (sqrt(v) + eps), before this step's updates
            torch._foreach_add_(ratios, eps)
            torch._foreach_reciprocal_(ratios)
            torch._foreach_mul_(ratios, ss)
            torch._foreach_mul_(ratios, grads)
            numerator_acum.append(cat_sum(ratios) * (r * dlr))
            del ratios
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
            torch._foreach_mul_(grads, dlr.float())  # dlr * grad
            torch._foreach_mul_(exp_avgs, beta1)
            torch._foreach_add_(exp_avgs, grads, alpha=r * (1 - beta1))
            torch._foreach_mul_(ss, sqrt_beta2)
            torch._foreach_add_(ss, grads, alpha=1 - sqrt_beta2)
            sk_l1.append(torch.stack(torch._foreach_norm(ss, 1)).sum(dtype=torch.float64) * r)

        # dadaptation's update of d; where it would return early (no |s| yet) nothing below changes
        numerator_weighted = sqrt_beta2 * sc["numerator_weighted"] + (1 - sqrt_beta2) * \
            (sum(numerator_acum) if numerator_acum else 0.0)
        total = sum(sk_l1) if sk_l1 else torch.zeros((), dtype=torch.float64, device=device)
        ok = total > 0
        d_new = d
        if lr > 0.0:
            d_hat = numerator_weighted / ((1 - sqrt_beta2) * torch.where(ok, total, 1.0))
            d_new = torch.maximum(d, torch.minimum(d_hat, d * group["growth_rate"]))
        step_rate = (dlr * ok).float()  # 0 where dadaptation returns early: the weights stay
        sc["numerator_weighted"].copy_(torch.where(ok, numerator_weighted, sc["numerator_weighted"]))
        d.copy_(torch.where(ok, d_new, d))

        # the second pass: the step itself (every group, as dadaptation)
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            if not params:
                continue
            states, denoms = self._counted_roots(params, ok)
            torch._foreach_add_(denoms, g["eps"])
            if g["weight_decay"] != 0 and decouple:
                torch._foreach_mul_(params, 1 - g["weight_decay"] * step_rate)
            # p - exp_avg / denom as p + exp_avg / (denom / -ok): not ok (0) leaves p as it is
            torch._foreach_div_(denoms, -ok.float())
            torch._foreach_addcdiv_(params, [s["exp_avg"] for s in states], denoms)
        k.add_(ok.to(k.dtype))

    def _init_state(self, p, device) -> None:
        state = self.state[p]
        if "step" in state:
            self._step_counter(state, device)
            return
        state["step"] = torch.zeros((), dtype=torch.int64, device=device)
        state["s"] = torch.zeros_like(p.data).detach()
        state["exp_avg"] = torch.zeros_like(p.data).detach()
        state["exp_avg_sq"] = torch.zeros_like(p.data).detach()


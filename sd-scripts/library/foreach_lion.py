"""lion-pytorch's Lion as multi-tensor operations (--optimizer_type Lion).

lion-pytorch steps each parameter with about seven small kernels (1,444 tensors in an SDXL LoRA: ~10,000 launches a
step). Here the same operations, in the same order, run as torch's multi-tensor (_foreach) forms over all parameters
of a group: the decay p *= 1 - lr * wd, the update sign(beta1 * m + (1 - beta1) * g) added times -lr, then m =
beta2 * m + (1 - beta2) * g. Nothing is read back to the host, and a learning rate given as a tensor is used as the
same number (the step could be captured; library.compile.step_graph runs it after each replay, as every optimizer
but torch's AdamW/Adam). The state (exp_avg) is lion-pytorch's; Triton's update (use_triton=True) keeps its own
step.
"""
from __future__ import annotations

import torch
from lion_pytorch import Lion
from lion_pytorch.lion_pytorch import update_fn


class ForeachLion(Lion):
    """Lion whose step is a few multi-tensor operations per param group (see the module's docstring)."""

    @torch.no_grad()
    def step(self, closure=None):
        if self.update_fn is not update_fn:  # use_triton
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            if self.decoupled_wd:
                wd /= self._init_lr
            grads = [p.grad for p in params]
            exp_avgs = []
            for p in params:
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avgs.append(state["exp_avg"])
            tensor_lr = isinstance(lr, torch.Tensor)
            if wd != 0:
                torch._foreach_mul_(params, (1.0 - lr.double() * wd).float() if tensor_lr else 1.0 - lr * wd)
            updates = torch._foreach_mul(exp_avgs, beta1)
            torch._foreach_add_(updates, grads, alpha=1.0 - beta1)
            torch._foreach_sign_(updates)
            if tensor_lr:  # -lr times a sign is exact: the same sums as add(..., alpha=-lr)
                torch._foreach_mul_(updates, -lr.float())
                torch._foreach_add_(params, updates)
            else:
                torch._foreach_add_(params, updates, alpha=-lr)
            torch._foreach_mul_(exp_avgs, beta2)
            torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)
        return loss

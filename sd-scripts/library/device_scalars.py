"""The per-group numbers of an adaptive optimizer (Prodigy's and D-Adaptation's d, k, ...) kept as float64 tensors
on the device, the same tensors in every param group, so that its step reads nothing back to the host
(library.foreach_prodigy, library.foreach_dadapt). state_dict() gives them (and the per-parameter step counts) as
Python numbers, as the original packages save them, so --save_state / --resume work across the two."""
from __future__ import annotations

import torch


class DeviceScalars:
    """Mixin before the optimizer class: SCALARS name the group entries kept on the device, INTEGERS those saved as
    ints; `_initial(group, key)` gives an entry a group does not have yet. step() runs the closure and the subclass's
    `_device_step`, or the original package's step where `_own_step` says so."""

    SCALARS: tuple[str, ...] = ()
    INTEGERS = ("k", "step")

    def _own_step(self, params: list) -> bool:
        """Whether the original package's step runs instead (FSDP, MPS: no float64...)."""
        return False

    def _device_step(self, device: torch.device, sc: dict) -> None:
        """The step on the device (some parameters have gradients); sc: the group numbers (`_scalars`)."""
        raise NotImplementedError

    LR_ERROR = "Setting different lr values in different parameter groups is only supported for values of 0"

    def _rate(self, d: torch.Tensor, k: torch.Tensor) -> tuple[float, torch.Tensor]:
        """(lr, dlr): the groups' learning rate (all the same, or 0; else the package's error) and d * lr * Adam's
        bias correction where the group asks for it, as both packages compute them."""
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        lrs = [g["lr"] for g in self.param_groups]
        lr = max(lrs)
        if any(v not in [lr, 0.0] for v in lrs):
            raise RuntimeError(self.LR_ERROR)
        if group["use_bias_correction"]:
            return lr, d * lr * (((1 - beta2 ** (k + 1)) ** 0.5) / (1 - beta1 ** (k + 1)))
        return lr, d * lr

    @torch.no_grad()
    def step(self, closure=None):
        stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self._own_step(stepped):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if stepped:
            self._device_step(stepped[0].device, self._scalars(stepped[0].device))
        return loss

    def _initial(self, group: dict, key: str) -> float:
        return group.get(key, 0.0)

    def _scalars(self, device) -> dict:
        """The groups' numbers as float64 device tensors, shared by all groups (made once, or after a load)."""
        first = self.param_groups[0]
        if not all(isinstance(first.get(k), torch.Tensor) and first[k].device == device for k in self.SCALARS) or \
                any(g.get(k) is not first[k] for g in self.param_groups for k in self.SCALARS):
            values = {k: torch.tensor(float(self._initial(first, k)), dtype=torch.float64, device=device)
                      for k in self.SCALARS}
            for g in self.param_groups:
                g.update(values)
        return {k: first[k] for k in self.SCALARS}

    def _step_counter(self, state: dict, device) -> None:
        """The per-parameter step count as an int64 device tensor (a loaded file holds an int)."""
        if not isinstance(state["step"], torch.Tensor):
            state["step"] = torch.tensor(int(state["step"]), dtype=torch.int64, device=device)

    def _with_grads(self, group: dict, coupled_decay: bool) -> tuple[list, list]:
        """The group's parameters that have a gradient and their gradients, with the weight decay added to the
        gradients where it is coupled (both packages do so before anything else)."""
        params = [p for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        if params and group["weight_decay"] != 0 and coupled_decay:
            torch._foreach_add_(grads, params, alpha=group["weight_decay"])
        return params, grads

    def _counted_roots(self, params: list, ok: torch.Tensor) -> tuple[list, list]:
        """The second pass's start: each parameter's step count goes up where the step happened (ok), and
        -> (their states, sqrt(exp_avg_sq) of each)."""
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        # the list form: the one-tensor form reads an integer tensor back to the host (a sync every step, run84)
        torch._foreach_add_(steps, [ok.long()] * len(steps))
        return states, torch._foreach_sqrt([s["exp_avg_sq"] for s in states])

    def state_dict(self):
        """The original layout: the group numbers and step counts as Python numbers (read back once)."""
        out = super().state_dict()
        out["state"] = {i: dict(s) for i, s in out["state"].items()}  # torch's packs the live dicts
        tensors = [(g, key) for g in out["param_groups"] for key in self.SCALARS
                   if isinstance(g.get(key), torch.Tensor)]
        steps = [(s, "step") for s in out["state"].values() if isinstance(s.get("step"), torch.Tensor)]
        if tensors or steps:
            values = torch.stack([c[key].double() for c, key in tensors + steps])
            for (c, key), value in zip(tensors + steps, values.tolist()):
                c[key] = int(value) if key in self.INTEGERS else value
        return out


def cat_sum(tensors: list) -> torch.Tensor:
    """The sum of all elements of `tensors` in float64 (one copy into one buffer, one reduction)."""
    return torch.cat([t.reshape(-1) for t in tensors]).sum(dtype=torch.float64)

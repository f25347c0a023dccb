"""The per-group numbers of an adaptive optimizer (Prodigy's and D-Adaptation's d, k, ...) kept as float64 tensors
on the device, the same tensors in every param group, so that its step reads nothing back to the host
(library.foreach_prodigy, library.foreach_dadapt). state_dict() gives them (and the per-parameter step counts) as
Python numbers, as the original packages save them, so --save_state / --resume work across the two."""
from __future__ import annotations

import torch


class DeviceScalars:
    """Mixin before the optimizer class: SCALARS name the group entries kept on the device, INTEGERS those saved as
    ints; `_initial(group, key)` gives an entry a group does not have yet."""

    SCALARS: tuple[str, ...] = ()
    INTEGERS = ("k", "step")

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

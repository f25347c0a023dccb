"""Checks that an optimizer step reads nothing back to the host: on the CPU any read of a tensor's value raises
(`refuse_host_reads`), on a GPU torch's sync debug mode raises on any wait (`steps_without_sync`)."""
import pytest
import torch

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__repr__")


def refuse_host_reads(patch) -> None:
    """patch: a monkeypatch (context); while it holds, reading a tensor's value on the host fails the test."""
    for name in READS:
        patch.setattr(torch.Tensor, name, lambda *a, **k: pytest.fail("the step read a tensor back to the host"))


def steps_without_sync(opt, params, steps: int = 4) -> None:
    """`steps` steps with random CUDA gradients; every step after the first (which makes the state) in torch's sync
    debug mode "error"."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=g)
        if step:
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)

"""The optimizer tests' shared pieces: LoRA-like parameters and their gradients (`lora_like_params`,
`pulled_gradients`), and checks that a step reads nothing back to the host: on the CPU any read of a tensor's value
raises (`refuse_host_reads`), on a GPU torch's sync debug mode raises on any wait (`steps_without_sync`)."""
import pytest
import torch

SHAPES = [(4, 32), (4, 32), (48, 4), (48, 4), (8, 16), (16,)]


def lora_like_params(shapes=SHAPES) -> list:
    """Seeded parameters; the third is a LoRA up matrix, which starts at zero."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.1) for s in shapes]
    with torch.no_grad():
        params[2].zero_()
    return params


def pulled_gradients(params, steps: int):
    """Yields each step's number after giving the parameters the gradient of a quadratic pull towards fixed targets,
    plus noise (so D-Adaptation's and Prodigy's d grows); at step 3 the last parameter has no gradient."""
    g = torch.Generator().manual_seed(1)
    targets = [torch.randn(p.shape, generator=g) for p in params]
    for step in range(steps):
        for p, t in zip(params, targets):
            p.grad = (p.detach() - t) + 0.1 * torch.randn(p.shape, generator=g)
        if step == 3:
            params[-1].grad = None
        yield step


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

"""library.bnb_unsynced: bitsandbytes' optimizers step with the same calls in the same order as bitsandbytes' own
step, without its GPU synchronize after every parameter (paged ones keep it). Needs bitsandbytes (an extra)."""
import copy

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from library import bnb_unsynced, optimizers  # noqa: E402


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((64, 96), (96, 64), (64, 96), (32,))]


def _train(opt, params, steps=5):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit", "SGD8bit"])
def test_same_updates_without_the_per_parameter_sync(name, monkeypatch):
    import bitsandbytes.optim.optimizer as bnb_optimizer

    syncs = []
    monkeypatch.setattr(bnb_optimizer, "sync_gpu", lambda t: syncs.append(t))
    cls = getattr(bnb.optim, name)
    kwargs = dict(lr=1e-2, min_8bit_size=16) | (dict(momentum=0.9) if name == "SGD8bit" else {})
    ref_params = _params()
    got_params = copy.deepcopy(ref_params)
    _train(cls(ref_params, **kwargs), ref_params)
    assert len(syncs) == 5 * len(ref_params)  # bitsandbytes' step: one wait per parameter
    syncs.clear()
    fast = bnb_unsynced.unsynced(cls)(got_params, **kwargs)
    _train(fast, got_params)
    assert syncs == []
    for a, b in zip(ref_params, got_params):
        assert torch.equal(a, b)  # the same kernels in the same order: bit for bit
    assert type(fast).__name__ == name and isinstance(fast, cls)


def test_paged_optimizers_keep_their_step(monkeypatch):
    called = []
    monkeypatch.setattr(bnb_unsynced.unsynced(bnb.optim.PagedAdamW8bit), "_bnb_step",
                        lambda self, closure=None: called.append(self))
    opt = bnb_unsynced.unsynced(bnb.optim.PagedAdamW8bit)(_params(), lr=1e-3)
    opt.step()
    assert called == [opt]  # bitsandbytes' own step, waits included


def test_get_optimizer_builds_the_unsynced_class_and_names_bitsandbytes_class():
    import argparse

    parser = argparse.ArgumentParser()
    optimizers.add_optimizer_arguments(parser)
    args = parser.parse_args(["--optimizer_type", "AdamW8bit"])
    _, class_path, opt = optimizers.get_optimizer(args, _params())
    assert class_path == "bitsandbytes.optim.adamw.AdamW8bit"
    assert type(opt).step is not bnb.optim.AdamW8bit.step and isinstance(opt, bnb.optim.AdamW8bit)

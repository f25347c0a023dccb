"""library.foreach_lion: lion-pytorch's Lion as multi-tensor operations gives lion-pytorch's weights and state, reads
nothing back to the host, and takes learning rates as tensors (as the step graph gives them). CPU."""
import argparse
import copy

import pytest
import torch

pytest.importorskip("lion_pytorch")
from lion_pytorch import Lion  # noqa: E402

from host_reads import refuse_host_reads  # noqa: E402
from library import optimizers  # noqa: E402
from library.foreach_lion import ForeachLion  # noqa: E402


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.1) for s in ((8, 32), (32, 8), (8, 32), (16,))]


def _train(opt, params, rates, tensor_rates=False, monkeypatch=None):
    g = torch.Generator().manual_seed(1)
    for step, rate in enumerate(rates):
        for i, p in enumerate(params):
            p.grad = None if (step == 2 and i == 3) else torch.randn(p.shape, generator=g)
        for group in opt.param_groups:
            group["lr"] = torch.tensor(rate) if tensor_rates else rate
        if monkeypatch is None:
            opt.step()
            continue
        with monkeypatch.context() as patch:
            refuse_host_reads(patch)
            opt.step()


@pytest.mark.parametrize("kwargs", [dict(), dict(weight_decay=0.1), dict(weight_decay=0.1, decoupled_weight_decay=True,
                                                                        betas=(0.95, 0.98))])
def test_same_weights_and_state_as_lion_pytorch(kwargs):
    ref_params = _params()
    got_params = copy.deepcopy(ref_params)
    rates = [1e-3, 5e-4, 2e-4, 1e-4]
    ref = Lion([{"params": ref_params[:2]}, {"params": ref_params[2:]}], lr=1e-3, **kwargs)
    got = ForeachLion([{"params": got_params[:2]}, {"params": got_params[2:]}], lr=1e-3, **kwargs)
    _train(ref, ref_params, rates)
    _train(got, got_params, rates)
    for a, b in zip(ref_params, got_params):
        assert torch.equal(a, b)  # the same operations in the same order
    for a, b in zip(ref_params, got_params):
        assert torch.equal(ref.state[a]["exp_avg"], got.state[b]["exp_avg"])


def test_tensor_rates_and_no_reads_back(monkeypatch):
    ref_params = _params()
    got_params = copy.deepcopy(ref_params)
    rates = [1e-3, 5e-4, 2e-4]
    ref = Lion(ref_params, lr=1e-3, weight_decay=0.1)
    got = ForeachLion(got_params, lr=1e-3, weight_decay=0.1)
    _train(ref, ref_params, rates)
    _train(got, got_params, rates, tensor_rates=True, monkeypatch=monkeypatch)
    for a, b in zip(ref_params, got_params):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)  # lr as float32 instead of a Python float


def test_get_optimizer_builds_it_and_names_lion_pytorch():
    parser = argparse.ArgumentParser()
    optimizers.add_optimizer_arguments(parser)
    _, class_path, opt = optimizers.get_optimizer(parser.parse_args(["--optimizer_type", "Lion"]), _params())
    assert type(opt) is ForeachLion and class_path == "lion_pytorch.lion_pytorch.Lion"

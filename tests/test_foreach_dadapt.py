"""library.foreach_dadapt: dadaptation's DAdaptAdam as multi-tensor operations with its numbers on the device trains to
dadaptation's weights, d and state, reads nothing back to the host after its first step, and saves dadaptation's
layout (CPU, a LoRA-like set of shapes)."""
import argparse
import copy

import pytest
import torch

pytest.importorskip("dadaptation")
from dadaptation import DAdaptAdam  # noqa: E402

from host_reads import refuse_host_reads, steps_without_sync  # noqa: E402
from library import optimizers  # noqa: E402
from library.foreach_dadapt import ForeachDAdaptAdam  # noqa: E402


def _params():
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 32), (4, 32), (48, 4), (48, 4), (8, 16), (16,)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.1) for s in shapes]
    with torch.no_grad():
        params[2].zero_()  # a LoRA up matrix starts at zero
    return params


def _train(opt, params, steps=6, rates=None, monkeypatch=None):
    g = torch.Generator().manual_seed(1)
    targets = [torch.randn(p.shape, generator=g) for p in params]
    for step in range(steps):
        for p, t in zip(params, targets):  # the gradient of a quadratic pull towards t, plus noise: d grows
            p.grad = (p.detach() - t) + 0.1 * torch.randn(p.shape, generator=g)
        if step == 3:
            params[-1].grad = None  # a parameter without a gradient this step
        if rates is not None:
            for group in opt.param_groups:
                group["lr"] = rates[step]
        if monkeypatch is None or step == 0:
            opt.step()
            continue
        with monkeypatch.context() as patch:
            refuse_host_reads(patch)
            opt.step()


def _groups(params, layer_scale=1.0):
    return [{"params": params[:4]}, {"params": params[4:], "layer_scale": layer_scale}]


@pytest.mark.parametrize("kwargs", [
    dict(),  # the presets': lr 1.0, defaults
    dict(weight_decay=0.01, decouple=True, use_bias_correction=True),
    dict(weight_decay=0.01, decouple=False, growth_rate=1.02),
])
def test_same_weights_d_and_state_as_dadaptation(kwargs, monkeypatch):
    ref_params, got_params = _params(), _params()
    ref = DAdaptAdam(_groups(ref_params, 0.5), lr=1.0, **kwargs)
    got = ForeachDAdaptAdam(_groups(got_params, 0.5), lr=1.0, **kwargs)
    rates = [0.0, 1.0, 1.0, 0.5, 0.5, 0.25]  # a warmup step at 0 (nothing happens), then a decay
    _train(ref, ref_params, rates=rates)
    _train(got, got_params, rates=rates, monkeypatch=monkeypatch)
    for a, b in zip(ref_params, got_params):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    saved, ref_saved = got.state_dict(), ref.state_dict()
    for rg, gg in zip(ref_saved["param_groups"], saved["param_groups"]):
        assert gg["k"] == rg["k"] == 5 and isinstance(gg["k"], int)
        assert gg["d"] == pytest.approx(rg["d"], rel=1e-5) and isinstance(gg["d"], float)
        assert gg["numerator_weighted"] == pytest.approx(rg["numerator_weighted"], rel=1e-5)
    assert ref_saved["param_groups"][0]["d"] > 1e-6  # d grew from d0: the estimate is exercised
    for i, rs in ref_saved["state"].items():
        gs = saved["state"][i]
        assert gs["step"] == rs["step"] and isinstance(gs["step"], int)
        for name in ("s", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(gs[name], rs[name], rtol=1e-4, atol=1e-6)


def test_a_saved_state_goes_on_in_dadaptation_and_here():
    params = _params()
    got = ForeachDAdaptAdam(params, lr=1.0)
    _train(got, params, steps=4)
    saved = got.state_dict()
    copies = {}
    for cls in (DAdaptAdam, ForeachDAdaptAdam):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = cls(ps, lr=1.0)
        opt.load_state_dict(copy.deepcopy(saved))
        _train(opt, ps, steps=3)
        copies[cls] = ps
    for a, b in zip(copies[DAdaptAdam], copies[ForeachDAdaptAdam]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_get_optimizer_builds_it_and_names_dadaptation():
    parser = argparse.ArgumentParser()
    optimizers.add_optimizer_arguments(parser)
    args = parser.parse_args(["--optimizer_type", "DAdaptAdam", "--learning_rate", "1.0"])
    _, class_path, opt = optimizers.get_optimizer(args, _params())
    assert type(opt) is ForeachDAdaptAdam and class_path == "dadaptation.dadapt_adam.DAdaptAdam"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_steps_do_not_synchronize():
    """torch's sync debug mode raises on any wait for the GPU: none after the first step (which makes the state)."""
    params = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    opt = ForeachDAdaptAdam(params, lr=1.0, weight_decay=0.01, decouple=True)
    steps_without_sync(opt, params)
    assert opt.state_dict()["param_groups"][0]["k"] == 4

"""library.grouped_adafactor: transformers' Adafactor with the parameters of one shape stepped as a batch trains to
the same weights and optimizer state as transformers' own step (CPU, a LoRA-like set of shapes)."""
import copy

import pytest
import torch
from transformers.optimization import Adafactor

from library import grouped_adafactor
from library.grouped_adafactor import GroupedAdafactor


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 32), (4, 32), (4, 32), (48, 4), (48, 4), (8, 16), (16,), (16,), (3, 2, 5)]
    return [torch.nn.Parameter((torch.randn(*s, generator=g) * 0.1).to(dtype)) for s in shapes]


def _train(opt_cls, params, steps=6, **kwargs):
    opt = opt_cls(params, **kwargs)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * (0.5 + step)).to(p.dtype)
        if step == 3:
            params[-1].grad = None  # a parameter without a gradient this step: not stepped
        opt.step()
    return opt


@pytest.mark.parametrize("kwargs", [
    dict(lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False),  # the kohya_ss presets'
    dict(lr=None),  # transformers' defaults: relative step, scale_parameter (max(eps, RMS) per parameter)
    dict(lr=None, warmup_init=True),
    dict(lr=1e-2, scale_parameter=True, relative_step=False, beta1=0.9, weight_decay=0.01),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_weights_and_state_as_transformers(kwargs, dtype, monkeypatch):
    monkeypatch.setattr(grouped_adafactor, "BATCH_ELEMENTS", 300)  # batches of 2 and of 1 as well as larger
    ref_params = _params(dtype)
    got_params = copy.deepcopy(ref_params)
    ref = _train(Adafactor, ref_params, **kwargs)
    got = _train(GroupedAdafactor, got_params, **kwargs)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=0, atol=0)
    for a, b in zip(ref_params, got_params):
        torch.testing.assert_close(b, a, **tol)
    ref_state, got_state = ref.state_dict()["state"], got.state_dict()["state"]
    assert ref_state.keys() == got_state.keys()
    for k in ref_state:
        assert ref_state[k].keys() == got_state[k].keys()
        assert got_state[k]["step"] == ref_state[k]["step"]
        for name in ref_state[k].keys() - {"step"}:
            torch.testing.assert_close(torch.as_tensor(got_state[k][name]), torch.as_tensor(ref_state[k][name]),
                                       rtol=1e-5, atol=1e-7)
    assert got_state[len(ref_params) - 1]["step"] == 5  # skipped once


def test_state_loads_into_transformers_adafactor_and_back():
    """--save_state with one, --resume with the other: the state dicts are interchangeable."""
    params = _params()
    got = _train(GroupedAdafactor, params, lr=1e-3, scale_parameter=False, relative_step=False)
    other = Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)
    other.load_state_dict(got.state_dict())
    assert other.state[params[0]]["step"] == 6
    back = GroupedAdafactor(params, lr=1e-3, scale_parameter=False, relative_step=False)
    back.load_state_dict(other.state_dict())
    for p in params:
        p.grad = torch.ones_like(p)
    back.step()
    assert back.state[params[0]]["step"] == 7

"""library.bnb_unsynced: bitsandbytes' optimizers step without its GPU synchronize after every parameter (paged ones
keep it), and with one update call for a flat run of parameters, bit for bit as bitsandbytes' own step. Needs
bitsandbytes (an extra); runs on the CPU (bitsandbytes' CPU kernels), tests/test_step_graph_gpu.py on a GPU."""
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


def _lora_like(seed=0, device="cpu"):
    """Sizes of a LoRA (multiples of 256 and not), one below min_8bit_size (32-bit state), one zero-initialised."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(32, 320), (320, 32), (7, 333), (333, 7), (16, 40), (40, 16), (300,), (64, 1280)]
    params = [torch.nn.Parameter((torch.randn(*s, generator=g) * 0.1).to(device)) for s in shapes]
    with torch.no_grad():
        params[1].zero_()
    return params


def _lora_steps(opt, params, steps, seed=1, skip=None):
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for i, p in enumerate(params):
            p.grad = (torch.randn(p.shape, generator=g) * (0.01 if i % 2 else 1.0)).to(p.device)
            if i == 2 and step < 2:
                p.grad.zero_()  # all-zero blocks (absmax 0) while a LoRA's up matrix is zero
        if skip is not None and step == skip:
            params[3].grad = None  # a parameter without a gradient this step: its run takes per-parameter calls
        opt.step()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["AdamW8bit", "Lion8bit", "SGD8bit", "AdamW"])
@pytest.mark.parametrize("chunk", [1 << 24, 10_000])
def test_flat_runs_give_bitsandbytes_bits(name, chunk, device, monkeypatch):
    """One update call per run of parameters laid out at block-aligned offsets: the same weights and state, bit for
    bit, as bitsandbytes' own per-parameter calls (8-bit and 32-bit state, two groups, chunks of the run; bitsandbytes'
    CPU kernels here, its CUDA kernels on a GPU)."""
    monkeypatch.setattr(bnb_unsynced, "CHUNK_ELEMENTS", chunk)
    cls = getattr(bnb.optim, name)
    kwargs = dict(lr=1e-2, weight_decay=0.01, min_8bit_size=1000) | (dict(momentum=0.9) if name == "SGD8bit" else {})
    ref_params, got_params = _lora_like(device=device), _lora_like(device=device)

    def groups(params):
        return [{"params": params[:5]}, {"params": params[5:], "lr": 3e-3}]

    ref = cls(groups(ref_params), **kwargs)
    got = bnb_unsynced.unsynced(cls)(groups(got_params), **kwargs)
    calls = []
    real = bnb.functional.optimizer_update_8bit_blockwise
    monkeypatch.setattr(bnb.functional, "optimizer_update_8bit_blockwise",
                        lambda *a, **k: (calls.append(a[1].numel()), real(*a, **k)))
    _lora_steps(ref, ref_params, 6, skip=4)
    n_ref = len(calls)
    calls.clear()
    _lora_steps(got, got_params, 6, skip=4)
    if name != "AdamW":  # 8-bit: fewer, larger calls than one per parameter
        assert 0 < len(calls) < n_ref
    for a, b in zip(ref_params, got_params):
        assert torch.equal(a, b)
    for pa, pb in zip(ref_params, got_params):
        sa, sb = ref.state[pa], got.state[pb]
        assert sa.keys() == sb.keys() and sa["step"] == sb["step"]
        for key in sa.keys() - {"step"}:
            assert torch.equal(sa[key], sb[key]), key


def test_flat_runs_survive_save_and_load():
    """A state saved from the flat runs loads into bitsandbytes' own class and into ours (a resume), and both go on
    with the same bits as an uninterrupted run."""
    kwargs = dict(lr=1e-2, min_8bit_size=1000)
    a_params = _lora_like()
    fast = bnb_unsynced.unsynced(bnb.optim.AdamW8bit)(a_params, **kwargs)
    _lora_steps(fast, a_params, 3)
    saved = copy.deepcopy(fast.state_dict())
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]
    c_params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]
    plain = bnb.optim.AdamW8bit(b_params, **kwargs)
    plain.load_state_dict(saved)
    resumed = bnb_unsynced.unsynced(bnb.optim.AdamW8bit)(c_params, **kwargs)
    resumed.load_state_dict(saved)
    for opt, params in ((fast, a_params), (plain, b_params), (resumed, c_params)):
        _lora_steps(opt, params, 3, seed=7)
    ref2_params = _lora_like()
    ref2 = bnb.optim.AdamW8bit(ref2_params, **kwargs)
    _lora_steps(ref2, ref2_params, 3)
    _lora_steps(ref2, ref2_params, 3, seed=7)
    for params in (a_params, b_params, c_params):
        for a, b in zip(ref2_params, params):
            assert torch.equal(a, b)

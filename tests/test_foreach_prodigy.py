"""library.foreach_prodigy: prodigyopt's Prodigy on flat buffers with its numbers on the device trains to the same
weights, d estimates and optimizer state as prodigyopt's own step, reads nothing back to the host after its first
step, and saves prodigyopt's layout (CPU, a LoRA-like set of shapes; on a GPU, no synchronization)."""
import copy

import pytest
import torch
from prodigyopt import Prodigy

from host_reads import SHAPES, lora_like_params, pulled_gradients, refuse_host_reads, steps_without_sync
from library import foreach_prodigy
from library.foreach_prodigy import ForeachProdigy


def _params(dtype=torch.float32):  # one parameter more, with three dimensions
    return [torch.nn.Parameter(p.detach().to(dtype)) for p in lora_like_params([*SHAPES, (3, 2, 5)])]


def _train(opt_cls, params, groups=False, steps=6, monkeypatch=None, **kwargs):
    opt = opt_cls([{"params": params[:4]}, {"params": params[4:]}] if groups else params, lr=1.0, **kwargs)
    for step in _gradients(params, steps):  # at step 3 the last parameter has no gradient
        if monkeypatch is None or step == 0:  # the first step makes the state (it reads which weights are zero)
            opt.step()
            continue
        with monkeypatch.context() as patch:
            refuse_host_reads(patch)
            opt.step()
    return opt


def _gradients(params, steps):
    """host_reads.pulled_gradients, in the parameters' dtype."""
    if params[0].dtype == torch.float32:
        yield from pulled_gradients(params, steps)
        return
    shadow = [torch.nn.Parameter(p.detach().float()) for p in params]
    for step in pulled_gradients(shadow, steps):
        for p, s in zip(params, shadow):
            p.grad = None if s.grad is None else s.grad.to(p.dtype)
            s.data.copy_(p.detach())
        yield step


def _assert_same(ref, got, ref_params, got_params, rtol=1e-4, atol=1e-6, d_rel=1e-5):
    for a, b in zip(ref_params, got_params):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
    saved, ref_saved = got.state_dict(), ref.state_dict()
    for rg, gg in zip(ref_saved["param_groups"], saved["param_groups"]):
        assert gg["k"] == rg["k"] and isinstance(gg["k"], int)
        for key in {"d", "d_max", "d_hat", "d_numerator", "d_denom"} & rg.keys():  # no d_hat before a step
            assert gg[key] == pytest.approx(rg[key], rel=d_rel) and isinstance(gg[key], float), key
    rs, gs = ref_saved["state"], saved["state"]
    assert rs.keys() == gs.keys()
    for k in rs:
        assert rs[k].keys() == gs[k].keys() and gs[k]["step"] == rs[k]["step"] and isinstance(gs[k]["step"], int)
        for name in rs[k].keys() - {"step"}:
            assert gs[k][name].shape == rs[k][name].shape, name  # p0 stays a zero scalar for a zero start
            torch.testing.assert_close(gs[k][name], rs[k][name], rtol=rtol, atol=atol)


@pytest.mark.parametrize("chunk", [1 << 23, 40])  # one chunk; chunks of a few parameters, split between p0 kinds
@pytest.mark.parametrize("kwargs, groups", [
    (dict(), False),  # the presets': lr 1.0, defaults
    (dict(weight_decay=0.01, decouple=True, use_bias_correction=True, safeguard_warmup=True), True),
    (dict(weight_decay=0.01, decouple=False, betas=(0.0, 0.99), slice_p=3), False),  # no first moment, coupled decay
    (dict(weight_decay=0.01, decouple=True, betas=(0.0, 0.99), slice_p=2), True),  # no first moment, decoupled
    (dict(d_coef=2.0, growth_rate=1.02, beta3=0.9), True),
])
def test_same_weights_d_and_state_as_prodigyopt(kwargs, groups, chunk, monkeypatch):
    monkeypatch.setattr(foreach_prodigy, "CHUNK_VALUES", chunk)
    ref_params = _params()
    got_params = copy.deepcopy(ref_params)
    ref = _train(Prodigy, ref_params, groups, **kwargs)
    got = _train(ForeachProdigy, got_params, groups, monkeypatch=monkeypatch, **kwargs)
    if chunk == 40:
        assert len(got._flat[0][0].chunks) > 3
    if not kwargs:  # the presets' settings: d grew from d0 within these steps, so the estimate is exercised
        assert ref.param_groups[0]["d"] > 10 * ref.param_groups[0]["d0"]
    # the same operations; the dot products and |s| are summed over chunks instead of per parameter (float32
    # rounding moves d in its 6th digit)
    _assert_same(ref, got, ref_params, got_params)


@pytest.mark.parametrize("chunk", [1 << 23, 40])
def test_parameters_without_gradients_in_some_steps_step_as_prodigyopt(chunk, monkeypatch):
    """LoRA's module dropout: each step a random set of parameters has no gradient (the second none in the first
    step, so it joins later): they keep their state and weights, as prodigyopt skips them; the layout is made again
    only when a parameter joins it."""
    monkeypatch.setattr(foreach_prodigy, "CHUNK_VALUES", chunk)
    ref_params = _params()
    got_params = copy.deepcopy(ref_params)
    opts = [Prodigy(ref_params, lr=1.0, weight_decay=0.01, decouple=True),
            ForeachProdigy(got_params, lr=1.0, weight_decay=0.01, decouple=True)]
    g = torch.Generator().manual_seed(2)
    layouts = []
    for step in range(8):
        grads = [torch.randn(p.shape, generator=g) - p.detach() for p in ref_params]
        dropped = {1} if step == 0 else set(torch.randperm(len(grads), generator=g)[:2].tolist())
        for opt, params in zip(opts, (ref_params, got_params)):
            for i, p in enumerate(params):
                p.grad = None if i in dropped else grads[i].clone()
            opt.step()
        layouts.append(opts[1]._flat[0][0])
    assert layouts[0] is not layouts[1] and all(lay is layouts[1] for lay in layouts[1:])
    _assert_same(*opts, ref_params, got_params)


def test_bfloat16_weights_step_as_prodigyopt_within_its_rounding():
    """bfloat16 weights: the arithmetic in float32 scratch, the state in bfloat16 (as prodigyopt keeps it)."""
    ref_params, got_params = _params(torch.bfloat16), _params(torch.bfloat16)
    kwargs = dict(weight_decay=0.01, decouple=True)
    ref = _train(Prodigy, ref_params, **kwargs)
    got = _train(ForeachProdigy, got_params, **kwargs)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in got.state.values())
    _assert_same(ref, got, ref_params, got_params, rtol=2e-2, atol=1e-3, d_rel=2e-2)


def test_no_gradients_no_step():
    params = _params()
    opt = ForeachProdigy(params, lr=1.0)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert opt.param_groups[0]["k"] == 0 and all(torch.equal(p, b) for p, b in zip(params, before))


def test_zero_gradients_leave_the_weights_as_prodigyopt_does():
    """All gradients zero: no |s|, so prodigyopt returns before the step (k and the step counts stay)."""
    ref_params, got_params = _params(), _params()
    opts = [Prodigy(ref_params, lr=1.0), ForeachProdigy(got_params, lr=1.0)]
    for opt, params in zip(opts, (ref_params, got_params)):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    _assert_same(*opts, ref_params, got_params, rtol=0, atol=0)
    assert opts[1].state_dict()["param_groups"][0]["k"] == 0


def test_a_saved_state_goes_on_in_prodigyopt_and_here():
    """Saved after 4 steps, loaded into prodigyopt and into a new ForeachProdigy, 3 steps more: the same weights; and
    prodigyopt's own saved state loads here."""
    params = _params()
    first = _train(ForeachProdigy, params, steps=4, weight_decay=0.01, decouple=True)
    saved = first.state_dict()
    results = {}
    for cls in (Prodigy, ForeachProdigy):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt = cls(ps, lr=1.0, weight_decay=0.01, decouple=True)
        opt.load_state_dict(copy.deepcopy(saved))
        _train_on(opt, ps, steps=3)
        results[cls] = (opt, ps)
    (ref, ref_params), (got, got_params) = results[Prodigy], results[ForeachProdigy]
    _assert_same(ref, got, ref_params, got_params)

    ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
    here = ForeachProdigy(ps, lr=1.0, weight_decay=0.01, decouple=True)
    here.load_state_dict(results[Prodigy][0].state_dict())
    assert here.state_dict()["param_groups"][0]["k"] == 7


def _train_on(opt, params, steps):
    for _ in pulled_gradients(params, steps):
        opt.step()


@pytest.mark.slow
def test_a_lora_run_logs_d_saves_prodigyopts_state_and_resumes(tmp_path, tiny_sd1_single_file, tiny_dataset_dir):
    """A tiny SD1 LoRA with Prodigy through the trainer: the trackers get d*lr (read from the device a step late),
    --save_state writes prodigyopt's numbers, and --resume goes on from them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import train_network
    from library.network_trainer import run

    def argv(name, steps, *extra):
        return ["--pretrained_model_name_or_path", str(tiny_sd1_single_file),
                "--tokenizer_cache_dir", str(tiny_sd1_single_file.parent / "tokenizers"),
                "--train_data_dir", str(tiny_dataset_dir), "--output_dir", str(tmp_path), "--output_name", name,
                "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4",
                "--resolution", "64", "--max_train_steps", str(steps), "--max_data_loader_n_workers", "0",
                "--seed", "1", "--optimizer_type", "Prodigy", "--learning_rate", "1.0", *extra]

    run(train_network.trainer(), train_network.setup_parser(),
        argv("p", 2, "--save_state", "--log_with", "tensorboard", "--logging_dir", str(tmp_path / "logs")))
    saved = torch.load(tmp_path / "p-state" / "optimizer.bin", weights_only=False)
    group = saved["param_groups"][0]
    assert isinstance(group["d"], float) and group["k"] == 2 and group["d"] > 0
    events = EventAccumulator(str(next((tmp_path / "logs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    tags = [t for t in events.Tags()["scalars"] if t.startswith("lr/d*lr/")]
    assert tags and len(events.Scalars(tags[0])) == 2 and events.Scalars(tags[0])[0].value > 0

    trainer = train_network.trainer()
    run(trainer, train_network.setup_parser(), argv("p2", 4, "--resume", str(tmp_path / "p-state")))
    resumed = trainer.state.optimizers[0].optimizer
    assert int(resumed.param_groups[0]["k"]) == 4  # two steps on from the saved two


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_steps_do_not_synchronize_and_match_prodigyopt():
    """torch's sync debug mode raises on any wait for the GPU: none after the first step (which makes the state);
    the weights are prodigyopt's."""
    for kwargs in (dict(), dict(weight_decay=0.01, decouple=True, use_bias_correction=True)):
        params = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
        ref_params = copy.deepcopy(params)
        opt = ForeachProdigy(params, lr=1.0, **kwargs)
        steps_without_sync(opt, params)
        ref = Prodigy(ref_params, lr=1.0, **kwargs)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(4):  # steps_without_sync's gradients
            for p in ref_params:
                p.grad = torch.randn(p.shape, device="cuda", generator=g)
            ref.step()
        _assert_same(ref, opt, ref_params, params)

"""library.foreach_prodigy: prodigyopt's Prodigy as multi-tensor operations with one read back a step trains to the
same weights, d estimates and optimizer state as prodigyopt's own step (CPU, a LoRA-like set of shapes)."""
import copy

import pytest
import torch
from prodigyopt import Prodigy

from library.foreach_prodigy import ForeachProdigy


def _params():
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 32), (4, 32), (48, 4), (48, 4), (8, 16), (16,), (3, 2, 5)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=g) * 0.1) for s in shapes]
    with torch.no_grad():
        params[2].zero_()  # a LoRA up matrix starts at zero: prodigyopt keeps a zero scalar as its p0
    return params


def _train(opt_cls, params, groups=False, steps=6, **kwargs):
    opt = opt_cls([{"params": params[:4]}, {"params": params[4:]}] if groups else params, lr=1.0, **kwargs)
    g = torch.Generator().manual_seed(1)
    targets = [torch.randn(p.shape, generator=g) for p in params]
    for step in range(steps):
        for p, t in zip(params, targets):  # the gradient of a quadratic pull towards t, plus noise: d grows
            p.grad = (p.detach() - t) + 0.1 * torch.randn(p.shape, generator=g)
        if step == 3:
            params[-1].grad = None  # a parameter without a gradient this step
        opt.step()
    return opt


@pytest.mark.parametrize("kwargs, groups", [
    (dict(), False),  # the presets': lr 1.0, defaults
    (dict(weight_decay=0.01, decouple=True, use_bias_correction=True, safeguard_warmup=True), True),
    (dict(weight_decay=0.01, decouple=False, betas=(0.0, 0.99), slice_p=3), False),  # no first moment, coupled decay
    (dict(d_coef=2.0, growth_rate=1.02, beta3=0.9), True),
])
def test_same_weights_d_and_state_as_prodigyopt(kwargs, groups):
    ref_params = _params()
    got_params = copy.deepcopy(ref_params)
    ref = _train(Prodigy, ref_params, groups, **kwargs)
    got = _train(ForeachProdigy, got_params, groups, **kwargs)
    # the same operations; only the fp32 summation order of the per-parameter dot products differs (a batched sum
    # instead of torch.dot), which moves d in its 6th digit
    for a, b in zip(ref_params, got_params):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    for rg, gg in zip(ref.param_groups, got.param_groups):
        assert gg["k"] == rg["k"] == 6
        for key in ("d", "d_max", "d_hat", "d_numerator", "d_denom"):
            assert gg[key] == pytest.approx(rg[key], rel=1e-5), key
    if not kwargs:  # the presets' settings: d grew from d0 within these steps, so the estimate is exercised
        assert ref.param_groups[0]["d"] > 10 * ref.param_groups[0]["d0"]
    rs, gs = ref.state_dict()["state"], got.state_dict()["state"]
    assert rs.keys() == gs.keys()
    for k in rs:
        assert rs[k].keys() == gs[k].keys() and rs[k]["step"] == gs[k]["step"]
        for name in rs[k].keys() - {"step"}:
            torch.testing.assert_close(gs[k][name], rs[k][name], rtol=1e-4, atol=1e-6)


def test_no_gradients_no_step():
    params = _params()
    opt = ForeachProdigy(params, lr=1.0)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert opt.param_groups[0]["k"] == 0 and all(torch.equal(p, b) for p, b in zip(params, before))


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

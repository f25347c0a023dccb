"""FLUX.1 sample images are drawn with a schedule-free optimizer's evaluation weights, as the SD trainers' are
(issue 24, bug 3): FLUX sampling goes through the hook that switches the optimizer to eval mode around it."""
from __future__ import annotations

import contextlib
import types

import torch


def test_flux_samples_see_the_schedulefree_eval_weights(tmp_path, monkeypatch):
    import flux_train_network
    from library import flux_train_utils, optimizers

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 32 --h 32 --s 1\n")
    args = flux_train_network.setup_parser().parse_args([
        "--learning_rate", "0.01", "--optimizer_type", "AdamWScheduleFree", "--optimizer_args", "warmup_steps=0",
        "--sample_prompts", str(prompts), "--output_dir", str(tmp_path)])
    params = [torch.nn.Parameter(torch.ones(3))]
    _, _, opt = optimizers.get_optimizer(args, params)
    for _ in range(2):
        (params[0] * torch.arange(1.0, 4.0)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    train_weights = params[0].detach().clone()
    opt.eval()
    eval_weights = params[0].detach().clone()
    opt.train()
    assert not torch.equal(train_weights, eval_weights)

    seen = {}

    def fake_sample(args, components, **kw):
        seen["weights"] = params[0].detach().clone()
        seen["train_mode"] = opt.param_groups[0]["train_mode"]
        return []

    monkeypatch.setattr(flux_train_utils, "sample_images", fake_sample)
    trainer = flux_train_network.trainer()
    accelerator = types.SimpleNamespace(is_main_process=True, device=torch.device("cpu"),
                                        autocast=contextlib.nullcontext, unwrap_model=lambda m: m)
    state = types.SimpleNamespace(args=args, accelerator=accelerator, optimizers=[opt], components=None,
                                  global_step=2, trainable=types.SimpleNamespace(models=[]), prediction_type=None)
    trainer.sample_images(state, epoch=None)
    assert seen["train_mode"] is False and torch.equal(seen["weights"], eval_weights)
    assert opt.param_groups[0]["train_mode"] is True  # back in train mode after sampling

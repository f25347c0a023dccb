"""Optimizer groups of the full trainers: sdxl_train --block_lr (upstream's 23 SGM blocks) and
--fused_optimizer_groups (upstream's split, optimizers stepped inside backward), flux_train
--blockwise_fused_optimizers (one optimizer per block)."""
from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from library import full_trainer
from library.families import sdxl
from library.train_util import ConfigError


def test_split_param_groups_as_upstream():
    """ceil(total / n) tensors per optimizer, in order; a learning-rate change always starts a new one."""
    a = [torch.nn.Parameter(torch.zeros(1)) for _ in range(5)]
    b = [torch.nn.Parameter(torch.zeros(1)) for _ in range(3)]
    out = full_trainer.split_param_groups([{"params": a, "lr": 1.0}, {"params": b, "lr": 2.0}], 3)  # 3 per group
    assert [(len(g["params"]), g["lr"]) for g in out] == [(3, 1.0), (2, 1.0), (3, 2.0)]
    assert [p for g in out for p in g["params"]] == a + b
    out = full_trainer.split_param_groups([{"params": a, "lr": 1.0}], 2)
    assert [len(g["params"]) for g in out] == [3, 2]


def _stub_accelerator():
    return types.SimpleNamespace(sync_gradients=True, num_processes=1)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 1))


def _loss(model):
    x = torch.linspace(-1, 1, 8).view(2, 4)
    return (model(x) ** 2).mean() * 100


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.01])
def test_grouped_fused_backward_equals_a_step_with_per_tensor_clipping(max_grad_norm):
    ref, fused = _model(), _model()
    # reference: one SGD step after backward, each gradient clipped on its own (upstream's hooks clip per tensor)
    _loss(ref).backward()
    if max_grad_norm:
        for p in ref.parameters():
            torch.nn.utils.clip_grad_norm_([p], max_grad_norm)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()

    groups = full_trainer.split_param_groups([{"params": list(fused.parameters()), "lr": 0.1}], 2)
    opts = [torch.optim.SGD([g["params"]][0], lr=g["lr"]) for g in groups]
    args = types.SimpleNamespace(max_grad_norm=max_grad_norm)
    counts = full_trainer.register_grouped_fused_backward(args, _stub_accelerator(), opts)
    assert len(opts) == 2
    _loss(fused).backward()  # the optimizers step in here
    assert counts == [3, 3]
    for p, q in zip(ref.parameters(), fused.parameters()):
        assert torch.allclose(p, q, atol=1e-7)
        assert q.grad is None  # freed as soon as its optimizer stepped


def test_block_index_and_parse():
    import sdxl_train

    assert [sdxl.block_index(n) for n in (
        "time_embed.0.weight", "label_emb.0.2.bias", "input_blocks.0.0.weight", "input_blocks.8.0.conv.weight",
        "middle_block.2.out_layers.3.weight", "output_blocks.0.0.in_layers.0.weight",
        "output_blocks.8.1.proj_out.weight", "out.0.weight", "out.2.bias")] == [0, 0, 1, 9, 12, 13, 21, 22, 22]
    assert sdxl.parse_block_lr(",".join(["1e-5"] * 23)) == [1e-5] * 23
    for bad in (",".join(["1e-5"] * 22), "a," * 22 + "b", ",".join(["-1"] * 23)):
        with pytest.raises(ConfigError, match="--block_lr needs 23 comma-separated"):
            sdxl.parse_block_lr(bad)


@pytest.fixture(scope="module")
def sdxl_unet(tiny_sdxl_single_file):
    from library.model_util import load_sd_components

    return load_sd_components(str(tiny_sdxl_single_file), "sdxl",
                              tokenizer_cache_dir=str(Path(tiny_sdxl_single_file).parent / "tokenizers")).unet


def test_block_lr_groups_on_the_sdxl_unet(sdxl_unet):
    import sdxl_train

    lrs = [float(i + 1) for i in range(23)]
    lrs[5] = lrs[22] = 0.0
    sdxl_unet.requires_grad_(True)
    groups, names = sdxl.block_lr_param_groups(sdxl_unet, lrs)
    assert names == [f"block{int(g['lr']) - 1}" for g in groups]
    by_id = {id(p): g["lr"] for g in groups for p in g["params"]}
    named = dict(sdxl_unet.named_parameters())
    assert by_id[id(named["time_embedding.linear_1.weight"])] == 1.0  # block 0: time/label embeddings
    assert by_id[id(named["add_embedding.linear_2.bias"])] == 1.0
    assert by_id[id(named["conv_in.weight"])] == 2.0  # input_blocks.0
    assert id(named["conv_out.weight"]) not in by_id and not named["conv_out.weight"].requires_grad  # out: 0
    assert not named["conv_norm_out.weight"].requires_grad
    # every other parameter is in exactly one block group, and the groups come in block order
    assert len(by_id) + sum(not p.requires_grad for p in sdxl_unet.parameters()) == len(named)
    assert [g["lr"] for g in groups] == sorted(g["lr"] for g in groups) and 6.0 not in [g["lr"] for g in groups]
    mid = [n for n in named if n.startswith("mid_block.")]
    assert {by_id[id(named[n])] for n in mid} <= {11.0, 12.0, 13.0}  # middle_block 0-2 = blocks 10-12
    sdxl_unet.requires_grad_(False)


def test_block_lr_log_names(sdxl_unet, monkeypatch):
    """lr/block<i> for the trained blocks, then the trained text encoders, as upstream's sdxl_train logs them."""
    import sdxl_train
    from library.network_trainer import Trainable

    trainer = sdxl_train.trainer()
    lrs = ["1e-4"] * 23
    lrs[3] = "0"
    te1, te2 = torch.nn.Linear(2, 2).requires_grad_(False), torch.nn.Linear(2, 2)
    comps = types.SimpleNamespace(unet=sdxl_unet, denoiser=sdxl_unet, text_encoders=[te1, te2])
    args = types.SimpleNamespace(block_lr=",".join(lrs), fused_optimizer_groups=None, fused_backward_pass=False,
                                 full_bf16=False, full_fp16=False)
    sdxl_unet.requires_grad_(True)
    monkeypatch.setattr(trainer.target, "_denoiser_and_text_encoders", lambda *a: Trainable(
        models=[sdxl_unet], param_groups=[{"params": list(sdxl_unet.parameters()), "lr": 1.0},
                                          {"params": list(te2.parameters()), "lr": 1.0}], train_text_encoder=True))
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    trainable = trainer.target.setup_trainable(args, accelerator, trainer.family, comps, torch.float32, True)
    names = trainable.lr_descriptions
    assert names[:2] == ["block0", "block1"] and "block3" not in names and names[-1] == "text_encoder2"
    assert len(names) == len(trainable.param_groups)
    sdxl_unet.requires_grad_(False)


def test_blockwise_groups_for_flux():
    import flux_train
    from library.flux_tiny import tiny_transformer
    from library.network_trainer import Trainable

    trainer = flux_train.trainer()
    model = tiny_transformer(width=64, num_double=2, num_single=3, t5_dim=32, clip_dim=32, guidance=True, seed=0,
                             dtype=torch.float32)
    comps = types.SimpleNamespace(transformer=model)
    args = types.SimpleNamespace(blockwise_fused_optimizers=True, fused_backward_pass=False, learning_rate=0.5)
    params = list(model.parameters())
    groups = trainer.target.optimizer_param_groups(args, trainer.family, comps, Trainable(
        models=[model], param_groups=[{"params": params}], train_text_encoder=False))
    assert len(groups) == 1 + 2 + 3  # the rest, each double block, each single block
    assert sum(len(g[0]["params"]) for g in groups) == len(params) and all(g[0]["lr"] == 0.5 for g in groups)
    first_double = set(map(id, model.transformer_blocks[0].parameters()))
    assert any(set(map(id, g[0]["params"])) == first_double for g in groups)
    args.blockwise_fused_optimizers = False
    assert len(trainer.target.optimizer_param_groups(args, trainer.family, comps,
                                                     Trainable([model], [{"params": params}], False))) == 1


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_sdxl_train_block_lr_with_fused_optimizer_groups(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    """2 steps of sdxl_train.py: blocks at rate 0 keep their weights, the others train, with the optimizers
    stepping inside backward (--fused_optimizer_groups) and a non-AdamW optimizer."""
    import sdxl_train

    lrs = ["1e-3"] * 23
    lrs[0] = lrs[22] = "0"  # embeddings and out frozen
    out = tmp_path / "out"
    final = sdxl_train.main([str(a) for a in [
        "--pretrained_model_name_or_path", tiny_sdxl_single_file,
        "--tokenizer_cache_dir", Path(tiny_sdxl_single_file).parent / "tokenizers",
        "--train_data_dir", tiny_dataset_dir, "--resolution", "64", "--output_dir", out, "--output_name", "blk",
        "--max_train_steps", 2, "--max_data_loader_n_workers", 0, "--seed", 1, "--block_lr", ",".join(lrs),
        "--fused_optimizer_groups", 4, "--optimizer_type", "Lion", "--lr_scheduler", "cosine"]])

    def unet_weights(path):
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.diffusion_model.")}

    base, trained = unet_weights(tiny_sdxl_single_file), unet_weights(final)
    prefix = "model.diffusion_model."
    frozen = [k for k in base if k[len(prefix):].startswith(("time_embed.", "label_emb.", "out."))]
    assert frozen and all(torch.equal(base[k], trained[k]) for k in frozen)
    assert any(not torch.equal(base[k], trained[k]) for k in base if k.startswith(prefix + "input_blocks."))
    assert any(not torch.equal(base[k], trained[k]) for k in base if k.startswith(prefix + "output_blocks."))


@pytest.mark.parametrize("script,extra,message", [
    ("sdxl_train", ["--block_lr", "1,2,3"], "--block_lr needs 23"),
    ("sdxl_train", ["--fused_optimizer_groups", "-1"], "--fused_optimizer_groups must be 1 or more (0 = off)"),
    ("sdxl_train", ["--fused_optimizer_groups", "2", "--mixed_precision", "fp16"], "use --mixed_precision bf16"),
    ("flux_train", ["--blockwise_fused_optimizers", "--optimizer_type", "AdamWScheduleFree"],
     "cannot be used with a schedule-free optimizer"),
])
def test_group_option_errors(tmp_path, capsys, script, extra, message):
    import importlib

    argv = ["--pretrained_model_name_or_path", str(tmp_path / "none.safetensors"), "--train_data_dir", str(tmp_path),
            "--output_dir", str(tmp_path / "out"), *extra]
    with pytest.raises(SystemExit) as e:
        importlib.import_module(script).main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_fused_adafactor_rounds_bf16_weights_stochastically():
    """Upstream's fused Adafactor writes bfloat16 weights with stochastic rounding: an update far below a bfloat16
    step (2**-7 at 1.0) moves some weights and leaves the mean where float32 would have it; round-to-nearest
    would leave every weight at 1.0."""
    from transformers.optimization import Adafactor

    torch.manual_seed(0)
    source = torch.full((20000,), 1.0 + 2 ** -9)  # a quarter of the way from 1.0 to the next bfloat16 value
    target = torch.empty_like(source, dtype=torch.bfloat16)
    full_trainer.copy_stochastic_(target, source)
    assert set(target.float().unique().tolist()) == {1.0, 1.0 + 2 ** -7}
    assert target.float().mean().item() == pytest.approx(1.0 + 2 ** -9, abs=2e-4)

    param = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
    opt = Adafactor([param], lr=1e-4, relative_step=False, scale_parameter=False, warmup_init=False)
    param.grad = torch.ones_like(param)
    full_trainer.step_one_parameter(opt, param, opt.param_groups[0])
    assert param.dtype == torch.bfloat16 and param.grad is not None
    assert (param != 1.0).any() and (param == 1.0).any()
    assert opt.state[param]["exp_avg_sq_row"].dtype == torch.float32
    nearest = torch.nn.Parameter(torch.ones(64, 64, dtype=torch.bfloat16))
    opt2 = Adafactor([nearest], lr=1e-4, relative_step=False, scale_parameter=False, warmup_init=False)
    nearest.grad = torch.ones_like(nearest)
    opt2.step()
    assert (nearest == 1.0).all()  # what the plain step does

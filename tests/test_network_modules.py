"""networks.dylora, networks.oft, networks.lora_fa: sd-scripts' keys and math on the tiny SD1 / SDXL, and
2 training steps each: the file follows sd-scripts' naming, continues with --network_weights and changes the
model's output."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import train_network
from torch import nn

from networks import dylora, lora, lora_fa, oft

pytestmark = pytest.mark.usefixtures("one_thread")


def test_oft_names_shapes_and_rotation(tiny_sdxl):
    from library.model_util import unet_sgm_module_names

    net = oft.create_network(1.0, 4, 1e-2, None, tiny_sdxl.text_encoders, tiny_sdxl.unet)
    sgm = unet_sgm_module_names(tiny_sdxl.unet)
    want = {}
    for path, m in tiny_sdxl.unet.named_modules():  # sd-scripts: Linear layers of every attention (CrossAttention)
        if type(m).__name__ == "Attention":
            for child, layer in m.named_modules():
                if isinstance(layer, nn.Linear):
                    full = f"{path}.{child}"
                    want["oft_unet_" + sgm[full].replace(".", "_")] = (4, layer.out_features // 4)
    got = {o.oft_name: (o.oft_blocks.shape[0], o.oft_blocks.shape[1]) for o in net.unet_ofts}
    assert got == want and not net.text_encoder_loras
    assert "oft_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q" in got
    net.apply_to(tiny_sdxl.text_encoders, tiny_sdxl.unet, True, True)
    assert set(net.state_dict()) == {f"{n}.{k}" for n in want for k in ("oft_blocks", "alpha")}
    net.remove_from()

    # the rotation, written out: Q = B - B^T clamped to alpha * out, R = (I + Q)(I - Q)^-1, W' = R^T W per block
    layer = nn.Linear(6, 8)
    m = oft.OFTModule("oft_unet_x", layer, 0.5, 2, 0.05)
    with torch.no_grad():
        m.oft_blocks.normal_()
    b = m.oft_blocks.detach()
    q = b - b.transpose(1, 2)
    q = q * (min(q.norm().item(), 0.05 * 8) + 1e-8) / (q.norm() + 1e-8)
    eye = torch.eye(4).expand(2, 4, 4)
    r = 0.5 * ((eye + q) @ torch.linalg.inv(eye - q) - eye) + eye
    w = layer.weight.detach().reshape(2, 4, 6)
    want_w = torch.cat([r[k].T @ w[k] for k in range(2)])
    m.apply_to()
    x = torch.randn(3, 6)
    assert torch.allclose(layer(x), x @ want_w.T + layer.bias, atol=1e-5)
    for k in range(2):  # an orthogonal rotation at multiplier 1
        r1 = m.rotation(1.0)[k].detach()
        assert torch.allclose(r1 @ r1.T, torch.eye(4), atol=1e-5)


def test_oft_enable_args(tiny_sd1):
    plain = oft.create_network(1.0, 4, 1e-3, None, tiny_sd1.text_encoders[0], tiny_sd1.unet)
    all_linear = oft.create_network(1.0, 4, 1e-3, None, tiny_sd1.text_encoders[0], tiny_sd1.unet,
                                    enable_all_linear="True")
    conv = oft.create_network(1.0, 4, 1e-3, None, tiny_sd1.text_encoders[0], tiny_sd1.unet, enable_all_linear="False",
                              enable_conv="True")
    names = {o.oft_name for o in plain.unet_ofts}
    assert names < {o.oft_name for o in all_linear.unet_ofts}
    assert any("_ff_net_" in o.oft_name for o in all_linear.unet_ofts) and not any("_ff_" in n for n in names)
    assert any(o.oft_name.endswith("resnets_0_conv1") for o in conv.unet_ofts)
    with pytest.raises(lora.NetworkArgsError, match="enable_conv=maybe"):
        oft.parse_network_kwargs({"enable_conv": "maybe"})


def test_dylora_trains_one_rank_unit_and_keeps_lora_math(tiny_sd1):
    net = dylora.create_network(1.0, 8, 4.0, None, tiny_sd1.text_encoders[0], tiny_sd1.unet, unit="2")
    names = {m.lora_name for m in net.text_encoder_loras + net.unet_loras}
    assert names == {m.lora_name for m in lora.create_network(1.0, 8, 4.0, None, tiny_sd1.text_encoders[0],
                                                              tiny_sd1.unet).text_encoder_loras +
                     lora.create_network(1.0, 8, 4.0, None, tiny_sd1.text_encoders[0], tiny_sd1.unet).unet_loras}
    layer = nn.Linear(16, 12)
    m = dylora._module_class(2)("lora_unet_x", layer, 1.0, 8, 4.0)
    with torch.no_grad():
        for p in m.lora_up.parameters():
            p.normal_()
    m.apply_to()
    x = torch.randn(5, 16)
    m.train()
    # upstream: one Parameter per rank; a step trains the drawn `unit` ranks only, the optimizer (AdamW: momentum,
    # weight decay) leaves the others untouched; the output has every rank, scaled by sqrt(dim / (r + unit))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    drawn = set()
    for seed in range(6):
        torch.manual_seed(seed)
        r = int(torch.randint(0, 8, ()).item())
        r -= r % 2
        down0, up0 = m.lora_down.weight.detach().clone(), m.lora_up.weight.detach().clone()
        torch.manual_seed(seed)
        y = layer(x)
        want = x @ layer.weight.T + layer.bias + x @ (up0 @ down0).T * 0.5 * math.sqrt(8 / (r + 2))
        assert torch.allclose(y, want, atol=1e-5)
        y.sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rows = (m.lora_down.weight != down0).any(dim=1).nonzero().flatten().tolist()
        cols = (m.lora_up.weight != up0).any(dim=0).nonzero().flatten().tolist()
        assert rows == cols == [r, r + 1], (seed, r, rows, cols)
        drawn.add(r)
    assert len(drawn) > 1
    # in a compiled block: the same output and rank slice (the LoRA term runs eagerly), and the log says so
    from library.compile import regional

    block = nn.Sequential(layer, nn.GELU())
    assert regional.adapter_kinds(block) == {"DyLoRAModule eager: a graph break each": 1}
    compiled = torch.compile(block, backend="eager")
    torch.manual_seed(7)
    eager_out = block(x)
    opt.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    compiled_out = compiled(x)
    compiled_out.sum().backward()
    torch.manual_seed(7)
    r = int(torch.randint(0, 8, ()).item())
    r -= r % 2
    assert torch.allclose(compiled_out, eager_out, atol=1e-6)
    assert [i for i, p in enumerate(m.lora_down.rows) if p.grad is not None] == [r, r + 1]
    m.eval()  # the file's meaning: plain LoRA, up @ down * alpha / dim
    with torch.no_grad():
        want = x @ layer.weight.T + layer.bias + x @ (m.lora_up.weight @ m.lora_down.weight).T * 0.5
        assert torch.allclose(layer(x), want, atol=1e-5)
    from library import network_options

    assert not network_options.supports_max_norm(net)  # upstream's DyLoRA: --scale_weight_norms ignored, warned
    assert network_options.supports_max_norm(lora.create_network(1.0, 4, 1.0, None, tiny_sd1.text_encoders[0],
                                                                  tiny_sd1.unet))
    with pytest.raises(lora.NetworkArgsError, match="must be a multiple"):
        dylora.create_network(1.0, 8, 1.0, None, tiny_sd1.text_encoders[0], tiny_sd1.unet, unit="3")
    with pytest.raises(lora.NetworkArgsError, match="conv_dim equal"):
        dylora.create_network(1.0, 8, 1.0, None, tiny_sd1.text_encoders[0], tiny_sd1.unet, conv_dim="4")


def test_lora_fa_freezes_down(tiny_sd1):
    with pytest.raises(lora.NetworkArgsError, match="loraplus_lr_ratio=2: unknown for networks.lora_fa"):
        lora_fa.parse_network_kwargs({"loraplus_lr_ratio": "2"})  # upstream's LoRA-FA has no LoRA+
    net = lora_fa.create_network(1.0, 4, 1.0, None, tiny_sd1.text_encoders[0], tiny_sd1.unet, rank_dropout="0.1")
    net.apply_to(tiny_sd1.text_encoders, tiny_sd1.unet, True, True)
    try:
        groups, names = net.prepare_optimizer_params(None, None, 1e-3)
        trained = {id(p) for g in groups for p in g["params"]}
        mods = net.text_encoder_loras + net.unet_loras
        assert trained == {id(m.lora_up.weight) for m in mods}
        net.prepare_grad_etc(None, None)
        assert not any(m.lora_down.weight.requires_grad for m in mods)
        big = max(mods, key=lambda m: m.lora_down.weight.numel())
        fan = big.lora_down.weight.shape[1] + big.lora_dim
        assert big.lora_down.weight.std().item() == pytest.approx(math.sqrt(2.0 / fan), rel=0.15)
    finally:
        net.remove_from()


def _unet_out(comps):
    from test_lora_network import _unet_input

    x, t, h, kw = _unet_input(comps)
    with torch.no_grad():
        return comps.unet(x, t, h, **kw).sample


@pytest.fixture(scope="module")
def one_image(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("netmod_img"), n=1, size=(64, 64), repeats=1, name="one")


CASES = [("networks.dylora", ["unit=2"], "lora_unet_", 4.0),
         ("networks.lora_fa", [], "lora_unet_", 4.0),
         ("networks.oft", ["enable_all_linear=True"], "oft_unet_", 0.01)]


@pytest.mark.parametrize("module, args, prefix, alpha", [
    pytest.param(*c, marks=() if c[0] == "networks.dylora" else pytest.mark.slow) for c in CASES])
def test_module_trains_saves_and_continues(module, args, prefix, alpha, tiny_sd1, tiny_sd1_single_file, one_image,
                                           tmp_path):
    import importlib

    import train_network
    from library.network_trainer import run
    from lora_checks import read_lora

    def argv(out, name, extra):
        return ["--pretrained_model_name_or_path", str(tiny_sd1_single_file), "--tokenizer_cache_dir",
                str(tiny_sd1_single_file.parent / "tokenizers"), "--train_data_dir", str(one_image),
                "--output_dir", str(out), "--output_name", name, "--network_module", module, "--network_dim", "4",
                "--network_alpha", str(alpha), "--resolution", "64", "--max_data_loader_n_workers", "0",
                "--seed", "5", "--network_train_unet_only", "--cache_latents", *extra]

    path = run(train_network.trainer(), train_network.setup_parser(),
               argv(tmp_path / "a", "m", ["--max_train_steps", "2", "--learning_rate", "1e-2",
                                          *(["--network_args", *args] if args else [])]))
    sd, md = read_lora(path)
    assert md["ss_network_module"] == module
    names = {k.split(".")[0] for k in sd}
    assert names and all(n.startswith(prefix) for n in names)
    assert "_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q" in "".join(sorted(names))
    suffixes = {k.split(".", 1)[1] for k in sd}
    assert suffixes == ({"oft_blocks", "alpha"} if prefix == "oft_unet_" else
                        {"lora_down.weight", "lora_up.weight", "alpha"})

    path2 = run(train_network.trainer(), train_network.setup_parser(),
                argv(tmp_path / "b", "m2", ["--max_train_steps", "1", "--learning_rate", "1e-12", "--optimizer_type",
                                            "SGDNesterov", "--network_weights", path, "--seed", "6",
                                            *(["--network_args", *args] if args else [])]))
    sd2, _ = read_lora(path2)
    assert set(sd2) == set(sd) and all(torch.allclose(sd2[k], sd[k], atol=1e-6) for k in sd)

    comps = copy.copy(tiny_sd1)
    comps.unet = copy.deepcopy(tiny_sd1.unet)
    plain = _unet_out(comps)
    mod = importlib.import_module(module)
    net, weights = mod.create_network_from_weights(1.0, path, None, comps.text_encoders[0], comps.unet)
    net.merge_to(comps.text_encoders, comps.unet, weights, None, None)
    assert not torch.allclose(_unet_out(comps), plain, atol=1e-6)

"""networks.lora on tiny SDXL / SD1 models: kohya names and targets, the math (zero init, scale, multiplier,
dropouts), optimizer groups, files (save/load, hashes, --dim_from_weights) and bad --network_args."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from networks import lora


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sdxl(tiny_sdxl):
    return tiny_sdxl


@pytest.fixture(scope="module")
def sd1(tiny_sd1):
    return tiny_sd1


def _expected_unet_targets(unet):
    out = set()
    for name, module in unet.named_modules():
        if type(module).__name__ == "Transformer2DModel":
            for child_name, child in module.named_modules():
                if isinstance(child, nn.Linear) or (isinstance(child, nn.Conv2d) and child.kernel_size == (1, 1)):
                    out.add(f"{name}.{child_name}")
    return out


def _unet_input(comps, batch=1):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, 8, 8, generator=g)
    dim = comps.unet.config.cross_attention_dim
    h = torch.randn(batch, 77, dim, generator=g)
    kwargs = {}
    if comps.family == "sdxl":
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.randn(batch, comps.text_encoders[1].config.projection_dim,
                                                                  generator=g),
                                       "time_ids": torch.tensor([[64, 64, 0, 0, 64, 64]] * batch).float()}
    return x, torch.tensor([500] * batch), h, kwargs


def _unet_out(comps):
    x, t, h, kw = _unet_input(comps)
    with torch.no_grad():
        return comps.unet(x, t, h, **kw).sample


def test_sdxl_names_and_targets(sdxl):
    from library.model_util import unet_sgm_module_names

    net = lora.create_network(1.0, 4, 2.0, sdxl.vae, sdxl.text_encoders, sdxl.unet)
    sgm = unet_sgm_module_names(sdxl.unet)
    expected = {"lora_unet_" + sgm[p].replace(".", "_") for p in _expected_unet_targets(sdxl.unet)}
    got = {m.lora_name for m in net.unet_loras}
    assert got == expected and len(got) > 0
    # kohya's input_blocks_4_1_... in the real SDXL (2 layers per block); the tiny UNet has 1 layer per block
    assert "lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q" in got
    assert any(n.startswith("lora_unet_middle_block_1_") for n in got)
    assert any(n.startswith("lora_unet_output_blocks_0_1_") for n in got)
    assert any(n.endswith("_proj_in") for n in got) and any("_ff_net_0_proj" in n for n in got)
    # text encoders: q/k/v/out_proj + fc1/fc2 in every layer of both
    for i, te in enumerate(sdxl.text_encoders, start=1):
        names = {m.lora_name for m in net.text_encoder_loras if m.lora_name.startswith(f"lora_te{i}_")}
        n_layers = te.config.num_hidden_layers
        assert len(names) == 6 * n_layers
        assert f"lora_te{i}_text_model_encoder_layers_0_self_attn_out_proj" in names
        assert f"lora_te{i}_text_model_encoder_layers_{n_layers - 1}_mlp_fc1" in names


def test_sd1_names_are_diffusers_style(sd1):
    net = lora.create_network(1.0, 4, 1.0, sd1.vae, sd1.text_encoders[0], sd1.unet)
    expected = {"lora_unet_" + p.replace(".", "_") for p in _expected_unet_targets(sd1.unet)}
    assert {m.lora_name for m in net.unet_loras} == expected
    assert all(m.lora_name.startswith("lora_te_text_model_") for m in net.text_encoder_loras)


def test_apply_zero_init_scale_multiplier_and_restore(sd1):
    base = _unet_out(sd1)
    net = lora.create_network(1.0, 4, 2.0, sd1.vae, sd1.text_encoders[0], sd1.unet)
    net.apply_to(sd1.text_encoders, sd1.unet, True, True)
    try:
        assert torch.equal(_unet_out(sd1), base)  # lora_up starts at zero
        mod = net.unet_loras[0]
        assert mod.scale == 0.5 and float(mod.alpha) == 2.0
        with torch.no_grad():
            for m in net.unet_loras:
                m.lora_up.weight.normal_(0, 0.1)
        changed = _unet_out(sd1)
        assert not torch.allclose(changed, base)
        # one module's output is org + up(down(x)) * multiplier * alpha / dim
        x = torch.randn(2, mod.lora_down.in_features if not mod.is_conv else 1)
        if not mod.is_conv:
            want = mod.org_forward(x) + mod.lora_up(mod.lora_down(x)) * 0.5
            assert torch.allclose(mod(x), want, atol=1e-6)
        net.set_multiplier(0.0)
        assert torch.allclose(_unet_out(sd1), base, atol=1e-6)
        net.set_multiplier(1.0)
        # state dict holds only LoRA tensors
        assert all(k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for k in net.state_dict())
    finally:
        net.remove_from()
    assert torch.equal(_unet_out(sd1), base)


def test_dropouts_only_in_training(sd1):
    net = lora.create_network(1.0, 4, 4.0, sd1.vae, sd1.text_encoders[0], sd1.unet, neuron_dropout=0.5,
                              rank_dropout="0.3", module_dropout="0.2")
    mod = next(m for m in net.unet_loras if not m.is_conv)
    mod.apply_to()
    try:
        with torch.no_grad():
            mod.lora_up.weight.normal_()
        x = torch.randn(4, 3, mod.lora_down.in_features)
        mod.train()
        outs = [mod(x) for _ in range(4)]
        assert any(not torch.allclose(outs[0], o) for o in outs[1:])
        mod.eval()
        assert torch.equal(mod(x), mod(x))
    finally:
        mod.restore()


def test_optimizer_groups(sdxl):
    net = lora.create_network(1.0, 4, 1.0, sdxl.vae, sdxl.text_encoders, sdxl.unet)
    net.apply_to(sdxl.text_encoders, sdxl.unet, True, True)
    try:
        groups, names = net.prepare_optimizer_params(5e-5, 1e-4, 1e-3)
        assert [g["lr"] for g in groups] == [5e-5, 1e-4] and names == ["textencoder", "unet"]
        n_te = sum(p.numel() for m in net.text_encoder_loras for p in m.parameters())
        assert sum(p.numel() for p in groups[0]["params"]) == n_te
        groups, _ = net.prepare_optimizer_params(0.0, None, 1e-3)  # TE lr 0: frozen, left out
        assert [g["lr"] for g in groups] == [1e-3]
        assert not any(p.requires_grad for m in net.text_encoder_loras for p in m.parameters())
    finally:
        net.remove_from()


def test_unet_only_and_conv_dim(sdxl):
    net = lora.create_network(1.0, 4, 1.0, sdxl.vae, sdxl.text_encoders, sdxl.unet, conv_dim="2", conv_alpha="1")
    net.apply_to(sdxl.text_encoders, sdxl.unet, apply_text_encoder=False, apply_unet=True)
    try:
        names = {k.split(".")[0] for k in net.state_dict()}
        assert names and all(n.startswith("lora_unet_") for n in names)
        conv = [m for m in net.unet_loras if m.is_conv and m.lora_down.kernel_size == (3, 3)]
        assert conv and all(m.lora_dim == 2 for m in conv)
        # ResNet convs get SGM names too (conv1 -> in_layers_2)
        assert any(m.lora_name.endswith("_in_layers_2") for m in conv)
    finally:
        net.remove_from()


def test_save_load_round_trip_and_mismatch(tmp_path, sd1, caplog):
    from library.train_util import model_hashes

    net = lora.create_network(1.0, 4, 2.0, sd1.vae, sd1.text_encoders[0], sd1.unet)
    net.apply_to(sd1.text_encoders, sd1.unet, True, True)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_()
    path = tmp_path / "a.safetensors"
    md = {"ss_network_dim": "4", "ss_network_alpha": "2.0"}
    net.save_weights(str(path), torch.float16, md)
    net.remove_from()

    from lora_checks import read_lora

    sd, meta = read_lora(path)
    assert all(v.dtype == torch.float16 for v in sd.values())
    assert meta["ss_network_dim"] == "4"
    assert (meta["sshs_model_hash"], meta["sshs_legacy_hash"]) == model_hashes(sd, md)
    with pytest.raises(FileExistsError):
        net.save_weights(str(path), None, md)

    # same shape: loads every tensor
    other = lora.create_network(1.0, 4, 1.0, sd1.vae, sd1.text_encoders[0], sd1.unet)
    other.apply_to(sd1.text_encoders, sd1.unet, True, True)
    other.load_weights(str(path))
    for k, v in other.state_dict().items():
        assert torch.equal(v.half(), sd[k]), k
    assert other.unet_loras[0].scale == 0.5  # alpha from the file
    other.remove_from()

    # --dim_from_weights
    net2, _ = lora.create_network_from_weights(1.0, str(path), sd1.vae, sd1.text_encoders[0], sd1.unet)
    net2.apply_to(sd1.text_encoders, sd1.unet, True, True)
    try:
        assert {k: tuple(v.shape) for k, v in net2.state_dict().items()} == {k: tuple(v.shape) for k, v in sd.items()}
    finally:
        net2.remove_from()

    bigger = lora.create_network(1.0, 8, 1.0, sd1.vae, sd1.text_encoders[0], sd1.unet)
    bigger.apply_to(sd1.text_encoders, sd1.unet, True, True)
    try:
        with pytest.raises(ValueError, match="different --network_dim"):
            bigger.load_weights(str(path))
    finally:
        bigger.remove_from()
    unet_only = lora.create_network(1.0, 4, 1.0, sd1.vae, sd1.text_encoders[0], sd1.unet)
    unet_only.apply_to(sd1.text_encoders, sd1.unet, apply_text_encoder=False, apply_unet=True)
    try:
        # keys the network lacks (here the text encoder's): a warning naming their count, the rest loads (upstream)
        n_te = sum(1 for k in sd if k.startswith("lora_te"))
        with caplog.at_level(logging.WARNING, logger="networks.lora"):
            unet_only.load_weights(str(path))
        assert f"{n_te} keys do not belong to this network" in caplog.text and n_te > 0
        for k, v in unet_only.state_dict().items():
            assert torch.equal(v.half(), sd[k]), k
    finally:
        unet_only.remove_from()


@pytest.mark.parametrize("kwargs, match", [
    ({"conv_dimm": "4"}, "conv_dimm=4: unknown for networks.lora; allowed: conv_dim"),
    ({"conv_dim": "four"}, "conv_dim=four: not a int"),
    ({"rank_dropout": "1.5"}, r"rank_dropout=1.5: must be in \[0, 1\)"),
])
def test_bad_network_args(kwargs, match):
    with pytest.raises(lora.NetworkArgsError, match=match):
        lora.parse_network_kwargs(kwargs)


def test_strip_orig_mod_on_save(tmp_path, sd1):
    net = lora.create_network(1.0, 4, 1.0, sd1.vae, sd1.text_encoders[0], sd1.unet)
    net.apply_to(sd1.text_encoders, sd1.unet, False, True)
    try:
        first = net.unet_loras[0]
        wrapped = torch.compile(first, backend="eager")  # a compiled wrapper puts _orig_mod. in the keys
        net._modules[first.lora_name] = wrapped
        assert any("_orig_mod." in k for k in net.state_dict())
        sd = net.lora_state_dict()
        assert not any("_orig_mod" in k for k in sd) and f"{first.lora_name}.lora_down.weight" in sd
    finally:
        net.remove_from()

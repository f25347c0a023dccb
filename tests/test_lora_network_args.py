"""networks.lora --network_args beyond dims (block dims / lr weights, LoRA+), max-norm regularization
(--scale_weight_norms), merging (--base_weights) and the trainer wiring of those options, on tiny SD1 / SDXL."""
from __future__ import annotations

import math
import re

import pytest
import torch
import train_network
from conftest import load_tiny_components

from networks import lora, lora_blocks


pytestmark = pytest.mark.usefixtures("one_thread")


# sd-scripts' block numbering, written out from its rules
def _sd_block(name):
    m = re.search(r"(up|down)_blocks_(\d+)_(resnets|upsamplers|downsamplers|attentions)_(\d+)_", name)
    if m:
        i, j = int(m.group(2)), int(m.group(4))
        idx = 3 * i + (2 if m.group(3).endswith("samplers") else j)
        return idx + (1 if m.group(1) == "down" else 13)
    return 12 if "mid_block_" in name else -1


def _sdxl_block(name):
    rest = name[len("lora_unet_"):]
    for prefix, base in (("input_blocks_", 1), ("middle_block_", 10), ("output_blocks_", 13)):
        if rest.startswith(prefix):
            return base + int(rest[len(prefix):].split("_")[0])
    return -1


@pytest.mark.parametrize("name, is_sdxl", [
    ("lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q", False),
    ("lora_unet_down_blocks_2_downsamplers_0_conv", False),
    ("lora_unet_up_blocks_3_attentions_2_proj_out", False),
    ("lora_unet_up_blocks_1_upsamplers_0_conv", False),
    ("lora_unet_mid_block_attentions_0_proj_in", False),
    ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q", True),
    ("lora_unet_middle_block_1_proj_in", True),
    ("lora_unet_output_blocks_8_0_in_layers_2", True),
])
def test_block_index(name, is_sdxl):
    want = _sdxl_block(name) if is_sdxl else _sd_block(name)
    assert want >= 0 and lora_blocks.block_index(name, is_sdxl) == want


def test_lr_weight_curves_and_lists():
    n = 9
    sine = [math.sin(math.pi * (i / (n - 1)) / 2) + 0.5 for i in range(n)]
    w = lora_blocks.block_lr_weights(True, {"down_lr_weight": "sine+0.5"})
    assert len(w) == 23 and w[0] == w[-1] == 1.0
    assert w[1:10] == pytest.approx(sine) and w[10:] == [1.0] * 13
    cos = [math.sin(math.pi * (i / 11) / 2) for i in reversed(range(12))]
    w = lora_blocks.block_lr_weights(False, {"up_lr_weight": "cosine", "mid_lr_weight": "0.3"})
    assert len(w) == 25 and w[12] == 0.3 and w[13:] == pytest.approx(cos)
    # short lists are filled with 1.0, empty items are 0, values at or under the threshold become 0
    w = lora_blocks.block_lr_weights(False, {"down_lr_weight": "0.5,,0.05", "block_lr_zero_threshold": 0.1})
    assert w[:3] == [0.5, 0.0, 0.0] and w[3:12] == [1.0] * 9
    with pytest.raises(lora.NetworkArgsError, match="down_lr_weight=sinus: .*cosine, sine, linear"):
        lora.parse_network_kwargs({"down_lr_weight": "sinus"})


def test_block_dims_and_block_lr(tiny_sd1):
    n = lora_blocks.num_blocks(False)
    dims = [4] * n
    dims[1] = 2  # down_blocks_0_attentions_0 -> block 1
    with pytest.raises(lora.NetworkArgsError, match="block_dims: 25 values expected"):
        lora.create_network(1.0, 4, 1.0, tiny_sd1.vae, tiny_sd1.text_encoders[0], tiny_sd1.unet, block_dims="4,4")
    down = ["1"] * 12
    down[4] = "0"  # IN04 = block 4 = down_blocks_1_attentions_0: no LoRA
    net = lora.create_network(1.0, 4, 1.0, tiny_sd1.vae, tiny_sd1.text_encoders[0], tiny_sd1.unet,
                              block_dims=",".join(map(str, dims)), down_lr_weight=",".join(down), mid_lr_weight="0.5")
    by_block = {}
    for m in net.unet_loras:
        by_block.setdefault(_sd_block(m.lora_name), []).append(m)
    assert 4 not in by_block and 1 in by_block and 12 in by_block
    assert all(m.lora_dim == 2 for m in by_block[1])
    assert all(m.lora_dim == 4 for b, ms in by_block.items() if b != 1 for m in ms)
    groups, names = net.prepare_optimizer_params(None, 1e-3, 1e-4)
    lrs = dict(zip(names, [g["lr"] for g in groups]))
    assert lrs["textencoder"] == 1e-4 and lrs["unet_block12"] == pytest.approx(5e-4)
    assert lrs["unet_block1"] == 1e-3 and "unet_block4" not in lrs


def test_loraplus_groups(tiny_sdxl):
    net = lora.create_network(1.0, 4, 1.0, tiny_sdxl.vae, tiny_sdxl.text_encoders, tiny_sdxl.unet,
                              loraplus_lr_ratio="16",
                              loraplus_text_encoder_lr_ratio="4")
    groups, names = net.prepare_optimizer_params(1e-5, 1e-4, 1e-3)
    assert names == ["textencoder", "textencoder plus", "unet", "unet plus"]
    assert [g["lr"] for g in groups] == pytest.approx([1e-5, 4e-5, 1e-4, 1.6e-3])
    up = {id(m.lora_up.weight) for m in net.text_encoder_loras + net.unet_loras}
    assert all(id(p) in up for i in (1, 3) for p in groups[i]["params"])
    assert not any(id(p) in up for i in (0, 2) for p in groups[i]["params"])


def test_max_norm_regularization(tiny_sd1):
    net = lora.create_network(1.0, 4, 2.0, tiny_sd1.vae, tiny_sd1.text_encoders[0], tiny_sd1.unet, conv_dim="2")
    torch.manual_seed(0)
    with torch.no_grad():
        for i, m in enumerate(net.text_encoder_loras + net.unet_loras):
            m.lora_up.weight.normal_(0, 0.3 if i % 2 else 1e-4)

    def delta(m):  # the delta weight, written out from sd-scripts' rule
        d, u = m.lora_down.weight, m.lora_up.weight
        if d.dim() == 2:
            w = u @ d
        elif d.shape[2:] == (1, 1):
            w = (u.flatten(1) @ d.flatten(1))[..., None, None]
        else:
            w = torch.nn.functional.conv2d(d.permute(1, 0, 2, 3), u).permute(1, 0, 2, 3)
        return w * float(m.alpha) / m.lora_dim

    mods = net.text_encoder_loras + net.unet_loras
    before = [delta(m).norm().item() for m in mods]
    max_norm = 0.05
    keys_scaled, mean, top = net.apply_max_norm_regularization(max_norm, "cpu")
    after = [delta(m).norm().item() for m in mods]
    assert keys_scaled == sum(b > max_norm for b in before) > 0
    assert after == pytest.approx([min(b, max_norm) for b in before], rel=1e-4)
    assert mean == pytest.approx(sum(after) / len(after), rel=1e-4) and top == pytest.approx(max(after), rel=1e-4)


def test_merge_to_equals_applied_lora(tmp_path, tiny_sd1):
    from test_lora_network import _unet_input

    net = lora.create_network(1.0, 4, 2.0, tiny_sd1.vae, tiny_sd1.text_encoders[0], tiny_sd1.unet, conv_dim="2")
    path = tmp_path / "base.safetensors"
    x, t, h, kw = _unet_input(tiny_sd1)
    with torch.no_grad():
        plain = tiny_sd1.unet(x, t, h, **kw).sample
    net.apply_to(tiny_sd1.text_encoders, tiny_sd1.unet, True, True)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.05)
    net.save_weights(str(path), None, {})
    org = {k: v.clone() for k, v in tiny_sd1.unet.state_dict().items()}
    try:
        with torch.no_grad():
            net.set_multiplier(0.5)
            want = tiny_sd1.unet(x, t, h, **kw).sample
        net.remove_from()
        merged, sd = lora.create_network_from_weights(0.5, str(path), tiny_sd1.vae, tiny_sd1.text_encoders[0],
                                                      tiny_sd1.unet,
                                                      for_inference=True)
        merged.merge_to(tiny_sd1.text_encoders, tiny_sd1.unet, sd)
        with torch.no_grad():
            got = tiny_sd1.unet(x, t, h, **kw).sample
        assert not torch.allclose(want, plain, atol=1e-4)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    finally:
        net.remove_from()
        tiny_sd1.unet.load_state_dict(org)


def test_trainer_options(tmp_path, tiny_sd1_single_file, caplog):
    """2 steps with LoRA+, block lr weights, conv_dim, --scale_weight_norms and --base_weights; the file keeps
    kohya's names and options, every module's delta norm is at most the max norm."""
    import logging

    import train_network
    from library.network_trainer import run
    from library.tiny_models import make_captioned_images
    from lora_checks import read_lora

    comps = load_tiny_components(tiny_sd1_single_file, "sd1")
    base = lora.create_network(1.0, 2, 2.0, comps.vae, comps.text_encoders[0], comps.unet)
    base.apply_to(comps.text_encoders, comps.unet, True, True)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0, 0.05)
    base.save_weights(str(tmp_path / "base.safetensors"), None, {})
    base.remove_from()
    data = make_captioned_images(tmp_path / "data", n=1, size=(64, 64), repeats=1, name="one")
    argv = ["--pretrained_model_name_or_path", str(tiny_sd1_single_file), "--tokenizer_cache_dir",
            str(tiny_sd1_single_file.parent / "tokenizers"), "--train_data_dir", str(data), "--output_dir",
            str(tmp_path / "out"), "--output_name", "opts", "--network_module", "networks.lora", "--network_dim", "4",
            "--network_alpha", "4", "--resolution", "64", "--learning_rate", "1e-1", "--max_data_loader_n_workers",
            "0", "--seed", "1", "--max_train_steps", "2", "--network_dropout", "0.1",
            "--network_args", "conv_dim=2", "loraplus_lr_ratio=4", "mid_lr_weight=0", "rank_dropout=0.1",
            "--scale_weight_norms", "0.01", "--base_weights", str(tmp_path / "base.safetensors"),
            "--base_weights_multiplier", "0.5"]
    with caplog.at_level(logging.INFO):
        path = run(train_network.trainer(), train_network.setup_parser(), argv)
    assert "all base weights merged" in caplog.text and "with multiplier 0.5" in caplog.text
    sd, md = read_lora(path)
    names = {k.split(".")[0] for k in sd}
    assert not any("mid_block" in n for n in names)  # mid lr weight 0: no LoRA there
    assert any(n.endswith("resnets_0_conv1") for n in names)  # conv_dim
    assert md["ss_scale_weight_norms"] == "0.01" and md["ss_network_dropout"] == "0.1"
    assert "loraplus_lr_ratio" in md["ss_network_args"]
    for n in names:
        d, u = sd[f"{n}.lora_down.weight"].float(), sd[f"{n}.lora_up.weight"].float()
        w = u.flatten(1) @ d.flatten(1) if d.shape[2:] in ((), (1, 1)) else \
            torch.nn.functional.conv2d(d.permute(1, 0, 2, 3), u).permute(1, 0, 2, 3)
        assert (w * float(sd[f"{n}.alpha"]) / d.shape[0]).norm() <= 0.01 * (1 + 1e-4), n


@pytest.mark.parametrize("extra, match", [
    (["--scale_weight_norms", "-1"], "--scale_weight_norms must be positive"),
    (["--base_weights", "missing.safetensors"], "--base_weights: file not found"),
    (["--network_args", "up_lr_weight=wave"], "up_lr_weight=wave"),
])
def test_bad_options_refused_before_loading(tmp_path, extra, match, capsys):
    import train_network

    argv = ["--pretrained_model_name_or_path", str(tmp_path / "none.safetensors"), "--train_data_dir",
            str(tmp_path), "--output_dir", str(tmp_path / "out"), "--network_module", "networks.lora", *extra]
    with pytest.raises(SystemExit) as e:
        train_network.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err

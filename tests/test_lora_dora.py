"""Native DoRA for the kohya LoRA networks (`--network_args dora_wd=True [wd_on_output=False]`): networks.lora
(SD/SDXL) and networks.lora_flux (FLUX.1). Checked against references computed independently: peft's DoRA layer
(magnitude per output feature) and ComfyUI's rule for `dora_scale` files (written out here; on the input axis it is
DoRA exactly, so a FLUX file applied that way to the BFL weights gives the model the network gives); the magnitude
starts at the weight norms (no change before training); training runs save `dora_scale` keys and continue from
them (SD1.x, FLUX.1 with split_qkv)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from library import flux_models, flux_tiny
from networks import lora, lora_flux

pytestmark = pytest.mark.usefixtures("one_thread")


def _randomize(net, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(p * (1 + 0.3 * noise) if name.endswith("dora_scale") else 0.3 * noise)


class _Holder(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.lin = layer


@pytest.mark.parametrize("multiplier", [1.0, 0.5])
def test_linear_dora_equals_peft(multiplier):
    """One Linear: our module == peft's DoRA layer holding the same A, B and magnitude (per output feature);
    at multiplier m the change is m times DoRA's (W + m * (W_dora - W), as ComfyUI's strength)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Linear(5, 6)
    module = lora.LoRAModule("lora_te_x", copy.deepcopy(base), multiplier, lora_dim=3, alpha=2.0)
    module.enable_dora(True)
    assert module.dora_scale.shape == (6, 1)
    module.apply_to()
    x = torch.randn(4, 5)
    with torch.no_grad():
        assert torch.allclose(module.org_module(x), base(x), atol=1e-6)  # magnitude = |W| and up = 0: no change
    _randomize(module)

    ref = peft.get_peft_model(_Holder(copy.deepcopy(base)),
                              peft.LoraConfig(r=3, lora_alpha=2.0, use_dora=True, target_modules=["lin"]))
    layer = ref.base_model.model.lin
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(module.lora_down.weight)
        layer.lora_B["default"].weight.copy_(module.lora_up.weight)
        layer.lora_magnitude_vector["default"].weight.copy_(module.dora_scale.flatten())
        want = base(x) + multiplier * (layer(x) - base(x))
        assert torch.allclose(module.org_module(x), want, atol=1e-5, rtol=1e-5)


def _comfy_dora(weight, up, down, alpha, dora_scale, strength):
    """ComfyUI's LoRA-with-dora_scale patch of one weight (comfy/weight_adapter: lora diff = up @ down times
    alpha / rank, weight_decompose: the norm axis from dora_scale's shape; input axis: norm of W + diff)."""
    diff = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape) * (alpha / down.shape[0])
    calc = weight + diff
    assert dora_scale.shape[0] != calc.shape[0]  # the input axis (ComfyUI's output branch normalises by |W|)
    norm = calc.transpose(0, 1).reshape(calc.shape[1], -1).norm(dim=1, keepdim=True) \
        .reshape(calc.shape[1], *[1] * (calc.dim() - 1)).transpose(0, 1)
    calc = calc * (dora_scale / (norm + torch.finfo(weight.dtype).eps))
    return weight + strength * (calc - weight)


def _flux_inputs(flux, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = flux.config
    return dict(hidden_states=torch.randn(1, 16, cfg.in_channels, generator=g),
                encoder_hidden_states=torch.randn(1, 8, cfg.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(1, cfg.pooled_projection_dim, generator=g),
                timestep=torch.tensor([0.5]), img_ids=torch.randn(16, 3, generator=g), txt_ids=torch.zeros(8, 3),
                guidance=torch.tensor([3.5]), return_dict=False)


@pytest.mark.parametrize("split_qkv", [False, True])
def test_flux_dora_file_applied_as_comfyui_does(split_qkv, tmp_path):
    """FLUX LoRA with dora_wd=True wd_on_output=False: the saved file (BFL keys, fused layout) patched into the
    BFL weights by ComfyUI's rule at strength 0.7 == the diffusers model with the network at multiplier 0.7."""
    flux = flux_tiny.tiny_transformer(seed=3)
    model = copy.deepcopy(flux)
    net = lora_flux.create_network(0.7, 4, 2.0, None, [], model, dora_wd="True", wd_on_output="False",
                                   split_qkv=str(split_qkv))
    net.apply_to([], model, False, True)
    _randomize(net)
    net.eval()
    path = tmp_path / "dora.safetensors"
    net.save_weights(str(path), None, {})
    sd = lora.load_lora_state_dict(str(path))
    assert sd["lora_unet_single_blocks_0_linear1.dora_scale"].shape == (1, flux.config.num_attention_heads
                                                                         * flux.config.attention_head_dim)
    bfl = flux_models.diffusers_to_bfl({k: v.detach().clone() for k, v in flux.state_dict().items()})
    names = {k.split(".")[0] for k in sd}
    for key in list(bfl):
        name = "lora_unet_" + key[:-len(".weight")].replace(".", "_")
        if key.endswith(".weight") and name in names:
            bfl[key] = _comfy_dora(bfl[key], sd[f"{name}.lora_up.weight"], sd[f"{name}.lora_down.weight"],
                                   float(sd[f"{name}.alpha"]), sd[f"{name}.dora_scale"], 0.7)
            names.discard(name)
    assert not names
    comfy = copy.deepcopy(flux)
    comfy.load_state_dict(flux_models.bfl_to_diffusers(bfl))
    with torch.no_grad():
        got, want = model(**_flux_inputs(model))[0], comfy(**_flux_inputs(comfy))[0]
        assert not torch.allclose(want, flux(**_flux_inputs(flux))[0], atol=1e-4)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()

    # the file makes the same network again (from weights: DoRA and its axis from the keys) and merges as applied
    merged = copy.deepcopy(flux)
    again, _ = lora_flux.create_network_from_weights(0.7, str(path), None, [], merged)
    again.merge_to([], merged, sd)
    with torch.no_grad():
        assert torch.allclose(merged(**_flux_inputs(merged))[0], want, atol=1e-4, rtol=1e-4)


def test_flux_dora_output_axis_parts_equal_whole_layer():
    """Per output feature (the default): each diffusers part of a fused layer == the rows of DoRA over the
    whole BFL layer (W' = m * V / |V| per row), written out here."""
    flux = flux_tiny.tiny_transformer(seed=3)
    model = copy.deepcopy(flux)
    net = lora_flux.create_network(1.0, 4, 2.0, None, [], model, dora_wd="True")
    net.apply_to([], model, False, True)
    _randomize(net)
    net.eval()
    m = next(m for m in net.unet_loras if m.lora_name.endswith("single_blocks_0_linear1"))
    w = torch.cat([p.weight for p in m._orgs])
    v = w + m.lora_up.weight @ m.lora_down.weight * (2.0 / 4)
    want_w = v * (m.dora_scale / v.norm(dim=1, keepdim=True))
    x = torch.randn(2, 3, w.shape[1])
    with torch.no_grad():
        got = torch.cat([p(x) for p in m._orgs], dim=-1)
        want = torch.nn.functional.linear(x, want_w, torch.cat([p.bias for p in m._orgs]))
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_bad_dora_arg_is_one_line():
    with pytest.raises(lora.NetworkArgsError, match="dora_wd=maybe: not a bool"):
        lora.parse_network_kwargs({"dora_wd": "maybe"})


# -- training runs ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def one_image(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("dora_img"), n=1, size=(64, 64), repeats=1, name="one")


def test_sd_lora_dora_trains_saves_and_continues(tiny_sd1_single_file, one_image, tmp_path):
    import train_network
    from lora_checks import read_lora

    def argv(out, name, extra=()):
        return ["--pretrained_model_name_or_path", str(tiny_sd1_single_file), "--tokenizer_cache_dir",
                str(tiny_sd1_single_file.parent / "tokenizers"), "--train_data_dir", str(one_image),
                "--output_dir", str(out), "--output_name", name, "--network_module", "networks.lora",
                "--network_dim", "4", "--network_alpha", "2", "--resolution", "64", "--max_train_steps", "2",
                "--learning_rate", "1e-2", "--max_data_loader_n_workers", "0", "--seed", "3",
                "--network_args", "dora_wd=True", "conv_dim=2", *extra]

    out = train_network.main(argv(tmp_path / "a", "dora"))
    sd, md = read_lora(out)
    names = {k.split(".")[0] for k in sd}
    assert all(f"{n}.dora_scale" in sd for n in names)
    conv = next(n for n in names if f"{n}.lora_down.weight" in sd and sd[f"{n}.lora_down.weight"].dim() == 4
                and sd[f"{n}.lora_down.weight"].shape[2] == 3)
    assert sd[f"{conv}.dora_scale"].shape == (sd[f"{conv}.lora_up.weight"].shape[0], 1, 1, 1)
    assert json.loads(md["ss_network_args"])["dora_wd"] == "True"
    out2 = train_network.main(argv(tmp_path / "b", "dora2", ["--network_weights", out, "--max_train_steps", "1",
                                                            "--learning_rate", "1e-12", "--optimizer_type",
                                                            "SGDNesterov"]))
    sd2, _ = read_lora(out2)
    assert set(sd2) == set(sd)
    for k in sd:
        assert torch.allclose(sd2[k].float(), sd[k].float(), atol=1e-5), k


@pytest.mark.slow
def test_flux_lora_dora_trains_and_saves(tmp_path, one_image):
    import flux_train_network
    from lora_checks import read_lora

    paths = flux_tiny.make_tiny_flux(tmp_path / "m")
    out = flux_train_network.main([
        "--pretrained_model_name_or_path", paths["transformer"], "--clip_l", paths["clip_l"], "--t5xxl",
        paths["t5xxl"], "--ae", paths["ae"], "--tokenizer_cache_dir", paths["tokenizer_cache_dir"],
        "--train_data_dir", str(one_image), "--output_dir", str(tmp_path / "o"), "--output_name", "fdora",
        "--network_module", "networks.lora_flux", "--network_dim", "4", "--resolution", "32", "--max_train_steps",
        "2", "--learning_rate", "1e-2", "--t5xxl_max_token_length", "16", "--max_data_loader_n_workers", "0",
        "--network_args", "dora_wd=True", "split_qkv=True"])
    sd, _ = read_lora(out)
    assert sd["lora_unet_double_blocks_0_img_attn_qkv.dora_scale"].shape[0] == \
        sd["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].shape[0]
    assert any(n.startswith("lora_te1_") for n in {k.split(".")[0] for k in sd})


def test_dora_inside_a_compiled_block_without_graph_breaks(tiny_sd1):
    block = copy.deepcopy(next(m for m in tiny_sd1.unet.modules() if type(m).__name__ == "BasicTransformerBlock"))
    layers = [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    modules = [lora.LoRAModule(f"lora_unet_{n}".replace(".", "_"), m, 1.0, 4, 1.0) for n, m in layers]
    for m in modules:
        m.enable_dora(True)
        m.apply_to()
    width = block.attn1.to_q.in_features
    x = torch.randn(1, 16, width)
    ctx = torch.randn(1, 77, tiny_sd1.unet.config.cross_attention_dim)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(block)(x, encoder_hidden_states=ctx)
    assert explain.graph_break_count == 0, [str(r.reason)[:200] for r in explain.break_reasons[:3]]
    compiled = torch.compile(block, backend="eager")
    with torch.no_grad():
        assert torch.allclose(compiled(x, encoder_hidden_states=ctx), block(x, encoder_hidden_states=ctx), atol=1e-6)

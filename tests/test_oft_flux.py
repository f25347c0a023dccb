"""networks.oft_flux (upstream's FLUX.1 OFT) on a tiny FLUX.1: BFL names and parts as upstream's rules (written
here), the per-part rotation against upstream's formula, merge, one real 2-step run continuing from a
--network_weights file with orthogonal, constrained blocks; modules refused on the model families upstream lacks."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F

from lora_checks import read_lora

pytestmark = pytest.mark.usefixtures("one_thread")


def expected_keys(n_double, n_single, dim, width, mlp, all_linear):
    """upstream's oft_flux: oft_unet_ + BFL path; qkv in 3 parts, a single block's linear1 in q, k, v + MLP input;
    the attention projections of the double blocks, or every Linear of the double and single blocks."""
    parts = {}
    for i in range(n_double):
        for s in ("img", "txt"):
            parts[f"oft_unet_double_blocks_{i}_{s}_attn_qkv"] = [width] * 3
            parts[f"oft_unet_double_blocks_{i}_{s}_attn_proj"] = [width]
            if all_linear:
                parts[f"oft_unet_double_blocks_{i}_{s}_mod_lin"] = [6 * width]
                parts[f"oft_unet_double_blocks_{i}_{s}_mlp_0"] = [mlp]
                parts[f"oft_unet_double_blocks_{i}_{s}_mlp_2"] = [width]
    for i in range(n_single if all_linear else 0):
        parts[f"oft_unet_single_blocks_{i}_linear1"] = [width] * 3 + [mlp]
        parts[f"oft_unet_single_blocks_{i}_linear2"] = [width]
        parts[f"oft_unet_single_blocks_{i}_modulation_lin"] = [3 * width]
    keys = {f"{name}.oft_blocks.{p}": (dim, d // dim, d // dim) for name, ds in parts.items() for p, d in enumerate(ds)}
    return keys | {f"{name}.alpha": () for name in parts}


def upstream_oft_weight(blocks, alpha, w):
    """upstream's OFT: Q = B - B^T scaled to norm <= alpha * out, R = (I+Q)(I-Q)^-1, rows of block k -> R_k^T W_k."""
    k, n = blocks.shape[:2]
    q = blocks - blocks.transpose(1, 2)
    norm = q.flatten().norm()
    q = q * ((norm.clamp(max=alpha * w.shape[0]) + 1e-8) / (norm + 1e-8))
    eye = torch.eye(n).expand(k, n, n)
    r = (eye + q) @ torch.linalg.inv(eye - q)
    wk = w.reshape(k, n, -1)
    return torch.stack([r[i].T @ wk[i] for i in range(k)]).reshape(w.shape)


def cayley_inverse(r):
    eye = torch.eye(r.shape[-1], dtype=r.dtype).expand_as(r)
    return (r - eye) @ torch.linalg.inv(r + eye)


@pytest.mark.parametrize("all_linear", [False, True])
def test_names_parts_forward_and_merge(tmp_path, all_linear):
    from library import flux_tiny
    from networks import oft_flux

    flux = flux_tiny.tiny_transformer(num_double=2, num_single=1)
    width = flux.config.num_attention_heads * flux.config.attention_head_dim
    mlp = flux.single_transformer_blocks[0].proj_mlp.out_features
    net = oft_flux.create_network(1.0, 4, 1e-2, None, [None, None], flux, enable_all_linear=str(all_linear))
    net.apply_to(None, flux)
    assert {k: tuple(v.shape) for k, v in net.state_dict().items()} == expected_keys(2, 1, 4, width, mlp, all_linear)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.2)
    # the fused BFL qkv is rotated per part, each with the constraint alpha * part width, as upstream's split module
    m = {x.oft_name: x for x in net.unet_ofts}["oft_unet_double_blocks_0_img_attn_qkv"]
    attn = flux.transformer_blocks[0].attn
    x = torch.randn(2, 5, width)
    fused_w = torch.cat([upstream_oft_weight(m.oft_blocks[i].detach(), 1e-2, lin.weight.detach())
                         for i, lin in enumerate((attn.to_q, attn.to_k, attn.to_v))])
    fused_b = torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias])
    applied = torch.cat([attn.to_q(x), attn.to_k(x), attn.to_v(x)], -1)
    assert torch.allclose(applied, F.linear(x, fused_w, fused_b), atol=1e-5)
    path = tmp_path / "oft_flux.safetensors"
    net.set_multiplier(0.0)
    assert torch.allclose(attn.to_q(x), F.linear(x, attn.to_q.weight, attn.to_q.bias))
    net.set_multiplier(1.0)
    from library.network_trainer import save_network_state_dict

    save_network_state_dict(net, str(path), None, {"ss_network_module": "networks.oft_flux"}, False)
    net.remove_from()
    # --base_weights: the file merged into the weights gives the applied output
    again, sd = oft_flux.create_network_from_weights(1.0, str(path), None, [None, None], flux, for_inference=True)
    assert {x.oft_name for x in again.unet_ofts} == {x.oft_name for x in net.unet_ofts}
    again.merge_to(None, flux, sd)
    assert torch.allclose(torch.cat([attn.to_q(x), attn.to_k(x), attn.to_v(x)], -1), applied, atol=1e-4)


@pytest.mark.parametrize("module, family, match", [
    ("networks.dylora", "flux", "made for sd1/sd2/sdxl models .*trains flux; use networks.lora_flux"),
    ("networks.lora_fa", "flux", "made for sd1/sd2/sdxl models .*trains flux; use networks.lora_flux"),
    ("networks.oft", "flux", "made for sd1/sd2/sdxl models .*trains flux; use networks.oft_flux"),
    ("networks.oft_flux", "sdxl", "made for flux models .*trains sdxl"),
])
def test_model_families_refused_before_loading(tmp_path, module, family, match):
    import flux_train_network
    import sdxl_train_network
    from library import train_util
    from library.train_util import ConfigError

    script = flux_train_network if family == "flux" else sdxl_train_network
    trainer = script.trainer() if family == "flux" else script.trainer()
    args = train_util.parse_args(script.setup_parser(), [
        "--pretrained_model_name_or_path", str(tmp_path / "none.safetensors"), "--network_module", module,
        "--output_dir", str(tmp_path), "--train_data_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=match):
        trainer.check_args(args)


@pytest.mark.slow
def test_trains_continues_and_stays_constrained(tmp_path, tmp_path_factory):
    import flux_train_network
    from library import flux_models, flux_tiny
    from library.network_trainer import run, save_network_state_dict
    from library.tiny_models import make_captioned_images
    from networks import oft_flux

    paths = flux_tiny.make_tiny_flux(tmp_path_factory.mktemp("oft_flux_models"))
    data = make_captioned_images(tmp_path / "data", n=1, size=(32, 32), repeats=1, name="demo")
    flux = flux_models.load_flux_transformer(paths["transformer"], torch.float32, False)
    alpha, lr = 1e-3, 1e-4
    net = oft_flux.create_network(1.0, 4, alpha, None, [None, None], flux, enable_all_linear="True")
    net.apply_to(None, flux)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.1)
    save_network_state_dict(net, str(tmp_path / "start.safetensors"), None, None, False)
    net.remove_from()
    start = read_lora(tmp_path / "start.safetensors")[0]
    argv = ["--pretrained_model_name_or_path", paths["transformer"], "--clip_l", paths["clip_l"], "--t5xxl",
            paths["t5xxl"], "--ae", paths["ae"], "--tokenizer_cache_dir", paths["tokenizer_cache_dir"],
            "--train_data_dir", str(data), "--output_dir", str(tmp_path), "--output_name", "oft",
            "--network_module", "networks.oft_flux", "--network_dim", "4", "--network_alpha", str(alpha),
            "--network_args", "enable_all_linear=True", "--network_weights", str(tmp_path / "start.safetensors"),
            "--network_train_unet_only", "--resolution", "32", "--max_train_steps", "2", "--learning_rate", str(lr),
            "--t5xxl_max_token_length", "16", "--max_data_loader_n_workers", "0", "--seed", "1"]
    path = run(flux_train_network.trainer(), flux_train_network.setup_parser(), argv)
    sd, md = read_lora(path)
    assert set(sd) == set(start) and md["ss_network_module"] == "networks.oft_flux"
    # continued from the file: AdamW moved each value by at most ~lr per step
    diffs = [(sd[k] - start[k]).abs().max().item() for k in sd if ".oft_blocks." in k]
    assert 0 < max(diffs) <= 2.05 * lr
    trained, _ = oft_flux.create_network_from_weights(1.0, str(path), None, [None, None], flux)
    trained.apply_to(None, flux)
    x = torch.randn(1, 3, flux.transformer_blocks[0].attn.to_q.in_features)
    before = flux.transformer_blocks[0].attn.to_q.weight.detach()
    trained.load_weights(str(path))
    for m in trained.unet_ofts:
        for part in m.parts:
            r = part.rotation().detach()
            assert torch.allclose(r @ r.transpose(1, 2), torch.eye(r.shape[-1]).expand_as(r), atol=1e-4)
            assert cayley_inverse(r).flatten().norm().item() <= alpha * part.out_dim * 1.001
    to_q = flux.transformer_blocks[0].attn.to_q
    assert not torch.allclose(to_q(x), F.linear(x, before, to_q.bias), atol=1e-6)  # the file changes the output
    trained.remove_from()

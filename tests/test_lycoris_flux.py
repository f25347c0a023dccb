"""--network_module lycoris.kohya on FLUX.1 (diffusers' transformer, BFL names): the module set and names are
networks.lora_flux's (sd-scripts' / ComfyUI's BFL names); each diffusers part of a fused BFL Linear computes
what LyCORIS' own merged weight of the fused layer gives (LoKr, LoHa, DoRA on rows or columns, full); a LoKr
file applied as ComfyUI applies it to the BFL weights gives the same output; the modules run inside a compiled
FLUX block without graph breaks; flux_train_network.py trains, saves and continues LoKr / DoRA on the tiny FLUX."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("lycoris")

from library import flux_models, flux_tiny  # noqa: E402
from networks import lora_flux, lycoris_kohya  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {"lokr": {"algo": "lokr", "factor": "4"}, "loha": {"algo": "loha"},
         "dora": {"algo": "locon", "dora_wd": "True"},
         "lokr_dora_columns": {"algo": "lokr", "factor": "4", "dora_wd": "True", "wd_on_output": "False"},
         "full": {"algo": "full"}, "locon": {"algo": "locon"}}


@pytest.fixture(scope="module")
def flux():
    return flux_tiny.tiny_transformer(seed=3)


def _inputs(flux, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = flux.config
    b, img, txt = 1, 16, 8
    return dict(hidden_states=torch.randn(b, img, cfg.in_channels, generator=g),
                encoder_hidden_states=torch.randn(b, txt, cfg.joint_attention_dim, generator=g),
                pooled_projections=torch.randn(b, cfg.pooled_projection_dim, generator=g),
                timestep=torch.tensor([0.5]), img_ids=torch.randn(img, 3, generator=g),
                txt_ids=torch.zeros(txt, 3), guidance=torch.tensor([3.5]) if cfg.guidance_embeds else None,
                return_dict=False)


def _randomized(net, seed=1):
    """Trained-looking weights: every LyCORIS tensor random (LyCORIS starts with a zero difference)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 2 and p.shape[1] == 1 else 0.0)
                    * p.detach())
    return net


def test_module_set_and_names_are_kohya_flux_lora(flux):
    kohya = lora_flux.create_network(1.0, 4, 1.0, None, [], flux)
    for kwargs in (CASES["lokr"], CASES["dora"], CASES["full"]):
        net = lycoris_kohya.create_network(1.0, 4, 1.0, None, None, flux, **kwargs)
        assert {m.lora_name for m in net.unet_loras} == {m.lora_name for m in kohya.unet_loras}
    attn = lycoris_kohya.create_network(1.0, 4, 1.0, None, None, flux, algo="lokr", preset="attn-only")
    assert {m.lora_name for m in attn.unet_loras} == {"lora_unet_double_blocks_0_img_attn_qkv",
                                                     "lora_unet_double_blocks_0_img_attn_proj",
                                                     "lora_unet_double_blocks_0_txt_attn_qkv",
                                                     "lora_unet_double_blocks_0_txt_attn_proj"}


def test_refuses_algos_it_cannot_run_on_flux(flux, tmp_path, capsys):
    import flux_train_network
    from networks.lora import NetworkArgsError

    with pytest.raises(NetworkArgsError, match="algo=boft: on FLUX.1 allowed: lora, locon, loha, lokr, full"):
        lycoris_kohya.create_network(1.0, 4, 1.0, None, None, flux, algo="boft")
    with pytest.raises(SystemExit) as e:  # before any model loads
        flux_train_network.main(["--pretrained_model_name_or_path", str(tmp_path / "m.safetensors"),
                                 "--train_data_dir", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                                 "--network_module", "lycoris.kohya", "--network_args", "algo=ia3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--network_args algo=ia3: on FLUX.1 allowed: lora, locon, loha, lokr, full" in err


@pytest.mark.parametrize("case", sorted(CASES))
def test_parts_compute_lycoris_forward_of_the_fused_layer(case, flux):
    """Each BFL layer's diffusers parts with the adapter, joined == LyCORIS' own forward over the whole (fused)
    layer; and the adapter changes the model's output."""
    model = copy.deepcopy(flux)
    net = lycoris_kohya.create_network(0.7, 4, 2.0, None, None, model, **CASES[case])
    net.apply_to(None, model, False, True)
    _randomized(net)
    net.eval()
    x = torch.randn(3, 5, max(m.org_module[0].in_features for m in net.unet_loras))
    with torch.no_grad():
        for m in net.unet_loras:
            whole = m.org_module[0]
            xi = x[..., :whole.in_features]
            got = torch.cat([part(xi) for part in whole.parts], dim=-1)
            if case == "full":  # LyCORIS' full layer = base + multiplier * the trained difference
                want = torch.nn.functional.linear(xi, whole.weight + 0.7 * m.weight, whole.bias + 0.7 * m.bias)
            else:
                want = m.forward(xi)  # LyCORIS on the whole layer (its org_forward is the joined BFL Linear)
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (m.lora_name, (got - want).abs().max())
        assert not torch.allclose(model(**_inputs(model))[0], flux(**_inputs(flux))[0], atol=1e-4)


def _comfy_lokr_weight(sd, name, shape):
    """ComfyUI's LoKr difference for one key (its weight_adapter.lokr rules, written out here)."""
    def get(k):
        return sd.get(f"{name}.{k}")

    w1, w2, dim = get("lokr_w1"), get("lokr_w2"), None
    if w1 is None:
        dim = get("lokr_w1_b").shape[0]
        w1 = get("lokr_w1_a") @ get("lokr_w1_b")
    if w2 is None:
        dim = get("lokr_w2_b").shape[0]
        w2 = get("lokr_w2_a") @ get("lokr_w2_b")
    alpha = get("alpha")
    scale = float(alpha) / dim if alpha is not None and dim is not None else 1.0
    return torch.kron(w1, w2).reshape(shape) * scale


def test_lokr_file_applied_as_comfyui_does(flux):
    """The saved tensors, applied to the BFL weights with ComfyUI's LoKr rule, give the model the adapter gives."""
    model = copy.deepcopy(flux)
    net = lycoris_kohya.create_network(1.0, 4, 2.0, None, None, model, algo="lokr", factor="4")
    net.apply_to(None, model, False, True)
    _randomized(net)
    net.eval()
    sd = {k: v.detach().float() for k, v in net.state_dict().items()}
    bfl = flux_models.diffusers_to_bfl({k: v.detach().clone() for k, v in flux.state_dict().items()})
    names = {k.split(".")[0] for k in sd}
    for key in list(bfl):
        name = "lora_unet_" + key[:-len(".weight")].replace(".", "_")
        if key.endswith(".weight") and name in names:
            bfl[key] = bfl[key] + _comfy_lokr_weight(sd, name, bfl[key].shape)
            names.discard(name)
    assert not names  # every module of the file names a BFL weight
    comfy = copy.deepcopy(flux)
    comfy.load_state_dict(flux_models.bfl_to_diffusers(bfl))
    with torch.no_grad():
        assert torch.allclose(model(**_inputs(model))[0], comfy(**_inputs(comfy))[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["lokr", "dora"])
def test_inside_compiled_flux_blocks_without_graph_breaks(case, flux):
    from library.compile.regional import adapter_kinds

    model = copy.deepcopy(flux)
    net = lycoris_kohya.create_network(1.0, 4, 1.0, None, None, model, **CASES[case])
    net.apply_to(None, model, False, True)
    block = model.single_transformer_blocks[0]
    kinds = adapter_kinds(block)
    assert kinds == {"LokrModule" if case == "lokr" else "LoConModule": 6}  # to_q/k/v, proj_mlp, proj_out, norm
    width = block.proj_out.out_features
    h, t = torch.randn(1, 24, width), torch.randn(1, width)
    rope = model.pos_embed(torch.randn(24, 3))
    torch._dynamo.reset()
    explain = torch._dynamo.explain(block)(hidden_states=h[:, 8:], encoder_hidden_states=h[:, :8], temb=t,
                                           image_rotary_emb=rope)
    assert explain.graph_break_count == 0, [str(r.reason)[:200] for r in explain.break_reasons[:3]]


# -- flux_train_network.py end to end ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def flux_set(tmp_path_factory):
    return flux_tiny.make_tiny_flux(tmp_path_factory.mktemp("lyco_flux_models"))


@pytest.fixture(scope="module")
def flux_data(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("lyco_flux_data"), n=1, size=(32, 32), repeats=1,
                                 name="demo")


def _argv(paths, data, out, name, network_args, extra=()):
    return ["--pretrained_model_name_or_path", paths["transformer"], "--clip_l", paths["clip_l"],
            "--t5xxl", paths["t5xxl"], "--ae", paths["ae"], "--tokenizer_cache_dir", paths["tokenizer_cache_dir"],
            "--train_data_dir", str(data), "--output_dir", str(out), "--output_name", name,
            "--network_module", "lycoris.kohya", "--network_dim", "4", "--network_alpha", "2",
            "--resolution", "32", "--max_train_steps", "2", "--learning_rate", "1e-2",
            "--t5xxl_max_token_length", "16", "--max_data_loader_n_workers", "0", "--seed", "1",
            "--network_args", *network_args, *extra]


@pytest.mark.parametrize("case", [pytest.param("lokr"), pytest.param("dora", marks=pytest.mark.slow),
                                  pytest.param("full", marks=pytest.mark.slow)])
def test_flux_train_network_trains_saves_and_continues(case, flux_set, flux_data, tmp_path):
    import flux_train_network
    from lora_checks import read_lora

    args = [f"{k}={v}" for k, v in CASES[case].items()]
    out = flux_train_network.main(_argv(flux_set, flux_data, tmp_path / "a", case, args,
                                        ["--network_train_unet_only"] if case == "full" else []))
    sd, md = read_lora(out)
    names = {k.split(".")[0] for k in sd}
    assert "lora_unet_double_blocks_0_img_attn_qkv" in names and "lora_unet_single_blocks_0_linear1" in names
    assert all(n.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_", "lora_te1_text_model_"))
               for n in names)
    assert md["ss_network_module"] == "lycoris.kohya" and md["ss_base_model_version"] == "flux1"
    if case == "lokr":
        assert any(k.endswith(".lokr_w1") for k in sd) and any(n.startswith("lora_te1_") for n in names)
    if case == "dora":
        assert sd["lora_unet_single_blocks_0_linear1.dora_scale"].shape[0] == \
            sd["lora_unet_single_blocks_0_linear1.lora_up.weight"].shape[0]
    if case == "full":
        assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith(".diff"))

    # continues: with a vanishing learning rate the result is the file
    out2 = flux_train_network.main(_argv(flux_set, flux_data, tmp_path / "b", case + "2", args,
                                         ["--network_weights", out, "--max_train_steps", "1", "--learning_rate",
                                          "1e-12", "--optimizer_type", "SGDNesterov", "--seed", "4",
                                          *(["--network_train_unet_only"] if case == "full" else [])]))
    sd2, _ = read_lora(out2)
    assert set(sd2) == set(sd)
    for k in sd:
        assert torch.allclose(sd2[k].float(), sd[k].float(), atol=1e-5), k


# -- kohya_ss' LoKr presets on FLUX.1 ------------------------------------------------------------------------------

def _lokr_presets():
    from kohya_gui import REPO

    folder = REPO.parent / "shared" / "parity" / "kohya_ss-presets" / "lora"
    import json

    return sorted(p for p in folder.glob("*.json") if json.loads(p.read_text()).get("LoRA_type") == "LyCORIS/LoKr") \
        if folder.is_dir() else []


def _network_flags(argv: list[str]) -> list[str]:
    """The --network_* flags (with their values) of a trainer command line."""
    out, keep = [], False
    for a in argv:
        if a.startswith("--"):
            keep = a.startswith("--network_") and a != "--network_train_unet_only"
        if keep:
            out.append(a)
    return out


@pytest.mark.parametrize("path", [pytest.param(p, marks=() if i == 0 else pytest.mark.slow)
                                  for i, p in enumerate(_lokr_presets())], ids=lambda p: p.name)
def test_kohya_ss_lokr_presets_train_on_flux(path, flux_set, flux_data, tmp_path):
    """A kohya_ss LoKr preset imported for FLUX.1 gives a flux_train_network.py command whose network settings
    train the tiny FLUX and save a LoKr file with BFL names."""
    import flux_train_network
    from kohya_gui import command, importer
    from lora_checks import read_lora

    imp = importer.load(path, family="FLUX.1")
    argv = command.trainer_args("lora", "FLUX.1", imp.values)
    assert command.script_path("lora", "FLUX.1").endswith("flux_train_network.py")
    network = _network_flags(argv)
    assert network[network.index("--network_module") + 1] == "lycoris.kohya" and "algo=lokr" in network
    run = _argv(flux_set, flux_data, tmp_path, "preset", [], ["--max_train_steps", "1", *network])
    run.remove("--network_args")  # _argv's empty --network_args: the preset's own come with `network`
    sd, md = read_lora(flux_train_network.main(run))
    assert "lora_unet_single_blocks_0_linear1.lokr_w1" in sd or "lora_unet_single_blocks_0_linear1.lokr_w1_a" in sd
    assert md["ss_network_module"] == "lycoris.kohya"


@pytest.mark.slow
def test_flux_lokr_trains_compiled_with_block_swap(flux_set, flux_data, tmp_path, caplog):
    """--compile (aot_eager) with gradient checkpointing and block swap: the LoKr modules run inside the compiled
    FLUX blocks (the compile log counts them) and the run saves the file."""
    import logging

    import flux_train_network
    from lora_checks import read_lora

    caplog.set_level(logging.INFO)
    out = flux_train_network.main(_argv(flux_set, flux_data, tmp_path, "compiled", ["algo=lokr", "factor=4"],
                                        ["--compile", "--compile_backend", "aot_eager", "--gradient_checkpointing",
                                         "--blocks_to_swap", "1", "--network_train_unet_only"]))
    assert "adapter layers (LokrModule) run inside the compiled blocks" in caplog.text
    sd, _ = read_lora(out)
    assert "lora_unet_single_blocks_0_linear1.lokr_w1" in sd and not any("_orig_mod" in k for k in sd)

"""--network_module lycoris.kohya (lycoris-lora) on the tiny SDXL: sd-scripts' module set and key names (SGM
UNet names, canonical CLIP names), 2 training steps per algorithm, the file continuing with --network_weights and
changing the model's output, the adapters inside the compiled blocks without graph breaks, and the clear error
when the package is missing."""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("lycoris")

from networks import lora, lycoris_kohya  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ALGOS = ["locon", "loha", "lokr", "ia3", "dylora", "glora", "diag-oft", "boft", "full"]
FAST = {"locon", "lokr"}


@pytest.fixture(scope="module")
def kohya_names(tiny_sdxl):
    """sd-scripts' LoRA names for the same layers (networks.lora with conv_dim keeps upstream's names)."""
    net = lora.create_network(1.0, 4, 1.0, tiny_sdxl.vae, tiny_sdxl.text_encoders, tiny_sdxl.unet, conv_dim="4")
    return {m.lora_name for m in net.text_encoder_loras + net.unet_loras}


def test_module_set_and_names(tiny_sdxl, kohya_names):
    for kwargs in ({"algo": "locon"}, {"algo": "lokr", "factor": "4", "dora_wd": "True"},
                   {"algo": "loha", "preset": "attn-mlp"}):
        net = lycoris_kohya.create_network(1.0, 4, 1.0, tiny_sdxl.vae, tiny_sdxl.text_encoders, tiny_sdxl.unet,
                                           **kwargs)
        names = {m.lora_name for m in net.text_encoder_loras + net.unet_loras}
        if kwargs.get("preset") == "attn-mlp":  # no ResNet / sampler layers: networks.lora's default targets
            plain = lora.create_network(1.0, 4, 1.0, tiny_sdxl.vae, tiny_sdxl.text_encoders, tiny_sdxl.unet)
            assert names == {m.lora_name for m in plain.text_encoder_loras + plain.unet_loras}
        else:
            assert names == kohya_names
    assert "lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q" in names
    assert "lora_te1_text_model_encoder_layers_0_self_attn_q_proj" in names


def _unet_out(comps):
    from test_lora_network import _unet_input

    x, t, h, kw = _unet_input(comps)
    with torch.no_grad():
        return comps.unet(x, t, h, **kw).sample


def _argv(model, data, out, name, extra=()):
    return ["--pretrained_model_name_or_path", str(model), "--tokenizer_cache_dir", str(model.parent / "tokenizers"),
            "--train_data_dir", str(data), "--output_dir", str(out), "--output_name", name,
            "--network_module", "lycoris.kohya", "--network_dim", "4", "--network_alpha", "2", "--resolution", "64",
            "--max_train_steps", "2", "--learning_rate", "1e-2", "--max_data_loader_n_workers", "0", "--seed", "3",
            "--network_train_unet_only", "--cache_latents", *extra]


@pytest.fixture(scope="module")
def one_image(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("lyco_img"), n=1, size=(64, 64), repeats=1, name="one")


@pytest.mark.parametrize("algo", [pytest.param(a, marks=() if a in FAST else pytest.mark.slow) for a in ALGOS])
def test_algo_trains_saves_and_continues(algo, tiny_sdxl, kohya_names, tiny_sdxl_single_file, one_image, tmp_path):
    import sdxl_train_network
    from lora_checks import read_lora

    extra = ["algo=" + algo] + (["dora_wd=True"] if algo == "locon" else []) + \
        (["factor=4", "conv_dim=2"] if algo == "lokr" else [])
    out = sdxl_train_network.main(_argv(tiny_sdxl_single_file, one_image, tmp_path / "a", algo,
                                        ["--network_args", *extra, "--network_dropout", "0.1"]))
    sd, md = read_lora(out)
    names = {k.split(".")[0] for k in sd}
    assert names and names <= {n for n in kohya_names if n.startswith("lora_unet_")}
    assert md["ss_network_module"] == "lycoris.kohya" and f"algo={algo}" not in md.get("ss_network_args", "")
    assert algo in md["ss_network_args"] and md["sshs_model_hash"] and md["sshs_legacy_hash"]

    # continues: with a vanishing learning rate the result is the file
    out2 = sdxl_train_network.main(_argv(tiny_sdxl_single_file, one_image, tmp_path / "b", algo + "2",
                                         ["--network_args", *extra, "--network_weights", out, "--max_train_steps", "1",
                                          "--learning_rate", "1e-12", "--optimizer_type", "SGDNesterov",
                                          "--seed", "4"]))  # another seed: a file that did not load shows
    sd2, _ = read_lora(out2)
    assert set(sd2) == set(sd)
    for k in sd:
        assert torch.allclose(sd2[k].float(), sd[k].float(), atol=1e-6), k

    # and changes the model's output: the file loaded into a network with the same arguments
    import copy

    comps = copy.copy(tiny_sdxl)
    comps.unet = copy.deepcopy(tiny_sdxl.unet)
    plain = _unet_out(comps)
    opts = dict(e.split("=", 1) for e in extra)
    net = lycoris_kohya.create_network(1.0, 4, 2.0, comps.vae, comps.text_encoders, comps.unet, **opts)
    net.apply_to(comps.text_encoders, comps.unet, False, True)
    net.load_weights(out)
    net.eval()
    assert not torch.allclose(_unet_out(comps), plain, atol=1e-6)
    if algo in FAST:  # --base_weights' path: made from the file and merged
        comps.unet = copy.deepcopy(tiny_sdxl.unet)
        merged, weights = lycoris_kohya.create_network_from_weights(1.0, out, comps.vae, comps.text_encoders,
                                                                    comps.unet)
        assert {m.lora_name for m in merged.unet_loras} == names
        merged.merge_to(comps.text_encoders, comps.unet, weights, torch.float32, "cpu")
        assert not torch.allclose(_unet_out(comps), plain, atol=1e-6)


@pytest.mark.parametrize("algo", [pytest.param(a, marks=() if a in {"locon", "dylora"} else pytest.mark.slow)
                                  for a in ALGOS])
def test_adapters_inside_compiled_block_without_graph_breaks(algo, tiny_sdxl):
    """Each algorithm's module runs inside a compiled transformer block as part of its graph (backend eager);
    DyLoRA's random rank draw runs eagerly (a break per module, as networks.dylora) and the log says so."""
    import copy

    t2d = copy.deepcopy(next(m for m in tiny_sdxl.unet.modules() if type(m).__name__ == "Transformer2DModel"))
    net = lycoris_kohya.create_network(1.0, 4, 1.0, None, None, t2d, algo=algo, preset="attn-mlp")
    net.apply_to(None, t2d, False, True)
    block = next(m for m in t2d.modules() if type(m).__name__ == "BasicTransformerBlock")
    width = block.attn1.to_q.in_features
    x = torch.randn(1, 16, width)
    ctx = torch.randn(1, 77, tiny_sdxl.unet.config.cross_attention_dim)
    torch._dynamo.reset()
    explain = torch._dynamo.explain(block)(x, encoder_hidden_states=ctx)
    from library.compile.regional import adapter_kinds

    kinds = adapter_kinds(block)
    if algo == "dylora":
        assert set(kinds) == {"DyLoraModule eager: a graph break each"}
        assert explain.graph_break_count > 0
        import random

        compiled = torch.compile(block, backend="eager")
        random.seed(1)
        want = block(x, encoder_hidden_states=ctx)
        random.seed(1)
        assert torch.allclose(compiled(x, encoder_hidden_states=ctx), want, atol=1e-6)
        return
    assert explain.graph_break_count == 0, [str(r.reason)[:200] for r in explain.break_reasons[:3]]
    assert explain.graph_count == 1 and len(kinds) == 1
    from library.compile.regional import count_adapters

    assert count_adapters(block) >= 6  # q, k, v, out of both attentions + ff


def test_missing_package_is_a_clear_error(tmp_path, capsys, monkeypatch):
    import builtins

    import sdxl_train_network

    real_import = builtins.__import__

    def no_lycoris(name, *args, **kwargs):
        if name == "lycoris" or name.startswith("lycoris."):
            raise ImportError("No module named 'lycoris'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lycoris)
    monkeypatch.setattr("importlib.import_module",
                        lambda name, package=None: no_lycoris(name) if name.startswith("lycoris") else
                        real_import(name, fromlist=["_"]))
    with pytest.raises(SystemExit) as e:
        sdxl_train_network.main(["--pretrained_model_name_or_path", str(tmp_path / "m.safetensors"),
                                 "--train_data_dir", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                                 "--network_module", "lycoris.kohya"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "lycoris-lora" in err and "'lycoris' extra" in err


def test_compile_log_counts_adapters(tiny_sdxl, caplog):
    """compile_model_blocks says how many adapter layers run inside the compiled blocks."""
    import copy
    from types import SimpleNamespace

    from library.compile import regional

    unet = copy.deepcopy(tiny_sdxl.unet)
    net = lycoris_kohya.create_network(1.0, 4, 1.0, None, tiny_sdxl.text_encoders, unet, algo="lokr")
    net.apply_to(tiny_sdxl.text_encoders, unet, False, True)
    args = SimpleNamespace(compile_backend="eager", compile_mode="default", compile_dynamic="auto",
                           compile_fullgraph=False)
    with caplog.at_level(logging.INFO):
        regional.compile_model_blocks(unet, args, model_name="SDXL UNet")
    n = sum(1 for m in net.unet_loras if "transformer_blocks" in m.lora_name)
    assert f"{n} adapter layers (LokrModule) run inside the compiled blocks" in caplog.text


@pytest.mark.parametrize("algo", ["diag-oft", "ia3"])
def test_bypass_mode_keeps_the_layers_dtype_under_cpu_autocast(algo, tiny_sd1):
    """Issue 31: kohya_ss' Diag-OFT config (bypass_mode, network_dim 32, bf16) crashed at step 1 on the CPU with
    "mixed dtype": LyCORIS' bypass sum came back float32 (Diag-OFT with 1x1 blocks, here the tiny CLIP's 32-wide
    layers at dim 32; IA3 always) and reached a bf16 LayerNorm. Each adapted layer gives what the layer gives."""
    import copy

    te = copy.deepcopy(tiny_sd1.text_encoders[0]).to(torch.bfloat16)
    unet = copy.deepcopy(tiny_sd1.unet).to(torch.bfloat16)
    net = lycoris_kohya.create_network(1.0, 32, 16.0, None, te, unet, algo=algo, conv_dim="8", conv_alpha="4",
                                       bypass_mode="True")
    net.apply_to(te, unet, True, True)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01)  # away from the identity start, so the adapters' difference is not zero
    ids = torch.randint(0, te.config.vocab_size, (2, 8))
    layer = net.text_encoder_loras[0].org_module[0]
    with torch.autocast("cpu", torch.bfloat16):
        hidden = te(ids).last_hidden_state
        x = torch.randn(2, layer.in_features)
        assert layer(x).dtype == torch.bfloat16  # float32 input, bf16 out: as the plain Linear under autocast
    assert hidden.dtype == torch.bfloat16 and torch.isfinite(hidden.float()).all()
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16

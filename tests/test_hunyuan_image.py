"""HunyuanImage 2.1 LoRA (hunyuan_image_train_network.py) on a tiny random HunyuanImage 2.1 built here in upstream's
file layouts (DiT with `model.diffusion_model.`, Qwen2.5-VL `model.*`, byT5 `encoder.*` + `shared.weight`, the VAE's
`encoder.down.N.block.M` keys) and a local word-level tokenizer that splits upstream's template as Qwen's does; CPU:
- the layouts load (the DiT's names are the file's, the VAE's upstream keys go both ways), prompt encoding as
  upstream (34 template tokens dropped, byT5 only for quoted text), the text join order;
- LoRA: upstream's keys and metadata, upstream's cache files, batch 2 with captions of different lengths, a sample
  image; save_state then --resume; bad settings: one line, exit 2.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import hunyuan_image_train_network
from library import hunyuan_image_models as models
from library.families import hunyuan_image

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def hy_set(tmp_path_factory):
    return models.make_tiny_hunyuan_image(tmp_path_factory.mktemp("hy_models"), prefix=True)


@pytest.fixture()
def hy_data(tmp_path):
    from library.tiny_models import make_captioned_images

    folder = make_captioned_images(tmp_path / "data", n=2, size=(64, 64), repeats=1, name="demo")
    captions = ['a red circle with a sign "Hi"', "a blue square photo on a green background"]
    for path, caption in zip(sorted(folder.rglob("*.png")), captions):
        path.with_suffix(".caption").write_text(caption)
    return folder


def model_argv(p):
    return ["--pretrained_model_name_or_path", p["dit"], "--text_encoder", p["text_encoder"], "--byt5", p["byt5"],
            "--vae", p["vae"], "--tokenizer_cache_dir", p["tokenizer_cache_dir"]]


LORA = ["--network_module", "networks.lora_hunyuan_image", "--network_dim", "4", "--network_alpha", "2",
        "--network_train_unet_only"]


def train_argv(data, out, name, extra=()):
    return ["--train_data_dir", str(data), "--output_dir", str(out), "--output_name", name, "--resolution", "64",
            "--max_train_steps", "2", "--learning_rate", "1e-3", "--max_data_loader_n_workers", "0", "--seed", "1",
            *extra]


def read(path):
    with safe_open(str(path), "pt") as f:
        md = f.metadata() or {}
    return load_file(str(path)), md


def upstream_lora_names(dit) -> set[str]:
    """Upstream's rule (networks/lora_hunyuan_image.py): every Linear inside MMDoubleStreamBlock /
    MMSingleStreamBlock, named lora_unet_<module path with _>."""
    names = set()
    for name, module in dit.named_modules():
        if type(module).__name__ in ("MMDoubleStreamBlock", "MMSingleStreamBlock"):
            for child_name, child in module.named_modules():
                if isinstance(child, torch.nn.Linear):
                    names.add(f"lora_unet_{name}.{child_name}".replace(".", "_"))
    return names


def test_layouts_load_and_prompts_encode_as_upstream(hy_set, tmp_path):
    dit = models.load_dit(hy_set["dit"], torch.float32)
    written = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(hy_set["dit"]).items()}
    assert set(written) == set(dit.state_dict())
    assert {"double_blocks.0.img_attn_qkv.weight", "double_blocks.1.txt_attn_q_norm.weight",
            "single_blocks.0.linear1.weight", "single_blocks.1.modulation.linear.bias", "byt5_in.fc3.weight",
            "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight", "txt_in.c_embedder.linear_2.weight",
            "final_layer.adaLN_modulation.1.weight", "img_in.proj.weight", "time_in.mlp.2.weight"} <= set(written)
    vae_file = load_file(hy_set["vae"])
    assert {"encoder.down.0.block.0.conv1.weight", "encoder.down.0.downsample.conv.weight",
            "encoder.mid.attn_1.q.weight", "decoder.up.0.upsample.conv.weight", "decoder.mid.block_2.norm1.weight"
            } <= set(vae_file)
    vae = models.load_vae(hy_set["vae"], torch.float32)
    again = models.vae_diffusers_to_upstream(vae.state_dict(), 1)
    assert again.keys() == vae_file.keys() and all(torch.equal(again[k], vae_file[k]) for k in vae_file)

    from safetensors.torch import save_file

    # upstream's Qwen2.5-VL file: the language model, its vision tower and lm_head; often named .sft
    sft = tmp_path / "qwen.sft"
    save_file({**load_file(hy_set["text_encoder"]), "visual.blocks.0.attn.qkv.weight": torch.zeros(3, 2),
               "lm_head.weight": torch.zeros(4, 32)}, str(sft))
    c = models.load_components(hy_set["dit"], str(sft), hy_set["byt5"], hy_set["vae"],
                               dtype=torch.float32, vae_dtype=torch.float32,
                               tokenizer_cache_dir=hy_set["tokenizer_cache_dir"])
    prefix = models.QWEN_TEMPLATE.split("{}")[0]
    assert len(c.qwen_tokenizer(prefix).input_ids) == models.QWEN_DROP_TOKENS  # as Qwen's tokenizer splits it
    te = models.encode_prompts(c, ['a sign "Hi" and ‘OK’', "a red circle photo"])
    assert te["vlm_embed"].shape[:2] == te["vlm_mask"].shape and te["vlm_mask"].sum(1).tolist()[1] == 5
    assert te["ocr_mask"].tolist() == [True, False]
    assert te["byt5_embed"].shape == (2, models.BYT5_MAX_TOKENS, 32)
    assert te["byt5_mask"][1].sum() == 0 and te["byt5_mask"][0].sum() == len('Text "Hi". Text "OK". ') + 1
    assert models.glyph_text('say "a" then “b”') == 'Text "a". Text "b". '


def test_text_join_order_and_dit_runs():
    byt5 = torch.arange(4.).view(1, 4, 1).repeat(2, 1, 1)
    txt = 10 + torch.arange(3.).view(1, 3, 1).repeat(2, 1, 1)
    joined, mask = models.join_text(byt5, torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]).bool(), txt,
                                    torch.tensor([[1, 0, 0], [1, 1, 0]]).bool())
    # valid byT5 tokens, valid Qwen tokens, then the rest; trimmed to the longest valid length (3)
    assert joined[0, :, 0].tolist() == [0, 1, 10] and joined[1, :, 0].tolist() == [10, 11, 0]
    assert mask.tolist() == [[True, True, True], [True, True, False]]


def test_blocks_get_no_mask_when_every_token_is_valid_and_compile_whole(monkeypatch):
    """--split_attn read each sample's token count inside the blocks (a graph break in every compiled block, run72's
    method would time them eager); with nothing to mask the blocks get no mask, and the output is the same."""
    dit = models.tiny_dit(32, 32).eval()
    lat, t = torch.randn(1, 16, 2, 2), torch.tensor([500])
    text, byt5 = torch.randn(1, 3, 32), torch.randn(1, 4, 32)
    args = (lat, t, text, torch.ones(1, 3, dtype=torch.bool), byt5, torch.tensor([[1, 1, 0, 0]]).bool())
    seen, attention = [], models.attention
    monkeypatch.setattr(models, "attention", lambda q, k, v, mask, split=False: seen.append(mask) or attention(
        q, k, v, mask, split))
    dit.split_attn = True
    out = dit(*args)
    blocks = len(dit.double_blocks) + len(dit.single_blocks)
    assert len(seen) > blocks and all(m is None for m in seen[-blocks:])  # (the text refiner before them keeps its)
    dit.split_attn = False
    monkeypatch.setattr(models, "attention", lambda q, k, v, mask, split=False: attention(
        q, k, v, torch.ones(q.shape[:2], dtype=torch.bool), split))  # the all-true mask the blocks had before
    torch.testing.assert_close(dit(*args), out)
    monkeypatch.setattr(models, "attention", attention)
    x, vec = torch.randn(1, 7, 32), torch.randn(1, 32)
    explained = torch._dynamo.explain(dit.single_blocks[0])(x, vec, models.rope_2d(16, 2, 2), None, True, 4)
    assert explained.graph_break_count == 0
    explained = torch._dynamo.explain(dit.single_blocks[0])(x, vec, models.rope_2d(16, 2, 2),
                                                             torch.ones(1, 7, dtype=torch.bool), True, 4)
    assert explained.graph_break_count == 1  # what a padded batch with --split_attn still costs


def test_step_graph_auto_stays_off_as_the_text_is_trimmed_on_the_host(monkeypatch, caplog):
    import argparse
    import logging

    from library.compile import graphs
    from library.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = argparse.Namespace(cuda_graph_step="auto", compile=True, compile_mode="reduce-overhead",
                              compile_backend="inductor", optimizer_type="AdamW", optimizer_args=[],
                              gradient_accumulation_steps=1, cache_latents=True, cache_text_encoder_outputs=True,
                              mixed_precision="bf16", blocks_to_swap=None)
    dataset = argparse.Namespace(buckets={(1024, 1024): [0]})
    with caplog.at_level(logging.INFO, logger="library.compile.graphs"):
        graphs.resolve(args, [argparse.Namespace(datasets=[dataset])], 1, "hunyuan_image", ConfigError)
    assert graphs.cuda_graphs(args) == "blocks" and graphs.block_compile_mode(args) == "reduce-overhead"
    assert any("off; the step graph is left off for HunyuanImage 2.1" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_lora_keys_metadata_caches_and_sample(hy_set, hy_data, tmp_path):
    import numpy as np

    prompts = tmp_path / "prompts.txt"
    prompts.write_text('a sign "Hi" --w 64 --h 64 --s 3 --l 4 --n blurry --d 7 --fs 3\n')
    path = hunyuan_image_train_network.main([*model_argv(hy_set), *LORA, *train_argv(
        hy_data, tmp_path / "out", "lora", ["--train_batch_size", "2", "--cache_latents_to_disk",
                                            "--cache_text_encoder_outputs_to_disk", "--text_encoder_batch_size", "1",
                                            "--sample_prompts", str(prompts),
                                            "--sample_every_n_steps", "2", "--save_state"])])
    sd, md = read(path)
    dit = models.load_dit(hy_set["dit"], torch.float32)
    assert {k.split(".")[0] for k in sd} == upstream_lora_names(dit)
    assert sd["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"].shape == (96, 4)
    assert sd["lora_unet_single_blocks_1_linear1.lora_down.weight"].shape == (4, 32)
    assert md["ss_network_module"] == "networks.lora_hunyuan_image"
    assert md["ss_base_model_version"] == "hunyuan-image-2.1"
    assert md["modelspec.architecture"] == "hunyuan-image-2.1/lora"
    assert md["modelspec.implementation"] == "diffusers" and md["modelspec.prediction_type"] == "epsilon"
    assert md["ss_timestep_sampling"] == "sigma" and md["ss_discrete_flow_shift"] == "5.0"
    assert md["ss_model_prediction_type"] == "raw"
    latents = sorted(hy_data.rglob("*_0064x0064_hi.npz"))
    te = sorted(hy_data.rglob("*_hi_te.npz"))
    assert len(latents) == 2 and len(te) == 2
    with np.load(te[0]) as npz:
        assert {"vlm_embed", "vlm_mask", "byt5_embed", "byt5_mask", "ocr_mask"} <= set(npz.files)
        assert npz["byt5_embed"].shape == (128, 32) and npz["ocr_mask"].shape == ()
    lengths = set()
    for f in te:
        with np.load(f) as npz:
            lengths.add(npz["vlm_embed"].shape[0])
    assert len(lengths) == 2  # cached one at a time, each at its own length; a batch of both trained
    with np.load(latents[0]) as npz:
        assert npz["latents_2x2"].shape == (16, 2, 2)
    assert len(list((tmp_path / "out" / "sample").glob("lora_000002_00_*_7.png"))) == 1

    resumed = hunyuan_image_train_network.main([*model_argv(hy_set), *LORA, *train_argv(
        hy_data, tmp_path / "out", "lora", ["--train_batch_size", "2", "--cache_latents_to_disk",
                                            "--cache_text_encoder_outputs_to_disk", "--resume",
                                            str(tmp_path / "out" / "lora-state"), "--max_train_steps", "3",
                                            "--overwrite_output"])])
    again, _ = read(resumed)
    key = "lora_unet_single_blocks_0_linear2.lora_up.weight"
    assert again.keys() == sd.keys() and not torch.equal(again[key], sd[key])


@pytest.mark.parametrize("add, needle", [
    (["--attn_mode", "sageattn"], "--attn_mode sageattn: Sage Attention does not support training"),
    (["--timestep_sampling", "nextdit_shift"], "invalid choice"),
    (["--resolution", "80"], "multiples of 32"),
    (["--network_args", "split_qkv=maybe"], "split_qkv"),
    (["--byt5", __file__], "byT5 (--byt5): cannot read"),
])
def test_bad_settings_one_line_exit_2(hy_set, hy_data, tmp_path, capsys, add, needle):
    argv = [*model_argv(hy_set), *LORA, *train_argv(hy_data, tmp_path / "out", "bad"), *add]
    with pytest.raises(SystemExit) as e:
        hunyuan_image_train_network.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "out" / "bad.safetensors").exists()


def test_text_encoder_lora_is_refused_as_upstream(hy_set, hy_data, tmp_path, capsys):
    argv = [*model_argv(hy_set), *LORA[:-1], *train_argv(hy_data, tmp_path / "out", "bad")]
    with pytest.raises(SystemExit) as e:
        hunyuan_image_train_network.main(argv)
    assert e.value.code == 2 and "--network_train_unet_only is required" in capsys.readouterr().err


def test_projected_guidance_keeps_the_orthogonal_part():
    """After its first steps upstream's sampler guides with APG: uncond + 10 * (the part of cond - uncond that is
    orthogonal to cond), the difference's norm capped at 10, with momentum -0.5 over the steps."""
    g = hunyuan_image.ProjectedGuidance()
    cond, uncond = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    out = g(cond, uncond)
    assert torch.allclose(out, torch.tensor([[0.0, 1.0 - 10.0]]))  # diff (1, -1): parallel (1, 0) removed
    out2 = hunyuan_image.guided(0, cond, uncond, 2.0, False, hunyuan_image.ProjectedGuidance())
    assert torch.allclose(out2, uncond + 2.0 * (cond - uncond))  # plain CFG in the first steps


def print_command(tmp_path, values: dict) -> str:
    import subprocess
    import sys
    from pathlib import Path

    from kohya_gui import config_file, params as P

    path = tmp_path / "lora.toml"
    config_file.save(path, "lora", "HunyuanImage 2.1", {**P.defaults("lora", "HunyuanImage 2.1"), **values})
    out = subprocess.run([sys.executable, "-m", "kohya_gui", "print-command", "--standalone", str(path)],
                         cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_gui_print_command_names_the_hunyuan_image_script(tmp_path):
    """A config whose [gui] family is HunyuanImage 2.1 runs hunyuan_image_train_network.py with its model files,
    its LoRA module, upstream's flow-matching defaults for it and --network_train_unet_only (which it requires)."""
    out = print_command(tmp_path, {"pretrained_model_name_or_path": "/m/dit.safetensors", "text_encoder": "/m/q.sft",
                                   "byt5": "/m/b.sft", "vae": "/m/vae.sft", "train_data_dir": "/data",
                                   "output_dir": str(tmp_path / "out"), "output_name": "x", "attn_mode": "torch"})
    assert "sd-scripts/hunyuan_image_train_network.py" in out
    for flag in ("--text_encoder /m/q.sft", "--byt5 /m/b.sft", "--vae /m/vae.sft", "--attn_mode torch",
                 "--network_module networks.lora_hunyuan_image", "--network_train_unet_only",
                 "--discrete_flow_shift 5.0", "--model_prediction_type raw"):
        assert flag in out, flag
    from kohya_gui import params as P

    # an upstream run TOML without a [gui] table is recognised by its byT5 file or network module
    assert P.guess_family({"byt5": "/m/b.sft", "text_encoder": "/m/q.sft"}) == "HunyuanImage 2.1"
    assert P.guess_family({"network_module": "networks.lora_hunyuan_image"}) == "HunyuanImage 2.1"


@pytest.mark.slow
def test_gui_demo_preset_makes_a_tiny_hunyuan_image_and_trains(tmp_path, monkeypatch):
    """The HunyuanImage 2.1 demo preset: the demo helper makes its tiny model and images in cache/demo/, and the flags
    the GUI builds from the preset run hunyuan_image_train_network.py and train a LoRA with upstream's keys."""
    from kohya_gui import command, config_file, demo, presets

    monkeypatch.chdir(tmp_path)
    cfg = config_file.load(presets.preset_path("lora", "demo-hunyuan-image-tiny"))
    assert (cfg.tab, cfg.family) == ("lora", "HunyuanImage 2.1")
    assert command.script_path(cfg.tab, cfg.family).endswith("hunyuan_image_train_network.py")
    values = {**cfg.values, "max_train_steps": 2, "sample_every_n_steps": 2}
    made = demo.make_assets(cfg.family, values, log=lambda *_: None)
    assert str(tmp_path / "cache/demo/hunyuan_image/dit.safetensors") in {str(tmp_path / p) for p in made}
    assert not demo.missing_demo_paths(cfg.family, values)
    argv = command.trainer_args(cfg.tab, cfg.family, values)
    assert argv[argv.index("--discrete_flow_shift") + 1] == "5.0"  # HunyuanImage's own default, written by the GUI
    path = hunyuan_image_train_network.main(argv)
    sd, md = read(path)
    assert md["ss_base_model_version"] == "hunyuan-image-2.1" and "lora_unet_single_blocks_0_linear1.alpha" in sd
    assert list((tmp_path / "outputs/demo-hunyuan-image-tiny/sample").glob("demo-hunyuan-image-lora_000002_00_*.png"))


@pytest.mark.slow
def test_lora_block_swap_fp8_checkpointing_and_regional_compile(hy_set, hy_data, tmp_path):
    path = hunyuan_image_train_network.main([*model_argv(hy_set), *LORA, *train_argv(
        hy_data, tmp_path / "out", "c", ["--blocks_to_swap", "1", "--gradient_checkpointing", "--fp8_scaled",
                                         "--split_attn", "--compile", "--compile_backend", "aot_eager"])])
    sd, md = read(path)
    # 2 double + 2 single blocks compiled one by one; upstream's 1 -> 0 double + 2 single blocks swapped
    assert md["ss_fp8_base"] == "True" and md["ss_blocks_to_swap"] == "1" and md["ss_compile_blocks"] == "4"
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))


@pytest.mark.slow
def test_text_encoders_on_cpu_in_fp8_tiled_vae_and_validation(hy_set, hy_data, tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO)
    path = hunyuan_image_train_network.main([*model_argv(hy_set), *LORA, *train_argv(
        hy_data, tmp_path / "out", "v", ["--fp8_vl", "--text_encoder_cpu", "--vae_chunk_size", "16",
                                         "--no_half_vae", "--validation_split", "0.5",
                                         "--validate_every_n_steps", "1", "--attn_mode", "sdpa"])])
    sd, _ = read(path)
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))
    assert "fp8 base: 21 Linear layers of text encoder Qwen2_5_VLTextModel" in caplog.text  # 3 layers x 7 Linears
    assert "validation" in caplog.text.lower()


def test_split_qkv_trains_one_lora_per_part_and_saves_them_fused():
    """split_qkv (upstream's network arg): q, k, v (and a single block's MLP rows) of the fused layers get a LoRA
    each; the file holds them fused (upstream's layout: n*rank downs, a block-diagonal up), and a network made from
    that file gives the same outputs."""
    from networks import lora_hunyuan_image as net

    torch.manual_seed(0)
    dit = models.tiny_dit(text_dim=32, byt5_dim=32).eval()
    split = net.create_network(1.0, 2, 1.0, None, [], dit, split_qkv="True")
    split.apply_to([], dit, False, True)
    for p in split.parameters():
        torch.nn.init.normal_(p, std=0.1)
    inputs = (torch.randn(1, 16, 2, 2), torch.tensor([500]), torch.randn(1, 3, 32), torch.ones(1, 3),
              torch.randn(1, 4, 32), torch.tensor([[1, 1, 0, 0]]))
    with torch.no_grad():
        trained = dit(*inputs)
    sd = split.lora_state_dict()
    assert sd["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape == (6, 32)  # 3 parts x rank 2
    assert sd["lora_unet_single_blocks_0_linear1.lora_up.weight"].shape == (3 * 32 + 128, 8)  # q, k, v, MLP
    assert sd["lora_unet_single_blocks_0_linear2.lora_down.weight"].shape == (2, 32 + 128)  # not split
    up = sd["lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight"]
    assert torch.count_nonzero(up[:32, 2:]) == 0 and torch.count_nonzero(up[32:64, :2]) == 0  # block-diagonal
    fresh = models.tiny_dit(text_dim=32, byt5_dim=32).eval()
    fresh.load_state_dict(dit.state_dict())
    with torch.no_grad():
        assert not torch.allclose(fresh(*inputs), trained, atol=1e-3)  # the LoRA changes the output
    loaded, _ = net.create_network_from_weights(1.0, None, None, [], fresh, weights_sd=sd)
    loaded.apply_to([], fresh, False, True)
    loaded.load_state_dict(loaded._file_to_own(sd), strict=False)
    with torch.no_grad():
        assert torch.allclose(fresh(*inputs), trained, atol=1e-5)

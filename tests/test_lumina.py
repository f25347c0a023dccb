"""Lumina Image 2.0 (lumina_train_network.py / lumina_train.py) on a tiny random Lumina 2 built here (upstream's
single-file DiT with the `model.diffusion_model.` prefix, Gemma 2 and FLUX.1's AE as single files, a local
tokenizer, and a diffusers Lumina2Pipeline folder; CPU, 2 steps):
- the layouts load the same weights and the single file is written back in upstream's layout;
- LoRA: upstream's keys (lora_unet_layers_N_attention_qkv ..., lora_te_layers_N_self_attn_q_proj ...), metadata,
  a sample image with CFG truncation / renormalisation; then from the diffusers folder continuing that LoRA;
- full fine-tune: the saved upstream-layout single file reads back and differs from the base;
- upstream's semantics: the loss convention for every --model_prediction_type, the CFG renormalisation;
- bad settings: one line, exit 2.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import lumina_train
import lumina_train_network
from library import lumina_models
from library.families import lumina

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lumina_set(tmp_path_factory):
    return lumina_models.make_tiny_lumina(tmp_path_factory.mktemp("lumina_models"), prefix=True,
                                          diffusers_folder=True)


@pytest.fixture(scope="module")
def lumina_data(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("lumina_data"), n=2, size=(32, 32), repeats=1, name="demo")


def single_file_argv(paths):
    return ["--pretrained_model_name_or_path", paths["transformer"], "--gemma2", paths["gemma2"], "--ae", paths["ae"],
            "--tokenizer_cache_dir", paths["tokenizer_cache_dir"]]


def train_argv(data, out, name, extra=()):
    return ["--train_data_dir", str(data), "--output_dir", str(out), "--output_name", name, "--resolution", "32",
            "--max_train_steps", "2", "--learning_rate", "1e-3", "--gemma2_max_token_length", "16",
            "--max_data_loader_n_workers", "0", "--seed", "1", *extra]


LORA = ["--network_module", "networks.lora_lumina", "--network_dim", "4", "--network_alpha", "2"]


def read(path):
    with safe_open(str(path), "pt") as f:
        md = f.metadata() or {}
    return load_file(str(path)), md


def test_layouts_load_the_same_weights_and_save_upstreams_layout(lumina_set):
    single, norm_final = lumina_models.load_transformer(lumina_set["transformer"], torch.float32)
    folder, _ = lumina_models.load_transformer(lumina_set["diffusers"], torch.float32)
    a, b = single.state_dict(), folder.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    written = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(lumina_set["transformer"]).items()}
    again = lumina_models.diffusers_to_single_file(a)
    assert again.keys() == written.keys()
    assert all(torch.equal(again[k], written[k]) for k in written)
    assert {"layers.0.attention.qkv.weight", "final_layer.adaLN_modulation.1.weight", "norm_final.weight",
            "cap_embedder.1.weight", "context_refiner.0.attention_norm1.weight"} <= written.keys()


@pytest.mark.slow
def test_lora_keys_metadata_sample_then_diffusers_folder(lumina_set, lumina_data, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --l 4 --n blurry --ctr 1.0 --rcfg 1.0 --d 7\n")
    path = lumina_train_network.main([*single_file_argv(lumina_set), *LORA, *train_argv(
        lumina_data, tmp_path / "out", "lora", ["--sample_prompts", str(prompts), "--sample_every_n_steps", "2",
                                                "--system_prompt", "You are an assistant."])])
    sd, md = read(path)
    names = {k.split(".")[0] for k in sd}
    dit = {n for n in names if n.startswith("lora_unet_")}
    assert {"lora_unet_layers_0_attention_qkv", "lora_unet_layers_1_attention_out",
            "lora_unet_layers_0_feed_forward_w2", "lora_unet_layers_0_adaLN_modulation_1",
            "lora_unet_noise_refiner_0_attention_qkv", "lora_unet_context_refiner_0_feed_forward_w3",
            "lora_unet_final_layer_linear", "lora_unet_final_layer_adaLN_modulation_1"} <= dit
    # 2 layers + 1 noise refiner: 6 Linears each; 1 context refiner: 5 (no modulation); final layer: 2
    assert len(dit) == 3 * 6 + 5 + 2
    assert {"lora_te_layers_0_self_attn_q_proj", "lora_te_layers_1_mlp_down_proj"} <= names
    assert sd["lora_unet_layers_0_attention_qkv.lora_up.weight"].shape[0] == 48 + 2 * 24  # q + k + v rows
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))
    assert md["ss_base_model_version"] == "lumina2" and md["modelspec.architecture"] == "lumina-2/lora"
    assert md["modelspec.implementation"] == "https://github.com/Alpha-VLLM/Lumina-Image-2.0"
    assert md["ss_timestep_sampling"] == "shift" and md["ss_discrete_flow_shift"] == "6.0"
    assert md["ss_model_prediction_type"] == "raw" and md["ss_system_prompt"] == "You are an assistant."
    assert md["ss_network_module"] == "networks.lora_lumina"
    assert len(list((tmp_path / "out" / "sample").glob("lora_000002_00_*_7.png"))) == 1

    path2 = lumina_train_network.main([
        "--pretrained_model_name_or_path", lumina_set["diffusers"], *LORA, "--network_weights", str(path),
        *train_argv(lumina_data, tmp_path / "out2", "lora2"), "--unet_lr", "0", "--text_encoder_lr", "1e-3",
        "--timestep_sampling", "nextdit_shift"])
    sd2, _ = read(path2)
    for k, v in sd.items():  # --unet_lr 0: the loaded DiT LoRA comes back unchanged, Gemma 2's trains on
        if k.startswith("lora_unet_"):
            assert torch.equal(sd2[k], v), k
    assert any(not torch.equal(sd2[k], v) for k, v in sd.items() if k.startswith("lora_te_"))


@pytest.mark.slow
def test_full_fine_tune_saves_upstreams_single_file_that_reads_back(lumina_set, lumina_data, tmp_path):
    path = lumina_train.main([*single_file_argv(lumina_set), "--optimizer_type", "AdamW", "--blockwise_fused_optimizers",
                              *train_argv(lumina_data, tmp_path / "out", "full")])
    written, md = read(path)
    base = {k.removeprefix("model.diffusion_model."): v for k, v in load_file(lumina_set["transformer"]).items()}
    assert written.keys() == base.keys()  # upstream's layout, no prefix, norm_final kept
    assert not torch.equal(base["layers.0.attention.qkv.weight"], written["layers.0.attention.qkv.weight"])
    tuned, _ = lumina_models.load_transformer(path, torch.float32)
    assert torch.equal(lumina_models.diffusers_to_single_file(tuned.state_dict())["layers.0.attention.qkv.weight"],
                       written["layers.0.attention.qkv.weight"])
    assert md["modelspec.architecture"] == "lumina-2" and md["ss_base_model_version"] == "lumina2"


@pytest.mark.parametrize("kind", ["raw", "additive", "sigma_scaled"])
def test_loss_equals_upstreams_for_every_prediction_type(kind):
    """Upstream: loss of m(o) against latents - noise; ours: loss of m(p) against noise - latents."""
    from argparse import Namespace

    from library.objectives.flow_matching import apply_model_prediction_type

    g = torch.Generator().manual_seed(0)
    latents, noise, out = (torch.randn(2, 16, 4, 4, generator=g) for _ in range(3))
    sigmas = torch.tensor([0.3, 0.8])
    s = sigmas.view(-1, 1, 1, 1)
    noisy = (1 - s) * latents + s * noise
    args = Namespace(model_prediction_type=kind)
    upstream = {"raw": out, "additive": out + noisy, "sigma_scaled": out * -s + noisy}[kind]
    ours = apply_model_prediction_type(args, lumina.upstream_convention(args, out, noisy, sigmas), noisy, sigmas)
    assert torch.allclose((ours - (noise - latents)) ** 2, (upstream - (latents - noise)) ** 2, atol=1e-4)


def test_cfg_renormalisation_limits_the_guided_norm():
    cond = torch.ones(2, 4, 2, 2)
    uncond = torch.zeros(2, 4, 2, 2)
    limited = lumina.guided(cond, uncond, 4.0, 1.0)
    assert torch.allclose(limited, cond)  # 4x the conditional norm, scaled back to it
    assert torch.allclose(lumina.guided(cond, uncond, 4.0, 0.0), 4 * cond)  # renorm 0: no limit
    assert torch.allclose(lumina.guided(cond, uncond, 4.0, 8.0), 4 * cond)  # under the limit: unchanged


@pytest.mark.parametrize("add, needle", [
    (["--use_flash_attn"], "--use_flash_attn needs the flash-attn package"),
    (["--timestep_sampling", "nextdit"], "invalid choice"),
    (["--network_args", "train_blocks=double"], "train_blocks=double: allowed: all, transformer"),
])
def test_bad_settings_one_line_exit_2(lumina_set, lumina_data, tmp_path, capsys, add, needle):
    argv = [*single_file_argv(lumina_set), *LORA, *train_argv(lumina_data, tmp_path / "out", "bad"), *add]
    with pytest.raises(SystemExit) as e:
        lumina_train_network.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "out" / "bad.safetensors").exists()


@pytest.mark.slow
def test_lora_with_disk_caches_in_upstreams_files_and_validation(lumina_set, lumina_data, tmp_path, caplog):
    import logging

    import numpy as np

    caplog.set_level(logging.INFO)
    path = lumina_train_network.main([*single_file_argv(lumina_set), *LORA, *train_argv(
        lumina_data, tmp_path / "out", "cached", ["--cache_latents_to_disk", "--cache_text_encoder_outputs_to_disk",
                                                  "--network_train_unet_only", "--validation_split", "0.5",
                                                  "--validate_every_n_steps", "1", "--save_state"])])
    sd, _ = read(path)
    assert sd and not any(k.startswith("lora_te_") for k in sd)
    latents = sorted(lumina_data.rglob("*_lumina.npz"))
    te = sorted(lumina_data.rglob("*_lumina_te.npz"))
    assert latents and te
    with np.load(te[0]) as npz:  # upstream's keys and shapes: [L, D], L a multiple of 8
        assert npz["hidden_state"].shape == (16, 32) and npz["attention_mask"].shape == (16,)
        assert "input_ids" in npz
    with np.load(latents[0]) as npz:
        assert any(k.startswith("latents_") for k in npz.files)
    assert "validation" in caplog.text.lower()
    resumed = lumina_train_network.main([*single_file_argv(lumina_set), *LORA, *train_argv(
        lumina_data, tmp_path / "out", "cached", ["--network_train_unet_only", "--resume",
                                                  str(tmp_path / "out" / "cached-state"), "--max_train_steps", "3",
                                                  "--overwrite_output"])])
    assert not torch.equal(read(resumed)[0]["lora_unet_layers_0_attention_qkv.lora_up.weight"],
                           sd["lora_unet_layers_0_attention_qkv.lora_up.weight"])


def test_validate_only_loads_no_model(lumina_set, lumina_data, tmp_path, capsys):
    assert lumina_train_network.main([*single_file_argv(lumina_set), *LORA,
                                      *train_argv(lumina_data, tmp_path / "out", "v"), "--validate_only"]) is None
    assert "validate_only: ok (2 training images; no model loaded)" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gui_demo_preset_makes_a_tiny_lumina_and_trains(tmp_path, monkeypatch):
    """The Lumina 2 demo preset: the demo helper makes its tiny Lumina 2 and images in cache/demo/, and the flags the
    GUI builds from the preset run lumina_train_network.py and train a LoRA with upstream's keys."""
    from kohya_gui import command, config_file, demo, presets

    monkeypatch.chdir(tmp_path)
    cfg = config_file.load(presets.preset_path("lora", "demo-lumina-tiny"))
    assert (cfg.tab, cfg.family) == ("lora", "Lumina 2")
    assert command.script_path(cfg.tab, cfg.family).endswith("lumina_train_network.py")
    values = {**cfg.values, "max_train_steps": 2, "sample_every_n_steps": 2}
    made = demo.make_assets(cfg.family, values, log=lambda *_: None)
    assert str(tmp_path / "cache/demo/lumina/lumina.safetensors") in {str(tmp_path / p) for p in made}
    assert not demo.missing_demo_paths(cfg.family, values)
    argv = command.trainer_args(cfg.tab, cfg.family, values)
    assert argv[argv.index("--timestep_sampling") + 1] == "shift"  # Lumina's own default, written by the GUI
    path = lumina_train_network.main(argv)
    sd, md = read(path)
    assert md["ss_base_model_version"] == "lumina2" and "lora_unet_layers_0_attention_qkv.lora_up.weight" in sd
    assert list((tmp_path / "outputs/demo-lumina-tiny/sample").glob("demo-lumina-lora_000002_00_*.png"))


@pytest.mark.slow
def test_lora_block_swap_fp8_checkpointing_and_regional_compile(lumina_set, lumina_data, tmp_path):
    path = lumina_train_network.main([*single_file_argv(lumina_set), *LORA, *train_argv(
        lumina_data, tmp_path / "out", "c", ["--network_train_unet_only", "--blocks_to_swap", "1",
                                             "--gradient_checkpointing", "--fp8_base", "--compile",
                                             "--compile_backend", "aot_eager"])])
    sd, md = read(path)
    # 2 layers + 1 noise refiner + 1 context refiner: the Lumina2TransformerBlocks compiled one by one
    assert md["ss_fp8_base"] == "True" and md["ss_blocks_to_swap"] == "1" and md["ss_compile_blocks"] == "4"
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))


def test_gui_print_command_names_the_lumina_scripts(tmp_path):
    """`python -m kohya_gui print-command` on a config whose [gui] family is Lumina 2 runs lumina_train_network.py
    (LoRA) or lumina_train.py (DreamBooth / Fine-tune), with Lumina's fields and its own flow-matching defaults."""
    import subprocess
    import sys
    from pathlib import Path

    from kohya_gui import config_file, params as P

    repo = Path(__file__).resolve().parent.parent
    for tab, script in (("lora", "lumina_train_network.py"), ("dreambooth", "lumina_train.py"),
                        ("finetune", "lumina_train.py")):
        values = {**P.defaults(tab, "Lumina 2"), "pretrained_model_name_or_path": "/m/lumina.safetensors", "gemma2": "/m/g.sft",
                  "ae": "/m/ae.safetensors", "train_data_dir": "/data", "output_dir": str(tmp_path / "out"),
                  "output_name": "x", "system_prompt": "You are an assistant."}
        path = tmp_path / f"{tab}.toml"
        config_file.save(path, tab, "Lumina 2", values)
        out = subprocess.run([sys.executable, "-m", "kohya_gui", "print-command", "--standalone", str(path)],
                             cwd=repo, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert f"sd-scripts/{script}" in out.stdout and "--gemma2 /m/g.sft" in out.stdout
        assert "--timestep_sampling shift" in out.stdout and "--discrete_flow_shift 6.0" in out.stdout
        assert "--system_prompt 'You are an assistant.'" in out.stdout


def test_gui_picking_lumina_sets_its_flow_matching_defaults():
    """FLUX.1 and Lumina 2 share --timestep_sampling / --discrete_flow_shift / --model_prediction_type with other
    defaults: the form shows the tab's first family's, and picking Lumina 2 sets upstream's Lumina defaults."""
    from kohya_gui import params as P
    from kohya_gui.ui import actions as A

    names = [p.name for p in A.family_default_params("lora")]
    updates = dict(zip(names, A.family_value_updates("lora", "Lumina 2"), strict=True))
    assert updates["timestep_sampling"]["value"] == "shift" and updates["discrete_flow_shift"]["value"] == 6.0
    assert updates["model_prediction_type"]["value"] == "raw"
    assert P.defaults("lora", "FLUX.1")["timestep_sampling"] == "sigma"
    assert "nextdit_shift" in P.BY_NAME["timestep_sampling"].choices_for("lora", "Lumina 2")
    assert "nextdit_shift" not in P.BY_NAME["timestep_sampling"].choices_for("lora", "FLUX.1")

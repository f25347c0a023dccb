"""anima_train.py (upstream's full Anima fine-tune) on a tiny random Anima built here (CPU, a few steps):
- upstream's six parameter groups (base, self_attn, cross_attn, mlp, mod, llm_adapter), a part at rate 0 frozen;
- upstream's single file (`net.` + the DiT's keys, metadata format=pt, modelspec anima-preview) that our loader reads
  back, step saves under upstream's names, save_state and resume;
- block swap with gradient checkpointing and Adafactor's fused backward pass (the fine-tune of a big DiT on a small GPU);
- bad settings: one line, exit 2, before any model loads.
"""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import anima_train
from library import anima_models
from library.families import anima

pytestmark = pytest.mark.usefixtures("one_thread")


def argv(paths, data, out, name, extra=()):
    return ["--pretrained_model_name_or_path", paths["dit"], "--qwen3", paths["qwen3"], "--vae", paths["vae"],
            "--tokenizer_cache_dir", paths["tokenizer_cache_dir"], "--train_data_dir", str(data),
            "--output_dir", str(out), "--output_name", name, "--resolution", "32", "--max_train_steps", "2",
            "--learning_rate", "1e-3", "--qwen3_max_token_length", "16", "--t5_max_token_length", "16",
            "--max_data_loader_n_workers", "0", "--seed", "1", *extra]


def read(path):
    with safe_open(str(path), "pt") as f:
        md = f.metadata() or {}
    return load_file(str(path)), md


def test_parameter_parts_are_upstreams(anima_set):
    """Upstream's get_anima_param_groups: the LLM adapter first, then .self_attn / .cross_attn / .mlp /
    .adaln_modulation in the name, the rest base (the blocks' adaln_modulation_self_attn is modulation)."""
    dit = anima_models.load_dit(anima_set["dit"], torch.float32)
    parts = {name: anima.param_part(name) for name, _ in dit.named_parameters()}
    assert parts["llm_adapter.blocks.0.self_attn.q_proj.weight"] == "llm_adapter"
    assert parts["blocks.0.self_attn.q_proj.weight"] == "self_attn"
    assert parts["blocks.1.cross_attn.k_norm.weight"] == "cross_attn"
    assert parts["blocks.0.mlp.layer1.weight"] == "mlp"
    assert parts["blocks.0.adaln_modulation_self_attn.1.weight"] == "mod"
    assert parts["final_layer.adaln_modulation.1.weight"] == "mod"
    assert parts["t_embedder.1.linear_1.weight"] == "base" and parts["x_embedder.proj.1.weight"] == "base"
    assert set(parts.values()) == {"base", "self_attn", "cross_attn", "mlp", "mod", "llm_adapter"}


@pytest.mark.slow
def test_full_fine_tune_saves_upstreams_file_and_resumes(anima_set, anima_data, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    path = anima_train.main(argv(anima_set, anima_data, out, "full", [
        "--llm_adapter_lr", "0", "--mod_lr", "2e-3", "--save_every_n_steps", "1", "--save_state"]))
    assert path == str(out / "full.safetensors")
    written, md = read(path)
    base = load_file(anima_set["dit"])
    assert written.keys() == base.keys()  # upstream's layout: net. + the DiT's keys, the LLM adapter inside
    for k, v in base.items():
        if ".llm_adapter." in k or k.startswith("net.llm_adapter."):
            assert torch.equal(written[k], v), k  # --llm_adapter_lr 0: frozen
    for k in ("net.blocks.0.self_attn.q_proj.weight", "net.blocks.1.mlp.layer2.weight",
              "net.blocks.0.adaln_modulation_cross_attn.2.weight", "net.t_embedder.1.linear_1.weight"):
        assert not torch.equal(written[k], base[k]), k
    assert md["format"] == "pt" and md["modelspec.architecture"] == "anima-preview"
    assert md["modelspec.implementation"] == "https://huggingface.co/circlestone-labs/Anima"
    assert md["ss_base_model_version"] == "anima" and md["ss_steps"] == "2" and "ss_network_module" not in md
    assert md["ss_llm_adapter_lr"] == "0.0" and md["ss_mod_lr"] == "0.002" and "ss_self_attn_lr" not in md
    assert "mod: 14 tensors at learning rate 0.002" in caplog.text and "llm_adapter: learning rate 0" in caplog.text
    # a step save under upstream's name; the file reads back into the same weights
    assert (out / "full-step00000001.safetensors").is_file()
    again = anima_models.load_dit(path, torch.float32)
    assert torch.equal(again.blocks[0].self_attn.q_proj.weight, written["net.blocks.0.self_attn.q_proj.weight"])

    # resumed from the saved state, one more step: it starts at step 2 and the weights move on
    caplog.clear()
    resumed = anima_train.main(argv(anima_set, anima_data, out, "full", [
        "--llm_adapter_lr", "0", "--mod_lr", "2e-3", "--resume", str(out / "full-state"), "--max_train_steps", "3",
        "--overwrite_output"]))
    assert "resumed at step 2" in caplog.text
    after, md3 = read(resumed)
    assert md3["ss_steps"] == "3"
    assert not torch.equal(after["net.blocks.0.self_attn.q_proj.weight"], written["net.blocks.0.self_attn.q_proj.weight"])
    assert torch.equal(after["net.llm_adapter.embed.weight"], base["net.llm_adapter.embed.weight"])


@pytest.mark.slow
def test_block_swap_checkpointing_and_fused_backward_pass(anima_set, anima_data, tmp_path):
    path = anima_train.main(argv(anima_set, anima_data, tmp_path / "out", "swap", [
        "--blocks_to_swap", "1", "--gradient_checkpointing", "--optimizer_type", "Adafactor", "--fused_backward_pass",
        "--optimizer_args", "relative_step=False", "scale_parameter=False", "warmup_init=False"]))
    written, md = read(path)
    base = load_file(anima_set["dit"])
    assert md["ss_blocks_to_swap"] == "1" and md["ss_fused_backward_pass"] == "True"
    assert md["ss_gradient_checkpointing"] == "True"
    for k in ("net.blocks.0.self_attn.q_proj.weight", "net.blocks.1.self_attn.q_proj.weight"):  # resident, swapped
        assert not torch.equal(written[k], base[k]), k
    assert not torch.equal(written["net.llm_adapter.embed.weight"], base["net.llm_adapter.embed.weight"])


def test_validate_only_loads_no_model(anima_set, anima_data, tmp_path, capsys):
    assert anima_train.main([*argv(anima_set, anima_data, tmp_path / "out", "v"), "--validate_only"]) is None
    assert "validate_only: ok (2 training images; no model loaded)" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, needle", [
    (["--train_text_encoder"], "--train_text_encoder: anima_train.py trains the DiT only"),
    (["--self_attn_lr", "-1"], "--self_attn_lr must be 0 (frozen) or more"),
    (["--learning_rate", "0"], "every part of the DiT would be frozen"),
    (["--attn_mode", "sageattn"], "--attn_mode sageattn"),
    (["--v_parameterization"], "--v2 / --v_parameterization are for SD2.x; this script trains Anima"),
    (["--fused_backward_pass", "--optimizer_type", "Adafactor", "--mixed_precision", "fp16"], "--mixed_precision bf16"),
])
def test_bad_settings_stop_with_one_line(anima_set, anima_data, tmp_path, capsys, extra, needle):
    with pytest.raises(SystemExit) as e:
        anima_train.main([*argv(anima_set, anima_data, tmp_path / "out", "bad"), *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gui_demo_preset_fine_tunes_a_tiny_anima(tmp_path, monkeypatch):
    """The Fine-tune tab's Anima demo preset: the demo helper makes its tiny Anima and images in cache/demo/, and the
    flags the GUI builds from the preset run anima_train.py, which writes upstream's single file and a sample."""
    from kohya_gui import command, config_file, demo, presets

    monkeypatch.chdir(tmp_path)
    cfg = config_file.load(presets.preset_path("finetune", "demo-anima-tiny"))
    assert (cfg.tab, cfg.family) == ("finetune", "Anima")
    assert command.script_path(cfg.tab, cfg.family).endswith("anima_train.py")
    values = {**cfg.values, "max_train_steps": 2, "sample_every_n_steps": 2}
    demo.make_assets(cfg.family, values, log=lambda *_: None)
    assert not demo.missing_demo_paths(cfg.family, values)
    argv = command.trainer_args(cfg.tab, cfg.family, values)
    assert argv[argv.index("--llm_adapter_lr") + 1] == "0.0"
    path = anima_train.main(argv)
    written, md = read(path)
    base = load_file(str(tmp_path / "cache/demo/anima/anima.safetensors"))
    assert written.keys() == base.keys() and md["modelspec.architecture"] == "anima-preview"
    assert torch.equal(written["net.llm_adapter.embed.weight"], base["net.llm_adapter.embed.weight"])
    assert not torch.equal(written["net.blocks.0.mlp.layer1.weight"], base["net.blocks.0.mlp.layer1.weight"])
    assert list((tmp_path / "outputs/demo-anima-ft/sample").glob("demo-anima-ft_000002_00_*.png"))

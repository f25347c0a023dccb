"""Anima (anima_train_network.py) on a tiny random Anima built here (upstream's DiT file with the `net.` prefix,
Qwen3 as a single file and as a folder, the Qwen-Image VAE, local Qwen3 and T5 tokenizers; CPU, 2 steps):
- the DiT reads upstream's layout, with the LLM adapter inside or in its own file, and computes upstream's output;
- LoRA: upstream's module selection and keys (lora_unet_blocks_N_..., lora_te_layers_N_..., the LLM adapter's with
  train_llm_adapter), metadata, a sample image; disk caches in upstream's files; save_state and resume;
- the GUI's print-command names the script; bad settings: one line, exit 2.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import anima_train_network
from library import anima_models
from networks import lora_anima

pytestmark = pytest.mark.usefixtures("one_thread")


def model_argv(paths, qwen3="qwen3"):
    return ["--pretrained_model_name_or_path", paths["dit"], "--qwen3", paths[qwen3], "--vae", paths["vae"],
            "--tokenizer_cache_dir", paths["tokenizer_cache_dir"]]


def train_argv(data, out, name, extra=()):
    return ["--train_data_dir", str(data), "--output_dir", str(out), "--output_name", name, "--resolution", "32",
            "--max_train_steps", "2", "--learning_rate", "1e-3", "--qwen3_max_token_length", "16",
            "--t5_max_token_length", "16", "--max_data_loader_n_workers", "0", "--seed", "1", *extra]


LORA = ["--network_module", "networks.lora_anima", "--network_dim", "4", "--network_alpha", "2"]


def read(path):
    with safe_open(str(path), "pt") as f:
        md = f.metadata() or {}
    return load_file(str(path)), md


def reference_inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 1, 8, 6, generator=g)
    h = torch.randn(2, 10, 32, generator=g)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    ids = torch.randint(0, 124, (2, 12), generator=g)
    t5_mask = torch.ones(2, 12, dtype=torch.long)
    t5_mask[0, 5:] = 0
    return x, torch.tensor([0.2, 0.9]), h, mask, ids, t5_mask


def test_dit_computes_upstreams_output():
    """The values upstream's library/anima_models.Anima (with its LLMAdapter) gives for these weights and inputs,
    computed once with upstream's module (padding mask zeros, as its trainer passes)."""
    dit = anima_models.tiny_dit(64, 2, qwen_dim=32, vocab=124).eval()
    with torch.no_grad():
        out = dit(*reference_inputs())
    upstream = [-0.231271, -0.56266, 0.01904, 1.050199, 0.679878, -0.429654, -0.379596, -0.689162]
    assert torch.allclose(out.flatten()[::97][:8], torch.tensor(upstream), atol=2e-5)
    assert out.sum().item() == pytest.approx(-15.27216, abs=1e-3)
    assert out.abs().sum().item() == pytest.approx(649.7335, abs=1e-2)


def test_dit_reads_upstreams_layout_and_a_separate_adapter_file(anima_set, tmp_path):
    written = load_file(anima_set["dit"])
    assert {"net.x_embedder.proj.1.weight", "net.t_embedder.1.linear_1.weight", "net.t_embedding_norm.weight",
            "net.blocks.0.adaln_modulation_self_attn.2.weight", "net.blocks.1.cross_attn.k_norm.weight",
            "net.llm_adapter.embed.weight", "net.llm_adapter.blocks.0.cross_attn.o_proj.weight",
            "net.final_layer.adaln_modulation.2.weight"} <= written.keys()
    dit = anima_models.load_dit(anima_set["dit"], torch.float32)
    assert {"net." + k for k in dit.state_dict()} == written.keys()
    # the adapter in its own file (--llm_adapter_path) replaces the DiT file's
    adapter = {k.removeprefix("net.llm_adapter."): v + 1 for k, v in written.items() if "llm_adapter." in k}
    save_file(adapter, str(tmp_path / "adapter.safetensors"))
    save_file({k: v for k, v in written.items() if "llm_adapter." not in k}, str(tmp_path / "dit.safetensors"))
    split = anima_models.load_dit(str(tmp_path / "dit.safetensors"), torch.float32, str(tmp_path / "adapter.safetensors"))
    assert torch.equal(split.llm_adapter.embed.weight, written["net.llm_adapter.embed.weight"] + 1)
    with pytest.raises(anima_models.ModelLoadError, match="--llm_adapter_path"):
        anima_models.load_dit(str(tmp_path / "dit.safetensors"), torch.float32)


def test_lora_modules_and_keys_are_upstreams(anima_set):
    """Default: each block's attention and MLP Linears (modulation, norms, embedders, final layer excluded);
    train_llm_adapter adds the adapter blocks'; include/exclude patterns and reg dims match the module path."""
    dit = anima_models.load_dit(anima_set["dit"], torch.float32)
    qwen = anima_models.load_qwen3(anima_set["qwen3"], torch.float32)
    net = lora_anima.create_network(1.0, 4, 2, None, [qwen], dit)
    unet = {m.lora_name for m in net.unet_loras}
    per_block = ["self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_output_proj",
                 "cross_attn_q_proj", "cross_attn_k_proj", "cross_attn_v_proj", "cross_attn_output_proj",
                 "mlp_layer1", "mlp_layer2"]
    assert unet == {f"lora_unet_blocks_{i}_{n}" for i in range(2) for n in per_block}
    te = {m.lora_name for m in net.text_encoder_loras}
    assert len(te) == 2 * 7 and "lora_te_layers_1_mlp_gate_proj" in te and "lora_te_layers_0_self_attn_o_proj" in te

    net = lora_anima.create_network(1.0, 4, 2, None, [], dit, train_llm_adapter="true",
                                    include_patterns="['final_layer.linear']", exclude_patterns="['.*mlp.*']",
                                    network_reg_dims="blocks\\.1\\..*=8")
    names = {m.lora_name: m.lora_dim for m in net.unet_loras}
    assert "lora_unet_llm_adapter_blocks_0_cross_attn_k_proj" in names  # adapter MLP excluded by '.*mlp.*'
    assert "lora_unet_llm_adapter_blocks_0_mlp_0" not in names and "lora_unet_blocks_0_mlp_layer1" not in names
    assert "lora_unet_final_layer_linear" in names and "lora_unet_final_layer_adaln_modulation_1" not in names
    assert names["lora_unet_blocks_1_self_attn_q_proj"] == 8 and names["lora_unet_blocks_0_self_attn_q_proj"] == 4
    # parameter groups as upstream's: Qwen3's at the first text encoder lr, network_reg_lrs (full match of the
    # module path) before the rest of the DiT's
    grouped = lora_anima.create_network(1.0, 4, 2, None, [qwen], dit, network_reg_lrs="blocks\\.1\\..*=0.5")
    grouped.apply_to([qwen], dit)
    groups, descriptions = grouped.prepare_optimizer_params([1e-5, 2e-5], 1e-3, 1e-4)
    assert descriptions == ["textencoder 1", "unet reg_lr_0", "unet"]
    assert [g["lr"] for g in groups] == [1e-5, 0.5, 1e-3]
    assert len(groups[1]["params"]) == 10 * 2  # blocks.1's ten LoRA modules, down and up each
    grouped.remove_from()
    # a file's modules come back as they were, the adapter's included
    net.apply_to([], dit, apply_text_encoder=False, apply_unet=True)
    sd = net.lora_state_dict()
    assert "lora_unet_llm_adapter_blocks_0_self_attn_q_proj.lora_down.weight" in sd
    again, _ = lora_anima.create_network_from_weights(1.0, None, None, [], dit, weights_sd=sd)
    assert {m.lora_name: m.lora_dim for m in again.unet_loras} == names


@pytest.mark.slow
def test_lora_keys_metadata_sample_caches_and_resume(anima_set, anima_data, tmp_path, caplog):
    import logging

    import numpy as np

    caplog.set_level(logging.INFO)

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --l 4 --n blurry --fs 2.0 --d 7\n")
    path = anima_train_network.main([*model_argv(anima_set), *LORA, *train_argv(
        anima_data, tmp_path / "out", "lora", ["--sample_prompts", str(prompts), "--sample_every_n_steps", "2",
                                               "--weighting_scheme", "cosmap"])])
    sd, md = read(path)
    names = {k.split(".")[0] for k in sd}
    assert {"lora_unet_blocks_0_self_attn_q_proj", "lora_unet_blocks_1_mlp_layer2",
            "lora_te_layers_0_self_attn_q_proj"} <= names
    assert len([n for n in names if n.startswith("lora_unet_")]) == 20
    assert sd["lora_unet_blocks_0_cross_attn_k_proj.lora_down.weight"].shape == (4, 32)
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))
    assert md["ss_base_model_version"] == "anima" and md["modelspec.architecture"] == "anima-preview/lora"
    assert md["modelspec.implementation"] == "https://huggingface.co/circlestone-labs/Anima"
    assert md["ss_timestep_sampling"] == "sigmoid" and md["ss_discrete_flow_shift"] == "1.0"
    assert md["ss_weighting_scheme"] == "cosmap" and md["ss_network_module"] == "networks.lora_anima"
    assert "ss_model_prediction_type" not in md
    assert len(list((tmp_path / "out" / "sample").glob("lora_000002_00_*_7.png"))) == 1

    # DiT only, disk caches in upstream's files, the Qwen3 folder, a saved state, then resumed
    cached = anima_train_network.main([*model_argv(anima_set, "qwen3_folder"), *LORA, *train_argv(
        anima_data, tmp_path / "out2", "cached", ["--cache_latents_to_disk", "--cache_text_encoder_outputs_to_disk",
                                                   "--network_train_unet_only", "--save_state",
                                                   "--unsloth_offload_checkpointing", "--validation_split", "0.5",
                                                   "--validate_every_n_steps", "1"])])
    csd, cmd = read(cached)
    assert cmd["ss_gradient_checkpointing"] == "True"  # turned on by --unsloth_offload_checkpointing
    assert cmd["ss_validation_split"] == "0.5" and "validation" in caplog.text.lower()
    assert csd and not any(k.startswith("lora_te_") for k in csd)
    latents = sorted(anima_data.rglob("*_0032x0032_anima.npz"))
    te = sorted(anima_data.rglob("*_anima_te.npz"))
    assert len(latents) == 2 and len(te) == 2
    with np.load(te[0]) as npz:
        assert npz["prompt_embeds"].shape == (16, 32) and npz["attn_mask"].shape == (16,)
        assert npz["t5_input_ids"].dtype == np.int32 and npz["t5_attn_mask"].shape == (16,)
        assert "caption_dropout_rate" in npz
    with np.load(latents[0]) as npz:
        assert npz["latents_4x4"].shape == (16, 4, 4)
    resumed = anima_train_network.main([*model_argv(anima_set), *LORA, *train_argv(
        anima_data, tmp_path / "out2", "cached", ["--network_train_unet_only", "--resume",
                                                   str(tmp_path / "out2" / "cached-state"), "--max_train_steps", "3",
                                                   "--overwrite_output"])])
    key = "lora_unet_blocks_0_self_attn_q_proj.lora_up.weight"
    assert not torch.equal(read(resumed)[0][key], csd[key])


def test_validate_only_loads_no_model(anima_set, anima_data, tmp_path, capsys):
    assert anima_train_network.main([*model_argv(anima_set), *LORA,
                                     *train_argv(anima_data, tmp_path / "out", "v"), "--validate_only"]) is None
    assert "validate_only: ok (2 training images; no model loaded)" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, needle", [
    (["--attn_mode", "sageattn"], "--attn_mode sageattn"),
    (["--unsloth_offload_checkpointing", "--blocks_to_swap", "1"], "--unsloth_offload_checkpointing"),
    (["--resolution", "40"], "multiples of 16"),
    (["--network_args", "exclude_patterns=['(']"], "exclude_patterns"),
])
def test_bad_settings_stop_with_one_line(anima_set, anima_data, tmp_path, capsys, extra, needle):
    with pytest.raises(SystemExit) as e:
        anima_train_network.main([*model_argv(anima_set), *LORA, *train_argv(anima_data, tmp_path / "out", "bad"),
                                  *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_missing_qwen3_stops_with_one_line(anima_set, anima_data, tmp_path, capsys):
    argv = [a for a in model_argv(anima_set) if a not in ("--qwen3", anima_set["qwen3"])]
    with pytest.raises(SystemExit) as e:
        anima_train_network.main([*argv, *LORA, *train_argv(anima_data, tmp_path / "out", "bad")])
    assert e.value.code == 2 and "--qwen3 is required" in capsys.readouterr().err


def test_gui_shows_animas_model_inputs_only_for_anima():
    """The LoRA tab's Anima family: the Qwen3 file and VAE in Model, its own fields in "Anima options"; none of them for
    the other families, and none of theirs (AE, Gemma 2, CLIP-L, FLUX.1 guidance) for Anima."""
    from kohya_gui import params as P

    assert P.script_for("lora", "Anima") == "anima_train_network.py"
    assert P.script_for("dreambooth", "Anima") == P.script_for("finetune", "Anima") == "anima_train.py"
    assert "Anima" in P.tab_families("dreambooth") and "Anima" in P.tab_families("finetune")
    parts = {f"{p}_lr" for p in ("llm_adapter", "self_attn", "cross_attn", "mlp", "mod")}
    full = {p.name for p in P.params_for("finetune", "Anima")}
    assert parts | {"qwen3", "fused_backward_pass", "blocks_to_swap"} <= full
    assert not full & {"train_text_encoder", "learning_rate_te"}  # Qwen3 stays frozen (as upstream)
    assert not parts & {p.name for p in P.params_for("lora", "Anima")}  # the LoRA script ignores them (as upstream)
    anima = {p.name for p in P.params_for("lora", "Anima")}
    own = {"qwen3", "llm_adapter_path", "t5_tokenizer_path", "qwen3_max_token_length", "t5_max_token_length",
           "attn_mode", "split_attn", "unsloth_offload_checkpointing"}
    assert own | {"vae", "timestep_sampling", "discrete_flow_shift", "blocks_to_swap"} <= anima
    assert not anima & {"ae", "gemma2", "clip_l", "t5xxl", "guidance_scale", "model_prediction_type", "compile"}
    assert P.BY_NAME["qwen3"].accordion == "model" and P.BY_NAME["attn_mode"].accordion == "advanced"
    shared = {"attn_mode", "split_attn"}  # HunyuanImage 2.1's too
    for family in P.tab_families("lora"):
        if family != "Anima":
            theirs = {p.name for p in P.params_for("lora", family)}
            assert not (own - shared) & theirs and (shared <= theirs) == (family == "HunyuanImage 2.1"), family


def test_gui_print_command_names_the_anima_scripts(tmp_path):
    """`python -m kohya_gui print-command` on a config whose [gui] family is Anima runs anima_train_network.py (LoRA)
    or anima_train.py (DreamBooth / Fine-tune) with its model files and upstream's Anima defaults (sigmoid timesteps,
    flow shift 1.0); the full fine-tune's per-part learning rates go to anima_train.py."""
    import subprocess
    import sys
    from pathlib import Path

    from kohya_gui import config_file, params as P

    repo = Path(__file__).resolve().parent.parent
    for tab, script in (("lora", "anima_train_network.py"), ("dreambooth", "anima_train.py"),
                        ("finetune", "anima_train.py")):
        values = {**P.defaults(tab, "Anima"), "pretrained_model_name_or_path": "/m/anima.safetensors",
                  "qwen3": "/m/qwen3.safetensors", "vae": "/m/vae.safetensors", "train_data_dir": "/data",
                  "output_dir": str(tmp_path / "out"), "output_name": "x"}
        if tab != "lora":
            values.update({"self_attn_lr": 2e-5, "llm_adapter_lr": 0.0})
        path = tmp_path / f"{tab}.toml"
        config_file.save(path, tab, "Anima", values)
        out = subprocess.run([sys.executable, "-m", "kohya_gui", "print-command", "--standalone", str(path)],
                             cwd=repo, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert f"sd-scripts/{script}" in out.stdout and "--qwen3 /m/qwen3.safetensors" in out.stdout
        assert "--vae /m/vae.safetensors" in out.stdout
        assert "--timestep_sampling sigmoid" in out.stdout and "--discrete_flow_shift 1.0" in out.stdout
        if tab == "lora":
            assert "--network_module networks.lora_anima" in out.stdout
        else:
            assert "--network_module" not in out.stdout
            assert "--self_attn_lr 2e-05" in out.stdout and "--llm_adapter_lr 0.0" in out.stdout


@pytest.mark.slow
def test_lora_block_swap_checkpointing_and_regional_compile(anima_set, anima_data, tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO)
    path = anima_train_network.main([*model_argv(anima_set), *LORA, *train_argv(
        anima_data, tmp_path / "out", "c", ["--network_train_unet_only", "--blocks_to_swap", "1",
                                            "--gradient_checkpointing", "--compile", "--compile_backend", "aot_eager",
                                            "--fp8_base"])])
    sd, md = read(path)
    assert md["ss_blocks_to_swap"] == "1" and md["ss_compile_blocks"] == "2"  # the DiT's two Blocks
    assert md["ss_fp8_base"] == "False"  # not supported for Anima: off, as upstream
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))
    # the checkpoint inside the compiled blocks keeps their inputs, as upstream's (its memory)
    assert "--compile_checkpoint_keep auto: inputs (the only choice at upstream's memory or less: as SD3.5" in caplog.text


@pytest.mark.slow
def test_gui_demo_preset_makes_a_tiny_anima_and_trains(tmp_path, monkeypatch):
    """The Anima demo preset: the demo helper makes its tiny Anima and images in cache/demo/, and the flags the GUI
    builds from the preset run anima_train_network.py and train a LoRA with upstream's keys."""
    from kohya_gui import command, config_file, demo, presets

    monkeypatch.chdir(tmp_path)
    cfg = config_file.load(presets.preset_path("lora", "demo-anima-tiny"))
    assert (cfg.tab, cfg.family) == ("lora", "Anima")
    assert command.script_path(cfg.tab, cfg.family).endswith("anima_train_network.py")
    values = {**cfg.values, "max_train_steps": 2, "sample_every_n_steps": 2}
    made = demo.make_assets(cfg.family, values, log=lambda *_: None)
    assert str(tmp_path / "cache/demo/anima/anima.safetensors") in {str(tmp_path / p) for p in made}
    assert not demo.missing_demo_paths(cfg.family, values)
    argv = command.trainer_args(cfg.tab, cfg.family, values)
    assert argv[argv.index("--timestep_sampling") + 1] == "sigmoid"  # Anima's own default, written by the GUI
    path = anima_train_network.main(argv)
    sd, md = read(path)
    assert md["ss_base_model_version"] == "anima" and "lora_unet_blocks_0_self_attn_q_proj.lora_up.weight" in sd
    assert list((tmp_path / "outputs/demo-anima-tiny/sample").glob("demo-anima-lora_000002_00_*.png"))

"""SD3 / SD3.5 end to end on tiny random models built here (the SAI single file with and without the text encoders
inside, separate --clip_l/--clip_g/--t5xxl files, a diffusers StableDiffusion3Pipeline folder; CPU, 2 steps):
- the layouts load the same weights, and diffusers' own SAI converter agrees with ours;
- LoRA (sd3_train_network.py): upstream's keys and metadata, a sample image, and the same LoRA in diffusers'
  StableDiffusion3Pipeline (load_lora_weights) changes the transformer exactly as our network does;
- full fine-tune (sd3_train.py): upstream's layout (MMDiT + VAE in one file, a trained CLIP-L beside it) reads back;
- the objective and the text-encoder dropout follow upstream; bad input: one line, exit 2.
"""
from __future__ import annotations

import types

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import sd3_train
import sd3_train_network
from library import sd3_models
from library.families import sd3
from library.objectives import flow_matching

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sd3_set(tmp_path_factory):
    """SD3.5-medium-like (qk norm, attn2 in block 0), text encoders inside the single file, and a diffusers folder."""
    return sd3_models.make_tiny_sd3(tmp_path_factory.mktemp("sd3_models"), diffusers_folder=True)


@pytest.fixture(scope="module")
def sd3_data(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("sd3_data"), n=2, size=(32, 32), repeats=1, name="demo")


def train_argv(data, out, name, extra=()):
    return ["--train_data_dir", str(data), "--output_dir", str(out), "--output_name", name, "--resolution", "32",
            "--max_train_steps", "2", "--learning_rate", "1e-3", "--t5xxl_max_token_length", "16",
            "--max_data_loader_n_workers", "0", "--seed", "1", *extra]


LORA = ["--network_module", "networks.lora_sd3", "--network_dim", "4", "--network_alpha", "2"]


def read(path):
    with safe_open(str(path), "pt") as f:
        md = f.metadata() or {}
    return load_file(str(path)), md


def test_layouts_load_the_same_weights(sd3_set, tmp_path):
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    inside = sd3_models.load_sd3_components(sd3_set["transformer"], dtype=torch.float32,
                                            tokenizer_cache_dir=sd3_set["tokenizer_cache_dir"])
    folder = sd3_models.load_sd3_components(sd3_set["diffusers"], dtype=torch.float32)
    bare = sd3_models.make_tiny_sd3(tmp_path / "bare", text_encoders_inside=False)
    separate = sd3_models.load_sd3_components(bare["transformer"], bare["clip_l"], bare["clip_g"], bare["t5xxl"],
                                              dtype=torch.float32, tokenizer_cache_dir=bare["tokenizer_cache_dir"])
    for name in ("transformer", "clip_l", "clip_g", "t5xxl", "vae"):
        a, b, c = (getattr(x, name).state_dict() for x in (inside, folder, separate))
        assert a.keys() == b.keys() == c.keys(), name
        assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a), name
    assert inside.model_type == "5-medium"
    written = load_file(sd3_set["transformer"])
    theirs = convert_sd3_transformer_checkpoint_to_diffusers(
        {k: v for k, v in written.items() if k.startswith(sd3_models.MMDIT_PREFIX)})
    ours = inside.transformer.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert "text_encoders.clip_g.transformer.text_projection.weight" in written
    # without T5-XXL (upstream: optional): 77 zero tokens after CLIP's, as upstream and diffusers' pipeline
    separate.t5xxl = None
    te = sd3.encode_prompts(separate, ["a cat"], 16, False, False)
    context, pooled = sd3.conditioning(te, 64)
    assert context.shape == (1, 77 + 77, 64) and context[:, 77:].abs().sum() == 0 and pooled.shape == (1, 64)
    assert not any(k.startswith("text_encoders.") for k in load_file(bare["transformer"]))


@pytest.mark.slow
def test_lora_has_upstreams_keys_and_loads_in_diffusers_pipeline(sd3_set, sd3_data, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    from networks import lora_sd3

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --l 4 --n blurry --d 7\n")
    path = sd3_train_network.main([
        "--pretrained_model_name_or_path", sd3_set["transformer"], "--tokenizer_cache_dir",
        sd3_set["tokenizer_cache_dir"], *LORA, *train_argv(sd3_data, tmp_path / "out", "lora", [
            "--weighting_scheme", "logit_normal", "--clip_l_dropout_rate", "0.5", "--t5_dropout_rate", "0.5",
            "--pos_emb_random_crop_rate", "0.5", "--network_args", "emb_dims=[2,0,0,2,2,0]", "--compile", "--compile_backend", "aot_eager",
            "--sample_prompts", str(prompts), "--sample_every_n_steps", "2"])])
    sd, md = read(path)
    names = {k.split(".")[0] for k in sd}
    assert {"lora_unet_joint_blocks_0_x_block_attn_qkv", "lora_unet_joint_blocks_0_x_block_attn2_qkv",
            "lora_unet_joint_blocks_0_context_block_mlp_fc2", "lora_unet_joint_blocks_1_context_block_attn_qkv",
            "lora_unet_joint_blocks_1_x_block_adaLN_modulation_1",
            "lora_unet_joint_blocks_1_context_block_adaLN_modulation_1",  # diffusers holds it swapped
            "lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
            "lora_te2_text_model_encoder_layers_1_mlp_fc2"} <= names
    assert not any(n.startswith("lora_te3_") for n in names)  # T5-XXL only with train_t5xxl
    assert {"lora_unet_context_embedder", "lora_unet_y_embedder_mlp_0", "lora_unet_final_layer_adaLN_modulation_1"} \
        <= names and sd["lora_unet_context_embedder.lora_down.weight"].shape[0] == 2
    # the last joint block's context block is "pre only": its qkv, not its proj/MLP
    assert "lora_unet_joint_blocks_1_context_block_mlp_fc1" not in names
    assert md["modelspec.architecture"] == "stable-diffusion-3-5-medium/lora"
    assert md["ss_base_model_version"] == "5-medium" and md["ss_network_module"] == "networks.lora_sd3"
    assert md["ss_weighting_scheme"] == "logit_normal" and md["ss_clip_l_dropout_rate"] == "0.5"
    assert md["ss_compile_blocks"] == "2"  # regional compile of the joint blocks
    assert len(list((tmp_path / "out" / "sample").glob("lora_000002_00_*_7.png"))) == 1

    # diffusers' pipeline loads it (in its PEFT keys) and its transformer then computes what our network computes
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_set["diffusers"])
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(1, 16, 8, 8, generator=g), torch.tensor([500.0])
    ctx, pooled = torch.randn(1, 93, 64, generator=g), torch.randn(1, 64, generator=g)

    def run(model):
        with torch.no_grad():
            return model(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled, timestep=t,
                         return_dict=False)[0]

    base = run(pipe.transformer)
    pipe.load_lora_weights(lora_sd3.to_diffusers(sd))
    assert {"transformer", "text_encoder", "text_encoder_2"} <= set(pipe.get_list_adapters())
    theirs = run(pipe.transformer)
    ours_model = sd3_models.load_sd3_components(sd3_set["diffusers"], dtype=torch.float32).transformer
    network, _ = lora_sd3.create_network_from_weights(1.0, None, None, [], ours_model, weights_sd=sd)
    network.apply_to([], ours_model, False, True)
    network.load_state_dict({k: v for k, v in sd.items() if k.startswith("lora_unet_")}, strict=False)
    ours = run(ours_model)
    assert not torch.allclose(base, ours, atol=1e-4)
    assert torch.allclose(theirs, ours, atol=1e-4)


@pytest.mark.slow
def test_full_fine_tune_saves_upstreams_layout_that_reads_back(sd3_set, sd3_data, tmp_path):
    path = sd3_train.main(["--pretrained_model_name_or_path", sd3_set["diffusers"], "--train_text_encoder",
                           "--learning_rate_te2", "0", "--num_last_block_to_freeze", "1", "--weighting_scheme",
                           "cosmap", *train_argv(sd3_data, tmp_path / "out", "full")])
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == ["full.safetensors",
                                                                              "full_clip_l.safetensors"]
    sd, md = read(path)
    assert {k.split(".")[0] for k in sd} == {"model", "first_stage_model"}
    assert md["modelspec.architecture"] == "stable-diffusion-3-5-medium"
    assert md["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
    back = sd3_models.load_sd3_components(path, clip_l=str(tmp_path / "out" / "full_clip_l.safetensors"),
                                          clip_g=sd3_set["clip_g"], t5xxl=sd3_set["t5xxl"], dtype=torch.float32,
                                          tokenizer_cache_dir=sd3_set["tokenizer_cache_dir"])
    base = sd3_models.load_sd3_components(sd3_set["diffusers"], dtype=torch.float32)
    b, n = base.transformer.state_dict(), back.transformer.state_dict()
    assert not torch.equal(b["transformer_blocks.0.attn.to_q.weight"], n["transformer_blocks.0.attn.to_q.weight"])
    assert all(torch.equal(b[k], n[k]) for k in b if k.startswith("transformer_blocks.1."))  # frozen last block
    assert not torch.equal(base.clip_l.state_dict()["text_projection.weight"],
                           back.clip_l.state_dict()["text_projection.weight"])


def test_objective_follows_upstream():
    """t = density shifted by --training_shift in [min, max) timesteps; target = latents; pred = -sigma * out +
    noisy; sigma_sqrt weights sigma^-2."""
    args = types.SimpleNamespace(weighting_scheme="sigma_sqrt", logit_mean=0.0, logit_std=1.0, mode_scale=1.29,
                                 training_shift=3.0, min_timestep=100, max_timestep=900, loss_type="l2")
    latents = torch.randn(4, 16, 4, 4)
    seen = {}

    def predict(noisy, t):
        seen["noisy"], seen["t"] = noisy, t
        return torch.zeros_like(noisy)

    pred, target, t, weighting = flow_matching.SD3FlowMatching().noisy_input_pred_target(
        args, None, latents, predict, torch.Generator().manual_seed(0))
    assert torch.equal(target, latents) and torch.equal(pred, seen["noisy"])
    assert ((t >= 100) & (t < 900)).all() and torch.equal(t, t.floor())
    assert torch.allclose(weighting.flatten(), (t / 1000) ** -2.0)
    g = torch.Generator().manual_seed(1)
    u = torch.rand(4, generator=g)
    assert torch.equal(flow_matching.sd3_timesteps(types.SimpleNamespace(**{**vars(args), "weighting_scheme": "none"}),
                                                   4, "cpu", torch.Generator().manual_seed(1)),
                       ((u * 3 / (1 + 2 * u)) * 800 + 100).long().float())


def test_text_encoder_dropout_zeroes_each_encoders_part_without_touching_the_cache(monkeypatch):
    te = {"lg_out": torch.ones(2, 3, 5), "lg_pooled": torch.ones(2, 4), "t5_out": torch.ones(2, 6, 7),
          "l_attn_mask": torch.ones(2, 3), "g_attn_mask": torch.ones(2, 3), "t5_attn_mask": torch.ones(2, 6)}
    draws = iter([0.1, 0.9, 0.9, 0.9, 0.1, 0.1])  # sample 0 drops CLIP-L; sample 1 drops CLIP-G and T5
    monkeypatch.setattr(sd3.random, "random", lambda: next(draws))
    args = types.SimpleNamespace(clip_l_dropout_rate=0.5, clip_g_dropout_rate=0.5, t5_dropout_rate=0.5)
    out = sd3.drop_outputs(args, te, l_width=2, l_pooled_width=1)
    assert out["lg_out"][0, :, :2].abs().sum() == 0 and out["lg_out"][0, :, 2:].eq(1).all()
    assert out["lg_out"][1, :, :2].eq(1).all() and out["lg_out"][1, :, 2:].abs().sum() == 0
    assert out["lg_pooled"].tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    assert out["t5_out"][0].eq(1).all() and out["t5_out"][1].abs().sum() == 0
    assert out["l_attn_mask"][0].sum() == 0 and out["g_attn_mask"][1].sum() == 0 and out["t5_attn_mask"][1].sum() == 0
    assert all(v.eq(1).all() for v in te.values())  # the cached batch is unchanged


@pytest.mark.parametrize("argv, needle", [
    (["--clip_l_dropout_rate", "2"], "--clip_l_dropout_rate must be between 0 and 1"),
    (["--weighting_scheme", "lognormal"], "invalid choice"),
    (["--network_args", "emb_dims=[0,0,4,0,0,0]"], "x_embedder"),
])
def test_bad_settings_one_line_exit_2(sd3_set, sd3_data, tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        sd3_train_network.main(["--pretrained_model_name_or_path", sd3_set["transformer"], "--tokenizer_cache_dir",
                                sd3_set["tokenizer_cache_dir"], *LORA,
                                *train_argv(sd3_data, tmp_path / "out", "bad"), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "out" / "bad.safetensors").exists()


def test_checkpoint_without_text_encoders_needs_the_clip_files(sd3_data, tmp_path, capsys):
    bare = sd3_models.make_tiny_sd3(tmp_path / "bare", text_encoders_inside=False)
    with pytest.raises(SystemExit) as e:
        sd3_train_network.main(["--pretrained_model_name_or_path", bare["transformer"], "--tokenizer_cache_dir",
                                bare["tokenizer_cache_dir"], "--clip_l", bare["clip_l"], *LORA,
                                *train_argv(sd3_data, tmp_path / "out", "x")])
    assert e.value.code == 2
    assert "--clip_g required" in capsys.readouterr().err


def test_gui_sd3_family_names_the_sd3_scripts_and_imports_kohya_ss_sd3_presets(tmp_path):
    """`python -m kohya_gui print-command` on a config whose [gui] family is SD3 runs sd3_train_network.py with
    networks.lora_sd3; the DreamBooth/Fine-tune tabs run sd3_train.py; kohya_ss' SD3 presets import as SD3."""
    import shlex
    import subprocess
    import sys

    from kohya_gui import REPO, config_file, importer
    from kohya_gui import params as P

    cfg = config_file.save(tmp_path / "sd3.toml", "lora", "SD3", {
        **P.defaults("lora"), "pretrained_model_name_or_path": "sd3.5_medium.safetensors", "clip_g": "clip_g.sft",
        "train_data_dir": "data", "output_dir": str(tmp_path / "out"), "output_name": "x"})
    out = subprocess.run([sys.executable, "-m", "kohya_gui", "print-command", "--standalone", str(cfg)],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout)
    assert argv[argv.index("--network_module") + 1] == "networks.lora_sd3"
    assert any(a.endswith("sd3_train_network.py") for a in argv) and argv[argv.index("--clip_g") + 1] == "clip_g.sft"
    assert {P.script_for(tab, "SD3") for tab in ("dreambooth", "finetune")} == {"sd3_train.py"}
    preset = REPO.parent / "shared" / "parity" / "kohya_ss-presets" / "dreambooth" / "sd3_bdsqlsz_v1.json"
    if preset.is_file():
        imp = importer.load(preset)
        assert (imp.tab, imp.family) == ("dreambooth", "SD3")
        assert imp.values["weighting_scheme"] == "logit_normal" and imp.values["clip_g"].endswith("clip_g.safetensors")
        assert imp.values["cache_text_encoder_outputs"] is True


@pytest.mark.slow
def test_gui_built_flags_train_an_sd3_lora(sd3_set, sd3_data, tmp_path):
    from kohya_gui import command
    from kohya_gui import params as P

    values = {**P.defaults("lora"), "pretrained_model_name_or_path": sd3_set["diffusers"],
              "train_data_dir": str(sd3_data), "output_dir": str(tmp_path / "out"), "output_name": "gui",
              "resolution": "32", "max_train_steps": 1, "network_dim": 4, "t5xxl_max_token_length": 16,
              "max_data_loader_n_workers": 0, "cache_latents_to_disk": True,
              "cache_text_encoder_outputs_to_disk": True, "network_train_unet_only": True}
    path = sd3_train_network.main(command.trainer_args("lora", "SD3", values))
    sd, md = read(path)
    assert md["ss_network_module"] == "networks.lora_sd3" and "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight" in sd
    assert len(list(sd3_data.rglob("*_sd3_te.npz"))) == 2 and len(list(sd3_data.rglob("*_sd3.npz"))) == 2


def test_validate_only_names_a_missing_clip_g_and_passes_a_good_run(sd3_set, sd3_data, tmp_path, capsys):
    base = ["--pretrained_model_name_or_path", sd3_set["transformer"], "--tokenizer_cache_dir",
            sd3_set["tokenizer_cache_dir"], *LORA, *train_argv(sd3_data, tmp_path / "out", "v"), "--validate_only"]
    with pytest.raises(SystemExit) as e:
        sd3_train_network.main([*base, "--clip_g", str(tmp_path / "missing_clip_g.safetensors")])
    assert e.value.code == 2 and "--clip_g" in capsys.readouterr().err
    assert sd3_train_network.main(base) is None
    assert not (tmp_path / "out" / "v.safetensors").exists()


@pytest.mark.slow
def test_block_swap_fp8_checkpointing_validation_and_resume(sd3_set, sd3_data, tmp_path):
    """What the other families have carries over: block swap, fp8 base, gradient checkpointing, validation, a saved
    state, and --resume continuing from it."""
    common = ["--pretrained_model_name_or_path", sd3_set["diffusers"], *LORA, "--blocks_to_swap", "1", "--fp8_base",
              "--gradient_checkpointing", "--validation_split", "0.5", "--validate_every_n_steps", "1",
              "--save_state", "--save_every_n_steps", "1"]
    sd3_train_network.main([*common, *train_argv(sd3_data, tmp_path / "out", "r", ["--max_train_steps", "1"])])
    state = tmp_path / "out" / "r-step00000001-state"
    assert state.is_dir()
    path = sd3_train_network.main([*common, *train_argv(sd3_data, tmp_path / "out", "r", ["--max_train_steps", "2"]),
                                   "--resume", str(state), "--overwrite_output"])
    sd, md = read(path)
    assert md["ss_blocks_to_swap"] == "1" and md["ss_fp8_base"] == "True" and md["ss_steps"] == "2"
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))


@pytest.mark.slow
def test_gui_demo_preset_makes_a_tiny_sd3_and_trains(tmp_path, monkeypatch):
    """The SD3 demo preset: the demo helper makes its tiny SD3 (text encoders inside the single file) and images in
    cache/demo/, and the flags the GUI builds from the preset train an SD3 LoRA with a sample."""
    from kohya_gui import command, config_file, demo, presets

    monkeypatch.chdir(tmp_path)
    cfg = config_file.load(presets.preset_path("lora", "demo-sd3-tiny"))
    assert (cfg.tab, cfg.family) == ("lora", "SD3")
    values = {**cfg.values, "max_train_steps": 2, "sample_every_n_steps": 2}
    made = demo.make_assets(cfg.family, values, log=lambda *_: None)
    assert str(tmp_path / "cache/demo/sd3/sd3.safetensors") in {str(tmp_path / p) for p in made}
    assert not demo.missing_demo_paths(cfg.family, values)
    path = sd3_train_network.main(command.trainer_args(cfg.tab, cfg.family, values))
    sd, md = read(path)
    assert md["modelspec.architecture"] == "stable-diffusion-3-5-medium/lora"
    assert "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_up.weight" in sd
    assert list((tmp_path / "outputs/demo-sd3-tiny/sample").glob("demo-sd3-lora_000002_00_*.png"))


def test_lora_optimizer_groups_take_upstreams_three_text_encoder_rates(sd3_set):
    from networks import lora_sd3

    c = sd3_models.load_sd3_components(sd3_set["diffusers"], dtype=torch.float32)
    net = lora_sd3.create_network(1.0, 4, 1.0, c.vae, [c.clip_l, c.clip_g, c.t5xxl], c.transformer,
                                  train_t5xxl="True", loraplus_lr_ratio="4")
    groups, labels = net.prepare_optimizer_params_with_multiple_te_lrs([1e-5, 2e-5], 3e-4, 1e-3)
    lrs = {label: g["lr"] for g, label in zip(groups, labels)}
    assert lrs == {"textencoder 1": 1e-5, "textencoder 1 plus": 4e-5, "textencoder 2": 2e-5,
                   "textencoder 2 plus": 8e-5, "textencoder 3": 2e-5, "textencoder 3 plus": 8e-5, "unet": 3e-4,
                   "unet plus": 1.2e-3}
    assert any(m.lora_name.startswith("lora_te3_encoder_block_0_layer_0_SelfAttention_q") for m in net.text_encoder_loras)


def test_pos_emb_random_crop_in_training_steps_only():
    model = sd3_models.tiny_transformer()
    centred = model.pos_embed.cropped_pos_embed(8, 8)
    sd3.set_pos_embed(model, 1.0)
    torch.manual_seed(0)
    with torch.no_grad():
        assert torch.equal(model.pos_embed.cropped_pos_embed(8, 8), centred)  # sampling / validation: centred
    crops = [model.pos_embed.cropped_pos_embed(8, 8) for _ in range(4)]
    assert crops[0].shape == centred.shape and any(not torch.equal(c, centred) for c in crops)


def upstream_scaled_table(dim, patched_size):
    """upstream's get_scaled_2d_sincos_pos_embed(dim, int(1.5 * size), sample_size=size, base_size=16), in numpy."""
    import numpy as np

    n = int(patched_size * 1.5)
    g = np.arange(n, dtype=np.float32) / n
    scale = 16 * n / patched_size
    g = g * scale - scale * (n - patched_size) / (2 * n)
    grid = np.stack(np.meshgrid(g, g), axis=0).reshape(2, 1, n, n)

    def one_d(d, pos):
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    return torch.from_numpy(np.concatenate([one_d(dim // 2, grid[0]), one_d(dim // 2, grid[1])], axis=1)).float()


def centre(table, side, h, w):
    top, left = (side - h) // 2, (side - w) // 2
    return table.reshape(side, side, -1)[top:top + h, left:left + w].reshape(h * w, -1)


def test_scaled_pos_embed_picks_upstreams_table_by_area():
    """Training sides 4 and 8 patches: tables of 6 and 12; areas up to (16 + 64) // 2 = 40 take side 4's, up to
    12 * 12 side 8's; a latent wider than its table gets a new table for its longer side."""
    model = sd3_models.tiny_transformer()
    scaled = sd3.ScaledPosEmbeds(64, [8, 4, 4])
    sd3.set_pos_embed(model, 0.0, scaled)
    assert scaled.bands == [(40, 4), (144, 8)]
    for (h, w), size in [((4, 4), 4), ((6, 6), 4), ((5, 6), 4), ((7, 6), 8), ((8, 8), 8), ((12, 12), 8)]:
        side = int(size * 1.5)
        want = centre(upstream_scaled_table(64, size), side, h, w)
        got = model.pos_embed.cropped_pos_embed(2 * h, 2 * w)[0]  # latent pixels: patch size 2
        assert torch.allclose(got, want, atol=1e-5), (h, w)
    got = model.pos_embed.cropped_pos_embed(2 * 2, 2 * 14)[0]  # 2 x 14 patches: wider than side 4's table
    assert torch.allclose(got, centre(upstream_scaled_table(64, 14), 21, 2, 14), atol=1e-5)
    assert (21 * 21, 14) in scaled.bands
    # and the model's forward adds that table
    x = torch.randn(1, 16, 8, 8)
    patch = model.pos_embed
    with torch.no_grad():
        want = patch.proj(x).flatten(2).transpose(1, 2) + centre(upstream_scaled_table(64, 4), 6, 4, 4)
        assert torch.allclose(patch(x), want, atol=1e-5)


@pytest.mark.slow
def test_enable_scaled_pos_embed_trains_with_each_datasets_table(sd3_set, sd3_data, tmp_path, monkeypatch):
    """Two datasets at 32 and 64 px: latent sides 4 and 8, 2 and 4 patches; each step's latent takes the table
    upstream's formula gives for its dataset's resolution."""
    used = []
    table_for = sd3.ScaledPosEmbeds.table_for

    def spy(self, h, w, device):
        table, side = table_for(self, h, w, device)
        used.append((h, w, side, table.clone()))
        return table, side

    monkeypatch.setattr(sd3.ScaledPosEmbeds, "table_for", spy)
    image_dir = next(sd3_data.iterdir())
    config = tmp_path / "data.toml"
    config.write_text("[general]\ncaption_extension = \".txt\"\n" + "".join(
        f"[[datasets]]\nresolution = {r}\nbatch_size = 2\n[[datasets.subsets]]\nimage_dir = '{image_dir}'\n"
        for r in (32, 64)))
    argv = [a for a in train_argv(sd3_data, tmp_path / "out", "scaled") if a not in ("--train_data_dir", str(sd3_data),
                                                                                  "--resolution", "32")]
    sd3_train_network.main(["--pretrained_model_name_or_path", sd3_set["transformer"], "--tokenizer_cache_dir",
                            sd3_set["tokenizer_cache_dir"], *LORA, *argv, "--dataset_config", str(config),
                            "--enable_scaled_pos_embed"])
    assert (tmp_path / "out" / "scaled.safetensors").is_file()
    assert {(h, w, side) for h, w, side, _ in used} == {(2, 2, 3), (4, 4, 6)}
    for h, _, side, table in used:
        assert torch.allclose(table[0], upstream_scaled_table(64, h), atol=1e-5)


@pytest.mark.slow
def test_use_t5xxl_cache_only_reads_t5_once_then_trains_from_its_cache(tmp_path, monkeypatch, capsys):
    """sd3_train.py --use_t5xxl_cache_only: the first run reads T5-XXL to cache its outputs (then frees it) and trains
    CLIP-L live; once the cache is on disk T5-XXL is never read (its file may be gone) and each step's T5 part is
    the cached one; without a cache nor T5-XXL: one line, exit 2."""
    from library.tiny_models import make_captioned_images

    import numpy as np

    bare = sd3_models.make_tiny_sd3(tmp_path / "models", text_encoders_inside=False)
    data = make_captioned_images(tmp_path / "data", n=2, size=(32, 32), repeats=1, name="demo")
    model = ["--pretrained_model_name_or_path", bare["transformer"], "--tokenizer_cache_dir",
             bare["tokenizer_cache_dir"], "--clip_l", bare["clip_l"], "--clip_g", bare["clip_g"], "--t5xxl",
             bare["t5xxl"], "--use_t5xxl_cache_only", "--cache_text_encoder_outputs_to_disk"]
    reads = []
    load_t5xxl = sd3_models.load_t5xxl
    monkeypatch.setattr(sd3_models, "load_t5xxl", lambda *a, **k: reads.append(a) or load_t5xxl(*a, **k))
    sd3_train.main([*model, "--train_text_encoder", "--learning_rate_te2", "0",
                    *train_argv(data, tmp_path / "out", "first")])
    assert len(reads) == 1 and (tmp_path / "out" / "first_clip_l.safetensors").is_file()
    caches = sorted(data.glob("*/*_sd3_te.npz"))
    assert len(caches) == 2

    import os

    os.remove(bare["t5xxl"])
    cached_t5 = [torch.from_numpy(np.load(p)["t5_out"]) for p in caches]
    seen = []
    conditioning = sd3.conditioning
    monkeypatch.setattr(sd3, "conditioning", lambda te, dim: seen.append(te["t5_out"].detach().clone())
                        or conditioning(te, dim))
    sd3_train.main([*model, *train_argv(data, tmp_path / "out", "second")])
    assert len(reads) == 1 and (tmp_path / "out" / "second.safetensors").is_file()
    assert len(seen) == 2 and all(any(torch.allclose(row, c) for c in cached_t5) for t in seen for row in t)

    other = make_captioned_images(tmp_path / "other", n=1, size=(32, 32), repeats=1, name="new")
    with pytest.raises(SystemExit) as e:
        sd3_train.main([*model, *train_argv(other, tmp_path / "out", "third")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--use_t5xxl_cache_only" in err and "file not found" in err and "Traceback" not in err
    assert not (tmp_path / "out" / "third.safetensors").exists()


def test_use_t5xxl_cache_only_with_train_t5xxl_is_one_line_exit_2(sd3_set, sd3_data, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sd3_train.main(["--pretrained_model_name_or_path", sd3_set["transformer"], "--use_t5xxl_cache_only",
                        "--train_text_encoder", "--train_t5xxl", *train_argv(sd3_data, tmp_path / "out", "bad")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--train_t5xxl cannot be used with --use_t5xxl_cache_only" in err and "Traceback" not in err


def _saved_bytes_of_compiled_block(keep: str, tokens: tuple[int, int], dim: int = 64, heads: int = 2) -> int:
    """Bytes one SD3 joint block compiled with --compile_checkpoint_keep `keep` (inductor's partitioner, no code
    generation) saves for backward beyond its weights and inputs, with frozen weights as under a LoRA."""
    from diffusers.models.attention import JointTransformerBlock

    from library.compile.checkpoint import CHECKPOINT_CONTEXTS, _checkpointed_forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = JointTransformerBlock(dim=dim, num_attention_heads=heads, attention_head_dim=dim // heads,
                                  context_pre_only=False, qk_norm="rms_norm").requires_grad_(False)
    block._ckpt_rng, block._ckpt_context = False, CHECKPOINT_CONTEXTS[keep]
    block._forward_inside_checkpoint = block.forward
    block.forward = types.MethodType(_checkpointed_forward, block)
    block.compile(backend="aot_eager_decomp_partition")
    inputs = [torch.randn(1, tokens[0], dim, requires_grad=True), torch.randn(1, tokens[1], dim, requires_grad=True),
              torch.randn(1, dim, requires_grad=True)]
    block(*inputs)  # compile
    known = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *inputs]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in known:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(*inputs)
    return sum(saved.values())


@pytest.mark.slow
def test_compiled_default_keeps_what_upstream_keeps():
    """Issue 28: SD3.5's compiled default took 3-5% more GPU memory than upstream (run81). The cause: the checkpoint
    inside each compiled block kept its attention output (tokens x width; 0.75 GiB over SD3.5 large's 38 blocks at
    1024 px). auto now keeps only the blocks' inputs for SD3, as upstream's checkpointing does."""
    from library.compile.checkpoint import auto_keep

    dim, text = 64, 20
    assert auto_keep("sd3", 1, 1024 * 1024, 70 * 2**30)[0] == "inputs"
    growth = {}  # bytes saved per image token more
    for keep in ("inputs", "attention"):
        small, large = (_saved_bytes_of_compiled_block(keep, (image, text), dim) for image in (64, 128))
        growth[keep] = (large - small) / 64
    assert growth["inputs"] == 0  # only the temb-sized modulation stays, whatever the image size
    assert dim * 4 <= growth["attention"] <= (dim + 8) * 4, growth  # each token's attention output (+ logsumexp)

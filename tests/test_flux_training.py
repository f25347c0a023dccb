"""FLUX.1 trainers end to end on a tiny FLUX (BFL single files, CPU, 2 steps):

- LoRA eager from a --config_file with CLIP-L LoRA, --fp8_base and a sample image (flow-matching Euler, --g);
- LoRA with --compile aot_eager + --blocks_to_swap 1 + gradient checkpointing + cached latents/T5 outputs;
- LoRA with --compile inductor (the one inductor case);
- full fine-tune with --train_blocks single: the saved BFL file reloads and differs from the base only in the
  single blocks;
- clear errors for missing files and impossible settings.
"""
from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import flux_train
import flux_train_network
from library.network_trainer import run as network_run
from library import flux_models, flux_tiny


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def flux_set(tmp_path_factory):
    return flux_tiny.make_tiny_flux(tmp_path_factory.mktemp("flux_train_models"))


@pytest.fixture(scope="module")
def flux_data(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("flux_data"), n=2, size=(32, 32), repeats=1, name="demo")


def model_argv(paths):
    return ["--pretrained_model_name_or_path", paths["transformer"], "--clip_l", paths["clip_l"],
            "--t5xxl", paths["t5xxl"], "--ae", paths["ae"], "--tokenizer_cache_dir", paths["tokenizer_cache_dir"]]


def lora_argv(paths, data, out, name, extra=()):
    return [*model_argv(paths), "--train_data_dir", str(data), "--output_dir", str(out), "--output_name", name,
            "--network_module", "networks.lora_flux", "--network_dim", "4", "--network_alpha", "2",
            "--resolution", "32", "--max_train_steps", "2", "--learning_rate", "1e-3",
            "--t5xxl_max_token_length", "16", "--max_data_loader_n_workers", "0", "--seed", "1", *extra]


def read(path):
    with safe_open(str(path), "pt") as f:
        md = f.metadata() or {}
    return load_file(str(path)), md


def check_kohya_flux_keys(sd, te: bool):
    names = {k.split(".")[0] for k in sd}
    assert "lora_unet_double_blocks_0_img_attn_qkv" in names and "lora_unet_single_blocks_0_linear1" in names
    assert all(n.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_", "lora_te1_")) for n in names)
    assert any(n.startswith("lora_te1_text_model_encoder_layers_") for n in names) == te
    for n in names:
        assert {f"{n}.lora_down.weight", f"{n}.lora_up.weight", f"{n}.alpha"} <= set(sd)
    assert any(v.abs().sum() > 0 for k, v in sd.items() if k.endswith("lora_up.weight"))  # it trained


def test_lora_eager_from_config_file_with_te_fp8_and_samples(flux_set, flux_data, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --g 3.5 --d 7\n")
    cfg = tmp_path / "flux.toml"
    argv = lora_argv(flux_set, flux_data, tmp_path / "out", "eager",
                     ["--fp8_base", "--sample_prompts", str(prompts), "--sample_every_n_steps", "2",
                      "--timestep_sampling", "shift", "--model_prediction_type", "raw", "--apply_t5_attn_mask"])
    lines = []
    it = iter(argv)
    for a in it:
        key = a[2:]
        if a in ("--fp8_base", "--apply_t5_attn_mask"):
            lines.append(f"{key} = true")
        else:
            v = next(it)
            lines.append(f"{key} = {v}" if v.replace(".", "").replace("e-", "").isdigit() else f'{key} = "{v}"')
    cfg.write_text("\n".join(lines) + "\n")
    path = flux_train_network.main(["--config_file", str(cfg)])
    sd, md = read(path)
    check_kohya_flux_keys(sd, te=True)
    assert md["ss_network_module"] == "networks.lora_flux" and md["ss_base_model_version"] == "flux1"
    assert md["ss_fp8_base"] == "True" and md["ss_timestep_sampling"] == "shift"
    assert md["ss_model_prediction_type"] == "raw" and md["ss_guidance_scale"] == "3.5"
    samples = list((tmp_path / "out" / "sample").glob("eager_000002_00_*_7.png"))
    assert len(samples) == 1


def test_lora_validation_weighting_huber_and_input_perturbation(flux_set, flux_data, tmp_path, caplog):
    """FLUX's loss options end to end: validation loss at fixed sigmas, logit_normal sigma sampling, an exponential
    Huber loss and input perturbation; the DDPM-only options are accepted and ignored with a warning (as upstream)."""
    caplog.set_level(logging.INFO)
    trainer = flux_train_network.trainer()
    path = network_run(trainer, flux_train_network.setup_parser(), lora_argv(
        flux_set, flux_data, tmp_path, "val",
        ["--validation_split", "0.5", "--validate_every_n_steps", "1", "--weighting_scheme", "logit_normal",
         "--logit_mean", "0.2", "--loss_type", "huber", "--huber_schedule", "exponential", "--ip_noise_gamma", "0.1",
         "--min_snr_gamma", "5", "--logging_dir", str(tmp_path / "logs")]))
    _, md = read(path)
    assert md["ss_weighting_scheme"] == "logit_normal" and md["ss_logit_mean"] == "0.2"
    assert md["ss_loss_type"] == "huber" and md["ss_ip_noise_gamma"] == "0.1"
    assert md["ss_num_validation_images"] == "1"
    assert "validation after step 1: val_loss=" in caplog.text and "timesteps [200, 400, 600, 800]" in caplog.text
    assert "--min_snr_gamma: no effect on FLUX" in caplog.text
    assert len(trainer.losses) == 2 and all(v == v for v in trainer.losses)  # finite, not NaN


def test_lora_compile_aot_eager_with_block_swap(flux_set, flux_data, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    argv = lora_argv(flux_set, flux_data, tmp_path, "swap",
                     ["--compile", "--compile_backend", "aot_eager", "--blocks_to_swap", "1",
                      "--gradient_checkpointing", "--compile_checkpoint_keep", "projections",
                      "--network_train_unet_only", "--cache_text_encoder_outputs",
                      "--cache_latents", "--network_args", "train_blocks=all"])
    path = flux_train_network.main(argv)
    assert "Compiling FLUX with torch.compile: backend=aot_eager, mode=default" in caplog.text
    assert "gradient checkpointing inside the compiled region (--compile_checkpoint_keep projections)" in caplog.text
    assert "Linear layers in the compiled blocks run outside the graph" in caplog.text
    assert "Block swap: 1 of 2 blocks swapped" in caplog.text
    assert "torch.compile after step 2: " in caplog.text and " compiled in " in caplog.text  # events.CompileReport
    sd, md = read(path)
    check_kohya_flux_keys(sd, te=False)
    assert md["ss_blocks_to_swap"] == "1" and md["ss_compile_backend"] == "aot_eager"
    assert not any("_orig_mod" in k for k in sd)


@pytest.mark.slow
def test_lora_compile_inductor(flux_set, flux_data, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    argv = lora_argv(flux_set, flux_data, tmp_path, "ind",
                     ["--compile", "--network_train_unet_only", "--network_args", "train_blocks=single"])
    path = flux_train_network.main(argv)
    assert "Compiling FLUX with torch.compile: backend=inductor, mode=default" in caplog.text
    sd, md = read(path)
    names = {k.split(".")[0] for k in sd}
    assert names and all(n.startswith("lora_unet_single_blocks_") for n in names)
    assert md["ss_compile"] == "True" and md["ss_network_args"] and "single" in md["ss_network_args"]


def full_argv(paths, data, out, name, extra=()):
    return [*model_argv(paths), "--train_data_dir", str(data), "--output_dir", str(out), "--output_name", name,
            "--resolution", "32", "--max_train_steps", "2", "--learning_rate", "1e-3",
            "--t5xxl_max_token_length", "16", "--max_data_loader_n_workers", "0", "--seed", "1",
            "--cache_latents", "--cache_text_encoder_outputs", *extra]


def test_full_finetune_changes_only_trained_blocks(flux_set, flux_data, tmp_path):
    path = flux_train.main(full_argv(flux_set, flux_data, tmp_path, "ft", ["--train_blocks", "single"]))
    saved, md = read(path)
    base = load_file(flux_set["transformer"])
    assert set(saved) == set(base)
    changed = {k for k in base if not torch.equal(saved[k], base[k])}
    assert changed and all(k.startswith("single_blocks.") for k in changed)
    assert md["modelspec.architecture"] == "flux-1-dev" and md["ss_train_blocks"] == "single"
    # our loader reads it back (the diffusers single-file loader is checked on a width-3072 file in
    # test_flux_models.py: its converter assumes FLUX's real width)
    model = flux_models.load_flux_transformer(path, dtype=torch.float32)
    assert torch.equal(model.single_transformer_blocks[0].proj_out.weight, saved["single_blocks.0.linear2.weight"])


def test_full_finetune_fused_backward_with_block_swap_equals_without(flux_set, flux_data, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    fused = ["--optimizer_type", "Adafactor", "--optimizer_args", "relative_step=False", "scale_parameter=False",
             "warmup_init=False", "--fused_backward_pass"]
    plain = read(flux_train.main(full_argv(flux_set, flux_data, tmp_path, "plain", fused)))[0]
    swapped = read(flux_train.main(full_argv(flux_set, flux_data, tmp_path, "swap", [*fused, "--blocks_to_swap", "1"])))[0]
    assert "Block swap: 1 of 2 blocks swapped" in caplog.text
    assert "torch.compile after step 2: " in caplog.text and " compiled in " in caplog.text  # events.CompileReport
    base = load_file(flux_set["transformer"])
    assert all(torch.equal(plain[k], swapped[k]) for k in plain)
    assert any(not torch.equal(plain[k], base[k]) for k in base if k.startswith("double_blocks."))


def test_full_finetune_blockwise_fused_optimizers_equal_one_step(flux_set, flux_data, tmp_path, caplog):
    """--blockwise_fused_optimizers: one optimizer per block, each stepped inside backward once its block's
    gradients are in; with SGD and no clipping that is exactly one SGD step after backward."""
    caplog.set_level(logging.INFO)
    sgd = ["--optimizer_type", "SGD", "--max_grad_norm", "0", "--learning_rate", "1e-2"]
    plain = read(flux_train.main(full_argv(flux_set, flux_data, tmp_path, "plain", sgd)))[0]
    blockwise = read(flux_train.main(full_argv(flux_set, flux_data, tmp_path, "blk",
                                               [*sgd, "--blockwise_fused_optimizers"])))[0]
    assert "fused optimizer groups: 3 optimizers step during backward" in caplog.text  # rest, 1 double, 1 single
    base = load_file(flux_set["transformer"])
    assert all(torch.equal(plain[k], blockwise[k]) for k in plain)
    assert any(not torch.equal(plain[k], base[k]) for k in base if k.startswith("single_blocks."))


@pytest.mark.parametrize("extra, match", [
    (["--blocks_to_swap", "5"], "between 1 and 1"),
    (["--timestep_sampling", "cosine"], "invalid choice"),
    (["--compile", "--blocks_to_swap", "1", "--compile_fullgraph"], "compile_fullgraph"),
    (["--network_args", "train_blocks=middle"], "train_blocks"),
])
def test_bad_options_named(flux_set, flux_data, tmp_path, capsys, extra, match):
    with pytest.raises(SystemExit) as e:
        flux_train_network.main(lora_argv(flux_set, flux_data, tmp_path, "bad", extra))
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_single_file_needs_text_encoders(flux_set, flux_data, tmp_path, capsys):
    argv = lora_argv(flux_set, flux_data, tmp_path, "noclip")
    i = argv.index("--clip_l")
    del argv[i:i + 2]
    with pytest.raises(SystemExit):
        flux_train_network.main(argv)
    assert "--clip_l" in capsys.readouterr().err

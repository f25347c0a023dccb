"""SD1.x / SD2.x LoRA trainer (train_network.py) end to end on tiny models (CPU): a diffusers-folder model with
text-encoder LoRA, epoch saves and pruning, sample images; SD2 v-prediction; loss falls when overfitting."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import train_network

from lora_checks import check_loads_in_diffusers, read_lora


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def one_image(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("one_image"), n=1, size=(64, 64), repeats=1, name="one")


def argv_for(model, tokenizers, out, data, name, extra=()):
    argv = ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir", str(out),
            "--output_name", name, "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4",
            "--resolution", "64", "--learning_rate", "1e-2", "--max_data_loader_n_workers", "0", "--seed", "7",
            *extra]
    if tokenizers:
        argv += ["--tokenizer_cache_dir", str(tokenizers)]
    return argv


def test_sd1_diffusers_folder_te_and_unet_epochs_samples(tmp_path, tiny_sd1_diffusers, one_image):
    import train_network
    from library.model_util import load_sd_components
    from library.network_trainer import run

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --l 4 --d 5\n")
    trainer = train_network.trainer()
    path = run(trainer, train_network.setup_parser(), argv_for(
        tiny_sd1_diffusers, None, tmp_path, one_image, "sd1lora",
        ["--max_train_epochs", "3", "--save_every_n_epochs", "1", "--save_last_n_epochs", "1",
         "--sample_prompts", str(prompts), "--sample_every_n_epochs", "3", "--sample_sampler", "euler_a",
         "--clip_skip", "2", "--max_token_length", "150", "--min_snr_gamma", "5", "--noise_offset", "0.05",
         "--gradient_checkpointing", "--logging_dir", str(tmp_path / "logs")]))
    assert Path(path) == tmp_path / "sd1lora.safetensors"
    assert len(trainer.losses) == 3
    # epoch saves with kohya names; --save_last_n_epochs 1 removed epoch 1
    assert (tmp_path / "sd1lora-000002.safetensors").is_file()
    assert not (tmp_path / "sd1lora-000001.safetensors").exists()
    samples = list((tmp_path / "sample").glob("sd1lora_e000003_00_*_5.png"))
    assert len(samples) == 1
    assert list((tmp_path / "logs").rglob("events.out.tfevents.*"))  # TensorBoard

    sd, md = read_lora(path)
    names = {k.split(".")[0] for k in sd}
    assert "lora_unet_down_blocks_0_attentions_0_proj_in" in names
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q" in names
    assert "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_ff_net_0_proj" in names
    assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj" in names
    assert "lora_te_text_model_encoder_layers_1_mlp_fc2" in names
    assert not any(n.startswith(("lora_te1_", "lora_te2_")) for n in names)
    assert sd["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"].dim() == 4  # 1x1 conv in SD1
    assert md["ss_base_model_version"] == "sd_v1" and md["ss_v2"] == "False"
    assert md["ss_epoch"] == "3" and md["ss_steps"] == "3" and md["ss_num_epochs"] == "3"
    assert md["ss_clip_skip"] == "2" and md["ss_max_token_length"] == "150" and md["ss_min_snr_gamma"] == "5.0"
    assert md["ss_network_dim"] == "4" and md["ss_network_alpha"] == "4.0"
    assert md["ss_sd_model_name"] == "tiny_sd1_diffusers" and "ss_compile" not in md
    epoch2, md2 = read_lora(tmp_path / "sd1lora-000002.safetensors")
    assert md2["ss_epoch"] == "2" and md2["ss_steps"] == "2"

    comps = load_sd_components(str(tiny_sd1_diffusers), "sd1")
    check_loads_in_diffusers(path, comps)


def test_sd2_v_parameterization(tmp_path_factory, tmp_path, one_image):
    import train_network
    from library.network_trainer import run
    from library.tiny_models import make_tiny_sd

    model = make_tiny_sd(tmp_path_factory.mktemp("tiny_sd2"), "sd2", "single_file")
    trainer = train_network.trainer()
    path = run(trainer, train_network.setup_parser(), argv_for(
        model, model.parent / "tokenizers", tmp_path, one_image, "sd2v",
        ["--v2", "--v_parameterization", "--max_train_steps", "2", "--network_train_unet_only"]))
    sd, md = read_lora(path)
    assert md["ss_base_model_version"] == "sd_v2_v" and md["ss_v2"] == "True"
    assert all(k.startswith("lora_unet_") for k in sd)
    # SD2 uses linear proj_in/proj_out
    assert sd["lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight"].dim() == 2
    assert trainer.objective.noise_scheduler(None, "v_prediction").config.prediction_type \
        == "v_prediction"


def test_loss_falls_when_overfitting_one_image(tmp_path, tiny_sd1_single_file, one_image):
    import train_network
    from library.network_trainer import run

    trainer = train_network.trainer()
    run(trainer, train_network.setup_parser(), argv_for(
        tiny_sd1_single_file, tiny_sd1_single_file.parent / "tokenizers", tmp_path, one_image, "overfit",
        ["--max_train_steps", "30", "--network_dim", "16", "--network_alpha", "16", "--learning_rate", "3e-3",
         "--network_train_unet_only", "--cache_latents", "--cache_text_encoder_outputs",
         "--min_timestep", "400", "--max_timestep", "600"]))
    losses = trainer.losses
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last, losses)


def test_encode_clip_long_prompts(tiny_sd1_single_file):
    from library.model_util import load_sd_components
    from library.families.sd import encode_clip

    comps = load_sd_components(str(tiny_sd1_single_file), "sd1",
                               tokenizer_cache_dir=str(tiny_sd1_single_file.parent / "tokenizers"))
    te, tok = comps.text_encoders[0], comps.tokenizers[0]
    captions = ["a red circle", " ".join(["word"] * 120)]
    with torch.no_grad():
        short, _ = encode_clip(tok, te, captions, None, None, True, "cpu")
        long, _ = encode_clip(tok, te, captions, 150, None, True, "cpu")
        skip2, _ = encode_clip(tok, te, captions, None, -2, True, "cpu")
    assert short.shape[:2] == (2, 77) and long.shape[:2] == (2, 152)
    # a short caption's first chunk is the plain 77-token encoding
    assert torch.allclose(long[0, :76], short[0, :76], atol=1e-5)
    assert not torch.allclose(skip2, short)


def test_network_weights_continue(tmp_path, tiny_sd1_single_file, one_image):
    """--network_weights starts from a LoRA file: with a vanishing learning rate the result is that file."""
    import train_network
    from library.model_util import load_sd_components
    from library.network_trainer import run
    from networks import lora

    comps = load_sd_components(str(tiny_sd1_single_file), "sd1",
                               tokenizer_cache_dir=str(tiny_sd1_single_file.parent / "tokenizers"))
    net = lora.create_network(1.0, 4, 4.0, comps.vae, comps.text_encoders[0], comps.unet)
    net.apply_to(comps.text_encoders, comps.unet, True, True)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.05)
    start = tmp_path / "start.safetensors"
    net.save_weights(str(start), None, {})
    out = run(train_network.trainer(), train_network.setup_parser(), argv_for(
        tiny_sd1_single_file, tiny_sd1_single_file.parent / "tokenizers", tmp_path, one_image, "continued",
        ["--max_train_steps", "1", "--network_weights", str(start), "--learning_rate", "1e-12",
         "--optimizer_type", "SGDNesterov"]))
    a, _ = read_lora(start)
    b, _ = read_lora(out)
    assert set(a) == set(b)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k

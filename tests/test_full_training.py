"""Full-model trainers on the CPU with tiny models: 2-step DreamBooth (with regularisation images) and
fine-tune runs of sdxl_train.py, train_db.py and fine_tune.py. Their results reload in our loader and in
diffusers, differ from the base model where trained (and only there), carry ss_*/modelspec metadata in the
SGM/LDM key layout, and never replace an earlier result."""
from __future__ import annotations

import importlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent


def train(script: str, argv: list[str]) -> str:
    return importlib.import_module(script).main([str(a) for a in argv])


def base_args(model: Path, data: Path, out: Path, name: str) -> list:
    return ["--pretrained_model_name_or_path", model, "--tokenizer_cache_dir", Path(model).parent / "tokenizers",
            "--train_data_dir", data, "--caption_extension", ".txt", "--resolution", "64",
            "--output_dir", out, "--output_name", name, "--max_train_steps", 2, "--max_data_loader_n_workers", 0,
            "--learning_rate", 1e-3, "--seed", 1]


@pytest.fixture(scope="module")
def reg_dir(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("reg"), n=2, size=(64, 64), repeats=1, name="dog")


def load(path, family):
    from library.model_util import load_sd_components

    return load_sd_components(path, family, tokenizer_cache_dir=None if Path(path).is_dir()
                              else Path(path).parent / "tokenizers")


def load_with_tokenizers(path, family, tokenizer_dir):
    from library.model_util import load_sd_components

    return load_sd_components(path, family, tokenizer_cache_dir=tokenizer_dir)


def changed(a: torch.nn.Module, b: torch.nn.Module, dtype=torch.float32) -> bool:
    """Any weight differs (compared after casting both to `dtype`, e.g. the --save_precision)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return any(not torch.equal(sa[k].to(dtype), sb[k].to(dtype)) for k in sa if sa[k].is_floating_point())


def same_weights(a: torch.nn.Module, b: torch.nn.Module, dtype=torch.float32) -> bool:
    return not changed(a, b, dtype)


def header(path) -> tuple[list[str], dict]:
    with safe_open(str(path), "pt") as f:
        return list(f.keys()), f.metadata()


# ---- SDXL ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sdxl_dreambooth_with_reg_images(tmp_path, tiny_sdxl_single_file, tiny_sdxl_diffusers, tiny_dataset_dir,
                                         reg_dir, caplog):
    """Prior preservation, text encoder 2 trained (te1 rate 0 = frozen), regional compile after prepare,
    a step save and the final single file in SGM layout that our loader and diffusers read."""
    out = tmp_path / "out"
    argv = base_args(tiny_sdxl_single_file, tiny_dataset_dir, out, "db") + [
        "--reg_data_dir", reg_dir, "--prior_loss_weight", 0.5, "--train_text_encoder", "--learning_rate_te1", 0,
        "--learning_rate_te2", 1e-3, "--gradient_checkpointing", "--save_every_n_steps", 1,
        "--compile", "--compile_backend", "eager"]
    with caplog.at_level(logging.INFO):
        final = train("sdxl_train", argv)
    assert Path(final) == out / "db.safetensors"
    # as upstream, the step save of the last step is written too
    assert sorted(p.name for p in out.iterdir()) == ["db-step00000001.safetensors", "db-step00000002.safetensors",
                                                     "db.safetensors", "db_config.toml"]
    assert "Compiling SDXL UNet with torch.compile: backend=eager" in caplog.text

    keys, md = header(final)
    assert not [k for k in keys if "_orig_mod." in k]
    for prefix in ("model.diffusion_model.", "first_stage_model.", "conditioner.embedders.0.transformer.",
                   "conditioner.embedders.1.model."):
        assert any(k.startswith(prefix) for k in keys), prefix
    assert md["ss_base_model_version"] == "sdxl_base_v1-0" and md["ss_steps"] == "2"
    assert md["ss_num_reg_images"] != "0" and md["ss_prior_loss_weight"] == "0.5"
    assert md["ss_train_text_encoder"] == "True" and md["ss_learning_rate_te1"] == "0.0"
    assert md["ss_compile"] == "True"
    assert md["modelspec.architecture"] == "stable-diffusion-xl-v1-base" and md["modelspec.title"] == "db"
    assert md["modelspec.resolution"] == "64x64"

    base = load(tiny_sdxl_single_file, "sdxl")
    trained = load_with_tokenizers(final, "sdxl", Path(tiny_sdxl_single_file).parent / "tokenizers")
    assert changed(trained.unet, base.unet)
    assert same_weights(trained.text_encoders[0], base.text_encoders[0])  # learning_rate_te1 0
    assert changed(trained.text_encoders[1], base.text_encoders[1])
    assert same_weights(trained.vae, base.vae)
    step1_keys, step1_md = header(out / "db-step00000001.safetensors")
    assert step1_keys == keys and step1_md["ss_steps"] == "1"

    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_single_file(final, config=str(tiny_sdxl_diffusers), local_files_only=True)
    assert same_weights(pipe.unet, trained.unet) and same_weights(pipe.text_encoder_2, trained.text_encoders[1])

    # a second run with the same name stops before training and leaves the earlier result alone
    before = Path(final).read_bytes()
    with pytest.raises(SystemExit) as e:
        train("sdxl_train", argv)
    assert e.value.code == 2
    assert Path(final).read_bytes() == before


@pytest.mark.slow
def test_sdxl_finetune_in_json_fused_adafactor_diffusers(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    """kohya metadata JSON (made by the merge tool), Adafactor with the fused backward pass, cached latents
    and text-encoder outputs, saved as a diffusers folder."""
    images = tiny_dataset_dir / "2_demo"
    meta = tmp_path / "meta.json"
    subprocess.run([sys.executable, str(REPO / "sd-scripts/finetune/merge_captions_to_metadata.py"), str(images),
                    str(meta), "--caption_extension", ".txt"], check=True, capture_output=True)
    assert len(json.loads(meta.read_text())) == 4
    out = tmp_path / "out"
    argv = base_args(tiny_sdxl_single_file, images, out, "ft") + [
        "--in_json", meta, "--optimizer_type", "Adafactor", "--fused_backward_pass", "--cache_latents",
        "--cache_text_encoder_outputs", "--gradient_checkpointing", "--save_model_as", "diffusers"]
    final = Path(train("sdxl_train", argv))
    assert final == out / "ft" and (final / "model_index.json").is_file()
    assert not list(out.glob(".*tmp*"))

    base = load(tiny_sdxl_single_file, "sdxl")
    trained = load(final, "sdxl")
    assert changed(trained.unet, base.unet)  # only the fused hooks step the optimizer
    assert same_weights(trained.text_encoders[0], base.text_encoders[0])
    assert same_weights(trained.text_encoders[1], base.text_encoders[1])

    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(str(final), local_files_only=True)
    assert same_weights(pipe.unet, trained.unet)


@pytest.mark.parametrize("extra, message", [
    (["--fused_backward_pass"], "only with --optimizer_type Adafactor"),
    (["--fused_backward_pass", "--optimizer_type", "Adafactor", "--gradient_accumulation_steps", "2"],
     "cannot accumulate gradients"),
    (["--fused_backward_pass", "--optimizer_type", "Adafactor", "--mixed_precision", "fp16"], "use --mixed_precision bf16"),
    (["--cache_text_encoder_outputs", "--train_text_encoder"], "cannot be used with --train_text_encoder"),
    (["--train_text_encoder", "--learning_rate_te1", "0", "--learning_rate_te2", "0"], "nothing of the text"),
    (["--save_model_as", "pt"], "invalid choice"),
])
def test_sdxl_train_refuses_impossible_options(tmp_path, capsys, extra, message):
    argv = ["--pretrained_model_name_or_path", tmp_path / "none.safetensors", "--train_data_dir", tmp_path,
            "--output_dir", tmp_path / "out"] + extra
    with pytest.raises(SystemExit) as e:
        train("sdxl_train", argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---- SD1.x -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sd1_dreambooth_with_reg_images_ckpt(tmp_path, tiny_sd1_single_file, tiny_sd1_diffusers, tiny_dataset_dir,
                                             reg_dir):
    out = tmp_path / "out"
    argv = base_args(tiny_sd1_single_file, tiny_dataset_dir, out, "db") + [
        "--reg_data_dir", reg_dir, "--train_text_encoder", "--learning_rate_te", 1e-3, "--save_model_as", "ckpt"]
    final = Path(train("train_db", argv))
    assert final == out / "db.ckpt"
    sd = torch.load(final, map_location="cpu", weights_only=True)["state_dict"]
    assert any(k.startswith("model.diffusion_model.") for k in sd)
    assert any(k.startswith("cond_stage_model.transformer.") for k in sd)
    assert not [k for k in sd if "_orig_mod." in k]

    base = load(tiny_sd1_single_file, "sd1")
    trained = load_with_tokenizers(final, "sd1", Path(tiny_sd1_single_file).parent / "tokenizers")
    assert changed(trained.unet, base.unet) and changed(trained.text_encoders[0], base.text_encoders[0])

    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_single_file(str(final), config=str(tiny_sd1_diffusers), subfolder="unet",
                                                 local_files_only=True)
    assert same_weights(unet, trained.unet)


def test_sd1_dreambooth_trains_text_encoder_by_default(tmp_path, tiny_sd1_single_file, tiny_dataset_dir):
    """kohya's train_db.py: the text encoder is trained without --train_text_encoder."""
    final = Path(train("train_db", base_args(tiny_sd1_single_file, tiny_dataset_dir, tmp_path / "out", "db")))
    base = load(tiny_sd1_single_file, "sd1")
    trained = load_with_tokenizers(final, "sd1", Path(tiny_sd1_single_file).parent / "tokenizers")
    assert changed(trained.unet, base.unet) and changed(trained.text_encoders[0], base.text_encoders[0])
    assert header(final)[1]["ss_train_text_encoder"] == "True"


def test_sd1_dreambooth_stop_text_encoder_training(tmp_path, tiny_sd1_single_file, tiny_dataset_dir, caplog):
    """--stop_text_encoder_training 1: the text encoder changes in step 1 and not in step 2 (the UNet does)."""
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO):
        final = Path(train("train_db", base_args(tiny_sd1_single_file, tiny_dataset_dir, out, "db")
                           + ["--stop_text_encoder_training", 1, "--save_every_n_steps", 1]))
    assert "stop text encoder training at step 1" in caplog.text
    tokenizers = Path(tiny_sd1_single_file).parent / "tokenizers"
    base = load(tiny_sd1_single_file, "sd1")
    step1 = load_with_tokenizers(out / "db-step00000001.safetensors", "sd1", tokenizers)
    step2 = load_with_tokenizers(final, "sd1", tokenizers)
    assert changed(step1.text_encoders[0], base.text_encoders[0])
    assert same_weights(step2.text_encoders[0], step1.text_encoders[0])
    assert changed(step2.unet, step1.unet)


@pytest.mark.slow
def test_sd1_finetune_captions_save_state_and_resume(tmp_path, tiny_sd1_single_file, tiny_sd1_diffusers,
                                                     tiny_dataset_dir, caplog):
    """Captions next to the images; --save_state, then --resume continues at step 2 into a new name."""
    out = tmp_path / "out"
    final = Path(train("fine_tune", base_args(tiny_sd1_single_file, tiny_dataset_dir, out, "ft")
                       + ["--save_state", "--save_precision", "fp16"]))
    state = out / "ft-state"
    assert state.is_dir() and (state / "optimizer.bin").is_file()
    keys, md = header(final)
    assert md["modelspec.architecture"] == "stable-diffusion-v1" and md["ss_steps"] == "2"
    with safe_open(str(final), "pt") as f:
        assert f.get_tensor(keys[0]).dtype == torch.float16

    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_single_file(str(final), config=str(tiny_sd1_diffusers), local_files_only=True,
                                                    safety_checker=None, requires_safety_checker=False)
    base = load(tiny_sd1_single_file, "sd1")
    assert changed(pipe.unet, base.unet)
    assert same_weights(pipe.text_encoder, base.text_encoders[0], torch.float16)  # no --train_text_encoder

    with caplog.at_level(logging.INFO):
        resumed = Path(train("fine_tune", base_args(tiny_sd1_single_file, tiny_dataset_dir, out, "ft2")
                             + ["--resume", state, "--max_train_steps", 3]))
    assert "resumed at step 2" in caplog.text
    assert header(resumed)[1]["ss_steps"] == "3"

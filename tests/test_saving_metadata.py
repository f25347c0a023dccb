"""Saving, resuming, metadata and Hugging Face upload as kohya-ss/sd-scripts does them (library.saving,
library.metadata, library.huggingface_util): upstream's ss_* key set, modelspec keys from the --metadata_*
options, keep-last-N pruning of models and states by epoch and step, --save_n_epoch_ratio, --initial_step /
--initial_epoch / --skip_until_initial_step, --save_model_as defaults of the full trainers, the streaming
(--mem_eff_save) writer, diffusers folders with "text_model." keys, and Hub upload/resume through a fake HfApi
(nothing touches the network)."""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import train_network
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from library import huggingface_util, metadata, saving, train_util

# ---- upstream's ss_* keys, written down from kohya-ss/sd-scripts train_network.py (NetworkTrainer.train) --------

# always written (None values as "None")
UPSTREAM_COMMON = """ss_session_id ss_training_started_at ss_output_name ss_learning_rate ss_text_encoder_lr ss_unet_lr
ss_num_train_images ss_num_validation_images ss_num_reg_images ss_num_batches_per_epoch ss_num_epochs
ss_gradient_checkpointing ss_gradient_accumulation_steps ss_max_train_steps ss_lr_warmup_steps ss_lr_scheduler
ss_network_module ss_network_dim ss_network_alpha ss_network_dropout ss_mixed_precision ss_full_fp16 ss_v2
ss_base_model_version ss_clip_skip ss_max_token_length ss_cache_latents ss_seed ss_lowram ss_noise_offset
ss_multires_noise_iterations ss_multires_noise_discount ss_adaptive_noise_scale ss_zero_terminal_snr
ss_training_comment ss_sd_scripts_commit_hash ss_optimizer ss_max_grad_norm ss_caption_dropout_rate
ss_caption_dropout_every_n_epochs ss_caption_tag_dropout_rate ss_face_crop_aug_range ss_prior_loss_weight
ss_min_snr_gamma ss_scale_weight_norms ss_ip_noise_gamma ss_debiased_estimation ss_noise_offset_random_strength
ss_ip_noise_gamma_random_strength ss_loss_type ss_huber_schedule ss_huber_scale ss_huber_c ss_fp8_base
ss_fp8_base_unet ss_validation_seed ss_validation_split ss_max_validation_steps ss_validate_every_n_epochs
ss_validate_every_n_steps ss_resize_interpolation""".split()
# --train_data_dir / --in_json (no --dataset_config)
UPSTREAM_NO_CONFIG = """ss_batch_size_per_device ss_total_batch_size ss_resolution ss_color_aug ss_flip_aug
ss_random_crop ss_shuffle_caption ss_enable_bucket ss_bucket_no_upscale ss_min_bucket_reso ss_max_bucket_reso ss_keep_tokens
ss_dataset_dirs ss_reg_dataset_dirs ss_tag_frequency ss_bucket_info""".split()
UPSTREAM_WITH_CONFIG = ["ss_datasets", "ss_tag_frequency", "ss_dataset_dirs"]
UPSTREAM_DATASET_FIELDS = {"is_dreambooth", "batch_size_per_device", "num_train_images", "num_reg_images", "resolution",
                           "enable_bucket", "min_bucket_reso", "max_bucket_reso", "tag_frequency", "bucket_info",
                           "resize_interpolation", "subsets"}
UPSTREAM_SUBSET_FIELDS = {"img_count", "num_repeats", "color_aug", "flip_aug", "random_crop", "shuffle_caption",
                          "keep_tokens", "keep_tokens_separator", "secondary_separator", "enable_wildcard",
                          "caption_prefix", "caption_suffix", "resize_interpolation", "image_dir", "class_tokens",
                          "is_reg"}
# written when the option is given / the file exists
UPSTREAM_CONDITIONAL = ["ss_network_args", "ss_sd_model_hash", "ss_new_sd_model_hash", "ss_sd_model_name",
                        "ss_vae_hash", "ss_new_vae_hash", "ss_vae_name"]
# save_model(): added at each save; lora.py save_weights adds the sshs_* hashes
UPSTREAM_AT_SAVE = ["ss_training_finished_at", "ss_steps", "ss_epoch", "sshs_model_hash", "sshs_legacy_hash"]
UPSTREAM_FLUX = """ss_model_type ss_apply_t5_attn_mask ss_weighting_scheme ss_logit_mean ss_logit_std ss_mode_scale
ss_guidance_scale ss_timestep_sampling ss_sigmoid_scale ss_model_prediction_type ss_discrete_flow_shift""".split()
UPSTREAM_MINIMUM = ["ss_v2", "ss_base_model_version", "ss_network_module", "ss_network_dim", "ss_network_alpha",
                    "ss_network_args"]


def _lora_args(data_dir, out, extra=()):
    import train_network

    return train_util.parse_args(train_network.setup_parser(), [
        "--pretrained_model_name_or_path", "model.safetensors", "--output_dir", str(out), "--output_name", "x",
        "--network_module", "networks.lora", "--resolution", "64", *extra,
        *(["--train_data_dir", str(data_dir)] if data_dir else [])])


def _network_md(args, family="sd1"):
    """What a LoRA trainer writes: its build_metadata and the validation keys (added in train())."""
    from library import validation
    from library.config_util import build_dataset_group

    group = build_dataset_group(args, family)
    md = train_network.trainer().build_metadata(args, group, 1, 2.0, "torch.optim.AdamW", "AdamW", len(group), 3, 6, 2)
    md.update({k: train_util.metadata_value(v) for k, v in validation.metadata(args, None).items()})
    return md


@pytest.mark.parametrize("hashed_on_a_thread", [False, True])
def test_network_metadata_has_every_upstream_key(tmp_path, tiny_dataset_dir, hashed_on_a_thread):
    model, vae = tmp_path / "m.safetensors", tmp_path / "vae.safetensors"
    model.write_bytes(os.urandom(0x100000 + 0x20000))
    vae.write_bytes(b"vae")
    args = _lora_args(tiny_dataset_dir, tmp_path, ["--network_args", "conv_dim=4", "--vae", str(vae),
                                                   "--optimizer_args", "weight_decay=0.01", "betas=0.9,0.99"])
    args.pretrained_model_name_or_path = str(model)
    if hashed_on_a_thread:  # as the trainers start it (library.run.setup): the same values come out
        metadata.start_file_hashes(str(model), str(vae), None)
        assert {k[0] for k in metadata._HASHES} >= {str(model), str(vae)}
    md = _network_md(args)
    assert "ss_sd_model_hash" not in md  # the hashes are added at save time (save_lora)
    md.update(metadata.file_hash_metadata(args))
    expected = UPSTREAM_COMMON + UPSTREAM_NO_CONFIG + UPSTREAM_CONDITIONAL
    assert not [k for k in expected if k not in md]
    assert all(isinstance(v, str) for v in md.values())
    assert md["ss_scale_weight_norms"] == "None"  # None is written, as upstream
    data = model.read_bytes()
    assert md["ss_sd_model_hash"] == hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]
    assert md["ss_new_sd_model_hash"] == hashlib.sha256(data).hexdigest()
    assert md["ss_sd_model_name"] == "m.safetensors" and md["ss_vae_name"] == "vae.safetensors"
    assert md["ss_new_vae_hash"] == hashlib.sha256(b"vae").hexdigest()
    assert md["ss_optimizer"] == "torch.optim.AdamW(weight_decay=0.01,betas=(0.9, 0.99))"
    assert md["ss_batch_size_per_device"] == "1" and md["ss_total_batch_size"] == "2"
    assert json.loads(md["ss_network_args"]) == {"conv_dim": "4"}
    assert json.loads(md["ss_dataset_dirs"]) == {"2_demo": {"n_repeats": 2, "img_count": 4}}
    assert json.loads(md["ss_reg_dataset_dirs"]) == {}
    assert metadata.minimum_network_metadata(md).keys() == set(UPSTREAM_MINIMUM)

    # only with the option / an existing file
    plain_args = _lora_args(tiny_dataset_dir, tmp_path)
    plain = _network_md(plain_args)
    assert not [k for k in ("ss_network_args", "ss_sd_model_hash", "ss_vae_name") if k in plain]
    assert plain["ss_sd_model_name"] == "model.safetensors"
    assert metadata.file_hash_metadata(plain_args) == {}  # no such file: no hash keys, as upstream


def test_file_hashes_kept_per_file_version(tmp_path):
    """A run saves many times and hashes once; a file written again (size or time changed) is hashed again."""
    f = tmp_path / "m.safetensors"
    f.write_bytes(b"a" * 100)
    first = metadata.file_hashes(str(f))
    assert first[1] == hashlib.sha256(b"a" * 100).hexdigest()
    assert metadata.file_hashes(str(f)) is first
    f.write_bytes(b"b" * 101)
    assert metadata.file_hashes(str(f))[1] == hashlib.sha256(b"b" * 101).hexdigest()
    assert metadata.file_hashes(str(tmp_path)) == ("IsADirectory", "IsADirectory")
    assert metadata.file_hashes(str(tmp_path / "none")) == ("NOFILE", "NOFILE")


def _upstream_hashes(data: bytes) -> tuple[str, str]:
    return hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8], hashlib.sha256(data).hexdigest()


def test_started_hashes_come_from_a_child_process(tmp_path, monkeypatch):
    """start_file_hashes hashes in a child Python (no GIL shared with the trainer's first steps): the parent's own
    hash_file is never called, and the answer is upstream's two hashes."""
    f = tmp_path / "m.safetensors"
    f.write_bytes(os.urandom(0x100000 + 0x30000))

    def not_here(path):
        raise AssertionError("hashed in the trainer's process")

    monkeypatch.setattr(metadata.file_hash, "hash_file", not_here)
    monkeypatch.setattr(metadata, "_HASHES", {})
    metadata.start_file_hashes(str(f))
    assert metadata.file_hashes(str(f)) == _upstream_hashes(f.read_bytes())


@pytest.mark.parametrize("executable", ["missing", "echo"])
def test_hashes_computed_here_where_the_child_cannot_answer(tmp_path, monkeypatch, executable):
    """No Python to run (a missing executable) or an answer that is not two hashes (echo prints its argv): the
    hashes are computed in the trainer's process, with the same values."""
    f = tmp_path / "m.safetensors"
    f.write_bytes(os.urandom(0x100000 + 0x30000))
    monkeypatch.setattr(metadata.sys, "executable", str(tmp_path / "none") if executable == "missing" else "echo")
    called = []
    real = metadata.file_hash.hash_file
    monkeypatch.setattr(metadata.file_hash, "hash_file", lambda path: called.append(path) or real(path))
    assert metadata._hash_in_child(str(f)) == _upstream_hashes(f.read_bytes())
    assert called == [str(f)]


def test_hashing_child_stopped_when_the_run_ends(tmp_path, monkeypatch):
    """A run that ends before the hash is done (a stop, an error) does not leave the child reading the file: the exit
    hook kills it; whoever still asks gets the hashes computed in the process."""
    import time

    f = tmp_path / "m.safetensors"
    f.write_bytes(os.urandom(0x100000 + 0x30000))
    slow = tmp_path / "slow_python"
    slow.write_text("#!/bin/sh\nexec sleep 60\n")
    slow.chmod(0o755)
    monkeypatch.setattr(metadata.sys, "executable", str(slow))
    monkeypatch.setattr(metadata, "_HASHES", {})
    metadata.start_file_hashes(str(f))
    deadline = time.monotonic() + 10
    while not metadata._HASHING_CHILDREN and time.monotonic() < deadline:
        time.sleep(0.01)
    (child,) = metadata._HASHING_CHILDREN
    metadata._stop_hashing_children()
    assert metadata.file_hashes(str(f)) == _upstream_hashes(f.read_bytes())
    assert child.returncode is not None and child.returncode < 0 and not metadata._HASHING_CHILDREN


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the ignored signals from /proc")
def test_hashing_child_outlives_the_stop_signal():
    """The GUI's Stop sends SIGTERM to every process of the run and a terminal's Ctrl+C SIGINT to its group: both are
    the trainer's stop-and-save, which needs the hash, so the child ignores them (the trainer ends it at exit)."""
    import signal
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-I", "-S", metadata.file_hash.__file__, "/dev/zero"],
                             stdout=subprocess.DEVNULL)
    try:
        wanted = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the child has set up its signals: /proc says they are ignored
            status = Path(f"/proc/{child.pid}/status").read_text()
            ignored = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigIgn:")), 16)
            if ignored & wanted == wanted:
                break
            time.sleep(0.01)
        child.send_signal(signal.SIGTERM)
        child.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert child.poll() is None  # still reading (/dev/zero never ends)
    finally:
        child.kill()
        child.wait()


def test_model_hashes_start_only_where_metadata_is_saved(tmp_path, monkeypatch):
    """library.run.setup.start_model_hashes: the main process of a run that writes metadata; not with --no_metadata,
    not in the other processes, not for the textual-inversion scripts (they have no --no_metadata)."""
    from library.run import setup

    f = tmp_path / "m.safetensors"
    f.write_bytes(b"model")
    started = []
    monkeypatch.setattr(metadata, "start_file_hashes", lambda *paths: started.append(paths))
    main, other = SimpleNamespace(is_main_process=True), SimpleNamespace(is_main_process=False)
    for args, accelerator in ((SimpleNamespace(pretrained_model_name_or_path=str(f), no_metadata=True), main),
                              (SimpleNamespace(pretrained_model_name_or_path=str(f), no_metadata=False), other),
                              (SimpleNamespace(pretrained_model_name_or_path=str(f)), main)):
        setup.start_model_hashes(args, accelerator)
    assert started == []
    setup.start_model_hashes(SimpleNamespace(pretrained_model_name_or_path=str(f), no_metadata=False, vae="v"), main)
    assert started == [(str(f), "v")]


def test_network_metadata_with_adafactor_relative_step(tmp_path, tiny_dataset_dir):
    """Upstream: Adafactor with relative_step (its default) has no learning rate; the scheduler is adafactor:<lr>."""
    md = _network_md(_lora_args(tiny_dataset_dir, tmp_path, ["--optimizer_type", "Adafactor", "--learning_rate",
                                                             "1e-4", "--unet_lr", "2e-4"]))
    assert md["ss_lr_scheduler"] == "adafactor:0.0001" and md["ss_learning_rate"] == "None"
    assert md["ss_unet_lr"] == "None" and md["ss_text_encoder_lr"] == "None"
    md = _network_md(_lora_args(tiny_dataset_dir, tmp_path, ["--optimizer_type", "Adafactor", "--optimizer_args",
                                                             "relative_step=False", "--learning_rate", "1e-4"]))
    assert md["ss_lr_scheduler"] == "constant" and md["ss_learning_rate"] == "0.0001"


def test_network_metadata_with_dataset_config(tmp_path, tiny_dataset_dir):
    cfg = tmp_path / "ds.toml"
    cfg.write_text(f'[general]\nresolution = 64\n[[datasets]]\nbatch_size = 2\n[[datasets.subsets]]\n'
                   f'image_dir = "{tiny_dataset_dir / "2_demo"}"\nnum_repeats = 3\nclass_tokens = "demo"\n')
    md = _network_md(_lora_args(None, tmp_path, ["--dataset_config", str(cfg)]))
    assert not [k for k in UPSTREAM_COMMON + UPSTREAM_WITH_CONFIG if k not in md]
    (ds,) = json.loads(md["ss_datasets"])
    assert UPSTREAM_DATASET_FIELDS <= ds.keys() and ds["batch_size_per_device"] == 2 and ds["is_dreambooth"]
    (sub,) = ds["subsets"]
    assert UPSTREAM_SUBSET_FIELDS <= sub.keys()
    assert sub["image_dir"] == "2_demo" and sub["num_repeats"] == 3 and sub["class_tokens"] == "demo"
    assert sub["img_count"] == 4


def test_flux_network_metadata_keys():
    import flux_train_network

    args = train_util.parse_args(flux_train_network.setup_parser(), [])
    # upstream writes these common keys for FLUX too
    common = {"ss_v2": "False", "ss_clip_skip": "None", "ss_max_token_length": "None"}
    md = dict(common)
    md.update(flux_train_network.trainer().family.metadata(args, (False, False)))
    assert not [k for k in UPSTREAM_FLUX if k not in md]
    assert common.items() <= md.items()


# ---- modelspec -------------------------------------------------------------------------------------------------


def test_modelspec_keys_from_metadata_options(tmp_path):
    thumb = tmp_path / "t.png"
    thumb.write_bytes(b"\x89PNG-bytes")
    args = _lora_args(None, tmp_path, [
        "--metadata_title", "My LoRA", "--metadata_author", "me", "--metadata_description", "desc",
        "--metadata_license", "MIT", "--metadata_tags", "a,b", "--metadata_usage_hint", "use 'xyz'",
        "--metadata_thumbnail", str(thumb), "--metadata_merged_from", "m1, m2", "--metadata_trigger_phrase", "xyz",
        "--metadata_preprocessor", "canny", "--metadata_is_negative_embedding", "False", "--clip_skip", "2",
        "--min_timestep", "100", "--resolution", "512,768"])
    md = metadata.modelspec_metadata(args, family="sdxl", lora=True, v_prediction=False, timestamp=1700000000)
    for opt in metadata.METADATA_FIELDS:
        assert f"modelspec.{opt}" in md, opt
    assert md["modelspec.title"] == "My LoRA" and md["modelspec.author"] == "me"
    assert md["modelspec.tags"] == "a,b" and md["modelspec.usage_hint"] == "use 'xyz'"
    assert md["modelspec.thumbnail"] == "data:image/png;base64," + base64.b64encode(b"\x89PNG-bytes").decode()
    assert md["modelspec.is_negative_embedding"] == "False" and md["modelspec.preprocessor"] == "canny"
    assert md["modelspec.sai_model_spec"] == "1.0.1"
    assert md["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert md["modelspec.implementation"] == metadata.IMPL_STABILITY_AI
    assert md["modelspec.resolution"] == "512x768" and md["modelspec.prediction_type"] == "epsilon"
    assert md["modelspec.timestep_range"] == "100,1000" and md["modelspec.encoder_layer"] == "2"
    assert md["modelspec.implementation_version"].startswith("sd-scripts/")
    assert md["modelspec.date"].startswith("2023-11-1")

    # defaults: title = output name, nothing optional, upstream's default resolution per family
    plain = _lora_args(None, tmp_path)
    plain.resolution = None
    md = metadata.modelspec_metadata(plain, family="sd2", lora=True, v_prediction=True)
    assert md["modelspec.title"] == "x" and md["modelspec.architecture"] == "stable-diffusion-v2-768-v/lora"
    assert md["modelspec.implementation"] == "diffusers" and md["modelspec.prediction_type"] == "v"
    assert md["modelspec.resolution"] == "768x768"
    assert not [k for k in md if k.split(".")[1] in ("author", "thumbnail", "timestep_range", "encoder_layer")]
    full = metadata.modelspec_metadata(plain, family="sd1", lora=False, v_prediction=False)
    assert full["modelspec.architecture"] == "stable-diffusion-v1"
    assert full["modelspec.implementation"] == metadata.IMPL_STABILITY_AI and full["modelspec.resolution"] == "512x512"
    flux = metadata.modelspec_metadata(plain, family="flux", lora=True, v_prediction=False, flux_variant="schnell")
    assert flux["modelspec.architecture"] == "flux-1-schnell/lora" and "modelspec.prediction_type" not in flux

    plain.metadata_thumbnail = str(tmp_path / "missing.png")  # skipped with a warning, as upstream
    assert "modelspec.thumbnail" not in metadata.modelspec_metadata(plain, family="sd1", lora=True, v_prediction=False)


# ---- cadence, keep-last-N, start position ------------------------------------------------------------------------


def test_save_n_epoch_ratio():
    for epochs, ratio, every in ((10, 3, 3), (10, 20, 1), (7, 7, 1), (100, 5, 20)):
        args = SimpleNamespace(save_n_epoch_ratio=ratio, save_every_n_epochs=None)
        saving.apply_save_n_epoch_ratio(args, epochs)
        assert args.save_every_n_epochs == every
    args = SimpleNamespace(save_n_epoch_ratio=0, save_every_n_epochs=4)
    saving.apply_save_n_epoch_ratio(args, 10)
    assert args.save_every_n_epochs == 4


def _saves(tmp_path, args, ext, by_step, points):
    """Make the files of each save as the trainer does, then prune; -> the names left."""
    from library.run.trainer import prune_checkpoints

    for n in points:
        if by_step:
            (tmp_path / train_util.step_file_name("x", n, ext)).write_bytes(b"m")
            (tmp_path / train_util.state_dir_name("x", step=n)).mkdir()
        else:
            (tmp_path / train_util.epoch_file_name("x", n, ext)).write_bytes(b"m")
            (tmp_path / train_util.state_dir_name("x", epoch=n)).mkdir()
        prune_checkpoints(args, n if not by_step else 1, n, ext, by_step)
    return sorted(p.name for p in tmp_path.iterdir())


def test_keep_last_n_models_and_states_by_step(tmp_path):
    # upstream: after saving step s, remove the newest multiple of every that is <= s - N - 1
    # (models with --save_last_n_steps 25: step 40 removes 10, 50 removes 20, 60 removes 30;
    #  states with --save_last_n_steps_state 15: 30 removes 10, ..., 60 removes 40)
    args = SimpleNamespace(output_dir=str(tmp_path), output_name="x", save_every_n_steps=10, save_last_n_steps=25,
                           save_last_n_steps_state=15, save_every_n_epochs=None, save_last_n_epochs=None,
                           save_last_n_epochs_state=None)
    left = _saves(tmp_path, args, ".safetensors", True, range(10, 61, 10))
    assert left == ["x-step00000040.safetensors", "x-step00000050-state", "x-step00000050.safetensors",
                    "x-step00000060-state", "x-step00000060.safetensors"]
    assert saving.remove_step_no(50, 10, 30) == 10 and saving.remove_step_no(30, 10, 30) is None


def test_keep_last_n_models_and_states_by_epoch(tmp_path):
    args = SimpleNamespace(output_dir=str(tmp_path), output_name="x", save_every_n_epochs=2, save_last_n_epochs=2,
                           save_last_n_epochs_state=1, save_every_n_steps=None, save_last_n_steps=None,
                           save_last_n_steps_state=None)
    left = _saves(tmp_path, args, ".pt", False, (2, 4, 6, 8))
    assert left == ["x-000006.pt", "x-000008-state", "x-000008.pt"]
    # without the _state option the states follow --save_last_n_epochs
    args.save_last_n_epochs_state = None
    assert saving.state_keep_last(args, by_step=False) == 2


def test_start_position_initial_step_and_epoch(caplog):
    def args(**kw):
        base = dict(initial_step=None, initial_epoch=None, skip_until_initial_step=False,
                    gradient_accumulation_steps=1, resume=None)
        return SimpleNamespace(**{**base, **kw})

    # resumed state: continue exactly (epoch 2, 3 batches of it done)
    assert saving.start_position(args(), 5, 13, 100) == saving.StartPosition(13, 2, 3)
    # --initial_epoch 3 (1-based) without skipping: epoch 3 from its first batch, counted from its first step
    assert saving.start_position(args(initial_epoch=3), 5, 0, 100) == saving.StartPosition(10, 2, 0)
    # --initial_step overrides --initial_epoch; skipping with accumulation skips batches (2 per step)
    pos = saving.start_position(args(initial_step=12, initial_epoch=9, skip_until_initial_step=True,
                                     gradient_accumulation_steps=2), 5, 0, 100)
    assert pos == saving.StartPosition(12, 2, 4)
    with caplog.at_level(logging.WARNING):
        assert saving.start_position(args(initial_step=3, skip_until_initial_step=True), 5, 13, 100).global_step == 3
    assert "ignored" in caplog.text
    with pytest.raises(train_util.ConfigError, match="not before the last step"):
        saving.start_position(args(initial_step=100), 5, 0, 100)
    with pytest.raises(train_util.ConfigError, match="--initial_epoch must be 1 or more"):
        saving.validate_saving_args(SimpleNamespace(initial_epoch=0))


def test_full_model_save_format_defaults(tmp_path):
    st, ckpt, folder = tmp_path / "m.safetensors", tmp_path / "m.ckpt", tmp_path / "diffusers"
    st.write_bytes(b"x")
    ckpt.write_bytes(b"x")
    folder.mkdir()
    fmt = saving.full_model_format
    assert fmt(None, False, st) == ("single", ".safetensors")
    assert fmt(None, False, ckpt) == ("single", ".ckpt")
    assert fmt(None, True, ckpt) == ("single", ".safetensors")
    assert fmt(None, False, folder) == ("diffusers", "") and fmt(None, False, "org/hub-id") == ("diffusers", "")
    assert fmt("ckpt", False, folder) == ("single", ".ckpt") and fmt("ckpt", True, folder) == ("single", ".safetensors")
    assert fmt("diffusers_safetensors", False, st) == ("diffusers", "")

    import sdxl_train

    args = train_util.parse_args(sdxl_train.setup_parser(), ["--pretrained_model_name_or_path", str(st)])
    assert args.save_model_as is None and sdxl_train.trainer().output_ext(args) == ".safetensors"
    args = train_util.parse_args(sdxl_train.setup_parser(), ["--pretrained_model_name_or_path", str(folder),
                                                             "--save_model_as", "diffusers_safetensors"])
    assert sdxl_train.trainer().output_ext(args) == ""


# ---- writing files -------------------------------------------------------------------------------------------


def test_streaming_safetensors_writer_round_trip(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, 2).bfloat16(),
               "s": torch.tensor(1.5), "e": torch.zeros(0, 4)}
    entries = [saving.TensorEntry(k, tuple(v.shape), v.dtype, lambda v=v: v) for k, v in tensors.items()]
    path = tmp_path / "s.safetensors"
    saving.save_safetensors_streaming(path, entries, {"k": "v"})
    back = load_file(str(path))
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"k": "v"}
    with pytest.raises(train_util.OutputExistsError):
        saving.save_safetensors_streaming(path, entries)

    def boom():
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        saving.save_safetensors_streaming(tmp_path / "t.safetensors",
                                          [saving.TensorEntry("x", (1,), torch.float32, boom)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]  # no partial or temp file left


def test_flux_mem_eff_save_writes_the_same_file(tmp_path):
    import flux_train
    from library import flux_tiny

    transformer = flux_tiny.tiny_transformer(width=64, num_double=1, num_single=1, t5_dim=32, clip_dim=32,
                                             guidance=True, seed=0, dtype=torch.float32)
    comps = SimpleNamespace(transformer=transformer, is_schnell=False)
    trainer = flux_train.trainer()
    outs = {}
    for eff in (False, True):
        args = SimpleNamespace(mem_eff_save=eff, overwrite_output=False)
        outs[eff] = tmp_path / f"{eff}.safetensors"
        trainer.family.save_full_model(args, comps, str(outs[eff]), {"modelspec.title": "t"}, torch.bfloat16)
    a, b = load_file(str(outs[False])), load_file(str(outs[True]))
    assert a.keys() == b.keys() and any(k.endswith("qkv.weight") for k in a)
    assert all(torch.equal(a[k], b[k]) and b[k].dtype == torch.bfloat16 for k in a)
    with safe_open(str(outs[True]), "pt") as f:
        assert f.metadata() == {"modelspec.title": "t"}


def test_diffusers_folder_text_encoder_keys_carry_text_model_prefix(tmp_path, tiny_sd1_single_file):
    from library import model_util

    comps = model_util.load_sd_components(tiny_sd1_single_file, "sd1",
                                          tokenizer_cache_dir=Path(tiny_sd1_single_file).parent / "tokenizers")
    folder = model_util.save_sd_diffusers(tmp_path / "out", comps, save_dtype="fp16")
    keys = load_file(str(folder / "text_encoder" / "model.safetensors")).keys()
    assert keys and all(k.startswith("text_model.") for k in keys)  # what transformers 4.x (upstream's pin) loads
    cfg = json.loads((folder / "text_encoder" / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "float16" and cfg["architectures"] == ["CLIPTextModel"]
    back = model_util.load_sd_components(folder, "sd1")
    for k, v in model_util.clip_state_dict(back.text_encoders[0]).items():
        assert torch.equal(v, model_util.clip_state_dict(comps.text_encoders[0])[k].half()), k


# ---- Hugging Face ----------------------------------------------------------------------------------------------


class FakeApi:
    """Records what would be uploaded / downloaded; `fail` makes uploads raise."""

    def __init__(self, calls, *, exists=True, fail=False, files=(), cache=None):
        self.calls, self.exists, self.fail, self.files, self.cache = calls, exists, fail, list(files), cache

    def repo_info(self, repo_id, repo_type=None, **kw):
        self.calls.append(("repo_info", repo_id, repo_type))
        if not self.exists:
            raise RuntimeError("404")

    def create_repo(self, repo_id, repo_type=None, private=None, **kw):
        self.calls.append(("create_repo", repo_id, repo_type, private))

    def upload_file(self, *, repo_id, repo_type, path_or_fileobj, path_in_repo, **kw):
        if self.fail:
            raise RuntimeError("network down")
        self.calls.append(("upload_file", repo_id, repo_type, os.path.basename(path_or_fileobj), path_in_repo))

    def upload_folder(self, *, repo_id, repo_type, folder_path, path_in_repo, **kw):
        self.calls.append(("upload_folder", repo_id, repo_type, sorted(os.listdir(folder_path)), path_in_repo))

    def list_repo_files(self, repo_id, revision=None, repo_type=None, **kw):
        self.calls.append(("list_repo_files", repo_id, revision, repo_type))
        return self.files

    def hf_hub_download(self, repo_id, filename, revision=None, repo_type=None, **kw):
        self.calls.append(("hf_hub_download", filename, revision, repo_type))
        path = Path(self.cache) / "snapshots" / "abc" / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(filename)
        return str(path)


def _hf_args(**kw):
    base = dict(huggingface_repo_id="me/loras", huggingface_repo_type=None, huggingface_path_in_repo=None,
                huggingface_token="tok", huggingface_repo_visibility=None, async_upload=False,
                save_state_to_huggingface=False, resume_from_huggingface=False, resume=None)
    return SimpleNamespace(**{**base, **kw})


def test_hf_upload_file_folder_async_and_repo_creation(tmp_path, monkeypatch):
    calls, tokens = [], []

    def make_api(token):
        tokens.append(token)
        return FakeApi(calls, exists=False)

    monkeypatch.setattr(huggingface_util, "make_api", make_api)
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"m")
    huggingface_util.upload(_hf_args(huggingface_path_in_repo="run1/"), f, "x.safetensors")
    assert calls == [("repo_info", "me/loras", None), ("create_repo", "me/loras", None, True),
                     ("upload_file", "me/loras", None, "x.safetensors", "run1/x.safetensors")]
    assert tokens == ["tok"]

    calls.clear()
    state = tmp_path / "x-state"
    state.mkdir()
    (state / "optimizer.bin").write_bytes(b"o")
    thread = huggingface_util.upload(_hf_args(async_upload=True, huggingface_repo_visibility="public",
                                              huggingface_repo_type="dataset"), state, "x-state")
    assert thread is not None
    huggingface_util.wait_for_uploads()
    assert calls == [("repo_info", "me/loras", "dataset"), ("create_repo", "me/loras", "dataset", False),
                     ("upload_folder", "me/loras", "dataset", ["optimizer.bin"], "x-state")]
    # the final model is uploaded before the run ends, even with --async_upload
    assert huggingface_util.upload(_hf_args(async_upload=True), f, "x.safetensors", force_sync=True) is None
    assert huggingface_util.upload(_hf_args(huggingface_repo_id=None), f, "x.safetensors") is None


def test_hf_async_upload_finishes_before_keep_last_n_removes_the_file(tmp_path, monkeypatch):
    import time

    from library import network_trainer

    read = []

    class SlowApi(FakeApi):
        def upload_file(self, *, path_or_fileobj, **kw):
            time.sleep(0.3)
            read.append(Path(path_or_fileobj).read_bytes())  # fails if the file was removed meanwhile

    monkeypatch.setattr(huggingface_util, "make_api", lambda token: SlowApi([]))
    f = tmp_path / "x-step00000001.safetensors"
    f.write_bytes(b"step1")
    assert huggingface_util.upload(_hf_args(async_upload=True), f, f.name) is not None
    from library.run.trainer import remove

    remove(str(f))
    assert read == [b"step1"] and not f.exists()


def test_hf_failed_upload_keeps_the_local_file(tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(huggingface_util, "make_api", lambda token: FakeApi(calls, fail=True))
    f = tmp_path / "x.safetensors"
    f.write_bytes(b"model")
    with caplog.at_level(logging.ERROR):
        huggingface_util.upload(_hf_args(), f, "x.safetensors")
    assert "failed to upload" in caplog.text and "network down" in caplog.text
    assert f.read_bytes() == b"model"


def test_hf_resume_downloads_the_state(tmp_path, monkeypatch):
    calls = []
    files = ["runs/x-state/optimizer.bin", "runs/x-state/model.safetensors", "runs/x-state2/other.bin", "README.md"]
    monkeypatch.setattr(huggingface_util, "make_api",
                        lambda token: FakeApi(calls, files=files, cache=tmp_path / "cache"))
    args = _hf_args(resume="me/loras/runs/x-state:v1", resume_from_huggingface=True)
    huggingface_util.validate_huggingface_args(args)
    local = huggingface_util.resume_state_dir(args)
    assert Path(local) == tmp_path / "cache" / "snapshots" / "abc" / "runs" / "x-state"
    assert sorted(os.listdir(local)) == ["model.safetensors", "optimizer.bin"]
    assert ("list_repo_files", "me/loras", "v1", "model") in calls
    assert [c[1] for c in calls if c[0] == "hf_hub_download"] == files[:2]
    assert huggingface_util.resume_state_dir(_hf_args(resume="local/dir")) == "local/dir"

    assert huggingface_util.parse_hub_state("a/b/c/d:main:dataset") == ("a/b", "c/d", "main", "dataset")
    assert huggingface_util.parse_hub_state("a/b/c") == ("a/b", "c", None, None)
    with pytest.raises(train_util.ConfigError, match="allowed values: model, dataset, space"):
        huggingface_util.parse_hub_state("a/b/c:main:bucket")
    with pytest.raises(train_util.ConfigError, match="needs --huggingface_repo_id"):
        huggingface_util.validate_huggingface_args(_hf_args(huggingface_repo_id=None, save_state_to_huggingface=True))


def test_hf_token_is_not_written_to_the_run_config(tmp_path):
    args = _lora_args(None, tmp_path, ["--huggingface_token", "hf_secret", "--huggingface_repo_id", "me/x"])
    assert "hf_secret" not in train_util.dumps_config(args) and "me/x" in train_util.dumps_config(args)


# ---- end to end: one tiny LoRA run --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_lora_run_saves_uploads_prunes_and_skips(tmp_path, monkeypatch, tiny_sd1_single_file, tiny_dataset_dir):
    """8 batches per epoch; --initial_step 5 with skipping starts after step 5 (5 batches skipped) and trains
    steps 6..8; saves every step keep the models of the last 2 steps and the states of the last step (upstream:
    at step 8 that removes the model of step 5 and the state of step 6); everything is uploaded."""
    import train_network
    from library.network_trainer import run

    calls = []
    monkeypatch.setattr(huggingface_util, "make_api", lambda token: FakeApi(calls))
    trainer = train_network.trainer()
    out = tmp_path / "out"
    final = run(trainer, train_network.setup_parser(), [
        "--pretrained_model_name_or_path", str(tiny_sd1_single_file), "--train_data_dir", str(tiny_dataset_dir),
        "--output_dir", str(out), "--output_name", "x", "--network_module", "networks.lora", "--network_dim", "2",
        "--resolution", "64", "--max_data_loader_n_workers", "0", "--seed", "1", "--max_train_steps", "8",
        "--tokenizer_cache_dir", str(Path(tiny_sd1_single_file).parent / "tokenizers"),
        "--initial_step", "5", "--skip_until_initial_step", "--save_every_n_steps", "1", "--save_last_n_steps", "2",
        "--save_state", "--save_last_n_steps_state", "1", "--huggingface_repo_id", "me/x",
        "--save_state_to_huggingface", "--metadata_author", "me", "--no_metadata"])
    assert len(trainer.losses) == 3  # steps 6, 7, 8
    assert sorted(p.name for p in out.iterdir()) == [
        "x-state", "x-step00000006.safetensors", "x-step00000007-state", "x-step00000007.safetensors",
        "x-step00000008-state", "x-step00000008.safetensors", "x.safetensors", "x_config.toml"]
    uploaded = [c[-1] for c in calls if c[0].startswith("upload")]
    assert uploaded == ["x-step00000006.safetensors", "x-step00000006-state", "x-step00000007.safetensors",
                        "x-step00000007-state", "x-step00000008.safetensors", "x-step00000008-state",
                        "x.safetensors", "x-state"]
    with safe_open(final, "pt") as f:
        md = f.metadata()
    # --no_metadata: upstream's minimum keys + modelspec (+ the sshs hashes)
    assert {k for k in md if k.startswith("ss_")} == {k for k in UPSTREAM_MINIMUM if k != "ss_network_args"}
    assert md["modelspec.author"] == "me" and md["modelspec.architecture"] == "stable-diffusion-v1/lora"
    assert "sshs_model_hash" in md

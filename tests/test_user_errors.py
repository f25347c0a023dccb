"""User errors found by trying the scripts as a new user would: each stops with exit status 2 and one clear
`error:` line naming the option (no traceback), before any model loads where the input allows it."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
import pytest
import torch
import train_network

pytestmark = pytest.mark.usefixtures("one_thread")


def _argv(model, data, out, *extra, tokenizers=True):
    argv = ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data), "--output_dir", str(out),
            "--output_name", "lora", "--network_module", "networks.lora", "--resolution", "64",
            "--caption_extension", ".txt", "--max_train_steps", "1", "--max_data_loader_n_workers", "0", "--learning_rate", "1e-3", *extra]
    if tokenizers:
        argv += ["--tokenizer_cache_dir", str(model.parent / "tokenizers")]
    return argv


def _fails(capsys, monkeypatch, argv, *expected):
    """Runs train_network.main in this process; asserts exit 2, one error line holding `expected`, and that no
    model was loaded."""
    import train_network
    from library import model_util

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the error was found")

    monkeypatch.setattr(model_util, "load_sd_components", no_load)
    with pytest.raises(SystemExit) as e:
        train_network.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def test_config_with_several_bad_keys_reports_all_at_once(tmp_path, capsys, monkeypatch, tiny_sd1_single_file,
                                                          tiny_dataset_dir):
    cfg = tmp_path / "run.toml"
    cfg.write_text('netwrk_dim = 4\nlearning_rat = 1e-4\n[training]\nmixed_precision = "fp32"\n'
                   'max_train_steps = "ten"\n')
    line = _fails(capsys, monkeypatch, ["--config_file", str(cfg), *_argv(tiny_sd1_single_file, tiny_dataset_dir,
                                                                           tmp_path / "out")],
                  "4 bad keys", "unknown key 'netwrk_dim' (did you mean 'network_dim'?)",
                  "unknown key 'learning_rat' (did you mean 'learning_rate'?)", "mixed_precision = 'fp32'",
                  "allowed values: no, fp16, bf16", "max_train_steps = 'ten' must be an integer")
    assert str(cfg) in line


@pytest.mark.parametrize("extra, expected", [
    (["--network_dim", "0"], ["--network_dim must be 1 or more", "got 0"]),
    (["--network_dim", "-4"], ["--network_dim must be 1 or more"]),
    (["--learning_rate", "-0.0001"], ["--learning_rate must be 0 or more", "-0.0001"]),
    (["--unet_lr", "-1"], ["--unet_lr must be 0 or more"]),
    (["--text_encoder_lr", "0.00001", "-0.00001"], ["--text_encoder_lr must be 0 or more"]),
    (["--output_name", "sub/lora"], ["--output_name 'sub/lora' must be a file name without a folder"]),
    (["--max_grad_norm", "-1"], ["--max_grad_norm must be 0 (no clipping) or more"]),
])
def test_bad_values_stop_before_any_model_loads(tmp_path, capsys, monkeypatch, tiny_sd1_single_file,
                                                tiny_dataset_dir, extra, expected):
    _fails(capsys, monkeypatch, _argv(tiny_sd1_single_file, tiny_dataset_dir, tmp_path / "out", *extra), *expected)


def test_clip_skip_beyond_the_text_encoder(tmp_path, capsys, tiny_sd1_single_file, tiny_dataset_dir):
    import train_network
    from library.model_util import load_sd_components

    layers = load_sd_components(str(tiny_sd1_single_file), "sd1", tokenizer_cache_dir=str(
        tiny_sd1_single_file.parent / "tokenizers")).text_encoders[0].config.num_hidden_layers
    with pytest.raises(SystemExit) as e:
        train_network.main(_argv(tiny_sd1_single_file, tiny_dataset_dir, tmp_path / "out", "--clip_skip",
                                 str(layers + 1)))
    assert e.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert f"--clip_skip {layers + 1}: the text encoder has only {layers} layers" in line


def test_output_dir_that_is_a_file(tmp_path, capsys, monkeypatch, tiny_sd1_single_file, tiny_dataset_dir):
    target = tmp_path / "out"
    target.write_text("not a folder")
    _fails(capsys, monkeypatch, _argv(tiny_sd1_single_file, tiny_dataset_dir, target),
           f"--output_dir {target} is a file, not a folder")
    _fails(capsys, monkeypatch, _argv(tiny_sd1_single_file, tiny_dataset_dir, target / "below"),
           f"{target} is a file, not a folder")


def test_read_only_output_dir(tmp_path, capsys, monkeypatch, tiny_sd1_single_file, tiny_dataset_dir):
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o555)
    try:
        if os.access(target, os.W_OK):  # root writes anywhere: deny as a read-only file system would
            real = os.access
            monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: (
                False if os.path.abspath(p) == str(target) and mode & os.W_OK else real(p, mode, *a, **k)))
        _fails(capsys, monkeypatch, _argv(tiny_sd1_single_file, tiny_dataset_dir, target),
               f"--output_dir {target} is not writable")
        _fails(capsys, monkeypatch, _argv(tiny_sd1_single_file, tiny_dataset_dir, target / "new"),
               f"--output_dir {target / 'new'} cannot be created: {target} is not writable")
    finally:
        target.chmod(0o755)


def test_truncated_weight_file_in_a_diffusers_folder(tmp_path, capsys, tiny_sd1_diffusers, tiny_dataset_dir):
    import train_network

    model = tmp_path / "model"
    shutil.copytree(tiny_sd1_diffusers, model)
    weights = next((model / "unet").glob("*.safetensors"))
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    with pytest.raises(SystemExit) as e:
        train_network.main(_argv(model, tiny_dataset_dir, tmp_path / "out", tokenizers=False))
    assert e.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert f"{model / 'unet'}: cannot load the weights" in line and "truncated" in line
    assert not (tmp_path / "out" / "lora.safetensors").exists()


def test_network_weights_with_keys_the_network_lacks_warn_and_train_on(tmp_path, caplog, tiny_sd1_single_file,
                                                                       one_image_dir):
    import train_network
    from library.model_util import load_sd_components
    from library.network_trainer import run
    from safetensors.torch import load_file, save_file

    from networks import lora

    comps = load_sd_components(str(tiny_sd1_single_file), "sd1",
                               tokenizer_cache_dir=str(tiny_sd1_single_file.parent / "tokenizers"))
    net = lora.create_network(1.0, 4, 4.0, comps.vae, comps.text_encoders[0], comps.unet)
    net.apply_to(comps.text_encoders, comps.unet, True, True)
    start = tmp_path / "start.safetensors"
    net.save_weights(str(start), None, {})
    sd = load_file(str(start))
    sd["lora_unet_not_a_module.lora_down.weight"] = torch.zeros(4, 8)
    sd["lora_unet_not_a_module.lora_up.weight"] = torch.zeros(8, 4)
    save_file(sd, str(start))
    with caplog.at_level(logging.WARNING):
        out = run(train_network.trainer(), train_network.setup_parser(),
                  _argv(tiny_sd1_single_file, one_image_dir, tmp_path / "out", "--network_dim", "4",
                        "--network_alpha", "4", "--network_weights", str(start)))
    assert os.path.isfile(out)
    assert "2 keys do not belong to this network and are ignored" in caplog.text
    assert "lora_unet_not_a_module" in caplog.text


@pytest.fixture(scope="module")
def one_image_dir(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("one_image"), n=1, size=(64, 64), repeats=1, name="one")


@pytest.mark.slow  # builds a tiny FLUX.1 diffusers folder
def test_truncated_weight_file_in_a_flux_diffusers_folder(tmp_path):
    from library import flux_models, flux_tiny

    paths = flux_tiny.make_tiny_flux(tmp_path / "flux", diffusers_folder=True)
    folder = Path(paths["diffusers"])
    weights = next((folder / "text_encoder").glob("*.safetensors"))
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    with pytest.raises(flux_models.FluxModelError, match="truncated or damaged") as e:
        flux_models.load_flux_components(str(folder), tokenizer_cache_dir=paths["tokenizer_cache_dir"])
    assert "\n" not in str(e.value)

"""The trainers' results stay bit for bit the same on a fixed seed on the CPU (issue 24: the training core was
recomposed into library/run, families, targets and objectives). Each case runs a tiny 3-step training through the
script's `main(argv)` and compares the end-of-run "weights checksum" line and a hash of the saved tensors with the
values recorded from the code before the recomposition (main ea8124c)."""
from __future__ import annotations

import hashlib
import importlib
import logging
import re
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

CHECKSUM = re.compile(r"finished (\d+) steps, last loss (\S+), weights checksum (\S+)")

# (steps, last loss, weights checksum, sha256 of the saved tensors) recorded before the recomposition
EXPECTED = {
    "sdxl_lora": (3, '1.0433', '9.5622833281e+00', '99bad84071bf16d8'),
    "sd1_lora": (3, '1.0604', '-1.1409070486e+01', '17bd59c0ed42ee1d'),
    "sdxl_full": (3, '0.9357', '4.5663227108e+03', '4b21211a6e85cbcb'),
    "sd1_dreambooth": (3, '0.9167', '3.1316040913e+03', 'eac2aa09ca022863'),
    # FLUX.1 changed on purpose (issue 24): bug 2, its noise, sigmas and AE sampling now draw from the run's saved
    # generator instead of the global one, and the frozen T5-XXL is in eval mode (its dropout drew from the global
    # generator too): (3, '0.8776', '7.8718121440e+00', '01b3411114949a4f') -> (3, '0.3401', '6.5230630359e+00',
    # 'f4258ea880a99da6'); then bug 4, the fused layers' LoRA down projection computed once (networks.lora_flux),
    # which rounds differently in the last bits:
    # each part of a fused FLUX.1 layer now takes its rows of lora_up on its own (no state kept in forward, so the
    # blocks compile inside a checkpoint): the same sums in another order, checksum 6.5230630099 before (4e-9 rel.)
    "flux_lora": (3, '0.3401', '6.5230630359e+00', 'f4258ea880a99da6'),
}


@pytest.fixture(scope="module")
def flux_set(tmp_path_factory):
    from library import flux_tiny

    return flux_tiny.make_tiny_flux(tmp_path_factory.mktemp("same_weights_flux"))


@pytest.fixture(scope="module")
def flux_data(tmp_path_factory):
    from library.tiny_models import make_captioned_images

    return make_captioned_images(tmp_path_factory.mktemp("same_weights_flux_data"), n=2, size=(32, 32), repeats=1,
                                 name="demo")


def _common(model, data, out, name, lr):
    return ["--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", out,
            "--output_name", name, "--max_train_steps", 3, "--learning_rate", lr, "--max_data_loader_n_workers", 0,
            "--seed", 42, "--train_batch_size", 2]


def _sd_argv(model, data, out, name, extra=()):
    return [*_common(model, data, out, name, 1e-3), "--tokenizer_cache_dir", Path(model).parent / "tokenizers",
            "--resolution", 64, "--caption_extension", ".txt", *extra]


def _lora(extra=()):
    return ["--network_module", "networks.lora", "--network_dim", 4, "--network_alpha", 2, *extra]


def _tensor_hash(path: str) -> str:
    from safetensors.torch import load_file

    if path.endswith(".safetensors"):
        sd = load_file(path)
    else:
        sd = torch.load(path, map_location="cpu", weights_only=True)
        sd = sd.get("state_dict", sd)
    h = hashlib.sha256()
    for key in sorted(sd):
        h.update(key.encode())
        h.update(sd[key].contiguous().view(torch.uint8).numpy().tobytes() if sd[key].dim() else
                 sd[key].reshape(1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _train(script, argv, caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO):
        path = importlib.import_module(script).main([str(a) for a in argv])
    found = CHECKSUM.findall(caplog.text)
    assert len(found) == 1, caplog.text[-2000:]
    steps, loss, checksum = found[0]
    return (int(steps), loss, checksum, _tensor_hash(str(path)))


def _check(case, got):
    print(f"{case}: {got}")
    assert got == EXPECTED[case]


def test_sdxl_lora(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir, caplog):
    argv = _sd_argv(tiny_sdxl_single_file, tiny_dataset_dir, tmp_path, "sdxl", _lora(["--gradient_accumulation_steps",
                                                                                      2]))
    _check("sdxl_lora", _train("sdxl_train_network", argv, caplog))


def test_sd1_lora(tmp_path, tiny_sd1_single_file, tiny_dataset_dir, caplog):
    argv = _sd_argv(tiny_sd1_single_file, tiny_dataset_dir, tmp_path, "sd1",
                    _lora(["--noise_offset", 0.05, "--min_snr_gamma", 5, "--clip_skip", 2]))
    _check("sd1_lora", _train("train_network", argv, caplog))


def test_sdxl_full(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir, caplog):
    argv = _sd_argv(tiny_sdxl_single_file, tiny_dataset_dir, tmp_path, "sdxlfull",
                    ["--train_text_encoder", "--learning_rate_te1", 1e-4])
    _check("sdxl_full", _train("sdxl_train", argv, caplog))


def test_sd1_dreambooth(tmp_path, tiny_sd1_single_file, tiny_dataset_dir, caplog):
    argv = _sd_argv(tiny_sd1_single_file, tiny_dataset_dir, tmp_path, "db", ["--stop_text_encoder_training", 2])
    _check("sd1_dreambooth", _train("train_db", argv, caplog))


def test_flux_lora(tmp_path, flux_set, flux_data, caplog):
    p = flux_set
    argv = [*_common(p["transformer"], flux_data, tmp_path, "flux", 1e-3), "--clip_l", p["clip_l"],
            "--t5xxl", p["t5xxl"], "--ae", p["ae"], "--tokenizer_cache_dir", p["tokenizer_cache_dir"],
            "--resolution", 32, "--t5xxl_max_token_length", 16, "--network_module", "networks.lora_flux",
            "--network_dim", 4, "--network_alpha", 2]
    _check("flux_lora", _train("flux_train_network", argv, caplog))

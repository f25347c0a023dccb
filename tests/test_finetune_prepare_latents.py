"""prepare_buckets_latents.py on a tiny SD1.x model (library/tiny_models.py): it writes the latent cache files the
trainers read (names, keys, shapes per bucket; the dataset of a fine-tune with the same settings encodes nothing
again and a fine_tune.py run reuses them), and train_resolution into the metadata."""
from __future__ import annotations

import argparse
import json
import logging

import numpy as np
import pytest
from PIL import Image

from finetune_tools import load as _load

SIZES = {"square": (128, 128), "wide": (192, 128), "tall": (64, 192)}
BUCKETS = {"square": (128, 128), "wide": (128, 128), "tall": (64, 192)}  # resolution 128, steps 64, 64..256
BUCKET_FLAGS = ["--min_bucket_reso", "64", "--max_bucket_reso", "256", "--bucket_reso_steps", "64"]

pytestmark = pytest.mark.usefixtures("one_thread")



@pytest.fixture
def captioned(tmp_path):
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    rng = np.random.default_rng(0)
    for name, (w, h) in SIZES.items():
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(imgs / f"{name}.png")
        (imgs / f"{name}.caption").write_text(f"a {name} picture\n", encoding="utf-8")
    meta = tmp_path / "meta.json"
    assert _load("merge_captions_to_metadata").cli([str(imgs), str(meta)]) == 0
    (imgs / "zz_broken.png").write_bytes(b"\x89PNG broken")
    return imgs, meta


def _npz(imgs, name):
    w, h = SIZES[name]
    return imgs / f"{name}_{w:04d}x{h:04d}_sd.npz"


def test_writes_the_trainers_cache_files_and_train_resolution(captioned, tiny_sd1_single_file, tmp_path, caplog):
    imgs, meta = captioned
    out = tmp_path / "meta_lat.json"
    tool = _load("prepare_buckets_latents")
    with caplog.at_level(logging.ERROR):
        assert tool.cli([str(imgs), str(meta), str(out), str(tiny_sd1_single_file), "--max_resolution", "128,128",
                         *BUCKET_FLAGS, "--batch_size", "2", "--flip_aug"]) == 0
    assert "zz_broken.png" in caplog.text  # skipped by name, the run went on
    md = json.loads(out.read_text())
    for name, (bw, bh) in BUCKETS.items():
        assert md[name] == {"caption": f"a {name} picture", "train_resolution": [bw, bh]}
        with np.load(_npz(imgs, name)) as npz:
            assert npz["latents"].shape == npz["latents_flipped"].shape == (4, bh // 8, bw // 8)
            assert npz["original_size"].tolist() == list(SIZES[name]) and "signature" not in npz.files
            assert np.isfinite(npz["latents"]).all() and not np.allclose(npz["latents"], npz["latents_flipped"])

    # the dataset of a fine-tune with these settings finds every latent on disk and encodes nothing
    from library import config_util
    from library.latent_cache import FAMILY_FORMATS

    p = argparse.ArgumentParser()
    config_util.add_dataset_arguments(p)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(["--in_json", str(out), "--train_data_dir", str(imgs), "--resolution", "128",
                         "--enable_bucket", *BUCKET_FLAGS, "--flip_aug"])
    group = config_util.build_dataset_group(args, "sd1")

    def must_not_encode(images):
        raise AssertionError(f"encoded {images.shape[0]} images again")

    group.cache_latents(must_not_encode, to_disk=True, signature="sd1:model:vae:75:None",
                        fmt=FAMILY_FORMATS["sd1"])
    assert sorted(info.latents_npz for _, info in group.all_images()) == sorted(str(_npz(imgs, n)) for n in SIZES)

    # --skip_existing keeps the files; without it they are encoded again
    before = {n: _npz(imgs, n).stat().st_mtime_ns for n in SIZES}
    assert tool.cli([str(imgs), str(out), str(out), str(tiny_sd1_single_file), "--max_resolution", "128,128",
                     *BUCKET_FLAGS, "--flip_aug", "--skip_existing"]) == 0
    assert {n: _npz(imgs, n).stat().st_mtime_ns for n in SIZES} == before
    assert tool.cli([str(imgs), str(out), str(out), str(tiny_sd1_single_file), "--max_resolution", "128,128",
                     *BUCKET_FLAGS]) == 0  # no --flip_aug: also not expected by --skip_existing
    assert all(_npz(imgs, n).stat().st_mtime_ns != before[n] for n in SIZES)


def test_bad_input_is_one_line(captioned, tiny_sd1_single_file, tmp_path, capsys):
    imgs, meta = captioned
    tool = _load("prepare_buckets_latents")
    out = tmp_path / "out.json"
    assert tool.cli([str(imgs), str(tmp_path / "none.json"), str(out), str(tiny_sd1_single_file)]) == 2
    assert "in_json" in capsys.readouterr().err
    assert tool.cli([str(imgs), str(meta), str(out), str(tiny_sd1_single_file), "--max_resolution", "512"]) == 2
    assert "--max_resolution" in capsys.readouterr().err
    assert tool.cli([str(imgs), str(meta), str(out), str(tmp_path / "no_model.safetensors")]) == 2
    assert "model_name_or_path" in capsys.readouterr().err
    assert not out.exists() and not list(imgs.glob("*.npz"))


@pytest.mark.slow
def test_fine_tune_run_reuses_the_files(captioned, tiny_sd1_single_file, tmp_path, caplog):
    imgs, meta = captioned
    out = tmp_path / "meta_lat.json"
    assert _load("prepare_buckets_latents").cli([str(imgs), str(meta), str(out), str(tiny_sd1_single_file),
                                                 "--max_resolution", "128,128", *BUCKET_FLAGS]) == 0
    (imgs / "zz_broken.png").unlink()
    mtimes = {n: _npz(imgs, n).stat().st_mtime_ns for n in SIZES}
    import fine_tune

    with caplog.at_level(logging.INFO):
        fine_tune.main(["--pretrained_model_name_or_path", str(tiny_sd1_single_file),
                        "--tokenizer_cache_dir", str(tiny_sd1_single_file.parent / "tokenizers"),
                        "--in_json", str(out), "--train_data_dir", str(imgs), "--resolution", "128",
                        "--enable_bucket", *BUCKET_FLAGS, "--cache_latents_to_disk",
                        "--output_dir", str(tmp_path / "model"), "--output_name", "ft", "--max_train_steps", "1",
                        "--max_data_loader_n_workers", "0", "--learning_rate", "1e-4"])
    assert "0 images to encode, 3 reused from disk" in caplog.text
    assert {n: _npz(imgs, n).stat().st_mtime_ns for n in SIZES} == mtimes


def test_sdxl_model_gets_sdxl_cache_names(captioned, tiny_sdxl_single_file, tmp_path):
    imgs, meta = captioned
    assert _load("prepare_buckets_latents").cli([str(imgs), str(meta), str(tmp_path / "out.json"),
                                                 str(tiny_sdxl_single_file), "--max_resolution", "128,128",
                                                 *BUCKET_FLAGS, "--mixed_precision", "bf16"]) == 0
    for name in SIZES:
        w, h = SIZES[name]
        with np.load(imgs / f"{name}_{w:04d}x{h:04d}_sdxl.npz") as npz:
            bw, bh = BUCKETS[name]
            assert npz["latents"].shape == (4, bh // 8, bw // 8) and npz["latents"].dtype == np.float32
    assert not list(imgs.glob("*_sd.npz"))

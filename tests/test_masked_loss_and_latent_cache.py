"""--masked_loss with alpha_mask / conditioning_data_dir (masks follow crops and flips, into the latent cache; masked
pixels add nothing to the loss), and latent cache files shared with kohya-ss/sd-scripts both ways (upstream's names
and npz keys per family, --skip_cache_check, --vae_batch_size)."""
from __future__ import annotations

import argparse
import os

import numpy as np
import pytest
import torch
import train_network
from PIL import Image

from library import buckets, masks
from library.config_util import add_dataset_arguments, build_dataset_group
from library.datasets import DatasetError
from library.latent_cache import FAMILY_FORMATS


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_dataset_arguments(parser)
    parser.add_argument("--seed", type=int, default=1)
    masks.add_masked_loss_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


def rgba_image(path, size, seed=0):
    w, h = size
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    arr[..., 3] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]  # alpha ramps left to right
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr, "RGBA").save(path)
    return arr


def avgpool(calls):
    def encode(images):
        calls.append(images.shape[0])
        return torch.nn.functional.avg_pool2d(images, 8)
    return encode


# ----------------------------------------------------------------------------- the loss


def test_apply_masked_loss_is_upstreams_formula():
    loss = torch.rand(2, 4, 8, 8)
    mask = torch.rand(2, 64, 64)
    ref = loss * torch.nn.functional.interpolate(mask[:, None], size=(8, 8), mode="area")
    assert torch.equal(masks.apply_masked_loss(loss, mask), ref)
    assert masks.apply_masked_loss(loss, None) is loss
    # masked-out pixels add nothing: changing pred/target there leaves the loss unchanged
    half = torch.ones(1, 64, 64)
    half[:, :, :32] = 0
    pred, target = torch.rand(1, 4, 8, 8), torch.rand(1, 4, 8, 8)
    pred2 = pred.clone()
    pred2[..., :4] += 5
    a = masks.apply_masked_loss(torch.nn.functional.mse_loss(pred, target, reduction="none"), half).mean()
    b = masks.apply_masked_loss(torch.nn.functional.mse_loss(pred2, target, reduction="none"), half).mean()
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- masks in the dataset


def test_alpha_mask_follows_crop_and_flip(tmp_path):
    arr = rgba_image(tmp_path / "t" / "1_x" / "a.png", (96, 64))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64", "--alpha_mask",
                                      "--flip_aug"), "sd1")
    seen = set()
    for epoch in range(8):
        group.set_current_epoch(epoch)
        b = group[0]
        flipped = b["flippeds"][0]
        seen.add(flipped)
        expected = arr[:, 16:80, 3].astype(np.float32) / 255  # 96x64 -> centre 64x64 (no resize)
        if flipped:
            expected = expected[:, ::-1]
        assert b["alpha_masks"].shape == (1, 64, 64)
        assert torch.allclose(b["alpha_masks"][0], torch.from_numpy(expected.copy()))
        rgb = ((b["images"][0] + 1) * 127.5).round().permute(1, 2, 0).numpy().astype(np.uint8)
        exp_rgb = arr[:, 16:80, :3][:, ::-1] if flipped else arr[:, 16:80, :3]
        assert np.array_equal(rgb, exp_rgb)
    assert seen == {True, False}
    # without alpha_mask there is no mask; an opaque image with alpha_mask gets ones
    assert build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64"), "sd1")[0][
        "alpha_masks"] is None
    Image.new("RGB", (64, 64), (1, 2, 3)).save(tmp_path / "t" / "1_x" / "b.png")
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64", "--alpha_mask",
                                      "--train_batch_size", "2"), "sd1")
    b = group[0]
    opaque = b["image_paths"].index(str(tmp_path / "t" / "1_x" / "b.png"))
    assert torch.equal(b["alpha_masks"][opaque], torch.ones(64, 64))


def test_conditioning_data_dir_masks(tmp_path):
    arr = rgba_image(tmp_path / "t" / "1_x" / "a.png", (128, 64))
    cond = np.zeros((64, 128, 3), dtype=np.uint8)
    cond[:, 64:, 0] = 255  # right half trained
    (tmp_path / "masks").mkdir()
    Image.fromarray(cond).save(tmp_path / "masks" / "a.png")
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64",
                                      "--conditioning_data_dir", tmp_path / "masks", "--masked_loss"), "sd1")
    m = group[0]["alpha_masks"][0]  # 128x64 -> centre crop columns 32..96: left half 0, right half 1
    assert torch.equal(m[:, :32], torch.zeros(64, 32)) and torch.equal(m[:, 32:], torch.ones(64, 32))
    # the flag needs --masked_loss (upstream ignores it in these scripts)
    assert build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64",
                                     "--conditioning_data_dir", tmp_path / "masks"), "sd1")[0]["alpha_masks"] is None
    os.remove(tmp_path / "masks" / "a.png")
    with pytest.raises(DatasetError, match="no mask image for 1 training images"):
        build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64",
                                  "--conditioning_data_dir", tmp_path / "masks", "--masked_loss"), "sd1")
    del arr


def test_masked_run_trains_nothing_on_fully_masked_images(tmp_path, tiny_sd1_single_file, one_thread):
    """End to end (2 steps): every pixel transparent -> every loss is exactly 0 and the LoRA stays at its zero
    up-projection; the same images without --alpha_mask train."""
    import train_network
    from library.network_trainer import run
    from safetensors.torch import load_file

    d = tmp_path / "data" / "1_x"
    for k in range(2):
        arr = rgba_image(d / f"{k}.png", (64, 64), seed=k)
        arr[..., 3] = 0
        Image.fromarray(arr, "RGBA").save(d / f"{k}.png")

    def train(name, *extra):
        trainer = train_network.trainer()
        path = run(trainer, train_network.setup_parser(), [
            "--pretrained_model_name_or_path", str(tiny_sd1_single_file),
            "--tokenizer_cache_dir", str(tiny_sd1_single_file.parent / "tokenizers"),
            "--train_data_dir", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"), "--output_name", name,
            "--network_module", "networks.lora", "--network_dim", "4", "--resolution", "64", "--learning_rate",
            "1e-2", "--max_train_steps", "2", "--max_data_loader_n_workers", "0", "--seed", "3",
            "--network_train_unet_only", *extra])
        ups = [v for k, v in load_file(path).items() if "lora_up" in k]
        return trainer.losses, ups

    losses, ups = train("masked", "--alpha_mask", "--masked_loss")
    assert losses == [0.0, 0.0]
    assert all(torch.count_nonzero(u) == 0 for u in ups)
    losses, ups = train("plain")
    assert all(x > 0 for x in losses) and any(torch.count_nonzero(u) > 0 for u in ups)


# ----------------------------------------------------------------------------- latent caches <-> upstream


def test_upstream_written_sdxl_cache_is_reused(tmp_path):
    d = tmp_path / "t" / "1_x"
    rgba_image(d / "a.png", (150, 100))
    argv = ("--train_data_dir", tmp_path / "t", "--resolution", "128", "--enable_bucket", "--min_bucket_reso", "64",
            "--max_bucket_reso", "256", "--flip_aug", "--alpha_mask", "--cache_latents_to_disk")
    group = build_dataset_group(parse(*argv), "sdxl")
    bucket = group.datasets[0].images[0].bucket
    h, w = bucket[1] // 8, bucket[0] // 8
    # what upstream's SdSdxlLatentsCachingStrategy writes (np.savez, its key names, unscaled VAE sample)
    raw, raw_f = np.random.rand(4, h, w).astype(np.float32), np.random.rand(4, h, w).astype(np.float32)
    alpha = np.random.rand(bucket[1], bucket[0]).astype(np.float32)
    ltrb = buckets.crop_ltrb(bucket, (150, 100))
    np.savez(d / "a_0150x0100_sdxl.npz", latents=raw, original_size=np.array((150, 100)), crop_ltrb=np.array(ltrb),
             latents_flipped=raw_f, alpha_mask=alpha)
    calls = []
    group.cache_latents(avgpool(calls), to_disk=True, signature="ours", fmt=FAMILY_FORMATS["sdxl"])
    assert calls == []  # reused, although it has no signature of ours
    for epoch in range(6):
        group.set_current_epoch(epoch)
        b = group[0]
        flipped = b["flippeds"][0]
        assert torch.allclose(b["latents"][0], torch.from_numpy(raw_f if flipped else raw) * 0.13025)
        exp_mask = alpha[:, ::-1] if flipped else alpha
        assert torch.allclose(b["alpha_masks"][0], torch.from_numpy(exp_mask.copy()))
        left = bucket[0] - ltrb[2] if flipped else ltrb[0]
        assert b["crop_top_lefts"].tolist() == [[int(ltrb[1]), int(left)]]
        assert b["original_sizes_hw"].tolist() == [[100, 150]]
    # a file lacking what this run needs (alpha_mask) is encoded again, unless --skip_cache_check
    np.savez(d / "a_0150x0100_sdxl.npz", latents=raw, original_size=np.array((150, 100)), crop_ltrb=np.array(ltrb),
             latents_flipped=raw_f)
    group.cache_latents(avgpool(calls), to_disk=True, fmt=FAMILY_FORMATS["sdxl"], skip_check=True)
    assert calls == []
    group.cache_latents(avgpool(calls), to_disk=True, fmt=FAMILY_FORMATS["sdxl"])
    assert calls == [1, 1]
    # upstream's older name <stem>.npz wins when it exists (SD/SDXL)
    os.replace(d / "a_0150x0100_sdxl.npz", d / "a.npz")
    calls.clear()
    group.cache_latents(avgpool(calls), to_disk=True, fmt=FAMILY_FORMATS["sdxl"])
    assert calls == [] and group.datasets[0].images[0].latents_npz == str(d / "a.npz")


def upstream_reader(npz_path, bucket, flip_aug, alpha_mask, multi_resolution):
    """Upstream's is_disk_cached_latents_expected + load_latents_from_disk, written from its rules."""
    suffix = f"_{bucket[1] // 8}x{bucket[0] // 8}" if multi_resolution else ""
    npz = np.load(npz_path)
    assert "latents" + suffix in npz
    assert not flip_aug or "latents_flipped" + suffix in npz
    assert not alpha_mask or "alpha_mask" + suffix in npz
    return (npz["latents" + suffix], npz["original_size" + suffix].tolist(), npz["crop_ltrb" + suffix].tolist(),
            npz.get("latents_flipped" + suffix), npz.get("alpha_mask" + suffix))


@pytest.mark.parametrize("family", ["sd1", "sdxl", "flux"])
def test_our_cache_files_are_what_upstream_reads(tmp_path, family):
    d = tmp_path / "t" / "1_x"
    arr = rgba_image(d / "a.png", (150, 100))
    argv = ("--train_data_dir", tmp_path / "t", "--resolution", "128", "--enable_bucket", "--min_bucket_reso", "64",
            "--max_bucket_reso", "256", "--flip_aug", "--alpha_mask", "--cache_latents_to_disk",
            "--vae_batch_size", "2")
    group = build_dataset_group(parse(*argv), family)
    fmt = FAMILY_FORMATS[family]
    calls = []
    group.cache_latents(avgpool(calls), to_disk=True, fmt=fmt)
    info = group.datasets[0].images[0]
    suffix = {"sd1": "_sd.npz", "sdxl": "_sdxl.npz", "flux": "_flux.npz"}[family]
    path = d / f"a_0150x0100{suffix}"
    assert info.latents_npz == str(path)
    lat, original, ltrb, lat_f, alpha = upstream_reader(path, info.bucket, True, True, family == "flux")
    ours = group[0]
    # upstream's npz holds the VAE sample before scaling (SD/SDXL) or the AE output (FLUX)
    scale = {"sd1": 0.18215, "sdxl": 0.13025, "flux": 1.0}[family]
    in_file = lat_f if ours["flippeds"][0] else lat
    assert torch.allclose(torch.from_numpy(in_file) * scale, ours["latents"][0], atol=1e-6)
    assert not np.allclose(lat, lat_f)
    assert original == [150, 100] and tuple(ltrb) == pytest.approx(buckets.crop_ltrb(info.bucket, (150, 100)))
    assert lat.shape == (3, info.bucket[1] // 8, info.bucket[0] // 8) and lat_f.shape == lat.shape
    assert alpha.shape == (info.bucket[1], info.bucket[0]) and alpha.dtype == np.float32
    resized = info.resized_size
    box = buckets.trim_box(resized, info.bucket)
    exp_alpha = np.asarray(Image.fromarray(arr).resize(resized, Image.LANCZOS))[..., 3]  # upscaled: PIL lanczos
    assert np.allclose(alpha, exp_alpha[box[1]:box[3], box[0]:box[2]] / 255.0, atol=1e-6)
    if family == "flux":  # another resolution adds its own keys to the same file, as upstream does
        group = build_dataset_group(parse(*argv[:3], "64", *argv[4:]), family)
        group.cache_latents(avgpool(calls), to_disk=True, fmt=fmt)
        b2 = group.datasets[0].images[0].bucket
        with np.load(path) as npz:
            assert f"latents_{b2[1] // 8}x{b2[0] // 8}" in npz and f"latents_{h8(info)}" in npz


def h8(info):
    return f"{info.bucket[1] // 8}x{info.bucket[0] // 8}"


def test_vae_batch_size_batches_the_cache(tmp_path):
    d = tmp_path / "t" / "1_x"
    for k in range(5):
        rgba_image(d / f"{k}.png", (64, 64), seed=k)
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64"), "sd1")
    calls = []
    group.cache_latents(avgpool(calls), batch_size=2)
    assert calls == [2, 2, 1]
    calls.clear()
    group.cache_latents(avgpool(calls), batch_size=1)  # upstream's default --vae_batch_size
    assert calls == [1] * 5
    assert parse().vae_batch_size == 1 and parse().skip_cache_check is False


# ----------------------------------------------------------------------------- text-encoder caches <-> upstream


def test_text_encoder_caches_in_upstreams_layout(tmp_path):
    from library import te_cache

    d = tmp_path / "t" / "1_x"
    for k in range(2):
        rgba_image(d / f"{k}.png", (64, 64), seed=k)
        (d / f"{k}.caption").write_text(f"caption {k}")
    calls = []

    def encode_sdxl(captions):
        calls.append(len(captions))
        n = torch.tensor([float(len(c)) for c in captions])
        return {"encoder_hidden_states": n[:, None, None] + torch.arange(12.0).expand(len(captions), 5, 12),
                "pooled": n[:, None].expand(-1, 7).clone()}

    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64",
                                      "--cache_text_encoder_outputs_to_disk", "--train_batch_size", "2"), "sdxl")
    fmt = te_cache.sdxl_format(4)  # TE1 width 4 of the 12 concatenated features
    group.cache_text_encoder_outputs(encode_sdxl, to_disk=True, signature="s", fmt=fmt)
    assert calls == [2]  # the training batch size (upstream's default)
    with np.load(d / "0_te_outputs.npz") as npz:  # what upstream's SDXL reader needs
        assert npz["hidden_state1"].shape == (5, 4) and npz["hidden_state2"].shape == (5, 8)
        assert npz["pool2"].shape == (7,) and npz["hidden_state2"][0, 0] == len("caption 0") + 4
    b = group[0]
    assert torch.equal(b["te_outputs"]["encoder_hidden_states"][0], encode_sdxl([b["captions"][0]])[
        "encoder_hidden_states"][0])
    # a file written by upstream (its keys only) is reused as it is
    np.savez(d / "1_te_outputs.npz", hidden_state1=np.ones((5, 4), np.float32),
             hidden_state2=np.full((5, 8), 2, np.float32), pool2=np.full((7,), 3, np.float32))
    calls.clear()
    group.cache_text_encoder_outputs(encode_sdxl, to_disk=True, signature="s", fmt=fmt)
    assert calls == []
    loaded = fmt.load(str(d / "1_te_outputs.npz"))
    assert loaded["encoder_hidden_states"].shape == (5, 12) and loaded["pooled"].tolist() == [3.0] * 7

    def encode_flux(captions):
        calls.append(len(captions))
        return {"t5_out": torch.rand(len(captions), 6, 10), "pooled": torch.rand(len(captions), 7),
                "t5_attn_mask": torch.ones(len(captions), 6, dtype=torch.long)}

    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64",
                                      "--cache_text_encoder_outputs_to_disk"), "flux")
    calls.clear()
    group.cache_text_encoder_outputs(encode_flux, to_disk=True, batch_size=1, fmt=te_cache.flux_format(True))
    assert calls == [1, 1]  # --text_encoder_batch_size 1
    with np.load(d / "0_flux_te.npz") as npz:
        assert {"l_pooled", "t5_out", "txt_ids", "t5_attn_mask", "apply_t5_attn_mask"} <= set(npz.files)
        assert npz["txt_ids"].shape == (6, 3) and bool(npz["apply_t5_attn_mask"])
    calls.clear()
    group.cache_text_encoder_outputs(encode_flux, to_disk=True, fmt=te_cache.flux_format(True))
    assert calls == []
    group.cache_text_encoder_outputs(encode_flux, to_disk=True, fmt=te_cache.flux_format(False))
    assert calls == [1, 1]  # upstream re-encodes when apply_t5_attn_mask differs
    calls.clear()
    group.cache_text_encoder_outputs(encode_flux, to_disk=True, fmt=te_cache.flux_format(True), skip_check=True)
    assert calls == []  # --skip_cache_check: the files exist


@pytest.mark.slow
def test_sdxl_run_writes_upstream_cache_files_and_reuses_them(tmp_path, tiny_sdxl_single_file, one_thread):
    """One SDXL LoRA step with both disk caches: upstream's file names and keys (unscaled latents, split hidden
    states); a second run encodes nothing."""
    import sdxl_train_network
    from library import network_trainer
    from library.tiny_models import make_captioned_images

    data = make_captioned_images(tmp_path / "data", n=1, size=(64, 64), repeats=1, name="x")
    img = next((data / "1_x").glob("*.png"))

    def train(name):
        trainer = sdxl_train_network.trainer()
        network_trainer.run(trainer, sdxl_train_network.setup_parser(), [
            "--pretrained_model_name_or_path", str(tiny_sdxl_single_file),
            "--tokenizer_cache_dir", str(tiny_sdxl_single_file.parent / "tokenizers"),
            "--train_data_dir", str(data), "--output_dir", str(tmp_path / "out"), "--output_name", name,
            "--network_module", "networks.lora", "--network_dim", "4", "--resolution", "64",
            "--max_train_steps", "1", "--max_data_loader_n_workers", "0", "--network_train_unet_only",
            "--cache_latents_to_disk", "--cache_text_encoder_outputs_to_disk", "--vae_batch_size", "4"])
        return trainer

    train("first")
    lat_file = img.with_name(img.stem + "_0064x0064_sdxl.npz")
    te_file = img.with_name(img.stem + "_te_outputs.npz")
    with np.load(lat_file) as npz:
        assert npz["latents"].shape == (4, 8, 8) and npz["original_size"].tolist() == [64, 64]
        assert npz["crop_ltrb"].tolist() == [0, 0, 64, 64]
    with np.load(te_file) as npz:
        assert {"hidden_state1", "hidden_state2", "pool2"} <= set(npz.files)
        assert npz["hidden_state1"].shape[0] == npz["hidden_state2"].shape[0] == 77 and npz["pool2"].ndim == 1
    mtimes = (lat_file.stat().st_mtime_ns, te_file.stat().st_mtime_ns)
    train("second")
    assert (lat_file.stat().st_mtime_ns, te_file.stat().st_mtime_ns) == mtimes  # reused, not written again

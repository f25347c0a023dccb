"""The image side of the data pipeline against kohya-ss/sd-scripts' rules: bucket lists and choice (with and without
bucket_no_upscale), resize filters (cv2 INTER_AREA when shrinking), SDXL crop conditioning (upstream's fit-inside
offset), SDXL size embeddings in float32, face crops, cache_info and the dataset-config keys of the image options.
Reference values are upstream's formulas, written here from its rules."""
from __future__ import annotations

import argparse
import json
import math

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from library import buckets, image_utils
from library.config_util import CONTROLNET, DREAMBOOTH, FINETUNING, add_dataset_arguments, build_dataset_group
from library.datasets import DatasetError


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_dataset_arguments(parser)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--masked_loss", action="store_true")
    return parser.parse_args([str(a) for a in argv])


def gradient_image(path, size, alpha=None):
    w, h = size
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]
    arr[..., 1] = (np.arange(w)[None, :] * 7 + np.arange(h)[:, None] * 13) % 256
    arr[..., 2] = np.linspace(0, 255, h, dtype=np.uint8)[:, None]
    if alpha is not None:
        arr = np.concatenate([arr, alpha[..., None]], axis=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path)
    return arr


# ----------------------------------------------------------------------------- upstream's formulas (reference)


def upstream_buckets(max_reso, min_size, max_size, divisible):
    area = max_reso[0] * max_reso[1]
    out = {(int(math.sqrt(area) // divisible) * divisible,) * 2}
    for width in range(min_size, max_size + 1, divisible):
        height = min(max_size, int((area // width) // divisible) * divisible)
        if height >= min_size:
            out |= {(width, height), (height, width)}
    return sorted(out)


def upstream_select(resos, w, h):
    ar = w / h
    if (w, h) in resos:
        reso = (w, h)
    else:
        reso = resos[int(np.abs(np.array([a / b for a, b in resos]) - ar).argmin())]
    scale = reso[1] / h if ar > reso[0] / reso[1] else reso[0] / w
    return reso, (int(w * scale + 0.5), int(h * scale + 0.5))


# ----------------------------------------------------------------------------- buckets


def test_bucket_lists_match_upstream():
    for args in [((1024, 1024), 256, 1024, 64), ((1024, 1024), 256, 2048, 64), ((512, 512), 256, 1024, 64),
                 ((768, 512), 320, 960, 32), ((1024, 1024), 512, 1536, 16)]:
        assert buckets.make_bucket_resolutions(*args) == upstream_buckets(*args)
    sdxl = buckets.make_bucket_resolutions((1024, 1024), 256, 2048, 64)
    assert (832, 1216) in sdxl and (1216, 832) in sdxl and (2048, 512) in sdxl and (1024, 1024) in sdxl


def test_bucket_selection_matches_upstream():
    resos = buckets.make_bucket_resolutions((1024, 1024), 256, 1024, 64)
    sel = buckets.BucketSelector((1024, 1024), 64, predefined=resos)
    for w, h in [(1000, 600), (600, 1000), (1024, 1024), (1500, 1000), (333, 777), (4000, 1000), (96, 48),
                 (640, 960), (1003, 1000)]:
        reso, resized, _ = sel.select(w, h)
        assert (reso, resized) == upstream_select(resos, w, h), (w, h)
        assert resized[0] >= reso[0] and resized[1] >= reso[1]  # covers the bucket
    # a tie in |ratio error| goes to the first bucket in sorted order (numpy argmin), not the larger one
    tie = buckets.BucketSelector((128, 128), 64, predefined=buckets.make_bucket_resolutions((128, 128), 64, 256, 64))
    assert tie.select(96, 48)[0] == (128, 128)


def test_bucket_no_upscale_rounding_matches_upstream():
    sel = buckets.BucketSelector((1024, 1024), 64, no_upscale=True)
    # larger than the max area: shrink keeping the aspect, round the side that keeps it best (upstream)
    assert sel.select(2000, 1000)[:2] == ((1408, 704), (1408, 704))
    rw = math.sqrt(1024 * 1024 * 1.5)  # 1254.1 -> rounded to steps: 1216 (int(x + 0.5) then down to 64)
    assert buckets.round_to_steps(rw, 64) == 1216
    reso, resized, _ = sel.select(3000, 2000)
    assert reso[0] * reso[1] <= 1024 * 1024 and reso[0] % 64 == 0 and reso[1] % 64 == 0
    assert resized in ((1216, int(1216 / 1.5 + 0.5)), (int(832 * 1.5 + 0.5), 832))
    # smaller images are never enlarged: the bucket is their size rounded down
    assert sel.select(500, 300)[:2] == ((448, 256), (500, 300))
    assert sel.select(1024, 1024)[:2] == ((1024, 1024), (1024, 1024))


def test_min_max_bucket_reso_are_adjusted_like_upstream(tmp_path):
    gradient_image(tmp_path / "t" / "1_x" / "a.png", (100, 60))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "128", "--enable_bucket",
                                      "--min_bucket_reso", "70", "--max_bucket_reso", "200"), "sd1")
    p = group.datasets[0].params
    assert (p.min_bucket_reso, p.max_bucket_reso) == (64, 256)


# ----------------------------------------------------------------------------- crop conditioning


@pytest.mark.parametrize("bucket,size,expected,flipped_left", [
    ((1024, 1024), (1500, 1000), (170, 0), 0),  # wider image: fitted 1024x682.7, top (1024-682.7)//2
    ((1216, 832), (1000, 1000), (0, 192), 192),  # wider bucket: fitted 832x832, left 192
    ((1216, 832), (1003, 1000), (0, 190), 191),  # float box: left 190.0, right 1024.496 -> flipped int(191.5)
])
def test_crop_conditioning_is_upstreams_fit_inside_offset(bucket, size, expected, flipped_left):
    ltrb = buckets.crop_ltrb(bucket, size)
    assert buckets.crop_top_left(ltrb, bucket[0], False) == expected
    assert buckets.crop_top_left(ltrb, bucket[0], True) == (expected[0], flipped_left)


def test_dataset_sdxl_conditioning_with_buckets_and_flip(tmp_path):
    gradient_image(tmp_path / "t" / "1_x" / "a.png", (150, 100))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "128", "--enable_bucket",
                                      "--min_bucket_reso", "64", "--max_bucket_reso", "256", "--flip_aug"), "sdxl")
    info = group.datasets[0].images[0]
    ltrb = buckets.crop_ltrb(info.bucket, (150, 100))
    seen = set()
    for epoch in range(10):
        group.set_current_epoch(epoch)
        b = group[0]
        flipped = b["flippeds"][0]
        seen.add(flipped)
        assert b["original_sizes_hw"].tolist() == [[100, 150]]
        assert b["target_sizes_hw"].tolist() == [[info.bucket[1], info.bucket[0]]]
        left = info.bucket[0] - ltrb[2] if flipped else ltrb[0]
        assert b["crop_top_lefts"].tolist() == [[int(ltrb[1]), int(left)]]
    assert seen == {True, False}


def test_no_bucket_exact_size_and_random_crop_condition_like_upstream(tmp_path):
    gradient_image(tmp_path / "t" / "1_x" / "a.png", (64, 64))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64", "--flip_aug"), "sdxl")
    for epoch in range(8):  # upstream: uncropped; a flipped image counts from the right edge of a 0-wide box
        group.set_current_epoch(epoch)
        b = group[0]
        assert b["original_sizes_hw"].tolist() == [[64, 64]]
        assert b["crop_top_lefts"].tolist() == [[0, 64 if b["flippeds"][0] else 0]]
    # random_crop without buckets cuts the larger image without resizing it
    arr = gradient_image(tmp_path / "r" / "1_x" / "a.png", (96, 80))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "r", "--resolution", "64", "--random_crop"), "sdxl")
    img = ((group[0]["images"][0] + 1) * 127.5).round().permute(1, 2, 0).numpy().astype(np.uint8)
    found = [(t, l) for t in range(17) for l in range(33) if np.array_equal(arr[t:t + 64, l:l + 64], img)]
    assert len(found) == 1
    assert group[0]["crop_top_lefts"].tolist() == [[0, 0]] and group[0]["original_sizes_hw"].tolist() == [[64, 64]]


def test_sdxl_size_embeddings_are_float32_integers():
    import sdxl_train_network

    seen = {}

    class FakeUNet:
        def __call__(self, x, t, hidden, added_cond_kwargs):
            seen.update(added_cond_kwargs)
            return type("Out", (), {"sample": x})()

    comps = type("C", (), {"denoiser": FakeUNet()})()
    batch = {"original_sizes_hw": torch.tensor([[1023, 1001]]), "crop_top_lefts": torch.tensor([[3, 257]]),
             "target_sizes_hw": torch.tensor([[1024, 1024]])}
    te = {"pooled": torch.zeros(1, 8), "encoder_hidden_states": torch.zeros(1, 4, 8)}
    trainer = sdxl_train_network.trainer()
    trainer.family.predict(None, comps, torch.zeros(1, 4, 8, 8, dtype=torch.bfloat16), torch.tensor([1]), te, batch,
                      torch.bfloat16)
    time_ids = seen["time_ids"]
    assert time_ids.dtype == torch.float32  # in bf16, 1023 -> 1024 and 1001 -> 1000
    assert time_ids.tolist() == [[1023, 1001, 3, 257, 1024, 1024]]

    # diffusers' add_time_proj over float32 sizes = upstream's timestep_embedding (cos first, max period 10000)
    from diffusers.models.embeddings import Timesteps

    proj = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
    x = time_ids.flatten()
    freqs = torch.exp(-math.log(10000) * torch.arange(128, dtype=torch.float32) / 128)
    ref = torch.cat([torch.cos(x[:, None] * freqs), torch.sin(x[:, None] * freqs)], dim=-1)
    assert torch.allclose(proj(x), ref, atol=1e-5)
    bf16_sizes = proj(x.to(torch.bfloat16))
    assert not torch.allclose(bf16_sizes, ref, atol=1e-2)  # what casting the sizes first would have done


# ----------------------------------------------------------------------------- resizing


def test_resize_filters_are_upstreams(monkeypatch):
    img = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    calls = []
    real = cv2.resize
    monkeypatch.setattr(cv2, "resize", lambda a, size, interpolation: calls.append(interpolation) or real(
        a, size, interpolation=interpolation))
    out = image_utils.resize_image(img, (30, 20))  # shrink: cv2 INTER_AREA
    assert calls == [cv2.INTER_AREA] and np.array_equal(out, real(img, (30, 20), interpolation=cv2.INTER_AREA))
    calls.clear()
    out = image_utils.resize_image(img, (90, 60))  # enlarge: PIL LANCZOS
    assert calls == [] and np.array_equal(out, np.asarray(Image.fromarray(img).resize((90, 60), Image.LANCZOS)))
    for name, flag in [("bicubic", cv2.INTER_CUBIC), ("cubic", cv2.INTER_CUBIC), ("bilinear", cv2.INTER_LINEAR),
                       ("nearest", cv2.INTER_NEAREST_EXACT), ("area", cv2.INTER_AREA)]:
        calls.clear()
        image_utils.resize_image(img, (90, 60), name)
        assert calls == [flag], name
    calls.clear()
    out = image_utils.resize_image(img, (30, 20), "lanczos")
    assert calls == [] and np.array_equal(out, np.asarray(Image.fromarray(img).resize((30, 20), Image.LANCZOS)))
    out = image_utils.resize_image(img, (30, 20), "box")
    assert np.array_equal(out, np.asarray(Image.fromarray(img).resize((30, 20), Image.BOX)))


def test_dataset_shrinks_with_inter_area_and_honours_resize_interpolation(tmp_path):
    arr = gradient_image(tmp_path / "t" / "1_x" / "a.png", (200, 100))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64"), "sd1")
    img = ((group[0]["images"][0] + 1) * 127.5).round().permute(1, 2, 0).numpy().astype(np.uint8)
    expected = cv2.resize(arr, (128, 64), interpolation=cv2.INTER_AREA)[:, 32:96]
    assert np.array_equal(img, expected)
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64",
                                      "--resize_interpolation", "bicubic"), "sd1")
    img = ((group[0]["images"][0] + 1) * 127.5).round().permute(1, 2, 0).numpy().astype(np.uint8)
    assert np.array_equal(img, cv2.resize(arr, (128, 64), interpolation=cv2.INTER_CUBIC)[:, 32:96])
    with pytest.raises(SystemExit):
        parse("--resize_interpolation", "box")  # upstream's CLI choices lack box; its dataset config has it


# ----------------------------------------------------------------------------- face crop


def test_face_crop_plan_matches_upstream():
    rng = __import__("random").Random(0)
    # range 2..2: the face spans half the target at most, never enlarged: scale 1, face centred
    assert image_utils.face_crop_plan((1000, 800), (256, 256), (500, 400, 100, 100), (2.0, 2.0), False, rng) == (
        (1000, 800), (372, 272, 628, 528))
    # range 4..4: scale 256 / 400 = 0.64 -> 640x512, face at (320, 256)
    assert image_utils.face_crop_plan((1000, 800), (256, 256), (500, 400, 100, 100), (4.0, 4.0), False, rng) == (
        (640, 512), (192, 128, 448, 384))
    # a range: the scale is drawn between the two, the crop stays inside the image
    for _ in range(20):
        (w, h), (l, t, r, b) = image_utils.face_crop_plan((1000, 800), (256, 256), (500, 400, 100, 100),
                                                          (2.0, 4.0), True, rng)
        assert 640 <= w <= 1000 and 0 <= l and r <= w and 0 <= t and b <= h and (r - l, b - t) == (256, 256)
    assert image_utils.face_info_from_name("/x/img_500_400_100_90.png") == (500, 400, 100, 90)
    assert image_utils.face_info_from_name("/x/my_cat_photo.png") == (0, 0, 0, 0)
    assert image_utils.parse_face_crop_aug_range("2.0,4.0", "x") == (2.0, 4.0)
    from library.metadata import _face_crop_range

    assert str(_face_crop_range("2,4")) == "(2.0, 4.0)"  # ss_face_crop_aug_range as upstream writes it
    assert image_utils.parse_face_crop_aug_range([2, 3.5], "x") == (2.0, 3.5)
    for bad in ("4,2", "2", "a,b", [1, 2, 3]):
        with pytest.raises(DatasetError, match="face_crop_aug_range"):
            image_utils.parse_face_crop_aug_range(bad, "x")


def test_dataset_face_crop(tmp_path):
    arr = gradient_image(tmp_path / "t" / "1_x" / "img_500_400_100_100.png", (1000, 800))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "256",
                                      "--face_crop_aug_range", "4.0,4.0"), "sd1")
    b = group[0]
    img = ((b["images"][0] + 1) * 127.5).round().permute(1, 2, 0).numpy().astype(np.uint8)
    expected = cv2.resize(arr, (640, 512), interpolation=cv2.INTER_AREA)[128:384, 192:448]
    assert np.array_equal(img, expected)
    assert b["original_sizes_hw"].tolist() == [[256, 256]] and b["crop_top_lefts"].tolist() == [[0, 0]]
    with pytest.raises(DatasetError, match="face_crop_aug_range"):
        build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--face_crop_aug_range", "4,1"), "sd1")


# ----------------------------------------------------------------------------- dataset config keys, cache_info


def test_image_keys_in_dataset_config_at_upstreams_levels(tmp_path):
    gradient_image(tmp_path / "img" / "a.png", (64, 64))
    (tmp_path / "cond").mkdir()
    gradient_image(tmp_path / "cond" / "a.png", (64, 64))

    def load(text, *flags):
        cfg = tmp_path / "d.toml"
        cfg.write_text(text)
        kinds = (DREAMBOOTH, FINETUNING) + ((CONTROLNET,) if "--masked_loss" in flags else ())  # as the trainers
        return build_dataset_group(parse("--dataset_config", cfg, *flags), "sd1", kinds)

    g = load('[general]\nresize_interpolation = "box"\ncache_info = true\nface_crop_aug_range = [2.0, 3.0]\n'
             '[[datasets]]\nresolution = 64\nresize_interpolation = "area"\n'
             '[[datasets.subsets]]\nimage_dir = "img"\nalpha_mask = true\nresize_interpolation = "nearest"\n')
    s = g.datasets[0].params.subsets[0]
    assert (s.resize_interpolation, s.cache_info, s.face_crop_aug_range, s.alpha_mask) == (
        "nearest", True, (2.0, 3.0), True)
    # --alpha_mask reaches every subset (as upstream's argparse fallback)
    g = load('[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "img"\n', "--alpha_mask")
    assert g.datasets[0].params.subsets[0].alpha_mask
    g = load('[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "img"\nconditioning_data_dir = "cond"\n',
             "--masked_loss")
    assert g.datasets[0].images[0].cond_path == str(tmp_path / "cond" / "a.png")
    for bad, match in [('[general]\nalpha_mask = true\n', "alpha_mask.*subsets"),
                       ('[general]\nconditioning_data_dir = "cond"\n', "conditioning_data_dir.*subsets"),
                       ('[general]\nresize_interpolation = "fancy"\n', "resize_interpolation must be one of"),
                       ('[general]\nface_crop_aug_range = "2,3"\n', "face_crop_aug_range")]:
        with pytest.raises(DatasetError, match=match):
            load(bad + '[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "img"\n')
    with pytest.raises(DatasetError, match="needs --masked_loss"):
        load('[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = "img"\nconditioning_data_dir = "cond"\n')


def test_cache_info_writes_and_reads_upstreams_file(tmp_path):
    d = tmp_path / "t" / "1_x"
    gradient_image(d / "a.png", (64, 48))
    (d / "a.caption").write_text("a cat")
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64", "--cache_info"), "sd1")
    meta = json.loads((d / "metadata_cache.json").read_text())
    assert meta == {str(d / "a.png"): {"caption": "a cat", "resolution": [64, 48]}}
    # the next run takes captions and sizes from the file (as upstream; it does not look at the folder again)
    meta[str(d / "a.png")] = {"caption": "from the cache", "resolution": [64, 48]}
    (d / "metadata_cache.json").write_text(json.dumps(meta))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64", "--cache_info"), "sd1")
    assert group.datasets[0].images[0].caption == "from the cache"
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "64"), "sd1")
    assert group.datasets[0].images[0].caption == "a cat"


def test_bucket_reso_steps_multiple_per_script(tmp_path):
    import flux_train
    import flux_train_network
    import sdxl_train_network

    # upstream's verify_bucket_reso_steps: 64 SD1.x/2.x, 32 SDXL and the FLUX LoRA, 16 the FLUX fine-tune
    import train_network

    assert [m.trainer().bucket_reso_steps_multiple for m in (train_network, sdxl_train_network, flux_train_network,
                                                              flux_train)] == [64, 32, 32, 16]
    gradient_image(tmp_path / "t" / "1_x" / "a.png", (100, 60))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "128", "--enable_bucket",
                                      "--min_bucket_reso", "64", "--max_bucket_reso", "256", "--bucket_reso_steps",
                                      "32"), "sd1")
    group.verify_bucket_reso_steps(32)
    with pytest.raises(DatasetError, match="bucket_reso_steps is 32: this script needs a multiple of 64"):
        group.verify_bucket_reso_steps(64)
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "t", "--resolution", "72"), "flux")
    with pytest.raises(DatasetError, match="multiples of 16"):  # FLUX packs 2x2 latent patches
        group.verify_bucket_reso_steps(16)

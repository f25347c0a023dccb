"""Data layer: folders, captions, buckets, dataset TOML, reg images, in_json + merge tool, caches, prompts."""
import argparse
import json
import math
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from library import train_util
from library.config_util import add_dataset_arguments, build_dataset_group, load_dataset_config
from library.datasets import DatasetError, make_bucket_resolutions, make_dataloader
from library.sample_prompts import PromptFileError, parse_prompt_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MERGE_TOOL = os.path.join(REPO, "sd-scripts", "finetune", "merge_captions_to_metadata.py")


def make_image(path, size, color=(200, 30, 60)):
    """A small image with a gradient so crops/flips differ."""
    w, h = size
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None, :]
    arr[..., 1] = color[1]
    arr[..., 2] = np.linspace(0, 255, h, dtype=np.uint8)[:, None]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(arr).save(path)
    return path


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_dataset_arguments(parser)
    parser.add_argument("--seed", type=int, default=1)
    return train_util.normalise_args(parser.parse_args([str(a) for a in argv]))


def all_batches(group):
    return [group[i] for i in range(len(group))]


BUCKET_ARGS = ("--resolution", "128", "--enable_bucket", "--min_bucket_reso", "64", "--max_bucket_reso", "256")


# ----------------------------------------------------------------------------- flags


def test_flags_and_kohya_defaults():
    a = parse()
    assert a.caption_extension == ".caption"
    assert (a.min_bucket_reso, a.max_bucket_reso, a.bucket_reso_steps) == (256, 1024, 64)
    assert a.train_batch_size == 1 and a.max_data_loader_n_workers == 8 and a.dataset_repeats == 1
    assert a.prior_loss_weight == 1.0 and a.keep_tokens == 0 and a.caption_dropout_rate == 0.0
    assert a.resolution is None and not a.enable_bucket and not a.cache_latents
    a = parse("--train_data_dir", "d", "--reg_data_dir", "r", "--dataset_config", "c.toml", "--in_json", "m.json",
              "--caption_extension", ".txt", "--resolution", "1024,768", "--enable_bucket", "--min_bucket_reso", "320",
              "--max_bucket_reso", "2048", "--bucket_reso_steps", "32", "--bucket_no_upscale", "--shuffle_caption",
              "--keep_tokens", "2", "--caption_dropout_rate", "0.1", "--flip_aug", "--color_aug", "--random_crop",
              "--train_batch_size", "4", "--max_data_loader_n_workers", "0", "--persistent_data_loader_workers",
              "--dataset_repeats", "3", "--prior_loss_weight", "0.5", "--cache_latents", "--cache_latents_to_disk",
              "--cache_text_encoder_outputs", "--cache_text_encoder_outputs_to_disk", "--class_tokens", "sks dog")
    assert a.resolution == "1024,768" and a.bucket_reso_steps == 32 and a.train_batch_size == 4
    assert a.class_tokens == "sks dog" and a.cache_text_encoder_outputs_to_disk and a.prior_loss_weight == 0.5


# ----------------------------------------------------------------------------- folders and captions


def test_repeats_and_captions_only_from_caption_extension(tmp_path):
    """Upstream's rule: the --caption_extension file (first line), else the folder's class tokens; a file with
    another extension is never read."""
    d = tmp_path / "train" / "3_sks cat"
    make_image(str(d / "a.png"), (64, 64))
    write(str(d / "a.caption"), "a photo of sks cat\nsecond line ignored")
    make_image(str(d / "b.jpg"), (64, 64))
    write(str(d / "b.txt"), "sks cat on a sofa")  # not read: --caption_extension is .caption
    make_image(str(d / "c.png"), (64, 64))  # no caption: the folder's class tokens
    write(str(d / "notes.md"), "not an image")
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64",
                                      "--train_batch_size", "2"), "sd1")
    assert group.num_train_images == 9 and group.num_reg_images == 0
    assert len(group) == math.ceil(9 / 2)
    counts = Counter()
    for batch in all_batches(group):
        assert batch["images"].shape[1:] == (3, 64, 64)
        assert batch["images"].min() >= -1 and batch["images"].max() <= 1
        counts.update(batch["captions"])
    assert counts == {"a photo of sks cat": 3, "sks cat": 6}

    # --caption_extension txt: only .txt files; the deprecated --caption_extention spelling wins when given
    write(str(d / "a.txt"), "from txt")
    for flag in ("--caption_extension", "--caption_extention"):
        group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64",
                                          flag, "txt"), "sd1")
        caps = Counter(c for b in all_batches(group) for c in b["captions"])
        assert caps == {"from txt": 3, "sks cat on a sofa": 3, "sks cat": 3}

    # a folder named '3_' has no class tokens: an image without a caption file gets an empty caption
    d2 = tmp_path / "train2" / "3_"
    make_image(str(d2 / "x.png"), (64, 64))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train2", "--resolution", "64"), "sd1")
    assert {c for b in all_batches(group) for c in b["captions"]} == {""}
    # an empty (0-byte) caption file is an error naming it, as upstream
    write(str(d2 / "x.caption"), "")
    with pytest.raises(DatasetError, match="caption file is empty: .*x.caption"):
        build_dataset_group(parse("--train_data_dir", tmp_path / "train2", "--resolution", "64"), "sd1")


def test_folders_without_repeat_prefix_are_ignored_as_upstream(tmp_path, caplog):
    make_image(str(tmp_path / "train" / "5_ok" / "a.png"), (64, 64))
    make_image(str(tmp_path / "train" / "cats" / "a.png"), (64, 64))
    make_image(str(tmp_path / "train" / "0_off" / "a.png"), (64, 64))
    with caplog.at_level("WARNING"):
        group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64"), "sd1")
    assert [s.name for s in group.datasets[0].params.subsets] == ["5_ok"] and group.num_train_images == 5
    assert "ignoring folders without a repeat count >= 1 ('N_name'): 0_off, cats" in caplog.text
    # nothing usable left: one error with the hint
    (tmp_path / "train" / "5_ok" / "a.png").unlink()
    (tmp_path / "train" / "5_ok").rmdir()
    with pytest.raises(DatasetError) as e:
        build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64"), "sd1")
    assert "'10_0_off'" in str(e.value) and "ignored: 0_off, cats" in str(e.value)


def test_config_subsets_with_zero_repeats_or_repeated_are_skipped(tmp_path):
    make_image(str(tmp_path / "a" / "x.png"), (64, 64))
    make_image(str(tmp_path / "b" / "y.png"), (64, 64))
    cfg = write(str(tmp_path / "ds.toml"), f"""
[general]
resolution = 64
[[datasets]]
  [[datasets.subsets]]
  image_dir = "{tmp_path / 'a'}"
  num_repeats = 2
  [[datasets.subsets]]
  image_dir = "{tmp_path / 'a'}"
  num_repeats = 7
  [[datasets.subsets]]
  image_dir = "{tmp_path / 'b'}"
  num_repeats = 0
""")
    group = build_dataset_group(parse("--dataset_config", cfg), "sd1")
    subsets = group.datasets[0].params.subsets
    assert [(s.image_dir, s.num_repeats) for s in subsets] == [(str(tmp_path / "a"), 2)]
    assert group.num_train_images == 2


def test_unreadable_image_names_the_file(tmp_path):
    make_image(str(tmp_path / "train" / "1_x" / "good.png"), (64, 64))
    bad = tmp_path / "train" / "1_x" / "broken.png"
    bad.write_bytes(b"this is not a png")
    with pytest.raises(DatasetError) as e:
        build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64"), "sdxl")
    assert str(bad) in str(e.value)


def test_empty_dataset_is_an_error(tmp_path):
    (tmp_path / "train" / "10_empty").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no training images"):
        build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64"), "sdxl")
    with pytest.raises(DatasetError, match="--train_data_dir"):
        build_dataset_group(parse("--resolution", "64"), "sdxl")
    with pytest.raises(DatasetError, match="does not exist"):
        build_dataset_group(parse("--train_data_dir", tmp_path / "missing"), "sdxl")


# ----------------------------------------------------------------------------- buckets


def test_bucketing_two_aspect_ratios(tmp_path):
    d = tmp_path / "train" / "2_mix"
    for k in range(3):
        make_image(str(d / f"wide{k}.png"), (96, 32))  # ratio 3: upstream picks by linear ratio error
        make_image(str(d / f"tall{k}.png"), (40, 88))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", *BUCKET_ARGS,
                                      "--train_batch_size", "4"), "sdxl")
    sizes = set()
    seen = 0
    for batch in torch.utils.data.DataLoader(group, batch_size=None, shuffle=True):  # items are whole batches
        imgs = batch["images"]
        b, _, h, w = imgs.shape
        seen += b
        assert h % 64 == 0 and w % 64 == 0 and 64 <= h <= 256 and 64 <= w <= 256 and h * w <= 128 * 128
        assert batch["target_sizes_hw"].tolist() == [[h, w]] * b  # never mixes buckets
        for (oh, ow), path in zip(batch["original_sizes_hw"].tolist(), batch["image_paths"]):
            assert (ow, oh) == Image.open(path).size
        sizes.add((w, h))
    assert seen == 12
    assert len(sizes) == 2
    (w1, h1), (w2, h2) = sorted(sizes)
    assert {w1 > h1, w2 > h2} == {True, False}  # one landscape, one portrait bucket
    info = json.loads(group.metadata()["ss_bucket_info"])
    assert sorted(b["count"] for b in info["buckets"].values()) == [6, 6]

    for reso in make_bucket_resolutions((1024, 1024), 256, 2048, 64):
        assert reso[0] % 64 == 0 and reso[1] % 64 == 0 and reso[0] * reso[1] <= 1024 * 1024
        assert 256 <= min(reso) and max(reso) <= 2048

    # bucket_no_upscale: small images keep their own (rounded-down) size
    make_image(str(tmp_path / "small" / "1_s" / "s.png"), (100, 70))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "small", *BUCKET_ARGS,
                                      "--bucket_no_upscale"), "sdxl")
    assert set(group.datasets[0].buckets) == {(64, 64)}
    # an image smaller than bucket_reso_steps has no bucket: a clear error (upstream divides by zero)
    with pytest.raises(DatasetError, match="smaller than bucket_reso_steps"):
        build_dataset_group(parse("--train_data_dir", tmp_path / "train", *BUCKET_ARGS, "--bucket_no_upscale"), "sdxl")


def test_sdxl_crop_conditioning_and_flip(tmp_path):
    make_image(str(tmp_path / "train" / "1_x" / "a.png"), (96, 48))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64"), "sdxl")
    batch = group[0]
    # 96x48 is resized to cover 64x64 -> 128x64 and center-cropped; the conditioning is upstream's fit-inside
    # offset (the image fitted inside 64x64 is 64x32: top 16, left 0), not the real crop (left 32)
    assert batch["original_sizes_hw"].tolist() == [[48, 96]]
    assert batch["crop_top_lefts"].tolist() == [[16, 0]]
    assert batch["target_sizes_hw"].tolist() == [[64, 64]]
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64", "--flip_aug",
                                      "--random_crop"), "sdxl")
    flips = set()
    for epoch in range(12):
        group.set_current_epoch(epoch)
        img = group[0]["images"][0]
        flips.add(bool(img[0, 0, 0] > img[0, 0, -1]))  # red gradient runs left to right unless flipped
    assert flips == {True, False}
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64", "--color_aug"),
                                "sdxl")
    hues = set()
    for epoch in range(12):  # upstream's color_aug changes a third of the images
        group.set_current_epoch(epoch)
        hues.add(tuple(group[0]["images"][0, :, 10, 10].tolist()))
    assert len(hues) > 1


def test_epoch_reshuffles_and_caption_shuffle_keeps_tokens(tmp_path):
    d = tmp_path / "train" / "1_x"
    for k in range(6):
        make_image(str(d / f"{k}.png"), (64, 64))
        write(str(d / f"{k}.caption"), f"img{k}, tag a, tag b, tag c, tag d")
    args = parse("--train_data_dir", tmp_path / "train", "--resolution", "64", "--shuffle_caption",
                 "--keep_tokens", "1", "--train_batch_size", "3")
    group = build_dataset_group(args, "sd1")
    orders, captions = [], set()
    for epoch in range(1, 5):
        group.set_current_epoch(epoch)
        batches = all_batches(group)
        orders.append(tuple(p for b in batches for p in b["image_paths"]))
        for b in batches:
            for c, p in zip(b["captions"], b["image_paths"]):
                tags = c.split(", ")
                assert tags[0] == f"img{os.path.basename(p)[0]}"  # kept token stays first
                assert sorted(tags[1:]) == ["tag a", "tag b", "tag c", "tag d"]
                captions.add(c)
    assert len(set(orders)) > 1 and len(captions) > 6
    # the same seed and epoch give the same order (all workers/processes agree)
    again = build_dataset_group(args, "sd1")
    again.set_current_epoch(4)
    assert tuple(p for b in all_batches(again) for p in b["image_paths"]) == orders[-1]


def test_dataloader_workers_follow_the_epoch(tmp_path):
    d = tmp_path / "train" / "1_x"
    for k in range(4):
        make_image(str(d / f"{k}.png"), (64, 64))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64"), "sd1")
    loader = make_dataloader(group, num_workers=1, persistent_workers=True, shuffle=False)
    orders = []
    for epoch in range(3):
        group.set_current_epoch(epoch)
        orders.append([b["image_paths"][0] for b in loader])
        expected = [b["image_paths"][0] for b in all_batches(group)]
        assert orders[-1] == expected  # the persistent worker saw the new epoch
    assert len({tuple(o) for o in orders}) > 1


# ----------------------------------------------------------------------------- dataset config


def test_dataset_config_toml(tmp_path):
    make_image(str(tmp_path / "imgs" / "a.png"), (96, 48))
    write(str(tmp_path / "imgs" / "a.txt"), "red, gradient")
    make_image(str(tmp_path / "imgs2" / "b.png"), (64, 64))
    write(str(tmp_path / "imgs2" / "b.cap"), "second subset")
    make_image(str(tmp_path / "reg" / "r.png"), (64, 64))
    cfg = write(str(tmp_path / "ds.toml"), f"""
[general]
shuffle_caption = false
caption_extension = ".txt"
keep_tokens = 1
enable_bucket = true
min_bucket_reso = 64
max_bucket_reso = 256

[[datasets]]
resolution = 128
batch_size = 2
flip_aug = true

  [[datasets.subsets]]
  image_dir = "imgs"
  num_repeats = 4

  [[datasets.subsets]]
  image_dir = "{tmp_path / 'imgs2'}"
  caption_extension = ".cap"
  flip_aug = false

  [[datasets.subsets]]
  image_dir = "reg"
  is_reg = true
  class_tokens = "a photo"

[[datasets]]
resolution = [64, 128]
enable_bucket = false

  [[datasets.subsets]]
  image_dir = "imgs2"
  num_repeats = 2
  caption_extension = ".cap"
""")
    group = build_dataset_group(parse("--dataset_config", cfg, "--prior_loss_weight", "0.25",
                                      "--train_batch_size", "7"), "sdxl")
    d1, d2 = group.datasets
    assert d1.params.resolution == (128, 128) and d1.params.batch_size == 2 and d1.params.enable_bucket
    assert d2.params.resolution == (64, 128) and d2.params.batch_size == 7 and not d2.params.enable_bucket
    s1, s2, s3 = d1.params.subsets
    assert (s1.num_repeats, s1.caption_extension, s1.flip_aug, s1.keep_tokens) == (4, ".txt", True, 1)
    assert (s2.caption_extension, s2.flip_aug) == (".cap", False)
    assert s3.is_reg and s3.class_tokens == "a photo"
    captions = Counter(c for b in all_batches(group) for c in b["captions"])
    # reg image is balanced to the 5 train images (4 + 1); no caption file -> class_tokens
    assert captions == {"red, gradient": 4, "second subset": 1 + 2, "a photo": 5}
    assert group.num_train_images == 7 and group.num_reg_images == 5
    b_shapes = set()
    for b in all_batches(group):
        for p, img, x in zip(b["image_paths"], b["images"], b["loss_weights"].tolist()):
            assert x == (0.25 if "/reg/" in p else 1.0)
            if p.endswith("b.png"):
                b_shapes.add(tuple(img.shape[1:]))
    assert b_shapes == {(128, 128), (128, 64)}  # dataset 1: square bucket; dataset 2: fixed 64x128 (W,H)
    md = group.metadata()
    assert "ss_datasets" in md and len(json.loads(md["ss_datasets"])) == 2


def test_dataset_config_unknown_key_errors(tmp_path):
    make_image(str(tmp_path / "imgs" / "a.png"), (64, 64))
    cfg = write(str(tmp_path / "bad.toml"), """
[[datasets]]
resolution = 64
  [[datasets.subsets]]
  image_dir = "imgs"
  num_repeat = 3
""")
    with pytest.raises(DatasetError) as e:
        load_dataset_config(cfg)
    msg = str(e.value)
    assert "'num_repeat'" in msg and "num_repeats" in msg and "caption_extension" in msg and "bad.toml" in msg
    write(cfg, '[general]\nresolution = 64\nfoo = 1\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "imgs"\n')
    with pytest.raises(DatasetError, match=r"unknown key 'foo' in \[general\].*Allowed keys in \[general\]: .*batch_size"):
        load_dataset_config(cfg)
    write(cfg, '[[datasets]]\n[[datasets.subsets]]\nimage_dir = "imgs"\nbatch_size = 2\n')
    with pytest.raises(DatasetError, match="'batch_size' in .* is a dataset setting"):
        load_dataset_config(cfg)
    write(cfg, '[[datasets]]\n[[datasets.subsets]]\nimage_dir = "imgs"\nnum_repeats = "3"\n')
    with pytest.raises(DatasetError, match="'num_repeats' must be an integer"):
        load_dataset_config(cfg)
    write(cfg, '[[datasets]]\nresolution = "big"\n[[datasets.subsets]]\nimage_dir = "imgs"\n')
    with pytest.raises(DatasetError, match="resolution must be 'W,H'"):
        load_dataset_config(cfg)


# ----------------------------------------------------------------------------- DreamBooth reg images


def test_reg_images_balance_and_prior_loss_weight(tmp_path):
    for k in range(3):
        make_image(str(tmp_path / "train" / "2_sks dog" / f"t{k}.png"), (64, 64))
    for k in range(2):
        make_image(str(tmp_path / "reg" / "1_dog" / f"r{k}.png"), (64, 64))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--reg_data_dir", tmp_path / "reg",
                                      "--resolution", "64", "--prior_loss_weight", "0.5"), "sd1")
    assert group.num_train_images == 6 and group.num_reg_images == 6  # reg repeated to match train x repeats
    weights, captions = Counter(), Counter()
    for b in all_batches(group):
        for p, w, c in zip(b["image_paths"], b["loss_weights"].tolist(), b["captions"]):
            weights[("reg" if "/reg/" in p else "train", w)] += 1
            captions[c] += 1
    assert weights == {("train", 1.0): 6, ("reg", 0.5): 6}
    assert captions == {"sks dog": 6, "dog": 6}
    md = group.metadata()
    assert md["ss_num_train_images"] == "6" and md["ss_num_reg_images"] == "6"
    assert json.loads(md["ss_dataset_dirs"]) == {"2_sks dog": {"n_repeats": 2, "img_count": 3},
                                                 "1_dog": {"n_repeats": 1, "img_count": 2}}

    # more reg images than train images: only as many as needed are used
    for k in range(2, 10):
        make_image(str(tmp_path / "reg" / "1_dog" / f"r{k}.png"), (64, 64))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--reg_data_dir", tmp_path / "reg",
                                      "--resolution", "64"), "sd1")
    assert group.num_reg_images == 6


# ----------------------------------------------------------------------------- fine-tune metadata


def test_in_json_with_merge_tool(tmp_path):
    train = tmp_path / "ft"
    make_image(str(train / "one.png"), (64, 96))
    write(str(train / "one.caption"), "first image")
    make_image(str(train / "two.jpg"), (96, 64))
    write(str(train / "two.caption"), "second image")
    make_image(str(train / "sub" / "three.png"), (64, 64))
    write(str(train / "sub" / "three.caption"), "third image")
    existing = write(str(tmp_path / "tags.json"), json.dumps({"one": {"tags": "red, blue"}, "gone": {"tags": "x"}}))
    out = tmp_path / "meta.json"
    r = subprocess.run([sys.executable, MERGE_TOOL, str(train), str(out), "--in_json", existing],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    meta = json.loads(out.read_text())
    assert meta["one"] == {"tags": "red, blue", "caption": "first image"} and meta["two"]["caption"] == "second image"
    assert "three" not in meta  # not recursive
    del meta["gone"]  # an entry without an image is an error for training (checked below)
    write(str(out), json.dumps(meta))

    group = build_dataset_group(parse("--in_json", out, "--train_data_dir", train, *BUCKET_ARGS,
                                      "--dataset_repeats", "3"), "sdxl")
    captions = Counter(c for b in all_batches(group) for c in b["captions"])
    assert captions == {"first image,red, blue": 3, "second image": 3}  # upstream: caption + separator + tags
    assert json.loads(group.metadata()["ss_dataset_dirs"]) == {"meta.json": {"n_repeats": 3, "img_count": 2}}

    # --full_path --recursive keys work without --train_data_dir
    out2 = tmp_path / "meta_full.json"
    r = subprocess.run([sys.executable, MERGE_TOOL, str(train), str(out2), "--full_path", "--recursive"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert str(train / "sub" / "three.png") in json.loads(out2.read_text())
    group = build_dataset_group(parse("--in_json", out2, "--resolution", "64"), "sd1")
    assert group.num_train_images == 3

    # the same metadata as a [[datasets.subsets]] metadata_file
    cfg = write(str(tmp_path / "ft.toml"), f"""
[[datasets]]
resolution = 64
  [[datasets.subsets]]
  metadata_file = "meta.json"
  image_dir = "{train}"
  num_repeats = 2
""")
    group = build_dataset_group(parse("--dataset_config", cfg), "sd1")
    assert Counter(c for b in all_batches(group) for c in b["captions"]) == {"first image,red, blue": 2,
                                                                          "second image": 2}

    write(str(out), json.dumps({"missing": {"caption": "x"}}))
    with pytest.raises(DatasetError, match="no image found for key 'missing'"):
        build_dataset_group(parse("--in_json", out, "--train_data_dir", train, "--resolution", "64"), "sd1")
    r = subprocess.run([sys.executable, MERGE_TOOL, str(tmp_path / "nope"), str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "nope" in r.stderr


# ----------------------------------------------------------------------------- caches


def avgpool_encoder(calls):
    def encode(images):
        calls.append(images.shape[0])
        return torch.nn.functional.avg_pool2d(images, 8)  # [B,3,H/8,W/8]
    return encode


def test_latent_cache_in_memory_and_on_disk(tmp_path):
    d = tmp_path / "train" / "2_x"
    make_image(str(d / "a.png"), (96, 48))
    make_image(str(d / "b.png"), (48, 96))
    make_image(str(d / "c.png"), (64, 64))
    argv = ("--train_data_dir", tmp_path / "train", *BUCKET_ARGS, "--flip_aug", "--train_batch_size", "2")

    group = build_dataset_group(parse(*argv, "--cache_latents"), "sdxl")
    calls = []
    group.cache_latents(avgpool_encoder(calls), to_disk=False)
    assert sum(calls) == 6  # 3 images, each also flipped
    assert not list(d.glob("*.npz"))
    for b in all_batches(group):
        assert b["images"] is None
        h, w = b["target_sizes_hw"][0].tolist()
        assert b["latents"].shape[1:] == (3, h // 8, w // 8)

    # the cached latents equal encoding the pixels the uncached path produces (center crop, no flip)
    plain = build_dataset_group(parse("--train_data_dir", tmp_path / "train", *BUCKET_ARGS), "sdxl")
    by_path = {}
    for b in all_batches(plain):
        for p, img in zip(b["image_paths"], b["images"]):
            by_path[p] = torch.nn.functional.avg_pool2d(img[None], 8)[0]
    info = next(i for i in group.datasets[0].images if i.path.endswith("a.png"))
    assert torch.allclose(info.latents, by_path[info.path], atol=1e-5)
    assert torch.allclose(info.latents_flipped, torch.flip(by_path[info.path], dims=[2]), atol=1e-5)

    group = build_dataset_group(parse(*argv, "--cache_latents_to_disk"), "sdxl")
    calls = []
    group.cache_latents(avgpool_encoder(calls), to_disk=True, signature="vae-1")
    assert sum(calls) == 6 and sorted(p.name for p in d.glob("*.npz")) == [
        "a_0096x0048_sdxl.npz", "b_0048x0096_sdxl.npz", "c_0064x0064_sdxl.npz"]  # upstream's names
    with np.load(d / "a_0096x0048_sdxl.npz") as npz:
        assert {"latents", "latents_flipped", "crop_ltrb", "original_size"} <= set(npz.files)
    lat_disk = {p: lat for b in all_batches(group) for p, lat in zip(b["image_paths"], b["latents"])}
    assert len(lat_disk) == 3

    # a second build reuses the files
    group = build_dataset_group(parse(*argv, "--cache_latents_to_disk"), "sdxl")
    calls = []
    group.cache_latents(avgpool_encoder(calls), to_disk=True, signature="vae-1")
    assert calls == []
    assert all(b["latents"] is not None for b in all_batches(group))
    # another VAE, or another bucket size, encodes again
    group.cache_latents(avgpool_encoder(calls), to_disk=True, signature="vae-2")
    assert sum(calls) == 6
    calls.clear()
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64", "--flip_aug",
                                      "--cache_latents_to_disk"), "sdxl")
    group.cache_latents(avgpool_encoder(calls), to_disk=True, signature="vae-2")
    assert sum(calls) == 6

    # an npz written by kohya's own scripts (no signature key) is reused when its shape fits
    calls.clear()
    with np.load(d / "c_0064x0064_sdxl.npz") as npz:
        kohya_style = {k: npz[k] for k in ("latents", "latents_flipped", "original_size", "crop_ltrb")}
    np.savez(d / "c_0064x0064_sdxl.npz", **kohya_style)
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64", "--flip_aug",
                                      "--cache_latents_to_disk"), "sdxl")
    group.cache_latents(avgpool_encoder(calls), to_disk=True)
    assert sum(calls) == 4  # a and b (signature differs), not c

    # pixel-changing augmentations are refused before any model loads
    for aug in ("--color_aug", "--random_crop"):
        with pytest.raises(DatasetError, match=aug[2:] + ".*cache_latents"):
            build_dataset_group(parse(*argv, "--cache_latents", aug), "sdxl")


def test_text_encoder_output_cache(tmp_path):
    d = tmp_path / "train" / "1_x"
    for k in range(3):
        make_image(str(d / f"{k}.png"), (64, 64))
        write(str(d / f"{k}.caption"), f"caption number {k}" + "!" * k)
    argv = ("--train_data_dir", tmp_path / "train", "--resolution", "64", "--train_batch_size", "3")
    calls = []

    def encode(captions):
        calls.append(list(captions))
        n = torch.tensor([float(len(c)) for c in captions])
        return {"hidden": n[:, None, None].expand(-1, 4, 8).clone(), "pooled": n[:, None].expand(-1, 8).clone()}

    group = build_dataset_group(parse(*argv, "--cache_text_encoder_outputs"), "sdxl")
    group.cache_text_encoder_outputs(encode, to_disk=False)
    assert sum(len(c) for c in calls) == 3
    b = group[0]
    assert b["te_outputs"]["hidden"].shape == (3, 4, 8) and b["te_outputs"]["pooled"].shape == (3, 8)
    for cap, pooled in zip(b["captions"], b["te_outputs"]["pooled"]):
        assert pooled[0].item() == len(cap)

    calls.clear()
    group = build_dataset_group(parse(*argv, "--cache_text_encoder_outputs_to_disk"), "sdxl")
    group.cache_text_encoder_outputs(encode, to_disk=True, signature="te")
    assert sorted(p.name for p in d.glob("*_te_outputs.npz")) == [f"{k}_te_outputs.npz" for k in range(3)]
    disk = group[0]
    for cap, pooled in zip(disk["captions"], disk["te_outputs"]["pooled"]):
        assert pooled[0].item() == len(cap)
    calls.clear()
    write(str(d / "1.caption"), "a changed caption")
    group = build_dataset_group(parse(*argv, "--cache_text_encoder_outputs_to_disk"), "sdxl")
    group.cache_text_encoder_outputs(encode, to_disk=True, signature="te")
    assert calls == [["a changed caption"]]  # the other two were reused

    for bad in (("--shuffle_caption",), ("--caption_dropout_rate", "0.1")):
        with pytest.raises(DatasetError, match=bad[0][2:] + ".*cache_text_encoder_outputs"):
            build_dataset_group(parse(*argv, *bad, "--cache_text_encoder_outputs"), "sdxl")


def test_metadata_values(tmp_path):
    d = tmp_path / "train" / "4_sks"
    make_image(str(d / "a.png"), (64, 64))
    write(str(d / "a.caption"), "sks, red, blue")
    make_image(str(d / "b.png"), (64, 64))
    write(str(d / "b.caption"), "sks, red")
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64,64",
                                      "--keep_tokens", "1", "--flip_aug", "--train_batch_size", "3"), "sd1")
    md = group.metadata()
    assert all(isinstance(v, str) for v in md.values())
    assert md["ss_num_train_images"] == "8" and md["ss_num_batches_per_epoch"] == "3"
    assert md["ss_resolution"] == "(64, 64)" and md["ss_enable_bucket"] == "False"
    assert md["ss_keep_tokens"] == "1" and md["ss_flip_aug"] == "True" and md["ss_color_aug"] == "False"
    assert md["ss_shuffle_caption"] == "False" and md["ss_caption_dropout_rate"] == "0.0"
    assert md["ss_min_bucket_reso"] == "256" and md["ss_max_bucket_reso"] == "1024"
    assert json.loads(md["ss_tag_frequency"]) == {"4_sks": {"sks": 2, "red": 2, "blue": 1}}
    assert json.loads(md["ss_bucket_info"])["buckets"] == {"0": {"resolution": [64, 64], "count": 8}}


def test_bad_values_are_named(tmp_path):
    make_image(str(tmp_path / "train" / "1_x" / "a.png"), (64, 64))
    base = ("--train_data_dir", tmp_path / "train")
    with pytest.raises(DatasetError, match="--resolution must be 'W,H'"):
        build_dataset_group(parse(*base, "--resolution", "big"), "sdxl")
    with pytest.raises(DatasetError, match="min_bucket_reso"):
        build_dataset_group(parse(*base, "--resolution", "128", "--enable_bucket"), "sdxl")
    # an empty --resolution (a GUI text field left blank) means the family's default
    assert build_dataset_group(parse(*base, "--resolution", ""), "sd1").datasets[0].params.resolution == (512, 512)
    with pytest.raises(DatasetError, match="unknown model family"):
        build_dataset_group(parse(*base), "sd9")
    (tmp_path / "train" / "0_none").mkdir()  # ignored, as upstream (see test_folders_without_repeat_prefix...)
    assert build_dataset_group(parse(*base, "--resolution", "64"), "sdxl").num_train_images == 1


# ----------------------------------------------------------------------------- prompt files


def test_prompt_file_txt_toml_json(tmp_path):
    txt = write(str(tmp_path / "p.txt"), "\n".join([
        "# a comment line",
        "a cat on a sofa --n blurry, lowres --w 1024 --h 768 --s 20 --l 5.5 --d 42 --g 3.0 --ss euler_a",
        "",
        "just a prompt",
    ]))
    p = parse_prompt_file(txt)
    assert len(p) == 2
    assert p[0] == {"prompt": "a cat on a sofa", "negative_prompt": "blurry, lowres", "width": 1024, "height": 768,
                    "sample_steps": 20, "scale": 5.5, "seed": 42, "guidance_scale": 3.0,
                    "sample_sampler": "euler_a", "enum": 0}
    assert (p[1]["prompt"], p[1]["width"], p[1]["height"], p[1]["sample_steps"], p[1]["scale"], p[1]["seed"]) == (
        "just a prompt", 512, 512, 30, 7.5, None)

    toml = write(str(tmp_path / "p.toml"), """
[prompt]
width = 1024
height = 1024
sample_steps = 25
negative_prompt = "bad"

  [[prompt.subset]]
  prompt = "first"

  [[prompt.subset]]
  prompt = "second"
  width = 832
  seed = 7
""")
    p = parse_prompt_file(toml)
    assert [(x["prompt"], x["width"], x["height"], x["sample_steps"], x["negative_prompt"], x["seed"]) for x in p] == [
        ("first", 1024, 1024, 25, "bad", None), ("second", 832, 1024, 25, "bad", 7)]

    js = write(str(tmp_path / "p.json"), json.dumps([{"prompt": "j", "scale": 4, "sample_sampler": "DDIM"}]))
    p = parse_prompt_file(js)
    assert p[0]["scale"] == 4.0 and p[0]["sample_sampler"] == "ddim" and p[0]["height"] == 512


def test_prompt_file_errors_name_the_line(tmp_path):
    cases = {
        "a cat --w big": r"line 2: width must be",
        "a cat --x 3": r"line 2: unknown option '--x'.*--ss",
        "a cat --s 0": r"line 2: sample_steps must be",
        "a cat --ss nosuch": r"line 2: sample_sampler must be one of .*euler_a",
        "a cat --w 1001": r"line 2: width must be .*divisible by 8",
        "a cat --d": r"line 2: option '--d' needs a value",
        "--n only negative": r"line 2: the prompt text is empty",
    }
    for line, pattern in cases.items():
        path = write(str(tmp_path / "bad.txt"), "# header\n" + line + "\n")
        with pytest.raises(PromptFileError, match=pattern):
            parse_prompt_file(path)
    path = write(str(tmp_path / "bad.json"), json.dumps([{"prompt": "x", "steps": 3}]))
    with pytest.raises(PromptFileError, match="entry #1: unknown key 'steps'"):
        parse_prompt_file(path)
    path = write(str(tmp_path / "empty.txt"), "# nothing\n")
    with pytest.raises(PromptFileError, match="no prompts"):
        parse_prompt_file(path)


def test_nan_latents_at_caching_name_the_image(tmp_path):
    """As upstream's caching: NaN latents stop the run there, naming the image (training does not check cached
    latents again, so it never waits for the GPU for that)."""
    d = tmp_path / "train" / "1_x"
    make_image(str(d / "a.png"), (64, 64))
    make_image(str(d / "b.png"), (64, 64))
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", *BUCKET_ARGS, "--cache_latents"),
                                "sdxl")

    def encode(images):
        out = torch.nn.functional.avg_pool2d(images, 8)
        out[1] = float("nan")  # the second image of the batch overflows
        return out

    with pytest.raises(DatasetError, match="--no_half_vae") as e:
        group.cache_latents(encode, batch_size=2)
    named = [p for p in ("a.png", "b.png") if p in str(e.value)]
    assert len(named) == 1

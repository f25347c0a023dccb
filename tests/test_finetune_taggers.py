"""tag_images_by_wd14_tagger.py on tiny ONNX taggers built here (onnx.helper), never downloaded: the caption files
it writes (thresholds per category, undesired tags, character tags first, ratings, append, replacement), the
existing-file rule, an image that will not open, JSON/JSONL output and the tag_mapping.json (subdir) layout."""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from finetune_tools import FINETUNE, load

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

SCRIPT = FINETUNE / "tag_images_by_wd14_tagger.py"
RED, BLUE = (255, 0, 0), (0, 0, 255)

# (name, category, probability on a red image, on a blue image); SmilingWolf order: ratings, general, character
TAGS = [
    ("general", "9", 0.2, 0.9), ("sensitive", "9", 0.7, 0.05), ("questionable", "9", 0.05, 0.01),
    ("explicit", "9", 0.01, 0.01),
    ("red_thing", "0", 0.9, 0.1), ("1girl", "0", 0.5, 0.6), ("white_background", "0", 0.4, 0.2),
    ("blue_thing", "0", 0.1, 0.95),
    ("alice_(wonderland)", "4", 0.9, 0.1), ("bob_(series)", "4", 0.6, 0.7),
]


def _logit(p):
    return math.log(p / (1 - p))


def _tagger_graph(red_logits, blue_logits, size, channels_first, sigmoid, batch="N"):
    """mean colour -> linear -> (sigmoid): the outputs for a plain red / blue image are the given logits."""
    red, blue = np.array(red_logits, np.float32), np.array(blue_logits, np.float32)
    n = len(red)
    w = np.zeros((3, n), np.float32)
    if channels_first:  # inputs in -1..1 (BGR): red = [-1, -1, 1], blue = [1, -1, -1]
        b = (red + blue) / 2
        w[2], w[0] = (red - blue) / 4, -(red - blue) / 4
        shape, axes = [batch, 3, size, size], [2, 3]
    else:  # inputs 0..255 BGR, scaled to 0..1: red = [0, 0, 1], blue = [1, 0, 0]
        b = np.zeros(n, np.float32)
        w[2], w[0] = red / 255.0, blue / 255.0
        shape, axes = [batch, size, size, 3], [1, 2]
    nodes = [helper.make_node("ReduceMean", ["input", "axes"], ["mean"], keepdims=0),
             helper.make_node("MatMul", ["mean", "w"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["logits" if sigmoid else "output"])]
    if sigmoid:
        nodes.append(helper.make_node("Sigmoid", ["logits"], ["output"]))
    graph = helper.make_graph(
        nodes, "tiny_tagger", [helper.make_tensor_value_info("input", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, n])],
        [helper.make_tensor("axes", TensorProto.INT64, [2], axes),
         helper.make_tensor("w", TensorProto.FLOAT, [3, n], w.flatten().tolist()),
         helper.make_tensor("b", TensorProto.FLOAT, [n], b.tolist())])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def make_smilingwolf_tagger(folder, tags=TAGS, size=32, batch="N"):
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(_tagger_graph([_logit(t[2]) for t in tags], [_logit(t[3]) for t in tags], size, False, True, batch),
              str(folder / "model.onnx"))
    with open(folder / "selected_tags.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["tag_id", "name", "category", "count"])
        for i, (name, cat, _, _) in enumerate(tags):
            w.writerow([1000 + i, name, cat, 10])
    return folder


def make_mapping_tagger(folder, tags, size=32):
    """The `namespace/repo/subdir` layout: model_optimized.onnx (NCHW, logits) + tag_mapping.json."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(_tagger_graph([_logit(t[2]) for t in tags], [_logit(t[3]) for t in tags], size, True, False),
              str(folder / "model_optimized.onnx"))
    mapping = {str(i): {"tag": name, "category": cat} for i, (name, cat, _, _) in enumerate(tags)}
    (folder / "tag_mapping.json").write_text(json.dumps(mapping), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tagger_module():
    return load("tag_images_by_wd14_tagger")


@pytest.fixture(scope="module")
def tagger_dir(tmp_path_factory):
    return make_smilingwolf_tagger(tmp_path_factory.mktemp("tagger") / "wd_tiny")


def _images(folder, colours: dict):
    folder.mkdir(parents=True, exist_ok=True)
    for name, colour in colours.items():
        Image.new("RGB", (40, 40), colour).save(folder / f"{name}.png")  # square: no white padding
    return folder


def _caption(folder, stem, ext=".txt"):
    return (folder / f"{stem}{ext}").read_text(encoding="utf-8")


def test_thresholds_per_category_and_caption_order(tagger_module, tagger_dir, tmp_path):
    imgs = _images(tmp_path / "imgs", {"red": RED, "blue": BLUE})
    assert tagger_module.cli([str(imgs), "--onnx", "--repo_id", str(tagger_dir), "--batch_size", "2",
                              "--character_threshold", "0.85"]) == 0
    # general tags >= 0.35 (--thresh), character >= 0.85, in the CSV's order (general first)
    assert _caption(imgs, "red") == "red_thing, 1girl, white_background, alice_(wonderland)\n"
    assert _caption(imgs, "blue") == "1girl, blue_thing\n"


def test_character_first_undesired_rating_underscore_and_expand(tagger_module, tagger_dir, tmp_path):
    imgs = _images(tmp_path / "imgs", {"red": RED})
    assert tagger_module.cli([str(imgs), "--repo_id", str(tagger_dir), "--general_threshold", "0.45",
                              "--character_threshold", "0.5", "--character_tags_first", "--use_rating_tags",
                              "--undesired_tags", "1girl", "--remove_underscore", "--character_tag_expand"]) == 0
    # character tags first (each put in front: the later CSV entry ends first, as upstream), the rating before all
    assert _caption(imgs, "red") == "sensitive, bob, series, alice, wonderland, red thing\n"


def test_rating_last_always_first_replacement_separator(tagger_module, tagger_dir, tmp_path):
    imgs = _images(tmp_path / "imgs", {"blue": BLUE})
    assert tagger_module.cli([str(imgs), "--repo_id", str(tagger_dir), "--use_rating_tags_as_last_tag",
                              "--always_first_tags", "blue_thing", "--caption_separator", ";",
                              "--tag_replacement", "1girl,one girl;bob_(series),bob",
                              "--caption_extension", ".cap"]) == 0
    assert _caption(imgs, "blue", ".cap") == "blue_thing;one girl;bob;general\n"


def test_existing_captions_refused_then_appended_or_skipped(tagger_module, tagger_dir, tmp_path, capsys):
    imgs = _images(tmp_path / "imgs", {"red": RED, "blue": BLUE})
    (imgs / "red.txt").write_text("my tag, red_thing\n", encoding="utf-8")
    args = [str(imgs), "--repo_id", str(tagger_dir), "--character_threshold", "0.85"]
    assert tagger_module.cli(args) == 2
    err = capsys.readouterr().err
    assert "red.txt" in err and "--overwrite" in err and "--append_tags" in err
    assert _caption(imgs, "red") == "my tag, red_thing\n" and not (imgs / "blue.txt").exists()

    assert tagger_module.cli(args + ["--skip_existing"]) == 0
    assert _caption(imgs, "red") == "my tag, red_thing\n"
    assert _caption(imgs, "blue") == "1girl, blue_thing\n"

    assert tagger_module.cli(args + ["--append_tags"]) == 0  # no repeats of a tag the file has
    assert _caption(imgs, "red") == "my tag, red_thing, 1girl, white_background, alice_(wonderland)\n"
    assert _caption(imgs, "blue") == "1girl, blue_thing\n"

    assert tagger_module.cli(args + ["--overwrite", "--general_threshold", "0.8"]) == 0
    assert _caption(imgs, "red") == "red_thing, alice_(wonderland)\n"


def test_broken_image_skipped_by_name_and_run_goes_on(tagger_module, tagger_dir, tmp_path, caplog):
    imgs = _images(tmp_path / "imgs", {"a_red": RED, "c_blue": BLUE})
    (imgs / "b_broken.png").write_bytes(b"not a png at all")
    with caplog.at_level("ERROR"):
        assert tagger_module.cli([str(imgs), "--repo_id", str(tagger_dir), "--batch_size", "2",
                                  "--character_threshold", "0.85"]) == 0
    assert "b_broken.png" in caplog.text
    assert _caption(imgs, "a_red").startswith("red_thing") and _caption(imgs, "c_blue") == "1girl, blue_thing\n"
    assert not (imgs / "b_broken.txt").exists()


def test_output_path_json_and_jsonl_and_fixed_batch_model(tagger_module, tmp_path):
    tagger = make_smilingwolf_tagger(tmp_path / "fixed", batch=2)  # a model with batch 2 baked in
    imgs = _images(tmp_path / "imgs", {"a": RED, "b": BLUE, "c": RED})
    out = tmp_path / "tags.jsonl"
    assert tagger_module.cli([str(imgs), "--repo_id", str(tagger), "--output_path", str(out),
                              "--character_threshold", "0.85"]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(l["image_path"].endswith("a.png"), l["caption"], l["image_size"]) for l in lines][1] == \
        (False, "1girl, blue_thing", [40, 40])
    assert len(lines) == 3 and not list(imgs.glob("*.txt"))
    out_json = tmp_path / "tags.json"
    assert tagger_module.cli([str(imgs), "--repo_id", str(tagger), "--output_path", str(out_json),
                              "--thresh", "0.8"]) == 0
    data = json.loads(out_json.read_text())
    assert data[str(imgs / "a.png")] == {"tags": "red_thing, alice_(wonderland)", "image_size": [40, 40]}


def test_model_dir_and_subdir_mapping_layout(tagger_module, tmp_path):
    tags = [("rating:safe", "Rating", 0.8, 0.3), ("rating:nsfw", "Rating", 0.1, 0.6),
            ("best quality", "Quality", 0.7, 0.2), ("red thing", "General", 0.6, 0.1),
            ("cat", "General", 0.9, 0.8), ("alice", "Character", 0.5, 0.95), ("studio", "Copyright", 0.2, 0.9)]
    make_mapping_tagger(tmp_path / "models" / "ns_cl" / "v1", tags)
    imgs = _images(tmp_path / "imgs", {"red": RED, "blue": BLUE})
    assert tagger_module.cli([str(imgs), "--repo_id", "ns/cl/v1", "--model_dir", str(tmp_path / "models"),
                              "--character_tags_first", "--use_rating_tags", "--use_quality_tags_as_last_tag",
                              "--copyright_threshold", "0.5", "--batch_size", "2"]) == 0
    # sorted by probability, characters first, rating first, quality last
    assert _caption(imgs, "red") == "rating:safe, alice, cat, red thing, best quality\n"
    assert _caption(imgs, "blue") == "rating:nsfw, alice, studio, cat\n"


def test_bad_input_one_line_exit_2(tagger_module, tagger_dir, tmp_path, capsys):
    imgs = _images(tmp_path / "imgs", {"red": RED})
    assert tagger_module.cli([str(imgs), "--repo_id", str(tagger_dir), "--tag_replacement", "a,b,c"]) == 2
    assert "--tag_replacement" in capsys.readouterr().err
    assert tagger_module.cli([str(tmp_path / "nothing"), "--repo_id", str(tagger_dir)]) == 2
    assert "train_data_dir" in capsys.readouterr().err
    assert tagger_module.cli([str(imgs), "--repo_id", str(tmp_path)]) == 2
    assert "model.onnx" in capsys.readouterr().err
    assert not (imgs / "red.txt").exists()


def test_command_line_and_dump_options(tagger_dir, tmp_path):
    imgs = _images(tmp_path / "imgs", {"red": RED})
    r = subprocess.run([sys.executable, str(SCRIPT), str(imgs), "--onnx", "--repo_id", str(tagger_dir),
                        "--caption_extention", ".tags", "--thresh", "0.8"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert _caption(imgs, "red", ".tags") == "red_thing, alice_(wonderland)\n"
    r = subprocess.run([sys.executable, str(SCRIPT), "--dump_options"], capture_output=True, text=True, timeout=300)
    opts = {o["name"]: o for o in json.loads(r.stdout)}
    assert opts["thresh"]["default"] == 0.35 and opts["append_tags"]["kind"] == "bool"
    assert opts["repo_id"]["default"] == "SmilingWolf/wd-v1-4-convnext-tagger-v2"


def test_preprocessing_is_upstreams(tagger_module):
    """Transparency onto white, BGR, padded to a white square, resized; NCHW in -1..1 for tag_mapping taggers."""
    img = Image.new("RGBA", (40, 20), (255, 0, 0, 255))
    img.putpixel((0, 10), (0, 255, 0, 0))  # fully transparent: white
    px = tagger_module.prepare_image(img, 40, channels_first=False)
    assert px.shape == (40, 40, 3) and px.dtype == np.float32
    assert px[0, 20].tolist() == [255, 255, 255] and px[20, 20].tolist() == [0, 0, 255]  # pad row / red in BGR
    assert px[20, 0].tolist() == [255, 255, 255]
    assert tagger_module.prepare_image(Image.new("L", (8, 8), 0), 16, channels_first=True).shape == (3, 16, 16)
    assert tagger_module.prepare_image(Image.new("RGB", (8, 8), (255, 0, 0)), 16, True)[:, 4, 4].tolist() == \
        [-1.0, -1.0, 1.0]


def test_recursive_tags_subfolders(tagger_module, tagger_dir, tmp_path, capsys):
    imgs = _images(tmp_path / "imgs" / "sub", {"red": RED})
    root = tmp_path / "imgs"
    assert tagger_module.cli([str(root), "--repo_id", str(tagger_dir)]) == 2  # no images at the top
    assert "--recursive" in capsys.readouterr().err
    assert tagger_module.cli([str(root), "--repo_id", str(tagger_dir), "--recursive", "--thresh", "0.8"]) == 0
    assert _caption(imgs, "red") == "red_thing, alice_(wonderland)\n"


def test_hub_download_into_model_dir(tagger_module, tagger_dir, tmp_path, monkeypatch):
    """The files asked from the Hub and where they go (huggingface_hub replaced: nothing downloaded)."""
    import shutil

    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename, subfolder=None, local_dir=None, force_download=False):
        calls.append((repo_id, filename, subfolder, force_download))
        dest = os.path.join(local_dir, subfolder or "", filename)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy(tagger_dir / filename, dest)
        return dest

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    imgs = _images(tmp_path / "imgs", {"red": RED})
    models = tmp_path / "models"
    args = [str(imgs), "--repo_id", "SmilingWolf/wd-vit-tagger-v3", "--model_dir", str(models), "--thresh", "0.8",
            "--overwrite"]
    assert tagger_module.cli(args) == 0
    assert sorted(calls) == [("SmilingWolf/wd-vit-tagger-v3", "model.onnx", None, False),
                             ("SmilingWolf/wd-vit-tagger-v3", "selected_tags.csv", None, False)]
    assert (models / "SmilingWolf_wd-vit-tagger-v3" / "model.onnx").is_file()
    assert _caption(imgs, "red") == "red_thing, alice_(wonderland)\n"
    calls.clear()
    assert tagger_module.cli(args) == 0 and calls == []  # already there
    assert tagger_module.cli(args + ["--force_download"]) == 0 and len(calls) == 2 and calls[0][3] is True


def test_missing_onnxruntime_is_one_line_naming_the_extra(tagger_module, tagger_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    imgs = _images(tmp_path / "imgs", {"red": RED})
    assert tagger_module.cli([str(imgs), "--repo_id", str(tagger_dir)]) == 2
    err = capsys.readouterr().err
    assert "onnxruntime" in err and "[captioning]" in err and "Traceback" not in err and len(err.splitlines()) == 1
    assert not (imgs / "red.txt").exists()

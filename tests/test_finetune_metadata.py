"""The fine-tune metadata tools on small folders: merge_captions_to_metadata.py, merge_dd_tags_to_metadata.py
(upstream's keys, OUT_JSON read when --in_json is unset, --full_path/--recursive) and clean_captions_and_tags.py
(upstream's tag and caption rules, the old three-argument form)."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from finetune_tools import load as _load




@pytest.fixture(scope="module")
def tools():
    return {n: _load(n) for n in ("merge_captions_to_metadata", "merge_dd_tags_to_metadata", "clean_captions_and_tags")}


def _img(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 16), (10, 20, 30)).save(path)


def _text(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_merge_captions_then_tags_into_one_metadata(tools, tmp_path, caplog):
    d = tmp_path / "imgs"
    for stem in ("a", "b"):
        _img(d / f"{stem}.png")
    _text(d / "a.caption", "a red cube\n")
    _text(d / "b.caption", "a blue ball\n")
    _text(d / "a.txt", "red, cube\n")  # b has no tag file: left out with a warning
    out = tmp_path / "meta.json"
    assert tools["merge_captions_to_metadata"].cli([str(d), str(out)]) == 0
    assert json.loads(out.read_text()) == {"a": {"caption": "a red cube"}, "b": {"caption": "a blue ball"}}
    with caplog.at_level("WARNING"):
        assert tools["merge_dd_tags_to_metadata"].cli([str(d), str(out)]) == 0  # reads OUT_JSON (no --in_json)
    assert "b.png" in caplog.text
    assert json.loads(out.read_text()) == {"a": {"caption": "a red cube", "tags": "red, cube"},
                                           "b": {"caption": "a blue ball"}}
    # --in_json given: that file is the base, OUT_JSON is replaced
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"a": {"train_resolution": [512, 512]}, "old": {"caption": "kept"}}))
    assert tools["merge_dd_tags_to_metadata"].cli([str(d), str(out), "--in_json", str(base)]) == 0
    assert json.loads(out.read_text()) == {"a": {"train_resolution": [512, 512], "tags": "red, cube"},
                                           "old": {"caption": "kept"}}


def test_merge_recursive_full_path_and_clashing_keys(tools, tmp_path, capsys):
    d = tmp_path / "imgs"
    for sub in ("x", "y"):
        _img(d / sub / "same.png")
        _text(d / sub / "same.txt", f"tag_{sub}")
    out = tmp_path / "meta.json"
    assert tools["merge_dd_tags_to_metadata"].cli([str(d), str(out), "--recursive"]) == 2
    assert "--full_path" in capsys.readouterr().err and not out.exists()
    assert tools["merge_dd_tags_to_metadata"].cli([str(d), str(out), "--recursive", "--full_path"]) == 0
    assert json.loads(out.read_text()) == {str(d / "x" / "same.png"): {"tags": "tag_x"},
                                           str(d / "y" / "same.png"): {"tags": "tag_y"}}
    assert tools["merge_captions_to_metadata"].cli([str(d), str(out), "--caption_extention", "txt",
                                                    "--recursive", "--full_path"]) == 0
    assert json.loads(out.read_text())[str(d / "x" / "same.png")] == {"tags": "tag_x", "caption": "tag_x"}


def test_clean_captions_and_tags_rules(tools, tmp_path):
    meta = {
        "two": {"tags": "2girls, long_hair, blue_eyes, red_eyes, shirt, white_shirt, ^_^, solo, rating:safe",
                "caption": "an anime girl with a young woman"},
        "one": {"tags": "1girl, long_hair, blue_hair, blue_eyes, shirt"},
        "hair": {"tags": "2girls, long_hair, blue_hair, red_hair, smile", "caption": "two anime women"},
    }
    src, out = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text(json.dumps(meta))
    assert tools["clean_captions_and_tags"].cli([str(src), str(out)]) == 0
    # several people: both eye colours go, one shared hair length stays, two hair colours go; `shirt` beside
    # `white shirt` goes; underscores become spaces (^_^ kept); DeepDanbooru's rating tail is cut
    assert json.loads(out.read_text()) == {
        "two": {"tags": "2girls, long hair, white shirt, ^_^, solo", "caption": "an girl with a girl"},
        "one": {"tags": "1girl, long hair, blue hair, blue eyes, shirt"},
        "hair": {"tags": "2girls, long hair, smile", "caption": "two girls"},
    }
    assert json.loads(src.read_text()) == meta  # the input is left as it was


def test_clean_old_three_argument_form_and_bad_input(tools, tmp_path, capsys):
    src, out = tmp_path / "in.json", tmp_path / "out.json"
    src.write_text(json.dumps({"a": {"tags": "blue_sky", "caption": "a lady"}}))
    assert tools["clean_captions_and_tags"].cli([str(tmp_path), str(src), str(out), "--debug"]) == 0
    assert json.loads(out.read_text()) == {"a": {"tags": "blue sky", "caption": "a girl"}}
    assert tools["clean_captions_and_tags"].cli([str(tmp_path / "missing.json"), str(out)]) == 2
    assert "missing.json" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert tools["clean_captions_and_tags"].cli([str(tmp_path / "bad.json"), str(out)]) == 2
    assert "image_key" in capsys.readouterr().err

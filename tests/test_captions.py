"""Captions (library/captions.py) and the dataset config schema (library/config_util.py), against upstream's rules:
keep_tokens_separator, secondary_separator, wildcards, token warm-up, weighted captions, caption files without
fallback, --no_token_padding, every upstream [general]/[[datasets]]/[[datasets.subsets]] key at its levels."""
import json
import math
import os
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import train_network

from library import captions, config_util
from library.captions import parse_prompt_attention, process_caption
from library.config_util import SCHEMA, build_dataset_group, load_dataset_config
from library.datasets import DatasetError, SubsetParams

from test_datasets import all_batches, make_image, parse, write


def subset(**kw):
    return SubsetParams(**kw)


def served(caption, s, n=200, **kw):
    return [process_caption(caption, s, epoch=1, rng=random.Random(i), **kw) for i in range(n)]


# ----------------------------------------------------------------------------- process_caption


def test_keep_tokens_separator_keeps_head_and_tail_and_shuffles_the_middle():
    cap = "1girl, hatsune miku, vocaloid ||| stage, microphone, white shirt, smile ||| best quality, rating: general"
    out = served(cap, subset(shuffle_caption=True, keep_tokens_separator="|||"))
    middles = set()
    for c in out:
        tags = c.split(", ")
        assert tags[:3] == ["1girl", "hatsune miku", "vocaloid"]
        assert tags[-2:] == ["best quality", "rating: general"]
        assert sorted(tags[3:-2]) == sorted(["stage", "microphone", "white shirt", "smile"])
        middles.add(tuple(tags[3:-2]))
    assert len(middles) > 10  # really shuffled
    # the separator wins over keep_tokens; without it in the caption keep_tokens applies
    out = served("a, b ||| c, d", subset(shuffle_caption=True, keep_tokens=3, keep_tokens_separator="|||"))
    assert {c.split(", ")[0] for c in out} == {"a"} and {c.split(", ")[1] for c in out} == {"b"}
    out = served("a, b, c, d", subset(shuffle_caption=True, keep_tokens=2, keep_tokens_separator="|||"))
    assert all(c.startswith("a, b, ") for c in out) and len(set(out)) == 2
    # upstream leaves the caption (separator included) as it is when nothing shuffles, drops or warms up
    assert served("a, b ||| c", subset(keep_tokens_separator="|||"), n=1) == ["a, b ||| c"]
    # and joins the tags with ", " whatever the separator; empty tags stay (no separator in the caption)
    assert served("x;y;;z", subset(shuffle_caption=True, caption_separator=";", keep_tokens=4), n=1) == \
        ["x, y, , z"]


def test_secondary_separator_is_one_tag_then_the_caption_separator():
    cap = "1girl, upper body, sky;;;cloud;;;day, outdoors"
    s = subset(shuffle_caption=True, secondary_separator=";;;")
    out = served(cap, s)
    for c in out:
        assert sorted(c.split(", ")) == sorted(["1girl", "upper body", "sky,cloud,day", "outdoors"])
    assert len(set(out)) > 5
    # replaced without shuffling too; dropped as a whole by tag dropout
    assert served(cap, subset(secondary_separator=";;;"), n=1) == ["1girl, upper body, sky,cloud,day, outdoors"]
    dropped = served(cap, subset(caption_tag_dropout_rate=0.5, secondary_separator=";;;"))
    assert all(("sky" in c) == ("sky,cloud,day" in c) for c in dropped)
    assert any("sky" not in c for c in dropped) and any("sky" in c for c in dropped)


def test_wildcards_and_multiline_captions():
    s = subset(enable_wildcard=True)
    out = Counter(served("1girl, {simple|white|dark} background", s))
    assert set(out) == {"1girl, simple background", "1girl, white background", "1girl, dark background"}
    assert served("1girl, {{retro style}}", s, n=3) == ["1girl, {retro style}"] * 3
    assert set(served("{a|b}{{x}}", s)) == {"a{x}", "b{x}"}
    lines = "first caption\nsecond {red|blue} caption\nthird"
    assert set(served(lines, s)) == {"first caption", "second red caption", "second blue caption", "third"}
    # without enable_wildcard: the first line, braces as written
    assert served(lines, subset(), n=1) == ["first caption"]
    assert served("{a|b}", subset(), n=1) == ["{a|b}"]
    assert captions.has_wildcard("x, {a|b}") and captions.has_wildcard("l1\nl2")
    assert not captions.has_wildcard("x, {{a|b}}") and not captions.has_wildcard("plain")


def upstream_warmup_count(step, n_flex, warmup_min, warmup_step, max_steps):
    """Upstream's formula, written out: the effective warm-up length, then floor(step * (n - min) / len) + min."""
    if warmup_step < 1:
        warmup_step = math.floor(warmup_step * max_steps)
    if warmup_step and step < warmup_step:
        return math.floor(step * (n_flex - warmup_min) / warmup_step) + warmup_min
    return n_flex


@pytest.mark.parametrize("warmup_step,max_steps", [(8, 0), (0.4, 20), (0.05, 10)])
def test_token_warmup_grows_the_tag_count_over_steps(warmup_step, max_steps):
    tags = [f"t{i}" for i in range(10)]
    s = subset(keep_tokens=1, token_warmup_min=2, token_warmup_step=warmup_step)
    counts = []
    for step in range(12):
        c = process_caption(", ".join(tags), s, epoch=1, step=step, max_train_steps=max_steps, rng=random.Random(0))
        got = c.split(", ")
        assert got[0] == "t0" and got == tags[:len(got)]  # kept tag first, the others in order (no shuffle)
        counts.append(len(got) - 1)
        assert len(got) - 1 == upstream_warmup_count(step, 9, 2, warmup_step, max_steps)
    if warmup_step == 8:
        assert counts[0] == 2 and counts[4] == math.floor(4 * 7 / 8) + 2 and counts[8:] == [9] * 4
    assert captions.caption_varies(s)


def test_caption_dropout_and_prefix_suffix_order():
    s = subset(caption_prefix="pre", caption_suffix="post", caption_dropout_every_n_epochs=2)
    assert process_caption("mid", s, epoch=1) == "pre mid post"
    assert process_caption("mid", s, epoch=2) == ""
    assert set(served("mid", subset(caption_dropout_rate=0.5))) == {"", "mid"}


# ----------------------------------------------------------------------------- weighted captions


def test_prompt_attention_parser_matches_upstream_examples():
    """Examples from upstream's parse_prompt_attention docstring."""
    def approx(res):
        return [[t, round(w, 6)] for t, w in res]

    assert parse_prompt_attention("normal text") == [["normal text", 1.0]]
    assert approx(parse_prompt_attention("an (important) word")) == [["an ", 1.0], ["important", 1.1],
                                                                     [" word", 1.0]]
    assert approx(parse_prompt_attention("(unbalanced")) == [["unbalanced", 1.1]]
    assert parse_prompt_attention("\\(literal\\]") == [["(literal]", 1.0]]
    assert approx(parse_prompt_attention("(unnecessary)(parens)")) == [["unnecessaryparens", 1.1]]
    assert approx(parse_prompt_attention("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).")) == approx([
        ["a ", 1.0], ["house", 1.1 * 1.1 * 1.3], [" ", 1.1], ["on", 1.0], [" a ", 1.1], ["hill", 0.55],
        [", sun, ", 1.1], ["sky", 1.1 ** 4], [".", 1.1]])
    assert approx(parse_prompt_attention("[a] b")) == [["a", round(1 / 1.1, 6)], [" b", 1.0]]
    assert parse_prompt_attention("x:1.5) y]") == [["x:1.5) y]", 1.0]]  # nothing open: literal text
    assert parse_prompt_attention("") == [["", 1.0]]


@pytest.fixture(scope="module")
def tiny_clip(tiny_sd1_single_file):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(str(tiny_sd1_single_file.parent / "tokenizers" / "tokenizer"))
    torch.manual_seed(0)
    cfg = CLIPTextConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    return tok, CLIPTextModel(cfg).eval()


@pytest.mark.parametrize("max_token_length", [None, 150])
def test_weighted_captions_scale_the_text_encoder_outputs(tiny_clip, max_token_length):
    from library.families.sd import encode_clip

    tok, te = tiny_clip
    plain_ids = tok("a red cat").input_ids[1:-1]
    with torch.no_grad():
        weighted, pooled_w = encode_clip(tok, te, ["a (red:1.5) [cat]"], max_token_length, None, False, "cpu",
                                         weighted=True)
        plain, pooled = encode_clip(tok, te, ["a red cat"], max_token_length, None, False, "cpu")
    assert weighted.shape == plain.shape
    n = len(plain_ids)
    w_a, w_red, w_cat = 1.0, 1.5, 1 / 1.1
    red_len = len(tok("red").input_ids) - 2
    expected = torch.tensor([1.0] + [w_a] + [w_red] * red_len + [w_cat] * (n - 1 - red_len))
    # the weighted positions are the plain states times their weights; every other position is unchanged
    torch.testing.assert_close(weighted[0, :n + 1], plain[0, :n + 1] * expected[:, None])
    torch.testing.assert_close(weighted[0, n + 1:], plain[0, n + 1:])
    # weighting off: the parentheses are text (other tokens)
    with torch.no_grad():
        literal, _ = encode_clip(tok, te, ["a (red:1.5) [cat]"], max_token_length, None, False, "cpu")
    assert not torch.allclose(literal, weighted)


def test_weighted_token_ids_layout(tiny_clip):
    tok, _ = tiny_clip
    ids, weights = captions.weighted_token_ids(tok, ["(dog:2) cat", ""], 77)
    assert ids.shape == weights.shape == (2, 77)
    dog, cat = tok("dog").input_ids[1:-1], tok("cat").input_ids[1:-1]
    assert ids[0, :1 + len(dog) + len(cat) + 1].tolist() == [tok.bos_token_id] + dog + cat + [tok.eos_token_id]
    assert weights[0, 1:1 + len(dog)].tolist() == [2.0] * len(dog) and weights[0, 0] == 1.0
    assert weights[0, 1 + len(dog):].eq(1.0).all() and ids[1, :2].tolist() == [tok.bos_token_id, tok.eos_token_id]


def test_no_token_padding_pads_to_the_longest_caption(tiny_clip):
    from library.families.sd import encode_clip

    tok, te = tiny_clip
    caps = ["a dog", "a red cat on a chair"]
    with torch.no_grad():
        short, _ = encode_clip(tok, te, caps, None, None, False, "cpu", pad_to_longest=True)
        full, _ = encode_clip(tok, te, caps, None, None, False, "cpu")
    longest = max(len(tok(c).input_ids) for c in caps)
    assert short.shape[1] == longest < full.shape[1] == 77
    torch.testing.assert_close(short[1], full[1, :longest])  # causal attention: same states where both exist


def test_weighted_and_padding_options(capsys, caplog):
    args = parse("--weighted_captions", "--train_data_dir", "x")
    assert captions.weighted_for(args, "sdxl") and not captions.weighted_for(args, "flux")
    with caplog.at_level("WARNING"):
        captions.check_caption_args(args, "flux")
    assert "no effect for FLUX.1" in caplog.text
    bad = SimpleNamespace(no_token_padding=True, cache_text_encoder_outputs=True)
    with pytest.raises(DatasetError, match="--no_token_padding cannot be used with --cache_text_encoder_outputs"):
        captions.check_caption_args(bad, "sd1")


# ----------------------------------------------------------------------------- caption files and datasets


def test_caption_files_multiline_wildcard_and_face_crop_names(tmp_path):
    d = tmp_path / "train" / "2_cls"
    make_image(str(d / "a.png"), (64, 64))
    write(str(d / "a.caption"), "line one\n\n  line {two|2}  \n")
    make_image(str(d / "pic_1_2_3_4.png"), (64, 64))  # upstream's face-crop names read pic.caption
    write(str(d / "pic.caption"), "face crop caption")
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64",
                                      "--enable_wildcard"), "sd1")
    infos = {os.path.basename(i.path): i.caption for i in group.datasets[0].images}
    assert infos == {"a.png": "line one\nline {two|2}", "pic_1_2_3_4.png": "face crop caption"}
    seen = set()
    for epoch in range(1, 12):
        group.set_current_epoch(epoch)
        seen.update(c for b in all_batches(group) for c in b["captions"])
    assert seen == {"line one", "line two", "line 2", "face crop caption"}
    # without --enable_wildcard only the first line is read
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64"), "sd1")
    assert {i.caption for i in group.datasets[0].images} == {"line one", "face crop caption"}
    # a wildcard caption cannot be cached as text-encoder output
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64",
                                      "--enable_wildcard", "--cache_text_encoder_outputs"), "sd1")
    with pytest.raises(DatasetError, match="cannot be cached"):
        group.cache_text_encoder_outputs(lambda caps: {"x": torch.zeros(len(caps), 1)})
    with pytest.raises(DatasetError, match="token_warmup_step cannot be used with --cache_text_encoder_outputs"):
        build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64",
                                  "--token_warmup_step", "5", "--cache_text_encoder_outputs"), "sd1")


def test_token_warmup_follows_the_group_step(tmp_path):
    d = tmp_path / "train" / "1_x"
    make_image(str(d / "a.png"), (64, 64))
    write(str(d / "a.caption"), "k, t1, t2, t3, t4, t5")
    group = build_dataset_group(parse("--train_data_dir", tmp_path / "train", "--resolution", "64",
                                      "--keep_tokens", "1", "--token_warmup_min", "1", "--token_warmup_step", "0.5"),
                                "sd1")
    group.set_max_train_steps(10)  # warm-up over 5 steps: 1 + floor(step * 4 / 5) tags after the kept one
    got = []
    for step in range(7):
        group.set_current_step(step)
        got.append(group[0]["captions"][0])
    assert [len(c.split(", ")) - 1 for c in got] == [1, 1, 2, 3, 4, 5, 5]


def test_fine_tuning_metadata_captions_with_tags_and_wildcards(tmp_path):
    make_image(str(tmp_path / "img" / "one.png"), (64, 64))
    make_image(str(tmp_path / "img" / "two.png"), (64, 64))
    md = {"one": {"caption": "a frog\nsecond line", "tags": "green, pond"}, "two": {"tags": "Tag, tag"}}
    meta = write(str(tmp_path / "meta.json"), json.dumps(md))
    group = build_dataset_group(parse("--in_json", meta, "--train_data_dir", tmp_path / "img", "--resolution", "64",
                                      "--class_tokens", "unused"), "sd1")
    caps = {os.path.basename(i.path): i.caption for i in group.datasets[0].images}
    assert caps == {"one.png": "a frog\nsecond line,green, pond", "two.png": "Tag, tag"}  # no class tokens
    assert json.loads(group.metadata()["ss_tag_frequency"]) == {"meta.json": {"green": 1, "pond": 1, "tag": 2}}
    group = build_dataset_group(parse("--in_json", meta, "--train_data_dir", tmp_path / "img", "--resolution", "64",
                                      "--enable_wildcard"), "sd1")
    caps = {os.path.basename(i.path): i.caption for i in group.datasets[0].images}
    assert caps["one.png"] == "a frog,green, pond\nsecond line,green, pond"
    # upstream's JSONL metadata
    jsonl = write(str(tmp_path / "meta.jsonl"), "\n".join(json.dumps(dict(image_path=k, **v)) for k, v in md.items()))
    group = build_dataset_group(parse("--in_json", jsonl, "--train_data_dir", tmp_path / "img", "--resolution", "64"),
                                "sd1")
    assert {i.caption for i in group.datasets[0].images} == {"a frog\nsecond line,green, pond", "Tag, tag"}


# ----------------------------------------------------------------------------- dataset config schema

UPSTREAM_KEYS = {  # upstream's ConfigSanitizer at 48d368f: key -> (levels, kinds) (what the image keys do is
    # tested in test_image_pipeline.py; conditioning_data_dir belongs to ControlNet datasets, --masked_loss only)
    **{k: ("gds", "db ft") for k in (
        "num_repeats", "shuffle_caption", "keep_tokens", "keep_tokens_separator", "secondary_separator",
        "caption_separator", "enable_wildcard", "token_warmup_min", "token_warmup_step", "caption_prefix",
        "caption_suffix", "custom_attributes", "color_aug", "flip_aug", "random_crop", "caption_dropout_rate",
        "caption_dropout_every_n_epochs", "caption_tag_dropout_rate")},
    "caption_extension": ("gds", "db"), "class_tokens": ("gds", "db"),
    "image_dir": ("s", "db ft"), "is_reg": ("s", "db"), "metadata_file": ("s", "ft"),
    **{k: ("gd", "db ft") for k in ("resolution", "batch_size", "enable_bucket", "min_bucket_reso",
                                     "max_bucket_reso", "bucket_reso_steps", "bucket_no_upscale",
                                     "network_multiplier", "validation_split", "validation_seed")},
    "face_crop_aug_range": ("gds", "db ft"), "resize_interpolation": ("gds", "db ft"), "cache_info": ("gds", "db"),
    "alpha_mask": ("s", "db ft"), "conditioning_data_dir": ("", ""),
}
VALUES = {int: 2, bool: True, str: "x", dict: {"a": 1}, "number": 0.5, "resolution": 64, list: [2.0, 3.0]}


def _config(tmp_path, kind, general=None, dataset=None, sub=None):
    make_image(str(tmp_path / "imgs" / "a.png"), (64, 64))
    if kind == "ft":
        write(str(tmp_path / "meta.json"), json.dumps({"a": {"caption": "c"}}))
        base = {"metadata_file": str(tmp_path / "meta.json"), "image_dir": str(tmp_path / "imgs")}
    else:
        base = {"image_dir": str(tmp_path / "imgs")}
    cfg = {"general": general or {}, "datasets": [{**(dataset or {}), "subsets": [{**base, **(sub or {})}]}]}
    path = tmp_path / "ds.json"  # a JSON dataset config, as upstream also reads
    path.write_text(json.dumps(cfg))
    return str(path)


def test_every_upstream_key_is_accepted_at_its_levels_and_refused_elsewhere(tmp_path):
    assert set(UPSTREAM_KEYS) == set(SCHEMA)
    for key, (levels, kinds) in UPSTREAM_KEYS.items():
        value = VALUES[SCHEMA[key].type]
        for kind in ("db", "ft"):
            for level, where in (("g", "general"), ("d", "dataset"), ("s", "sub")):
                if key in ("image_dir", "metadata_file") and level == "s":
                    continue  # part of every subset already
                path = _config(tmp_path, kind, **{where: {key: value}})
                ok = level in levels and (kind in kinds or level == "g")  # [general]: the script's kinds
                if ok:
                    load_dataset_config(path)
                else:
                    with pytest.raises(DatasetError, match=f"'{key}'"):
                        load_dataset_config(path)
        # a wrong type is named with the key
        path = _config(tmp_path, "db", sub={key: [1, 2, 3]} if SCHEMA[key].type != list else {key: 1})
        if "s" in levels and "db" in kinds:
            with pytest.raises(DatasetError, match=f"'?{key}'?"):
                load_dataset_config(path)


def test_script_kinds_and_mixed_datasets(tmp_path):
    db = _config(tmp_path, "db", general={"caption_extension": ".txt"})
    ft = _config(tmp_path / "ft", "ft")
    load_dataset_config(db, (config_util.DREAMBOOTH,))
    with pytest.raises(DatasetError, match="needs metadata_file"):  # fine_tune.py
        load_dataset_config(db, (config_util.FINETUNING,))
    with pytest.raises(DatasetError, match="'caption_extension' in \\[general\\] is not used by fine-tuning"):
        load_dataset_config(db, (config_util.FINETUNING,))
    with pytest.raises(DatasetError, match="'metadata_file' .* is not used by DreamBooth"):  # train_db.py
        load_dataset_config(ft, (config_util.DREAMBOOTH,))
    mixed = write(str(tmp_path / "mixed.toml"), f"""
[[datasets]]
  [[datasets.subsets]]
  image_dir = "{tmp_path / 'imgs'}"
  [[datasets.subsets]]
  metadata_file = "m.json"
""")
    with pytest.raises(DatasetError, match="cannot be mixed in one dataset"):
        load_dataset_config(mixed)


def test_several_bad_keys_in_one_message(tmp_path):
    make_image(str(tmp_path / "imgs" / "a.png"), (64, 64))
    cfg = write(str(tmp_path / "bad.toml"), """
[general]
shuffle_captions = true
[[datasets]]
resolution = 64
keep_token_separator = "|||"
  [[datasets.subsets]]
  image_dir = "imgs"
  batch_size = 2
  num_repeats = "3"
""")
    with pytest.raises(DatasetError) as e:
        load_dataset_config(cfg)
    msg = str(e.value)
    assert msg.startswith(f"{cfg}: 4 problems:")
    assert "unknown key 'shuffle_captions' in [general]. Did you mean 'shuffle_caption'?" in msg
    assert "unknown key 'keep_token_separator' in [[datasets]] #1. Did you mean 'keep_tokens_separator'?" in msg
    assert "'batch_size' in [[datasets.subsets]] #1 of [[datasets]] #1 is a dataset setting" in msg
    assert "'num_repeats' must be an integer" in msg
    assert "Allowed keys in [general]:" in msg and "Allowed keys in [[datasets]]:" in msg


def test_custom_attributes_and_network_multiplier_reach_the_batch(tmp_path):
    make_image(str(tmp_path / "imgs" / "a.png"), (64, 64))
    cfg = write(str(tmp_path / "ds.toml"), """
[general]
resolution = 64
network_multiplier = 0.5
[[datasets]]
  [[datasets.subsets]]
  image_dir = "imgs"
  custom_attributes = {diff_output_preservation = true}
[[datasets]]
network_multiplier = -1.0
  [[datasets.subsets]]
  image_dir = "imgs"
""")
    group = build_dataset_group(parse("--dataset_config", cfg, "--dataset_repeats", "3"), "sd1")
    # upstream: --dataset_repeats is the num_repeats of config subsets that set none
    assert [s.num_repeats for d in group.datasets for s in d.params.subsets] == [3, 3]
    group.set_current_epoch(1)
    b1, b2 = group[0], group[3]
    assert b1["network_multipliers"].tolist() == [0.5] and b1["custom_attributes"] == [
        {"diff_output_preservation": True}]
    assert b2["network_multipliers"].tolist() == [-1.0] and b2["custom_attributes"] == [{}]

    from library.run.step import set_network_multiplier
    from networks.lora import LoRANetwork

    net = LoRANetwork([], torch.nn.Sequential(torch.nn.Linear(4, 4)), lora_dim=2)
    assert hasattr(net, "set_multiplier")
    set_network_multiplier([net, torch.nn.Linear(1, 1)], b2)
    assert net.multiplier == -1.0 and all(m.multiplier == -1.0 for m in getattr(net, "unet_loras", []))
    set_network_multiplier([net], b1)
    assert net.multiplier == 0.5


# ----------------------------------------------------------------------------- one tiny run


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_sd1_lora_run_with_caption_options(tmp_path, tiny_sd1_single_file):
    """train_network.py with an upstream-style dataset config: the loop feeds the step to token warm-up,
    the dataset's network_multiplier to the LoRA, and --weighted_captions to the text encoding."""
    import train_network
    from library.network_trainer import run

    make_image(str(tmp_path / "imgs" / "a.png"), (64, 64))
    write(str(tmp_path / "imgs" / "a.txt"), "sks (toy:1.2) ||| red;;;blue, circle, square ||| best")
    cfg = write(str(tmp_path / "ds.toml"), f"""
[general]
resolution = 64
caption_extension = ".txt"
keep_tokens_separator = "|||"
secondary_separator = ";;;"
shuffle_caption = true
token_warmup_min = 1
token_warmup_step = 4
[[datasets]]
network_multiplier = 0.5
  [[datasets.subsets]]
  image_dir = "{tmp_path / 'imgs'}"
  custom_attributes = {{diff_output_preservation = true}}
""")

    trainer = train_network.trainer()
    trainer.seen, trainer.multipliers, models = [], [], []
    setup_trainable, encode_prompts = trainer.target.setup_trainable, trainer.family.encode_prompts
    noisy_input_pred_target = trainer.noisy_input_pred_target

    def recording_setup_trainable(*a, **kw):
        trainable = setup_trainable(*a, **kw)
        models.extend(trainable.models)
        return trainable

    def recording_encode_prompts(args, components, caps, with_grad=False, **kw):
        trainer.seen.append((list(caps), models[0].multiplier, args.weighted_captions))
        return encode_prompts(args, components, caps, with_grad, **kw)

    def recording_noisy_input_pred_target(*a, **kw):
        trainer.multipliers.append(models[0].multiplier)
        return noisy_input_pred_target(*a, **kw)

    trainer.target.setup_trainable = recording_setup_trainable
    trainer.family.encode_prompts = recording_encode_prompts
    trainer.noisy_input_pred_target = recording_noisy_input_pred_target
    run(trainer, train_network.setup_parser(), [
        "--pretrained_model_name_or_path", str(tiny_sd1_single_file),
        "--tokenizer_cache_dir", str(tiny_sd1_single_file.parent / "tokenizers"), "--dataset_config", cfg,
        "--output_dir", str(tmp_path / "out"), "--network_module", "networks.lora", "--network_dim", "2",
        "--max_train_steps", "6", "--max_data_loader_n_workers", "0", "--seed", "1", "--weighted_captions"])
    counts = []
    for caps, multiplier, weighted in trainer.seen:
        assert multiplier == 0.5 and weighted
        tags = caps[0].split(", ")
        assert tags[0] == "sks (toy:1.2)"
        assert tags[-1] == "best" and set(tags[1:-1]) <= {"red,blue", "circle", "square"}
        counts.append(len(tags) - 2)
    assert len(counts) == 6 and counts[0] == 1 and counts[-1] == 3 and counts == sorted(counts)
    # differential output preservation: the base model's prediction (multiplier 0) first, then the LoRA's
    assert trainer.multipliers == [0.0, 0.5] * 6


def test_base_model_prediction_draws_the_same_noise_with_multiplier_zero():
    from library.network_trainer import base_model_prediction, diff_output_preservation_indices

    class Net:
        multiplier = 0.7

        def set_multiplier(self, value):
            self.multiplier = value

    net, g = Net(), torch.Generator().manual_seed(0)

    def forward():
        return (torch.randn(3, generator=g) * net.multiplier + torch.randn(3),)

    torch.manual_seed(5)
    prior = base_model_prediction([net], forward, g, "cpu")
    assert net.multiplier == 0.7
    out = forward()[0]  # the training pass: same generator and global draws as the prior pass
    torch.manual_seed(5)
    expected_global = torch.randn(3)
    torch.testing.assert_close(prior, expected_global)
    torch.testing.assert_close(out, torch.randn(3, generator=torch.Generator().manual_seed(0)) * 0.7 + expected_global)
    assert diff_output_preservation_indices({"custom_attributes": [{}, {"diff_output_preservation": True}]}) == [1]


def test_debug_dataset_logs_batches_and_trains_nothing(tmp_path, caplog):
    import train_network
    from library.network_trainer import run

    make_image(str(tmp_path / "train" / "2_cls" / "a.png"), (64, 64))
    write(str(tmp_path / "train" / "2_cls" / "a.caption"), "x, {y|z}")
    with caplog.at_level("INFO"):
        result = run(train_network.trainer(), train_network.setup_parser(), [
            "--pretrained_model_name_or_path", str(tmp_path / "no_model.safetensors"), "--train_data_dir",
            str(tmp_path / "train"), "--resolution", "64", "--output_dir", str(tmp_path / "out"), "--network_module",
            "networks.lora", "--enable_wildcard", "--debug_dataset"])
    assert result is None and not (tmp_path / "out").exists()
    assert "debug_dataset: 2 batches in epoch 1" in caplog.text
    assert "caption: 'x, y'" in caplog.text or "caption: 'x, z'" in caplog.text


def test_sdxl_weighted_captions_scale_both_encoders_not_the_pooled_output(tiny_clip):
    from transformers import CLIPTextModelWithProjection

    import sdxl_train_network

    tok, te1 = tiny_clip
    torch.manual_seed(1)
    te2 = CLIPTextModelWithProjection(te1.config).eval()
    comps = SimpleNamespace(text_encoders=[te1, te2], tokenizers=[tok, tok])
    trainer = sdxl_train_network.trainer().family
    args = SimpleNamespace(max_token_length=None, weighted_captions=True)
    with torch.no_grad():
        w = trainer.encode_prompts(args, comps, ["a (red:2.0) cat"])
        args.weighted_captions = False
        plain = trainer.encode_prompts(args, comps, ["a red cat"])
    red = 1 + len(tok("a").input_ids) - 2  # position of the first 'red' token
    torch.testing.assert_close(w["encoder_hidden_states"][0, red], 2.0 * plain["encoder_hidden_states"][0, red])
    torch.testing.assert_close(w["encoder_hidden_states"][0, :red], plain["encoder_hidden_states"][0, :red])
    torch.testing.assert_close(w["pooled"], plain["pooled"])

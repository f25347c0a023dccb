"""make_captions.py (BLIP), make_captions_by_git.py (GIT) and make_captions_by_florence2.py on tiny random models
built here from their configs, saved to folders and loaded by path (nothing downloaded): the caption files equal
what the model generates for each image on its own (so batching, the data loader and the prompt handling change
nothing), images that will not open are skipped by name, existing captions are kept unless asked."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from finetune_tools import load as _load

WORDS = "a picture of red blue cube ball on the table dog cat with sign".split()
COLOURS = {"a_red": (255, 0, 0), "c_blue": (0, 0, 255), "d_green": (0, 200, 0)}

pytestmark = pytest.mark.usefixtures("one_thread")



def _bert_tokenizer(folder, extra=()):
    from transformers import BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *extra, *WORDS]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return BertTokenizer(str(folder / "vocab.txt"), **({"bos_token": extra[0]} if extra else {})), len(vocab)


def _pil_image_processor(name, size, **kw):
    import transformers

    cls = getattr(transformers, f"{name}Pil", None) or getattr(transformers, name)
    return cls(size={"height": size, "width": size}, **kw)


@pytest.fixture(scope="module")
def tiny_blip(tmp_path_factory):
    from transformers import BlipConfig, BlipForConditionalGeneration, BlipProcessor

    folder = tmp_path_factory.mktemp("blip") / "tiny_blip"
    tok, n = _bert_tokenizer(folder, extra=("[DEC]",))
    cfg = BlipConfig(
        text_config=dict(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         max_position_embeddings=64, bos_token_id=5, pad_token_id=0, sep_token_id=3,
                         eos_token_id=3, initializer_range=0.5),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8, initializer_range=0.5), projection_dim=32)
    torch.manual_seed(0)
    BlipForConditionalGeneration(cfg).eval().save_pretrained(folder)
    BlipProcessor(image_processor=_pil_image_processor("BlipImageProcessor", 32), tokenizer=tok).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_git(tmp_path_factory):
    from transformers import GitConfig, GitForCausalLM, GitProcessor

    folder = tmp_path_factory.mktemp("git") / "tiny_git"
    tok, n = _bert_tokenizer(folder)
    cfg = GitConfig(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=32, patch_size=8),
                    vocab_size=n, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                    max_position_embeddings=64, bos_token_id=2, eos_token_id=3, pad_token_id=0,
                    initializer_range=0.5)
    torch.manual_seed(0)
    GitForCausalLM(cfg).eval().save_pretrained(folder)
    ip = _pil_image_processor("CLIPImageProcessor", 32, crop_size={"height": 32, "width": 32})
    GitProcessor(image_processor=ip, tokenizer=tok).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_florence2(tmp_path_factory):
    """Florence-2 with a byte-level BART tokenizer (no merges), the <image> and <loc_N> tokens, 64 px images."""
    from transformers import BartTokenizer, Florence2Config, Florence2ForConditionalGeneration, Florence2Processor

    from library.tiny_models import _bytes_to_unicode

    folder = tmp_path_factory.mktemp("florence2") / "tiny_florence2"
    folder.mkdir()
    words = ["Ġred", "Ġcube", "Ġblue", "Ġball", "Ġcat"]
    locs = [f"<loc_{i}>" for i in range(1000)]
    vocab = ["<s>", "<pad>", "</s>", "<unk>", *_bytes_to_unicode().values(), *words, "<mask>", "<image>"]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    tok = BartTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"),
                        extra_special_tokens={"image_token": "<image>"})
    tok.add_tokens(locs)
    ip = _pil_image_processor("CLIPImageProcessor", 64, do_center_crop=False)
    ip.image_seq_length = 5  # 64 px / 32 = 2x2 patches + the pooled one
    processor = Florence2Processor(image_processor=ip, tokenizer=tok,
                                   post_processor_config={"pure_text": {}, "description_with_bboxes": {}})
    cfg = Florence2Config(
        text_config=dict(vocab_size=len(tok), d_model=32, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                         max_position_embeddings=128, init_std=0.5),
        vision_config=dict(depths=[1, 1, 1, 1], embed_dim=[8, 16, 16, 32], num_heads=[1, 2, 2, 2],
                           num_groups=[1, 2, 2, 2], window_size=2, projection_dim=32),
        image_token_id=tok.image_token_id)
    torch.manual_seed(0)
    Florence2ForConditionalGeneration(cfg).eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _images(folder, broken=False):
    folder.mkdir(parents=True, exist_ok=True)
    for name, colour in COLOURS.items():
        img = Image.new("RGB", (48, 40), colour)
        img.putpixel((3, 5), (255, 255, 255))
        img.save(folder / f"{name}.png")
    if broken:
        (folder / "b_broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return folder


def _captions(folder, ext=".caption"):
    return {p.stem: p.read_text(encoding="utf-8") for p in sorted(folder.glob(f"*{ext}"))}


def _one_by_one(folder, generate):
    """What the model writes for each image alone (batch of one, no data loader)."""
    out = {}
    with torch.inference_mode():
        for name in COLOURS:
            out[name] = " ".join(generate(Image.open(folder / f"{name}.png").convert("RGB")).split()) + "\n"
    return out


def test_blip_beam_search_batched_equals_one_by_one(tiny_blip, tmp_path, caplog):
    from transformers import BlipForConditionalGeneration, BlipProcessor

    mod = _load("make_captions")
    imgs = _images(tmp_path / "imgs", broken=True)
    with caplog.at_level("ERROR"):
        assert mod.cli([str(imgs), "--caption_weights", str(tiny_blip), "--beam_search", "--num_beams", "2",
                        "--batch_size", "2", "--max_length", "12", "--min_length", "6"]) == 0
    assert "b_broken.jpg" in caplog.text  # skipped by name, the run went on
    proc, model = BlipProcessor.from_pretrained(tiny_blip), BlipForConditionalGeneration.from_pretrained(tiny_blip)

    def generate(img):
        inp = proc(images=img, text="a picture of", return_tensors="pt")
        out = model.generate(**inp, num_beams=2, max_length=12, min_length=6, do_sample=False)
        text = proc.decode(out[0], skip_special_tokens=True)
        assert text.startswith("a picture of")
        return text[len("a picture of"):]

    expected = _one_by_one(imgs, generate)
    assert _captions(imgs) == expected
    assert all(len(c.split()) >= 3 for c in expected.values())


def test_blip_sampling_is_seeded_and_existing_captions_kept(tiny_blip, tmp_path, capsys):
    mod = _load("make_captions")
    imgs = _images(tmp_path / "imgs")
    args = [str(imgs), "--caption_weights", str(tiny_blip), "--max_length", "12", "--caption_extension", ".txt"]
    assert mod.cli(args + ["--seed", "7"]) == 0
    first = _captions(imgs, ".txt")
    assert len(first) == 3
    assert mod.cli(args + ["--seed", "7"]) == 2  # the files exist: nothing replaced without a choice
    assert "--overwrite" in capsys.readouterr().err and _captions(imgs, ".txt") == first
    (imgs / "a_red.txt").write_text("my own caption\n", encoding="utf-8")
    (imgs / "c_blue.txt").unlink()
    assert mod.cli(args + ["--seed", "7", "--skip_existing"]) == 0
    assert _captions(imgs, ".txt")["a_red"] == "my own caption\n" and "c_blue" in _captions(imgs, ".txt")
    assert mod.cli(args + ["--seed", "7", "--overwrite"]) == 0
    assert _captions(imgs, ".txt") == first  # same seed, same captions


def test_blip_original_checkpoint_is_one_clear_line(tmp_path, capsys):
    mod = _load("make_captions")
    imgs = _images(tmp_path / "imgs")
    assert mod.cli([str(imgs), "--caption_weights", str(tmp_path / "model_large_caption_local.pth")]) == 2
    err = capsys.readouterr().err
    assert "--caption_weights" in err and "Salesforce/blip-image-captioning-large" in err and "Traceback" not in err
    assert mod.model_id(mod.DEFAULT_CAPTION_WEIGHTS) == "Salesforce/blip-image-captioning-large"
    assert mod.cli([str(imgs), "--caption_weights", str(tmp_path / "no_such_folder")]) == 2
    assert "could not load" in capsys.readouterr().err
    assert not _captions(imgs)


def test_git_batched_equals_one_by_one(tiny_git, tmp_path):
    from transformers import AutoModelForCausalLM, AutoProcessor

    mod = _load("make_captions_by_git")
    imgs = _images(tmp_path / "imgs")
    assert mod.cli([str(imgs), "--model_id", str(tiny_git), "--batch_size", "3", "--max_length", "10",
                    "--max_data_loader_n_workers", "1"]) == 0
    proc, model = AutoProcessor.from_pretrained(tiny_git), AutoModelForCausalLM.from_pretrained(tiny_git)

    def generate(img):
        out = model.generate(pixel_values=proc(images=img, return_tensors="pt").pixel_values, max_length=10)
        return proc.batch_decode(out, skip_special_tokens=True)[0]

    expected = _one_by_one(imgs, generate)
    assert _captions(imgs) == expected and all(c.strip() for c in expected.values())


def test_git_remove_words_patterns():
    mod = _load("make_captions_by_git")
    assert mod.remove_words('a sign with the words "open late" on the door') == "a sign "  # the place it is on goes too
    assert mod.remove_words("a shop that says welcome on it") == "a shop "
    assert mod.remove_words("a shirt with the number 23 on it") == "a shirt "
    assert mod.remove_words("a red cube on a table") == "a red cube on a table"


def test_florence2_detailed_caption_batched_equals_one_by_one(tiny_florence2, tmp_path):
    from transformers import AutoProcessor, Florence2ForConditionalGeneration

    mod = _load("make_captions_by_florence2")
    imgs = _images(tmp_path / "imgs", broken=True)
    assert mod.cli([str(imgs), "--model_id", str(tiny_florence2), "--batch_size", "2", "--max_new_tokens", "8",
                    "--num_beams", "2"]) == 0
    proc = AutoProcessor.from_pretrained(tiny_florence2)
    model = Florence2ForConditionalGeneration.from_pretrained(tiny_florence2)

    def generate(img):
        inp = proc(images=img, text="<DETAILED_CAPTION>", return_tensors="pt")
        out = model.generate(**inp, max_new_tokens=8, num_beams=2, do_sample=False)
        return proc.batch_decode(out, skip_special_tokens=True)[0]

    expected = _one_by_one(imgs, generate)
    assert _captions(imgs) == expected and all(c.strip() for c in expected.values())


def test_florence2_tags_task(tiny_florence2, tmp_path):
    mod = _load("make_captions_by_florence2")
    assert mod.object_tags(["cat", "red cube", " cat", ""], ", ") == "cat, red cube"
    imgs = _images(tmp_path / "imgs")
    assert mod.cli([str(imgs), "--model_id", str(tiny_florence2), "--task", "tags", "--max_new_tokens", "10",
                    "--caption_extension", ".txt", "--num_beams", "1"]) == 0
    assert set(_captions(imgs, ".txt")) == set(COLOURS)  # a tags file for every image (the tiny model finds
    # whatever its random weights decode to; the label parsing is checked on object_tags above)


def test_captioners_dump_options():
    from library import option_dump

    for name, flag in (("make_captions", "beam_search"), ("make_captions_by_git", "remove_words"),
                       ("make_captions_by_florence2", "task")):
        opts = {o["name"]: o for o in option_dump.describe(_load(name).setup_parser())}
        assert flag in opts and "overwrite" in opts and opts["batch_size"]["default"] == 1
    florence = {o["name"]: o for o in option_dump.describe(_load("make_captions_by_florence2").setup_parser())}
    assert florence["task"]["choices"] == ["caption", "detailed_caption", "more_detailed_caption", "tags"]


def test_florence2_tags_from_detections(tiny_florence2, tmp_path, monkeypatch):
    """--task tags: the labels of the detections the model writes, each once, in order (generate replaced by a
    fixed detection sequence, decoded and parsed by the model's own processor)."""
    from transformers import AutoProcessor, Florence2ForConditionalGeneration

    tok = AutoProcessor.from_pretrained(tiny_florence2).tokenizer
    text = "</s><s>cat<loc_1><loc_2><loc_500><loc_600>red cube<loc_3><loc_4><loc_900><loc_900>" \
           "cat<loc_10><loc_20><loc_30><loc_40></s>"
    ids = torch.tensor([tok(text, add_special_tokens=False).input_ids])
    monkeypatch.setattr(Florence2ForConditionalGeneration, "generate",
                        lambda self, pixel_values=None, **kw: ids.repeat(pixel_values.shape[0], 1))
    imgs = _images(tmp_path / "imgs")
    assert _load("make_captions_by_florence2").cli([str(imgs), "--model_id", str(tiny_florence2), "--task", "tags",
                                                    "--caption_extension", ".txt", "--batch_size", "2"]) == 0
    assert _captions(imgs, ".txt") == {name: "cat, red cube\n" for name in COLOURS}

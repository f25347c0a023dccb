"""Textual inversion (train_textual_inversion.py, sdxl_train_textual_inversion.py, library.targets.embedding) on
tiny models on the CPU: upstream's file keys, read by diffusers' pipelines; only the new rows of the embedding
tables change; --weights continues from a file; --resume continues the run as if never stopped; the captions
and sample prompts are rewritten as upstream does."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.usefixtures("one_thread")


def train(script: str, argv: list) -> str:
    return importlib.import_module(script).main([str(a) for a in argv])


def base_args(model: Path, data: Path, out: Path, steps: int = 2) -> list:
    return ["--pretrained_model_name_or_path", model, "--tokenizer_cache_dir", Path(model).parent / "tokenizers",
            "--train_data_dir", data, "--caption_extension", ".txt", "--resolution", "64", "--output_dir", out,
            "--max_train_steps", steps, "--max_data_loader_n_workers", 0, "--learning_rate", 1e-2, "--seed", 1,
            "--token_string", "zxq", "--init_word", "red circle"]


def tables(comps) -> list[torch.Tensor]:
    return [te.get_input_embeddings().weight.detach().clone() for te in comps.text_encoders]


def state_tables(state_dir: Path, n: int) -> list[torch.Tensor]:
    """The token-embedding tables of the text encoders in an accelerate state folder (the trained modules are
    its first custom checkpoints)."""
    out = []
    for i in range(n):
        sd = torch.load(state_dir / f"custom_checkpoint_{i}.pkl", weights_only=True)
        out.append(next(v for k, v in sd.items() if k.endswith("token_embedding.weight")))
    return out


@pytest.mark.slow
def test_sdxl_embedding_has_clip_l_and_clip_g_that_diffusers_loads(tiny_sdxl_single_file, tiny_dataset_dir,
                                                                   tmp_path):
    from conftest import load_tiny_components
    from library.model_util import make_pipeline

    base = load_tiny_components(tiny_sdxl_single_file, "sdxl")
    before = tables(base)
    path = train("sdxl_train_textual_inversion", base_args(tiny_sdxl_single_file, tiny_dataset_dir, tmp_path) + [
        "--num_vectors_per_token", 2, "--use_object_template", "--save_model_as", "safetensors", "--save_state"])
    assert Path(path) == tmp_path / "zxq.safetensors"  # the output name defaults to the token string
    with safe_open(path, "pt") as f:
        assert sorted(f.keys()) == ["clip_g", "clip_l"]
        assert f.metadata()["modelspec.architecture"] == "stable-diffusion-xl-v1-base/textual-inversion"
    emb = load_file(path)
    assert emb["clip_l"].shape == (2, before[0].shape[1]) and emb["clip_g"].shape == (2, before[1].shape[1])

    # only the new rows were trained: the text encoders' tables in the saved state keep every old row
    n_old = [t.shape[0] for t in before]
    for old, new, key in zip(before, state_tables(tmp_path / "zxq-state", 2), ("clip_l", "clip_g")):
        assert new.shape[0] == old.shape[0] + 2
        assert torch.equal(new[:old.shape[0]], old)
        assert torch.equal(new[old.shape[0]:], emb[key])
    init = base.tokenizers[0].encode("red circle", add_special_tokens=False)
    assert not torch.equal(emb["clip_l"], before[0][init])  # trained away from the init word's rows

    pipe = make_pipeline(base)
    pipe.load_textual_inversion(emb["clip_l"], token="zxq", text_encoder=pipe.text_encoder,
                                tokenizer=pipe.tokenizer)
    pipe.load_textual_inversion(emb["clip_g"], token="zxq", text_encoder=pipe.text_encoder_2,
                                tokenizer=pipe.tokenizer_2)
    ids = pipe.tokenizer.convert_tokens_to_ids(["zxq", "zxq_1"])
    assert ids == [n_old[0], n_old[0] + 1]
    assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[ids], emb["clip_l"])
    ids2 = pipe.tokenizer_2.convert_tokens_to_ids(["zxq", "zxq_1"])
    assert torch.equal(pipe.text_encoder_2.get_input_embeddings().weight[ids2], emb["clip_g"])
    image = pipe("a photo of zxq", num_inference_steps=1, height=64, width=64, output_type="np").images[0]
    assert image.shape == (64, 64, 3)


@pytest.mark.slow
def test_sd1_emb_params_load_in_diffusers_and_resume_continues_the_run(tiny_sd1_single_file, tiny_dataset_dir,
                                                                       tmp_path, caplog):
    import logging

    from conftest import load_tiny_components
    from library.model_util import make_pipeline

    base = load_tiny_components(tiny_sd1_single_file, "sd1")
    before = tables(base)[0]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of zxq --n zxq, blurry --w 64 --h 64 --s 1 --d 3\n")
    caplog.set_level(logging.INFO, logger="library.sampling")
    whole = train("train_textual_inversion", base_args(tiny_sd1_single_file, tiny_dataset_dir, tmp_path / "whole", 4)
                  + ["--num_vectors_per_token", 3, "--sample_prompts", prompts, "--sample_every_n_steps", 4])
    assert whole.endswith("zxq.pt")  # upstream's default format
    # the sample prompt's token string stands for the three tokens, as upstream
    assert "prompt 'a photo of zxq zxq1 zxq2'" in caplog.text
    assert len(list((tmp_path / "whole" / "sample").glob("zxq_*.png"))) == 1
    emb = torch.load(whole, weights_only=True)
    assert list(emb) == ["emb_params"] and emb["emb_params"].shape == (3, before.shape[1])

    pipe = make_pipeline(base)
    pipe.load_textual_inversion(whole, token="zxq")
    ids = pipe.tokenizer.convert_tokens_to_ids(["zxq", "zxq_1", "zxq_2"])
    assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[ids], emb["emb_params"])
    assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[:before.shape[0]], before)

    # 2 steps saved with their state, then resumed to 4: the same vectors as the uninterrupted run
    part = tmp_path / "part"
    common = base_args(tiny_sd1_single_file, tiny_dataset_dir, part, 4) + ["--num_vectors_per_token", 3]
    train("train_textual_inversion", common + ["--save_every_n_steps", 2, "--save_state"])
    state = part / "zxq-step00000002-state"
    assert state.is_dir()
    stepped = torch.load(part / "zxq-step00000002.pt", weights_only=True)["emb_params"]
    resumed = train("train_textual_inversion", common + ["--resume", state, "--output_name", "zxq_resumed"])
    assert torch.equal(torch.load(resumed, weights_only=True)["emb_params"], emb["emb_params"])
    assert not torch.equal(stepped, emb["emb_params"])

    # --weights: a run that starts from the file starts from its vectors (0 steps of learning rate 0)
    again = train("train_textual_inversion", base_args(tiny_sd1_single_file, tiny_dataset_dir, tmp_path / "w", 1)
                  + ["--num_vectors_per_token", 3, "--weights", whole, "--learning_rate", 0])
    assert torch.equal(torch.load(again, weights_only=True)["emb_params"], emb["emb_params"])


def test_templates_and_token_expansion_rewrite_captions(tiny_dataset_dir, tmp_path):
    """The captions a real dataset serves: the token string expanded to the tokens, or one of upstream's
    templates around them; the sample prompts get the same expansion."""
    import train_textual_inversion
    from library import config_util
    from library.targets import embedding

    captions = tmp_path / "data" / "1_zxq"
    captions.mkdir(parents=True)
    for f in (tiny_dataset_dir / "2_demo").glob("img_0.*"):
        (captions / f.name).write_bytes(f.read_bytes())
    (captions / "img_0.txt").write_text("a zxq on grass")

    def served(*argv):
        args = train_textual_inversion.setup_parser().parse_args(
            ["--train_data_dir", str(tmp_path / "data"), "--caption_extension", ".txt", "--resolution", "64",
             "--token_string", "zxq", "--num_vectors_per_token", "3", *argv])
        group, _ = config_util.build_dataset_groups(args, "sd1")
        target = embedding.Embedding()
        target.prepare_dataset(args, [group])
        return group[0]["captions"][0], target.sample_args(args)

    caption, sample_args = served()
    assert caption == "a zxq zxq1 zxq2 on grass"
    assert sample_args.prompt_replacement == ("zxq", "zxq zxq1 zxq2")
    caption, _ = served("--use_style_template")
    assert caption in [t.format("zxq zxq1 zxq2") for t in embedding.STYLE_TEMPLATES]
    caption, _ = served("--use_object_template")
    assert caption in [t.format("zxq zxq1 zxq2") for t in embedding.OBJECT_TEMPLATES]


@pytest.mark.parametrize("argv, message", [
    ([], "--token_string is required"),
    (["--token_string", "zxq", "--num_vectors_per_token", "0"], "--num_vectors_per_token must be 1 or more"),
    (["--token_string", "zxq", "--weights", "missing.pt"], "--weights: file not found"),
    (["--token_string", "zxq", "--weights", "{emb}"], "emb_params has 2 vectors; --num_vectors_per_token is 1"),
    (["--token_string", "zxq", "--weights", "{bad}"], "cannot read the embedding file"),
    (["--token_string", "zxq", "--cache_text_encoder_outputs"], "--cache_text_encoder_outputs cannot be used"),
])
def test_bad_options_are_one_line(argv, message, tiny_sd1_single_file, tiny_dataset_dir, tmp_path, capsys):
    emb, bad = tmp_path / "two.safetensors", tmp_path / "bad.pt"
    save_file({"emb_params": torch.zeros(2, 8)}, str(emb))
    bad.write_bytes(b"not a torch file")
    argv = ["--pretrained_model_name_or_path", tiny_sd1_single_file, "--train_data_dir", tiny_dataset_dir,
            "--output_dir", tmp_path, "--validate_only"] + [a.format(emb=emb, bad=bad) for a in argv]
    with pytest.raises(SystemExit) as e:
        train("train_textual_inversion", argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


# -- the GUI: the Textual Inversion tab and kohya_ss' TI configurations -------------------------------------------

KOHYA_SS_TI = sorted((Path(__file__).parent / "data" / "kohya_ss_ti").glob("*.json"))  # kohya_ss' test/config


def test_the_ti_tab_prints_the_textual_inversion_command_from_its_preset():
    from kohya_gui import params as P
    from kohya_gui.ui import actions as A

    assert P.TABS.index("ti") == P.TABS.index("finetune") + 1 and P.tab_families("ti") == ["SD1.x", "SD2.x", "SDXL"]
    out = A.open_preset("ti", "demo-sdxl-tiny", "SD1.x")
    family = out[2]["value"]
    values = [u["value"] for u in out[3:3 + len(A.tab_params("ti"))]]
    cmd, standalone, status, _, _ = A.print_command("ti", family, *values)
    assert family == "SDXL" and "Error" not in status
    assert "sd-scripts/sdxl_train_textual_inversion.py --config_file" in cmd
    for flag in ("--token_string zxc", "--init_word shape", "--num_vectors_per_token 2", "--use_object_template",
                 "--save_model_as safetensors"):
        assert flag in standalone
    # the same settings for SD1.x run upstream's SD script
    from kohya_gui import command

    sd1, _ = A.values_from_ui("ti", values)
    argv = command.standalone_argv("ti", "SD1.x", sd1)
    assert any(a.endswith("sd-scripts/train_textual_inversion.py") for a in argv) and "--token_string" in argv


@pytest.mark.skipif(not KOHYA_SS_TI, reason="kohya_ss TI configs not found")
@pytest.mark.parametrize("path", KOHYA_SS_TI, ids=lambda p: p.name)
def test_kohya_ss_ti_configs_import_into_the_ti_tab(path, tmp_path, tiny_dataset_dir, capsys):
    import json

    from kohya_gui import command, config_file, importer

    data = json.loads(path.read_text())
    imp = importer.load(path)
    assert (imp.tab, imp.family) == ("ti", "SDXL" if data["sdxl"] else "SD1.x")
    assert [k for k, _, _ in imp.report] == list(data)  # every key reported, once
    v = imp.values
    assert (v["token_string"], v["init_word"], v["num_vectors_per_token"]) == ("zxc", "*", 8)
    assert v["use_style_template"] is True and not v.get("use_object_template")  # template "style template"
    report = {k: (what, why) for k, what, why in imp.report}
    assert report["stop_text_encoder_training"][0] == "dropped"  # train_db.py's; the TI scripts have none
    out = importer.write(imp, tmp_path / "ti.toml")
    assert config_file.load(out).tab == "ti"

    # the trainer's own checks on the command the tab builds (tiny data, an empty model file: no model loads)
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"")
    values = dict(v, pretrained_model_name_or_path=str(model), train_data_dir=str(tiny_dataset_dir),
                  output_dir=str(tmp_path / "out"), sample_prompts="", dataset_config="", logging_dir="",
                  optimizer_type="AdamW")  # AdamW8bit needs bitsandbytes, an optional package
    script = command.P.script_for(imp.tab, imp.family)
    argv = command.trainer_args(imp.tab, imp.family, values)
    assert "--use_style_template" in argv and script.endswith("textual_inversion.py")
    capsys.readouterr()
    importlib.import_module(script.removesuffix(".py")).main(argv + ["--validate_only"])
    assert "validate_only: ok" in capsys.readouterr().out


def test_a_flux_ti_configuration_is_refused_with_one_line():
    from kohya_gui import importer

    with pytest.raises(importer.ImportError_, match="Textual Inversion tab trains SD1.x, SD2.x, SDXL"):
        importer.from_kohya_ss({"token_string": "zxc", "flux1_checkbox": True})

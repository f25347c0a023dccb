"""Importing kohya_ss GUI configurations (kohya_gui.importer): every preset kohya_ss ships imports with every key
reported, the mappings follow kohya_ss' meaning, the result reopens in the GUI and passes the trainer's own
--validate_only, and the CLI never overwrites."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kohya_gui import REPO, __main__ as cli, config_file, importer, trainer_check
from kohya_gui import params as P

PRESETS = REPO.parent / "shared" / "parity" / "kohya_ss-presets"
ALL = sorted(PRESETS.glob("*/*.json")) if PRESETS.is_dir() else []
needs_presets = pytest.mark.skipif(not ALL, reason=f"kohya_ss presets not found at {PRESETS}")


@needs_presets
@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_every_kohya_ss_preset_imports_with_every_key_reported(path, tmp_path):
    data = json.loads(path.read_text())
    imp = importer.load(path)
    if data.get("sd3_checkbox"):  # kohya_ss' SD3 presets: the SD3 family (sd3_train.py)
        assert imp.family == "SD3" and P.script_for(imp.tab, imp.family) == "sd3_train.py"
    assert [k for k, _, _ in imp.report] == list(data)  # every key, in the file's order, once
    out = importer.write(imp, tmp_path / "out.toml")
    cfg = config_file.load(out)  # our TOML, which the GUI opens
    assert (cfg.tab, cfg.family) == (imp.tab, imp.family)


def kohya(**kw):
    base = {"LoRA_type": "Standard", "sdxl": True, "max_resolution": "1024,1024", "optimizer": "AdamW8bit",
            "seed": "1234", "network_dim": 32, "network_alpha": "16", "learning_rate": "0.0001"}
    return {**base, **kw}


def test_kohya_ss_meanings():
    imp = importer.from_kohya_ss(kohya(epoch=10, lr_warmup=5, xformers="sdpa", text_encoder_lr=[5e-05, 5e-05],
                                       noise_offset_type="Multires", noise_offset=0.05,
                                       multires_noise_iterations="6", save_every_n_steps=0))
    v = imp.values
    assert (imp.tab, imp.family) == ("lora", "SDXL")
    assert v["resolution"] == "1024,1024" and v["optimizer_type"] == "AdamW8bit" and v["seed"] == 1234
    assert v["network_alpha"] == 16.0 and v["learning_rate"] == 1e-4  # numbers written as text
    assert v["max_train_epochs"] == 10 and v["lr_warmup_steps"] == 0.05  # 5% of the steps: a ratio
    assert v["sdpa"] is True and not v.get("xformers")
    assert v["text_encoder_lr"] == 5e-05
    assert v["multires_noise_iterations"] == 6 and v["noise_offset"] is None  # Multires: no plain offset
    assert v["save_every_n_steps"] is None  # kohya_ss' 0 = not set
    assert v["network_module"] == "networks.lora"
    report = {k: (what, why) for k, what, why in imp.report}
    assert report["noise_offset"][0] == "dropped" and "Multires" in report["noise_offset"][1]


def test_lycoris_types_become_module_and_args():
    imp = importer.from_kohya_ss(kohya(LoRA_type="LyCORIS/LoKr", factor=8, conv_dim=16, conv_alpha=8, dora_wd=True,
                                       unit=1, LyCORIS_preset="attn-mlp", rank_dropout_scale=True))
    v = imp.values
    assert v["network_module"] == "lycoris.kohya"
    # the LoKr fields of the form hold them (unit is DyLoRA's only; LyCORIS reads no rank_dropout_scale)
    assert (v["network_args.algo"], v["network_args.factor"], v["network_args.conv_dim"]) == ("lokr", 8, 16)
    assert (v["network_args.conv_alpha"], v["network_args.dora_wd"], v["network_args.preset"]) == \
        (8.0, True, "attn-mlp")
    assert v["network_args"] == []
    report = {k: (what, why) for k, what, why in imp.report}
    assert report["rank_dropout_scale"] == ("dropped", "lycoris.kohya does not read rank_dropout_scale")
    assert report["unit"][0] == "dropped"
    assert sorted(P.fold_network_args("lora", imp.family, v)["network_args"]) == sorted(
        ["algo=lokr", "conv_dim=16", "conv_alpha=8.0", "dora_wd=True", "factor=8", "preset=attn-mlp"])
    dylora = importer.from_kohya_ss(kohya(LoRA_type="Kohya DyLoRA", unit=4))
    assert dylora.values["network_module"] == "networks.dylora" and dylora.values["network_args.unit"] == 4
    # kohya_ss' names for LyCORIS keys: constrain -> constraint, unit -> block_size (LyCORIS DyLoRA)
    oft = importer.from_kohya_ss(kohya(LoRA_type="LyCORIS/Diag-OFT", constrain=0.5))
    assert oft.values["network_args.constraint"] == 0.5
    lycoris_dylora = importer.from_kohya_ss(kohya(LoRA_type="LyCORIS/DyLoRA", unit=2))
    assert lycoris_dylora.values["network_args.block_size"] == 2


def test_inline_prompts_go_to_a_file_and_the_cli_never_overwrites(tmp_path, capsys):
    src = tmp_path / "kohya.json"
    src.write_text(json.dumps(kohya(sample_prompts="a photo of sks dog --w 1024\na cat --s 20",
                                    sample_every_n_steps=100)))
    out = tmp_path / "ours.toml"
    assert cli.main(["import", str(src), "-o", str(out)]) == 0
    prompts = out.with_suffix(".prompts.txt")
    assert prompts.read_text().splitlines() == ["a photo of sks dog --w 1024", "a cat --s 20"]
    assert config_file.load(out).values["sample_prompts"] == str(prompts)
    assert "LoRA_type: converted" in capsys.readouterr().out
    before = out.read_bytes()
    assert cli.main(["import", str(src), "-o", str(out)]) == 2
    assert "exists" in capsys.readouterr().err and out.read_bytes() == before
    assert cli.main(["print-command", str(src)]) == 0  # the JSON directly
    assert "sdxl_train_network.py" in capsys.readouterr().out
    assert cli.main(["import", str(tmp_path / "missing.json"), "-o", str(tmp_path / "x.toml")]) == 2


def assert_only_missing_packages(problems):
    """The only problem allowed: an optional package this machine lacks (e.g. bitsandbytes for AdamW8bit)."""
    assert all("needs the Python package" in p and "is not installed" in p for p in problems), problems


def with_tiny_paths(imp, tmp_path, data_dir):
    """The imported settings with the user's paths replaced by an empty model file and the tiny dataset."""
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"")  # --validate_only loads no model
    v = dict(imp.values)
    v.update(pretrained_model_name_or_path=str(model), train_data_dir=str(data_dir),
             output_dir=str(tmp_path / "out"), output_name="imported", sample_prompts="", dataset_config="",
             in_json="", reg_data_dir="", logging_dir="", resume="", network_weights="", vae="",
             dim_from_weights=False)  # it reads the network weights, which are the user's file
    for key in ("clip_l", "t5xxl", "ae"):
        if key in v:
            v[key] = str(model)
    return v


@needs_presets
@pytest.mark.parametrize("path", [p for p in ALL if not json.loads(p.read_text()).get("sd3_checkbox")],
                         ids=lambda p: p.name)
def test_every_imported_preset_passes_the_trainers_own_checks(path, tmp_path, tiny_dataset_dir, capsys):
    """The command the GUI builds from each imported kohya_ss preset, run in-process with --validate_only (the
    scripts' own checks; no model loads): ok, or only an optional package this machine lacks."""
    import importlib

    from kohya_gui import command
    from kohya_gui import params as P

    imp = importer.load(path)
    values = with_tiny_paths(imp, tmp_path, tiny_dataset_dir)
    script = P.script_for(imp.tab, imp.family).removesuffix(".py")
    try:
        importlib.import_module(script).main(command.trainer_args(imp.tab, imp.family, values) + ["--validate_only"])
        problems = []
    except SystemExit as e:
        assert e.code == 2
        problems = trainer_check.parse_errors(capsys.readouterr().err)
        assert problems
    assert_only_missing_packages(problems)


@needs_presets
@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora/SDXL - LoKR v1.0.json", "lora/flux1D - adamw8bit fp8.json",
                                  "finetune/SDXL - AI_Now PagedAdamW8bit v1.0.json"])
def test_imported_presets_pass_the_trainers_check(name, tmp_path, tiny_dataset_dir):
    imp = importer.load(PRESETS / name)
    v = with_tiny_paths(imp, tmp_path, tiny_dataset_dir)
    if imp.family in ("SDXL", "FLUX.1"):
        v["compile"] = False
    assert_only_missing_packages(trainer_check.problems(imp.tab, imp.family, v))


def test_open_in_the_gui_fills_the_form_and_shows_the_report(tmp_path):
    from gui_helpers import ui_values_from_updates

    from kohya_gui.ui import actions as A

    src = tmp_path / "kohya.json"
    src.write_text(json.dumps(kohya(LoRA_type="LyCORIS/LoCon", conv_dim=8, train_on_input=True)))
    out = A.open_config("lora", str(src), "SD1.x")
    assert "Imported the kohya_ss configuration" in out[0] and "train_on_input" in out[0]
    assert out[1]["value"] == "SDXL"
    values = dict(zip([p.name for p in A.tab_params("lora")], ui_values_from_updates("lora", out)))
    assert values["network_module"] == "lycoris.kohya" and values["network_args"] == ""
    assert (values["network_args.algo"], values["network_args.conv_dim"]) == ("locon", "8")  # its LoCon fields
    wrong_tab = A.open_config("dreambooth", str(src), "SDXL")
    assert "open it in that tab" in wrong_tab[0]


def test_kohya_ss_presets_in_the_dropdown_import_when_chosen(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # configs/ (where Save goes) is relative to the working folder
    from kohya_gui import presets
    from kohya_gui.ui import actions as A

    names = presets.dropdown_choices("lora")
    assert "demo-sdxl-tiny" in names and "kohya_ss: SDXL - LoKR v1.0" in names
    out = A.open_preset("lora", "kohya_ss: SDXL - LoKR v1.0", "SD1.x")
    assert out[0]["value"] == "configs/lora/SDXL - LoKR v1.0.toml"  # Save goes to the user's folder
    assert "Loaded preset" in out[1] and "Import report" in out[1] and out[2]["value"] == "SDXL"


def test_an_upstream_output_config_imports_key_for_key(tmp_path):
    import tomlkit
    from test_upstream_configs import upstream_output_config

    values = upstream_output_config("model.safetensors", "tok", "data", "out")
    path = tmp_path / "config_lora-20260101.toml"
    path.write_text(tomlkit.dumps(values))
    imp = importer.load(path)
    assert imp.tab == "lora"
    report = {k: what for k, what, _ in imp.report}
    assert set(report) == set(values) and set(report.values()) <= {"mapped"}, report
    for key, value in values.items():
        got = imp.values[key]
        assert got == value or got == pytest.approx(value), key


# ---- issue 31: the run a kohya_ss config means -----------------------------------------------------------------

def validate_in_process(imp, values, capsys) -> list[str]:
    """The trainer's own --validate_only on the command the GUI builds, in-process: [] when ok, else the problems."""
    import importlib

    from kohya_gui import command

    script = P.script_for(imp.tab, imp.family).removesuffix(".py")
    try:
        importlib.import_module(script).main(command.trainer_args(imp.tab, imp.family, values) + ["--validate_only"])
    except SystemExit as e:
        assert e.code == 2
        return trainer_check.parse_errors(capsys.readouterr().err)
    return []


def argv_of(imp) -> list[str]:
    from kohya_gui import command

    return command.trainer_args(imp.tab, imp.family, imp.values)


@pytest.mark.parametrize("tab", ["dreambooth", "finetune"])
def test_the_text_encoder_rate_of_sd_dreambooth_and_finetune_comes_through(tab):
    """kohya_ss passes learning_rate_te to train_db.py / fine_tune.py under that name (0: not trained)."""
    imp = importer.from_kohya_ss({"learning_rate": 5e-5, "learning_rate_te": 1e-5, "v2": False}, tab)
    assert imp.values["learning_rate_te"] == 1e-5 and "text_encoder_lr" not in imp.values
    argv = argv_of(imp)
    assert argv[argv.index("--learning_rate_te") + 1] == "1e-05"
    frozen = importer.from_kohya_ss({"learning_rate": 5e-5, "learning_rate_te": 0}, tab)
    assert frozen.values["learning_rate_te"] == 0.0


def test_sdxl_dreambooth_trains_the_text_encoders_when_a_rate_is_above_zero():
    """dreambooth_gui.py: train_text_encoder = learning_rate_te1 > 0 or learning_rate_te2 > 0 (SDXL)."""
    imp = importer.from_kohya_ss({"sdxl": True, "learning_rate": 1e-5, "learning_rate_te1": 1e-5,
                                  "learning_rate_te2": 0}, "dreambooth")
    argv = argv_of(imp)
    assert "--train_text_encoder" in argv and argv[argv.index("--learning_rate_te1") + 1] == "1e-05"
    assert imp.values["learning_rate_te2"] == 0.0  # that one stays frozen
    unet_only = importer.from_kohya_ss({"sdxl": True, "learning_rate_te1": 0, "learning_rate_te2": 0}, "dreambooth")
    assert "--train_text_encoder" not in argv_of(unet_only)
    report = {k: what for k, what, _ in unet_only.report}
    assert report["learning_rate_te1"] == "dropped"


def test_a_lora_text_encoder_rate_of_zero_trains_the_unet_only(tmp_path, tiny_dataset_dir, capsys):
    """lora_gui.py: text_encoder_lr 0 with a UNet rate -> --network_train_unet_only (so caching the text-encoder
    outputs is allowed, as in kohya_ss); a UNet rate of 0 -> --network_train_text_encoder_only."""
    imp = importer.from_kohya_ss(kohya(optimizer="AdamW", text_encoder_lr=0, unet_lr=1e-4,
                                       sdxl_cache_text_encoder_outputs=True))
    assert imp.values["network_train_unet_only"] is True and imp.values["text_encoder_lr"] is None
    assert "--network_train_unet_only" in argv_of(imp) and "--cache_text_encoder_outputs" in argv_of(imp)
    assert validate_in_process(imp, with_tiny_paths(imp, tmp_path, tiny_dataset_dir), capsys) == []
    te_only = importer.from_kohya_ss(kohya(text_encoder_lr=1e-5, unet_lr=0))
    assert te_only.values["network_train_text_encoder_only"] is True and te_only.values["text_encoder_lr"] == 1e-5
    both = importer.from_kohya_ss(kohya(text_encoder_lr=0, unet_lr=0))
    assert not both.values.get("network_train_unet_only") and not both.values.get("network_train_text_encoder_only")


def test_a_run_toml_keeps_a_zero_rate(tmp_path):
    """In a run TOML the keys are the trainer's options: text_encoder_lr = 0 is passed on (upstream then leaves the
    text encoder's parameter groups out)."""
    path = tmp_path / "config_lora.toml"
    path.write_text('network_module = "networks.lora"\ntext_encoder_lr = 0.0\nunet_lr = 0.0001\n'
                    'pretrained_model_name_or_path = "m.safetensors"\n')
    imp = importer.load(path)
    argv = argv_of(imp)
    assert argv[argv.index("--text_encoder_lr") + 1] == "0.0"


def finetune_form(folder, train_dir, **kw):
    return {"sdxl_checkbox": True, "use_latent_files": "No", "image_folder": str(folder), "train_dir": str(train_dir),
            "caption_extension": ".txt", "dataset_repeats": "3", "full_path": True, "learning_rate": 1e-6,
            "max_resolution": "64,64", "optimizer": "AdamW", **kw}


def flat_images(folder):
    """kohya_ss' fine-tune image folder: images and their caption files side by side, no N_name subfolders."""
    from PIL import Image

    folder.mkdir()
    for i in range(3):
        Image.new("RGB", (64, 64), (i * 60, 90, 200)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(f"a photo number {i}")
    return folder


def test_finetune_data_comes_through_as_kohya_ss_runs_it(tmp_path, capsys):
    """finetune_gui.py: the images are image_folder; with "generate caption database" kohya_ss first merges their
    caption files into train_dir/meta_cap.json. Here the run reads those caption files straight from the folder (a
    dataset config written beside ours), and the trainer finds the images; without it, in_json is kohya_ss'
    metadata file."""
    folder = flat_images(tmp_path / "images")
    src = tmp_path / "ft.json"
    src.write_text(json.dumps(finetune_form(folder, tmp_path / "train", generate_caption_database=True)))
    out = tmp_path / "ours.toml"
    assert cli.main(["import", str(src), "-o", str(out)]) == 0
    cfg = config_file.load(out)
    dataset = Path(cfg.values["dataset_config"])
    assert dataset == tmp_path / "ours.dataset.toml"
    import tomllib

    subset = tomllib.loads(dataset.read_text())["datasets"][0]["subsets"][0]
    assert subset == {"image_dir": str(folder), "num_repeats": 3, "caption_extension": ".txt"}
    imp = importer.load(src)
    values = with_tiny_paths(imp, tmp_path, tmp_path / "unused")
    values.update(dataset_config=str(dataset), train_data_dir="", compile=False)
    capsys.readouterr()
    assert validate_in_process(imp, values, capsys) == []
    assert "(3 training images" in capsys.readouterr().out
    existing = importer.from_kohya_ss(finetune_form(folder, tmp_path / "train", generate_caption_database=False,
                                                    use_latent_files="Yes"))
    assert existing.values["train_data_dir"] == str(folder)
    assert existing.values["in_json"] == f"{tmp_path / 'train'}/meta_lat.json" and not existing.side_files


@pytest.mark.parametrize("content, why", [
    ({"img1": {"caption": "a dog", "tags": "dog"}, "img2": {"caption": "a cat"}}, "caption metadata"),
    ({}, "holds no settings"),
    ({"foo": 1, "bar": "x"}, "none of its keys is a training setting"),
])
def test_files_that_are_no_configuration_here_are_refused_with_one_line(tmp_path, capsys, content, why):
    src = tmp_path / "file.json"
    src.write_text(json.dumps(content))
    assert cli.main(["import", str(src), "-o", str(tmp_path / "out.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and why in err and str(src) in err
    assert not (tmp_path / "out.toml").exists()
    from kohya_gui.ui import actions as A

    assert why in A.open_config("lora", str(src), "SDXL")[0]


def test_an_empty_toml_and_a_dataset_config_are_refused(tmp_path, capsys):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    dataset = tmp_path / "dataset.toml"
    dataset.write_text('[general]\nresolution = 512\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "x"\n')
    for path, why in ((empty, "holds no settings"), (dataset, "this is a dataset config")):
        assert cli.main(["import", str(path), "-o", str(tmp_path / "out.toml")]) == 2
        assert why in capsys.readouterr().err


def test_import_and_print_command_guess_the_same_family(tmp_path, capsys):
    """One rule for a run TOML that does not say its family: import and print-command (Open) agree, and the import
    says what it assumed."""
    import tomlkit
    from test_upstream_configs import upstream_output_config

    path = tmp_path / "config_lora.toml"
    path.write_text(tomlkit.dumps(upstream_output_config("model.safetensors", "tok", "data", "out")))
    imp = importer.load(path)
    assert imp.family == config_file.load(path).family == "SDXL"
    assert imp.notes and "SDXL is assumed" in imp.notes[0]
    sd = tmp_path / "config_db.toml"
    sd.write_text('pretrained_model_name_or_path = "m.ckpt"\nlearning_rate_te = 1e-6\n')  # train_db.py's option
    assert importer.load(sd).family == config_file.load(sd, "dreambooth").family == "SD1.x"
    assert importer.load(sd, family="SD2.x").family == "SD2.x"


@pytest.mark.slow
def test_print_command_warns_as_the_guis_print(tmp_path, tiny_dataset_dir, capsys):
    """print-command on the command line shows what the GUI's Print shows: the trainer's own problems (missing
    model and data, an unknown optimizer, a resolution it refuses) as warnings, after the command."""
    def warnings(**kw):
        cfg = tmp_path / "c.toml"
        values = {**P.defaults("lora"), "pretrained_model_name_or_path": str(tmp_path / "no.safetensors"),
                  "output_dir": str(tmp_path), "output_name": "x", **kw}
        config_file.save(cfg, "lora", "SDXL", values)
        assert cli.main(["print-command", str(cfg)]) == 0
        out, err = capsys.readouterr()
        assert "sdxl_train_network.py" in out
        return "\n".join(ln for ln in err.splitlines() if ln.startswith("warning:"))

    found = warnings(train_data_dir=str(tmp_path / "nodata"), optimizer_type="NoSuchOpt")
    assert "no.safetensors" in found and "nodata" in found and "NoSuchOpt" in found
    assert "resolution" in warnings(train_data_dir=str(tiny_dataset_dir), resolution="64,abc")


def test_import_has_its_own_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["import", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m kohya_gui import") and "--output" in out and "--family" in out


def test_gui_import_keeps_the_inline_prompts_through_save_and_clears_the_preset(tmp_path, monkeypatch):
    """Open a kohya_ss JSON in the GUI: the inline prompts are written at once to a file beside where Save goes
    (configs/<tab>/<name>.prompts.txt, never over another file), the form holds its path, Save keeps it; the
    path box names our TOML and the Preset box is cleared."""
    from gui_helpers import ui_values_from_updates

    from kohya_gui.ui import actions as A

    monkeypatch.chdir(tmp_path)
    src = tmp_path / "mine.json"
    src.write_text(json.dumps(kohya(sample_prompts="a photo of sks dog --w 1024\na cat", sample_every_n_steps=10)))
    (tmp_path / "configs" / "lora").mkdir(parents=True)
    (tmp_path / "configs" / "lora" / "mine.prompts.txt").write_text("someone else's prompts\n")
    out = A.open_from_box("lora", str(src), "SD1.x")
    *opened, path_box, preset_box = out
    assert "Imported the kohya_ss configuration" in opened[0] and preset_box == {"value": None, "__type__": "update"}
    assert path_box["value"] == str(Path("configs/lora/mine.toml"))
    prompts = Path("configs/lora/mine-2.prompts.txt")  # the existing file stays as it was
    assert prompts.read_text() == "a photo of sks dog --w 1024\na cat\n" and str(prompts) in opened[0]
    assert (tmp_path / "configs/lora/mine.prompts.txt").read_text() == "someone else's prompts\n"
    ui = ui_values_from_updates("lora", opened)
    assert "Saved" in A.save_config("lora", path_box["value"], "SDXL", *ui)
    saved = config_file.load(path_box["value"])
    assert saved.values["sample_prompts"] == str(prompts) and saved.values["sample_every_n_steps"] == 10


def test_the_option_filter_knows_each_options_families():
    """The filter's index says which families an option is for: "block swap" on SDXL hints "FLUX.1, SD3, Lumina 2,
    HunyuanImage 2.1, Anima only"."""
    from kohya_gui.ui import actions as A
    from kohya_gui.ui.option_filter import filter_js

    js = filter_js("lora", A.tab_params("lora"))
    index = json.loads(js.split("index = ", 1)[1].split(";\n", 1)[0])
    row = next(r for r in index if r[0] == "blocks_to_swap")
    assert row[3] == ["FLUX.1", "SD3", "Lumina 2", "HunyuanImage 2.1", "Anima"] and all(w in row[1] for w in ("block", "swap"))
    assert "No option matches" in js and "only)" in js


@pytest.mark.slow
def test_an_imported_diag_oft_bypass_bf16_config_trains_on_the_cpu(tmp_path, tiny_sd1_single_file, tiny_dataset_dir):
    """Issue 31: a kohya_ss LyCORIS/Diag-OFT config with bypass mode in bf16, imported and run as the GUI runs it
    (the trainer's command line with the config TOML), trains its steps on the CPU and saves. kohya_ss' own
    test/config/Diag-OFT-AdamW8bit-toml.json: dim 32, conv 8/4, clip skip 2 (dim 32 on the tiny model's 32-wide
    layers gives 1x1 OFT blocks, which crashed with "mixed dtype" before; AdamW: bitsandbytes is optional)."""
    import subprocess
    import sys

    from kohya_gui import command

    pytest.importorskip("lycoris")
    imp = importer.from_kohya_ss(kohya(LoRA_type="LyCORIS/Diag-OFT", sdxl=False, bypass_mode=True, constrain=0.0,
                                       optimizer="AdamW", mixed_precision="bf16", save_precision="bf16",
                                       max_resolution="64,64", max_train_steps=2, network_dim=32, network_alpha=16,
                                       conv_dim=8, conv_alpha=4, clip_skip=2, LyCORIS_preset="full"))
    values = with_tiny_paths(imp, tmp_path, tiny_dataset_dir)
    values.update(pretrained_model_name_or_path=str(tiny_sd1_single_file), max_data_loader_n_workers=0,
                  tokenizer_cache_dir=str(tiny_sd1_single_file.parent / "tokenizers"))
    argv = command.trainer_args(imp.tab, imp.family, values)
    assert "bypass_mode=True" in argv and "algo=diag-oft" in argv
    proc = subprocess.run([sys.executable, str(REPO / "sd-scripts" / "train_network.py"), *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "imported.safetensors").is_file()

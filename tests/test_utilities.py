"""The Utilities tab's own functions: the caption editor (find/replace with count, backup and undo; unsaved edits
are not dropped), the N_name folder builder and balancing, the dataset TOML editor (round trip, checked by a
trainer's --validate_only), and the tool table (options from the tool scripts' --dump_options, commands, a run
through the training runner and the queue)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from PIL import Image

from kohya_gui import captions_edit as C
from kohya_gui import dataset_prep, dataset_toml, tools
from kohya_gui.run_queue import QueueWorker, RunQueue
from kohya_gui.runner import Runner


@pytest.fixture(autouse=True)
def user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "user-config"))  # backups, tool logs, queue


def make_images(folder: Path, captions: dict[str, str], size=(64, 64)) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, (stem, caption) in enumerate(captions.items()):
        Image.new("RGB", size, (40 * i % 255, 80, 120)).save(folder / f"{stem}.png")
        if caption is not None:
            (folder / f"{stem}.txt").write_text(caption, encoding="utf-8")
    return folder


# ---- caption editor ------------------------------------------------------------------------------------------------

def test_whole_tag_replace_remove_and_plain_text():
    assert C.replace_in_caption("1girl, red hair, smile", "red hair", "blue hair") == ("1girl, blue hair, smile", 1)
    assert C.replace_in_caption("1girl,red hair ,smile", "red hair", "") == ("1girl, smile", 1)
    assert C.replace_in_caption("1girl, red hairband", "red hair", "x") == ("1girl, red hairband", 0)  # whole tags
    assert C.replace_in_caption("1girl, red hairband", "red hair", "x", whole_tag=False) == ("1girl, xband", 1)
    assert C.replace_in_caption("a, b\nb, c", "b", "d, e") == ("a, d, e\nd, e, c", 2)  # one tag -> two, every line


def test_find_replace_counts_then_changes_with_a_backup_that_undo_restores(tmp_path):
    folder = make_images(tmp_path / "imgs", {"a": "cat, red hair", "b": "dog, red hair", "c": "bird", "d": None})
    counted = C.find_replace(str(folder), ".txt", "red hair", "blue hair")
    assert [p.name for p in counted.changed] == ["a.txt", "b.txt"] and counted.files == 3
    assert (folder / "a.txt").read_text() == "cat, red hair"  # Count writes nothing
    done = C.find_replace(str(folder), ".txt", "red hair", "blue hair", apply=True)
    assert (folder / "a.txt").read_text() == "cat, blue hair" and (folder / "b.txt").read_text() == "dog, blue hair"
    assert (folder / "c.txt").read_text() == "bird" and not (folder / "d.txt").exists()
    assert done.backup.is_dir() and done.backup.is_relative_to(C.backups_folder())
    assert C.undo_replace(done.backup) == 2
    assert (folder / "a.txt").read_text() == "cat, red hair" and (folder / "b.txt").read_text() == "dog, red hair"
    with pytest.raises(C.CaptionError, match="Find"):
        C.find_replace(str(folder), ".txt", "  ", "x")
    with pytest.raises(C.CaptionError, match="is not a folder"):
        C.find_replace(str(tmp_path / "nope"), ".txt", "a", "b")


def test_editor_keeps_unsaved_edits_until_saved_or_discarded(tmp_path):
    from kohya_gui.ui import utilities as U

    folder = make_images(tmp_path / "imgs", {"a": "cat", "b": "dog"})
    message, picker, gallery, image, caption, current = U.load_folder(str(folder), ".txt")
    assert current == str(folder / "a.png") and caption == "cat" and "2 images, 2 with" in message
    assert [c for c in gallery["value"]] == [(str(folder / "a.png"), "cat"), (str(folder / "b.png"), "dog")]
    refused = U.step_image(".txt", current, "cat, edited", str(folder), 1)
    assert "unsaved changes" in refused[0] and refused[-1] == current  # stays on a.png, the edit kept on screen
    assert "Saved" in U.save_caption(".txt", current, "cat, edited")
    assert (folder / "a.txt").read_text() == "cat, edited"
    moved = U.step_image(".txt", current, "cat, edited", str(folder), 1)
    assert moved[0] == "" and moved[-1] == str(folder / "b.png") and moved[-2] == "dog"
    assert U.discard_changes(".txt", str(folder / "b.png")) == ("", "dog")
    assert C.tag_counts(str(folder))[:1] == [("cat", 1)]
    message, backup = U.replace_tags(str(folder), ".txt", "cat", "", True, apply=False)
    assert "removing `cat`: 1 of 2 caption files would change" in message and (folder / "a.txt").read_text() == \
        "cat, edited"
    message, backup = U.replace_tags(str(folder), ".txt", "cat", "", True, apply=True)
    assert "changed 1 of 2 caption files" in message and (folder / "a.txt").read_text() == "edited"
    assert "Put back 1 caption files" in U.undo_replace(backup)[0] and (folder / "a.txt").read_text() == "cat, edited"


# ---- folder builder and balancing ----------------------------------------------------------------------------------

def test_build_makes_the_n_name_layout_and_never_overwrites(tmp_path):
    src = make_images(tmp_path / "src", {"a": "sks dog", "b": "sks dog, grass"})
    reg = make_images(tmp_path / "regsrc", {"r1": None, "r2": None, "r3": None})
    built = dataset_prep.build(str(tmp_path / "ds"), str(src), "sks dog", 10, str(reg), "dog", 1)
    assert [(b.folder, b.images, b.captions) for b in built] == [(tmp_path / "ds/img/10_sks dog", 2, 2),
                                                                (tmp_path / "ds/reg/1_dog", 3, 0)]
    assert sorted(p.name for p in (tmp_path / "ds/img/10_sks dog").iterdir()) == ["a.png", "a.txt", "b.png", "b.txt"]
    with pytest.raises(dataset_prep.PrepError, match="already exists and is not empty"):
        dataset_prep.build(str(tmp_path / "ds"), str(src), "sks dog", 10)
    with pytest.raises(dataset_prep.PrepError, match="Images repeats: expected a whole number of at least 1"):
        dataset_prep.build(str(tmp_path / "ds"), str(src), "cat", 0)
    with pytest.raises(dataset_prep.PrepError, match="Images name"):
        dataset_prep.build(str(tmp_path / "ds"), str(src), "a/b", 2)
    with pytest.raises(dataset_prep.PrepError, match="no images"):
        dataset_prep.build(str(tmp_path / "ds"), str(tmp_path / "ds/reg"), "x", 2)


def test_balance_sets_repeats_from_image_counts(tmp_path):
    make_images(tmp_path / "img/5_big", {f"b{i}": None for i in range(8)})
    make_images(tmp_path / "img/1_small", {"s0": None, "s1": None})
    plan = dataset_prep.balance_plan(str(tmp_path / "img"), 40)
    assert [(r.old.name, r.new.name, r.images) for r in plan] == [("1_small", "20_small", 2), ("5_big", "5_big", 8)]
    assert (tmp_path / "img/1_small").is_dir()  # a plan changes nothing
    dataset_prep.balance(str(tmp_path / "img"), 40)
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == ["20_small", "5_big"]


# ---- dataset TOML editor -------------------------------------------------------------------------------------------

def test_dataset_toml_round_trip_is_accepted_by_the_trainer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_images(tmp_path / "ds/img/3_cat", {"a": "cat", "b": "cat"})
    make_images(tmp_path / "ds/reg/1_animal", {"r": "animal"})
    make_images(tmp_path / "wide", {"w": "wide"}, size=(96, 64))
    text = dataset_toml.from_folders("ds/img", "ds/reg", 64, 1, dataset_toml.TEMPLATE + "# my notes\n")
    text = dataset_toml.add_subset(text, "wide", 2, "96,64", 2, "wide thing")  # a second resolution
    saved = dataset_toml.save_file(str(tmp_path / "conf/dataset.toml"), text)
    assert dataset_toml.open_file(str(saved)) == text and "# my notes" in text
    assert dataset_toml.summary(text) == [[1, 64, 1, str(Path("ds/img/3_cat")), 3, False, 2],
                                          [1, 64, 1, str(Path("ds/reg/1_animal")), 1, True, 1],
                                          [2, "96x64", 2, "wide", 2, False, 1]]
    with pytest.raises(dataset_toml.DatasetTomlError, match="Save as never overwrites"):
        dataset_toml.save_file(str(saved), text, overwrite=False)
    ok, lines = dataset_toml.check(text, "SDXL", str(saved))
    assert ok, lines
    assert any("6 train images with repeats, 6 reg images" in ln for ln in lines), lines
    ok, problems = dataset_toml.check(text.replace("num_repeats = 3", "num_repeat = 3"), "SD1.x", str(saved))
    assert not ok and any("unknown key 'num_repeat'" in p and "Did you mean 'num_repeats'" in p for p in problems)
    with pytest.raises(dataset_toml.DatasetTomlError, match="not valid TOML"):
        dataset_toml.add_subset("[general", "x")


# ---- the tool table -----------------------------------------------------------------------------------------------

def test_every_tool_names_only_options_its_script_describes():
    assert tools.TOOLS, "no tool script is wired"
    for t in tools.TOOLS:
        names = {o.name for o in t.options}
        named = set(t.main) | set(t.outputs) | set(t.folders) | set(t.labels)
        assert named <= names, f"{t.script}: {sorted(named - names)} are not options of the script"
        assert t.group in tools.GROUPS
    files = {p.name for p in tools.OPTIONS_DIR.glob("*.json")}
    assert files == {t.option_file.name for t in tools.TOOLS}, "an option file without a tool, or the reverse"


def test_a_tool_runs_through_the_runner_and_the_queue(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_images(tmp_path / "imgs", {"a": "a cat", "b": "a dog"})
    t = tools.tool("merge_captions_to_metadata")
    values, errors = tools.values_from_ui(t, {"train_data_dir": "imgs", "out_json": "out/meta.json",
                                              "caption_extension": ".txt", "full_path": False})
    assert not errors
    assert tools.argv(t, values)[1:] == [str(Path(tools.script_path(t))), "imgs", "out/meta.json",
                                         "--caption_extension", ".txt"]
    bad, errors = tools.values_from_ui(t, {})
    assert tools.validation_errors(t, bad) == ["Image folder (train_data_dir) is required",
                                               "Metadata JSON to write (out_json) is required"]
    runner = Runner()
    tools.start(runner, t, values)
    state = runner.wait(120)
    assert state.returncode == 0, runner.log_tail()
    assert json.loads((tmp_path / "out/meta.json").read_text()) == {"a": {"caption": "a cat"},
                                                                    "b": {"caption": "a dog"}}
    assert "merged 2 .txt files" in runner.log_tail() and Path(state.log_path) == tools.log_path(t)
    with pytest.raises(tools.ToolError, match="already exists"):  # never overwrites without the tick
        tools.start(runner, t, values)
    queue = RunQueue(tmp_path / "queue")
    entry = queue.add_tool(t, {**values, "out_json": "out/queued.json"})
    worker = QueueWorker(queue, runner, poll_s=0.1)
    worker.step()  # starts it
    assert runner.wait(120).returncode == 0, runner.log_tail()
    worker.step()  # notes how it ended
    assert queue.snapshot()[1][0].state == "finished" and queue.snapshot()[1][0].id == entry.id
    assert (tmp_path / "out/queued.json").is_file()


def test_show_metadata_lists_the_files_metadata(tmp_path):
    import torch
    from safetensors.torch import save_file

    from kohya_gui.ui import utilities as U

    path = tmp_path / "lora.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(2, 2)}, str(path), metadata={"ss_network_dim": "4"})
    out = U.show_metadata(str(path))
    assert "1 tensors, 1 metadata entries" in out and "| `ss_network_dim` | 4 |" in out
    assert "is not a file" in U.show_metadata(str(tmp_path / "none.safetensors"))
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    assert "is not a safetensors file" in U.show_metadata(str(tmp_path / "bad.safetensors"))


def test_the_run_panels_lora_shortcuts_fill_resize_and_merge(tmp_path, monkeypatch):
    """After a LoRA run, "Resize this LoRA" / "Merge it into its model" open the LoRA tools with the result, the
    run's model and the family's merge script filled in (the run here: a command that writes the LoRA file)."""
    import sys

    from kohya_gui import config_file
    from kohya_gui import params as P
    from kohya_gui.ui import actions as A
    from kohya_gui.ui import utilities as U

    if not {"resize_lora", "sdxl_merge_lora"} <= {t.key for t in tools.TOOLS}:
        pytest.skip("the LoRA tool scripts are not here")
    out = tmp_path / "out"
    run_toml = out / "mylora.toml"
    config_file.save(run_toml, "lora", "SDXL", {**P.defaults("lora"), "output_dir": str(out), "output_name": "mylora",
                                                "pretrained_model_name_or_path": "models/base.safetensors"})
    (out / "mylora-resized.safetensors").write_bytes(b"x")  # taken: the shortcut picks a free name
    runner = Runner()
    runner.start([[sys.executable, "-c", f"open({str(out / 'mylora.safetensors')!r}, 'wb').write(b'x')"]],
                 tmp_path / "run.log", output_dir=out, config_path=run_toml)
    assert runner.wait(60).returncode == 0
    monkeypatch.setattr(A, "RUNNER", runner)
    key, fills, _ = U.lora_fills("resize")
    assert key == "resize_lora" and fills == {"model": str(out / "mylora.safetensors"),
                                              "save_to": str(out / "mylora-resized-2.safetensors")}
    key, fills, note = U.lora_fills("merge")
    assert key == "sdxl_merge_lora" and "SDXL" in note
    assert fills == {"sd_model": "models/base.safetensors", "models": str(out / "mylora.safetensors"),
                     "ratios": "1", "save_to": str(out / "mylora-merged.safetensors")}
    values, errors = tools.values_from_ui(tools.tool(key), fills)  # the filled form makes a valid command
    assert not errors and not tools.validation_errors(tools.tool(key), values)
    assert tools.argv(tools.tool(key), values)[2:] == [
        "--sd_model", "models/base.safetensors", "--save_to", str(out / "mylora-merged.safetensors"),
        "--models", str(out / "mylora.safetensors"), "--ratios", "1.0"]
    updates = U.lora_shortcut("merge")
    assert updates[2]["value"] == "sdxl_merge_lora" and "Merge `mylora.safetensors`" in updates[-1]
    assert updates[3]["key"] == "sdxl_merge_lora" and updates[3]["values"] == fills  # the form drawn with them


def test_a_tools_progress_bar_is_the_run_panels_progress():
    from kohya_gui.runner import parse_progress

    p = parse_progress("resizing: 100%|##########| 2/2 [00:01<00:00,  6.17it/s]")
    assert (p["step"], p["total"], p["its"], p["eta_s"]) == (2, 2, 6.17, 0)
    p = parse_progress("tagging:  40%|####      | 40/100 [00:10<00:15,  4.00it/s]")
    assert (p["step"], p["total"], p["eta_s"]) == (40, 100, 15)
    assert parse_progress("steps: 3/10 loss=0.5")["step"] == 3  # the trainers' line as before
    assert parse_progress("merged 2 captions into out.json") is None


def test_a_lora_tool_runs_from_its_form_values_and_its_result_shows_its_metadata(tmp_path, monkeypatch):
    """Resize LoRA, with the values its form sends (text fields, a number box), through the runner; the result's
    metadata (Show a LoRA's metadata) has the new rank."""
    import torch
    from safetensors.torch import save_file

    from kohya_gui.ui import utilities as U

    monkeypatch.chdir(tmp_path)
    lora = {}
    for i in range(2):
        name = f"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q{i}"
        lora |= {f"{name}.lora_down.weight": torch.randn(8, 32), f"{name}.lora_up.weight": torch.randn(32, 8),
                 f"{name}.alpha": torch.tensor(8.0)}
    save_file(lora, "tiny.safetensors", metadata={"ss_network_dim": "8", "ss_network_alpha": "8.0"})
    ui = [{"model": "tiny.safetensors", "save_to": "out/tiny-r2.safetensors", "new_rank": 2,
           "device": "cpu"}.get(o.name, U.to_ui(o)) for o in U.form_options(tools.tool("resize_lora"))]
    command, message = U.print_tool("resize_lora", False, *ui)
    assert "--new_rank 2" in command and "--device cpu" in command and "Run runs this command" in message
    runner = Runner()
    monkeypatch.setattr(U.A, "RUNNER", runner)
    command, message = U.run_tool("resize_lora", False, *ui)
    assert "started" in message
    state = runner.wait(180)
    assert state.returncode == 0 and state.outputs == ["out/tiny-r2.safetensors"], runner.log_tail()
    assert "| `ss_network_dim` | 2 |" in U.show_metadata("out/tiny-r2.safetensors")
    _, message = U.run_tool("resize_lora", False, *ui)  # the result exists: refused before any run
    assert "already exists" in message and runner.snapshot().started == state.started


def test_the_utilities_stop_ends_a_tool_but_never_a_training_run(tmp_path, monkeypatch):
    import sys

    from kohya_gui.ui import utilities as U

    runner = Runner()
    monkeypatch.setattr(U.A, "RUNNER", runner)
    assert "No tool is running" in U.stop_tool()
    runner.start([[sys.executable, "-c", "import time; time.sleep(60)"]], tmp_path / "train.log")  # not a tool
    assert "training run" in U.stop_tool() and runner.running
    runner.stop(now=True, grace=2)
    runner.start([["python", "-c", "import time; time.sleep(60)"]], tmp_path / "python.log")
    assert not tools.is_tool_run(runner.snapshot().commands)
    runner.stop(now=True, grace=2)
    if not hasattr(os, "mkfifo"):
        pytest.skip("needs os.mkfifo")
    os.mkfifo(tmp_path / "waits.safetensors")  # the tool blocks reading it: a tool run that lasts
    tools.start(runner, tools.tool("check_lora_weights"), {"file": str(tmp_path / "waits.safetensors")})
    assert "Stopped the tool" in U.stop_tool()
    assert not runner.running and runner.snapshot().stopped


def test_the_page_holds_no_tool_form_until_one_is_needed():
    """The tool forms are drawn by the server when their tab is opened or a tool is picked (gr.render), not built
    into the page: ~18 forms of ~25 controls each would slow every event of the page."""
    from kohya_gui.ui import app

    page = app.build_app()
    ids = [b.elem_id for b in page.blocks.values() if getattr(b, "elem_id", None)]
    assert "util-lora-tool" in ids and "util-lora-print" in ids and "run-lora-resize" in ids
    assert not [i for i in ids if i.startswith("tool-")]


def test_an_untouched_form_prints_no_flag_and_a_default_with_spaces_is_kept():
    """Every tool's form as drawn (to_ui of each default) gives the bare command: no option is changed by the
    round trip through the form (the tagger's ", " separator was stripped to "," and printed as a flag)."""
    from kohya_gui.ui import utilities as U

    for t in tools.TOOLS:
        values, errors = tools.values_from_ui(t, {o.name: U.to_ui(o) for o in U.form_options(t)})
        assert not errors, (t.key, errors)
        assert [w for w in tools.argv(t, values)[2:] if w.startswith("--")] == [], t.key
    t = tools.tool("tag_images_by_wd14_tagger")
    values, _ = tools.values_from_ui(t, {"train_data_dir": "imgs", "caption_separator": ";"})
    assert tools.argv(t, values)[2:] == ["imgs", "--caption_separator", ";"]

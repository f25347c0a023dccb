"""In the browser (Playwright + Debian's chromium against `python gui.py --headless`), the Utilities tab: build a
kohya N_name dataset folder and check its dataset TOML with the trainer, edit a caption and replace a tag across
the folder, and every tool of the tab picked, filled and run through the training runner (the run panel shows its
log and result) or printed; the run panel's "Resize this LoRA" shortcut. One GUI for the module, a fresh page per
test."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from PIL import Image

from test_gui_e2e import CHROMIUM, gui_url, workdir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def browser(gui_url):  # noqa: F811
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM,
                              args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield b
        b.close()


@pytest.fixture
def page(browser, gui_url):  # noqa: F811
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    pg.set_default_timeout(180000)  # the limit of every wait on two busy cores; each ends on the page's state
    pg.goto(gui_url)
    # the page load's restore of the training tabs' remembered settings is done (feedback.restore_on_load)
    pg.wait_for_selector("body[data-form-restored]", state="attached")
    pg.get_by_role("tab", name="Utilities").click()
    pg.locator("#util-tabs").wait_for()
    yield pg
    pg.close()


def field(page, elem_id: str):
    return page.locator(f"#{elem_id}").locator("input, textarea").first


def images(folder: Path, captions: dict[str, str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for stem, caption in captions.items():
        Image.new("RGB", (64, 64), (200, 80, 40)).save(folder / f"{stem}.png")
        (folder / f"{stem}.txt").write_text(caption, encoding="utf-8")
    return folder


def wait_text(page, elem_id: str, text: str | re.Pattern, timeout: float = 120000) -> str:
    """The element's text once it shows `text` (a string matches case-insensitively, anywhere: "Saved" would
    match "unsaved"; a pattern matches as written)."""
    page.locator(f"#{elem_id}").get_by_text(text).first.wait_for(timeout=timeout)
    return page.locator(f"#{elem_id}").inner_text()


def message(page, elem_id: str, text: str, timeout: float = 120000) -> str:
    """A button's message (feedback.follow): its text, then the area inside the window. The page scrolls it there
    just after drawing it; a click before that scroll (the next tool's picker) lands on a page that moves under it,
    and the picker's option list, which Gradio keeps beside its box, moves out of the window with it."""
    out = wait_text(page, elem_id, text, timeout)
    page.wait_for_function("id => { const r = document.getElementById(id).getBoundingClientRect();"
                           " return r.top >= 0 && r.bottom <= window.innerHeight; }", arg=elem_id)
    return out


def test_build_the_folder_layout_and_check_its_dataset_toml(page, workdir):  # noqa: F811
    src = images(workdir / "prep-src", {"a": "sks dog", "b": "sks dog, grass"})
    page.get_by_role("tab", name="Dataset preparation").click()
    field(page, "prep-root").fill(str(workdir / "prep-ds"))
    field(page, "prep-source").fill(str(src))
    field(page, "prep-name").fill("sks dog")
    field(page, "prep-repeats").fill("5")
    page.locator("#prep-build").click()
    wait_text(page, "prep-status", "Built")
    assert sorted(p.name for p in (workdir / "prep-ds/img/5_sks dog").iterdir()) == ["a.png", "a.txt", "b.png",
                                                                                      "b.txt"]
    page.wait_for_function("() => document.querySelector('#dstoml-train-dir textarea, #dstoml-train-dir input')"
                           ".value.endsWith('img')")  # the builder fills the TOML editor's folder
    field(page, "dstoml-sub-reso").fill("64")
    page.locator("#dstoml-from-folders").click()
    wait_text(page, "dstoml-status", "Added a subset per N_name folder")
    assert "5_sks dog" in page.locator("#dstoml-summary").inner_text()
    page.locator("#dstoml-check").click()  # the text on screen, as it is (Save: tests/test_utilities.py)
    out = message(page, "dstoml-status", "accepts this dataset", timeout=240000)
    assert "10 train images with repeats" in out


def test_edit_a_caption_and_replace_a_tag_in_the_folder(page, workdir):  # noqa: F811
    folder = images(workdir / "cap", {"a": "cat, red hair", "b": "dog, red hair", "c": "bird"})
    field(page, "cap-folder").fill(str(folder))
    page.locator("#cap-load").click()
    wait_text(page, "cap-status", "3 images, 3 with")
    page.wait_for_function("() => document.querySelector('#cap-text textarea').value === 'cat, red hair'")
    field(page, "cap-text").fill("cat, red hair, smile")
    page.locator("#cap-next").click()  # unsaved: refused
    wait_text(page, "cap-status", "unsaved changes")
    page.locator("#cap-save").click()
    wait_text(page, "cap-status", re.compile(r"\bSaved"))  # not the "unsaved changes" still shown
    assert (folder / "a.txt").read_text() == "cat, red hair, smile"
    page.locator("#cap-next").click()
    page.wait_for_function("() => document.querySelector('#cap-text textarea').value === 'dog, red hair'")
    field(page, "cap-find").fill("red hair")
    field(page, "cap-replace").fill("blue hair")
    page.locator("#cap-replace-all").click()
    wait_text(page, "cap-replace-status", "changed 2 of 3 caption files")
    assert (folder / "a.txt").read_text() == "cat, blue hair, smile" and (folder / "b.txt").read_text() == \
        "dog, blue hair"
    page.locator("#cap-undo").click()
    wait_text(page, "cap-replace-status", "Put back 2 caption files")
    assert (folder / "b.txt").read_text() == "dog, red hair"


# ---- every tool of the tab, through the page ----------------------------------------------------------------------
# A tool is picked, its required fields are filled, then either Run (it runs through the training runner and the
# test waits for the run panel's result and checks the file it wrote) or Print (the command line is checked): the
# tools that load torch (~10 s each here) or transformers / a diffusion model run only where they show something the
# others do not; each script's own behaviour is tested in tests/test_lora_tools.py, test_finetune_*.py.

def pick_tool(page, group: str, label: str, key: str) -> None:
    """Picks a tool (unless its form is the one shown) and waits for its form, which the server draws. Gradio draws
    the option list beside the box where it was when opened: a page that scrolls after that (a message scrolled into
    view, the run panel growing) carries the list out of the window, and the option is never clickable. Then the
    list is closed and opened again (as a user would), at most five times."""
    box = page.locator(f"#util-{group}-tool input")
    option = page.get_by_role("option", name=label, exact=True)
    for attempt in range(5):
        if box.input_value() == label:
            break
        box.scroll_into_view_if_needed()
        box.click()
        try:
            option.click(timeout=20000)
        except Exception:  # playwright's TimeoutError
            if attempt == 4:
                raise
            page.keyboard.press("Escape")
    page.locator(f"#tool-{key}").wait_for()


def fill_form(page, key: str, values: dict) -> None:
    """Fills the tool's fields. The server draws the form (when its tab opens, when a tool is picked), and a draw
    still on its way replaces a form already filled with an empty one (a Run then answered "Image folder
    (train_data_dir) is required"): the values are read back until they stayed for a second, filled again where a
    draw wiped them."""
    def field_of(name):
        box = page.locator(f"#tool-{key}-{name}")
        return box.locator("input[type=checkbox]") if isinstance(values[name], bool) else \
            box.locator("input, textarea").first

    def shows(name) -> bool:
        value = values[name]
        return field_of(name).is_checked() == value if isinstance(value, bool) else \
            field_of(name).input_value() == str(value)

    deadline, stable = time.monotonic() + 60, 0
    while stable < 4:
        wrong = [name for name in values if not shows(name)]
        assert not wrong or time.monotonic() < deadline, f"{key}: {wrong} do not keep their values"
        for name in wrong:
            if isinstance(values[name], bool):
                field_of(name).set_checked(values[name])
            else:
                field_of(name).fill(str(values[name]))
        stable = 0 if wrong else stable + 1
        page.wait_for_timeout(250)


def click_until(page, group: str, button: str, done) -> None:
    """Clicks one of the group's buttons until done(timeout) returns, at most twice. A click can be lost: one that
    lands while the page moves (a message scrolled into view) reaches no button, and one sent while the server
    draws the form again names the Run/Print listeners of the form before (gradio's queue then answers KeyError, in
    gui.log). A second click finds the drawn form; a refusal (the tool's own message) stays, and fails here with
    the status's text."""
    for attempt in (1, 2):
        page.locator(f"#util-{group}-{button}").click()
        try:
            done(60000)
            return
        except Exception:  # playwright's TimeoutError
            assert attempt == 1, page.locator(f"#util-{group}-status").inner_text()


def printed(page, group: str, key: str) -> str:
    """Print: the command shown (its script is the tool's)."""
    click_until(page, group, "print", lambda timeout: page.wait_for_function(
        f"() => document.querySelector('#util-{group}-command textarea').value.includes('/{key}.py')",
        timeout=timeout))
    message(page, f"util-{group}-status", "Run runs this command")
    return field(page, f"util-{group}-command").input_value()


def ran(page, group: str, key: str) -> str:
    """Run, then the run panel's result for this tool's run (its log is tool_logs/<tool>.log); the run's log."""
    status = f"util-{group}-status"
    before = page.locator(f"#{status}").inner_text()  # an earlier tool's "... started" may still be shown

    def started(timeout):
        page.wait_for_function("([id, before]) => { const text = document.getElementById(id).innerText;"
                               " return text.includes('started') && text !== before; }", arg=[status, before],
                               timeout=timeout)
    click_until(page, group, "run", started)
    message(page, status, "started")
    result = wait_text(page, "run-result", f"{key}.log", timeout=240000)
    log = field(page, "kg-log").input_value()
    assert "Run finished" in result and "exit status 0" in result, result + "\n" + log
    return log


def test_every_captioning_tool(page, workdir):  # noqa: F811
    """WD14 tagger: Run with a tiny ONNX tagger built here (onnx.helper; without the `onnx` package of the test
    extra: Print), the caption files are written. BLIP, GIT, Florence-2 (transformers models, slow to load on the CI
    box): Print shows the command with the fields given."""
    folder = workdir / "to-tag"
    folder.mkdir()
    Image.new("RGB", (40, 40), (255, 0, 0)).save(folder / "red.png")
    Image.new("RGB", (40, 40), (0, 0, 255)).save(folder / "blue.png")
    pick_tool(page, "captioning", "WD14 tagger (ONNX)", "tag_images_by_wd14_tagger")
    try:
        from test_finetune_taggers import make_smilingwolf_tagger
    except pytest.skip.Exception:  # no onnx
        make_smilingwolf_tagger = None
    tagger = make_smilingwolf_tagger(workdir / "wd_tiny") if make_smilingwolf_tagger else workdir / "wd_tiny"
    fill_form(page, "tag_images_by_wd14_tagger", {"train_data_dir": folder, "repo_id": tagger,
                                                  "character_threshold": "0.85"})
    if make_smilingwolf_tagger is None:
        assert printed(page, "captioning", "tag_images_by_wd14_tagger").endswith(
            f"tag_images_by_wd14_tagger.py {folder} --repo_id {tagger} --character_threshold 0.85")
    else:
        ran(page, "captioning", "tag_images_by_wd14_tagger")
        assert (folder / "red.txt").read_text() == "red_thing, 1girl, white_background, alice_(wonderland)\n"
        assert (folder / "blue.txt").read_text() == "1girl, blue_thing\n"

    for label, key, values, expected in (
            ("BLIP captions", "make_captions", {"caption_weights": workdir / "blip", "beam_search": True},
             f"{folder} --caption_weights {workdir / 'blip'} --beam_search"),
            ("GIT captions", "make_captions_by_git", {"model_id": workdir / "git", "max_length": "20"},
             f"{folder} --model_id {workdir / 'git'} --max_length 20"),
            ("Florence-2 captions", "make_captions_by_florence2", {"model_id": workdir / "florence",
                                                                   "caption_extension": ".txt"},
             f"{folder} --model_id {workdir / 'florence'} --caption_extension .txt")):
        pick_tool(page, "captioning", label, key)
        fill_form(page, key, {"train_data_dir": folder, **values})
        assert printed(page, "captioning", key).endswith(f"finetune/{key}.py {expected}")


def test_every_dataset_tool(page, workdir):  # noqa: F811
    """Merge captions, merge tags, clean captions and tags: Run, each writes its metadata JSON (the next one reads
    it), and a second Run is refused before it starts (the result exists). Bucket latents (it encodes the images
    with a model's VAE): Print."""
    folder = images(workdir / "meta-imgs", {"a": "a cat", "b": "a dog"})
    (folder / "a.tags").write_text("1girl, red_hair", encoding="utf-8")
    (folder / "b.tags").write_text("dog", encoding="utf-8")
    page.get_by_role("tab", name="Dataset preparation").click()
    captions, tags, clean = (workdir / "meta" / f"{n}.json" for n in ("captions", "tags", "clean"))

    pick_tool(page, "dataset", "Merge captions into metadata JSON", "merge_captions_to_metadata")
    fill_form(page, "merge_captions_to_metadata", {"train_data_dir": folder, "out_json": captions,
                                                   "caption_extension": ".txt"})
    ran(page, "dataset", "merge_captions_to_metadata")
    assert json.loads(captions.read_text()) == {"a": {"caption": "a cat"}, "b": {"caption": "a dog"}}
    page.locator("#util-dataset-run").click()  # the result exists now: refused, nothing overwritten
    message(page, "util-dataset-status", "already exists")

    pick_tool(page, "dataset", "Merge tags into metadata JSON", "merge_dd_tags_to_metadata")
    fill_form(page, "merge_dd_tags_to_metadata", {"train_data_dir": folder, "in_json": captions, "out_json": tags,
                                                  "caption_extension": ".tags"})
    ran(page, "dataset", "merge_dd_tags_to_metadata")
    assert json.loads(tags.read_text()) == {"a": {"caption": "a cat", "tags": "1girl, red_hair"},
                                            "b": {"caption": "a dog", "tags": "dog"}}

    pick_tool(page, "dataset", "Clean captions and tags", "clean_captions_and_tags")
    fill_form(page, "clean_captions_and_tags", {"in_json": tags, "out_json": clean})
    ran(page, "dataset", "clean_captions_and_tags")
    assert json.loads(clean.read_text()) == {"a": {"caption": "a cat", "tags": "1girl, red hair"},
                                             "b": {"caption": "a dog", "tags": "dog"}}

    pick_tool(page, "dataset", "Bucket latents (fine-tune)", "prepare_buckets_latents")
    fill_form(page, "prepare_buckets_latents", {"train_data_dir": folder, "in_json": clean,
                                                "out_json": workdir / "meta" / "latents.json",
                                                "model_name_or_path": workdir / "model.safetensors",
                                                "max_resolution": "64,64"})
    assert printed(page, "dataset", "prepare_buckets_latents").endswith(
        f"prepare_buckets_latents.py {folder} {clean} {workdir / 'meta' / 'latents.json'} "
        f"{workdir / 'model.safetensors'} --max_resolution 64,64")


def tiny_lora(path: Path, rank: int = 8) -> Path:
    """A LoRA of two attention modules (kohya keys), rank `rank`."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(2):
        name = f"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q{i}"
        sd |= {f"{name}.lora_down.weight": torch.randn(rank, 32, generator=g),
               f"{name}.lora_up.weight": torch.randn(32, rank, generator=g), f"{name}.alpha": torch.tensor(4.0)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata={"ss_network_dim": str(rank), "ss_network_alpha": "4.0"})
    return path


def metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return f.metadata()


def test_every_lora_tool_and_the_run_panels_shortcuts(page, workdir):  # noqa: F811
    """Resize, check weights and split a DyLoRA: Run on a tiny LoRA built here, the files are written (the check:
    its report in the log). After the resize, the run panel's "Resize this LoRA" opens the resize form with the
    result filled in, and "Merge it into its model" says why it cannot (a tool's result, not a LoRA training run:
    tests/test_utilities.py fills a training run's merge). The merges (into a model, LoRAs into one, by SVD), the
    extractions from two models and the FLUX.1 format conversion (each loads models or runs a torch SVD; ~10 s of
    imports alone each on the CI box): Print."""
    lora = tiny_lora(workdir / "loras" / "tiny.safetensors")
    out = workdir / "lora-out"
    page.get_by_role("tab", name="LoRA tools").click()

    pick_tool(page, "lora", "Resize LoRA", "resize_lora")  # the first tool: drawn when the tab opens
    fill_form(page, "resize_lora", {"model": lora, "save_to": out / "r2.safetensors", "new_rank": 2,
                                    "device": "cpu"})
    ran(page, "lora", "resize_lora")
    assert metadata(out / "r2.safetensors")["ss_network_dim"] == "2"

    page.locator("#run-lora-resize").click()
    page.wait_for_function("([a, b]) => document.querySelector('#tool-resize_lora-model input').value === a && "
                           "document.querySelector('#tool-resize_lora-save_to input').value === b",
                           arg=[str(out / "r2.safetensors"), str(out / "r2-resized.safetensors")])
    assert "r2.safetensors" in wait_text(page, "util-lora-status", "choose the new rank, then Run")
    page.locator("#run-lora-merge").click()
    wait_text(page, "util-lora-status", "is not from a LoRA training run")

    pick_tool(page, "lora", "Check LoRA weights", "check_lora_weights")
    fill_form(page, "check_lora_weights", {"file": lora})
    assert "number of LoRA modules: 4" in ran(page, "lora", "check_lora_weights")

    pick_tool(page, "lora", "Extract LoRAs from a DyLoRA", "extract_lora_from_dylora")
    fill_form(page, "extract_lora_from_dylora", {"model": lora, "save_to": out / "dy.safetensors", "unit": 3})
    ran(page, "lora", "extract_lora_from_dylora")
    assert sorted(p.name for p in out.glob("dy-*.safetensors")) == ["dy-0003.safetensors", "dy-0006.safetensors"]

    a, b, model, tuned, o = (str(workdir / n) for n in ("a.safetensors", "b.safetensors", "model.safetensors",
                                                         "tuned.safetensors", "o.safetensors"))
    for label, key, values, expected in (
            ("Merge LoRA (SD1.x / SD2.x)", "merge_lora", {"sd_model": model, "models": f"{a} {b}",
                                                         "ratios": "1 0.5", "save_to": o},
             f"--sd_model {model} --save_to {o} --models {a} {b} --ratios 1.0 0.5"),
            ("Merge LoRA (SDXL)", "sdxl_merge_lora", {"sd_model": model, "models": a, "ratios": "0.8",
                                                      "save_to": o},
             f"--sd_model {model} --save_to {o} --models {a} --ratios 0.8"),
            ("Merge LoRA (FLUX.1)", "flux_merge_lora", {"flux_model": model, "models": a, "ratios": "0.8",
                                                        "save_to": o},
             f"--flux_model {model} --save_to {o} --models {a} --ratios 0.8"),
            ("Merge LoRAs by SVD (new rank)", "svd_merge_lora", {"models": f"{a} {b}", "ratios": "1 1",
                                                                 "save_to": o, "new_rank": 2},
             f"--save_to {o} --models {a} {b} --ratios 1.0 1.0 --new_rank 2"),
            ("Extract LoRA (SD1.x / SD2.x / SDXL)", "extract_lora_from_models",
             {"model_org": model, "model_tuned": tuned, "save_to": o, "dim": 2, "sdxl": True},
             f"--sdxl --model_org {model} --model_tuned {tuned} --save_to {o} --dim 2"),
            ("Extract LoRA (FLUX.1)", "flux_extract_lora", {"model_org": model, "model_tuned": tuned, "save_to": o,
                                                            "dim": 2},
             f"--model_org {model} --model_tuned {tuned} --save_to {o} --dim 2"),
            ("Convert FLUX.1 LoRA format", "convert_flux_lora", {"src_path": a, "dst_path": o, "src": "sd-scripts",
                                                                  "dst": "ai-toolkit"},
             f"--src sd-scripts --dst ai-toolkit --src_path {a} --dst_path {o}")):
        pick_tool(page, "lora", label, key)
        fill_form(page, key, values)
        assert printed(page, "lora", key).endswith(f"networks/{key}.py {expected}"), key

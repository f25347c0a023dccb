"""In the browser (Playwright + Debian's chromium against `python gui.py --headless`), the Utilities tab: build a
kohya N_name dataset folder and check its dataset TOML with the trainer, edit a caption and replace a tag across
the folder, and run a tool through the training runner (the run panel shows its log and result). One GUI for the
module, a fresh page per test."""

from __future__ import annotations

import json
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
    pg.set_default_timeout(120000)  # two shared cores: a page of ~2100 components takes a while to draw
    pg.goto(gui_url)
    pg.wait_for_selector("#lora-family")
    pg.get_by_role("tab", name="Utilities").click(timeout=180000)
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


def wait_text(page, elem_id: str, text: str, timeout: float = 120000) -> str:
    page.locator(f"#{elem_id}").get_by_text(text).first.wait_for(timeout=timeout)
    return page.locator(f"#{elem_id}").inner_text()


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
    out = wait_text(page, "dstoml-status", "accepts this dataset", timeout=240000)
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
    wait_text(page, "cap-status", "Saved")
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


def test_a_tool_runs_through_the_runner_with_its_log_and_result(page, workdir):  # noqa: F811
    folder = images(workdir / "meta-imgs", {"a": "a cat", "b": "a dog"})
    out = workdir / "meta-out" / "meta.json"
    page.get_by_role("tab", name="Dataset preparation").click()
    field(page, "tool-merge_captions_to_metadata-train_data_dir").fill(str(folder))
    field(page, "tool-merge_captions_to_metadata-out_json").fill(str(out))
    field(page, "tool-merge_captions_to_metadata-caption_extension").fill(".txt")
    page.locator("#util-dataset-print").click()
    page.wait_for_function("() => document.querySelector('#util-dataset-command textarea').value"
                           ".includes('merge_captions_to_metadata.py')")
    assert "--caption_extension .txt" in field(page, "util-dataset-command").input_value()
    page.locator("#util-dataset-run").click()
    wait_text(page, "util-dataset-status", "started")
    page.wait_for_function("() => document.querySelector('#kg-log textarea').value.includes('merged 2 .txt files')",
                           timeout=240000)
    wait_text(page, "run-result", "Run finished")
    assert json.loads(out.read_text()) == {"a": {"caption": "a cat"}, "b": {"caption": "a dog"}}
    page.locator("#util-dataset-run").click()  # the result exists now: refused, nothing overwritten
    wait_text(page, "util-dataset-status", "already exists")

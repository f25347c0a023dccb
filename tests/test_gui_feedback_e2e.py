"""In a real browser (the live server and page of test_gui_e2e.py, own working folder): a Start click at the
bottom of the window with a bad value shows the error inside the window, in red; a refresh keeps the form; a
refresh during a run shows the run's settings. The tests run in this order, each on a fresh page of one server."""

from __future__ import annotations

import pytest

from test_gui_e2e import (ARTIFACTS, BROWSER_TIMEOUT_MS, browser, field, gui_url, page, wait_for,  # noqa: F401
                          workdir)

pytestmark = pytest.mark.slow


def value_is(page, elem_id: str, value: str):
    page.wait_for_function(
        "([id, v]) => { const e = document.querySelector(`#${id} input, #${id} textarea`); return e && e.value === v; }",
        arg=[elem_id, value])


def kept(workdir, text: str) -> bool:
    f = workdir / "user-config" / "kohya_gui" / "last_lora.toml"  # the server's XDG_CONFIG_HOME (test_gui_e2e)
    return f.is_file() and text in f.read_text()


def test_start_error_appears_inside_the_window_in_red(page):
    field(page, "lora-train_data_dir").fill("")
    # Start at the bottom edge of the window: the message area under it starts outside
    page.evaluate("document.getElementById('lora-start').scrollIntoView({block: 'end'})")
    page.locator("#lora-start").click()
    msg = page.locator("#lora-run-status blockquote")
    msg.get_by_text("image folder").wait_for()
    # the page scrolls the message into view once it is drawn
    page.wait_for_function("""() => { const r = document.querySelector('#lora-run-status blockquote')
        .getBoundingClientRect(); return r.top >= 0 && r.bottom <= window.innerHeight; }""")
    box, height = msg.bounding_box(), page.viewport_size["height"]
    assert box["y"] >= 0 and box["y"] + box["height"] <= height, (box, height)
    r, g, b = (int(x) for x in msg.evaluate("e => getComputedStyle(e).color").strip("rgba()").split(",")[:3])
    assert r > 150 and g < 100 and b < 100, (r, g, b)  # red, not the grey of a plain Markdown quote
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "lora-start-error.png"))
    assert "image folder" not in page.locator("#lora-status").inner_text()  # not in the config bar's area


def typed(page, elem_id: str, text: str) -> None:
    """Types like a user (Playwright's fill sets the value without the key events Gradio's .input follows)."""
    box = field(page, elem_id)
    box.fill("")
    box.press_sequentially(text)


def test_refresh_keeps_the_form(page, workdir):
    field(page, "lora-train_data_dir").fill("cache/demo/images")
    field(page, "lora-output_name").fill("saved-name")
    page.locator("#lora-save").click()
    page.locator("#lora-status").get_by_text("Saved").wait_for()
    typed(page, "lora-output_dir", "outputs/edited")  # an edit without any click is kept too
    assert wait_for(lambda: kept(workdir, 'output_dir = "outputs/edited"'), BROWSER_TIMEOUT_MS / 1000)
    page.reload()
    value_is(page, "lora-output_dir", "outputs/edited")
    assert field(page, "lora-output_name").input_value() == "saved-name"
    assert field(page, "lora-train_data_dir").input_value() == "cache/demo/images"


def test_refresh_during_a_run_shows_the_runs_settings(page, workdir):
    field(page, "lora-output_dir").fill("outputs/demo-sdxl-tiny")
    field(page, "lora-output_name").fill("during-run")
    page.locator("#lora-acc-parameters").get_by_text("Parameters").first.click()  # closed accordions render lazily
    field(page, "lora-max_train_steps").fill("5000")
    page.locator("#lora-start").click()
    page.locator("#lora-run-status").get_by_text("Training started").wait_for()
    try:
        typed(page, "lora-output_name", "edited-after-start")
        assert wait_for(lambda: kept(workdir, "edited-after-start"), BROWSER_TIMEOUT_MS / 1000)
        page.reload()
        value_is(page, "lora-output_name", "during-run")
        page.locator("#lora-status").get_by_text("Showing the settings of the running training").wait_for()
        panel = page.locator("#run-progress")
        panel.get_by_text("outputs/demo-sdxl-tiny/during-run.toml").wait_for()
    finally:
        page.locator("#lora-stop-now").click()
        page.locator("#lora-run-status").get_by_text("Training stopped").wait_for()

"""In the browser: the filter box finds an option read from the trainer's own description by part of its --flag
(or its kohya_ss label) and opens its group and sub-group; Additional parameters reach the printed command."""
from __future__ import annotations

import json
import re

import pytest

from test_gui_e2e import browser, field, gui_url, page, workdir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow


def test_filter_box_finds_an_option_and_opens_its_group(page):
    # read from the trainer's description; in Advanced > Loss, both closed at first
    target = page.locator("#lora-huber_c")
    assert not target.is_visible()
    page.locator("#lora-filter input, #lora-filter textarea").first.fill("--huber_")
    target.wait_for(state="visible")
    assert page.locator("#lora-acc-advanced").is_visible() and page.locator("#lora-acc-advanced_loss").is_visible()
    other = page.locator("#lora-loss_type")  # in the same sub-group, no match: in the page but hidden
    other.wait_for(state="attached")
    page.wait_for_function("() => document.getElementById('lora-loss_type').style.display === 'none'")
    assert not other.is_visible()
    assert not page.locator("#lora-acc-advanced_noise").is_visible()  # a sub-group without a match is hidden
    assert not page.locator("#lora-acc-folders").is_visible()  # a group without a match is hidden
    page.locator("#lora-filter input, #lora-filter textarea").first.fill("max grad norm")  # kohya_ss's label
    page.locator("#lora-max_grad_norm").wait_for(state="visible")
    assert page.locator("#lora-acc-optimizer").is_visible()
    page.locator("#lora-filter input, #lora-filter textarea").first.fill("")
    page.locator("#lora-acc-compile").wait_for(state="visible")


def test_additional_parameters_reach_the_command_or_name_the_unknown_flag(page):
    page.locator("#lora-filter input, #lora-filter textarea").first.fill("additional")
    box = field(page, "lora-additional_parameters")
    box.wait_for(state="visible")
    box.fill("--max_grad_nrm 0.5")
    page.locator("#lora-print").click()
    status = page.locator("#lora-run-status")
    # Print waits behind the form-saving events the earlier test queued (each updates ~1,100 outputs; the page-speed
    # branch cuts that): minutes on a 2-core machine
    status.get_by_text("--max_grad_nrm is not an option").wait_for(timeout=540_000)
    assert "did you mean --max_grad_norm" in status.inner_text()
    box.fill("--max_grad_norm 0.5")
    page.locator("#lora-print").click()
    page.wait_for_function(
        "() => document.querySelector('#lora-command textarea').value.includes('--max_grad_norm 0.5')")
    page.locator("#lora-filter input, #lora-filter textarea").first.fill("")


def test_three_kohya_ss_presets_fill_the_form_and_show_the_report(page):
    from test_gui_e2e import pick

    for name, family, module in (("SDXL - LoKR v1.0", "SDXL", "lycoris.kohya"),
                                 ("flux1D - adamw8bit fp8", "FLUX.1", "networks.lora_flux"),
                                 ("SDXL - LoRA adafactor v1.0", "SDXL", "networks.lora")):
        pick(page, "lora-preset", f"kohya_ss: {name}")
        status = page.locator("#lora-status")
        try:
            page.wait_for_function(f"""() => document.querySelector('#lora-status').innerText
                                       .includes({json.dumps('Loaded preset kohya_ss: ' + name)})""")
                                   # a family change redraws ~230 controls
        except Exception:
            raise AssertionError(status.inner_text()[:500]) from None
        assert "Import report" in status.inner_text()
        page.wait_for_function(f"() => document.querySelector('#lora-family input').value === '{family}'")
        status.get_by_text("Import report").click()  # the report lists every key of the file
        assert f"network_module {module}" in status.inner_text()


def test_network_fields_follow_the_network_module_and_reach_the_command(page):
    from test_gui_e2e import pick

    page.locator("#lora-filter input, #lora-filter textarea").first.fill("network module")
    page.locator("#lora-network_module").wait_for(state="visible")
    page.locator("#lora-filter input, #lora-filter textarea").first.fill("")
    page.locator("#lora-network_args-block_dims").wait_for(state="visible")  # an SDXL LoRA: networks.lora's fields
    assert not page.locator("#lora-network_args-factor").is_visible()
    pick(page, "lora-network_module", "lycoris.kohya")
    page.locator("#lora-network_args-factor").wait_for(state="visible")  # LyCORIS' fields
    page.locator("#lora-network_args-block_dims").wait_for(state="hidden")
    pick(page, "lora-network_args-algo", "lokr")
    field(page, "lora-network_args-factor").fill("8")
    page.locator("#lora-print").click()
    page.wait_for_function("() => document.querySelector('#lora-standalone textarea').value.includes('lycoris')")
    standalone = page.locator("#lora-standalone textarea").input_value()
    assert "--network_module lycoris.kohya" in standalone and re.search(
        r"--network_args (\S+=\S+ )*algo=lokr( \S+=\S+)* factor=8", standalone), standalone
    pick(page, "lora-network_module", "LoRA (the family's)")
    page.locator("#lora-network_args-block_dims").wait_for(state="visible")


def test_filter_box_says_when_nothing_matches_or_only_another_family(page):
    box = page.locator("#lora-filter input, #lora-filter textarea").first

    def hint_says(text):
        page.wait_for_function("(t) => document.getElementById('lora-filter-hint').textContent.includes(t)", arg=text)

    page.wait_for_function("() => document.querySelector('#lora-family input').value === 'SDXL'")
    box.fill("block swap")  # FLUX.1's --blocks_to_swap, every word matched
    hint_says("Blocks to swap (optional) (FLUX.1, SD3, Lumina 2, HunyuanImage 2.1, Anima only)")
    box.fill("no such option at all")
    hint_says('No option matches "no such option at all"')
    box.fill("")
    page.locator("#lora-filter-hint").wait_for(state="hidden")

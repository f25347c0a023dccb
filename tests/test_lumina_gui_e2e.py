"""In the browser: the LoRA tab's family choice offers Lumina 2; picking it shows its model fields and the Lumina 2
options, hides the Torch Compile Settings (SDXL and FLUX.1 only), sets Lumina's flow-matching defaults, and Print
names lumina_train_network.py."""
from __future__ import annotations

import pytest

from test_gui_e2e import browser, field, gui_url, page, pick, workdir  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.browser]


def test_picking_lumina_shows_its_fields_defaults_and_script(page):
    pick(page, "lora-family", "Lumina 2")
    page.locator("#lora-acc-lumina").wait_for(state="visible")
    page.locator("#lora-acc-compile").wait_for(state="hidden")
    assert "sd-scripts/lumina_train_network.py" in page.locator("#lora-acc-model").inner_text()
    assert page.locator("#lora-gemma2").is_visible() and not page.locator("#lora-clip_l").is_visible()
    page.locator("#lora-print").click()
    page.wait_for_function(
        "() => document.querySelector('#lora-standalone textarea').value.includes('lumina_train_network.py')")
    standalone = field(page, "lora-standalone").input_value()
    assert "--timestep_sampling shift" in standalone and "--discrete_flow_shift 6.0" in standalone
    assert "--model_prediction_type raw" in standalone
    pick(page, "lora-family", "SDXL")
    page.locator("#lora-acc-lumina").wait_for(state="hidden")

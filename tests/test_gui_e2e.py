"""End to end, with the real trainers: the runner stops a real training run mid-way and leaves no process behind;
then a real browser (Playwright + Debian's chromium) drives `python gui.py --headless` on a free port: the
compile accordion follows the family, Print shows --compile, Save then Open restores values, the demo preset's
Start finishes and shows the LoRA path. All in one working folder so the demo files are made once."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import psutil
import pytest

from kohya_gui import REPO, config_file, presets, training
from kohya_gui import params as P
from kohya_gui.runner import Runner
from kohya_gui.ui import actions as A
from kohya_gui.ui import visibility as V
from gui_helpers import wait_for

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = REPO / "tests" / "_artifacts"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    if not (REPO / "sd-scripts" / "sdxl_train_network.py").exists():
        pytest.skip("sd-scripts/sdxl_train_network.py does not exist yet")
    return tmp_path_factory.mktemp("gui_e2e")


def test_real_training_stops_mid_run_and_leaves_no_process(workdir, monkeypatch):
    monkeypatch.chdir(workdir)  # the demo preset's relative paths (cache/demo, outputs/) land here
    cfg = config_file.load(presets.preset_path("lora", "demo-sdxl-tiny"))
    values = {**cfg.values, "max_train_steps": 500, "sample_every_n_steps": None, "output_name": "stopped"}
    runner = Runner()
    training.start(runner, cfg.tab, cfg.family, values)  # makes the demo files first, then trains
    # the trainer's step line (a tqdm bar of the demo's preparation or of caching is progress too)
    assert wait_for(lambda: (runner.snapshot().progress or {}).get("total") == 500 or not runner.running, 400), \
        runner.log_tail()
    assert runner.running, "the run ended before it could be stopped:\n" + runner.log_tail()
    leader = psutil.Process(runner.pid)
    tree = [leader, *leader.children(recursive=True)]
    assert len(tree) >= 2  # accelerate launch + the training script
    assert runner.stop(grace=10) is True  # Stop = save and stop (accelerate launch dies, its child saves)
    state = runner.snapshot()
    lora = workdir / "outputs/demo-sdxl-tiny/stopped.safetensors"
    assert state.stopped and state.progress["total"] == 500
    assert re.fullmatch(r"stopped at step \d+, saved \S*outputs/demo-sdxl-tiny/stopped\.safetensors",
                        state.message), runner.log_tail()
    gone, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, alive
    assert lora.is_file()
    log = (workdir / "outputs/demo-sdxl-tiny/stopped.log").read_text()
    assert "steps: 1/500" in log and log.rstrip().endswith("# " + state.message)
    assert (workdir / "outputs/demo-sdxl-tiny/stopped.toml").is_file()


# ---- the browser ---------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gui_url(workdir):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
           "XDG_CONFIG_HOME": str(workdir / "user-config")}  # last used settings: this server's own
    log = open(workdir / "gui.log", "w")
    proc = subprocess.Popen([sys.executable, str(REPO / "gui.py"), "--headless", "--server_port", str(port)],
                            cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def answers():
        try:
            with urllib.request.urlopen(url + "/config", timeout=2) as r:
                return r.status == 200
        except OSError:
            return proc.poll() is not None  # died: stop waiting, fail below

    try:
        assert wait_for(answers, 180) and proc.poll() is None, (workdir / "gui.log").read_text()
        yield url
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(10)
                break
            except subprocess.TimeoutExpired:
                continue
        log.close()


BROWSER_TIMEOUT_MS = 180_000  # the limit of every wait; waits end on the page's state, long before it when idle


@pytest.fixture(scope="module")
def browser(gui_url):
    """One chromium per module (with its one GUI server, gui_url)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM,
                              args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield b
        b.close()


@pytest.fixture
def page(browser, gui_url, workdir):
    """A fresh page per test, so a test that times out leaves nothing half-done for the next one. The server keeps
    each tab's last used settings, so a test starts from the form the previous one left."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(BROWSER_TIMEOUT_MS)
    pg.goto(gui_url)
    pg.wait_for_selector("#lora-family")
    # the page's load event puts the remembered settings into the form, then marks the body: a test that typed
    # before that would see its values replaced
    pg.wait_for_selector("body[data-form-restored]", state="attached")
    yield pg
    context.close()


def pick(page, elem_id: str, option: str):
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option, exact=True).click()


def field(page, elem_id: str):
    return page.locator(f"#{elem_id}").locator("input, textarea").first


# Whether the page shows an element: it and every container up to its tab displayed (null: not drawn)
SHOWN_JS = """([tab, ids]) => {
  const root = document.getElementById(`tab-${tab}`);
  const shown = el => {
    if (!el) return false;
    for (let e = el; e && e !== root; e = e.parentElement)
      if (getComputedStyle(e).display === 'none') return false;
    return true;
  };
  return Object.fromEntries(ids.map(id => {
    const el = document.getElementById(id);
    return [id, el ? shown(el) : null];
  }));
}"""

# Opens each closed group the tab shows (a click on its title, as a user; gradio draws a group's controls when it
# is first opened); true once none is left closed and the given elements are drawn
OPEN_GROUPS_JS = """([tab, ids]) => {
  let closed = 0;
  for (const b of document.querySelectorAll(`#tab-${tab} .gr-accordion > button.label-wrap:not(.open)`))
    if (b.offsetParent !== null) { b.click(); closed++; }
  return closed === 0 && ids.every(id => document.getElementById(id));
}"""


def open_groups(page, tab: str, ids=()) -> None:
    page.wait_for_function(OPEN_GROUPS_JS, arg=[tab, list(ids)], polling=200, timeout=60_000)


def registry_view(tab: str, family: str, module: str = "") -> tuple[dict, str]:
    """What the registry says the tab shows for the family (and network module), by element id: each control
    (P.visible, inside groups that are shown) and each group (P.accordion_visible; the model group always), and
    the script note."""
    def group_shown(key):
        top = P.top_group(key)
        return (key == "model" or P.accordion_visible(key, tab, family)) and \
            (top == "model" or P.accordion_visible(top, tab, family))

    view = {f"{tab}-acc-{k}": group_shown(k) for k in A.tab_accordions(tab)}
    view |= {A.elem_id(tab, p): P.visible(p, tab, family, module) and group_shown(p.accordion)
             for p in A.tab_params(tab)}
    return view, A.script_note(tab, family).replace("<code>", "").replace("</code>", "")


def network_module_on_page(page, tab: str) -> str:
    """The Network module field's value ("" when the tab has none)."""
    box = page.locator(f"#{tab}-network_module input")
    if not box.count():
        return ""
    labels = {label: value for value, label in P.BY_NAME["network_module"].choice_labels.items()}
    shown = box.input_value()
    return labels.get(shown, shown)


def assert_page_shows_the_registrys_view(page, tab: str, family: str, every_group: bool = True) -> None:
    """Once the page has taken the family, the tab's controls and groups are shown or hidden as the registry says
    for it and the Network module field's value, and the script note names the family's script only.
    every_group: each group the tab shows is opened first (gradio draws a group's controls when it is first
    opened), so every control is checked; else the groups and the controls drawn so far (the open groups')."""
    from playwright.sync_api import TimeoutError

    page.wait_for_function("([tab, f]) => document.body.getAttribute(`data-kg-${tab}-family`) === f",
                           arg=[tab, family])
    module = network_module_on_page(page, tab)
    expected, note = registry_view(tab, family, module)
    if every_group:
        try:
            open_groups(page, tab, [k for k, v in expected.items() if v])
        except TimeoutError:  # a group that should show does not: the comparison below names what is missing
            pass
    shown = page.evaluate(SHOWN_JS, [tab, list(expected)])
    groups = [f"{tab}-acc-{k}" for k in A.tab_accordions(tab)
              if k not in P.SUBGROUPS and V.group_shown_somewhere(tab, k)]
    assert all(shown[g] is not None for g in groups), [g for g in groups if shown[g] is None]  # always drawn
    if every_group:
        wrong = {k: bool(v) for k, v in shown.items() if bool(v) != expected[k]}
    else:  # a control not drawn yet is in a group not opened yet: nothing to tell
        wrong = {k: v for k, v in shown.items() if v is not None and v != expected[k]}
    assert not wrong, f"{tab} / {family} / module {module!r}, shown (True) or hidden (False) unlike the registry: " \
        f"{wrong}"
    assert page.locator(f"#{tab}-script-note").inner_text().strip() == note


def test_compile_accordion_follows_family_and_print_shows_compile(page):
    acc = page.locator("#lora-acc-compile")
    assert acc.is_visible()  # the demo preset is SDXL
    assert page.get_by_text("Torch Compile Settings").first.is_visible()
    pick(page, "lora-family", "SD1.x")
    acc.wait_for(state="hidden")
    assert "sd-scripts/train_network.py" in page.locator("#lora-acc-model").inner_text()
    assert not page.locator("#lora-acc-flux").is_visible()
    pick(page, "lora-family", "FLUX.1")
    acc.wait_for(state="visible")
    page.locator("#lora-acc-flux").wait_for(state="visible")
    assert "sd-scripts/flux_train_network.py" in page.locator("#lora-acc-model").inner_text()
    pick(page, "lora-family", "SDXL")
    page.locator("#lora-acc-flux").wait_for(state="hidden")
    acc.wait_for(state="visible")
    acc.get_by_text("Torch Compile Settings").click()
    page.locator("#lora-compile input[type=checkbox]").check()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "lora-tab-compile-open.png"), full_page=True)
    page.locator("#lora-print").click()
    page.wait_for_function(
        "() => document.querySelector('#lora-standalone textarea').value.includes('--compile')")
    standalone = field(page, "lora-standalone").input_value()
    assert "sd-scripts/sdxl_train_network.py" in standalone and "--compile" in standalone.split()
    command = field(page, "lora-command").input_value()
    assert command.startswith("accelerate launch ") and "--config_file" in command
    page.locator("#lora-compile input[type=checkbox]").uncheck()


LORA_SCRIPTS = {"SD1.x": "train_network.py", "SD2.x": "train_network.py", "SDXL": "sdxl_train_network.py",
                "FLUX.1": "flux_train_network.py", "SD3": "sd3_train_network.py",
                "Lumina 2": "lumina_train_network.py", "HunyuanImage 2.1": "hunyuan_image_train_network.py"}
LORA_SCRIPTS["Anima"] = "anima_train_network.py"


def test_every_family_names_its_script_and_shows_its_own_fields(page):
    """Each family of the LoRA tab: its script, the compile accordion for SDXL and FLUX.1 only, its own options;
    Lumina 2 prints its flow-matching defaults (upstream's, not FLUX.1's), FLUX.1's Chroma model type prints
    --model_type chroma."""
    assert sorted(LORA_SCRIPTS) == sorted(P.FAMILIES)
    compile_acc = page.locator("#lora-acc-compile")
    for family, script in LORA_SCRIPTS.items():
        pick(page, "lora-family", family)
        page.wait_for_function("(s) => document.querySelector('#lora-acc-model').innerText.includes(s)",
                               arg=f"sd-scripts/{script}")
        compile_acc.wait_for(state="visible" if family in P.COMPILE_FAMILIES else "hidden")
        assert_page_shows_the_registrys_view(page, "lora", family)
    pick(page, "lora-family", "Lumina 2")
    page.locator("#lora-acc-lumina").wait_for(state="visible")
    assert page.locator("#lora-gemma2").is_visible() and not page.locator("#lora-clip_l").is_visible()
    page.locator("#lora-print").click()
    page.wait_for_function(
        "() => document.querySelector('#lora-standalone textarea').value.includes('lumina_train_network.py')")
    standalone = field(page, "lora-standalone").input_value()
    assert "--timestep_sampling shift" in standalone and "--discrete_flow_shift 6.0" in standalone
    assert "--model_prediction_type raw" in standalone
    pick(page, "lora-family", "HunyuanImage 2.1")
    page.locator("#lora-acc-hunyuan_image").wait_for(state="visible")
    page.locator("#lora-acc-lumina").wait_for(state="hidden")
    assert page.locator("#lora-byt5").is_visible() and not page.locator("#lora-gemma2").is_visible()
    pick(page, "lora-family", "SD3")
    page.locator("#lora-acc-sd3").wait_for(state="visible")
    page.locator("#lora-acc-lumina").wait_for(state="hidden")
    page.locator("#lora-acc-hunyuan_image").wait_for(state="hidden")
    pick(page, "lora-family", "FLUX.1")
    open_groups(page, "lora")  # FLUX.1 options among them
    pick(page, "lora-model_type", "chroma")
    page.locator("#lora-print").click()
    page.wait_for_function(
        "() => document.querySelector('#lora-standalone textarea').value.includes('--model_type chroma')")
    assert "flux_train_network.py" in field(page, "lora-standalone").input_value()
    pick(page, "lora-model_type", "flux")
    pick(page, "lora-family", "SDXL")
    compile_acc.wait_for(state="visible")


def test_every_tab_and_family_shows_the_registrys_fields(page):
    """The DreamBooth, Fine-tune and Textual Inversion tabs with each of their families: every group, and the
    controls drawn, shown or hidden as the registry says (KG_E2E_EVERY_GROUP=1: every group opened and every
    control checked; ~11 min on 2 busy cores, as the whole form of three tabs is then drawn); the LoRA tab's
    network-type fields with LyCORIS, OFT and the family's LoRA: every control. (The LoRA tab's families, every
    control: the test above.) Each tab is left on the family it had."""
    every_group = os.environ.get("KG_E2E_EVERY_GROUP") == "1"
    for tab in ("dreambooth", "finetune", "ti"):
        page.get_by_role("tab", name=P.TAB_LABELS[tab]).click()
        start = page.locator(f"#{tab}-family input").input_value()
        for family in [f for f in P.tab_families(tab) if f != start] + [start]:
            pick(page, f"{tab}-family", family)
            assert_page_shows_the_registrys_view(page, tab, family, every_group)
    page.get_by_role("tab", name="LoRA").click()
    family = page.locator("#lora-family input").input_value()
    open_groups(page, "lora")  # the Network group among them
    for module in ("lycoris.kohya", "networks.oft", ""):
        pick(page, "lora-network_module", module or "LoRA (the family's)")
        page.wait_for_function("m => document.body.getAttribute('data-kg-lora-module') === m",
                               arg=V.effective_module(family, module))
        assert network_module_on_page(page, "lora") == module
        assert_page_shows_the_registrys_view(page, "lora", family)


def test_dreambooth_tab_compile_accordion_and_print(page):
    page.get_by_role("tab", name="DreamBooth").click()
    acc = page.locator("#dreambooth-acc-compile")
    acc.wait_for(state="visible")  # its demo preset is SDXL too
    pick(page, "dreambooth-family", "SD1.x")
    acc.wait_for(state="hidden")
    page.locator("#dreambooth-print").click()
    page.wait_for_function(
        "() => document.querySelector('#dreambooth-command textarea').value.includes('train_db.py')")
    pick(page, "dreambooth-family", "SDXL")
    acc.wait_for(state="visible")
    page.locator("#dreambooth-print").click()
    page.wait_for_function(
        "() => document.querySelector('#dreambooth-command textarea').value.includes('sdxl_train.py')")
    page.get_by_role("tab", name="LoRA").click()
    page.locator("#lora-family").wait_for(state="visible")


def test_save_then_open_restores_values(page, workdir):
    target = workdir / "configs" / "browser.toml"
    page.locator("#lora-acc-network").get_by_text("Network").first.click()  # closed accordions render lazily
    field(page, "lora-network_dim").fill("12")
    page.locator("#lora-acc-compile").get_by_text("Torch Compile Settings").click()  # a fresh page: closed
    pick(page, "lora-compile_mode", "reduce-overhead")
    field(page, "lora-config-path").fill(str(target))
    page.wait_for_function("(want) => document.querySelector('#lora-config-path input, #lora-config-path textarea')"
                           ".value === want", arg=str(target))
    page.locator("#lora-save").click()
    page.locator("#lora-status").get_by_text("Saved").wait_for()
    saved = config_file.load(target)
    assert saved.values["network_dim"] == 12 and saved.values["compile_mode"] == "reduce-overhead"
    field(page, "lora-network_dim").fill("20")
    pick(page, "lora-compile_mode", "default")
    page.locator("#lora-open").click()
    page.locator("#lora-status").get_by_text("Opened").wait_for()
    page.wait_for_function("() => document.querySelector('#lora-network_dim textarea').value === '12'")
    assert field(page, "lora-compile_mode").input_value() == "reduce-overhead"
    # a bad file: the error names the key, nothing changes
    bad = workdir / "configs" / "bad.toml"
    bad.write_text('[network]\nnetwork_dimm = 3\n')
    field(page, "lora-config-path").fill(str(bad))
    page.locator("#lora-open").click()
    page.locator("#lora-status").get_by_text("network_dimm").wait_for()
    assert "network_dim" in page.locator("#lora-status").inner_text()
    assert field(page, "lora-network_dim").input_value() == "12"


def test_demo_preset_start_finishes_and_shows_the_lora(page, workdir):
    pick(page, "lora-preset", "demo-sdxl-tiny")  # back to the demo as shipped
    page.locator("#lora-status").get_by_text("Loaded preset").wait_for()
    page.locator("#lora-start").click()
    page.locator("#lora-run-status").get_by_text("Training started").wait_for()
    result = page.locator("#run-result")
    result.get_by_text("Run finished").wait_for(timeout=400_000)
    lora = "outputs/demo-sdxl-tiny/demo-sdxl-lora.safetensors"
    page.locator("#run-files").get_by_text(lora).wait_for()  # the output files, with their sizes
    assert re.search(re.escape(lora) + r" \(\d+\.\d KiB\)", page.locator("#run-files").inner_text())
    assert (workdir / lora).is_file()
    page.locator("#run-loss").wait_for(state="visible")  # the loss chart, from the trainer's progress lines
    page.locator("#run-lr").wait_for(state="visible")
    gallery = page.locator("#run-samples")  # the demo samples at step 4
    gallery.locator("img").first.wait_for()
    assert "step 4:" in gallery.inner_text() or gallery.locator("img").count() >= 1
    assert "steps: 4/4" in page.locator("#kg-log textarea").input_value() or "steps: 4/4" in (
        workdir / "outputs/demo-sdxl-tiny/demo-sdxl-lora.log").read_text()
    page.screenshot(path=str(ARTIFACTS / "lora-tab-demo-finished.png"), full_page=True)


def test_tensorboard_button_serves_the_log_folder(page, workdir):
    from torch.utils.tensorboard import SummaryWriter

    logs = workdir / "tb-logs"
    with SummaryWriter(str(logs / "run1")) as w:
        w.add_scalar("loss/current", 0.5, 1)
    page.locator("#lora-filter input, #lora-filter textarea").first.fill("--logging_dir")
    field(page, "lora-logging_dir").fill(str(logs))
    page.locator("#lora-filter input, #lora-filter textarea").first.fill("")
    page.locator("#lora-tensorboard").click()
    status = page.locator("#lora-run-status")
    page.wait_for_function("() => /TensorBoard for|Error/.test(document.querySelector('#lora-run-status').innerText)")
    link = status.locator("a")
    assert link.count() == 1, status.inner_text()
    url = link.get_attribute("href")
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200 and b"TensorBoard" in r.read()

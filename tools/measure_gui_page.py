"""Measures the GUI page's cost: the number of Gradio blocks, each event's inputs and outputs (from the Blocks
config), and in a real browser (Playwright + chromium) the wall time of the everyday events, from the click to the
page showing the result and its main thread being idle again. Not a test: a tool to compare before / after.

    python tools/measure_gui_page.py [--static] [--repeat 3] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# every long task (> 50 ms of the main thread) from page start, so "idle again" can be told
LONGTASKS_JS = """
window.__lt = [];
new PerformanceObserver(l => { for (const e of l.getEntries()) window.__lt.push([e.startTime, e.duration]); })
  .observe({type: 'longtask', buffered: true});
"""


def static_report(top: int) -> None:
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="measure-gui-")  # no remembered settings
    sys.path.insert(0, str(REPO))
    from kohya_gui.ui.app import build_app

    app = build_app()
    kinds = collections.Counter(type(b).__name__ for b in app.blocks.values())
    print(f"blocks: {len(app.blocks)}  ({', '.join(f'{k} {n}' for k, n in kinds.most_common(8))})")
    rows, progress_targets = [], set()
    for fn in app.fns.values():
        trigger = "-"
        if fn.targets:
            block_id, event = fn.targets[0]
            block = app.blocks.get(block_id)
            trigger = f"{getattr(block, 'elem_id', None) or type(block).__name__}.{event}"
            if len(fn.targets) > 1:
                trigger += f" (+{len(fn.targets) - 1} triggers)"
        targets = fn.outputs if fn.show_progress_on is None else fn.show_progress_on
        if fn.fn is not None:
            progress_targets.update(b._id for b in targets)
        rows.append((len(fn.outputs), len(fn.inputs), len(targets), "queue" if fn.queue else "no queue",
                     "js" if fn.js else "", fn.fn is not None, trigger))
    rows.sort(key=lambda r: -r[0])
    print(f"events: {len(rows)}, outputs in all: {sum(r[0] for r in rows)}, inputs in all: {sum(r[1] for r in rows)}")
    # the browser keeps a progress status for each of these once its event ran, and updates every one of them on
    # each status change of any later event
    print(f"components with a progress status: {len(progress_targets)}")
    print(f"{'outputs':>7} {'inputs':>6} {'progress':>8}  trigger")
    for outputs, inputs, targets, queue, js, has_fn, trigger in rows[:top]:
        print(f"{outputs:7d} {inputs:6d} {targets:8d}  {trigger}  [{queue}{', js' if js else ''}"
              f"{'' if has_fn else ', no python'}]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gui(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1",
           "XDG_CONFIG_HOME": str(workdir / "user-config")}
    log = open(workdir / "gui.log", "w")
    proc = subprocess.Popen([sys.executable, str(REPO / "gui.py"), "--headless", "--server_port", str(port)],
                            cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    end = time.time() + 180
    while time.time() < end:
        try:
            with urllib.request.urlopen(url + "/config", timeout=2):
                return proc, url
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    raise SystemExit("the GUI did not start:\n" + (workdir / "gui.log").read_text())


def settle(page, t0: float, quiet_ms: int = 600, limit_ms: float = 60_000) -> float:
    """Milliseconds from t0 (performance.now() before the action) to the end of the last long task, once the main
    thread has had no long task for quiet_ms; at most limit_ms after the call (a page whose own timer events keep
    its main thread busy is never idle)."""
    start = page.evaluate("() => performance.now()")
    while True:
        now, last = page.evaluate("() => [performance.now(), Math.max(0, ...window.__lt.map(e => e[0] + e[1]))]")
        if now - max(last, t0) >= quiet_ms or now - start > limit_ms:
            return max(last, t0) - t0
        time.sleep(0.1)


def timed(page, action, done) -> tuple[float, float]:
    """(ms until `done` is true, ms until the main thread is idle again) for `action`."""
    t0 = page.evaluate("() => performance.now()")
    action()
    page.wait_for_function(done) if isinstance(done, str) else done()
    shown = page.evaluate("() => performance.now()") - t0
    return shown, max(shown, settle(page, t0))


class Results(collections.defaultdict):
    """name -> [(ms shown, ms idle)]; each measurement printed as it comes."""

    def __init__(self):
        super().__init__(list)

    def add(self, name: str, value: tuple[float, float]) -> None:
        self[name].append(value)
        print(f"  {name}: {value[0]:.0f} / {value[1]:.0f} ms", flush=True)


def pick(page, elem_id: str, option: str) -> None:
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option, exact=True).click()


def browser_report(chromium: str, repeat: int) -> None:
    from playwright.sync_api import sync_playwright

    workdir = Path(tempfile.mkdtemp(prefix="measure-gui-"))
    proc, url = start_gui(workdir)
    results = Results()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium,
                                        args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            for _ in range(repeat):
                context = browser.new_context(viewport={"width": 1400, "height": 1000})
                page = context.new_page()
                page.add_init_script(LONGTASKS_JS)
                page.set_default_timeout(300_000)
                results.add("page load (to the form restored)", timed(
                    page, lambda: page.goto(url),
                    lambda: page.wait_for_selector("body[data-form-restored]", state="attached")))
                for family, script, compile_shown in (("SD1.x", "train_network.py", False),
                                                      ("FLUX.1", "flux_train_network.py", True),
                                                      ("SDXL", "sdxl_train_network.py", True)):
                    results.add("LoRA family change", timed(
                        page, lambda f=family: pick(page, "lora-family", f),
                        "() => document.querySelector('#lora-acc-model').innerText.includes('sd-scripts/%s') && "
                        "(document.querySelector('#lora-acc-compile')?.offsetParent != null) === %s"
                        % (script, "true" if compile_shown else "false")))
                box = page.locator("#lora-acc-folders input[type=checkbox]").first
                results.add("a checkbox ticked (remember)", timed(page, lambda: box.click(), lambda: None))
                box.click()
                page.locator("#lora-acc-network").get_by_text("Network").first.click()
                for module, shown in (("lycoris.kohya", "factor"), ("LoRA (the family's)", "block_dims")):
                    results.add("network module change", timed(
                        page, lambda m=module: pick(page, "lora-network_module", m),
                        lambda s=shown: page.locator(f"#lora-network_args-{s}").wait_for(state="visible")))
                results.add("Print training command", timed(
                    page, lambda: page.locator("#lora-print").click(),
                    "() => document.querySelector('#lora-standalone textarea').value.includes('--')"))
                page.evaluate("() => { document.querySelector('#lora-standalone textarea').value = ''; }")
                results.add("Utilities / LoRA tools opened", timed(
                    page, lambda: (page.get_by_role("tab", name="Utilities").click(),
                                   page.get_by_role("tab", name="LoRA tools").click()),
                    lambda: page.locator("#tool-resize_lora").wait_for()))
                results.add("LoRA tool picked", timed(
                    page, lambda: pick(page, "util-lora-tool", "Check LoRA weights"),
                    lambda: page.locator("#tool-check_lora_weights").wait_for()))
                context.close()
            browser.close()
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(20)
    print(f"browser: median of {repeat} (ms until shown / ms until the main thread is idle again)")
    for name, values in results.items():
        shown = statistics.median(v[0] for v in values)
        idle = statistics.median(v[1] for v in values)
        print(f"  {name:40s} {shown:8.0f} {idle:8.0f}   (runs: {', '.join(f'{v[1]:.0f}' for v in values)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--static", action="store_true", help="only the blocks and events, no browser")
    ap.add_argument("--top", type=int, default=25, help="events listed (most outputs first)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    static_report(args.top)
    if not args.static:
        browser_report(args.chromium, args.repeat)


if __name__ == "__main__":
    main()

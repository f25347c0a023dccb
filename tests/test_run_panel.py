"""The run panel (issue 14 item 3): loss / average / validation loss and learning-rate charts and the sample
gallery from the trainer's own lines, the output files with their sizes, and the TensorBoard button."""
from __future__ import annotations

import sys
import urllib.request

import gradio as gr
import psutil
import pytest

from kohya_gui.run_history import RunHistory
from kohya_gui.runner import Runner
from kohya_gui.ui import actions as A

LINES = [
    "steps: 1/10 loss=0.5000 it/s=1.00 avr_loss=0.5000 lr=1.00e-04 epoch=1/1 eta=00:00:09",
    "steps: 1/10 loss=0.5000 it/s=1.00 avr_loss=0.5000 lr=1.00e-04 epoch=1/1 eta=00:00:09",  # printed twice
    "INFO sample image: /o/sample/run_000002_00_20261124120000_7.png (prompt 'a red circle, (sks:1.2)')",
    "steps: 2/10 loss=0.3000 it/s=1.10 avr_loss=0.4000 val_loss=0.4500 lr=9.00e-05 epoch=1/1 eta=00:00:08",
    "steps: 3/10 it/s=1.10 eta=00:00:08",  # no loss: not a point
]


def test_points_and_samples_from_the_trainers_lines():
    h = RunHistory()
    assert [h.feed(line) for line in LINES] == [True, False, True, True, False]
    assert [p["step"] for p in h.points] == [1, 2]
    assert h.loss_rows() == [
        {"step": 1, "value": 0.5, "series": "loss"}, {"step": 1, "value": 0.5, "series": "average"},
        {"step": 2, "value": 0.3, "series": "loss"}, {"step": 2, "value": 0.4, "series": "average"},
        {"step": 2, "value": 0.45, "series": "validation"}]
    assert h.lr_rows() == [{"step": 1, "value": 1e-4, "series": "learning rate"},
                           {"step": 2, "value": 9e-5, "series": "learning rate"}]
    assert h.samples == [("/o/sample/run_000002_00_20261124120000_7.png", "step 2: a red circle, (sks:1.2)")]


def test_charts_gallery_and_files_follow_a_run(tmp_path, monkeypatch):
    out = tmp_path / "out"
    (out / "sample").mkdir(parents=True)
    image = out / "sample" / "run_000002_00_20261124120000_7.png"
    from PIL import Image

    Image.new("RGB", (8, 8)).save(image)
    script = tmp_path / "fake_trainer.py"
    lines = [ln.replace("/o/sample/run_000002_00_20261124120000_7.png", str(image)) for ln in LINES]
    script.write_text(
        "import pathlib\n"
        + "".join(f"print({ln!r}, flush=True)\n" for ln in lines)
        + f"pathlib.Path({str(out / 'run.safetensors')!r}).write_bytes(b'x' * 3000)\n")
    runner = Runner()
    monkeypatch.setattr(A, "RUNNER", runner)
    empty = A.run_charts(None)
    assert empty[0]["visible"] is False and empty[2]["visible"] is False and empty[3] == ""
    runner.start([[sys.executable, str(script)]], tmp_path / "run.log", output_dir=out)
    assert runner.wait().returncode == 0
    loss, lr, gallery, files, seen = A.run_charts(empty[4])
    assert loss["visible"] and list(loss["value"]["series"]) == ["loss", "average", "loss", "average", "validation"]
    assert list(lr["value"]["value"]) == [1e-4, 9e-5]
    assert gallery["value"] == [(str(image), "step 2: a red circle, (sks:1.2)")]
    assert f"- `{out / 'run.safetensors'}` (2.9 KiB)" in files
    assert A.run_charts(seen) == (gr.skip(), gr.skip(), gr.skip(), gr.skip(), seen)  # nothing new: no redraw


def test_tensorboard_button_serves_the_log_folder_and_goes_with_the_gui(tmp_path):
    from kohya_gui.tensorboard import TensorBoard

    assert "logging_dir) is empty" in A.open_tensorboard("")
    assert "does not exist yet" in A.open_tensorboard(str(tmp_path / "none"))
    logs = tmp_path / "logs"
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(logs / "run1")) as w:
        w.add_scalar("loss/current", 0.5, 1)
    tb = TensorBoard()
    try:
        port = tb.start(str(logs))
        assert tb.start(str(logs)) == port  # the same folder: the same server
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as r:
            assert r.status == 200 and b"TensorBoard" in r.read()
        pid = tb._proc.pid
    finally:
        tb.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("n,text", [(512, "512 B"), (3000, "2.9 KiB"), (5 * 2**20, "5.0 MiB"), (3 * 2**30, "3.0 GiB")])
def test_sizes_read_as_people_write_them(n, text):
    assert A.format_size(n) == text


def test_the_panel_asks_every_second_only_during_a_run(tmp_path, monkeypatch):
    runner = Runner()
    monkeypatch.setattr(A, "RUNNER", runner)
    *_, timer, seen = A.run_tick(None)
    assert timer.value == A.TICK_IDLE_S and seen[-1] == A.TICK_IDLE_S
    assert A.run_tick(seen)[-2] == gr.skip()  # unchanged: no update for the timer
    runner.start([[sys.executable, "-c", "import time; time.sleep(3)"]], tmp_path / "run.log")
    try:
        *_, timer, seen = A.run_tick(seen)
        assert timer.value == A.TICK_RUNNING_S
    finally:
        runner.stop(now=True)
    *_, timer, seen = A.run_tick(seen)
    assert timer.value == A.TICK_IDLE_S

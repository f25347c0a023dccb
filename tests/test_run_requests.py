"""Save now, Sample now and Stop while a trainer runs (issue 14 item 2): `python -m kohya_gui signal` (the GUI's
buttons use the same function) appends to the output folder's request file; the trainer acts at its next step
boundary and training goes on."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lora_checks import read_lora
from test_sdxl_lora_training import base_argv

from kohya_gui import __main__ as cli
from kohya_gui import run_requests as gui_requests

REPO = Path(__file__).resolve().parent.parent


def test_both_sides_use_one_file_and_one_set_of_words():
    from library import run_requests

    assert (run_requests.FILE_NAME, run_requests.REQUESTS) == (gui_requests.FILE_NAME, gui_requests.REQUESTS)


def test_requests_are_taken_once_in_order_of_arrival_and_unknown_words_are_named(tmp_path, caplog):
    from library import run_requests

    trainer_side = run_requests.RunRequests(str(tmp_path))
    assert trainer_side.take() == set()
    gui_requests.send("save", tmp_path)
    (tmp_path / gui_requests.FILE_NAME).open("a").write("dance\n")
    gui_requests.send("sample", tmp_path)
    with caplog.at_level(logging.WARNING):
        assert trainer_side.take() == {"save", "sample"}
    assert "ignored dance (allowed: save, sample, stop)" in caplog.text
    assert trainer_side.take() == set()  # taken: not again at the next step
    assert trainer_side.take(stop_flag=True) == {"stop"}  # a stop signal joins the requests
    gui_requests.send("stop", tmp_path)
    trainer_side.clear_stale()  # what a new run does first
    assert trainer_side.take() == set() and not list(tmp_path.iterdir())


def test_cli_errors_name_the_problem_and_exit_2(tmp_path, capsys):
    assert cli.main(["signal", "save", str(tmp_path / "missing")]) == 2
    assert "no such folder or file" in capsys.readouterr().err
    toml = tmp_path / "run.toml"
    toml.write_text('[folders]\noutput_dir = "/nonexistent/out"\n')
    assert cli.main(["signal", "sample", str(toml)]) == 2
    assert "does not exist (has the run started?)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["signal", "pause", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'pause'" in err and "'save', 'sample', 'stop'" in err
    assert not (tmp_path / gui_requests.FILE_NAME).exists()


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_save_now_sample_now_then_stop_while_training(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    out = tmp_path / "out"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --d 5\n")
    argv = base_argv(tiny_sdxl_single_file, out, tiny_dataset_dir, "asked", steps=500,
                     extra=["--network_train_unet_only", "--sample_prompts", str(prompts)])
    out.mkdir()
    (out / gui_requests.FILE_NAME).write_text("stop\n")  # left by an earlier run: not for this one
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "sd-scripts/sdxl_train_network.py", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, sent_stop = [], False
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("steps: ") and len([ln for ln in lines if ln.startswith("steps: ")]) == 1:
                assert cli.main(["signal", "save", str(out)]) == 0
                assert cli.main(["signal", "sample", str(out)]) == 0
            if "sample requested: sampling at step" in line and not sent_stop:
                # the run TOML names the folder too
                assert cli.main(["signal", "stop", str(out / "asked_config.toml")]) == 0
                sent_stop = True
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines)
    assert proc.returncode == 0, text[-3000:]
    saved = [ln for ln in text.splitlines() if "save requested: saving at step" in ln]
    assert len(saved) == 1, text[-3000:]
    step = int(saved[0].rsplit(" ", 1)[1])
    assert read_lora(out / f"asked-step{step:08d}.safetensors")[1]["ss_steps"] == str(step)
    # the two requests are two writes: the trainer may read the first alone and sample one step boundary later
    sampled = [ln for ln in text.splitlines() if "sample requested: sampling at step" in ln]
    assert len(sampled) == 1, text[-3000:]
    sample_step = int(sampled[0].rsplit(" ", 1)[1])
    assert step <= sample_step <= step + 1
    assert len(list((out / "sample").glob(f"asked_{sample_step:06d}_00_*_5.png"))) == 1
    stopped = [ln for ln in text.splitlines() if ln.startswith("stopped at step ")]
    assert len(stopped) == 1 and step <= int(stopped[0].split()[3].rstrip(",")) < 500
    assert read_lora(out / "asked.safetensors")[0]
    assert not (out / gui_requests.FILE_NAME).exists()


def test_the_gui_buttons_ask_the_running_trainer(tmp_path, monkeypatch):
    from kohya_gui.runner import RunState
    from kohya_gui.ui import actions as A

    assert "No training is running" in A.request_now("save")
    monkeypatch.setattr(A.RUNNER, "snapshot", lambda: RunState(running=True, output_dir=str(tmp_path)))
    assert "Asked the trainer to save" in A.request_now("save")
    assert "Asked the trainer to draw the sample images" in A.request_now("sample")
    assert (tmp_path / gui_requests.FILE_NAME).read_text().split() == ["save", "sample"]

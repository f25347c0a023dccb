"""Issue 26 item 9 (the trainer side): SIGTERM to `accelerate launch` alone (which forwards no signal) still stops
the trainer with a save, and a trainer stopped before its loop exits 0 and leaves no `<name>_config.toml`."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kohya_gui import REPO

SD_SCRIPTS = str(REPO / "sd-scripts")

# a trainer's shape: settings file written, StopRequest() at train()'s start, a slow "model load", then the loop
# with install(); the except path is train()'s (a run that never trained leaves no settings file)
TRAINER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[2])
    from library.stop_signal import StopRequest
    out = sys.argv[1]
    config = os.path.join(out, "x_config.toml")
    stop = StopRequest()
    trained = False
    try:
        open(config, "w").write("seed = 1\\n")
        print("loading", flush=True)
        time.sleep(float(sys.argv[3]))  # the models load
        stop.install()
        trained = True
        step = 0
        while not stop.flag:
            step += 1
            print(f"step {step}", flush=True)
            time.sleep(0.1)
        open(os.path.join(out, "x.safetensors"), "w").write(stop.signal_name)
        print(f"stopped at step {step}", flush=True)
    except BaseException:
        if not trained:
            os.remove(config)
        raise
    finally:
        stop.restore()
""")
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.Popen([sys.executable, *sys.argv[1:]]).wait())"


def _start(tmp_path, load_s: float, env_extra: dict):
    (tmp_path / "trainer.py").write_text(TRAINER)
    env = {**os.environ, **env_extra}
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "trainer.py"), str(tmp_path), SD_SCRIPTS,
                             str(load_s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _read_until(proc, word):
    for line in proc.stdout:
        if word in line:
            return line
    raise AssertionError(f"no {word!r} line")


def _trainer_pid(launcher_pid):
    import psutil

    return psutil.Process(launcher_pid).children()[0].pid


def test_sigterm_to_the_launcher_alone_stops_the_trainer_with_a_save(tmp_path):
    proc = _start(tmp_path, 0.0, {"ACCELERATE_DYNAMO_BACKEND": "NO"})
    _read_until(proc, "step 2")
    trainer = _trainer_pid(proc.pid)
    proc.send_signal(signal.SIGTERM)  # the launcher dies of it and forwards nothing
    proc.wait(10)
    deadline = time.time() + 20
    while time.time() < deadline and not (tmp_path / "x.safetensors").exists():
        time.sleep(0.1)
    assert (tmp_path / "x.safetensors").read_text() == "launcher ended"
    deadline = time.time() + 10
    while time.time() < deadline and os.path.exists(f"/proc/{trainer}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{trainer}")


def test_without_a_launcher_a_changed_parent_is_not_a_stop(monkeypatch):
    from library import stop_signal

    stop = stop_signal.StopRequest(environ={})
    try:
        monkeypatch.setattr(os, "getppid", lambda: 1)  # e.g. nohup python train.py &, the shell closed
        assert not stop.flag
    finally:
        stop.restore()


def test_a_stop_while_held_is_answered_at_the_end_of_the_block():
    """The settings file is written and its path kept inside held(): a SIGTERM that comes between the two (after the
    file exists, before the clean-up knows its path: it left the file once, in a slow-set run on a loaded machine)
    waits for both."""
    from library import stop_signal

    stop = stop_signal.StopRequest(environ={})
    kept = []
    try:
        with pytest.raises(stop_signal.StoppedBeforeTraining) as stopped:
            with stop.held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler has run by now (between two bytecodes of this thread)
                kept.append("path")  # still reached: the stop waits for the block's end
        assert kept == ["path"] and stopped.value.signal_name == "SIGTERM"
        with pytest.raises(stop_signal.StoppedBeforeTraining):  # outside the block: at once, as before
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            kept.append("never")
        assert kept == ["path"]
    finally:
        stop.restore()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_before_the_loop_exits_0_and_leaves_no_settings_file(tmp_path, sig):
    (tmp_path / "trainer.py").write_text(TRAINER)
    proc = subprocess.Popen([sys.executable, str(tmp_path / "trainer.py"), str(tmp_path), SD_SCRIPTS, "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _read_until(proc, "loading")
    assert (tmp_path / "x_config.toml").exists()
    proc.send_signal(sig)
    rest = proc.communicate(timeout=20)[0]
    assert proc.returncode == 0, rest
    assert f"stopped before training started ({signal.Signals(sig).name}): nothing saved" in rest
    assert "Traceback" not in rest
    assert not (tmp_path / "x_config.toml").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_real_trainer_stopped_as_it_starts_keeps_its_settings_file_only_if_it_trained(
        tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    """SIGTERM the moment `<name>_config.toml` appears: exit 0, no traceback, and the settings file is there only
    next to a result (7 of 17 such stops used to leave it alone)."""
    from test_sdxl_lora_training import base_argv

    out = tmp_path / "out"
    argv = base_argv(tiny_sdxl_single_file, out, tiny_dataset_dir, "early", steps=50,
                     extra=["--network_train_unet_only"])
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "sd-scripts/sdxl_train_network.py", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (out / "early_config.toml").exists():
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        text = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in text, text[-3000:]
    trained = (out / "early.safetensors").exists()
    assert (out / "early_config.toml").exists() == trained
    assert ("stopped before training started (SIGTERM): nothing saved" in text) != trained


@pytest.mark.slow
def test_a_stop_during_the_samples_trains_no_step_more(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    """SIGTERM while step 1's sample images are drawn: the run stops after step 1 (it used to train step 2)."""
    from test_sdxl_lora_training import base_argv

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"a red square {i} --w 64 --h 64 --s 40 --d {i}\n" for i in range(4)))
    out = tmp_path / "out"
    argv = base_argv(tiny_sdxl_single_file, out, tiny_dataset_dir, "sampled", steps=50,
                     extra=["--network_train_unet_only", "--sample_prompts", str(prompts),
                            "--sample_every_n_steps", "1"])
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "sd-scripts/sdxl_train_network.py", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "sample image: " in line:  # the first of step 1's four images: three are still to be drawn
                proc.send_signal(signal.SIGTERM)
                break
        text = "".join(lines) + proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text[-3000:]
    stopped = [ln for ln in text.splitlines() if ln.startswith("stopped at step ")]
    assert stopped and stopped[0].startswith("stopped at step 1,"), text[-3000:]

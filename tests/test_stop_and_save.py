"""Runs that never lose work (issue 14): SIGTERM = finish the step, save, exit 0 (library.stop_signal); state
folders written atomically and stale temporary ones removed (library.saving); --resume refuses taken names
before any model loads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lora_checks import read_lora
from test_sdxl_lora_training import base_argv

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM is not deliverable on Windows (see stop_signal)")
def test_sigterm_saves_and_exits_zero(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    out = tmp_path / "out"
    max_steps = 500
    argv = base_argv(tiny_sdxl_single_file, out, tiny_dataset_dir, "stopped", steps=max_steps,
                     extra=["--network_train_unet_only", "--save_state"])
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "sd-scripts/sdxl_train_network.py", *argv], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("steps: "):
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + rest
    assert proc.returncode == 0, text[-3000:]
    lora = out / "stopped.safetensors"
    stopped = [ln for ln in text.splitlines() if ln.startswith("stopped at step ")]
    assert len(stopped) == 1, text[-3000:]
    step = int(stopped[0].split()[3].rstrip(","))
    assert stopped[0] == f"stopped at step {step}, saved {lora}"
    assert 1 <= step < max_steps
    sd, md = read_lora(lora)
    assert sd and md["ss_steps"] == str(step)
    state = out / "stopped-state"
    assert state.is_dir() and any(p.name.startswith("custom_checkpoint") for p in state.iterdir())
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temporary files left behind"

    # the state folder continues the run: one more step from where it stopped
    import sdxl_train_network
    from library import network_trainer

    trainer = sdxl_train_network.trainer()
    resumed = network_trainer.run(trainer, sdxl_train_network.setup_parser(),
                                  base_argv(tiny_sdxl_single_file, out, tiny_dataset_dir, "resumed", steps=step + 1,
                                            extra=["--network_train_unet_only", "--resume", str(state)]))
    assert len(trainer.losses) == 1
    assert read_lora(resumed)[1]["ss_steps"] == str(step + 1)


def test_stop_request_first_signal_flags_second_aborts_and_restore(tmp_path):
    """In-process: the first Ctrl+C only sets the flag; a second one (during a save here) raises
    KeyboardInterrupt and the atomic writer leaves neither the result nor its temporary file."""
    import torch

    from library import stop_signal, train_util

    before = signal.getsignal(signal.SIGINT)
    stop = stop_signal.StopRequest().install()
    try:
        assert not stop.flag
        signal.raise_signal(signal.SIGINT)
        assert stop.flag and stop.signal_name == "SIGINT"
        signal.raise_signal(signal.SIGTERM)  # the same stop delivered twice at once (group + launcher): ignored
        assert stop.flag and stop.signal_name == "SIGINT"
        stop._first_at -= stop_signal.REPEAT_WINDOW_S  # a real second stop comes later
        target = tmp_path / "x.safetensors"
        with pytest.raises(KeyboardInterrupt):
            with train_util.atomic_target(target) as tmp:
                torch.save({"a": torch.zeros(2)}, tmp)
                signal.raise_signal(signal.SIGINT)
                os.replace(tmp, target)  # not reached
        assert list(tmp_path.iterdir()) == []
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before


# ---------------------------------------------------------------------------------------------------------
# state folders: written beside the target, renamed when complete (library.state_folders)


class _FakeAccelerator:
    """accelerate's save_state writing `files` into the folder, failing after the first one when `fail`."""
    is_main_process = True

    def __init__(self, files, fail=False):
        self.files, self.fail = files, fail

    def wait_for_everyone(self):
        pass

    def save_state(self, path):
        os.makedirs(path, exist_ok=True)
        for i, (name, text) in enumerate(self.files.items()):
            if self.fail and i == 1:
                raise KeyboardInterrupt  # a second Ctrl+C, a full disk ...
            Path(path, name).write_text(text)


def test_state_save_replaces_only_when_complete(tmp_path):
    from library import state_folders

    target = tmp_path / "x-state"
    target.mkdir()
    (target / "optimizer.bin").write_text("old")
    (target / "custom_checkpoint_0.pkl").write_text("old")
    new = {"optimizer.bin": "new", "custom_checkpoint_0.pkl": "new"}
    with pytest.raises(KeyboardInterrupt):
        state_folders.write_state(_FakeAccelerator(new, fail=True), str(target), overwrite=True)
    assert {p.name: p.read_text() for p in target.iterdir()} == {"optimizer.bin": "old",
                                                                  "custom_checkpoint_0.pkl": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-state"]  # no temporary folder left

    fresh = tmp_path / "y-state"
    with pytest.raises(KeyboardInterrupt):
        state_folders.write_state(_FakeAccelerator(new, fail=True), str(fresh), overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-state"]  # no partial folder under the final name

    state_folders.write_state(_FakeAccelerator(new), str(target), overwrite=True)
    assert {p.name: p.read_text() for p in target.iterdir()} == new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-state"]


def test_stale_state_folders_of_killed_runs_removed(tmp_path):
    from library import state_folders

    # library.files' work folders: a state save killed while writing, one killed between the two renames of a
    # replacement (the complete old folder moved aside as "previous"), another name's, a finished replacement's
    for name, inside in ((".x-state.tmp-0", "x-state"), (".x-step00000005-state.tmp-0", "x-step00000005-state"),
                         (".x-000002-state.tmp-0", "previous"), (".xy-state.tmp-0", "xy-state"),
                         (".x-state.tmp-1a2b", "previous"), (".x_v2-state.tmp-0", "x_v2-state"),
                         (".x_config.toml.tmp-3c", "x_config.toml"), (".x.safetensors.tmp-4d", ".tmpAb12Cd")):
        (tmp_path / name / inside).mkdir(parents=True)
        (tmp_path / name / inside / "optimizer.bin").write_text(name)
    (tmp_path / "x-state").mkdir()
    (tmp_path / "sample").mkdir()
    (tmp_path / "sample" / ".x_000001_00_20261124_1.png.tmp-1f").mkdir()
    state_folders.remove_stale(str(tmp_path), "x")
    # killed between the two renames: the complete old folder is put back; other names are not touched
    assert sorted(p.name for p in tmp_path.iterdir()) == [".x_v2-state.tmp-0", ".xy-state.tmp-0", "sample",
                                                            "x-000002-state", "x-state"]
    assert (tmp_path / "x-000002-state" / "optimizer.bin").read_text() == ".x-000002-state.tmp-0"
    assert list((tmp_path / "x-state").iterdir()) == []
    assert list((tmp_path / "sample").iterdir()) == []


def _state_folder(path, step, epoch):
    import torch

    path.mkdir()
    torch.save({"not": "the step counter"}, path / "custom_checkpoint_0.pkl")
    torch.save({"global_step": step, "epoch": epoch}, path / "custom_checkpoint_1.pkl")
    return path


@pytest.mark.parametrize("existing, extra, refused", [
    ("r-state", ["--save_state"], True),
    ("r-state", ["--save_state_on_train_end"], True),
    ("r-state", [], False),  # this run writes no state folder
    ("r-step00000010.safetensors", ["--save_every_n_steps", "5"], True),
    ("r-step00000005.safetensors", ["--save_every_n_steps", "5"], False),  # before the resumed step
    ("r-step00000010-state", ["--save_every_n_steps", "5"], False),  # without --save_state
    ("r-step00000010-state", ["--save_every_n_steps", "5", "--save_state"], True),
    ("r-000002.safetensors", ["--save_every_n_epochs", "1"], True),
    ("r-000001.safetensors", ["--save_every_n_epochs", "1"], False),
    ("r-state", ["--save_state", "--overwrite_output"], False),
])
def test_resume_checks_names_before_model_load(tmp_path, tiny_dataset_dir, existing, extra, refused):
    """Refused before any model loads (the model path does not exist); a free set of names goes on to the model
    load, which then fails."""
    from library import train_util
    from library.model_util import ModelLoadError

    state = _state_folder(tmp_path / "old-step00000005-state", step=5, epoch=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / existing).mkdir() if existing.endswith("-state") else (out / existing).write_bytes(b"x")
    argv = base_argv(tmp_path / "missing.safetensors", out, tiny_dataset_dir, "r", steps=20,
                     extra=["--resume", str(state), *extra])
    if refused:
        with pytest.raises(train_util.OutputExistsError, match=f"--resume would write {existing}"):
            _train(argv)
    else:
        with pytest.raises((ModelLoadError, FileNotFoundError, OSError)):
            _train(argv)


def test_resume_of_a_folder_without_state_refused(tmp_path, tiny_dataset_dir):
    from library.network_trainer import TrainingError

    (tmp_path / "empty-state").mkdir()  # what a kill during a state save left before (an empty folder)
    argv = base_argv(tmp_path / "missing.safetensors", tmp_path / "out", tiny_dataset_dir, "r",
                     extra=["--resume", str(tmp_path / "empty-state")])
    with pytest.raises(TrainingError, match="not a training state folder"):
        _train(argv)


def _train(argv):
    import sdxl_train_network
    from library import train_util

    args = train_util.parse_args(sdxl_train_network.setup_parser(), argv)
    return sdxl_train_network.trainer().train(args)

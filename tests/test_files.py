"""library.files, the one atomic writer (issue 24 item 1; issue 26 items 2, 3, 11): a kill -9 inside a safetensors
write leaves nothing the next run does not remove, a full disk is one SaveError naming the file with the earlier
saves kept and no temporary left, and results get the umask's mode."""
from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from library import files, state_folders
from library.errors import SaveError

SD_SCRIPTS = Path(__file__).resolve().parents[1] / "sd-scripts"


def _everything(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_results_get_the_umask_mode_not_safetensors_0600(tmp_path):
    from library.train_util import save_safetensors_atomic
    from networks import lora

    old = os.umask(0o027)
    try:
        files.FILE_MODE = 0o640  # what the module reads at import, for this umask
        save_safetensors_atomic({"a": torch.zeros(2)}, tmp_path / "x.safetensors")
        files.write_text(tmp_path / "x.toml", "a = 1\n")
        net = lora.LoRANetwork.__new__(lora.LoRANetwork)
        torch.nn.Module.__init__(net)
        net.lora_state_dict = lambda dtype: {"w": torch.ones(1)}
        lora.LoRANetwork.save_weights(net, str(tmp_path / "net.safetensors"), None, {"ss_network_dim": "4"})
    finally:
        os.umask(old)
        files.FILE_MODE = 0o666 & ~old
    for name in ("x.safetensors", "x.toml", "net.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640, name


def test_a_replaced_folder_is_swapped_only_when_complete_and_restored_after_a_kill(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "a").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_target(target) as tmp:
            os.mkdir(tmp)
            Path(tmp, "a").write_text("new")
            raise KeyboardInterrupt
    assert _everything(tmp_path) == ["m", "m/a"] and (target / "a").read_text() == "old"
    with files.atomic_target(target) as tmp:
        os.mkdir(tmp)
        Path(tmp, "a").write_text("new")
    assert _everything(tmp_path) == ["m", "m/a"] and (target / "a").read_text() == "new"
    # a kill between the two renames: the old folder sits in the work folder as "previous", `m` is gone
    work = Path(files.work_folder(target))
    (work / "m").mkdir(parents=True)
    os.replace(target, work / "previous")
    assert files.remove_stale(tmp_path, re.compile("m")) == [str(work)]
    assert _everything(tmp_path) == ["m", "m/a"] and (target / "a").read_text() == "new"


_WRITER = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[1])
    from library import train_util
    big = {"w": torch.ones(8 * 1024 * 1024)}  # 32 MiB: each write takes a while
    print("ready", flush=True)
    while True:
        train_util.save_safetensors_atomic(big, sys.argv[2] + "/x.safetensors", {"ss_steps": "1"}, overwrite=True)
""")


@pytest.mark.slow
def test_kill_9_inside_a_safetensors_write_leaves_nothing_the_next_run_keeps(tmp_path):
    """safetensors writes its own `.tmpXXXXXX` and renames it; killed inside that write, the file must sit where
    the next run's remove_stale finds it (issue 26 item 2: 13/13 kills left one in the output folder)."""
    out = tmp_path / "out"
    out.mkdir()
    kills = 0
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(SD_SCRIPTS), str(out)], stdout=subprocess.PIPE,
                                text=True)
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kill while safetensors' own temporary file exists
            if [p for p in out.rglob(".tmp*") if p.is_file()]:
                break
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        left = _everything(out)
        if any(Path(p).name.startswith(".tmp") for p in left):
            kills += 1
        state_folders.remove_stale(str(out), "x")
        assert [p for p in _everything(out) if p != "x.safetensors"] == [], left
    assert kills >= 1  # at least one kill landed inside safetensors' write


def _full_disk_save_file(tensors, filename, metadata=None):
    from safetensors import SafetensorError

    Path(filename).write_bytes(b"partial")
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("case", ["safetensors", "torch", "png", "toml", "state"])
def test_disk_full_is_one_save_error_naming_the_file_earlier_saves_kept(tmp_path, monkeypatch, case):
    """Each writer's real error type for ENOSPC (safetensors' SafetensorError, torch's RuntimeError, PIL's and
    open()'s OSError, accelerate's state save failing inside torch) becomes SaveError with the file's name."""
    import safetensors.torch
    from PIL import Image

    from library import sampling, train_util

    (tmp_path / "earlier.safetensors").write_bytes(b"kept")
    if case == "safetensors":
        monkeypatch.setattr(safetensors.torch, "save_file", _full_disk_save_file)
        target = tmp_path / "x.safetensors"
        write = lambda: train_util.save_safetensors_atomic({"a": torch.zeros(1)}, target)  # noqa: E731
    elif case == "torch":
        def full_torch_save(obj, f):
            Path(f).write_bytes(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

        monkeypatch.setattr(torch, "save", full_torch_save)
        monkeypatch.setattr(files, "_free_bytes", lambda where: 0)  # the disk is full when torch gives up
        target = tmp_path / "x.pt"
        write = lambda: train_util.save_torch_atomic({"a": torch.zeros(1)}, target)  # noqa: E731
    elif case == "png":
        def full_png_save(self, fp, *a, **k):
            Path(fp).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(Image.Image, "save", full_png_save)
        args = type("Args", (), {"output_dir": str(tmp_path), "output_name": "x"})()
        target = tmp_path / "sample"
        write = lambda: sampling.save_sample_image(Image.new("RGB", (8, 8)), args, epoch=None, steps=1,  # noqa: E731
                                                   index=0, seed=1, prompt="p")
    elif case == "toml":
        real_open = open

        def full_open(path, mode="r", *a, **k):
            if "w" in mode:
                real_open(path, mode).close()
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real_open(path, mode, *a, **k)

        monkeypatch.setattr("builtins.open", full_open)
        target = tmp_path / "x_config.toml"
        write = lambda: train_util.atomic_write_text(target, "a = 1\n")  # noqa: E731
    else:
        class FullDiskAccelerator:
            is_main_process = True

            def wait_for_everyone(self):
                pass

            def save_state(self, path):
                os.makedirs(path)
                Path(path, "optimizer.bin").write_bytes(b"partial")
                raise RuntimeError("basic_ios::clear: iostream error")

        monkeypatch.setattr(files, "_free_bytes", lambda where: 0)  # the disk is full when torch gives up
        target = tmp_path / "x-state"
        write = lambda: state_folders.write_state(FullDiskAccelerator(), str(target), False)  # noqa: E731
    with pytest.raises(SaveError) as e:
        write()
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"cannot save {target}")
    assert "No space left on device (free some space, or choose another --output_dir); the earlier saves in" \
        in message
    left = _everything(tmp_path)
    assert left == ["earlier.safetensors"] or (case == "png" and left == ["earlier.safetensors", "sample"]), left
    assert (tmp_path / "earlier.safetensors").read_bytes() == b"kept"


def _tiny_filesystem(path: Path) -> bool:
    path.mkdir()
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_really_full_disk(tmp_path):
    """The same on a real 256 KiB filesystem (root on Linux only): every writer's own error, no injection."""
    disk = tmp_path / "disk"
    if not _tiny_filesystem(disk):
        pytest.skip("needs root to mount a tiny tmpfs")
    try:
        files.write_text(disk / "earlier.toml", "kept = true\n")
        big = {"a": torch.zeros(200_000)}
        writes = {"x.safetensors": lambda p: files.save_safetensors(big, p),
                  "x.pt": lambda p: files.save_torch(big, p),
                  "x.png": lambda p: _save_png(p),
                  "x.toml": lambda p: files.write_text(p, "a" * 400_000)}
        for name, write in writes.items():
            with pytest.raises(SaveError, match=f"cannot save {disk / name}: No space left on device"):
                write(disk / name)
            assert _everything(disk) == ["earlier.toml"], name
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def _save_png(path):
    import numpy as np
    from PIL import Image

    image = Image.frombytes("RGB", (512, 512), np.random.default_rng(0).bytes(512 * 512 * 3))  # no compression
    with files.atomic_target(path) as tmp:
        image.save(tmp)

"""Nothing lost at save time (issue 14 item 5): a disk that refuses a save (full: an injected ENOSPC) stops the
run with one line naming the file and the reason, exit 2, the earlier saves kept and no temporary file left;
what a killed run left is removed when the next run of that name starts."""
from __future__ import annotations

import errno

import pytest

from lora_checks import read_lora
from test_sdxl_lora_training import base_argv

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_disk_full_at_the_final_save(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir, monkeypatch, capsys):
    import safetensors.torch
    import sdxl_train_network
    from library import network_trainer

    real_save = safetensors.torch.save_file
    calls = []

    def full_disk_on_second_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:  # the final save: half written, then the disk is full
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk_on_second_save)
    out = tmp_path / "out"
    out.mkdir()
    # library.files' work folders left by kill -9: one inside safetensors' own write (its .tmpXXXXXX), a sample's
    (out / ".full.safetensors.tmp-424242").mkdir()
    (out / ".full.safetensors.tmp-424242" / ".tmpAb12Cd").write_bytes(b"left by a killed run")
    (out / "sample" / ".full_000001_00_20261124_1.png.tmp-1f").mkdir(parents=True)
    (out / "sample" / ".full_000001_00_20261124_1.png.tmp-1f" / "full_000001_00_20261124_1.png").write_bytes(b"x")
    (out / ".other.safetensors.tmp-1").mkdir()  # another run's: kept
    argv = base_argv(tiny_sdxl_single_file, out, tiny_dataset_dir, "full", steps=2,
                     extra=["--network_train_unet_only", "--save_every_n_steps", "1"])
    with pytest.raises(SystemExit) as e:
        network_trainer.run(sdxl_train_network.trainer(), sdxl_train_network.setup_parser(), argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"error: cannot save {out / 'full-step00000002.safetensors'}: No space left on device "
                       f"(free some space, or choose another --output_dir); the earlier saves in {out} are kept")
    assert "Traceback" not in "\n".join(err)
    assert read_lora(out / "full-step00000001.safetensors")[1]["ss_steps"] == "1"  # the earlier save is kept
    names = sorted(p.name for p in out.iterdir())
    assert names == [".other.safetensors.tmp-1", "full-step00000001.safetensors", "full_config.toml", "sample"]
    assert list((out / "sample").iterdir()) == []

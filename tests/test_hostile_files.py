"""Issue 26 item 6: hostile input files (a 5000-digit integer, deep nesting of arrays / inline tables / table
headers, binary and UTF-16 files, huge files, hundreds of thousands of unknown keys) give one clear line (a short
list for bad keys), exit 2 and no traceback, within seconds: in the GUI's Open, `python -m kohya_gui`
(print-command, train, import, signal) and the trainers (--config_file, --dataset_config)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kohya_gui import REPO, __main__ as cli, config_file, importer
from kohya_gui.ui import actions as A

HOSTILE = {
    "bigint.toml": lambda: ("max_train_steps = " + "9" * 5000 + "\n").encode(),
    "arrays.toml": lambda: ("x = " + "[" * 100000 + "]" * 100000 + "\n").encode(),
    "inline.toml": lambda: ("x = " + "{a=" * 10000 + "1" + "}" * 10000 + "\n").encode(),
    "headers.toml": lambda: ("[" + ".".join(["a"] * 5000) + "]\nb = 1\n").encode(),
    "binary.toml": lambda: bytes(range(256)) * 100,
    "utf16.toml": lambda: "max_train_steps = 5\n".encode("utf-16"),
    "huge.toml": lambda: b"".join(b"unknown_key_%d = %d\n" % (i, i) for i in range(400000)),
}
EXPECT = {"bigint.toml": "4300 digits", "arrays.toml": "nested", "inline.toml": "nested", "headers.toml": "a.a",
          "binary.toml": "not a UTF-8 text file", "utf16.toml": "not a UTF-8 text file", "huge.toml": "too large"}
MANY_KEYS = 60000  # under the size limits: every key is read, and listed as unknown


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hostile")
    for name, make in HOSTILE.items():
        (folder / name).write_bytes(make())
    (folder / "many_keys.toml").write_text("".join(f"unknown_key_{i} = {i}\n" for i in range(MANY_KEYS)))
    (folder / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (folder / "bigint.json").write_text('{"max_train_steps": ' + "9" * 5000 + "}")
    return folder


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _refused(error, fn) -> tuple[str, float]:
    """(the message of the `error` that fn raises, seconds it took)."""
    t0 = time.perf_counter()
    with pytest.raises(error) as e:
        fn()
    return str(e.value), time.perf_counter() - t0


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_the_gui_and_its_cli_give_one_line(hostile, name, capsys):
    path = hostile / name
    message, seconds = _refused(config_file.ConfigError, lambda: config_file.load(path))
    assert seconds < 5 and len(message.splitlines()) == 1 and str(path) in message and EXPECT[name] in message, message
    opened, seconds = _timed(lambda: A.open_config("lora", str(path), "SDXL"))
    assert seconds < 5 and EXPECT[name] in opened[0]
    assert cli.main(["print-command", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert cli.main(["signal", "save", str(path)]) == 2  # a run TOML given to `signal`
    assert "Traceback" not in capsys.readouterr().err


def test_many_unknown_keys_are_listed_briefly_and_fast(hostile):
    message, seconds = _refused(config_file.ConfigError, lambda: config_file.load(hostile / "many_keys.toml"))
    assert seconds < 10
    opened, seconds = _timed(lambda: A.open_config("lora", str(hostile / "many_keys.toml"), "SDXL"))
    lines = message.splitlines()
    assert len(lines) == config_file.MAX_PROBLEMS + 1 and lines[-1] == f"... and {MANY_KEYS - 20} more problems"
    assert seconds < 10 and opened[0].count("unknown key") == config_file.MAX_PROBLEMS


@pytest.mark.parametrize("name", ["deep.json", "bigint.json", "binary.toml", "utf16.toml", "arrays.toml"])
def test_import_gives_one_line(hostile, name):
    with pytest.raises(importer.ImportError_) as e:
        importer.load(hostile / name)
    assert len(str(e.value).splitlines()) == 1 and str(hostile / name) in str(e.value)


def _trainer_parser():
    sys.path.insert(0, str(REPO / "sd-scripts"))
    import train_network

    return train_network.setup_parser()


@pytest.mark.parametrize("name", sorted(HOSTILE) + ["many_keys.toml"])
def test_the_trainers_readers_give_one_line(hostile, name):
    from library import config_util, datasets, train_util

    path = hostile / name
    parser = _trainer_parser()
    message, seconds = _refused(train_util.ConfigError, lambda: train_util.load_config_file(path, parser))
    assert seconds < 10 and len(message.splitlines()) == 1 and str(path) in message, message[:500]
    if name == "many_keys.toml":
        assert message.endswith(f"... and {MANY_KEYS - 20} more") and len(message) < 2000
    if name != "headers.toml":  # a dataset config's tables are its own
        message, seconds = _refused(datasets.DatasetError, lambda: config_util.load_dataset_config(str(path)))
        lines = message.splitlines()  # one line; many bad keys: a short list
        assert len(lines) <= 25 and str(path) in lines[0] and seconds < 10, lines[:3]


def test_the_nesting_scan_skips_strings_and_comments():
    from library import input_files

    text = 'a = [[1, 2], [3]]\nb = "[[[[\\"[["\nc = \'{{{{\'\n# [[[[[[[[\n[x.y]\nd = {e = {f = 1}}\n[[datasets.subsets]]\n'
    assert input_files.nesting_depth(text) == 2
    assert input_files.nesting_depth("x = " + "[" * 70 + "]" * 70) == input_files.MAX_DEPTH + 1  # stops counting


@pytest.mark.slow
@pytest.mark.parametrize("name", ["binary.toml", "arrays.toml", "headers.toml", "many_keys.toml"])
def test_the_trainer_script_exits_2_with_one_line(hostile, name):
    proc = subprocess.run([sys.executable, "sd-scripts/train_network.py", "--config_file", str(hostile / name)],
                          cwd=REPO, capture_output=True, text=True, timeout=500)  # a busy 2-core CI machine
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and len(errors[0]) < 2000

"""A newcomer's first hour (issue 31): where the GUI keeps its files and how to move them (--config_dir), and what
README tells before the first command: the two commands' duration, the optional extras, the import command, the
quick test run."""
from __future__ import annotations

import re

from kohya_gui import REPO, last_settings

README = (REPO / "README.md").read_text(encoding="utf-8")


def test_config_dir_moves_the_last_settings_and_the_queue(tmp_path, monkeypatch):
    import gui

    from kohya_gui.run_queue import RunQueue

    monkeypatch.setenv(last_settings.CONFIG_DIR_ENV, "")  # restored after the test
    gui.parse_args(["--config_dir", str(tmp_path / "mine")])
    assert last_settings.folder() == tmp_path / "mine"
    assert last_settings.path("lora") == tmp_path / "mine" / "last_lora.toml"
    assert RunQueue().folder == tmp_path / "mine" / "queue"


def test_readme_tells_what_the_two_commands_do_and_how_long_they_take():
    assert "--config_dir" in README and "~/.config/kohya_gui" in README
    assert "pip install -e '.[extras]'" in README and "bitsandbytes" in README
    assert "python -m kohya_gui import" in README and "python -m kohya_gui import --help" in README
    assert len(re.findall(r"\d+(\.\d+)? minutes", README)) >= 2  # how long the first run and the suite take
    assert "chromium" in README and "apt-get" in README and "../shared" in README
    assert '-m "not slow and not browser"' in README


def _run_test_sh(tmp_path, *args, entry="test.sh"):
    """test.sh (or .ci/run) in a copy of the checkout's two scripts, with setup.sh and .venv's python stand-ins
    that record what they were called with: the arguments pytest gets."""
    import os
    import shutil
    import subprocess

    (tmp_path / ".ci").mkdir(exist_ok=True)
    for name in ("test.sh", ".ci/run"):
        shutil.copy2(REPO / name, tmp_path / name)
    (tmp_path / "setup.sh").write_text("#!/usr/bin/env bash\necho \"setup $*\" >> calls\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    (tmp_path / ".venv" / "bin" / "python").write_text(
        "#!/usr/bin/env bash\nfor a in \"$@\"; do echo \"$a\"; done > pytest_args\n")
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin" / "chromium").write_text("")  # found: test.sh never calls apt-get here
    for f in ("setup.sh", ".venv/bin/python", "bin/chromium"):
        os.chmod(tmp_path / f, 0o755)
    subprocess.run(["bash", str(tmp_path / entry), *args], check=True, cwd=tmp_path, timeout=60,
                   env={**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
    assert (tmp_path / "calls").read_text() == "setup --test\n"
    (tmp_path / "calls").unlink()
    return (tmp_path / "pytest_args").read_text().splitlines()


def test_test_sh_is_quick_by_default_and_all_runs_everything(tmp_path):
    quick = ["-m", "pytest", "-q", "-m", "not slow and not browser"]
    assert _run_test_sh(tmp_path) == quick
    assert _run_test_sh(tmp_path, "tests/test_files.py", "-x") == quick + ["tests/test_files.py", "-x"]
    assert _run_test_sh(tmp_path, "-m", "browser") == quick + ["-m", "browser"]  # pytest: the last -m counts
    assert _run_test_sh(tmp_path, "--all") == ["-m", "pytest", "-q"]
    assert _run_test_sh(tmp_path, "--all", "-x") == ["-m", "pytest", "-q", "-x"]
    assert _run_test_sh(tmp_path, entry=".ci/run") == ["-m", "pytest", "-q"]  # CI is the whole suite

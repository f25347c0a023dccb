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

"""Each tab's last used settings, kept in the user's config folder so that a browser refresh and a GUI restart
reopen the tab as it was: `$XDG_CONFIG_HOME/kohya_gui/last_<tab>.toml` (`~/.config/...` without XDG_CONFIG_HOME;
`%APPDATA%\\kohya_gui` on Windows; `gui.py --config_dir DIR` uses DIR instead). The file is an ordinary
configuration file (config_file's format, so Open reads it too); its first line, a comment, keeps the path that
was in the tab's "Configuration file" box.

Nothing here raises: a file that cannot be written is logged, a file that cannot be read gives a note and the
caller falls back to the preset."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from . import config_file

logger = logging.getLogger(__name__)

_HEADER = "# kohya_gui: last used settings of the {tab} tab; configuration file box: {path}\n"
_HEADER_PATH = re.compile(r"^# kohya_gui: .*; configuration file box: (.*)$")


CONFIG_DIR_ENV = "KOHYA_GUI_CONFIG_DIR"  # gui.py --config_dir sets it: another folder for these files


def folder() -> Path:
    """The folder of the last used settings and the run queue. It belongs to the user account: people sharing an
    account share these files, unless each starts the GUI with its own --config_dir."""
    if os.environ.get(CONFIG_DIR_ENV):
        return Path(os.environ[CONFIG_DIR_ENV])
    if os.name == "nt" and os.environ.get("APPDATA"):
        return Path(os.environ["APPDATA"]) / "kohya_gui"
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kohya_gui"


def path(tab: str) -> Path:
    return folder() / f"last_{tab}.toml"


def save(tab: str, family: str, values: dict[str, Any], config_path: str | None = None) -> bool:
    """Writes the tab's settings; False (and a log line) when they cannot be written."""
    target = path(tab)
    try:
        text = config_file.to_toml(tab, family, values)
        config_file.write_text_atomic(target, _HEADER.format(tab=tab, path=json.dumps(config_path or "")) + text)
    except (OSError, ValueError) as e:
        logger.warning("cannot keep the last settings in %s: %s", target, e)
        return False
    return True


def load(tab: str) -> tuple[config_file.Config | None, str | None, str | None]:
    """(settings, configuration file box, note). (None, None, None) when nothing was kept yet; (None, None, note)
    when the file cannot be used: the note says so and that the preset is shown instead."""
    source = path(tab)
    try:
        text = source.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, None, None
    except (OSError, UnicodeDecodeError) as e:
        return None, None, _unusable(source, f"cannot read it: {e}")
    try:
        cfg = config_file.parse(text, str(source), tab)
    except config_file.ConfigError as e:
        return None, None, _unusable(source, str(e))
    config_path = None
    if m := _HEADER_PATH.match(text.split("\n", 1)[0]):
        try:
            config_path = json.loads(m.group(1)) or None
        except ValueError:
            pass
    return cfg, config_path if isinstance(config_path, str) else None, None


def _unusable(source: Path, why: str) -> str:
    first = why.split("\n")[0]
    logger.warning("last settings %s not used: %s", source, why)
    return f"The last used settings ({source}) could not be used, so the preset is shown: {first}"

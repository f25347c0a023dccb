"""Console logging options (kohya-ss/sd-scripts `library/utils.py` names): `--console_log_level`,
`--console_log_file`, `--console_log_simple`.

Our default console log is one plain line per record on stdout (`time LEVEL logger: message`); upstream uses rich
on stderr when it is installed. The options mean what they mean upstream:

- `--console_log_level`: the root logger's level (default INFO);
- `--console_log_file PATH`: the log goes to this file (truncated first) instead of the console;
- `--console_log_simple`: the message alone, nothing around it.

The progress line and the tqdm bar are not log records: they stay on the console either way.
"""
from __future__ import annotations

import argparse
import logging
import sys

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
DEFAULT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SIMPLE_FORMAT = "%(message)s"

# marks the handler this module installed, so that reconfiguring replaces it and nothing else (a test
# runner's capture handlers on the root logger are left alone)
_OURS = "_sd_scripts_console"


def add_console_log_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--console_log_level", type=str, default=None, choices=LOG_LEVELS,
                        help="level of the console log (default INFO)")
    parser.add_argument("--console_log_file", type=str, default=None,
                        help="write the log to this file (replaced) instead of the console")
    parser.add_argument("--console_log_simple", action="store_true",
                        help="log the messages alone, without time, level and logger name")


def _install(handler: logging.Handler, fmt: str, level: int) -> None:
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)
        old.close()
    handler.setFormatter(logging.Formatter(fmt, datefmt="%Y-%m-%d %H:%M:%S"))
    setattr(handler, _OURS, True)
    root.addHandler(handler)
    root.setLevel(level)


def setup_logging(level: int = logging.INFO) -> None:
    """The default console log (stdout); does nothing when the root logger already has handlers."""
    if not logging.getLogger().handlers:
        _install(logging.StreamHandler(sys.stdout), DEFAULT_FORMAT, level)


def apply_console_log_args(args) -> None:
    """Applies the --console_log_* options of a parsed run (none given: the log stays as it is)."""
    level_name = getattr(args, "console_log_level", None)
    path = getattr(args, "console_log_file", None) or None  # "" (a GUI's empty field) = not given
    simple = bool(getattr(args, "console_log_simple", False))
    if level_name is None and path is None and not simple:
        return
    level = getattr(logging, level_name or "INFO")
    fmt = SIMPLE_FORMAT if simple else DEFAULT_FORMAT
    if path is None and not simple:
        logging.getLogger().setLevel(level)  # only the level changes
        return
    try:
        handler = logging.FileHandler(path, mode="w", encoding="utf-8") if path else logging.StreamHandler(sys.stdout)
    except OSError as e:
        from library.errors import ConfigError

        raise ConfigError(f"--console_log_file {path}: cannot write it ({e.strerror or e})") from e
    _install(handler, fmt, level)

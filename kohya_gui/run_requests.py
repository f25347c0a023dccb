"""Save now, Sample now and Stop for a running trainer, from the GUI or `python -m kohya_gui signal`: a word
appended to `<output_dir>/.train_requests`, which the trainer reads at its next step boundary (the file and the
words are sd-scripts/library/run_requests.py's; both sides are tested together). A file works the same on
Windows, where SIGTERM cannot reach a process."""

from __future__ import annotations

import tomllib
from pathlib import Path

FILE_NAME = ".train_requests"
REQUESTS = ("save", "sample", "stop")


class RequestError(ValueError):
    """A request that cannot be sent; the message says why."""


def output_dir_of(target: str | Path) -> Path:
    """The output folder named by `target`: the folder itself, or the output_dir of a run TOML (any table)."""
    target = Path(target)
    if target.is_dir():
        return target
    if not target.is_file():
        raise RequestError(f"{target}: no such folder or file (give the run's output folder or its TOML)")
    from .config_file import ConfigError, read_text

    try:
        data = tomllib.loads(read_text(target))
    except ConfigError as e:  # huge, binary, not UTF-8
        raise RequestError(str(e)) from None
    except (ValueError, RecursionError) as e:  # not TOML (TOMLDecodeError is a ValueError), nested too deeply
        raise RequestError(f"{target}: cannot read it as TOML: {str(e).split(';')[0] or 'nested too deeply'}") \
            from None
    found = [v for v in (data, *(t for t in data.values() if isinstance(t, dict)))
             if isinstance(v.get("output_dir"), str)]
    if not found:
        raise RequestError(f"{target}: no output_dir in it")
    out = Path(found[0]["output_dir"])
    if not out.is_absolute():
        out = target.parent / out if not out.exists() else out
    if not out.is_dir():
        raise RequestError(f"{target}: its output_dir {out} does not exist (has the run started?)")
    return out


def send(request: str, target: str | Path) -> Path:
    """Appends the request for the run writing into `target` (a folder or a run TOML); returns the file."""
    if request not in REQUESTS:
        raise RequestError(f"request: {request!r} is not one of the allowed values: {', '.join(REQUESTS)}")
    path = output_dir_of(target) / FILE_NAME
    with open(path, "a", encoding="utf-8") as f:  # appends are whole lines: requests sent together all arrive
        f.write(request + "\n")
    return path

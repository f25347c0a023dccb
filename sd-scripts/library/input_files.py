"""Reading the user's TOML / JSON files (config, dataset config, sample prompts) so that any file, however
hostile, gives one line and no traceback, within a moment:

- more than MAX_BYTES: refused before it is read;
- binary, UTF-16/32 or otherwise not UTF-8: "not a UTF-8 text file";
- arrays, tables or table headers nested more than MAX_DEPTH deep: refused before parsing (tomllib and json
  recurse, and so do the readers after them), by one pass over the text that skips strings and comments;
- a number the parser refuses (a 5000-digit integer: Python's int limit) or any other parse error: the parser's
  message in one line.

`capped(problems)` keeps a list of per-key problems short (the first MAX_PROBLEMS and a count); callers stop
working out suggestions ("did you mean ...") once that many are found, so 360,000 unknown keys take a moment.
"""
from __future__ import annotations

import json
import os
import re
import tomllib
from typing import Any

MAX_BYTES = 8 * 1024 * 1024
MAX_DEPTH = 64
MAX_PROBLEMS = 20


class InputFileError(ValueError):
    """A file that cannot be read as what it should be; the message names it (callers wrap it in their error)."""


def read_text(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        if size > MAX_BYTES:
            raise InputFileError(f"{path}: {size / 2**20:.1f} MiB is too large for a settings file "
                                 f"(at most {MAX_BYTES // 2**20} MiB)")
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise InputFileError(f"{path}: cannot read it: {e.strerror or e}") from None
    if data[:2] in (b"\xff\xfe", b"\xfe\xff") or b"\x00" in data:
        raise InputFileError(f"{path}: not a UTF-8 text file (binary, or UTF-16: save it as UTF-8)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputFileError(f"{path}: not a UTF-8 text file (byte {e.start}: {data[e.start:e.start + 1]!r}); "
                             "save it as UTF-8") from None


_INTERESTING = re.compile(r"[\"'#\[\]{}]")


def nesting_depth(text: str, limit: int = MAX_DEPTH) -> int:
    """How deep [ and { nest in TOML or JSON text (strings and # comments skipped), counting a table header's
    dotted parts as levels; stops counting past `limit`."""
    depth = deepest = 0
    i, n = 0, len(text)
    while deepest <= limit:
        m = _INTERESTING.search(text, i)
        if m is None:
            break
        i, c = m.start(), m.group()
        if c in "\"'":
            quote = c * 3 if text.startswith(c * 3, i) else c
            end = text.find(quote, i + len(quote))
            while end != -1 and c == '"' and _escaped(text, end):
                end = text.find(quote, end + 1)
            i = n if end == -1 else end + len(quote)
        elif c == "#":
            end = text.find("\n", i)
            i = n if end == -1 else end
        elif c == "[" and depth == 0 and not text[text.rfind("\n", 0, i) + 1:i].strip():
            end = text.find("]", i)  # a table header: [a.b.c] is three levels
            deepest = max(deepest, text[i:n if end == -1 else end].count(".") + 1)
            i = n if end == -1 else end + 1
        else:
            depth = depth + 1 if c in "[{" else max(0, depth - 1)
            deepest = max(deepest, depth)
            i += 1
    return deepest


def _escaped(text: str, pos: int) -> bool:
    backslashes = 0
    while pos - backslashes - 1 >= 0 and text[pos - backslashes - 1] == "\\":
        backslashes += 1
    return backslashes % 2 == 1


def load_toml(path: str | os.PathLike) -> dict[str, Any]:
    return _load(path, "TOML", tomllib.loads)


def load_json(path: str | os.PathLike) -> Any:
    return _load(path, "JSON", json.loads)


def _load(path: str | os.PathLike, kind: str, parse) -> Any:
    path = os.fspath(path)
    text = read_text(path)
    if nesting_depth(text) > MAX_DEPTH:
        raise InputFileError(f"{path}: arrays or tables nested more than {MAX_DEPTH} levels deep; "
                             "a settings file needs a few")
    try:
        return parse(text)
    except (ValueError, RecursionError) as e:  # the parser's error; an integer over Python's 4300-digit limit
        first = (str(e).splitlines() or [type(e).__name__])[0].split(";")[0]
        raise InputFileError(f"{path}: not valid {kind}: {first}") from None


def capped(problems: list[str]) -> list[str]:
    if len(problems) <= MAX_PROBLEMS:
        return problems
    return problems[:MAX_PROBLEMS] + [f"... and {len(problems) - MAX_PROBLEMS} more"]

"""An argv list as text to paste into a shell: POSIX shells (`shlex.join`) or Windows cmd.exe / PowerShell.

The Windows form quotes as `subprocess.list2cmdline` does (the Microsoft C runtime rules every Python and
accelerate.exe parse their command line with: backslashes are literal except before a double quote, a `"` inside
a quoted argument is `\\"`, backslashes before the closing quote are doubled), and it also quotes an argument that
holds a character cmd.exe or PowerShell would act on outside quotes (`& | < > ^ ( ) % ! ; , ' { } @ $ # backquote`),
which list2cmdline leaves bare. Inside double quotes cmd.exe still expands `%NAME%` and PowerShell `$name` and
backquotes; Windows paths rarely hold them, and no quoting serves both shells there.
"""
from __future__ import annotations

import os
import re
import shlex

SHELLS = ("posix", "windows")
SHELL_LABELS = {"posix": "POSIX shell (bash, zsh, WSL)", "windows": "Windows (cmd, PowerShell)"}
_WINDOWS_BARE = re.compile(r"""[\s"&|<>^()%!;,'{}@$#`]""")


def native_shell() -> str:
    return "windows" if os.name == "nt" else "posix"


def other_shell(shell: str) -> str:
    return "posix" if shell == "windows" else "windows"


def windows_quote(arg: str) -> str:
    if arg and not _WINDOWS_BARE.search(arg):
        return arg
    out, backslashes = ['"'], 0
    for ch in arg:
        if ch == "\\":
            backslashes += 1
            continue
        # backslashes are doubled only before a quote: the one inside (then escaped) or the closing one
        out.append("\\" * (2 * backslashes + 1) + ch if ch == '"' else "\\" * backslashes + ch)
        backslashes = 0
    out.append("\\" * (2 * backslashes) + '"')
    return "".join(out)


def join(argv: list[str], shell: str | None = None) -> str:
    """The command for `shell` ("posix" or "windows"; None: the one of this machine)."""
    shell = shell or native_shell()
    if shell not in SHELLS:
        raise ValueError(f"shell must be one of {', '.join(SHELLS)}; got {shell!r}")
    if shell == "posix":
        return shlex.join(argv)
    return " ".join(windows_quote(a) for a in argv)

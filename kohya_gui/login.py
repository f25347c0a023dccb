"""The GUI's password: where it comes from, and a login check that slows down repeated wrong guesses.

A password on the command line shows in `ps` to every user of the machine, so it can also come from the
environment (KOHYA_GUI_PASSWORD) or the first line of a file (--password_file). Gradio calls `Login` with each
attempt; after a wrong one the next answer for that user name comes later and later (0.5 s, 1 s, 2 s ... 30 s), so
guessing is slow, and a right one resets it.
"""

from __future__ import annotations

import hmac
import os
import threading
import time
from pathlib import Path

PASSWORD_ENV = "KOHYA_GUI_PASSWORD"
MAX_DELAY_S = 30.0


class PasswordError(ValueError):
    """A password source that cannot be used; the message names it."""


def password_from(cli_password: str, password_file: str | None, environ=os.environ) -> str:
    """--password, else --password_file's first line, else $KOHYA_GUI_PASSWORD, else "" (no password)."""
    if cli_password and password_file:
        raise PasswordError("give --password or --password_file, not both")
    if password_file:
        try:
            lines = Path(password_file).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise PasswordError(f"--password_file {password_file}: cannot read it ({e.strerror or e})") from e
        if not lines or not lines[0].strip():
            raise PasswordError(f"--password_file {password_file}: the first line is empty")
        return lines[0].strip()
    return cli_password or environ.get(PASSWORD_ENV, "")


def delay_after(failures: int) -> float:
    return min(0.5 * 2 ** (failures - 1), MAX_DELAY_S) if failures > 0 else 0.0


class Login:
    """Gradio's `auth` callable: (username, password) -> bool, compared in constant time."""

    def __init__(self, username: str, password: str, sleep=time.sleep):
        self.username, self.password = username, password
        self.sleep = sleep
        self.failures: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, username: str, password: str) -> bool:
        ok = hmac.compare_digest(username.encode(), self.username.encode()) & \
            hmac.compare_digest(password.encode(), self.password.encode())
        with self._lock:
            if ok:
                self.failures.pop(username, None)
                return True
            n = self.failures[username] = self.failures.get(username, 0) + 1
        self.sleep(delay_after(n))
        return False

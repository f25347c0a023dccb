"""The GUI's password: where it comes from, and a login check that slows down repeated wrong guesses.

A password on the command line shows in `ps` to every user of the machine, so it can also come from the
environment (KOHYA_GUI_PASSWORD) or the first line of a file (--password_file).

Wrong guesses: after the n-th wrong password from one client (its address and the user name it tried), that client
waits 0.5 s, 1 s, 2 s ... 30 s before its next try counts: a try inside the wait is answered at once with "try again
in N s" (HTTP 429) and its password is not even compared. Nothing sleeps: the server answers every other request,
and every other client's login, as fast as ever. A right password resets the client's count.
Gradio hands the check only (username, password), so `ClientAddress` (an ASGI middleware given to the app) notes the
address of the request being served in a context variable.
"""

from __future__ import annotations

import contextvars
import hmac
import math
import os
import threading
import time
from pathlib import Path

PASSWORD_ENV = "KOHYA_GUI_PASSWORD"
MAX_DELAY_S = 30.0
MAX_CLIENTS = 10_000  # remembered clients; beyond this, those idle for FORGET_AFTER_S, then the oldest, are forgotten
FORGET_AFTER_S = 3600.0  # a client's count is forgotten an hour after its last wrong try

_client_address: contextvars.ContextVar[str] = contextvars.ContextVar("client_address", default="?")


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
        except UnicodeDecodeError:
            raise PasswordError(f"--password_file {password_file}: not a UTF-8 text file") from None
        if not lines or not lines[0].strip():
            raise PasswordError(f"--password_file {password_file}: the first line is empty")
        return lines[0].strip()
    return cli_password or environ.get(PASSWORD_ENV, "")


def delay_after(failures: int) -> float:
    return min(0.5 * 2 ** (failures - 1), MAX_DELAY_S) if failures > 0 else 0.0


class TooSoon(Exception):
    """A try inside the client's wait; `seconds` = how long is left."""

    def __init__(self, seconds: float):
        super().__init__(f"Too many wrong passwords: try again in {math.ceil(seconds)} s.")
        self.seconds = seconds


class ClientAddress:
    """ASGI middleware: notes each request's client address for `Login` (app_kwargs={"middleware": [...]})."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        client = scope.get("client") if scope.get("type") in ("http", "websocket") else None
        token = _client_address.set(str(client[0]) if client else "?")
        try:
            await self.app(scope, receive, send)
        finally:
            _client_address.reset(token)


class Login:
    """Gradio's `auth`: pass `Login(user, password).check` (a coroutine function, which gradio awaits).
    Passwords are compared in constant time."""

    def __init__(self, username: str, password: str, clock=time.monotonic):
        self.username, self.password = username, password
        self.clock = clock
        self._clients: dict[tuple[str, str], tuple[int, float]] = {}  # (address, user) -> (failures, wait ends)
        self._lock = threading.Lock()

    def attempt(self, username: str, password: str, address: str = "?") -> bool:
        """True for the right user and password. Raises TooSoon inside this client's wait; never sleeps."""
        key, now = (address, username), self.clock()
        with self._lock:
            failures, until = self._clients.get(key, (0, 0.0))
            if now < until:
                raise TooSoon(until - now)
            ok = hmac.compare_digest(username.encode(), self.username.encode()) & \
                hmac.compare_digest(password.encode(), self.password.encode())
            if ok:
                self._clients.pop(key, None)
                return True
            self._clients[key] = (failures + 1, now + delay_after(failures + 1))
            if len(self._clients) > MAX_CLIENTS:
                self._forget(now)
            return False

    def _forget(self, now: float) -> None:
        for key, (_, until) in list(self._clients.items()):
            if now - until > FORGET_AFTER_S:
                del self._clients[key]
        for key in list(self._clients)[:max(0, len(self._clients) - MAX_CLIENTS)]:  # the oldest first
            del self._clients[key]

    async def check(self, username: str, password: str) -> bool:
        """The `auth` callable: TooSoon becomes HTTP 429 with its message."""
        try:
            return self.attempt(username, password, _client_address.get())
        except TooSoon as e:
            from fastapi import HTTPException

            raise HTTPException(status_code=429, detail=str(e), headers={"Retry-After": str(math.ceil(e.seconds))})

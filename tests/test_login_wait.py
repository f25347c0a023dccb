"""Issue 26 item 1: a wrong password delays only the client that sent it (its address and user name); the server
answers everyone else, and that client's other requests, at once (no sleep in gradio's async login)."""
from __future__ import annotations

import concurrent.futures
import http.client
import inspect
import socket
import time
import urllib.parse

import gradio as gr
import pytest

import gui
from kohya_gui import login


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_client_waits_after_each_wrong_password_and_nobody_else_does():
    clock = Clock()
    check = login.Login("u", "p", clock=clock)
    assert not check.attempt("u", "x", "10.0.0.1")
    with pytest.raises(login.TooSoon, match=r"try again in 1 s"):
        check.attempt("u", "p", "10.0.0.1")  # inside the wait even the right password is not compared
    assert check.attempt("u", "p", "10.0.0.2")  # another address logs in at once
    clock.t += 0.5
    assert not check.attempt("u", "y", "10.0.0.1")
    with pytest.raises(login.TooSoon) as e:
        check.attempt("u", "z", "10.0.0.1")
    assert e.value.seconds == 1.0  # 0.5 s, 1 s, 2 s ... 30 s
    for n in range(3, 12):
        clock.t += login.delay_after(n - 1)
        assert not check.attempt("u", "w", "10.0.0.1")
    assert login.delay_after(11) == login.MAX_DELAY_S
    clock.t += login.MAX_DELAY_S
    assert check.attempt("u", "p", "10.0.0.1")  # right: the count starts again
    assert not check.attempt("u", "x", "10.0.0.1")
    assert check._clients[("10.0.0.1", "u")][1] == clock.t + 0.5


def test_the_clients_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(login, "MAX_CLIENTS", 50)
    check = login.Login("u", "p", clock=Clock())
    for i in range(200):
        check.attempt(f"user{i}", "x", "10.0.0.9")
    assert len(check._clients) <= 51
    assert ("10.0.0.9", "user199") in check._clients  # the newest are kept


def test_gradio_awaits_the_check():
    kwargs = gui.login_kwargs("u", "p")
    assert inspect.iscoroutinefunction(kwargs["auth"])  # a plain callable returning a coroutine would let all in
    assert gui.login_kwargs("", "") == {}


def _post_login(port: int, user: str, password: str, source: str) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    body = urllib.parse.urlencode({"username": user, "password": password})
    conn.request("POST", "/login", body, {"Content-Type": "application/x-www-form-urlencoded"})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    return r.status, text, time.perf_counter() - t0


def _get(port: int, path: str, source: str = "127.0.0.1") -> tuple[int, float]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60, source_address=(source, 0))
    conn.request("GET", path)
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status, time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wrong_logins_freeze_nothing_for_anyone_else():
    """A guesser deep in its wait sends 6 wrong logins at once; meanwhile a page request, the guesser's own
    unauthenticated request and another client's right login are timed."""
    kwargs = gui.login_kwargs("u", "right")
    check = kwargs["auth"].__self__
    with gr.Blocks() as app:
        gr.Markdown("hello")
    port = _free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **kwargs)
    try:
        status, text, _ = _post_login(port, "u", "wrong", "127.0.0.1")
        assert status == 400 and "Incorrect" in text
        assert ("127.0.0.1", "u") in check._clients  # the client address reached the check
        check._clients[("127.0.0.1", "u")] = (6, time.monotonic() + 30)  # the 7th try's 30 s wait
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            guesses = [pool.submit(_post_login, port, "u", f"guess{i}", "127.0.0.1") for i in range(6)]
            time.sleep(0.05)
            page = pool.submit(_get, port, "/robots.txt")
            other = pool.submit(_post_login, port, "u", "right", "127.0.0.2")
            results = [g.result() for g in guesses]
            other_status, _, other_s = other.result()
            page_status, page_s = page.result()
        for status, text, seconds in results:
            assert status == 429 and "try again in" in text and seconds < 3, (status, text, seconds)
        assert other_status == 200 and other_s < 3, other_s
        assert page_status in (200, 404) and page_s < 3, page_s
        assert check._clients[("127.0.0.1", "u")][0] == 6  # tries inside the wait do not count as guesses
    finally:
        app.close()

"""The run panel's notes that the Start button's handler (actions) and the feedback layer (feedback) share: the
settings file of the run (`settings_html`), and after a Start click that did not start a run the previous run's
result is hidden (`NOTICE`), so that an old failure is not read as the answer."""

from __future__ import annotations

import html
import threading


class StartNotice:
    """Remembers that a Start click did not start a run while none was running: the run panel then hides the
    previous run's result (it would read as the answer to the click). A new run ends it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.version = 0  # added to the runner's version: the panel redraws when it changes
        self._hidden: tuple | None = None  # (started,) of the run whose result is hidden

    def start_failed(self, snapshot) -> None:
        if snapshot.running:  # the click failed because of the run: keep showing it
            return
        with self._lock:
            self._hidden = (snapshot.started,)
            self.version += 1

    def hides(self, snapshot) -> bool:
        with self._lock:
            return not snapshot.running and self._hidden == (snapshot.started,)


NOTICE = StartNotice()


def not_started_html() -> str:
    return ("<div class='kg-progress'><span class='kg-state'>Not started.</span> "
            "<span class='kg-note'>The last Start training click did not start a run: the reason is shown next to "
            "the button. The previous run's result is hidden; its log is below.</span></div>")


def settings_html(s) -> str:
    """The settings file of the run shown in the panel."""
    if not getattr(s, "config_path", None):
        return ""
    return (f"<div class='kg-run-settings'>Settings of this run: <code>{html.escape(s.config_path)}</code>"
            "</div>")

"""The queue of runs: "Add to queue" beside Start saves the tab's settings as a TOML in the queue folder
(`<user config>/kohya_gui/queue/`, next to the last used settings), `queue.json` keeps their order and states,
and a worker thread starts the first queued entry whenever the runner is idle, with Start's own checks
(training.start). The queue is on disk, so a GUI restart shows it and goes on; a run the GUI was running when it
ended is marked interrupted. A failed run does not stop the queue unless "Stop the queue when a run fails" is on.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from . import command, config_file, last_settings, tools, training
from . import params as P
from .runner import Runner, RunnerBusy

logger = logging.getLogger(__name__)

STATES = ("queued", "running", "finished", "failed", "stopped", "interrupted")


class QueueError(ValueError):
    """A queue change that cannot be made; the message says why."""


@dataclass
class Entry:
    id: str
    tab: str
    family: str
    name: str  # the output name, to tell entries apart
    config: str  # the entry's settings file
    state: str = "queued"
    message: str = ""


class RunQueue:
    def __init__(self, folder: str | Path | None = None):
        self.folder = Path(folder) if folder is not None else last_settings.folder() / "queue"
        self.path = self.folder / "queue.json"
        self._lock = threading.RLock()
        self.version = 0  # bumped on every change (the page redraws the list only then)
        self.entries: list[Entry] = []
        self.stop_on_failure = False
        self.paused = False  # "Run the queue" unticked: entries wait (Stop ends one run; the queue goes on)
        self._load()

    # -- on disk --------------------------------------------------------------------------------------------
    def _load(self) -> None:
        if not self.path.is_file():
            return
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            self.entries = [Entry(**e) for e in data.get("entries", [])]
            self.stop_on_failure = bool(data.get("stop_on_failure", False))
            self.paused = bool(data.get("paused", False))
        except (OSError, ValueError, TypeError) as e:
            logger.warning("%s cannot be read (%s); the queue starts empty", self.path, e)
            self.entries = []

    def _write(self) -> None:
        self.version += 1
        data = {"stop_on_failure": self.stop_on_failure, "paused": self.paused,
                "entries": [asdict(e) for e in self.entries]}
        config_file.write_text_atomic(self.path, json.dumps(data, indent=1) + "\n")

    # -- changes --------------------------------------------------------------------------------------------
    def add(self, tab: str, family: str, values: dict[str, Any]) -> Entry:
        """Queues these settings (checked as Start checks them before anything runs). Raises QueueError."""
        errors = command.validation_errors(tab, family, values)
        if errors:
            raise QueueError("Cannot queue this run:\n" + "\n".join(f"- {e}" for e in errors))
        return self._append(tab, family, values.get("output_name") or "", ".toml",
                            lambda config: config_file.save(config, tab, family, values))

    def add_tool(self, tool: tools.Tool, values: dict[str, Any], overwrite: bool = False) -> Entry:
        """Queues a Utilities tool run (checked as its Run button checks it). Raises tools.ToolError."""
        tools.check(tool, values, overwrite)
        return self._append(tools.QUEUE_TAB, tool.label, tool.key, ".tool.json",
                            lambda config: tools.save_queued(config, tool, values, overwrite))

    def _append(self, tab: str, family: str, name: str, suffix: str, write: Callable[[Path], Any]) -> Entry:
        with self._lock:
            entry_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            config = self.folder / f"{entry_id}{suffix}"
            write(config)
            entry = Entry(entry_id, tab, family, name, str(config))
            self.entries.append(entry)
            self._write()
            return entry

    def _find(self, entry_id: str) -> Entry:
        for e in self.entries:
            if e.id == entry_id:
                return e
        raise QueueError(f"queue entry {entry_id!r} is not in the queue (choose one from the list)")

    def move(self, entry_id: str, delta: int) -> None:
        with self._lock:
            entry = self._find(entry_id)
            i = self.entries.index(entry)
            j = max(0, min(len(self.entries) - 1, i + delta))
            self.entries.insert(j, self.entries.pop(i))
            self._write()

    def remove(self, entry_id: str) -> None:
        with self._lock:
            entry = self._find(entry_id)
            if entry.state == "running":
                raise QueueError(f"{entry.name or entry.id} is running: stop it first")
            self.entries.remove(entry)
            Path(entry.config).unlink(missing_ok=True)
            self._write()

    def set_options(self, *, run: bool, stop_on_failure: bool) -> None:
        with self._lock:
            self.paused, self.stop_on_failure = not run, bool(stop_on_failure)
            self._write()

    def mark(self, entry_id: str, state: str, message: str = "") -> None:
        assert state in STATES
        with self._lock:
            entry = self._find(entry_id)
            entry.state, entry.message = state, message
            self._write()

    def recover(self, still_running: bool = False) -> Entry | None:
        """At GUI start: a run the previous GUI was running ended with it, unless it is `still_running` (the
        runner took it over): then that entry stays running and is returned."""
        with self._lock:
            kept = None
            for e in self.entries:
                if e.state == "running" and still_running and kept is None:
                    kept = e
                elif e.state == "running":
                    e.state, e.message = "interrupted", "the GUI ended during this run"
            self._write()
            return kept

    # -- reading --------------------------------------------------------------------------------------------
    def next_queued(self) -> Entry | None:
        """The entry to run next; None while nothing is queued, the queue is paused or it stopped on a failed
        run."""
        with self._lock:
            if self.paused or self.stop_on_failure and any(e.state == "failed" for e in self.entries):
                return None
            return next((e for e in self.entries if e.state == "queued"), None)

    def snapshot(self) -> tuple[int, list[Entry]]:
        with self._lock:
            return self.version, [Entry(**asdict(e)) for e in self.entries]


class QueueWorker:
    """Starts the queue's next entry whenever the runner is idle; notes how each run ended."""

    def __init__(self, queue: RunQueue, runner: Runner, poll_s: float = 1.0,
                 start: Callable[..., Any] = training.start):
        self.queue, self.runner, self.poll_s, self._start = queue, runner, poll_s, start
        self._current: tuple[str, float | None] | None = None  # (entry id, its run's start time)
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "QueueWorker":
        s = self.runner.snapshot()
        kept = self.queue.recover(still_running=s.running)  # a run an earlier GUI started, taken over
        if kept is not None:
            self._current = (kept.id, s.started)  # noted as finished / stopped / failed when it ends
        self._thread = threading.Thread(target=self._loop, name="run-queue", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._halt.is_set():
            try:
                self.step()
            except Exception:  # noqa: BLE001 - the worker must outlive a bad entry; the log says what happened
                logger.exception("run queue")
            self._halt.wait(self.poll_s)

    def step(self) -> None:
        """One look: note a finished run, else start the next queued entry if the runner is idle."""
        s = self.runner.snapshot()
        if self._current is not None:
            entry_id, started = self._current
            if s.running and s.started == started:
                return
            self._current = None
            state = "finished" if s.returncode == 0 and not s.stopped else "stopped" if s.stopped else "failed"
            self.queue.mark(entry_id, state, s.message)
        if s.running:
            return
        entry = self.queue.next_queued()
        if entry is None:
            return
        try:
            if entry.tab == tools.QUEUE_TAB:  # a Utilities tool
                tools.start_queued(self.runner, entry.config)
                what = entry.family
            else:
                cfg = config_file.load(entry.config)
                self._start(self.runner, cfg.tab, cfg.family, cfg.values)
                what = f"{P.TAB_LABELS[cfg.tab]} {cfg.family}"
        except RunnerBusy:
            return  # a Start click won the runner; try again later
        except (training.RunError, config_file.ConfigError, tools.ToolError) as e:
            self.queue.mark(entry.id, "failed", str(e))
            return
        self._current = (entry.id, self.runner.snapshot().started)
        self.queue.mark(entry.id, "running", what)

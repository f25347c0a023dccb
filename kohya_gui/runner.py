"""Runs one training at a time: spawns it in its own process group, streams its output into memory and a log
file, parses progress, and stops the whole process tree (kohya_gui.proc_tree). Stop asks the trainer to finish the
step, save and print "stopped at step N, saved <path>" (sd-scripts/library/stop_signal.py): with SIGTERM where POSIX
process groups exist; on Windows, where no process can catch SIGTERM, with "stop" in the run's request file
(kohya_gui.run_requests, read once per step). What is left of the tree is killed `grace` seconds after that line or
after `save_timeout`. Before the first progress line (nothing to save yet) a Windows stop ends the tree at once, as
SIGTERM's default action does then on POSIX. Stop now: SIGTERM (Windows: terminate), then SIGKILL after `grace`
seconds (nothing saved)."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import proc_tree, quoting, run_requests
from .run_history import NUM, RunHistory

# the trainers' last line after a stop-and-save (library.stop_signal.stopped_line)
STOPPED_LINE = re.compile(r"^stopped at step \d+, saved ")
SAVE_TIMEOUT = 600.0  # a stop waits this long for the step and the saves to finish
# the trainers' line before a step that compiles (library.compile.regional.ShapeLog); with CUDA graphs the step
# after it records them, so "compiling" lasts two steps then
COMPILE_LINE = re.compile(r"torch\.compile: new input shape (\S+) .*this step (compiles and records CUDA graphs|compiles)")

# ---- progress lines ------------------------------------------------------------------------------------------
# The trainers print plain lines such as "steps: 12/100 loss=0.1234 it/s=1.23 eta=00:40" (docs/ARCHITECTURE.md);
# tqdm-style lines ("steps:  12%|##  | 12/100 [00:05<00:40,  2.15it/s, avr_loss=0.123]") are understood too.

_STEPS = re.compile(r"(?:\bsteps?\b[^\n]*?|\d+%\|[^|\n]*\|\s*)(\d+)\s*/\s*(\d+)", re.I)  # or any tqdm bar (tools)
_LOSS = re.compile(r"\b(avr_loss|avg_loss|loss)\s*[=:]\s*" + NUM, re.I)
_ITS = re.compile(r"(?:\bit/s\s*[=:]\s*" + NUM + r")|(?:" + NUM + r"\s*it/s(?!\s*[=:]))", re.I)
_SIT = re.compile(NUM + r"\s*s/it", re.I)
_ETA = re.compile(r"(?:\beta\s*[=:]\s*|<)(\d+(?::\d{1,2}){1,2})", re.I)


def _clock_seconds(text: str) -> float:
    seconds = 0.0
    for part in text.split(":"):
        seconds = seconds * 60 + float(part)
    return seconds


def parse_progress(line: str) -> dict | None:
    """{'step', 'total', 'loss', 'its', 'eta_s'} from one progress line (missing parts None), or None."""
    m = _STEPS.search(line)
    if not m:
        return None
    out = {"step": int(m.group(1)), "total": int(m.group(2)), "loss": None, "its": None, "eta_s": None}
    losses = {k.lower(): float(v) for k, v in _LOSS.findall(line)}  # prefer the running average
    if losses:
        out["loss"] = losses.get("avr_loss", losses.get("avg_loss", losses.get("loss")))
    if im := _ITS.search(line):
        out["its"] = float(im.group(1) or im.group(2))
    elif sm := _SIT.search(line):
        value = float(sm.group(1))
        out["its"] = 1.0 / value if value > 0 else None
    if em := _ETA.search(line):
        out["eta_s"] = _clock_seconds(em.group(1))
    elif out["its"]:
        out["eta_s"] = max(out["total"] - out["step"], 0) / out["its"]
    return out


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


# ---- the runner ----------------------------------------------------------------------------------------------

ERROR_WORDS = re.compile(r"error|exception|traceback|failed|killed|refus", re.I)
OUTPUT_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".png", ".jpg", ".webp")


class RunnerBusy(RuntimeError):
    pass


@dataclass
class RunState:
    running: bool = False
    commands: list = field(default_factory=list)
    log_path: str | None = None
    output_dir: str | None = None
    started: float | None = None
    ended: float | None = None
    returncode: int | None = None
    stopped: bool = False
    progress: dict | None = None
    outputs: list = field(default_factory=list)
    error_lines: list = field(default_factory=list)
    message: str = ""  # "starting", "running", "compiling (...)", "stopping..." while running; the outcome after
    config_path: str | None = None  # the settings file of the run (what Start wrote), if any


class Runner:
    """One training at a time. Thread-safe; the GUI and the CLI share this class."""

    def __init__(self, max_lines: int = 2000):
        self._lock = threading.Lock()
        self._lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self._partial = ""  # an in-place progress line (ended by \r), shown after the lines
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._stop_requested = threading.Event()
        self._stopped_line: tuple[float, str] | None = None  # (when, text) of the trainer's "stopped at step"
        self._compiling: list | None = None  # [steps it lasts, first step or None] after a COMPILE_LINE
        self.state = RunState()
        self._reserved = False  # a Start is checking its settings and writing its files (see reserved())
        self.line_callback = None  # optional: called with every output line (the CLI echoes them)
        self.version = 0  # bumped whenever the log or the state changes (lets the page skip idle refreshes)
        self.history = RunHistory()  # the run's loss points and sample images (run panel chart and gallery)
        self.history_version = 0  # bumped when a point or a sample is added

    # -- public ---------------------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        with self._lock:
            return self.state.running

    @property
    def pid(self) -> int | None:
        """Process id of the command running now (it leads its own process group), or None."""
        with self._lock:
            return self._proc.pid if self._proc is not None else None

    @contextlib.contextmanager
    def reserved(self):
        """Holds the runner for one Start while it checks its settings and writes its files, so that of two
        simultaneous Starts the second is refused (RunnerBusy) before it touches anything, and the run that starts
        is the one whose files were written. `start` is called inside the block."""
        with self._lock:
            if self.state.running or self._reserved:
                raise RunnerBusy("A training run is already active or starting; stop it first or wait for it "
                                 "to finish.")
            self._reserved = True
        try:
            yield
        finally:
            with self._lock:
                self._reserved = False

    def start(self, commands: list[list[str]], log_path: str | os.PathLike, *, cwd=None, env=None,
              output_dir: str | os.PathLike | None = None, config_path: str | os.PathLike | None = None) -> None:
        """Runs the argv lists one after another (a failing one ends the run). `config_path`: the run's settings
        file, shown by the GUI. Raises RunnerBusy."""
        with self._lock:
            if self.state.running:
                raise RunnerBusy("A training run is already active; stop it first or wait for it to finish.")
            self._lines.clear()
            self._partial = ""
            self._stop_requested.clear()
            self._stopped_line = None
            self._compiling = None
            self.version += 1
            self.history = RunHistory()
            self.history_version += 1
            self.state = RunState(running=True, commands=[list(c) for c in commands], log_path=str(log_path),
                                  output_dir=str(output_dir) if output_dir else None, started=time.time(),
                                  message="starting", config_path=str(config_path) if config_path else None)
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, args=(commands, Path(log_path), cwd, env), daemon=True)
        self._thread.start()

    def stop(self, grace: float = 10.0, *, now: bool = False, save_timeout: float = SAVE_TIMEOUT) -> bool:
        """Stop and save: SIGTERM to the tree (without process groups: the "stop" request), then waits until the
        tree has ended, killing what is left `grace` seconds after the trainer's "stopped at step" line or after
        `save_timeout`. now=True: SIGTERM, SIGKILL after `grace` seconds (Stop now). Returns False when nothing was
        running."""
        with self._lock:
            if not self.state.running:
                return False
            self._stop_requested.set()
            proc, output_dir = self._proc, self.state.output_dir
            # without process groups only the trainer's loop reads the request file: before it nothing is to be
            # saved, and a run without an output folder has no such file
            now = now or (not proc_tree.groups() and (self.state.progress is None or not output_dir))
            self._compiling = None
            self.state.message = "stopping now" if now else "stopping: the trainer finishes its step and saves"
            self.version += 1
        if proc is not None:
            if now:
                proc_tree.end(proc, grace)
            else:
                self._stop_and_save(proc, output_dir, grace, save_timeout)
        if self._thread is not None:
            self._thread.join(timeout=grace + 10)
        return True

    def wait(self, timeout: float | None = None) -> RunState:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.snapshot()

    def snapshot(self) -> RunState:
        with self._lock:
            s = self.state
            return RunState(**{**s.__dict__, "commands": list(s.commands), "outputs": list(s.outputs),
                               "error_lines": list(s.error_lines),
                               "progress": dict(s.progress) if s.progress else None})

    def history_snapshot(self) -> tuple[int, RunHistory]:
        """(history_version, a copy of the run's points and samples)."""
        with self._lock:
            return self.history_version, RunHistory(list(self.history.points), list(self.history.samples))

    def log_tail(self, n: int = 200) -> str:
        with self._lock:
            lines = list(self._lines)[-n:]
            if self._partial:
                lines.append(self._partial)
        return "\n".join(lines)

    # -- internals ------------------------------------------------------------------------------------------
    def _stop_and_save(self, proc: subprocess.Popen, output_dir: str | None, grace: float,
                       save_timeout: float) -> None:
        # the whole tree is watched: `accelerate launch` itself dies on SIGTERM while its child saves
        tree = proc_tree.tree(proc.pid)
        if proc_tree.groups():
            # once per process: a second SIGTERM would be the trainer's "stop now" (no save)
            proc_tree.terminate(proc.pid, tree[1:], once=True)
        else:
            try:
                run_requests.send("stop", output_dir)
            except (run_requests.RequestError, OSError):
                save_timeout = 0.0  # no way to ask: what is left is ended below
        deadline = time.time() + save_timeout
        while time.time() < deadline and any(proc_tree.alive(p) for p in tree):
            seen = self._stopped_line
            if seen is not None:
                deadline = min(deadline, seen[0] + grace)
            time.sleep(0.1)
        alive = [p for p in proc_tree.grown(tree) if proc_tree.alive(p)]
        if alive:
            proc_tree.kill(proc.pid, alive)

    def _add(self, text: str, in_place: bool, log) -> None:
        text = text.rstrip()
        if not text:
            return
        prog = parse_progress(text)
        with self._lock:
            self.version += 1
            if not in_place and STOPPED_LINE.match(text):
                self._stopped_line = (time.time(), text)
            if not in_place and self.history.feed(text):
                self.history_version += 1
            if prog:
                self.state.progress = prog
            self._follow_compile(text, prog, in_place)
            if in_place:
                self._partial = text
            else:
                self._partial = ""
                self._lines.append(text)
        if log is not None and not (in_place and prog is None):
            log.write(text + "\n")
            log.flush()
        if self.line_callback is not None and not in_place:
            self.line_callback(text)

    def _follow_compile(self, text: str, prog: dict | None, in_place: bool) -> None:
        """message = "compiling (...)" from a COMPILE_LINE until the step(s) it announces are done (the progress
        line's step passes the step before it). Called under the lock."""
        m = COMPILE_LINE.search(text) if not in_place else None
        if m and self.state.running:
            before = (self.state.progress or {}).get("step")
            self._compiling = [2 if "CUDA graphs" in m.group(2) else 1, before]
            self.state.message = f"compiling (input shape {m.group(1)}; the first steps with a new shape are slow)"
        elif prog and self._compiling is not None:
            steps, before = self._compiling
            if before is None:  # no progress line before the compile: this line ends the first step
                before = self._compiling[1] = prog["step"] - 1
            if prog["step"] >= before + steps:
                self._compiling = None
                if self.state.running:
                    self.state.message = "running"

    def _run(self, commands, log_path: Path, cwd, env) -> None:
        rc = None
        with open(log_path, "a", encoding="utf-8") as log:
            for argv in commands:
                if self._stop_requested.is_set():
                    break
                self._add("$ " + quoting.join(argv), False, log)
                with self._lock:
                    self.state.message = "running"
                try:
                    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=cwd, env=env, **proc_tree.popen_kwargs())
                except OSError as e:
                    self._add(f"Could not start {argv[0]}: {e}", False, log)
                    rc = 127
                    break
                with self._lock:
                    self._proc = proc
                if self._stop_requested.is_set():  # stop() came between the check and Popen
                    proc_tree.end(proc, 5.0)
                self._pump(proc, log)
                rest = proc_tree.tree(proc.pid)[1:]  # normally none: the output ended, so did the processes
                rc = proc.wait()
                proc_tree.kill(proc.pid, rest)  # leftovers of a finished run
                with self._lock:
                    self._proc = None
                if rc != 0:
                    break
            stopped = self._stop_requested.is_set()
            with self._lock:
                st = self.state
                st.running, st.ended, st.returncode, st.stopped = False, time.time(), rc, stopped
                st.outputs = new_outputs(st.output_dir, st.started)
                if rc not in (0, None) and not stopped:
                    lines = list(self._lines)
                    lines = [ln for ln in lines if not ln.startswith("$ ")]
                    errs = [ln for ln in lines if ERROR_WORDS.search(ln)]
                    st.error_lines = (errs or lines)[-12:]
                self.version += 1
                if stopped:  # the trainer's "stopped at step N, saved ..." when it saved
                    st.message = self._stopped_line[1] if self._stopped_line else "stopped"
                else:
                    st.message = "finished" if rc == 0 else f"failed (exit status {rc})"
            log.write(f"# {st.message}\n")

    def _pump(self, proc: subprocess.Popen, log) -> None:
        buf = b""
        fd = proc.stdout.fileno()
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            while True:
                idx = [i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0]
                if not idx:
                    break
                i = min(idx)
                piece, sep, buf = buf[:i], buf[i:i + 1], buf[i + 1:]
                self._add(piece.decode("utf-8", "replace"), sep == b"\r", log)
        if buf:
            self._add(buf.decode("utf-8", "replace"), False, log)
        proc.stdout.close()


def new_outputs(output_dir: str | None, since: float | None) -> list[str]:
    """Result files written into the output folder during the run, newest last."""
    if not output_dir or since is None or not Path(output_dir).is_dir():
        return []
    found = []
    for path in Path(output_dir).rglob("*"):
        try:
            if path.is_file() and path.suffix.lower() in OUTPUT_SUFFIXES and path.stat().st_mtime >= since - 1:
                found.append((path.stat().st_mtime, str(path)))
        except OSError:
            continue
    return [p for _, p in sorted(found)][-50:]


def training_env() -> dict[str, str]:
    """The environment for a run: the venv's bin first on PATH (so "accelerate" is ours), unbuffered output."""
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    return env


def run_env() -> dict[str, str]:
    env = training_env()
    from . import REPO  # the demo helper runs `python -m kohya_gui`, also when it is not installed

    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    return env

"""Runs one training at a time: spawns it in its own process group with its output going straight into the run's
log file (never through a pipe to the GUI: a run outlives the GUI that started it), follows that file to parse
progress, and stops the whole process tree (kohya_gui.proc_tree). A runner given a `record` file (the GUI's) notes
its active run there, and a GUI started later takes over a run that is still going (`adopt`): the run panel, Stop
and Save now work on it, and Start refuses a second run meanwhile.

Stop asks the trainer to finish the step, save and print "stopped at step N, saved <path>"
(sd-scripts/library/stop_signal.py): with SIGTERM to the processes under the command the runner started (so
`accelerate launch` stays and ends with the trainer's exit status) where POSIX process groups exist; on Windows,
where no process can catch SIGTERM, with "stop" in the run's request file (kohya_gui.run_requests, read once per
step). What is left of the tree is killed `grace` seconds after that line or after `save_timeout`. Before the first
progress line (nothing to save yet) a Windows stop ends the tree at once. Stop now: kills the tree at once, nothing
saved (the log says so)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from . import compile_auto, proc_tree, quoting, run_requests
from .run_history import NUM, RunHistory

# the trainers' last line after a stop-and-save (library.stop_signal.stopped_line)
STOPPED_LINE = re.compile(r"^stopped at step \d+, saved ")
SAVE_TIMEOUT = 600.0  # a stop waits this long for the step and the saves to finish
POLL_S = 0.1  # how often the log file is read while the run writes nothing
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



# torch's launcher (accelerate launch --multi_gpu, torchrun) ends every process when one fails and reports the first
ROOT_CAUSE = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: (\d+)\)")
ROOT_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(?: \(pid: \d+\))?\s*(?:\((\w+)\))?")
ROOT_HOST = re.compile(r"^\s*host\s*:\s*(\S+)")


def root_cause(lines) -> tuple[int, str | None, str | None] | None:
    """(rank, host, exit code with its signal) of the process that ended first, from the launcher's "Root Cause"
    block, or None when the log has none."""
    lines = list(lines)  # (the runner's lines are a deque, which cannot be sliced)
    try:
        start = max(i for i, ln in enumerate(lines) if ln.startswith("Root Cause"))
    except ValueError:
        return None
    rank = host = code = None
    for ln in lines[start + 1:start + 12]:
        if (m := ROOT_CAUSE.match(ln)) and rank is None:
            rank = int(m.group(1))
        elif (m := ROOT_HOST.match(ln)) and host is None:
            host = m.group(1)
        elif (m := ROOT_EXIT.match(ln)) and code is None:
            code = m.group(1) + (f" ({m.group(2)})" if m.group(2) else "")
    return None if rank is None else (rank, host, code)


def first_failed_process(lines: list[str]) -> str | None:
    """`process rank R (host H) ended first with exit code C (SIGNAL)` from the launcher's "Root Cause" block, or
    None when the log has none."""
    cause = root_cause(lines)
    if cause is None:
        return None
    rank, host, code = cause
    return f"process rank {rank}{f' (host {host})' if host else ''} ended first" + \
        (f" with exit code {code}" if code else "")


# ---- every rank of a multi-process run ------------------------------------------------------------------------
# library.run.events.RankProgress: "rank 1/2 (pid 4242): step 12/100, 0.532 s/step, peak GPU memory 7.11 GiB"; and
# library.data_parallel's last line of each rank, "process 1/2 finished 100 steps, last loss ..."
RANK_LINE = re.compile(r"\brank (\d+)/(\d+) \(pid (\d+)\): step (\d+)/(\d+), " + NUM +
                       r" s/step(?:, peak (GPU memory|RSS) " + NUM + r" GiB)?")
RANK_DONE = re.compile(r"\bprocess (\d+)/(\d+) finished (\d+) steps")
SILENT_S = 30.0  # a rank that printed nothing for this long (it prints every few seconds) is shown as silent


def parse_rank(line: str) -> dict | None:
    """{'rank', 'world', 'pid', 'step', 'total', 'step_s', 'memory_gib', 'memory_kind'} from a rank line, or None."""
    m = RANK_LINE.search(line)
    if not m:
        return None
    return {"rank": int(m.group(1)), "world": int(m.group(2)), "pid": int(m.group(3)), "step": int(m.group(4)),
            "total": int(m.group(5)), "step_s": float(m.group(6)), "memory_kind": m.group(7),
            "memory_gib": float(m.group(8)) if m.group(8) else None}


def rank_status(info: dict, now: float, running: bool) -> str:
    """What the run panel says of one rank: its end ("finished", "ended", "ended first ..."), or while the run goes
    on "training" / "silent for N s"."""
    if info.get("ended"):
        return info["ended"]
    if running and now - info["seen"] > SILENT_S:
        return f"silent for {format_eta(now - info['seen'])}"
    return "training" if running else "-"

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
    auto_choices: dict = field(default_factory=dict)  # what the compile settings left at auto chose (compile_auto)
    ranks: dict = field(default_factory=dict)  # rank -> parse_rank's dict + "seen" (time), "ended" (several processes)


class _Adopted:
    """A run's leading process that an earlier GUI started (not our child): the parts of Popen the runner uses."""

    def __init__(self, process: psutil.Process):
        self.process, self.pid = process, process.pid

    def poll(self) -> int | None:
        return None if proc_tree.alive(self.process) else 0  # its exit status is its parent's, gone with the GUI

    def kill(self) -> None:
        with contextlib.suppress(psutil.Error):
            self.process.kill()


class Runner:
    """One training at a time. Thread-safe; the GUI and the CLI share this class. `record`: a file where the
    runner notes its active run, for a GUI started later (`adopt`); None: not noted (the CLI)."""

    def __init__(self, max_lines: int = 2000, record: str | os.PathLike | None = None):
        self._lock = threading.Lock()
        self._lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self._partial = ""  # an in-place progress line (ended by \r), shown after the lines
        self._proc: subprocess.Popen | _Adopted | None = None
        self._thread: threading.Thread | None = None
        self._stop_requested = threading.Event()
        self._stopped_line: tuple[float, str] | None = None  # (when, text) of the trainer's "stopped at step"
        self._compiling: list | None = None  # [steps it lasts, first step or None] after a COMPILE_LINE
        self._log_fd: int | None = None  # the run's log file, opened for appending (the runner's own lines)
        self._rank_procs: dict[int, psutil.Process | None] = {}  # each rank's process, to see it end
        self.state = RunState()
        self._reserved = False  # a Start is checking its settings and writing its files (see reserved())
        self.line_callback = None  # optional: called with every output line (the CLI echoes them)
        self.version = 0  # bumped whenever the log or the state changes (lets the page skip idle refreshes)
        self.history = RunHistory()  # the run's loss points and sample images (run panel chart and gallery)
        self.history_version = 0  # bumped when a point or a sample is added
        self.record = Path(record) if record is not None else None

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

    def _begin(self, state: RunState) -> None:
        """A new run's state and an empty log view (under the lock)."""
        self._lines.clear()
        self._partial = ""
        self._stop_requested.clear()
        self._stopped_line = None
        self._compiling = None
        self._rank_procs = {}
        self.version += 1
        self.history = RunHistory()
        self.history_version += 1
        self.state = state

    def start(self, commands: list[list[str]], log_path: str | os.PathLike, *, cwd=None, env=None,
              output_dir: str | os.PathLike | None = None, config_path: str | os.PathLike | None = None) -> None:
        """Runs the argv lists one after another (a failing one ends the run). `config_path`: the run's settings
        file, shown by the GUI. Raises RunnerBusy."""
        with self._lock:
            if self.state.running:
                raise RunnerBusy("A training run is already active; stop it first or wait for it to finish.")
            self._begin(RunState(running=True, commands=[list(c) for c in commands], log_path=str(log_path),
                                 output_dir=str(output_dir) if output_dir else None, started=time.time(),
                                 message="starting", config_path=str(config_path) if config_path else None))
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, args=(commands, Path(log_path), cwd, env), daemon=True)
        self._thread.start()

    def adopt(self) -> bool:
        """At GUI start: takes over the run noted in `record` if it is still going (its panel, Stop, Save now; Start
        refuses meanwhile). True when it did; a note of a run that has ended is removed."""
        if self.record is None:
            return False
        try:
            noted = json.loads(self.record.read_text(encoding="utf-8"))
            process = psutil.Process(int(noted["pid"]))
            same = abs(process.create_time() - float(noted["create_time"])) < 0.01  # not a reused pid
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            same = False
        if not same or not proc_tree.alive(process):
            with contextlib.suppress(OSError):
                self.record.unlink()
            return False
        log_path = Path(noted["log_path"])
        with self._lock:
            if self.state.running or self._reserved:
                return False
            self._begin(RunState(running=True, commands=noted.get("commands") or [], log_path=str(log_path),
                                 output_dir=noted.get("output_dir"), started=noted.get("started"),
                                 message="running", config_path=noted.get("config_path")))
            self._proc = _Adopted(process)
        self._thread = threading.Thread(target=self._watch_adopted, args=(log_path, int(noted.get("log_offset", 0))),
                                        daemon=True)
        self._thread.start()
        return True

    def stop(self, grace: float = 10.0, *, now: bool = False, save_timeout: float = SAVE_TIMEOUT) -> bool:
        """Stop and save: SIGTERM to the processes under the command (without process groups: the "stop"
        request), then waits until the tree has ended, killing what is left `grace` seconds after the trainer's
        "stopped at step" line or after `save_timeout`. now=True: kills the tree at once (Stop now; nothing is
        saved). Returns False when nothing was running."""
        with self._lock:
            if not self.state.running:
                return False
            self._stop_requested.set()
            proc, output_dir = self._proc, self.state.output_dir
            # without process groups only the trainer's loop reads the request file: before it nothing is to be
            # saved, and a run without an output folder has no such file
            now = now or (not proc_tree.groups() and (self.state.progress is None or not output_dir))
            self._compiling = None
            self.state.message = "stopping now, without saving" if now else \
                "stopping: the trainer finishes its step and saves"
            self.version += 1
        if now:
            self._note("# Stop now: ending the run's processes at once; nothing is saved (Stop saves first)")
        if proc is not None:
            if now:
                proc_tree.kill(proc.pid, proc_tree.tree(proc.pid))
                if proc.poll() is None:
                    proc.kill()
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
                               "error_lines": list(s.error_lines), "auto_choices": dict(s.auto_choices),
                               "ranks": {r: dict(info) for r, info in s.ranks.items()},
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
    def _stop_and_save(self, proc, output_dir: str | None, grace: float, save_timeout: float) -> None:
        tree = proc_tree.tree(proc.pid)
        if proc_tree.groups():
            # the processes under the command (the trainer and its helpers), once each (a second SIGTERM is the
            # trainer's "stop now"); `accelerate launch` itself stays, waits for the trainer and ends with its
            # exit status. Nothing under it yet: the command itself (nothing to save).
            for p in tree[1:] or tree[:1]:
                with contextlib.suppress(psutil.Error):
                    p.terminate()
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

    def _add(self, text: str, in_place: bool) -> None:
        text = text.rstrip()
        if not text:
            return
        rank = parse_rank(text) if not in_place else None
        prog = parse_progress(text) if rank is None else None  # a rank's line is not the run's progress
        done = RANK_DONE.search(text) if not in_place and rank is None else None
        with self._lock:
            self.version += 1
            if rank is not None:
                self._see_rank(rank)
            elif done and int(done.group(2)) > 1 and int(done.group(1)) in self.state.ranks:
                self.state.ranks[int(done.group(1))]["ended"] = f"finished {done.group(3)} steps"
            if not in_place and STOPPED_LINE.match(text):
                self._stopped_line = (time.time(), text)
            if not in_place and self.history.feed(text):
                self.history_version += 1
            if not in_place:
                compile_auto.feed(self.state.auto_choices, text)
            if prog:
                self.state.progress = prog
            self._follow_compile(text, prog, in_place)
            if in_place:
                self._partial = text
            else:
                self._partial = ""
                self._lines.append(text)
        if self.line_callback is not None and not in_place:
            self.line_callback(text)

    def _note(self, text: str) -> None:
        """A line of the runner's own: shown, and appended to the log file (one write: never inside a line of the
        run's, which appends to the same file)."""
        fd = self._log_fd
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, (text + "\n").encode("utf-8"))
        self._add(text, False)

    def _see_rank(self, rank: dict) -> None:
        """A rank's line (under the lock): its row, and its process, looked up once, to see it end (the log holds
        this machine's ranks only: a process not found has ended before its line was read)."""
        info = self.state.ranks.setdefault(rank["rank"], {})
        new_process = info.get("pid") != rank["pid"]  # the first line, or the rank restarted (torchrun)
        info.update(rank, seen=time.time())
        if new_process:
            info.pop("ended", None)
            try:
                self._rank_procs[rank["rank"]] = psutil.Process(rank["pid"])
            except psutil.Error:
                self._rank_procs[rank["rank"]] = None
                info.setdefault("ended", "ended")

    def _check_ranks(self) -> None:
        """A rank whose process has ended without its "finished" line is shown as ended, while the others go on."""
        with self._lock:
            for rank, process in self._rank_procs.items():
                info = self.state.ranks.get(rank)
                if info is not None and process is not None and not info.get("ended") \
                        and not proc_tree.alive(process):
                    info["ended"] = "ended"
                    self.version += 1

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
        self._log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        run_start = os.fstat(self._log_fd).st_size
        try:
            for argv in commands:
                if self._stop_requested.is_set():
                    break
                self._note("$ " + quoting.join(argv))
                with self._lock:
                    self.state.message = "running"
                offset = os.fstat(self._log_fd).st_size
                try:
                    # the output goes into the log file itself: the run does not depend on the GUI staying alive
                    proc = subprocess.Popen(argv, stdout=self._log_fd, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=cwd, env=env, **proc_tree.popen_kwargs())
                except OSError as e:
                    self._note(f"Could not start {argv[0]}: {e}")
                    rc = 127
                    break
                with self._lock:
                    self._proc = proc
                self._note_active(proc, log_path, run_start)
                if self._stop_requested.is_set():  # stop() came between the check and Popen
                    proc_tree.end(proc, 5.0)
                tree = self._follow(proc, log_path, offset)
                rc = proc.wait()
                proc_tree.kill(proc.pid, [p for p in tree if proc_tree.alive(p)])  # leftovers of a finished run
                with self._lock:
                    self._proc = None
                if rc != 0:
                    break
        finally:
            self._finish(rc)

    def _watch_adopted(self, log_path: Path, offset: int) -> None:
        """Follows a run an earlier GUI started, until its processes have ended (its exit status is unknown)."""
        try:
            self._log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError:
            self._log_fd = None
        try:
            self._note("# this run was started before the GUI restarted; followed from its log file")
            self._follow(self._proc, log_path, offset)
        finally:
            self._finish(None, adopted=True)

    def _finish(self, rc: int | None, adopted: bool = False) -> None:
        stopped = self._stop_requested.is_set()
        self._check_ranks()
        with self._lock:
            st = self.state
            self._proc = None
            st.running, st.ended, st.returncode, st.stopped = False, time.time(), rc, stopped
            st.outputs = new_outputs(st.output_dir, st.started)
            if rc not in (0, None) and not stopped:
                lines = [ln for ln in self._lines if not ln.startswith(("$ ", "# "))]
                errs = [ln for ln in lines if ERROR_WORDS.search(ln)]
                st.error_lines = (errs or lines)[-12:]
            self.version += 1
            if self._stopped_line:  # the trainer's "stopped at step N, saved ..."
                st.message = self._stopped_line[1]
            elif stopped:
                st.message = "stopped"
            elif adopted:
                st.message = "ended (started before the GUI restarted: its exit status is unknown; see the log)"
            else:
                st.message = "finished" if rc == 0 else f"failed (exit status {rc})"
                first = first_failed_process(self._lines) if rc else None
                if first:  # several processes: the one that ended first, as the launcher reports it
                    st.message = f"failed: {first}; the launcher stopped every other process (exit status {rc})"
                    rank, _, code = root_cause(self._lines)
                    if rank in st.ranks:
                        st.ranks[rank]["ended"] = "ended first" + (f" (exit code {code})" if code else "")
            message = st.message
        self._forget_active()
        fd, self._log_fd = self._log_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, f"# {message}\n".encode("utf-8"))
            os.close(fd)

    def _follow(self, proc, log_path: Path, offset: int) -> list[psutil.Process]:
        """Reads the log file from `offset` as the run writes it, until the command and every process under it
        have ended (a launcher may end before its trainer). Returns the processes seen."""
        tree = proc_tree.tree(proc.pid)
        looked = time.monotonic()
        buf = b""
        try:
            f = open(log_path, "rb")
        except OSError:
            f = None
        with f if f is not None else contextlib.nullcontext():
            if f is not None:
                f.seek(offset)
            while True:
                chunk = f.read(65536) if f is not None else b""
                if chunk:
                    buf = self._feed(buf + chunk)
                    continue
                if proc.poll() is not None and not any(proc_tree.alive(p) for p in tree[1:]):
                    rest = f.read() if f is not None else b""
                    if not rest:
                        break
                    buf = self._feed(buf + rest)
                    continue
                time.sleep(POLL_S)
                if time.monotonic() - looked > 0.5:  # processes started since (the trainer, its workers)
                    tree, looked = proc_tree.grown(tree), time.monotonic()
                    self._check_ranks()
        if buf:
            self._add(buf.decode("utf-8", "replace"), False)
        return tree

    def _feed(self, buf: bytes) -> bytes:
        """Takes the complete lines (ended by \\n, or \\r for in-place progress) out of `buf`; returns the rest."""
        while True:
            idx = [i for i in (buf.find(b"\n"), buf.find(b"\r")) if i >= 0]
            if not idx:
                return buf
            i = min(idx)
            piece, sep, buf = buf[:i], buf[i:i + 1], buf[i + 1:]
            self._add(piece.decode("utf-8", "replace"), sep == b"\r")

    def _note_active(self, proc: subprocess.Popen, log_path: Path, run_start: int) -> None:
        if self.record is None:
            return
        from .config_file import write_text_atomic

        try:
            with self._lock:
                st = self.state
                noted = {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(),
                         "log_path": str(log_path), "log_offset": run_start, "output_dir": st.output_dir,
                         "config_path": st.config_path, "started": st.started, "commands": st.commands}
            write_text_atomic(self.record, json.dumps(noted, indent=1) + "\n")
        except (OSError, psutil.Error) as e:
            self._add(f"# cannot note the run in {self.record} ({e}); a GUI restart will not find it", False)

    def _forget_active(self) -> None:
        if self.record is not None:
            with contextlib.suppress(OSError):
                self.record.unlink()


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

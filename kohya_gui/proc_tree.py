"""Ending a run's process tree (the runner's `accelerate launch`, its trainer processes, their data loaders).

Where POSIX process groups exist (`os.killpg` and `signal.SIGKILL`), the run leads its own group
(`start_new_session`), so one signal reaches every process in it, also those whose parent has already died; only
the descendants that left the group get theirs one by one (psutil). Where they do not (Windows), psutil walks the
tree from the run's process: `terminate()` and `kill()` are both TerminateProcess there, so no trainer can save on a
signal; the runner asks for stop-and-save with the run's request file instead (kohya_gui.run_requests).
A descendant whose parent died before we listed it is out of reach there (a Windows job object would hold it).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil


def groups() -> bool:
    """POSIX process groups can be signalled (looked up at each call: tests take them away)."""
    return hasattr(os, "killpg") and hasattr(signal, "SIGKILL")


def popen_kwargs() -> dict:
    """Popen arguments for a run: its own process group, so the GUI's Ctrl+C in a terminal does not reach it
    (Windows: CREATE_NEW_PROCESS_GROUP does that for the console's Ctrl+C)."""
    if groups():
        return {"start_new_session": True}
    return {"creationflags": getattr(subprocess, "CREATE_NEW_PROCESS_GROUP", 0)}


def tree(pid: int) -> list[psutil.Process]:
    """The process and its descendants now; [] when it has gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def grown(processes: list[psutil.Process]) -> list[psutil.Process]:
    """`processes` plus the descendants the living ones have now (started since they were listed)."""
    out = {p.pid: p for p in processes}
    for p in processes:
        if alive(p):
            try:
                out.update((c.pid, c) for c in p.children(recursive=True))
            except psutil.Error:
                pass
    return list(out.values())


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def terminate(leader: int, processes: list[psutil.Process], *, once: bool = False) -> None:
    """Asks them to end: SIGTERM to the group of `leader` and to `processes` (with `once`, only those outside the
    group: a second SIGTERM is the trainer's "stop now"); without groups terminate() each."""
    if groups():
        _signal_group(leader, signal.SIGTERM)
        processes = outside_group(processes, leader) if once else processes
    _each(processes, psutil.Process.terminate)


def kill(leader: int, processes: list[psutil.Process]) -> None:
    """Ends them at once (SIGKILL / TerminateProcess) and waits a little for them to go."""
    if groups():
        _signal_group(leader, signal.SIGKILL)
    living = [p for p in processes if alive(p)]
    _each(living, psutil.Process.kill)
    psutil.wait_procs(living, timeout=5)


def end(proc: subprocess.Popen, grace: float) -> None:
    """Ends the tree of `proc` (started with popen_kwargs): SIGTERM to it (Windows: terminate() each, which ends
    them at once), what is left killed after `grace` seconds."""
    processes = tree(proc.pid)
    terminate(proc.pid, processes if not groups() else processes[1:])
    deadline = time.time() + grace
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    kill(proc.pid, [p for p in grown(processes) if alive(p)])
    if proc.poll() is None:
        proc.kill()


def outside_group(processes: list[psutil.Process], pgid: int) -> list[psutil.Process]:
    """The processes that left process group `pgid` (a group signal does not reach them)."""
    if not hasattr(os, "getpgid"):
        return processes
    out = []
    for p in processes:
        try:
            if os.getpgid(p.pid) != pgid:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _each(processes: list[psutil.Process], send) -> None:
    """send(p) for each process; one that has already gone is skipped."""
    for p in processes:
        try:
            send(p)
        except psutil.Error:
            pass

"""The TensorBoard button: one `tensorboard --logdir <logging_dir>` on a free port, a child of the GUI (ended
with it, or when another folder is asked for). It listens where the GUI listens (127.0.0.1 unless --listen)."""

from __future__ import annotations

import atexit
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import proc_tree

HOST = {"address": "127.0.0.1"}  # gui.py sets the --listen address
START_TIMEOUT = 60.0


class TensorBoardError(RuntimeError):
    """TensorBoard could not be started; the message says why."""


class TensorBoard:
    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self.logdir: str | None = None
        self.port: int | None = None
        atexit.register(self.stop)

    def start(self, logdir: str) -> int:
        """Serves `logdir` (reusing a running server for the same folder); returns the port."""
        if not logdir:
            raise TensorBoardError("TensorBoard log folder (logging_dir) is empty: set it, then train (the trainer "
                                   "writes TensorBoard logs there)")
        folder = Path(logdir).expanduser()
        if not folder.is_dir():
            raise TensorBoardError(f"TensorBoard log folder (logging_dir): {folder} does not exist yet (it is made "
                                   "when a run with this setting starts)")
        with self._lock:
            if self._proc is not None and self._proc.poll() is None and self.logdir == str(folder):
                return self.port
            self._stop_locked()
            port = _free_port(HOST["address"])
            argv = [sys.executable, "-m", "tensorboard.main", "--logdir", str(folder), "--port", str(port),
                    "--host", HOST["address"]]
            self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          stdin=subprocess.DEVNULL, **proc_tree.popen_kwargs())
            self.logdir, self.port = str(folder), port
            proc = self._proc
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise TensorBoardError(f"tensorboard exited with status {proc.returncode} (is the 'tensorboard' "
                                       "package installed? pip install tensorboard)")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1" if HOST["address"] in ("0.0.0.0", "::") else HOST["address"],
                                 port)) == 0:
                    return port
            time.sleep(0.2)
        self.stop()
        raise TensorBoardError(f"tensorboard did not answer on port {port} within {START_TIMEOUT:.0f} s")

    def stop(self) -> None:
        with self._lock:
            self._stop_locked()

    def _stop_locked(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc_tree.end(proc, grace=10.0)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

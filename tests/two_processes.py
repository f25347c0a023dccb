"""A test's worker on several processes (torch.multiprocessing.spawn): worker(rank, port, out_dir, *args) joins a
process group on 127.0.0.1:port and writes out_dir/ok<rank> once all its checks passed."""
from __future__ import annotations

import socket
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(worker, out_dir, *args, nprocs: int = 2) -> None:
    """Runs worker on nprocs processes (an error in one is raised here) and checks that each finished its checks."""
    mp.spawn(worker, args=(free_port(), str(out_dir), *args), nprocs=nprocs, join=True)
    assert sorted(p.name for p in Path(out_dir).iterdir()) == [f"ok{r}" for r in range(nprocs)]

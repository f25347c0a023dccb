"""library.data_parallel.all_reduce_gradients on 2 CPU processes (gloo): afterwards every gradient is the
average of what each process accumulated (two micro-steps of gradient accumulation), over several buckets,
with a parameter no process used (it keeps no gradient) and one only the second process used."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import two_processes

REPO = Path(__file__).resolve().parent.parent


def _model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)  # the same weights on every process
    return torch.nn.ModuleDict(dict(
        a=torch.nn.Linear(8, 16), b=torch.nn.Linear(16, 16), c=torch.nn.Linear(16, 4),
        only_rank1=torch.nn.Linear(4, 4), unused=torch.nn.Linear(4, 4),
    ))


def _accumulated_grads(model, rank: int, micro_steps: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(micro_steps):
        x = torch.randn(3, 8, generator=gen)
        y = model["c"](torch.relu(model["b"](torch.relu(model["a"](x)))))
        if rank == 1:
            y = model["only_rank1"](y)
        y.pow(2).mean().backward()


def _worker(rank: int, port: int, out_dir: str) -> None:
    sys.path.insert(0, str(REPO / "sd-scripts"))
    from library import data_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        data_parallel.BUCKET_BYTES = 200  # several buckets
        model = _model()
        _accumulated_grads(model, rank, micro_steps=2)
        data_parallel.all_reduce_gradients(list(model.parameters()), SimpleNamespace(num_processes=2))

        # expected: each process's accumulated gradients, computed here for both ranks, averaged
        expected = {}
        for r in (0, 1):
            ref = _model()
            _accumulated_grads(ref, r, micro_steps=2)
            for name, p in ref.named_parameters():
                if p.grad is not None:
                    expected[name] = expected.get(name, 0) + p.grad / 2
        for name, p in model.named_parameters():
            if name.startswith("unused"):
                assert p.grad is None, name
            else:
                assert p.grad is not None, name
                torch.testing.assert_close(p.grad, expected[name], msg=f"{name} on rank {rank}")
        Path(out_dir, f"ok{rank}").write_text("ok")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_all_reduce_gradients_two_processes(tmp_path):
    two_processes.run(_worker, tmp_path)


def test_all_reduce_gradients_single_process_does_nothing():
    sys.path.insert(0, str(REPO / "sd-scripts"))
    from library import data_parallel

    model, ref = _model(), _model()
    _accumulated_grads(model, 0, micro_steps=1)
    _accumulated_grads(ref, 0, micro_steps=1)
    data_parallel.all_reduce_gradients(list(model.parameters()), SimpleNamespace(num_processes=1))
    torch.testing.assert_close(model["a"].weight.grad, ref["a"].weight.grad)
    assert model["unused"].weight.grad is None

"""--cuda_graph_step on several processes (data parallel), on the CPU: 2 gloo processes train through
library.compile.step_graph with the gradients averaged by library.data_parallel.all_reduce_gradients inside the
step, and end with the weights torch's DistributedDataParallel gives for the same batches. CUDA graphs need a GPU:
here a stand-in graph runs the captured step again on each replay, with data_parallel on the path it takes under a
capture (nothing read back to the host), so what is checked is that this path averages as DDP does, a parameter
used on one process only included, one no process uses left without a gradient (AdamW's weight decay would move it
otherwise) and one whose use changes over the ordinary steps before the capture. The GPU check with NCCL and real
graphs is tests/test_step_graph_dist_gpu.py."""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import two_processes

REPO = Path(__file__).resolve().parent.parent
WORLD = 2


class _Model(torch.nn.Module):
    """A frozen base with trained layers; `only_rank1` is used by the second process only, `unused` by none, `moving`
    by none in the first step, by the first process in the second and by the second process from then on (what the
    capture keeps follows the last ordinary step, not an earlier one)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same weights on every process
        self.base = torch.nn.Linear(8, 8).requires_grad_(False)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.only_rank1, self.unused, self.moving = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, rank: int, step: int):
        y = self.b(torch.relu(self.a(self.base(x))))
        if rank == 1:
            y = self.only_rank1(y)
        if (step, rank) == (1, 0) or (step >= 2 and rank == 1):
            y = self.moving(y)
        return y


def _optimizer(name: str, params):
    if name == "AdamW":  # fused, as library.optimizers makes it: the graph holds its step
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, fused=True)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)  # steps after each replay


class _Graph:
    """Stands in for a CUDA graph: the capture runs forward, backward and the all-reduce once to make the graph's
    own gradient tensors (a real capture records them; the weights do not change either way), and replay() runs
    the step again, writing the new gradients into those tensors, with the optimizer step only where the capture
    held it (`step_inside`). data_parallel takes its capture path throughout."""

    def __init__(self, run, optimizer, step_inside: bool, capturing: list):
        self.run, self.optimizer, self.step_inside, self.capturing = run, optimizer, step_inside, capturing
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.loss = torch.zeros(())
        self.replays = 0
        _, self.grads = self._run(step=False)
        for p, g in zip(self.params, self.grads):
            p.grad = g

    def _run(self, step: bool):
        from library.compile import step_graph

        before = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None  # the graph's backward writes its gradients, not onto earlier ones
        self.capturing[0] = True
        if not step:
            self.optimizer.step = step_graph._skip_step
        try:
            loss = self.run()
        finally:
            self.capturing[0] = False
            self.optimizer.__dict__.pop("step", None)
        new = [p.grad for p in self.params]
        for p, g in zip(self.params, before):
            p.grad = g
        return loss, new

    def replay(self):
        self.replays += 1
        loss, new = self._run(step=self.step_inside)
        self.loss.copy_(loss.detach())
        for static, g in zip(self.grads, new):
            assert (static is None) == (g is None)  # the same parameters have gradients in every replay
            if static is not None:
                static.copy_(g)


def _batches(rank: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)  # each process its own share of the data
    return [torch.randn(3, 8, generator=gen) for _ in range(steps)]


def _train_with_step_graphs(rank: int, name: str, steps: int, capturing: list):
    from library import data_parallel
    from library.compile import step_graph

    model = _Model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(name, params)
    accelerator = SimpleNamespace(num_processes=WORLD)

    def run_step(batch):  # what library.run.step.MicroStep.forward_to_optimizer_step does
        loss = model(batch["latents"], rank, batch["step"]).pow(2).mean()  # (a graph keeps its capture's step)
        loss.backward()
        data_parallel.all_reduce_gradients(params, accelerator)
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        return loss

    graphs_made = []

    def capture(run, generators):
        graph = _Graph(run, optimizer, step_graph.fuses_into_graph(optimizer), capturing)
        graphs_made.append(graph)
        return graph, graph.loss

    graphs = step_graph.StepGraphs([optimizer], "cpu", capture=capture)
    for step, x in enumerate(_batches(rank, steps)):
        graphs.step({"latents": x, "network_multipliers": [1.0], "step": step}, run_step)
    assert graphs.off is None and len(graphs_made) == 1 and graphs_made[0].replays == steps - step_graph.WARMUP
    return model


def _train_with_ddp(rank: int, name: str, steps: int):
    model = _Model()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(name, params)
    for step, x in enumerate(_batches(rank, steps)):
        ddp(x, rank, step).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def _worker(rank: int, port: int, out_dir: str, steps: int) -> None:
    sys.path.insert(0, str(REPO / "sd-scripts"))
    from library import data_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        capturing = [False]
        data_parallel._capturing = lambda: capturing[0]  # the stand-in graph's steps take the capture path
        data_parallel.BUCKET_BYTES = 300  # several buckets
        for name in ("AdamW", "SGD"):
            graphed = _train_with_step_graphs(rank, name, steps, capturing)
            reference = _train_with_ddp(rank, name, steps)
            start = _Model()
            for (key, a), b, s in zip(graphed.named_parameters(), reference.parameters(), start.parameters()):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{name} {key} on rank {rank}")
                moved = not torch.equal(a, s)
                assert moved == (a.requires_grad and not key.startswith("unused")), f"{name} {key} moved: {moved}"
            # every process holds the same weights
            flat = torch.cat([p.detach().reshape(-1) for p in graphed.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(WORLD)]
            torch.distributed.all_gather(gathered, flat)
            assert torch.equal(gathered[0], gathered[1])
        Path(out_dir, f"ok{rank}").write_text("ok")
    finally:
        gc.collect()  # the DDP wrappers (reference cycles) go while their process group is still there
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_train_to_ddps_weights_through_the_step_graph(tmp_path):
    from library.compile import step_graph

    two_processes.run(_worker, tmp_path, step_graph.WARMUP + 4, nprocs=WORLD)

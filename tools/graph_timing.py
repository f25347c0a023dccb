"""Runs a training script with timers around the parts of torch's CUDA-graph trees and compile path that the
slow setup steps spend their time in, and prints one line with the totals when the script ends:

    graph_timing: {"record_function": [280, 12.31], "capture": [280, 4.02], ...}   # name: [calls, seconds]

    python tools/graph_timing.py SCRIPT.py [ARGS...]      # as `python SCRIPT.py ARGS...`

tools/bench_shipped.py runs the trainer through it with --time_graphs. Names (nested: a call's seconds include
those of the calls inside it):
- record_function: recording one graph (CUDAGraphTreeManager.record_function: node setup, capture, first replay)
  - capture: CUDAGraphNode._record (the stream capture, and the bookkeeping after it)
    - capture_begin / capture_end: torch.cuda.CUDAGraph's (capture_end instantiates the graph)
    - outputs_bookkeeping: CUDAGraphNode._add_first_outputs (liveness of the path's outputs, allocator checkpoint)
  - copy_recording_inputs: CUDAGraphNode._allocate_and_copy_recording_inputs
- warmup: CUDAGraphTreeManager.run_eager (a function's first run, before its recording)
- replay: CUDAGraphNode.run (every replay) / check_invariants: the checks before each replay
- get_checkpoint_state / set_checkpoint_state: the allocator checkpoints of the graph pool
- apply_checkpoint: CUDAGraphTreeManager.apply_checkpoint_execution_state_in_allocator
- try_end_recording, dealloc_path_weakrefs: the tree manager's path changes
- synchronize, empty_cache, gc_collect: torch.cuda.synchronize / empty_cache, gc.collect, from anywhere
The dynamo/inductor compile-time table of torch (torch._dynamo.utils.compile_times) follows on its own lines.
"""
from __future__ import annotations

import atexit
import functools
import gc
import json
import os
import runpy
import sys
import time

TOTALS: dict[str, list] = {}


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            entry = TOTALS.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - t0

    return wrapper


def _wrap(owner, attr: str, name: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is not None:
        setattr(owner, attr, _timed(name, fn))


def install() -> None:
    import torch
    from torch._inductor import cudagraph_trees as trees

    manager, node = trees.CUDAGraphTreeManager, trees.CUDAGraphNode
    for owner, attr, name in (
        (manager, "record_function", "record_function"),
        (manager, "run_eager", "warmup"),
        (manager, "apply_checkpoint_execution_state_in_allocator", "apply_checkpoint"),
        (manager, "try_end_curr_recording", "try_end_recording"),
        (manager, "dealloc_current_path_weakrefs", "dealloc_path_weakrefs"),
        (node, "_record", "capture"),
        (node, "_add_first_outputs", "outputs_bookkeeping"),
        (node, "_allocate_and_copy_recording_inputs", "copy_recording_inputs"),
        (node, "run", "replay"),
        (node, "check_invariants", "check_invariants"),
        (torch.cuda.graphs.CUDAGraph, "capture_begin", "capture_begin"),
        (torch.cuda.graphs.CUDAGraph, "capture_end", "capture_end"),
        (torch._C, "_cuda_getCheckpointState", "get_checkpoint_state"),
        (torch._C, "_cuda_setCheckpointPoolState", "set_checkpoint_state"),
        (torch.cuda, "synchronize", "synchronize"),
        (torch.cuda, "empty_cache", "empty_cache"),
        (gc, "collect", "gc_collect"),
    ):
        _wrap(owner, attr, name)
    atexit.register(report)


def report() -> None:
    print("graph_timing: " + json.dumps({k: [v[0], round(v[1], 3)] for k, v in sorted(TOTALS.items())}), flush=True)
    try:
        import torch._dynamo.utils

        print("compile_times:\n" + str(torch._dynamo.utils.compile_times(repr="str", aggregate=True)), flush=True)
    except Exception as e:  # a torch without the table
        print(f"compile_times: not available ({e})", flush=True)


def main() -> None:
    script = os.path.abspath(sys.argv[1])
    sys.argv = [script] + sys.argv[2:]
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT.py` has it
    install()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

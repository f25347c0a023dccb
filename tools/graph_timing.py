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
- node_init: CUDAGraphNode.__init__ (torch records the graph in it; its inputs and outputs are checked against the
  path's outputs: recorded_scan, alias_scan)
- pool_check: check_memory_pool (inductor's slow_path_cudagraph_asserts) / liveness: CUDAGraphNode._get_liveness
- synchronize, empty_cache, gc_collect: torch.cuda.synchronize / empty_cache, gc.collect, from anywhere
The dynamo/inductor compile-time table of torch (torch._dynamo.utils.compile_times) follows on its own lines, after
one line `graph_timing counters: {...}` of torch's counters (FX-graph and AOTAutograd cache hits and misses, frames,
unique graphs, recompile reasons).

Environment:
- GRAPH_TIMING_VARIANT: "shipped" (default: library.compile.recording.speed_up, as the trainers do with the
  blocks' CUDA graphs; applied here in every run, and its inductor setting is part of torch's FX-graph cache key:
  a run through this tool and one without it do not share compile-cache entries, so time a warm restart with the
  tool on both runs or on neither), "torch"
  (torch's own bookkeeping), "no_pool_checks" (torch's, with slow_path_cudagraph_asserts off), to compare them on
  one machine.
- GRAPH_TIMING_PROFILE=1: cProfile over the warm-up runs and recordings; the 30 functions with the most own time
  are printed at the end (cProfile slows Python code, so its times are only relative).
- GRAPH_TIMING_PROFILE=all: cProfile over the whole run (imports after this tool's, model load, caching, compile,
  every step): the 120 functions with the most cumulative time and the 40 with the most own time are printed at
  the end, and with GRAPH_TIMING_PROFILE_OUT=PATH the stats are written there (pstats) too; keep the run short.
- GRAPH_TIMING_STEADY=A:B: cProfile over the steady steps A to B-1 (counted by the trainer's calls of
  torch.compiler.cudagraph_mark_step_begin, so only with the CUDA-graph modes): the host work of a replayed step,
  by own time and by cumulative time.
- GRAPH_TIMING_KERNELS=A:B: torch.profiler over the GPU kernels of steps A to B-1 (counted the same way): one
  line `graph_timing kernels: {...}` with the wall time and the kernel time a step, the kernel time by kind
  (attention, matmul, triton = inductor's fused kernels, optimizer, other) and the 20 costliest kernels.
"""
from __future__ import annotations

import atexit
import cProfile
import functools
import gc
import inspect
import io
import json
import os
import pstats
import runpy
import sys
import time

TOTALS: dict[str, list] = {}
VARIANTS = ("shipped", "torch", "no_pool_checks")
PROFILE = cProfile.Profile() if os.environ.get("GRAPH_TIMING_PROFILE") == "1" else None
STEADY = tuple(int(x) for x in os.environ["GRAPH_TIMING_STEADY"].split(":")) if os.environ.get(
    "GRAPH_TIMING_STEADY") else None
STEADY_PROFILE = cProfile.Profile() if STEADY else None
WHOLE_PROFILE = cProfile.Profile() if os.environ.get("GRAPH_TIMING_PROFILE") == "all" else None
KERNELS = tuple(int(x) for x in os.environ["GRAPH_TIMING_KERNELS"].split(":")) if os.environ.get(
    "GRAPH_TIMING_KERNELS") else None
_kernel_profile: dict = {}
_steps = [0]


def _timed(name: str, fn, profiled: bool = False):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        profiling = profiled and PROFILE is not None
        if profiling:
            PROFILE.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            if profiling:
                PROFILE.disable()
            entry = TOTALS.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - t0

    return wrapper


def _wrap(owner, attr: str, name: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is None:
        return
    wrapped = _timed(name, fn, profiled=name in ("record_function", "warmup"))
    if isinstance(inspect.getattr_static(owner, attr), staticmethod):
        wrapped = staticmethod(wrapped)
    setattr(owner, attr, wrapped)


def _apply_variant(variant: str) -> None:
    """Which CUDA-graph bookkeeping the run uses (see GRAPH_TIMING_VARIANT above). The trainer's own call of
    library.compile.recording.speed_up is made a no-op, so that the timers put in after this stay."""
    import torch._inductor.config as inductor_config

    if variant not in VARIANTS:
        raise SystemExit(f"GRAPH_TIMING_VARIANT: {variant!r} is not one of {', '.join(VARIANTS)}")
    try:
        from library.compile import recording as cuda_graph_recording
    except ImportError:  # an older tree (--scripts_dir): torch's bookkeeping is all it has
        if variant != "torch":
            raise SystemExit(f"GRAPH_TIMING_VARIANT={variant} needs library.compile.recording")
        return
    if variant == "shipped":
        cuda_graph_recording.speed_up()
    elif variant == "no_pool_checks":
        cuda_graph_recording.skip_debug_checks()
    cuda_graph_recording.speed_up = lambda: []
    print(f"graph_timing: variant {variant} (pool checks {inductor_config.triton.slow_path_cudagraph_asserts})",
          flush=True)


def _count_steps(mark_step_begin):
    """The trainer marks each optimizer step's start: profile the steps STEADY asks for."""

    @functools.wraps(mark_step_begin)
    def wrapper():
        _steps[0] += 1
        if STEADY and _steps[0] == STEADY[0]:
            STEADY_PROFILE.enable()
        elif STEADY and _steps[0] == STEADY[1]:
            STEADY_PROFILE.disable()
        if KERNELS and _steps[0] in KERNELS:
            try:
                _kernel_steps(start=_steps[0] == KERNELS[0])
            except Exception as e:  # a measurement aid: never the reason a training run stops
                print(f"graph_timing kernels: failed ({type(e).__name__}: {e})", flush=True)
        return mark_step_begin()

    return wrapper


KERNEL_KINDS = (  # by name, first match: inductor names its kernels after the ops they fuse (attention's too),
    ("triton", ("triton",)),  # and cuDNN's attention kernels carry gemm-like words
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("optimizer", ("adam", "multi_tensor")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "splitk")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, words in KERNEL_KINDS if any(w in low for w in words)), "other")


def _kernel_steps(start: bool) -> None:
    """Starts (at step A) or ends (at step B) the kernel profile of GRAPH_TIMING_KERNELS."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    if start:
        _kernel_profile["prof"] = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
        _kernel_profile["prof"].start()
        _kernel_profile["t0"] = time.perf_counter()
        return
    wall = time.perf_counter() - _kernel_profile.pop("t0")
    prof = _kernel_profile.pop("prof")
    prof.stop()
    steps = KERNELS[1] - KERNELS[0]
    per_kernel, by_kind = {}, {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
        if not us:
            continue
        per_kernel[evt.key] = (us, evt.count)
        kind = kernel_kind(evt.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:20]
    print("graph_timing kernels: " + json.dumps({
        "steps": f"{KERNELS[0]}-{KERNELS[1] - 1}", "wall_ms_per_step": round(wall * 1e3 / steps, 1),
        "kernel_ms_per_step": round(sum(us for us, _ in per_kernel.values()) / 1e3 / steps, 1),
        "by_kind_ms_per_step": {k: round(v / 1e3 / steps, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [[name[:90], round(us / 1e3 / steps, 2), n // steps] for name, (us, n) in top]}), flush=True)


def install() -> None:
    import torch
    from torch._inductor import cudagraph_trees as trees

    _apply_variant(os.environ.get("GRAPH_TIMING_VARIANT", "shipped"))
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
        (node, "__init__", "node_init"),
        (node, "_is_cuda_graph_recorded_tensor", "recorded_scan"),
        (node, "_is_alias_of_live_recorded_tensor", "alias_scan"),
        (node, "_get_liveness", "liveness"),
        (trees, "check_memory_pool", "pool_check"),
        (torch.cuda.graphs.CUDAGraph, "capture_begin", "capture_begin"),
        (torch.cuda.graphs.CUDAGraph, "capture_end", "capture_end"),
        (torch._C, "_cuda_getCheckpointState", "get_checkpoint_state"),
        (torch._C, "_cuda_setCheckpointPoolState", "set_checkpoint_state"),
        (torch.cuda, "synchronize", "synchronize"),
        (torch.cuda, "empty_cache", "empty_cache"),
        (gc, "collect", "gc_collect"),
    ):
        _wrap(owner, attr, name)
    if STEADY or KERNELS:
        torch.compiler.cudagraph_mark_step_begin = _count_steps(torch.compiler.cudagraph_mark_step_begin)
    atexit.register(report)


def report() -> None:
    print("graph_timing: " + json.dumps({k: [v[0], round(v[1], 3)] for k, v in sorted(TOTALS.items())}), flush=True)
    if PROFILE is not None:
        out = io.StringIO()
        try:
            pstats.Stats(PROFILE, stream=out).sort_stats("tottime").print_stats(30)
        except TypeError:  # nothing was recorded (no CUDA graphs in this run)
            out.write("nothing recorded")
        print("graph_timing profile:\n" + out.getvalue(), flush=True)
    if WHOLE_PROFILE is not None:
        WHOLE_PROFILE.disable()
        out = io.StringIO()
        stats = pstats.Stats(WHOLE_PROFILE, stream=out)
        stats.sort_stats("cumulative").print_stats(120)
        stats.sort_stats("tottime").print_stats(40)
        if path := os.environ.get("GRAPH_TIMING_PROFILE_OUT"):
            stats.dump_stats(path)
        print("graph_timing whole-run profile:\n" + out.getvalue(), flush=True)
    if STEADY_PROFILE is not None:
        STEADY_PROFILE.disable()
        out = io.StringIO()
        try:
            stats = pstats.Stats(STEADY_PROFILE, stream=out)
            stats.sort_stats("tottime").print_stats(45)
            stats.sort_stats("cumulative").print_stats(60)
        except TypeError:
            out.write("nothing recorded")
        print(f"graph_timing steady profile, steps {STEADY[0]}-{STEADY[1] - 1}:\n" + out.getvalue(), flush=True)
    try:
        from torch._dynamo.utils import counters

        # cache hits and misses (inductor: fxgraph_cache_*, aot_autograd: autograd_cache_*), frames, unique graphs
        keep = ("stats", "frames", "inductor", "aot_autograd", "recompile_reasons", "graph_break")
        print("graph_timing counters: " + json.dumps(
            {k: {str(n): v for n, v in counters[k].items() if k != "inductor" or "cache" in n}
             for k in keep if counters.get(k)}, default=str)[:4000], flush=True)
    except Exception as e:  # a torch without the counters
        print(f"graph_timing counters: not available ({e})", flush=True)
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
    if WHOLE_PROFILE is not None:
        WHOLE_PROFILE.enable()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

"""Shorter dynamo tracing at every start, warm compile cache or not (setup_compile_environment applies it).

A new process traces every compiled graph again before the caches can answer (torch 2.11 keeps no trace). Of a
FLUX.1 warm restart's tracing (two block graphs), a third went to a log header: dynamo's `OutputGraph.create_proxy`
builds "file:line in function (qualified name)" for each graph node it records, for its `trace_call` debug log,
whether that log is on or not, and the qualified name comes from `funcname_cache`, which tokenizes each source file
it meets in whole the first time (torch/nn/functional.py, diffusers' transformer files...): 0.65 s of 2.0 s
(py-spy, H100, docs/BENCHMARKS.md session 20). `skip_unlogged_funcnames` answers None there while dynamo's trace
logs are off (the header then has no qualified name, and nothing reads it); with TORCH_LOGS=trace_call or
trace_source on, torch's lookup runs as before.
"""
from __future__ import annotations

import logging


def skip_unlogged_funcnames() -> bool:
    """Put the lookup above into torch's dynamo; False (nothing changed) on a torch laid out otherwise."""
    try:
        from torch._dynamo import symbolic_convert
    except ImportError:
        return False
    original = getattr(symbolic_convert, "get_funcname", None)
    if getattr(original, "_sd_scripts_original", None) is not None:
        return True  # installed before
    logs = [getattr(symbolic_convert, name, None) for name in ("trace_call_log", "trace_source_log")]
    if original is None or not all(isinstance(log, logging.Logger) for log in logs):
        return False

    def get_funcname(filename: str, lineno: int) -> str | None:
        if any(log.isEnabledFor(logging.DEBUG) for log in logs):
            return original(filename, lineno)
        return None

    get_funcname._sd_scripts_original = original
    symbolic_convert.get_funcname = get_funcname
    return True

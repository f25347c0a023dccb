"""library.compile.tracing: dynamo's log-header lookups are skipped while its trace logs are off (CPU, backend eager)."""
import argparse
import logging
import textwrap

import pytest
import torch
from torch._dynamo import funcname_cache, symbolic_convert

from library.compile import environment as compile_environment, options as compile_options, tracing

ORIGINAL = symbolic_convert.get_funcname


@pytest.fixture
def restore_torch(monkeypatch):
    monkeypatch.setattr(symbolic_convert, "get_funcname", ORIGINAL)
    yield
    torch._dynamo.reset()


def _traced_file(tmp_path, name):
    """A module file of its own (so funcname_cache has not seen it) with a function dynamo traces."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent("""
        import torch

        class Layer:
            def forward(self, x):
                y = torch.sin(x) * 2
                return torch.cos(y) + x
        """))
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(path), module.Layer()


def _compile_and_run(layer):
    torch._dynamo.reset()
    x = torch.randn(8)
    compiled = torch.compile(layer.forward, backend="eager", fullgraph=True)
    return torch.testing.assert_close(compiled(x), layer.forward(x))


def test_tracing_skips_the_lookup_while_the_logs_are_off(restore_torch, tmp_path):
    path, layer = _traced_file(tmp_path, "traced_torch_default")
    _compile_and_run(layer)
    assert path in funcname_cache.cache  # torch's own: the file tokenized for a header nobody logs

    assert tracing.skip_unlogged_funcnames() is True
    assert tracing.skip_unlogged_funcnames() is True  # installed once
    assert symbolic_convert.get_funcname._sd_scripts_original is ORIGINAL
    path, layer = _traced_file(tmp_path, "traced_skipped")
    _compile_and_run(layer)
    assert path not in funcname_cache.cache
    assert symbolic_convert.get_funcname(path, 6) is None


def test_the_lookup_runs_when_a_trace_log_is_on(restore_torch, tmp_path):
    assert tracing.skip_unlogged_funcnames() is True
    path, layer = _traced_file(tmp_path, "traced_logged")
    log = symbolic_convert.trace_call_log
    level = log.level
    log.setLevel(logging.DEBUG)
    try:
        assert symbolic_convert.get_funcname(path, 6) == "Layer.forward"
    finally:
        log.setLevel(level)
    assert symbolic_convert.get_funcname(path, 6) is None


def test_torch_without_the_lookup_is_left_alone(restore_torch, monkeypatch):
    monkeypatch.delattr(symbolic_convert, "trace_call_log")
    assert tracing.skip_unlogged_funcnames() is False
    assert symbolic_convert.get_funcname is ORIGINAL


@pytest.mark.parametrize("argv", [["--compile", "--compile_mode", "reduce-overhead"],
                                  ["--compile", "--compile_mode", "default"]])
def test_compile_setup_applies_it(argv, restore_torch, tmp_path):
    args = compile_options.add_compile_arguments(argparse.ArgumentParser()).parse_args(
        argv + ["--compile_cache_dir", str(tmp_path)])
    result = compile_environment.setup_compile_environment(args)
    assert "dynamo_tracing" in result
    assert symbolic_convert.get_funcname._sd_scripts_original is ORIGINAL


def test_triton_key_is_hashed_on_a_thread(monkeypatch):
    """warm_compile_workers' prefetch: triton's cached installation hash is computed on another thread, so the first
    compile-cache lookup finds it; without triton (or without its cache) nothing starts."""
    import functools
    import sys
    import threading
    import types

    threads = []

    @functools.lru_cache()
    def triton_key():
        threads.append(threading.current_thread())
        return "3.6.0-" + "ab" * 32

    cache = types.ModuleType("triton.runtime.cache")
    cache.triton_key = triton_key
    runtime = types.ModuleType("triton.runtime")
    runtime.cache = cache
    triton = types.ModuleType("triton")
    triton.runtime = runtime
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.runtime", runtime)
    monkeypatch.setitem(sys.modules, "triton.runtime.cache", cache)
    thread = compile_environment.prefetch_triton_key()
    thread.join(10)
    assert threads == [thread] and thread is not threading.main_thread()
    assert triton_key.cache_info().currsize == 1

    cache.triton_key = lambda: "uncached"
    assert compile_environment.prefetch_triton_key() is None
    monkeypatch.setitem(sys.modules, "triton.runtime.cache", None)  # import fails: no triton
    assert compile_environment.prefetch_triton_key() is None

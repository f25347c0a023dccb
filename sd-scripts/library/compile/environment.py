"""The process-wide settings of a compiled run: TF32 / cuDNN switches, cuDNN attention, the persistent compile cache
(and its key), the recompile limit, cheaper CUDA-graph recording."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch._dynamo

from library.compile.graphs import cuda_graphs
from library.compile.options import _torch_version

logger = logging.getLogger(__name__)

def user_inductor_cache_dir() -> str | None:
    """TORCHINDUCTOR_CACHE_DIR when the user set it, else None.

    Importing torch._dynamo sets the variable to torch's own default (/tmp/torchinductor_<user>) before any trainer
    code runs, so the environment alone cannot tell. library/__init__ keeps the value from before torch's inductor
    was imported; without that snapshot (library imported after torch._inductor), a value equal to torch's default
    counts as not set.
    """
    import library

    start = getattr(library, "INDUCTOR_CACHE_DIR_AT_START", None)
    if start is not None:
        return start[0] or None
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not value:
        return None
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return None if os.path.abspath(value) == os.path.abspath(default_cache_dir()) else value


def default_compile_cache_dir() -> str:
    """The persistent compile cache used when --compile_cache_dir is not given.

    A TORCHINDUCTOR_CACHE_DIR the user set wins (user_inductor_cache_dir: not the /tmp value torch sets itself);
    otherwise a folder in the user's cache directory ($XDG_CACHE_HOME or ~/.cache). It is not under --output_dir
    on purpose: entries are keyed by a hash of the graph, torch version and device, so they are safe to share,
    and sharing them across runs with different output folders is what makes the second run start warm.
    """
    env = user_inductor_cache_dir()
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sd-scripts", "torch_compile")


def resolve_cache_dir(args) -> str:
    return os.path.abspath(os.path.expanduser(getattr(args, "compile_cache_dir", None) or default_compile_cache_dir()))


def _needs_cudnn_sdpa_workaround() -> bool:
    """torch 2.11 with CUDA 13 on Hopper: the cuDNN SDPA backward crashed ("illegal memory access")."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    if _torch_version() != (2, 11) or not torch.version.cuda.startswith("13"):
        return False
    return torch.cuda.get_device_capability()[0] == 9


SDPA_CACHE_KEY = "sd-scripts.sdpa_backends"  # an entry of inductor's config, so part of every compile cache key


def _key_caches_by_sdpa_backends(inductor_config) -> None:
    """The attention backend is picked when a graph is traced, and torch's cache keys leave the backend switches
    out: a graph traced with cuDNN attention would come back from the cache in a run that turned it off (and crash
    where it crashed before). An entry naming the switches in the (otherwise unused) marked-cacheable-functions
    table of inductor's config puts them into the FX-graph and AOTAutograd cache keys."""
    table = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if table is None:  # older torch: no such table (nor an AOTAutograd cache)
        return
    b = torch.backends.cuda
    state = (f"cudnn={int(b.cudnn_sdp_enabled())},flash={int(b.flash_sdp_enabled())},"
             f"efficient={int(b.mem_efficient_sdp_enabled())},math={int(b.math_sdp_enabled())}")
    inductor_config.unsafe_marked_cacheable_functions = {**table, SDPA_CACHE_KEY: state}


def setup_compile_environment(args) -> dict:
    """Apply the global settings the compile flags ask for. Returns what was set (for logs and metadata)."""
    applied: dict = {}
    if getattr(args, "cuda_allow_tf32", False):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        applied["tf32"] = True
        logger.info("TF32 enabled for CUDA matmul and cuDNN (--cuda_allow_tf32)")
    if getattr(args, "cuda_cudnn_benchmark", False):
        torch.backends.cudnn.benchmark = True
        applied["cudnn_benchmark"] = True
        logger.info("cudnn.benchmark enabled (--cuda_cudnn_benchmark)")

    cudnn_sdp = getattr(args, "cudnn_sdp", "auto")
    if cudnn_sdp != "auto":
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp == "on")
        applied["cudnn_sdp"] = cudnn_sdp == "on"
        logger.info("cuDNN SDPA backend %s (--cudnn_sdp %s)", "allowed" if cudnn_sdp == "on" else "off", cudnn_sdp)
    elif _needs_cudnn_sdpa_workaround():
        torch.backends.cuda.enable_cudnn_sdp(False)
        applied["cudnn_sdp"] = False
        logger.info(
            "Disabled the cuDNN SDPA backend: its backward crashed FLUX.1 training on torch %s / CUDA %s / %s "
            "(illegal memory access); flash / memory-efficient attention are used instead (--cudnn_sdp on uses it)",
            torch.__version__,
            torch.version.cuda,
            torch.cuda.get_device_name(),
        )

    if not getattr(args, "compile", False):
        return applied

    import torch._inductor.config as inductor_config  # binds only the alias (a plain `import torch.x` would shadow torch)

    cache_dir = resolve_cache_dir(args)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    # inductor reads the variable at every cache access (cache_dir_utils.cache_dir), so setting it before the
    # first compile is enough (also replaces the /tmp default that importing torch._dynamo put there)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    inductor_config.fx_graph_cache = True
    try:
        import torch._functorch.config as functorch_config

        functorch_config.enable_autograd_cache = True
    except (ImportError, AttributeError):  # older torch: FX graph cache only
        pass
    _key_caches_by_sdpa_backends(inductor_config)
    applied["cache_dir"] = cache_dir
    logger.info("Persistent compile cache: %s", cache_dir)

    if cuda_graphs(args) == "blocks":
        from library.compile import recording

        if applied_speedups := recording.speed_up():
            applied["cuda_graph_recording"] = applied_speedups
            logger.info("CUDA-graph recording: %s (library.compile.recording)", ", ".join(applied_speedups))

    limit = getattr(args, "compile_cache_size_limit", 0) or 0
    if limit > 0:
        _set_recompile_limit(limit)
        applied["cache_size_limit"] = limit
        logger.info("torch._dynamo recompile limit set to %d", limit)

    # No torch recompile logging by default: its [__recompiles] lines (guard failures, several per new shape and
    # block) filled the console; ShapeLog says once per new input shape instead. TORCH_LOGS=recompiles shows them,
    # and torch warns itself when the recompile limit is hit.
    return applied


def _set_recompile_limit(limit: int) -> None:
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, limit)
    acc = "accumulated_recompile_limit" if hasattr(cfg, "accumulated_recompile_limit") else "accumulated_cache_size_limit"
    if hasattr(cfg, acc):
        # the accumulated limit bounds all entries of one code object; every compiled block shares Module._call_impl
        setattr(cfg, acc, max(getattr(cfg, acc), limit * 8))


def recompile_limit() -> int:
    cfg = torch._dynamo.config
    return getattr(cfg, "recompile_limit", None) or cfg.cache_size_limit


"""The process-wide settings of a run: TF32 / cuDNN switches, cuDNN attention and the recompile limit
(apply_process_settings, before any model loads or runs), and the compile's: the persistent compile cache (and its
key), cheaper CUDA-graph recording (setup_compile_environment)."""

from __future__ import annotations

import logging
import os
import threading
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


# families whose compiled training step was measured with cuDNN attention on torch 2.11 + CUDA 13 on Hopper
CUDNN_SDP_MEASURED = {
    "sdxl": "SDXL bs4 + GC 314.2 against 336.8 ms (run51)",
    "flux": "FLUX.1 1024 px + GC 446.6 against 523.6 ms with flash attention at the same peak memory (issue 25), each "
            "attention's gradient in one layout (library.families.flux.one_attention_grad_layout)",
}


def _text_encoders_may_train(args) -> bool:
    """Whether the run may train a text encoder (their attention runs eagerly, outside the compiled blocks)."""
    if any(getattr(args, flag, False) for flag in ("network_train_unet_only", "cache_text_encoder_outputs",
                                                  "cache_text_encoder_outputs_to_disk")):
        return False
    return getattr(args, "train_text_encoder", True) is not False  # sdxl_train.py's flag; LoRA trains them unless told


def cudnn_sdp_auto(args) -> tuple[bool, str]:
    """--cudnn_sdp auto on torch 2.11 + CUDA 13 on Hopper: (allowed, why).

    The crashes (docs/BENCHMARKS.md run17, run49-run57, run69: FLUX.1's attention backward, eager every time,
    compiled once) had one cause: torch caches cuDNN's backward plan by the q/k/v layout alone, while the plan holds
    the output gradient's layout too, and FLUX.1's single blocks hand back a sliced gradient where the double blocks
    hand back a contiguous one (tools/probe_cudnn_sdpa.py --grad_layouts). The FLUX.1 family now gives every
    attention one gradient layout. Auto still uses cuDNN attention only where it was measured: every attention
    backward inside inductor-compiled blocks of a family whose training ran clean and faster with it."""
    family = getattr(args, "_family", None)  # graphs.resolve's: Chroma apart from FLUX.1 (not measured)
    if not (getattr(args, "compile", False) and getattr(args, "compile_backend", None) == "inductor"):
        return False, ("measured only inside blocks compiled with --compile --compile_backend inductor (its backward "
                       "crashed eager FLUX.1 training before); --cudnn_sdp on forces it")
    if _text_encoders_may_train(args):
        return False, ("the text encoders may train, and their attention backward runs eagerly, where cuDNN's "
                       "was not measured (--network_train_unet_only or cached text-encoder outputs keep them frozen)")
    if family not in CUDNN_SDP_MEASURED:
        return False, (f"not measured for this model family ({family or 'unknown'}) on this torch/CUDA/GPU; "
                       "--cudnn_sdp on allows it")
    if getattr(args, "apply_t5_attn_mask", False):  # torch 2.11's cuDNN backward with a mask: pytorch#196678
        return False, ("not measured with an attention mask (--apply_t5_attn_mask), where torch 2.11's cuDNN "
                       "backward gives NaN gradients at some sequence lengths (pytorch/pytorch#196678); "
                       "--cudnn_sdp on allows it")
    return True, ("every attention backward of this run is inside the inductor-compiled blocks, where it ran clean "
                  f"and faster: {CUDNN_SDP_MEASURED[family]}; --cudnn_sdp off turns it off")


SDPA_CACHE_KEY = "sd-scripts.sdpa_backends"  # an entry of inductor's config, so part of every compile cache key
# torch's wrapper around an op that may draw random numbers and is recomputed in backward (SDPA, for its dropout):
# before torch 2.13 (pytorch#185562) the FX-graph cache left out every graph that holds it, so with
# --compile_checkpoint_keep inputs (SD3, Anima: attention recomputed) each start compiled every block again (SD3.5
# medium's warm restart 34.6 s against 41.5 s cold, run98; 7.6 s cached, run99). The RNG state is an input of the
# compiled graph, so its code is the same for any state (what torch's own change relies on).
RNG_WRAPPER = "torch.ops.higher_order.graphsafe_run_with_rng_state"


def _fill_cacheable_table(inductor_config) -> None:
    """Two entries in the marked-cacheable-functions table of inductor's config, which is part of the FX-graph and
    AOTAutograd cache keys. SDPA_CACHE_KEY: the attention backend is picked when a graph is traced, and torch's cache
    keys leave the backend switches out: a graph traced with cuDNN attention would come back from the cache in a run
    that turned it off (and crash where it crashed before); the entry names the switches. RNG_WRAPPER: graphs that
    hold torch's RNG-state wrapper are cached (the table's own purpose)."""
    table = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)
    if table is None:  # older torch: no such table (nor an AOTAutograd cache)
        return
    b = torch.backends.cuda
    state = (f"cudnn={int(b.cudnn_sdp_enabled())},flash={int(b.flash_sdp_enabled())},"
             f"efficient={int(b.mem_efficient_sdp_enabled())},math={int(b.math_sdp_enabled())}")
    inductor_config.unsafe_marked_cacheable_functions = {**table, SDPA_CACHE_KEY: state,
                                                         RNG_WRAPPER: "rng-state-is-a-graph-input"}


def _skip_rblock_rebenchmark(inductor_config) -> bool:
    """torch before 2.13 benchmarks the halved-RBLOCK variant it adds to register-heavy reductions
    (dynamic_scale_rblock) again in every process, cache or not (pytorch#181789, #189121), and near-tied winners
    can differ from one run to the next. Off unless TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK says otherwise: FLUX.1 from the
    compile line to step 2 28.5 -> 24.6 s cold, warm restarts 7.6 / 8.1 -> 6.4 / 7.9 s, steady step 429-432 ms either
    way (run96). Returns whether it was switched off."""
    if "TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK" in os.environ or _torch_version() >= (2, 13) or \
            not hasattr(inductor_config, "dynamic_scale_rblock"):
        return False
    inductor_config.dynamic_scale_rblock = False
    return True


def warm_compile_workers(args) -> bool:
    """Start inductor's pool of kernel-compile processes now (called before the models load), not at the first
    compile inside step 1: the processes start while the models load and the latents are cached. Only for an
    inductor compile on a CUDA GPU (the pool compiles triton kernels); returns whether it was started."""
    if not (getattr(args, "compile", False) and getattr(args, "compile_backend", None) == "inductor"
            and torch.cuda.is_available()):
        return False
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # another torch: the pool starts at the first compile, as before
        return False
    cache_dir = resolve_cache_dir(args)  # the workers start with it (setup_compile_environment sets it too)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    maybe_warm_pool()
    prefetch_triton_key()
    return True


def prefetch_triton_key() -> threading.Thread | None:
    """Hash triton's installation (triton.runtime.cache.triton_key, kept by an lru_cache; part of every compile-cache
    key) on a thread while the models load, not at the first cache lookup inside step 1: 0.5 s of a FLUX.1 warm
    restart on an H100 (py-spy, docs/BENCHMARKS.md session 20). Returns the thread, or None where triton or its
    cached key is missing."""
    try:
        from triton.runtime import cache as triton_cache
    except ImportError:
        return None
    key = getattr(triton_cache, "triton_key", None)
    if key is None or not hasattr(key, "cache_info"):
        return None

    def run():
        try:
            key()
        except Exception:  # the first cache lookup computes it again and reports what is wrong
            pass

    thread = threading.Thread(target=run, name="triton-key", daemon=True)
    thread.start()
    return thread


def _process_switches() -> dict:
    """torch's process-wide switches that the run's flags set (apply_process_settings)."""
    b, cfg = torch.backends, torch._dynamo.config
    return {"matmul_tf32": b.cuda.matmul.allow_tf32, "cudnn_tf32": b.cudnn.allow_tf32,
            "cudnn_benchmark": b.cudnn.benchmark, "cudnn_sdp": b.cuda.cudnn_sdp_enabled(),
            "recompile_limit": recompile_limit(),
            "accumulated_recompile_limit": getattr(cfg, _ACCUMULATED_LIMIT, None)}


def _set_process_switches(values: dict) -> None:
    b = torch.backends
    b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = values["matmul_tf32"], values["cudnn_tf32"]
    b.cudnn.benchmark = values["cudnn_benchmark"]
    b.cuda.enable_cudnn_sdp(values["cudnn_sdp"])
    cfg = torch._dynamo.config
    setattr(cfg, _RECOMPILE_LIMIT, values["recompile_limit"])
    if values["accumulated_recompile_limit"] is not None:
        setattr(cfg, _ACCUMULATED_LIMIT, values["accumulated_recompile_limit"])


def apply_process_settings(args) -> dict:
    """Set every process-wide torch switch a run's flags decide: TF32 (--cuda_allow_tf32), cudnn.benchmark
    (--cuda_cudnn_benchmark), cuDNN attention (--cudnn_sdp and its auto rule) and dynamo's recompile limit
    (--compile_cache_size_limit). args: the run's compile settings (graphs.compile_args), after graphs.resolve.

    library.run.setup calls it once per run, before any model loads or runs, so caching the latents and the
    text-encoder outputs, training and sampling all run under the same switches; and it starts from torch's values
    at import, so a run never inherits what an earlier run of the same process set. (run87: while the compile step
    set them, after the caching, the first trainer run of a process saved other weights than every later run with
    the same flags.) Returns what was set (for logs and metadata)."""
    _set_process_switches(_TORCH_SWITCHES_AT_IMPORT)
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

    cudnn_sdp = getattr(args, "cudnn_sdp", None)  # None: a script without the compile flags keeps torch's choice
    if cudnn_sdp in ("on", "off"):
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp == "on")
        applied["cudnn_sdp"] = cudnn_sdp == "on"
        logger.info("cuDNN SDPA backend %s (--cudnn_sdp %s)", "allowed" if cudnn_sdp == "on" else "off", cudnn_sdp)
    elif cudnn_sdp == "auto" and _needs_cudnn_sdpa_workaround():
        allowed, why = cudnn_sdp_auto(args)
        torch.backends.cuda.enable_cudnn_sdp(allowed)
        applied["cudnn_sdp"] = allowed
        logger.info("cuDNN attention (--cudnn_sdp auto) %s on torch %s / CUDA %s / %s: %s", "on" if allowed else "off",
                    torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), why)

    limit = getattr(args, "compile_cache_size_limit", 0) or 0
    if getattr(args, "compile", False) and limit > 0:
        _set_recompile_limit(limit)
        applied["cache_size_limit"] = limit
        logger.info("torch._dynamo recompile limit set to %d", limit)
    return applied


def setup_compile_environment(args) -> dict:
    """The compile's own settings (persistent cache, CUDA-graph recording), after apply_process_settings. Returns what
    was set (for logs and metadata)."""
    applied: dict = {}
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
        # torch leaves graphs with an autograd.Function out of its AOTAutograd cache unless told; dynamo traces the
        # Function's forward and backward into the graph, so the cache key covers them. Without this, a FLUX.1
        # warm restart traced its single blocks again (families.flux.one_attention_grad_layout; the fp8 base's
        # linear is another): 1.7 s of joint-graph tracing and 0.9 s of its passes in the first step.
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
    except (ImportError, AttributeError):  # older torch: FX graph cache only
        pass
    _fill_cacheable_table(inductor_config)
    if _skip_rblock_rebenchmark(inductor_config):
        applied["dynamic_scale_rblock"] = False
    applied["cache_dir"] = cache_dir
    logger.info("Persistent compile cache: %s", cache_dir)
    from library.compile import tracing

    if tracing.skip_unlogged_funcnames():
        applied["dynamo_tracing"] = "qualified-name lookups only for its trace logs (library.compile.tracing)"

    if cuda_graphs(args) == "blocks":
        from library.compile import recording

        if applied_speedups := recording.speed_up():
            applied["cuda_graph_recording"] = applied_speedups
            logger.info("CUDA-graph recording: %s (library.compile.recording)", ", ".join(applied_speedups))

    # No torch recompile logging by default: its [__recompiles] lines (guard failures, several per new shape and
    # block) filled the console; ShapeLog says once per new input shape instead. TORCH_LOGS=recompiles shows them,
    # and torch warns itself when the recompile limit is hit.
    return applied


# dynamo's names for them (older torch: cache_size_limit, accumulated_cache_size_limit)
_RECOMPILE_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
_ACCUMULATED_LIMIT = "accumulated_recompile_limit" if hasattr(torch._dynamo.config, "accumulated_recompile_limit") \
    else "accumulated_cache_size_limit"


def _set_recompile_limit(limit: int) -> None:
    cfg = torch._dynamo.config
    setattr(cfg, _RECOMPILE_LIMIT, limit)
    if hasattr(cfg, _ACCUMULATED_LIMIT):
        # the accumulated limit bounds all entries of one code object; every compiled block shares Module._call_impl
        setattr(cfg, _ACCUMULATED_LIMIT, max(getattr(cfg, _ACCUMULATED_LIMIT), limit * 8))


def recompile_limit() -> int:
    return getattr(torch._dynamo.config, _RECOMPILE_LIMIT)


_TORCH_SWITCHES_AT_IMPORT = _process_switches()  # what apply_process_settings starts every run from


def compile_cache_report() -> str | None:
    """What torch compiled so far in this process, and what came from the persistent compile cache, in words (None
    when nothing was compiled): dynamo traces every compiled graph again in a new process (no cache of its own in
    torch 2.11), then takes the AOTAutograd and FX-graph (inductor) results from the cache when their keys match. A
    warm restart that shows misses compiled again (another torch, other options, or another cache folder)."""
    from torch._dynamo import utils as dynamo_utils

    counters = dynamo_utils.counters
    graphs = counters["stats"].get("unique_graphs", 0)
    if not graphs:
        return None
    aot, inductor = counters["aot_autograd"], counters["inductor"]
    parts = [f"{graphs} graph{'s' if graphs != 1 else ''} compiled"]
    times = getattr(dynamo_utils, "compilation_time_metrics", {})  # seconds per timed phase (torch's table)
    if times.get("_compile.compile_inner"):
        parts[0] += (f" in {sum(times['_compile.compile_inner']):.1f} s (of it dynamo's tracing "
                     f"{sum(times.get('bytecode_tracing', [])):.1f} s)")
    if aot.get("autograd_cache_hit") or aot.get("autograd_cache_miss") or aot.get("autograd_cache_bypass"):
        parts.append(f"AOTAutograd cache {aot.get('autograd_cache_hit', 0)} hit, {aot.get('autograd_cache_miss', 0)} "
                     f"compiled, {aot.get('autograd_cache_bypass', 0)} bypassed")
    if inductor.get("fxgraph_cache_hit") or inductor.get("fxgraph_cache_miss") or inductor.get("fxgraph_cache_bypass"):
        parts.append(f"FX-graph cache {inductor.get('fxgraph_cache_hit', 0)} hit, "
                     f"{inductor.get('fxgraph_cache_miss', 0)} compiled, {inductor.get('fxgraph_cache_bypass', 0)} "
                     "bypassed")
    return "; ".join(parts)

"""torch.compile support for the SDXL and FLUX.1 trainers.

What the trainers call, in this order:

1. ``add_compile_arguments(parser)`` in ``setup_parser()``.
2. ``validate_compile_args(args)`` right after parsing, before any model loads: impossible settings raise
   ``CompileConfigError`` with a message that names the flags and the allowed values.
3. ``setup_compile_environment(args)``: TF32 / cuDNN flags, the persistent compile cache, the dynamo
   recompile limit, recompile logging, and the cuDNN SDPA work-around for torch 2.11 + CUDA 13 on Hopper.
4. ``compile_model_blocks(model, args, model_name=..., gradient_checkpointing=...)`` after
   ``accelerator.prepare`` (and after the LoRA network is applied): REGIONAL compilation, i.e. each repeated
   transformer block (diffusers' ``_repeated_blocks``) is compiled in place with ``module.compile()``. Identical
   blocks share one graph, so the cold compile takes seconds instead of minutes, LoRA modules inside the blocks
   are traced into the graph, and state_dict keys stay free of ``_orig_mod.``.
5. ``mark_step_begin(args)`` at the start of every optimizer step, i.e. at the first micro-step of each gradient
   accumulation window (``opens_accumulation_window``), and before each validation batch (CUDA graphs need it).
6. ``strip_orig_mod(state_dict)`` on every save path.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import types
from pathlib import Path

import torch
import torch._dynamo
from library.errors import CompileConfigError  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

BACKENDS = ("inductor", "cudagraphs", "eager", "aot_eager")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DYNAMIC_CHOICES = ("auto", "true", "false")
CUDNN_SDP_CHOICES = ("auto", "on", "off")  # --cudnn_sdp
# inductor modes that capture CUDA graphs (cudagraph trees)
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
MIN_TORCH = (2, 2)  # nn.Module.compile() (in-place compilation) appeared in torch 2.2

# Repeated blocks per model class, used when a model does not declare diffusers' `_repeated_blocks`.
_FALLBACK_REPEATED_BLOCKS = {
    "UNet2DConditionModel": ("BasicTransformerBlock",),
    "FluxTransformer2DModel": ("FluxTransformerBlock", "FluxSingleTransformerBlock"),
}


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


def add_compile_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("torch.compile")
    group.add_argument("--compile", action="store_true", help="compile the repeated transformer blocks with torch.compile")
    group.add_argument(
        "--compile_backend", type=str, default="inductor", choices=BACKENDS, help="torch.compile backend (default: inductor)"
    )
    group.add_argument(
        "--compile_mode",
        type=str,
        default="default",
        choices=MODES,
        help="inductor compile mode; reduce-overhead and max-autotune use CUDA graphs (default: default)",
    )
    group.add_argument(
        "--compile_dynamic",
        type=str,
        default="auto",
        choices=DYNAMIC_CHOICES,
        help="dynamic shapes: auto (the image-size dimensions of the blocks' inputs dynamic from the start, so "
        "bucket shapes share graphs; the rest as torch decides), true (all), false (static: each shape recompiles)",
    )
    group.add_argument("--compile_fullgraph", action="store_true", help="require each compiled block to be one graph")
    group.add_argument(
        "--compile_cache_size_limit",
        type=int,
        default=0,
        help="dynamo recompile limit per compiled function, 0 = torch default (8); raise it for many bucket shapes",
    )
    group.add_argument(
        "--compile_cache_dir",
        type=str,
        default=None,
        help="persistent inductor/FX/autograd compile cache so a second run starts warm; wins over "
        "TORCHINDUCTOR_CACHE_DIR (default: $TORCHINDUCTOR_CACHE_DIR if you set it, else "
        "$XDG_CACHE_HOME or ~/.cache, + /sd-scripts/torch_compile)",
    )
    group.add_argument(
        "--compile_checkpoint_keep",
        type=str,
        default="attention",
        choices=CHECKPOINT_KEEP_CHOICES,
        help="with --gradient_checkpointing, what is kept for backward instead of recomputed; each choice uses "
        "more memory for less recompute: attention (the compiled blocks' attention outputs; least memory), "
        "projections (also the outputs of their Linear layers no wider than their inputs, so only the MLP's "
        "widening projection is recomputed), resnets (projections, and a UNet's ResNets are not checkpointed; "
        "FLUX.1: as projections). On an H100, SDXL 1024 bs4 (--cuda_graph_step --cudnn_sdp on): 299 / 264 ms "
        "(attention / resnets) at 10.6 / 18.8 GiB; FLUX.1 1024: 581 / 521 ms (attention / projections) at 27.3 / "
        "33.8 GiB",
    )
    group.add_argument("--cuda_allow_tf32", action="store_true", help="allow TF32 matmul/cuDNN on Ampere or newer GPUs")
    group.add_argument("--cuda_cudnn_benchmark", action="store_true", help="enable cudnn.benchmark")
    group.add_argument(
        "--cudnn_sdp",
        type=str,
        default="auto",
        choices=CUDNN_SDP_CHOICES,
        help="cuDNN attention backend of scaled_dot_product_attention: auto (torch's choice, except off on torch "
        "2.11 + CUDA 13 on Hopper GPUs, where its backward crashed FLUX.1 training), on (allowed there too: on an "
        "H100 with cuDNN 9.19 a compiled FLUX.1 1024 px step took 514 instead of 584 ms, but an eager 512 px run "
        "still crashed in its first backward), off (never used)",
    )
    return parser


# ---------------------------------------------------------------------------------------------- upstream switches

# upstream's --dynamo_backend choices (accelerate's DynamoBackend names), default inductor
DYNAMO_BACKENDS = ("eager", "aot_eager", "inductor", "aot_ts_nvfuser", "nvprims_nvfuser", "cudagraphs", "ofi",
                   "fx2trt", "onnxrt", "tensort", "ipex", "tvm")


class _DynamoChoices(list):
    """Lists upstream's choices; also accepts "no" (any case): the kohya_ss GUI writes dynamo_backend = "no" into
    every run TOML, which upstream's TOML reader passes unchecked and which means "do not compile"."""

    def __contains__(self, value) -> bool:
        return (isinstance(value, str) and value.lower() == "no") or super().__contains__(value)


def add_torch_compile_arguments(parser: argparse.ArgumentParser) -> None:
    """kohya-ss/sd-scripts' switches: an upstream config that turns compile on gets regional compilation."""
    parser.add_argument("--torch_compile", action="store_true",
                        help="upstream's compile switch: regional compilation with --dynamo_backend "
                             "(same as --compile --compile_backend BACKEND)")
    parser.add_argument("--dynamo_backend", type=str, default="inductor", choices=_DynamoChoices(DYNAMO_BACKENDS),
                        help="backend of --torch_compile: inductor, aot_eager, eager or cudagraphs here "
                             "(no = do not compile)")


def _compile_defaults() -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False)
    add_compile_arguments(parser)
    return parser.parse_args([])


def apply_torch_compile_alias(args) -> None:
    """--torch_compile [--dynamo_backend B] -> regional compilation (--compile --compile_backend B), logged.

    Scripts with the compile flags (SDXL, FLUX.1) get them set; the SD1.x/SD2.x scripts, which have none, get
    the settings in args._torch_compile (compile_args reads them; the run TOML keeps only the upstream switches).
    Raises CompileConfigError for a backend that torch.compile does not have here."""
    if not getattr(args, "torch_compile", False):
        return
    backend = str(args.dynamo_backend)
    if backend.lower() == "no":
        return  # as upstream: compile switched on with no backend compiles nothing
    if backend not in BACKENDS:
        raise CompileConfigError(
            f"--dynamo_backend {backend}: not available with torch {torch.__version__} here; "
            f"use one of {', '.join(BACKENDS)} (or no)"
        )
    target = args if hasattr(args, "compile") else argparse.Namespace(**{**vars(_compile_defaults()), **vars(args)})
    if target.compile and target.compile_backend != backend:
        logger.info(f"--torch_compile --dynamo_backend {backend} ignored: --compile --compile_backend "
                    f"{target.compile_backend} is set")
        return
    target.compile = True
    target.compile_backend = backend
    if target is not args:
        validate_compile_args(target)
        args._torch_compile = target
    logger.info(f"--torch_compile/--dynamo_backend {backend}: using regional compilation "
                f"(--compile --compile_backend {backend})")


def compile_args(args):
    """The namespace with the compile settings of a run: args itself when the script has the compile flags, the
    one --torch_compile made for a script without them, else None."""
    if hasattr(args, "compile"):
        return args
    return getattr(args, "_torch_compile", None)


def dynamic_value(args) -> bool | None:
    """--compile_dynamic auto/true/false -> None/True/False for torch.compile."""
    return {"auto": None, "true": True, "false": False}[getattr(args, "compile_dynamic", "auto") or "auto"]


def uses_cuda_graphs(args) -> bool:
    """Whether the compiled blocks record CUDA graphs of their own (not under --cuda_graph_step: its graph of the
    whole step holds them)."""
    if not getattr(args, "compile", False) or getattr(args, "cuda_graph_step", False):
        return False
    if args.compile_backend == "cudagraphs":
        return True
    return args.compile_backend == "inductor" and args.compile_mode in CUDAGRAPH_MODES


def _torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def _cuda_in_use(args) -> bool:
    device = getattr(args, "device", None)
    if device is not None:
        return str(device).startswith("cuda")
    return torch.cuda.is_available()


def triton_problem() -> str | None:
    """Why inductor cannot make GPU kernels with triton here, in a few words, or None. Checked: installed, imports
    the way inductor imports it (a broken install or a DLL that does not load fails here, not an hour into a
    run), and a GPU triton supports (compute capability 7.0 or newer)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    try:
        import triton  # noqa: F401
        from torch._inductor.runtime import triton_compat  # noqa: F401  (inductor's own triton imports)
    except Exception as e:  # noqa: BLE001 - anything here means no working triton
        text = str(e).strip().splitlines()
        return f"triton does not load ({type(e).__name__}: {text[0] if text else 'no message'})"
    major, minor = torch.cuda.get_device_capability()
    if major < 7:
        return f"this GPU (compute capability {major}.{minor}) is older than triton supports (7.0)"
    return None


def _triton_install_hint() -> str:
    return "`pip install triton-windows`" if sys.platform == "win32" else "`pip install triton`"


def validate_compile_args(args) -> None:
    """Refuse impossible settings before any model loads. Raises CompileConfigError."""
    limit = getattr(args, "compile_cache_size_limit", 0) or 0
    if limit < 0:
        raise CompileConfigError(f"--compile_cache_size_limit must be 0 (torch default) or a positive integer, got {limit}")
    keep = getattr(args, "compile_checkpoint_keep", "attention")
    for flag, value, choices in (
        ("--compile_backend", args.compile_backend, BACKENDS),
        ("--compile_mode", args.compile_mode, MODES),
        ("--compile_dynamic", args.compile_dynamic, DYNAMIC_CHOICES),
        ("--compile_checkpoint_keep", keep, CHECKPOINT_KEEP_CHOICES),
    ):
        if value not in choices:
            raise CompileConfigError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")
    checkpoints_inside = getattr(args, "compile", False) and getattr(args, "gradient_checkpointing", False) and not \
        getattr(args, "cpu_offload_checkpointing", False)
    if keep != "attention" and not checkpoints_inside:
        logger.warning(f"--compile_checkpoint_keep {keep} has no effect: it applies with --compile and "
                       "--gradient_checkpointing (without --cpu_offload_checkpointing)")
    if not getattr(args, "compile", False):
        return

    if _torch_version() < MIN_TORCH:
        raise CompileConfigError(
            f"--compile needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} (installed: {torch.__version__}); "
            "upgrade torch or train without --compile"
        )
    if args.compile_backend != "inductor" and args.compile_mode != "default":
        raise CompileConfigError(
            f"--compile_mode {args.compile_mode} only applies to --compile_backend inductor "
            f"(got --compile_backend {args.compile_backend}); use --compile_mode default with this backend"
        )
    if args.compile_backend == "cudagraphs" and not _cuda_in_use(args):
        raise CompileConfigError(
            "--compile_backend cudagraphs records CUDA graphs and needs a CUDA GPU, and none is in use here; use "
            "--compile_backend inductor (or aot_eager / eager)"
        )
    if args.compile_backend in ("inductor", "cudagraphs") and _cuda_in_use(args):
        problem = triton_problem() if args.compile_backend == "inductor" else None
        if problem:
            fix = "" if problem.startswith("this GPU") else f"install it into this environment ({_triton_install_hint()}), "
            raise CompileConfigError(
                f"--compile_backend inductor on a CUDA GPU needs a working triton, and {problem}: {fix}or turn "
                "compile off (drop --compile; in the GUI untick Enable torch.compile), or use a --compile_backend "
                "that needs no triton: aot_eager, eager or cudagraphs"
            )

    blocks_to_swap = getattr(args, "blocks_to_swap", None) or 0
    if blocks_to_swap > 0:
        if uses_cuda_graphs(args):
            raise CompileConfigError(
                f"{_cuda_graph_flag(args)} captures CUDA graphs, which cannot follow blocks moving between CPU and GPU "
                f"(--blocks_to_swap {blocks_to_swap}); use --compile_mode default or max-autotune-no-cudagraphs "
                "with --compile_backend inductor, or --blocks_to_swap 0"
            )
        if args.compile_fullgraph:
            raise CompileConfigError(
                f"--compile_fullgraph cannot be used with --blocks_to_swap {blocks_to_swap}: block swap keeps the "
                "Linear layers out of the graph, which splits each block into several graphs; drop --compile_fullgraph"
            )
    if getattr(args, "cpu_offload_checkpointing", False) and uses_cuda_graphs(args):
        # the offloading checkpoint sits outside the compiled blocks and re-runs them in backward
        raise CompileConfigError(
            f"--cpu_offload_checkpointing re-runs the compiled blocks in backward, which CUDA graphs "
            f"({_cuda_graph_flag(args)}) cannot do; use --compile_mode default or max-autotune-no-cudagraphs, "
            "or drop --cpu_offload_checkpointing"
        )


def _cuda_graph_flag(args) -> str:
    return "--compile_backend cudagraphs" if args.compile_backend == "cudagraphs" else f"--compile_mode {args.compile_mode}"


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

    if uses_cuda_graphs(args):
        from library import cuda_graph_recording

        if applied_speedups := cuda_graph_recording.speed_up():
            applied["cuda_graph_recording"] = applied_speedups
            logger.info("CUDA-graph recording: %s (library.cuda_graph_recording)", ", ".join(applied_speedups))

    limit = getattr(args, "compile_cache_size_limit", 0) or 0
    if limit > 0:
        _set_recompile_limit(limit)
        applied["cache_size_limit"] = limit
        logger.info("torch._dynamo recompile limit set to %d", limit)

    # No torch recompile logging by default: its [__recompiles] lines (guard failures, several per new shape and
    # block) filled the console; ShapeLog says once per new input shape instead. TORCH_LOGS=recompiles shows them,
    # and torch warns itself when the recompile limit is hit.
    return applied


class ShapeLog:
    """One log line per new input shape of the compiled model during training: each new shape compiles new graphs
    (and, with CUDA graphs, records them), which is why those steps are slow."""

    def __init__(self, args):
        self.args = args
        self.shapes: set[tuple] = set()

    @staticmethod
    def shape_of(batch: dict) -> tuple | None:
        """The batch's input shape: its cached latents', else its images'; None when it has neither."""
        t = batch.get("latents")
        if t is None:
            t = batch.get("images")
        return None if t is None else tuple(t.shape)

    def see(self, batch: dict, step: int | None = None) -> bool:
        """Note the batch's input shape; True (and a log line, naming the step when given) when it is new."""
        shape = self.shape_of(batch)
        if shape is None or shape in self.shapes:
            return False
        self.shapes.add(shape)
        what = "compiles and records CUDA graphs" if uses_cuda_graphs(self.args) else "compiles"
        at = f" at step {step}" if step is not None else ""
        logger.info("torch.compile: new input shape %s%s (%d so far): this step %s for it",
                    "x".join(map(str, shape)), at, len(self.shapes), what)
        return True


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


# ---------------------------------------------------------------------------------------------- compilation


def repeated_block_names(model: torch.nn.Module) -> tuple[str, ...]:
    names = tuple(getattr(model, "_repeated_blocks", None) or ())
    if not names:
        names = _FALLBACK_REPEATED_BLOCKS.get(type(model).__name__, ())
    if not names:
        raise CompileConfigError(
            f"{type(model).__name__} declares no repeated blocks (_repeated_blocks); regional compilation "
            "does not know what to compile"
        )
    return names


def find_repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = repeated_block_names(model)
    return [m for m in model.modules() if type(m).__name__ in names]


def _attention_ops() -> set:
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    return {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}


_ATTENTION_OPS = _attention_ops()


_LINEAR_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}  # what nn.Linear runs as


def _linear_widths(op, args) -> tuple[int, int]:
    """(input, output) features of an mm / addmm call: its weight operand is (in, out)."""
    weight = args[1] if op is torch.ops.aten.mm.default else args[2]
    return weight.shape[0], weight.shape[1]


def _keeps_attention(op, args) -> bool:
    # Attention is the costliest op to recompute and its output is only as large as the hidden states. Not
    # recomputing it also keeps the graph free of the RNG-state wrapper that torch puts around recomputed SDPA
    # (which the FX graph cache cannot store).
    return op in _ATTENTION_OPS


def _keeps_projections(op, args) -> bool:
    # also the Linear outputs no wider than their inputs (q/k/v, output projections, the MLP's down projection):
    # only the MLP's widening projection is recomputed, the largest activation of a block
    if op in _LINEAR_OPS:
        width_in, width_out = _linear_widths(op, args)
        return width_out <= width_in
    return _keeps_attention(op, args)


def _checkpoint_context(keeps, version: str):
    """The context_fn of a selective checkpoint that saves the outputs `keeps` picks and recomputes the rest."""

    def policy(ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        return CheckpointPolicy.MUST_SAVE if keeps(op, args) else CheckpointPolicy.PREFER_RECOMPUTE

    def context():
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return create_selective_checkpoint_contexts(policy)

    # lets the AOTAutograd cache store graphs that use this policy (bump the version when the policy changes)
    context.cache_hash = f"sd-scripts/compile_utils/{version}"
    return context


# --compile_checkpoint_keep: what the checkpoint inside each compiled block saves (the rest is recomputed in backward);
# "resnets" saves what "projections" does and also stops diffusers' checkpointing outside the blocks (a UNet's ResNets)
_KEEP_PROJECTIONS = _checkpoint_context(_keeps_projections, "save-projections-v1")
CHECKPOINT_CONTEXTS = {
    "attention": _checkpoint_context(_keeps_attention, "save-attention-v1"),
    "projections": _KEEP_PROJECTIONS,
    "resnets": _KEEP_PROJECTIONS,
}
CHECKPOINT_KEEP_CHOICES = tuple(CHECKPOINT_CONTEXTS)


def _checkpointed_forward(self, *args, **kwargs):
    # One module-level function bound to every block, so all blocks share one traced graph.
    return torch.utils.checkpoint.checkpoint(
        self._forward_inside_checkpoint,
        *args,
        use_reentrant=False,
        preserve_rng_state=self._ckpt_rng,
        context_fn=self._ckpt_context,
        **kwargs,
    )


def _uses_dropout(block: torch.nn.Module) -> bool:
    """Whether a block draws random numbers in training (nn.Dropout, or a LoRA module's dropout settings)."""
    for m in block.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        for attr in ("dropout", "rank_dropout", "module_dropout"):
            v = getattr(m, attr, None)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                return True
    return False


@torch._dynamo.disable
def _eager_linear_forward(self, *args, **kwargs):
    return self._forward_outside_compile(*args, **kwargs)


def _keep_linear_out_of_graph(block: torch.nn.Module) -> int:
    count = 0
    for module in block.modules():
        if isinstance(module, torch.nn.Linear) and not hasattr(module, "_forward_outside_compile"):
            # keeps a LoRA forward that replaced Linear.forward (kohya style) as it is
            module._forward_outside_compile = module.forward
            module.forward = types.MethodType(_eager_linear_forward, module)
            count += 1
    return count


def _adapter_kind(layer: torch.nn.Module) -> str | None:
    """The class of the adapter whose forward replaced this layer's (kohya LoRA, LyCORIS), or None."""
    forward = layer.__dict__.get("forward")
    forward = getattr(layer, "_forward_outside_compile", forward)  # block swap keeps the adapter's forward here
    if forward is None:
        return None
    owner = getattr(forward, "__self__", None)
    if owner is layer:  # the layer's own patched forward (fp8 upcast), no adapter
        return None
    if owner is not None:  # an adapter that keeps its work out of the graph (networks.dylora) says so
        return type(owner).__name__ + (" eager: a graph break each" if getattr(owner, "eager_in_compile", False)
                                       else "")
    return getattr(forward, "__qualname__", "adapter").split(".")[0]  # a closure (FLUX split LoRA)


def adapter_kinds(root: torch.nn.Module) -> dict[str, int]:
    """Adapter class -> number of layers inside `root` whose forward an adapter replaced."""
    kinds: dict[str, int] = {}
    for module in root.modules():
        kind = _adapter_kind(module)
        if kind is not None:
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def count_adapters(root: torch.nn.Module) -> int:
    return sum(adapter_kinds(root).values())


def _move_checkpointing_inside(model: torch.nn.Module, names: tuple[str, ...]) -> int:
    """Turn off diffusers' checkpointing of the repeated blocks (their parents' flag); return how many parents had it on."""
    switched = 0
    for module in model.modules():
        if not getattr(module, "gradient_checkpointing", False):
            continue
        children = []
        for child in module.children():
            children.extend(child if isinstance(child, torch.nn.ModuleList) else [child])
        if any(type(c).__name__ in names for c in children):
            module.gradient_checkpointing = False
            switched += 1
    return switched


def _checkpointing_off(model: torch.nn.Module) -> int:
    """Turn off diffusers' checkpointing flags everywhere in `model`; return how many modules had it on."""
    switched = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False):
            module.gradient_checkpointing = False
            switched += 1
    return switched


# Inputs of the repeated blocks whose size follows the image size (the bucket), per block class: argument name ->
# dims (for a tuple argument, those dims of each tensor in it). With --compile_dynamic auto these dims are marked
# dynamic before each call, so the first graphs are already shape-generic: a new bucket shape needs no recompile
# (with CUDA graphs it still records its own graphs). Torch's automatic dynamic alone compiles the first shape
# static and recompiles each block kind once as dynamic at the second shape.
IMAGE_SIZE_DIMS = {
    # SDXL / SD: hidden_states (batch, H*W tokens, channels)
    "BasicTransformerBlock": {"hidden_states": (1,)},
    # FLUX.1: hidden_states (batch, image tokens, width); image_rotary_emb (cos, sin), each (text + image tokens, dim)
    "FluxTransformerBlock": {"hidden_states": (1,), "image_rotary_emb": (0,)},
    "FluxSingleTransformerBlock": {"hidden_states": (1,), "image_rotary_emb": (0,)},
}


def image_size_dims(block: torch.nn.Module) -> list[tuple[str, int, tuple[int, ...]]]:
    """(argument name, its position in the block's forward, dims) for each input of `block` that follows the image
    size; empty for a block class IMAGE_SIZE_DIMS does not know."""
    spec = IMAGE_SIZE_DIMS.get(type(block).__name__)
    if not spec:
        return []
    import inspect

    params = list(inspect.signature(type(block).forward).parameters)[1:]  # the class's forward, without self
    return [(name, params.index(name), dims) for name, dims in spec.items() if name in params]


class _MarkImageSizeDims:
    """A block's compiled call that first marks the image-size dims of its inputs dynamic (maybe_mark_dynamic: a dim
    that the graph needs static stays static, with no error). Set as the block's `_compiled_call_impl`, the function
    nn.Module.__call__ hands every call to once `module.compile()` ran, so the marks are made outside the graph."""

    def __init__(self, compiled_call, dims: list[tuple[str, int, tuple[int, ...]]]):
        self.compiled_call = compiled_call
        self.dims = dims

    def __call__(self, *args, **kwargs):
        for name, position, dims in self.dims:
            value = kwargs.get(name) if name in kwargs else (args[position] if position < len(args) else None)
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    for d in dims:
                        if d < t.dim():
                            torch._dynamo.maybe_mark_dynamic(t, d)
        return self.compiled_call(*args, **kwargs)


def compile_model_blocks(
    model: torch.nn.Module,
    args,
    *,
    model_name: str,
    gradient_checkpointing: bool = False,
    disable_linear: bool = False,
    offload_checkpointing: bool = False,
) -> int:
    """Compile the repeated transformer blocks of `model` in place; return the number of compiled blocks.

    gradient_checkpointing: checkpoint each block INSIDE its compiled region. diffusers' own checkpointing of
    these blocks (enable_gradient_checkpointing) would re-run the compiled forward during backward, which with
    CUDA graphs overwrites outputs that are still needed; it is switched off for these blocks (and a model that
    already had it on is treated as gradient_checkpointing=True). Call this after enable_gradient_checkpointing.
    disable_linear: keep Linear layers out of the graph (block swap moves their weights between devices).
    offload_checkpointing: --cpu_offload_checkpointing: the model's own (offloading) checkpoint function stays
    around each compiled block, which it re-runs in backward; nothing is checkpointed inside.
    """
    names = repeated_block_names(model)
    blocks = find_repeated_blocks(model)
    if not blocks:
        raise CompileConfigError(f"{model_name}: none of the repeated blocks {list(names)} were found in the model")

    from library import step_graph

    dynamic = dynamic_value(args)
    backend = args.compile_backend
    mode = step_graph.block_compile_mode(args)
    fullgraph = bool(args.compile_fullgraph)
    logger.info(
        f"Compiling {model_name} with torch.compile: backend={backend}, mode={mode}, dynamic={dynamic}, fullgraph={fullgraph}"
        + (f" (--compile_mode {args.compile_mode}: the blocks record no CUDA graphs of their own, --cuda_graph_step "
           "captures the whole step)" if mode != args.compile_mode else "")
    )

    if offload_checkpointing:
        gradient_checkpointing = False
    elif _move_checkpointing_inside(model, names):
        gradient_checkpointing = True
    keep = getattr(args, "compile_checkpoint_keep", "attention")
    if gradient_checkpointing and keep == "resnets" and _checkpointing_off(model):
        logger.info(f"{model_name}: the layers outside the compiled blocks (ResNets) are not checkpointed "
                    "(--compile_checkpoint_keep resnets)")
    if disable_linear:
        n_linear = sum(_keep_linear_out_of_graph(b) for b in blocks)
        logger.info(f"Block swap: {n_linear} Linear layers in the compiled blocks run outside the graph (torch._dynamo.disable)")

    compile_kwargs = dict(backend=backend, dynamic=dynamic, fullgraph=fullgraph)
    if backend == "inductor":
        compile_kwargs["mode"] = mode
    for block in blocks:
        if gradient_checkpointing and not hasattr(block, "_forward_inside_checkpoint"):
            # Saving/restoring the RNG state is only needed when the recompute draws random numbers (dropout).
            block._ckpt_rng = _uses_dropout(block)
            block._ckpt_context = CHECKPOINT_CONTEXTS[keep]
            block._forward_inside_checkpoint = block.forward
            block.forward = types.MethodType(_checkpointed_forward, block)
        block.compile(**compile_kwargs)
    marked = 0
    if dynamic is None:  # auto: the image-size dims dynamic from the first call (IMAGE_SIZE_DIMS)
        for block in blocks:
            dims = image_size_dims(block)
            if dims and getattr(block, "_compiled_call_impl", None) is not None:
                block._compiled_call_impl = _MarkImageSizeDims(block._compiled_call_impl, dims)
                marked += 1

    kinds = sorted({type(b).__name__ for b in blocks})
    logger.info(
        f"Compiled {len(blocks)} blocks of {model_name} ({', '.join(kinds)})"
        + (f", gradient checkpointing inside the compiled region (--compile_checkpoint_keep {keep})"
           if gradient_checkpointing else "")
        + (", inside checkpoints that keep their inputs in CPU memory" if offload_checkpointing else "")
        + (", image-size dimensions of their inputs dynamic (bucket shapes share the graphs)" if marked else "")
    )
    adapters: dict[str, int] = {}
    for block in blocks:
        for kind, n in adapter_kinds(block).items():
            adapters[kind] = adapters.get(kind, 0) + n
    if adapters:
        # the adapters replaced the layers' forward before compiling, so they are traced into each block's graph
        logger.info(f"{sum(adapters.values())} adapter layers ({', '.join(sorted(adapters))}) run inside the "
                    f"compiled blocks")
    return len(blocks)


def opens_accumulation_window(micro_steps: int, accumulation_steps: int) -> bool:
    """Whether the micro-step about to run is the first of an optimizer step's gradient accumulation window.

    micro_steps: accelerate's micro-step counter before the batch (``Accelerator.step``): it counts the batches
    run through ``accumulate()``, syncs when it reaches a multiple of the accumulation steps, restarts at 0 after
    the last batch of an epoch (which cuts that epoch's last window short) and is restored on --resume.
    Only this micro-step may call ``mark_step_begin``: marking a later one tells CUDA graph trees that the
    previous micro-step's outputs are dead, and its replay overwrites the gradients still being accumulated
    ("accessing tensor output of CUDAGraphs that has been overwritten by a subsequent run").
    """
    return micro_steps % max(1, accumulation_steps) == 0


def mark_step_begin(args) -> None:
    """Call at the start of each optimizer step (see opens_accumulation_window): tells CUDA graph trees that the
    previous step's outputs are done. args: the compile settings (compile_args(args)); None = no compile."""
    if uses_cuda_graphs(args) and torch.cuda.is_available():
        torch.compiler.cudagraph_mark_step_begin()


def strip_orig_mod(state_dict: dict) -> dict:
    """Remove the `_orig_mod.` segments that torch.compile(module) wrappers put into state_dict keys."""
    if not any("_orig_mod." in k for k in state_dict):
        return state_dict
    return {k.replace("_orig_mod.", ""): v for k, v in state_dict.items()}


def compile_settings_metadata(args) -> dict[str, str]:
    """ss_* metadata describing the compile settings of a run."""
    return {
        "ss_compile": str(bool(getattr(args, "compile", False))),
        "ss_compile_backend": str(args.compile_backend),
        "ss_compile_mode": str(args.compile_mode),
        "ss_compile_dynamic": str(args.compile_dynamic),
        "ss_compile_fullgraph": str(bool(args.compile_fullgraph)),
        "ss_compile_cache_size_limit": str(args.compile_cache_size_limit or 0),
    }

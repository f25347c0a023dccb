"""The compile flags: declaration, the upstream switches (--torch_compile / --dynamo_backend), validation before any
model loads, and the run's metadata."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys

import torch

from library.compile.checkpoint import KEEP_CHOICES
from library.compile.graphs import compile_args, cuda_graph_flag, cuda_graphs  # noqa: F401  (compile_args re-exported)
from library.errors import CompileConfigError  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

BACKENDS = ("inductor", "cudagraphs", "eager", "aot_eager")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DYNAMIC_CHOICES = ("auto", "true", "false")
CUDNN_SDP_CHOICES = ("auto", "on", "off")  # --cudnn_sdp

MIN_TORCH = (2, 2)  # nn.Module.compile() (in-place compilation) appeared in torch 2.2


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
        help="dynamic shapes: auto (static when the dataset has one bucket shape; with several the image-size "
        "dimensions of the blocks' inputs dynamic from the start, so bucket shapes share graphs, the rest as torch "
        "decides), true (all), false (static: each shape recompiles)",
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
        default="auto",
        choices=KEEP_CHOICES,
        help="with --gradient_checkpointing, what is kept for backward instead of recomputed; each choice uses "
        "more memory for less recompute: inputs (only each compiled block's inputs, everything recomputed, as "
        "eager checkpointing; least memory), attention (also the compiled blocks' attention outputs), "
        "projections (also the outputs of their Linear layers no wider than their inputs, so only the MLP's "
        "widening projection is recomputed), resnets (projections, and a UNet's ResNets are not checkpointed; "
        "FLUX.1: as projections); auto (default): FLUX.1 projections, SDXL resnets from batch size 2, each when "
        "the GPU's free memory at the compile holds twice what they keep more (scaled by batch and image size) "
        "+ 4 GiB, else attention; Chroma, SD3 and Anima inputs, the only choice at upstream's memory or less "
        "(keeping more took more memory than upstream's training; Chroma with inputs is still 2.4x upstream's "
        "step); one log line says which. On an H100, SDXL 1024 bs1: 114 / 100 ms (attention / resnets) at 7.1 / "
        "9.2 GiB; bs4 (--cuda_graph_step --cudnn_sdp on): 299 / 264 ms (attention / resnets) at 10.6 / 18.8 GiB; "
        "FLUX.1 1024: 581 / 521 ms (attention / projections) at 27.3 / 33.8 GiB; Chroma 1024: 477 / 451 / 417 ms "
        "(inputs / attention / projections) at 19.6 / 21.0 / 25.4 GiB",
    )
    group.add_argument("--cuda_allow_tf32", action="store_true", help="allow TF32 matmul/cuDNN on Ampere or newer GPUs")
    group.add_argument("--cuda_cudnn_benchmark", action="store_true", help="enable cudnn.benchmark")
    group.add_argument(
        "--cudnn_sdp",
        type=str,
        default="auto",
        choices=CUDNN_SDP_CHOICES,
        help="cuDNN attention backend of scaled_dot_product_attention: auto (torch's choice; on torch 2.11 + CUDA 13 "
        "on Hopper GPUs on only when every attention backward runs inside inductor-compiled blocks of FLUX.1 or "
        "SDXL (text encoders not trained), where it was measured clean and faster: a FLUX.1 1024 px step 447 "
        "instead of 524 ms on an H100; one log line says which), on (allowed everywhere), off (never used)",
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
    """--torch_compile [--dynamo_backend B] -> regional compilation (--compile --compile_backend B); run by
    train_util.normalise_args. check_torch_compile_alias logs the outcome (once the console log is set up) and
    refuses a backend torch.compile lacks here, which this leaves as it is.

    Scripts with the compile flags (SDXL, FLUX.1) get them set; the SD1.x/SD2.x scripts, which have none, get
    the settings in args._torch_compile (compile_args reads them; the run TOML keeps only the upstream switches)."""
    if not getattr(args, "torch_compile", False):
        return
    backend = str(args.dynamo_backend)
    if backend.lower() == "no" or backend not in BACKENDS:
        return  # "no", as upstream: compile switched on with no backend compiles nothing
    target = args if hasattr(args, "compile") else argparse.Namespace(**{**vars(_compile_defaults()), **vars(args)})
    if target.compile and target.compile_backend != backend:
        return  # --compile --compile_backend wins
    target.compile = True
    target.compile_backend = backend
    if target is not args:
        args._torch_compile = target


def check_torch_compile_alias(args) -> None:
    """Logs what apply_torch_compile_alias made of --torch_compile; raises CompileConfigError for a
    --dynamo_backend that torch.compile does not have here, and for the SD1.x/SD2.x scripts' --torch_compile
    settings (the other scripts check their --compile flags themselves)."""
    if not getattr(args, "torch_compile", False):
        return
    backend = str(args.dynamo_backend)
    if backend.lower() == "no":
        return
    if backend not in BACKENDS:
        raise CompileConfigError(
            f"--dynamo_backend {backend}: not available with torch {torch.__version__} here; "
            f"use one of {', '.join(BACKENDS)} (or no)"
        )
    settings = compile_args(args)
    if settings.compile_backend != backend:
        logger.info(f"--torch_compile --dynamo_backend {backend} ignored: --compile --compile_backend "
                    f"{settings.compile_backend} is set")
        return
    if settings is not args:
        validate_compile_args(settings)
    logger.info(f"--torch_compile/--dynamo_backend {backend}: using regional compilation "
                f"(--compile --compile_backend {backend})")


def dynamic_value(args) -> bool | None:
    """--compile_dynamic auto/true/false -> None/True/False for torch.compile. auto is False (static graphs, which
    run faster) when the dataset has one bucket shape (graphs.resolve notes it before the model is compiled), else
    None (the image-size dims marked dynamic: regional.compile_model_blocks). With one bucket shape where the text
    length follows each batch's captions (the family sets `_text_length_varies`): None, torch's automatic dynamic
    (static graphs, one recompile with the length symbolic at a second length), not a static graph per length."""
    setting = getattr(args, "compile_dynamic", "auto") or "auto"
    if setting == "auto" and getattr(args, "_input_shapes", None) == 1:
        return None if getattr(args, "_text_length_varies", False) else False
    return {"auto": None, "true": True, "false": False}[setting]


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
    keep = getattr(args, "compile_checkpoint_keep", "auto")
    for flag, value, choices in (
        ("--compile_backend", args.compile_backend, BACKENDS),
        ("--compile_mode", args.compile_mode, MODES),
        ("--compile_dynamic", args.compile_dynamic, DYNAMIC_CHOICES),
        ("--compile_checkpoint_keep", keep, KEEP_CHOICES),
    ):
        if value not in choices:
            raise CompileConfigError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")
    checkpoints_inside = getattr(args, "compile", False) and getattr(args, "gradient_checkpointing", False) and not \
        getattr(args, "cpu_offload_checkpointing", False)
    if keep not in ("auto", "attention") and not checkpoints_inside:
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
        if cuda_graphs(args) == "blocks":
            raise CompileConfigError(
                f"{cuda_graph_flag(args)} captures CUDA graphs, which cannot follow blocks moving between CPU and GPU "
                f"(--blocks_to_swap {blocks_to_swap}); use --compile_mode default or max-autotune-no-cudagraphs "
                "with --compile_backend inductor, or --blocks_to_swap 0"
            )
        if args.compile_fullgraph:
            raise CompileConfigError(
                f"--compile_fullgraph cannot be used with --blocks_to_swap {blocks_to_swap}: block swap keeps the "
                "Linear layers out of the graph, which splits each block into several graphs; drop --compile_fullgraph"
            )
    if getattr(args, "cpu_offload_checkpointing", False) and cuda_graphs(args) == "blocks":
        # the offloading checkpoint sits outside the compiled blocks and re-runs them in backward
        raise CompileConfigError(
            f"--cpu_offload_checkpointing re-runs the compiled blocks in backward, which CUDA graphs "
            f"({cuda_graph_flag(args)}) cannot do; use --compile_mode default or max-autotune-no-cudagraphs, "
            "or drop --cpu_offload_checkpointing"
        )



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

"""Which CUDA graphs a run records, decided in one place (``cuda_graphs``), and the --cuda_graph_step option.

Three kinds of run: the whole training step as one graph (--cuda_graph_step, library.compile.step_graph), which
holds the compiled blocks, so these are compiled without graphs of their own; compiled blocks that record their
own graphs (cudagraph trees: --compile_backend cudagraphs, or inductor's reduce-overhead / max-autotune); none.
"""

from __future__ import annotations

import torch

from library.compile.step_graph import WARMUP

# inductor modes that capture CUDA graphs (cudagraph trees)
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
# --compile_mode values whose blocks would record CUDA graphs of their own -> the same mode without them
_BLOCK_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def step_graph_on(args) -> bool:
    return bool(getattr(args, "cuda_graph_step", False))


def cuda_graphs(args) -> str | None:
    """The one answer to "are CUDA graphs in use?": "step" (--cuda_graph_step: one graph of the whole training
    step), "blocks" (the compiled blocks record graphs of their own) or None. args: the run's settings or its
    compile settings (options.compile_args); None = no compile."""
    if args is None:
        return None
    if step_graph_on(args):
        return "step"
    if not getattr(args, "compile", False):
        return None
    if args.compile_backend == "cudagraphs":
        return "blocks"
    return "blocks" if args.compile_backend == "inductor" and args.compile_mode in CUDAGRAPH_MODES else None


def cuda_graph_flag(args) -> str:
    """The flag that makes the compiled blocks record CUDA graphs, for messages."""
    return "--compile_backend cudagraphs" if args.compile_backend == "cudagraphs" else f"--compile_mode {args.compile_mode}"


def add_arguments(parser) -> None:
    parser.add_argument(
        "--cuda_graph_step", action="store_true",
        help="capture the whole training step (forward, backward, optimizer step) as one CUDA graph after its first "
             f"{WARMUP} steps per batch shape and replay it: no per-step Python overhead at small batch sizes. Needs "
             "one CUDA GPU, cached latents and text-encoder outputs, AdamW/Adam and no gradient accumulation")


def check_args(args, error: type[Exception]) -> None:
    """Settings the step graph cannot follow, before any model loads (raises `error`)."""
    if not step_graph_on(args):
        return
    from library import optimizers

    def refuse(why: str) -> None:
        raise error(f"--cuda_graph_step {why}; drop --cuda_graph_step or change that setting")

    if args.gradient_accumulation_steps > 1:
        refuse(f"replays one whole optimizer step, so it cannot accumulate gradients "
               f"(--gradient_accumulation_steps {args.gradient_accumulation_steps})")
    if not (args.cache_latents or args.cache_latents_to_disk):
        refuse("needs cached latents (--cache_latents or --cache_latents_to_disk): encoding images checks them on "
               "the host each step")
    if not (getattr(args, "cache_text_encoder_outputs", False) or
            getattr(args, "cache_text_encoder_outputs_to_disk", False)):
        refuse("needs cached text-encoder outputs (--cache_text_encoder_outputs or "
               "--cache_text_encoder_outputs_to_disk): captions are tokenized on the host each step")
    if args.mixed_precision == "fp16":
        refuse("cannot replay fp16's loss scaling, which checks the gradients on the host (--mixed_precision fp16); "
               "use bf16")
    for flag in ("fused_backward_pass", "cpu_offload_checkpointing"):
        if getattr(args, flag, False):
            refuse(f"cannot capture --{flag}")
    if (getattr(args, "blocks_to_swap", None) or 0) > 0:
        refuse(f"cannot capture blocks moving between CPU and GPU (--blocks_to_swap {args.blocks_to_swap})")
    if getattr(args, "compile", False) and args.compile_backend == "cudagraphs":
        refuse("holds the compiled blocks in its own CUDA graph: use --compile_backend inductor, not cudagraphs")
    name = optimizers.canonical_name(optimizers.optimizer_type(args)) or optimizers.optimizer_type(args)
    given = optimizers.parse_optimizer_args(args.optimizer_args)
    if name not in ("AdamW", "Adam") or {"fused", "foreach", "differentiable"} & given.keys():
        refuse(f"needs torch's AdamW or Adam in its fused form (--optimizer_type AdamW, no fused/foreach/"
               f"differentiable in --optimizer_args); got --optimizer_type {optimizers.optimizer_type(args)}"
               + (f" with {sorted(given)}" if given else ""))
    if not torch.cuda.is_available():
        refuse("needs a CUDA GPU, and none is available")


def block_compile_mode(args) -> str:
    """The --compile_mode the blocks are compiled with: without their own CUDA graphs under the step graph."""
    mode = args.compile_mode
    if step_graph_on(args) and mode in _BLOCK_MODES:
        return _BLOCK_MODES[mode]
    return mode


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
    if cuda_graphs(args) == "blocks" and torch.cuda.is_available():
        torch.compiler.cudagraph_mark_step_begin()

"""Which CUDA graphs a run records, decided in one place (``cuda_graphs``), and the --cuda_graph_step option.

Three kinds of run: the whole training step as one graph (--cuda_graph_step, library.compile.step_graph), which
holds the compiled blocks, so these are compiled without graphs of their own; compiled blocks that record their
own graphs (cudagraph trees: --compile_backend cudagraphs, or inductor's reduce-overhead / max-autotune); none.
"""

from __future__ import annotations

import logging

import torch

from library.compile.step_graph import WARMUP

logger = logging.getLogger(__name__)

# inductor modes that capture CUDA graphs (cudagraph trees)
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
# --compile_mode values whose blocks would record CUDA graphs of their own -> the same mode without them
_BLOCK_MODES = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def step_graph_setting(args) -> str:
    """--cuda_graph_step as auto / on / off; true / false (the flag before it had auto, and files that say so) read
    as on / off."""
    value = getattr(args, "cuda_graph_step", "off")
    if isinstance(value, bool) or value in ("true", "false"):
        return "on" if value in (True, "true") else "off"
    return value or "off"


def step_graph_on(args) -> bool:
    """Whether the run uses the step graph: on, or auto once `resolve` decided for it."""
    setting = step_graph_setting(args)
    return setting == "on" or (setting == "auto" and bool(getattr(args, "_step_graph_auto", False)))


def compile_args(args):
    """The namespace with the compile settings of a run: args itself when the script has the compile flags, the
    one --torch_compile made for a script without them, else None."""
    if hasattr(args, "compile"):
        return args
    return getattr(args, "_torch_compile", None)


def cuda_graphs(args) -> str | None:
    """The one answer to "are CUDA graphs in use?": "step" (--cuda_graph_step: one graph of the whole training
    step), "blocks" (the compiled blocks record graphs of their own) or None. args: the run's settings or its
    compile settings (compile_args); None = no compile."""
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


CHOICES = ("auto", "on", "off")
# torch's optimizers that the captured graph steps itself (capturable, the learning rate read from a tensor). Others
# step after the replay: a Prodigy stepped inside the graph with its numbers as float64 device tensors took 351.7 ms
# a step against 116.1 ms after it (SDXL bs1 + GC, docs/BENCHMARKS.md run83)
IN_GRAPH_OPTIMIZERS = ("AdamW", "Adam")
# optimizers that read host values each step (step counters, adaptive rates): the graph holds forward, backward
# and clipping, and their step runs after each replay; auto uses the step graph with these (each shown to train
# to the same weights as the ordinary step on a GPU: tests/test_step_graph_gpu.py)
AFTER_GRAPH_OPTIMIZERS = ("AdamW8bit", "Lion8bit", "SGDNesterov8bit", "Lion", "Prodigy", "AdaFactor", "DAdaptation",
                          "DAdaptAdam", "DAdaptLion", "AdamWScheduleFree", "RAdamScheduleFree", "SGDScheduleFree",
                          "SGDNesterov")
# families where auto leaves it off, and why
AUTO_OFF_FAMILIES = {"flux": "FLUX.1: GPU-bound at its sizes, its step was slower with the step graph "
                             "(docs/BENCHMARKS.md, run46/run47)",
                     "hunyuan_image": "HunyuanImage 2.1: its forward trims the text to the batch's valid tokens, "
                                      "counted on the host (a capture fails there)",
                     "lumina": "Lumina 2: its forward counts each caption's valid tokens on the host to place the "
                               "image tokens (a capture fails there; run97)"}


def _setting_type(value: str) -> str:
    value = value.lower()
    return {"true": "on", "false": "off"}.get(value, value)


def add_arguments(parser) -> None:
    parser.add_argument(
        "--cuda_graph_step", type=_setting_type, nargs="?", const="on", default="auto", choices=CHOICES,
        help="capture the whole training step (forward, backward, optimizer step) as one CUDA graph after its first "
             f"{WARMUP} steps per batch shape and replay it: no per-step Python overhead at small batch sizes. Needs "
             "CUDA (one GPU, or one per process of a data-parallel run) and cached latents and text-encoder outputs "
             "(with gradient accumulation a micro-step that ends the window and one that does not are two graphs); "
             "optimizers other than AdamW/Adam step after the graph. auto (default): on where it can follow and was "
             "measured faster (SDXL with --compile, SD1.x and SD2.x with --torch_compile, one bucket shape; on several "
             "GPUs too), else off with a log line saying why; on (also the bare flag): always, refused where it cannot "
             "follow; off: never")


def optimizer_in_graph(args) -> bool:
    """Whether the step graph holds the optimizer step too (torch's fusable AdamW/Adam), or the step runs after it."""
    from library import optimizers

    name = optimizers.canonical_name(optimizers.optimizer_type(args))
    given = optimizers.parse_optimizer_args(args.optimizer_args)
    return name in IN_GRAPH_OPTIMIZERS and not {"fused", "foreach", "differentiable"} & given.keys()


def blocker(args, num_processes: int = 1) -> str | None:
    """Why the step graph cannot follow this run, or None."""
    if not (args.cache_latents or args.cache_latents_to_disk):
        return ("needs cached latents (--cache_latents or --cache_latents_to_disk): encoding images checks them on "
                "the host each step")
    if not (getattr(args, "cache_text_encoder_outputs", False) or
            getattr(args, "cache_text_encoder_outputs_to_disk", False)):
        return ("needs cached text-encoder outputs (--cache_text_encoder_outputs or "
                "--cache_text_encoder_outputs_to_disk): captions are tokenized on the host each step")
    if args.mixed_precision == "fp16":
        return ("cannot replay fp16's loss scaling, which checks the gradients on the host (--mixed_precision fp16); "
                "use bf16")
    for flag in ("fused_backward_pass", "cpu_offload_checkpointing"):
        if getattr(args, flag, False):
            return f"cannot capture --{flag}"
    if (getattr(args, "blocks_to_swap", None) or 0) > 0:
        return f"cannot capture blocks moving between CPU and GPU (--blocks_to_swap {args.blocks_to_swap})"
    if getattr(args, "multires_noise_iterations", None):
        return ("cannot replay --multires_noise_iterations, whose noise level sizes are drawn on the host each step")
    if _module_dropout(args) > 0:
        return ("cannot replay LoRA's module_dropout, which draws on the host each step which modules to leave out "
                "(--network_args module_dropout)")
    if getattr(args, "compile", False) and args.compile_backend == "cudagraphs":
        return "holds the compiled blocks in its own CUDA graph: use --compile_backend inductor, not cudagraphs"
    for flag in ("fsdp", "deepspeed"):  # their collectives run in hooks and engines the step graph cannot capture
        if getattr(args, flag, None):
            return f"cannot capture --{flag}'s sharded training; without it, data parallel works"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU, and none is available"
    return None


def _module_dropout(args) -> float:
    """--network_args module_dropout (0 where unset or not a number: the network module names that error)."""
    from library.network_options import parse_network_args

    try:
        return float(parse_network_args(getattr(args, "network_args", None)).get("module_dropout") or 0)
    except ValueError:
        return 0.0


def check_args(args, error: type[Exception]) -> None:
    """--cuda_graph_step on: settings it cannot follow, before any model loads (raises `error`)."""
    if step_graph_setting(args) != "on":
        return
    why = blocker(args)
    if why:
        raise error(f"--cuda_graph_step {why}; drop --cuda_graph_step or change that setting")


def bucket_shapes(groups) -> int:
    """How many image sizes (bucket resolutions) the datasets of these groups (training, validation) hold."""
    return len({reso for g in groups for d in g.datasets for reso in d.buckets})


def resolve(args, groups, num_processes: int, family: str, error: type[Exception]) -> None:
    """Once the dataset's buckets are known, before the model is compiled: decides --cuda_graph_step auto and
    notes the number of input shapes for --compile_dynamic auto (options.dynamic_value: static for one shape), on
    args and on the compile settings (compile_args). One log line says what auto chose and why."""
    shapes = bucket_shapes(groups)
    compiled = compile_args(args)
    setting = step_graph_setting(args)
    why = blocker(args, num_processes) if setting != "off" else None
    if setting == "on" and why:
        raise error(f"--cuda_graph_step {why}; drop --cuda_graph_step or change that setting")
    on = setting == "on"
    if setting == "auto":
        from library import optimizers

        name = optimizers.optimizer_type(args)
        if why is None and family in AUTO_OFF_FAMILIES:
            why = f"is left off for {AUTO_OFF_FAMILIES[family]}"
        if why is None and not getattr(compiled, "compile", False):
            why = "is left off without --compile: measured only with the compiled blocks (docs/BENCHMARKS.md)"
        if why is None and shapes > 1:
            why = (f"is left off for {shapes} bucket shapes: each would keep a graph's memory "
                   "(--cuda_graph_step on captures them)")
        if why is None and optimizers.canonical_name(name) not in IN_GRAPH_OPTIMIZERS + AFTER_GRAPH_OPTIMIZERS:
            why = (f"is left off for --optimizer_type {name}" + (f" with --optimizer_args {' '.join(args.optimizer_args)}"
                   if args.optimizer_args else "") + ": not shown to train as without it")
        on = why is None
        if on:
            how = "the optimizer step inside the graph" if optimizer_in_graph(args) else \
                f"the {name} step after each replay"
            if args.gradient_accumulation_steps > 1:
                how += (f"; {args.gradient_accumulation_steps} micro-steps a step: one graph for those that accumulate "
                        "gradients, one for the window's last")
            if num_processes > 1:
                how += f"; the gradients averaged over the {num_processes} processes inside it"
            logger.info("--cuda_graph_step auto: on (forward, backward and clipping as one CUDA graph, %s)", how)
        else:
            logger.info("--cuda_graph_step auto: off; the step graph %s", why)
    resos = {reso for g in groups for d in g.datasets for reso in d.buckets}
    for target in {id(t): t for t in (args, compiled) if t is not None}.values():
        target._step_graph_auto = on
        target._input_shapes = shapes
        # --cudnn_sdp auto and --compile_checkpoint_keep auto follow what was measured on this model (Chroma apart
        # from FLUX.1, whose scripts it runs in)
        target._family = "chroma" if getattr(args, "model_type", None) == "chroma" else family
        target._max_pixels = max((w * h for w, h in resos), default=None)  # --compile_checkpoint_keep auto


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

"""Gradient checkpointing inside the compiled blocks, and what it keeps for backward (--compile_checkpoint_keep)."""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

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


def _keeps_inputs(op, args) -> bool:
    # nothing inside the block: only its inputs stay (the checkpoint's own), every op is recomputed in backward
    return False


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


def _policy(keeps, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if keeps(op, args) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context(keeps):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(functools.partial(_policy, keeps))


def _checkpoint_context(keeps, version: str) -> functools.partial:
    """The context_fn of a selective checkpoint that saves the outputs `keeps` picks and recomputes the rest.

    A partial of module-level functions (dynamo takes functions and partials as context_fn): it pickles by
    reference. Inductor pickles the cache key, and a closure there made the AOTAutograd cache bypass every
    checkpointed graph ("Can't pickle local object"), so a warm restart traced and partitioned them again.
    `cache_hash` lets the AOTAutograd cache store graphs that use it (bump the version when the policy changes).
    """
    context = functools.partial(_selective_context, keeps)
    context.cache_hash = f"sd-scripts/compile_utils/{version}"
    return context


# --compile_checkpoint_keep: what the checkpoint inside each compiled block saves (the rest is recomputed in backward);
# "resnets" saves what "projections" does and also stops diffusers' checkpointing outside the blocks (a UNet's ResNets)
_KEEP_PROJECTIONS = _checkpoint_context(_keeps_projections, "save-projections-v1")
CHECKPOINT_CONTEXTS = {
    "inputs": _checkpoint_context(_keeps_inputs, "save-inputs-v1"),
    "attention": _checkpoint_context(_keeps_attention, "save-attention-v1"),
    "projections": _KEEP_PROJECTIONS,
    "resnets": _KEEP_PROJECTIONS,
}
CHECKPOINT_KEEP_CHOICES = tuple(CHECKPOINT_CONTEXTS)
KEEP_CHOICES = ("auto",) + CHECKPOINT_KEEP_CHOICES  # the option's choices

# --compile_checkpoint_keep auto: per family, the faster choice that keeps more, and what it kept more than
# "attention" at the measured size (one H100, docs/BENCHMARKS.md run54-run62): GiB at that many tokens a sample
# (tokens = pixels / pixels_per_token + text_tokens; the kept outputs grow with the tokens and the batch)
AUTO_KEEP = {
    # FLUX.1 1024 px bs1: 27.28 -> 33.75 GiB, 581 -> 521 ms (flash) / 511 -> 451 ms (cuDNN attention)
    "flux": dict(choice="projections", extra_gib=6.47, tokens=4096 + 512, pixels_per_token=256, text_tokens=512),
    # SDXL 1024 px bs4: 10.56 -> 18.76 GiB, 298.7 -> 264.3 ms
    "sdxl": dict(choice="resnets", extra_gib=8.2 / 4, tokens=16384, pixels_per_token=64, text_tokens=0,
                 # bs1 keeps attention: 114.0 ms at 7.13 GiB meets issue 25's bs1 + GC target (<= 130 ms under
                 # 8 GiB); resnets' 99.8 ms needs 9.16 GiB (run80). From bs2 attention alone needs about 8.3 GiB
                 # (between bs1's 7.13 and bs4's 10.56), so no choice fits that bound and the faster one is taken
                 min_batch=2, below_min_batch="at 1024 px bs1 + GC it took 114 ms at 7.1 GiB against resnets' 100 ms "
                                                "at 9.2 GiB (H100)"),
}
AUTO_MARGIN_GIB = 4.0
# --compile_checkpoint_keep auto where only "inputs" meets issue 28's target (2x upstream's step at upstream's memory
# or less; upstream checkpoints each block whole, keeping its inputs): what keeping more cost, 1024 px bs1, an H100
AUTO_KEEP_INPUTS = {
    "chroma": "Chroma 1024 px: 477 ms at 21.2 GiB, 2.43x upstream's step at its 21.3 GiB; attention (451 ms, 22.7 GiB) "
              "and projections (417 ms, 27.4 GiB) take more memory than upstream (docs/BENCHMARKS.md run78)",
    "sd3": "SD3.5: attention keeps each block's attention output, 0.75 GiB more on large (20.2 against upstream's "
           "19.6 GiB), 0.36 GiB on medium (7.6 against 7.25) (docs/BENCHMARKS.md run81); inputs keeps what upstream "
           "keeps",
    "anima": "as SD3.5: attention would keep each block's self- and cross-attention outputs, 8.3 kB a token (a "
             "compiled block on the CPU), 0.9 GiB over its 28 blocks at 1024 px, where upstream uses 6.5 GiB in all "
             "(docs/BENCHMARKS.md run82); with inputs 165.5 ms at 6.53 GiB against upstream's 626.8 ms at 6.52 (run86)",
}


def auto_keep(family: str | None, batch_size: int, pixels: int | None, free_bytes: int | None) -> tuple[str, str]:
    """--compile_checkpoint_keep auto: (choice, why). The family's faster choice only when the GPU's free memory (at
    the compile, with the model, the network and the optimizer in place) holds twice what it keeps more than
    "attention" (scaled from the measured size by tokens and batch) plus AUTO_MARGIN_GIB: the other half covers
    what "attention" itself still needs for its activations, gradients and optimizer state, which was at most 1.3x
    that extra at the measured sizes; and from the family's min_batch on. Otherwise attention, the least memory, as
    before auto. AUTO_KEEP_INPUTS's families: inputs, whatever the free memory."""
    if family in AUTO_KEEP_INPUTS:
        return "inputs", f"the only choice at upstream's memory or less: {AUTO_KEEP_INPUTS[family]}"
    table = AUTO_KEEP.get(family or "")
    if table is None:
        return "attention", f"no faster choice measured for this model family ({family or 'unknown'})"
    if batch_size < table.get("min_batch", 1):
        return "attention", (f"batch size {batch_size}: the least memory, {table['below_min_batch']}; "
                             f"{table['choice']} from batch size {table['min_batch']} when memory allows")
    if free_bytes is None or not pixels:
        return "attention", "free GPU memory or the image size unknown"
    tokens = pixels / table["pixels_per_token"] + table["text_tokens"]
    extra = table["extra_gib"] * tokens / table["tokens"] * max(1, batch_size)
    need = 2 * extra + AUTO_MARGIN_GIB
    free = free_bytes / 2**30
    if free >= need:
        return table["choice"], (f"{free:.1f} GiB of GPU memory free >= {need:.1f} GiB (twice the {extra:.1f} GiB it "
                                 f"keeps more than attention, + {AUTO_MARGIN_GIB:.0f})")
    return "attention", (f"{free:.1f} GiB of GPU memory free < {need:.1f} GiB that {table['choice']} would want "
                         f"(twice the {extra:.1f} GiB it keeps more, + {AUTO_MARGIN_GIB:.0f})")


def free_gpu_bytes(device=None) -> int | None:
    """Free memory of the current CUDA device for this process: the driver's free memory plus what torch's caching
    allocator holds unused. None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def resolve_keep(args, gradient_checkpointing: bool) -> str:
    """What the checkpoint inside the compiled blocks keeps: the option's choice, or auto's (one log line)."""
    keep = getattr(args, "compile_checkpoint_keep", "attention") or "attention"
    if keep != "auto" or not gradient_checkpointing:
        return "attention" if keep == "auto" else keep
    choice, why = auto_keep(getattr(args, "_family", None), getattr(args, "train_batch_size", 1) or 1,
                            getattr(args, "_max_pixels", None), free_gpu_bytes())
    logger.info("--compile_checkpoint_keep auto: %s (%s)", choice, why)
    return choice


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


def adapter_of(layer: torch.nn.Module, forward=None) -> torch.nn.Module | None:
    """The adapter (kohya LoRA, LyCORIS) whose forward replaced this layer's, or None. An adapter is not a child of
    the block it changes: it put its own bound forward on the layer. `forward`: the one to look at (default: the
    layer's own)."""
    owner = getattr(layer.__dict__.get("forward") if forward is None else forward, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) and owner is not layer else None


def dropout_rate(module: torch.nn.Module | None, kind: str) -> float:
    """A module's dropout setting `kind` ("dropout", "rank_dropout", "module_dropout") as a number, 0 where unset."""
    v = getattr(module, kind, None)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _uses_dropout(block: torch.nn.Module) -> bool:
    """Whether a block draws random numbers in training: nn.Dropout, its LoRA modules' dropout settings, or an
    adapter that draws outside the graph (DyLoRA's rank: `eager_in_compile`)."""
    for m in block.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        adapter = adapter_of(m)
        if getattr(adapter, "eager_in_compile", False) or any(
                dropout_rate(module, kind) > 0 for module in (m, adapter)
                for kind in ("dropout", "rank_dropout", "module_dropout")):
            return True
    return False


def class_name(module: torch.nn.Module) -> str:
    """The module's own class name: torch's fully_shard (--fsdp) gives a sharded module the class FSDP<name>."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


@torch._dynamo.disable

def _move_checkpointing_inside(model: torch.nn.Module, names: tuple[str, ...]) -> int:
    """Turn off diffusers' checkpointing of the repeated blocks (their parents' flag); return how many parents had it on."""
    switched = 0
    for module in model.modules():
        if not getattr(module, "gradient_checkpointing", False):
            continue
        children = []
        for child in module.children():
            children.extend(child if isinstance(child, torch.nn.ModuleList) else [child])
        if any(class_name(c) in names for c in children):
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

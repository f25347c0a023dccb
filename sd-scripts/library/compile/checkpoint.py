"""Gradient checkpointing inside the compiled blocks, and what it keeps for backward (--compile_checkpoint_keep)."""

from __future__ import annotations

import torch

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


def _class_name(module: torch.nn.Module) -> str:
    from library.compile.regional import class_name  # (regional imports this module)

    return class_name(module)


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
        if any(_class_name(c) in names for c in children):
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

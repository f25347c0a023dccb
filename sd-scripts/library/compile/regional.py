"""Regional compilation: each repeated transformer block of a model compiled in place, and what goes with it
(adapters traced into the blocks, block swap's Linear layers kept out, the image-size marks, new-shape log lines)."""

from __future__ import annotations

import logging
import types

import torch
import torch._dynamo

from library.compile.checkpoint import (CHECKPOINT_CONTEXTS, class_name, resolve_keep, _checkpointed_forward,
                                        _checkpointing_off, _move_checkpointing_inside, _uses_dropout)
from library.compile.graphs import block_compile_mode, cuda_graphs
from library.compile.options import CompileConfigError, dynamic_value

logger = logging.getLogger(__name__)

# Repeated blocks per model class, used when a model does not declare diffusers' `_repeated_blocks`.
_FALLBACK_REPEATED_BLOCKS = {
    "UNet2DConditionModel": ("BasicTransformerBlock",),
    "FluxTransformer2DModel": ("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    "SD3Transformer2DModel": ("JointTransformerBlock",),
    "Lumina2Transformer2DModel": ("Lumina2TransformerBlock",),  # the layers and both refiners
}


def repeated_block_names(model: torch.nn.Module) -> tuple[str, ...]:
    names = tuple(getattr(model, "_repeated_blocks", None) or ())
    if not names:
        names = _FALLBACK_REPEATED_BLOCKS.get(class_name(model), ())
    if not names:
        raise CompileConfigError(
            f"{class_name(model)} declares no repeated blocks (_repeated_blocks); regional compilation "
            "does not know what to compile"
        )
    return names


def find_repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = repeated_block_names(model)
    return [m for m in model.modules() if class_name(m) in names]


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


IMAGE_SIZE_DIMS = {
    # SDXL / SD: hidden_states (batch, H*W tokens, channels)
    "BasicTransformerBlock": {"hidden_states": (1,)},
    # FLUX.1: hidden_states (batch, image tokens, width); image_rotary_emb (cos, sin), each (text + image tokens, dim)
    "FluxTransformerBlock": {"hidden_states": (1,), "image_rotary_emb": (0,)},
    "FluxSingleTransformerBlock": {"hidden_states": (1,), "image_rotary_emb": (0,)},
    # Lumina 2: hidden_states (batch, caption + image tokens, width); rotary (batch, tokens, dim); mask (batch, tokens)
    "Lumina2TransformerBlock": {"hidden_states": (1,), "attention_mask": (1,), "image_rotary_emb": (1,)},
}


def image_size_dims(block: torch.nn.Module) -> list[tuple[str, int, tuple[int, ...]]]:
    """(argument name, its position in the block's forward, dims) for each input of `block` that follows the image
    size; empty for a block class IMAGE_SIZE_DIMS does not know."""
    spec = IMAGE_SIZE_DIMS.get(class_name(block))
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

    dynamic = dynamic_value(args)
    backend = args.compile_backend
    mode = block_compile_mode(args)
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
    keep = resolve_keep(args, gradient_checkpointing)
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

    kinds = sorted({class_name(b) for b in blocks})
    logger.info(
        f"Compiled {len(blocks)} blocks of {model_name} ({', '.join(kinds)})"
        + (f", gradient checkpointing inside the compiled region (--compile_checkpoint_keep {keep})"
           if gradient_checkpointing else "")
        + (", inside checkpoints that keep their inputs in CPU memory" if offload_checkpointing else "")
        + (", image-size dimensions of their inputs dynamic (bucket shapes share the graphs)" if marked else "")
        + (", static shapes (--compile_dynamic auto: the dataset has one bucket shape)"
           if dynamic is False and getattr(args, "compile_dynamic", "auto") == "auto" else "")
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


def strip_orig_mod(state_dict: dict) -> dict:
    """Remove the `_orig_mod.` segments that torch.compile(module) wrappers put into state_dict keys."""
    if not any("_orig_mod." in k for k in state_dict):
        return state_dict
    return {k.replace("_orig_mod.", ""): v for k, v in state_dict.items()}


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
        what = "compiles and records CUDA graphs" if cuda_graphs(self.args) == "blocks" else "compiles"
        at = f" at step {step}" if step is not None else ""
        logger.info("torch.compile: new input shape %s%s (%d so far): this step %s for it",
                    "x".join(map(str, shape)), at, len(self.shapes), what)
        return True


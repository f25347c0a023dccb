"""Regional compilation: each repeated transformer block of a model compiled in place, and what goes with it
(adapters traced into the blocks, block swap's Linear layers kept out, the image-size marks, new-shape log lines)."""

from __future__ import annotations

import logging
import types

import torch
import torch._dynamo

from library.compile.checkpoint import (CHECKPOINT_CONTEXTS, class_name, resolve_keep, _checkpointed_forward,
                                        _checkpointing_off, _move_checkpointing_inside, _uses_dropout, adapter_of,
                                        dropout_rate)
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
    if forward is None or getattr(forward, "__self__", None) is layer:  # none, or the layer's own (fp8 upcast)
        return None
    owner = adapter_of(layer, forward)
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


def _positions(block: torch.nn.Module, names) -> dict[str, int]:
    """Argument name -> its position in the block's forward, for those of `names` it has."""
    import inspect

    params = list(inspect.signature(type(block).forward).parameters)[1:]  # the class's forward, without self
    return {name: params.index(name) for name in names if name in params}


def image_size_dims(block: torch.nn.Module) -> list[tuple[str, int, tuple[int, ...]]]:
    """(argument name, its position in the block's forward, dims) for each input of `block` that follows the image
    size; empty for a block class IMAGE_SIZE_DIMS does not know."""
    spec = IMAGE_SIZE_DIMS.get(class_name(block))
    if not spec:
        return []
    positions = _positions(block, spec)
    return [(name, positions[name], dims) for name, dims in spec.items() if name in positions]


# Inputs that the first block of a kind gets in another form than the blocks after it, which get the previous block's
# outputs. Each difference is one more graph of that kind to trace, compile, load and guard (a second graph per kind
# doubled FLUX.1's compile: 4 graphs for 2 kinds); the first block's inputs are made like the later ones' outside its
# compiled call, so every block of a kind runs one graph. Per block class:
# "grad": while autograd records and the block trains, these inputs require grad (the first one's come from layers
# that do not train; its input gradient, a few matmuls, is left unused);
# "joint": (a, b) as two slices of one tensor along dim 1, a first (as a block of this kind hands them on).
LIKE_LATER_BLOCKS = {
    # FLUX.1: the first double block's image and text streams come from the embedders
    "FluxTransformerBlock": {"grad": ("hidden_states", "encoder_hidden_states")},
    # the double blocks hand on two tensors; a single block hands on two slices of its joint (text, image) output
    "FluxSingleTransformerBlock": {"grad": ("hidden_states", "encoder_hidden_states"),
                                   "joint": ("encoder_hidden_states", "hidden_states")},
    # Chroma: the first double block's streams come from the embedders (its single blocks get one joint tensor)
    "ChromaTransformerBlock": {"grad": ("hidden_states", "encoder_hidden_states")},
    # SD3/SD3.5: the first joint block's streams come from the patch and caption embedders
    "JointTransformerBlock": {"grad": ("hidden_states", "encoder_hidden_states")},
    # HunyuanImage 2.1: the first double block's streams come from the patch embedder and the text refiner
    "MMDoubleStreamBlock": {"grad": ("img", "txt")},
    # Lumina 2: the first block of the noise and of the context refiner gets the embedders' tokens
    "Lumina2TransformerBlock": {"grad": ("hidden_states",)},
    # Anima (library.anima_models.Block): the first block's tokens come from the patch embedder
    "Block": {"grad": ("x",)},
}


def _parameters_of(block: torch.nn.Module) -> list:
    """The block's parameters and those of the adapters (kohya LoRA, LyCORIS) whose forward replaced a layer's."""
    params = list(block.parameters())
    for module in block.modules():
        forward = module.__dict__.get("forward")
        forward = getattr(module, "_forward_outside_compile", forward)
        owner = getattr(forward, "__self__", None)
        if isinstance(owner, torch.nn.Module) and owner is not module:
            params.extend(owner.parameters())
        for cell in getattr(forward, "__closure__", None) or ():  # a closure's adapter (FLUX split LoRA)
            if isinstance(getattr(cell, "cell_contents", None), torch.nn.Module):
                params.extend(cell.cell_contents.parameters())
    return params


class _BlockCall:
    """A block's compiled call that first makes its inputs like the later blocks' (LIKE_LATER_BLOCKS) and marks the
    image-size dims dynamic (maybe_mark_dynamic: a dim that the graph needs static stays static, with no error).
    Set as the block's `_compiled_call_impl`, the function nn.Module.__call__ hands every call to once
    `module.compile()` ran, so this runs outside the graph."""

    def __init__(self, block: torch.nn.Module, compiled_call, dims: list[tuple[str, int, tuple[int, ...]]],
                 like: dict | None):
        self.compiled_call = compiled_call
        self.dims = dims
        self.like = like or {}
        self.positions = _positions(block, [n for names in self.like.values() for n in names])
        self._params = (lambda: _parameters_of(block)) if "grad" in self.like else None
        self._trains: bool | None = None  # known at the first call that records autograd (after the network's setup)

    def _get(self, args, kwargs, name):
        if name in kwargs:
            return kwargs[name]
        position = self.positions.get(name, len(args))
        return args[position] if position < len(args) else None

    def _set(self, args: list, kwargs, name, value):
        if name in kwargs or self.positions.get(name, len(args)) >= len(args):
            kwargs[name] = value
        else:
            args[self.positions[name]] = value

    def _like_later_blocks(self, args: list, kwargs: dict) -> None:
        joint = self.like.get("joint")
        if joint:
            a, b = (self._get(args, kwargs, n) for n in joint)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not _joint_slices(a, b):
                whole = torch.cat([a, b], dim=1)
                self._set(args, kwargs, joint[0], whole[:, :a.shape[1]])
                self._set(args, kwargs, joint[1], whole[:, a.shape[1]:])
        if self._params is not None and torch.is_grad_enabled():
            if self._trains is None:
                self._trains = any(p.requires_grad for p in self._params())
            if self._trains:
                for name in self.like["grad"]:
                    t = self._get(args, kwargs, name)
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.requires_grad:
                        self._set(args, kwargs, name, t.detach().requires_grad_())

    def __call__(self, *args, **kwargs):
        if self.like:
            args = list(args)
            self._like_later_blocks(args, kwargs)
        for name, position, dims in self.dims:
            value = kwargs.get(name) if name in kwargs else (args[position] if position < len(args) else None)
            for t in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(t, torch.Tensor):
                    for d in dims:
                        if d < t.dim():
                            torch._dynamo.maybe_mark_dynamic(t, d)
        return self.compiled_call(*args, **kwargs)


def _joint_slices(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b lie as [:, :n] and [:, n:] of one tensor (joined along dim 1) in memory: the layout a compiled
    block's guards see (strides), checked from data pointers (a replayed CUDA graph's outputs share no `_base`)."""
    if a.dim() < 2 or a.stride() != b.stride() or a.stride(0) != (a.shape[1] + b.shape[1]) * a.stride(1):
        return False
    return b.data_ptr() == a.data_ptr() + a.shape[1] * a.stride(1) * a.element_size()


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

    drawn = max((dropout_rate(adapter_of(m), "module_dropout") for b in blocks for m in b.modules()), default=0.0)
    if drawn > 0:
        logger.info(f"{model_name}: the blocks are not compiled: LoRA's module_dropout ({drawn:g}) decides on the "
                    "host in every adapter call whether to leave it out, which a compiled block cannot follow (SDXL "
                    "bs1 + GC: 2.2 s a step compiled against 1.1 s without, run106)")
        return 0
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
    marked = like = 0
    for block in blocks:
        # auto with several bucket shapes: the image-size dims dynamic from the first call (IMAGE_SIZE_DIMS)
        dims = image_size_dims(block) if dynamic is None and getattr(args, "_input_shapes", None) != 1 else []
        like_later = LIKE_LATER_BLOCKS.get(class_name(block))
        if (dims or like_later) and getattr(block, "_compiled_call_impl", None) is not None:
            block._compiled_call_impl = _BlockCall(block, block._compiled_call_impl, dims, like_later)
            marked += bool(dims)
            like += bool(like_later)

    kinds = sorted({class_name(b) for b in blocks})
    logger.info(
        f"Compiled {len(blocks)} blocks of {model_name} ({', '.join(kinds)})"
        + (f", gradient checkpointing inside the compiled region (--compile_checkpoint_keep {keep})"
           if gradient_checkpointing else "")
        + (", inside checkpoints that keep their inputs in CPU memory" if offload_checkpointing else "")
        + (", image-size dimensions of their inputs dynamic (bucket shapes share the graphs)" if marked else "")
        + (", the first block of each kind given inputs like the later ones' (one graph a kind)" if like else "")
        + (", static shapes (--compile_dynamic auto: the dataset has one bucket shape)"
           if dynamic is False and getattr(args, "compile_dynamic", "auto") == "auto" else "")
        + (", torch's automatic dynamic shapes (--compile_dynamic auto: one bucket shape, the text length follows "
           "each batch's captions)" if dynamic is None and getattr(args, "_input_shapes", None) == 1 else "")
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


"""Sharded full fine-tuning over the processes of `accelerate launch` / torchrun: `--fsdp` (torch's FSDP2
`fully_shard`) and its options, from the command line or from accelerate's FSDP config.

The trained denoiser is sharded block by block (the repeated blocks regional compilation uses, plus the UNet's
ResNet blocks), then as a whole: every process holds 1/N of its weights, gradients and optimizer state, and the
optimizer is built on the sharded parameters. Trained text encoders stay whole, their gradients averaged by
library.data_parallel. Saving a model gathers the full weights on the main process into a plain copy of the model
(`gathered`), so the file is the usual one with the usual metadata; `--save_state` writes the models and optimizers
with torch.distributed.checkpoint (`ShardedState`), which `--resume` reads on any number of processes.

Upstream's DeepSpeed options (`--deepspeed`, `--zero_stage`, `--offload_*`, `--zero3_*`) live here too: accelerate's
DeepSpeed plugin with upstream's values when the `deepspeed` package is installed (install extra `deepspeed`).

    add_fsdp_arguments(parser)           --fsdp full_shard|shard_grad_op|hybrid_shard, --fsdp_cpu_offload
    check_fsdp_args(args, error)         before any model loads: what FSDP cannot go with
    from_accelerate_config(args)         `accelerate launch --use_fsdp` (its FSDP_* environment) -> --fsdp
    shards(args, accelerator)            the denoiser will be sharded: leave it off the device until shard()
    shard(args, accelerator, trainable, denoiser, weight_dtype)   the denoiser sharded, param groups remapped
    init_optimizer_state(optimizers)     Adafactor's factored statistics made as DTensors laid out like the shards
    clip_grad_norm_(params, max_norm, accelerator)   --max_grad_norm over sharded and whole gradients
    gathered(components, models, accelerator)   context: full weights in `components` on the main process
    ShardedState(models, optimizers)     save(accelerator, folder) / load(accelerator, folder) for -state folders
    add_deepspeed_arguments / from_accelerate_deepspeed_config / check_deepspeed_args / deepspeed_plugin /
    deepspeed_kwargs_handlers / check_deepspeed_engaged / prepare_deepspeed   --deepspeed
"""
from __future__ import annotations

import contextlib
import logging
import math
import os

import torch

logger = logging.getLogger(__name__)

FSDP_CHOICES = ("full_shard", "shard_grad_op", "hybrid_shard")
# inside a -state folder: the models and optimizers as torch.distributed.checkpoint writes them
SHARDED_STATE = "sharded"
# blocks sharded one by one besides the repeated (compiled) ones: the UNet's ResNet blocks hold half its weights
_EXTRA_BLOCKS = {"UNet2DConditionModel": ("ResnetBlock2D",)}
# accelerate's FSDP_SHARDING_STRATEGY (names or 1-based numbers) -> --fsdp
_ACCELERATE_STRATEGIES = {"FULL_SHARD": "full_shard", "1": "full_shard", "SHARD_GRAD_OP": "shard_grad_op",
                          "2": "shard_grad_op", "HYBRID_SHARD": "hybrid_shard", "4": "hybrid_shard"}


def add_fsdp_arguments(parser) -> None:
    parser.add_argument("--fsdp", type=str, default=None, choices=FSDP_CHOICES,
                        help="shard the trained models, their gradients and optimizer state over the processes of "
                             "`accelerate launch` (torch FSDP2): full_shard (weights gathered per block in forward and "
                             "backward), shard_grad_op (weights kept gathered from forward to backward), hybrid_shard "
                             "(sharded within each machine, replicated across machines)")
    parser.add_argument("--fsdp_cpu_offload", action="store_true",
                        help="with --fsdp: keep the sharded weights, gradients and optimizer state in CPU memory "
                             "(the optimizer steps on the CPU)")


def from_accelerate_config(args) -> None:
    """`accelerate launch --use_fsdp` (or an accelerate config with FSDP) sets ACCELERATE_USE_FSDP and FSDP_*: taken
    as --fsdp (the strategy, CPU offload), and accelerate's own FSDP wrapper is turned off: the trainers shard here."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() not in ("1", "true", "yes"):
        return
    os.environ["ACCELERATE_USE_FSDP"] = "false"  # read by Accelerator(); our models are not prepared by it
    if not hasattr(args, "fsdp"):
        logger.info("accelerate's FSDP config: this trainer has no --fsdp (the base model is frozen); it trains "
                    "data parallel")
        return
    if args.fsdp is None:
        strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
        if strategy not in _ACCELERATE_STRATEGIES:
            from library.errors import ConfigError

            raise ConfigError(f"accelerate's FSDP sharding strategy {strategy} is not supported here; use "
                              f"FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD (or --fsdp {'|'.join(FSDP_CHOICES)})")
        args.fsdp = _ACCELERATE_STRATEGIES[strategy]
    if os.environ.get("FSDP_OFFLOAD_PARAMS", "").lower() in ("1", "true", "yes"):
        args.fsdp_cpu_offload = True
    logger.info("accelerate's FSDP config: --fsdp %s%s", args.fsdp, " --fsdp_cpu_offload" if args.fsdp_cpu_offload
                else "")


def check_fsdp_args(args, error) -> None:
    """Before any model loads: --fsdp with what it cannot go with is one line naming both."""
    from_accelerate_config(args)
    if not getattr(args, "fsdp", None):
        if getattr(args, "fsdp_cpu_offload", False):
            raise error("--fsdp_cpu_offload needs --fsdp (full_shard, shard_grad_op or hybrid_shard)")
        return
    conflicts = [
        ("--fused_backward_pass", getattr(args, "fused_backward_pass", False),
         "the optimizer would step on unreduced gradient shards inside backward"),
        ("--fused_optimizer_groups", getattr(args, "fused_optimizer_groups", None), "as --fused_backward_pass"),
        ("--blockwise_fused_optimizers", getattr(args, "blockwise_fused_optimizers", False),
         "as --fused_backward_pass"),
        ("--blocks_to_swap", (getattr(args, "blocks_to_swap", None) or 0) > 0,
         "sharding already divides the weights; use --fsdp_cpu_offload to keep them in CPU memory"),
        ("--ema_decay", getattr(args, "ema_decay", None) is not None, "the EMA copy is not sharded"),
        ("--cuda_graph_step", getattr(args, "cuda_graph_step", "off") not in ("off", "auto", None),
         "the step's collectives cannot be captured in one CUDA graph"),
        ("--sample_prompts", bool(getattr(args, "sample_prompts", None)),
         "sampling from sharded weights is not supported yet; sample from the saved model"),
        ("--mixed_precision fp16",
         getattr(args, "mixed_precision", None) == "fp16" or getattr(args, "full_fp16", False),
         "the loss scaler does not unscale sharded gradients; use --mixed_precision bf16"),
        ("--deepspeed", getattr(args, "deepspeed", False), "choose one sharding engine"),
    ]
    for flag, given, why in conflicts:
        if given:
            raise error(f"--fsdp cannot be used with {flag}: {why}")


def enabled(args) -> bool:
    return bool(getattr(args, "fsdp", None))


def shards(args, accelerator) -> bool:
    """The denoiser will be sharded (--fsdp over several processes): it stays where it loaded until `shard`, whose
    fully_shard moves it to the device block by block (moving it whole first would need the whole model's memory on
    every GPU, which is what sharding avoids)."""
    return enabled(args) and accelerator.num_processes > 1


def _fsdp_api():
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    return fully_shard, FSDPModule, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy


def _class_name(module: torch.nn.Module) -> str:
    from library.compile import regional

    return regional.class_name(module)


def unsharded_class(module: torch.nn.Module) -> type:
    _, FSDPModule, *_ = _fsdp_api()
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def shard_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks sharded one by one (outermost first; none nested in another): the repeated blocks (diffusers'
    `_repeated_blocks`, as regional compilation), ResNet blocks of a UNet, or transformers' `_no_split_modules`."""
    from library.compile import regional
    from library.compile.options import CompileConfigError

    try:
        names = set(regional.repeated_block_names(model))
    except CompileConfigError:
        names = set(getattr(model, "_no_split_modules", None) or ())
    names |= set(_EXTRA_BLOCKS.get(_class_name(model), ()))
    blocks, inside = [], set()
    for name, module in model.named_modules():
        if module is model or _class_name(module) not in names:
            continue
        if any(name.startswith(p + ".") for p in inside):
            continue
        inside.add(name)
        blocks.append(module)
    return blocks


def _mesh(args, accelerator):
    from torch.distributed.device_mesh import init_device_mesh

    world = accelerator.num_processes
    device_type = accelerator.device.type
    if args.fsdp == "hybrid_shard":
        per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
        if world % per_machine:
            from library.errors import TrainingError

            raise TrainingError(f"--fsdp hybrid_shard: {world} processes do not divide into machines of "
                                f"{per_machine} (LOCAL_WORLD_SIZE)")
        return init_device_mesh(device_type, (world // per_machine, per_machine),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world,))


def is_sharded(module: torch.nn.Module) -> bool:
    _, FSDPModule, *_ = _fsdp_api()
    return isinstance(module, FSDPModule)


def shard(args, accelerator, trainable, denoiser, weight_dtype):
    """--fsdp: the trained denoiser sharded per block and as a whole over the processes; the param groups point at
    the sharded parameters (fully_shard replaces them). Trained text encoders stay whole on every process, their
    gradients averaged by library.data_parallel (transformers finds a sharded model's hidden-state recorders by its
    class, which fully_shard renames). One process: nothing to shard, said once."""
    if not enabled(args):
        return trainable
    if accelerator.num_processes == 1:
        logger.info("--fsdp %s: one process, nothing to shard (the state is still saved sharded, so a run of any "
                    "number of processes can resume it)", args.fsdp)
        return trainable
    if not any(m is denoiser for m in trainable.models):
        return trainable
    fully_shard, _, MixedPrecisionPolicy, CPUOffloadPolicy, OffloadPolicy = _fsdp_api()
    before = {id(p): n for n, p in denoiser.named_parameters()}
    mixed = args.mixed_precision in ("bf16", "fp16") and not (args.full_bf16 or args.full_fp16)
    policy = dict(mesh=_mesh(args, accelerator), reshard_after_forward=args.fsdp != "shard_grad_op",
                  mp_policy=MixedPrecisionPolicy(param_dtype=weight_dtype if mixed else None,
                                                 reduce_dtype=torch.float32 if mixed else None),
                  offload_policy=CPUOffloadPolicy(pin_memory=accelerator.device.type == "cuda")
                  if args.fsdp_cpu_offload else OffloadPolicy())
    blocks = shard_blocks(denoiser)
    for block in blocks:
        fully_shard(block, **policy)
    fully_shard(denoiser, **policy)
    after = dict(denoiser.named_parameters())
    trainable.param_groups = [{**g, "params": [after[before[id(p)]] if id(p) in before else p for p in g["params"]]}
                              for g in trainable.param_groups]
    n_params = sum(p.numel() for p in after.values())
    logger.info("--fsdp %s: the parameters of the %s (%.1fM, %d blocks) are sharded over %d processes%s%s",
                args.fsdp, _class_name(denoiser), n_params / 1e6, len(blocks), accelerator.num_processes,
                f", computed in {str(weight_dtype).removeprefix('torch.')}" if mixed else "",
                ", kept in CPU memory" if args.fsdp_cpu_offload else "")
    return trainable


def init_optimizer_state(optimizers) -> None:
    """transformers' Adafactor (the full fine-tune presets' optimizer) on sharded (DTensor) weights. Its own step
    makes its factored statistics as plain tensors of the whole weight's shape, which cannot meet sharded gradients,
    and stepping through DTensor operations costs milliseconds of dispatch per weight. So with sharded weights its
    state is made here first, as its first step makes it, the statistics as DTensors laid out like the weights (a
    sharded checkpoint holds them whole; resumed on any number of processes), and its step is replaced by
    `_sharded_adafactor_step`: Adafactor's arithmetic on each process's shards, with the few sums that span shards
    (column statistics, the RMS of weights and updates) reduced in a handful of collectives per step. The weights
    after each step are those of the unsharded optimizer."""
    import types

    from torch.distributed.tensor import DTensor

    try:
        from transformers.optimization import Adafactor
    except ImportError:
        return
    for optimizer in optimizers:
        raw = getattr(optimizer, "optimizer", optimizer)
        params = [p for g in raw.param_groups for p in g["params"]]
        sharded = [p for p in params if isinstance(p, DTensor)]
        if not isinstance(raw, Adafactor) or not sharded:
            continue
        for group in raw.param_groups:
            for p in group["params"]:
                if not raw.state[p]:
                    raw.state[p].update(_adafactor_state(group, p))
        groups = {_shard_group(p) for p in sharded}
        if len(groups) == 1 and None not in groups:
            raw.step = types.MethodType(_sharded_adafactor_step, raw)
            raw._shard_group = groups.pop()
        else:  # (not what fully_shard makes) Adafactor's own step through DTensor operations: slow, exact
            logger.warning("Adafactor: some weights are not sharded on their first dim over one group; it steps "
                           "them through DTensor operations (slower)")


def _shard_group(p):
    """The process group a DTensor weight is sharded over on its dim 0 (fully_shard's layout), or None."""
    from torch.distributed.tensor import Replicate, Shard

    dims = [i for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if len(dims) != 1 or p.placements[dims[0]] != Shard(0):
        return None
    return p.device_mesh.get_group(dims[0])


def _adafactor_state(group: dict, p: torch.Tensor) -> dict:
    from torch.distributed.tensor import DTensor

    zeros = torch.zeros_like(p, dtype=torch.float32)  # (float32 statistics, whatever the weights' dtype)
    device = zeros.to_local().device if isinstance(zeros, DTensor) else zeros.device
    state = {"step": 0, "RMS": torch.zeros((), dtype=torch.float32, device=device)}
    if group["beta1"] is not None:
        state["exp_avg"] = torch.zeros_like(zeros)
    if p.ndim < 2:
        state["exp_avg_sq"] = torch.zeros_like(zeros)
        return state
    # the row statistics reduce the last dim, the column ones the one before: a DTensor sharded on dim 0 gives
    # them the weight's layout (Shard(0)), except a 2-d weight's columns, whose sharded dim is averaged away
    state["exp_avg_sq_row"] = zeros.mean(dim=-1)
    state["exp_avg_sq_col"] = zeros.mean(dim=-2)
    if isinstance(p, DTensor) and p.ndim == 2:
        from torch.distributed.tensor import Replicate

        state["exp_avg_sq_col"] = state["exp_avg_sq_col"].redistribute(placements=[Replicate()] * len(p.placements))
    return state


# sharded Adafactor updates held at once before their RMS is reduced (bytes of float32)
_ADAFACTOR_CHUNK_BYTES = 512 * 1024 * 1024


@torch.no_grad()
def _sharded_adafactor_step(self, closure=None):
    """transformers' Adafactor.step (same options, same arithmetic) on the local shards of FSDP2 weights (plain
    weights too, e.g. trained text encoders): sums over a sharded dim are reduced over the shard group."""
    from torch.distributed.tensor import DTensor

    loss = closure() if closure is not None else None
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    items, partial = [], []  # partial: the sums to reduce, in the order they are read back
    for group in self.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state.update(_adafactor_state(group, p))
            sharded = isinstance(p, DTensor)
            grad = local(p.grad).float()
            weight = local(p).float()
            state["step"] += 1
            beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
            sq = grad * grad + group["eps"][0]
            item = dict(p=p, group=group, state=state, sharded=sharded, beta2t=beta2t, split_rows=False)
            if p.ndim >= 2:
                row = local(state["exp_avg_sq_row"])
                row.mul_(beta2t).add_(sq.mean(dim=-1), alpha=1.0 - beta2t)
                if sharded and p.ndim == 2:  # the column means and the row statistics' mean span the shards
                    item["split_rows"] = True
                    partial += [sq.sum(dim=-2), row.sum().reshape(1)]
                else:
                    local(state["exp_avg_sq_col"]).mul_(beta2t).add_(sq.mean(dim=-2), alpha=1.0 - beta2t)
            else:
                local(state["exp_avg_sq"]).mul_(beta2t).add_(sq, alpha=1.0 - beta2t)
            weight_sq = weight.square().sum().reshape(1)
            if sharded:
                partial.append(weight_sq)
            item["weight_sq"] = weight_sq
            items.append(item)
    reduced = _all_reduce_sums(partial, getattr(self, "_shard_group", None))
    for item in items:  # read back in the order they were added
        if item["split_rows"]:
            item["col_sum"], item["row_sum"] = next(reduced), next(reduced)
        if item["sharded"]:
            item["weight_sq"] = next(reduced)
    # the updates, a chunk at a time (their RMS spans the shards too)
    chunk, size = [], 0
    for item in items:
        chunk.append(item)
        size += local(item["p"]).numel() * 4
        if size >= _ADAFACTOR_CHUNK_BYTES:
            _adafactor_apply(self, chunk, local)
            chunk, size = [], 0
    if chunk:
        _adafactor_apply(self, chunk, local)
    return loss


def _all_reduce_sums(tensors: list, group):
    """Sums each tensor over the group in one collective; an iterator over the sums, in order."""
    if not tensors:
        return iter(())
    flat = torch.cat([t.reshape(-1) for t in tensors])
    home = flat.device
    if home.type == "cpu" and "gloo" not in str(torch.distributed.get_backend(group)):
        flat = flat.cuda()  # --fsdp_cpu_offload on an NCCL group: the sums go through the GPU
    torch.distributed.all_reduce(flat, group=group)
    flat = flat.to(home)
    sums, offset = [], 0
    for t in tensors:
        sums.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return iter(sums)


def _adafactor_apply(optimizer, items: list, local) -> None:
    update_sq = []
    for item in items:
        p, state = item["p"], item["state"]
        grad = local(p.grad).float()
        if p.ndim >= 2:
            row, col = local(state["exp_avg_sq_row"]), local(state["exp_avg_sq_col"])
            if item["split_rows"]:
                rows = p.shape[0]
                col.mul_(item["beta2t"]).add_(item["col_sum"] / rows, alpha=1.0 - item["beta2t"])
                row_mean = item["row_sum"] / rows
            else:
                row_mean = row.mean(dim=-1, keepdim=True)
            update = torch.mul((row / row_mean).rsqrt_().unsqueeze(-1), col.unsqueeze(-2).rsqrt())
            update.mul_(grad)
        else:
            update = local(state["exp_avg_sq"]).rsqrt().mul_(grad)
        item["update"] = update
        item["update_sq"] = update.square().sum().reshape(1)
        if item["sharded"]:
            update_sq.append(item["update_sq"])
    reduced = _all_reduce_sums(update_sq, getattr(optimizer, "_shard_group", None))
    for item in items:
        p, group, state = item["p"], item["group"], item["state"]
        if item["sharded"]:
            item["update_sq"] = next(reduced)
        numel = p.numel()  # (a DTensor's is the whole weight's)
        state["RMS"] = (item["weight_sq"] / numel).sqrt().reshape(())
        lr = group["lr"]
        if group["relative_step"]:
            min_step = 1e-6 * state["step"] if group["warmup_init"] else 1e-2
            lr = min(min_step, 1.0 / math.sqrt(state["step"]))
        if group["scale_parameter"]:
            lr = state["RMS"].clamp(min=group["eps"][1]) * lr
        update = item.pop("update")
        update.div_(((item["update_sq"] / numel).sqrt() / group["clip_threshold"]).clamp_(min=1.0))
        update.mul_(lr)
        if group["beta1"] is not None:
            exp_avg = local(state["exp_avg"])
            exp_avg.mul_(group["beta1"]).add_(update, alpha=1 - group["beta1"])
            update = exp_avg
        weight = local(p)
        weight32 = weight.float()
        if group["weight_decay"] != 0:
            weight32.add_(weight32 * (-group["weight_decay"] * lr))
        weight32.add_(-update)
        if weight32 is not weight:
            weight.copy_(weight32)


def clip_grad_norm_(params, max_norm: float, accelerator) -> None:
    """Gradient clipping by the norm of all gradients, sharded ones (--fsdp) included: their shards' norms are
    combined over the processes."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    if not sharded:
        accelerator.clip_grad_norm_(params, max_norm)
        return
    whole = [g for g in grads if not isinstance(g, DTensor)]
    norms = [torch.nn.utils.get_total_norm(sharded).full_tensor()]
    if whole:
        norms.append(torch.nn.utils.get_total_norm(whole).to(norms[0].device))
    total = float(torch.linalg.vector_norm(torch.stack(norms)))
    scale = min(1.0, max_norm / (total + 1e-6))  # (torch's clip_grads_with_norm_ leaves DTensor gradients as they are)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)


def set_gradient_sync(models, sync: bool) -> None:
    """Within an accumulation window the gradients are reduced only at its last micro-step."""
    for model in models:
        if is_sharded(model):
            model.set_requires_gradient_sync(sync)


def _plain_copy(model: torch.nn.Module, state_dict: dict) -> torch.nn.Module:
    """A model of the same class and config without FSDP, holding `state_dict` (no extra memory: built on the meta
    device, the tensors assigned); buffers outside the state dict are taken from `model` (they are not sharded)."""
    cls = unsharded_class(model)
    with torch.device("meta"):
        copy = cls.from_config(model.config) if hasattr(cls, "from_config") else cls(model.config)
    copy.load_state_dict(state_dict, assign=True)
    for name, buffer in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        target = copy.get_submodule(owner) if owner else copy
        if getattr(target, leaf).is_meta:
            target.register_buffer(leaf, buffer.detach().cpu(), persistent=False)
    return copy.train(model.training)


def _replace_in(components, replacements: dict) -> list:
    """Puts each replacement in place of its model in `components` (attributes and lists); returns how to undo."""
    undo = []
    for name, value in list(vars(components).items()):
        if id(value) in replacements:
            setattr(components, name, replacements[id(value)])
            undo.append((name, None, value))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if id(item) in replacements:
                    value[i] = replacements[id(item)]
                    undo.append((name, i, item))
    return undo


@contextlib.contextmanager
def gathered(components, models, accelerator):
    """Every process enters it (the weights are gathered by collectives); inside, on the main process, the sharded
    models in `components` are plain models with the full weights (on the CPU), which the usual save writes."""
    sharded = [m for m in models if is_sharded(m)]
    if not sharded:
        yield
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    replacements = {}
    for model in sharded:
        full = get_model_state_dict(model, options=options)
        if accelerator.is_main_process:
            replacements[id(model)] = _plain_copy(model, full)
    undo = _replace_in(components, replacements) if replacements else []
    try:
        yield
    finally:
        for name, index, value in undo:
            if index is None:
                setattr(components, name, value)
            else:
                getattr(components, name)[index] = value


class ShardedState:
    """The trained models and their optimizers in a -state folder, written and read with torch.distributed.checkpoint
    (each process its shards; read back on any number of processes). accelerate's save_state / load_state keep the
    rest (LR scheduler, step counter, RNG states) and leave the models and optimizers to this."""

    def __init__(self, models: list, optimizers: list):
        self.models = torch.nn.ModuleList(models)  # one module: the state dict's names are "<index>.<name>"
        self.optimizers = optimizers

    def _raw_optimizers(self) -> list:
        return [getattr(o, "optimizer", o) for o in self.optimizers]

    @contextlib.contextmanager
    def _without_optimizers(self, accelerator):
        kept = accelerator._optimizers  # accelerate would write / read each optimizer as one unsharded file
        accelerator._optimizers = []
        try:
            yield
        finally:
            accelerator._optimizers = kept

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.models, self._raw_optimizers())
        return {"model": model_sd, "optimizer": optim_sd}

    def save(self, accelerator, folder: str) -> None:
        import torch.distributed.checkpoint as dcp

        with self._without_optimizers(accelerator):
            accelerator.save_state(folder)
        dcp.save(self._state(), checkpoint_id=os.path.join(folder, SHARDED_STATE))

    def load(self, accelerator, folder: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        with self._without_optimizers(accelerator):
            accelerator.load_state(folder)
        state = self._state()
        dcp.load(state, checkpoint_id=os.path.join(folder, SHARDED_STATE))
        set_state_dict(self.models, self._raw_optimizers(), model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


def is_sharded_state(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, SHARDED_STATE, ".metadata"))


def check_resume(args, folder: str) -> str | None:
    """A -state folder written with --fsdp is resumed with --fsdp (on any number of processes), and only such a
    folder: the problem as one line, or None."""
    if is_sharded_state(folder) and not enabled(args):
        return (f"--resume {folder}: the state was saved with --fsdp (sharded); resume with --fsdp (any number of "
                "processes)")
    if enabled(args) and not is_sharded_state(folder):
        return f"--resume {folder}: the state was saved without --fsdp; resume it without --fsdp"
    return None


# ----------------------------------------------------------------------------------------------------------
# upstream's DeepSpeed options (library/deepspeed_utils.py there), through accelerate's DeepSpeed plugin

DEEPSPEED_EXTRA = "deepspeed"  # pyproject install extra: pip install -e ".[deepspeed]"


def add_deepspeed_arguments(parser) -> None:
    """Upstream's names, types, defaults and choices (every trainer)."""
    parser.add_argument("--deepspeed", action="store_true",
                        help="train through DeepSpeed ZeRO (accelerate's DeepSpeed plugin; install extra "
                             f"'{DEEPSPEED_EXTRA}')")
    parser.add_argument("--zero_stage", type=int, default=2, choices=[0, 1, 2, 3],
                        help="with --deepspeed: the ZeRO stage (1 optimizer state, 2 + gradients, 3 + weights sharded)")
    parser.add_argument("--offload_optimizer_device", type=str, default=None, choices=[None, "cpu", "nvme"],
                        help="with --deepspeed: keep the optimizer state on cpu or nvme (ZeRO stages 2 and 3)")
    parser.add_argument("--offload_optimizer_nvme_path", type=str, default=None,
                        help="with --deepspeed --offload_optimizer_device nvme: the NVMe folder (ZeRO stage 3)")
    parser.add_argument("--offload_param_device", type=str, default=None, choices=[None, "cpu", "nvme"],
                        help="with --deepspeed: keep the weights on cpu or nvme (ZeRO stage 3)")
    parser.add_argument("--offload_param_nvme_path", type=str, default=None,
                        help="with --deepspeed --offload_param_device nvme: the NVMe folder (ZeRO stage 3)")
    parser.add_argument("--zero3_init_flag", action="store_true",
                        help="with --deepspeed: build the models through deepspeed.zero.Init (ZeRO stage 3)")
    parser.add_argument("--zero3_save_16bit_model", action="store_true",
                        help="with --deepspeed: gather 16-bit weights to save the model (ZeRO stage 3)")


def deepspeed_enabled(args) -> bool:
    return bool(getattr(args, "deepspeed", False))


def from_accelerate_deepspeed_config(args, error) -> None:
    """`accelerate launch --use_deepspeed` (or an accelerate config with DeepSpeed) sets ACCELERATE_USE_DEEPSPEED and
    ACCELERATE_DEEPSPEED_*: taken as --deepspeed with its ZeRO stage, offload devices and ZeRO-3 flags (the trainer
    builds the plugin itself, with upstream's values; the command line's --deepspeed options win)."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true", "yes") or deepspeed_enabled(args) \
            or not hasattr(args, "deepspeed"):
        return
    if env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        raise error(f"accelerate's DeepSpeed config file {env['ACCELERATE_DEEPSPEED_CONFIG_FILE']} is not read here; "
                    "use --deepspeed with --zero_stage and --offload_* (upstream's options)")
    args.deepspeed = True
    if env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        args.zero_stage = int(env["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
    for name, attr in (("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "offload_optimizer_device"),
                       ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "offload_param_device")):
        if env.get(name, "none").lower() != "none" and getattr(args, attr) is None:
            setattr(args, attr, env[name].lower())
    for name, attr in (("ACCELERATE_DEEPSPEED_ZERO3_INIT", "zero3_init_flag"),
                       ("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "zero3_save_16bit_model")):
        if env.get(name, "").lower() == "true":
            setattr(args, attr, True)
    logger.info("accelerate's DeepSpeed config: --deepspeed --zero_stage %d%s", args.zero_stage,
                f" --offload_optimizer_device {args.offload_optimizer_device}" if args.offload_optimizer_device else "")


def check_deepspeed_args(args, error) -> None:
    """Before any model loads: accelerate's DeepSpeed config taken as --deepspeed, the deepspeed package is there
    (else one line naming the install extra), and what it cannot go with."""
    from_accelerate_deepspeed_config(args, error)
    if not deepspeed_enabled(args):
        return
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise error(f"--deepspeed needs the deepspeed package: pip install -e \".[{DEEPSPEED_EXTRA}]\" (or "
                    "DS_BUILD_OPS=0 pip install deepspeed)") from None
    for flag, given in (("--fused_backward_pass", getattr(args, "fused_backward_pass", False)),
                        ("--fused_optimizer_groups", getattr(args, "fused_optimizer_groups", None)),
                        ("--blockwise_fused_optimizers", getattr(args, "blockwise_fused_optimizers", False)),
                        ("--blocks_to_swap", (getattr(args, "blocks_to_swap", None) or 0) > 0),
                        ("--cuda_graph_step", getattr(args, "cuda_graph_step", "off") not in ("off", "auto", None))):
        if given:
            raise error(f"--deepspeed cannot be used with {flag}: DeepSpeed steps the optimizer itself")
    if args.zero_stage == 3:
        raise error("--deepspeed --zero_stage 3 is not supported yet (the model is saved from every process's whole "
                    "weights); use --zero_stage 0, 1 or 2, or --fsdp full_shard (weights sharded through torch)")
    args.max_data_loader_n_workers = 1  # upstream: "DataLoader worker exited unexpectedly" with more


def deepspeed_plugin(args):
    """accelerate's DeepSpeedPlugin with upstream's values, or None without --deepspeed."""
    if not deepspeed_enabled(args):
        return None
    from accelerate import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(
        zero_stage=args.zero_stage, gradient_accumulation_steps=args.gradient_accumulation_steps,
        gradient_clipping=args.max_grad_norm, offload_optimizer_device=args.offload_optimizer_device,
        offload_optimizer_nvme_path=args.offload_optimizer_nvme_path, offload_param_device=args.offload_param_device,
        offload_param_nvme_path=args.offload_param_nvme_path, zero3_init_flag=args.zero3_init_flag,
        zero3_save_16bit_model=args.zero3_save_16bit_model)
    config = plugin.deepspeed_config
    config["train_micro_batch_size_per_gpu"] = args.train_batch_size
    config["train_batch_size"] = (args.train_batch_size * args.gradient_accumulation_steps
                                  * int(os.environ.get("WORLD_SIZE", "1") or 1))
    plugin.set_mixed_precision(args.mixed_precision)
    if args.mixed_precision == "fp16":
        config["fp16"]["initial_scale_power"] = 0  # upstream: no overflow in the first steps
    if (args.full_fp16 or getattr(args, "fp16_master_weights_and_gradients", False)) \
            and args.offload_optimizer_device == "cpu" and args.zero_stage == 2:
        config["fp16"]["fp16_master_weights_and_grads"] = True
    logger.info("--deepspeed: ZeRO stage %d%s%s", args.zero_stage,
                f", optimizer state on {args.offload_optimizer_device}" if args.offload_optimizer_device else "",
                f", weights on {args.offload_param_device}" if args.offload_param_device else "")
    return plugin


def deepspeed_kwargs_handlers(args, handlers: list) -> list:
    """The process group of a --deepspeed run, before the Accelerator is made. One process started without a
    launcher gets the environment of a one-process group (DeepSpeed otherwise looks for MPI). Without a GPU,
    accelerate leaves DeepSpeed off on the CPU (ACCELERATE_USE_CPU, `--cpu`) and finds no process-group backend,
    so the CPU switch is taken back and the processes join over gloo (DeepSpeed's CPU accelerator). Returns
    accelerate's kwargs handlers: `handlers`, with gloo as the backend without a GPU."""
    if not deepspeed_enabled(args):
        return handlers
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    if torch.cuda.is_available():
        return handlers
    from accelerate.utils import InitProcessGroupKwargs

    os.environ.pop("ACCELERATE_USE_CPU", None)
    kept = [h for h in handlers if not isinstance(h, InitProcessGroupKwargs)]
    timeout = next((h.timeout for h in handlers if isinstance(h, InitProcessGroupKwargs)), None)
    logger.info("--deepspeed without a GPU: DeepSpeed's CPU accelerator, the processes joined over gloo")
    return kept + [InitProcessGroupKwargs(backend="gloo", timeout=timeout)]


def check_deepspeed_engaged(args, accelerator) -> str | None:
    """After the Accelerator is made: None when --deepspeed is off or accelerate runs DeepSpeed, else the one line
    saying why not (no silent data-parallel run in its place)."""
    if not deepspeed_enabled(args) or accelerator.distributed_type == "DEEPSPEED":
        return None
    return (f"--deepspeed: accelerate did not set up DeepSpeed (distributed type "
            f"{str(accelerator.distributed_type).rsplit('.', 1)[-1]}); launch with `accelerate launch` on a "
            "machine with GPUs, or with --multi_gpu --num_processes N (N > 1) on the CPU")


def prepare_deepspeed(accelerator, models: list, dataloader, optimizers: list):
    """accelerate prepares the trained models (one module, as DeepSpeed takes one model), the optimizer and the
    dataloader together; the models keep being called directly (the engine's hooks and its backward/step do the
    rest). Returns (dataloader, [optimizer])."""
    wrapper = torch.nn.ModuleList(models)
    engine, optimizer, dataloader = accelerator.prepare(wrapper, optimizers[0], dataloader)
    trained = sum(p.numel() for p in wrapper.parameters() if p.requires_grad)
    logger.info("--deepspeed: the DeepSpeed engine trains %.2fM parameters with ZeRO stage %d (%s) over %d "
                "processes", trained / 1e6, engine.zero_optimization_stage(), type(engine.optimizer).__name__,
                accelerator.num_processes)
    return dataloader, [optimizer]

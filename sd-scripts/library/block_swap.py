"""Block swap: keep only part of a transformer's repeated blocks on the GPU during training.

With ``blocks_to_swap = k`` of ``n`` blocks (FLUX: double blocks then single blocks, in execution order), the
first ``n - k`` blocks start on the device and the last ``k`` on the offload device (CPU). In forward, when
block ``i < k`` has run it leaves and block ``n - k + i`` comes in, so it is there when its turn comes; backward
runs the same rotation in reverse (the blocks a step's backward needs come back in the reverse order). At no
time are more than ``n - k`` swapped-region blocks on the device (plus one in flight).

Frozen blocks (LoRA training: the LoRA weights live in the network, always on the device) keep their offloaded
copy (pinned, on CUDA), so sending a block out costs no copy: the device tensor is just dropped. Trained blocks
(full fine-tune with a fused backward pass, which steps each parameter while its block is on the device) are
copied back to that copy when they leave. Bringing one in is an async copy on a side CUDA stream when the device is CUDA,
a plain ``.to()`` otherwise. Moves replace ``param.data``, so tensors autograd saved for backward follow.

Hooks: a forward pre-hook on the root model (``prepare``: every forward starts from the initial placement),
forward pre/post hooks on each block, and, from the post hook, a gradient hook on the block's outputs, which
fires when that block's backward is about to run. The hooks are excluded from torch.compile (the compiled
blocks break the graph around them; library.compile.regional keeps Linear layers out of the graph for the same reason).

``device`` and ``offload_device`` are arguments, so on a CPU-only machine both can be "cpu": the placement
bookkeeping (``location``, ``events``) is the same and tests check it.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from library.errors import BlockSwapError  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)


class BlockSwapper:
    def __init__(self, blocks: list[nn.Module], blocks_to_swap: int, device, offload_device="cpu",
                 record_events: bool = False, trainable: bool = False):
        n = len(blocks)
        if not 1 <= blocks_to_swap <= n - 1:
            raise BlockSwapError(f"--blocks_to_swap {blocks_to_swap}: must be between 1 and {n - 1} "
                                 f"(the model has {n} swappable blocks and at least one must stay on the device)")
        found = [name for b in blocks for name, p in b.named_parameters() if p.requires_grad]
        if found and not trainable:
            raise BlockSwapError(f"--blocks_to_swap needs frozen blocks; trainable parameters found: {found[:3]}")
        # trained blocks (full fine-tune with a fused backward pass: each parameter is stepped while its block
        # is on the device) are copied back to the offload copy whenever they leave
        self.trainable = bool(found)
        self.blocks = list(blocks)
        self.n = n
        self.k = blocks_to_swap
        self.device = torch.device(device)
        self.offload_device = torch.device(offload_device)
        self.use_stream = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.use_stream else None
        self.location = ["offload"] * n  # "device" / "offload": where each block's weights are
        self.events: list[tuple[str, int]] | None = [] if record_events else None
        self.max_resident = 0  # most swap-region blocks on the device at one time (for tests and logs)
        self._pending: dict[int, object] = {}  # block index -> CUDA event of its copy in
        self._offloaded: list[dict[str, torch.Tensor]] = []  # per block: tensor name -> offload copy
        self._phase = "forward"
        self._bw_seen: set[int] = set()
        self._handles = []
        for b in self.blocks:
            copies = {}
            for name, t in _tensors(b):
                c = t.data.to(self.offload_device)
                if self.use_stream and self.offload_device.type == "cpu":
                    c = c.pin_memory()
                copies[name] = c
                _set(b, name, c)
            self._offloaded.append(copies)

    # -- placement --------------------------------------------------------------------------------------
    def _log(self, what: str, i: int) -> None:
        if self.events is not None:
            self.events.append((what, i))

    def _move_in(self, i: int) -> None:
        if self.location[i] == "device":
            return
        b = self.blocks[i]
        if self.use_stream:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for name, c in self._offloaded[i].items():
                    _set(b, name, c.to(self.device, non_blocking=True))
                ev = torch.cuda.Event()
                ev.record(self.stream)
            self._pending[i] = ev
        else:
            for name, c in self._offloaded[i].items():
                _set(b, name, c.to(self.device))
        self.location[i] = "device"
        self._log("in", i)
        self.max_resident = max(self.max_resident, self.resident_swap_blocks())

    def _move_out(self, i: int) -> None:
        if self.location[i] == "offload":
            return
        b = self.blocks[i]
        self._pending.pop(i, None)
        live = dict(_tensors(b))
        if self.trainable:
            if self.use_stream:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    for name, c in self._offloaded[i].items():
                        c.copy_(live[name].data, non_blocking=True)
                        live[name].data.record_stream(self.stream)
            else:
                for name, c in self._offloaded[i].items():
                    c.copy_(live[name].data)
        for name, c in self._offloaded[i].items():
            if self.use_stream:
                # the compute stream may still read the device copy: let the allocator know before it is dropped
                live[name].data.record_stream(torch.cuda.current_stream(self.device))
            _set(b, name, c)
        self.location[i] = "offload"
        self._log("out", i)

    def _ensure(self, i: int) -> None:
        """Block i must be usable now: its copy in is finished (waited for on the compute stream)."""
        if self.location[i] != "device":
            self._move_in(i)
        ev = self._pending.pop(i, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def synchronize(self) -> None:
        """Finish every copy in flight (before the host reads weights, e.g. to save the model)."""
        if self.use_stream:
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        self._pending.clear()

    def resident_swap_blocks(self) -> int:
        return sum(1 for loc in self.location if loc == "device")

    def prepare(self) -> None:
        """The initial placement: blocks [0, n-k) on the device, [n-k, n) offloaded."""
        self._phase = "forward"
        self._bw_seen.clear()
        for i in range(self.n - self.k, self.n):
            self._move_out(i)
        for i in range(self.n - self.k):
            self._move_in(i)

    # -- hooks --------------------------------------------------------------------------------------------
    @torch._dynamo.disable
    def _root_pre_hook(self, module, args):
        self.prepare()

    def _block_pre_hook(self, i: int):
        @torch._dynamo.disable
        def hook(module, args):
            self._ensure(i)
            self._log("forward" if self._phase == "forward" else "recompute", i)

        return hook

    def _block_post_hook(self, i: int):
        @torch._dynamo.disable
        def hook(module, args, output):
            if self._phase != "forward":
                return None
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward_hook(i))
            if i < self.k:  # rotate: this block is done for the forward, a swap-region block comes in
                self._move_out(i)
                self._move_in(self.n - self.k + i)
            return None

        return hook

    def _pre_backward_hook(self, j: int):
        def hook(grad):
            if j in self._bw_seen:
                return None
            self._bw_seen.add(j)
            self._phase = "backward"
            self._log("backward", j)
            self._ensure(j)
            # block j+1's backward is complete: a swap-region block leaves, its partner from the front comes back
            nxt = j + 1
            if self.n - self.k <= nxt < self.n:
                self._move_out(nxt)
                self._move_in(nxt - (self.n - self.k))
            return None

        return hook

    def attach(self, root: nn.Module) -> "BlockSwapper":
        self._handles.append(root.register_forward_pre_hook(self._root_pre_hook))
        for i, b in enumerate(self.blocks):
            self._handles.append(b.register_forward_pre_hook(self._block_pre_hook(i)))
            self._handles.append(b.register_forward_hook(self._block_post_hook(i)))
        self.prepare()
        logger.info(f"Block swap: {self.k} of {self.n} blocks swapped between {self.device} and "
                    f"{self.offload_device}; at most {self.n - self.k} on {self.device} at a time")
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _tensors(module: nn.Module):
    yield from module.named_parameters()
    yield from ((n, b) for n, b in module.named_buffers() if b is not None)


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    t = getattr(owner, attr)
    t.data = value


def flux_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The swappable blocks in execution order: FLUX's double then single blocks (SD3: its joint blocks)."""
    return list(transformer.transformer_blocks) + list(getattr(transformer, "single_transformer_blocks", ()))


def place_with_block_swap(transformer: nn.Module, blocks_to_swap: int, device, offload_device="cpu",
                          record_events: bool = False, trainable: bool = False, blocks=None) -> BlockSwapper:
    """Move a transformer to ``device`` except its swap-region blocks (``blocks``: FLUX's by default), and attach
    the swapper."""
    blocks = flux_blocks(transformer) if blocks is None else blocks
    in_blocks = {id(t) for b in blocks for _, t in _tensors(b)}
    for _, t in list(transformer.named_parameters()) + list(transformer.named_buffers()):
        if id(t) not in in_blocks:
            t.data = t.data.to(device)
    return BlockSwapper(blocks, blocks_to_swap, device, offload_device, record_events, trainable).attach(transformer)

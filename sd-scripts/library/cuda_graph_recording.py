"""Cheaper CUDA-graph recording for the CUDA-graph compile modes (reduce-overhead, max-autotune).

Recording the graphs of a new input shape (140 per SDXL step: each compiled block's forward and backward) took
~110 ms a graph on an H100, almost all of it Python bookkeeping in torch's cudagraph trees, not the capture
(docs/BENCHMARKS.md, run34). Two parts of that bookkeeping grow with the number of graphs already on the step's
path, so a step's recording grows quadratically:

- inductor's `slow_path_cudagraph_asserts` (on by default): consistency checks of the graph memory pool around
  every warm-up run and recording, each walking every live output of the path. They check torch itself (a failure
  is an inductor bug), so the trainers switch them off, as torch's own config allows.
- `CUDAGraphNode._is_cuda_graph_recorded_tensor` / `_is_alias_of_live_recorded_tensor`, asked for every input and
  output of a new graph: they compare its storage with every output of the path, and per comparison they build a
  storage object (and dereference a weak reference); `_get_liveness` (several times per graph) maps over every
  output of the path with torch's pytree. `install_fast_scans` puts in versions that give the same answers,
  comparing the plain integers first, in C where possible. Applied only where torch has the methods this was
  written against (tests compare both versions' answers on the installed torch).
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def _storage_ptr(t) -> int:
    return t.untyped_storage().data_ptr()


def _path_ptrs(node) -> list:
    """The data pointers of every output on the node's path (StorageWeakRefWrapper keeps it in `_data_ptr`, also
    after the storage is gone), in one list comprehension: a per-entry method call was the scans' main cost."""
    return [ref._data_ptr for refs in node.path_weakrefs for ref in refs if ref is not None]


def is_cuda_graph_recorded_tensor(self, t) -> bool:
    """Is `t` stored in an output of a graph on this node's path (live or not)."""
    return _storage_ptr(t) in _path_ptrs(self)


def is_alias_of_live_recorded_tensor(self, t):
    """(depth, index) of the first live output on this node's path that `t` shares its storage with, or None."""
    ptr = _storage_ptr(t)
    if ptr not in _path_ptrs(self):  # most tensors: parameters and inputs that no graph on the path wrote
        return None
    for depth, refs in enumerate(self.path_weakrefs):
        for index, ref in enumerate(refs):
            # ref() is None once the storage is gone (torch's maybe_deref)
            if ref is not None and ref._data_ptr == ptr and ref() is not None:
                return depth, index
    return None


def get_liveness(weakrefs):
    """For each graph on the path, whether each output's storage is still alive (None entries: False)."""
    return [[ref is not None and ref() is not None for ref in refs] for refs in weakrefs]


FAST_SCANS = {
    "_is_cuda_graph_recorded_tensor": is_cuda_graph_recorded_tensor,
    "_is_alias_of_live_recorded_tensor": is_alias_of_live_recorded_tensor,
    "_get_liveness": staticmethod(get_liveness),
}


def install_fast_scans() -> bool:
    """Replace torch's two path scans by the equivalent ones above; False (nothing changed) on a torch without them."""
    try:
        from torch._inductor import cudagraph_trees
    except ImportError:
        return False
    import torch.utils._pytree as pytree

    node = getattr(cudagraph_trees, "CUDAGraphNode", None)
    if node is None or not all(callable(getattr(node, name, None)) for name in FAST_SCANS):
        return False
    if pytree.tree_map(lambda x: 1, [None]) != [1]:  # torch's liveness maps over None entries as leaves
        return False
    if "_data_ptr" not in getattr(cudagraph_trees.StorageWeakRefWrapper, "__slots__", ()):
        return False
    for name, fn in FAST_SCANS.items():
        setattr(node, name, fn)
    return True


def skip_debug_checks() -> bool:
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config.triton, "slow_path_cudagraph_asserts"):
        return False
    inductor_config.triton.slow_path_cudagraph_asserts = False
    return True


def speed_up() -> list[str]:
    """Both changes; returns what was applied (for the log)."""
    return [name for name, fn in (("no pool checks", skip_debug_checks), ("fast path scans", install_fast_scans))
            if fn()]

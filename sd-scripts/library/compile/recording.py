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
  output of the path with torch's pytree. `install_fast_scans` puts in versions that give the same answers from
  an index of the path's data pointers that each node builds once (dictionary lookups instead of scans), and a
  liveness list without pytree. Applied only where torch has the methods this was written against (tests
  compare both versions' answers on the installed torch).
"""
from __future__ import annotations


def _storage_ptr(t) -> int:
    return t.untyped_storage().data_ptr()


def _level_index(refs) -> dict[int, list[int]]:
    index: dict[int, list[int]] = {}
    for i, ref in enumerate(refs):
        if ref is not None:
            index.setdefault(ref._data_ptr, []).append(i)
    return index


def _path_index(node) -> list[tuple[int, dict[int, list[tuple[int, int]]]]]:
    """The node's path as two indexes, data pointer -> (depth, index) of the outputs with it, in path order: one of
    the graphs before the node, one of the node's own outputs. StorageWeakRefWrapper keeps the pointer in `_data_ptr`
    (also after the storage is gone), and an output's pointer never changes once recorded (torch rebuilds a replayed
    output's storage at the recorded pointer), so each index is kept on the node while its output lists keep their
    lengths: the earlier graphs' are fixed, so their index is made once a node (one dictionary lookup a question
    instead of one a graph on the path: a FLUX.1 step has 114), from its parent's index of the graphs before it and
    the parent's outputs where the parent kept one (else from the whole path: each new graph of a step then indexed
    the whole path again, 0.4 s of a FLUX.1 step's recording); the node's own list grows while it records."""
    cache = node.__dict__.setdefault("_sd_scripts_ptr_index", {})
    levels = node.path_weakrefs
    *earlier, own = levels or [[]]
    lengths = [len(refs) for refs in earlier]
    entry = cache.get("earlier")
    if entry is None or entry[0] != lengths:
        index = _from_parent(node, earlier)
        entry = cache["earlier"] = (lengths, _whole_index(earlier) if index is None else index)
    mine = cache.get("own")
    if mine is None or mine[0] != len(own):
        mine = cache["own"] = (len(own), _depth_index(own, len(earlier)))
    return [entry[1], mine[1]]


def _depth_index(refs, depth: int) -> dict[int, list[tuple[int, int]]]:
    """One graph's outputs at `depth` on the path: data pointer -> [(depth, index), ...]."""
    return {ptr: [(depth, i) for i in positions] for ptr, positions in _level_index(refs).items()}


def _whole_index(levels) -> dict[int, list[tuple[int, int]]]:
    index: dict[int, list[tuple[int, int]]] = {}
    for depth, refs in enumerate(levels):
        for ptr, at in _depth_index(refs, depth).items():
            index.setdefault(ptr, []).extend(at)
    return index


def _from_parent(node, earlier: list) -> dict[int, list[tuple[int, int]]] | None:
    """The index of the graphs before `node` as its parent's index of the graphs before the parent joined with the
    parent's outputs (the last of `earlier`), where the parent kept one for the same output lists (None otherwise).
    Lists of the parent's index are not changed (a pointer on both gets a new list): its other children read them."""
    parent = getattr(node, "parent", None)  # None has no __dict__: no index kept
    kept = getattr(parent, "__dict__", {}).get("_sd_scripts_ptr_index", {}).get("earlier")
    if kept is None or not earlier or kept[0] != [len(refs) for refs in earlier[:-1]]:
        return None
    index = dict(kept[1])
    for ptr, at in _depth_index(earlier[-1], len(earlier) - 1).items():
        index[ptr] = index[ptr] + at if ptr in index else at
    return index


def is_cuda_graph_recorded_tensor(self, t) -> bool:
    """Is `t` stored in an output of a graph on this node's path (live or not)."""
    ptr = _storage_ptr(t)
    return any(ptr in index for index in _path_index(self))


def is_alias_of_live_recorded_tensor(self, t):
    """(depth, index) of the first live output on this node's path that `t` shares its storage with, or None."""
    ptr = _storage_ptr(t)
    for index in _path_index(self):
        for depth, i in index.get(ptr, ()):
            ref = self.path_weakrefs[depth][i]
            # ref() is None once the storage is gone (torch's maybe_deref)
            if ref is not None and ref._data_ptr == ptr and ref() is not None:
                return depth, i
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
    """Put the scans and liveness above into torch's CUDAGraphNode; False (nothing changed) on a torch whose
    classes differ from what they were written against."""
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
    if "__slots__" in vars(node):  # the index is kept in the node's __dict__
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

"""library.compile.recording: the path scans give torch's answers; the CUDA-graph modes switch it on (CPU).

The scans only read `path_weakrefs` (lists of torch's StorageWeakRefWrapper or None per graph on the path), so a
stand-in node with real wrappers over CPU storages exercises torch's own methods and ours on the same data."""
import argparse
import inspect
import types

import pytest
import torch
from torch._inductor import cudagraph_trees as trees

from library.compile import environment as compile_environment, options as compile_options
from library.compile import recording as cgr

ORIGINALS = {name: inspect.getattr_static(trees.CUDAGraphNode, name) for name in cgr.FAST_SCANS}
SCANS = ("_is_cuda_graph_recorded_tensor", "_is_alias_of_live_recorded_tensor")


@pytest.fixture
def restore_torch(monkeypatch):
    """Whatever a test installs into torch is undone after it."""
    for name, fn in ORIGINALS.items():
        monkeypatch.setattr(trees.CUDAGraphNode, name, fn)
    with torch._inductor.config.patch({"triton.slow_path_cudagraph_asserts": True}):
        yield


def _path():
    """A path of three graphs' outputs: live storages, a dead one, None entries, a view sharing a live storage,
    and a dead output whose data pointer a live output of a later graph has again (the pool reuses memory)."""
    live = [torch.zeros(4 + i) for i in range(5)]
    dead = torch.zeros(3)
    dead_ref = trees.StorageWeakRefWrapper(dead)
    reused = trees.StorageWeakRefWrapper.from_weakref_and_data_ptr(
        dead.untyped_storage()._weak_ref(), live[4].untyped_storage().data_ptr())
    del dead
    path = [
        [trees.StorageWeakRefWrapper(live[0]), None, dead_ref],
        [None, reused, trees.StorageWeakRefWrapper(live[1])],
        [trees.StorageWeakRefWrapper(live[2]), trees.StorageWeakRefWrapper(live[4]), None],
    ]
    assert reused() is None and dead_ref() is None and path[2][1]() is not None
    return types.SimpleNamespace(path_weakrefs=path), live


def test_fast_scans_answer_as_torch():
    node, live = _path()
    probes = live + [live[1][1:], live[4].view(2, 4), torch.zeros(2), torch.zeros(0)]
    answers = {name: [] for name in SCANS}
    for t in probes:
        for name in SCANS:
            expected = ORIGINALS[name](node, t)
            assert cgr.FAST_SCANS[name](node, t) == expected, (name, t.shape)
            answers[name].append(expected)
    liveness = ORIGINALS["_get_liveness"].__func__(node.path_weakrefs)
    assert cgr.get_liveness(node.path_weakrefs) == liveness == [[True, False, False], [False, False, True],
                                                                [True, True, False]]
    # the probes cover both answers of both scans, and the reused pointer resolves to the later live output
    assert set(answers["_is_cuda_graph_recorded_tensor"]) == {True, False}
    assert None in answers["_is_alias_of_live_recorded_tensor"]
    assert cgr.is_alias_of_live_recorded_tensor(node, live[4]) == (2, 1)
    assert cgr.is_alias_of_live_recorded_tensor(node, live[1][1:]) == (1, 2)

    # the index kept on the node follows what changes while it lives: its own output list grows while it
    # records, and outputs die
    late = torch.zeros(7)
    node.path_weakrefs[2].append(trees.StorageWeakRefWrapper(late))
    del live[1]  # the storage of path[1][2] is gone once the probes let go of it too
    probes = live + [late, late[2:], torch.zeros(2)]
    assert node.path_weakrefs[1][2]() is None
    for t in probes:
        for name in SCANS:
            assert cgr.FAST_SCANS[name](node, t) == ORIGINALS[name](node, t), (name, t.shape)
    assert cgr.is_alias_of_live_recorded_tensor(node, late) == (2, 3)
    assert cgr.is_cuda_graph_recorded_tensor(node, late)


def test_speed_up_installs_into_torch(restore_torch):
    assert cgr.speed_up() == ["no pool checks", "fast path scans"]
    assert torch._inductor.config.triton.slow_path_cudagraph_asserts is False
    for name, fn in cgr.FAST_SCANS.items():
        assert inspect.getattr_static(trees.CUDAGraphNode, name) is fn


def test_torch_without_the_methods_is_left_alone(restore_torch, monkeypatch):
    monkeypatch.delattr(trees.CUDAGraphNode, "_is_alias_of_live_recorded_tensor")
    assert cgr.install_fast_scans() is False
    assert trees.CUDAGraphNode._is_cuda_graph_recorded_tensor is ORIGINALS["_is_cuda_graph_recorded_tensor"]


@pytest.mark.parametrize("argv, applied", [
    (["--compile", "--compile_mode", "reduce-overhead"], True),
    (["--compile", "--compile_mode", "max-autotune"], True),
    (["--compile", "--compile_mode", "default"], False),
    (["--compile", "--compile_backend", "aot_eager", "--compile_mode", "reduce-overhead"], False),
])
def test_compile_setup_applies_it_for_cuda_graph_modes(argv, applied, restore_torch, tmp_path):
    args = compile_options.add_compile_arguments(argparse.ArgumentParser()).parse_args(
        argv + ["--compile_cache_dir", str(tmp_path)])
    result = compile_environment.setup_compile_environment(args)
    assert ("cuda_graph_recording" in result) is applied
    assert torch._inductor.config.triton.slow_path_cudagraph_asserts is (not applied)
    assert (trees.CUDAGraphNode._is_cuda_graph_recorded_tensor is cgr.is_cuda_graph_recorded_tensor) is applied


def test_the_earlier_graphs_index_is_built_once_a_node(monkeypatch):
    """A FLUX.1 step has 114 graphs on its path: the outputs of the graphs before a node are indexed once for it,
    not once a question (each input and output of a new graph asks), while its own growing list is indexed again."""
    keep = [torch.zeros(2) for _ in range(40)]
    path = [[trees.StorageWeakRefWrapper(t) for t in keep[i:i + 4]] for i in range(0, 36, 4)] + [[]]
    node = types.SimpleNamespace(path_weakrefs=path)
    built = []
    level_index = cgr._level_index
    monkeypatch.setattr(cgr, "_level_index", lambda refs: built.append(len(refs)) or level_index(refs))
    for t in keep[:36] + [torch.zeros(1)] * 5:
        assert cgr.is_cuda_graph_recorded_tensor(node, t) == ORIGINALS["_is_cuda_graph_recorded_tensor"](node, t)
        assert (cgr.is_alias_of_live_recorded_tensor(node, t)
                == ORIGINALS["_is_alias_of_live_recorded_tensor"](node, t))
    assert built == [4] * 9 + [0]  # each earlier graph once, the node's own (empty) list once
    path[-1].append(trees.StorageWeakRefWrapper(keep[36]))  # the node records an output
    assert cgr.is_alias_of_live_recorded_tensor(node, keep[36]) == (9, 0)
    assert built == [4] * 9 + [0, 1]


def test_a_child_builds_its_index_from_its_parents(monkeypatch):
    """A node whose parent kept the index of the graphs before it indexes only the parent's outputs (the graphs
    before the parent are not walked again), and gives torch's answers; where the parent's index is of other
    lists (another path), the child indexes its whole path."""
    keep = [torch.zeros(2) for _ in range(44)]
    levels = [[trees.StorageWeakRefWrapper(t) for t in keep[i:i + 4]] for i in range(0, 40, 4)]
    shared = trees.StorageWeakRefWrapper(keep[0])  # a parent output on the storage of an earlier graph's output
    parent = types.SimpleNamespace(path_weakrefs=levels[:9] + [levels[9] + [shared]])
    child = types.SimpleNamespace(path_weakrefs=parent.path_weakrefs + [[]], parent=parent)
    built = []
    level_index = cgr._level_index
    monkeypatch.setattr(cgr, "_level_index", lambda refs: built.append(len(refs)) or level_index(refs))
    probes = keep + [keep[0][1:], torch.zeros(1)]
    for t in probes:
        assert cgr.is_alias_of_live_recorded_tensor(parent, t) == ORIGINALS["_is_alias_of_live_recorded_tensor"](
            parent, t)
    assert built == [4] * 9 + [5]
    built.clear()
    for t in probes:
        for name in SCANS:
            assert cgr.FAST_SCANS[name](child, t) == ORIGINALS[name](child, t), (name, t.shape)
    assert built == [5, 0]  # the parent's outputs, the child's own (empty) list
    assert cgr.is_alias_of_live_recorded_tensor(child, keep[0]) == (0, 0)
    assert cgr._path_index(child)[0][keep[0].untyped_storage().data_ptr()] == [(0, 0), (9, 4)]

    built.clear()
    other = types.SimpleNamespace(path_weakrefs=levels[:8] + [levels[9], []], parent=parent)
    for t in probes:
        for name in SCANS:
            assert cgr.FAST_SCANS[name](other, t) == ORIGINALS[name](other, t), (name, t.shape)
    assert built == [4] * 9 + [0]

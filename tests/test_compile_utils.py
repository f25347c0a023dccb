"""library.compile (options, environment, regional, checkpoint, graphs): flags, validation, regional compilation of the repeated blocks (CPU).

One inductor case (tiny UNet); everything else uses aot_eager / eager so the file stays fast.
"""
import argparse
import copy
import logging
import os

import pytest
import torch
import torch._dynamo.testing

from library.compile import checkpoint as compile_checkpoint
from library.compile import environment as compile_environment
from library.compile import graphs as compile_graphs
from library.compile import options as compile_options
from library.compile import regional


def _parse(*argv, blocks_to_swap=None):
    parser = compile_options.add_compile_arguments(argparse.ArgumentParser())
    if blocks_to_swap is not None:
        parser.add_argument("--blocks_to_swap", type=int, default=0)
    return parser.parse_args(list(argv))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------ flags / validation


def test_defaults_and_choices():
    a = _parse()
    assert (a.compile, a.compile_backend, a.compile_mode, a.compile_dynamic) == (False, "inductor", "default", "auto")
    assert (a.compile_fullgraph, a.compile_cache_size_limit, a.compile_cache_dir) == (False, 0, None)
    assert (a.cuda_allow_tf32, a.cuda_cudnn_benchmark) == (False, False)
    a = _parse("--compile", "--compile_backend", "aot_eager", "--compile_mode", "max-autotune-no-cudagraphs",
               "--compile_dynamic", "false", "--compile_fullgraph", "--compile_cache_size_limit", "64",
               "--compile_cache_dir", "/tmp/cc", "--cuda_allow_tf32", "--cuda_cudnn_benchmark")
    assert a.compile_mode == "max-autotune-no-cudagraphs" and a.compile_cache_size_limit == 64
    assert [compile_options.dynamic_value(_parse("--compile_dynamic", v)) for v in ("auto", "true", "false")] == [None, True, False]
    with pytest.raises(SystemExit):
        _parse("--compile_mode", "fast")
    with pytest.raises(SystemExit):
        _parse("--compile_backend", "tensorrt")


@pytest.mark.parametrize("choice, crashed_here, expected", [
    ("auto", False, None),  # torch's own choice
    ("auto", True, False),  # torch 2.11 + CUDA 13 on Hopper
    ("on", True, True),
    ("off", False, False),
])
def test_cudnn_sdp_choice(monkeypatch, caplog, choice, crashed_here, expected):
    monkeypatch.setattr(compile_environment, "_needs_cudnn_sdpa_workaround", lambda: crashed_here)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")  # named in the log
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        with caplog.at_level(logging.INFO, logger="library.compile"):
            applied = compile_environment.apply_process_settings(_parse("--cudnn_sdp", choice))
        assert applied.get("cudnn_sdp") == expected
        assert torch.backends.cuda.cudnn_sdp_enabled() is (expected is not False)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    if choice == "auto" and crashed_here:  # not compiled: off, and the log line says why
        assert "cuDNN attention (--cudnn_sdp auto) off on torch" in caplog.text and "measured only inside" in caplog.text
    with pytest.raises(SystemExit):
        _parse("--cudnn_sdp", "yes")


@pytest.mark.parametrize("argv, family, allowed, why", [
    (["--compile", "--network_train_unet_only"], "flux", True, "each attention's gradient in one layout"),
    (["--compile", "--network_train_unet_only", "--apply_t5_attn_mask"], "flux", False, "attention mask"),
    (["--compile", "--cache_text_encoder_outputs"], "sdxl", True, "inside the inductor-compiled blocks"),
    (["--network_train_unet_only"], "flux", False, "measured only inside"),  # eager: where it crashed
    (["--compile", "--compile_backend", "aot_eager", "--network_train_unet_only"], "flux", False, "measured only"),
    (["--compile"], "flux", False, "text encoders may train"),  # their attention backward runs eagerly
    (["--compile", "--network_train_unet_only"], "sd3", False, "not measured for this model family (sd3)"),
    (["--compile", "--network_train_unet_only", "--model_type", "chroma"], "chroma", False, "family (chroma)"),
    (["--compile", "--train_text_encoder"], "sdxl", False, "text encoders may train"),  # sdxl_train.py
    (["--compile"], "sdxl", True, "inside the inductor-compiled blocks"),  # sdxl_train.py without the flag
])
def test_cudnn_sdp_auto_where_the_crash_was(argv, family, allowed, why):
    """--cudnn_sdp auto on torch 2.11 + CUDA 13 + Hopper: cuDNN attention only where every attention backward runs
    inside inductor-compiled blocks of a measured family (test_cudnn_sdp_choice: apply_process_settings applies it
    and logs the choice)."""
    parser = compile_options.add_compile_arguments(argparse.ArgumentParser())
    for flag in ("--network_train_unet_only", "--cache_text_encoder_outputs", "--apply_t5_attn_mask"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--model_type", default="flux")
    if family == "sdxl" and "--cache_text_encoder_outputs" not in argv:
        parser.add_argument("--train_text_encoder", action="store_true")  # sdxl_train.py's
    args = parser.parse_args(argv)
    args._family = family
    got, reason = compile_environment.cudnn_sdp_auto(args)
    assert got is allowed and why in reason


GIB = 2**30


@pytest.mark.parametrize("family, batch, pixels, free_gib, expected", [
    ("flux", 1, 1024 * 1024, 56.0, "projections"),  # an 80 GB card after FLUX.1's 22.7 GiB: 2 x 6.47 + 4 = 16.9
    ("flux", 1, 1024 * 1024, 16.5, "attention"),  # a 40 GB card: fits attention's 27.3 GiB peak, not with margin
    ("flux", 1, 512 * 512, 10.0, "projections"),  # 512 px: (1024 + 512) / 4608 of the extra
    ("flux", 4, 1024 * 1024, 40.0, "attention"),  # four samples keep four times as much
    ("sdxl", 2, 1024 * 1024, 12.2, "resnets"),  # 2 x 4.1 + 4
    ("sdxl", 2, 1024 * 1024, 12.1, "attention"),
    ("sdxl", 1, 1024 * 1024, 74.0, "attention"),  # bs1: attention meets <= 130 ms under 8 GiB, resnets not (run80)
    ("sdxl", 4, 1024 * 1024, 74.0, "resnets"),
    ("sdxl", 4, 1024 * 1024, 18.0, "attention"),  # a 24 GB card at bs4: 2 x 8.2 + 4 = 20.4
    ("sd3", 1, 1024 * 1024, 70.0, "inputs"),  # attention's outputs took it past upstream's memory (run81)
    ("chroma", 1, 1024 * 1024, 56.0, "inputs"),  # projections was faster at 6 GiB more than upstream (run78)
    ("anima", 1, 1024 * 1024, 70.0, "inputs"),  # as SD3.5: self- and cross-attention outputs
    ("lumina", 1, 1024 * 1024, 70.0, "attention"),  # at upstream's memory with it (run72)
    ("flux", 1, 1024 * 1024, None, "attention"),  # no CUDA
])
def test_checkpoint_keep_auto_from_free_memory(family, batch, pixels, free_gib, expected):
    choice, why = compile_checkpoint.auto_keep(family, batch, pixels, None if free_gib is None else free_gib * GIB)
    assert choice == expected, why


def test_checkpoint_keep_auto_logs_its_choice(monkeypatch, caplog):
    """resolve_keep: auto reads the free memory (faked here) and the run's family, batch and largest bucket."""
    args = _parse("--compile")
    args._family, args._max_pixels, args.train_batch_size = "flux", 1024 * 1024, 1
    for free_gib, expected in ((60.0, "projections"), (12.0, "attention")):
        monkeypatch.setattr(compile_checkpoint, "free_gpu_bytes", lambda *a, f=free_gib: int(f * GIB))
        with caplog.at_level(logging.INFO, logger="library.compile"):
            assert compile_checkpoint.resolve_keep(args, gradient_checkpointing=True) == expected
        assert f"--compile_checkpoint_keep auto: {expected} ({free_gib:.1f} GiB of GPU memory free" in caplog.text
    assert compile_checkpoint.resolve_keep(_parse("--compile_checkpoint_keep", "resnets"), True) == "resnets"
    assert compile_checkpoint.resolve_keep(args, gradient_checkpointing=False) == "attention"


def test_checkpoint_keep_auto_tells_chroma_from_flux(monkeypatch, caplog):
    """Chroma runs in FLUX.1's scripts (family "flux"); graphs.resolve notes the model, so auto keeps inputs for it,
    whatever the free memory, and says why in its line."""
    monkeypatch.setattr(compile_checkpoint, "free_gpu_bytes", lambda *a: 60 * GIB)
    picked = {}
    for model_type in ("flux", "chroma"):
        args = _parse("--compile")
        args.model_type, args.cuda_graph_step, args.train_batch_size = model_type, "off", 1
        dataset = argparse.Namespace(buckets={(1024, 1024): [0]})
        compile_graphs.resolve(args, [argparse.Namespace(datasets=[dataset])], 1, "flux", ValueError)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="library.compile"):
            picked[model_type] = compile_checkpoint.resolve_keep(args, gradient_checkpointing=True)
    assert picked == {"flux": "projections", "chroma": "inputs"}
    assert "--compile_checkpoint_keep auto: inputs (the only choice at upstream's memory or less: Chroma" in caplog.text


def test_checkpoint_contexts_pickle_for_the_autograd_cache():
    """Inductor pickles the cache key, context_fn included: a closure made the AOTAutograd cache bypass every
    checkpointed graph (warm restarts traced and partitioned them again). The contexts pickle by reference and keep
    their cache_hash and policy."""
    import pickle

    from torch.utils.checkpoint import CheckpointPolicy

    for keep, context in compile_checkpoint.CHECKPOINT_CONTEXTS.items():
        back = pickle.loads(pickle.dumps(context))
        assert back.cache_hash == context.cache_hash and back.func is context.func
        policy = back.args[0]
        attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        assert (compile_checkpoint._policy(policy, None, attention)
                is (CheckpointPolicy.MUST_SAVE if keep != "inputs" else CheckpointPolicy.PREFER_RECOMPUTE))
        narrowing = (None, torch.empty(64, 32))  # mm(x, w) with w (in 64, out 32)
        assert (compile_checkpoint._policy(policy, None, torch.ops.aten.mm.default, *narrowing)
                is (CheckpointPolicy.MUST_SAVE if keep not in ("inputs", "attention")
                    else CheckpointPolicy.PREFER_RECOMPUTE))
    assert len({c.cache_hash for c in compile_checkpoint.CHECKPOINT_CONTEXTS.values()}) == 3  # resnets = projections


def test_compile_caches_are_keyed_by_the_attention_backends(tmp_path, monkeypatch):
    """A graph traced with cuDNN attention must not come back from the persistent cache in a run that turned it off:
    the backend switches go into inductor's config, which is part of the FX-graph and AOTAutograd cache keys."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))  # restored after
    saved = (torch.backends.cuda.cudnn_sdp_enabled(), dict(inductor_config.unsafe_marked_cacheable_functions))
    keys = {}
    try:
        for choice in ("on", "off"):
            args = _parse("--compile", "--cudnn_sdp", choice, "--compile_cache_dir", str(tmp_path))
            compile_environment.apply_process_settings(args)
            compile_environment.setup_compile_environment(args)
            keys[choice] = inductor_config.save_config_portable()["unsafe_marked_cacheable_functions"]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(saved[0])
        inductor_config.unsafe_marked_cacheable_functions = saved[1]
        torch._logging.set_logs()
    assert keys["on"][compile_environment.SDPA_CACHE_KEY].startswith("cudnn=1,")
    assert keys["off"][compile_environment.SDPA_CACHE_KEY].startswith("cudnn=0,")


@pytest.mark.parametrize("version, env, rblock_off", [((2, 11), None, True), ((2, 11), "1", False),
                                                     ((2, 13), None, False)])
def test_compile_settings_cache_recomputed_attention_and_skip_rblock_rebenchmarks(tmp_path, monkeypatch, version,
                                                                                 env, rblock_off):
    """Before torch 2.13: graphs that recompute attention in backward (--compile_checkpoint_keep inputs) go into the
    FX-graph cache, and the halved-RBLOCK re-benchmark of every start is off unless the user's variable says."""
    import torch._inductor.config as inductor_config

    hop = torch._prims.rng_prims.graphsafe_run_with_rng_state
    monkeypatch.setattr(hop, "_cacheable", False)  # as torch before 2.13 declares it
    monkeypatch.setattr(compile_environment, "_torch_version", lambda: version)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))  # restored after
    if env is None:
        monkeypatch.delenv("TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK", env)
    table = {k: v for k, v in inductor_config.unsafe_marked_cacheable_functions.items()
             if k != compile_environment.RNG_WRAPPER}  # as a process that compiled nothing yet has it
    with inductor_config.patch(dynamic_scale_rblock=True, fx_graph_cache=inductor_config.fx_graph_cache,
                               unsafe_marked_cacheable_functions=table):
        assert not hop.cacheable()
        args = _parse("--compile", "--compile_cache_dir", str(tmp_path))
        applied = compile_environment.setup_compile_environment(args)
        assert hop.cacheable()
        assert inductor_config.dynamic_scale_rblock is not rblock_off
    assert ("dynamic_scale_rblock" in applied) is rblock_off


@pytest.mark.parametrize("version, cuda, capability, needed", [
    ((2, 11), "13.0", (9, 0), True),
    ((2, 11), "12.8", (9, 0), False),
    ((2, 12), "13.0", (9, 0), False),
    ((2, 11), "13.0", (8, 9), False),
])
def test_cudnn_sdpa_workaround_rule(monkeypatch, version, cuda, capability, needed):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(compile_environment, "_torch_version", lambda: version)
    assert compile_environment._needs_cudnn_sdpa_workaround() is needed


@pytest.mark.parametrize(
    "argv, swap, needles",
    [
        (["--compile_cache_size_limit", "-1"], None, ["--compile_cache_size_limit", "positive"]),
        (["--compile", "--compile_mode", "reduce-overhead"], 4, ["--compile_mode reduce-overhead", "--blocks_to_swap 4", "max-autotune-no-cudagraphs"]),
        (["--compile", "--compile_mode", "max-autotune"], 2, ["CUDA graphs", "--blocks_to_swap 2"]),
        (["--compile", "--compile_backend", "cudagraphs"], 1, ["--compile_backend cudagraphs", "--blocks_to_swap 1"]),
        (["--compile", "--compile_fullgraph"], 3, ["--compile_fullgraph", "--blocks_to_swap 3"]),
        (["--compile", "--compile_backend", "aot_eager", "--compile_mode", "reduce-overhead"], None,
         ["--compile_mode reduce-overhead", "--compile_backend inductor"]),
    ],
)
def test_validation_errors_name_the_flags(argv, swap, needles):
    args = _parse(*argv, blocks_to_swap=swap if swap is not None else None)
    if swap is not None:
        args.blocks_to_swap = swap
    if "cudagraphs" in argv:
        args.device = "cuda:0"  # the block-swap rule as on a GPU machine (without one, cudagraphs is refused first)
    with pytest.raises(compile_options.CompileConfigError) as e:
        compile_options.validate_compile_args(args)
    for n in needles:
        assert n in str(e.value)


def test_validation_accepts_good_settings_and_block_swap_without_cudagraphs():
    args = _parse("--compile", "--compile_mode", "max-autotune-no-cudagraphs", blocks_to_swap=True)
    args.blocks_to_swap = 8
    compile_options.validate_compile_args(args)  # no error
    compile_options.validate_compile_args(_parse("--compile", "--compile_mode", "reduce-overhead"))
    compile_options.validate_compile_args(_parse("--compile_mode", "reduce-overhead", blocks_to_swap=True))  # compile off


def test_validation_missing_triton_and_old_torch(monkeypatch):
    args = _parse("--compile")
    args.device = "cuda"
    monkeypatch.setattr(compile_options.importlib.util, "find_spec", lambda name: None if name == "triton" else object())
    with pytest.raises(compile_options.CompileConfigError, match="needs a working triton, and triton is not installed"):
        compile_options.validate_compile_args(args)
    args.compile_backend = "aot_eager"
    compile_options.validate_compile_args(args)  # aot_eager needs no triton
    monkeypatch.setattr(compile_options, "_torch_version", lambda: (2, 0))
    with pytest.raises(compile_options.CompileConfigError, match=r"torch >= 2\.2"):
        compile_options.validate_compile_args(args)


def test_setup_environment_cache_dir_and_limits(tmp_path, monkeypatch):
    import library

    monkeypatch.setattr(library, "INDUCTOR_CACHE_DIR_AT_START", (None,))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_environment.default_compile_cache_dir() == str(tmp_path / "xdg" / "sd-scripts" / "torch_compile")
    cfg = torch._dynamo.config
    old = (compile_environment.recompile_limit(), cfg.accumulated_recompile_limit)
    try:
        args = _parse("--compile", "--compile_cache_dir", str(tmp_path / "cc"), "--compile_cache_size_limit", "64")
        applied = compile_environment.setup_compile_environment(args)
        assert compile_environment.apply_process_settings(args)["cache_size_limit"] == 64
        assert applied["cache_dir"] == str(tmp_path / "cc") and (tmp_path / "cc").is_dir()
        import os

        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cc")
        assert torch._inductor.config.fx_graph_cache is True
        assert compile_environment.recompile_limit() == 64 and cfg.accumulated_recompile_limit >= 64
    finally:
        cfg.recompile_limit, cfg.accumulated_recompile_limit = old
        torch._logging.set_logs()


@pytest.mark.parametrize("accumulation, expected", [
    (1, [True] * 7),
    (2, [True, False] * 3 + [True]),
    (3, [True, False, False, True, False, False, True]),
])
def test_opens_accumulation_window(accumulation, expected):
    assert [compile_graphs.opens_accumulation_window(n, accumulation) for n in range(7)] == expected


def _window_marks(accumulation, batches, epochs, skip=0, restored_step=0):
    """The training loop's pattern on a real accelerate Accelerator (CPU): per epoch, (batch, marks, syncs)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
        model = torch.nn.Linear(1, 1)
        loader = acc.prepare(torch.utils.data.DataLoader(list(range(batches)), batch_size=1))
        model = acc.prepare(model)
        acc.step = restored_step  # what load_state restores on --resume
        out = []
        for epoch in range(epochs):
            epoch_loader = loader
            if skip and epoch == 0:
                from accelerate import skip_first_batches

                epoch_loader = skip_first_batches(loader, skip)
            rows = []
            for batch in epoch_loader:
                marks = compile_graphs.opens_accumulation_window(acc.step, accumulation)
                with acc.accumulate(model):
                    rows.append((int(batch), marks, acc.sync_gradients))
            out.append(rows)
        return out
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.parametrize("accumulation", [1, 2, 3])
@pytest.mark.parametrize("skip_steps", [0, 1])
def test_step_marked_once_per_accumulation_window(accumulation, skip_steps):
    """CUDA graphs: mark_step_begin at the first micro-step of each optimizer step only. Epochs of 5 batches cut the
    last window short (2 and 3 do not divide 5); a resume skips whole optimizer steps of the first epoch."""
    batches, skip = 5, skip_steps * accumulation
    epochs = _window_marks(accumulation, batches, 2, skip=skip, restored_step=skip)
    for e, rows in enumerate(epochs):
        first = skip if e == 0 else 0
        # windows start at every accumulation-th batch of the epoch (counted from its first batch, skipped ones too)
        assert [b for b, marks, _ in rows if marks] == list(range(first, batches, accumulation))
        # ... which is exactly the batch after each optimizer step (and the epoch's first)
        assert [marks for _, marks, _ in rows] == [True] + [synced for _, _, synced in rows[:-1]]
        assert rows[-1][2]  # the epoch's last batch steps the optimizer, even in a short window
        assert sum(marks for _, marks, _ in rows) == sum(synced for _, _, synced in rows)


def test_cache_dir_user_value_versus_torch_default(tmp_path, monkeypatch):
    """--compile_cache_dir > a TORCHINDUCTOR_CACHE_DIR the user set > $XDG_CACHE_HOME/sd-scripts/torch_compile; the
    /tmp value that importing torch._dynamo puts into the variable is not the user's."""
    import library
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    xdg = str(tmp_path / "xdg" / "sd-scripts" / "torch_compile")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what torch set on import
    monkeypatch.setattr(library, "INDUCTOR_CACHE_DIR_AT_START", (None,))  # the user set nothing
    assert compile_environment.default_compile_cache_dir() == xdg
    monkeypatch.setattr(library, "INDUCTOR_CACHE_DIR_AT_START", ("/data/ic",))  # the user's, before torch's import
    assert compile_environment.default_compile_cache_dir() == "/data/ic"
    assert compile_environment.resolve_cache_dir(_parse("--compile")) == "/data/ic"
    assert compile_environment.resolve_cache_dir(_parse("--compile", "--compile_cache_dir", str(tmp_path / "cc"))) == str(tmp_path / "cc")
    # no snapshot (library imported after torch's inductor): torch's default value counts as unset
    monkeypatch.setattr(library, "INDUCTOR_CACHE_DIR_AT_START", None)
    assert compile_environment.default_compile_cache_dir() == xdg
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/data/other")
    assert compile_environment.default_compile_cache_dir() == "/data/other"


_CACHE_PROBE = """
import sys
import torch  # the scripts' import order: torch, then the library
sys.path.insert(0, sys.argv[1])
from library.compile import environment as compile_environment, options as compile_options
import torch._dynamo  # sets TORCHINDUCTOR_CACHE_DIR to torch's /tmp default when unset
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch._inductor.codecache import FxGraphCache
parser = compile_options.add_compile_arguments(__import__("argparse").ArgumentParser())
for argv in (["--compile"], ["--compile", "--compile_cache_dir", sys.argv[2]]):
    compile_environment.setup_compile_environment(parser.parse_args(argv))
    print(cache_dir(), FxGraphCache._get_tmp_dir())
"""


@pytest.mark.slow
def test_compile_cache_lands_in_the_documented_folder(tmp_path):
    """A fresh process as the scripts start: where inductor's caches (FX graph, AOTAutograd, kernels: all under
    cache_dir()) will be written."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    sd_scripts = str(Path(compile_options.__file__).resolve().parents[2])
    flag = str(tmp_path / "flag")

    def probe(**env):
        base = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
        out = subprocess.run([sys.executable, "-c", _CACHE_PROBE, sd_scripts, flag], env={**base, **env},
                             capture_output=True, text=True, timeout=300, check=True).stdout
        return [line.split() for line in out.splitlines()[-2:]]

    xdg = str(tmp_path / "xdg" / "sd-scripts" / "torch_compile")
    assert probe(XDG_CACHE_HOME=str(tmp_path / "xdg")) == [[xdg, os.path.join(xdg, "fxgraph")],
                                                           [flag, os.path.join(flag, "fxgraph")]]
    user = str(tmp_path / "user")
    assert probe(XDG_CACHE_HOME=str(tmp_path / "xdg"), TORCHINDUCTOR_CACHE_DIR=user) == [
        [user, os.path.join(user, "fxgraph")], [flag, os.path.join(flag, "fxgraph")]]


def test_shape_log_one_line_per_new_shape_and_no_recompile_logs(tmp_path, monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(torch._logging, "set_logs", lambda **kw: calls.append(kw))
    compile_environment.setup_compile_environment(_parse("--compile", "--compile_cache_dir", str(tmp_path)))
    assert not any(kw.get("recompiles") for kw in calls)  # torch's [__recompiles] lines stay off by default

    caplog.set_level(logging.INFO, logger="library.compile")
    log = regional.ShapeLog(_parse("--compile", "--compile_mode", "reduce-overhead"))
    square, wide = torch.zeros(1, 4, 8, 8), torch.zeros(1, 4, 4, 16)
    seen = [log.see({"latents": square}), log.see({"latents": square}), log.see({"latents": None, "images": wide}),
            log.see({"latents": square}), log.see({"latents": wide})]
    assert seen == [True, False, True, False, False]
    assert regional.ShapeLog.shape_of({"latents": None, "images": wide}) == (1, 4, 4, 16)
    assert regional.ShapeLog.shape_of({"latents": None}) is None
    assert log.see({"latents": torch.zeros(1, 4, 6, 6)}, step=7)
    lines = [r.getMessage() for r in caplog.records if "new input shape" in r.getMessage()]
    assert lines == ["torch.compile: new input shape 1x4x8x8 (1 so far): this step compiles and records CUDA graphs "
                     "for it",
                     "torch.compile: new input shape 1x4x4x16 (2 so far): this step compiles and records CUDA graphs "
                     "for it",
                     "torch.compile: new input shape 1x4x6x6 at step 7 (3 so far): this step compiles and records CUDA "
                     "graphs for it"]


def test_strip_orig_mod():
    sd = {"a._orig_mod.b.weight": 1, "c.weight": 2}
    assert regional.strip_orig_mod(sd) == {"a.b.weight": 1, "c.weight": 2}
    clean = {"x": 1}
    assert regional.strip_orig_mod(clean) is clean


# ------------------------------------------------------------------------------------------ tiny models


def _tiny_unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=4, norm_num_groups=8, use_linear_projection=True,
    )


def _tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )


def _grads(*modules):
    return {f"{i}.{n}": p.grad.clone() for i, m in enumerate(modules) for n, p in m.named_parameters() if p.grad is not None}


def _unet_step(model, seed=1, network=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, 8, generator=g)
    ctx = torch.randn(2, 5, 16, generator=g)
    out = model(x, torch.tensor([10, 500]), ctx).sample
    out.square().mean().backward()
    return out.detach(), _grads(model, *([network] if network is not None else []))


def _flux_step(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    n_img, n_txt = 16, 4
    out = model(
        hidden_states=torch.randn(1, n_img, 8, generator=g), encoder_hidden_states=torch.randn(1, n_txt, 16, generator=g),
        pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.tensor([0.3]),
        img_ids=torch.stack([torch.zeros(n_img), torch.arange(n_img) // 4, torch.arange(n_img) % 4], -1),
        txt_ids=torch.zeros(n_txt, 3), guidance=torch.tensor([3.5]),
    ).sample
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ref, got, tol=1e-5):
    (o1, g1), (o2, g2) = ref, got
    torch.testing.assert_close(o2, o1, atol=tol, rtol=tol)
    assert g1.keys() == g2.keys() and len(g1) > 0
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], atol=tol, rtol=tol, msg=k)


def _count(model, name):
    return sum(1 for m in model.modules() if type(m).__name__ == name)


def _with_lora(model):
    """LoRA modules inside the blocks (the project's kohya-style network), trained; base frozen."""
    from networks import lora

    model.requires_grad_(False)
    net = lora.create_network(1.0, 4, 4, None, [], model)
    net.apply_to([], model, apply_text_encoder=False, apply_unet=True)
    for m in net.modules():
        if hasattr(m, "lora_up"):
            torch.nn.init.normal_(m.lora_up.weight, std=0.1)  # non-zero so LoRA changes outputs and grads
    net.requires_grad_(True)
    return net


@pytest.mark.slow
def test_unet_aot_eager_matches_eager_log_line_and_clean_keys(caplog):
    eager = _tiny_unet()
    compiled = copy.deepcopy(eager)
    ref = _unet_step(eager)
    args = _parse("--compile", "--compile_backend", "aot_eager")
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    args.compile_backend = counter  # counts the graphs dynamo hands to aot_eager
    with caplog.at_level(logging.INFO, logger="library.compile"):
        n = regional.compile_model_blocks(compiled, args, model_name="SDXL UNet")
    assert n == _count(eager, "BasicTransformerBlock") == 7
    _assert_same(ref, _unet_step(compiled))
    _assert_same(_unet_step(eager, seed=2), _unet_step(compiled, seed=2))
    # regional compilation: identical blocks share graphs (one per distinct block shape, not one per block)
    assert 1 <= counter.frame_count < n
    assert all(not k.startswith("_") and "_orig_mod" not in k for k in compiled.state_dict())
    assert compiled.state_dict().keys() == eager.state_dict().keys()

    args = _parse("--compile", "--compile_mode", "reduce-overhead")
    m = _tiny_unet()
    with caplog.at_level(logging.INFO, logger="library.compile"):
        regional.compile_model_blocks(m, args, model_name="SDXL UNet")
    assert "Compiling SDXL UNet with torch.compile: backend=inductor, mode=reduce-overhead, dynamic=None, fullgraph=False" in caplog.messages
    assert any(msg.startswith("Compiled 7 blocks of SDXL UNet") for msg in caplog.messages)


@pytest.mark.slow
def test_unet_lora_with_checkpointing_inside_compiled_region_same_grads():
    eager, compiled = _tiny_unet(), _tiny_unet()
    net_eager, net_compiled = _with_lora(eager), _with_lora(compiled)
    net_compiled.load_state_dict(net_eager.state_dict())
    ref = _unet_step(eager, network=net_eager)  # eager, no checkpointing
    compiled.enable_gradient_checkpointing()  # diffusers' way first, as a trainer does
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    args = _parse("--compile", "--compile_backend", "aot_eager")
    args.compile_backend = counter
    n = regional.compile_model_blocks(compiled, args, model_name="SDXL UNet", gradient_checkpointing=True)
    assert n == 7
    # diffusers' own checkpointing of the blocks is off (no double checkpoint); resnets keep theirs
    assert not any(m.gradient_checkpointing for m in compiled.modules() if type(m).__name__ == "Transformer2DModel")
    assert any(m.gradient_checkpointing for m in compiled.modules() if type(m).__name__ == "CrossAttnDownBlock2D")
    got = _unet_step(compiled, network=net_compiled)
    _assert_same(ref, got)
    assert any("lora_up" in k for k in got[1])  # LoRA weights inside the blocks got gradients
    # the checkpoint is inside the compiled graph (a tagged activation-checkpoint region)
    code = "\n".join(gm.code for gm in counter.graphs)
    assert "checkpoint" in code
    assert all("_orig_mod" not in k for k in compiled.state_dict())


def test_lora_dropouts_make_the_checkpoint_keep_the_rng_state():
    """A LoRA module is not a child of the block it changes (it replaced its layer's forward): its dropouts (and
    DyLoRA's drawn rank) still make the block's checkpoint save and restore the RNG state, so a recompute that runs
    eagerly draws what the forward drew."""
    from networks import dylora, lora

    for kwargs, draws in ((dict(), False), (dict(module_dropout="0.5"), True), (dict(rank_dropout="0.2"), True),
                          (dict(neuron_dropout=0.1), True), (dict(unit="1"), True)):
        model = _tiny_unet()
        model.requires_grad_(False)
        module = dylora if "unit" in kwargs else lora
        module.create_network(1.0, 4, 4, None, [], model, **kwargs).apply_to([], model, apply_text_encoder=False,
                                                                             apply_unet=True)
        blocks = regional.find_repeated_blocks(model)
        assert blocks and all(compile_checkpoint._uses_dropout(b) == draws for b in blocks), kwargs


@pytest.mark.slow
def test_compiled_checkpointed_blocks_recompute_dylora_with_the_forwards_rank():
    """DyLoRA draws its rank outside the compiled graph (eager_in_compile), which makes the checkpointed block run its
    recompute eagerly: the RNG state is kept for it, so the recompute uses the forward's rank and the gradients are
    eager's (before, it drew another rank: other gradients, no error)."""
    from networks import dylora

    grads = []
    for compiled in (False, True):
        model = _tiny_unet()
        model.requires_grad_(False)
        net = dylora.create_network(1.0, 4, 4, None, [], model, unit="1")
        net.apply_to([], model, apply_text_encoder=False, apply_unet=True)
        for name, p in net.named_parameters():
            if "lora_up" in name:
                torch.nn.init.normal_(p, std=0.1)  # non-zero so the drawn rank changes the gradients
        net.requires_grad_(True)
        if compiled:
            model.enable_gradient_checkpointing()
            regional.compile_model_blocks(model, _parse("--compile", "--compile_backend", "aot_eager"),
                                          model_name="SDXL UNet", gradient_checkpointing=True)
        torch.manual_seed(3)
        grads.append(_unet_step(model, network=net))
    _assert_same(*grads)


def test_blocks_with_lora_module_dropout_are_not_compiled(caplog):
    """module_dropout decides on the host in every LoRA call whether to leave it out: a compiled block cannot follow
    (twice eager's step time on an H100, run106), so the blocks stay eager with one log line, and diffusers' own
    checkpointing stays on."""
    from networks import lora

    model = _tiny_unet()
    model.requires_grad_(False)
    lora.create_network(1.0, 4, 4, None, [], model, module_dropout="0.1").apply_to([], model, apply_text_encoder=False,
                                                                                     apply_unet=True)
    model.enable_gradient_checkpointing()
    with caplog.at_level(logging.INFO):
        n = regional.compile_model_blocks(model, _parse("--compile", "--compile_backend", "aot_eager"),
                                          model_name="SDXL UNet", gradient_checkpointing=True)
    assert n == 0 and "the blocks are not compiled: LoRA's module_dropout (0.1)" in caplog.text
    assert not any(hasattr(m, "_forward_inside_checkpoint") for m in model.modules())
    assert all(m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing"))


def _count_resnet_forwards(model) -> list:
    """A list that grows by one at each ResnetBlock2D forward (a pre-hook: a checkpoint's recompute stops early)."""
    calls = []
    for m in model.modules():
        if type(m).__name__ == "ResnetBlock2D":
            m.register_forward_pre_hook(lambda *a: calls.append(1))
    return calls


def _recompute_counts(model, network, argv):
    """Run one step with the blocks compiled through AOTAutograd's min-cut partitioner (inductor's); return the grads,
    the number of mm / addmm calls in the blocks' backward graphs (recomputed forward matmuls included) and the
    number of ResNet forwards (twice each where diffusers' checkpoint recomputes them)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    backward_graphs = []

    def keep_backward(gm, example_inputs):
        backward_graphs.append(gm)
        return make_boxed_func(gm)

    model.enable_gradient_checkpointing()  # diffusers' way first, as a trainer does
    resnet_calls = _count_resnet_forwards(model)
    args = _parse("--compile", "--compile_backend", "aot_eager", *argv)  # --compile_dynamic auto: symbolic tokens
    args.compile_backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=keep_backward,
                                        partition_fn=min_cut_rematerialization_partition)
    regional.compile_model_blocks(model, args, model_name="SDXL UNet", gradient_checkpointing=True)
    got = _unet_step(model, network=network)
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return got, (sum(n.target in matmuls for gm in backward_graphs for n in gm.graph.nodes), len(resnet_calls))


@pytest.mark.slow
def test_checkpoint_keep_choices_recompute_less_with_the_same_grads():
    """--compile_checkpoint_keep: attention recomputes every Linear of a block in backward, projections only the
    widening ones (the MLP's up projection, LoRA's up), resnets those and no ResNet."""
    base = _tiny_unet()
    net_base = _with_lora(base)
    resnet_calls = _count_resnet_forwards(base)
    ref = _unet_step(base, network=net_base)  # eager, no checkpointing: each ResNet runs once
    counts = {}
    for keep in compile_checkpoint.CHECKPOINT_KEEP_CHOICES:
        torch._dynamo.reset()
        model = _tiny_unet()
        net = _with_lora(model)
        net.load_state_dict(net_base.state_dict())
        got, counts[keep] = _recompute_counts(model, net, ("--compile_checkpoint_keep", keep))
        _assert_same(ref, got)
    (mm_attention, resnets), (mm_projections, resnets_p), (mm_resnets, resnets_r) = (
        counts[k] for k in ("attention", "projections", "resnets"))
    assert mm_attention > mm_projections == mm_resnets > 0, counts
    assert resnets == resnets_p > resnets_r == len(resnet_calls) > 0, counts  # diffusers' checkpoint recomputes
    with pytest.raises(SystemExit):
        _parse("--compile_checkpoint_keep", "everything")
    assert _parse().compile_checkpoint_keep == "auto"


@pytest.mark.parametrize("argv, applies", [
    (["--compile", "--gradient_checkpointing"], True),
    (["--gradient_checkpointing"], False),
    (["--compile"], False),
    (["--compile", "--gradient_checkpointing", "--cpu_offload_checkpointing"], False),
])
def test_checkpoint_keep_without_inside_checkpointing_warns(argv, applies, caplog):
    parser = compile_options.add_compile_arguments(argparse.ArgumentParser())
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--cpu_offload_checkpointing", action="store_true")
    args = parser.parse_args(argv + ["--compile_backend", "aot_eager", "--compile_checkpoint_keep", "resnets"])
    with caplog.at_level(logging.WARNING, logger="library.compile"):
        compile_options.validate_compile_args(args)
    assert ("--compile_checkpoint_keep resnets has no effect" in caplog.text) != applies
    args.compile_checkpoint_keep = "everything"  # as a config file can set it
    with pytest.raises(compile_options.CompileConfigError, match="--compile_checkpoint_keep must be one of auto, "
                                                    "inputs, attention, projections, resnets; got 'everything'"):
        compile_options.validate_compile_args(args)


@pytest.mark.slow
def test_flux_double_and_single_blocks_with_checkpointing():
    eager = _tiny_flux()
    compiled = copy.deepcopy(eager)
    ref = _flux_step(eager)
    args = _parse("--compile", "--compile_backend", "aot_eager", "--compile_dynamic", "false")
    n = regional.compile_model_blocks(compiled, args, model_name="FLUX", gradient_checkpointing=True)
    assert n == _count(eager, "FluxTransformerBlock") + _count(eager, "FluxSingleTransformerBlock") == 2
    _assert_same(ref, _flux_step(compiled))


def _flux_blocks(double, single):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=double, num_single_layers=single, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )


@pytest.mark.parametrize("network_args", [{}, {"split_qkv": "True"}, {"train_blocks": "single"}])
def test_flux_blocks_of_a_kind_share_one_graph(network_args):
    """The first double and the first single block get inputs like the later ones' (regional.LIKE_LATER_BLOCKS):
    with LoRA in the blocks (the embedders frozen), every block of a kind runs one graph: 2 graphs for FLUX.1, where
    the first block of each kind had one of its own (inputs without gradient; two tensors, not two slices of one),
    with the uncompiled model's output and LoRA gradients. A kind whose blocks do not train (train_blocks=single)
    gets no input gradient."""
    from networks import lora_flux

    eager = _flux_blocks(2, 3)
    compiled = copy.deepcopy(eager)
    nets = []
    for model in (eager, compiled):
        model.requires_grad_(False)
        torch.manual_seed(1)
        net = lora_flux.create_network(1.0, 4, 4, None, None, model, **network_args)
        net.apply_to([], model, False, True)
        for m in net.unet_loras:
            for up in (m.lora_up if isinstance(m.lora_up, torch.nn.ModuleList) else [m.lora_up]):
                torch.nn.init.normal_(up.weight, std=0.1)  # non-zero so LoRA changes outputs and gradients
        net.requires_grad_(True)
        nets.append(net)
    counter = torch._dynamo.testing.CompileCounter()
    args = _parse("--compile", "--compile_backend", "eager", "--compile_dynamic", "false")
    args.compile_backend = counter
    regional.compile_model_blocks(compiled, args, model_name="FLUX", gradient_checkpointing=True)
    outs = [_flux_step(model)[0] for model in (eager, compiled)]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    grads = [_grads(net) for net in nets]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-5, rtol=1e-5, msg=k)
    assert counter.frame_count == 2
    calls = {type(b).__name__: b._compiled_call_impl for b in regional.find_repeated_blocks(compiled)}
    assert calls["FluxSingleTransformerBlock"]._trains
    assert calls["FluxTransformerBlock"]._trains == (network_args.get("train_blocks") != "single")


def test_joint_slices():
    whole = torch.randn(2, 7, 4)
    assert regional._joint_slices(whole[:, :3], whole[:, 3:])
    assert not regional._joint_slices(whole[:, 3:], whole[:, :3])  # the wrong order
    assert not regional._joint_slices(whole[:, :3].contiguous(), whole[:, 3:].contiguous())
    assert not regional._joint_slices(whole[:, :3], whole[:, 4:])  # not adjacent


@pytest.mark.slow
def test_disable_linear_keeps_linears_out_of_graph(caplog):
    eager = _tiny_flux()
    compiled = copy.deepcopy(eager)
    ref = _flux_step(eager)
    args = _parse("--compile", "--compile_backend", "eager")
    with caplog.at_level(logging.INFO, logger="library.compile"):
        regional.compile_model_blocks(compiled, args, model_name="FLUX", disable_linear=True)
    assert any("Linear layers in the compiled blocks run outside the graph" in m for m in caplog.messages)
    blocks = regional.find_repeated_blocks(compiled)
    linears = [m for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(hasattr(m, "_forward_outside_compile") for m in linears)
    _assert_same(ref, _flux_step(compiled))
    assert compiled.state_dict().keys() == eager.state_dict().keys()


def test_unknown_model_is_a_clear_error():
    with pytest.raises(compile_options.CompileConfigError, match="declares no repeated blocks"):
        regional.compile_model_blocks(torch.nn.Linear(2, 2), _parse("--compile"), model_name="X")


@pytest.mark.slow
def test_inductor_tiny_unet_matches_eager():
    """The one inductor case: default mode on the CPU (C++ codegen), shared test cache dir."""
    eager = _tiny_unet()
    compiled = copy.deepcopy(eager)
    ref = _unet_step(eager)
    n = regional.compile_model_blocks(compiled, _parse("--compile", "--compile_dynamic", "false"), model_name="SDXL UNet")
    assert n == 7
    _assert_same(ref, _unet_step(compiled), tol=1e-4)


def test_triton_problem_names_a_missing_or_broken_triton(tmp_path, monkeypatch):
    import sys

    monkeypatch.setattr(compile_options.importlib.util, "find_spec", lambda name: None if name == "triton" else object())
    assert compile_options.triton_problem() == "triton is not installed"
    monkeypatch.undo()
    # an installed triton whose import fails, as a triton-windows built for another Python does
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text(
        "raise ImportError('DLL load failed while importing libtriton: The specified module could not be found.\\n"
        "more detail')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    try:
        assert compile_options.triton_problem() == ("triton does not load (ImportError: DLL load failed while importing libtriton: "
                                       "The specified module could not be found.)")
    finally:
        sys.modules.pop("triton", None)


@pytest.mark.parametrize("platform, install", [("linux", "`pip install triton`"),
                                               ("win32", "`pip install triton-windows`")])
def test_compile_without_working_triton_stops_before_the_model_loads(tmp_path, capsys, monkeypatch, platform,
                                                                     install, tiny_dataset_dir):
    """The trainer as on a CUDA machine whose triton does not load: exit status 2, one `error:` line naming
    --compile_backend, the allowed backends and how to get triton here, no traceback, no model loaded."""
    import sdxl_train_network
    from library import model_util

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the error was found")

    monkeypatch.setattr(model_util, "load_sd_components", no_load)
    monkeypatch.setattr(compile_options, "_cuda_in_use", lambda args: True)
    monkeypatch.setattr(compile_options, "triton_problem", lambda: "triton does not load (ImportError: DLL load failed)")
    monkeypatch.setattr(compile_options.sys, "platform", platform)
    argv = ["--pretrained_model_name_or_path", str(tmp_path / "model.safetensors"), "--train_data_dir",
            str(tiny_dataset_dir), "--output_dir", str(tmp_path / "out"), "--output_name", "x", "--network_module",
            "networks.lora", "--resolution", "64", "--max_train_steps", "1", "--compile"]
    with pytest.raises(SystemExit) as e:
        sdxl_train_network.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [f"error: --compile_backend inductor on a CUDA GPU needs a working triton, and triton does not "
                     f"load (ImportError: DLL load failed): install it into this environment ({install}), or turn "
                     "compile off (drop --compile; in the GUI untick Enable torch.compile), or use a "
                     "--compile_backend that needs no triton: aot_eager, eager or cudagraphs"]
    # the same settings with a backend that needs no triton get past the check, to the model load
    with pytest.raises(AssertionError, match="a model was loaded"):
        sdxl_train_network.main([*argv, "--compile_backend", "aot_eager"])


# ------------------------------------------------------------------------------------------ bucket shapes


def _unet_at(model, h, w):
    out = model(torch.randn(1, 4, h, w), torch.tensor([10]), torch.randn(1, 5, 16)).sample
    out.square().mean().backward()


def _flux_at(model, rows, cols):
    n_img, n_txt = rows * cols, 4
    out = model(
        hidden_states=torch.randn(1, n_img, 8), encoder_hidden_states=torch.randn(1, n_txt, 16),
        pooled_projections=torch.randn(1, 8), timestep=torch.tensor([0.3]),
        img_ids=torch.stack([torch.zeros(n_img), torch.arange(n_img) // cols, torch.arange(n_img) % cols], -1),
        txt_ids=torch.zeros(n_txt, 3), guidance=torch.tensor([3.5]),
    ).sample
    out.square().mean().backward()


def test_image_size_dims_of_the_repeated_blocks():
    unet_block = regional.find_repeated_blocks(_tiny_unet())[0]
    assert regional.image_size_dims(unet_block) == [("hidden_states", 0, (1,))]
    double, single = regional.find_repeated_blocks(_tiny_flux())
    for block in (double, single):
        assert regional.image_size_dims(block) == [("hidden_states", 0, (1,)), ("image_rotary_emb", 3, (0,))]
    assert regional.image_size_dims(torch.nn.Linear(2, 2)) == []


@pytest.mark.parametrize("family", ["sdxl", "flux"])
@pytest.mark.slow
def test_auto_dynamic_new_bucket_shapes_do_not_recompile(family, caplog):
    """--compile_dynamic auto: every graph is compiled at the first shape; three more bucket shapes (positional and
    keyword calls of the blocks) add none. --compile_dynamic false compiles again for each."""
    model, step, shapes = ((_tiny_unet(), _unet_at, [(8, 8), (8, 12), (12, 8), (6, 10)]) if family == "sdxl" else
                           (_tiny_flux(), _flux_at, [(4, 4), (4, 6), (6, 4), (3, 5)]))
    static = copy.deepcopy(model)
    counts = {}
    for name, m, dynamic in (("auto", model, "auto"), ("false", static, "false")):
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounter()
        args = _parse("--compile", "--compile_backend", "eager", "--compile_dynamic", dynamic,
                      "--compile_cache_size_limit", "64")
        args.compile_backend = counter
        with caplog.at_level(logging.INFO, logger="library.compile"):
            regional.compile_model_blocks(m, args, model_name=family, gradient_checkpointing=True)
        counts[name] = []
        for h, w in shapes + shapes[:1]:
            step(m, h, w)
            counts[name].append(counter.frame_count)
    assert counts["auto"][0] >= 1 and len(set(counts["auto"])) == 1, counts
    assert counts["false"][-1] > counts["false"][0], counts
    assert any("image-size dimensions of their inputs dynamic" in msg for msg in caplog.messages)


def test_compile_workers_start_before_the_models_load(monkeypatch, tmp_path):
    """Run setup (after graphs.resolve, before the models load) starts inductor's kernel-compile pool (an inductor
    compile on a CUDA GPU only), with the run's compile cache folder in the environment the workers start with."""
    import torch._inductor.async_compile as async_compile

    started = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: started.append(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))  # restored after
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not compile_environment.warm_compile_workers(_parse("--compile", "--compile_backend", "aot_eager"))
    assert not compile_environment.warm_compile_workers(_parse("--compile_cache_dir", str(tmp_path)))
    assert compile_environment.warm_compile_workers(_parse("--compile", "--compile_cache_dir", str(tmp_path)))
    assert started == [str(tmp_path)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not compile_environment.warm_compile_workers(_parse("--compile"))


@pytest.mark.parametrize("keep", ["attention", "projections"])
def test_checkpoint_contexts_compile_whole_inside_a_block(keep):
    """The selective checkpoint's context (a partial of module-level functions) traces into the block's graph:
    fullgraph compiles it, so no checkpointed block falls back to eager; the gradients are eager's."""
    import types

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            q = self.down(torch.nn.functional.gelu(self.up(x)))
            return torch.nn.functional.scaled_dot_product_attention(q[None], q[None], q[None])[0]

    torch.manual_seed(0)
    eager, block = Block(), Block()
    block.load_state_dict(eager.state_dict())
    block._ckpt_rng, block._ckpt_context = False, compile_checkpoint.CHECKPOINT_CONTEXTS[keep]
    block._forward_inside_checkpoint = block.forward
    block.forward = types.MethodType(compile_checkpoint._checkpointed_forward, block)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    block.compile(backend=counter, fullgraph=True)
    x = torch.randn(8, 16)
    block(x).sum().backward()
    eager(x).sum().backward()
    assert counter.frame_count == 1
    for a, b in zip(eager.parameters(), block.parameters()):
        torch.testing.assert_close(b.grad, a.grad)


def test_the_compile_report_after_step_two_says_what_the_cache_served(caplog):
    """library.run.events.CompileReport logs once, after the second step of a --compile run, how many graphs dynamo
    traced and how many the persistent caches served (environment.compile_cache_report, from torch's counters)."""
    from types import SimpleNamespace

    from torch._dynamo.utils import counters

    from library.compile import environment
    from library.run.events import CompileReport

    torch._dynamo.reset()
    counters.clear()
    try:
        assert environment.compile_cache_report() is None  # nothing compiled yet
        x = torch.randn(4, requires_grad=True)
        torch.compile(lambda t: (t.sin() * 2).sum(), backend="aot_eager")(x).backward()
        report = environment.compile_cache_report()
        assert report.startswith("1 graph compiled in ") and "dynamo's tracing" in report and "cache" not in report  # aot_eager: no caches
        # a warm restart's counters as torch 2.13 left them (tiny SDXL, inductor on the CPU, 2 block kinds)
        counters["stats"]["unique_graphs"] = 2
        counters["inductor"]["fxgraph_cache_hit"] = 4
        counters["aot_autograd"].update(total=2, autograd_cache_hit=2, ok=2)
        report = environment.compile_cache_report()
        assert report.startswith("2 graphs compiled in ")
        assert ("AOTAutograd cache 2 hit, 0 compiled, 0 bypassed; FX-graph cache 4 hit, 0 compiled, 0 bypassed"
                in report)

        event = CompileReport()
        state = SimpleNamespace(args=SimpleNamespace(compile=True), at_epoch_end=False, global_step=1,
                                timer=SimpleNamespace(durations=[30.0]))
        assert not event.due(state)  # the first step only: CUDA graphs are recorded in the second
        state.timer.durations.append(0.5)
        state.global_step = 2
        assert event.due(state)
        with caplog.at_level(logging.INFO, logger="library.run.events"):
            event.run(state)
        assert f"torch.compile after step 2: {report}" in caplog.text
        assert not event.due(state)  # once
        assert not CompileReport().due(SimpleNamespace(args=SimpleNamespace(compile=False), at_epoch_end=False,
                                                       timer=state.timer))
    finally:
        counters.clear()
        torch._dynamo.reset()

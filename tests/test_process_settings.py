"""torch's process-wide switches (TF32, cudnn.benchmark, cuDNN attention, dynamo's recompile limit) are set by one
function, library.compile.environment.apply_process_settings, once per run before any model runs: every model call of
a run (the latent and text-encoder caching too) sees the run's switches, and a run never inherits an earlier run's.
On a GPU (run87) the first trainer run of a process saved other weights than later runs while the compile step set
them after the caching; tests/test_step_graph_gpu.py checks two runs of one process save the same LoRA."""
from __future__ import annotations

import argparse

import pytest
import torch

from library.compile import environment, options as compile_options

pytestmark = pytest.mark.usefixtures("one_thread")


def _switches() -> tuple:
    b = torch.backends
    return b.cuda.cudnn_sdp_enabled(), b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark


@pytest.fixture
def torch_defaults():
    """Puts torch's switches back as they were at import whatever the test leaves."""
    yield environment._TORCH_SWITCHES_AT_IMPORT
    environment._set_process_switches(environment._TORCH_SWITCHES_AT_IMPORT)


def test_each_run_starts_from_torchs_own_switches(torch_defaults, monkeypatch):
    # --cudnn_sdp auto as torch has it (on Hopper with torch 2.11 + CUDA 13 auto turns it off: test_compile_utils)
    monkeypatch.setattr(environment, "_needs_cudnn_sdpa_workaround", lambda: False)
    parser = compile_options.add_compile_arguments(argparse.ArgumentParser())
    given = parser.parse_args(["--compile", "--cuda_allow_tf32", "--cuda_cudnn_benchmark", "--cudnn_sdp", "off",
                               "--compile_cache_size_limit", "64"])
    applied = environment.apply_process_settings(given)
    assert applied == {"tf32": True, "cudnn_benchmark": True, "cudnn_sdp": False, "cache_size_limit": 64}
    assert _switches() == (False, True, True, True) and environment.recompile_limit() == 64
    # the next run of the process, with none of these flags: torch's values, not the run before's
    assert environment.apply_process_settings(parser.parse_args([])) == {}
    assert environment._process_switches() == torch_defaults
    assert environment.recompile_limit() != 64 and torch.backends.cuda.matmul.allow_tf32 is False


def test_a_script_without_the_compile_flags_keeps_torchs_attention_choice(torch_defaults, monkeypatch):
    """train_network.py without --torch_compile has no --cudnn_sdp: cuDNN attention as torch has it (not auto's rule
    for the Hopper + torch 2.11 + CUDA 13 crash, which is about compiled blocks), also after a run that turned it off."""
    monkeypatch.setattr(environment, "_needs_cudnn_sdpa_workaround", lambda: True)
    parser = compile_options.add_compile_arguments(argparse.ArgumentParser())
    environment.apply_process_settings(parser.parse_args(["--cudnn_sdp", "off"]))
    assert environment.apply_process_settings(argparse.Namespace(cache_latents=True)) == {}
    assert torch.backends.cuda.cudnn_sdp_enabled() is torch_defaults["cudnn_sdp"]


@pytest.mark.slow
def test_every_model_call_of_a_run_sees_its_switches_and_the_next_run_torchs(torch_defaults, tiny_sdxl_single_file,
                                                                             tiny_dataset_dir, tmp_path, monkeypatch,
                                                                             fresh_accelerate):
    """Two SDXL LoRA runs in one process: the first with --cudnn_sdp off --cuda_allow_tf32 --cuda_cudnn_benchmark,
    the second with --cudnn_sdp on alone (auto's choice depends on the GPU). Every attention call, while the latents
    and text-encoder outputs are cached and while training, sees the run's switches: the first run's, then torch's
    own with cuDNN attention on."""
    import sdxl_train_network
    from library.network_trainer import run
    from library.run import setup

    calls = []  # (caching?, switches) at each attention call
    caching = [False]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **k):
        calls.append((caching[0], _switches()))
        return sdpa(*a, **k)

    def cache(*a, **k):
        caching[0] = True
        try:
            return org_cache(*a, **k)
        finally:
            caching[0] = False

    org_cache = setup.cache
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(setup, "cache", cache)
    seen = {}
    for name, extra in (("first", ["--cudnn_sdp", "off", "--cuda_allow_tf32", "--cuda_cudnn_benchmark"]),
                        ("second", ["--cudnn_sdp", "on"])):
        calls.clear()
        argv = ["--pretrained_model_name_or_path", str(tiny_sdxl_single_file), "--tokenizer_cache_dir",
                str(tiny_sdxl_single_file.parent / "tokenizers"), "--train_data_dir", str(tiny_dataset_dir),
                "--output_dir", str(tmp_path / name), "--output_name", name, "--network_module", "networks.lora",
                "--network_dim", "4", "--network_train_unet_only", "--resolution", "64,64", "--max_train_steps", "1",
                "--max_data_loader_n_workers", "0", "--seed", "42", "--mixed_precision", "no", "--cache_latents",
                "--cache_text_encoder_outputs", *extra]
        fresh_accelerate()  # each run its own mixed precision (the GPU tests around this one train in bf16)
        run(sdxl_train_network.trainer(), sdxl_train_network.setup_parser(), argv)
        assert {c for c, _ in calls} == {True, False}, calls  # attention ran while caching and while training
        seen[name] = {s for _, s in calls}
    assert seen["first"] == {(False, True, True, True)}
    b = torch_defaults
    assert seen["second"] == {(True, b["matmul_tf32"], b["cudnn_tf32"], b["cudnn_benchmark"])}

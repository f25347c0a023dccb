"""Issue 25 item 4: after a run (and while it runs), the Torch Compile Settings of the run's tab say what
`--compile_dynamic auto` and `--cuda_graph_step auto` chose and why, read from the trainer's log lines
(kohya_gui.compile_auto, fed by the runner; actions.compile_auto_notes on the run panel's timer)."""
from __future__ import annotations

import argparse
import copy
import logging
import sys

import gradio as gr
import pytest

from kohya_gui import compile_auto, config_file
from kohya_gui import params as P
from kohya_gui.runner import Runner
from kohya_gui.ui import actions as A


def _resolve_line(caplog, monkeypatch, **change) -> str:
    """The line library.compile.graphs.resolve logs for --cuda_graph_step auto (one bucket shape, SDXL)."""
    import torch
    from library.compile import graphs
    from library.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = argparse.Namespace(**{
        **dict(cuda_graph_step="auto", gradient_accumulation_steps=1, cache_latents=True, cache_latents_to_disk=False,
               cache_text_encoder_outputs=True, cache_text_encoder_outputs_to_disk=False, mixed_precision="bf16",
               fused_backward_pass=False, cpu_offload_checkpointing=False, blocks_to_swap=0, compile=True,
               compile_backend="inductor", compile_mode="reduce-overhead", optimizer_type="AdamW", optimizer_args=[],
               use_8bit_adam=False, use_lion_optimizer=False, multires_noise_iterations=None), **change})
    dataset = argparse.Namespace(buckets={(1024, 1024): [0]})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="library.compile.graphs"):
        graphs.resolve(args, [argparse.Namespace(datasets=[dataset])], 1, "sdxl", ConfigError)
    (line,) = [r.getMessage() for r in caplog.records]
    return f"2026-01-01 12:00:00 INFO library.compile.graphs: {line}"


def _compiled_line(caplog, unet, shapes: int, text_length_varies: bool = False) -> str:
    """The line library.compile.regional logs after compiling the blocks with --compile_dynamic auto."""
    from library.compile import regional

    args = argparse.Namespace(compile_backend="eager", compile_mode="default", compile_dynamic="auto",
                              compile_fullgraph=False, _input_shapes=shapes, _text_length_varies=text_length_varies)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="library.compile.regional"):
        regional.compile_model_blocks(copy.deepcopy(unet), args, model_name="SDXL UNet")
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiled ")]
    return line


def test_reads_what_auto_chose_from_the_trainers_lines(caplog, monkeypatch, tiny_sdxl):
    off = _resolve_line(caplog, monkeypatch, optimizer_type="DAdaptAdan")
    on = _resolve_line(caplog, monkeypatch)
    static = _compiled_line(caplog, tiny_sdxl.unet, shapes=1)
    dynamic = _compiled_line(caplog, tiny_sdxl.unet, shapes=3)

    choices = {}
    assert compile_auto.feed(choices, off) and compile_auto.feed(choices, static)
    assert choices["cuda_graph_step"].startswith("off: the step graph is left off for --optimizer_type DAdaptAdan")
    assert choices["compile_dynamic"].startswith("static (the dataset has one bucket shape)")
    assert compile_auto.feed(choices, on) and compile_auto.feed(choices, dynamic)
    assert choices["cuda_graph_step"] == ("on (forward, backward and clipping as one CUDA graph, the optimizer step "
                                          "inside the graph)")
    assert choices["compile_dynamic"].startswith("dynamic")
    assert not compile_auto.feed(choices, "steps: 3/10 loss=0.1") and len(choices) == 2
    # Chroma, Lumina 2, HunyuanImage with one bucket shape: torch's automatic dynamic for the text length
    assert compile_auto.feed(choices, _compiled_line(caplog, tiny_sdxl.unet, shapes=1, text_length_varies=True))
    assert choices["compile_dynamic"].startswith("automatic (one bucket shape; the text length follows")
    assert compile_auto.feed(choices, dynamic)
    md = compile_auto.markdown(choices, "LoRA")
    assert md.startswith("**What auto chose in the last LoRA run:** `--compile_dynamic auto` → dynamic")
    assert "`--cuda_graph_step auto` → on (" in md
    assert compile_auto.markdown({}, "LoRA") == ""  # a run that compiled nothing: nothing chosen


def test_the_compile_settings_of_the_runs_tab_show_it(tmp_path, monkeypatch, caplog, tiny_sdxl):
    """The runner reads the lines while the run goes; the run panel's timer puts them into the LoRA tab's Torch
    Compile Settings only (the other tabs keep theirs), once (then skipped until something changes)."""
    lines = [_resolve_line(caplog, monkeypatch, cache_text_encoder_outputs=False),
             _compiled_line(caplog, tiny_sdxl.unet, shapes=1), "steps: 1/1 loss=0.5"]
    run_toml = tmp_path / "run.toml"
    config_file.save(run_toml, "lora", "SDXL", P.defaults("lora"), run_record=True)
    runner = Runner()
    monkeypatch.setattr(A, "RUNNER", runner)
    script = "import sys\nfor line in sys.argv[1:]:\n    print(line, flush=True)\n"
    runner.start([[sys.executable, "-c", script, *lines]], tmp_path / "run.log", config_path=run_toml)
    s = runner.wait(60)
    assert not s.running and s.returncode == 0
    out = A.run_tick(None)
    seen = out[-1]
    notes = dict(zip(P.TABS, out[-2 - len(P.TABS):-2]))
    lora = notes.pop("lora")
    assert "`--compile_dynamic auto` → static (the dataset has one bucket shape)" in lora
    assert "`--cuda_graph_step auto` → off: the step graph needs cached text-encoder outputs" in lora
    assert all(v == gr.skip() for v in notes.values())
    assert all(v == gr.skip() for v in A.run_tick(seen)[-2 - len(P.TABS):-2])  # nothing new: nothing sent


def test_reads_the_checkpoint_keep_choice_and_the_compile_report(caplog, monkeypatch):
    """`--compile_checkpoint_keep auto`'s line (library.compile.checkpoint.resolve_keep) and the compile report after
    step 2 (library.run.events.CompileReport), as the trainer logs them, reach the Torch Compile Settings."""
    from types import SimpleNamespace

    import torch
    from torch._dynamo.utils import counters

    from library.compile import checkpoint
    from library.run.events import CompileReport

    monkeypatch.setattr(checkpoint, "free_gpu_bytes", lambda *a: 70 * 2**30)
    args = argparse.Namespace(compile_checkpoint_keep="auto", _family="sdxl", train_batch_size=1,
                              _max_pixels=1024 * 1024)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="library"):
        assert checkpoint.resolve_keep(args, gradient_checkpointing=True) == "attention"
        torch._dynamo.reset()
        counters.clear()
        try:
            torch.compile(lambda t: t.cos() + 1, backend="eager")(torch.randn(3))
            state = SimpleNamespace(args=SimpleNamespace(compile=True), at_epoch_end=False, global_step=2,
                                    timer=SimpleNamespace(durations=[9.0, 0.2]))
            CompileReport().run(state)
        finally:
            counters.clear()
            torch._dynamo.reset()
    lines = [f"2026-01-01 12:00:00 INFO {r.name}: {r.getMessage()}" for r in caplog.records]
    choices = {}
    assert [compile_auto.feed(choices, line) for line in lines] == [True, True]
    assert choices["compile_checkpoint_keep"].startswith("attention (batch size 1: the least memory")
    md = compile_auto.markdown(choices, "LoRA")
    assert "`--compile_checkpoint_keep auto` → attention (batch size 1" in md
    assert "**Compile in the last LoRA run:** 1 graph compiled in " in md

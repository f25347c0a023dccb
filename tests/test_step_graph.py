"""--cuda_graph_step (library.compile.step_graph, library.compile.graphs): which runs may use it, and how steps go from ordinary runs to a captured
graph's replays. CUDA graphs need a GPU: here a stand-in capture re-runs the captured step on each replay (with the
batch tensors the real graph reads), so the bookkeeping around it is what is tested; the GPU check that the real
graph trains like the ordinary step is tools/benchmark_compile_suite.sh step_graph (docs/BENCHMARKS.md)."""
from __future__ import annotations

import argparse
import logging

import pytest
import torch

from library.compile import graphs as compile_graphs, step_graph
from library.train_util import ConfigError


def _args(**kw):
    base = dict(cuda_graph_step="on", gradient_accumulation_steps=1, cache_latents=True, cache_latents_to_disk=False,
                cache_text_encoder_outputs=True, cache_text_encoder_outputs_to_disk=False, mixed_precision="bf16",
                fused_backward_pass=False, cpu_offload_checkpointing=False, blocks_to_swap=0, compile=True,
                compile_backend="inductor", compile_mode="reduce-overhead", optimizer_type="AdamW",
                optimizer_args=[], use_8bit_adam=False, use_lion_optimizer=False, multires_noise_iterations=None)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("change, expected", [
    (dict(cache_latents=False), "needs cached latents (--cache_latents or --cache_latents_to_disk)"),
    (dict(cache_text_encoder_outputs=False), "needs cached text-encoder outputs"),
    (dict(mixed_precision="fp16"), "(--mixed_precision fp16); use bf16"),
    (dict(blocks_to_swap=4), "(--blocks_to_swap 4)"),
    (dict(cpu_offload_checkpointing=True), "cannot capture --cpu_offload_checkpointing"),
    (dict(compile_backend="cudagraphs"), "use --compile_backend inductor, not cudagraphs"),
    (dict(multires_noise_iterations=6), "cannot replay --multires_noise_iterations"),
    (dict(network_args=["conv_dim=4", "module_dropout=0.1"]), "cannot replay LoRA's module_dropout"),
])
def test_settings_it_cannot_follow_are_refused_by_name(change, expected, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError) as e:
        compile_graphs.check_args(_args(**change), ConfigError)
    assert str(e.value).startswith("--cuda_graph_step ") and expected in str(e.value)
    assert "drop --cuda_graph_step" in str(e.value)
    compile_graphs.check_args(_args(), ConfigError)  # the same run without that setting passes
    compile_graphs.check_args(_args(cuda_graph_step="off", **change), ConfigError)  # and without the flag
    compile_graphs.check_args(_args(cuda_graph_step="auto", **change), ConfigError)  # auto decides later


def test_the_trainer_refuses_it_with_exit_2_before_loading_a_model(tmp_path, capsys, monkeypatch,
                                                                   tiny_sd1_single_file, tiny_dataset_dir):
    import train_network
    from library import model_util

    monkeypatch.setattr(model_util, "load_sd_components",
                        lambda *a, **k: pytest.fail("a model was loaded before the error was found"))
    argv = ["--pretrained_model_name_or_path", str(tiny_sd1_single_file), "--train_data_dir", str(tiny_dataset_dir),
            "--output_dir", str(tmp_path / "out"), "--network_module", "networks.lora", "--resolution", "64",
            "--max_train_steps", "1", "--cuda_graph_step", "--cache_latents"]
    with pytest.raises(SystemExit) as e:
        train_network.main(argv)
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--cuda_graph_step needs cached text-encoder outputs" in errors[0], errors
    with pytest.raises(SystemExit) as e:  # everything cached: this machine has no CUDA GPU
        train_network.main(argv + ["--cache_text_encoder_outputs", "--network_train_unet_only"])
    assert e.value.code == 2
    assert "--cuda_graph_step needs a CUDA GPU" in capsys.readouterr().err


def test_blocks_compile_without_their_own_cuda_graphs_under_it():
    assert compile_graphs.block_compile_mode(_args()) == "default"
    assert compile_graphs.block_compile_mode(_args(compile_mode="max-autotune")) == "max-autotune-no-cudagraphs"
    assert compile_graphs.block_compile_mode(_args(cuda_graph_step="off")) == "reduce-overhead"
    assert compile_graphs.cuda_graphs(_args()) == "step"
    assert compile_graphs.cuda_graphs(_args(cuda_graph_step="off")) == "blocks"
    assert compile_graphs.cuda_graphs(_args(cuda_graph_step="off", compile_mode="default")) is None
    assert compile_graphs.cuda_graphs(_args(compile=False)) == "step"  # the step graph needs no compile
    assert compile_graphs.cuda_graphs(None) is None


def _batch(value: float, size: int = 4, multiplier: float = 1.0, **extra) -> dict:
    return {"latents": torch.full((1, size), value), "te_outputs": {"pooled": torch.full((1, 3), value)},
            "loss_weights": torch.ones(1), "network_multipliers": torch.full((1,), multiplier), "images": None,
            "captions": [f"caption {value}"], **extra}


def test_signature_holds_shapes_dtypes_nones_and_the_multiplier_not_values_or_captions():
    key = step_graph.signature(_batch(1.0))
    assert key == step_graph.signature(_batch(2.0))  # other values and captions: the same graph
    assert key != step_graph.signature(_batch(1.0, size=8))  # another bucket shape
    assert key != step_graph.signature(_batch(1.0, multiplier=0.5))  # a float the LoRA reads on the host
    assert key != step_graph.signature({**_batch(1.0), "alpha_masks": torch.ones(1, 8, 8)})
    dop = _batch(1.0, custom_attributes=[{"diff_output_preservation": True}])
    assert step_graph.signature(dop) is None


class _Replaying:
    """Stands in for a CUDA graph: replay() runs the captured step again on the batch tensors the graph was
    captured with, writing its loss into the tensor the capture returned."""

    def __init__(self, run, log: list):
        self.run, self.log = run, log
        self.loss = torch.zeros(())

    def replay(self):
        self.log.append("replay")
        self.loss.copy_(self.run())


class _Trainer:
    def __init__(self, fail_capture: bool = False):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        # fused, as library.optimizers makes it: the graph holds its step
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1, fused=True)
        self.log: list = []
        self.seen_batches: list[torch.Tensor] = []
        self.during_capture: list = []
        self.fail_capture = fail_capture

    def run_step(self, batch):
        self.seen_batches.append(batch["latents"].clone())
        x = batch["latents"].reshape(-1, batch["latents"].shape[-1])[:, :4]
        loss = (self.model(x) ** 2).mean()
        loss.backward()
        self.optimizer.step()
        return loss

    def capture(self, run, generators):
        group = self.optimizer.param_groups[0]
        self.during_capture.append((group["lr"], group["capturable"], [p.grad for p in self.model.parameters()]))
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        self.log.append("capture")
        graph = _Replaying(run, self.log)
        return graph, graph.loss


def test_each_shape_warms_up_then_replays_its_graph_with_the_new_batch_and_learning_rate(caplog):
    t = _Trainer()
    graphs = step_graph.StepGraphs([t.optimizer], "cpu", capture=t.capture)
    with caplog.at_level(logging.INFO, logger="library.compile.step_graph"):
        for i in range(step_graph.WARMUP):
            graphs.step(_batch(float(i)), t.run_step)
            assert all(p.grad is None for p in t.model.parameters())  # ordinary steps end with zero_grad
        assert t.log == []
        t.optimizer.param_groups[0]["lr"] = 0.05  # a scheduler's change
        loss = graphs.step(_batch(7.0), t.run_step)
    assert t.log == ["capture", "replay"]  # captured, then replayed for this very step
    lr, capturable, grads = t.during_capture[0]
    assert isinstance(lr, torch.Tensor) and lr.item() == pytest.approx(0.05) and capturable
    assert grads == [None, None]  # the graph's backward makes the gradients
    group = t.optimizer.param_groups[0]
    assert group["lr"] == 0.05 and group["capturable"] is False  # the ordinary settings come back
    assert torch.equal(t.seen_batches[-1], torch.full((1, 4), 7.0))
    assert loss.item() > 0
    assert "captured the training step for batch latents 1x4 (1 of at most 4 graphs)" in caplog.text

    group["lr"] = 0.01
    graphs.step(_batch(9.0), t.run_step)
    assert t.log == ["capture", "replay", "replay"]
    assert graphs.lrs[0].item() == pytest.approx(0.01)  # filled from the param group before the replay
    assert torch.equal(t.seen_batches[-1], torch.full((1, 4), 9.0))  # copied into the captured batch tensors
    static = graphs.graphs[step_graph.signature(_batch(0.0))].batch["latents"]
    assert torch.equal(static, torch.full((1, 4), 9.0))

    graphs.step(_batch(1.0, size=8), t.run_step)  # a new shape: ordinary steps first
    assert t.log.count("capture") == 1 and len(t.seen_batches) == 5
    for _ in range(step_graph.WARMUP):
        graphs.step(_batch(2.0, size=8), t.run_step)
    assert t.log.count("capture") == 2 and len(graphs.graphs) == 2


def test_no_more_than_limit_graphs(monkeypatch, caplog):
    monkeypatch.setattr(step_graph, "LIMIT", 1)
    t = _Trainer()
    graphs = step_graph.StepGraphs([t.optimizer], "cpu", capture=t.capture)
    with caplog.at_level(logging.INFO, logger="library.compile.step_graph"):
        for size in (4, 8):
            for _ in range(step_graph.WARMUP + 2):
                graphs.step(_batch(1.0, size=size), t.run_step)
    assert t.log.count("capture") == 1 and len(graphs.graphs) == 1
    assert "1 batch shapes have graphs; further shapes run without one" in caplog.text


def test_a_step_that_cannot_be_captured_runs_the_ordinary_way_and_the_run_goes_on(caplog):
    t = _Trainer(fail_capture=True)
    graphs = step_graph.StepGraphs([t.optimizer], "cpu", capture=t.capture)
    with caplog.at_level(logging.WARNING, logger="library.compile.step_graph"):
        for i in range(step_graph.WARMUP + 3):
            loss = graphs.step(_batch(float(i)), t.run_step)
            assert loss.grad_fn is None and loss.item() > 0  # detached: no autograd node outlives the step
    assert "replay" not in t.log  # every step the ordinary one
    assert len(t.during_capture) == 1  # tried once
    assert len(t.seen_batches) == step_graph.WARMUP + 3  # the failed step's batch trained too
    assert torch.equal(t.seen_batches[step_graph.WARMUP], torch.full((1, 4), float(step_graph.WARMUP)))
    assert "could not be captured (RuntimeError: operation not permitted when stream is capturing)" in caplog.text
    group = t.optimizer.param_groups[0]
    assert group["lr"] == 0.1 and group["capturable"] is False


def test_batches_no_graph_may_take_run_the_ordinary_way():
    t = _Trainer()
    graphs = step_graph.StepGraphs([t.optimizer], "cpu", capture=t.capture)
    for _ in range(step_graph.WARMUP + 2):
        graphs.step(_batch(1.0, custom_attributes=[{"diff_output_preservation": True}]), t.run_step)
    assert t.log == [] and len(t.seen_batches) == step_graph.WARMUP + 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA GPU")
def test_random_draws_work_after_a_failed_capture_once_the_generators_are_reset():
    # on an H100 (torch 2.11): without the reset the next draw failed with "Offset increment outside graph capture
    # encountered unexpectedly"
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(gen)
    torch.cuda.synchronize()
    with pytest.raises(Exception):
        with torch.cuda.graph(graph):
            torch.randn(4, device=device, generator=gen).sum().item()  # a host sync: capture refuses it
    step_graph._reset_generators([gen], device)
    drawn = torch.randn(4, device=device, generator=gen) + torch.rand(4, device=device)
    assert torch.isfinite(drawn).all()


# ---- --cuda_graph_step auto: what it decides, from the settings and the dataset's bucket shapes

class _Dataset:
    def __init__(self, *resolutions):
        self.buckets = {r: [0] for r in resolutions}


class _Group:
    def __init__(self, *datasets):
        self.datasets = list(datasets)


def _resolve(args, shapes=((1024, 1024),), processes=1, family="sdxl"):
    compile_graphs.resolve(args, [_Group(_Dataset(*shapes))], processes, family, ConfigError)
    return compile_graphs.cuda_graphs(args)


@pytest.mark.parametrize("change, family, why", [
    (dict(), "sdxl", None),
    (dict(optimizer_type="AdamW8bit"), "sdxl", None),
    (dict(optimizer_type="Prodigy"), "sdxl", None),
    (dict(), "sd1", None),  # measured faster with it (SD1.5 bs1 512, --torch_compile)
    (dict(), "sd2", None),  # SD2.1 768-v bs1 --torch_compile: 43.2 against 154.4 ms, + GC 53.6 against 209.4 (run93)
    (dict(compile=False), "sdxl", "is left off without --compile"),
    (dict(optimizer_type="AdaFactor"), "sdxl", None),
    (dict(optimizer_args=["foreach=True"]), "sdxl", None),
    (dict(), "flux", "is left off for FLUX.1"),
    (dict(), "lumina", "is left off for Lumina 2: its forward counts each caption's valid tokens on the host"),
    (dict(optimizer_type="DAdaptAdan"), "sdxl", "is left off for --optimizer_type DAdaptAdan: not shown"),
    (dict(gradient_accumulation_steps=4), "sdxl", None),  # tests/test_step_graph_gpu.py: the ordinary weights
    (dict(gradient_accumulation_steps=2, optimizer_type="AdamW8bit"), "sdxl", None),
    (dict(cache_text_encoder_outputs=False), "sdxl", "needs cached text-encoder outputs"),
    (dict(blocks_to_swap=2), "sdxl", "(--blocks_to_swap 2)"),
])
def test_auto_turns_it_on_where_it_can_follow_and_says_why_not(change, family, why, monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = _args(cuda_graph_step="auto", **change)
    with caplog.at_level(logging.INFO, logger="library.compile.graphs"):
        used = _resolve(args, family=family)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--cuda_graph_step auto")]
    assert len(lines) == 1, lines
    if why is None:
        assert used == "step" and lines[0].startswith("--cuda_graph_step auto: on")
        in_graph = change.get("optimizer_type", "AdamW") in compile_graphs.IN_GRAPH_OPTIMIZERS and \
            not change.get("optimizer_args")
        assert ("optimizer step inside the graph" in lines[0]) == in_graph
        accumulation = change.get("gradient_accumulation_steps", 1)
        assert (f"{accumulation} micro-steps a step: one graph for those that accumulate gradients" in lines[0]) == \
            (accumulation > 1)
    else:
        assert used == ("blocks" if args.compile else None)  # the blocks record their own CUDA graphs, as before
        assert lines[0].startswith("--cuda_graph_step auto: off; the step graph ") and why in lines[0], lines[0]
    if args.compile:
        assert compile_graphs.block_compile_mode(args) == ("default" if why is None else "reduce-overhead")


def test_auto_is_off_for_several_bucket_shapes_without_a_gpu_and_on_with_several_processes(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    caplog.set_level(logging.INFO, logger="library.compile.graphs")
    assert _resolve(_args(cuda_graph_step="auto"), shapes=((1024, 1024), (896, 1152))) == "blocks"
    assert "is left off for 2 bucket shapes" in caplog.text
    # data parallel: auto as on one GPU, the all-reduce inside the graph (2 H200s: 118.3 against 206.6 ms, run89)
    assert _resolve(_args(cuda_graph_step="auto"), processes=2) == "step"
    assert "; the gradients averaged over the 2 processes inside it)" in caplog.text
    assert _resolve(_args(cuda_graph_step="on"), processes=2) == "step"
    with pytest.raises(ConfigError, match="--cuda_graph_step cannot capture --fsdp's sharded training"):
        _resolve(_args(cuda_graph_step="on", fsdp="full_shard"), processes=2)
    assert _resolve(_args(cuda_graph_step="auto", fsdp="full_shard"), processes=2) == "blocks"
    assert _resolve(_args(cuda_graph_step="on"), shapes=((64, 64), (32, 128))) == "step"  # on: several shapes too
    assert _resolve(_args(cuda_graph_step="off")) == "blocks"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _resolve(_args(cuda_graph_step="auto")) == "blocks"
    assert "needs a CUDA GPU" in caplog.text


def test_unresolved_auto_counts_as_off_and_the_compile_settings_get_the_decision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = _args(cuda_graph_step="auto")
    assert compile_graphs.cuda_graphs(args) == "blocks"  # before resolve (checks before any model loads)
    compiled = argparse.Namespace(**vars(args))  # what --torch_compile makes for the SD1.x/SD2.x scripts
    args._torch_compile = compiled
    del args.compile, args.compile_backend, args.compile_mode  # the SD1.x/SD2.x scripts have no compile flags
    _resolve(args)
    assert compiled._step_graph_auto is True and compiled._input_shapes == 1
    assert compile_graphs.cuda_graphs(compiled) == "step"


@pytest.mark.parametrize("argv, expected", [
    ([], "auto"), (["--cuda_graph_step"], "on"), (["--cuda_graph_step", "off"], "off"),
    (["--cuda_graph_step", "true"], "on"), (["--cuda_graph_step", "False"], "off"),
])
def test_the_flag_keeps_its_old_forms(argv, expected):
    parser = argparse.ArgumentParser()
    compile_graphs.add_arguments(parser)
    assert parser.parse_args(argv).cuda_graph_step == expected


def test_config_files_that_say_true_or_false_keep_working(tmp_path):
    import sdxl_train_network
    from library import train_util

    parser = sdxl_train_network.setup_parser()
    for value, expected in (("true", "on"), ("false", "off"), ('"auto"', "auto")):
        path = tmp_path / "run.toml"
        path.write_text(f"cuda_graph_step = {value}\n")
        assert train_util.load_config_file(path, parser)["cuda_graph_step"] == expected
    path.write_text('cuda_graph_step = "sometimes"\n')
    with pytest.raises(ConfigError, match="cuda_graph_step = 'sometimes' is not allowed; allowed values: auto, on, off"):
        train_util.load_config_file(path, parser)


def test_compile_dynamic_auto_is_static_for_one_bucket_shape():
    from library.compile import options

    args = _args(cuda_graph_step="off", compile_dynamic="auto")
    assert options.dynamic_value(args) is None  # not known yet: as before
    _resolve(args, shapes=((1024, 1024),))
    assert options.dynamic_value(args) is False
    args._text_length_varies = True  # Chroma, Lumina 2, HunyuanImage: torch's automatic dynamic for the text length
    assert options.dynamic_value(args) is None
    del args._text_length_varies
    _resolve(args, shapes=((1024, 1024), (896, 1152)))
    assert options.dynamic_value(args) is None  # several shapes: the image-size dims marked dynamic
    args.compile_dynamic = "true"
    assert options.dynamic_value(args) is True


# ---- optimizers that step after the graph

class _StepAfter:
    """Stands in for a graph captured without the optimizer step: its backward writes the gradients into tensors of
    its own (made at capture, as a capture allocates them), whatever the parameters' .grad are now; replay() runs
    forward and backward again with the optimizer's step a no-op, as it was during the capture."""

    def __init__(self, run, optimizer, log):
        self.run, self.optimizer, self.log = run, optimizer, log
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.loss = torch.zeros(())
        _, self.grads = self._run()
        for p, g in zip(self.params, self.grads):
            p.grad = g  # as after a capture: the parameters hold the graph's gradient tensors

    def _run(self):
        before = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        own = self.optimizer.__dict__.get("step")
        self.optimizer.step = step_graph._skip_step
        try:
            loss = self.run()
        finally:
            del self.optimizer.step
            if own is not None:
                self.optimizer.step = own
        new = [p.grad for p in self.params]
        for p, g in zip(self.params, before):
            p.grad = g
        return loss, new

    def replay(self):
        self.log.append("replay")
        loss, new = self._run()
        self.loss.copy_(loss)
        for static, g in zip(self.grads, new):
            static.copy_(g)


def _sgd_trainer():
    t = _Trainer()
    t.optimizer = torch.optim.SGD(t.model.parameters(), lr=0.1, momentum=0.9)  # not fusable: steps after
    t.capture = lambda run, generators: (lambda g: (g, g.loss))(_StepAfter(run, t.optimizer, t.log))
    return t


def test_an_optimizer_outside_the_graph_steps_after_each_replay_and_trains_as_without_it(caplog):
    t, plain = _sgd_trainer(), _sgd_trainer()
    graphs = step_graph.StepGraphs([t.optimizer], "cpu", capture=t.capture)
    assert not graphs.optimizer_in_graph
    with caplog.at_level(logging.INFO, logger="library.compile.step_graph"):
        for i in range(step_graph.WARMUP + 4):
            graphs.step(_batch(float(i)), t.run_step)
            plain.run_step(_batch(float(i)))
            plain.optimizer.zero_grad(set_to_none=True)
            if i == step_graph.WARMUP + 1:
                t.optimizer.zero_grad(set_to_none=True)  # e.g. after validation: the graph's gradients come back
    assert t.log.count("replay") == 4 and graphs.off is None
    assert "the SGD step runs after each replay" in caplog.text
    for a, b in zip(t.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)
    assert t.optimizer.state[next(t.model.parameters())]["momentum_buffer"] is not None


def test_an_optimizer_that_gives_parameters_new_storage_ends_the_step_graphs(caplog):
    t = _sgd_trainer()
    step = t.optimizer.step

    def new_storage():
        step()
        for p in t.model.parameters():
            p.data = p.data.clone()

    t.optimizer.step = new_storage  # an instance's own step, as a scheduler's wrapper is
    graphs = step_graph.StepGraphs([t.optimizer], "cpu", capture=t.capture)
    with caplog.at_level(logging.WARNING, logger="library.compile.step_graph"):
        for i in range(step_graph.WARMUP + 3):
            graphs.step(_batch(float(i)), t.run_step)
    assert t.log.count("replay") == 1 and graphs.off and not graphs.graphs
    assert "gave a parameter new storage in its step" in caplog.text
    assert t.optimizer.step is new_storage  # put back after the capture


def test_the_gui_reads_older_files_that_say_true_or_false():
    from kohya_gui import params as P

    p = P.BY_NAME["cuda_graph_step"]
    assert p.kind == "choice" and p.default == "auto" and set(p.choices) == {"auto", "on", "off"}
    assert p.check(True) == "on" and p.check(False) == "off" and p.check("auto") == "auto"
    with pytest.raises(ValueError):
        p.check("sometimes")
    with pytest.raises(ValueError):
        P.BY_NAME["compile_dynamic"].check(True)  # only a switch that became on / off reads true / false


class _Accumulating:
    """A model trained with gradient accumulation: run_step steps the optimizer only at the window's end (as
    accelerate's wrapper does), the ordinary loop zeroes the gradients only then."""

    def __init__(self, fused: bool):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.1, fused=True) if fused else \
            torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.sync = False
        self.log: list = []

    def run_step(self, batch):
        x = batch["latents"].reshape(-1, batch["latents"].shape[-1])[:, :4]
        loss = ((self.model(x) - 1.0) ** 2).mean() / 3
        loss.backward()
        if self.sync:
            self.optimizer.step()
        return loss

    def capture(self, run, generators):
        self.log.append("capture")
        if self.optimizer.__dict__.get("step") is step_graph._skip_step:  # a real graph holds no step: nor here
            run = self._without_step(run)
        graph = _Replaying(run, self.log)
        return graph, graph.loss

    def _without_step(self, run):
        def replay():
            self.optimizer.step = step_graph._skip_step
            try:
                return run()
            finally:
                del self.optimizer.step
        return replay


@pytest.mark.parametrize("fused", [True, False], ids=["in-graph", "after-graph"])
def test_gradient_accumulation_replays_two_graphs_adding_into_the_same_gradients(fused, caplog):
    """With 3 micro-steps a window: a graph for the micro-steps that accumulate and one for the window's last (with
    the optimizer step), both adding into gradient tensors that outlive them; the weights are those of the ordinary
    accumulation loop."""
    t, plain = _Accumulating(fused), _Accumulating(fused)
    graphs = step_graph.StepGraphs([t.optimizer], "cpu", capture=t.capture, accumulation_steps=3)
    with caplog.at_level(logging.INFO, logger="library.compile.step_graph"):
        for i in range(3 * (step_graph.WARMUP + 4)):
            sync = i % 3 == 2
            t.sync = plain.sync = sync
            batch = _batch(float(i % 5) / 5)
            graphs.step(batch, t.run_step, sync=sync)
            plain.run_step(batch)
            if sync:
                plain.optimizer.zero_grad(set_to_none=True)
            if i == 3 * (step_graph.WARMUP + 2) + 2:  # e.g. after validation, at a window's end
                t.optimizer.zero_grad(set_to_none=True)
    assert t.log.count("capture") == 2 and len(graphs.graphs) == 2 and graphs.off is None
    assert t.log.count("replay") > 6
    assert "captured the training micro-step that accumulates gradients" in caplog.text
    for a, b in zip(t.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(torch.count_nonzero(g) == 0 for _, g in graphs.static_grads)  # zero after the window's step


def test_a_failed_capture_mid_window_keeps_the_windows_gradients(caplog):
    """Gradient accumulation: a capture that fails on a micro-step inside a window leaves the gradients of the
    window's earlier micro-steps, and the run goes on the ordinary way with the weights of the ordinary loop."""
    t, plain = _Accumulating(True), _Accumulating(True)

    def fail(run, generators):
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs = step_graph.StepGraphs([t.optimizer], "cpu", capture=fail, accumulation_steps=4)
    failed_at = []
    with caplog.at_level(logging.WARNING, logger="library.compile.step_graph"):
        for i in range(4 * (step_graph.WARMUP + 2)):
            t.sync = plain.sync = i % 4 == 3
            graphs.step(_batch(float(i % 5) / 5), t.run_step, sync=t.sync)
            if graphs.off and not failed_at:
                failed_at.append(i)
            plain.run_step(_batch(float(i % 5) / 5))
            if plain.sync:
                plain.optimizer.zero_grad(set_to_none=True)
    assert failed_at == [step_graph.WARMUP] and "could not be captured" in caplog.text  # after 2 micro-steps
    for a, b in zip(t.model.parameters(), plain.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

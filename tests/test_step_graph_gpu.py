"""--cuda_graph_step on a CUDA GPU: for torch's fused AdamW (stepped inside the graph) and each optimizer that
`--cuda_graph_step auto` lets step after the graph (library.compile.graphs.AFTER_GRAPH_OPTIMIZERS), a few steps
through library.compile.step_graph give the same weights as the same steps without it, with and without gradient
accumulation. The model is LoRA-like (a frozen bf16 base, fp32 down/up matrices, bf16 autocast), with clipping, a
schedule that changes the rate every step and noise drawn from a generator registered with the graph. Skipped
without CUDA; an optimizer whose package is not installed is skipped."""
from __future__ import annotations

import argparse

import pytest
import torch

from library import optimizers
from library.compile import graphs as compile_graphs
from library.compile import step_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")

CASES = [("AdamW", ()), ("AdamW", ("foreach=True",)),
         ("Prodigy", ("weight_decay=0.4", "use_bias_correction=True", "safeguard_warmup=True", "d0=1e-5")),
         ("Lion", ("weight_decay=0.1",))] + \
    [(n, ()) for n in compile_graphs.AFTER_GRAPH_OPTIMIZERS]
STEPS = step_graph.WARMUP + 5  # two ordinary steps, the capture's step, four replays


class _Lora(torch.nn.Module):
    def __init__(self, width: int = 64, rank: int = 8):
        super().__init__()
        self.base = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                        torch.nn.Linear(4 * width, width)).to(torch.bfloat16).requires_grad_(False)
        self.down = torch.nn.Parameter(torch.randn(rank, width) * 0.1)
        self.up = torch.nn.Parameter(torch.randn(width, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.down.t().to(x.dtype) @ self.up.t().to(x.dtype)


def _train(name: str, optimizer_args: tuple, with_graph: bool, device: str = "cuda", accumulation: int = 1):
    """-> (the trained weights, the StepGraphs that ran the steps or None); accumulation: micro-steps a window,
    clipping and the optimizer step at the window's end"""
    device = torch.device(device)
    torch.manual_seed(0)
    model = _Lora().to(device)
    known = optimizers.canonical_name(name) or ""
    args = argparse.Namespace(optimizer_type=name, optimizer_args=list(optimizer_args), use_8bit_adam=False,
                              use_lion_optimizer=False, max_grad_norm=1.0,
                              learning_rate=1.0 if known.startswith("DAdapt") or known == "Prodigy" else 1e-3)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizers.get_optimizer(args, [{"params": params}])[2]
    # a rate that changes every step (Adafactor with relative_step computes its own)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step)) \
        if optimizer.param_groups[0].get("lr") is not None else None
    generator = torch.Generator(device=device).manual_seed(1)
    target = torch.randn(4, 64, device=device, generator=torch.Generator(device=device).manual_seed(2))

    window = {"sync": True}

    def run_step(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            x = batch["latents"] + torch.randn(batch["latents"].shape, device=device, generator=generator)
            loss = torch.nn.functional.mse_loss(model(x).float(), target)
        (loss / accumulation).backward()
        if window["sync"]:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
        return loss

    graphs = step_graph.StepGraphs([optimizer], device, [generator], accumulation_steps=accumulation) \
        if with_graph else None
    micro_steps = STEPS * accumulation
    batches = torch.randn(micro_steps, 4, 64, device=device, generator=torch.Generator(device=device).manual_seed(3))
    for i in range(micro_steps):
        batch = {"latents": batches[i].clone(), "network_multipliers": [1.0]}
        window["sync"] = (i + 1) % accumulation == 0
        if graphs is not None:
            graphs.step(batch, run_step, sync=window["sync"])
        elif window["sync"]:
            run_step(batch)
            optimizer.zero_grad(set_to_none=True)
        else:
            run_step(batch)
        if schedule is not None and window["sync"]:
            schedule.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return [p.detach().clone() for p in params], graphs


@pytest.mark.parametrize("name, optimizer_args", CASES, ids=[f"{n}{'-' + '-'.join(a) if a else ''}" for n, a in CASES])
def test_the_step_graph_trains_to_the_same_weights_as_the_ordinary_step(name, optimizer_args):
    try:
        optimizers.optimizer_class(name)
    except Exception as e:  # noqa: BLE001 - an optional package that is not installed here
        pytest.skip(f"{name}: {e}")
    plain, _ = _train(name, optimizer_args, with_graph=False)
    graphed, graphs = _train(name, optimizer_args, with_graph=True)
    assert graphs.off is None and len(graphs.graphs) == 1  # captured, and replayed from then on
    assert graphs.optimizer_in_graph == (name == "AdamW" and not optimizer_args)
    for a, b in zip(graphed, plain):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    start = [p.detach().cuda() for p in _Lora().parameters() if p.requires_grad]
    assert all(not torch.equal(a, s) for a, s in zip(graphed, start))  # the steps moved the weights


ACCUMULATING = ["AdamW", *compile_graphs.AFTER_GRAPH_OPTIMIZERS]  # every optimizer auto lets use the step graph


@pytest.mark.parametrize("name", ACCUMULATING)
def test_with_gradient_accumulation_the_same_weights(name):
    """3 micro-steps a window: the accumulating micro-step's graph and the window's last (with clipping and, for
    AdamW, the optimizer step) add into the same gradients; the weights are the ordinary loop's."""
    try:
        optimizers.optimizer_class(name)
    except Exception as e:  # noqa: BLE001 - an optional package that is not installed here
        pytest.skip(f"{name}: {e}")
    plain, _ = _train(name, (), with_graph=False, accumulation=3)
    graphed, graphs = _train(name, (), with_graph=True, accumulation=3)
    assert graphs.off is None and len(graphs.graphs) == 2
    for a, b in zip(graphed, plain):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _sdxl_lora_argv(model, dataset, output_dir, name: str, *extra: str) -> list[str]:
    return ["--pretrained_model_name_or_path", str(model), "--tokenizer_cache_dir", str(model.parent / "tokenizers"),
            "--train_data_dir", str(dataset), "--output_dir", str(output_dir), "--output_name", name,
            "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "2",
            "--network_train_unet_only", "--resolution", "64,64", "--max_train_steps", "6",
            "--learning_rate", "1e-3", "--max_grad_norm", "1.0", "--max_data_loader_n_workers", "0", "--seed", "42",
            "--mixed_precision", "bf16", "--cache_latents", "--cache_text_encoder_outputs", *extra]


def _up_matrices(saved: dict) -> torch.Tensor:
    return torch.cat([saved[k].float().flatten() for k in sorted(saved) if k.endswith("lora_up.weight")])


# two trainer runs in a new process, where the first run of a process is the first
_TWO_RUNS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import sdxl_train_network
from library.network_trainer import run
for argv in json.loads(sys.argv[2]):
    run(sdxl_train_network.trainer(), sdxl_train_network.setup_parser(), argv)
"""


def test_two_trainer_runs_of_one_process_save_the_same_lora(tiny_sdxl_single_file, tiny_dataset_dir, tmp_path):
    """The first trainer run of a process saved other weights than every later run with the same flags (run87: up
    matrices 10% apart, on an H200) while the process-wide switches were set at the compile step, after the latents
    and text-encoder outputs were cached (library.compile.environment.apply_process_settings now sets them before
    any model runs). Two runs with the same flags, the first two of a new process, save the same LoRA."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from lora_checks import read_lora

    scripts = Path(__file__).resolve().parent.parent / "sd-scripts"
    argvs = [_sdxl_lora_argv(tiny_sdxl_single_file, tiny_dataset_dir, tmp_path, name, "--cuda_graph_step", "off")
             for name in ("first", "second")]
    subprocess.run([sys.executable, "-c", _TWO_RUNS, str(scripts), json.dumps(argvs)], check=True, timeout=600)
    first, second = (_up_matrices(read_lora(tmp_path / f"{name}.safetensors")[0]) for name in ("first", "second"))
    rel = ((second - first).norm() / first.norm()).item()
    print(f"first and second run of a process: up matrices {rel:.3g} apart (relative), equal: {torch.equal(first, second)}")
    assert first.norm() > 0 and torch.isfinite(second).all()
    assert rel < 1e-3, rel


@pytest.mark.parametrize("optimizer, accumulation", [("AdamW", 1), ("AdamW", 2), ("AdaFactor", 3)])
@pytest.mark.usefixtures("fresh_accelerate")
def test_the_sdxl_trainer_saves_the_same_lora_with_and_without_it(optimizer, accumulation, tmp_path,
                                                                  tiny_sdxl_single_file, tiny_dataset_dir, caplog):
    """The shipped SDXL LoRA trainer (tiny model, cached latents and text-encoder outputs, bf16): 6 optimizer steps
    with --cuda_graph_step on (captured, then replayed: with accumulation two graphs) save the LoRA of
    --cuda_graph_step off. AdamW steps inside the graph, Adafactor (the kohya_ss presets' arguments) after it; with 3
    micro-steps a window, each epoch's 8 batches end in a window cut short (accelerate syncs at an epoch's end)."""
    import logging

    import sdxl_train_network
    from library.network_trainer import run
    from lora_checks import read_lora

    caplog.set_level(logging.INFO, logger="library.compile.step_graph")
    extra = ["--optimizer_args", "scale_parameter=False", "relative_step=False", "warmup_init=False"] \
        if optimizer == "AdaFactor" else []
    saved = {}
    for setting in ("off", "on"):
        argv = _sdxl_lora_argv(tiny_sdxl_single_file, tiny_dataset_dir, tmp_path, setting,
                               "--gradient_accumulation_steps", str(accumulation), "--optimizer_type", optimizer, *extra,
                               "--cuda_graph_step", setting)
        saved[setting] = read_lora(run(sdxl_train_network.trainer(), sdxl_train_network.setup_parser(), argv))[0]
    captures = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step graph: captured")]
    assert len(captures) == (2 if accumulation > 1 else 1), captures
    assert not [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert saved["on"].keys() == saved["off"].keys()
    # the up matrices start at zero, so they are all training: the two runs' differ by GPU rounding only (bf16
    # kernels with atomic adds), far less than a step drawn from other noise or timesteps would make them differ
    off, on = _up_matrices(saved["off"]), _up_matrices(saved["on"])
    assert off.norm() > 0 and torch.isfinite(on).all()
    assert (on - off).norm() / off.norm() < 1e-2, ((on - off).norm() / off.norm()).item()


@pytest.fixture(scope="module")
def tiny_sd2_v_file(tmp_path_factory):
    """A tiny random SD2.x v-prediction single file (its tokenizer at path.parent / 'tokenizers')."""
    from library.tiny_models import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("tiny_sd2"), "sd2")


@pytest.mark.usefixtures("fresh_accelerate")
def test_the_sd2_v_trainer_saves_the_same_lora_with_and_without_it(tiny_sd2_v_file, tiny_dataset_dir, tmp_path, caplog):
    """SD2.x v-prediction through train_network.py (--v2 --v_parameterization, AdamW inside the graph): 6 steps with
    --cuda_graph_step on save the LoRA of --cuda_graph_step off (the v target is computed inside the graph)."""
    import logging

    import train_network
    from library.network_trainer import run
    from lora_checks import read_lora

    caplog.set_level(logging.INFO, logger="library.compile.step_graph")
    saved = {}
    for setting in ("off", "on"):
        argv = _sdxl_lora_argv(tiny_sd2_v_file, tiny_dataset_dir, tmp_path, setting, "--v2", "--v_parameterization",
                               "--cuda_graph_step", setting)
        saved[setting] = read_lora(run(train_network.trainer(), train_network.setup_parser(), argv))[0]
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("step graph: captured")]
    off, on = _up_matrices(saved["off"]), _up_matrices(saved["on"])
    assert off.norm() > 0 and torch.isfinite(on).all()
    assert (on - off).norm() / off.norm() < 1e-2, ((on - off).norm() / off.norm()).item()

"""SDXL LoRA trainer end to end on tiny models (CPU): eager (as a subprocess, from a config file), compiled with
aot_eager / inductor / two bucket shapes, resume from --save_state, and the named errors for bad input."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lora_checks import check_loads_in_diffusers, read_lora

REPO = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sdxl_components(tiny_sdxl_single_file):
    from library.model_util import load_sd_components

    return tiny_sdxl_single_file, tiny_sdxl_single_file.parent / "tokenizers"


def base_argv(model, out, data, name, steps=2, extra=()):
    return ["--pretrained_model_name_or_path", str(model), "--tokenizer_cache_dir", str(Path(model).parent / "tokenizers"),
            "--train_data_dir", str(data), "--output_dir", str(out), "--output_name", name,
            "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "2",
            "--resolution", "64,64", "--max_train_steps", str(steps), "--learning_rate", "1e-2",
            "--max_data_loader_n_workers", "0", "--seed", "42", *extra]


def load_components(model):
    from library.model_util import load_sd_components

    return load_sd_components(str(model), "sdxl", tokenizer_cache_dir=str(Path(model).parent / "tokenizers"))


def count_transformer_blocks(model) -> int:
    comps = load_components(model)
    return sum(1 for m in comps.unet.modules() if type(m).__name__ == "BasicTransformerBlock")


def check_kohya_sdxl_keys(sd: dict):
    names = {k.split(".")[0] for k in sd}
    assert all(k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for k in sd)
    assert any(n.startswith("lora_unet_input_blocks_") for n in names)
    assert any(n.startswith("lora_unet_middle_block_") for n in names)
    assert any(n.startswith("lora_unet_output_blocks_") for n in names)
    assert not any("down_blocks" in n or "up_blocks" in n or "_orig_mod" in n for n in names)
    assert any(n.startswith("lora_te1_text_model_encoder_layers_") for n in names)
    assert any(n.startswith("lora_te2_text_model_encoder_layers_") for n in names)
    for n in names:
        assert {f"{n}.lora_down.weight", f"{n}.lora_up.weight", f"{n}.alpha"} <= set(sd)


@pytest.mark.slow
def test_sdxl_eager_subprocess_from_config_file(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    """The script as users run it: a sectioned TOML (with a GUI-only [accelerate] table), a CLI flag that wins."""
    out = tmp_path / "out"
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        "[accelerate]\nnum_processes = 1\n\n"
        "[model]\n"
        f"pretrained_model_name_or_path = {json.dumps(str(tiny_sdxl_single_file))}\n"
        f"tokenizer_cache_dir = {json.dumps(str(tiny_sdxl_single_file.parent / 'tokenizers'))}\n"
        "[dataset]\n"
        f"train_data_dir = {json.dumps(str(tiny_dataset_dir))}\nresolution = \"64,64\"\nmax_data_loader_n_workers = 0\n"
        "[training]\n"
        f"output_dir = {json.dumps(str(out))}\noutput_name = \"mylora\"\nnetwork_module = \"networks.lora\"\n"
        "network_dim = 8\nnetwork_alpha = 4\nmax_train_steps = 2\nlearning_rate = 1e-2\nseed = 3\n"
        "optimizer_type = \"AdamW\"\noptimizer_args = [\"weight_decay=0.01\"]\nlr_scheduler = \"cosine\"\n")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a blue square --n blurry --w 64 --h 64 --s 2 --l 5 --d 11\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "sd-scripts/sdxl_train_network.py", "--config_file", str(cfg),
                           "--network_dim", "4", "--sample_prompts", str(prompts), "--sample_every_n_steps", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("steps: ")]
    assert lines and lines[-1].startswith("steps: 2/2 loss="), proc.stdout[-2000:]
    assert " it/s=" in lines[-1]
    # the run's own timing summary (library.step_timer): a 2-step run keeps its 2nd step in the median
    assert re.search(r"^median step \d+\.\d ms \(steps 2-2\); first step \d+\.\d s$", proc.stdout, re.M), \
        proc.stdout[-2000:]

    lora = out / "mylora.safetensors"
    sd, md = read_lora(lora)
    check_kohya_sdxl_keys(sd)
    # the CLI's --network_dim 4 beat the file's 8; everything else came from the file
    assert md["ss_network_dim"] == "4" and md["ss_network_alpha"] == "4.0"
    assert next(v for k, v in sd.items() if k.endswith("lora_down.weight")).shape[0] == 4
    assert md["ss_base_model_version"] == "sdxl_base_v1-0"
    assert md["ss_sd_model_name"] == "tiny_sdxl.safetensors"
    # the base model's hash (taken in a child process once the models are loaded) is the file's
    assert md["ss_new_sd_model_hash"] == hashlib.sha256(tiny_sdxl_single_file.read_bytes()).hexdigest()
    assert md["ss_steps"] == "2" and md["ss_epoch"] == "1" and md["ss_max_train_steps"] == "2"
    assert md["ss_optimizer"] == "torch.optim.adamw.AdamW(weight_decay=0.01)"
    assert md["ss_lr_scheduler"] == "cosine" and md["ss_learning_rate"] == "0.01"
    assert md["ss_output_name"] == "mylora" and md["ss_compile"] == "False"
    assert md["ss_resolution"] == "(64, 64)" and json.loads(md["ss_dataset_dirs"])
    assert float(md["ss_training_finished_at"]) >= float(md["ss_training_started_at"])
    assert len(md["sshs_model_hash"]) == 64 and len(md["sshs_legacy_hash"]) == 8
    # the run's TOML reproduces it: the merged options, loadable by the same parser
    import sdxl_train_network
    from library import train_util

    run_cfg = out / "mylora_config.toml"
    values = train_util.load_config_file(run_cfg, sdxl_train_network.setup_parser())
    assert values["network_dim"] == 4 and values["lr_scheduler"] == "cosine" and values["seed"] == 3
    assert not [p for p in out.iterdir() if p.name.startswith(".")], "temp files left behind"
    samples = list((out / "sample").glob("mylora_000002_00_*_11.png"))
    assert len(samples) == 1
    from PIL import Image

    assert Image.open(samples[0]).size == (64, 64)

    check_loads_in_diffusers(lora, load_components(tiny_sdxl_single_file))


def test_sdxl_compile_aot_eager(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir, caplog, monkeypatch):
    import sdxl_train_network
    from library.compile import graphs as compile_graphs

    caplog.set_level(logging.INFO)
    argv = base_argv(tiny_sdxl_single_file, tmp_path, tiny_dataset_dir, "compiled",
                     extra=["--compile", "--compile_backend", "aot_eager", "--gradient_checkpointing",
                            "--network_train_unet_only", "--cache_latents", "--cache_text_encoder_outputs",
                            "--gradient_accumulation_steps", "2"])
    trainer = sdxl_train_network.trainer()
    from library import network_trainer

    marks, micro_steps = [], []
    monkeypatch.setattr(compile_graphs, "mark_step_begin", lambda a: marks.append(len(micro_steps)))
    step = trainer.training_step
    monkeypatch.setattr(trainer, "training_step", lambda *a, **k: micro_steps.append(1) or step(*a, **k))
    # the base model's hash starts once the models are loaded (not while they load: it reads the whole file again)
    from library import metadata

    monkeypatch.setattr(metadata, "_HASHES", {})
    hashing_at_load = []
    load_models = trainer.load_models
    monkeypatch.setattr(trainer, "load_models",
                        lambda *a: hashing_at_load.append(dict(metadata._HASHES)) or load_models(*a))
    path = network_trainer.run(trainer, sdxl_train_network.setup_parser(), argv)
    assert hashing_at_load == [{}] and [k[0] for k in metadata._HASHES] == [str(tiny_sdxl_single_file)]
    # CUDA graphs: the step is marked once per optimizer step, before its first micro-step (2 steps x 2 micro-steps)
    assert len(trainer.losses) == 4 and marks == [0, 2]
    # --compile_dynamic auto with one bucket shape: static graphs
    assert "Compiling SDXL UNet with torch.compile: backend=aot_eager, mode=default, dynamic=False, fullgraph=False" \
        in caplog.text
    assert "static shapes (--compile_dynamic auto: the dataset has one bucket shape)" in caplog.text
    assert "--cuda_graph_step auto: off; the step graph cannot accumulate gradients" not in caplog.text
    if torch.cuda.is_available():  # gradient accumulation: one graph for the accumulating micro-step, one for the last
        assert "--cuda_graph_step auto: on (" in caplog.text and "2 micro-steps a step" in caplog.text
    else:
        assert "--cuda_graph_step auto: off; the step graph needs a CUDA GPU" in caplog.text
    assert "gradient checkpointing inside the compiled region (--compile_checkpoint_keep attention)" in caplog.text  # default
    n_blocks = count_transformer_blocks(tiny_sdxl_single_file)
    assert n_blocks > 0 and trainer.family.compiled_blocks == n_blocks
    sd, md = read_lora(path)
    names = {k.split(".")[0] for k in sd}
    assert names and all(n.startswith("lora_unet_") for n in names)  # --network_train_unet_only
    assert not any("_orig_mod" in k for k in sd)
    assert md["ss_compile"] == "True" and md["ss_compile_backend"] == "aot_eager"
    assert md["ss_compile_blocks"] == str(n_blocks) and md["ss_gradient_checkpointing"] == "True"
    assert md["ss_cache_latents"] == "True"
    assert all(torch.isfinite(torch.tensor(trainer.losses)))
    check_loads_in_diffusers(path, load_components(tiny_sdxl_single_file))


@pytest.mark.slow
def test_sdxl_compile_inductor(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir, caplog):
    import sdxl_train_network
    from library import network_trainer

    caplog.set_level(logging.INFO)
    argv = base_argv(tiny_sdxl_single_file, tmp_path, tiny_dataset_dir, "inductor",
                     extra=["--compile", "--network_train_unet_only", "--cache_latents",
                            "--cache_text_encoder_outputs"])
    trainer = sdxl_train_network.trainer()
    path = network_trainer.run(trainer, sdxl_train_network.setup_parser(), argv)
    assert "Compiling SDXL UNet with torch.compile: backend=inductor, mode=default" in caplog.text
    assert trainer.family.compiled_blocks == count_transformer_blocks(tiny_sdxl_single_file)
    sd, md = read_lora(path)
    assert md["ss_compile_backend"] == "inductor" and not any("_orig_mod" in k for k in sd)
    check_loads_in_diffusers(path, load_components(tiny_sdxl_single_file))


def test_sdxl_compile_two_buckets_dynamic_auto(tmp_path, tiny_sdxl_diffusers, caplog):
    """Also the diffusers-folder layout of the model."""
    import sdxl_train_network
    from library import network_trainer
    from library.tiny_models import make_captioned_images

    data = tmp_path / "data"
    make_captioned_images(data, n=1, size=(64, 64), repeats=1, name="square")
    make_captioned_images(data, n=1, size=(128, 32), repeats=1, name="wide")
    caplog.set_level(logging.INFO)
    argv = base_argv(tiny_sdxl_diffusers, tmp_path / "out", data, "buckets",
                     extra=["--enable_bucket", "--bucket_reso_steps", "32", "--min_bucket_reso", "32",
                            "--max_bucket_reso", "128", "--compile", "--compile_backend", "aot_eager",
                            "--compile_dynamic", "auto", "--network_train_unet_only"])
    trainer = sdxl_train_network.trainer()
    path = network_trainer.run(trainer, sdxl_train_network.setup_parser(), argv)
    sd, md = read_lora(path)
    buckets = json.loads(md["ss_bucket_info"])["buckets"]
    assert sorted(tuple(b["resolution"]) for b in buckets.values()) == [(64, 64), (128, 32)]
    assert md["ss_compile_dynamic"] == "auto" and md["ss_steps"] == "2"
    # one line per bucket shape (latents 8x8 and 16x4 here), no torch recompile lines
    shapes = [r.getMessage() for r in caplog.records if "torch.compile: new input shape" in r.getMessage()]
    assert len(shapes) == 2 and len(set(shapes)) == 2, shapes
    assert "image-size dimensions of their inputs dynamic" in caplog.text  # several bucket shapes: shape-generic
    assert "__recompiles" not in caplog.text and "Recompiling function" not in caplog.text
    assert trainer.family.compiled_blocks == count_transformer_blocks(tiny_sdxl_diffusers)
    check_loads_in_diffusers(path, load_components(tiny_sdxl_diffusers))


def test_sdxl_resume_from_saved_state(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    """Two steps in one go == one step, --save_state, then --resume for the second step."""
    import sdxl_train_network
    from library import network_trainer

    extra = ["--network_train_unet_only", "--save_every_n_steps", "1", "--save_state"]
    full = network_trainer.run(sdxl_train_network.trainer(), sdxl_train_network.setup_parser(),
                               base_argv(tiny_sdxl_single_file, tmp_path, tiny_dataset_dir, "full", extra=extra))
    state = tmp_path / "full-step00000001-state"
    assert (tmp_path / "full-step00000001.safetensors").is_file() and state.is_dir()
    assert (tmp_path / "full-state").is_dir()  # the last state, at the end of training
    resumed_trainer = sdxl_train_network.trainer()
    resumed = network_trainer.run(resumed_trainer, sdxl_train_network.setup_parser(),
                                  base_argv(tiny_sdxl_single_file, tmp_path, tiny_dataset_dir, "resumed",
                                            extra=["--network_train_unet_only", "--resume", str(state)]))
    assert len(resumed_trainer.losses) == 1  # only the second step ran
    a, _ = read_lora(full)
    b, md = read_lora(resumed)
    assert md["ss_steps"] == "2"
    step1, _ = read_lora(tmp_path / "full-step00000001.safetensors")
    assert any(not torch.equal(step1[k], a[k]) for k in a)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


# ---------------------------------------------------------------------------------------------------------
# bad input: each case is refused with its named error, before any model loads where that is possible


def _train(argv):
    import sdxl_train_network
    from library import train_util

    args = train_util.parse_args(sdxl_train_network.setup_parser(), argv)
    return sdxl_train_network.trainer().train(args)


def test_empty_dataset_stops_before_model_loads(tmp_path):
    from library.datasets import DatasetError

    empty = tmp_path / "data" / "1_empty"
    empty.mkdir(parents=True)
    # the model path does not exist: the dataset error must come first
    with pytest.raises(DatasetError, match="no training images"):
        _train(base_argv(tmp_path / "missing.safetensors", tmp_path / "out", tmp_path / "data", "x"))
    assert not (tmp_path / "out").exists()


def test_missing_optional_optimizer_package(tmp_path, tiny_dataset_dir, monkeypatch):
    from library.train_util import OptionalPackageError

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as when not installed
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", None)
    with pytest.raises(OptionalPackageError, match="bitsandbytes.*pip install bitsandbytes"):
        _train(base_argv(tmp_path / "missing.safetensors", tmp_path / "out", tiny_dataset_dir, "x",
                         extra=["--optimizer_type", "AdamW8bit"]))


def test_bad_compile_settings_refused(tmp_path, tiny_dataset_dir):
    from library.compile.options import CompileConfigError

    with pytest.raises(CompileConfigError, match="--compile_mode reduce-overhead"):
        _train(base_argv(tmp_path / "missing.safetensors", tmp_path / "out", tiny_dataset_dir, "x",
                         extra=["--compile", "--compile_backend", "aot_eager", "--compile_mode", "reduce-overhead"]))


def test_existing_output_not_overwritten(tmp_path, tiny_dataset_dir):
    from library.train_util import OutputExistsError

    (tmp_path / "x.safetensors").write_bytes(b"earlier work")
    with pytest.raises(OutputExistsError, match="--overwrite_output"):
        _train(base_argv(tmp_path / "missing.safetensors", tmp_path, tiny_dataset_dir, "x"))
    assert (tmp_path / "x.safetensors").read_bytes() == b"earlier work"
    # epoch / step saves of an unfinished earlier run are protected too (refused before any model loads)
    (tmp_path / "y-step00000010.safetensors").write_bytes(b"earlier step save")
    with pytest.raises(OutputExistsError, match="y-step00000010.safetensors"):
        _train(base_argv(tmp_path / "missing.safetensors", tmp_path, tiny_dataset_dir, "y"))
    # a run that fails before training (here: the model path) leaves no settings file, and the next try runs
    from library.model_util import ModelLoadError

    with pytest.raises(ModelLoadError):
        _train(base_argv(tmp_path / "missing.safetensors", tmp_path, tiny_dataset_dir, "z"))
    assert not (tmp_path / "z_config.toml").exists()
    with pytest.raises(ModelLoadError):
        _train(base_argv(tmp_path / "missing.safetensors", tmp_path, tiny_dataset_dir, "z"))


@pytest.mark.parametrize("extra, error, match", [
    (["--cache_text_encoder_outputs"], "ConfigError", "--network_train_unet_only"),
    (["--network_args", "conv_dimm=4"], "NetworkArgsError", "conv_dimm.*allowed: conv_dim"),
    (["--optimizer_type", "Adam9000"], "ConfigError", "--optimizer_type Adam9000 is not supported; allowed: AdamW"),
    (["--lr_scheduler", "cosine_forever"], "ConfigError", "--lr_scheduler 'cosine_forever'"),
    (["--network_weights", "nope.safetensors"], "ConfigError", "--network_weights: file not found"),
    (["--v2"], "ConfigError", "--v2"),
    (["--full_bf16"], "ConfigError", "--full_bf16 needs --mixed_precision bf16"),
])
def test_bad_options_named(tmp_path, tiny_dataset_dir, extra, error, match):
    from library import train_util
    from networks import lora

    cls = {"ConfigError": train_util.ConfigError, "NetworkArgsError": lora.NetworkArgsError}[error]
    with pytest.raises(cls, match=match):
        _train(base_argv(tmp_path / "missing.safetensors", tmp_path / "out", tiny_dataset_dir, "x", extra=extra))


def test_bad_sample_prompt_file_refused_early(tmp_path, tiny_dataset_dir):
    from library.sample_prompts import PromptFileError

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat --w 63\n")
    with pytest.raises(PromptFileError, match="width"):
        _train(base_argv(tmp_path / "missing.safetensors", tmp_path / "out", tiny_dataset_dir, "x",
                         extra=["--sample_prompts", str(prompts), "--sample_every_n_steps", "1"]))


def test_cli_error_exits_cleanly(tmp_path, tiny_dataset_dir, capsys):
    import sdxl_train_network

    cfg = tmp_path / "cfg.toml"
    cfg.write_text("network_dimm = 4\n")
    with pytest.raises(SystemExit) as e:
        sdxl_train_network.main(["--config_file", str(cfg)])
    assert e.value.code == 2
    assert "unknown key 'network_dimm' (did you mean 'network_dim'?)" in capsys.readouterr().err


@pytest.mark.slow
def test_min_timestep_equal_to_max_timestep_trains_at_that_timestep(tmp_path, tiny_sdxl_single_file,
                                                                     tiny_dataset_dir, monkeypatch):
    """Issue 24 bug 1: `--min_timestep 300 --max_timestep 300` trains every step at t=300, as upstream and
    library.noise accept it (train_util refused it with a second, different check)."""
    import sdxl_train_network
    from library import network_trainer, noise

    seen = []
    real = noise.sample_timesteps

    def recording(*a, **k):
        t = real(*a, **k)
        seen.append(t.tolist())
        return t

    monkeypatch.setattr(noise, "sample_timesteps", recording)
    out = network_trainer.run(sdxl_train_network.trainer(), sdxl_train_network.setup_parser(),
                              base_argv(tiny_sdxl_single_file, tmp_path, tiny_dataset_dir, "t300", steps=2,
                                        extra=["--network_train_unet_only", "--min_timestep", "300",
                                               "--max_timestep", "300"]))
    assert Path(out).is_file()
    assert seen and all(t == 300 for step in seen for t in step)

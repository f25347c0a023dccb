"""--validate_only (library.validate_only): the run's own checks and a few more, every problem at once, without
loading a model; and the GUI's Start / Print asking the trainer through it (kohya_gui.trainer_check)."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from kohya_gui import REPO

FAMILY_OF = {"sdxl_train_network": "sdxl", "train_network": "sd1", "flux_train_network": "flux",
             "sdxl_train": "sdxl", "train_db": "sd1", "fine_tune": "sd1", "flux_train": "flux"}


@pytest.fixture
def not_models(tmp_path):
    """Empty files where the model files go: a check that loaded a model would fail on them."""
    paths = {}
    for name in ("model.safetensors", "clip_l.safetensors", "t5xxl.safetensors", "ae.safetensors"):
        (tmp_path / name).write_bytes(b"")
        paths[name.split(".")[0]] = str(tmp_path / name)
    return paths


def argv_for(script, models, data, out, *extra):
    argv = ["--pretrained_model_name_or_path", models["model"], "--train_data_dir", str(data),
            "--output_dir", str(out), "--output_name", "v", "--resolution", "64", "--validate_only"]
    if FAMILY_OF[script] == "flux":
        argv += ["--clip_l", models["clip_l"], "--t5xxl", models["t5xxl"], "--ae", models["ae"]]
    if script.endswith("_network"):
        argv += ["--network_module", "networks.lora_flux" if FAMILY_OF[script] == "flux" else "networks.lora"]
    return argv + list(extra)


@pytest.mark.parametrize("script", sorted(FAMILY_OF))
def test_every_script_checks_and_exits_without_loading_a_model(script, not_models, tiny_dataset_dir, tmp_path,
                                                               capsys):
    module = importlib.import_module(script)
    assert module.main(argv_for(script, not_models, tiny_dataset_dir, tmp_path / "out")) is None
    out = capsys.readouterr().out
    assert "validate_only: ok (4 training images; no model loaded)" in out
    assert not (tmp_path / "out").exists()  # nothing written


def test_all_problems_are_reported_at_once_with_exit_2(not_models, tmp_path, capsys):
    import sdxl_train_network

    empty = tmp_path / "empty"
    (empty / "1_x").mkdir(parents=True)
    argv = argv_for("sdxl_train_network", dict(not_models, model=str(tmp_path / "missing.safetensors")), empty,
                    tmp_path / "out", "--compile", "--compile_backend", "aot_eager", "--compile_mode",
                    "reduce-overhead", "--optimizer_type", "nosuchpackage.FastAdam", "--vae", str(tmp_path / "vae"))
    with pytest.raises(SystemExit) as e:
        sdxl_train_network.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for expected in ("--pretrained_model_name_or_path: file not found", "--vae: file not found",
                     "--compile_mode reduce-overhead only applies to --compile_backend inductor",
                     "nosuchpackage", "no training images found"):
        assert expected in err, expected
    assert "Traceback" not in err


def test_a_missing_output_dir_is_a_problem_not_a_traceback(not_models, tiny_dataset_dir, tmp_path, capsys):
    import sdxl_train_network

    argv = argv_for("sdxl_train_network", not_models, tiny_dataset_dir, tmp_path / "out")
    i = argv.index("--output_dir")
    with pytest.raises(SystemExit) as e:
        sdxl_train_network.main(argv[:i] + argv[i + 2:])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--output_dir is required" in err and "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a CUDA GPU")
def test_cudagraphs_backend_without_a_gpu_is_refused(not_models, tiny_dataset_dir, tmp_path, capsys):
    import sdxl_train_network

    with pytest.raises(SystemExit):
        sdxl_train_network.main(argv_for("sdxl_train_network", not_models, tiny_dataset_dir, tmp_path / "o",
                                         "--compile", "--compile_backend", "cudagraphs"))
    assert "--compile_backend cudagraphs records CUDA graphs and needs a CUDA GPU" in capsys.readouterr().err


def test_the_script_on_the_command_line_lists_problems_without_a_traceback(not_models, tmp_path):
    argv = argv_for("sdxl_train_network", not_models, tmp_path / "no_data", tmp_path / "out")
    proc = subprocess.run([sys.executable, str(REPO / "sd-scripts" / "sdxl_train_network.py"), *argv],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--train_data_dir: folder not found" in proc.stderr and "Traceback" not in proc.stderr


def test_the_gui_reads_the_trainers_problems():
    from kohya_gui import trainer_check

    stderr = "some log line\nerror: 2 problem(s) found:\n- --vae: file not found: x\n- the dataset has no images\n"
    assert trainer_check.parse_errors(stderr) == ["--vae: file not found: x", "the dataset has no images"]
    assert trainer_check.parse_errors("error: --network_weights: file not found: y\n") == [
        "--network_weights: file not found: y"]


def test_gui_start_with_a_missing_model_starts_nothing(tmp_path, tiny_dataset_dir):
    from kohya_gui import params as P
    from kohya_gui import training
    from kohya_gui.runner import Runner

    values = dict(P.defaults("lora"), pretrained_model_name_or_path=str(tmp_path / "gone.safetensors"),
                  train_data_dir=str(tiny_dataset_dir), output_dir=str(tmp_path / "out"), output_name="x",
                  resolution="64")
    runner = Runner()
    with pytest.raises(training.RunError, match="--pretrained_model_name_or_path: file not found"):
        training.start(runner, "lora", "SDXL", values)
    assert not runner.running and not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, expected", [
    # the run's own check (upstream's verify_bucket_reso_steps): SD1.x needs a multiple of 64
    (["--enable_bucket", "--bucket_reso_steps", "32", "--min_bucket_reso", "64"], "bucket_reso_steps is 32: this script needs a multiple of 64"),
    # 64 px images in 256 px steps: an empty bucket, named, instead of a ZeroDivisionError
    (["--enable_bucket", "--bucket_reso_steps", "256", "--resolution", "512", "--bucket_no_upscale"],
     "(64x64) is smaller than bucket_reso_steps (256)"),
])
def test_what_the_run_refuses_about_buckets_is_found_first(extra, expected, not_models, tiny_dataset_dir, tmp_path,
                                                           capsys):
    import train_network

    with pytest.raises(SystemExit) as e:
        train_network.main(argv_for("train_network", not_models, tiny_dataset_dir, tmp_path / "out", *extra))
    assert e.value.code == 2
    assert expected in capsys.readouterr().err

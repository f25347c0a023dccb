"""Data-parallel training through `accelerate launch` with 2 CPU processes (gloo): both processes train on
their half of the batches, their weights stay identical (gradients averaged), and exactly one set of outputs
is written, by the main process.

On a machine without GPUs, accelerate's `--cpu --num_processes 2` starts a single process (its simple
launcher); 2 CPU processes come from `--multi_gpu` (torchrun) with ACCELERATE_USE_CPU=1, which is what
these tests launch. Without ACCELERATE_USE_CPU the trainers refuse to run as N unconnected processes.
"""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, args: list, *, cpu_env: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if cpu_env:
        env["ACCELERATE_USE_CPU"] = "1"
    else:
        env.pop("ACCELERATE_USE_CPU", None)
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
           "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1", str(REPO / "sd-scripts" / script)]
    return subprocess.run(cmd + [str(a) for a in args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def common(model: Path, data: Path, out: Path, name: str, seed: int | None = 3) -> list:
    return ["--pretrained_model_name_or_path", model, "--tokenizer_cache_dir", model.parent / "tokenizers",
            "--train_data_dir", data, "--caption_extension", ".txt", "--resolution", "64", "--output_dir", out,
            "--output_name", name, "--max_train_steps", 2, "--max_data_loader_n_workers", 0, "--learning_rate", 1e-3,
            *(["--seed", seed] if seed is not None else [])]


def check_both_ranks_trained(proc: subprocess.CompletedProcess, batches_per_rank: int) -> None:
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    for rank in (0, 1):
        assert f"process {rank}/2 (cpu" in log and f"trains {batches_per_rank} batches per epoch" in log, log[-4000:]
    done = dict(re.findall(r"process (\d)/2 finished 2 steps, last loss [-\d.naninf]+, weights checksum (\S+)", log))
    assert set(done) == {"0", "1"}, log[-4000:]
    assert done["0"] == done["1"], f"the processes hold different weights: {done}"
    assert log.count("steps: 2/2 ") == 1  # the progress line comes from the main process only


@pytest.mark.slow
def test_two_process_sdxl_lora(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    import shutil

    out = tmp_path / "out"
    data = shutil.copytree(tiny_dataset_dir, tmp_path / "data")  # the disk caches are written beside the images
    proc = launch("sdxl_train_network.py", common(tiny_sdxl_single_file, data, out, "lora")
                  + ["--network_module", "networks.lora", "--network_dim", 4, "--save_every_n_steps", 1,
                     "--save_state", "--compile", "--compile_backend", "eager", "--lr_scheduler", "linear",
                     "--lr_warmup_steps", 2, "--cache_latents_to_disk", "--cache_text_encoder_outputs_to_disk",
                     "--network_train_unet_only"])
    check_both_ranks_trained(proc, batches_per_rank=4)  # 8 batches (4 images x 2 repeats) split over 2
    # disk caches: the main process encodes and writes them, the other waits and then reuses its files
    log = proc.stdout + proc.stderr
    for what, line in (("latents", "caching latents: {} images to encode, {} reused from disk"),
                       ("text encoder outputs", "caching text encoder outputs: {} captions to encode, {} reused "
                                                "from disk")):
        assert f"process 0/2 caches the {what} to disk" in log and f"process 1/2 reads the {what}" in log, log
        assert log.count(line.format(4, 0)) == 1 and log.count(line.format(0, 4)) == 1, log
        assert log.index(line.format(4, 0)) < log.index(line.format(0, 4))
    # the LR schedule as upstream's accelerate-prepared one: 2 x 2 = 4 scheduler steps, 2 per optimizer step,
    # so the warmup of 2 ends with the first step (lr 1e-3; one process would be half-way, 5e-4)
    assert re.search(r"steps: 1/2 .*lr=1\.00e-03", proc.stdout), proc.stdout[-2000:]
    # each process compiles its own UNet
    assert (proc.stdout + proc.stderr).count("Compiling SDXL UNet with torch.compile: backend=eager") == 2
    assert sorted(p.name for p in out.iterdir()) == [  # step saves at every step, the last one too (upstream)
        "lora-state", "lora-step00000001-state", "lora-step00000001.safetensors", "lora-step00000002-state",
        "lora-step00000002.safetensors", "lora.safetensors", "lora_config.toml"]
    # every process saved its own RNG state into the one state folder
    assert {p.name for p in (out / "lora-state").glob("random_states_*.pkl")} == {"random_states_0.pkl",
                                                                                   "random_states_1.pkl"}


@pytest.mark.slow
def test_two_process_sdxl_dreambooth(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    from library.tiny_models import make_captioned_images

    reg = make_captioned_images(tmp_path / "reg", n=2, size=(64, 64), repeats=1, name="dog")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a sks dog --w 64 --h 64 --s 2 --d 1\n")
    out = tmp_path / "out"
    proc = launch("sdxl_train.py", common(tiny_sdxl_single_file, tiny_dataset_dir, out, "db", seed=None)
                  + ["--reg_data_dir", reg, "--train_text_encoder", "--save_every_n_steps", 1,
                     "--sample_prompts", prompts, "--sample_every_n_steps", 2])
    check_both_ranks_trained(proc, batches_per_rank=8)  # 8 train + 8 balanced reg batches split over 2
    # no --seed: the main process draws one and every process uses it (they must agree on the data order)
    seeds = re.findall(r"seed: (\d+) \(random", proc.stdout + proc.stderr)
    assert len(seeds) == 2 and seeds[0] == seeds[1], seeds
    assert sorted(p.name for p in out.iterdir()) == ["db-step00000001.safetensors", "db-step00000002.safetensors",
                                                     "db.safetensors", "db_config.toml", "sample"]
    assert [p.suffix for p in (out / "sample").iterdir()] == [".png"]  # sampled once, by the main process


def test_processes_that_accelerate_did_not_join_are_refused():
    from types import SimpleNamespace

    from library import data_parallel

    os.environ["WORLD_SIZE"] = "2"
    try:
        with pytest.raises(RuntimeError, match="ACCELERATE_USE_CPU=1"):
            data_parallel.check_launch(SimpleNamespace(num_processes=1))
        data_parallel.check_launch(SimpleNamespace(num_processes=2))
    finally:
        del os.environ["WORLD_SIZE"]

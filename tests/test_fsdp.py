"""--fsdp (library/sharding.py): FSDP2 sharding of the full trainers over the processes of `accelerate launch`.

The slow tests launch 2 CPU processes (gloo; ACCELERATE_USE_CPU=1 with --multi_gpu, as
test_multiprocess_training.py): a sharded run saves one ordinary model file equal to the data-parallel run's, and
its sharded state resumes on 2 processes and on 1."""
from __future__ import annotations

import gc
import importlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def train(script: str, argv: list) -> str:
    return importlib.import_module(script).main([str(a) for a in argv])


@pytest.mark.parametrize("extra, message", [
    (["--fsdp", "full_shard", "--fused_backward_pass", "--optimizer_type", "Adafactor"],
     "--fsdp cannot be used with --fused_backward_pass"),
    (["--fsdp", "full_shard", "--mixed_precision", "fp16"], "use --mixed_precision bf16"),
    (["--fsdp", "shard_grad_op", "--ema_decay", "0.99"], "--fsdp cannot be used with --ema_decay"),
    (["--fsdp_cpu_offload"], "--fsdp_cpu_offload needs --fsdp"),
    (["--fsdp", "zero3"], "argument --fsdp: invalid choice: 'zero3'"),
])
def test_fsdp_refuses_what_it_cannot_go_with(tmp_path, capsys, extra, message):
    argv = ["--pretrained_model_name_or_path", tmp_path / "none.safetensors", "--train_data_dir", tmp_path,
            "--output_dir", tmp_path / "out"] + extra
    with pytest.raises(SystemExit) as e:
        train("sdxl_train", argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_accelerate_fsdp_config_is_taken_as_fsdp(monkeypatch):
    from library import sharding

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    args = SimpleNamespace(fsdp=None, fsdp_cpu_offload=False)
    sharding.from_accelerate_config(args)
    assert (args.fsdp, args.fsdp_cpu_offload) == ("shard_grad_op", True)
    assert os.environ["ACCELERATE_USE_FSDP"] == "false"  # accelerate's own wrapper stays off
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "1")
    monkeypatch.setenv("FSDP_SHARDING_STRATEGY", "NO_SHARD")
    from library.errors import ConfigError

    with pytest.raises(ConfigError, match="NO_SHARD is not supported here"):
        sharding.from_accelerate_config(SimpleNamespace(fsdp=None, fsdp_cpu_offload=False))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # a LoRA trainer (no --fsdp): data parallel, no FSDP wrapper
    sharding.from_accelerate_config(SimpleNamespace())
    assert os.environ["ACCELERATE_USE_FSDP"] == "false"


def test_unet_blocks_sharded_one_by_one(tiny_sdxl_single_file):
    from conftest import load_tiny_components
    from library import sharding

    unet = load_tiny_components(tiny_sdxl_single_file, "sdxl").unet
    blocks = sharding.shard_blocks(unet)
    kinds = [type(b).__name__ for b in blocks]
    assert set(kinds) == {"BasicTransformerBlock", "ResnetBlock2D"}
    assert kinds.count("BasicTransformerBlock") == sum(type(m).__name__ == "BasicTransformerBlock"
                                                       for m in unet.modules())
    inner = {id(m) for b in blocks for m in b.modules() if m is not b}
    assert not any(id(b) in inner for b in blocks)  # none inside another


# ---- 2 processes (gloo) ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", ACCELERATE_USE_CPU="1")


def launch_command(processes: int, script: str, args: list) -> list[str]:
    """`accelerate launch` of `processes` CPU processes (gloo with launch_env's ACCELERATE_USE_CPU) of a trainer."""
    several = ["--multi_gpu"] if processes > 1 else []
    return [str(Path(sys.executable).parent / "accelerate"), "launch", *several, "--num_processes", str(processes),
            "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
            "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1", str(REPO / "sd-scripts" / script),
            *(str(a) for a in args)]


def launch(processes: int, args: list, timeout: int = 400, script: str = "sdxl_train.py") -> subprocess.CompletedProcess:
    proc = subprocess.run(launch_command(processes, script, args), env=launch_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def sdxl_args(model: Path, data: Path, out: Path, name: str, steps: int) -> list:
    # SGD: the weights follow the gradients linearly (Adam's first steps turn a rounding difference of a ~0 gradient
    # into a whole learning-rate step), so both runs can be compared to 1e-4
    return ["--pretrained_model_name_or_path", model, "--tokenizer_cache_dir", model.parent / "tokenizers",
            "--train_data_dir", data, "--caption_extension", ".txt", "--resolution", "64", "--output_dir", out,
            "--output_name", name, "--max_train_steps", steps, "--max_data_loader_n_workers", 0, "--seed", 3,
            "--optimizer_type", "torch.optim.SGD", "--learning_rate", 0.05, "--train_text_encoder",
            "--gradient_checkpointing"]


def relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    diff = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a) ** 0.5
    return diff / sum(float((b[k].double() ** 2).sum()) for k in b) ** 0.5


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, tiny_sdxl_single_file, tiny_dataset_dir):
    out = tmp_path_factory.mktemp("fsdp")
    args = sdxl_args(tiny_sdxl_single_file, tiny_dataset_dir, out / "fsdp", "ft", 2)
    proc = launch(2, args + ["--fsdp", "full_shard", "--save_state"])
    return SimpleNamespace(out=out / "fsdp", args=args, log=proc.stdout + proc.stderr, root=out)


@pytest.mark.slow
def test_fsdp_saves_one_file_with_the_data_parallel_weights(sharded_run, tiny_sdxl_single_file, tiny_dataset_dir):
    from safetensors import safe_open
    from safetensors.torch import load_file

    log = sharded_run.log
    assert re.search(r"--fsdp full_shard: the parameters of the UNet2DConditionModel \([\d.]+M, \d+ blocks\) are "
                     r"sharded over 2 processes", log), log[-3000:]
    done = dict(re.findall(r"process (\d)/2 finished 2 steps, last loss \S+, weights checksum (\S+)", log))
    assert set(done) == {"0", "1"} and done["0"] == done["1"], log[-3000:]
    out = sharded_run.out
    assert sorted(p.name for p in out.iterdir()) == ["ft-state", "ft.safetensors", "ft_config.toml"]
    assert (out / "ft-state" / "sharded" / ".metadata").is_file()  # torch.distributed.checkpoint, one file a rank
    assert len(list((out / "ft-state" / "sharded").glob("*.distcp"))) == 2

    plain_out = sharded_run.root / "plain"
    launch(2, sdxl_args(tiny_sdxl_single_file, tiny_dataset_dir, plain_out, "ft", 2))
    sharded, plain = load_file(out / "ft.safetensors"), load_file(plain_out / "ft.safetensors")
    base = load_file(tiny_sdxl_single_file)
    assert relative_difference(sharded, plain) < 1e-4
    # and training moved the weights far more than the two runs differ
    moved = {k: plain[k] - base[k] for k in plain}
    gap = {k: sharded[k] - plain[k] for k in plain}
    norm = lambda d: sum(float((v.double() ** 2).sum()) for v in d.values()) ** 0.5  # noqa: E731
    assert norm(gap) < 1e-4 * norm(moved), (norm(gap), norm(moved))
    with safe_open(out / "ft.safetensors", "pt") as f, safe_open(plain_out / "ft.safetensors", "pt") as g:
        assert f.metadata().keys() == g.metadata().keys()
        assert f.metadata()["ss_steps"] == "2" and f.metadata()["modelspec.architecture"]


@pytest.mark.slow
def test_fsdp_state_resumes_on_two_and_on_one_process(sharded_run):
    from safetensors.torch import load_file

    state = sharded_run.out / "ft-state"
    # 2 processes: continues from step 2 to 3
    two = sharded_run.root / "resumed2"
    proc = launch(2, sharded_run.args + ["--fsdp", "full_shard", "--resume", state, "--max_train_steps", 3,
                                         "--output_dir", two])
    log = proc.stdout + proc.stderr
    assert log.count("resumed at step 2 (epoch 1)") == 2 and "steps: 3/3 " in log, log[-3000:]
    assert "process 1/2 finished 3 steps" in log
    # 1 process reads the 2 processes' shards: with no step left, the saved model is exactly the state's weights
    one = sharded_run.root / "resumed1"
    proc = launch(1, sharded_run.args + ["--fsdp", "full_shard", "--resume", state, "--output_dir", one])
    log = proc.stdout + proc.stderr
    assert "--fsdp full_shard: one process, nothing to shard" in log and "resumed at step 2" in log, log[-3000:]
    saved, resumed = load_file(sharded_run.out / "ft.safetensors"), load_file(one / "ft.safetensors")
    assert all(torch.equal(saved[k], resumed[k]) for k in saved)


# ---- --deepspeed (upstream's options, accelerate's DeepSpeed plugin) ---------------------------------------------


def test_deepspeed_without_the_package_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # not installed (import raises ImportError)
    argv = ["--pretrained_model_name_or_path", tmp_path / "none.safetensors", "--train_data_dir", tmp_path,
            "--output_dir", tmp_path / "out", "--deepspeed", "--zero_stage", "2"]
    with pytest.raises(SystemExit) as e:
        train("sdxl_train_network", argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert 'pip install -e ".[deepspeed]"' in err and "Traceback" not in err, err
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err


def test_deepspeed_plugin_has_upstreams_values(monkeypatch):
    """With the package present (a stand-in module here: deepspeed is not installed on the test machine), the
    options become accelerate's real DeepSpeedPlugin with upstream's settings."""
    from library import sharding
    from library.errors import ConfigError
    import sdxl_train

    import importlib.machinery
    import types

    stand_in = types.ModuleType("deepspeed")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("deepspeed", None)
    monkeypatch.setitem(sys.modules, "deepspeed", stand_in)
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = sdxl_train.setup_parser().parse_args([
        "--deepspeed", "--zero_stage", "2", "--offload_optimizer_device", "cpu", "--train_batch_size", "3",
        "--gradient_accumulation_steps", "2", "--max_grad_norm", "0.5", "--mixed_precision", "fp16", "--full_fp16",
        "--max_data_loader_n_workers", "4"])
    sharding.check_deepspeed_args(args, ConfigError)
    assert args.max_data_loader_n_workers == 1  # as upstream
    config = sharding.deepspeed_plugin(args).deepspeed_config
    assert config["zero_optimization"]["stage"] == 2
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["gradient_clipping"] == 0.5 and config["gradient_accumulation_steps"] == 2
    assert config["train_micro_batch_size_per_gpu"] == 3 and config["train_batch_size"] == 3 * 2 * 4
    assert config["fp16"]["enabled"] is True and config["fp16"]["initial_scale_power"] == 0
    assert config["fp16"]["fp16_master_weights_and_grads"] is True  # --full_fp16 with ZeRO-2 CPU offload
    args.fsdp, args.mixed_precision, args.full_fp16 = "full_shard", "bf16", False
    with pytest.raises(ConfigError, match="--fsdp cannot be used with --deepspeed"):
        sharding.check_fsdp_args(args, ConfigError)
    args.fsdp, args.zero_stage = None, 3
    with pytest.raises(ConfigError, match="--zero_stage 3 is not supported yet"):
        sharding.check_deepspeed_args(args, ConfigError)


def test_deepspeed_without_a_gpu_joins_the_processes_over_gloo(monkeypatch):
    """accelerate leaves DeepSpeed off with ACCELERATE_USE_CPU and has no backend without a GPU: the trainer takes
    the CPU switch back and asks for gloo, keeping --ddp_timeout; one process without a launcher gets a group."""
    from datetime import timedelta

    from accelerate.utils import InitProcessGroupKwargs

    from library import sharding

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name, value in (("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("RANK", "1"), ("ACCELERATE_USE_CPU", "1")):
        monkeypatch.setenv(name, value)
    args = SimpleNamespace(deepspeed=True)
    handlers = sharding.deepspeed_kwargs_handlers(args, [InitProcessGroupKwargs(timeout=timedelta(minutes=7))])
    assert len(handlers) == 1 and handlers[0].to_kwargs() == {"backend": "gloo", "timeout": timedelta(minutes=7)}
    assert "ACCELERATE_USE_CPU" not in os.environ and os.environ["RANK"] == "1"
    assert sharding.deepspeed_kwargs_handlers(SimpleNamespace(deepspeed=False), []) == []
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    sharding.deepspeed_kwargs_handlers(args, [])  # one process, no launcher
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("0", "1", "127.0.0.1")
    assert int(os.environ["MASTER_PORT"]) > 0


def test_deepspeed_that_accelerate_did_not_set_up_is_one_line():
    from accelerate.utils import DistributedType

    from library import sharding

    args = SimpleNamespace(deepspeed=True)
    line = sharding.check_deepspeed_engaged(args, SimpleNamespace(distributed_type=DistributedType.MULTI_CPU))
    assert line.startswith("--deepspeed: accelerate did not set up DeepSpeed (distributed type MULTI_CPU)"), line
    assert sharding.check_deepspeed_engaged(args, SimpleNamespace(distributed_type=DistributedType.DEEPSPEED)) is None
    assert sharding.check_deepspeed_engaged(SimpleNamespace(deepspeed=False),
                                            SimpleNamespace(distributed_type=DistributedType.NO)) is None


def test_accelerate_deepspeed_config_is_taken_as_deepspeed(monkeypatch):
    from library import sharding
    from library.errors import ConfigError

    def parsed(*argv):
        import sdxl_train

        return sdxl_train.setup_parser().parse_args(list(argv))

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # accelerate launch --use_deepspeed --zero_stage 1 ...
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")
    args = parsed()
    sharding.from_accelerate_deepspeed_config(args, ConfigError)
    assert (args.deepspeed, args.zero_stage, args.offload_optimizer_device, args.offload_param_device) == \
        (True, 1, "cpu", None)
    args = parsed("--deepspeed", "--zero_stage", "2")  # the command line's options win
    sharding.from_accelerate_deepspeed_config(args, ConfigError)
    assert (args.zero_stage, args.offload_optimizer_device) == (2, None)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds.json")
    with pytest.raises(ConfigError, match="DeepSpeed config file ds.json is not read here"):
        sharding.from_accelerate_deepspeed_config(parsed(), ConfigError)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    args = parsed()
    sharding.from_accelerate_deepspeed_config(args, ConfigError)
    assert not args.deepspeed


def deepspeed_missing() -> str | None:
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - not installed, or installed without what it needs here
        return f"deepspeed is not importable ({type(e).__name__}: {e}); install extra 'deepspeed' to run this test"
    return None


@pytest.mark.slow
@pytest.mark.skipif(deepspeed_missing() is not None, reason=deepspeed_missing() or "")
def test_deepspeed_zero2_full_fine_tune_on_two_cpu_processes(tmp_path, tiny_sd1_single_file, tiny_dataset_dir):
    """DeepSpeed's CPU accelerator over gloo: ZeRO-2 trains the same weights as data parallel, --save_state writes
    DeepSpeed's sharded optimizer state (one file a process) and --resume continues from it."""
    from safetensors.torch import load_file

    def args(out: Path, steps: int) -> list:
        return ["--pretrained_model_name_or_path", tiny_sd1_single_file, "--tokenizer_cache_dir",
                tiny_sd1_single_file.parent / "tokenizers", "--train_data_dir", tiny_dataset_dir, "--caption_extension",
                ".txt", "--resolution", 64, "--output_dir", out, "--output_name", "db", "--max_train_steps", steps,
                "--max_data_loader_n_workers", 0, "--seed", 3, "--optimizer_type", "torch.optim.SGD",
                "--learning_rate", 0.05, "--train_text_encoder"]

    proc = launch(2, args(tmp_path / "ds", 2) + ["--deepspeed", "--zero_stage", "2", "--save_state"],
                  script="train_db.py")
    log = proc.stdout + proc.stderr
    assert log.count("--deepspeed: the DeepSpeed engine trains") == 2, log[-3000:]
    assert re.search(r"DeepSpeed engine trains [\d.]+M parameters with ZeRO stage 2 \(DeepSpeedZeroOptimizer\) over 2 "
                     r"processes", log), log[-3000:]
    done = dict(re.findall(r"process (\d)/2 finished 2 steps, last loss \S+, weights checksum (\S+)", log))
    assert set(done) == {"0", "1"} and done["0"] == done["1"], log[-3000:]
    state = tmp_path / "ds" / "db-state"
    assert sorted(p.name for p in (state / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]

    launch(2, args(tmp_path / "dp", 2), script="train_db.py")
    ds, dp = load_file(tmp_path / "ds" / "db.safetensors"), load_file(tmp_path / "dp" / "db.safetensors")
    base = load_file(tiny_sd1_single_file)
    assert relative_difference(ds, dp) < 1e-4
    moved = relative_difference(dp, {k: base[k] for k in dp})
    assert moved > 100 * relative_difference(ds, dp), moved  # and training moved the weights far more

    proc = launch(2, args(tmp_path / "resumed", 3) + ["--deepspeed", "--zero_stage", "2", "--resume", state],
                  script="train_db.py")
    log = proc.stdout + proc.stderr
    assert log.count("resumed at step 2") == 2 and "steps: 3/3 " in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(deepspeed_missing() is not None, reason=deepspeed_missing() or "")
def test_accelerate_launch_use_deepspeed_trains_a_lora_with_zero1(tmp_path, tiny_sd1_single_file, tiny_dataset_dir):
    """`accelerate launch --use_deepspeed --zero_stage 1` (no --deepspeed on the trainer's line), 2 CPU processes."""
    cmd = launch_command(2, "train_network.py", [
        "--pretrained_model_name_or_path", tiny_sd1_single_file, "--tokenizer_cache_dir",
        tiny_sd1_single_file.parent / "tokenizers", "--train_data_dir", tiny_dataset_dir, "--caption_extension", ".txt",
        "--resolution", 64, "--output_dir", tmp_path, "--output_name", "lora", "--max_train_steps", 2,
        "--network_module", "networks.lora", "--network_dim", 4])
    cmd[cmd.index("--multi_gpu")] = "--use_deepspeed"
    cmd[cmd.index("--use_deepspeed") + 1:cmd.index("--use_deepspeed") + 1] = ["--zero_stage", "1"]
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=400, cwd=REPO)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "accelerate's DeepSpeed config: --deepspeed --zero_stage 1" in log, log[-3000:]
    assert log.count("with ZeRO stage 1 (DeepSpeedZeroOptimizer) over 2 processes") == 2, log[-3000:]
    assert (tmp_path / "lora.safetensors").is_file()


@pytest.mark.slow
def test_data_parallel_resume_on_two_processes_continues_exactly(tmp_path, tiny_sd1_single_file, tiny_dataset_dir):
    """Each process draws its noise from its own generator: the -state folder keeps every rank's (only the main
    process writes it), so a resume on 2 processes trains the same weights as the run that was not interrupted."""
    args = ["--pretrained_model_name_or_path", tiny_sd1_single_file, "--tokenizer_cache_dir",
            tiny_sd1_single_file.parent / "tokenizers", "--train_data_dir", tiny_dataset_dir, "--caption_extension",
            ".txt", "--resolution", 64, "--output_name", "lora", "--max_train_steps", 3, "--max_data_loader_n_workers",
            0, "--network_module", "networks.lora", "--network_dim", 4, "--seed", 3]
    whole = launch(2, args + ["--output_dir", tmp_path / "whole", "--save_state", "--save_every_n_steps", 2],
                   script="train_network.py")
    resumed = launch(2, args + ["--output_dir", tmp_path / "resumed", "--resume",
                                tmp_path / "whole" / "lora-step00000002-state"], script="train_network.py")
    finished = r"process (\d)/2 finished 3 steps, last loss (\S+), weights checksum (\S+)"
    whole_done = sorted(re.findall(finished, whole.stdout + whole.stderr))
    resumed_log = resumed.stdout + resumed.stderr
    assert resumed_log.count("resumed at step 2") == 2, resumed_log[-3000:]
    assert len(whole_done) == 2 and sorted(re.findall(finished, resumed_log)) == whole_done, resumed_log[-3000:]


# ---- faults: a process that dies -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_process_killed_during_a_save_ends_the_run_and_keeps_the_earlier_save(tmp_path, tiny_sdxl_single_file,
                                                                                 tiny_dataset_dir):
    import signal
    import time

    import psutil

    from kohya_gui.runner import first_failed_process

    out = tmp_path / "out"
    args = sdxl_args(tiny_sdxl_single_file, tiny_dataset_dir, out, "ft", 40) + [
        "--fsdp", "full_shard", "--save_state", "--save_every_n_steps", 2]
    log_path = tmp_path / "log.txt"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(launch_command(2, "sdxl_train.py", args), env=launch_env(), stdout=log,
                                    stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.time() + 300
        # the second state save has begun (the first is complete): kill process rank 1 now
        while "ft-step00000004-state" not in log_path.read_text() and time.time() < deadline:
            assert launcher.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.05)
        rank1 = next(p for p in psutil.Process(launcher.pid).children(recursive=True)
                     if p.environ().get("LOCAL_RANK") == "1" and "sdxl_train.py" in " ".join(p.cmdline()))
        rank1.send_signal(signal.SIGKILL)
        killed = time.time()
        rc = launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    log = log_path.read_text()
    assert rc != 0 and time.time() - killed < 60, log[-3000:]  # every process ended, no wait for a timeout
    assert first_failed_process(log.splitlines()) == "process rank 1 (host localhost) ended first with exit code " \
                                                     "-9 (SIGKILL)", log[-3000:]
    names = sorted(p.name for p in out.iterdir())
    # a half-written save is only ever a library.files work folder (the next run removes it), never in place
    work = re.compile(r"\.ft-step\d+(-state|\.safetensors)\.tmp-[0-9a-f]+")
    assert all(work.fullmatch(n) for n in names if n.startswith(".")), names
    for name in ("ft-step00000002-state", "ft-step00000004-state"):
        if name in names:  # complete, or not there at all
            assert (out / name / "sharded" / ".metadata").is_file()
            assert (out / name / "custom_checkpoint_1.pkl").is_file()
    assert "ft-step00000002-state" in names and "ft-step00000002.safetensors" in names, names


# ---- Adafactor (the full fine-tune presets' optimizer) on sharded weights -----------------------------------------


def _adafactor_worker(rank: int, world: int, port: int, folder: str, results):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.optimization import Adafactor

    sys.path.insert(0, str(REPO / "sd-scripts"))
    from library import sharding
    from library.grouped_adafactor import GroupedAdafactor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    options = dict(lr=1e-2, scale_parameter=False, relative_step=False, warmup_init=False, beta1=0.9)

    def make(sharded: bool):  # weights of 1, 2 and 4 dims whose first dims (3, 5, 7) do not divide over 2 processes
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Flatten(),
                                    torch.nn.Linear(3 * 4 * 4, 5), torch.nn.Linear(5, 7))
        whole = torch.nn.Linear(7, 3)  # in the same optimizer, never sharded (as a trained text encoder)
        if sharded:
            for layer in (model[0], model[2], model[3]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        # sharded: the class the trainers build for --optimizer_type Adafactor (a subclass with a batched step)
        cls = GroupedAdafactor if sharded else Adafactor
        optimizer = cls([*model.parameters(), *whole.parameters()], **options)
        sharding.init_optimizer_state([optimizer])
        return torch.nn.Sequential(model, whole), optimizer

    def steps(pairs, seeds):
        for seed in seeds:
            x = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(seed))
            for model, opt in pairs:
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()

    def gap(sharded, whole):
        with torch.no_grad():
            return max(float(((p.full_tensor() if hasattr(p, "full_tensor") else p) - w).abs().max())
                       for p, w in zip(sharded.parameters(), whole.parameters()))

    whole, sharded = make(False), make(True)
    steps([whole, sharded], range(3))
    gap3 = gap(sharded[0], whole[0])
    with torch.no_grad():
        moved = max(float((w - b).abs().max()) for w, b in zip(whole[0].parameters(), make(False)[0].parameters()))
    # the sharded state saved and read into a new sharded model and optimizer, as --save_state / --resume do
    dcp.save(dict(zip(("model", "optimizer"), get_state_dict(*sharded))), checkpoint_id=folder)
    resumed = make(True)
    state = dict(zip(("model", "optimizer"), get_state_dict(*resumed)))
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(*resumed, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    steps([whole, resumed], (3, 4))
    results.put((rank, gap3, gap(resumed[0], whole[0]), moved))
    # the sharded modules and their DTensors go while their process group is still there (a rare abort at exit,
    # "terminate called without an active exception", came after the group was destroyed under them)
    del whole, sharded, resumed, state
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.slow
def test_adafactor_steps_sharded_weights_as_whole_ones(tmp_path):
    """transformers' Adafactor on FSDP2 shards (2 gloo processes): with its state made first as sharded tensors
    (sharding.init_optimizer_state) every process steps its shard, the weights equal the unsharded optimizer's
    (without it, Adafactor's first step raises on mixing plain and sharded tensors), and its state saved with
    torch.distributed.checkpoint and read back continues as the unsharded optimizer does."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.spawn(_adafactor_worker, args=(2, free_port(), str(tmp_path / "state"), results), nprocs=2)
    for _ in range(2):
        rank, after3, after_resume, moved = results.get(timeout=10)
        assert moved > 1e-3 and after3 < 1e-6 and after_resume < 1e-6, (rank, after3, after_resume, moved)


# ---- flux_train.py: Adafactor (the preset's optimizer), sharded state resumed on 2 and on 1 process ---------------


@pytest.mark.slow
def test_flux_fsdp_adafactor_state_resumes_on_two_and_on_one_process(tmp_path):
    from safetensors.torch import load_file

    from library import flux_tiny, tiny_models

    paths = flux_tiny.make_tiny_flux(tmp_path / "models", num_double=2, num_single=2)
    data = tiny_models.make_captioned_images(tmp_path / "data", n=2, size=(32, 32), repeats=2, name="demo")
    args = ["--pretrained_model_name_or_path", paths["transformer"], "--clip_l", paths["clip_l"], "--t5xxl",
            paths["t5xxl"], "--ae", paths["ae"], "--tokenizer_cache_dir", paths["tokenizer_cache_dir"],
            "--train_data_dir", data, "--resolution", "32", "--t5xxl_max_token_length", "16", "--output_name", "ft",
            "--max_data_loader_n_workers", 0, "--seed", 1, "--cache_latents", "--cache_text_encoder_outputs",
            "--gradient_checkpointing", "--optimizer_type", "Adafactor", "--optimizer_args", "scale_parameter=False",
            "relative_step=False", "warmup_init=False", "--learning_rate", "1e-3", "--fsdp", "full_shard"]
    first = launch(2, args + ["--output_dir", tmp_path / "first", "--max_train_steps", 2, "--save_state"],
                   script="flux_train.py")
    log = first.stdout + first.stderr
    assert re.search(r"--fsdp full_shard: the parameters of the FluxTransformer2DModel \([\d.]+M, \d+ blocks\) are "
                     r"sharded over 2 processes", log), log[-3000:]
    state = tmp_path / "first" / "ft-state"
    assert (state / "sharded" / ".metadata").is_file()
    # 2 processes continue to step 3 with the saved Adafactor state
    proc = launch(2, args + ["--output_dir", tmp_path / "two", "--max_train_steps", 3, "--resume", state],
                  script="flux_train.py")
    log = proc.stdout + proc.stderr
    assert log.count("resumed at step 2 (epoch 1)") == 2 and "process 1/2 finished 3 steps" in log, log[-3000:]
    # 1 process reads the 2 processes' shards (the Adafactor statistics too) and trains step 3 on them
    proc = launch(1, args + ["--output_dir", tmp_path / "one", "--max_train_steps", 3, "--resume", state],
                  script="flux_train.py")
    log = proc.stdout + proc.stderr
    assert "one process, nothing to shard" in log and "resumed at step 2" in log, log[-3000:]
    assert "process 0/1 finished 3 steps" in log, log[-3000:]
    saved, two, one = (load_file(tmp_path / d / "ft.safetensors") for d in ("first", "two", "one"))
    assert set(saved) == set(two) == set(one)
    assert any(not torch.equal(saved[k], one[k]) for k in saved)  # step 3 was trained

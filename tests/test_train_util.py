"""train_util: --config_file (flat / sectioned, CLI wins, GUI tables skipped, named errors), --output_config,
optimizers (incl. missing packages, fused AdamW), schedulers, atomic saving, hashes, the progress line, steps/epochs."""
from __future__ import annotations

import hashlib
import re
import sys

import pytest
import torch

from library import train_util
from library.train_util import ConfigError, OptionalPackageError, OutputExistsError


@pytest.fixture(scope="module")
def parser():
    import sdxl_train_network

    return sdxl_train_network.setup_parser()


def test_every_script_has_setup_parser():
    import sdxl_train_network
    import train_network

    sd = {a.dest for a in train_network.setup_parser()._actions}
    sdxl = {a.dest for a in sdxl_train_network.setup_parser()._actions}
    assert {"v2", "v_parameterization", "network_dim", "optimizer_type", "config_file", "cache_latents"} <= sd
    # compile flags belong to the SDXL (and FLUX) scripts only
    assert "compile" in sdxl and "compile_backend" in sdxl and "compile" not in sd


def test_config_flat_and_sectioned_merge_order(tmp_path, parser):
    flat = tmp_path / "flat.toml"
    flat.write_text('network_dim = 16\nlearning_rate = 0.0005\ncompile = true\noptimizer_args = ["weight_decay=0.1"]\n'
                    'output_dir = "out"\n')
    args = train_util.parse_args(parser, ["--config_file", str(flat), "--network_dim", "8"])
    assert args.network_dim == 8  # command line wins
    assert args.learning_rate == 0.0005 and args.compile is True and args.optimizer_args == ["weight_decay=0.1"]
    assert args.network_alpha == 1  # parser default where neither sets it

    sectioned = tmp_path / "sectioned.toml"
    sectioned.write_text('[accelerate]\nnum_processes = 2\nmixed_precision = "bf16"\n[gui]\ntab = "lora"\n'
                         '[model]\npretrained_model_name_or_path = "m.safetensors"\n'
                         '[training]\nmax_train_steps = 7\nlearning_rate = 1\n[training.compile]\ncompile_mode = "reduce-overhead"\n')
    args = train_util.parse_args(parser, ["--config_file", str(sectioned)])
    assert args.pretrained_model_name_or_path == "m.safetensors" and args.max_train_steps == 7
    assert args.learning_rate == 1.0 and isinstance(args.learning_rate, float)
    assert args.compile_mode == "reduce-overhead"
    assert args.mixed_precision == "no"  # [accelerate] is the launcher's, not the trainer's
    # kohya accepts the file name without .toml
    args = train_util.parse_args(parser, ["--config_file", str(sectioned)[:-5]])
    assert args.max_train_steps == 7


@pytest.mark.parametrize("text, match", [
    ("netwrk_dim = 4\n", r"unknown key 'netwrk_dim' \(did you mean 'network_dim'\?\)"),
    ("[training]\ncompile_mod = 'default'\n", r"unknown key 'compile_mod' \(did you mean 'compile_mode'\?\)"),
    ("network_dim = 'four'\n", r"network_dim = 'four' must be an integer"),
    ("compile = 1\n", r"compile = 1 must be true or false"),
    ("mixed_precision = 'fp8'\n", r"mixed_precision = 'fp8' is not allowed; allowed values: no, fp16, bf16"),
    ("learning_rate = [1, 2]\n", r"learning_rate = \[1, 2\] must be a single value"),
    ("[a]\nseed = 1\n[b]\nseed = 2\n", r"key 'seed' is set twice"),
    ("config_file = 'x.toml'\n", r"'config_file' cannot be set inside a config file"),
    ("seed = \n", r"not valid TOML"),
])
def test_config_errors_name_the_key(tmp_path, parser, text, match):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=match) as e:
        train_util.parse_args(parser, ["--config_file", str(cfg)])
    assert str(cfg) in str(e.value)


def test_config_file_missing(parser, tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        train_util.parse_args(parser, ["--config_file", str(tmp_path / "nope.toml")])


def test_output_config_and_run_config_round_trip(tmp_path, parser):
    target = tmp_path / "saved.toml"
    args = train_util.parse_args(parser, ["--config_file", str(target), "--output_config", "--network_dim", "12",
                                          "--optimizer_args", "betas=0.9,0.99", "--compile", "--output_dir", "o"])
    assert train_util.write_output_config(args) == str(target)
    back = train_util.parse_args(parser, ["--config_file", str(target)])
    for key, value in vars(args).items():
        if key not in ("config_file", "output_config"):
            assert getattr(back, key) == value, key
    with pytest.raises(OutputExistsError):  # never over an existing file
        train_util.write_output_config(args)


def test_optimizers(parser):
    params = [torch.nn.Parameter(torch.zeros(3))]
    cases = {
        "AdamW": "torch.optim.adamw.AdamW",
        "SGDNesterov": "torch.optim.sgd.SGD",
        "Adafactor": "transformers.optimization.Adafactor",
        "Prodigy": "prodigyopt.prodigy.Prodigy",
        "torch.optim.RAdam": "torch.optim.radam.RAdam",
    }
    for name, cls in cases.items():
        args = parser.parse_args(["--optimizer_type", name, "--learning_rate", "0.5"])
        _, full, opt = train_util.get_optimizer(args, params)
        assert full == cls
    args = parser.parse_args(["--optimizer_type", "SGDNesterov", "--optimizer_args", "momentum=0.5", "weight_decay=0.01"])
    _, _, opt = train_util.get_optimizer(args, params)
    assert opt.defaults["momentum"] == 0.5 and opt.defaults["nesterov"] is True and opt.defaults["weight_decay"] == 0.01
    args = parser.parse_args(["--optimizer_args", "betas=0.8,0.9"])
    _, full, opt = train_util.get_optimizer(args, params)
    assert full == "torch.optim.adamw.AdamW" and opt.defaults["betas"] == (0.8, 0.9)
    # Adafactor with relative_step picks its own schedule
    args = parser.parse_args(["--optimizer_type", "adafactor", "--optimizer_args", "relative_step=True"])
    _, _, opt = train_util.get_optimizer(args, params)
    assert args.lr_scheduler == "adafactor"
    assert train_util.get_scheduler(args, opt, 10).__class__.__name__ == "AdafactorSchedule"


def test_adamw_is_fused_unless_optimizer_args_choose(parser):
    """AdamW gets torch's fused kernels (one launch for all tensors); --optimizer_args fused/foreach win."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.1},
              {"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))], "lr": 0.2}]
    _, _, opt = train_util.get_optimizer(parser.parse_args([]), groups)
    assert opt.defaults["fused"] is True
    for p in (g["params"][0] for g in groups):
        p.grad = torch.ones_like(p)
    opt.step()  # fused step runs on these (CPU, fp32 and bf16) tensors
    assert all((g["params"][0] < 0).all() for g in groups)
    _, _, opt = train_util.get_optimizer(parser.parse_args(["--optimizer_args", "foreach=True"]), groups)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    _, _, opt = train_util.get_optimizer(parser.parse_args(["--optimizer_type", "SGDNesterov"]), groups)
    assert "fused" not in opt.defaults or not opt.defaults["fused"]


def test_optimizer_errors(parser, monkeypatch):
    params = [torch.nn.Parameter(torch.zeros(3))]
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", None)
    monkeypatch.setitem(sys.modules, "lion_pytorch", None)
    for name, package in (("AdamW8bit", "bitsandbytes"), ("Lion", "lion-pytorch")):
        with pytest.raises(OptionalPackageError, match=f"needs the Python package '{package}'.*pip install {package}"):
            train_util.get_optimizer(parser.parse_args(["--optimizer_type", name]), params)
    with pytest.raises(ConfigError, match="not supported; allowed: AdamW, AdamW8bit"):
        train_util.get_optimizer(parser.parse_args(["--optimizer_type", "Adamm"]), params)
    with pytest.raises(ConfigError, match="not accepted by torch.optim.adamw.AdamW"):
        train_util.get_optimizer(parser.parse_args(["--optimizer_args", "colour=3"]), params)
    with pytest.raises(ConfigError, match="must be key=value"):
        train_util.parse_optimizer_args(["oops"])


def test_schedulers(parser):
    def lrs(argv, steps=10):
        args = parser.parse_args(["--learning_rate", "1.0", *argv])
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = train_util.get_scheduler(args, opt, steps)
        out = []
        for _ in range(steps):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    assert lrs(["--lr_scheduler", "constant"]) == [1.0] * 10
    warm = lrs(["--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "4"])
    assert warm[:5] == [0.0, 0.25, 0.5, 0.75, 1.0] and warm[-1] == 1.0
    assert lrs(["--lr_scheduler", "constant_with_warmup", "--lr_warmup_steps", "0.2"])[:3] == [0.0, 0.5, 1.0]
    lin = lrs(["--lr_scheduler", "linear"])
    assert lin[0] == 1.0 and lin[5] == pytest.approx(0.5)
    cos = lrs(["--lr_scheduler", "cosine"])
    assert cos[5] == pytest.approx(0.5) and cos[9] < 0.05
    restarts = lrs(["--lr_scheduler", "cosine_with_restarts", "--lr_scheduler_num_cycles", "2"])
    assert restarts[5] == pytest.approx(1.0) and restarts[4] < 0.2
    poly = lrs(["--lr_scheduler", "polynomial", "--lr_scheduler_power", "2"])
    assert poly[5] < lin[5]


def test_train_length():
    import argparse

    args = argparse.Namespace(gradient_accumulation_steps=2, max_train_steps=7, max_train_epochs=None)
    assert train_util.resolve_train_length(args, 5) == (3, 7, 3)
    args.max_train_epochs = 4
    assert train_util.resolve_train_length(args, 5) == (3, 12, 4)


def test_atomic_save_and_hashes(tmp_path):
    tensors = {"a.lora_down.weight": torch.randn(4, 8), "a.alpha": torch.tensor(2.0)}
    md = {"ss_network_dim": "4", "other": "not hashed"}
    model_hash, legacy = train_util.model_hashes(tensors, md)
    path = tmp_path / "x.safetensors"
    train_util.save_safetensors_atomic(tensors, path, {k: v for k, v in md.items() if k.startswith("ss_")})
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    assert model_hash == hashlib.sha256(blob[8 + n:]).hexdigest()
    assert legacy == hashlib.sha256(blob[0x100000:0x110000]).hexdigest()[:8]
    # non-ss_ metadata does not change the hash
    assert train_util.model_hashes(tensors, {"ss_network_dim": "4"})[0] == model_hash
    with pytest.raises(OutputExistsError, match="--overwrite_output"):
        train_util.save_safetensors_atomic(tensors, path)
    train_util.save_safetensors_atomic({"b": torch.zeros(1)}, path, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temp file left


def test_output_names():
    assert train_util.epoch_file_name("lora", 1, ".safetensors") == "lora-000001.safetensors"
    assert train_util.step_file_name("lora", 10, ".safetensors") == "lora-step00000010.safetensors"
    assert train_util.state_dir_name("lora", step=10) == "lora-step00000010-state"
    assert train_util.state_dir_name("lora", epoch=2) == "lora-000002-state"
    assert train_util.state_dir_name("lora") == "lora-state"


def test_progress_line_format():
    line = train_util.ProgressLine(max_steps=100, num_epochs=5)
    text = line.format(12, 0.1234, 0.13, 1e-4, 1)
    assert re.fullmatch(r"steps: 12/100 loss=0\.1234 it/s=\d+\.\d\d avr_loss=0\.1300 lr=1\.00e-04 epoch=1/5 "
                        r"eta=(\d\d:\d\d:\d\d|\?)", text), text
    assert line.should_print(1) and line.should_print(100)

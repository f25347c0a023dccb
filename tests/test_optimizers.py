"""library.optimizers: every upstream --optimizer_type name builds and steps, class paths, --optimizer_args,
--use_8bit_adam / --use_lion_optimizer, upstream's Adafactor and D-Adaptation/Prodigy rules, missing packages
(exit 2 naming the package and the extra), schedule-free eval mode around saves, fused AdamW."""
from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import train_network

from library import optimizers, schedulers
from library.train_util import ConfigError, OptionalPackageError


@pytest.fixture(scope="module")
def parser():
    import sdxl_train_network

    return sdxl_train_network.setup_parser()


def _args(parser, *argv):
    return parser.parse_args(["--learning_rate", "0.01", *argv])


def _two_steps(optimizer, params) -> None:
    for _ in range(2):
        loss = sum((p * torch.arange(1, p.numel() + 1).view_as(p)).pow(2).sum() for p in params) + \
            sum(p.sum() for p in params)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# name -> (top-level module, class name): written from upstream's get_optimizer
FAMILIES = {
    "AdamW": ("torch", "AdamW"),
    "Lion": ("lion_pytorch", "Lion"),
    "SGDNesterov": ("torch", "SGD"),
    "DAdaptation": ("dadaptation", "DAdaptAdamPreprint"),
    "DAdaptAdamPreprint": ("dadaptation", "DAdaptAdamPreprint"),
    "DAdaptAdaGrad": ("dadaptation", "DAdaptAdaGrad"),
    "DAdaptAdam": ("dadaptation", "DAdaptAdam"),
    "DAdaptAdan": ("dadaptation", "DAdaptAdan"),
    "DAdaptAdanIP": ("dadaptation", "DAdaptAdanIP"),
    "DAdaptLion": ("dadaptation", "DAdaptLion"),
    "DAdaptSGD": ("dadaptation", "DAdaptSGD"),
    "AdaFactor": ("transformers", "Adafactor"),
    "Prodigy": ("prodigyopt", "Prodigy"),
    "RAdamScheduleFree": ("schedulefree", "RAdamScheduleFree"),
    "AdamWScheduleFree": ("schedulefree", "AdamWScheduleFree"),
    "SGDScheduleFree": ("schedulefree", "SGDScheduleFree"),
    "pytorch_optimizer.CAME": ("pytorch_optimizer", "CAME"),
    "RAdam": ("torch", "RAdam"),  # no dot: a torch.optim class, as upstream
    "prodigyplus.ProdigyPlusScheduleFree": ("prodigyplus", "ProdigyPlusScheduleFree"),  # in upstream's requirements
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_builds_and_steps(parser, name):
    params = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))]
    before = [p.detach().clone() for p in params]
    # upstream matches the table's names in any case
    typed = name.lower() if "." not in name and name != "RAdam" else name
    lr = ["--learning_rate", "1.0"] if name.startswith(("DAdapt", "Prodigy", "prodigyplus")) else []  # their usual rate
    if name == "RAdamScheduleFree":  # RAdam makes no update in its first steps unless told to take SGD steps
        lr += ["--optimizer_args", "silent_sgd_phase=False"]
    asked, class_path, opt = optimizers.get_optimizer(_args(parser, "--optimizer_type", typed, *lr), params)
    module, cls = FAMILIES[name]
    assert asked == typed and class_path.split(".")[0] == module and class_path.endswith("." + cls)
    assert cls in [c.__name__ for c in type(opt).__mro__]  # AdaFactor: library.grouped_adafactor's subclass
    _two_steps(opt, params)
    assert all(torch.isfinite(p).all() for p in params)
    assert any(not torch.equal(p, b) for p, b in zip(params, before)), "two steps left the weights unchanged"


def test_every_upstream_name_is_in_the_one_list():
    upstream = ["AdamW", "AdamW8bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit", "Lion", "Lion8bit",
                "PagedLion8bit", "SGDNesterov", "SGDNesterov8bit", "DAdaptation", "DAdaptAdam", "DAdaptAdaGrad",
                "DAdaptAdan", "DAdaptAdanIP", "DAdaptLion", "DAdaptSGD", "AdaFactor", "Prodigy",
                "RAdamScheduleFree", "AdamWScheduleFree", "SGDScheduleFree"]
    assert sorted(optimizers.OPTIMIZER_NAMES) == sorted(upstream)
    assert optimizers.canonical_name("adafactor") == "AdaFactor" and optimizers.canonical_name("Adafactor")


@pytest.fixture
def fake_bitsandbytes(monkeypatch):
    """bitsandbytes needs CUDA for its 8-bit optimizers: a stand-in records which class is made with what."""
    made = []
    optim = types.ModuleType("bitsandbytes.optim")
    for cls_name in ("AdamW8bit", "PagedAdamW", "PagedAdamW8bit", "PagedAdamW32bit", "Lion8bit", "PagedLion8bit",
                     "SGD8bit"):
        def init(self, params, lr=1e-3, _n=cls_name, **kw):
            made.append((_n, lr, kw))
            torch.optim.SGD.__init__(self, params, lr=lr)

        setattr(optim, cls_name, type(cls_name, (torch.optim.SGD,), {"__init__": init}))
    bnb = types.ModuleType("bitsandbytes")
    bnb.optim = optim
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", optim)
    return made


@pytest.mark.parametrize("name,cls,kwargs", [
    ("AdamW8bit", "AdamW8bit", {}),
    ("PagedAdamW", "PagedAdamW", {}),
    ("PagedAdamW8bit", "PagedAdamW8bit", {}),
    ("PagedAdamW32bit", "PagedAdamW32bit", {}),
    ("Lion8bit", "Lion8bit", {}),
    ("PagedLion8bit", "PagedLion8bit", {}),
    ("SGDNesterov8bit", "SGD8bit", {"momentum": 0.9, "nesterov": True}),
])
def test_bitsandbytes_names(parser, fake_bitsandbytes, name, cls, kwargs):
    optimizers.get_optimizer(_args(parser, "--optimizer_type", name), [torch.nn.Parameter(torch.zeros(2))])
    assert fake_bitsandbytes == [(cls, 0.01, kwargs)]


def test_use_8bit_adam_and_use_lion_optimizer(parser, fake_bitsandbytes):
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizers.get_optimizer(_args(parser, "--use_8bit_adam"), params)
    assert fake_bitsandbytes[-1][0] == "AdamW8bit"
    _, class_path, _ = optimizers.get_optimizer(_args(parser, "--use_lion_optimizer"), params)
    assert class_path == "lion_pytorch.lion_pytorch.Lion"
    for argv in (["--use_8bit_adam", "--use_lion_optimizer"], ["--use_lion_optimizer", "--optimizer_type", "AdamW"],
                 ["--use_8bit_adam", "--optimizer_type", "Lion"]):
        with pytest.raises(ConfigError, match="exclude each other"):
            optimizers.get_optimizer(_args(parser, *argv), params)


@pytest.mark.parametrize("name,module,package,extra", [
    ("AdamW8bit", "bitsandbytes", "bitsandbytes", "bitsandbytes"),
    ("PagedLion8bit", "bitsandbytes", "bitsandbytes", "bitsandbytes"),
    ("Lion", "lion_pytorch", "lion-pytorch", "lion"),
    ("DAdaptAdam", "dadaptation", "dadaptation", "dadaptation"),
    ("DAdaptation", "dadaptation", "dadaptation", "dadaptation"),
    ("Prodigy", "prodigyopt", "prodigyopt", "prodigy"),
    ("AdamWScheduleFree", "schedulefree", "schedulefree", "schedulefree"),
    ("pytorch_optimizer.CAME", "pytorch_optimizer", "pytorch-optimizer", "pytorch-optimizer"),
    ("prodigyplus.ProdigyPlusScheduleFree", "prodigyplus", "prodigy-plus-schedule-free", "prodigy-plus"),
])
def test_missing_package_names_package_and_extra(parser, monkeypatch, name, module, package, extra):
    for m in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, m, None)
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(OptionalPackageError, match=rf"needs the Python package '{package}'.*pip install {package}.*"
                                                   rf"\.\[{extra}\]"):
        optimizers.get_optimizer(_args(parser, "--optimizer_type", name), [torch.nn.Parameter(torch.zeros(2))])


def test_missing_package_exits_2_before_models_load(tmp_path, monkeypatch, capsys):
    import sdxl_train_network

    monkeypatch.setitem(sys.modules, "lion_pytorch", None)
    with pytest.raises(SystemExit) as e:
        sdxl_train_network.main(["--pretrained_model_name_or_path", str(tmp_path / "missing.safetensors"),
                                 "--output_dir", str(tmp_path), "--network_module", "networks.lora",
                                 "--train_data_dir", str(tmp_path), "--optimizer_type", "Lion"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --optimizer_type Lion needs the Python package 'lion-pytorch'" in err and "Traceback" not in err


def test_unknown_names_and_bad_args(parser):
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ConfigError, match="not supported; allowed: AdamW, AdamW8bit"):
        optimizers.get_optimizer(_args(parser, "--optimizer_type", "Adamm"), params)
    with pytest.raises(ConfigError, match="cannot import no_such_pkg"):
        optimizers.get_optimizer(_args(parser, "--optimizer_type", "no_such_pkg.Opt"), params)
    with pytest.raises(ConfigError, match="not accepted by torch.optim.adamw.AdamW"):
        optimizers.get_optimizer(_args(parser, "--optimizer_args", "colour=3"), params)
    with pytest.raises(ConfigError, match="must be key=value"):
        optimizers.parse_optimizer_args(["oops"])


def test_optimizer_args_values(parser):
    assert optimizers.parse_optimizer_args(
        ["betas=0.8,0.9", "decouple=True", "relative_step=false", "weight_decay=1e-2", "eps=[1e-30, 1e-3]",
         "mode=fast", "d_coef=2"]) == {"betas": (0.8, 0.9), "decouple": True, "relative_step": False,
                                       "weight_decay": 0.01, "eps": [1e-30, 1e-3], "mode": "fast", "d_coef": 2}
    # as a config file may hold them: one string, an empty entry; a space inside a value stays
    assert optimizers.parse_optimizer_args(["weight_decay=0.1 betas=0.9,0.99", "", "eps=(1e-8, 1e-6)"]) == \
        {"weight_decay": 0.1, "betas": (0.9, 0.99), "eps": (1e-8, 1e-6)}
    assert optimizers.parse_optimizer_args([""]) == {} and optimizers.parse_optimizer_args("T_max=5") == {"T_max": 5}
    params = [torch.nn.Parameter(torch.zeros(3))]
    _, _, opt = optimizers.get_optimizer(_args(parser, "--optimizer_type", "SGDNesterov", "--optimizer_args",
                                               "momentum=0.5", "weight_decay=0.01"), params)
    assert opt.defaults["momentum"] == 0.5 and opt.defaults["nesterov"] is True and opt.defaults["weight_decay"] == 0.01
    _, _, opt = optimizers.get_optimizer(_args(parser, "--optimizer_type", "SGDNesterov"), params)
    assert opt.defaults["momentum"] == 0.9  # upstream's default for nesterov


def test_adafactor_rules(parser):
    groups = [{"params": [torch.nn.Parameter(torch.ones(4, 4))], "lr": 1e-4},
              {"params": [torch.nn.Parameter(torch.ones(4))], "lr": 5e-5}]
    # upstream: relative_step defaults to True -> no learning rate, the adafactor scheduler
    args = _args(parser, "--optimizer_type", "Adafactor", "--lr_scheduler", "cosine")
    _, _, opt = optimizers.get_optimizer(args, groups)
    assert opt.defaults["relative_step"] is True and opt.defaults["lr"] is None
    assert all(g["lr"] is None for g in opt.param_groups)  # the group rates are dropped
    sched = schedulers.get_scheduler(args, opt, 10)
    assert type(sched).__name__ == "AdafactorSchedule" and sched.get_last_lr() == [0.01, 0.01]
    # warmup_init=True turns relative_step on
    _, _, opt = optimizers.get_optimizer(_args(parser, "--optimizer_type", "adafactor", "--optimizer_args",
                                               "relative_step=False", "warmup_init=True"), groups)
    assert opt.defaults["relative_step"] is True and opt.defaults["warmup_init"] is True
    # relative_step=False: the learning rates are used, the asked scheduler runs
    args = _args(parser, "--optimizer_type", "AdaFactor", "--optimizer_args", "relative_step=False",
                 "scale_parameter=False", "--lr_scheduler", "cosine")
    _, _, opt = optimizers.get_optimizer(args, groups)
    assert [g["lr"] for g in opt.param_groups] == [1e-4, 5e-5]
    assert type(schedulers.get_scheduler(args, opt, 10)).__name__ == "LambdaLR"


def test_dadaptation_and_prodigy_warnings(parser, caplog):
    groups = [{"params": [torch.nn.Parameter(torch.ones(2))], "lr": 1e-4},
              {"params": [torch.nn.Parameter(torch.ones(2))], "lr": 1e-5}]
    with caplog.at_level(logging.WARNING, logger="library.optimizers"):
        optimizers.get_optimizer(_args(parser, "--optimizer_type", "Prodigy"), groups)
    assert "expect about 1.0" in caplog.text and "only the first learning rate (0.0001)" in caplog.text
    caplog.clear()
    one = [{"params": [torch.nn.Parameter(torch.ones(2))], "lr": 1.0}]
    with caplog.at_level(logging.WARNING, logger="library.optimizers"):
        optimizers.get_optimizer(_args(parser, "--optimizer_type", "DAdaptAdam"), one)
    assert caplog.text == ""


def test_adamw_is_fused_unless_optimizer_args_choose(parser):
    """AdamW gets torch's fused kernels (one launch for all tensors); --optimizer_args fused/foreach win."""
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.1},
              {"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))], "lr": 0.2}]
    _, _, opt = optimizers.get_optimizer(parser.parse_args([]), groups)
    assert opt.defaults["fused"] is True
    for p in (g["params"][0] for g in groups):
        p.grad = torch.ones_like(p)
    opt.step()  # fused step runs on these (CPU, fp32 and bf16) tensors
    assert all((g["params"][0] < 0).all() for g in groups)
    _, _, opt = optimizers.get_optimizer(parser.parse_args(["--optimizer_args", "foreach=True"]), groups)
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]
    _, _, opt = optimizers.get_optimizer(parser.parse_args(["--optimizer_type", "SGDNesterov"]), groups)
    assert "fused" not in opt.defaults or not opt.defaults["fused"]


def test_ss_optimizer_as_upstream_writes_it(parser):
    """module.Class(k=v,k=v) with upstream's additions to --optimizer_args (not our fused=True)."""
    def value(*argv):
        args = _args(parser, *argv)
        return optimizers.metadata_value(optimizers.get_optimizer(args, [torch.nn.Parameter(torch.ones(2))])[1], args)

    assert value() == "torch.optim.adamw.AdamW"
    assert value("--optimizer_args", "weight_decay=0.01", "betas=0.9,0.99") == \
        "torch.optim.adamw.AdamW(weight_decay=0.01,betas=(0.9, 0.99))"
    assert value("--optimizer_type", "SGDNesterov") == "torch.optim.sgd.SGD(momentum=0.9)"
    assert value("--optimizer_type", "Adafactor") == "transformers.optimization.Adafactor(relative_step=True)"
    assert value("--optimizer_type", "Adafactor", "--optimizer_args", "relative_step=False", "warmup_init=True") == \
        "transformers.optimization.Adafactor(relative_step=True,warmup_init=True)"


def test_old_train_util_names_still_work(parser):
    from library import train_util

    assert train_util.get_optimizer is optimizers.get_optimizer and train_util.get_scheduler is schedulers.get_scheduler
    assert train_util.OPTIMIZER_NAMES is optimizers.OPTIMIZER_NAMES


def test_fused_backward_pass_rules_in_every_script(parser):
    import train_network

    for p in (parser, train_network.setup_parser()):
        with pytest.raises(ConfigError, match="only with --optimizer_type Adafactor, got AdamW"):
            optimizers.check_optimizer_args(p.parse_args(["--fused_backward_pass"]))
        with pytest.raises(ConfigError, match="cannot accumulate"):
            optimizers.check_optimizer_args(p.parse_args(["--fused_backward_pass", "--optimizer_type", "Adafactor",
                                                          "--gradient_accumulation_steps", "2"]))
        optimizers.check_optimizer_args(p.parse_args(["--fused_backward_pass", "--optimizer_type", "Adafactor"]))


# ----------------------------------------------------------------------------------------------------------
# schedule-free


def test_schedulefree_eval_mode_around_a_save(parser, tmp_path):
    """Upstream saves (and samples) a schedule-free optimizer's averaged weights: eval() before, train() after."""

    args = _args(parser, "--optimizer_type", "AdamWScheduleFree", "--optimizer_args", "warmup_steps=0",
                 "--output_dir", str(tmp_path))
    params = [torch.nn.Parameter(torch.ones(3))]
    _, _, opt = optimizers.get_optimizer(args, params)
    assert opt.param_groups[0]["train_mode"] is True  # made in train mode
    _two_steps(opt, params)
    train_weights = params[0].detach().clone()
    opt.eval()
    eval_weights = params[0].detach().clone()
    opt.train()
    assert not torch.allclose(train_weights, eval_weights)

    trainer = train_network.trainer()
    state = types.SimpleNamespace(args=args, optimizers=[opt])
    seen = {}

    def fake_save(*a, **k):
        seen["weights"] = params[0].detach().clone()
        seen["train_mode"] = opt.param_groups[0]["train_mode"]

    trainer._save_checkpoint = fake_save
    trainer.save_checkpoint(state, 1, 2, by_step=True)
    assert seen["train_mode"] is False and torch.allclose(seen["weights"], eval_weights)
    assert opt.param_groups[0]["train_mode"] is True and torch.allclose(params[0], train_weights, atol=1e-6)
    # a schedule-free optimizer has no LR schedule (upstream's dummy scheduler)
    sched = schedulers.get_scheduler(args, opt, 10)
    assert isinstance(sched, schedulers.ConstantLRReporter) and sched.get_last_lr() == [0.01]
    # other optimizers: nothing switches
    train, evaluate = optimizers.train_eval_fns(opt, _args(parser, "--optimizer_type", "AdamW"))
    evaluate()
    assert opt.param_groups[0]["train_mode"] is True


# ----------------------------------------------------------------------------------------------------------
# end to end


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_lora_trains_with_schedulefree_and_saves_its_eval_weights(tmp_path, tiny_sd1_single_file, tiny_dataset_dir):
    """A tiny SD1 LoRA run with AdamWScheduleFree: it trains, and the saved file holds the optimizer's evaluation
    weights (upstream switches to eval mode around saving), not the weights the gradients are taken at."""
    from lora_checks import read_lora

    import train_network
    from library.network_trainer import run

    trainer = train_network.trainer()
    path = run(trainer, train_network.setup_parser(), [
        "--pretrained_model_name_or_path", str(tiny_sd1_single_file),
        "--tokenizer_cache_dir", str(tiny_sd1_single_file.parent / "tokenizers"),
        "--train_data_dir", str(tiny_dataset_dir), "--output_dir", str(tmp_path), "--output_name", "sf",
        "--network_module", "networks.lora", "--network_dim", "4", "--network_alpha", "4", "--resolution", "64",
        "--max_train_steps", "3", "--learning_rate", "1e-2", "--max_data_loader_n_workers", "0", "--seed", "1",
        "--optimizer_type", "AdamWScheduleFree", "--optimizer_args", "warmup_steps=0", "weight_decay=0.01"])
    sd, md = read_lora(path)
    assert md["ss_optimizer"].startswith("schedulefree.") and \
        md["ss_optimizer"].endswith(".AdamWScheduleFree(warmup_steps=0,weight_decay=0.01)")
    opt = trainer.state.optimizers[0].optimizer
    params = [p for g in opt.param_groups for p in g["params"]]
    ups = [t for k, t in sd.items() if k.endswith("lora_up.weight")]
    assert any(t.abs().sum() > 0 for t in ups)  # trained (lora_up starts at zero)

    def saved_match():
        return all(any(p.shape == t.shape and torch.allclose(p.detach().float(), t.float(), atol=1e-6)
                       for p in params) for k, t in sd.items() if not k.endswith(".alpha"))

    assert opt.param_groups[0]["train_mode"] is True and not saved_match()
    opt.eval()
    assert saved_match()


@pytest.mark.parametrize("name", ["Prodigy", "DAdaptAdam"])
def test_d_times_lr_is_logged(parser, name):
    """Prodigy and DAdaptAdam keep d on the device (library.foreach_prodigy, library.foreach_dadapt), so its value is
    a LateValue: copied without waiting, read when the logs go out."""
    groups = [{"params": [torch.nn.Parameter(torch.ones(3))], "lr": 1.0},
              {"params": [torch.nn.Parameter(torch.ones(2))], "lr": 1.0}]
    _, _, opt = optimizers.get_optimizer(_args(parser, "--optimizer_type", name), groups)
    _two_steps(opt, [g["params"][0] for g in groups])
    logs = optimizers.d_lr_logs([opt], ["unet"])
    assert logs and all(isinstance(v, optimizers.LateValue) for v in logs.values())
    values = {k: float(v) for k, v in logs.items()}
    assert values == {"lr/d*lr/unet": float(opt.param_groups[0]["d"]),
                      "lr/d*lr/group1": float(opt.param_groups[1]["d"])}
    assert values["lr/d*lr/unet"] > 1e-6  # d grew from d0 = 1e-6
    assert optimizers.d_lr_logs([torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0)]) == {}

"""The GUI <-> trainer contract: for every tab x family, every visible registry parameter set to a non-default
value, saved as the GUI saves it, is accepted by the target script's own parser (with the trainer's own
--config_file reading) and comes back with the same value. The registry's defaults must also be the parser's
defaults (a value left out of the file must mean the same thing to both sides), and the launch options must
parse with accelerate's own `launch` parser. Skips only where the target script does not exist yet."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys

import pytest
from gui_helpers import all_non_default

from kohya_gui import REPO, command, config_file
from kohya_gui import params as P
from kohya_gui.secret_options import SECRET_OPTIONS

SD_SCRIPTS = REPO / "sd-scripts"


def load_parser(script: str):
    path = SD_SCRIPTS / script
    if not path.exists():
        pytest.skip(f"sd-scripts/{script} does not exist yet")
    name = "gui_contract_" + script.removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].setup_parser()


def same(expected, got) -> bool:
    if isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got):
        # a list of numbers is held as texts in the GUI ("0.5"); the trainer reads numbers
        return all(same(float(e) if isinstance(g, float) else e, g) for e, g in zip(expected, got))
    if isinstance(expected, float) and isinstance(got, (int, float)):
        return math.isclose(expected, got, rel_tol=1e-12)
    if expected in ("", []) and got is None:
        return True
    if isinstance(got, list) and len(got) == 1 and not isinstance(expected, list):
        return same(expected, got[0])  # one number for a nargs="*" option (--text_encoder_lr) is a one-item list
    return expected == got


def missing_flags(namespace, tab, family) -> set[str]:
    """Registry options the trainer lacks (reported by the config-file test; left out here so the rest parse)."""
    return {p.name for p in trainer_params(tab, family) if not hasattr(namespace, p.name)}


def trainer_params(tab, family):
    return [p for p in P.params_for(tab, family) if p.target not in ("launch", "gui") and not p.network_arg]


def expected_value(p, tab, family, values):
    """What the trainer must read: network_args with the chosen network type's fields folded in."""
    if p.fixed:
        return p.fixed[family]
    if p.name in SECRET_OPTIONS:  # never in a file or a command: the run gets it in its environment
        return None
    return P.fold_network_args(tab, family, values)[p.name]


@pytest.mark.parametrize("tab,family", sorted(P.SCRIPTS))
def test_config_file_values_reach_the_trainer(tmp_path, tab, family):
    from library import train_util

    parser = load_parser(P.script_for(tab, family))
    values = all_non_default(tab, family)
    path = tmp_path / "run.toml"
    config_file.save(path, tab, family, values)
    args = train_util.parse_args(parser, ["--config_file", str(path)])
    # what the trainer reads after its normalisation (a deprecated spelling becomes its option)
    written = train_util.normalise_args(argparse.Namespace(
        **{p.name: expected_value(p, tab, family, values) for p in trainer_params(tab, family)}))
    wrong = []
    for p in trainer_params(tab, family):
        expected = getattr(written, p.name)
        if not hasattr(args, p.name):
            wrong.append(f"--{p.name}: the trainer has no such option")
        elif not same(expected, getattr(args, p.name)):
            wrong.append(f"--{p.name}: wrote {expected!r}, trainer read {getattr(args, p.name)!r}")
    assert not wrong, f"{P.script_for(tab, family)} ({tab} {family}):\n" + "\n".join(wrong)


@pytest.mark.parametrize("tab,family", sorted(P.SCRIPTS))
def test_cli_flags_reach_the_trainer_and_defaults_agree(tab, family):
    parser = load_parser(P.script_for(tab, family))
    defaults = parser.parse_args([])
    values = all_non_default(tab, family)
    wrong = []
    for p in trainer_params(tab, family):
        if hasattr(defaults, p.name) and not p.fixed and not same(p.default_for(tab, family),
                                                                  getattr(defaults, p.name)):
            wrong.append(f"--{p.name}: registry default {p.default_for(tab, family)!r}, "
                         f"trainer default {getattr(defaults, p.name)!r}")
    missing = missing_flags(defaults, tab, family)
    sent = {**values, **{n: P.BY_NAME[n].default_for(tab) for n in missing}}
    argv = command.trainer_args(tab, family, sent)  # what the stand-alone command passes
    args = parser.parse_args(argv)
    for p in trainer_params(tab, family):
        if p.name not in missing:
            expected = expected_value(p, tab, family, values)
            if not same(expected, getattr(args, p.name)):
                wrong.append(f"--{p.name}: passed {expected!r}, trainer read {getattr(args, p.name)!r}")
    assert not wrong, f"{P.script_for(tab, family)} ({tab} {family}):\n" + "\n".join(wrong)


@pytest.mark.parametrize("tab,family", [("lora", "SDXL"), ("dreambooth", "FLUX.1"), ("finetune", "SD1.x")])
def test_launch_options_parse_with_accelerate(tab, family):
    from accelerate.commands.launch import launch_command_parser

    values = all_non_default(tab, family)
    argv = command.build_argv(tab, family, values, "out/run.toml")
    assert argv[:2] == ["accelerate", "launch"]
    ns = launch_command_parser().parse_args(argv[2:])
    assert ns.training_script.endswith(P.script_for(tab, family))
    assert ns.training_script_args == ["--config_file", "out/run.toml", *command.additional_args(values)]
    assert ns.num_processes == values["num_processes"] and ns.num_machines == values["num_machines"]
    assert ns.mixed_precision == values["mixed_precision"] and ns.multi_gpu is True
    assert ns.gpu_ids == values["gpu_ids"] and ns.main_process_port == values["main_process_port"]
    assert ns.main_process_ip == values["main_process_ip"] and ns.machine_rank == values["machine_rank"]
    assert ns.num_cpu_threads_per_process == values["num_cpu_threads_per_process"]
    assert ns.dynamo_backend == "no" and ns.cpu is True


def _all_presets():
    from kohya_gui import presets

    return [(tab, name) for tab in P.TABS for name in presets.list_presets(tab)]


@pytest.mark.parametrize("tab,name", _all_presets())
def test_presets_pass_the_trainers_checks(tab, name):
    """Every shipped preset parses with its trainer and passes the option checks the trainer makes before any
    model loads (files that only exist on the user's machine aside)."""
    from library import train_util
    from library.compile import options as compile_options

    from kohya_gui import presets

    cfg = config_file.load(presets.preset_path(tab, name))
    assert cfg.tab == tab
    parser = load_parser(P.script_for(tab, cfg.family))
    args = train_util.parse_args(parser, ["--config_file", str(presets.preset_path(tab, name))])
    args.sample_prompts = args.resume = None  # files that are made on first use / exist on the user's machine
    train_util.verify_training_args(args)
    if cfg.family in P.COMPILE_FAMILIES or cfg.family in ("SD3", "Lumina 2", "HunyuanImage 2.1", "Anima"):  # no accordion
        compile_options.validate_compile_args(args)
    else:
        assert not hasattr(args, "compile")


@pytest.mark.parametrize("tab,family", sorted(P.SCRIPTS))
def test_every_trainer_option_is_reachable_with_the_trainers_kind_and_choices(tab, family):
    """The other direction: each option of the script's own parser has a control (or a family-fixed value) in this
    tab and family, and a choice control offers exactly the parser's choices (or, for options that take any value,
    at least the names the trainer knows)."""
    import argparse

    from library.parity import REFUSED  # accepted at their defaults only (DeepSpeed, --dataset_class)

    parser = load_parser(P.script_for(tab, family))
    applies = {p.name: p for p in P.params_for(tab, family)}
    wrong = []
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", *P.NOT_SETTINGS) or action.dest in REFUSED:
            continue
        p = applies.get(action.dest)
        if p is None:
            if (action.dest, tab) not in P.NOT_SHOWN and (action.dest, family) not in P.NOT_SHOWN:
                wrong.append(f"--{action.dest}: no control in {tab} {family}")
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) != (p.kind == "bool"):
            wrong.append(f"--{action.dest}: registry kind {p.kind}, trainer action {type(action).__name__}")
        if action.choices is not None and p.kind == "choice":
            allowed = {c for c in p.choices_for(tab, family) if c != ""}
            if allowed != {str(c) for c in action.choices if c is not None}:
                wrong.append(f"--{action.dest}: choices {sorted(allowed)} vs the trainer's {list(action.choices)}")
    assert not wrong, f"{P.script_for(tab, family)}:\n" + "\n".join(wrong)


def test_the_option_files_are_the_trainers_current_options():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_gui_options", REPO / "tools" / "gen_gui_options.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.main(["--check"]) == 0, "run python tools/gen_gui_options.py"


def test_every_trainer_option_has_a_kohya_ss_like_group_and_label():
    """The presentation table (option_places.PLACES) covers every option the trainers describe with a group kohya_ss
    users know (nothing is left in "Other options"), names only options that exist (a renamed trainer option
    fails here) and states no option facts: kinds and defaults only for the options that are not the trainers'
    (accelerate launch, the GUI's own), and its widget hints fit the trainer's option."""
    from kohya_gui import option_places

    described = {name for options in P.TRAINER_OPTIONS.values() for name in options}
    assert sorted(p.name for p in P.PARAMS if p.accordion == "other") == []
    own = {n for n, look in option_places.PLACES.items() if look.own}
    assert sorted(set(option_places.PLACES) - described - own) == []
    assert sorted(own & described) == [], "the trainers describe it: its kind and default come from there"
    assert all(P.BY_NAME[n].target in ("launch", "gui") for n in own)
    assert {P.top_group(look.group) for look in option_places.PLACES.values()} <= set(P.ACCORDIONS)
    for name, look in option_places.PLACES.items():
        per_script = {s: o[name] for s, o in P.TRAINER_OPTIONS.items() if name in o}
        if look.widget == "names":
            assert any(o.get("suggested") for o in per_script.values()), name
        if look.widget == "one_number":
            assert all("nargs" in o for o in per_script.values()), name
        if look.widget in ("file", "folder"):
            assert all(o["kind"] == "str" for o in per_script.values()), name
        for tab, shown in look.tab_choices.items():  # which of the tab's trainer choices are offered
            allowed = {c or "" for (t, _), script in P.SCRIPTS.items() if t == tab and script in per_script
                       for c in per_script[script].get("choices") or []}
            assert set(shown) <= allowed, (name, tab, set(shown) - allowed)
        assert not look.choices or look.own, f"{name}: choices of a trainer option come from the trainer"
    assert all(parent in P.ACCORDIONS for _, parent in P.SUBGROUPS.values())

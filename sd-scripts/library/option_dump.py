"""`--dump_options`: the script's options as JSON, for the GUI (which never imports the trainers).

Each entry: name (the dest = TOML key), flag ("" and `positional: true` for a positional argument), kind (bool, int, float, str), nargs, choices, default, help, and
`suggested` where the option takes any value but the trainer knows names for it (optimizers, schedulers,
network modules), and on --network_args the `keys` each network module reads (kind, choices). kohya_gui/options/<script>.json holds this output per script (tools/gen_gui_options.py writes
them; a test keeps them fresh). Our own option: upstream has none.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

FLAG = "--dump_options"
KINDS = {int: "int", float: "float", str: "str", None: "str"}
CUSTOM_KINDS = {"int_or_float": "float"}  # type functions: how the GUI holds their value (steps or a ratio: a number)


def add_dump_options_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(FLAG, action="store_true",
                        help="print every option of this script as JSON (name, kind, default, choices, help) and "
                             "exit; the GUI is built from it")


NETWORK_MODULES = ("networks.lora", "networks.lora_flux", "lycoris.kohya", "networks.dylora", "networks.oft",
                   "networks.oft_flux", "networks.lora_fa")


def suggested_values() -> dict[str, list[str]]:
    from library import optimizers, schedulers

    return {"optimizer_type": ["", *optimizers.OPTIMIZER_NAMES], "lr_scheduler": list(schedulers.SCHEDULER_NAMES),
            "network_module": list(NETWORK_MODULES)}


def _arg_kind(kind) -> str:
    """How a network module reads one --network_args value: int, float, bool or str (parsers of block lists and
    index ranges read text)."""
    from networks import lora

    if kind is bool or kind is lora.arg_bool:
        return "bool"
    return {int: "int", float: "float"}.get(kind, "str")


def network_arg_keys() -> dict[str, dict[str, dict[str, Any]]]:
    """module -> {--network_args key: {"kind", "choices"?, "any_value"?}}, from each network module's own
    NETWORK_ARGS (NETWORK_ARG_CHOICES: the values it knows; NETWORK_ARG_ANY_VALUE: keys that take others too)."""
    out = {}
    for name in NETWORK_MODULES:
        module = importlib.import_module("networks.lycoris_kohya" if name == "lycoris.kohya" else name)
        choices = getattr(module, "NETWORK_ARG_CHOICES", {})
        any_value = getattr(module, "NETWORK_ARG_ANY_VALUE", ())
        out[name] = {key: {"kind": _arg_kind(kind), **({"choices": list(choices[key])} if key in choices else {}),
                           **({"any_value": True} if key in any_value else {})}
                     for key, kind in module.NETWORK_ARGS.items()}
    return out


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return str(value)


def describe(parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    from library import parity

    suggested = suggested_values()
    out = []
    for action in parser._actions:
        if action.dest in ("help", "dump_options"):
            continue
        if not action.option_strings:  # a positional argument (check_lora_weights.py's file): flag ""
            out.append({"name": action.dest, "flag": "", "positional": True, "kind": "str",
                        "default": _json_value(action.default), "help": action.help or ""})
            continue
        flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            kind = "bool"
        else:
            kind = KINDS.get(action.type) or CUSTOM_KINDS.get(getattr(action.type, "__name__", ""), "str")
        entry = {"name": action.dest, "flag": flag, "kind": kind, "default": _json_value(action.default),
                 "help": action.help or ""}
        if action.nargs not in (None, 0):
            entry["nargs"] = action.nargs
        if action.choices is not None:
            entry["choices"] = [_json_value(c) for c in action.choices]
        if action.dest in suggested:
            entry["suggested"] = suggested[action.dest]
        if action.dest == "network_args":
            entry["keys"] = network_arg_keys()
        if action.dest in parity.REFUSED:  # accepted only at its default (library/parity.py says why)
            entry["refused"] = parity.REFUSED[action.dest]
        out.append(entry)
    return out


def dump_if_asked(parser: argparse.ArgumentParser, argv: list[str] | None) -> None:
    """Prints the description and exits 0 when the command line asks for it (before anything is parsed)."""
    if FLAG in (sys.argv[1:] if argv is None else argv):
        print(json.dumps(describe(parser), indent=1))
        raise SystemExit(0)

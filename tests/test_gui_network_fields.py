"""The Network group shows the fields of the chosen network type (LyCORIS included), read from each network
module's own list of --network_args keys; their values travel as network_args entries, so the TOML and the
command stay sd-scripts' own, and opening a file puts the entries back into the fields."""

from __future__ import annotations

import tomllib

from gui_helpers import ui_values, ui_values_from_updates
from test_gui_contract import load_parser

from kohya_gui import command, config_file
from kohya_gui import params as P
from kohya_gui.ui import actions as A


def field(key: str) -> P.Param:
    return P.BY_NAME[P.NETWORK_ARG_PREFIX + key]


def lokr_values(**extra) -> dict:
    values = P.defaults("lora")
    values.update({"pretrained_model_name_or_path": "/m.safetensors", "train_data_dir": "/d", "output_dir": "/o",
                   "output_name": "x", "network_module": "lycoris.kohya", "network_args.algo": "lokr",
                   "network_args.factor": 8, "network_args.dora_wd": True, "network_args.preset": "attn-mlp",
                   "network_args": ["rank_dropout_scale=True"]}, **extra)
    return values


def test_the_fields_follow_the_chosen_network_module():
    def shown(module: str, family: str) -> set[str]:
        return {p.network_arg for p in A.network_fields("lora") if P.visible(p, "lora", family, module)}

    sdxl_lora, flux_lora = shown("", "SDXL"), shown("", "FLUX.1")  # empty: the family's LoRA
    assert {"conv_dim", "block_dims", "loraplus_lr_ratio"} <= sdxl_lora and "algo" not in sdxl_lora
    assert {"train_blocks", "img_attn_dim", "split_qkv"} <= flux_lora and "block_dims" not in flux_lora
    lycoris = shown("lycoris.kohya", "SDXL")
    assert {"algo", "preset", "factor", "dora_wd", "use_tucker", "conv_dim"} <= lycoris and "block_dims" not in lycoris
    dylora = shown("networks.dylora", "SD1.x")
    assert dylora >= {"unit", "conv_dim"} and "factor" not in dylora
    assert field("train_blocks").choices == ("", "all", "single", "double") and not field("train_blocks").open_choices
    assert field("preset").open_choices  # a LyCORIS preset can be a TOML file
    assert not any(p.network_arg for p in A.tab_params("dreambooth"))  # LoRA tab only


def test_fields_are_written_as_network_args_and_opened_back(tmp_path):
    values = lokr_values()
    path = tmp_path / "lokr.toml"
    assert "Error" not in A.save_config("lora", str(path), "SDXL", *ui_values("lora", values))
    data = tomllib.loads(path.read_text())
    written = data["network"]["network_args"]
    assert written == ["algo=lokr", "preset=attn-mlp", "factor=8", "dora_wd=True", "rank_dropout_scale=True"]
    assert not any(k.startswith(P.NETWORK_ARG_PREFIX) for t in data.values() for k in t)  # sd-scripts' own keys
    opened = A.open_config("lora", str(path), "SD1.x")
    restored = dict(zip([p.name for p in A.tab_params("lora")], ui_values_from_updates("lora", opened)))
    assert (restored["network_args.algo"], restored["network_args.factor"]) == ("lokr", "8")
    assert restored["network_args.dora_wd"] is True and restored["network_args"] == "rank_dropout_scale=True"
    # the trainer reads the same list from the file and from the stand-alone command
    parser = load_parser("sdxl_train_network.py")
    from library import train_util

    assert train_util.parse_args(parser, ["--config_file", str(path)]).network_args == written
    argv = command.trainer_args("lora", "SDXL", values)
    assert parser.parse_args(argv).network_args == written


def test_entries_a_field_cannot_hold_stay_as_entries():
    values = lokr_values(**{"network_args.algo": "", "network_args.factor": None, "network_args.dora_wd": False,
                            "network_args.preset": "",
                            "network_args": ["algo=loha", "factor=x", "wd_on_output=False", "mystery=1"]})
    opened = P.unfold_network_args("lora", "SDXL", values)
    assert opened["network_args.algo"] == "loha"
    # not a number / a false flag (unticked = the module's default, which may be true) / unknown key
    assert opened["network_args"] == ["factor=x", "wd_on_output=False", "mystery=1"]
    assert P.fold_network_args("lora", "SDXL", opened)["network_args"] == \
        ["algo=loha", "factor=x", "wd_on_output=False", "mystery=1"]


def test_a_key_in_a_field_and_in_network_arguments_is_refused():
    values = lokr_values(network_args=["factor=4"])
    errors = command.validation_errors("lora", "SDXL", values)
    assert any("factor is also set in the field 'LoKr factor'" in e for e in errors), errors
    values["network_args.factor"] = "eight"
    values["network_args"] = []
    errors = command.validation_errors("lora", "SDXL", values)
    assert any(e.startswith("LoKr factor (network_args.factor): expected a whole number") for e in errors), errors


def test_only_the_chosen_modules_fields_are_written():
    values = lokr_values(network_module="networks.lora", **{"network_args.conv_dim": 8})
    # LoKr's algo, preset and factor are not written; dora_wd is, as networks.lora reads it too (DoRA)
    assert P.fold_network_args("lora", "SDXL", values)["network_args"] == \
        ["conv_dim=8", "dora_wd=True", "rank_dropout_scale=True"]
    assert config_file.parse(config_file.to_toml("lora", "SDXL", values), "x").values["network_args.conv_dim"] == 8

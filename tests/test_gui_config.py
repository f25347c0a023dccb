"""Save / Open through the GUI's own functions: round trip, defaults left out, compile keys per family,
visibility rules, and every bad-file case (error names file, key, allowed values; nothing changes)."""

from __future__ import annotations

import tomllib

import gradio as gr
import pytest
from gui_helpers import all_non_default, ui_values, ui_values_from_updates

from kohya_gui import config_file, presets
from kohya_gui import params as P
from kohya_gui.secret_options import SECRET_OPTIONS
from kohya_gui.ui import actions as A
from kohya_gui.ui import visibility as V

COMPILE_PARAMS = [p for p in P.PARAMS if p.accordion == "compile"]


def _save_open_save(tmp_path, tab, family, values):
    first, second = tmp_path / "first.toml", tmp_path / "second.toml"
    msg = A.save_config(tab, str(first), family, *ui_values(tab, values))
    assert "Error" not in msg, msg
    opened = A.open_config(tab, str(first), "SD1.x")
    assert opened[1]["value"] == family
    msg = A.save_config(tab, str(second), family, *ui_values_from_updates(tab, opened))
    assert "Error" not in msg, msg
    return first.read_bytes(), second.read_bytes(), opened


@pytest.mark.parametrize("tab,family", sorted(P.SCRIPTS))
def test_round_trip_all_non_default(tmp_path, tab, family):
    values = all_non_default(tab, family)
    a, b, opened = _save_open_save(tmp_path, tab, family, values)
    assert a == b
    # Open restored every visible control to exactly what was saved
    restored = dict(zip([p.name for p in A.tab_params(tab)], ui_values_from_updates(tab, opened)))
    for p in P.params_for(tab, family):
        if p.name in SECRET_OPTIONS:  # never saved (test_secrets.py)
            assert restored[p.name] == "", p.name
        elif p.has_control and P.visible(p, tab, family, values.get("network_module", "")):
            assert restored[p.name] == A.to_ui(p, values[p.name]), p.name
    data = tomllib.loads(a.decode())
    assert data["gui"] == {"tab": tab, "family": family, "additional_parameters": values["additional_parameters"]}
    flat = {k: v for t in data.values() for k, v in t.items()}
    has_compile = family in ("SDXL", "FLUX.1")
    assert all((p.name in flat) == has_compile for p in COMPILE_PARAMS if tab in p.tabs)
    assert all(p.name not in flat for p in COMPILE_PARAMS if tab not in p.tabs)  # cuda_graph_step: LoRA only
    if family == "SD2.x":
        assert data["model"]["v2"] is True


@pytest.mark.parametrize("tab", P.TABS)
def test_presets_round_trip_byte_identical(tmp_path, tab):
    names = presets.list_presets(tab)
    assert "demo-sdxl-tiny" in names
    for name in names:
        path = presets.preset_path(tab, name)
        out = A.open_preset(tab, name, "SD1.x")
        assert out[0]["value"] == presets.user_config_path(tab, name)
        assert "Error" not in out[1], out[1]
        family = out[2]["value"]
        target = tmp_path / f"{name}.toml"
        n = len(A.tab_params(tab))
        assert "Error" not in A.save_config(tab, str(target), family, *[u["value"] for u in out[3:3 + n]])
        assert target.read_bytes() == path.read_bytes(), name


def test_defaults_left_out_and_compile_defaults_never_written(tmp_path):
    values = P.defaults("lora")
    values.update(pretrained_model_name_or_path="m.safetensors", compile=True, compile_dynamic="auto",
                  compile_cache_size_limit=0, compile_mode="reduce-overhead")
    text = config_file.to_toml("lora", "SDXL", values)
    data = tomllib.loads(text)
    assert data["compile"] == {"compile": True, "compile_mode": "reduce-overhead"}
    assert "compile_dynamic" not in text and "compile_cache_size_limit" not in text
    assert "learning_rate" not in text  # at its default
    assert set(data) == {"gui", "model", "network", "compile"}
    # the same values for SD1.x: no compile keys at all
    sd1 = config_file.to_toml("lora", "SD1.x", values)
    assert "compile" not in sd1
    # defaults only: just the gui table and the family-implied network module
    assert tomllib.loads(config_file.to_toml("lora", "SD1.x", P.defaults("lora"))) == {
        "gui": {"tab": "lora", "family": "SD1.x"}, "network": {"network_module": "networks.lora"}}


def _shown_by_classes(tab, p, family, module=""):
    """What the page's style sheet shows (ui/visibility.py): a drawn control without the family's kg-hide- class;
    a network-type field also needs the effective module's kg-mod- class."""
    classes = V.control_classes(tab, p)
    if not V.control_shown_somewhere(tab, p) or f"kg-hide-{V.slug(family)}" in classes:
        return False
    m = V.effective_module(family, module)
    return "kg-net" not in classes or bool(m) and f"kg-mod-{V.slug(m)}" in classes


@pytest.mark.parametrize("tab", P.TABS)
def test_page_classes_show_what_the_registry_says(tab):
    """Every control, family and network module: the page's classes agree with params.visible; every group with
    params.accordion_visible; the style sheet has a rule for each family's class."""
    modules = ["", "lycoris.kohya", "networks.oft", "my.own_module"]
    for family in P.tab_families(tab):
        for p in A.tab_params(tab):
            for module in (modules if p.network_arg else [""]):
                assert _shown_by_classes(tab, p, family, module) == P.visible(p, tab, family, module), \
                    (p.name, family, module)
        for key in A.tab_accordions(tab):
            shown = V.group_shown_somewhere(tab, key) and f"kg-hide-{V.slug(family)}" not in V.group_classes(tab, key)
            assert shown == (P.accordion_visible(key, tab, family) or key == "model"), (key, family)
        assert f"[data-kg-{tab}-family=\"{family}\"] #tab-{tab} .kg-hide-{V.slug(family)}" in V.css()
    assert len({V.slug(f) for f in P.FAMILIES}) == len(P.FAMILIES)


def test_visibility_rules():
    def shown(tab, family):
        controls = {p.name: _shown_by_classes(tab, p, family) for p in A.tab_params(tab)}
        accs = {k: "kg-hide-" + V.slug(family) not in V.group_classes(tab, k) for k in A.tab_accordions(tab)}
        return controls, accs, A.script_note(tab, family)

    c, a, note = shown("lora", "SD1.x")
    assert not a["compile"] and not any(c[p.name] for p in COMPILE_PARAMS)
    assert not a["flux"] and not c["clip_l"] and c["v_parameterization"]  # v-pred SD1.x checkpoints exist
    c_flux, _, _ = shown("lora", "FLUX.1")
    assert not c_flux["v_parameterization"] and not c_flux["vae"]
    assert "train_network.py" in note
    c, a, note = shown("lora", "SDXL")
    assert a["compile"] and all(c[p.name] for p in COMPILE_PARAMS) and not a["flux"]
    assert "sdxl_train_network.py" in note
    c, a, note = shown("lora", "FLUX.1")
    assert a["compile"] and a["flux"] and c["clip_l"] and c["blocks_to_swap"] and not c["vae"]
    assert "flux_train_network.py" in note
    c, a, _ = shown("lora", "SD2.x")
    assert c["v_parameterization"] and not a["compile"]
    c, a, note = shown("dreambooth", "SDXL")
    assert "network" not in a and c["reg_data_dir"] and c["fused_backward_pass"] and "sdxl_train.py" in note
    c, a, note = shown("finetune", "SD1.x")
    assert c["in_json"] and not c["fused_backward_pass"] and "fine_tune.py" in note


def _write(tmp_path, text):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return str(path)


def _assert_nothing_changed(out):
    assert all(u == gr.update() for u in out[1:]), "a failed open must not change any control"


@pytest.mark.parametrize("body,expected", [
    ('[model]\npretrained_model_name_or_path = "m"\nnetwork_dimm = 8\n',
     ["network_dimm", "unknown key", "did you mean 'network_dim'"]),
    ('[parameters]\nmax_train_steps = "ten"\n', ["max_train_steps", "whole number", "'ten'"]),
    ('[parameters]\nlearning_rate = true\n', ["learning_rate", "expected a number"]),
    ('[compile]\ncompile_mode = "turbo"\n',
     ["compile_mode", "'turbo'", "'default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs'"]),
    ('[gui]\ntab = "lora"\nfamily = "SD4"\n', ["[gui] family", "'SD1.x', 'SD2.x', 'SDXL', 'FLUX.1', 'SD3'"]),
    ('[gui]\ntab = "lora"\nfamily = "SD1.x"\n[compile]\ncompile = true\n', ["compile", "not used by LoRA SD1.x"]),
    ('[gui]\ntab = "dreambooth"\nfamily = "SDXL"\n', ["DreamBooth tab"]),
    ('[accelerate]\nlearning_rate = 0.1\n', ["learning_rate", "belongs in the [optimizer] table"]),
    ('[parameters]\nnum_processes = 2\n', ["num_processes", "belongs in the [accelerate] table"]),
    ("this is = = not toml", ["not valid TOML"]),
])
def test_bad_files_name_file_key_and_allowed_values(tmp_path, body, expected):
    path = _write(tmp_path, body)
    out = A.open_config("lora", path, "SDXL")
    msg = out[0]
    assert path in msg
    for text in expected:
        assert text in msg, (text, msg)
    _assert_nothing_changed(out)


def test_missing_file_and_empty_path(tmp_path):
    out = A.open_config("lora", str(tmp_path / "nope.toml"), "SDXL")
    assert "file not found" in out[0]
    _assert_nothing_changed(out)
    out = A.open_config("lora", "", "SDXL")
    assert "Enter the path" in out[0]
    _assert_nothing_changed(out)


def test_plain_sd_scripts_toml_opens(tmp_path):
    """A flat kohya TOML without [gui] opens in the current tab, family inferred."""
    path = _write(tmp_path, 'pretrained_model_name_or_path = "flux1-dev.safetensors"\nclip_l = "c.safetensors"\n'
                            'network_module = "networks.lora_flux"\nnetwork_dim = 16\ncompile = true\n'
                            'resolution = 512\n')
    out = A.open_config("lora", path, "SDXL")
    assert out[1]["value"] == "FLUX.1"
    got = dict(zip([p.name for p in A.tab_params("lora")], ui_values_from_updates("lora", out)))
    assert got["network_dim"] == "16" and got["compile"] is True and got["resolution"] == "512" and got["clip_l"] == "c.safetensors"


def test_save_as_never_overwrites_and_bad_ui_values(tmp_path):
    target = tmp_path / "cfg.toml"
    target.write_text("keep me")
    vals = ui_values("lora", P.defaults("lora"))
    msg = A.save_config("lora", str(target), "SDXL", *vals, overwrite=False)
    assert "already exists" in msg and target.read_text() == "keep me"
    bad = list(vals)
    bad[[p.name for p in A.tab_params("lora")].index("max_train_steps")] = 2.5
    msg = A.save_config("lora", str(target), "SDXL", *bad)
    assert "max_train_steps" in msg and "whole number" in msg and target.read_text() == "keep me"
    names = [p.name for p in A.tab_params("lora")]
    for name, text, error in (("network_dim", "abc", "expected a whole number, got 'abc'"),
                              ("max_train_epochs", "0", "must be at least 1"),
                              ("train_batch_size", 0, "must be at least 1")):
        bad = list(vals)
        bad[names.index(name)] = text
        msg = A.save_config("lora", str(target), "SDXL", *bad)
        assert name in msg and error in msg and target.read_text() == "keep me", msg
    assert "Saved" in A.save_config("lora", str(target), "SDXL", *vals)
    assert target.read_text().startswith("[gui]")

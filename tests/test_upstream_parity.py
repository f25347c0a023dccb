"""Option parity with kohya-ss/sd-scripts: every upstream option of the seven scripts (and of the LoRA tools in
sd-scripts/networks/) parses here with the same
option strings, type, default, choices and nargs, except the documented tables of `library/parity.py`
(REFUSED, DIFFERENT, NOT_YET); those tables cannot go stale; docs/PARITY.md is generated from the same data.

Upstream's option tables live outside the repository (`../shared/parity/upstream-flags/`, beside the checkout,
as in CI); without them the table checks are skipped."""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys

import pytest

from kohya_gui import REPO

_spec = importlib.util.spec_from_file_location("gen_parity", REPO / "tools" / "gen_parity.py")
gen_parity = importlib.util.module_from_spec(_spec)
sys.modules["gen_parity"] = gen_parity
_spec.loader.exec_module(gen_parity)

from library import parity, train_util  # noqa: E402

needs_upstream = pytest.mark.skipif(not gen_parity.UPSTREAM_FLAGS.is_dir(),
                                    reason=f"upstream option tables not found at {gen_parity.UPSTREAM_FLAGS} "
                                           "(shared/ beside the checkout)")


@pytest.fixture(scope="module")
def upstream():
    return gen_parity.load_upstream()


@pytest.fixture(scope="module")
def parsers():
    return gen_parity.load_parsers()


@needs_upstream
@pytest.mark.parametrize("script", parity.SCRIPTS)
def test_every_upstream_option_parses_as_upstream(script, upstream, parsers):
    rows = gen_parity.script_rows(upstream[script], parsers[script])
    bad = [f"--{r.option}: {r.status}: {r.note}" for r in rows if r.status in (gen_parity.MISSING,
                                                                               gen_parity.DIFFERS)]
    assert not bad, f"{script}.py differs from upstream:\n" + "\n".join(bad)


@needs_upstream
def test_tool_scripts_parse_as_upstream():
    """The captioning, dataset and LoRA tools (parity.TOOLS) against upstream's tables, with their own
    TOOL_DIFFERENT entries, none of them stale."""
    assert gen_parity.tool_problems(gen_parity.load_tools()) == []


@pytest.mark.parametrize("script", parity.SCRIPTS)
def test_help_renders(script, parsers):
    """--help formats every option's help (a stray '%' in a help text breaks argparse's --help)."""
    assert "--config_file" in parsers[script].format_help()


@needs_upstream
def test_exception_tables_are_not_stale(upstream, parsers):
    assert gen_parity.table_problems(upstream, parsers) == []


# -- the tool scripts (parity.TOOLS) --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tools():
    return gen_parity.load_tools()


@needs_upstream
@pytest.mark.parametrize("table", list(parity.TOOLS))
def test_every_upstream_tool_option_is_compared(table, tools):
    upstream_options, _parser = tools[table]
    rows = gen_parity.tool_rows({table: tools[table]})[table]
    assert rows and len(rows) == len(upstream_options), f"{table}: upstream options not all compared"


@needs_upstream
@pytest.mark.parametrize("table", list(parity.TOOLS))
def test_tool_help_renders(table, tools):
    assert "--dump_options" in tools[table][1].format_help()


@needs_upstream
def test_a_stale_tool_entry_is_reported(tools, monkeypatch):
    monkeypatch.setitem(parity.TOOL_DIFFERENT, "networks__resize_lora", {"no_such_option": parity.Different("x")})
    assert gen_parity.tool_problems(tools) == [
        "parity.TOOL_DIFFERENT['networks__resize_lora']: 'no_such_option' is no upstream option of it"]


@needs_upstream
def test_parity_md_is_up_to_date(upstream, parsers):
    expected = gen_parity.render(upstream, parsers)
    assert gen_parity.PARITY_MD.read_text() == expected, "docs/PARITY.md is stale: run python tools/gen_parity.py"


# -- the comparison itself (no upstream files needed) --------------------------------------------------------

def _entry(**kw):
    base = {"opts": ["--x"], "type": "float", "default": "None", "choices": None, "nargs": None,
            "action": "_StoreAction"}
    base.update(kw)
    return base


def _parser_with(*args, **kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument(*args, **kwargs)
    return p


def test_comparison_finds_each_kind_of_difference():
    up = {"x": _entry(default="2e-06")}
    assert gen_parity.script_rows(up, _parser_with("--x", type=float, default=2e-6)) == [gen_parity.Row("x", "same")]
    for kwargs, field in (({"type": float, "default": 1e-4}, "default"), ({"type": int, "default": 2e-6}, "type"),
                          ({"type": float, "default": 2e-6, "nargs": "*"}, "nargs"),
                          ({"type": float, "default": 2e-6, "choices": [1.0]}, "choices")):
        (row,) = gen_parity.script_rows(up, _parser_with("--x", **kwargs))
        assert row.status == gen_parity.DIFFERS and row.note.startswith(field), (kwargs, row)
    (row,) = gen_parity.script_rows(up, _parser_with("--y", type=float))
    assert row.status == gen_parity.MISSING
    (row,) = gen_parity.script_rows({"x": _entry(action="_StoreTrueAction", type=None, nargs=0, default="False")},
                                    _parser_with("--x", type=str))
    assert row.status == gen_parity.DIFFERS


def test_comparison_equivalences():
    # a store without type and a pathlib.Path type both read text: same as type=str
    up = {"x": _entry(type="Path"), }
    assert gen_parity.script_rows(up, _parser_with("--x", type=str))[0].status == "same"
    up = {"x": _entry(type=None, choices=["None", "a"])}
    assert gen_parity.script_rows(up, _parser_with("--x", type=str, choices=[None, "a"]))[0].status == "same"


def test_upstream_int_or_float_rule():
    # upstream: "N%" is a ratio, values >= 1 must be integers (steps), below 1 a ratio
    assert train_util.int_or_float("100") == 100 and isinstance(train_util.int_or_float("100"), int)
    assert train_util.int_or_float("0.05") == 0.05
    assert train_util.int_or_float("10%") == pytest.approx(0.1)
    with pytest.raises(argparse.ArgumentTypeError):
        train_util.int_or_float("1.5")
    with pytest.raises(argparse.ArgumentTypeError):
        train_util.int_or_float("ten")


# -- refused options --------------------------------------------------------------------------------------

def test_refused_options_parse_at_their_defaults_and_stop_otherwise(tmp_path):
    import sdxl_train_network

    parser = sdxl_train_network.setup_parser()
    args = train_util.parse_args(parser, ["--zero_stage", "2"])  # DeepSpeed's options parse (library/sharding.py)
    assert args.deepspeed is False and args.zero_stage == 2
    cfg = tmp_path / "c.toml"
    cfg.write_text('dataset_class = "my.Dataset"\n')
    with pytest.raises(train_util.ConfigError, match="--dataset_class"):
        train_util.parse_args(parser, ["--config_file", str(cfg)])
    with pytest.raises(train_util.ConfigError, match="--dataset_class.*--dataset_config"):
        train_util.parse_args(parser, ["--dataset_class", "my.Dataset"])


def test_refused_option_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "sd-scripts" / "train_network.py"), "--dataset_class", "my.D",
                           "--output_dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--dataset_class" in errors[0] and "--dataset_config" in errors[0]


# -- config files as the kohya_ss GUI writes them ------------------------------------------------------------

def test_kohya_ss_gui_config_quirks(tmp_path, caplog):
    import logging

    import sdxl_train_network

    parser = sdxl_train_network.setup_parser()
    cfg = tmp_path / "gui.toml"
    cfg.write_text('epoch = 3\nnoise_offset_type = "Original"\nmax_token_length = 75\n'
                   "persistent_data_loader_workers = 1\ncache_latents = 0\n")
    with caplog.at_level(logging.INFO, logger="library.train_util"):
        args = train_util.parse_args(parser, ["--config_file", str(cfg)])
    assert "skipped keys of the kohya_ss GUI" in caplog.text and "epoch, noise_offset_type" in caplog.text
    assert not hasattr(args, "epoch") and not hasattr(args, "noise_offset_type")
    assert args.max_token_length is None  # 75 = the default
    assert args.persistent_data_loader_workers is True and args.cache_latents is False
    cfg.write_text("max_token_length = 150\n")
    assert train_util.parse_args(parser, ["--config_file", str(cfg)]).max_token_length == 150
    cfg.write_text("epoch = 3\nepochs = 3\npersistent_data_loader_workers = 2\n")  # other keys still stop the run
    with pytest.raises(train_util.ConfigError) as e:
        train_util.parse_args(parser, ["--config_file", str(cfg)])
    assert "2 bad keys" in str(e.value) and "unknown key 'epochs'" in str(e.value)
    assert "persistent_data_loader_workers = 2 must be true or false" in str(e.value)

"""--console_log_level/_file/_simple (library.console_log) and the tracker options --wandb_run_name,
--wandb_api_key, --log_tracker_config, --log_config (library.trackers), checked against upstream's rules."""
from __future__ import annotations

import argparse
import logging

import pytest

from library import console_log, trackers
from library.train_util import ConfigError, OptionalPackageError


@pytest.fixture
def root_logger():
    """Restores the root logger's handlers and level after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


def parse(argv, add=console_log.add_console_log_arguments):
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def ours(root):
    return [h for h in root.handlers if getattr(h, console_log._OURS, False)]


def test_console_log_options_parse_as_upstream():
    args = parse([])
    assert (args.console_log_level, args.console_log_file, args.console_log_simple) == (None, None, False)
    with pytest.raises(SystemExit):
        parse(["--console_log_level", "info"])  # upstream's choices are upper case


def test_no_console_option_leaves_the_log_alone(root_logger):
    console_log.setup_logging()
    before = (list(root_logger.handlers), root_logger.level)
    console_log.apply_console_log_args(parse([]))
    assert (list(root_logger.handlers), root_logger.level) == before


def test_console_log_file_replaces_the_console_handler(root_logger, tmp_path):
    console_log._install(logging.StreamHandler(), console_log.DEFAULT_FORMAT, logging.INFO)
    path = tmp_path / "run.log"
    path.write_text("old content\n")
    console_log.apply_console_log_args(parse(["--console_log_file", str(path), "--console_log_level", "DEBUG"]))
    handlers = ours(root_logger)
    assert len(handlers) == 1 and isinstance(handlers[0], logging.FileHandler)
    assert root_logger.level == logging.DEBUG
    logging.getLogger("sd.test").debug("hello %s", "file")
    handlers[0].flush()
    text = path.read_text()
    assert "old content" not in text  # mode "w", as upstream
    assert "DEBUG sd.test: hello file" in text


def test_console_log_simple_is_the_message_alone(root_logger, capsys):
    console_log.apply_console_log_args(parse(["--console_log_simple"]))
    (handler,) = ours(root_logger)
    record = logging.LogRecord("sd.x", logging.INFO, __file__, 1, "just %s", ("this",), None)
    assert handler.format(record) == "just this"
    assert root_logger.level == logging.INFO


def test_console_log_level_filters(root_logger):
    console_log.setup_logging()
    console_log.apply_console_log_args(parse(["--console_log_level", "ERROR"]))
    assert root_logger.level == logging.ERROR
    assert not logging.getLogger("sd.y").isEnabledFor(logging.WARNING)


def test_unwritable_console_log_file_is_a_config_error(root_logger, tmp_path):
    with pytest.raises(ConfigError, match="--console_log_file"):
        console_log.apply_console_log_args(parse(["--console_log_file", str(tmp_path / "no" / "dir" / "x.log")]))


# ---------------------------------------------------------------------------------------------- trackers


def tracker_args(argv):
    parser = argparse.ArgumentParser()
    trackers.add_tracker_arguments(parser)
    parser.add_argument("--log_with", default=None)
    parser.add_argument("--logging_dir", default=None)
    parser.add_argument("--log_tracker_name", default=None)
    parser.add_argument("--output_dir", default=None)
    parser.add_argument("--optimizer_args", nargs="*", default=None)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    return parser.parse_args(argv)


def test_wandb_run_name_and_tracker_toml_init_kwargs(tmp_path):
    assert trackers.init_kwargs(tracker_args([])) == {}
    assert trackers.init_kwargs(tracker_args(["--wandb_run_name", "run A"])) == {"wandb": {"name": "run A"}}
    toml = tmp_path / "trackers.toml"
    toml.write_text('[wandb]\nname = "from toml"\ntags = ["sdxl", "lora"]\n\n[tensorboard]\nflush_secs = 5\n')
    # as upstream: the file replaces what --wandb_run_name set
    kwargs = trackers.init_kwargs(tracker_args(["--wandb_run_name", "run A", "--log_tracker_config", str(toml)]))
    assert kwargs == {"wandb": {"name": "from toml", "tags": ["sdxl", "lora"]}, "tensorboard": {"flush_secs": 5}}


@pytest.mark.parametrize("content, match", [
    (None, "file not found"),
    ("[wandb\n", "not a readable TOML"),
    ('name = "x"\n', "must be tables named after the tracker"),
])
def test_bad_tracker_toml_is_refused_before_training(tmp_path, content, match):
    path = tmp_path / "t.toml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=f"--log_tracker_config.*{match}"):
        trackers.check_tracker_args(tracker_args(["--log_tracker_config", str(path)]))


def test_log_config_sends_the_options_without_secrets_and_paths():
    args = tracker_args(["--wandb_api_key", "SECRET", "--output_dir", "/home/me/out", "--optimizer_args", "a=1", "b=2"])
    assert trackers.sanitized_config(args) is None  # off: upstream sends no config
    args.log_config = True
    cfg = trackers.sanitized_config(args)
    assert "wandb_api_key" not in cfg and "output_dir" not in cfg
    assert cfg["optimizer_args"] == "['a=1', 'b=2']" and cfg["learning_rate"] == 1e-4 and cfg["log_with"] is None
    assert all(v is None or isinstance(v, (bool, int, float, str)) for v in cfg.values())


def test_init_trackers_passes_name_config_and_kwargs():
    class FakeAccelerator:
        is_main_process = True

        def init_trackers(self, name, config=None, init_kwargs=None):
            self.call = (name, config, init_kwargs)

    acc = FakeAccelerator()
    args = tracker_args(["--log_config", "--wandb_run_name", "r1", "--log_tracker_name", "proj"])
    trackers.init_trackers(acc, args, "network_train")
    name, config, kwargs = acc.call
    assert name == "proj" and kwargs == {"wandb": {"name": "r1"}} and config["wandb_run_name"] == "r1"
    acc2 = FakeAccelerator()
    trackers.init_trackers(acc2, tracker_args([]), "network_train")
    assert acc2.call == ("network_train", None, {})


def test_wandb_login_with_the_api_key(monkeypatch, tmp_path):
    import sys
    import types

    calls = []
    fake = types.SimpleNamespace(login=lambda key: calls.append(key))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    args = tracker_args(["--log_with", "wandb", "--wandb_api_key", "KEY1"])
    trackers.check_tracker_args(args)
    trackers.prepare_wandb(args, str(tmp_path / "logs"))
    assert calls == ["KEY1"]
    import os

    assert os.environ["WANDB_DIR"] == str(tmp_path / "logs")
    calls.clear()
    trackers.prepare_wandb(tracker_args(["--log_with", "tensorboard", "--wandb_api_key", "KEY1"]), None)
    assert calls == []  # only when wandb logs


def test_wandb_missing_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(OptionalPackageError, match="pip install wandb"):
        trackers.check_tracker_args(tracker_args(["--log_with", "all"]))

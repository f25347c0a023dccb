"""Issue 13 item 6: preset names on the command line, files written with the user's umask, one exit status in
the result, the password kept out of `ps` (wrong ones slowed down: test_login_wait.py), nothing of the GUI on the login page, a port in use."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request

import pytest

import gui
from kohya_gui import REPO, __main__ as cli, config_file, login, presets
from kohya_gui.runner import RunState
from kohya_gui.ui import actions


@pytest.mark.slow
def test_a_preset_name_works_on_the_command_line(capsys):
    assert presets.resolve("demo-sdxl-tiny") == presets.preset_dir("lora") / "demo-sdxl-tiny.toml"
    assert presets.resolve("dreambooth/demo-sdxl-tiny") == presets.preset_dir("dreambooth") / "demo-sdxl-tiny.toml"
    assert cli.main(["print-command", "demo-sdxl-tiny"]) == 0
    assert "sdxl_train_network.py" in capsys.readouterr().out
    assert cli.main(["print-command", "no-such-preset"]) == 2
    err = capsys.readouterr().err
    assert "not a file and not a preset" in err and "lora/demo-sdxl-tiny" in err


def test_saved_configs_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = config_file.write_text_atomic(tmp_path / "run.toml", "x = 1\n")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["run.toml"]  # no temporary file left


def test_a_failed_run_names_its_exit_status_once():
    s = RunState(started=1.0, ended=2.0, running=False, returncode=1, message="failed (exit status 1)")
    assert actions.result_md(s).count("exit status 1") == 1


def test_password_from_a_file_or_the_environment(tmp_path):
    f = tmp_path / "pw"
    f.write_text("s3cret\nignored\n")
    assert login.password_from("", str(f), {}) == "s3cret"
    assert login.password_from("", None, {login.PASSWORD_ENV: "envpw"}) == "envpw"
    assert login.password_from("cli", None, {login.PASSWORD_ENV: "envpw"}) == "cli"
    with pytest.raises(login.PasswordError, match="not both"):
        login.password_from("cli", str(f), {})
    with pytest.raises(login.PasswordError, match="cannot read"):
        login.password_from("", str(tmp_path / "missing"), {})
    a = gui.parse_args(["--username", "u", "--password_file", str(f)])
    assert a.password == "s3cret"
    with pytest.raises(SystemExit):
        gui.parse_args(["--username", "u", "--password_file", str(tmp_path / "missing")])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_login_page_carries_nothing_of_the_gui_and_a_busy_port_is_one_line(tmp_path):
    port = _free_port()
    env = dict(os.environ, KOHYA_GUI_PASSWORD="pw", XDG_CONFIG_HOME=str(tmp_path))
    proc = subprocess.Popen([sys.executable, str(REPO / "gui.py"), "--server_port", str(port), "--username", "u"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if f":{port}" in line:
                break
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30).read().decode()
        assert "auth_required" in page  # the login page
        assert "demo-sdxl-tiny" not in page and "named_endpoints\":{\"" not in page
        busy = subprocess.run([sys.executable, str(REPO / "gui.py"), "--server_port", str(port)], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert busy.returncode == 2
        assert f"port {port}" in busy.stderr and "--server_port" in busy.stderr and "Traceback" not in busy.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=60)

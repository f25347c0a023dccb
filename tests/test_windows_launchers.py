"""gui.bat and gui.ps1 do what gui.sh does (we cannot run Windows here, so the files are read): set up .venv through
the same tools/setup_venv.py as setup.sh, then run gui.py with every argument passed through; and
tools/setup_venv.py itself (stamp, commands, Python version)."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from kohya_gui import REPO

sys.path.insert(0, str(REPO / "tools"))
import setup_venv  # noqa: E402


def code_lines(name: str) -> list[str]:
    comment = re.compile(r"^\s*(#|rem\b|::)", re.I)
    return [ln.strip() for ln in (REPO / name).read_text().splitlines() if ln.strip() and not comment.match(ln)]


def comment_text(name: str) -> str:
    code = set(code_lines(name))
    return "\n".join(ln for ln in (REPO / name).read_text().splitlines() if ln.strip() not in code)


def flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", text))


WINDOWS = {"gui.bat": "%*", "gui.ps1": "@args"}  # the way each passes its own arguments on


@pytest.mark.parametrize("name", WINDOWS)
def test_windows_launcher_sets_up_then_passes_every_argument_to_gui_py(name):
    lines = code_lines(name)
    setup = [i for i, ln in enumerate(lines) if re.search(r"tools[\\/]setup_venv\.py", ln)]
    run = [i for i, ln in enumerate(lines) if re.search(r"\bgui\.py\b", ln)]
    assert len(setup) == 1 and len(run) == 1, lines
    assert setup[0] < run[0]
    line = lines[run[0]]
    # the venv's interpreter runs gui.py, with the arguments as given, after it and nothing else
    assert re.search(r"\.venv\\Scripts\\python\.exe\"?\s+gui\.py\s+" + re.escape(WINDOWS[name]) + r"\s*(\}\s*)?$",
                     line), line
    # a failed setup does not start the GUI, and the exit status comes back
    assert "errorlevel" in line.lower() or "$LASTEXITCODE -eq 0" in line
    assert re.search(r"exit\s+(/b\s+)?%?\$?rc%?$", lines[-1], re.I), lines[-1]
    # like gui.sh's cd "$(dirname "$0")": run from the repository, and put the caller's folder back
    assert any(re.match(r"(pushd\s+\"%~dp0\"|Push-Location \$PSScriptRoot)", ln) for ln in lines)
    assert any(re.match(r"(popd|Pop-Location)$", ln) for ln in lines)


def test_gui_sh_handles_no_flag_the_windows_launchers_miss():
    """Flags gui.sh (and setup.sh, which it runs) handle themselves must be handled by the Windows launchers or
    the setup they share; the rest go to gui.py, through "$@" there and %* / @args here."""
    gui_sh, setup_sh = "\n".join(code_lines("gui.sh")), "\n".join(code_lines("setup.sh"))
    assert re.search(r'gui\.py "\$@"$', gui_sh) and "./setup.sh" in gui_sh
    assert re.search(r'tools/setup_venv\.py "\$@"$', setup_sh)
    setup_code = (REPO / "tools" / "setup_venv.py").read_text()
    for name in WINDOWS:
        code = "\n".join(code_lines(name))
        for flag in flags(gui_sh):
            assert flag in code, f"gui.sh handles {flag}, {name} does not"
        for flag in flags(setup_sh):
            assert flag in setup_code, f"setup.sh handles {flag}, tools/setup_venv.py does not"
        # the environment variables they read: the interpreter here, the rest in the shared setup
        for var in set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", gui_sh + setup_sh)):
            assert var in code or f'"{var}"' in setup_code, f"{var} is read by gui.sh/setup.sh, not on Windows"
        # the launch flags gui.sh's comment lists are listed too, and each is one of gui.py's
        listed = flags(comment_text("gui.sh"))
        assert listed and listed <= flags(comment_text(name)), (name, listed - flags(comment_text(name)))
    gui_py_flags = set(re.findall(r'add_argument\("(--\w+)"', (REPO / "gui.py").read_text()))
    assert flags(comment_text("gui.sh")) <= gui_py_flags


def test_windows_launchers_have_crlf_line_ends_in_checkouts():
    attrs = (REPO / ".gitattributes").read_text().split("\n")
    assert "*.bat text eol=crlf" in attrs and "*.ps1 text eol=crlf" in attrs
    out = subprocess.run(["git", "check-attr", "eol", "gui.bat", "gui.ps1"], cwd=REPO, capture_output=True,
                         text=True)
    assert out.stdout.count("eol: crlf") == 2, out.stdout + out.stderr


# ---- tools/setup_venv.py ----------------------------------------------------------------------------------------

def test_requires_python_matches_the_setup_check_and_the_code():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=%d.%d" % setup_venv.MIN_PYTHON == ">=3.11"  # tomllib is 3.11+
    assert "Python 3.11" in (REPO / "README.md").read_text()


def fake_checkout(tmp_path, stamp_age: float | None):
    """A repository with an existing .venv; the stamp `stamp_age` seconds older than pyproject.toml (None: none)."""
    import os

    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    python = setup_venv.venv_python(tmp_path)
    python.parent.mkdir(parents=True)
    python.write_text("")
    if stamp_age is not None:
        stamp = setup_venv.stamp_path(tmp_path, False)
        stamp.touch()
        mtime = (tmp_path / "pyproject.toml").stat().st_mtime - stamp_age
        os.utime(stamp, (mtime, mtime))
    return python


@pytest.mark.parametrize("stamp_age, installs", [(None, True), (10.0, True), (-10.0, False)])
def test_setup_installs_only_when_pyproject_changed(tmp_path, monkeypatch, stamp_age, installs):
    python = fake_checkout(tmp_path, stamp_age)
    monkeypatch.setenv("TORCH_SPEC", "torch==2.13.0  --index-url https://download.pytorch.org/whl/cu130")
    calls = []
    assert setup_venv.main([], root=tmp_path, run=lambda cmd, cwd: calls.append((cmd, cwd))) == 0
    if not installs:
        assert calls == []
        return
    pip = [str(python), "-m", "pip", "install", "-q"]
    assert calls == [(pip + ["--upgrade", "pip"], tmp_path),
                     (pip + ["torch==2.13.0", "--index-url", "https://download.pytorch.org/whl/cu130"], tmp_path),
                     (pip + ["-e", "."], tmp_path)]
    assert not setup_venv.needs_install(tmp_path, False)
    assert setup_venv.needs_install(tmp_path, True)  # --test has its own stamp


def test_setup_test_extra_default_torch_and_failures(tmp_path, monkeypatch, capsys):
    fake_checkout(tmp_path, None)
    monkeypatch.delenv("TORCH_SPEC", raising=False)
    calls = []
    assert setup_venv.main(["--test"], root=tmp_path, run=lambda cmd, cwd: calls.append(cmd)) == 0
    assert calls[1][-1] == "torch==2.13.0" and calls[2][-2:] == ["-e", ".[test]"]

    def fail(cmd, cwd):
        raise subprocess.CalledProcessError(1, cmd)

    fake_checkout(tmp_path / "y", None)
    assert setup_venv.main([], root=tmp_path / "y", run=fail) == 1
    assert not setup_venv.stamp_path(tmp_path / "y", False).exists()  # a failed install is tried again next time
    assert "failed with exit status 1" in capsys.readouterr().err

    assert setup_venv.main(["--tset"], root=tmp_path) == 2
    assert "unknown arguments --tset; the only option is --test" in capsys.readouterr().err
    monkeypatch.setattr(sys, "version_info", (3, 10, 14))
    assert setup_venv.main([], root=tmp_path) == 2
    assert "Python 3.11 or newer is needed" in capsys.readouterr().err


def test_setup_says_what_it_does_and_hides_the_build_noise(tmp_path, monkeypatch, capsys):
    """The first run prints each step (and how to get the optional extras) instead of minutes of silence; the
    commands' own output (pip, setuptools' notes) shows only when one fails."""
    fake_checkout(tmp_path, None)
    monkeypatch.delenv("TORCH_SPEC", raising=False)
    assert setup_venv.main([], root=tmp_path, run=lambda cmd, cwd: None) == 0
    out = capsys.readouterr().out
    assert "[1/3]" in out and "[2/3] installing torch==2.13.0" in out and "[3/3]" in out
    assert "pip install -e '.[extras]'" in out
    setup_venv.quiet_run([sys.executable, "-c", "import sys; print('noise'); print('warn', file=sys.stderr)"],
                         tmp_path)
    assert "noise" not in capsys.readouterr().out
    with pytest.raises(subprocess.CalledProcessError):
        setup_venv.quiet_run([sys.executable, "-c", "import sys; print('why it failed'); sys.exit(3)"], tmp_path)
    assert "why it failed" in capsys.readouterr().err


def test_the_package_builds_without_setuptools_warnings(tmp_path):
    """pyproject's packaging: every folder of kohya_gui (kohya_gui.options holds data) is a package, so the build
    prints no 'Package would be ignored' warning."""
    proc = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "egg_info",
                           "--egg-base", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py",
                           "--build-lib", str(tmp_path / "lib")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and "would be ignored" not in proc.stderr + proc.stdout, proc.stderr
    assert (tmp_path / "lib" / "kohya_gui" / "options" / "sdxl_train.py.json").is_file()

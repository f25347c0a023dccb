@echo off
rem Windows (cmd) version of gui.sh: the first run creates .venv and installs the project (tools\setup_venv.py, as
rem setup.sh does); then starts the GUI on 127.0.0.1:7860. Extra flags go to gui.py (--listen --server_port --share
rem --inbrowser --headless --username --password ...). PYTHON picks the interpreter (3.11+, default python),
rem TORCH_SPEC the torch build (e.g. set "TORCH_SPEC=torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130").
setlocal
pushd "%~dp0"
if not defined PYTHON set "PYTHON=python"
%PYTHON% tools\setup_venv.py
if not errorlevel 1 .venv\Scripts\python.exe gui.py %*
set "rc=%errorlevel%"
popd
exit /b %rc%

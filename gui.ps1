# Windows (PowerShell) version of gui.sh: the first run creates .venv and installs the project
# (tools/setup_venv.py, as setup.sh does); then starts the GUI on 127.0.0.1:7860. Extra flags go to gui.py
# (--listen --server_port --share --inbrowser --headless --username --password ...). $env:PYTHON picks the
# interpreter (3.11+, default python), $env:TORCH_SPEC the torch build.
$py = if ($env:PYTHON) { $env:PYTHON } else { "python" }
Push-Location $PSScriptRoot  # like gui.sh's cd, undone at the end (a script's Set-Location outlives it)
try {
    & $py tools/setup_venv.py
    if ($LASTEXITCODE -eq 0) { & .venv\Scripts\python.exe gui.py @args }
    $rc = $LASTEXITCODE
} finally {
    Pop-Location
}
exit $rc

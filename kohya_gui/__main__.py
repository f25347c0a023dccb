"""Without a browser:

    python -m kohya_gui print-command CONFIG.toml   # prints the command Start training would run
    python -m kohya_gui print-command --standalone CONFIG.toml   # the same run, every setting as a flag
    python -m kohya_gui print-command --shell windows CONFIG.toml   # quoted for cmd / PowerShell (default: this OS)
    python -m kohya_gui train CONFIG.toml           # runs it with the GUI's runner (Ctrl+C: stop + save; twice: now)
    python -m kohya_gui prepare-demo CONFIG.toml    # makes a demo preset's tiny model and images (used by runs)
    python -m kohya_gui import KOHYA_SS.json -o OUT.toml   # a kohya_ss GUI configuration as our TOML, with a report
    python -m kohya_gui signal save|sample|stop OUTPUT_DIR_OR_RUN_TOML   # Save now / Sample now / Stop (and save)

print-command and train also take a kohya_ss JSON directly (imported on the fly, the report on stderr).
"""

from __future__ import annotations

import argparse
import signal
import sys

from . import command, config_file, demo, importer, params, presets, quoting, run_requests, training
from .runner import Runner


def send_request(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kohya_gui signal",
                                     description="Ask a running trainer to save, sample or stop (and save) at its "
                                                 "next step boundary.")
    parser.add_argument("request", choices=run_requests.REQUESTS)
    parser.add_argument("target", help="the run's output folder, or its run TOML (the GUI writes "
                                       "<output_dir>/<output_name>.toml)")
    args = parser.parse_args(argv)
    try:
        path = run_requests.send(args.request, args.target)
    except run_requests.RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"asked for {args.request} ({path}); the trainer acts on it after its current step")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["signal"]:
        return send_request(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m kohya_gui", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["print-command", "train", "prepare-demo", "import", "signal"],
                        help="signal: python -m kohya_gui signal save|sample|stop OUTPUT_DIR_OR_RUN_TOML")
    parser.add_argument("config", help="a configuration TOML saved by the GUI, a preset name (demo-sdxl-tiny, "
                                       "dreambooth/sdxl-dreambooth-24gb), or a kohya_ss GUI JSON")
    parser.add_argument("--standalone", action="store_true",
                        help="print-command: every setting as a flag instead of --config_file")
    parser.add_argument("--shell", choices=quoting.SHELLS, default=quoting.native_shell(),
                        help="print-command: quote for a POSIX shell or for Windows cmd / PowerShell (default: "
                             "this machine's, %(default)s)")
    parser.add_argument("-o", "--output", help="import: the TOML to write")
    parser.add_argument("--tab", choices=list(params.TABS), help="import: the tab (default: from the file)")
    parser.add_argument("--force", action="store_true", help="import: overwrite an existing output file")
    args = parser.parse_args(argv)
    if args.action == "import":
        return import_file(args)
    try:
        if args.config.lower().endswith(".json"):
            imported = importer.load(args.config, args.tab)
            print("\n".join(f"import: {line}" for line in imported.report_lines()), file=sys.stderr)
            if imported.sample_prompts_text:
                print("import: the inline sample prompts are not used here; `import -o` writes them to a file",
                      file=sys.stderr)
                imported.values["sample_prompts"] = ""
            cfg = config_file.Config(imported.tab, imported.family, imported.values)
        else:
            cfg = config_file.load(presets.resolve(args.config))
    except (config_file.ConfigError, FileNotFoundError, importer.ImportError_) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.action == "print-command":
        errors = command.validation_errors(cfg.tab, cfg.family, cfg.values)
        build = command.standalone_argv if args.standalone else command.build_argv
        print(command.printable(build(cfg.tab, cfg.family, cfg.values), args.shell))
        for e in errors:
            print(f"warning: {e}", file=sys.stderr)
        return 0
    if args.action == "prepare-demo":
        demo.make_assets(cfg.family, cfg.values, log=lambda m: print(m, flush=True))
        return 0

    runner = Runner()
    runner.line_callback = lambda line: print(line, flush=True)
    try:
        training.start(runner, cfg.tab, cfg.family, cfg.values)
    except (training.RunError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    signals = []

    def on_signal(signum, frame):  # the first: stop and save; another: stop now
        signals.append(signum)
        now = len(signals) > 1
        print("stopping the training process tree now ..." if now else
              "stopping: the trainer finishes its step and saves (again to stop now) ...", file=sys.stderr, flush=True)
        runner.stop(now=now)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    state = runner.wait()
    print(f"# {state.message}")
    for path in state.outputs:
        print(f"output: {path}")
    rc = state.returncode  # the training's (the runner leaves `accelerate launch` to end with it)
    return 128 - rc if rc is not None and rc < 0 else 1 if rc is None else rc  # killed by signal N: 128 + N


def import_file(args) -> int:
    if not args.output:
        print("error: import needs -o OUT.toml (where to write our configuration)", file=sys.stderr)
        return 2
    try:
        imported = importer.load(args.config, args.tab)
        path = importer.write(imported, args.output, force=args.force)
    except importer.ImportError_ as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in imported.report_lines():
        print(line)
    print(f"# wrote {path} ({params.TAB_LABELS[imported.tab]}, {imported.family})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Without a browser:

    python -m kohya_gui print-command CONFIG.toml   # prints the command Start training would run
    python -m kohya_gui print-command --standalone CONFIG.toml   # the same run, every setting as a flag
    python -m kohya_gui print-command --shell windows CONFIG.toml   # quoted for cmd / PowerShell (default: this OS)
    python -m kohya_gui train CONFIG.toml           # runs it with the GUI's runner (Ctrl+C: stop + save; twice: now)
    python -m kohya_gui prepare-demo CONFIG.toml    # makes a demo preset's tiny model and images (used by runs)
    python -m kohya_gui import KOHYA_SS.json -o OUT.toml   # a kohya_ss GUI configuration as our TOML, with a report
    python -m kohya_gui signal save|sample|stop OUTPUT_DIR_OR_RUN_TOML   # Save now / Sample now / Stop (and save)

print-command and train also take a kohya_ss JSON directly (imported on the fly, the report on stderr).
`python -m kohya_gui ACTION --help` describes each action.
"""

from __future__ import annotations

import argparse
import signal
import sys

from . import command, config_file, demo, importer, params, presets, quoting, run_requests, trainer_check, training
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kohya_gui", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION",
                                help="print-command, train, prepare-demo, import, signal (each has --help)")
    config_help = ("a configuration TOML saved by the GUI, a preset name (demo-sdxl-tiny, "
                   "dreambooth/sdxl-dreambooth-24gb), a kohya_ss GUI JSON (imported on the fly) or an sd-scripts "
                   "TOML (for a kohya_ss run TOML use import)")
    family_help = f"the model family, where the file does not say it ({', '.join(params.FAMILIES)})"
    printing = sub.add_parser("print-command", help="print the command Start training would run, and what the "
                                                    "GUI's Print warns about (on stderr)")
    printing.add_argument("config", help=config_help)
    printing.add_argument("--standalone", action="store_true", help="every setting as a flag instead of --config_file")
    printing.add_argument("--shell", choices=quoting.SHELLS, default=quoting.native_shell(),
                          help="quote for a POSIX shell or for Windows cmd / PowerShell (default: this machine's, "
                               "%(default)s)")
    train = sub.add_parser("train", help="run it with the GUI's runner (Ctrl+C: stop and save; twice: stop now)")
    train.add_argument("config", help=config_help)
    demo_parser = sub.add_parser("prepare-demo", help="make a demo preset's tiny model and images")
    demo_parser.add_argument("config", help=config_help)
    importing = sub.add_parser(
        "import", help="a kohya_ss GUI JSON or a run TOML as our configuration, with a report of every key",
        description="Writes a kohya_ss GUI configuration (JSON, any version) or a run TOML (kohya_ss' "
                    "config_*.toml, sd-scripts' --output_config) as our configuration TOML, which the GUI opens. "
                    "Every key of the file is reported: mapped, converted (with what it became) or dropped (with "
                    "why). Files kohya_ss makes from its form before a run (the inline sample prompts, the fine-tune "
                    "image folder) are written beside OUT. Nothing is overwritten without --force.")
    importing.add_argument("config", help="the kohya_ss JSON or run TOML")
    importing.add_argument("-o", "--output", required=True, help="the TOML to write (e.g. configs/lora/mine.toml)")
    importing.add_argument("--tab", choices=list(params.TABS), help="the tab (default: from the file)")
    importing.add_argument("--force", action="store_true", help="overwrite existing output files")
    for p in (printing, train):
        p.add_argument("--tab", choices=list(params.TABS), help="the tab of a kohya_ss JSON (default: from the file)")
    for p in (printing, train, importing):
        p.add_argument("--family", choices=params.FAMILIES, help=family_help)
    sub.add_parser("signal", help="python -m kohya_gui signal save|sample|stop OUTPUT_DIR_OR_RUN_TOML")
    return parser


def load_config(args) -> config_file.Config:
    """The configuration of print-command / train / prepare-demo: a kohya_ss JSON is imported on the fly (its
    report on stderr); our TOMLs, presets and plain sd-scripts TOMLs are opened."""
    path = presets.resolve(args.config)
    family = getattr(args, "family", None)
    if path.suffix.lower() != ".json":  # ours; a plain sd-scripts TOML opens too (family: the import's rule)
        return config_file.load(path, family=family or "SDXL")
    imported = importer.load(path, getattr(args, "tab", None), family)
    print("\n".join(f"import: {line}" for line in imported.report_lines()), file=sys.stderr)
    for note in imported.notes:
        print(f"note: {note}", file=sys.stderr)
    for name in imported.side_files:
        print(f"import: {name} is not used here (kohya_ss makes that file before a run); `import -o OUT.toml` "
              "writes it beside OUT", file=sys.stderr)
        imported.values[name] = ""
    return config_file.Config(imported.tab, imported.family, imported.values)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["signal"]:
        return send_request(argv[1:])
    args = build_parser().parse_args(argv)
    if args.action == "import":
        return import_file(args)
    try:
        cfg = load_config(args)
    except (config_file.ConfigError, FileNotFoundError, importer.ImportError_) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.action == "print-command":
        # what the GUI's Print shows: the form's own checks, then the trainer's (--validate_only)
        errors = command.validation_errors(cfg.tab, cfg.family, cfg.values)
        errors = errors or trainer_check.problems(cfg.tab, cfg.family, cfg.values)
        build = command.standalone_argv if args.standalone else command.build_argv
        print(command.printable(build(cfg.tab, cfg.family, cfg.values), args.shell))
        for e in errors:
            print(f"warning: {e}", file=sys.stderr)
        if errors:
            print("warning: the command is printed, but a run with these settings stops; fix the above first",
                  file=sys.stderr)
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
    try:
        imported = importer.load(args.config, args.tab, args.family)
        path = importer.write(imported, args.output, force=args.force)
    except importer.ImportError_ as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in imported.report_lines():
        print(line)
    for note in imported.notes:
        print(f"note: {note}")
    for name in imported.side_files:
        print(f"# wrote {imported.values[name]} ({name})")
    print(f"# wrote {path} ({params.TAB_LABELS[imported.tab]}, {imported.family}); open it in the GUI or run "
          f"python -m kohya_gui print-command {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

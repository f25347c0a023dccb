"""Starts the training GUI. Listens on 127.0.0.1:7860 unless told otherwise."""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Kohya-style training GUI (LoRA, DreamBooth, Fine-tune) with torch.compile")
    p.add_argument("--listen", nargs="?", const="0.0.0.0", default="127.0.0.1", metavar="ADDRESS",
                   help="address to listen on; --listen alone means 0.0.0.0 (all networks). Default 127.0.0.1")
    p.add_argument("--server_port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--share", action="store_true", help="also make a public gradio.live link")
    p.add_argument("--inbrowser", action="store_true", help="open the GUI in the browser")
    p.add_argument("--headless", action="store_true",
                   help="for servers: never open a browser, even with --inbrowser (the GUI has no native file "
                        "dialogs; paths are typed)")
    p.add_argument("--username", default="", help="require this user name (with a password)")
    p.add_argument("--password", default="",
                   help="require this password (with --username); other users of the machine can see it in `ps`: "
                        "prefer --password_file or the KOHYA_GUI_PASSWORD environment variable")
    p.add_argument("--password_file", default=None, help="read the password from the first line of this file")
    p.add_argument("--config_dir", default=None,
                   help="where the GUI keeps each tab's last used settings and the run queue (default: "
                        "~/.config/kohya_gui, %%APPDATA%%\\kohya_gui on Windows; everyone using the same account shares "
                        "that folder)")
    args = p.parse_args(argv)
    from kohya_gui.login import PasswordError, password_from

    try:
        # the environment variable applies only with --username (it may be set for other runs)
        args.password = password_from(args.password, args.password_file, os.environ if args.username else {})
    except PasswordError as e:
        p.error(str(e))
    if args.config_dir:  # before anything reads it (kohya_gui.last_settings.folder)
        os.environ["KOHYA_GUI_CONFIG_DIR"] = os.path.abspath(args.config_dir)
    if bool(args.username) != bool(args.password):
        p.error("--username and a password (--password, --password_file or KOHYA_GUI_PASSWORD) go together")
    return args


def exposure_warning(args: argparse.Namespace) -> str | None:
    """The warning printed when the GUI is reachable from other machines without a password."""
    exposed = args.share or args.listen not in LOCAL_HOSTS
    if exposed and not args.password:
        where = "a public share link" if args.share else f"{args.listen}:{args.server_port}"
        return (f"WARNING: the GUI is reachable on {where} without a password. Anyone who can reach it can run "
                "commands as you. Add --username and --password, or listen on 127.0.0.1.")
    return None


def follow_runs(runner) -> None:
    """The GUI notes its active run in its config folder; a run an earlier GUI started (and outlived: it was
    killed) is taken over: shown in the run panel, Stop and Save now work, Start waits for it."""
    from kohya_gui import last_settings

    runner.record = last_settings.folder() / "active_run.json"
    if runner.adopt():
        print(f"A training run started by an earlier GUI is still going (log: {runner.snapshot().log_path}); "
              "the run panel follows it.", file=sys.stderr, flush=True)


def stop_run_on_exit(runner) -> None:
    """A run lives in its own process group (so Stop can end all of it); end it when the GUI ends, too (Ctrl+C,
    SIGTERM, normal exit), rather than leaving an unseen training process behind."""

    def stop_run():
        if runner.running:
            print("The GUI is closing: stopping the training run ...", file=sys.stderr, flush=True)
            runner.stop()

    atexit.register(stop_run)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))  # so atexit handlers run on SIGTERM too


def login_kwargs(username: str, password: str) -> dict:
    """launch() arguments for the login: none without a user name."""
    if not username:
        return {}
    from starlette.middleware import Middleware

    from kohya_gui.login import ClientAddress, Login

    # the wait after wrong passwords is per client address: ClientAddress tells the check who asks
    return {"auth": Login(username, password).check, "app_kwargs": {"middleware": [Middleware(ClientAddress)]}}


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    warning = exposure_warning(args)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    from kohya_gui.ui.actions import RUNNER
    from kohya_gui.ui.app import build_app, launch_kwargs

    from kohya_gui import tensorboard

    tensorboard.HOST["address"] = args.listen  # the TensorBoard button serves where the GUI does
    follow_runs(RUNNER)
    stop_run_on_exit(RUNNER)
    app = build_app()
    from kohya_gui.ui.actions import start_queue_worker

    worker = start_queue_worker()  # runs the queued entries (kept on disk: a restart goes on with them)
    atexit.register(worker.stop)  # runs before stop_run_on_exit's handler: no queued run starts while closing
    app.queue(default_concurrency_limit=4)
    try:
        app.launch(
            server_name=args.listen,
            server_port=args.server_port,
            share=args.share,
            inbrowser=args.inbrowser and not args.headless,
            **login_kwargs(args.username, args.password),
            show_error=True,
            footer_links=["gradio", "settings"],  # no "Use via API": the GUI's events are not a documented API
            **launch_kwargs(),
        )
    except OSError as e:
        if "port" not in str(e).lower():
            raise
        print(f"error: port {args.server_port} on {args.listen} is in use (another GUI or program); "
              "choose another with --server_port", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()

"""Uploading results to the Hugging Face Hub and resuming from a state kept there (kohya-ss/sd-scripts options),
through the `huggingface_hub` package.

    add_huggingface_arguments(parser)   --huggingface_repo_id --huggingface_repo_type --huggingface_path_in_repo
                                        --huggingface_token --huggingface_repo_visibility --save_state_to_huggingface
                                        --resume_from_huggingface --async_upload
    validate_huggingface_args(args)     before any model loads; raises ConfigError
    upload(args, src, dest_name, force_sync=False)   a file or folder; a failed upload is logged, never raised
                                        (the local result stays); --async_upload uploads in a thread
    wait_for_uploads(src=None)          joins the uploads still running (all at the end of training; one before
                                        keep-last-N removes its file)
    resume_state_dir(args) -> str       the local state folder --resume names, downloaded first with
                                        --resume_from_huggingface ("{repo_id}/{path}[:{revision}[:{repo_type}]]")

Every Hub call goes through `make_api(token)` (tests replace it with a fake, nothing touches the network).
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_TYPES = ("model", "dataset", "space")
_pending: list[tuple[str, threading.Thread]] = []  # (local path, upload thread) of --async_upload


def add_huggingface_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--huggingface_repo_id", type=str, default=None,
                        help="Hugging Face repo to upload the saved models to (user/name)")
    parser.add_argument("--huggingface_repo_type", type=str, default=None,
                        help=f"type of that repo: {', '.join(REPO_TYPES)} (default model)")
    parser.add_argument("--huggingface_path_in_repo", type=str, default=None,
                        help="folder in the repo the files go to (default: the repo's top level)")
    parser.add_argument("--huggingface_token", type=str, default=None,
                        help="Hugging Face token (default: the one huggingface_hub has stored)")
    parser.add_argument("--huggingface_repo_visibility", type=str, default=None,
                        help="'public' makes a new repo public; anything else (default) private")
    parser.add_argument("--save_state_to_huggingface", action="store_true",
                        help="also upload the --save_state folders")
    parser.add_argument("--resume_from_huggingface", action="store_true",
                        help="--resume names a state in a Hub repo: {repo_id}/{path_in_repo}:{revision}:{repo_type}")
    parser.add_argument("--async_upload", action="store_true",
                        help="upload in the background while training goes on (the final model is uploaded "
                             "before the run ends)")


def validate_huggingface_args(args) -> None:
    from library.errors import ConfigError

    repo_type = getattr(args, "huggingface_repo_type", None)
    if repo_type is not None and repo_type not in REPO_TYPES:
        raise ConfigError(f"--huggingface_repo_type {repo_type!r} is not allowed; allowed values: "
                          f"{', '.join(REPO_TYPES)}")
    if getattr(args, "save_state_to_huggingface", False) and not args.huggingface_repo_id:
        raise ConfigError("--save_state_to_huggingface needs --huggingface_repo_id (the repo to upload to)")
    if getattr(args, "resume_from_huggingface", False):
        if not args.resume:
            raise ConfigError("--resume_from_huggingface needs --resume {repo_id}/{path_in_repo}[:{revision}"
                              "[:{repo_type}]]")
        parse_hub_state(args.resume)


def make_api(token: str | None):
    from huggingface_hub import HfApi

    return HfApi(token=token)


def _path_in_repo(args, dest_name: str) -> str:
    """`--huggingface_path_in_repo` + "/" + the file or folder name. Without it the name itself (upstream
    would pass None: an upload_file error, and a folder's contents spread over the repo's top level)."""
    base = args.huggingface_path_in_repo
    return f"{base.rstrip('/')}/{dest_name}" if base else dest_name


def _ensure_repo(api, args) -> None:
    repo_id, repo_type = args.huggingface_repo_id, args.huggingface_repo_type
    try:
        api.repo_info(repo_id=repo_id, repo_type=repo_type)
        return
    except Exception:  # noqa: BLE001 - missing repo or no access: try to create it
        pass
    private = args.huggingface_repo_visibility != "public"
    try:
        api.create_repo(repo_id=repo_id, repo_type=repo_type, private=private)
        logger.info("created %s Hugging Face repo %s", "private" if private else "public", repo_id)
    except Exception as e:  # noqa: BLE001 - the upload below reports what is wrong
        logger.error("failed to create the Hugging Face repo %s: %s", repo_id, e)


def upload(args, src: str | os.PathLike, dest_name: str, force_sync: bool = False) -> threading.Thread | None:
    """Uploads a saved file or folder to --huggingface_repo_id (no-op without it). Errors are logged and the
    local copy is kept; with --async_upload (unless force_sync) it runs in a thread, which is returned."""
    if not getattr(args, "huggingface_repo_id", None):
        return None
    src = os.fspath(src)
    path_in_repo = _path_in_repo(args, dest_name)
    api = make_api(args.huggingface_token)

    def run() -> None:
        try:
            _ensure_repo(api, args)
            if os.path.isdir(src):
                api.upload_folder(repo_id=args.huggingface_repo_id, repo_type=args.huggingface_repo_type,
                                  folder_path=src, path_in_repo=path_in_repo)
            else:
                api.upload_file(repo_id=args.huggingface_repo_id, repo_type=args.huggingface_repo_type,
                                path_or_fileobj=src, path_in_repo=path_in_repo)
            logger.info("uploaded %s to %s/%s", src, args.huggingface_repo_id, path_in_repo)
        except Exception as e:  # noqa: BLE001 - an upload never ends the training; the local file stays
            logger.error("failed to upload %s to Hugging Face (%s/%s): %s; the local copy is kept", src,
                         args.huggingface_repo_id, path_in_repo, e)

    if getattr(args, "async_upload", False) and not force_sync:
        thread = threading.Thread(target=run, name=f"upload {dest_name}")
        thread.start()
        _pending.append((src, thread))
        return thread
    run()
    return None


def wait_for_uploads(src: str | os.PathLike | None = None) -> None:
    """Joins the background uploads (only those of `src`: a save about to be removed must finish uploading)."""
    src = None if src is None else os.fspath(src)
    for item in [p for p in _pending if src is None or p[0] == src]:
        path, thread = item
        if thread.is_alive():
            logger.info("waiting for the upload of %s", path)
        thread.join()
        _pending.remove(item)


def parse_hub_state(resume: str) -> tuple[str, str, str | None, str | None]:
    """'{owner}/{name}/{path...}[:{revision}[:{repo_type}]]' -> (repo_id, path_in_repo, revision, repo_type).
    As upstream: with a revision and no type the type is "model"."""
    from library.errors import ConfigError

    parts = resume.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ConfigError(f"--resume {resume!r} with --resume_from_huggingface must be "
                          "{repo_id}/{path_in_repo}[:{revision}[:{repo_type}]]")
    rest = "/".join(parts[2:])
    revision = repo_type = None
    if ":" in parts[1] and not rest:  # owner/name:revision (a state at the repo's top level)
        name, _, tail = parts[1].partition(":")
        parts[1], rest = name, ":" + tail
    if ":" in rest:
        pieces = rest.split(":")
        if len(pieces) == 2:
            rest, revision, repo_type = pieces[0], pieces[1], "model"
        elif len(pieces) == 3:
            rest, revision, repo_type = pieces
        else:
            raise ConfigError(f"--resume {resume!r}: too many ':' (expected path:revision:repo_type)")
        revision = revision or None
        repo_type = repo_type or None
    if repo_type is not None and repo_type not in REPO_TYPES:
        raise ConfigError(f"--resume {resume!r}: repo type {repo_type!r} is not allowed; allowed values: "
                          f"{', '.join(REPO_TYPES)}")
    return f"{parts[0]}/{parts[1]}", rest.strip("/"), revision, repo_type


def resume_state_dir(args) -> str:
    """The local folder to load the state from: --resume itself, or (--resume_from_huggingface) the Hub state
    downloaded into the huggingface_hub cache."""
    if not getattr(args, "resume_from_huggingface", False):
        return args.resume
    from library.errors import TrainingError

    repo_id, path_in_repo, revision, repo_type = parse_hub_state(args.resume)
    logger.info("downloading the state %s from Hugging Face repo %s (revision %s)", path_in_repo or "/", repo_id,
                revision or "main")
    api = make_api(args.huggingface_token)
    prefix = path_in_repo + "/" if path_in_repo else ""
    try:
        files = [f for f in api.list_repo_files(repo_id=repo_id, revision=revision, repo_type=repo_type)
                 if f.startswith(prefix)]
        if not files:
            raise TrainingError(f"--resume {args.resume}: no files under {path_in_repo or 'the top level'} of "
                                f"{repo_id} (revision {revision or 'main'})")
        local = [api.hf_hub_download(repo_id=repo_id, filename=f, revision=revision, repo_type=repo_type)
                 for f in files]
    except TrainingError:
        raise
    except Exception as e:  # noqa: BLE001 - network / auth / missing repo
        raise TrainingError(f"--resume {args.resume}: cannot download the state from Hugging Face: {e}") from e
    # every file sits in the cache at <snapshot>/<its path in the repo>
    first, name = Path(local[0]), files[0]
    snapshot = Path(str(first)[: len(str(first)) - len(name)]) if str(first).endswith(name) else first.parent
    return str(snapshot / path_in_repo) if path_in_repo else str(snapshot)

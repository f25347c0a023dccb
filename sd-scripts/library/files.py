"""The one atomic writer: every result file or folder of a run is written through `atomic_target`.

    atomic_target(path, overwrite=True)     yields `<dir>/.<name>.tmp-<hex>/<name>` to write (a file or a folder);
                                            renamed to `path` when the block completes, removed when it fails
    write_bytes / write_text(path, ...)     small files (run TOML, JSON)
    save_safetensors(tensors, path, metadata, overwrite) / save_torch(obj, path, overwrite)
    ensure_can_write(path, overwrite)       OutputExistsError for an existing result without --overwrite_output
    remove_stale(folder, ours)              what killed writers of results named like `ours` left there
    explained_write_errors(path)            a write the disk refused -> SaveError naming the file, one line

One temporary-name scheme: the hidden folder `.<name>.tmp-<hex>` beside the result. Writers that make their own
temporary files (safetensors writes `.tmpXXXXXX` and renames it) make them inside that folder, so a kill at any
moment leaves only names that `remove_stale` knows. A folder that replaces an existing one moves the old one into
the hidden folder first; a kill between the two renames leaves it there, and `remove_stale` puts it back.
Results get the mode the umask gives (safetensors' own temporary files are 0600).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil

from library.errors import OutputExistsError, SaveError, UserError

_TMP = ".tmp-"
_PREVIOUS = "previous"  # inside the hidden folder: the folder being replaced, until the new one is in place
_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_LOW_SPACE = 1 << 20  # a failed write with less free space than this was a full disk


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()


def ensure_can_write(path: str | os.PathLike, overwrite: bool) -> None:
    if os.path.exists(path) and not overwrite:
        raise OutputExistsError(f"{path} already exists; choose another --output_name / --output_dir, "
                                "or pass --overwrite_output to replace it")


def work_folder(path: str | os.PathLike, *, shared: bool = False) -> str:
    """The hidden folder beside `path` for writing it: `.<name>.tmp-<pid><random hex>`, or `.<name>.tmp-0` when
    several processes write into it (accelerate's save_state)."""
    d, name = os.path.split(os.path.normpath(os.fspath(path)))
    token = "0" if shared else f"{os.getpid():x}{secrets.token_hex(4)}"
    return os.path.join(d, f".{name}{_TMP}{token}")


@contextlib.contextmanager
def atomic_target(path: str | os.PathLike, *, overwrite: bool = True):
    """Yields the temporary path to write `path` to (same name and extension, inside the hidden work folder).
    When the block completes the result is renamed to `path` (an existing file or folder is replaced only then);
    when it fails nothing but the earlier results remains, and a disk that refused the write is a SaveError."""
    path = os.path.normpath(os.fspath(path))
    ensure_can_write(path, overwrite)
    with explained_write_errors(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        work = work_folder(path)
        os.mkdir(work)
        try:
            tmp = os.path.join(work, os.path.basename(path))
            try:
                yield tmp
            except BaseException as e:
                _raise_explained(path, e, work)
                raise
            commit(tmp, path, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)


def commit(tmp: str, path: str, work: str) -> None:
    """The complete result `tmp` (inside `work`) becomes `path`, with the umask's mode."""
    _use_umask(tmp)
    if os.path.isdir(tmp) and os.path.isdir(path):  # a folder cannot be renamed over a non-empty one
        os.replace(path, os.path.join(work, _PREVIOUS))
    os.replace(tmp, path)


def _use_umask(tmp: str) -> None:
    files = [tmp] if not os.path.isdir(tmp) else [os.path.join(d, f) for d, _, fs in os.walk(tmp) for f in fs]
    for f in files:
        if os.stat(f).st_mode & 0o777 != FILE_MODE:
            os.chmod(f, FILE_MODE)


def write_bytes(path: str | os.PathLike, data: bytes, *, overwrite: bool = True) -> None:
    with atomic_target(path, overwrite=overwrite) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_text(path: str | os.PathLike, text: str, *, overwrite: bool = True) -> None:
    write_bytes(path, text.encode("utf-8"), overwrite=overwrite)


def save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None, *,
                     overwrite: bool = False) -> None:
    """`tensors` as a .safetensors file (made contiguous); an existing file needs overwrite=True."""
    from safetensors.torch import save_file

    with atomic_target(path, overwrite=overwrite) as tmp:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)


def save_torch(obj, path: str | os.PathLike, *, overwrite: bool = False) -> None:
    import torch

    with atomic_target(path, overwrite=overwrite) as tmp:
        torch.save(obj, tmp)


# ----------------------------------------------------------------------------------------------------------
# what killed writers left


_WORK = re.compile(r"\.(.+)" + re.escape(_TMP) + r"[0-9a-f]+")


def remove_stale(folder: str | os.PathLike, ours: re.Pattern) -> list[str]:
    """Removes the work folders that killed writers of results named like `ours` (a pattern of the final names)
    left in `folder` (call it before the run writes anything); a folder that was being replaced when the kill
    came is put back. Returns what was removed."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return []
    removed = []
    for entry in sorted(os.listdir(folder)):
        found = _WORK.fullmatch(entry)
        if not found or not ours.fullmatch(found.group(1)):
            continue
        work = os.path.join(folder, entry)
        final = os.path.join(folder, found.group(1))
        previous = os.path.join(work, _PREVIOUS)
        if os.path.isdir(previous) and not os.path.exists(final):
            os.replace(previous, final)  # killed between the two renames of commit: the complete old folder
        if os.path.isdir(work):
            shutil.rmtree(work, ignore_errors=True)
        else:
            os.remove(work)
        removed.append(work)
    return removed


# ----------------------------------------------------------------------------------------------------------
# a disk that refuses a write


@contextlib.contextmanager
def explained_write_errors(path: str | os.PathLike):
    """OSError (no space, read-only, no permission), safetensors' SafetensorError and torch's failed-write
    RuntimeErrors inside the block become one SaveError naming `path`."""
    try:
        yield
    except BaseException as e:
        _raise_explained(os.fspath(path), e, os.path.dirname(os.fspath(path)) or ".")
        raise


def _raise_explained(path: str, e: BaseException, where: str) -> None:
    reason = write_failure(e, where)
    if reason is not None:
        hint = " (free some space, or choose another --output_dir)" if reason == os.strerror(errno.ENOSPC) else ""
        raise SaveError(f"cannot save {path}: {reason}{hint}; the earlier saves in "
                        f"{os.path.dirname(path) or '.'} are kept") from e


def write_failure(e: BaseException, where: str) -> str | None:
    """Why a write failed, as one line, or None for an error that is not the disk's (a bug, an interrupt)."""
    if isinstance(e, (UserError, KeyboardInterrupt, SystemExit)) or not isinstance(e, Exception):
        return None
    message = str(e)
    code = e.errno if isinstance(e, OSError) else None
    if type(e).__name__ == "SafetensorError" and "I/O error" in message:  # "... I/O error: <text> (os error N)"
        found = re.search(r"\(os error (\d+)\)", message)
        code = int(found.group(1)) if found else None
        message = re.sub(r" \(os error \d+\)", "", message.split("I/O error: ", 1)[-1])
        if code not in _FULL:
            return message
    if code in _FULL or _free_bytes(where) < _LOW_SPACE:
        return os.strerror(errno.ENOSPC)
    if isinstance(e, OSError):
        return e.strerror or message
    if isinstance(e, RuntimeError) and re.search(r"basic_ios|inline_container|PytorchStreamWriter|file write failed",
                                                 message):
        return f"the write failed ({message.strip().splitlines()[0]})"
    return None


def _free_bytes(where: str) -> int:
    try:
        st = os.statvfs(where)
    except (OSError, AttributeError):  # gone, or Windows (no statvfs): not known to be full
        return _LOW_SPACE
    return st.f_bavail * st.f_frsize

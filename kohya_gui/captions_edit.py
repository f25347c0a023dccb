"""The caption editor of the Utilities tab: a folder's images with their caption files, one caption edited and
saved at a time, and find/replace of a tag across the folder.

Nothing is lost without the user's choice: captions are written through a temporary file and a rename, and a
find/replace first copies every file it changes into a backup (`<user config>/kohya_gui/caption_backups/<time>/`,
with a manifest), which `undo_replace` puts back."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from . import last_settings
from .config_file import write_text_atomic

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")  # the trainers' (sd-scripts library.dataset_files)


class CaptionError(ValueError):
    """Bad caption-editor input: the message names the field or file."""


def list_images(folder: str | os.PathLike, recursive: bool = False) -> list[Path]:
    """The folder's images, sorted, hidden files and folders skipped."""
    root = Path(folder or "").expanduser()
    if not str(folder or "").strip():
        raise CaptionError("Image folder: enter a folder")
    if not root.is_dir():
        raise CaptionError(f"Image folder: {root} is not a folder")
    pattern = root.rglob("*") if recursive else root.iterdir()
    return sorted(p for p in pattern if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def caption_extension(ext: str) -> str:
    ext = (ext or "").strip() or ".txt"
    return ext if ext.startswith(".") else "." + ext


def caption_path(image: str | os.PathLike, ext: str = ".txt") -> Path:
    return Path(image).with_suffix(caption_extension(ext))


def read_caption(image: str | os.PathLike, ext: str = ".txt") -> str:
    path = caption_path(image, ext)
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def write_caption(image: str | os.PathLike, ext: str, text: str) -> Path:
    path = caption_path(image, ext)
    write_text_atomic(path, text)
    return path


def preview(folder: str, ext: str = ".txt", count: int = 8) -> list[tuple[str, str]]:
    """(image path, caption) of the folder's first `count` images, for a gallery."""
    return [(str(p), read_caption(p, ext) or "(no caption)") for p in list_images(folder)[:count]]


# ---- find / replace -------------------------------------------------------------------------------------------

def split_tags(line: str) -> list[str]:
    return [t.strip() for t in line.split(",") if t.strip()]


def replace_in_caption(text: str, find: str, replace: str, whole_tag: bool = True) -> tuple[str, int]:
    """(new text, number of replacements). whole_tag: `find` is a comma-separated tag, matched whole (spaces around
    it ignored), and `replace` (empty: remove the tag; "a, b": two tags) takes its place; else plain text."""
    if not whole_tag:
        return text.replace(find, replace), text.count(find)
    find, new_tags = find.strip(), split_tags(replace)
    count, lines = 0, []
    for line in text.split("\n"):
        tags = split_tags(line)
        if find not in tags:
            lines.append(line)
            continue
        out = []
        for tag in tags:
            if tag == find:
                count += 1
                out += new_tags
            else:
                out.append(tag)
        lines.append(", ".join(out))
    return "\n".join(lines), count


@dataclass
class ReplaceReport:
    files: int  # caption files looked at
    changed: list[Path]  # caption files that change (or changed)
    replacements: int
    backup: Path | None = None  # where the originals were copied (apply=True)


def backups_folder() -> Path:
    return last_settings.folder() / "caption_backups"


def find_replace(folder: str, ext: str, find: str, replace: str, *, whole_tag: bool = True, recursive: bool = False,
                 apply: bool = False) -> ReplaceReport:
    """Counts (apply=False) or makes (apply=True) the replacement in every caption file of the folder. Before
    anything is written, the files that change are copied to a new backup folder."""
    if not (find or "").strip():
        raise CaptionError("Find: enter the tag or text to find")
    captions = [caption_path(p, ext) for p in list_images(folder, recursive)]
    captions = [c for c in captions if c.is_file()]
    changes, total = [], 0
    for path in captions:
        old = path.read_text(encoding="utf-8")
        new, n = replace_in_caption(old, find, replace, whole_tag)
        if n and new != old:
            changes.append((path, new))
            total += n
    report = ReplaceReport(len(captions), [p for p, _ in changes], total)
    if not apply or not changes:
        return report
    backup = backups_folder() / time.strftime("%Y%m%d-%H%M%S")
    backup = Path(f"{backup}-{os.getpid()}-{time.monotonic_ns() % 10**6}")
    backup.mkdir(parents=True)
    manifest = {}
    for i, (path, _) in enumerate(changes):
        copy = backup / f"{i:06d}{path.suffix}"
        shutil.copy2(path, copy)
        manifest[copy.name] = str(path.resolve())
    (backup / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    for path, new in changes:
        write_text_atomic(path, new)
    report.backup = backup
    return report


def undo_replace(backup: str | os.PathLike) -> int:
    """Puts back the caption files a find/replace changed (from its backup folder). Returns how many."""
    backup = Path(backup)
    manifest_path = backup / "manifest.json"
    if not manifest_path.is_file():
        raise CaptionError(f"No find/replace backup at {backup}")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    for name, original in manifest.items():
        write_text_atomic(Path(original), (backup / name).read_text(encoding="utf-8"))
    return len(manifest)


def tag_counts(folder: str, ext: str = ".txt", recursive: bool = False) -> list[tuple[str, int]]:
    """Each tag of the folder's captions with the number of files that have it, most frequent first."""
    counts: dict[str, int] = {}
    for image in list_images(folder, recursive):
        tags = {t for line in read_caption(image, ext).split("\n") for t in split_tags(line)}
        for tag in tags:
            counts[tag] = counts.get(tag, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))

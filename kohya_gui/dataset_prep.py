"""Dataset preparation of the Utilities tab: kohya's folder layout, where the trainers read the repeats from the
subfolder names (`<root>/img/<N>_<name>/`, `<root>/reg/<N>_<class>/`: N = repeats), built by copying a source
folder's images and their caption files; and balancing, which renames the `N_name` subfolders of a training folder
so every concept brings about the same number of images per epoch. Nothing is overwritten or deleted."""

from __future__ import annotations

import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .captions_edit import IMAGE_EXTENSIONS, CaptionError, list_images

CAPTION_EXTENSIONS = (".txt", ".caption")  # copied along with each image (same file name)
REPEATS_FOLDER = re.compile(r"^(\d+)_(.+)$")


class PrepError(ValueError):
    """Bad input to the folder builder or balancing; the message names the field."""


@dataclass
class Built:
    folder: Path  # the new N_name folder
    images: int
    captions: int


def _check_name(name: str, field: str) -> str:
    name = (name or "").strip()
    if not name:
        raise PrepError(f"{field}: enter a name (the trainers read it as the class tokens)")
    if any(c in name for c in "/\\") or name in (".", ".."):
        raise PrepError(f"{field}: {name!r} must be a folder name, without / or \\")
    return name


def whole_number(repeats, field: str) -> int:
    """A whole number of at least 1 (repeats, batch size), else PrepError naming the field."""
    try:
        number = float(repeats)
    except (TypeError, ValueError):
        number = 0.5
    if number != int(number) or number < 1:
        raise PrepError(f"{field}: expected a whole number of at least 1, got {repeats!r}")
    return int(number)


def copy_concept(source: str, root: str, kind: str, name: str, repeats: int) -> Built:
    """Copies source's images and caption files into <root>/<kind>/<repeats>_<name>/ (kind: img or reg). Refuses
    a target folder that exists and is not empty, and a source without images."""
    field = "Regularisation" if kind == "reg" else "Images"
    name = _check_name(name, f"{field} name")
    repeats = whole_number(repeats, f"{field} repeats")
    try:
        images = list_images(source)
    except CaptionError as e:
        raise PrepError(f"{field} source folder: {str(e).split(': ', 1)[1]}") from None
    if not images:
        raise PrepError(f"{field} source folder: no images ({', '.join(IMAGE_EXTENSIONS)}) in {source}")
    target = Path(root).expanduser() / kind / f"{repeats}_{name}"
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise PrepError(f"{target} already exists and is not empty; nothing was copied (choose another name or "
                        "destination)")
    if Path(source).resolve() == target.resolve():
        raise PrepError(f"{field} source folder and the target {target} are the same folder")
    target.mkdir(parents=True, exist_ok=True)
    captions = 0
    for image in images:
        shutil.copy2(image, target / image.name)
        for ext in CAPTION_EXTENSIONS:
            caption = image.with_suffix(ext)
            if caption.is_file():
                shutil.copy2(caption, target / caption.name)
                captions += 1
    return Built(target, len(images), captions)


def build(root: str, source: str, name: str, repeats, reg_source: str = "", reg_name: str = "",
          reg_repeats=1) -> list[Built]:
    """The training folder layout: <root>/img/<repeats>_<name>/ from `source` and, when `reg_source` is given,
    <root>/reg/<reg_repeats>_<reg_name>/ from it. Everything is checked before anything is copied."""
    if not (root or "").strip():
        raise PrepError("Destination folder: enter the folder to build the dataset in")
    _check_name(name, "Images name")
    whole_number(repeats, "Images repeats")
    if (reg_source or "").strip():
        _check_name(reg_name, "Regularisation name")
        whole_number(reg_repeats, "Regularisation repeats")
        for target in (Path(root) / "img" / f"{int(repeats)}_{name.strip()}",
                       Path(root) / "reg" / f"{int(reg_repeats)}_{reg_name.strip()}"):
            if target.exists() and any(target.iterdir()):
                raise PrepError(f"{target} already exists and is not empty; nothing was copied")
    built = [copy_concept(source, root, "img", name, repeats)]
    if (reg_source or "").strip():
        built.append(copy_concept(reg_source, root, "reg", reg_name, reg_repeats))
    return built


# ---- balancing -------------------------------------------------------------------------------------------------

@dataclass
class Rename:
    old: Path
    new: Path
    images: int

    @property
    def repeats(self) -> int:
        return int(REPEATS_FOLDER.match(self.new.name).group(1))


def balance_plan(train_dir: str, images_per_epoch) -> list[Rename]:
    """For each `N_name` subfolder: repeats = round(images_per_epoch / its image count), at least 1 (kohya_ss'
    dataset balancing). Refuses folders without images and names that would collide."""
    target = whole_number(images_per_epoch, "Images per concept per epoch")
    root = Path(train_dir or "").expanduser()
    if not str(train_dir or "").strip() or not root.is_dir():
        raise PrepError(f"Training image folder: {train_dir!r} is not a folder")
    plan = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        m = REPEATS_FOLDER.match(sub.name)
        if not m:
            continue
        count = len(list_images(sub))
        if count == 0:
            continue
        repeats = max(1, math.floor(target / count + 0.5))
        plan.append(Rename(sub, sub.with_name(f"{repeats}_{m.group(2)}"), count))
    if not plan:
        raise PrepError(f"Training image folder: no N_name subfolders with images in {root}")
    news = [r.new.name for r in plan]
    for r in plan:
        if news.count(r.new.name) > 1 or (r.new != r.old and r.new.exists()):
            raise PrepError(f"{r.old.name} would become {r.new.name}, which already exists; nothing was renamed")
    return plan


def balance(train_dir: str, images_per_epoch) -> list[Rename]:
    """Renames the subfolders as balance_plan says (a folder already right keeps its name)."""
    plan = balance_plan(train_dir, images_per_epoch)
    for r in plan:
        if r.new != r.old:
            os.rename(r.old, r.new)
    return plan

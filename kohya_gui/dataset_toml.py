"""The dataset TOML editor of the Utilities tab: upstream's dataset config (`--dataset_config`: [general],
[[datasets]] with resolution / batch size, [[datasets.subsets]] with image_dir, num_repeats ...). The TOML text is
the document (edited as text, comments kept: tomlkit); the helpers here add a subset to the dataset of its
resolution and batch size, make one from a kohya `N_name` training folder, summarise it with image counts, and ask
a trainer whether it can train on it (`<trainer> --dataset_config FILE --validate_only`, through its command line:
the GUI never imports sd-scripts)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError

from . import REPO, config_file
from .runner import run_env
from .captions_edit import CaptionError, list_images
from .dataset_prep import REPEATS_FOLDER, PrepError, whole_number

# which trainer checks the file (its family's LoRA script: the dataset rules are the same for every script)
CHECK_SCRIPTS = {"SD1.x": ("train_network.py", "networks.lora"), "SD2.x": ("train_network.py", "networks.lora"),
                 "SDXL": ("sdxl_train_network.py", "networks.lora"),
                 "FLUX.1": ("flux_train_network.py", "networks.lora_flux")}
CHECK_TIMEOUT_S = 180
# the trainer's problems that are not the dataset's: no model is named for the check
NOT_DATASET = tuple(f"--{flag}" for flag in ("pretrained_model_name_or_path", "clip_l", "t5xxl", "ae"))
TEMPLATE = """[general]
shuffle_caption = true
caption_extension = ".txt"
"""


class DatasetTomlError(ValueError):
    """A dataset TOML that cannot be read or written; the message names the file or field."""


def parse(text: str) -> tomlkit.TOMLDocument:
    try:
        return tomlkit.parse(text or "")
    except TOMLKitError as e:
        raise DatasetTomlError(f"The dataset TOML is not valid TOML: {e}") from None


def _resolution(value) -> int | list[int]:
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value).strip().replace("x", ",")
    try:
        parts = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 64:
        raise DatasetTomlError(f"Resolution: expected one size or width,height of at least 64, got {value!r}")
    return parts[0] if len(parts) == 1 else parts


def _positive(value, field: str) -> int:
    try:
        return whole_number(value, field)
    except PrepError as e:
        raise DatasetTomlError(str(e)) from None


def add_subset(text: str, image_dir: str, num_repeats=1, resolution=1024, batch_size=1, class_tokens: str = "",
               is_reg: bool = False, caption_extension: str = "") -> str:
    """The text with a subset added to the [[datasets]] entry of this resolution and batch size (a new entry when
    there is none); everything else in the text stays as it was."""
    if not (image_dir or "").strip():
        raise DatasetTomlError("Image folder (image_dir): enter the subset's image folder")
    doc = parse(text)
    reso, batch = _resolution(resolution), _positive(batch_size, "Batch size")
    subset = tomlkit.table()
    subset["image_dir"] = image_dir.strip()
    subset["num_repeats"] = _positive(num_repeats, "Repeats (num_repeats)")
    if (class_tokens or "").strip():
        subset["class_tokens"] = class_tokens.strip()
    if is_reg:
        subset["is_reg"] = True
    if (caption_extension or "").strip():
        subset["caption_extension"] = caption_extension.strip()
    datasets = doc.get("datasets")
    if datasets is None:
        datasets = tomlkit.aot()
        doc["datasets"] = datasets
    target = next((d for d in datasets if _same(d.get("resolution"), reso) and d.get("batch_size", 1) == batch),
                  None)
    if target is None:
        target = tomlkit.table()
        target["resolution"] = reso
        target["batch_size"] = batch
        target["subsets"] = tomlkit.aot()
        datasets.append(target)
    target.setdefault("subsets", tomlkit.aot()).append(subset)
    return tomlkit.dumps(doc)


def _same(a, b) -> bool:
    def pair(v):
        return [int(v), int(v)] if isinstance(v, int) else [int(x) for x in v]
    try:
        return a is not None and pair(a) == pair(b)
    except (TypeError, ValueError):
        return False


def from_folders(train_dir: str, reg_dir: str = "", resolution=1024, batch_size=1, text: str = "") -> str:
    """Adds one subset per `N_name` subfolder of the training folder (and of the regularisation folder, as
    is_reg), with num_repeats = N and class_tokens = name, as the trainers read such folders."""
    added = 0
    for folder, is_reg in ((train_dir, False), (reg_dir, True)):
        if not (folder or "").strip():
            continue
        root = Path(folder).expanduser()
        if not root.is_dir():
            raise DatasetTomlError(f"{'Regularisation' if is_reg else 'Training image'} folder: {folder} is not a "
                                   "folder")
        for sub in sorted(p for p in root.iterdir() if p.is_dir()):
            m = REPEATS_FOLDER.match(sub.name)
            if m:
                text = add_subset(text or TEMPLATE, str(sub), int(m.group(1)), resolution, batch_size,
                                  m.group(2), is_reg)
                added += 1
    if not added:
        raise DatasetTomlError(f"Training image folder: no N_name subfolders (N = repeats) in {train_dir}")
    return text


def summary(text: str, base_dir: str | None = None) -> list[list]:
    """One row per subset: dataset #, resolution, batch size, image folder, repeats, regularisation, images found
    (relative folders: from the current folder, else from base_dir, as the trainers resolve them)."""
    doc = parse(text).unwrap()
    general = doc.get("general", {})
    rows = []
    for i, ds in enumerate(doc.get("datasets", []), 1):
        reso = ds.get("resolution", general.get("resolution", ""))
        for sub in ds.get("subsets", []):
            image_dir = sub.get("image_dir", sub.get("metadata_file", ""))
            path = Path(image_dir).expanduser()
            if not path.is_absolute() and not path.exists() and base_dir:
                path = Path(base_dir) / path
            try:
                found = len(list_images(path)) if sub.get("image_dir") else ""
            except CaptionError:
                found = "folder not found"
            rows.append([i, "x".join(map(str, reso)) if isinstance(reso, list) else reso,
                         ds.get("batch_size", general.get("batch_size", 1)), image_dir,
                         sub.get("num_repeats", general.get("num_repeats", 1)), bool(sub.get("is_reg", False)),
                         found])
    return rows


def open_file(path: str) -> str:
    path = (path or "").strip()
    if not path:
        raise DatasetTomlError("Dataset TOML file: enter a path")
    if not Path(path).is_file():
        raise DatasetTomlError(f"Dataset TOML file: {path} does not exist")
    text = Path(path).read_text(encoding="utf-8")
    parse(text)
    return text


def save_file(path: str, text: str, overwrite: bool = True) -> Path:
    """Writes the text (checked to be TOML) through a temporary file; overwrite=False never replaces a file."""
    path = (path or "").strip()
    if not path:
        raise DatasetTomlError("Dataset TOML file: enter a path (e.g. datasets/my-dataset.toml)")
    parse(text)
    target = Path(path if path.endswith(".toml") else path + ".toml")
    if not overwrite and target.exists():
        raise DatasetTomlError(f"{target} already exists; Save as never overwrites, choose a new name")
    target.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text_atomic(target, text)
    return target


def check(text: str, family: str = "SDXL", path: str = "") -> tuple[bool, list[str]]:
    """(ok, lines): the trainer's verdict on this dataset config (`--validate_only`: it builds the datasets, counts
    images and buckets, checks every key). The text is checked as it is on screen: written to a temporary file in
    the folder of `path` (relative image folders resolve from there, as for the saved file)."""
    parse(text)
    script, module = CHECK_SCRIPTS.get(family, (None, None))
    if script is None:
        raise DatasetTomlError(f"Family: {family!r} is not one of {', '.join(CHECK_SCRIPTS)}")
    folder = Path(path).expanduser().parent if (path or "").strip() else Path.cwd()
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kohya_gui_dataset_check_") as out, \
            tempfile.NamedTemporaryFile("w", suffix=".toml", prefix=".dataset-check-", dir=folder, delete=False,
                                        encoding="utf-8") as f:
        f.write(text)
        f.close()
        argv = [sys.executable, str(REPO / "sd-scripts" / script), "--dataset_config", f.name, "--output_dir", out,
                "--network_module", module, "--validate_only"]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, env=run_env(),
                                  cwd=os.getcwd())
        except subprocess.TimeoutExpired:
            return False, [f"the trainer's check did not answer within {CHECK_TIMEOUT_S} s"]
        finally:
            os.unlink(f.name)
    lines = [ln.replace(f.name, "<the dataset TOML>") for ln in (proc.stdout + proc.stderr).splitlines()]
    found = [ln.split(": ", 1)[-1] for ln in lines if "library.datasets" in ln]  # images, repeats, buckets
    problems = [ln[2:] for ln in lines if ln.startswith("- ") and not ln[2:].startswith(NOT_DATASET)]
    if proc.returncode == 0 or (not problems and any(ln.startswith("- ") for ln in lines)):
        return True, found
    problems = problems or [ln for ln in lines if "error" in ln.lower()]
    return False, list(dict.fromkeys(problems)) or lines[-5:]  # the trainer logs and prints each problem

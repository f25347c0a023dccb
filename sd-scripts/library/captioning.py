"""What the captioning and dataset tools of `sd-scripts/finetune/` share: finding the images, the rule for caption
files that already exist, images that will not open (skipped with their name, the run goes on), batches through a
DataLoader, the device, optional packages named by their install extra, and the command-line wrapper (bad input =
one line, exit 2; `--dump_options` for the GUI).

torch is imported only where a batch loader or a device is asked for, so the metadata tools start fast.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from typing import Callable, Iterable, Iterator, Optional

from library import files
from library.dataset_files import DatasetError, list_images
from library.errors import UserError

logger = logging.getLogger(__name__)

EXTRA = "captioning"  # pyproject's install extra with the tools' optional packages


class ToolError(UserError):
    """Bad input or a missing package: the script prints the message as one line and exits 2."""


def require(module: str, package: Optional[str] = None, what: str = "this tool"):
    """Imports an optional package, or raises ToolError naming the package and the install extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = package or module
        raise ToolError(f"{what} needs the '{package}' package, which is not installed ({e}): pip install "
                        f"'{package}' (or the project's '{EXTRA}' extra: pip install -e '.[{EXTRA}]')") from e


# ----------------------------------------------------------------------------- images and caption files


def find_images(train_data_dir: str, recursive: bool) -> list[str]:
    try:
        images = list_images(train_data_dir, recursive=recursive)
    except DatasetError as e:
        raise ToolError(f"train_data_dir: {e}") from e
    if not images:
        hint = "" if recursive else " (add --recursive to look in subfolders)"
        raise ToolError(f"train_data_dir: no images (.png .jpg .jpeg .webp .bmp) in {train_data_dir}{hint}")
    logger.info("found %d images in %s", len(images), train_data_dir)
    return images


def caption_path(image_path: str, caption_extension: str) -> str:
    ext = caption_extension if caption_extension.startswith(".") else "." + caption_extension
    return os.path.splitext(image_path)[0] + ext


def add_existing_caption_arguments(parser: argparse.ArgumentParser) -> None:
    """Our own choice for caption files that exist already (upstream replaces them without a word)."""
    parser.add_argument("--overwrite", action="store_true",
                        help="replace caption files that exist already (without this or --skip_existing the tool "
                             "stops before captioning when one exists)")
    parser.add_argument("--skip_existing", action="store_true",
                        help="leave images that have a caption file already as they are and caption the others")


def images_to_caption(images: list[str], caption_extension: str, overwrite: bool, skip_existing: bool,
                      append_flag: Optional[str] = None) -> list[str]:
    """The images to caption under the existing-file rule: with neither choice made an existing caption file
    stops the run (ToolError) before any model loads, so no earlier caption is lost."""
    existing = [p for p in images if os.path.exists(caption_path(p, caption_extension))]
    if not existing or overwrite:
        return images
    if skip_existing:
        logger.info("skipping %d images that have a %s file already (--skip_existing)", len(existing),
                    caption_extension)
        keep = set(existing)
        return [p for p in images if p not in keep]
    choices = "--overwrite to replace them, --skip_existing to caption only the other images"
    if append_flag:
        choices += f" or {append_flag} to add to them"
    raise ToolError(f"{len(existing)} of {len(images)} images have a {caption_extension} file already (first: "
                    f"{caption_path(existing[0], caption_extension)}): pass {choices}")


def images_to_write(args, overwrite: Optional[bool] = None, append_flag: Optional[str] = None) -> list[str]:
    """The images of args.train_data_dir (args.recursive) whose caption file may be written (see
    images_to_caption); `overwrite` defaults to args.overwrite."""
    images = find_images(args.train_data_dir, args.recursive)
    images = images_to_caption(images, args.caption_extension, args.overwrite if overwrite is None else overwrite,
                               args.skip_existing, append_flag)
    if not images:
        logger.info("nothing to caption: every image has a %s file", args.caption_extension)
    return images


def add_captioner_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every captioner ends with: --debug, --recursive, the existing-caption choice, --dump_options."""
    parser.add_argument("--debug", action="store_true", help="print each caption")
    parser.add_argument("--recursive", action="store_true", help="also caption the images in subfolders")
    add_existing_caption_arguments(parser)
    return add_dump_options(parser)


def write_caption(image_path: str, caption_extension: str, caption: str) -> str:
    """A caption file through a hidden temporary name (library.files' `.<name>.tmp-<hex>`, which its remove_stale
    knows) and a rename: never half a file. Without library.files' fsync and work folder per file, which cost
    ~4x the time over thousands of small files."""
    path = caption_path(image_path, caption_extension)
    tmp = files.work_folder(path)
    with files.explained_write_errors(path):
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(caption + "\n")
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return path


def write_json_atomic(path: str, data, indent: int = 2) -> None:
    files.write_text(path, json.dumps(data, indent=indent, ensure_ascii=False))


def read_metadata(path: str, what: str = "in_json") -> dict:
    """A kohya metadata JSON {image_key: {...}}; a missing or broken file is a ToolError naming `what`."""
    if not os.path.isfile(path):
        raise ToolError(f"{what}: the metadata file does not exist: {path}")
    try:
        with open(path, "r", encoding="utf-8") as f:
            metadata = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ToolError(f"{what}: not a valid JSON file: {path} ({e})") from e
    if not isinstance(metadata, dict) or not all(isinstance(v, dict) for v in metadata.values()):
        raise ToolError(f"{what}: must hold a JSON object {{image_key: {{caption, tags, ...}}}}: {path}")
    return metadata


# ----------------------------------------------------------------------------- loading images in batches


def open_image(path: str):
    """The image as PIL (file contents loaded), or None after logging why it was skipped."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.load()
            return img.copy() if img.mode != "P" else img.convert("RGBA")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        logger.error("skipping %s: the image will not open (%s)", path, e)
        return None


class _PreparedImages:
    """torch Dataset of (path, prepare(PIL image)); None for an image that will not open or prepare."""

    def __init__(self, paths: list[str], prepare: Callable):
        self.paths, self.prepare = paths, prepare

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        path = self.paths[i]
        img = open_image(path)
        if img is None:
            return None
        try:
            return path, img.size, self.prepare(img)
        except (OSError, ValueError) as e:  # a truncated file can fail only when decoded further
            logger.error("skipping %s: the image will not open (%s)", path, e)
            return None


def _keep_loaded(batch: list) -> list:
    return [item for item in batch if item is not None]


def default_workers(requested: Optional[int]) -> int:
    """--max_data_loader_n_workers: None = upstream's loading in the main process on the CPU; with a GPU a few
    workers load the next batch while the model runs (same results, only sooner)."""
    if requested is not None:
        return max(0, int(requested))
    import torch

    return min(4, max(1, (os.cpu_count() or 2) // 2)) if torch.cuda.is_available() else 0


def image_batches(paths: list[str], prepare: Callable, batch_size: int,
                  workers: Optional[int] = None) -> Iterator[list[tuple[str, tuple[int, int], object]]]:
    """Batches of (path, (w, h), prepare(image)) in path order; images that will not open are left out (logged),
    so a batch can be shorter than batch_size. A progress bar counts the images."""
    import torch
    from tqdm import tqdm

    loader = torch.utils.data.DataLoader(_PreparedImages(paths, prepare), batch_size=max(1, int(batch_size)),
                                         shuffle=False, num_workers=default_workers(workers),
                                         collate_fn=_keep_loaded, drop_last=False)
    step = max(1, int(batch_size))
    with tqdm(total=len(paths), smoothing=0.0, unit="img") as bar:
        for batch in loader:  # one list per `step` paths, in order (images that did not open left out)
            if batch:
                yield batch
            bar.update(min(step, len(paths) - bar.n))


def pick_device(name: Optional[str] = None):
    import torch

    if name:
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


# ----------------------------------------------------------------------------- the command line


def setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)


def run_tool(parser: argparse.ArgumentParser, main: Callable[[argparse.Namespace], Optional[int]],
             argv: Optional[list[str]] = None, after_parse: Optional[Callable] = None) -> int:
    """`--dump_options` (the GUI's form), then parse and run; a UserError (ToolError, DatasetError ...) = one line
    on stderr and exit 2 (no traceback)."""
    from library import option_dump

    option_dump.dump_if_asked(parser, argv)
    args = parser.parse_args(argv)
    setup_logging()
    try:
        if after_parse is not None:
            after_parse(args)
        return int(main(args) or 0)
    except UserError as e:  # ToolError, DatasetError, ModelLoadError, SaveError ...
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


def add_dump_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from library import option_dump

    option_dump.add_dump_options_argument(parser)
    return parser


def check_positive(args: argparse.Namespace, names: Iterable[str]) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ToolError(f"--{name} must be 1 or more, got {value}")


# ----------------------------------------------------------------------------- metadata JSON (fine-tuning)


def add_merge_arguments(parser: argparse.ArgumentParser, what: str, caption_extension: str,
                        with_alias: bool) -> argparse.ArgumentParser:
    """The two metadata mergers' command line (upstream's)."""
    parser.add_argument("train_data_dir", type=str, help=f"folder with images and {what} files")
    parser.add_argument("out_json", type=str, help="metadata JSON to write")
    parser.add_argument("--in_json", type=str, default=None,
                        help="metadata to merge into (unset: OUT_JSON when it exists)")
    if with_alias:
        parser.add_argument("--caption_extention", type=str, default=None,
                            help="deprecated spelling of --caption_extension (wins when set, as upstream)")
    parser.add_argument("--caption_extension", type=str, default=caption_extension, help=f"{what} file extension")
    parser.add_argument("--full_path", action="store_true", help="use the image's full path as its key")
    parser.add_argument("--recursive", action="store_true", help="also read images in subfolders")
    parser.add_argument("--debug", action="store_true", help=f"print each {what}")
    return add_dump_options(parser)


def run_merge(args, field: str) -> int:
    from library.captions import resolve_caption_extension_alias

    resolve_caption_extension_alias(args)
    metadata = merge_text_files(args.train_data_dir, args.out_json, args.in_json, args.caption_extension, field,
                                args.full_path, args.recursive, args.debug)
    write_json_atomic(args.out_json, metadata)
    logger.info("wrote %s", args.out_json)
    return 0


def image_key(image_path: str, full_path: bool) -> str:
    """upstream's metadata key: the file name without extension, or the image's path with --full_path."""
    return os.path.abspath(image_path) if full_path else os.path.splitext(os.path.basename(image_path))[0]


def merge_text_files(train_data_dir: str, out_json: str, in_json: Optional[str], caption_extension: str,
                     field: str, full_path: bool, recursive: bool, debug: bool = False) -> dict:
    """Each image's `caption_extension` file becomes metadata[key][field] ("caption" or "tags"); other fields
    and entries of the metadata read (in_json, else an existing out_json, as upstream) are kept. Images without
    the file are listed and left out. Returns the metadata (not written)."""
    from library.captions import find_caption, normalize_caption_extension

    if in_json is None and os.path.isfile(out_json):
        in_json = out_json
    metadata = read_metadata(in_json) if in_json else {}
    if in_json:
        logger.info("merging into the metadata of %s (the %s of images found here are replaced)", in_json, field)
    ext = normalize_caption_extension(caption_extension)
    seen: dict[str, str] = {}
    merged, missing = 0, []
    for path in find_images(train_data_dir, recursive):
        key = image_key(path, full_path)
        if key in seen:
            raise ToolError(f"images {seen[key]} and {path} have the same key {key!r}: add --full_path")
        seen[key] = path
        text = find_caption(path, ext, enable_wildcard=True)  # the whole file (every non-blank line), stripped
        if text is None:
            missing.append(path)
            continue
        metadata.setdefault(key, {})[field] = text
        merged += 1
        if debug:
            logger.info("%s: %s", key, text)
    for path in missing:
        logger.warning("no %s file for %s: left out", ext, path)
    logger.info("merged %d %s files (%s) into %d entries", merged, ext, field, len(metadata))
    return metadata


# ----------------------------------------------------------------------------- transformers captioners


class PixelValues:
    """A transformers image processor as the DataLoader's per-image step (picklable for worker processes)."""

    def __init__(self, image_processor):
        self.image_processor = image_processor

    def __call__(self, image):
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        return self.image_processor(images=rgb, return_tensors="pt")["pixel_values"][0]


def from_pretrained(cls, model_id: str, option: str, **kwargs):
    """cls.from_pretrained(model_id) for a Hub id or a local folder; a failure is one line naming the option."""
    try:
        return cls.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as e:
        where = "the folder" if os.path.isdir(model_id) else "the Hugging Face Hub model"
        raise ToolError(f"{option}: could not load {where} {model_id!r} as {cls.__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e


def caption_images(images: list[str], caption_extension: str, prepare: Callable,
                   caption_batch: Callable[[list], list[str]], batch_size: int, workers: Optional[int],
                   debug: bool = False) -> int:
    """Captions `images` batch by batch: prepare(PIL image) runs in the DataLoader, caption_batch(list of
    prepared) -> captions on the model's device; each caption file is written as soon as its batch is done.
    Returns the number written."""
    import torch

    written = 0
    with torch.inference_mode():
        for batch in image_batches(images, prepare, batch_size, workers):
            for (path, _, _), text in zip(batch, caption_batch([item for _, _, item in batch])):
                text = " ".join(text.split())  # one line
                write_caption(path, caption_extension, text)
                written += 1
                if debug:
                    logger.info("%s: %s", path, text)
    logger.info("wrote %d caption files (%s)", written, caption_extension)
    return written


def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch_size", type=int, default=1, help="images per inference batch")
    parser.add_argument("--max_data_loader_n_workers", type=int, default=None,
                        help="processes reading the images (unset: in the main process on the CPU, a few with a "
                             "GPU)")

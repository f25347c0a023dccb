"""Merge caption files into kohya's fine-tune metadata JSON (the file --in_json reads).

    python sd-scripts/finetune/merge_captions_to_metadata.py TRAIN_DIR OUT_JSON \
        [--in_json existing.json] [--caption_extension .caption] [--full_path] [--recursive]

Each image's caption file (same name, --caption_extension only, as upstream) becomes
metadata[image_key]["caption"]; every non-blank line is kept (one is chosen per step with enable_wildcard). image_key is the file name without extension, or the full path
with --full_path (needed when names repeat across subfolders with --recursive). Other fields of an
existing --in_json (tags, train_resolution, ...) are kept. The output is written to a temporary file and
renamed, so a failed run never leaves a half-written JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library.captions import find_caption, normalize_caption_extension, resolve_caption_extension_alias  # noqa: E402
from library.dataset_files import DatasetError, list_images  # noqa: E402

logger = logging.getLogger("merge_captions_to_metadata")


def merge_captions(train_dir: str, in_json: str | None, caption_extension: str, full_path: bool,
                   recursive: bool) -> tuple[dict, int, list[str]]:
    """Returns (metadata, number of captions merged, images without a caption file)."""
    if in_json:
        if not os.path.isfile(in_json):
            raise DatasetError(f"--in_json does not exist: {in_json}")
        with open(in_json, "r", encoding="utf-8") as f:
            try:
                metadata = json.load(f)
            except json.JSONDecodeError as e:
                raise DatasetError(f"--in_json is not valid JSON: {in_json} ({e})") from e
        if not isinstance(metadata, dict):
            raise DatasetError(f"--in_json must hold a JSON object {{image_key: {{...}}}}: {in_json}")
    else:
        metadata = {}
    ext = normalize_caption_extension(caption_extension)
    images = list_images(train_dir, recursive=recursive)
    if not images:
        raise DatasetError(f"no images found in {train_dir}")
    keys_seen: dict[str, str] = {}
    merged, missing = 0, []
    for path in images:
        key = os.path.abspath(path) if full_path else os.path.splitext(os.path.basename(path))[0]
        if key in keys_seen:
            raise DatasetError(f"images {keys_seen[key]} and {path} have the same key {key!r}; use --full_path")
        keys_seen[key] = path
        caption = find_caption(path, ext, enable_wildcard=True)  # upstream keeps the whole file
        if caption is None:
            missing.append(path)
            continue
        entry = metadata.setdefault(key, {})
        if not isinstance(entry, dict):
            raise DatasetError(f"--in_json entry {key!r} must be an object")
        entry["caption"] = caption
        merged += 1
    return metadata, merged, missing


def write_json_atomic(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
    os.replace(tmp, path)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("train_data_dir", type=str, help="folder with images and caption files")
    parser.add_argument("out_json", type=str, help="metadata JSON to write")
    parser.add_argument("--in_json", type=str, default=None, help="existing metadata to merge into")
    parser.add_argument("--caption_extension", type=str, default=".caption", help="caption file extension")
    parser.add_argument("--caption_extention", type=str, default=None,
                        help="deprecated spelling of --caption_extension (wins when set, as upstream)")
    parser.add_argument("--full_path", action="store_true", help="use the image's full path as its key")
    parser.add_argument("--recursive", action="store_true", help="also read images in subfolders")
    parser.add_argument("--debug", action="store_true", help="print each caption")
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = setup_parser().parse_args(argv)
    resolve_caption_extension_alias(args)
    try:
        metadata, merged, missing = merge_captions(args.train_data_dir, args.in_json, args.caption_extension,
                                                   args.full_path, args.recursive)
    except DatasetError as e:
        logger.error("error: %s", e)
        return 2
    for path in missing:
        logger.warning("no caption file for %s", path)
    if args.debug:
        for key, entry in metadata.items():
            logger.info("%s: %s", key, entry.get("caption"))
    write_json_atomic(args.out_json, metadata)
    logger.info("merged %d captions into %s (%d entries)", merged, args.out_json, len(metadata))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Merge caption files into kohya's fine-tune metadata JSON (the file --in_json reads), as kohya-ss/sd-scripts' tool.

    python sd-scripts/finetune/merge_captions_to_metadata.py TRAIN_DIR OUT_JSON \
        [--in_json existing.json] [--caption_extension .caption] [--full_path] [--recursive]

Each image's caption file (same name, --caption_extension only, as upstream) becomes metadata[image_key]["caption"];
every non-blank line is kept (one is chosen per step with enable_wildcard). image_key is the file name without
extension, or the full path with --full_path (needed when names repeat across subfolders with --recursive). Other
fields of the metadata read (--in_json, else an existing OUT_JSON, as upstream) are kept. The output is written to a
temporary file and renamed, so a failed run never leaves a half-written JSON.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library import captioning  # noqa: E402
from library.captions import resolve_caption_extension_alias  # noqa: E402


def main(args) -> int:
    metadata = captioning.merge_text_files(args.train_data_dir, args.out_json, args.in_json, args.caption_extension,
                                           "caption", args.full_path, args.recursive, args.debug)
    captioning.write_json_atomic(args.out_json, metadata)
    captioning.logger.info("wrote %s", args.out_json)
    return 0


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("train_data_dir", type=str, help="folder with images and caption files")
    parser.add_argument("out_json", type=str, help="metadata JSON to write")
    parser.add_argument("--in_json", type=str, default=None,
                        help="metadata to merge into (unset: OUT_JSON when it exists)")
    parser.add_argument("--caption_extention", type=str, default=None,
                        help="deprecated spelling of --caption_extension (wins when set, as upstream)")
    parser.add_argument("--caption_extension", type=str, default=".caption", help="caption file extension")
    parser.add_argument("--full_path", action="store_true", help="use the image's full path as its key")
    parser.add_argument("--recursive", action="store_true", help="also read images in subfolders")
    parser.add_argument("--debug", action="store_true", help="print each caption")
    return captioning.add_dump_options(parser)


def cli(argv=None) -> int:
    return captioning.run_tool(setup_parser(), main, argv, after_parse=resolve_caption_extension_alias)


if __name__ == "__main__":
    sys.exit(cli())

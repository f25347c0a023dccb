"""Merge tag files (the tagger's .txt files) into kohya's fine-tune metadata JSON, as kohya-ss/sd-scripts' tool.

    python sd-scripts/finetune/merge_dd_tags_to_metadata.py TRAIN_DIR OUT_JSON \
        [--in_json meta_cap.json] [--caption_extension .txt] [--full_path] [--recursive]

Each image's tag file becomes metadata[image_key]["tags"]; the other fields (captions merged before) and entries of
the metadata read (--in_json, else an existing OUT_JSON) are kept. Written atomically.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library import captioning  # noqa: E402


def main(args) -> int:
    metadata = captioning.merge_text_files(args.train_data_dir, args.out_json, args.in_json, args.caption_extension,
                                           "tags", args.full_path, args.recursive, args.debug)
    captioning.write_json_atomic(args.out_json, metadata)
    captioning.logger.info("wrote %s", args.out_json)
    return 0


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("train_data_dir", type=str, help="folder with images and tag files")
    parser.add_argument("out_json", type=str, help="metadata JSON to write")
    parser.add_argument("--in_json", type=str, default=None,
                        help="metadata to merge into (unset: OUT_JSON when it exists)")
    parser.add_argument("--full_path", action="store_true", help="use the image's full path as its key")
    parser.add_argument("--recursive", action="store_true", help="also read images in subfolders")
    parser.add_argument("--caption_extension", type=str, default=".txt", help="tag file extension")
    parser.add_argument("--debug", action="store_true", help="print each image's tags")
    return captioning.add_dump_options(parser)


def cli(argv=None) -> int:
    return captioning.run_tool(setup_parser(), main, argv)


if __name__ == "__main__":
    sys.exit(cli())

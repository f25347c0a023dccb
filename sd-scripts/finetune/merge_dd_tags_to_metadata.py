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
    return captioning.run_merge(args, "tags")


def setup_parser() -> argparse.ArgumentParser:
    return captioning.add_merge_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), "tag",
                                          ".txt", with_alias=False)


def cli(argv=None) -> int:
    return captioning.run_tool(setup_parser(), main, argv)


if __name__ == "__main__":
    sys.exit(cli())

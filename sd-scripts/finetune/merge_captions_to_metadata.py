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


def main(args) -> int:
    return captioning.run_merge(args, "caption")


def setup_parser() -> argparse.ArgumentParser:
    return captioning.add_merge_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]), "caption",
                                          ".caption", with_alias=True)


def cli(argv=None) -> int:
    return captioning.run_tool(setup_parser(), main, argv)


if __name__ == "__main__":
    sys.exit(cli())

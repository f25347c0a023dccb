"""Clean the captions and tags of a fine-tune metadata JSON with kohya-ss/sd-scripts' rules.

    python sd-scripts/finetune/clean_captions_and_tags.py IN_JSON OUT_JSON [--debug]

Tags: underscores become spaces (`^_^` kept), a DeepDanbooru rating tail (`, rating...`) is cut, with several
people (`girls`/`boys`) repeated hair/eye/sleeve/hairstyle tags are dropped, and a tag contained in a longer one
(`shirt` beside `white shirt`) is dropped. Captions: upstream's word replacements (`anime girl` -> `girl`,
`woman` -> `girl` ...), each repeated until it no longer applies. The old three-argument form
(TRAIN_DIR IN_JSON OUT_JSON) is accepted with a warning, as upstream.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library import captioning  # noqa: E402
from library.captioning import ToolError  # noqa: E402

logger = logging.getLogger("clean_captions_and_tags")

# Tags are matched as ", tag, " in ", " + tags + ", " with every separator doubled, so neighbours never share a comma.
HAIR_LENGTH = re.compile(r", (long|short|medium) hair, ")
HAIR_CUT = re.compile(r", (bob|hime) cut, ")
ANY_HAIR = re.compile(r", ([\w\-]+) hair, ")
ONE_WORD = re.compile(r", ([\w\-]+|hair ornament), ")
# with several people, two or more tags of one of these kinds are all removed
PER_PERSON = [
    HAIR_LENGTH,
    HAIR_CUT,
    re.compile(r", [\w\-]+ eyes, "),
    re.compile(r", ([\w\-]+ sleeves|sleeveless), "),
    re.compile(r", (ponytail|braid|ahoge|twintails|[\w\-]+ bun|single hair bun|single side bun|two side up|two tails|"
               r"[\w\-]+ braid|sidelocks), "),
]
HOLD = ", @@@, "

# applied in order, each until the caption no longer changes
CAPTION_REPLACEMENTS = [
    ("anime anime", "anime"), ("young ", ""), ("anime girl", "girl"), ("cartoon female", "girl"),
    ("cartoon lady", "girl"), ("cartoon character", "girl"), ("cartoon woman", "girl"), ("cartoon women", "girls"),
    ("cartoon girl", "girl"), ("anime female", "girl"), ("anime lady", "girl"), ("anime character", "girl"),
    ("anime woman", "girl"), ("anime women", "girls"), ("lady", "girl"), ("female", "girl"), ("woman", "girl"),
    ("women", "girls"), ("people", "girls"), ("person", "girl"), ("a cartoon figure", "a figure"),
    ("a cartoon image", "an image"), ("a cartoon picture", "a picture"), ("an anime cartoon image", "an image"),
    ("a cartoon anime drawing", "a drawing"), ("a cartoon drawing", "a drawing"), ("girl girl", "girl"),
]


def clean_tags(key: str, tags: str) -> str:
    tags = tags.replace("^_^", "\0").replace("_", " ").replace("\0", "^_^")
    parts = tags.split(", rating")
    if len(parts) > 1:  # DeepDanbooru's rating tail (the WD14 tagger writes none)
        if len(parts) > 2:
            logger.info("several ratings in %s: %s", key, tags)
        tags = parts[0]
    padded = ", " + tags.replace(", ", ", , ") + ", "
    if "girls" in padded or "boys" in padded:
        for pattern in PER_PERSON:
            if len(pattern.findall(padded)) > 1:
                padded = pattern.sub("", padded)
        length = HAIR_LENGTH.search(padded)  # one hair length shared by everyone stays
        if length:
            padded = HAIR_LENGTH.sub(HOLD, padded)
        if len(ANY_HAIR.findall(padded)) > 1:
            padded = ANY_HAIR.sub("", padded)
        if length:
            padded = padded.replace(HOLD, length.group())
    for word in ONE_WORD.findall(padded):  # `shirt` beside `white shirt`
        if re.search(rf", ((\w+) )+{word}, ", padded):
            padded = padded.replace(f", {word}, ", "")
    padded = padded.replace(", , ", ", ")
    return padded[2:-2]


def clean_caption(caption: str) -> str:
    for old, new in CAPTION_REPLACEMENTS:
        while old in caption:
            caption = caption.replace(old, new)
    return caption


def main(args) -> int:
    metadata = captioning.read_metadata(args.in_json)
    changed = 0
    for key, entry in metadata.items():
        for field, clean in (("tags", lambda text: clean_tags(key, text)), ("caption", clean_caption)):
            text = entry.get(field)
            if text is None:
                logger.warning("%s has no %s", key, field)
                continue
            if not isinstance(text, str):
                raise ToolError(f"in_json: the {field} of {key!r} must be text, got {type(text).__name__}")
            new = clean(text)
            if new != text:
                changed += 1
                entry[field] = new
                if args.debug:
                    logger.info("FROM: %s\nTO:   %s", text, new)
    captioning.write_json_atomic(args.out_json, metadata)
    logger.info("cleaned %d entries (%d captions/tags changed), wrote %s", len(metadata), changed, args.out_json)
    return 0


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("in_json", type=str, help="metadata JSON to read")
    parser.add_argument("out_json", type=str, help="metadata JSON to write")
    parser.add_argument("--debug", action="store_true", help="print each change")
    return captioning.add_dump_options(parser)


def without_legacy_argument(argv: list[str]) -> list[str]:
    """upstream's old form TRAIN_DIR IN_JSON OUT_JSON: the first argument is dropped with a warning."""
    positional = [a for a in argv if not a.startswith("-")]  # the only option, --debug, takes no value
    if len(positional) == 3:
        captioning.setup_logging()
        logger.warning("the train_data_dir argument is no longer used: pass IN_JSON OUT_JSON only; every caption "
                       "and tag of the metadata is cleaned")
        argv = list(argv)
        argv.remove(positional[0])
    return argv


def cli(argv=None) -> int:
    return captioning.run_tool(setup_parser(), main, without_legacy_argument(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(cli())

"""Caption images with GIT (transformers' GitForCausalLM, e.g. microsoft/git-large-textcaps), command line as
kohya-ss/sd-scripts'.

    python sd-scripts/finetune/make_captions_by_git.py IMAGES --batch_size 8 --max_length 50 --remove_words

`--model_id`: a Hub id or a local folder. `--remove_words` drops the text GIT tends to imagine on signs
("with the words ...", "that says ...") with upstream's patterns.
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library import captioning  # noqa: E402

logger = logging.getLogger("make_captions_by_git")

# upstream's patterns, applied in this order
PATTERN_REPLACE = [
    re.compile(r'(has|with|and) the (words?|letters?|name) (" ?[^"]*"|\w+)'
               r'( ?(is )?(on|in) (the |her |their |him )?\w+)?'),
    re.compile(r'(with a sign )?that says ?(" ?[^"]*"|\w+)( ?on it)?'),
    re.compile(r"(with a sign )?that says ?(' ?(i'm)?[^']*'|\w+)( ?on it)?"),
    re.compile(r"with the number \d+ on (it|\w+ \w+)"),
    re.compile(r'with the words "'),
    re.compile(r"word \w+ on it"),
    re.compile(r"that says the word \w+ on it"),
    re.compile("that says'the word \"( on it)?"),
]


def remove_words(caption: str, debug: bool = False) -> str:
    cleaned = caption
    for pattern in PATTERN_REPLACE:
        cleaned = pattern.sub("", cleaned)
    if debug and cleaned != caption:
        logger.info("%s -> %s", caption, cleaned)
    return cleaned


def main(args) -> int:
    images = captioning.images_to_write(args)
    if not images:
        return 0
    import torch
    from transformers import AutoModelForCausalLM, AutoProcessor

    device = captioning.pick_device()
    logger.info("loading GIT %s on %s", args.model_id, device)
    processor = captioning.from_pretrained(AutoProcessor, args.model_id, "--model_id")
    model = captioning.from_pretrained(AutoModelForCausalLM, args.model_id, "--model_id").to(device).eval()

    def caption_batch(pixels: list) -> list[str]:
        out = model.generate(pixel_values=torch.stack(pixels).to(device, model.dtype), max_length=args.max_length)
        captions = processor.batch_decode(out, skip_special_tokens=True)
        return [remove_words(c, args.debug) if args.remove_words else c for c in captions]

    captioning.caption_images(images, args.caption_extension, captioning.PixelValues(processor.image_processor),
                              caption_batch, args.batch_size, args.max_data_loader_n_workers, args.debug)
    logger.info("done!")
    return 0


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("train_data_dir", type=str, help="folder of the images to caption")
    p.add_argument("--caption_extension", type=str, default=".caption", help="extension of the caption files written")
    p.add_argument("--model_id", type=str, default="microsoft/git-large-textcaps",
                   help="GIT model: a Hugging Face Hub id or a local folder")
    captioning.add_batch_arguments(p)
    p.add_argument("--max_length", type=int, default=50, help="longest caption in tokens")
    p.add_argument("--remove_words", action="store_true",
                   help="remove text GIT reads on signs, such as 'with the words xxx'")
    return captioning.add_captioner_arguments(p)


def check_args(args) -> None:
    captioning.check_positive(args, ["batch_size", "max_length"])


def cli(argv=None) -> int:
    return captioning.run_tool(setup_parser(), main, argv, after_parse=check_args)


if __name__ == "__main__":
    sys.exit(cli())

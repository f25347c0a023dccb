"""Caption images with BLIP (transformers' BlipForConditionalGeneration), command line as kohya-ss/sd-scripts'.

    python sd-scripts/finetune/make_captions.py IMAGES --batch_size 8 --beam_search --num_beams 3 \
        --max_length 75 --min_length 5 --caption_extension .caption

Each caption is BLIP's continuation of "a picture of" (the prompt removed), as upstream's BLIP decoder writes it.
`--caption_weights`: a transformers BLIP model, Hub id or local folder; upstream's default (the original
model_large_caption.pth) is read as its transformers conversion, Salesforce/blip-image-captioning-large.
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library import captioning  # noqa: E402
from library.captioning import ToolError  # noqa: E402

logger = logging.getLogger("make_captions")

DEFAULT_CAPTION_WEIGHTS = ("https://storage.googleapis.com/sfr-vision-language-research/BLIP/models/"
                           "model_large_caption.pth")
PROMPT = "a picture of"  # upstream's BLIP decoder prompt, cut from each caption
# the original checkpoints of upstream's BLIP code -> the same weights converted for transformers by Salesforce
CONVERTED = {"model_large_caption.pth": "Salesforce/blip-image-captioning-large",
             "model_base_caption_capfilt_large.pth": "Salesforce/blip-image-captioning-base"}


def model_id(caption_weights: str) -> str:
    name = caption_weights.rstrip("/").rsplit("/", 1)[-1]
    if caption_weights.startswith(("http://", "https://")) and name in CONVERTED:
        logger.info("--caption_weights %s: using its transformers conversion %s", name, CONVERTED[name])
        return CONVERTED[name]
    if caption_weights.startswith(("http://", "https://")) or caption_weights.endswith((".pth", ".pt", ".ckpt")):
        raise ToolError(f"--caption_weights: original BLIP checkpoints ({caption_weights}) are not read here; give a "
                        "transformers BLIP captioning model: a Hub id such as Salesforce/blip-image-captioning-large "
                        "or a folder saved with save_pretrained")
    return caption_weights


def strip_prompt(caption: str) -> str:
    caption = caption.strip()
    return caption[len(PROMPT):].strip() if caption.lower().startswith(PROMPT) else caption


def main(args) -> int:
    images = captioning.images_to_write(args)
    if not images:
        return 0
    name = model_id(args.caption_weights)
    import numpy as np
    import torch
    from transformers import BlipForConditionalGeneration, BlipProcessor

    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)
    device = captioning.pick_device()
    logger.info("loading BLIP %s on %s", name, device)
    processor = captioning.from_pretrained(BlipProcessor, name, "--caption_weights")
    model = captioning.from_pretrained(BlipForConditionalGeneration, name, "--caption_weights").to(device).eval()
    tokenizer = processor.tokenizer
    if args.beam_search:
        sampling = dict(do_sample=False, num_beams=args.num_beams, repetition_penalty=1.0)
    else:  # nucleus sampling, with upstream's repetition penalty
        sampling = dict(do_sample=True, top_p=args.top_p, repetition_penalty=1.1)

    def caption_batch(pixels: list) -> list[str]:
        prompt = tokenizer([PROMPT] * len(pixels), return_tensors="pt").to(device)
        out = model.generate(pixel_values=torch.stack(pixels).to(device, model.dtype), input_ids=prompt.input_ids,
                             attention_mask=prompt.attention_mask, max_length=args.max_length,
                             min_length=args.min_length, **sampling)
        return [strip_prompt(t) for t in processor.batch_decode(out, skip_special_tokens=True)]

    captioning.caption_images(images, args.caption_extension, captioning.PixelValues(processor.image_processor),
                              caption_batch, args.batch_size, args.max_data_loader_n_workers, args.debug)
    logger.info("done!")
    return 0


def resolve_args(args) -> None:
    from library.captions import resolve_caption_extension_alias

    resolve_caption_extension_alias(args)
    captioning.check_positive(args, ["batch_size", "num_beams", "max_length"])
    if args.min_length > args.max_length:
        raise ToolError(f"--min_length ({args.min_length}) must not be above --max_length ({args.max_length})")


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("train_data_dir", type=str, help="folder of the images to caption")
    p.add_argument("--caption_weights", type=str, default=DEFAULT_CAPTION_WEIGHTS,
                   help="BLIP captioning model: a transformers Hub id or folder (upstream's default URL = "
                        "Salesforce/blip-image-captioning-large)")
    p.add_argument("--caption_extention", type=str, default=None,
                   help="deprecated spelling of --caption_extension (wins when set, as upstream)")
    p.add_argument("--caption_extension", type=str, default=".caption", help="extension of the caption files written")
    p.add_argument("--beam_search", action="store_true", help="beam search (default: nucleus sampling)")
    captioning.add_batch_arguments(p)
    p.add_argument("--num_beams", type=int, default=1, help="beams of --beam_search")
    p.add_argument("--top_p", type=float, default=0.9, help="top_p of nucleus sampling")
    p.add_argument("--max_length", type=int, default=75, help="longest caption in tokens (the prompt included)")
    p.add_argument("--min_length", type=int, default=5, help="shortest caption in tokens")
    p.add_argument("--seed", default=42, type=int, help="seed of the sampling")
    return captioning.add_captioner_arguments(p)


def cli(argv=None) -> int:
    return captioning.run_tool(setup_parser(), main, argv, after_parse=resolve_args)


if __name__ == "__main__":
    sys.exit(cli())

"""Caption images with Florence-2 (transformers' native Florence2ForConditionalGeneration): a caption, a detailed
caption, or tags (the names of the objects Florence-2 finds). Our own tool: kohya-ss/sd-scripts has none.

    python sd-scripts/finetune/make_captions_by_florence2.py IMAGES --task detailed_caption --batch_size 8

`--model_id`: a Florence-2 model in transformers' layout, Hub id (florence-community/Florence-2-large,
florence-community/Florence-2-base) or a local folder. `--prompt` sends any task token or text instead of --task
(e.g. <GENERATE_TAGS> for a PromptGen fine-tune converted to that layout).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library import captioning  # noqa: E402
from library.captioning import ToolError  # noqa: E402

logger = logging.getLogger("make_captions_by_florence2")

TASKS = {"caption": "<CAPTION>", "detailed_caption": "<DETAILED_CAPTION>",
         "more_detailed_caption": "<MORE_DETAILED_CAPTION>", "tags": "<OD>"}
DTYPES = ("auto", "float32", "float16", "bfloat16")


def object_tags(labels: list[str], separator: str) -> str:
    """Object detection labels as tags: each once, in the order found."""
    return separator.join(dict.fromkeys(label.strip() for label in labels if label.strip()))


def load_dtype(name: str, device):
    import torch

    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def main(args) -> int:
    images = captioning.images_to_write(args)
    if not images:
        return 0
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Florence2ForConditionalGeneration

    device = captioning.pick_device()
    dtype = load_dtype(args.dtype, device)
    logger.info("loading Florence-2 %s on %s (%s)", args.model_id, device, dtype)
    processor = captioning.from_pretrained(AutoProcessor, args.model_id, "--model_id")
    if not hasattr(processor, "post_process_generation"):
        raise ToolError(f"--model_id: {args.model_id} has no Florence-2 processor (transformers' native layout, "
                        "e.g. florence-community/Florence-2-large)")
    model = captioning.from_pretrained(Florence2ForConditionalGeneration, args.model_id, "--model_id", dtype=dtype)
    model = model.to(device).eval()
    task = args.prompt or TASKS[args.task]
    # the prompt's tokens (image placeholders + text) are the same for every image: made once
    prompt = processor(images=[Image.new("RGB", (8, 8))], text=[task], return_tensors="pt")

    def caption_batch(pixels: list) -> list[str]:
        n = len(pixels)
        out = model.generate(input_ids=prompt["input_ids"].repeat(n, 1).to(device),
                             attention_mask=prompt["attention_mask"].repeat(n, 1).to(device),
                             pixel_values=torch.stack(pixels).to(device, dtype), max_new_tokens=args.max_new_tokens,
                             num_beams=args.num_beams, do_sample=False)
        if task != TASKS["tags"]:
            return [t.strip() for t in processor.batch_decode(out, skip_special_tokens=True)]
        texts = processor.batch_decode(out, skip_special_tokens=False)
        try:
            found = [processor.post_process_generation(t, task=task, image_size=(1000, 1000))[task] for t in texts]
        except ValueError as e:
            raise ToolError(f"--task tags: the processor of {args.model_id} cannot read object detections ({e})") \
                from e
        return [object_tags(f["labels"], args.caption_separator) for f in found]

    captioning.caption_images(images, args.caption_extension, captioning.PixelValues(processor.image_processor),
                              caption_batch, args.batch_size, args.max_data_loader_n_workers, args.debug)
    logger.info("done!")
    return 0


def check_args(args) -> None:
    captioning.check_positive(args, ["batch_size", "num_beams", "max_new_tokens"])


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("train_data_dir", type=str, help="folder of the images to caption")
    p.add_argument("--model_id", type=str, default="florence-community/Florence-2-large",
                   help="Florence-2 model in transformers' layout: a Hugging Face Hub id or a local folder")
    p.add_argument("--task", type=str, default="detailed_caption", choices=list(TASKS),
                   help="caption, detailed_caption, more_detailed_caption, or tags (the objects found, each once)")
    p.add_argument("--prompt", type=str, default=None,
                   help="a task token or text sent instead of --task (its output written as text)")
    p.add_argument("--caption_extension", type=str, default=".caption", help="extension of the caption files written")
    p.add_argument("--caption_separator", type=str, default=", ", help="text between tags (--task tags)")
    captioning.add_batch_arguments(p)
    p.add_argument("--num_beams", type=int, default=3, help="beams of the beam search")
    p.add_argument("--max_new_tokens", type=int, default=1024, help="longest caption in tokens")
    p.add_argument("--dtype", type=str, default="auto", choices=list(DTYPES),
                   help="model precision (auto: bfloat16 on a GPU that has it, float16 on other GPUs, float32 on the "
                        "CPU)")
    return captioning.add_captioner_arguments(p)


def cli(argv=None) -> int:
    return captioning.run_tool(setup_parser(), main, argv, after_parse=check_args)


if __name__ == "__main__":
    sys.exit(cli())

"""Assign each image its aspect-ratio bucket and cache its VAE latents next to it, for fine-tuning with --in_json;
command line as kohya-ss/sd-scripts'.

    python sd-scripts/finetune/prepare_buckets_latents.py IMAGES meta_clean.json meta_lat.json MODEL \
        --batch_size 4 --max_resolution 1024,1024 --min_bucket_reso 256 --max_bucket_reso 2048 \
        --bucket_reso_steps 64 --mixed_precision bf16 [--flip_aug] [--skip_existing]

The buckets, resizing and cropping are the trainers' own (library/datasets.py and buckets.py), and the files are the
ones `--cache_latents_to_disk` reads and writes (library/latent_cache.py: `<image>_<W>x<H>_sd.npz`, `_sdxl.npz` for
an SDXL model, or an existing `<image>.npz`), so a fine-tune with the same resolution and bucket settings encodes
nothing again. OUT_JSON is IN_JSON with each image's `train_resolution` (the bucket, as upstream writes it).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from library import captioning  # noqa: E402
from library.captioning import ToolError  # noqa: E402

logger = logging.getLogger("prepare_buckets_latents")

DTYPES = {"no": "float32", "fp16": "float16", "bf16": "bfloat16"}


def parse_resolution(text: str) -> tuple[int, int]:
    try:
        parts = tuple(int(t) for t in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 2 or min(parts) <= 0:
        raise ToolError(f"--max_resolution must be 'width,height' in pixels, e.g. 512,512; got {text!r}")
    return parts


def build_dataset(args, images: list[str]):
    """The trainers' dataset over the folder's images: buckets assigned as a fine-tune with these settings does."""
    from library.dataset_files import DatasetError, read_image_size
    from library.datasets import DatasetParams, ImageDataset, ImageInfo, SubsetParams, new_epoch_value

    subset = SubsetParams(image_dir=args.train_data_dir, flip_aug=args.flip_aug, alpha_mask=bool(args.alpha_mask))
    params = DatasetParams(resolution=parse_resolution(args.max_resolution), enable_bucket=True,
                           min_bucket_reso=args.min_bucket_reso, max_bucket_reso=args.max_bucket_reso,
                           bucket_reso_steps=args.bucket_reso_steps, bucket_no_upscale=args.bucket_no_upscale,
                           subsets=[subset])
    infos = []
    for path in images:
        try:
            infos.append(ImageInfo(path, "", subset, 1, read_image_size(path)))
        except DatasetError as e:
            logger.error("skipping %s: the image will not open (%s)", path, e)
    return ImageDataset(params, infos, 1.0, 0, 0, new_epoch_value())


class _Pixels:
    """DataLoader items: (index, pixels [3,H,W] in -1..1 at the bucket size, mask, original_size, crop_ltrb)."""

    def __init__(self, dataset, order: list[int]):
        self.dataset, self.order = dataset, order

    def __len__(self):
        return len(self.order)

    def __getitem__(self, i):
        from library import image_utils
        from library.dataset_files import DatasetError

        info = self.dataset.images[self.order[i]]
        try:
            img, mask, original, ltrb = self.dataset.load_pixels(info, None, for_cache=True)
        except DatasetError as e:
            logger.error("skipping %s: the image will not open (%s)", info.path, e)
            return None
        return self.order[i], image_utils.to_tensor(img), mask, original, ltrb


def _one(batch):
    return batch[0]


def check_args(args) -> None:
    captioning.check_positive(args, ["batch_size", "bucket_reso_steps", "min_bucket_reso", "max_bucket_reso"])
    parse_resolution(args.max_resolution)
    if args.bucket_reso_steps % 8:
        logger.warning("--bucket_reso_steps %d is not a multiple of 8: the latents are 1/8 of the bucket size",
                       args.bucket_reso_steps)
    if args.bucket_reso_steps % 32:
        logger.warning("--bucket_reso_steps %d is not a multiple of 32, which SDXL needs", args.bucket_reso_steps)
    if args.bucket_no_upscale:
        logger.info("--bucket_no_upscale: buckets follow each image's size; min/max_bucket_reso are not used")


def main(args) -> int:
    metadata = captioning.read_metadata(args.in_json, "in_json")
    images = captioning.find_images(args.train_data_dir, args.recursive)
    import numpy as np
    import torch

    from library import model_util
    from library.latent_cache import FAMILY_FORMATS

    family = model_util.detect_family(args.model_name_or_path) or ("sd2" if args.v2 else "sd1")
    if family == "flux":
        raise ToolError("model_name_or_path: a FLUX.1 model; cache its latents with flux_train*.py "
                        "--cache_latents_to_disk")
    dataset = build_dataset(args, images)  # a bucket problem is a DatasetError: one line, exit 2
    fmt = dataclasses.replace(FAMILY_FORMATS[family], scale=1.0)  # the files hold the unscaled VAE sample
    npz_of = {info.path: fmt.npz_path(info.path, info.size) for info in dataset.images}
    todo = []
    for i, info in enumerate(dataset.images):
        key = captioning.image_key(info.path, args.full_path)
        metadata.setdefault(key, {})["train_resolution"] = [info.bucket[0] - info.bucket[0] % 8,
                                                            info.bucket[1] - info.bucket[1] % 8]
        if args.skip_existing and fmt.is_expected(npz_of[info.path], info.bucket, args.flip_aug,
                                                  bool(args.alpha_mask), image_path=info.path):
            continue
        todo.append(i)
    logger.info("%d images to encode, %d cached already", len(todo), len(dataset.images) - len(todo))

    if todo:
        device = captioning.pick_device()
        dtype = getattr(torch, DTYPES[args.mixed_precision])
        logger.info("loading the VAE of %s (%s) on %s", args.model_name_or_path, family, device)
        try:
            vae = model_util.load_vae(args.model_name_or_path, family, dtype).to(device).eval()
        except (model_util.ModelLoadError, OSError) as e:
            raise ToolError(f"model_name_or_path: {e}") from e
        todo.sort(key=lambda i: dataset.images[i].bucket)  # a batch never mixes buckets
        loader = torch.utils.data.DataLoader(_Pixels(dataset, todo), batch_size=1, collate_fn=_one,
                                             num_workers=captioning.default_workers(args.max_data_loader_n_workers))
        pending: list = []

        def encode(items):
            pixels = torch.stack([p for _, p, _, _, _ in items]).to(device, dtype)
            with torch.inference_mode():
                latents = vae.encode(pixels).latent_dist.sample().float().cpu()
                flipped = vae.encode(torch.flip(pixels, dims=[3])).latent_dist.sample().float().cpu() \
                    if args.flip_aug else None
            for j, (i, _, mask, original, ltrb) in enumerate(items):
                info = dataset.images[i]
                if torch.isnan(latents[j]).any() or (flipped is not None and torch.isnan(flipped[j]).any()):
                    raise ToolError(f"the VAE gave NaN latents for {info.path}: try --mixed_precision no or bf16")
                fmt.save(npz_of[info.path], info.bucket, latents[j], original, ltrb,
                         flipped[j] if flipped is not None else None, mask if args.alpha_mask else None,
                         signature=None)

        from tqdm import tqdm

        for item in tqdm(loader, total=len(todo), smoothing=0.0, unit="img"):
            if item is None:
                continue
            if pending and dataset.images[pending[0][0]].bucket != dataset.images[item[0]].bucket:
                encode(pending)
                pending = []
            pending.append(item)
            if len(pending) >= args.batch_size:
                encode(pending)
                pending = []
        if pending:
            encode(pending)

    counts: dict = {}
    for info in dataset.images:
        counts[info.bucket] = counts.get(info.bucket, 0) + 1
    for i, (bucket, n) in enumerate(sorted(counts.items())):
        logger.info("bucket %d %s: %d", i, bucket, n)
    logger.info("mean ar error: %s", dataset.mean_ar_error if dataset.images else float(np.nan))
    captioning.write_json_atomic(args.out_json, metadata)
    logger.info("wrote %s", args.out_json)
    return 0


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("train_data_dir", type=str, help="folder of the training images")
    p.add_argument("in_json", type=str, help="metadata JSON to read (captions/tags merged before)")
    p.add_argument("out_json", type=str, help="metadata JSON to write (with train_resolution)")
    p.add_argument("model_name_or_path", type=str,
                   help="the model whose VAE encodes the latents: .safetensors/.ckpt, diffusers folder or Hub id")
    p.add_argument("--v2", action="store_true",
                   help="an SD2.x model given by Hub id (files and folders are recognised from their weights)")
    p.add_argument("--batch_size", type=int, default=1, help="images per VAE batch")
    p.add_argument("--max_data_loader_n_workers", type=int, default=None,
                   help="processes reading the images (unset: in the main process on the CPU, a few with a GPU)")
    p.add_argument("--max_resolution", type=str, default="512,512",
                   help="training resolution 'width,height' (the trainer's --resolution)")
    p.add_argument("--min_bucket_reso", type=int, default=256, help="smallest bucket side")
    p.add_argument("--max_bucket_reso", type=int, default=1024, help="largest bucket side")
    p.add_argument("--bucket_reso_steps", type=int, default=64, help="bucket sides are multiples of this")
    p.add_argument("--bucket_no_upscale", action="store_true", help="buckets from each image's size, never enlarged")
    p.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"],
                   help="VAE precision")
    p.add_argument("--full_path", action="store_true",
                   help="metadata keys are the images' full paths (as merged with --full_path)")
    p.add_argument("--flip_aug", action="store_true", help="also cache the latents of the mirrored image")
    p.add_argument("--alpha_mask", type=str, default="",
                   help="any text (e.g. 1): also cache each image's alpha channel as its loss mask")
    p.add_argument("--skip_existing", action="store_true",
                   help="keep cache files that fit already (bucket, flip and mask) instead of encoding again")
    p.add_argument("--recursive", action="store_true", help="also the images in subfolders")
    return captioning.add_dump_options(p)


def cli(argv=None) -> int:
    return captioning.run_tool(setup_parser(), main, argv, after_parse=check_args)


if __name__ == "__main__":
    sys.exit(cli())

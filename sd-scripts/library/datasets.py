"""Training data for every trainer: images + captions in aspect-ratio buckets, served as whole batches.

A `DatasetGroup` is a torch `Dataset` whose items are complete batches (use a DataLoader with
batch_size=None, or `make_dataloader`). Batches never mix bucket sizes. Latents and text-encoder
outputs can be cached in memory or next to the images (kohya's `<image>.npz` and
`<image>_te_outputs.npz`). Configuration (CLI flags, --dataset_config TOML) lives in config_util.py;
this module only knows the resolved `DatasetParams` / `SubsetParams`.
"""
from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from library import buckets as buckets_mod
from library import files
from library import image_utils
from library.buckets import BucketSelector, make_bucket_resolutions  # noqa: F401  (re-exported)
from library.latent_cache import FAMILY_FORMATS, LatentCacheFormat
from library.masks import find_conditioning_image
from library.te_cache import TeCacheFormat

from library import captions
from library.captions import find_caption, normalize_caption_extension, read_caption_file  # noqa: F401
from library.dataset_files import (  # noqa: F401  (re-exported: the data API lives here)
    IMAGE_EXTENSIONS,
    DatasetError,
    is_image_file,
    list_images,
    read_image_size,
)

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- parameters


@dataclass
class SubsetParams:
    """One folder of images (or one metadata file) with its caption and augmentation settings."""

    image_dir: Optional[str] = None
    num_repeats: int = 1
    caption_extension: str = ".caption"
    shuffle_caption: bool = False
    keep_tokens: int = 0
    caption_separator: str = ","
    caption_prefix: Optional[str] = None
    caption_suffix: Optional[str] = None
    caption_dropout_rate: float = 0.0
    caption_dropout_every_n_epochs: int = 0
    caption_tag_dropout_rate: float = 0.0
    keep_tokens_separator: str = ""
    secondary_separator: Optional[str] = None
    enable_wildcard: bool = False
    token_warmup_min: int = 1
    token_warmup_step: float = 0
    custom_attributes: Optional[dict] = None  # passed through to the batch (upstream: for custom trainers)
    flip_aug: bool = False
    color_aug: bool = False
    random_crop: bool = False
    is_reg: bool = False
    class_tokens: Optional[str] = None
    metadata_file: Optional[str] = None
    face_crop_aug_range: Optional[tuple[float, float]] = None
    resize_interpolation: Optional[str] = None  # None: area when shrinking, lanczos when enlarging (upstream)
    alpha_mask: bool = False
    conditioning_data_dir: Optional[str] = None  # masks for --masked_loss (red channel)
    cache_info: bool = False

    @property
    def name(self) -> str:
        """Key used in ss_dataset_dirs / ss_tag_frequency (kohya: the folder's base name)."""
        path = self.metadata_file if self.metadata_file else self.image_dir
        return os.path.basename(os.path.normpath(path)) if path else "dataset"

    @property
    def caption_is_random(self) -> bool:
        return captions.caption_varies(self)


@dataclass
class DatasetParams:
    """One [[datasets]] entry: resolution, batching and bucketing shared by its subsets."""

    resolution: tuple[int, int]
    batch_size: int = 1
    enable_bucket: bool = False
    min_bucket_reso: int = 256
    max_bucket_reso: int = 1024
    bucket_reso_steps: int = 64
    bucket_no_upscale: bool = False
    network_multiplier: float = 1.0  # the network's multiplier while training on this dataset's batches
    subsets: list[SubsetParams] = field(default_factory=list)
    validation_split: float = 0.0  # share of each image_dir subset held out for the validation loss
    validation_seed: Optional[int] = None


@dataclass
class ImageInfo:
    path: str
    caption: str  # caption as read (before prefix/suffix/shuffle; all lines with enable_wildcard)
    subset: SubsetParams
    num_repeats: int
    size: tuple[int, int]  # original (w, h) after EXIF orientation
    bucket: tuple[int, int] = (0, 0)  # (w, h) the image is resized+cropped to
    resized_size: tuple[int, int] = (0, 0)  # (w, h) before the crop to the bucket (upstream's select_bucket)
    cond_path: Optional[str] = None  # mask image in the subset's conditioning_data_dir
    latents: Optional[torch.Tensor] = None
    latents_flipped: Optional[torch.Tensor] = None
    latents_npz: Optional[str] = None  # set when latents are cached on disk
    latents_original_size: tuple = (0, 0)  # SDXL conditioning of the cached latents
    latents_crop_ltrb: tuple = (0, 0, 0, 0)
    alpha_mask: Optional[torch.Tensor] = None  # [H, W] cached with the latents (alpha_mask subsets)
    te_outputs: Optional[dict] = None
    te_npz: Optional[str] = None
    tags: Optional[str] = None  # fine-tuning metadata tags (ss_tag_frequency counts them)

    @property
    def is_reg(self) -> bool:
        return self.subset.is_reg


# ----------------------------------------------------------------------------- image sources


IMAGE_INFO_CACHE_FILE = "metadata_cache.json"  # upstream's --cache_info file in each image folder


def images_from_dir(subset: SubsetParams) -> list[ImageInfo]:
    """A DreamBooth-style subset: every image in image_dir, caption file or class_tokens. With cache_info the
    paths, captions and sizes come from (or go to) upstream's `metadata_cache.json` in image_dir
    ({path: {"caption", "resolution": [w, h]}}); delete it after changing the folder."""
    cache_file = os.path.join(subset.image_dir, IMAGE_INFO_CACHE_FILE)
    if subset.cache_info and os.path.isfile(cache_file):
        logger.info("using cached image info: %s", cache_file)
        try:
            with open(cache_file, "r", encoding="utf-8") as f:
                metas = json.load(f)
            return [ImageInfo(path, meta["caption"] or "", subset, subset.num_repeats, tuple(meta["resolution"]))
                    for path, meta in metas.items()]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DatasetError(f"cache_info: cannot read {cache_file} ({e}); delete it to scan the folder again")
    infos, missing = [], []
    for path in list_images(subset.image_dir):
        caption = find_caption(path, subset.caption_extension, subset.enable_wildcard)
        if caption is None:  # upstream: the class tokens, else an empty caption (no other extension is read)
            missing.append(path)
            caption = subset.class_tokens if subset.class_tokens is not None else ""
        infos.append(ImageInfo(path, caption, subset, subset.num_repeats, read_image_size(path)))
    if missing:
        use = f"the class tokens {subset.class_tokens!r}" if subset.class_tokens else "an empty caption"
        shown = ", ".join(os.path.basename(p) for p in missing[:5]) + (" ..." if len(missing) > 5 else "")
        logger.warning("%d images in %s have no %s caption file; using %s: %s", len(missing), subset.image_dir,
                       subset.caption_extension, use, shown)
    if not infos:
        logger.warning("no images in %s (extensions: %s)", subset.image_dir, ", ".join(IMAGE_EXTENSIONS))
    if subset.cache_info:
        metas = {info.path: {"caption": info.caption, "resolution": list(info.size)} for info in infos}
        text = json.dumps(metas, ensure_ascii=False, indent=2)
        files.write_text(cache_file, text)
        logger.info("image info cached in %s", cache_file)
    return infos


def _find_image_for_key(key: str, image_dir: Optional[str]) -> Optional[str]:
    if os.path.isfile(key) and is_image_file(key):  # --full_path keys
        return key
    if image_dir:
        candidate = os.path.join(image_dir, key)
        if os.path.isfile(candidate) and is_image_file(candidate):
            return candidate
        for ext in IMAGE_EXTENSIONS:
            for e in (ext, ext.upper()):
                if os.path.isfile(candidate + e):
                    return candidate + e
    return None


def images_from_metadata(subset: SubsetParams) -> list[ImageInfo]:
    """A fine-tune subset: kohya metadata JSON {image_key: {"caption", "tags", ...}}."""
    path = subset.metadata_file
    if not os.path.isfile(path):
        raise DatasetError(f"metadata file (--in_json / metadata_file) does not exist: {path}")
    try:
        with open(path, "r", encoding="utf-8") as f:
            if path.endswith(".jsonl"):  # upstream's JSONL form: one {"image_path", "caption", "tags"} per line
                metadata = {}
                for line in f:
                    if line.strip():
                        md = json.loads(line)
                        metadata[md["image_path"]] = md
            else:
                metadata = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DatasetError(f"metadata file is not valid JSON: {path} ({e})") from e
    if not isinstance(metadata, dict):
        raise DatasetError(f"metadata file must hold a JSON object {{image_key: {{caption, tags}}}}: {path}")
    infos = []
    for key, md in metadata.items():
        if not isinstance(md, dict):
            raise DatasetError(f"metadata file {path}: entry {key!r} must be an object with 'caption'/'tags'")
        image_path = _find_image_for_key(key, subset.image_dir)
        if image_path is None:
            where = f" in {subset.image_dir}" if subset.image_dir else ""
            raise DatasetError(f"metadata file {path}: no image found for key {key!r}{where}")
        caption, tags = md.get("caption"), md.get("tags")
        if not isinstance(caption, (str, type(None))) or not isinstance(tags, (str, type(None))):
            raise DatasetError(f"metadata file {path}: caption/tags of {key!r} must be strings")
        caption = captions.metadata_caption(caption, tags, subset.caption_separator, subset.enable_wildcard)
        infos.append(ImageInfo(image_path, caption, subset, subset.num_repeats, read_image_size(image_path),
                               tags=tags or None))
    if not infos:
        logger.warning("metadata file has no images: %s", path)
    return infos


# ----------------------------------------------------------------------------- one dataset


class ImageDataset(torch.utils.data.Dataset):
    """One [[datasets]] entry; item i is batch i of the current epoch."""

    def __init__(self, params: DatasetParams, images: list[ImageInfo], prior_loss_weight: float, seed: int,
                 index: int, epoch_value):
        self.params = params
        self.images = images
        self.prior_loss_weight = float(prior_loss_weight)
        self.seed = seed
        self.index = index
        self._epoch = epoch_value  # multiprocessing.Value shared with DataLoader workers
        # current optimizer step and run length, for token warm-up (shared with DataLoader workers)
        self._step, self._max_steps = multiprocessing.Value("i", 0), multiprocessing.Value("i", 0)
        self._batches_epoch = None
        self._batches: list[list[int]] = []
        self.latents_cached = False
        self.latent_format: Optional[LatentCacheFormat] = None  # set by DatasetGroup.cache_latents(to_disk=True)
        self.te_cached = False
        self.te_format: Optional[TeCacheFormat] = None  # set by DatasetGroup.cache_text_encoder_outputs
        self.buckets: dict[tuple[int, int], list[int]] = {}
        self.mean_ar_error = 0.0
        # textual inversion: text -> replacement in every served caption; "" -> the whole caption (a list: one
        # chosen at random), as upstream's add_replacement
        self.replacements: dict[str, str | list[str]] = {}
        self._assign_buckets()
        _attach_conditioning_images(images)

    # --- buckets and batches
    def _selector(self) -> BucketSelector:
        p = self.params
        if not p.enable_bucket:  # one fixed bucket: the resolution
            return BucketSelector(tuple(p.resolution), predefined=[tuple(p.resolution)])
        if p.bucket_no_upscale:
            return BucketSelector(tuple(p.resolution), p.bucket_reso_steps, no_upscale=True)
        return BucketSelector(tuple(p.resolution), p.bucket_reso_steps, predefined=make_bucket_resolutions(
            p.resolution, p.min_bucket_reso, p.max_bucket_reso, p.bucket_reso_steps))

    def _assign_buckets(self) -> None:
        selector = self._selector()
        errors = []
        for i, info in enumerate(self.images):
            info.bucket, info.resized_size, error = selector.select(*info.size)
            if min(info.bucket) <= 0:
                raise DatasetError(f"image {info.path} ({info.size[0]}x{info.size[1]}) is smaller than "
                                   f"bucket_reso_steps ({self.params.bucket_reso_steps}) with bucket_no_upscale")
            self.buckets.setdefault(info.bucket, []).append(i)
            errors.append(abs(error))
        self.buckets = dict(sorted(self.buckets.items()))
        self.mean_ar_error = float(np.mean(errors)) if errors else 0.0

    def _batches_for_epoch(self, epoch: int) -> list[list[int]]:
        # Same permutation in every process/worker for a given (seed, epoch): safe with accelerate sharding.
        rng = random.Random(f"order:{self.seed}:{self.index}:{epoch}")
        batches = []
        for indices in self.buckets.values():
            entries = [i for i in indices for _ in range(self.images[i].num_repeats)]
            rng.shuffle(entries)
            bs = self.params.batch_size
            batches.extend(entries[k:k + bs] for k in range(0, len(entries), bs))
        rng.shuffle(batches)
        return batches

    def current_batches(self) -> list[list[int]]:
        epoch = self._epoch.value
        if self._batches_epoch != epoch:
            self._batches = self._batches_for_epoch(epoch)
            self._batches_epoch = epoch
        return self._batches

    def __len__(self) -> int:
        bs = self.params.batch_size
        return sum(math.ceil(sum(self.images[i].num_repeats for i in idx) / bs) for idx in self.buckets.values())

    @property
    def num_train_images(self) -> int:
        return sum(i.num_repeats for i in self.images if not i.is_reg)

    @property
    def num_reg_images(self) -> int:
        return sum(i.num_repeats for i in self.images if i.is_reg)

    # --- captions
    @staticmethod
    def base_caption(info: ImageInfo) -> str:
        """The caption of an image whose subset does not vary captions (what the text-encoder cache encodes)."""
        return captions.process_caption(info.caption, info.subset, epoch=0, rng=random.Random(0))

    def process_caption(self, info: ImageInfo, epoch: int, rng: random.Random) -> str:
        caption = captions.process_caption(info.caption, info.subset, epoch=epoch, step=self._step.value,
                                           max_train_steps=self._max_steps.value, rng=rng)
        return captions.apply_replacements(caption, self.replacements, rng)

    # --- pixels
    def plan(self, info: ImageInfo, size: tuple[int, int], rng: Optional[random.Random], for_cache: bool = False):
        """Where the pixels of an image of `size` (w, h) go, as upstream decides it -> (resized (w, h), crop box
        (l, t, r, b) of the resized image, original_size, crop_ltrb) with the last two its SDXL conditioning.

        Buckets (and every latent cache) resize to cover the bucket then crop (random with random_crop), and
        condition on the image's size and the fit-inside box. Without buckets upstream takes the image as it is:
        a face crop (face_crop_aug_range + `name_cx_cy_w_h` file names), a random crop of a larger image
        (random_crop), or an image of exactly the resolution, conditioned as uncropped at the resolution; other
        images, which upstream refuses, are resized to cover and cropped like a bucket."""
        s, bucket = info.subset, info.bucket
        random_rng = rng if s.random_crop else None
        if size != info.size:  # the file changed since the dataset was built: cover the same bucket
            info.size = size
            info.resized_size = BucketSelector(bucket, predefined=[bucket]).select(*size)[1]
        if not self.params.enable_bucket and not for_cache:
            face = image_utils.face_info_from_name(info.path) if s.face_crop_aug_range else (0, 0, 0, 0)
            if face[0] > 0:
                resized, box = image_utils.face_crop_plan(size, bucket, face, s.face_crop_aug_range, s.random_crop,
                                                          rng or random.Random(0))
                return resized, box, bucket, (0, 0, 0, 0)
            if size == bucket or (random_rng is not None and size[0] >= bucket[0] and size[1] >= bucket[1]):
                return size, buckets_mod.trim_box(size, bucket, random_rng), bucket, (0, 0, 0, 0)
        box = buckets_mod.trim_box(info.resized_size, bucket, random_rng)
        return info.resized_size, box, size, buckets_mod.crop_ltrb(bucket, size)

    def load_pixels(self, info: ImageInfo, rng: Optional[random.Random], for_cache: bool = False):
        """-> (HxWx3|4 uint8 at the bucket size (alpha kept for alpha_mask), mask [H,W] float or None,
        original_size, crop_ltrb)."""
        s = info.subset
        img = image_utils.load_image(info.path, alpha=s.alpha_mask)
        size = (img.shape[1], img.shape[0])
        resized, box, original, ltrb = self.plan(info, size, rng, for_cache)
        img = _resize_crop(img, resized, box, s.resize_interpolation)
        mask = None
        if info.cond_path:
            mask = self.conditioning_mask(info, size, resized, box)
        elif s.alpha_mask:
            mask = torch.from_numpy(img[:, :, 3].astype(np.float32) / 255.0)
        return img, mask, original, ltrb

    @staticmethod
    def conditioning_mask(info: ImageInfo, size, resized, box) -> torch.Tensor:
        """The red channel of the conditioning image through the image's own resize and crop, in 0..1. (Upstream
        stretches it straight to the bucket, which misplaces it when the image's aspect differs from the bucket.)"""
        cond = image_utils.load_image(info.cond_path)[:, :, 0]
        if (cond.shape[1], cond.shape[0]) != size:
            cond = image_utils.resize_image(cond, size, info.subset.resize_interpolation)
        cond = _resize_crop(cond, resized, box, info.subset.resize_interpolation)
        return torch.from_numpy(cond.astype(np.float32) / 255.0)

    # --- items
    def __getitem__(self, index: int) -> dict:
        batches = self.current_batches()
        if index < 0 or index >= len(batches):
            raise IndexError(index)
        epoch = self._epoch.value
        images, latents, captions, paths, masks = [], [], [], [], []
        orig, crops, targets, weights, te_list, flips = [], [], [], [], [], []
        for pos, i in enumerate(batches[index]):
            info = self.images[i]
            rng = random.Random(f"item:{self.seed}:{self.index}:{epoch}:{index}:{pos}")
            flip = info.subset.flip_aug and rng.random() < 0.5
            if self.latents_cached:
                lat, lat_flipped, original, ltrb, mask = self._cached_latents(info)
                latents.append(lat_flipped if flip else lat)
                if info.cond_path:  # not cached (as upstream): the same centred plan as the cached pixels
                    resized, box, _, _ = self.plan(info, info.size, None, for_cache=True)
                    mask = self.conditioning_mask(info, info.size, resized, box)
            else:
                img, mask, original, ltrb = self.load_pixels(info, rng)
                if info.subset.color_aug:
                    img = image_utils.color_aug(img, rng)
                if flip:
                    img = img[:, ::-1]
                images.append(image_utils.to_tensor(img))
            if mask is not None and flip:
                mask = torch.flip(mask, dims=[1])
            masks.append(mask)
            orig.append((int(original[1]), int(original[0])))
            # upstream's crop conditioning: the fit-inside box; a flipped image counts from the right edge
            crops.append(buckets_mod.crop_top_left(ltrb, info.bucket[0], flip))
            targets.append((info.bucket[1], info.bucket[0]))
            flips.append(flip)
            weights.append(self.prior_loss_weight if info.is_reg else 1.0)
            if self.te_cached:
                captions.append(self.base_caption(info))
                te_list.append(self._cached_te(info))
            else:
                captions.append(self.process_caption(info, epoch, rng))
            paths.append(info.path)
        te_outputs = None
        if te_list:
            te_outputs = {k: stack_padded([t[k] for t in te_list]) for k in te_list[0]}
        n = len(captions)
        return {
            "network_multipliers": torch.full((n,), float(self.params.network_multiplier)),
            "custom_attributes": [self.images[i].subset.custom_attributes or {} for i in batches[index]],
            "images": torch.stack(images) if images else None,
            "latents": torch.stack(latents) if latents else None,
            "captions": captions,
            "original_sizes_hw": torch.tensor(orig, dtype=torch.long),
            "crop_top_lefts": torch.tensor(crops, dtype=torch.long),
            "target_sizes_hw": torch.tensor(targets, dtype=torch.long),
            "flippeds": flips,
            "alpha_masks": _stack_masks(masks, targets),
            "loss_weights": torch.tensor(weights, dtype=torch.float32),
            "te_outputs": te_outputs,
            "image_paths": paths,
        }

    def _cached_latents(self, info: ImageInfo):
        if info.latents_npz:
            lat, original, ltrb, lat_flipped, mask = self.latent_format.load(info.latents_npz, info.bucket)
            return lat, lat_flipped, original, ltrb, mask
        return info.latents, info.latents_flipped, info.latents_original_size, info.latents_crop_ltrb, \
            info.alpha_mask

    def _cached_te(self, info: ImageInfo) -> dict:
        if info.te_npz:
            return self.te_format.load(info.te_npz)
        return info.te_outputs


def _resize_crop(img: np.ndarray, resized, box, interpolation) -> np.ndarray:
    img = image_utils.resize_image(img, resized, interpolation)
    left, top, right, bottom = box
    return img[top:bottom, left:right]


def _stack_masks(masks: list, targets_hw: list) -> Optional[torch.Tensor]:
    """[B, H, W] masks, or None when no image of the batch has one (others then count fully, as upstream)."""
    if all(m is None for m in masks):
        return None
    return torch.stack([m if m is not None else torch.ones(hw, dtype=torch.float32)
                        for m, hw in zip(masks, targets_hw)])


def _attach_conditioning_images(images: list[ImageInfo]) -> None:
    """Finds each image's mask in its subset's conditioning_data_dir; every image needs one (as upstream)."""
    missing: dict[str, list[str]] = defaultdict(list)
    for info in images:
        cond_dir = info.subset.conditioning_data_dir
        if not cond_dir:
            continue
        if not os.path.isdir(cond_dir):
            raise DatasetError(f"conditioning_data_dir does not exist: {cond_dir}")
        info.cond_path = find_conditioning_image(cond_dir, info.path)
        if info.cond_path is None:
            missing[cond_dir].append(os.path.basename(info.path))
    for cond_dir, names in missing.items():
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise DatasetError(f"conditioning_data_dir {cond_dir} has no mask image for {len(names)} training "
                           f"images ({shown}); it needs one image with the same name per training image")


# ----------------------------------------------------------------------------- the group


def balance_reg_images(images: list[ImageInfo]) -> None:
    """kohya's prior preservation balance: repeat reg images until they match the train images count
    (train images x repeats); the first pass uses each reg folder's own repeats."""
    train = sum(i.num_repeats for i in images if not i.is_reg)
    reg = [i for i in images if i.is_reg]
    if not reg:
        return
    counts = [0] * len(reg)
    n, first = 0, True
    while n < train:
        for k, info in enumerate(reg):
            step = info.num_repeats if first else 1
            counts[k] += step
            n += step
            if n >= train:
                break
        first = False
    for k, info in enumerate(reg):
        if counts[k] == 0:  # more reg images than train images: unused reg images are dropped
            info.num_repeats = 0
        else:
            info.num_repeats = counts[k]
    images[:] = [i for i in images if i.num_repeats > 0]


class DatasetGroup(torch.utils.data.Dataset):
    """All datasets of a run; item i is one whole batch (a dict, see docs/ARCHITECTURE.md)."""

    def __init__(self, datasets: list[ImageDataset], epoch_value, family: str = "sd1"):
        self.datasets = datasets
        self.family = family  # picks the latent cache file format (latent_cache.FAMILY_FORMATS)
        self._epoch = epoch_value
        self._offsets = np.cumsum([0] + [len(d) for d in datasets]).tolist()

    def __len__(self) -> int:
        return self._offsets[-1]

    def __getitem__(self, index: int) -> dict:
        if index < 0:
            index += len(self)
        if index < 0 or index >= len(self):
            raise IndexError(index)
        k = int(np.searchsorted(self._offsets, index, side="right")) - 1
        return self.datasets[k][index - self._offsets[k]]

    def verify_bucket_reso_steps(self, multiple: int) -> None:
        """Upstream's check before training: with buckets, bucket_reso_steps must be a multiple of the script's
        (64 for SD1.x/2.x, 32 for SDXL and the FLUX LoRA, 16 for the FLUX fine-tune). FLUX latents are packed in
        2x2 patches, so its sizes must also be multiples of 16 without buckets."""
        for d in self.datasets:
            p = d.params
            if p.enable_bucket and p.bucket_reso_steps % multiple:
                raise DatasetError(f"bucket_reso_steps is {p.bucket_reso_steps}: this script needs a multiple of "
                                   f"{multiple} (as upstream)")
            if self.family == "flux" and not p.enable_bucket and (p.resolution[0] % 16 or p.resolution[1] % 16):
                raise DatasetError(f"resolution {p.resolution[0]}x{p.resolution[1]}: FLUX.1 needs sides that are "
                                   "multiples of 16")

    @property
    def resolutions(self) -> list[tuple[int, int]]:
        """Each dataset's (width, height) resolution (upstream's get_resolutions)."""
        return [tuple(d.params.resolution) for d in self.datasets]

    def add_replacement(self, text: str, replacement: str | list[str]) -> None:
        """Every served caption gets `text` replaced (upstream's textual-inversion captions; captions.apply_replacements)."""
        for d in self.datasets:
            d.replacements[text] = replacement

    def set_current_epoch(self, epoch: int) -> None:
        """Reshuffles batches for `epoch` (also in persistent DataLoader workers: the value is shared)."""
        self._epoch.value = int(epoch)

    def set_current_step(self, step: int) -> None:
        """The optimizer step the next batches are for (token warm-up)."""
        for d in self.datasets:
            d._step.value = int(step)

    def set_max_train_steps(self, max_train_steps: int) -> None:
        for d in self.datasets:
            d._max_steps.value = int(max_train_steps)

    @property
    def num_train_images(self) -> int:
        return sum(d.num_train_images for d in self.datasets)

    @property
    def num_reg_images(self) -> int:
        return sum(d.num_reg_images for d in self.datasets)

    def all_images(self):
        for d in self.datasets:
            for info in d.images:
                yield d, info

    # --- latents
    def cache_latents(self, encode_fn: Callable[[torch.Tensor], torch.Tensor], to_disk: bool = False,
                      batch_size: int = 1, signature: str = "", fmt: Optional[LatentCacheFormat] = None,
                      skip_check: bool = False) -> None:
        """Encodes every image once (and its mirror when flip_aug) with encode_fn(images[B,3,H,W] in [-1,1])
        -> latents[B,C,h,w], `batch_size` images at a time (--vae_batch_size). to_disk writes upstream's cache
        files (latent_cache.py; `fmt` = the family's names and scale) and reuses them, ours or upstream's, when they
        fit the bucket, flip and alpha settings and `signature`; with skip_check (--skip_cache_check) any existing
        file is reused. alpha_mask subsets cache their masks with the latents."""
        for d, info in self.all_images():
            if info.subset.color_aug or info.subset.random_crop:
                raise DatasetError(latent_cache_conflict(info.subset))
        fmt = fmt or FAMILY_FORMATS.get(self.family, FAMILY_FORMATS["sd1"])
        npz_of = {info.path: fmt.npz_path(info.path, info.size) for _, info in self.all_images()}
        if to_disk:
            _check_unique_npz_paths([info.path for _, info in self.all_images()], npz_of.__getitem__)
        todo: dict[tuple, list] = defaultdict(list)
        reused = 0
        for d, info in self.all_images():
            info.latents = info.latents_flipped = info.alpha_mask = None
            info.latents_npz = None
            s = info.subset
            if to_disk and fmt.is_expected(npz_of[info.path], info.bucket, s.flip_aug, s.alpha_mask,
                                           skip_check=skip_check, signature=signature, image_path=info.path):
                info.latents_npz = npz_of[info.path]
                reused += 1
                continue
            todo[info.bucket].append((d, info))
        total = sum(len(v) for v in todo.values())
        logger.info("caching latents: %d images to encode, %d reused from disk", total, reused)
        step = max(1, int(batch_size or 1))
        with torch.no_grad():
            for bucket, items in sorted(todo.items(), key=lambda kv: kv[0][0] * kv[0][1]):
                for k in range(0, len(items), step):
                    chunk = items[k:k + step]
                    pixels, extras = [], []
                    for d, info in chunk:
                        img, mask, original, ltrb = d.load_pixels(info, None, for_cache=True)
                        pixels.append(image_utils.to_tensor(img))
                        extras.append((mask if info.subset.alpha_mask else None, original, ltrb))
                    batch = torch.stack(pixels)
                    lat = _check_encoded(encode_fn(batch), chunk)
                    lat_f = None
                    if any(info.subset.flip_aug for _, info in chunk):
                        lat_f = _check_encoded(encode_fn(torch.flip(batch, dims=[3])), chunk)
                    for j, (d, info) in enumerate(chunk):
                        mask, original, ltrb = extras[j]
                        one = lat[j].detach().to("cpu")
                        one_f = lat_f[j].detach().to("cpu") if lat_f is not None and info.subset.flip_aug else None
                        if to_disk:
                            info.latents_npz = npz_of[info.path]
                            fmt.save(info.latents_npz, info.bucket, one, original, ltrb, one_f, mask, signature)
                        else:
                            info.latents, info.latents_flipped, info.alpha_mask = one, one_f, mask
                            info.latents_original_size, info.latents_crop_ltrb = original, ltrb
        for d in self.datasets:
            d.latents_cached = True
            d.latent_format = fmt

    # --- text encoder outputs
    def cache_text_encoder_outputs(self, encode_fn: Callable[[list], dict], to_disk: bool = False,
                                   batch_size: Optional[int] = None, signature: str = "",
                                   skip_check: bool = False, fmt: Optional[TeCacheFormat] = None) -> None:
        """Encodes every caption once with encode_fn(captions) -> {name: Tensor[B, ...]}, `batch_size` captions at
        a time (default: the training batch size, as upstream). to_disk writes `fmt`'s files (te_cache.py: upstream's
        layout for SDXL and FLUX, default `<image>_te_outputs.npz` with the output names) and reuses them when the
        caption and `signature` (e.g. the model's name) match, or whenever one exists with skip_check."""
        fmt = fmt or TeCacheFormat()
        for _, info in self.all_images():
            if info.subset.caption_is_random:
                raise DatasetError(te_cache_conflict(info.subset))
            if info.subset.enable_wildcard and captions.has_wildcard(info.caption):
                # deliberate: upstream would cache the caption text with its '{a|b}' and line breaks as written
                raise DatasetError(f"{info.path}: its caption has several lines or '{{a|b}}' wildcards "
                                   "(enable_wildcard), so it changes every step and cannot be cached with "
                                   "--cache_text_encoder_outputs")
        if to_disk:
            _check_unique_npz_paths([info.path for _, info in self.all_images()], fmt.npz_path)
        todo = []
        for d, info in self.all_images():
            info.te_outputs, info.te_npz = None, None
            caption = ImageDataset.base_caption(info)
            if to_disk and fmt.is_expected(fmt.npz_path(info.path), caption, signature, skip_check):
                info.te_npz = fmt.npz_path(info.path)
                continue
            todo.append((info, caption))
        logger.info("caching text encoder outputs: %d captions to encode, %d reused from disk", len(todo),
                    sum(1 for _ in self.all_images()) - len(todo))
        with torch.no_grad():
            step = max(1, int(batch_size or max(d.params.batch_size for d in self.datasets)))
            for k in range(0, len(todo), step):
                chunk = todo[k:k + step]
                out = encode_fn([c for _, c in chunk])
                if not isinstance(out, dict) or not out:
                    raise DatasetError("text encoder encode_fn must return a non-empty dict of tensors")
                for name, t in out.items():
                    if not isinstance(t, torch.Tensor) or t.shape[0] != len(chunk):
                        raise DatasetError(
                            f"text encoder output {name!r} must be a tensor with batch size {len(chunk)} first")
                    if name.startswith("__"):
                        raise DatasetError(f"text encoder output name {name!r} may not start with '__'")
                for j, (info, caption) in enumerate(chunk):
                    one = {name: t[j].detach().to("cpu") for name, t in out.items()}
                    if to_disk:
                        info.te_npz = fmt.npz_path(info.path)
                        fmt.save(info.te_npz, one, caption, signature)
                    else:
                        info.te_outputs = one
        for d in self.datasets:
            d.te_cached = True
            d.te_format = fmt

    # --- ss_* metadata
    def metadata(self) -> dict:
        """kohya ss_* keys, all values strings."""
        first = self.datasets[0].params
        dirs, tag_freq = {}, {}
        bucket_counts: Counter = Counter()
        ar_errors = []
        for d in self.datasets:
            for reso, idx in d.buckets.items():
                bucket_counts[reso] += sum(d.images[i].num_repeats for i in idx)
            ar_errors.extend([d.mean_ar_error] * len(d.images))
            by_subset = defaultdict(list)
            for info in d.images:
                by_subset[id(info.subset)].append(info)
            for infos in by_subset.values():
                s = infos[0].subset
                entry = dirs.setdefault(s.name, {"n_repeats": s.num_repeats, "img_count": 0})
                entry["img_count"] += len(infos)
                freq = tag_freq.setdefault(s.name, {})
                for info in infos:  # upstream: lower-cased tags; of the metadata tags for fine-tuning subsets
                    text = (info.tags or "") if s.metadata_file else info.caption
                    for tag in text.split(","):
                        tag = tag.strip().lower()
                        if tag:
                            freq[tag] = freq.get(tag, 0) + 1
        buckets = {
            str(k): {"resolution": list(reso), "count": n} for k, (reso, n) in enumerate(sorted(bucket_counts.items()))
        }
        subsets = [s for d in self.datasets for s in d.params.subsets]

        def any_of(attr):
            return str(any(getattr(s, attr) for s in subsets))

        md = {
            "ss_num_train_images": str(self.num_train_images),
            "ss_num_reg_images": str(self.num_reg_images),
            "ss_num_batches_per_epoch": str(len(self)),
            "ss_dataset_dirs": json.dumps(dirs),
            "ss_bucket_info": json.dumps({
                "buckets": buckets,
                "mean_img_ar_error": float(np.mean(ar_errors)) if ar_errors else 0.0,
            }),
            "ss_tag_frequency": json.dumps(tag_freq),
            "ss_resolution": str(tuple(first.resolution)),
            "ss_enable_bucket": str(first.enable_bucket),
            "ss_min_bucket_reso": str(first.min_bucket_reso),
            "ss_max_bucket_reso": str(first.max_bucket_reso),
            "ss_bucket_no_upscale": str(first.bucket_no_upscale),
            "ss_keep_tokens": str(max((s.keep_tokens for s in subsets), default=0)),
            "ss_shuffle_caption": any_of("shuffle_caption"),
            "ss_caption_dropout_rate": str(max((s.caption_dropout_rate for s in subsets), default=0.0)),
            "ss_caption_dropout_every_n_epochs": str(max((s.caption_dropout_every_n_epochs for s in subsets),
                                                         default=0)),
            "ss_caption_tag_dropout_rate": str(max((s.caption_tag_dropout_rate for s in subsets), default=0.0)),
            "ss_flip_aug": any_of("flip_aug"),
            "ss_color_aug": any_of("color_aug"),
            "ss_random_crop": any_of("random_crop"),
        }
        if len(self.datasets) > 1:
            md["ss_datasets"] = json.dumps([
                {
                    "resolution": list(d.params.resolution),
                    "batch_size": d.params.batch_size,
                    "enable_bucket": d.params.enable_bucket,
                    "num_train_images": d.num_train_images,
                    "num_reg_images": d.num_reg_images,
                    "subsets": [{"image_dir": s.name, "num_repeats": s.num_repeats, "is_reg": s.is_reg}
                                for s in d.params.subsets],
                }
                for d in self.datasets
            ])
        return md

    def log_summary(self) -> None:
        for k, d in enumerate(self.datasets):
            logger.info("[dataset %d] %d train images with repeats, %d reg images, batch size %d, %d batches",
                        k, d.num_train_images, d.num_reg_images, d.params.batch_size, len(d))
            for reso, idx in d.buckets.items():
                logger.info("  bucket %s: %d images (%d with repeats)", reso, len(idx),
                            sum(d.images[i].num_repeats for i in idx))
            if d.params.enable_bucket:
                logger.info("  mean aspect-ratio error: %.4f", d.mean_ar_error)


def debug_dataset(group: DatasetGroup, epoch: int = 1) -> None:
    """--debug_dataset: logs every batch of `epoch` as training would see it (upstream shows the images in a
    window on Windows and loops over epochs until a key is pressed; here one epoch is logged and the run ends)."""
    group.set_current_epoch(epoch)
    group.set_current_step(0)
    logger.info("debug_dataset: %d batches in epoch %d", len(group), epoch)
    for k in range(len(group)):
        b = group[k]
        logger.info("batch %d/%d", k + 1, len(group))
        for j, path in enumerate(b["image_paths"]):
            shape = tuple(b["images"][j].shape) if b["images"] is not None else tuple(b["latents"][j].shape)
            logger.info("  %s: %s, loss weight %.3g, caption: %r, original size (h, w) %s, crop top left %s, "
                        "target size %s, network multiplier %.3g, custom attributes %s", path, shape,
                        float(b["loss_weights"][j]), b["captions"][j], tuple(b["original_sizes_hw"][j].tolist()),
                        tuple(b["crop_top_lefts"][j].tolist()), tuple(b["target_sizes_hw"][j].tolist()),
                        float(b["network_multipliers"][j]), b["custom_attributes"][j])


def latent_cache_conflict(subset: SubsetParams) -> str:
    opts = [o for o in ("color_aug", "random_crop") if getattr(subset, o)]
    return (f"{' and '.join(opts)} cannot be used with --cache_latents / --cache_latents_to_disk "
            f"(subset {subset.name}): cached latents are computed once from fixed pixels. "
            "Turn off the augmentation or the latent cache (flip_aug is allowed: both flips are cached).")


def te_cache_conflict(subset: SubsetParams) -> str:
    opts = [o for o in ("shuffle_caption", "caption_dropout_rate", "caption_dropout_every_n_epochs",
                        "caption_tag_dropout_rate", "token_warmup_step") if getattr(subset, o)]
    return (f"{', '.join(opts)} cannot be used with --cache_text_encoder_outputs (subset {subset.name}): "
            "cached text-encoder outputs need fixed captions. Turn off caption shuffling/dropout/warm-up "
            "or the text-encoder cache.")


def _check_unique_npz_paths(paths: list[str], to_npz: Callable[[str], str]) -> None:
    seen = {}
    for p in paths:
        npz = to_npz(p)
        if npz in seen and seen[npz] != p:
            raise DatasetError(f"images {seen[npz]} and {p} would share the cache file {npz}; rename one of them")
        seen[npz] = p


def _check_encoded(latents, chunk: list) -> torch.Tensor:
    n = len(chunk)
    if not isinstance(latents, torch.Tensor) or latents.ndim != 4 or latents.shape[0] != n:
        shape = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
        raise DatasetError(f"latent encode_fn must return a tensor [B={n}, C, h, w]; got {shape}")
    if torch.isnan(latents).any():  # as upstream's caching; training then never checks cached latents again
        bad = [info.path for (_, info), lat in zip(chunk, latents) if torch.isnan(lat).any()]
        raise DatasetError(f"NaN in the latents of {', '.join(bad)}: the VAE overflowed; try --no_half_vae")
    return latents


def new_epoch_value():
    """The shared current-epoch counter (inherited by DataLoader workers)."""
    return multiprocessing.Value("i", 0)


def stack_padded(tensors: list) -> torch.Tensor:
    """torch.stack; cached text-encoder outputs of different lengths (HunyuanImage's Qwen2.5-VL tokens, padded to
    each caption's own length) are right-padded with zeros first (a zero mask = padding)."""
    if all(t.shape == tensors[0].shape for t in tensors):
        return torch.stack(tensors)
    n = max(t.shape[0] for t in tensors)
    return torch.stack([torch.nn.functional.pad(t, (0, 0) * (t.ndim - 1) + (0, n - t.shape[0])) for t in tensors])


def collate_one(items: list) -> dict:
    """collate_fn for batch_size=1: our items already are whole batches."""
    return items[0]


def make_dataloader(group: DatasetGroup, num_workers: int = 8, persistent_workers: bool = False,
                    shuffle: bool = True) -> torch.utils.data.DataLoader:
    """DataLoader over whole batches (kohya: workers = min(--max_data_loader_n_workers, cpu count)).
    Uses batch_size=1 + collate_one rather than batch_size=None so that accelerate can shard it
    across processes (its BatchSamplerShard needs a batch sampler)."""
    n = max(0, min(int(num_workers), os.cpu_count() or 1))
    return torch.utils.data.DataLoader(
        group, batch_size=1, shuffle=shuffle, collate_fn=collate_one, num_workers=n,
        persistent_workers=persistent_workers and n > 0)

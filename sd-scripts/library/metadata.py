"""What a saved model says about itself: the `ss_*` training metadata of LoRA files (the keys kohya-ss/sd-scripts'
train_network.py writes, read by A1111/Forge, CivitAI and the additional-networks extension) and the
`modelspec.*` keys (Stability AI's ModelSpec 1.0.1, read by ComfyUI / A1111 / CivitAI), with the
`--metadata_*` options that fill them.

    add_metadata_arguments(parser)           --metadata_title ... --metadata_is_negative_embedding (every trainer)
    modelspec_metadata(args, family=, lora=, v_prediction=, flux_variant=) -> {"modelspec.*": str}
    network_metadata(args, ...) -> {"ss_*": str}    the LoRA trainers' training metadata
    minimum_network_metadata(md)             what --no_metadata still writes (upstream's minimum keys)
    file_hashes(path) -> (legacy 8-hex hash, sha256)  ss_sd_model_hash / ss_new_sd_model_hash of the base model
    start_file_hashes(*paths)                those hashes in a child process, started once the models are loaded
    file_hash_metadata(args) -> {"ss_*hash": str}   the model/VAE hash keys, added at save time
    model_hashes(tensors, metadata) -> (sshs_model_hash, sshs_legacy_hash)   of a saved LoRA file

Values follow upstream: every key upstream always writes is written (None as the text "None"), the keys upstream
writes only in some cases (ss_network_args, the model/VAE hashes, ss_datasets with --dataset_config, ...) only then.
"""
from __future__ import annotations

import argparse
import atexit
import base64
import concurrent.futures
import datetime
import functools
import hashlib
import json
import logging
import mimetypes
import os
import subprocess
import sys
import threading
import time
from typing import Any

from library import file_hash

logger = logging.getLogger(__name__)

# --metadata_<name> -> modelspec.<name>; the first five are ModelSpec's "should" fields, the rest optional ones
METADATA_FIELDS = ("title", "author", "description", "license", "tags", "usage_hint", "thumbnail", "merged_from",
                   "trigger_phrase", "preprocessor", "is_negative_embedding")
_METADATA_HELP = {
    "title": "model title in the modelspec metadata (default: --output_name)",
    "author": "author name in the modelspec metadata",
    "description": "model description in the modelspec metadata",
    "license": "license in the modelspec metadata",
    "tags": "tags in the modelspec metadata, separated by commas",
    "usage_hint": "usage hint in the modelspec metadata",
    "thumbnail": "thumbnail image in the modelspec metadata: a data URL, or an image file (stored as a data URL)",
    "merged_from": "source models of a merged model, in the modelspec metadata",
    "trigger_phrase": "trigger phrase in the modelspec metadata",
    "preprocessor": "preprocessor used, in the modelspec metadata",
    "is_negative_embedding": "whether this is a negative embedding, in the modelspec metadata",
}

MODELSPEC_VERSION = "1.0.1"
IMPL_STABILITY_AI = "https://github.com/Stability-AI/generative-models"
IMPL_DIFFUSERS = "diffusers"
IMPL_FLUX = "https://github.com/black-forest-labs/flux"
IMPL_CHROMA = "https://huggingface.co/lodestones/Chroma"
IMPL_LUMINA = "https://github.com/Alpha-VLLM/Lumina-Image-2.0"
IMPL_ANIMA = "https://huggingface.co/circlestone-labs/Anima"

# the keys of a network (a full checkpoint has none of them)
NETWORK_KEYS = ("ss_text_encoder_lr", "ss_unet_lr", "ss_network_module", "ss_network_dim", "ss_network_alpha",
                "ss_network_dropout", "ss_network_args")
# what --no_metadata still writes (upstream: SS_METADATA_MINIMUM_KEYS, so tools can filter LoRAs by base model)
MINIMUM_KEYS = ("ss_v2", "ss_base_model_version", "ss_network_module", "ss_network_dim", "ss_network_alpha",
                "ss_network_args")


def add_comment_arguments(parser: argparse.ArgumentParser, *, lora: bool) -> None:
    """--no_metadata (a LoRA keeps upstream's minimum keys) and --training_comment."""
    parser.add_argument("--no_metadata", action="store_true",
                        help="write only the minimum ss_* keys (base model, network) and the modelspec keys" if lora
                        else "write no ss_*/modelspec metadata")
    parser.add_argument("--training_comment", type=str, default=None, help="ss_training_comment metadata")


def add_metadata_arguments(parser: argparse.ArgumentParser) -> None:
    for name in METADATA_FIELDS:
        parser.add_argument(f"--metadata_{name}", type=str, default=None, help=_METADATA_HELP[name])


# ----------------------------------------------------------------------------------------------------------
# modelspec


def architecture(family: str, *, v_prediction: bool, lora: bool, flux_variant: str | None = None) -> str:
    """ModelSpec architecture id: stable-diffusion-v1, -v2-512, -v2-768-v, -xl-v1-base, flux-1-dev/-schnell;
    a LoRA gets "/lora" appended."""
    if family == "sdxl":
        arch = "stable-diffusion-xl-v1-base"
    elif family == "flux":
        arch = {"dev": "flux-1-dev", "schnell": "flux-1-schnell", "chroma": "chroma"}.get(flux_variant or "", "flux-1")
    elif family == "sd3":  # upstream: "stable-diffusion-3-" + the model type (medium, 5-medium, 5-large)
        arch = f"stable-diffusion-3-{flux_variant or 'medium'}"
    elif family == "lumina":
        arch = "lumina-2"
    elif family == "hunyuan_image":
        arch = "hunyuan-image-2.1"
    elif family == "anima":
        arch = "anima-preview"  # upstream: anima="preview"
    elif family == "sd2":
        arch = "stable-diffusion-v2-768-v" if v_prediction else "stable-diffusion-v2-512"
    else:
        arch = "stable-diffusion-v1"
    return arch + "/lora" if lora else arch


def implementation(family: str, *, lora: bool, flux_variant: str | None = None) -> str:
    """Upstream: FLUX -> BFL's repo (Chroma -> lodestones/Chroma); SDXL LoRAs and every full checkpoint (SGM/LDM keys) -> Stability AI's
    generative-models; SD1/SD2 LoRAs -> "diffusers"."""
    if family == "flux":
        return IMPL_CHROMA if flux_variant == "chroma" else IMPL_FLUX
    if family == "lumina":
        return IMPL_LUMINA
    if family == "anima":
        return IMPL_ANIMA
    if not lora or family == "sdxl":
        return IMPL_STABILITY_AI
    return IMPL_DIFFUSERS


def _resolution(args, family: str, v_prediction: bool) -> str:
    value = getattr(args, "resolution", None)
    if value:
        from library.config_util import parse_resolution

        w, h = parse_resolution(value, "--resolution")
    else:  # upstream's defaults (not our training default for SD2 without v-prediction)
        w = h = 1024 if family in ("sdxl", "flux", "sd3", "lumina", "anima") else 768 if family == "sd2" and v_prediction else 512
    return f"{w}x{h}"


def thumbnail_data_url(value: str) -> str | None:
    """A data URL as given; a file path becomes a data URL of its bytes; a missing file is skipped (warning)."""
    if value.startswith("data:"):
        return value
    if not os.path.isfile(value):
        logger.warning("--metadata_thumbnail: file not found, not stored: %s", value)
        return None
    mime = mimetypes.guess_type(value)[0] or "application/octet-stream"
    with open(value, "rb") as f:
        return f"data:{mime};base64,{base64.b64encode(f.read()).decode('ascii')}"


@functools.lru_cache(maxsize=1)
def git_revision() -> str | None:
    """The commit of this checkout (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def modelspec_metadata(args, *, family: str, lora: bool, v_prediction: bool, flux_variant: str | None = None,
                       timestamp: float | None = None) -> dict[str, str]:
    """The modelspec.* keys upstream's sai_model_spec.build_metadata writes for these options."""
    timestamp = time.time() if timestamp is None else timestamp
    title = getattr(args, "metadata_title", None) or getattr(args, "output_name", None)
    if title is None:
        title = f"{'LoRA' if lora else 'Checkpoint'}@{timestamp}"
    md = {
        "modelspec.sai_model_spec": MODELSPEC_VERSION,
        "modelspec.architecture": architecture(family, v_prediction=v_prediction, lora=lora, flux_variant=flux_variant),
        "modelspec.implementation": implementation(family, lora=lora, flux_variant=flux_variant),
        "modelspec.title": title,
        "modelspec.resolution": _resolution(args, family, v_prediction),
        "modelspec.date": datetime.datetime.fromtimestamp(int(timestamp)).isoformat(),
        "modelspec.implementation_version": f"sd-scripts/{git_revision() or 'unknown'}",
    }
    if family != "flux":  # FLUX files carry no prediction type
        md["modelspec.prediction_type"] = "v" if v_prediction else "epsilon"
    min_t, max_t = getattr(args, "min_timestep", None), getattr(args, "max_timestep", None)
    if min_t is not None or max_t is not None:
        md["modelspec.timestep_range"] = f"{0 if min_t is None else min_t},{1000 if max_t is None else max_t}"
    if getattr(args, "clip_skip", None) is not None:
        md["modelspec.encoder_layer"] = str(args.clip_skip)
    for name in METADATA_FIELDS[1:]:
        value = getattr(args, f"metadata_{name}", None)
        if value is None:
            continue
        if name == "thumbnail":
            value = thumbnail_data_url(value)
            if value is None:
                continue
        md[f"modelspec.{name}"] = str(value)
    return md


# ----------------------------------------------------------------------------------------------------------
# ss_* training metadata


# (path, size, mtime) -> Future of file_hashes' answer: started by start_file_hashes or the first file_hashes call
_HASHES: dict[tuple, concurrent.futures.Future] = {}


def _hash_key(path) -> tuple:
    st = os.stat(path)
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


def start_file_hashes(*paths) -> None:
    """Start hashing these files (the base model, the VAE) in a child process; file_hashes then waits only for what
    is left. The full sha256 of a 7-23 GB checkpoint takes 5-20 s, which the trainers used to spend before their
    first step; the hashes are needed only at the first save. A child, not a thread: a thread took the GIL back after
    each 1 MiB read, slowing the compiled first steps it overlapped (FLUX.1's warm restart: docs/BENCHMARKS.md,
    session 21)."""
    for path in paths:
        if not path or not os.path.isfile(path) or (key := _hash_key(path)) in _HASHES:
            continue
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work(path=path, future=future):
            try:
                future.set_result(_hash_in_child(path))
            except BaseException as e:  # noqa: BLE001 - given to whoever asks for the hashes
                future.set_exception(e)

        _HASHES[key] = future
        threading.Thread(target=work, name="file-hashes", daemon=True).start()


def _hash_in_child(path: str) -> tuple[str, str]:
    """library.file_hash run by this Python (-I -S: no site packages, only the standard library); where it cannot
    run or answers nothing usable, the hashes are computed here. A run that ends before it answers stops it."""
    try:
        with subprocess.Popen([sys.executable, "-I", "-S", file_hash.__file__, path], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as child:
            _HASHING_CHILDREN.add(child)
            try:
                out, _ = child.communicate()
            finally:
                _HASHING_CHILDREN.discard(child)
        legacy, full = out.split()
        if child.returncode == 0 and len(legacy) == 8 and len(full) == 64:
            return legacy, full
    except (OSError, ValueError):
        pass
    return file_hash.hash_file(path)


_HASHING_CHILDREN: set[subprocess.Popen] = set()


@atexit.register
def _stop_hashing_children() -> None:
    for child in list(_HASHING_CHILDREN):
        child.kill()


def file_hashes(path: str) -> tuple[str, str]:
    """(ss_sd_model_hash, ss_new_sd_model_hash) as upstream computes them: the first 8 hex digits of sha256 over
    64 KiB at offset 1 MiB (A1111's old hash), and sha256 of the whole file; a folder gives "IsADirectory".
    Kept per file for the process (a run saves many times)."""
    if os.path.isdir(path):
        return "IsADirectory", "IsADirectory"
    if not os.path.isfile(path):
        return "NOFILE", "NOFILE"
    if (future := _HASHES.get(key := _hash_key(path))) is None:
        future = concurrent.futures.Future()
        future.set_result(file_hash.hash_file(path))
        _HASHES[key] = future
    return future.result()


def _subset_dir(subset) -> str:
    return os.path.basename(str(getattr(subset, "image_dir", None) or getattr(subset, "name", "") or ""))


def _dirs_info(datasets, reg: bool) -> dict:
    """{folder name: {"n_repeats", "img_count"}} of the (reg or non-reg) subsets, names made unique as upstream."""
    from collections import Counter

    counts: Counter = Counter()
    subsets = {}
    for d in datasets:
        for info in d.images:
            counts[id(info.subset)] += 1
            subsets[id(info.subset)] = info.subset
        for s in d.params.subsets:
            subsets.setdefault(id(s), s)
    out: dict[str, dict] = {}
    for key, s in subsets.items():
        if bool(getattr(s, "is_reg", False)) != reg:
            continue
        meta_file = getattr(s, "metadata_file", None)  # fine-tuning subsets are named by their metadata file
        name = os.path.basename(str(meta_file)) if meta_file else _subset_dir(s)
        unique, i = name, 2
        while unique in out:
            unique, i = f"{name} ({i})", i + 1
        out[unique] = {"n_repeats": s.num_repeats, "img_count": counts[key]}
    return out


def datasets_metadata(group) -> list[dict]:
    """ss_datasets (written with --dataset_config): per dataset and subset, the fields upstream lists."""
    from library.datasets import DatasetGroup

    out = []
    for d in group.datasets:
        p = d.params
        stats = DatasetGroup([d], None).metadata()  # this dataset's tag frequency and buckets
        subsets = []
        counts = {}
        for info in d.images:
            counts[id(info.subset)] = counts.get(id(info.subset), 0) + 1
        is_dreambooth = not any(getattr(s, "metadata_file", None) for s in p.subsets)
        for s in p.subsets:
            entry = {
                "img_count": counts.get(id(s), 0),
                "num_repeats": s.num_repeats,
                "color_aug": bool(s.color_aug),
                "flip_aug": bool(s.flip_aug),
                "random_crop": bool(s.random_crop),
                "shuffle_caption": bool(s.shuffle_caption),
                "keep_tokens": s.keep_tokens,
                "keep_tokens_separator": getattr(s, "keep_tokens_separator", ""),
                "secondary_separator": getattr(s, "secondary_separator", None),
                "enable_wildcard": bool(getattr(s, "enable_wildcard", False)),
                "caption_prefix": s.caption_prefix,
                "caption_suffix": s.caption_suffix,
                "resize_interpolation": getattr(s, "resize_interpolation", None),
            }
            if getattr(s, "image_dir", None):
                entry["image_dir"] = _subset_dir(s)
            if is_dreambooth:
                entry["class_tokens"] = s.class_tokens
                entry["is_reg"] = bool(s.is_reg)
            else:
                entry["metadata_file"] = os.path.basename(str(s.metadata_file))
            subsets.append(entry)
        out.append({
            "is_dreambooth": is_dreambooth,
            "batch_size_per_device": p.batch_size,
            "num_train_images": d.num_train_images,
            "num_reg_images": d.num_reg_images,
            "resolution": list(p.resolution),
            "enable_bucket": bool(p.enable_bucket),
            "min_bucket_reso": p.min_bucket_reso,
            "max_bucket_reso": p.max_bucket_reso,
            "tag_frequency": json.loads(stats["ss_tag_frequency"]),
            "bucket_info": json.loads(stats["ss_bucket_info"]),
            "resize_interpolation": getattr(p, "resize_interpolation", None),
            "subsets": subsets,
        })
    return out


def _face_crop_range(value):
    """"2.0,4.0" -> (2.0, 4.0): upstream writes the parsed pair ("(2.0, 4.0)")."""
    from library.image_utils import parse_face_crop_aug_range

    return parse_face_crop_aug_range(value, "--face_crop_aug_range")


def network_metadata(args, *, group, session_id: int, started_at: float, opt_class: str, num_batches: int,
                     num_epochs: int, max_train_steps: int, total_batch_size: int, base_model_version: str,
                     network_dim, text_encoder_lr) -> dict[str, str]:
    """The ss_* keys upstream's train_network.py writes for these options, except those of the loss, noise and
    validation options (losses.metadata, noise.metadata, validation.metadata) and the family's (the trainer's
    update_metadata). All values are text; None is written as "None", as upstream does."""
    from library import optimizers, schedulers

    g = functools.partial(getattr, args)
    # Adafactor with relative_step uses no learning rate: upstream writes None for the rates (the LoRA groups
    # always carry one) and "adafactor:<--learning_rate>" for the scheduler
    no_lr = optimizers.adafactor_relative_step(args)
    md: dict[str, Any] = {
        "ss_session_id": session_id,
        "ss_training_started_at": started_at,
        "ss_output_name": args.output_name,
        "ss_learning_rate": None if no_lr else args.learning_rate,
        "ss_text_encoder_lr": None if no_lr else text_encoder_lr,
        "ss_unet_lr": None if no_lr else g("unet_lr", None),
        "ss_num_train_images": group.num_train_images,
        "ss_num_reg_images": group.num_reg_images,
        "ss_num_batches_per_epoch": num_batches,
        "ss_num_epochs": num_epochs,
        "ss_gradient_checkpointing": args.gradient_checkpointing,
        "ss_gradient_accumulation_steps": args.gradient_accumulation_steps,
        "ss_max_train_steps": max_train_steps,
        "ss_lr_warmup_steps": args.lr_warmup_steps,
        "ss_lr_scheduler": schedulers.metadata_value(args),
        "ss_network_module": g("network_module", None),
        "ss_network_dim": network_dim,
        "ss_network_alpha": g("network_alpha", None),
        "ss_network_dropout": g("network_dropout", None),
        "ss_mixed_precision": args.mixed_precision,
        "ss_full_fp16": bool(g("full_fp16", False)),
        "ss_v2": bool(g("v2", False)),
        "ss_base_model_version": base_model_version,
        "ss_clip_skip": g("clip_skip", None),
        "ss_max_token_length": g("max_token_length", None),
        "ss_cache_latents": bool(g("cache_latents", False) or g("cache_latents_to_disk", False)),
        "ss_seed": g("seed", None),
        "ss_lowram": g("lowram", False),
        "ss_training_comment": g("training_comment", None),
        "ss_sd_scripts_commit_hash": git_revision() or "(unknown)",
        "ss_optimizer": optimizers.metadata_value(opt_class, args),
        "ss_max_grad_norm": args.max_grad_norm,
        "ss_caption_dropout_rate": g("caption_dropout_rate", 0.0),
        "ss_caption_dropout_every_n_epochs": g("caption_dropout_every_n_epochs", 0),
        "ss_caption_tag_dropout_rate": g("caption_tag_dropout_rate", 0.0),
        "ss_face_crop_aug_range": _face_crop_range(g("face_crop_aug_range", None)),
        "ss_prior_loss_weight": g("prior_loss_weight", 1.0),
        "ss_scale_weight_norms": g("scale_weight_norms", None),
        "ss_fp8_base": bool(g("fp8_base", False)),
        "ss_fp8_base_unet": bool(g("fp8_base_unet", False)),
        "ss_resize_interpolation": g("resize_interpolation", None),
    }
    dataset_md = dict(group.metadata())
    dataset_md.pop("ss_datasets", None)
    md.update(dataset_md)
    if g("dataset_config", None):
        # upstream: with a dataset config the per-dataset settings go into ss_datasets
        md["ss_datasets"] = json.dumps(datasets_metadata(group))
        md["ss_dataset_dirs"] = json.dumps(_dirs_info(group.datasets, reg=False))
    else:
        md["ss_batch_size_per_device"] = args.train_batch_size
        md["ss_total_batch_size"] = total_batch_size
        md["ss_dataset_dirs"] = json.dumps(_dirs_info(group.datasets, reg=False))
        md["ss_reg_dataset_dirs"] = json.dumps(_dirs_info(group.datasets, reg=True))
    if g("network_args", None):
        from library.network_options import parse_network_args

        md["ss_network_args"] = json.dumps(parse_network_args(args.network_args))
    for option, key in HASHED_FILES:
        if (value := g(option, None)) is not None:  # an existing file or folder by its name, else as given
            name = str(value)
            md[f"ss_{key}_name"] = os.path.basename(name.rstrip("/\\")) if os.path.exists(name) else name
    return {k: v if isinstance(v, str) else str(v) for k, v in md.items()}


# option -> the ss_* key stem of its file's name and hashes (ss_sd_model_name, ss_sd_model_hash, ss_new_sd_model_hash)
HASHED_FILES = (("pretrained_model_name_or_path", "sd_model"), ("vae", "vae"))


def file_hash_metadata(args) -> dict[str, str]:
    """The base model's and VAE's hashes (upstream writes them for existing files only), added at each save: the
    first one waits for what the thread of start_file_hashes has left, later ones reuse the result."""
    md = {}
    for option, key in HASHED_FILES:
        path = getattr(args, option, None)
        if path is not None and os.path.exists(str(path)):
            md[f"ss_{key}_hash"], md[f"ss_new_{key}_hash"] = file_hashes(str(path))
    return md


def minimum_network_metadata(md: dict[str, str]) -> dict[str, str]:
    """--no_metadata: only the keys tools filter LoRAs by (upstream's minimum metadata)."""
    return {k: md[k] for k in MINIMUM_KEYS if k in md}


# ----------------------------------------------------------------------------------------------------------
# sshs_* hashes (the ones A1111's additional-networks and kohya write)


def _safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().contiguous() for k, v in tensors.items()}, metadata)


def model_hashes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[str, str]:
    """(sshs_model_hash, sshs_legacy_hash) of the file these tensors make with their `ss_*` metadata only:
    sha256 of the data after the header, and the first 8 hex digits of sha256 of 64 KiB at offset 1 MiB."""
    blob = _safetensors_bytes(tensors, {k: v for k, v in metadata.items() if k.startswith("ss_")})
    header_len = int.from_bytes(blob[:8], "little")
    model_hash = hashlib.sha256(blob[8 + header_len:]).hexdigest()
    legacy_hash = hashlib.sha256(blob[0x100000:0x110000]).hexdigest()[:8]
    return model_hash, legacy_hash

"""Dataset configuration: the kohya dataset flags, --dataset_config TOML, and `build_dataset_group`.

Sources, highest priority first: a [[datasets.subsets]] entry, its [[datasets]] entry, [general], the
command-line flags, then kohya's defaults. Without --dataset_config the dataset comes from
--train_data_dir (`N_name` folders, N = repeats) plus --reg_data_dir, or --in_json (fine-tune metadata).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import os
import re
from typing import Any

from library import captions, image_utils
from library.buckets import adjust_min_max_bucket_reso
from library.input_files import MAX_PROBLEMS, capped
from library.datasets import (
    DatasetError,
    DatasetGroup,
    DatasetParams,
    ImageDataset,
    SubsetParams,
    balance_reg_images,
    images_from_dir,
    images_from_metadata,
    is_image_file,
    latent_cache_conflict,
    new_epoch_value,
    te_cache_conflict,
)

logger = logging.getLogger(__name__)

__all__ = ["add_dataset_arguments", "build_dataset_group", "build_dataset_groups", "load_dataset_config", "parse_resolution",
           "DatasetError", "FAMILY_DEFAULT_RESOLUTION"]

# Default --resolution when neither the CLI nor the dataset config sets one.
FAMILY_DEFAULT_RESOLUTION = {"sd1": 512, "sd2": 768, "sdxl": 1024, "flux": 1024, "sd3": 1024,
                             "lumina": 1024, "hunyuan_image": 1024, "anima": 1024}
_FAMILY_ALIASES = {"sd15": "sd1", "sd1x": "sd1", "sd1.x": "sd1", "v1": "sd1", "sd2x": "sd2", "sd2.x": "sd2",
                   "v2": "sd2", "flux1": "flux", "flux.1": "flux"}

_FOLDER_RE = re.compile(r"^(\d+)_(.*)$")


def add_dataset_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The kohya dataset flags (same names and defaults as sd-scripts)."""
    g = parser.add_argument_group("dataset")
    g.add_argument("--train_data_dir", type=str, default=None,
                   help="folder of training images in 'N_name' subfolders (N = repeats), or the image folder for --in_json")
    g.add_argument("--reg_data_dir", type=str, default=None,
                   help="regularization images in 'N_class' subfolders (DreamBooth prior preservation)")
    g.add_argument("--dataset_config", type=str, default=None,
                   help="dataset TOML: [general], [[datasets]], [[datasets.subsets]] (overrides the folder flags)")
    g.add_argument("--in_json", type=str, default=None,
                   help="fine-tune metadata JSON {image_key: {caption, tags}} (see finetune/merge_captions_to_metadata.py)")
    g.add_argument("--resolution", type=str, default=None,
                   help="training resolution 'W,H' or 'N' (default by model: 512 SD1, 768 SD2, 1024 SDXL/FLUX)")
    g.add_argument("--enable_bucket", action="store_true", help="aspect-ratio buckets")
    g.add_argument("--min_bucket_reso", type=int, default=256, help="smallest bucket side")
    g.add_argument("--max_bucket_reso", type=int, default=1024, help="largest bucket side")
    g.add_argument("--bucket_reso_steps", type=int, default=64, help="bucket sides are multiples of this")
    g.add_argument("--bucket_no_upscale", action="store_true",
                   help="one bucket per image size, never upscaling small images")
    g.add_argument("--flip_aug", action="store_true", help="random horizontal flips")
    g.add_argument("--color_aug", action="store_true", help="random hue shifts (not with latent caching)")
    g.add_argument("--random_crop", action="store_true", help="random instead of center crop (not with latent caching)")
    g.add_argument("--train_batch_size", type=int, default=1, help="batch size")
    g.add_argument("--max_data_loader_n_workers", type=int, default=8,
                   help="DataLoader worker processes (capped at the CPU count; 0 = load in the main process)")
    g.add_argument("--persistent_data_loader_workers", action="store_true",
                   help="keep DataLoader workers between epochs")
    g.add_argument("--dataset_repeats", type=int, default=1, help="repeats of the --in_json dataset")
    g.add_argument("--prior_loss_weight", type=float, default=1.0, help="loss weight of regularization images")
    g.add_argument("--cache_latents", action="store_true", help="encode images with the VAE once, in memory")
    g.add_argument("--cache_latents_to_disk", action="store_true",
                   help="cache latents in <image>.npz next to each image and reuse them on later runs")
    g.add_argument("--cache_text_encoder_outputs", action="store_true",
                   help="encode captions once (needs captions without shuffle/dropout)")
    g.add_argument("--cache_text_encoder_outputs_to_disk", action="store_true",
                   help="cache text encoder outputs in <image>_te_outputs.npz and reuse them")
    g.add_argument("--class_tokens", type=str, default=None,
                   help="caption of DreamBooth-style images without a caption file when their folder name "
                        "gives none ('N_' folders; not an upstream option)")
    g.add_argument("--debug_dataset", action="store_true",
                   help="print every batch of the first epoch (images, sizes, crops, captions as served) and "
                        "stop without loading a model or training")
    captions.add_caption_arguments(parser)
    add_image_arguments(g)
    return parser


def add_image_arguments(g) -> None:
    """Image loading and latent caching flags (upstream's add_dataset_arguments has them in all seven scripts)."""
    g.add_argument("--face_crop_aug_range", type=str, default=None,
                   help="without buckets: crop around the face given in file names '<name>_<cx>_<cy>_<w>_<h>', "
                        "scaled so the face spans 1/high..1/low of the image (e.g. 2.0,4.0)")
    g.add_argument("--resize_interpolation", type=str, default=None, choices=image_utils.RESIZE_INTERPOLATIONS,
                   help="resize filter (default: area when shrinking, lanczos when enlarging)")
    g.add_argument("--alpha_mask", action="store_true",
                   help="use each image's alpha channel as its loss mask (transparent pixels are not trained)")
    g.add_argument("--cache_info", action="store_true",
                   help="cache image sizes and captions in metadata_cache.json in each image folder (folder datasets)")
    g.add_argument("--vae_batch_size", type=int, default=1, help="batch size for caching latents")
    g.add_argument("--skip_cache_check", action="store_true",
                   help="reuse every existing latent / text encoder cache file without checking its contents")


# ----------------------------------------------------------------------------- schema
# Upstream's ConfigSanitizer, as a table: each key with its type, where it may be written and which dataset
# kinds take it. A dataset's kind follows from its subsets: all with `conditioning_data_dir` -> controlnet
# (scripts with --masked_loss), all with `metadata_file` -> fine-tuning, none with it -> DreamBooth.
# Adding an upstream key is one line here (plus its field in datasets.SubsetParams / DatasetParams).

_RESO = "resolution"  # a type tag: int N, [W, H] or "W,H"
_NUMBER = "number"    # int or float, read as float

DREAMBOOTH, FINETUNING, CONTROLNET = "dreambooth", "finetuning", "controlnet"
ALL_KINDS = frozenset({DREAMBOOTH, FINETUNING, CONTROLNET})
_CAPTION_FILE_KINDS = frozenset({DREAMBOOTH, CONTROLNET})

# levels: "subset" = [[datasets.subsets]], [[datasets]] and [general] (a subset setting with defaults above it);
# "subset_only" = only [[datasets.subsets]]; "dataset" = [[datasets]] and [general].
_SUBSET, _SUBSET_ONLY, _DATASET = "subset", "subset_only", "dataset"


@dataclasses.dataclass(frozen=True)
class KeySpec:
    type: Any
    level: str
    kinds: frozenset = ALL_KINDS


SCHEMA: dict[str, KeySpec] = {
    # subset settings (upstream SUBSET_ASCENDABLE_SCHEMA + caption dropout)
    "num_repeats": KeySpec(int, _SUBSET),
    "shuffle_caption": KeySpec(bool, _SUBSET),
    "keep_tokens": KeySpec(int, _SUBSET),
    "keep_tokens_separator": KeySpec(str, _SUBSET),
    "secondary_separator": KeySpec(str, _SUBSET),
    "caption_separator": KeySpec(str, _SUBSET),
    "enable_wildcard": KeySpec(bool, _SUBSET),
    "token_warmup_min": KeySpec(int, _SUBSET),
    "token_warmup_step": KeySpec(_NUMBER, _SUBSET),
    "caption_prefix": KeySpec(str, _SUBSET),
    "caption_suffix": KeySpec(str, _SUBSET),
    "custom_attributes": KeySpec(dict, _SUBSET),
    "color_aug": KeySpec(bool, _SUBSET),
    "flip_aug": KeySpec(bool, _SUBSET),
    "random_crop": KeySpec(bool, _SUBSET),
    "face_crop_aug_range": KeySpec(list, _SUBSET),  # [low, high]
    "resize_interpolation": KeySpec(str, _SUBSET),  # upstream also has it per dataset: the same levels here
    "caption_dropout_rate": KeySpec(_NUMBER, _SUBSET),
    "caption_dropout_every_n_epochs": KeySpec(int, _SUBSET),
    "caption_tag_dropout_rate": KeySpec(_NUMBER, _SUBSET),
    # subset settings of the kinds that read caption files (upstream DB_/CN_SUBSET_ASCENDABLE_SCHEMA)
    "caption_extension": KeySpec(str, _SUBSET, _CAPTION_FILE_KINDS),
    "class_tokens": KeySpec(str, _SUBSET, frozenset({DREAMBOOTH})),
    "cache_info": KeySpec(bool, _SUBSET, _CAPTION_FILE_KINDS),
    # per subset only (upstream *_SUBSET_DISTINCT_SCHEMA)
    "image_dir": KeySpec(str, _SUBSET_ONLY),
    "is_reg": KeySpec(bool, _SUBSET_ONLY, frozenset({DREAMBOOTH})),
    "metadata_file": KeySpec(str, _SUBSET_ONLY, frozenset({FINETUNING})),
    "alpha_mask": KeySpec(bool, _SUBSET_ONLY, frozenset({DREAMBOOTH, FINETUNING})),  # --alpha_mask: every subset
    "conditioning_data_dir": KeySpec(str, _SUBSET_ONLY, frozenset({CONTROLNET})),  # masks for --masked_loss
    # dataset settings (upstream DATASET_ASCENDABLE_SCHEMA)
    "resolution": KeySpec(_RESO, _DATASET),
    "batch_size": KeySpec(int, _DATASET),
    "enable_bucket": KeySpec(bool, _DATASET),
    "min_bucket_reso": KeySpec(int, _DATASET),
    "max_bucket_reso": KeySpec(int, _DATASET),
    "bucket_reso_steps": KeySpec(int, _DATASET),
    "bucket_no_upscale": KeySpec(bool, _DATASET),
    "network_multiplier": KeySpec(_NUMBER, _DATASET),
    "validation_split": KeySpec(_NUMBER, _DATASET),  # library.validation
    "validation_seed": KeySpec(int, _DATASET),
}
_REQUIRED = {DREAMBOOTH: ("image_dir",), FINETUNING: ("metadata_file",),
             CONTROLNET: ("image_dir", "conditioning_data_dir")}
_KIND_LABEL = {DREAMBOOTH: "DreamBooth (image_dir + caption files)", FINETUNING: "fine-tuning (metadata_file)",
               CONTROLNET: "ControlNet (conditioning_data_dir)"}

SUBSET_KEYS = {k: s.type for k, s in SCHEMA.items() if s.level in (_SUBSET, _SUBSET_ONLY)}
DATASET_KEYS = {k: s.type for k, s in SCHEMA.items() if s.level == _DATASET}
_INHERITED_SUBSET_KEYS = {k: s.type for k, s in SCHEMA.items() if s.level == _SUBSET}
_PATH_KEYS = ("image_dir", "metadata_file", "conditioning_data_dir")  # relative: to the working folder, else the config's
_CLI_SUBSET_ONLY = ("alpha_mask",)  # subset-only in the TOML, yet upstream's argparse fallback gives --alpha_mask to all
# dataset key -> CLI flag (dest) that is its fallback
_CLI_NAME = {"batch_size": "train_batch_size", "num_repeats": "dataset_repeats"}


def allowed_keys(where: str, kinds) -> dict[str, Any]:
    """Keys allowed in `where` ('general', 'datasets', 'subsets') for datasets of `kinds`."""
    levels = {"general": (_SUBSET, _DATASET), "datasets": (_SUBSET, _DATASET),
              "subsets": (_SUBSET, _SUBSET_ONLY)}[where]
    return {k: s.type for k, s in SCHEMA.items() if s.level in levels and s.kinds & frozenset(kinds)}


def _closest(key: str, allowed) -> str:
    match = difflib.get_close_matches(key, list(allowed), n=1)
    return f" Did you mean '{match[0]}'?" if match else ""


def _unknown_key_problem(key: str, allowed: dict, where: str, level: str, kinds) -> str:
    spec = SCHEMA.get(key)
    if spec is None:
        return f"unknown key '{key}' in {where}.{_closest(key, allowed)}"
    if spec.level == _DATASET and level == "subsets":
        return f"'{key}' in {where} is a dataset setting: put it in [[datasets]] or [general]"
    if spec.level == _SUBSET_ONLY and level != "subsets":
        return f"'{key}' in {where} belongs in [[datasets.subsets]]"
    if spec.kinds == {CONTROLNET} and CONTROLNET not in kinds:
        return (f"'{key}' in {where} (mask images) needs --masked_loss, and then one in every subset of "
                "its [[datasets]]")
    names = " or ".join(_KIND_LABEL[k] for k in sorted(kinds))
    return f"'{key}' in {where} is not used by {names} datasets"


def parse_resolution(value, field: str = "resolution") -> tuple[int, int]:
    """'W,H', 'N', N or [W, H] -> (W, H)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        if isinstance(value, int):
            w = h = value
        elif isinstance(value, (list, tuple)) and len(value) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            w, h = value
        elif isinstance(value, str):
            parts = [p.strip() for p in value.replace("x", ",").split(",")]
            if len(parts) == 1:
                w = h = int(parts[0])
            elif len(parts) == 2:
                w, h = int(parts[0]), int(parts[1])
            else:
                raise ValueError
        else:
            raise ValueError
    except ValueError:
        raise DatasetError(f"{field} must be 'W,H' or a single size N (like '1024,1024' or 1024), got {value!r}")
    if w <= 0 or h <= 0 or w % 8 or h % 8:
        raise DatasetError(f"{field} sides must be positive multiples of 8, got {w}x{h}")
    return w, h


_TYPE_NAMES = {bool: "true or false", int: "an integer", _NUMBER: "a number", str: "a string",
               dict: "a table", list: "a list"}


def _check_type(key: str, value, kind, where: str) -> Any:
    if kind is _RESO:
        return parse_resolution(value, f"{where} {key}")
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        _NUMBER: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        dict: isinstance(value, dict),
        list: isinstance(value, list),
    }[kind]
    if not ok:
        raise DatasetError(f"{where}: '{key}' must be {_TYPE_NAMES[kind]}, got {value!r}")
    return float(value) if kind is _NUMBER else value


def _dataset_kind(subsets: list, kinds, where: str) -> str:
    """The kind of a [[datasets]] entry from its subsets, as upstream decides it."""
    if CONTROLNET in kinds and subsets and all("conditioning_data_dir" in s for s in subsets):
        return CONTROLNET
    with_md = sum(1 for s in subsets if "metadata_file" in s)
    if with_md and with_md < len(subsets):
        raise DatasetError(f"{where}: DreamBooth subsets (image_dir) and fine-tuning subsets (metadata_file) "
                           "cannot be mixed in one dataset; put them in separate [[datasets]]")
    if with_md:
        return FINETUNING if FINETUNING in kinds else DREAMBOOTH  # the DreamBooth schema then refuses the key
    return DREAMBOOTH if DREAMBOOTH in kinds else FINETUNING  # ... or the fine-tuning one asks for metadata_file


def _read_config_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise DatasetError(f"--dataset_config file does not exist: {path}")
    from library.input_files import InputFileError, load_json, load_toml

    try:  # upstream reads JSON dataset configs too
        config = load_json(path) if path.lower().endswith(".json") else load_toml(path)
    except InputFileError as e:  # any file: one line (binary, too large, nested too deep, ...)
        raise DatasetError(str(e)) from None
    if not isinstance(config, dict):
        raise DatasetError(f"{path}: must hold a table with [general] and [[datasets]]")
    return config


def load_dataset_config(path: str, kinds=(DREAMBOOTH, FINETUNING)) -> dict:
    """Reads and checks a dataset TOML (or JSON) for a script that trains on datasets of `kinds`; every bad key
    and value in the file is reported in one DatasetError (each with a suggestion where there is one)."""
    kinds = frozenset(kinds)
    config = _read_config_file(path)
    problems: list[str] = []
    bad_levels: dict[str, dict] = {}

    def check_table(table: dict, level: str, where: str, table_kinds) -> None:
        allowed = allowed_keys(level, table_kinds)
        for key in list(table):
            if level == "datasets" and key == "subsets":
                continue
            if key not in allowed:
                problems.append(_unknown_key_problem(key, allowed, where, level, table_kinds)
                                if len(problems) < MAX_PROBLEMS else f"{where}: unknown key '{key}'")
                if key not in SCHEMA:
                    bad_levels.setdefault(where.split(" #")[0], allowed)
                continue
            try:
                table[key] = _check_type(key, table[key], allowed[key], where)
            except DatasetError as e:
                problems.append(str(e))

    for key in config:
        if key not in ("general", "datasets"):
            problems.append(f"unknown top-level key '{key}'.{_closest(key, ('general', 'datasets'))} "
                            "Use [general] and [[datasets]] / [[datasets.subsets]]")
    general = config.get("general", {})
    if not isinstance(general, dict):
        problems.append("[general] must be a table")
        general = {}
    check_table(general, "general", "[general]", kinds)
    datasets = config.get("datasets", [])
    if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) for d in datasets):
        problems.append("needs at least one [[datasets]] table with [[datasets.subsets]]")
        datasets = []
    for i, ds in enumerate(datasets):
        where = f"[[datasets]] #{i + 1}"
        subsets = ds.get("subsets", [])
        if not isinstance(subsets, list) or not subsets or not all(isinstance(s, dict) for s in subsets):
            problems.append(f"{where} has no [[datasets.subsets]] (each needs image_dir or metadata_file)")
            subsets = []
        try:
            kind = _dataset_kind(subsets, kinds, where)
        except DatasetError as e:
            problems.append(str(e))
            continue
        check_table(ds, "datasets", where, {kind})
        for j, sub in enumerate(subsets):
            swhere = f"[[datasets.subsets]] #{j + 1} of {where}"
            check_table(sub, "subsets", swhere, {kind})
            missing = [k for k in _REQUIRED[kind] if k not in sub]
            if missing:
                need = " and ".join(missing)
                problems.append(f"{swhere} needs {need} ({_KIND_LABEL[kind]} dataset)")
        ds["__kind__"] = kind
    if problems:
        allowed_lines = [f"Allowed keys in {where}: {', '.join(sorted(allowed))}"
                         for where, allowed in bad_levels.items()]
        if len(problems) == 1:
            raise DatasetError(" ".join([f"{path}: {problems[0]}"] + allowed_lines))
        raise DatasetError(f"{path}: {len(problems)} problems:\n  " + "\n  ".join(capped(problems) + allowed_lines))
    return config


# ----------------------------------------------------------------------------- resolving values


def _normalize_family(family: str) -> str:
    f = (family or "").lower()
    f = _FAMILY_ALIASES.get(f, f)
    if f not in FAMILY_DEFAULT_RESOLUTION:
        raise DatasetError(f"unknown model family {family!r}; expected one of {', '.join(FAMILY_DEFAULT_RESOLUTION)}")
    return f


def _arg(args, name: str, default=None):
    value = getattr(args, name, None)
    return default if value is None else value


def _cli_layer(args, family: str) -> dict:
    """CLI values as the lowest-priority config layer (kohya uses argparse values as fallbacks)."""
    layer = {}
    for key in list(DATASET_KEYS) + list(_INHERITED_SUBSET_KEYS) + list(_CLI_SUBSET_ONLY):
        value = getattr(args, _CLI_NAME.get(key, key), None)
        if value is not None and value != "":  # "" = unset (as the GUI leaves empty text fields)
            layer[key] = value
    if "resolution" in layer:
        layer["resolution"] = parse_resolution(layer["resolution"], "--resolution")
    else:
        n = FAMILY_DEFAULT_RESOLUTION[family]
        logger.info("--resolution not set: using %dx%d for %s", n, n, family)
        layer["resolution"] = (n, n)
    return layer


def _resolve_path(path: str, base_dir: str | None) -> str:
    path = os.path.expanduser(path)
    if not os.path.isabs(path) and not os.path.exists(path) and base_dir:
        candidate = os.path.join(base_dir, path)
        if os.path.exists(candidate):
            return candidate
    return path


def _make_subset(values: dict, where: str) -> SubsetParams:
    s = SubsetParams(**{k: v for k, v in values.items() if k in SUBSET_KEYS})
    s.caption_extension = captions.normalize_caption_extension(s.caption_extension)
    if s.keep_tokens < 0:
        raise DatasetError(f"{where}: keep_tokens must be >= 0, got {s.keep_tokens}")
    if s.caption_dropout_every_n_epochs < 0:
        raise DatasetError(f"{where}: caption_dropout_every_n_epochs must be >= 0")
    for rate in ("caption_dropout_rate", "caption_tag_dropout_rate"):
        if not 0.0 <= getattr(s, rate) <= 1.0:
            raise DatasetError(f"{where}: {rate} must be between 0 and 1, got {getattr(s, rate)}")
    if s.token_warmup_step < 0 or s.token_warmup_min < 0:
        raise DatasetError(f"{where}: token_warmup_step and token_warmup_min must be >= 0")
    s.face_crop_aug_range = image_utils.parse_face_crop_aug_range(s.face_crop_aug_range, where)
    image_utils.check_interpolation(s.resize_interpolation, where)
    return s


def _make_dataset_params(values: dict, subsets: list[SubsetParams], where: str) -> DatasetParams:
    p = DatasetParams(subsets=subsets, **{k: v for k, v in values.items() if k in DATASET_KEYS})
    p.resolution = tuple(p.resolution)
    if p.batch_size < 1:
        raise DatasetError(f"{where}: batch_size / --train_batch_size must be >= 1, got {p.batch_size}")
    if not 0.0 <= p.validation_split < 1.0:
        raise DatasetError(f"{where}: validation_split must be at least 0 and below 1, got {p.validation_split}")
    steps = p.bucket_reso_steps
    if steps <= 0 or steps % 8:
        raise DatasetError(f"{where}: bucket_reso_steps must be a positive multiple of 8, got {steps}")
    if p.enable_bucket and not p.bucket_no_upscale:
        for name in ("min_bucket_reso", "max_bucket_reso"):
            v = getattr(p, name)
            if v <= 0:
                raise DatasetError(f"{where}: {name} must be positive, got {v}")
        p.min_bucket_reso, p.max_bucket_reso = adjust_min_max_bucket_reso(p.min_bucket_reso, p.max_bucket_reso, steps)
        if p.min_bucket_reso > min(p.resolution):
            raise DatasetError(f"{where}: min_bucket_reso ({p.min_bucket_reso}) must be <= the resolution's "
                               f"shorter side ({min(p.resolution)})")
        if p.max_bucket_reso < max(p.resolution):
            raise DatasetError(f"{where}: max_bucket_reso ({p.max_bucket_reso}) must be >= the resolution's "
                               f"longer side ({max(p.resolution)})")
    return p


def _folder_subsets(root: str, is_reg: bool, base: dict, flag: str) -> list[SubsetParams]:
    """kohya layout: every subfolder of root is 'N_name' (N repeats, name = class tokens)."""
    if not os.path.isdir(root):
        raise DatasetError(f"{flag} folder does not exist: {root}")
    subsets, loose, skipped = [], [], []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith("."):
            continue
        if not os.path.isdir(path):
            if is_image_file(name):
                loose.append(name)
            continue
        m = _FOLDER_RE.match(name)
        if not m or int(m.group(1)) < 1:  # upstream ignores these folders (with a warning)
            skipped.append(name)
            continue
        values = dict(base, image_dir=path, num_repeats=int(m.group(1)), is_reg=is_reg)
        if m.group(2).strip():
            values["class_tokens"] = m.group(2).strip()
        subsets.append(_make_subset(values, f"{flag} folder '{name}'"))
    if skipped:
        logger.warning("%s: ignoring folders without a repeat count >= 1 ('N_name'): %s", flag, ", ".join(skipped))
    if not subsets:
        if skipped:
            hint = (f" (name a folder 'N_name', for example '10_{skipped[0]}' for 10 repeats per epoch; "
                    f"ignored: {', '.join(skipped)})")
        elif loose:
            hint = f" ({len(loose)} images lie directly in it: move them into a subfolder such as '10_name')"
        else:
            hint = ""
        raise DatasetError(f"{flag} {root} has no 'N_name' image folders{hint}")
    return subsets


def _usable_subsets(subsets: list[SubsetParams], where: str) -> list[SubsetParams]:
    """Upstream skips (with a warning) subsets with num_repeats < 1 and repeats of an earlier subset of the
    same dataset (same image_dir, or same metadata_file)."""
    kept, seen = [], set()
    for s in subsets:
        key = s.metadata_file or s.image_dir
        if s.num_repeats < 1:
            logger.warning("%s: ignoring subset %s: num_repeats is %d", where, key, s.num_repeats)
        elif key in seen:
            logger.warning("%s: ignoring the repeated subset %s (the first one is used)", where, key)
        else:
            seen.add(key)
            kept.append(s)
    return kept


def _dataset_params_from_args(args, cli: dict) -> list[DatasetParams]:
    subset_base = {k: v for k, v in cli.items() if k in _INHERITED_SUBSET_KEYS or k in _CLI_SUBSET_ONLY}
    train_dir = getattr(args, "train_data_dir", None)
    in_json = getattr(args, "in_json", None)
    if in_json:
        values = dict(subset_base, metadata_file=in_json, image_dir=train_dir,
                      num_repeats=int(_arg(args, "dataset_repeats", 1)))
        subsets = [_make_subset(values, "--in_json")]
    elif train_dir:
        subsets = _folder_subsets(train_dir, False, subset_base, "--train_data_dir")
    else:
        raise DatasetError("no training data: set --train_data_dir (with 'N_name' folders), --in_json "
                           "with --train_data_dir, or --dataset_config")
    cond_dir = getattr(args, "conditioning_data_dir", None)
    if cond_dir and getattr(args, "masked_loss", False):
        # upstream reads conditioning_data_dir only from [[datasets.subsets]] and ignores the flag here;
        # we give the training folders' images their masks from it (looked up by file name)
        for s in subsets:
            s.conditioning_data_dir = cond_dir
    elif cond_dir:
        logger.warning("--conditioning_data_dir is used only with --masked_loss: ignored")
    reg_dir = getattr(args, "reg_data_dir", None)
    if reg_dir:
        subsets += _folder_subsets(reg_dir, True, subset_base, "--reg_data_dir")
    return [_make_dataset_params(cli, _usable_subsets(subsets, "dataset"), "dataset")]


def _dataset_params_from_config(path: str, cli: dict, kinds) -> list[DatasetParams]:
    config = load_dataset_config(path, kinds)
    base_dir = os.path.dirname(os.path.abspath(path))
    general = config.get("general", {})
    result = []
    for i, ds in enumerate(config["datasets"]):
        kind = ds.pop("__kind__")
        ds_values = {**cli, **general, **{k: v for k, v in ds.items() if k != "subsets"}}
        subset_keys = allowed_keys("subsets", {kind})  # e.g. no caption_extension for fine-tuning subsets
        subsets = []
        for j, sub in enumerate(ds["subsets"]):
            values = {k: v for k, v in ds_values.items()
                      if (k in _INHERITED_SUBSET_KEYS or k in _CLI_SUBSET_ONLY) and k in subset_keys}
            values.update(sub)
            for key in _PATH_KEYS:
                if values.get(key):
                    values[key] = _resolve_path(values[key], base_dir)
            subsets.append(_make_subset(values, f"{path} [[datasets]] #{i + 1} subset #{j + 1}"))
        where = f"{path} [[datasets]] #{i + 1}"
        result.append(_make_dataset_params(ds_values, _usable_subsets(subsets, where), where))
    return result


def build_dataset_group(args, family: str, kinds=(DREAMBOOTH, FINETUNING)) -> DatasetGroup:
    """Scans the dataset described by args (see module doc); raises DatasetError before any model loads."""
    return build_dataset_groups(args, family, kinds)[0]


def build_dataset_groups(args, family: str, kinds=(DREAMBOOTH, FINETUNING)) -> tuple[DatasetGroup, DatasetGroup | None]:
    """(training group, validation group or None): `validation_split` holds images of each image_dir subset
    out of training (library.validation.split_images); raises DatasetError before any model loads.
    kinds: the dataset kinds the script trains on (train_db.py: DreamBooth only, fine_tune.py: fine-tuning
    only, the others both; upstream adds ControlNet subsets with --masked_loss)."""
    from library.validation import split_images

    family = _normalize_family(family)
    captions.check_caption_args(args, family)
    cli = _cli_layer(args, family)
    config_path = getattr(args, "dataset_config", None)
    if config_path:
        if getattr(args, "train_data_dir", None) or getattr(args, "in_json", None):
            logger.warning("--dataset_config is set: ignoring --train_data_dir/--reg_data_dir/--in_json")
        params = _dataset_params_from_config(str(config_path), cli, kinds)
    else:
        params = _dataset_params_from_args(args, cli)

    cache_latents = bool(getattr(args, "cache_latents", False) or getattr(args, "cache_latents_to_disk", False))
    cache_te = bool(getattr(args, "cache_text_encoder_outputs", False)
                    or getattr(args, "cache_text_encoder_outputs_to_disk", False))
    for p in params:
        for s in p.subsets:
            if cache_latents and (s.color_aug or s.random_crop):
                raise DatasetError(latent_cache_conflict(s))
            if cache_te and s.caption_is_random:
                raise DatasetError(te_cache_conflict(s))

    # Batch order and augmentations derive from (seed, epoch): every process of a multi-GPU run must agree,
    # so no per-process random seed here; the trainers set args.seed first (train_util.prepare_seed: a random
    # seed, shared by the processes, when --seed is not given), 0 is only for callers that did not.
    seed = getattr(args, "seed", None)
    if seed is None:
        seed = 0
    epoch_value = new_epoch_value()
    datasets, val_datasets = [], []
    for i, p in enumerate(params):
        images, val_images = [], []
        for s in p.subsets:
            found = images_from_metadata(s) if s.metadata_file else images_from_dir(s)
            if p.validation_split and s.metadata_file:
                logger.warning("validation_split: the metadata_file subset %s is not split (image_dir subsets "
                               "only)", s.name)
            elif p.validation_split and not s.is_reg:
                vseed = p.validation_seed if p.validation_seed is not None else seed
                found, held = split_images(found, p.validation_split, vseed)
                val_images.extend(held)
            images.extend(found)
        n_train = sum(1 for im in images if not im.is_reg)
        n_reg = len(images) - n_train
        if n_train == 0:
            dirs = ", ".join(s.metadata_file or s.image_dir for s in p.subsets if not s.is_reg) or "(none)"
            raise DatasetError(f"no training images found in {dirs} (image extensions: "
                               ".png .jpg .jpeg .webp .bmp); add images or fix the paths")
        if n_reg:
            balance_reg_images(images)
        datasets.append(ImageDataset(p, images, float(_arg(args, "prior_loss_weight", 1.0)), seed, i, epoch_value))
        if val_images:
            val_datasets.append((p, val_images, i))
    group = DatasetGroup(datasets, epoch_value, family)
    group.log_summary()
    val_group = None
    if val_datasets:
        val_epoch = new_epoch_value()
        val_group = DatasetGroup([ImageDataset(p, ims, 1.0, seed, i, val_epoch) for p, ims, i in val_datasets],
                                 val_epoch, family)
        logger.info("validation split: %d images held out of training", sum(len(ims) for _, ims, _ in val_datasets))
    return group, val_group

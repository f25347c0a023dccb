"""Tag images with a WD14 tagger (SmilingWolf's wd-v1-4 / v3 taggers incl. wd-eva02-large-tagger-v3, or a
`namespace/repo/subdir` tagger with tag_mapping.json) through onnxruntime; writes one caption file per image
(`--caption_extension`, default .txt) or a metadata JSON/JSONL (`--output_path`). Command line as kohya-ss/sd-scripts.

    python sd-scripts/finetune/tag_images_by_wd14_tagger.py IMAGES --onnx \
        --repo_id SmilingWolf/wd-eva02-large-tagger-v3 \
        --batch_size 8 --general_threshold 0.35 --character_threshold 0.85 --character_tags_first --append_tags

The model is read from `--model_dir/<repo_id with _ for />` (downloaded there from the Hub when missing, or with
--force_download), or from `--repo_id` itself when that is a local folder holding model.onnx and selected_tags.csv.
Needs onnxruntime (the project's `captioning` extra; onnxruntime-gpu for CUDA).
"""
from __future__ import annotations

import argparse
import csv
import functools
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from library import captioning, files  # noqa: E402
from library.captioning import ToolError  # noqa: E402

logger = logging.getLogger("tag_images_by_wd14_tagger")

DEFAULT_WD14_TAGGER_REPO = "SmilingWolf/wd-v1-4-convnext-tagger-v2"
IMAGE_SIZE = 448  # the WD14 taggers' input size, when the model does not fix it
CSV_FILE = "selected_tags.csv"
ONNX_FILE = "model.onnx"
TAG_JSON_FILE = "tag_mapping.json"  # the `namespace/repo/subdir` taggers (cl_tagger layout)
SUBDIR_ONNX_FILE = "model_optimized.onnx"
# selected_tags.csv categories
GENERAL, CHARACTER, RATING = "0", "4", "9"
MAPPING_CATEGORIES = ("Rating", "General", "Character", "Copyright", "Meta", "Model", "Quality", "Artist")


# ----------------------------------------------------------------------------- the model's files


class ModelFiles:
    """Where the tagger's files are: `folder`, `onnx_path`, `csv_path` (SmilingWolf layout) or `mapping_path`."""

    def __init__(self, folder: str, subdir_layout: bool):
        self.folder, self.subdir_layout = folder, subdir_layout
        self.onnx_path = os.path.join(folder, SUBDIR_ONNX_FILE if subdir_layout else ONNX_FILE)
        self.csv_path = None if subdir_layout else os.path.join(folder, CSV_FILE)
        self.mapping_path = os.path.join(folder, TAG_JSON_FILE) if subdir_layout else None

    def missing(self) -> list[str]:
        return [p for p in (self.onnx_path, self.csv_path, self.mapping_path) if p and not os.path.isfile(p)]


def locate_model(args) -> ModelFiles:
    """upstream's places: model_dir/<namespace_repo>[/subdir]; a local folder given as --repo_id is used as is."""
    if os.path.isdir(args.repo_id):
        mapping_only = not os.path.isfile(os.path.join(args.repo_id, CSV_FILE)) and \
            os.path.isfile(os.path.join(args.repo_id, TAG_JSON_FILE))
        model_files = ModelFiles(args.repo_id, subdir_layout=mapping_only)
        if model_files.missing():
            missing = ", ".join(os.path.basename(p) for p in model_files.missing())
            raise ToolError(f"--repo_id: the folder {args.repo_id} has no {missing}")
        return model_files
    tokens = args.repo_id.split("/")
    if len(tokens) < 2 or not all(tokens):
        raise ToolError(f"--repo_id: expected a Hub id 'namespace/name' (or 'namespace/name/subdir'), or a local "
                        f"folder, got {args.repo_id!r}")
    repo_id, subdir = "/".join(tokens[:2]), "/".join(tokens[2:]) or None
    root = os.path.join(args.model_dir, repo_id.replace("/", "_"))
    model_files = ModelFiles(os.path.join(root, subdir) if subdir else root, subdir_layout=subdir is not None)
    if args.force_download or not os.path.isdir(model_files.folder) or model_files.missing():
        download(repo_id, subdir, root, model_files, args.force_download)
    else:
        logger.info("using the tagger in %s", model_files.folder)
    return model_files


def download(repo_id: str, subdir, root: str, model_files: ModelFiles, force: bool) -> None:
    hub = captioning.require("huggingface_hub", what="downloading the tagger")
    names = [os.path.basename(p) for p in (model_files.onnx_path, model_files.csv_path, model_files.mapping_path) if p]
    logger.info("downloading the tagger %s%s (%s) to %s", repo_id, f"/{subdir}" if subdir else "", ", ".join(names),
                root)
    os.makedirs(root, exist_ok=True)
    for name in names:
        try:
            hub.hf_hub_download(repo_id=repo_id, filename=name, subfolder=subdir, local_dir=root,
                                force_download=force)
        except Exception as e:  # network, missing file, gated repo: one line naming what failed
            raise ToolError(f"--repo_id: could not download {name} of {repo_id}"
                            f"{'/' + subdir if subdir else ''} from the Hugging Face Hub: {e}") from e


# ----------------------------------------------------------------------------- tags


def remove_underscore(tag: str) -> str:
    return tag.replace("_", " ") if len(tag) > 3 else tag  # short tags are emoticons such as ^_^


def expand_character_tag(tag: str, separator: str) -> str:
    """`chara_name_(series)` -> `chara_name<sep>series`; `name_(costume)_(series)` -> `name_(costume)<sep>series`."""
    if not tag.endswith(")") or "(" not in tag:
        return tag
    head, _, series = tag.rpartition("(")
    return head.rstrip("_") + separator + series[:-1]


def parse_tag_replacement(text: str) -> dict[str, str]:
    """`src1,dst1;src2,dst2`; `\\,` and `\\;` are a literal comma and semicolon."""
    escaped = text.replace("\\,", "\0c").replace("\\;", "\0s")
    out = {}
    for pair in escaped.split(";"):
        if not pair.strip():
            continue
        parts = pair.split(",")
        if len(parts) != 2:
            shown = pair.replace("\0c", "\\,").replace("\0s", "\\;")
            raise ToolError("--tag_replacement: each entry must be 'source,target' (entries separated by ';', "
                            f"\\, and \\; for a literal comma or semicolon), got {shown!r}")
        src, dst = (p.replace("\0c", ",").replace("\0s", ";") for p in parts)
        out[src] = dst
    return out


def split_tags(text: str, separator: str) -> list[str]:
    sep = separator.strip() or separator
    return [t.strip() for t in text.split(sep) if t.strip()]


class TagSet:
    """The model's outputs as (name, category) per index, names already shaped as the options ask
    (character_tag_expand, then remove_underscore, then tag_replacement, as upstream)."""

    def __init__(self, names: list[str], categories: list[str], args, index: list[int] = None):
        replace = parse_tag_replacement(args.tag_replacement) if args.tag_replacement is not None else {}
        self.names, self.categories = [], categories
        for name, cat in zip(names, categories):
            if args.character_tag_expand and cat in (CHARACTER, "Character"):
                name = expand_character_tag(name, args.caption_separator)
            if args.remove_underscore:
                name = remove_underscore(name)
            self.names.append(replace.get(name, name))
        self.index = index if index is not None else list(range(len(names)))  # output index of each tag

    @classmethod
    def from_csv(cls, path: str, args) -> "TagSet":
        with open(path, "r", encoding="utf-8", newline="") as f:
            rows = list(csv.reader(f))
        if not rows or rows[0][:3] != ["tag_id", "name", "category"]:
            raise ToolError(f"{path}: expected a CSV with the columns tag_id,name,category,..., got {rows[:1]}")
        rows = [r for r in rows[1:] if len(r) >= 3]
        return cls([r[1] for r in rows], [r[2] for r in rows], args)

    @classmethod
    def from_mapping(cls, path: str, args) -> "TagSet":
        with open(path, "r", encoding="utf-8") as f:
            mapping = json.load(f)
        items = sorted(((int(k), v) for k, v in mapping.items()), key=lambda kv: kv[0])
        bad = [v.get("category") for _, v in items if v.get("category") not in MAPPING_CATEGORIES]
        if bad:
            raise ToolError(f"{path}: unexpected tag category {bad[0]!r} (known: {', '.join(MAPPING_CATEGORIES)})")
        return cls([v["tag"] for _, v in items], [v["category"] for _, v in items], args, [k for k, _ in items])


class Tagger:
    """Picks and orders the tags of one image's probabilities, as upstream's tagger does."""

    def __init__(self, tags: TagSet, args):
        self.tags, self.args = tags, args
        self.sep = args.caption_separator
        self.undesired = set(split_tags(args.undesired_tags, self.sep))
        self.always_first = split_tags(args.always_first_tags, self.sep) if args.always_first_tags is not None \
            else None
        self.frequency: dict[str, int] = {}

    def _count(self, tag: str) -> None:
        self.frequency[tag] = self.frequency.get(tag, 0) + 1

    def select(self, probs: np.ndarray) -> tuple[list[str], dict[str, list[str]]]:
        """-> (tags in caption order, {"rating"|"character"|"general"|"other": tags} for --debug)."""
        if self.tags.categories and self.tags.categories[0] in MAPPING_CATEGORIES:
            ordered, parts = self._select_mapping(1.0 / (1.0 + np.exp(-probs)))
        else:
            ordered, parts = self._select_csv(probs)
        if self.always_first is not None:
            for tag in self.always_first:  # each moved to the front in turn: the last one listed ends first
                if tag in ordered:
                    ordered.remove(tag)
                    ordered.insert(0, tag)
        return ordered, parts

    def _select_csv(self, probs):
        a = self.args
        ordered, parts = [], {"rating": [], "character": [], "general": []}
        ratings = []
        for i, (name, cat) in enumerate(zip(self.tags.names, self.tags.categories)):
            p = probs[i] if i < len(probs) else 0.0
            if cat == RATING:
                ratings.append((p, name))
                continue
            if name in self.undesired:
                continue
            if cat == GENERAL and p >= a.general_threshold:
                self._count(name)
                parts["general"].append(name)
                ordered.append(name)
            elif cat == CHARACTER and p >= a.character_threshold:
                self._count(name)
                parts["character"].append(name)
                if a.character_tags_first:
                    ordered.insert(0, name)
                else:
                    ordered.append(name)
        if (a.use_rating_tags or a.use_rating_tags_as_last_tag) and ratings:
            rating = max(ratings, key=lambda r: r[0])[1]  # first of equal maxima, as argmax
            if rating not in self.undesired:
                self._count(rating)
                parts["rating"].append(rating)
                if a.use_rating_tags:
                    ordered.insert(0, rating)
                else:
                    ordered.append(rating)
        return ordered, parts

    def _select_mapping(self, probs):
        a = self.args
        thresholds = {"General": a.general_threshold, "Character": a.character_threshold,
                      "Copyright": a.copyright_threshold, "Meta": a.meta_threshold, "Model": a.model_threshold,
                      "Artist": a.artist_threshold}
        parts = {"rating": [], "character": [], "general": [], "other": []}
        rating = quality = None
        chars, others = [], []
        lowest = min(a.thresh, *thresholds.values())  # upstream looks only at tags above every threshold's minimum
        for idx, name, cat in zip(self.tags.index, self.tags.names, self.tags.categories):
            if idx >= len(probs) or name in self.undesired:
                continue
            p = float(probs[idx])
            if p < lowest:
                continue
            if cat == "Rating":
                if rating is None or p > rating[0]:
                    rating = (p, name)
            elif cat == "Quality":
                if quality is None or p > quality[0]:
                    quality = (p, name)
            elif p >= thresholds[cat]:
                self._count(name)
                if cat == "Character":
                    parts["character"].append(name)
                    (chars if a.character_tags_first else others).append((p, name))
                else:
                    parts["general" if cat == "General" else "other"].append(
                        name if cat == "General" else f"{name} ({cat})")
                    others.append((p, name))
        by_prob = sorted(chars, key=lambda t: -t[0]) + sorted(others, key=lambda t: -t[0])
        ordered = [n for _, n in by_prob]
        if quality is not None and (a.use_quality_tags or a.use_quality_tags_as_last_tag):
            parts["other"].append(quality[1])
            if a.use_quality_tags_as_last_tag:
                ordered.append(quality[1])
            else:
                ordered.insert(0, quality[1])
        if rating is not None:
            parts["rating"].append(rating[1])
            if a.use_rating_tags_as_last_tag:
                ordered.append(rating[1])
            elif a.use_rating_tags:
                ordered.insert(0, rating[1])
        return ordered, parts

    def caption(self, ordered: list[str], caption_file: str = None) -> str:
        """The caption text; with --append_tags the new tags follow the file's own, without repeats."""
        if self.args.append_tags and caption_file and os.path.exists(caption_file):
            with open(caption_file, "r", encoding="utf-8") as f:
                existing = split_tags(f.read().strip("\n"), self.sep)
            ordered = existing + [t for t in ordered if t not in existing]
        return self.sep.join(ordered)


# ----------------------------------------------------------------------------- images


def prepare_image(image, size: int, channels_first: bool) -> np.ndarray:
    """upstream's preprocessing: transparency onto white, BGR, padded to a white square, resized to size x size,
    float32 0..255 (the SmilingWolf layout, NHWC); the tag_mapping.json taggers take NCHW in -1..1."""
    from PIL import Image

    from library.image_utils import resize_image

    if image.mode in ("RGBA", "LA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        image = Image.new("RGB", rgba.size, (255, 255, 255))
        image.paste(rgba, mask=rgba.split()[3])
    elif image.mode != "RGB":
        image = image.convert("RGB")
    pixels = np.asarray(image)[:, :, ::-1]  # RGB -> BGR
    h, w = pixels.shape[:2]
    side = max(h, w)
    top, left = (side - h) // 2, (side - w) // 2
    pixels = np.pad(pixels, ((top, side - h - top), (left, side - w - left), (0, 0)), constant_values=255)
    pixels = resize_image(np.ascontiguousarray(pixels), (size, size)).astype(np.float32)
    if channels_first:
        pixels = pixels.transpose(2, 0, 1) / 127.5 - 1.0
    return pixels


class OnnxModel:
    def __init__(self, path: str, batch_size: int):
        ort = captioning.require("onnxruntime", "onnxruntime", "tag_images_by_wd14_tagger.py (onnxruntime-gpu for "
                                 "CUDA)")
        available = ort.get_available_providers()
        if "OpenVINOExecutionProvider" in available:
            self.session = ort.InferenceSession(path, providers=["OpenVINOExecutionProvider"],
                                                provider_options=[{"device_type": "GPU", "precision": "FP32"}])
        else:
            providers = [p for p in ("CUDAExecutionProvider", "ROCMExecutionProvider") if p in available][:1]
            self.session = ort.InferenceSession(path, providers=providers + ["CPUExecutionProvider"])
        logger.info("onnxruntime providers: %s", self.session.get_providers())
        inp = self.session.get_inputs()[0]
        self.input_name, shape = inp.name, list(inp.shape)
        self.channels_first = len(shape) == 4 and shape[1] == 3
        side = shape[2] if self.channels_first else shape[1] if len(shape) == 4 else None
        self.size = side if isinstance(side, int) and side > 0 else IMAGE_SIZE
        self.fixed_batch = shape[0] if shape and isinstance(shape[0], int) and shape[0] > 0 else None
        self.batch_size = batch_size
        if self.fixed_batch and self.fixed_batch != batch_size:
            logger.warning("--batch_size %d does not match the model's batch size %d: using %d", batch_size,
                           self.fixed_batch, self.fixed_batch)
            self.batch_size = self.fixed_batch
        self.dtype = np.float16 if "float16" in inp.type else np.float32

    def __call__(self, images: np.ndarray) -> np.ndarray:
        n = len(images)
        if self.fixed_batch and n < self.fixed_batch:  # pad the last batch of a fixed-batch model
            images = np.concatenate([images, np.zeros((self.fixed_batch - n, *images.shape[1:]), images.dtype)])
        return self.session.run(None, {self.input_name: images.astype(self.dtype)})[0][:n].astype(np.float32)


# ----------------------------------------------------------------------------- main


def resolve_args(args) -> None:
    from library.captions import resolve_caption_extension_alias

    resolve_caption_extension_alias(args)
    for name in ("general", "character", "meta", "model", "copyright", "artist"):
        if getattr(args, f"{name}_threshold") is None:
            setattr(args, f"{name}_threshold", args.thresh)
    captioning.check_positive(args, ["batch_size"])
    if args.output_path and os.path.splitext(args.output_path)[1].lower() not in (".json", ".jsonl"):
        raise ToolError(f"--output_path must end in .json or .jsonl, got {args.output_path}")


def main(args) -> int:
    if not args.onnx:
        logger.info("running the tagger's ONNX model (--onnx is implied: TensorFlow/Keras models are not supported)")
    if args.output_path:  # no caption files written
        images = captioning.find_images(args.train_data_dir, args.recursive)
    else:
        images = captioning.images_to_write(args, args.overwrite or args.append_tags, append_flag="--append_tags")
        if not images:
            return 0
    if args.tag_replacement is not None:
        parse_tag_replacement(args.tag_replacement)  # a bad entry stops the run before the model loads
    captioning.require("onnxruntime", "onnxruntime", "tag_images_by_wd14_tagger.py (onnxruntime-gpu for CUDA)")
    model_files = locate_model(args)
    tags = TagSet.from_mapping(model_files.mapping_path, args) if model_files.subdir_layout else \
        TagSet.from_csv(model_files.csv_path, args)
    model = OnnxModel(model_files.onnx_path, args.batch_size)
    tagger = Tagger(tags, args)

    prepare = functools.partial(prepare_image, size=model.size, channels_first=model.channels_first)  # picklable
    results = {}
    for batch in captioning.image_batches(images, prepare, model.batch_size, args.max_data_loader_n_workers):
        probs = model(np.stack([pixels for _, _, pixels in batch]))
        for (path, size, _), prob in zip(batch, probs):
            ordered, parts = tagger.select(prob)
            if args.output_path:
                results[path] = {"tags": tagger.sep.join(ordered), "image_size": list(size)}
            else:
                out = captioning.caption_path(path, args.caption_extension)
                captioning.write_caption(path, args.caption_extension, tagger.caption(ordered, out))
            if args.debug:
                logger.info("%s:\n\tRating tags: %s\n\tCharacter tags: %s\n\tGeneral tags: %s%s", path,
                            tagger.sep.join(parts["rating"]), tagger.sep.join(parts["character"]),
                            tagger.sep.join(parts["general"]),
                            f"\n\tOther tags: {tagger.sep.join(parts['other'])}" if parts.get("other") else "")
    if args.output_path:
        if args.output_path.lower().endswith(".jsonl"):
            lines = "".join(json.dumps({"image_path": p, "caption": e["tags"], "image_size": e["image_size"]},
                                       ensure_ascii=False) + "\n" for p, e in results.items())
            files.write_text(args.output_path, lines)
        else:
            captioning.write_json_atomic(args.output_path, results, indent=4)
        logger.info("tags of %d images written to %s", len(results), args.output_path)
    if args.frequency_tags:
        print("Tag frequencies:")
        for tag, n in sorted(tagger.frequency.items(), key=lambda kv: kv[1], reverse=True):
            print(f"{tag}: {n}")
    logger.info("done!")
    return 0


def setup_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("train_data_dir", type=str, help="folder of the images to tag")
    p.add_argument("--repo_id", type=str, default=DEFAULT_WD14_TAGGER_REPO,
                   help="tagger on the Hugging Face Hub ('namespace/name', or 'namespace/name/subdir' for "
                        "tag_mapping.json taggers), e.g. SmilingWolf/wd-eva02-large-tagger-v3, "
                        "SmilingWolf/wd-vit-tagger-v3; or a local folder with model.onnx and selected_tags.csv")
    p.add_argument("--model_dir", type=str, default="wd14_tagger_model",
                   help="folder the taggers are downloaded to (model_dir/<namespace>_<name>)")
    p.add_argument("--force_download", action="store_true", help="download the tagger again")
    p.add_argument("--batch_size", type=int, default=1, help="images per inference batch")
    p.add_argument("--max_data_loader_n_workers", type=int, default=None,
                   help="processes reading the images (unset: in the main process on the CPU, a few with a GPU)")
    p.add_argument("--output_path", type=str, default=None,
                   help="write the tags to this .json (image path -> tags, image_size) or .jsonl file instead of "
                        "caption files")
    p.add_argument("--caption_extention", type=str, default=None,
                   help="deprecated spelling of --caption_extension (wins when set, as upstream)")
    p.add_argument("--caption_extension", type=str, default=".txt", help="extension of the caption files written")
    p.add_argument("--thresh", type=float, default=0.35, help="confidence needed to add a tag")
    for cat, extra in (("general", ""), ("character", ""), ("meta", " (tag_mapping.json taggers)"),
                       ("model", " (tag_mapping.json taggers)"), ("copyright", " (tag_mapping.json taggers)"),
                       ("artist", " (tag_mapping.json taggers)")):
        p.add_argument(f"--{cat}_threshold", type=float, default=None,
                       help=f"confidence needed to add a {cat} tag{extra}; unset = --thresh; above 1 = none")
    p.add_argument("--recursive", action="store_true", help="also tag the images in subfolders")
    p.add_argument("--remove_underscore", action="store_true",
                   help="write tags with spaces instead of underscores (tags longer than 3 characters)")
    p.add_argument("--debug", action="store_true", help="print each image's tags by category")
    p.add_argument("--undesired_tags", type=str, default="",
                   help="tags never written, separated by --caption_separator (without its spaces)")
    p.add_argument("--frequency_tags", action="store_true", help="print how often each tag was given")
    p.add_argument("--onnx", action="store_true",
                   help="run the ONNX model (always so here: the TensorFlow models are not supported)")
    p.add_argument("--append_tags", action="store_true",
                   help="add the new tags after those of an existing caption file (no repeats) instead of "
                        "replacing it")
    p.add_argument("--use_rating_tags", action="store_true", help="put the rating tag first")
    p.add_argument("--use_rating_tags_as_last_tag", action="store_true", help="put the rating tag last")
    p.add_argument("--use_quality_tags", action="store_true",
                   help="put the quality tag first (tag_mapping.json taggers)")
    p.add_argument("--use_quality_tags_as_last_tag", action="store_true",
                   help="put the quality tag last (tag_mapping.json taggers)")
    p.add_argument("--character_tags_first", action="store_true", help="put character tags before general tags")
    p.add_argument("--always_first_tags", type=str, default=None,
                   help="tags put first when present, e.g. '1girl,1boy' (the last one listed ends up first)")
    p.add_argument("--caption_separator", type=str, default=", ",
                   help="text between tags in the caption (include the space if wanted)")
    p.add_argument("--tag_replacement", type=str, default=None,
                   help="rename tags: 'source1,target1;source2,target2'; \\, and \\; for a literal comma or "
                        "semicolon")
    p.add_argument("--character_tag_expand", action="store_true",
                   help="split a character tag's trailing '(series)' into its own tag: 'name_(series)' -> "
                        "'name, series'")
    captioning.add_existing_caption_arguments(p)
    return captioning.add_dump_options(p)


def cli(argv=None) -> int:
    return captioning.run_tool(setup_parser(), main, argv, after_parse=resolve_args)


if __name__ == "__main__":
    sys.exit(cli())

"""Captions as kohya-ss/sd-scripts (upstream) reads and varies them; the caption options of all seven scripts.

Reading (`find_caption`, `metadata_caption`): a DreamBooth-style image's caption is the file with exactly
`caption_extension` next to it (or next to its face-crop base name, `name_a_b_c_d.png` -> `name.ext`), else
the subset's class tokens, else "". Only the first line is used, or every non-blank line with
`enable_wildcard` (one is chosen per step). Fine-tuning metadata joins `caption` and `tags` with
`caption_separator`.

Varying (`process_caption`, every time an image is served), in upstream's order: prefix/suffix, caption
dropout, wildcards `{a|b}` (`{{`/`}}` are literal braces) or the first line, then when shuffling, token
warm-up or tag dropout is on: fixed part (`keep_tokens` or text around `keep_tokens_separator`), warm-up
truncation, shuffle, tag dropout, joined with ", "; finally `secondary_separator` -> `caption_separator`.

Weighting (`--weighted_captions`, `parse_prompt_attention`, `weighted_token_ids`, `apply_token_weights`):
upstream's attention syntax `(word)` x1.1, `[word]` /1.1, `(word:1.3)`, `\\(` literal; each token's text
encoder output is multiplied by its weight (SD1.x/2.x/SDXL; upstream has no weighting for FLUX.1).

No torch at import time (the caption tools in finetune/ start fast); the weighting helpers import it.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import random
import re
from typing import Optional

from library.dataset_files import DatasetError

logger = logging.getLogger(__name__)

DEFAULT_CAPTION_EXTENSION = ".caption"


# ----------------------------------------------------------------------------- options


def add_caption_arguments(parser: argparse.ArgumentParser) -> None:
    """Caption options every one of the seven scripts has upstream (same names, types and defaults)."""
    g = parser.add_argument_group("captions")
    g.add_argument("--caption_extension", type=str, default=DEFAULT_CAPTION_EXTENSION,
                   help="extension of the caption files; an image without one gets its subset's class tokens "
                        "(folder name of 'N_name' folders), else an empty caption")
    g.add_argument("--caption_extention", type=str, default=None,
                   help="deprecated spelling of --caption_extension (kept for old configs; it wins when set)")
    g.add_argument("--shuffle_caption", action="store_true", help="shuffle the separated caption tags")
    g.add_argument("--caption_separator", type=str, default=",", help="tag separator in captions")
    g.add_argument("--keep_tokens", type=int, default=0, help="keep the first N tags in place when shuffling")
    g.add_argument("--keep_tokens_separator", type=str, default="",
                   help="tags before this separator (and after a second one) stay in place; overrides "
                        "--keep_tokens for captions that contain it, e.g. '|||'")
    g.add_argument("--secondary_separator", type=str, default=None,
                   help="separator inside one tag (shuffled and dropped as a whole), replaced by "
                        "--caption_separator afterwards, e.g. ';;;'")
    g.add_argument("--enable_wildcard", action="store_true",
                   help="'{a|b|c}' picks one alternative per step ('{{' '}}' are literal braces); a caption "
                        "file's lines become alternatives too (one line per step)")
    g.add_argument("--caption_prefix", type=str, default=None, help="text put before every caption")
    g.add_argument("--caption_suffix", type=str, default=None, help="text put after every caption")
    g.add_argument("--caption_dropout_rate", type=float, default=0.0, help="probability of an empty caption")
    g.add_argument("--caption_dropout_every_n_epochs", type=int, default=0,
                   help="drop all captions every N epochs (0 = never)")
    g.add_argument("--caption_tag_dropout_rate", type=float, default=0.0,
                   help="probability of dropping each tag (not the kept ones)")
    g.add_argument("--token_warmup_min", type=int, default=1,
                   help="token warm-up: start with this many tags (after the kept ones)")
    g.add_argument("--token_warmup_step", type=float, default=0,
                   help="token warm-up: all tags from this step on (a value < 1 is a fraction of "
                        "--max_train_steps; 0 = off)")
    g.add_argument("--weighted_captions", action="store_true",
                   help="read '(word:1.2)', '(word)', '[word]' in captions as attention weights on the text "
                        "encoder outputs (SD1.x/2.x/SDXL; no effect for FLUX.1, as upstream)")


def add_no_token_padding_argument(parser: argparse.ArgumentParser) -> None:
    """train_db.py only, as upstream."""
    parser.add_argument("--no_token_padding", action="store_true",
                        help="pad captions only to the longest one in the batch instead of 77 tokens "
                             "(as diffusers' DreamBooth)")


def resolve_caption_extension_alias(args) -> None:
    """Upstream's misspelt `--caption_extention` replaces `--caption_extension` when given."""
    alias = getattr(args, "caption_extention", None)
    if alias is not None:
        logger.warning("--caption_extention is a deprecated spelling: use --caption_extension")
        args.caption_extension = alias
        args.caption_extention = None


def check_caption_args(args, family: str) -> None:
    """Option checks before data or models load (raises DatasetError)."""
    if getattr(args, "token_warmup_min", 1) < 0:
        raise DatasetError(f"--token_warmup_min must be >= 0, got {args.token_warmup_min}")
    if getattr(args, "token_warmup_step", 0) < 0:
        raise DatasetError(f"--token_warmup_step must be >= 0, got {args.token_warmup_step}")
    if getattr(args, "weighted_captions", False) and family in ("flux", "lumina", "hunyuan_image"):
        logger.warning("--weighted_captions has no effect for FLUX.1 / Lumina 2 / HunyuanImage 2.1 (upstream does not "
                       "weight their captions either): captions are encoded as written")
    if getattr(args, "no_token_padding", False) and getattr(args, "max_token_length", None):
        logger.warning("--max_token_length is ignored with --no_token_padding (one chunk of at most 77 tokens, "
                       "padded to the longest caption of the batch)")
    if getattr(args, "no_token_padding", False) and (getattr(args, "cache_text_encoder_outputs", False)
                                                     or getattr(args, "cache_text_encoder_outputs_to_disk", False)):
        raise DatasetError("--no_token_padding cannot be used with --cache_text_encoder_outputs: cached outputs "
                           "of different lengths cannot share a batch")


def weighted_for(args, family: str) -> bool:
    return bool(getattr(args, "weighted_captions", False)) and family != "flux"


# ----------------------------------------------------------------------------- reading


def normalize_caption_extension(ext: Optional[str]) -> str:
    ext = (ext or DEFAULT_CAPTION_EXTENSION).strip()
    return ext if ext.startswith(".") else "." + ext


def read_caption_file(path: str, enable_wildcard: bool = False) -> str:
    """Upstream's rule: the first line, stripped; with enable_wildcard all non-blank lines joined by newlines.
    An empty (0-byte) caption file is an error, as upstream."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise DatasetError(f"caption file is not UTF-8 text: {path} ({e})") from e
    except OSError as e:
        raise DatasetError(f"cannot read caption file {path}: {e}") from e
    if not lines:
        raise DatasetError(f"caption file is empty: {path} (write a caption or delete the file to use the "
                           "class tokens)")
    if enable_wildcard:
        return "\n".join(line.strip() for line in lines if line.strip())
    return lines[0].strip()


def caption_paths(image_path: str, caption_extension: str) -> list[str]:
    """The caption file of an image, then that of its face-crop base name (upstream: 'x_a_b_c_d' -> 'x')."""
    base = os.path.splitext(image_path)[0]
    parts = base.split("_")
    face_base = "_".join(parts[:-4]) if len(parts) >= 5 else base
    return [base + caption_extension, face_base + caption_extension]


def find_caption(image_path: str, caption_extension: str, enable_wildcard: bool = False) -> Optional[str]:
    """Caption of an image from the `caption_extension` file only (no other extension), None without one."""
    for path in caption_paths(image_path, caption_extension):
        if os.path.isfile(path):
            return read_caption_file(path, enable_wildcard)
    return None


def metadata_caption(caption: Optional[str], tags: Optional[str], separator: str, enable_wildcard: bool) -> str:
    """Fine-tuning metadata: caption + separator + tags (upstream); with enable_wildcard the tags join each
    non-blank caption line."""
    caption = caption or ""
    if enable_wildcard:
        if tags is None:
            return caption
        tags = tags.replace("\n", separator)
        lines = [line for line in caption.split("\n") if line.strip()]
        if not lines:  # deliberate: upstream drops the tags of an empty caption here; we keep them
            return tags
        return "\n".join(f"{line}{separator}{tags}" for line in lines)
    if tags:
        caption = f"{caption}{separator}{tags}" if caption else tags
    return caption


# ----------------------------------------------------------------------------- varying


def _escape_braces(caption: str) -> tuple[str, str, str]:
    """'{{' and '}}' -> two characters the caption does not use (private-use code points)."""
    free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in caption)
    lb, rb = next(free), next(free)
    return caption.replace("{{", lb).replace("}}", rb), lb, rb


def choose_wildcards(caption: str, rng: random.Random) -> str:
    """One random line of a multi-line caption, then each '{a|b|...}' (up to the next '}') replaced by one of
    its '|' alternatives; '{{' and '}}' stand for literal braces."""
    if "\n" in caption:
        caption = rng.choice(caption.split("\n"))
    text, lb, rb = _escape_braces(caption)
    out, i, n = [], 0, len(text)
    while i < n:
        if text[i] == "{":
            end = text.find("}", i + 1)
            if end > i + 1:
                out.append(rng.choice(text[i + 1:end].split("|")))
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out).replace(lb, "{").replace(rb, "}")


def split_fixed_flex(caption: str, separator: str, keep_tokens: int, keep_tokens_separator: str):
    """(fixed head, shuffled/dropped tags, fixed tail) as upstream splits a caption."""
    if keep_tokens_separator and keep_tokens_separator in caption:
        head, flex = caption.split(keep_tokens_separator, 1)
        tail = ""
        if keep_tokens_separator in flex:
            flex, tail = flex.split(keep_tokens_separator, 1)

        def tags(text):
            return [t.strip() for t in text.split(separator) if t.strip()]

        return tags(head), tags(flex), tags(tail)
    tokens = [t.strip() for t in caption.strip().split(separator)]  # upstream keeps empty tags here
    if keep_tokens > 0:
        return tokens[:keep_tokens], tokens[keep_tokens:], []
    return [], tokens, []


def resolve_warmup_steps(token_warmup_step: float, max_train_steps: int) -> int:
    """token_warmup_step < 1 is a fraction of the run (floored), as upstream."""
    if token_warmup_step < 1:
        return math.floor(token_warmup_step * max_train_steps)
    return token_warmup_step


def warmup_tag_count(step: int, n_tags: int, warmup_min: int, warmup_steps: float) -> Optional[int]:
    """Tags kept at `step` during token warm-up (None: warm-up over or off):
    floor(step * (n_tags - warmup_min) / warmup_steps) + warmup_min."""
    if not warmup_steps or step >= warmup_steps:
        return None
    return math.floor(step * ((n_tags - warmup_min) / warmup_steps)) + warmup_min


def process_caption(caption: str, s, *, epoch: int, step: int = 0, max_train_steps: int = 0,
                    rng: Optional[random.Random] = None) -> str:
    """The caption served at (epoch, step) for subset settings `s` (SubsetParams-like), upstream's order."""
    rng = rng or random.Random()
    if s.caption_prefix:
        caption = f"{s.caption_prefix} {caption}"
    if s.caption_suffix:
        caption = f"{caption} {s.caption_suffix}"
    dropped = s.caption_dropout_rate > 0 and rng.random() < s.caption_dropout_rate
    every = s.caption_dropout_every_n_epochs
    if dropped or (every > 0 and epoch > 0 and epoch % every == 0):
        return ""
    if getattr(s, "enable_wildcard", False):
        caption = choose_wildcards(caption, rng)
    else:
        caption = caption.split("\n")[0]
    warmup_steps = resolve_warmup_steps(getattr(s, "token_warmup_step", 0) or 0, max_train_steps)
    if s.shuffle_caption or warmup_steps > 0 or s.caption_tag_dropout_rate > 0:
        fixed, flex, tail = split_fixed_flex(caption, s.caption_separator, s.keep_tokens,
                                             getattr(s, "keep_tokens_separator", "") or "")
        count = warmup_tag_count(step, len(flex), getattr(s, "token_warmup_min", 1), warmup_steps)
        if count is not None:
            flex = flex[:count]
        if s.shuffle_caption:
            rng.shuffle(flex)
        if s.caption_tag_dropout_rate > 0:
            flex = [t for t in flex if rng.random() >= s.caption_tag_dropout_rate]
        caption = ", ".join(fixed + flex + tail)  # upstream joins with ", " whatever the separator
    secondary = getattr(s, "secondary_separator", None)
    if secondary:
        caption = caption.replace(secondary, s.caption_separator)
    return caption


def apply_replacements(caption: str, replacements: dict, rng: random.Random) -> str:
    """Upstream's textual-inversion caption rewrite, after everything else: each `text -> replacement` in order;
    the text "" replaces the whole caption (a list: one entry drawn from `rng`)."""
    for text, replacement in replacements.items():
        if text == "":
            caption = rng.choice(replacement) if isinstance(replacement, list) else replacement
        else:
            caption = caption.replace(text, replacement)
    return caption


def caption_varies(s) -> bool:
    """True when process_caption can return different captions for one image (no text-encoder cache then)."""
    return bool(s.shuffle_caption or s.caption_dropout_rate > 0 or s.caption_dropout_every_n_epochs > 0
                or s.caption_tag_dropout_rate > 0 or (getattr(s, "token_warmup_step", 0) or 0) > 0)


def has_wildcard(caption: str) -> bool:
    """A caption whose text changes from step to step under enable_wildcard (several lines or a '{a|b}')."""
    if "\n" in caption:
        return True
    text, _, _ = _escape_braces(caption)
    return re.search(r"\{[^}]+\}", text) is not None


# ----------------------------------------------------------------------------- weighted captions

_ROUND_UP = 1.1
_SQUARE_DOWN = 1 / 1.1
_WEIGHT_RE = re.compile(r":([+-]?[.\d]+)\)")


def parse_prompt_attention(text: str) -> list[list]:
    """Upstream's attention syntax -> [[text, weight], ...] (runs of equal weight merged).

    '(x)' multiplies x's weight by 1.1, '[x]' divides it by 1.1, '(x:1.3)' multiplies it by 1.3 (nesting
    multiplies), brackets left open apply to the end; '\\(' '\\)' '\\[' '\\]' '\\\\' are literal characters,
    a lone backslash is dropped, and an unmatched ')' or ']' is literal text."""
    res: list[list] = []
    round_open: list[int] = []
    square_open: list[int] = []

    def scale(start: int, factor: float) -> None:
        for item in res[start:]:
            item[1] *= factor

    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            if i + 1 < n and text[i + 1] in "()[]\\":
                res.append([text[i + 1], 1.0])
                i += 2
            else:
                i += 1
            continue
        if c == "(":
            round_open.append(len(res))
        elif c == "[":
            square_open.append(len(res))
        elif c == ":":
            m = _WEIGHT_RE.match(text, i)
            weight = _to_float(m.group(1)) if m else None
            if m and weight is not None and round_open:
                scale(round_open.pop(), weight)
                i = m.end()
                continue
            if m:  # no '(' open: the whole ':1.2)' is text
                res.append([m.group(0), 1.0])
                i = m.end()
                continue
            res.append([":", 1.0])
        elif c == ")" and round_open:
            scale(round_open.pop(), _ROUND_UP)
        elif c == "]" and square_open:
            scale(square_open.pop(), _SQUARE_DOWN)
        elif c in ")]":
            res.append([c, 1.0])
        else:
            j = i
            while j < n and text[j] not in "\\()[]:":
                j += 1
            res.append([text[i:j], 1.0])
            i = j
            continue
        i += 1
    for start in round_open:
        scale(start, _ROUND_UP)
    for start in square_open:
        scale(start, _SQUARE_DOWN)
    if not res:
        return [["", 1.0]]
    merged = [res[0]]
    for item in res[1:]:
        if item[1] == merged[-1][1]:
            merged[-1][0] += item[0]
        else:
            merged.append(item)
    return merged


def _to_float(value: str) -> Optional[float]:
    try:
        return float(value)
    except ValueError:
        return None


def weighted_token_ids(tokenizer, captions: list[str], max_length: int):
    """(input_ids LongTensor[B, max_length], weights FloatTensor[B, max_length]): each weighted piece is
    tokenized on its own, then <BOS> tokens <EOS> <PAD>..., truncated to max_length - 2 tokens; BOS, EOS and
    padding weigh 1 (upstream's rule)."""
    import torch

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    all_ids, all_weights = [], []
    for caption in captions:
        ids, weights = [], []
        for piece, weight in parse_prompt_attention(caption):
            piece_ids = tokenizer(piece).input_ids[1:-1]
            ids += piece_ids
            weights += [weight] * len(piece_ids)
        if len(ids) > max_length - 2:
            logger.debug("weighted caption truncated to %d tokens", max_length - 2)
            ids, weights = ids[:max_length - 2], weights[:max_length - 2]
        rest = max_length - 2 - len(ids)
        all_ids.append([tokenizer.bos_token_id] + ids + [eos] + [pad] * rest)
        all_weights.append([1.0] + weights + [1.0] * (rest + 1))
    return torch.tensor(all_ids, dtype=torch.long), torch.tensor(all_weights, dtype=torch.float32)


def apply_token_weights(hidden, weights):
    """hidden [B, L, D] * weights [B, L] per token position (upstream multiplies, without renormalizing)."""
    if weights.shape[1] != hidden.shape[1]:
        raise ValueError(f"token weights for {weights.shape[1]} positions, hidden states have {hidden.shape[1]}")
    return hidden * weights.to(hidden.device, hidden.dtype).unsqueeze(-1)

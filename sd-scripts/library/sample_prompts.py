"""kohya sample-prompt files: parsing.

A .txt file has one prompt per line with options after it:
    masterpiece, a cat on a sofa --n blurry, lowres --w 1024 --h 768 --s 28 --l 7 --d 42 --ss euler_a
Lines starting with '#' and blank lines are skipped. A .toml file has a [prompt] table of defaults and
[[prompt.subset]] entries; a .json file is a list of objects. Both use the long key names below.
Image generation itself lives with the trainers; this module only turns files into prompt dicts.
"""
from __future__ import annotations

import json
import os
import re
import tomllib
from typing import Any, Optional
from library.errors import PromptFileError  # noqa: F401  (re-exported)

SAMPLERS = (
    "ddim", "pndm", "lms", "euler", "euler_a", "heun", "dpm_2", "dpm_2_a", "dpmsolver", "dpmsolver++",
    "dpmsingle", "k_lms", "k_euler", "k_euler_a", "k_dpm_2", "k_dpm_2_a",
)

DEFAULTS: dict[str, Any] = {
    "negative_prompt": "",
    "width": 512,
    "height": 512,
    "sample_steps": 30,
    "scale": 7.5,
    "seed": None,  # None: the trainer picks one
    "guidance_scale": 3.5,  # FLUX.1 distilled guidance
    "sample_sampler": None,  # None: the trainer's --sample_sampler
}
# keys a prompt has only when given (the family that reads them has its own default): Lumina 2's CFG truncation
# ratio (upstream's --ctr, 0.25) and renormalisation (--rcfg, 1.0); the flow shift (--fs) of HunyuanImage 2.1 (5.0)
# and Anima (3.0)
OPTIONAL = ("cfg_trunc_ratio", "renorm_cfg", "flow_shift")

# line option -> (key, description)
OPTIONS = {
    "n": ("negative_prompt", "negative prompt"),
    "w": ("width", "width in pixels"),
    "h": ("height", "height in pixels"),
    "s": ("sample_steps", "steps"),
    "l": ("scale", "CFG scale"),
    "d": ("seed", "seed"),
    "g": ("guidance_scale", "FLUX guidance"),
    "ss": ("sample_sampler", "sampler name"),
    "ctr": ("cfg_trunc_ratio", "Lumina 2 CFG truncation ratio"),
    "rcfg": ("renorm_cfg", "Lumina 2 CFG renormalisation"),
    "fs": ("flow_shift", "HunyuanImage 2.1 / Anima flow shift"),
}
KEYS = ("prompt",) + tuple(DEFAULTS) + OPTIONAL


def _number(value, kind):
    """int/float of `value`, or None when it is not one (booleans are not numbers here)."""
    if isinstance(value, bool):
        return None
    try:
        return kind(value)
    except (TypeError, ValueError):
        return None


def _convert(key: str, value, where: str):
    def fail(expected):
        raise PromptFileError(f"{where}: {key} must be {expected}, got {value!r}")

    if key in ("prompt", "negative_prompt"):
        if not isinstance(value, str):
            fail("text")
        return value.strip()
    if key in ("width", "height"):
        v = _number(value, int)
        if v is None or v < 64 or v % 8:
            fail("a whole number of pixels >= 64 and divisible by 8")
        return v
    if key == "sample_steps":
        v = _number(value, int)
        if v is None or v < 1:
            fail("a whole number >= 1")
        return v
    if key == "seed":
        if value is None:
            return None
        v = _number(value, int)
        if v is None or v < 0:
            fail("a whole number >= 0")
        return v
    if key in ("scale", "guidance_scale", "cfg_trunc_ratio", "renorm_cfg", "flow_shift"):
        v = _number(value, float)
        if v is None or v != v or v < 0:
            fail("a number >= 0")
        return v
    if key == "sample_sampler":
        if value is None:
            return None
        v = str(value).strip().lower()
        if v not in SAMPLERS:
            fail(f"one of {', '.join(SAMPLERS)}")
        return v
    raise PromptFileError(f"{where}: unknown key '{key}'; allowed: {', '.join(KEYS)}")


_OPTION_RE = re.compile(r"^(\w+)(?:\s+(.*))?$", re.DOTALL)


def parse_prompt_line(line: str, where: str = "prompt", defaults: Optional[dict] = None) -> dict:
    """'prompt --n neg --w 512 ...' -> prompt dict (all keys present)."""
    result = dict(DEFAULTS, **(defaults or {}))
    parts = line.split(" --")
    prompt = parts[0]
    if prompt.lstrip().startswith("--"):  # a line that starts with an option has no prompt text
        parts = [""] + prompt.lstrip()[2:].split(" --") + parts[1:]
        prompt = ""
    seen = set()
    for part in parts[1:]:
        m = _OPTION_RE.match(part.strip())
        if not m:
            raise PromptFileError(f"{where}: cannot read option '--{part.strip()}'; "
                                  f"options are {', '.join('--' + o for o in OPTIONS)}")
        opt, value = m.group(1), (m.group(2) or "").strip()
        if opt not in OPTIONS:
            allowed = ", ".join(f"--{o} ({desc})" for o, (_, desc) in OPTIONS.items())
            raise PromptFileError(f"{where}: unknown option '--{opt}'; allowed: {allowed}")
        if opt in seen:
            raise PromptFileError(f"{where}: option '--{opt}' given twice")
        seen.add(opt)
        key = OPTIONS[opt][0]
        if value == "" and key != "negative_prompt":
            raise PromptFileError(f"{where}: option '--{opt}' needs a value ({OPTIONS[opt][1]})")
        result[key] = _convert(key, value, where)
    result["prompt"] = prompt.strip()
    if not result["prompt"]:
        raise PromptFileError(f"{where}: the prompt text is empty")
    return result


def _from_mapping(entry: dict, where: str, defaults: dict, require_prompt: bool = True) -> dict:
    if not isinstance(entry, dict):
        raise PromptFileError(f"{where}: must be a table/object with a 'prompt' key")
    result = dict(defaults)
    for key, value in entry.items():
        if key not in KEYS:
            raise PromptFileError(f"{where}: unknown key '{key}'; allowed: {', '.join(KEYS)}")
        result[key] = _convert(key, value, where)
    if require_prompt and not result.get("prompt"):
        raise PromptFileError(f"{where}: needs a non-empty 'prompt'")
    return result


def parse_prompt_file(path: str, defaults: Optional[dict] = None) -> list[dict]:
    """Prompt dicts (keys: prompt, negative_prompt, width, height, sample_steps, scale, seed,
    guidance_scale, sample_sampler, enum) from a .txt, .toml or .json prompt file."""
    if not os.path.isfile(path):
        raise PromptFileError(f"sample prompt file does not exist: {path}")
    base = dict(DEFAULTS, **(defaults or {}))
    ext = os.path.splitext(path)[1].lower()
    prompts: list[dict] = []
    try:
        if ext == ".toml":
            with open(path, "rb") as f:
                data = tomllib.load(f)
            if set(data) - {"prompt"}:
                raise PromptFileError(f"{path}: unknown table(s) {sorted(set(data) - {'prompt'})}; "
                                      "expected [prompt] with [[prompt.subset]]")
            table = dict(data.get("prompt", {}))
            subsets = table.pop("subset", [])
            table_defaults = _from_mapping(table, f"{path} [prompt]", base, require_prompt=False)
            if not isinstance(subsets, list):
                raise PromptFileError(f"{path}: [[prompt.subset]] must be an array of tables")
            for i, entry in enumerate(subsets):
                prompts.append(_from_mapping(entry, f"{path} [[prompt.subset]] #{i + 1}", table_defaults))
        elif ext == ".json":
            with open(path, "r", encoding="utf-8") as f:
                data = json.load(f)
            if isinstance(data, dict):
                data = [data]
            if not isinstance(data, list):
                raise PromptFileError(f"{path}: expected a list of prompt objects")
            for i, entry in enumerate(data):
                prompts.append(_from_mapping(entry, f"{path} entry #{i + 1}", base))
        else:
            with open(path, "r", encoding="utf-8") as f:
                lines = f.read().splitlines()
            for n, line in enumerate(lines, start=1):
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                prompts.append(parse_prompt_line(line, f"{path} line {n}", base))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{path}: cannot parse: {e}") from e
    if not prompts:
        raise PromptFileError(f"{path}: no prompts (lines starting with '#' are comments)")
    for i, p in enumerate(prompts):
        p["enum"] = i
    return prompts

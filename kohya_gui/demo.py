"""The embedded demo: a tiny random SDXL- (or FLUX.1- / Chroma- / SD3- / Lumina 2- / HunyuanImage 2.1- / Anima-) shaped model and a few captioned images, made locally on
first use, so a new user (and the tests) can train on the CPU with no download.

A demo preset simply points its paths into ``cache/demo/``. Before a run, any of those paths that is missing is
made by a helper process (``python -m kohya_gui prepare-demo RUN.toml``) that imports the trainers' own
``library.tiny_models`` / ``library.flux_tiny``; kohya_gui itself never imports sd-scripts. Paths outside
``cache/demo/`` are never created or touched.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from . import REPO

DEMO_DIR = Path("cache") / "demo"
DEMO_PROMPTS = "a red circle on a blue background --w 64 --h 64 --s 4 --d 1\n"
DEMO_IMAGES = {"n": 4, "size": (64, 64), "repeats": 2, "name": "shapes"}
SD_FAMILY_NAMES = {"SD1.x": "sd1", "SD2.x": "sd2", "SDXL": "sdxl"}  # library.tiny_models' family names


def _demo_roots() -> list[Path]:
    return [(Path.cwd() / DEMO_DIR).resolve(), (REPO / DEMO_DIR).resolve()]


def in_demo_cache(path: str) -> bool:
    if not path:
        return False
    resolved = Path(path).resolve()
    return any(resolved.is_relative_to(root) for root in _demo_roots())


def missing_demo_paths(family: str, values: dict[str, Any]) -> dict[str, str]:
    """option name -> path, for the demo-cache paths of these settings that do not exist yet."""
    names = ["pretrained_model_name_or_path", "train_data_dir", "sample_prompts"]
    if family == "FLUX.1":
        names += ["clip_l", "t5xxl", "ae", "tokenizer_cache_dir"]  # Chroma's preset has no clip_l
    elif family == "Lumina 2":
        names += ["gemma2", "ae", "tokenizer_cache_dir"]
    elif family == "HunyuanImage 2.1":
        names += ["text_encoder", "byt5", "vae", "tokenizer_cache_dir"]
    elif family == "Anima":
        names += ["qwen3", "vae", "tokenizer_cache_dir"]
    elif values.get("tokenizer_cache_dir"):
        names.append("tokenizer_cache_dir")
    out = {}
    for name in names:
        path = values.get(name) or ""
        if in_demo_cache(path) and not Path(path).exists():
            out[name] = path
    return out


def prepare_commands(family: str, values: dict[str, Any], config_path) -> list[list[str]]:
    """The helper run that makes the missing demo files, or [] when there is nothing to make."""
    if not missing_demo_paths(family, values):
        return []
    return [[sys.executable, "-m", "kohya_gui", "prepare-demo", str(config_path)]]


def make_assets(family: str, values: dict[str, Any], log=print) -> list[str]:
    """Makes the missing demo files (runs in the helper process). Returns what it made."""
    missing = missing_demo_paths(family, values)
    if not missing:
        log("demo: everything is in place")
        return []
    sd_scripts = str(REPO / "sd-scripts")
    if sd_scripts not in sys.path:
        sys.path.insert(0, sd_scripts)
    made = []
    model_keys = {"pretrained_model_name_or_path", "clip_l", "t5xxl", "ae", "tokenizer_cache_dir", "gemma2",
                  "text_encoder", "byt5", "vae", "qwen3"}
    if model_keys & missing.keys():
        model = Path(values["pretrained_model_name_or_path"])
        if family == "HunyuanImage 2.1":
            from library import hunyuan_image_models

            log(f"demo: making a tiny HunyuanImage 2.1 model in {model.parent} (CPU, random weights)")
            made += list(hunyuan_image_models.make_tiny_hunyuan_image(model.parent).values())
        elif family == "Anima":
            from library import anima_models

            log(f"demo: making a tiny Anima model in {model.parent} (CPU, random weights)")
            made += list(anima_models.make_tiny_anima(model.parent).values())
        elif family == "Lumina 2":
            from library import lumina_models

            log(f"demo: making a tiny Lumina 2 model in {model.parent} (CPU, random weights)")
            made += list(lumina_models.make_tiny_lumina(model.parent).values())
        elif family == "FLUX.1" and values.get("model_type") == "chroma":
            from library import chroma_models

            log(f"demo: making a tiny Chroma model in {model.parent} (CPU, random weights)")
            made += list(chroma_models.make_tiny_chroma(model.parent).values())
        elif family == "SD3":
            from library import sd3_models

            log(f"demo: making a tiny SD3 model in {model.parent} (CPU, random weights)")
            made += [p for p in sd3_models.make_tiny_sd3(model.parent).values()]
        elif family == "FLUX.1":
            from library import flux_tiny

            log(f"demo: making a tiny FLUX.1 model in {model.parent} (CPU, random weights)")
            paths = flux_tiny.make_tiny_flux(model.parent)
            made += [p for p in paths.values()]
        else:
            from library import tiny_models

            layout = "single_file" if model.suffix in (".safetensors", ".ckpt") else "diffusers"
            log(f"demo: making a tiny {family} model at {model} ({layout}, CPU, random weights)")
            # make_tiny_sd(dir, family) writes dir/tiny_<family>.safetensors or dir/tiny_<family>_diffusers
            result = tiny_models.make_tiny_sd(model.parent, SD_FAMILY_NAMES[family], layout)
            if Path(result).resolve() != model.resolve():
                raise RuntimeError(f"demo: the tiny model was written to {result}, but the preset expects {model}")
            made.append(str(result))
    if "train_data_dir" in missing:
        from library import tiny_models

        dest = Path(missing["train_data_dir"])
        log(f"demo: making {DEMO_IMAGES['n']} captioned {DEMO_IMAGES['size'][0]}px images in {dest}")
        tiny_models.make_captioned_images(dest, DEMO_IMAGES["n"], DEMO_IMAGES["size"], DEMO_IMAGES["repeats"],
                                          DEMO_IMAGES["name"])
        made.append(str(dest))
    if "sample_prompts" in missing:
        path = Path(missing["sample_prompts"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(DEMO_PROMPTS, encoding="utf-8")
        made.append(str(path))
    for name, path in missing.items():
        if not Path(path).exists():
            raise RuntimeError(f"demo: {name} = {path} was not created; check the demo preset's paths")
    log("demo: ready")
    return made

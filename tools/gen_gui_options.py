"""Writes kohya_gui/options/<script>.json: each trainer's `--dump_options` output, which the GUI's registry is
built from (the GUI never imports the trainers), and kohya_gui/options/tools/<folder>__<script>.json for the tool
scripts of the Utilities tab (sd-scripts/networks/*.py, sd-scripts/finetune/*.py).

    python tools/gen_gui_options.py           # writes the files
    python tools/gen_gui_options.py --check   # exit 1 when one is stale (tests/test_gui_contract.py runs this)
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "kohya_gui" / "options"
SCRIPTS = ("sdxl_train_network", "train_network", "flux_train_network", "sdxl_train", "train_db", "fine_tune",
           "flux_train", "sd3_train_network", "sd3_train")
SCRIPTS += ("train_textual_inversion", "sdxl_train_textual_inversion")
SCRIPTS += ("lumina_train_network", "lumina_train")  # Lumina Image 2.0 (library/families/lumina.py)
SCRIPTS += ("hunyuan_image_train_network",)  # HunyuanImage 2.1 (library/families/hunyuan_image.py)
SCRIPTS += ("anima_train_network", "anima_train")  # Anima (library/families/anima.py)
# the Utilities tab's tools (kohya_gui/tools.py has their presentation); a script that is not there yet is left out
TOOL_SCRIPTS = tuple(f"finetune/{n}" for n in (
    "tag_images_by_wd14_tagger", "make_captions", "make_captions_by_git", "make_captions_by_florence2",
    "merge_captions_to_metadata", "merge_dd_tags_to_metadata", "clean_captions_and_tags", "prepare_buckets_latents")
) + tuple(f"networks/{n}" for n in (
    "resize_lora", "merge_lora", "sdxl_merge_lora", "flux_merge_lora", "svd_merge_lora", "extract_lora_from_models",
    "flux_extract_lora", "extract_lora_from_dylora", "check_lora_weights", "convert_flux_lora"))


def render(script: str) -> str:
    """`script`: a trainer name, or a tool's "<folder>/<name>" under sd-scripts/."""
    sys.path.insert(0, str(REPO / "sd-scripts"))
    from library import option_dump

    parser = importlib.import_module(script.replace("/", ".")).setup_parser()
    return json.dumps(option_dump.describe(parser), indent=1) + "\n"


def tool_option_file(script: str) -> Path:
    return OUT / "tools" / f"{script.replace('/', '__')}.py.json"


def targets() -> list[tuple[str, Path]]:
    tools = [(s, tool_option_file(s)) for s in TOOL_SCRIPTS if (REPO / "sd-scripts" / f"{s}.py").is_file()]
    return [(s, OUT / f"{s}.py.json") for s in SCRIPTS] + tools


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    stale = []
    for script, path in targets():
        text = render(script)
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(path.name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if stale:
        print(f"stale: {', '.join(stale)}; run python tools/gen_gui_options.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The Utilities tab's tool scripts (captioning, dataset and LoRA tools under sd-scripts/networks and
sd-scripts/finetune): a table of presentation (label, group, which options come first, which ones name what the
tool writes), their options from each script's `--dump_options` (kohya_gui/options/tools/*.json, written by
tools/gen_gui_options.py), and a run through the training runner: `python sd-scripts/<folder>/<script>.py ...`.

The GUI never imports the scripts; a tool whose script or option file is missing is not in TOOLS."""

from __future__ import annotations

import functools
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import REPO, config_file, last_settings, quoting
from .runner import run_env

OPTIONS_DIR = Path(__file__).with_name("options") / "tools"
GROUPS = {"captioning": "Captioning", "dataset": "Dataset preparation", "lora": "LoRA tools"}
NOT_SETTINGS = frozenset({"dump_options"})
# the tools' own --overwrite is the form's "Overwrite existing results" box (one box for every tool)
OVERWRITE = "overwrite"
NO_CONTROL = NOT_SETTINGS | {OVERWRITE}


class ToolError(ValueError):
    """Tool settings that cannot be run; the message names the field and what is allowed."""


@dataclass(frozen=True)
class Option:
    """One argument of a tool script, as its `--dump_options` describes it."""
    name: str
    flag: str  # "" for a positional argument
    kind: str  # bool, int, float, str
    default: Any
    help: str = ""
    choices: tuple = ()
    nargs: Any = None
    required: bool = False

    @property
    def positional(self) -> bool:
        return not self.flag

    @property
    def is_list(self) -> bool:
        return self.nargs not in (None, "?")

    def convert(self, value: Any) -> Any:
        """A control's value as the script's type (empty = the default). Raises ValueError with the reason."""
        if self.kind == "bool":
            return bool(value)
        if value == self.default:  # as shown: a default with spaces (the tagger's ", " separator) stays as it is
            return self.default
        if isinstance(value, str):
            value = value.strip()
        if value is None or value == "":
            return self.default
        if self.is_list:
            items = shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
            return [self._one(v) for v in items]
        return self._one(value)

    def _one(self, value: Any) -> Any:
        if self.kind in ("int", "float"):
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"expected a number, got {value!r}") from None
            if self.kind == "int":
                if number != int(number):
                    raise ValueError(f"expected a whole number, got {value!r}")
                value = int(number)
            else:
                value = number
        else:
            value = str(value)
        if self.choices and value not in self.choices:
            raise ValueError(f"{value!r} is not one of {', '.join(str(c) for c in self.choices)}")
        return value

    def args(self, value: Any) -> list[str]:
        """The command-line words for this value ([] at the default)."""
        if self.kind == "bool":
            return [self.flag] if value != bool(self.default) else []
        if value is None or (value == self.default and not self.positional):
            return []
        words = [_word(v) for v in value] if isinstance(value, list) else [_word(value)]
        return words if self.positional else [self.flag, *words]


def _word(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class Tool:
    script: str  # under sd-scripts/, e.g. "networks/resize_lora.py"
    label: str
    group: str  # a GROUPS key
    about: str
    main: tuple[str, ...] = ()  # options shown first, in this order; the others go under "More options"
    outputs: tuple[str, ...] = ()  # options naming the file or folder the tool writes (refused when it exists)
    folders: tuple[str, ...] = ()  # options naming a folder (presentation: placeholder; output folder)
    labels: dict = field(default_factory=dict)  # option -> label (else the option name in words)

    @property
    def key(self) -> str:
        return Path(self.script).stem

    @property
    def option_file(self) -> Path:
        return OPTIONS_DIR / f"{self.script.replace('/', '__')}.json"

    @property
    def options(self) -> tuple[Option, ...]:
        return _options(self.option_file)

    def option(self, name: str) -> Option:
        return next(o for o in self.options if o.name == name)

    def label_of(self, o: Option) -> str:
        return self.labels.get(o.name) or COMMON_LABELS.get(o.name) or o.name.replace("_", " ").capitalize()

    def ordered(self) -> tuple[list[Option], list[Option]]:
        """(main options in `main` order after the positionals, the other options in the script's order)."""
        opts = [o for o in self.options if o.name not in NO_CONTROL]
        first = [o for o in opts if o.positional] + [self.option(n) for n in self.main
                                                     if not self.option(n).positional]
        return first, [o for o in opts if o not in first]


@functools.cache
def _options(path: Path) -> tuple[Option, ...]:
    return tuple(Option(o["name"], o["flag"], o["kind"], o["default"], o.get("help", ""),
                        tuple(o.get("choices") or ()), o.get("nargs"), bool(o.get("required") or o.get("positional")))
                 for o in json.loads(path.read_text(encoding="utf-8")))


COMMON_LABELS = {"sd_model": "Model to merge into", "models": "LoRA files", "ratios": "Ratios (one per LoRA)",
                "save_to": "Save to", "model_org": "Original model", "model_tuned": "Tuned model"}
CAPTION_MAIN = ("caption_extension", "batch_size", "recursive", "debug")
_TABLE = (
    # captioning: each writes a caption file next to every image of the folder
    Tool("finetune/tag_images_by_wd14_tagger.py", "WD14 tagger (ONNX)", "captioning",
         "Tags the images with a SmilingWolf WD tagger (v2, v3, eva02-large ...) from the Hub or a folder.",
         main=("repo_id", "thresh", "general_threshold", "character_threshold", "undesired_tags",
               "always_first_tags", "tag_replacement", "model_dir", "caption_separator", *CAPTION_MAIN,
               "append_tags", "skip_existing", "character_tags_first", "remove_underscore", "use_rating_tags"),
         folders=("train_data_dir", "model_dir"), labels={"train_data_dir": "Image folder", "repo_id": "Tagger"}),
    Tool("finetune/make_captions.py", "BLIP captions", "captioning", "Captions the images with BLIP.",
         main=("caption_weights", "beam_search", "num_beams", "top_p", "max_length", "min_length", *CAPTION_MAIN,
               "skip_existing"),
         folders=("train_data_dir",), labels={"train_data_dir": "Image folder", "caption_weights": "BLIP model"}),
    Tool("finetune/make_captions_by_git.py", "GIT captions", "captioning", "Captions the images with GIT.",
         main=("model_id", "max_length", "remove_words", *CAPTION_MAIN, "skip_existing"),
         folders=("train_data_dir",), labels={"train_data_dir": "Image folder", "model_id": "GIT model"}),
    Tool("finetune/make_captions_by_florence2.py", "Florence-2 captions", "captioning",
         "Captions (short, detailed, more detailed) or tags the images with Florence-2.",
         main=("model_id", "task", "prompt", "num_beams", "max_new_tokens", "dtype", *CAPTION_MAIN, "skip_existing"),
         folders=("train_data_dir",), labels={"train_data_dir": "Image folder", "model_id": "Florence-2 model"}),
    # dataset: kohya's fine-tune metadata
    Tool("finetune/merge_captions_to_metadata.py", "Merge captions into metadata JSON", "dataset",
         "Writes each image's caption file into kohya's fine-tune metadata JSON (the Fine-tune tab's "
         "`in_json`).", main=("in_json", "caption_extension", "recursive", "full_path"),
         outputs=("out_json",), folders=("train_data_dir",),
         labels={"train_data_dir": "Image folder", "out_json": "Metadata JSON to write",
                 "in_json": "Existing metadata JSON to merge into"}),
    Tool("finetune/merge_dd_tags_to_metadata.py", "Merge tags into metadata JSON", "dataset",
         "Writes each image's tag file (the WD14 tagger's) into the fine-tune metadata JSON.",
         main=("in_json", "caption_extension", "recursive", "full_path"), outputs=("out_json",),
         folders=("train_data_dir",), labels={"train_data_dir": "Image folder", "out_json": "Metadata JSON to write",
                                              "in_json": "Existing metadata JSON to merge into"}),
    Tool("finetune/clean_captions_and_tags.py", "Clean captions and tags", "dataset",
         "Cleans the captions and tags of a metadata JSON as upstream does (tag spelling, duplicated words).",
         outputs=("out_json",), labels={"in_json": "Metadata JSON", "out_json": "Cleaned metadata JSON to write"}),
    Tool("finetune/prepare_buckets_latents.py", "Bucket latents (fine-tune)", "dataset",
         "Sorts the images into resolution buckets and caches their latents for the Fine-tune tab.",
         main=("max_resolution", "min_bucket_reso", "max_bucket_reso", "bucket_reso_steps", "batch_size",
               "mixed_precision", "bucket_no_upscale", "flip_aug", "skip_existing", "recursive", "full_path"),
         outputs=("out_json",), folders=("train_data_dir",),
         labels={"train_data_dir": "Image folder", "in_json": "Metadata JSON", "out_json": "Metadata JSON to write",
                 "model_name_or_path": "Model (its VAE encodes the images)"}),
    # LoRA tools
    Tool("networks/resize_lora.py", "Resize LoRA", "lora",
         "Gives a LoRA a lower rank by SVD: a fixed rank, or per module from its singular values (sv_ratio, "
         "sv_fro, sv_cumulative).",
         main=("model", "save_to", "new_rank", "new_conv_rank", "dynamic_method", "dynamic_param", "save_precision",
               "device", "verbose"), outputs=("save_to",), labels={"model": "LoRA to resize"}),
    Tool("networks/merge_lora.py", "Merge LoRA (SD1.x / SD2.x)", "lora",
         "Merges LoRAs into a model (with a model), or into one LoRA (without).",
         main=("sd_model", "models", "ratios", "save_to", "precision", "save_precision", "v2", "concat"),
         outputs=("save_to",)),
    Tool("networks/sdxl_merge_lora.py", "Merge LoRA (SDXL)", "lora",
         "Merges LoRAs into an SDXL model (with a model), or into one LoRA (without).",
         main=("sd_model", "models", "ratios", "save_to", "precision", "save_precision", "lbws", "concat"),
         outputs=("save_to",)),
    Tool("networks/flux_merge_lora.py", "Merge LoRA (FLUX.1)", "lora",
         "Merges LoRAs into a FLUX.1 model and its text encoders (with a model), or into one LoRA (without).",
         main=("flux_model", "models", "ratios", "save_to", "clip_l", "clip_l_save_to", "t5xxl", "t5xxl_save_to",
               "precision", "save_precision", "diffusers", "concat"),
         outputs=("save_to", "clip_l_save_to", "t5xxl_save_to"),
         labels={"flux_model": "FLUX.1 model to merge into"}),
    Tool("networks/svd_merge_lora.py", "Merge LoRAs by SVD (new rank)", "lora",
         "Adds LoRAs of any ranks and makes one LoRA of a new rank by SVD.",
         main=("models", "ratios", "save_to", "new_rank", "new_conv_rank", "precision", "save_precision", "device"),
         outputs=("save_to",)),
    Tool("networks/extract_lora_from_models.py", "Extract LoRA (SD1.x / SD2.x / SDXL)", "lora",
         "Makes a LoRA from the difference between a tuned model and its original, by SVD.",
         main=("model_org", "model_tuned", "save_to", "dim", "conv_dim", "sdxl", "v2", "device", "clamp_quantile",
               "save_precision"), outputs=("save_to",)),
    Tool("networks/flux_extract_lora.py", "Extract LoRA (FLUX.1)", "lora",
         "Makes a LoRA from the difference between a tuned FLUX.1 model and its original, by SVD.",
         main=("model_org", "model_tuned", "save_to", "dim", "device", "clamp_quantile", "save_precision"),
         outputs=("save_to",)),
    Tool("networks/extract_lora_from_dylora.py", "Extract LoRAs from a DyLoRA", "lora",
         "Writes one LoRA per rank step of a DyLoRA (<name>-<rank>).", main=("model", "save_to", "unit"),
         outputs=("save_to",), labels={"model": "DyLoRA file"}),
    Tool("networks/check_lora_weights.py", "Check LoRA weights", "lora",
         "Lists a LoRA's modules with the mean and the mean absolute value of their weights (all zero = not "
         "trained).", labels={"file": "LoRA file"}),
    Tool("networks/convert_flux_lora.py", "Convert FLUX.1 LoRA format", "lora",
         "Converts a FLUX.1 LoRA between sd-scripts' keys and ai-toolkit / diffusers keys.",
         main=("src_path", "dst_path", "src", "dst"), outputs=("dst_path",),
         labels={"src_path": "LoRA to convert", "dst_path": "Save to", "src": "From format", "dst": "To format"}),
)

TOOLS: tuple[Tool, ...] = tuple(t for t in _TABLE
                                if (REPO / "sd-scripts" / t.script).is_file() and t.option_file.is_file())


def tool(key: str) -> Tool:
    for t in TOOLS:
        if t.key == key:
            return t
    raise ToolError(f"unknown tool {key!r}; the tools are: {', '.join(t.key for t in TOOLS)}")


def in_group(group: str) -> list[Tool]:
    return [t for t in TOOLS if t.group == group]


# ---- values -> command -----------------------------------------------------------------------------------------

def values_from_ui(t: Tool, ui_values: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(values, errors) from the controls' values by option name; errors name the field."""
    values, errors = {}, []
    for o in t.options:
        if o.name in NO_CONTROL:
            continue
        try:
            values[o.name] = o.convert(ui_values.get(o.name))
        except ValueError as e:
            errors.append(f"{t.label_of(o)} ({o.flag or o.name}): {e}")
            values[o.name] = o.default
    return values, errors


def validation_errors(t: Tool, values: dict[str, Any], overwrite: bool = False) -> list[str]:
    errors = [f"{t.label_of(o)} ({o.flag or o.name}) is required" for o in t.options
              if o.required and values.get(o.name) in (None, "", [])]
    if not overwrite:
        for name in t.outputs:
            value = values.get(name)
            if value and name not in t.folders and Path(value).is_file():
                errors.append(f"{t.label_of(t.option(name))} ({t.option(name).flag or name}): {value} already "
                              "exists; choose another name, or tick 'Overwrite existing results'")
    return errors


def script_path(t: Tool) -> str:
    path = REPO / "sd-scripts" / t.script
    try:
        return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd().resolve()) else str(path)
    except ValueError:  # other drive on Windows
        return str(path)


def argv(t: Tool, values: dict[str, Any]) -> list[str]:
    """`python sd-scripts/<script> <positionals> <options not at their default>` (python: the venv's, first on the
    run's PATH)."""
    words = [w for o in t.options if o.positional for w in o.args(values.get(o.name))]
    words += [w for o in t.options if not o.positional and o.name not in NOT_SETTINGS
              for w in o.args(values.get(o.name, o.default))]
    return ["python", script_path(t), *words]


def printable(argv_: list[str], shell: str | None = None) -> str:
    return quoting.join(argv_, shell)


def output_dir(t: Tool, values: dict[str, Any]) -> str | None:
    """Where the tool's results go (the run panel lists the new files there)."""
    for name in t.outputs:
        value = values.get(name)
        if value:
            return str(value) if name in t.folders else str(Path(value).parent)
    return None


def log_path(t: Tool) -> Path:
    """Tool logs stay out of the user's dataset folders: <user config>/kohya_gui/tool_logs/<tool>.log."""
    return last_settings.folder() / "tool_logs" / f"{t.key}.log"


def with_overwrite(t: Tool, values: dict[str, Any], overwrite: bool) -> dict[str, Any]:
    """The values with the tool's own --overwrite set from the form's box (when the tool has one)."""
    return {**values, OVERWRITE: bool(overwrite)} if any(o.name == OVERWRITE for o in t.options) else values


def is_tool_run(commands: list[list[str]]) -> bool:
    """Whether a run's commands are a tool's (`python sd-scripts/<tool script> ...`)."""
    scripts = {str((REPO / "sd-scripts" / t.script).resolve()) for t in TOOLS}
    return bool(commands) and all(len(c) > 1 and c[0] == "python" and str(Path(c[1]).resolve()) in scripts
                                  for c in commands)


def check(t: Tool, values: dict[str, Any], overwrite: bool = False) -> None:
    """Raises ToolError listing what must be fixed before the tool can run."""
    errors = validation_errors(t, values, overwrite)
    if errors:
        raise ToolError(f"Cannot run {t.label}:\n" + "\n".join(f"- {e}" for e in errors))


def start(runner, t: Tool, values: dict[str, Any], overwrite: bool = False) -> list[str]:
    """Checks, then runs the tool with the training runner (progress, log, Stop). Returns its argv. Raises ToolError
    or runner.RunnerBusy."""
    check(t, values, overwrite)
    command = argv(t, with_overwrite(t, values, overwrite))
    with runner.reserved():
        runner.start([command], log_path(t), env=run_env(), output_dir=output_dir(t, values), cwd=os.getcwd())
    return command


# ---- the run queue ---------------------------------------------------------------------------------------------------

QUEUE_TAB = "tool"  # a queue entry's "tab" for a tool run; its settings file is <id>.tool.json


def save_queued(path: Path, t: Tool, values: dict[str, Any], overwrite: bool) -> None:
    data = {"tool": t.key, "values": values, "overwrite": overwrite}
    config_file.write_text_atomic(path, json.dumps(data, indent=1) + "\n")


def start_queued(runner, path: str | os.PathLike) -> list[str]:
    """Starts a queued tool run from its settings file (checked again: a result may exist by now)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        t, values, overwrite = tool(data["tool"]), data["values"], bool(data.get("overwrite"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ToolError(f"Cannot read the queued tool run {path}: {e}") from None
    return start(runner, t, values, overwrite)

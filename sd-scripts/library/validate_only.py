"""`--validate_only`: every check a run makes before it loads a model, and a few more, without loading one.

The GUI's Start and Print run the script with this flag (through its command line: the GUI never imports the
trainers), so a missing file, an empty dataset, an impossible compile setting or a missing optional package shows
next to the button instead of 10 seconds into a run. The checks are the run's own (the same functions raise the
same errors in a real run); they are tried one group at a time and every problem is reported, not only the first.
Exit status 2 with one "error:" line per problem, or 0 with one "ok" line. Our own option: upstream has none.
"""
from __future__ import annotations

import argparse
import os
import re

from library.errors import ConfigError, UserError

# path options that must exist when set (a hub id "owner/name" is allowed where upstream allows one)
FILES = ("vae", "clip_l", "clip_g", "t5xxl", "ae", "network_weights", "in_json", "dataset_config", "sample_prompts",
         "log_tracker_config")
FOLDERS = ("train_data_dir", "reg_data_dir", "conditioning_data_dir")
HUB_OK = ("pretrained_model_name_or_path", "vae")
DATASET_PATHS = ("train_data_dir", "reg_data_dir", "conditioning_data_dir", "in_json", "dataset_config")


class ValidationProblems(ConfigError):
    """All the problems --validate_only found, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(f"{len(problems)} problem(s) found:\n" + "\n".join(f"- {p}" for p in problems))


def add_validate_only_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--validate_only", action="store_true",
                        help="check the options, config files, paths, dataset, compile settings and optional "
                             "packages, then exit without loading a model (0: ok, 2: problems listed)")


def _hub_id(value: str) -> bool:
    return re.fullmatch(r"[\w.\-]+/[\w.\-]+", value) is not None and not value.startswith((".", "/"))


def missing_paths(args) -> list[str]:
    problems = []

    def check(name, value, want_dir):
        if not value or os.path.exists(value):
            if value and want_dir and not os.path.isdir(value):
                problems.append(f"--{name}: {value} is not a folder")
            return
        if name in HUB_OK and _hub_id(value):
            return  # downloaded by the run (fails there when offline)
        problems.append(f"--{name}: {'folder' if want_dir else 'file'} not found: {value}")

    check("pretrained_model_name_or_path", getattr(args, "pretrained_model_name_or_path", None), False)
    for name in FILES:
        check(name, getattr(args, name, None), False)
    for name in FOLDERS:
        check(name, getattr(args, name, None), True)
    if getattr(args, "resume", None) and not getattr(args, "resume_from_huggingface", False):
        check("resume", args.resume, True)
    for path in getattr(args, "base_weights", None) or []:
        check("base_weights", path, False)
    return problems


def run(trainer, args) -> None:
    """Runs the checks; raises ValidationProblems (exit 2 through the scripts' run()) or prints the ok line."""
    from library import config_util, state_folders, train_util
    from library.compile import options as compile_options

    problems: list[str] = []

    def attempt(fn):
        try:
            return fn()
        except UserError as e:
            problems.extend(e.problems if isinstance(e, ValidationProblems) else [str(e)])
            return None

    attempt(lambda: trainer.check_common_options(args))
    attempt(lambda: trainer.check_args(args))
    compiled = compile_options.compile_args(args)
    if compiled is not None:
        attempt(lambda: compile_options.validate_compile_args(compiled))
    problems.extend(missing_paths(args))
    output_name = args.output_name or trainer.default_output_name
    ext = trainer.output_ext(args)
    if args.output_dir:  # unset: the checks above said so
        attempt(lambda: train_util.check_outputs_free(args.output_dir, output_name, ext, args.overwrite_output,
                                                      bool(args.resume)))
    if args.resume and os.path.isdir(args.resume):
        attempt(lambda: state_folders.check_resume(args, ext))
    images = None
    if not any(p.startswith(tuple(f"--{n}:" for n in DATASET_PATHS)) for p in problems):
        family = trainer.family_for(args)
        kinds = trainer.dataset_kinds + ((config_util.CONTROLNET,) if getattr(args, "masked_loss", False) else ())
        groups = attempt(lambda: config_util.build_dataset_groups(args, family, kinds))
        if groups is not None:
            group = groups[0]
            images = sum(1 for _ in group.all_images())
            multiple = getattr(trainer, "bucket_reso_steps_multiple", None)  # the run's own check, where it has one
            for g in groups:
                if g is not None and multiple:
                    attempt(lambda g=g: g.verify_bucket_reso_steps(multiple))
            if len(group) == 0:
                problems.append("the dataset has no images: check --train_data_dir (N_name subfolders of images) "
                                "or --dataset_config")
    problems = list(dict.fromkeys(problems))  # a check reached twice reports once
    if problems:
        raise ValidationProblems(problems)
    print(f"validate_only: ok ({images} training images; no model loaded)", flush=True)

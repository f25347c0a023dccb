"""Importing a kohya_ss GUI configuration (its JSON, any version) into our settings, with a report of every key.

kohya_ss saves its form as JSON with its own field names; most are the trainers' option names, some are not
(`max_resolution`, `optimizer`, `LoRA_type` ...), and old files store numbers as text. Each key is mapped to our
option (converted where kohya_ss means something else by it), or dropped with the reason. Run TOMLs written by
kohya_ss or by sd-scripts' `--output_config` hold the trainers' own option names and go through the same path.
Nothing is silent: the report lists every key of the file.
"""

from __future__ import annotations

import json
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomlkit

from . import config_file
from . import params as P


class ImportError_(ValueError):
    """A file that cannot be imported; the message says why."""


@dataclass
class Imported:
    tab: str
    family: str
    values: dict[str, Any]
    report: list[tuple[str, str, str]] = field(default_factory=list)  # (key, "mapped"/"converted"/"dropped", why)
    # files kohya_ss makes from its form before a run, written beside our configuration: option -> (file name
    # suffix, text); e.g. the inline sample prompts, the fine-tune image folder as a dataset config
    side_files: dict[str, tuple[str, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what the file does not say (a guessed model family)

    def report_lines(self) -> list[str]:
        return [f"{key}: {what}" + (f" ({why})" if why else "") for key, what, why in self.report]

    def write_side_files(self, base: Path, force: bool = False, free_names: bool = False) -> list[Path]:
        """Writes the side files as <base stem><suffix> and sets their options. An existing file is replaced only
        with `force`: otherwise it stops the import (nothing written), or with `free_names` the side file takes
        the next free name (<stem>-2<suffix> ...)."""
        paths = {}
        for name, (suffix, text) in self.side_files.items():
            path, n = base.with_name(base.stem + suffix), 1
            while free_names and path.exists() and path.read_text(encoding="utf-8", errors="replace") != text:
                n += 1
                path = base.with_name(f"{base.stem}-{n}{suffix}")
            paths[name] = path
        taken = [str(p) for p in paths.values() if p.exists()]
        if taken and not force and not free_names:
            raise ImportError_(f"{', '.join(taken)} exists; choose another name or pass --force")
        for name, path in paths.items():
            config_file.write_text_atomic(path, self.side_files[name][1])
            self.values[name] = str(path)
        return list(paths.values())


RENAMED = {"max_resolution": "resolution", "optimizer": "optimizer_type", "lora_network_weights": "network_weights",
           "sdxl_no_half_vae": "no_half_vae", "sdxl_cache_text_encoder_outputs": "cache_text_encoder_outputs",
           "flux1_cache_text_encoder_outputs": "cache_text_encoder_outputs",
           "flux1_cache_text_encoder_outputs_to_disk": "cache_text_encoder_outputs_to_disk",
           "batch_size": "train_batch_size"}
LORA_RENAMED = {"learning_rate_te": "text_encoder_lr"}  # the LoRA scripts' name for it; train_db/fine_tune keep it
ZERO_IS_UNSET = {"vae_batch_size"}  # kohya_ss writes 0 for "not set" where the trainer's default is another number
# text-encoder rates of the full trainers: kohya_ss passes 0 as written, and 0 means "not trained" there
ZERO_IS_A_RATE = {"learning_rate_te", "learning_rate_te1", "learning_rate_te2"}
# kohya_ss' fine-tune fields that describe the data (see _finetune_data)
FINETUNE_DATA_KEYS = ("image_folder", "train_dir", "generate_caption_database", "create_caption",
                      "generate_image_buckets", "create_buckets", "use_latent_files", "caption_metadata_filename",
                      "latent_metadata_filename", "full_path")
TEXTUAL_INVERSION_KEYS = ("token_string", "init_word", "num_vectors_per_token")
FAMILY_KEYS = ("sdxl", "sdxl_checkbox", "v2", "flux1_checkbox", "sd3_checkbox", "model_list")
# kohya_ss LoRA_type -> (network_module, fixed network_args); kohya_ss runs "LoCon" with LyCORIS
LORA_TYPES = {
    "Standard": ("networks.lora", []), "Kohya LoCon": ("networks.lora", []),
    "Kohya DyLoRA": ("networks.dylora", []), "LoRA-FA": ("networks.lora_fa", []),
    "Flux1": ("networks.lora_flux", []), "Flux1 OFT": ("networks.oft_flux", []),
    "LoCon": ("lycoris.kohya", ["algo=locon"]), "LyCORIS/LoCon": ("lycoris.kohya", ["algo=locon"]),
    "LyCORIS/LoHa": ("lycoris.kohya", ["algo=loha"]), "LyCORIS/LoKr": ("lycoris.kohya", ["algo=lokr"]),
    "LyCORIS/iA3": ("lycoris.kohya", ["algo=ia3"]), "LyCORIS/DyLoRA": ("lycoris.kohya", ["algo=dylora"]),
    "LyCORIS/GLoRA": ("lycoris.kohya", ["algo=glora"]), "LyCORIS/Diag-OFT": ("lycoris.kohya", ["algo=diag-oft"]),
    "LyCORIS/BOFT": ("lycoris.kohya", ["algo=boft"]), "LyCORIS/Native Fine-Tuning": ("lycoris.kohya", ["algo=full"]),
}
# kohya_ss' network fields, passed as network_args where the chosen module reads them (a field at its "unset"
# value is left out); the network_args key where kohya_ss passes the field under another name
NET_FIELDS = ("conv_dim", "conv_alpha", "rank_dropout", "module_dropout", "block_dims", "block_alphas",
              "conv_block_dims", "conv_block_alphas", "down_lr_weight", "mid_lr_weight", "up_lr_weight",
              "block_lr_zero_threshold", "loraplus_lr_ratio", "loraplus_unet_lr_ratio",
              "loraplus_text_encoder_lr_ratio", "unit", "train_blocks", "train_norm", "use_tucker", "use_cp",
              "use_scalar", "rank_dropout_scale", "dora_wd", "constrain", "rescaled", "bypass_mode",
              "decompose_both", "factor", "train_on_input", "split_qkv", "train_t5xxl", "in_dims",
              "train_double_block_indices", "train_single_block_indices", "img_attn_dim", "img_mlp_dim",
              "img_mod_dim", "single_dim", "txt_attn_dim", "txt_mlp_dim", "txt_mod_dim", "single_mod_dim",
              "enable_all_linear", "ggpo_sigma", "ggpo_beta")
LYCORIS_NAMES = {"use_cp": "use_tucker", "constrain": "constraint", "unit": "block_size"}


def _unset(value: Any) -> bool:
    return value is None or value == "" or value is False or (isinstance(value, (int, float)) and value == 0)


def _looks_like_path(value: str) -> bool:
    return "\n" not in value.strip() and (Path(value).exists() or value.endswith((".txt", ".toml", ".json")))


def _network(data: dict, report: list) -> tuple[str | None, list[str], dict[str, tuple[str, str]]]:
    """(module, network_args, {kohya_ss network field: (what, why)}) for a kohya_ss LoRA_type and its fields."""
    lora_type = data.get("LoRA_type")
    if lora_type is None:
        return None, [], {}
    if lora_type not in LORA_TYPES:
        report.append(("LoRA_type", "dropped", f"{lora_type!r} is not a network type here; "
                                                f"known: {', '.join(LORA_TYPES)}"))
        return None, [], {}
    module, args = LORA_TYPES[lora_type][0], list(LORA_TYPES[lora_type][1])
    reads = {p.network_arg for p in P.PARAMS if module in p.modules}  # the keys the module reads
    dylora = module == "networks.dylora" or "algo=dylora" in args
    handled = {}
    for name in NET_FIELDS:
        if name not in data:
            continue
        value = data[name]
        key = LYCORIS_NAMES.get(name, name) if module == "lycoris.kohya" else name
        if _unset(value) or name == "factor" and value in (-1, "-1"):
            handled[name] = ("converted", "unset")  # factor -1: LyCORIS' own default
        elif name == "unit" and not dylora or name.startswith("ggpo_") and not data.get("train_lora_ggpo"):
            handled[name] = ("dropped", f"not used by {lora_type}")
        elif key not in reads:
            handled[name] = ("dropped", f"{module} does not read {key}")
        else:
            args.append(f"{key}={value}")
            handled[name] = ("converted", f"into network_args {key}={value}")
    if module == "lycoris.kohya" and data.get("LyCORIS_preset") not in (None, "", "full"):
        args.append(f"preset={data['LyCORIS_preset']}")
    handled["LyCORIS_preset"] = ("converted", "into network_args" if module == "lycoris.kohya" else "not LyCORIS")
    report.append(("LoRA_type", "converted", f"{lora_type} -> network_module {module}"
                                             + (f", network_args {' '.join(args)}" if args else "")))
    return module, args, handled


def _off_grid(resolution: str) -> bool:
    try:
        return any(int(v) % 8 for v in resolution.split(","))
    except ValueError:
        return False


def _refused_by_the_trainer(key: str, value: Any, data: dict) -> str | None:
    """Values that old kohya_ss presets carry but sd-scripts (upstream and ours) stops on: left at the default,
    with the reason in the report."""
    try:
        if key == "bucket_reso_steps" and float(value) % 8:
            return f"{value} is not a multiple of 8, which sd-scripts requires (64 for SD1.x/2.x, 32 for SDXL)"
    except (TypeError, ValueError):
        return None
    if key == "lr_warmup" and data.get("lr_scheduler") == "adafactor" and not _unset(value):
        return "the adafactor scheduler takes no warmup"
    if key == "dim_from_weights" and value and _unset(data.get("lora_network_weights") or data.get("network_weights")):
        return "it needs a LoRA file to continue from, and the file gives none"
    return None


def refuse_non_config(data: dict) -> None:
    """Files that are no configuration, and configurations of trainers we do not have: one line saying which."""
    if not data:
        raise ImportError_("holds no settings: not a kohya_ss configuration or a run TOML")
    if isinstance(data.get("datasets"), list):
        raise ImportError_("this is a dataset config ([[datasets]]), not a run configuration; give it as the "
                           "Dataset config TOML (dataset_config) of a run")
    known = {*P.BY_NAME, *RENAMED, *LORA_RENAMED, *FAMILY_KEYS, *NET_FIELDS, *FINETUNE_DATA_KEYS, "LoRA_type",
             "epoch", "lr_warmup", "sd3_checkbox", "template"}
    if not known & set(data):
        if all(isinstance(v, dict) for v in data.values()):
            raise ImportError_("this is caption metadata (image -> caption/tags), not a configuration; give it as "
                               "the Metadata JSON (in_json) of a Fine-tune run")
        raise ImportError_("none of its keys is a training setting: not a kohya_ss configuration or a run TOML "
                           f"(keys: {', '.join(list(data)[:5])}{' ...' if len(data) > 5 else ''})")


def _family(data: dict, run_toml: bool = False) -> str:
    if data.get("sd3_checkbox"):
        raise ImportError_("this is a kohya_ss SD3 configuration (sd3_checkbox); SD3 is not a model family here "
                           "(SD1.x, SD2.x, SDXL, FLUX.1)")
    if run_toml:  # the trainers' own option names: the same rule as opening such a TOML
        return P.guess_family(data)
    if data.get("flux1_checkbox"):
        return "FLUX.1"
    if data.get("sdxl") or data.get("sdxl_checkbox"):
        return "SDXL"
    if data.get("v2"):
        return "SD2.x"
    return "SD1.x"


def _convert(p: P.Param, value: Any, tab: str) -> Any:
    """A kohya_ss value as the registry type (numbers may be text); ValueError when it cannot be."""
    if p.kind == "list":
        return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
    if p.kind in ("int", "float") and isinstance(value, str):
        value = float(value)
    if p.kind == "int" and isinstance(value, float) and value.is_integer():
        value = int(value)
    if p.kind == "float" and isinstance(value, list):
        value = float(value[0])  # text_encoder_lr as kohya_ss' list: one value for all text encoders
    if p.kind in ("str", "path", "dir", "choice") and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    return p.check(value, tab)


def _text_encoder_rates(data: dict, tab: str, family: str) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """kohya_ss' rules for what trains ({option: value}, {key: report}), from lora_gui.py and dreambooth_gui.py:
    LoRA: a text-encoder rate of 0 with a UNet rate trains the UNet only (--network_train_unet_only), a UNet rate
    of 0 with a text-encoder rate the text encoder only; both 0: both at the main rate. SDXL DreamBooth:
    --train_text_encoder when learning_rate_te1 or learning_rate_te2 is above 0."""
    def rate(key):
        value = data.get(key)
        value = value[0] if isinstance(value, list) and value else value
        try:
            return float(value or 0)
        except (TypeError, ValueError):
            return 0.0

    values, handled = {}, {}
    if tab == "lora" and "text_encoder_lr" in data and "unet_lr" in data:
        te, unet = rate("text_encoder_lr"), rate("unet_lr")
        if te == 0 and unet != 0:
            values["network_train_unet_only"] = True
            handled["text_encoder_lr"] = ("converted", "0 -> --network_train_unet_only: the text encoder is not "
                                                       "trained (as kohya_ss runs it)")
        elif unet == 0 and te != 0:
            values["network_train_text_encoder_only"] = True
            handled["unet_lr"] = ("converted", "0 -> --network_train_text_encoder_only: the UNet is not trained "
                                               "(as kohya_ss runs it)")
    if tab == "dreambooth" and family == "SDXL" and "train_text_encoder" not in data:
        trained = [k for k in ("learning_rate_te1", "learning_rate_te2") if rate(k) > 0]
        if trained:
            values["train_text_encoder"] = True
        for key in ("learning_rate_te1", "learning_rate_te2"):
            if key in data and trained:
                handled[key] = ("mapped", "with --train_text_encoder (kohya_ss sets it when a text-encoder rate is "
                                          "above 0)")
            elif key in data:
                handled[key] = ("dropped", "the text encoders are not trained: kohya_ss sets --train_text_encoder "
                                           "only when a text-encoder rate is above 0")
    return values, handled


def _finetune_data(data: dict) -> tuple[dict[str, Any], dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    """kohya_ss' fine-tune data ({option: value}, {key: report}, side files), from finetune_gui.py: the images are
    `image_folder`; the run reads `train_dir`/meta_cap.json (meta_lat.json with use_latent_files "Yes"), which
    kohya_ss first builds from the image folder's caption files when "generate caption database" is ticked. Here
    that case reads the caption files straight from the image folder (a dataset config beside ours), so no
    metadata step is needed; otherwise the run reads the metadata file kohya_ss would."""
    keys = [k for k in FINETUNE_DATA_KEYS if k in data]
    if not keys:
        return {}, {}, {}
    folder = data.get("image_folder") or ""
    train_dir = data.get("train_dir") or ""
    rebuilt = bool(data.get("generate_caption_database") or data.get("create_caption"))
    latents = data.get("use_latent_files") == "Yes"
    meta = (data.get("latent_metadata_filename") or "meta_lat.json") if latents else \
        (data.get("caption_metadata_filename") or "meta_cap.json")
    handled = {k: ("converted", "how kohya_ss prepares the fine-tune data") for k in keys}
    if not folder:
        handled.update((k, ("dropped", "no image_folder: the data is not set")) for k in keys)
        return {}, handled, {}
    values = {"train_data_dir": folder}
    side = {}
    if rebuilt:
        repeats = int(float(data.get("dataset_repeats") or 1))
        ext = data.get("caption_extension") or ".caption"  # kohya_ss' default for the caption database
        side["dataset_config"] = (".dataset.toml", tomlkit.dumps({"datasets": [{"subsets": [
            {"image_dir": folder, "num_repeats": repeats, "caption_extension": ext}]}]}))
        handled["image_folder"] = ("converted", f"-> a dataset config beside ours: the images of {folder} with their "
                                                f"{ext} captions, {repeats} repeat(s) (kohya_ss merges those captions "
                                                f"into {meta} before each run)")
    elif train_dir:
        values["in_json"] = f"{train_dir}/{meta}"
        handled["image_folder"] = ("converted", f"-> train_data_dir {folder}, with in_json {values['in_json']} "
                                                "(as kohya_ss runs it)")
    else:
        handled["image_folder"] = ("dropped", "no train_dir holds its metadata, and the caption database is not "
                                              "generated: the data is not set")
        values = {}
    return values, handled, side


def _form_field(key: str, value: Any, data: dict, imported: Imported) -> tuple[str, str, str] | None:
    """kohya_ss form fields that mean something else than the option of that name (or no option): the report
    entry, or None for an ordinary option."""
    values = imported.values
    noise_type = data.get("noise_offset_type")  # kohya_ss' switch between the two kinds
    if key == "sample_prompts" and isinstance(value, str) and value.strip() and not _looks_like_path(value):
        imported.side_files["sample_prompts"] = (".prompts.txt", value.strip() + "\n")  # kept in kohya_ss' form
        return key, "converted", "the prompts written to a prompt file beside the configuration"
    why_not = _refused_by_the_trainer(key, value, data)
    if why_not:
        return key, "dropped", why_not
    if key == "max_resolution" and isinstance(value, str) and _off_grid(value):
        fixed = ",".join(str(int(v) // 8 * 8) for v in value.split(","))
        values["resolution"] = fixed
        return key, "converted", f"{value} -> resolution {fixed} (sd-scripts needs multiples of 8)"
    if key == "template":  # kohya_ss' textual-inversion caption choice
        flag = {"object template": "use_object_template", "style template": "use_style_template"}.get(value)
        if flag:
            values[flag] = True
        return key, "converted", f"{value!r} -> " + (f"--{flag}" if flag else "the captions (no template)")
    if key == "xformers":
        chosen = {"xformers": "xformers", True: "xformers", "sdpa": "sdpa"}.get(value)
        if chosen:
            values[chosen] = True
        return key, "converted", f"{value!r} -> " + (f"--{chosen}" if chosen else "neither flag")
    if key == "epoch":
        if not _unset(value) and _unset(data.get("max_train_epochs")):
            values["max_train_epochs"] = int(float(value))
            return key, "converted", f"-> max_train_epochs {values['max_train_epochs']}"
        return key, "dropped", "max_train_epochs is given" if not _unset(value) else "unset"
    if key == "lr_warmup":
        if not _unset(value) and _unset(data.get("lr_warmup_steps")):
            values["lr_warmup_steps"] = float(value) / 100.0
            return key, "converted", (f"{value}% -> lr_warmup_steps {values['lr_warmup_steps']:g} (a ratio of the "
                                      "total steps, as the trainer reads it)")
        return key, "dropped", "unset" if _unset(value) else "lr_warmup_steps is given"
    if noise_type and (key in ("noise_offset", "adaptive_noise_scale") and noise_type != "Original" or
                       key in ("multires_noise_iterations", "multires_noise_discount") and noise_type != "Multires"):
        return key, "dropped", f"noise_offset_type is {noise_type}"
    return None


def from_kohya_ss(data: dict, tab: str | None = None, run_toml: bool = False, family: str | None = None) -> Imported:
    """`run_toml`: the keys are the trainers' options (a kohya_ss or --output_config run TOML), not kohya_ss'
    form fields. `family`: overrides what the file says or what is guessed."""
    refuse_non_config(data)
    tab = tab or ("ti" if any(k in data for k in TEXTUAL_INVERSION_KEYS) else "lora" if "LoRA_type" in data
                  else "finetune" if "use_latent_files" in data else "dreambooth")
    guessed = _family(data, run_toml)
    family = family or guessed
    if (tab, family) not in P.SCRIPTS:
        raise ImportError_(f"a {P.TAB_LABELS[tab]} configuration for {family}: the {P.TAB_LABELS[tab]} tab trains "
                           f"{', '.join(P.tab_families(tab))}")
    values = P.defaults(tab)
    report: list[tuple[str, str, str]] = []
    module, net_args, by_network = _network(data, report) if tab == "lora" else (None, [], {})
    imported = Imported(tab, family, values, report)
    if run_toml and not P.guess_family(data, fallback="") and family == guessed:
        imported.notes.append(f"the file does not say its model family: {family} is assumed (as when the GUI opens "
                              "it); choose another with --family")
    derived, by_rule = ({}, {}) if run_toml else _text_encoder_rates(data, tab, family)
    data_values, by_data, side = ({}, {}, {}) if run_toml or tab != "finetune" else _finetune_data(data)
    by_rule.update(by_data)
    imported.side_files.update(side)
    for key, value in data.items():
        if key == "LoRA_type":
            continue
        if key in FAMILY_KEYS:
            report.append((key, "converted", f"model family {family}"))
            continue
        if key in by_network:
            report.append((key, *by_network[key]))
            continue
        if key in by_rule and by_rule[key][0] != "mapped":
            report.append((key, *by_rule[key]))
            continue
        entry = None if run_toml else _form_field(key, value, data, imported)
        if entry:
            report.append(entry)
            continue
        name = RENAMED.get(key, key) if not run_toml else key
        if tab == "lora" and not run_toml:
            name = LORA_RENAMED.get(key, name)
        p = P.BY_NAME.get(name)
        if p is None or not p.has_control:
            report.append((key, "dropped", "a kohya_ss GUI field with no trainer option here" if not run_toml
                           else "no trainer option here"))
            continue
        if not p.applies(tab, family):
            report.append((key, "dropped", f"not used by {P.script_for(tab, family)}"))
            continue
        zero_unset = value in (0, "0") and p.kind in ("int", "float") and not run_toml and \
            name not in ZERO_IS_A_RATE and (p.default is None or name in ZERO_IS_UNSET)
        if value == "" or zero_unset or (name == "max_token_length" and str(value) == "75") \
                or (name == "dynamo_backend" and value == "no"):
            report.append((key, "mapped", "unset in kohya_ss: left at the default"))
            continue
        try:
            values[name] = _convert(p, value, tab)
        except (ValueError, TypeError) as e:
            report.append((key, "dropped", f"{value!r}: {e}"))
            continue
        if key in by_rule:
            report.append((key, *by_rule[key]))
            continue
        report.append((key, "mapped" if name == key else "converted",
                       "" if name == key else f"-> {name}"))
    values.update(derived)
    values.update(data_values)
    if module:
        values["network_module"] = module
        values["network_args"] = net_args + [a for a in values.get("network_args", []) if a not in net_args]
    imported.values = P.unfold_network_args(tab, family, values)  # into the chosen network type's fields
    return imported


def load(path: str | Path, tab: str | None = None, family: str | None = None) -> Imported:
    """A kohya_ss JSON, or a run TOML (kohya_ss' config_*.toml, sd-scripts' --output_config) whose keys are the
    trainers' options. Raises ImportError_ with the file's name."""
    path = Path(path)
    is_json = path.suffix.lower() == ".json"
    try:
        text = config_file.read_text(path)  # a missing, huge, binary or UTF-16 file: one line
    except config_file.ConfigError as e:
        raise ImportError_(str(e)) from None
    kind = "JSON" if is_json else "TOML"
    try:
        data = json.loads(text) if is_json else _flat_toml(tomllib.loads(text))
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ImportError_(f"{path}: not valid {kind}: {e}") from None
    except (ValueError, RecursionError) as e:  # nested too deeply, a 5000-digit integer
        raise ImportError_(f"{path}: not valid {kind}: {(str(e) or 'nested too deeply').split(';')[0]}") from None
    if not isinstance(data, dict):
        raise ImportError_(f"{path}: expected a JSON object of settings")
    if not is_json and tab is None:
        name = path.name.lower()
        tab = "ti" if "token_string" in data else "lora" if "network_module" in data or "lora" in name \
            else "finetune" if "finetune" in name else "dreambooth"
    try:
        return from_kohya_ss(data, tab, run_toml=not is_json, family=family)
    except ImportError_ as e:
        raise ImportError_(f"{path}: {e}") from e


def _flat_toml(data: dict) -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def write(imported: Imported, out: str | Path, force: bool = False) -> Path:
    """Our TOML and its side files (the prompt file, the dataset config). Never overwrites without `force`."""
    out = Path(out)
    if out.exists() and not force:
        raise ImportError_(f"{out} exists; choose another name or pass --force")
    imported.write_side_files(out, force)
    try:
        return config_file.save(out, imported.tab, imported.family, imported.values)
    except config_file.ConfigError as e:
        raise ImportError_(str(e)) from e

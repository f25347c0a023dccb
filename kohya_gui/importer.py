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
    sample_prompts_text: str = ""  # kohya_ss keeps the prompts in the form; they go to a file beside the config

    def report_lines(self) -> list[str]:
        return [f"{key}: {what}" + (f" ({why})" if why else "") for key, what, why in self.report]


RENAMED = {"max_resolution": "resolution", "optimizer": "optimizer_type", "lora_network_weights": "network_weights",
           "sdxl_no_half_vae": "no_half_vae", "sdxl_cache_text_encoder_outputs": "cache_text_encoder_outputs",
           "flux1_cache_text_encoder_outputs": "cache_text_encoder_outputs",
           "flux1_cache_text_encoder_outputs_to_disk": "cache_text_encoder_outputs_to_disk",
           "learning_rate_te": "text_encoder_lr", "batch_size": "train_batch_size"}
ZERO_IS_UNSET = {"vae_batch_size"}  # kohya_ss writes 0 for "not set" where the trainer's default is another number
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


def _family(data: dict) -> str:
    if data.get("sd3_checkbox"):
        raise ImportError_("this is a kohya_ss SD3 configuration (sd3_checkbox); SD3 is not a model family here "
                           "(SD1.x, SD2.x, SDXL, FLUX.1)")
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


def from_kohya_ss(data: dict, tab: str | None = None) -> Imported:
    tab = tab or ("lora" if "LoRA_type" in data else "finetune" if "use_latent_files" in data else "dreambooth")
    family = _family(data)
    values = P.defaults(tab)
    report: list[tuple[str, str, str]] = []
    module, net_args, by_network = _network(data, report) if tab == "lora" else (None, [], {})
    imported = Imported(tab, family, values, report)
    noise_type = data.get("noise_offset_type")  # kohya_ss' switch between the two kinds; run TOMLs have none
    for key, value in data.items():
        if key == "LoRA_type":
            continue
        if key in FAMILY_KEYS:
            report.append((key, "converted", f"model family {family}"))
            continue
        if key in by_network:
            report.append((key, *by_network[key]))
            continue
        if key == "sample_prompts" and isinstance(value, str) and value.strip() and not _looks_like_path(value):
            imported.sample_prompts_text = value  # kohya_ss keeps the prompt lines in its form
            report.append((key, "converted", "the prompts written to a prompt file beside the configuration"))
            continue
        why_not = _refused_by_the_trainer(key, value, data)
        if why_not:
            report.append((key, "dropped", why_not))
            continue
        if key == "max_resolution" and isinstance(value, str) and _off_grid(value):
            fixed = ",".join(str(int(v) // 8 * 8) for v in value.split(","))
            values["resolution"] = fixed
            report.append((key, "converted", f"{value} -> resolution {fixed} (sd-scripts needs multiples of 8)"))
            continue
        if key == "xformers":
            chosen = {"xformers": "xformers", True: "xformers", "sdpa": "sdpa"}.get(value)
            if chosen:
                values[chosen] = True
            report.append((key, "converted", f"{value!r} -> " + (f"--{chosen}" if chosen else "neither flag")))
            continue
        if key == "epoch":
            if not _unset(value) and _unset(data.get("max_train_epochs")):
                values["max_train_epochs"] = int(float(value))
                report.append((key, "converted", f"-> max_train_epochs {values['max_train_epochs']}"))
            else:
                report.append((key, "dropped", "max_train_epochs is given" if not _unset(value) else "unset"))
            continue
        if key == "lr_warmup":
            if not _unset(value) and _unset(data.get("lr_warmup_steps")):
                values["lr_warmup_steps"] = float(value) / 100.0
                report.append((key, "converted", f"{value}% -> lr_warmup_steps {values['lr_warmup_steps']:g} "
                                                 "(a ratio of the total steps, as the trainer reads it)"))
            else:
                report.append((key, "dropped", "unset" if _unset(value) else "lr_warmup_steps is given"))
            continue
        if noise_type and (key in ("noise_offset", "adaptive_noise_scale") and noise_type != "Original" or
                           key in ("multires_noise_iterations", "multires_noise_discount") and noise_type != "Multires"):
            report.append((key, "dropped", f"noise_offset_type is {noise_type}"))
            continue
        name = RENAMED.get(key, key)
        p = P.BY_NAME.get(name)
        if p is None or not p.has_control:
            report.append((key, "dropped", "a kohya_ss GUI field with no trainer option here"))
            continue
        if not p.applies(tab, family):
            report.append((key, "dropped", f"not used by {P.script_for(tab, family)}"))
            continue
        if value == "" or (value in (0, "0") and (p.default is None or name in ZERO_IS_UNSET)
                           and p.kind in ("int", "float")) or (name == "max_token_length" and str(value) == "75") \
                or (name == "dynamo_backend" and value == "no"):
            report.append((key, "mapped", "unset in kohya_ss: left at the default"))
            continue
        try:
            values[name] = _convert(p, value, tab)
        except (ValueError, TypeError) as e:
            report.append((key, "dropped", f"{value!r}: {e}"))
            continue
        report.append((key, "mapped" if name == key else "converted",
                       "" if name == key else f"-> {name}"))
    if module:
        values["network_module"] = module
        values["network_args"] = net_args + [a for a in values.get("network_args", []) if a not in net_args]
    imported.values = P.unfold_network_args(tab, family, values)  # into the chosen network type's fields
    return imported


def load(path: str | Path, tab: str | None = None) -> Imported:
    """A kohya_ss JSON, or a run TOML (kohya_ss' config_*.toml, sd-scripts' --output_config) whose keys are the
    trainers' options. Raises ImportError_ with the file's name."""
    path = Path(path)
    kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
    try:
        text = config_file.read_text(path)  # a missing, huge, binary or UTF-16 file: one line
    except config_file.ConfigError as e:
        raise ImportError_(str(e)) from None
    try:
        data = json.loads(text) if kind == "JSON" else _flat_toml(tomllib.loads(text))
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ImportError_(f"{path}: not valid {kind}: {e}") from None
    except (ValueError, RecursionError) as e:  # nested too deeply, a 5000-digit integer
        raise ImportError_(f"{path}: not valid {kind}: {(str(e) or 'nested too deeply').split(';')[0]}") from None
    if not isinstance(data, dict):
        raise ImportError_(f"{path}: expected a JSON object of settings")
    if path.suffix.lower() != ".json" and tab is None:
        name = path.name.lower()
        tab = "lora" if "network_module" in data or "lora" in name else "finetune" if "finetune" in name \
            else "dreambooth"
        if "network_module" in data:
            data.setdefault("LoRA_type", None)
    try:
        return from_kohya_ss(data, tab)
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
    """Our TOML (and the prompt file kohya_ss kept inline). Never overwrites without `force`."""
    out = Path(out)
    if out.exists() and not force:
        raise ImportError_(f"{out} exists; choose another name or pass --force")
    if imported.sample_prompts_text:
        prompts = out.with_suffix(".prompts.txt")
        config_file.write_text_atomic(prompts, imported.sample_prompts_text.strip() + "\n")
        imported.values["sample_prompts"] = str(prompts)
    try:
        return config_file.save(out, imported.tab, imported.family, imported.values)
    except config_file.ConfigError as e:
        raise ImportError_(str(e)) from e

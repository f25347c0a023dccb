"""THE parameter registry: every training option is declared here exactly once.

A declaration carries the option's name (= the trainer's CLI flag without ``--`` = its TOML key), kind, default
(the trainer parser's own default, so leaving a default out of a file changes nothing), choices, label, help,
the accordion it sits in, the tabs and model families that use it, and where it goes (trainer or
``accelerate launch``). The Gradio controls, their visibility, save/open, the command and the validation
messages are all derived from this list; nothing else in kohya_gui lists parameters.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from . import option_places

# ---- tabs, families, the script each (tab, family) runs -----------------------------------------------------

TABS = ("lora", "dreambooth", "finetune")
TAB_LABELS = {"lora": "LoRA", "dreambooth": "DreamBooth", "finetune": "Fine-tune"}
FAMILIES = ("SD1.x", "SD2.x", "SDXL", "FLUX.1")
COMPILE_FAMILIES = frozenset({"SDXL", "FLUX.1"})

SCRIPTS = {
    ("lora", "SD1.x"): "train_network.py",
    ("lora", "SD2.x"): "train_network.py",
    ("lora", "SDXL"): "sdxl_train_network.py",
    ("lora", "FLUX.1"): "flux_train_network.py",
    ("dreambooth", "SD1.x"): "train_db.py",
    ("dreambooth", "SD2.x"): "train_db.py",
    ("dreambooth", "SDXL"): "sdxl_train.py",
    ("dreambooth", "FLUX.1"): "flux_train.py",
    ("finetune", "SD1.x"): "fine_tune.py",
    ("finetune", "SD2.x"): "fine_tune.py",
    ("finetune", "SDXL"): "sdxl_train.py",
    ("finetune", "FLUX.1"): "flux_train.py",
}

# Accordions in page order: key -> (title, open by default). The key is also the TOML table name. Sub-groups
# (option_places.SUBGROUPS) are accordions inside one of these; their options go in the parent's table.
ACCORDIONS = {
    "model": ("Model", True),
    "folders": ("Folders", True),
    "dataset": ("Dataset", False),
    "parameters": ("Parameters", False),
    "optimizer": ("Optimizer and scheduler", False),
    "network": ("Network", False),
    "flux": ("FLUX.1 options", False),
    "advanced": ("Advanced", False),
    "samples": ("Samples", False),
    "accelerate": ("Accelerate launch", False),
    "compile": ("Torch Compile Settings", False),
    "metadata": ("Metadata", False),
    "huggingface": ("Hugging Face", False),
    "other": ("Other options", False),  # trainer options option_places.py does not place (a test keeps it empty)
}
SUBGROUPS = option_places.SUBGROUPS
# every group and sub-group, in page order: each group followed by its sub-groups
GROUP_ORDER = tuple(k for top in ACCORDIONS for k in (top, *(s for s, (_, parent) in SUBGROUPS.items()
                                                                if parent == top)))


def top_group(key: str) -> str:
    """The accordion a group or sub-group belongs to (its TOML table)."""
    return SUBGROUPS[key][1] if key in SUBGROUPS else key


def group_title(key: str) -> str:
    return SUBGROUPS[key][0] if key in SUBGROUPS else ACCORDIONS[key][0]


GUI_TABLE = "gui"  # [gui]: tab and family; the trainers skip it
LAUNCH_TABLE = "accelerate"  # [accelerate]: launch-only options; the trainers skip it

KINDS = ("bool", "int", "float", "str", "path", "dir", "choice", "list")

ALL_TABS = frozenset(TABS)
ALL_FAMILIES = frozenset(FAMILIES)
SD = frozenset({"SD1.x", "SD2.x"})
SD_SDXL = frozenset({"SD1.x", "SD2.x", "SDXL"})
FLUX = frozenset({"FLUX.1"})
LORA = frozenset({"lora"})
FULL = frozenset({"dreambooth", "finetune"})


@dataclass(frozen=True)
class Param:
    name: str  # CLI flag without "--" and TOML key
    kind: str  # one of KINDS
    default: Any  # the trainer's argparse default ("" for an unset path/text, None for an unset number)
    label: str
    help: str = ""
    accordion: str = "parameters"
    tabs: frozenset = ALL_TABS
    families: frozenset = ALL_FAMILIES
    choices: tuple = ()
    # where the value goes: "trainer" (TOML trainer table), "launch" ([accelerate] table and accelerate
    # launch flags only), "both" (trainer table and also passed to accelerate launch) or "gui" ([gui] table; the
    # command uses it in its own way, the trainers skip it)
    target: str = "trainer"
    write_default: bool = False  # write even when equal to the default
    required: bool = False  # Start/Print refuse to run when it is empty
    # family-implied values: the control is not shown; the value is fixed by the family (e.g. v2 for SD2.x)
    fixed: dict = field(default_factory=dict)
    minimum: float | None = None
    choice_labels: dict = field(default_factory=dict)  # how a choice is shown, when not as itself
    tab_choices: dict = field(default_factory=dict)  # tab -> choices, where a tab's trainer allows fewer
    tab_defaults: dict = field(default_factory=dict)  # tab -> default, where a tab's trainer has its own
    # options read from the trainers' descriptions: the scripts that have it (then it applies exactly where the
    # tab and family run one of them; tabs/families are not used)
    scripts: frozenset = frozenset()
    open_choices: bool = False  # choices are suggestions; any text is accepted (a class path, a module name)
    item_kind: str = "str"  # list options: what each item is ("float": numbers, written as TOML numbers)
    family_default: dict = field(default_factory=dict)  # family -> what an empty value means (always written)
    whole_as_int: bool = False  # a number that is steps when whole and a ratio below 1: written 100, not 100.0
    # a field of the chosen network type: this --network_args key, read by these network modules; its value is
    # written into network_args (key=value), never as an option of its own
    network_arg: str = ""
    modules: frozenset = frozenset()

    def default_for(self, tab: str | None) -> Any:
        value = self.tab_defaults.get(tab, self.default)
        return list(value) if self.kind == "list" else value

    def choices_for(self, tab: str | None) -> tuple:
        return tuple(self.tab_choices.get(tab, self.choices))

    # -- where it applies ------------------------------------------------------------------------------------
    def applies(self, tab: str, family: str) -> bool:
        if self.scripts:
            return SCRIPTS[(tab, family)] in self.scripts
        if tab not in self.tabs:
            return False
        if self.fixed:
            return family in self.fixed
        return family in self.families

    def shown_for(self, module: str) -> bool:
        """Network-type fields: shown when the chosen network module reads the key (other options: always)."""
        return not self.network_arg or module in self.modules

    @property
    def has_control(self) -> bool:
        return not self.fixed

    @property
    def table(self) -> str:
        if self.target == "launch":
            return LAUNCH_TABLE
        if self.target == "gui":
            return GUI_TABLE
        if self.accordion == LAUNCH_TABLE:  # trainer options shown with the launch options
            return "parameters"
        return top_group(self.accordion)

    # -- values ----------------------------------------------------------------------------------------------
    def is_default(self, value: Any, tab: str | None = None) -> bool:
        default = self.default_for(tab)
        if self.kind == "list":
            return not value
        if self.kind in ("str", "path", "dir"):
            return (value or "") == (default or "")
        if self.kind == "float" and value is not None and default is not None:
            return float(value) == float(default)
        return value == default

    def check(self, value: Any, tab: str | None = None) -> Any:
        """Validates a value read from a file or a control (for `tab`, when given); returns it normalised.
        Raises ValueError."""
        k = self.kind
        if value is None:
            if self.default is None or k in ("str", "path", "dir", "list"):
                return self.default if k != "list" else []
            raise ValueError(f"expected {self.type_words()}, got nothing")
        if k == "bool":
            if not isinstance(value, bool):
                raise ValueError(f"expected true or false, got {value!r}")
            return value
        if k == "int":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
                raise ValueError(f"expected a whole number, got {value!r}")
            value = int(value)
        elif k == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"expected a number, got {value!r}")
            value = float(value)
        elif k in ("str", "path", "dir", "choice"):
            if k == "str" and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)  # e.g. resolution = 1024 in a kohya TOML; the trainers read it the same way
            allowed = self.choices_for(tab)
            if k == "choice" and isinstance(value, bool) and {"on", "off"} <= set(allowed):
                value = "on" if value else "off"  # a switch that became auto / on / off: older files say true / false
            if not isinstance(value, str):
                raise ValueError(f"expected text, got {value!r}")
            if k == "choice" and value not in allowed and not self.open_choices:
                raise ValueError(f"{value!r} is not one of the allowed values: {', '.join(map(repr, allowed))}")
            return value
        elif k == "list":
            if isinstance(value, str):
                value = shlex.split(value)
            if isinstance(value, list) and self.item_kind != "str":
                value = [v if isinstance(v, str) else format_number(v) for v in value if not isinstance(v, bool)]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"expected a list of texts, got {value!r}")
            if self.item_kind != "str":
                for v in value:
                    try:
                        float(v)
                    except ValueError:
                        raise ValueError(f"expected numbers, got {v!r}") from None
            return list(value)
        if self.choices and value not in self.choices:  # a number option with a fixed set (--max_token_length)
            raise ValueError(f"{value!r} is not one of the allowed values: {', '.join(map(repr, self.choices))}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"must be at least {self.minimum:g}, got {value!r}")
        return value

    def type_words(self) -> str:
        return {
            "bool": "true or false",
            "int": "a whole number",
            "float": "a number",
            "str": "text",
            "path": "a file path",
            "dir": "a folder path",
            "choice": "one of " + ", ".join(map(repr, self.choices)),
            "list": "a list of texts",
        }[self.kind]

    def effective(self, value: Any, family: str) -> Any:
        """The value a run gets: an empty value means the family's default where there is one."""
        return self.family_default[family] if self.family_default and not value else value

    def cli_args(self, value: Any) -> list[str]:
        """The trainer/launcher argv for a (non-default) value."""
        flag = "--" + self.name
        if self.kind == "bool":
            return [flag] if value else []
        if self.kind == "list":
            return [flag, *value] if value else []
        if value is None or value == "":
            return []
        if self.whole_as_int and float(value).is_integer():
            return [flag, str(int(value))]
        return [flag, format_number(value) if self.kind == "float" else str(value)]


def format_number(value: float) -> str:
    """Shortest text that reads back as the same float (1e-4 -> '0.0001', 5e-05 -> '5e-05')."""
    return repr(float(value))


def _p(*args, **kw) -> Param:
    return Param(*args, **kw)


# ---- the registry ------------------------------------------------------------------------------------------

OVERLAY: tuple[Param, ...] = (  # what the GUI adds to the trainers' options: labels, groups, help, visibility
    # Model
    _p("pretrained_model_name_or_path", "path", "", "Pretrained model",
       "Single-file checkpoint (.safetensors/.ckpt) or diffusers folder (FLUX.1: the BFL transformer file).",
       "model", required=True),
    _p("v2", "bool", False, "SD2.x model", "Implied by the SD2.x family.", "model", fixed={"SD2.x": True}),
    _p("vae", "path", "", "VAE (optional)", "A separate VAE file or folder to use instead of the model's own.",
       "model", families=SD_SDXL),
    _p("clip_l", "path", "", "CLIP-L", "CLIP-L text encoder file (clip_l.safetensors).", "model", families=FLUX),
    _p("t5xxl", "path", "", "T5-XXL", "T5-XXL text encoder file (t5xxl_fp16.safetensors).", "model", families=FLUX),
    _p("ae", "path", "", "AE", "FLUX.1 autoencoder file (ae.safetensors).", "model", families=FLUX),
    _p("v_parameterization", "bool", False, "v-parameterization",
       "Tick for v-prediction models (SD2.x 768-v, v-pred SD1.x / SDXL checkpoints).", "model", families=SD_SDXL),
    _p("fp8_base", "bool", False, "fp8 base model",
       "Keep the frozen base model's weights in fp8 to save memory (FLUX.1 transformer, SD/SDXL UNet).", "model"),
    _p("network_module", "choice", "", "Network module",
       "Empty = the family's LoRA (networks.lora; networks.lora_flux for FLUX.1). lycoris.kohya needs the "
       "lycoris extra and its algo in Network arguments (algo=locon, lokr, loha ...).", "network", tabs=LORA,
       choices=("",), choice_labels={"": "LoRA (the family's)"},
       family_default={"SD1.x": "networks.lora", "SD2.x": "networks.lora", "SDXL": "networks.lora",
                       "FLUX.1": "networks.lora_flux"}),
    # Folders
    _p("train_data_dir", "dir", "", "Image folder",
       "Folder with N_name subfolders (N = repeats) of images and captions.", "folders"),
    _p("reg_data_dir", "dir", "", "Regularisation folder (optional)",
       "Class images for prior preservation, in N_class subfolders.", "folders",
       tabs=frozenset({"lora", "dreambooth"})),
    _p("in_json", "path", "", "Metadata JSON (optional)",
       "kohya's captions/metadata JSON (made with sd-scripts/finetune/merge_captions_to_metadata.py).", "folders",
       tabs=frozenset({"lora", "finetune"})),
    _p("dataset_config", "path", "", "Dataset config TOML (optional)",
       "A --dataset_config file ([general], [[datasets]], [[datasets.subsets]]); replaces the image folder.",
       "folders"),
    _p("output_dir", "dir", "", "Output folder", "Where the trained files, the run's TOML and its log go.",
       "folders", required=True),
    _p("output_name", "str", "", "Output name", "File name of the result, without extension.", "folders",
       required=True),
    _p("logging_dir", "dir", "", "TensorBoard log folder (optional)", "", "folders"),
    _p("overwrite_output", "bool", False, "Overwrite existing result",
       "Replace a result file of the same name (otherwise the run stops before training).", "folders"),
    # Dataset
    _p("resolution", "str", "", "Resolution", "Training resolution as 'width,height' or one number.", "dataset"),
    _p("caption_extension", "str", ".caption", "Caption extension", "Caption files next to the images.",
       "dataset"),
    _p("min_bucket_reso", "int", 256, "Min bucket resolution", "", "dataset", minimum=64),
    _p("max_bucket_reso", "int", 1024, "Max bucket resolution", "", "dataset", minimum=64),
    _p("keep_tokens", "int", 0, "Keep first N tags", "Tags kept in place when shuffling.", "dataset",
       minimum=0),
    _p("max_data_loader_n_workers", "int", 8, "Data loader workers",
       "Processes that load images (at most the number of CPU cores). 0 = load in the training process.",
       "dataset", minimum=0),
    _p("prior_loss_weight", "float", 1.0, "Prior loss weight", "Loss weight of regularisation images.",
       "dataset", tabs=frozenset({"lora", "dreambooth"}), minimum=0),
    _p("enable_bucket", "bool", False, "Aspect-ratio buckets", "Group images of similar aspect ratio.",
       "dataset"),
    _p("shuffle_caption", "bool", False, "Shuffle caption tags", "Shuffle comma-separated tags.", "dataset"),
    _p("flip_aug", "bool", False, "Flip augmentation", "Random horizontal flips.", "dataset"),
    _p("color_aug", "bool", False, "Colour augmentation", "Random hue shifts (not with cached latents).",
       "dataset"),
    _p("cache_latents", "bool", False, "Cache latents", "Encode the images once before training.", "dataset"),
    _p("cache_latents_to_disk", "bool", False, "Cache latents to disk", "Keep the cached latents as files.",
       "dataset"),
    _p("cache_text_encoder_outputs", "bool", False, "Cache text-encoder outputs",
       "Encode the captions once (the text encoders are then not trained).", "dataset"),
    _p("cache_text_encoder_outputs_to_disk", "bool", False, "Cache text-encoder outputs to disk", "",
       "dataset"),
    # Parameters
    _p("train_batch_size", "int", 1, "Batch size", "", "parameters", minimum=1),
    _p("max_train_steps", "int", 1600, "Max train steps", "", "parameters", minimum=1),
    _p("max_train_epochs", "int", None, "Max train epochs (optional)", "Overrides max train steps when set.",
       "parameters", minimum=1),
    _p("learning_rate", "float", 2e-6, "Learning rate", "", "optimizer", minimum=0),
    _p("unet_lr", "float", None, "UNet / transformer learning rate (optional)", "", "optimizer", tabs=LORA,
       minimum=0),
    _p("text_encoder_lr", "float", None, "Text-encoder learning rate (optional)",
       "One value for all text encoders (the trainer reads it as a one-item list).", "optimizer", tabs=LORA,
       minimum=0),
    _p("learning_rate_te1", "float", None, "Text encoder 1 learning rate (optional)", "", "optimizer",
       tabs=FULL, families=frozenset({"SDXL"}), minimum=0),
    _p("learning_rate_te2", "float", None, "Text encoder 2 learning rate (optional)", "", "optimizer",
       tabs=FULL, families=frozenset({"SDXL"}), minimum=0),
    _p("optimizer_type", "choice", "", "Optimizer", "AdamW8bit needs bitsandbytes, Prodigy needs prodigyopt.",
       "optimizer", choices=("", "AdamW", "AdamW8bit", "Adafactor", "Prodigy", "SGD"),
       choice_labels={"": "AdamW (default)"}),
    _p("optimizer_args", "list", [], "Optimizer arguments", "Space-separated key=value, e.g. weight_decay=0.01",
       "optimizer"),
    _p("lr_scheduler", "choice", "constant", "LR scheduler", "", "optimizer",
       choices=("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")),
    _p("lr_warmup_steps", "float", 0, "LR warmup steps",
       "Steps, or below 1 a ratio of the total steps (0.05 = the first 5%), as the trainer reads it.",
       "optimizer", minimum=0, whole_as_int=True),
    _p("gradient_accumulation_steps", "int", 1, "Gradient accumulation steps", "", "parameters", minimum=1),
    _p("seed", "int", None, "Seed (optional)", "", "parameters"),
    _p("save_precision", "choice", "", "Save precision", "Empty = same as training.", "parameters",
       choices=("", "float", "fp16", "bf16"), choice_labels={"": "same as training"}),
    _p("save_model_as", "choice", "safetensors", "Save model as", "", "parameters",
       choices=("", "safetensors", "ckpt", "pt", "diffusers", "diffusers_safetensors"),
       choice_labels={"": "same as the base model"},
       tab_choices={"lora": ("safetensors", "ckpt", "pt"),
                    "dreambooth": ("", "safetensors", "ckpt", "diffusers", "diffusers_safetensors"),
                    "finetune": ("", "safetensors", "ckpt", "diffusers", "diffusers_safetensors")},
       tab_defaults={"dreambooth": "", "finetune": ""}),
    _p("save_every_n_epochs", "int", None, "Save every N epochs (optional)", "", "parameters", minimum=1),
    _p("save_every_n_steps", "int", None, "Save every N steps (optional)", "", "parameters", minimum=1),
    _p("resume", "dir", "", "Resume from state folder (optional)", "", "parameters"),
    _p("gradient_checkpointing", "bool", False, "Gradient checkpointing", "Less memory, a little slower.",
       "parameters"),
    _p("full_bf16", "bool", False, "Full bf16", "Keep the trained weights and gradients in bf16.", "parameters"),
    _p("fused_backward_pass", "bool", False, "Fused backward pass",
       "Adafactor only: apply updates during backward (saves memory for full SDXL training).", "optimizer_fused",
       tabs=FULL, families=frozenset({"SDXL", "FLUX.1"})),
    _p("train_text_encoder", "bool", False, "Train text encoder",
       "DreamBooth SD1.x/SD2.x trains it anyway (as kohya's train_db.py): see Stop text-encoder training.",
       "parameters", tabs=FULL, families=SD_SDXL),
    _p("stop_text_encoder_training", "int", None, "Stop text-encoder training at step (optional)",
       "The text encoder is trained until this step; -1 = never trained. Empty = the whole run.", "parameters",
       tabs=frozenset({"dreambooth"}), families=SD),
    _p("save_state", "bool", False, "Save training state", "Also save the optimizer state to resume later.",
       "parameters"),
    # Network (LoRA)
    _p("network_dim", "int", None, "Network rank (dim)", "LoRA rank; empty = trainer default (4).", "network",
       tabs=LORA, minimum=1),
    _p("network_alpha", "float", 1.0, "Network alpha", "Scales the LoRA update by alpha/dim.", "network",
       tabs=LORA, minimum=0),
    _p("network_dropout", "float", None, "Network dropout (optional)", "", "network", tabs=LORA, minimum=0),
    _p("network_weights", "path", "", "Continue from LoRA (optional)", "Existing LoRA file to start from.",
       "network", tabs=LORA),
    _p("network_args", "list", [], "Network arguments",
       "Space-separated key=value, e.g. train_blocks=single for FLUX.1.", "network", tabs=LORA),
    _p("network_train_unet_only", "bool", False, "Train UNet / transformer only", "No text-encoder LoRA.",
       "network", tabs=LORA),
    # FLUX.1
    _p("guidance_scale", "float", 3.5, "Guidance scale", "Guidance value given to FLUX.1 dev during training.",
       "flux", families=FLUX),
    _p("timestep_sampling", "choice", "sigma", "Timestep sampling", "", "flux", families=FLUX,
       choices=("sigma", "uniform", "sigmoid", "shift", "flux_shift")),
    _p("sigmoid_scale", "float", 1.0, "Sigmoid scale", "For sigmoid/shift timestep sampling.", "flux",
       families=FLUX),
    _p("discrete_flow_shift", "float", 3.0, "Discrete flow shift", "For shift timestep sampling.", "flux",
       families=FLUX),
    _p("model_prediction_type", "choice", "sigma_scaled", "Model prediction type", "", "flux", families=FLUX,
       choices=("raw", "additive", "sigma_scaled")),
    _p("t5xxl_max_token_length", "int", None, "T5-XXL max tokens (optional)",
       "Empty = 512 for dev, 256 for schnell.", "flux", families=FLUX, minimum=1),
    _p("blocks_to_swap", "int", None, "Blocks to swap (optional)",
       "Keep this many transformer blocks on the CPU and swap them in; saves memory.", "flux", families=FLUX,
       minimum=0),
    _p("apply_t5_attn_mask", "bool", False, "Apply T5 attention mask", "", "flux", families=FLUX),
    # Advanced
    _p("noise_offset", "float", None, "Noise offset (optional)", "", "advanced_noise", families=SD_SDXL, minimum=0),
    _p("min_snr_gamma", "float", None, "Min-SNR gamma (optional)", "5 is a common value.", "advanced_loss",
       families=SD_SDXL, minimum=0),
    _p("tokenizer_cache_dir", "dir", "", "Tokenizer cache folder (optional)", "", "advanced"),
    _p("additional_parameters", "str", "", "Additional parameters",
       "Trainer flags appended to the command as written, e.g. --max_grad_norm 0.5 --noise_offset_random_strength; "
       "each flag must be one of the script's options (kept in the [gui] table, which the trainers skip).",
       "advanced", target="gui"),
    # Samples
    _p("sample_prompts", "path", "", "Sample prompts file",
       "One prompt per line, with kohya options --n --w --h --s --l --d.", "samples"),
    _p("sample_every_n_steps", "int", None, "Sample every N steps (optional)", "", "samples", minimum=1),
    _p("sample_every_n_epochs", "int", None, "Sample every N epochs (optional)", "", "samples", minimum=1),
    # Accelerate launch
    _p("mixed_precision", "choice", "no", "Mixed precision", "Also passed to accelerate launch.", "accelerate",
       choices=("no", "fp16", "bf16"), target="both"),
    _p("num_processes", "int", 1, "Number of processes", "One per GPU.", "accelerate", target="launch",
       write_default=False, minimum=1),
    _p("num_machines", "int", 1, "Number of machines", "", "accelerate", target="launch", minimum=1),
    _p("machine_rank", "int", 0, "Machine rank", "", "accelerate", target="launch", minimum=0),
    _p("gpu_ids", "str", "", "GPU ids", "Comma-separated, e.g. 0,1", "accelerate", target="launch"),
    _p("main_process_ip", "str", "", "Main process IP", "For several machines.", "accelerate", target="launch"),
    _p("main_process_port", "int", None, "Main process port (optional)", "", "accelerate", target="launch",
       minimum=1),
    _p("num_cpu_threads_per_process", "int", 2, "CPU threads per process", "", "accelerate", target="launch",
       write_default=False, minimum=1),
    _p("multi_gpu", "bool", False, "Multi-GPU", "Data-parallel over several GPUs.", "accelerate",
       target="launch"),
    _p("cpu", "bool", False, "CPU only", "Train on the CPU even when a GPU is there (accelerate --cpu).",
       "accelerate", target="launch"),
    # Torch Compile Settings (SDXL and FLUX.1)
    _p("compile", "bool", False, "Enable torch.compile",
       "Compile the repeated transformer blocks. The first steps are slow while it compiles (seconds to a "
       "minute); later steps are faster. Needs PyTorch 2.2+ and, on NVIDIA GPUs, Triton.",
       "compile", families=COMPILE_FAMILIES),
    _p("compile_backend", "choice", "inductor", "Compile backend",
       "inductor: fastest (default). cudagraphs: CUDA graphs only. aot_eager, eager: for debugging.",
       "compile", families=COMPILE_FAMILIES, choices=("inductor", "cudagraphs", "eager", "aot_eager")),
    _p("compile_mode", "choice", "default", "Compile mode",
       "reduce-overhead uses CUDA graphs: the big win at batch 1-4. max-autotune: longest compile.",
       "compile", families=COMPILE_FAMILIES,
       choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")),
    _p("compile_dynamic", "choice", "auto", "Dynamic shapes",
       "auto: the image size is dynamic from the first step, so bucket sizes share graphs (the rest as torch "
       "decides). true: every dimension dynamic. false: static, each new shape recompiles.",
       "compile", families=COMPILE_FAMILIES, choices=("auto", "true", "false")),
    _p("compile_cache_size_limit", "int", 0, "Cache size limit",
       "How many recompiles per block before falling back to eager. 0 = torch default; 64 for many bucket "
       "resolutions.", "compile", families=COMPILE_FAMILIES, minimum=0),
    _p("compile_cache_dir", "dir", "", "Compile cache folder (optional)",
       "Persistent compile cache so the next run starts warm (default: ~/.cache/sd-scripts/torch_compile).",
       "compile", families=COMPILE_FAMILIES),
    _p("compile_fullgraph", "bool", False, "Fullgraph",
       "Require each compiled block to be one graph; fails on graph breaks. Keep off unless debugging.",
       "compile", families=COMPILE_FAMILIES),
    _p("cuda_graph_step", "choice", "auto", "CUDA graph of the whole step",
       "Capture forward, backward and optimizer step as one CUDA graph after the first steps of each batch shape: "
       "no per-step Python overhead at batch 1-4 (SDXL 1024 bs1 on an H100: 191 -> 95 ms; FLUX.1 was slower). One "
       "GPU; needs cached latents and text-encoder outputs and no gradient accumulation. auto: on where it can "
       "follow and was measured faster (SDXL with torch.compile, one bucket shape; the log says what it chose and "
       "why), on: always, off: never.",
       "compile", tabs=LORA, families=COMPILE_FAMILIES, choices=("auto", "on", "off")),
    _p("cuda_allow_tf32", "bool", False, "Allow TF32", "Faster matmuls on Ampere or newer GPUs.", "compile",
       families=COMPILE_FAMILIES),
    _p("cuda_cudnn_benchmark", "bool", False, "cuDNN benchmark", "Let cuDNN pick the fastest kernels.",
       "compile", families=COMPILE_FAMILIES),
    _p("cudnn_sdp", "choice", "auto", "cuDNN attention",
       "auto: torch's choice, but off on torch 2.11 + CUDA 13 with Hopper GPUs (H100/H200), where its backward "
       "crashed FLUX.1 training. on: use it there too (on an H100 with cuDNN 9.19 a compiled FLUX.1 1024 px "
       "step took 514 instead of 584 ms, but an eager 512 px run still crashed). off: never.", "compile",
       families=COMPILE_FAMILIES, choices=("auto", "on", "off")),
    _p("compile_checkpoint_keep", "choice", "attention", "Checkpointing keeps",
       "With gradient checkpointing: what is kept for backward instead of recomputed; each choice uses more memory "
       "for less recompute. attention: the compiled blocks' attention outputs (least memory). projections: also "
       "their Linear outputs no wider than the inputs (q/k/v, output projections). resnets: projections, and the "
       "UNet's ResNets are not checkpointed (FLUX.1: as projections). On an H100, SDXL 1024 bs4: 299 -> 264 ms "
       "(attention -> resnets) at 10.6 -> 18.8 GiB; FLUX.1 1024: 581 -> 521 ms (attention -> projections) at "
       "27.3 -> 33.8 GiB.", "compile", families=COMPILE_FAMILIES, choices=("attention", "projections", "resnets")),
)

# ---- every other trainer option, from the trainers' own descriptions ------------------------------------------
# kohya_gui/options/<script>.json is each script's `--dump_options` (tools/gen_gui_options.py writes them, a test
# keeps them fresh): the one source of names, kinds, defaults and choices. An option the overlay above does not
# declare still gets a control, in "Other options", where the tab and family run a script that has it.

OPTIONS_DIR = Path(__file__).with_name("options")
NOT_SETTINGS = frozenset({"config_file", "output_config", "dump_options", "validate_only"})  # how a run is made


# (option, tab or family): why an option of the script that runs there has no control there
NOT_SHOWN: dict[tuple[str, str], str] = {
    **{("v2", f): "SD2.x is a family of its own: choosing it sets --v2" for f in ("SD1.x", "SDXL", "FLUX.1")},
    ("v_parameterization", "FLUX.1"): "FLUX.1 is a flow-matching model",
    ("vae", "FLUX.1"): "FLUX.1 takes its autoencoder as --ae",
    ("noise_offset", "FLUX.1"): "sd-scripts applies it to SD1.x/SD2.x/SDXL noise only",
    ("min_snr_gamma", "FLUX.1"): "SNR weighting is for SD1.x/SD2.x/SDXL (FLUX.1 has weighting schemes)",
    ("train_text_encoder", "FLUX.1"): "flux_train.py trains the transformer (as upstream)",
    ("reg_data_dir", "finetune"): "fine-tuning has no regularisation images (the DreamBooth tab has)",
    ("prior_loss_weight", "finetune"): "fine-tuning has no regularisation images (the DreamBooth tab has)",
    ("in_json", "dreambooth"): "the DreamBooth tab trains image folders; a metadata JSON is the Fine-tune tab's",
    ("fused_backward_pass", "lora"): "upstream's LoRA scripts accept it but never fuse; it is for full training",
    **{("fused_backward_pass", f): "sd-scripts fuses the backward pass for SDXL and FLUX.1 full training"
       for f in ("SD1.x", "SD2.x")},
    **{("cuda_graph_step", f): "it sits with the Torch Compile Settings, which are for SDXL and FLUX.1 (train_network.py "
       "takes it on the command line)" for f in ("SD1.x", "SD2.x")},
}


def _load_trainer_options() -> dict[str, dict[str, dict]]:
    """script -> {option name: description}"""
    return {path.name.removesuffix(".json"): {o["name"]: o for o in json.loads(path.read_text(encoding="utf-8"))}
            for path in sorted(OPTIONS_DIR.glob("*.py.json"))}


TRAINER_OPTIONS = _load_trainer_options()


def _kind_default_choices(o: dict) -> tuple[str, Any, tuple]:
    default = o["default"]
    if o["kind"] == "bool":
        return "bool", bool(default), ()
    if "nargs" in o:
        return "list", [str(v) for v in default or []], ()  # item kind: see _from_trainers
    choices = [c for c in o.get("choices") or [] if c is not None]
    if choices and o["kind"] == "str":
        return "choice", default or "", tuple(([""] if default is None else []) + choices)
    if o["kind"] in ("int", "float"):
        return o["kind"], default, tuple(choices)
    return "str", "" if default is None else str(default), ()


def _from_trainers(declared: set[str]) -> tuple[Param, ...]:
    per_name: dict[str, dict[str, dict]] = {}
    for script, options in TRAINER_OPTIONS.items():
        for name, o in options.items():
            if name not in declared and name not in NOT_SETTINGS and "refused" not in o:
                per_name.setdefault(name, {})[script] = o
    out = []
    for name, per_script in per_name.items():
        scripts = frozenset(per_script)
        tab_of = {t: sc for (t, _), sc in SCRIPTS.items() if sc in scripts}
        kind, default, choices = _kind_default_choices(next(iter(per_script.values())))
        tab_defaults = {}
        for tab, script in tab_of.items():
            d = _kind_default_choices(per_script[script])[1]
            if d != default:
                tab_defaults[tab] = d
        o = next(iter(per_script.values()))
        group, label = option_places.PLACES.get(name, ("other", name.replace("_", " ").capitalize()))
        out.append(Param(name, kind, default, label, o["help"], group,
                         tabs=frozenset(tab_of), choices=choices, tab_defaults=tab_defaults, scripts=scripts,
                         item_kind=o["kind"] if kind == "list" and o["kind"] in ("int", "float") else "str"))
    return tuple(out)


def _choices_from_trainers(p: Param) -> Param:
    """Where the trainer knows names for an option (optimizers, schedulers): those names, and any other text."""
    for options in TRAINER_OPTIONS.values():
        suggested = options.get(p.name, {}).get("suggested")
        if suggested and p.kind == "choice":
            keep = [c for c in p.choices if c == ""]  # "not set" (the trainer's or the family's default)
            return replace(p, choices=tuple(dict.fromkeys(keep + suggested)), open_choices=True)
    return p


NETWORK_ARG_PREFIX = "network_args."


def _network_arg_params() -> tuple[Param, ...]:
    """A field per --network_args key that a network module reads (from the network_args entry of the LoRA
    scripts' descriptions). Bools are ticked = key=True; unticked, numbers left empty and texts left empty are not
    written (the module's own default applies)."""
    per_key: dict[str, dict[str, dict]] = {}  # key -> module -> description
    scripts: set[str] = set()
    for script, options in TRAINER_OPTIONS.items():
        for module, keys in options.get("network_args", {}).get("keys", {}).items():
            scripts.add(script)
            for key, d in keys.items():
                per_key.setdefault(key, {})[module] = d
    out = []
    for key, per_module in per_key.items():
        kinds = {d["kind"] for d in per_module.values()}
        kind = kinds.pop() if len(kinds) == 1 else "str"
        choices = next((d["choices"] for d in per_module.values() if "choices" in d), None)
        any_value = any(d.get("any_value") for d in per_module.values())
        default = {"bool": False, "int": None, "float": None}.get(kind, "")
        if choices and kind == "str":
            kind, choices = "choice", ("", *choices)
        modules = sorted(per_module)
        label = option_places.NETWORK_ARG_LABELS.get(key, key.replace("_", " ").capitalize())
        out.append(Param(NETWORK_ARG_PREFIX + key, kind, default, label,
                         f"--network_args {key}=... (read by {', '.join(modules)})", "network",
                         tabs=LORA, choices=tuple(choices or ()), scripts=frozenset(scripts), network_arg=key,
                         modules=frozenset(modules), open_choices=any_value))
    return tuple(out)


PARAMS: tuple[Param, ...] = tuple(_choices_from_trainers(p) for p in OVERLAY) + \
    _from_trainers({p.name for p in OVERLAY}) + _network_arg_params()

BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}
assert len(BY_NAME) == len(PARAMS), "a parameter is declared twice"
assert all(p.kind in KINDS and p.accordion in GROUP_ORDER for p in PARAMS)
assert all(p.kind != "choice" or p.default in p.choices for p in PARAMS)

CONTROL_PARAMS: tuple[Param, ...] = tuple(p for p in PARAMS if p.has_control)


def script_flags(script: str) -> set[str]:
    """Every --flag the script accepts (its description's option strings)."""
    return {o["flag"] for o in TRAINER_OPTIONS.get(script, {}).values()}


def _family_options(family: str) -> set[str]:
    return {name for (_, f), script in SCRIPTS.items() if f == family for name in TRAINER_OPTIONS.get(script, {})}


def guess_family(keys: dict[str, Any], fallback: str = "SDXL") -> str:
    """The model family of a run TOML that does not say (no [gui] table): the one rule of Open, print-command and
    import. FLUX.1 by its model files or network, SD2.x by v2, else SDXL or SD1.x where a key only that family's
    scripts accept says so, else `fallback` (the GUI's default family)."""
    if keys.get("network_module") in ("networks.lora_flux", "networks.oft_flux") or \
            any(keys.get(k) for k in ("clip_l", "t5xxl", "ae")):
        return "FLUX.1"
    if keys.get("v2") is True:
        return "SD2.x"
    sdxl, sd = _family_options("SDXL"), _family_options("SD1.x")
    if any(k in sdxl and k not in sd for k in keys):
        return "SDXL"
    if any(k in sd and k not in sdxl for k in keys):
        return "SD1.x"
    return fallback


def script_for(tab: str, family: str) -> str:
    return SCRIPTS[(tab, family)]


def params_for(tab: str, family: str) -> list[Param]:
    """Parameters that apply to this tab and family, in registry order (fixed ones included)."""
    return [p for p in PARAMS if p.applies(tab, family)]


def visible(p: Param, tab: str, family: str, module: str = "") -> bool:
    """`module`: the Network module field's value (network-type fields follow it; empty = the family's LoRA)."""
    return p.has_control and p.applies(tab, family) and p.shown_for(network_module(module, family))


def accordion_visible(key: str, tab: str, family: str) -> bool:
    """A group is shown when one of its options, or of its sub-groups' options, is."""
    return any(visible(p, tab, family) for p in CONTROL_PARAMS
               if key in (p.accordion, top_group(p.accordion)) and not p.network_arg)


# ---- network-type fields <-> network_args -------------------------------------------------------------------

def network_module(value: str | None, family: str) -> str:
    """The network module a run uses: the field's value, or the family's LoRA when it is empty."""
    return BY_NAME["network_module"].effective(value or "", family)


def network_arg_fields(tab: str, family: str, values: dict[str, Any]) -> list[Param]:
    """The fields of the chosen network type (none outside the LoRA tab)."""
    module = network_module(values.get("network_module"), family)
    return [p for p in PARAMS if p.network_arg and p.applies(tab, family) and p.shown_for(module)]


def _arg_text(p: Param, value: Any) -> str:
    if p.kind == "bool":
        return "True"
    return format_number(value) if p.kind == "float" else str(value)


def _set_fields(tab: str, family: str, values: dict[str, Any]) -> list[Param]:
    """The chosen network type's fields that hold a value (the others are not written)."""
    return [p for p in network_arg_fields(tab, family, values)
            if values.get(p.name) is not None and not p.is_default(values[p.name], tab)]


def fold_network_args(tab: str, family: str, values: dict[str, Any]) -> dict[str, Any]:
    """The values as the trainer gets them: the chosen network type's fields that are set become key=value entries
    of network_args, before the entries typed into Network arguments."""
    if not network_arg_fields(tab, family, values):
        return values
    args = [f"{p.network_arg}={_arg_text(p, values[p.name])}" for p in _set_fields(tab, family, values)]
    return {**values, "network_args": args + list(values.get("network_args") or [])}


def unfold_network_args(tab: str, family: str, values: dict[str, Any]) -> dict[str, Any]:
    """The other way, for a file being opened: network_args entries that a field of the chosen network type shows
    go into that field; the rest (unknown keys, values a field cannot hold, false booleans) stay as entries."""
    fields = {p.network_arg: p for p in network_arg_fields(tab, family, values)}
    out, rest = dict(values), []
    for item in values.get("network_args") or []:
        key, sep, text = item.partition("=")
        p = fields.pop(key.strip(), None)
        value = _field_value(p, text.strip()) if p is not None and sep else None
        if value is None:
            rest.append(item)
            if p is not None:
                fields[p.network_arg] = p
        else:
            out[p.name] = value
    out["network_args"] = rest
    return out


def _field_value(p: Param, text: str) -> Any:
    """A network_args value as its field holds it, or None where the field cannot hold it."""
    try:
        if p.kind == "bool":
            return True if text.lower() in ("true", "1", "yes") else None
        if p.kind in ("int", "float"):
            number = float(text)
            return p.check(int(number) if p.kind == "int" and number.is_integer() else number)
        return p.check(text) or None
    except ValueError:
        return None


def network_arg_clashes(tab: str, family: str, values: dict[str, Any]) -> list[str]:
    """Keys set both in a field and in Network arguments (which would the network module take?)."""
    set_in_fields = {p.network_arg: p for p in _set_fields(tab, family, values)}
    return [f"Network arguments (network_args): {key} is also set in the field '{set_in_fields[key].label}'; "
            "keep one" for key in (item.partition("=")[0].strip() for item in values.get("network_args") or [])
            if key in set_in_fields]


def defaults(tab: str | None = None) -> dict[str, Any]:
    return {p.name: p.default_for(tab) for p in CONTROL_PARAMS if tab is None or tab in p.tabs}

"""One owner per option (issue 24 item 4): every option of the seven scripts is declared by one module, the
concern module whose code reads it; train_util only places each concern's group where upstream has it; the
checks never change the options (normalisation is train_util.normalise_args, one step right after parsing)."""
from __future__ import annotations

import argparse
import collections
import copy
import importlib
import sys

import pytest

from library import train_util

SCRIPTS = ("sdxl_train_network", "train_network", "flux_train_network", "sdxl_train", "train_db", "fine_tune",
           "flux_train", "sd3_train_network", "sd3_train")
SCRIPTS += ("train_textual_inversion", "sdxl_train_textual_inversion")
SCRIPTS += ("lumina_train_network", "lumina_train")
SCRIPTS += ("hunyuan_image_train_network",)


# options that train_util declared while their code lives in these modules
MOVED = {
    "library.saving": ("save_precision", "save_every_n_epochs", "save_every_n_steps", "save_last_n_epochs",
                       "save_last_n_steps", "save_state", "save_state_on_train_end", "resume"),
    "library.precision": ("mixed_precision", "full_fp16", "full_bf16", "no_half_vae", "lowram", "highvram"),
    "library.trackers": ("logging_dir", "log_with", "log_prefix", "log_tracker_name"),
    "library.sampling": ("sample_every_n_steps", "sample_every_n_epochs", "sample_prompts", "sample_sampler",
                         "sample_at_first"),
    "library.model_util": ("v2", "v_parameterization", "pretrained_model_name_or_path", "tokenizer_cache_dir",
                           "vae"),
}
# options whose LoRA and full forms differ (choices, default or help): one function of the concern module each
TWO_FORMS = {"no_metadata": "library.metadata", "training_comment": "library.metadata",
             "save_model_as": "library.saving"}


@pytest.fixture(scope="module")
def owners():
    """option dest -> the modules whose code called add_argument for it, over the seven scripts' parsers."""
    found = collections.defaultdict(set)
    real = argparse._ActionsContainer.add_argument

    def recording(self, *args, **kwargs):
        action = real(self, *args, **kwargs)
        found[action.dest].add(sys._getframe(1).f_globals["__name__"])
        return action

    argparse._ActionsContainer.add_argument = recording
    try:
        for script in SCRIPTS:
            importlib.import_module(script).setup_parser()
    finally:
        argparse._ActionsContainer.add_argument = real
    return dict(found)


def test_every_option_is_declared_by_one_module(owners):
    several = {dest: sorted(mods) for dest, mods in owners.items() if len(mods) > 1}
    assert not several, several


def test_moved_options_are_declared_by_their_concern_module(owners):
    for module, dests in MOVED.items():
        for dest in dests:
            assert owners[dest] == {module}, (dest, owners[dest])
    for dest, module in TWO_FORMS.items():
        assert owners[dest] == {module}, (dest, owners[dest])


@pytest.mark.usefixtures("one_thread")
def test_checks_do_not_change_the_options(tmp_path, tiny_sdxl_single_file, tiny_dataset_dir):
    """Parsing normalises (the deprecated --caption_extention becomes --caption_extension); every check after
    it, the dataset build included, leaves args as it found them."""
    import sdxl_train_network
    from library import (config_util, huggingface_util, losses, noise, offload_checkpointing, optimizers,
                         precision, sampling, saving, schedulers, trackers, validation)
    from library.errors import ConfigError

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat --w 64 --h 64\n")
    args = train_util.parse_args(sdxl_train_network.setup_parser(), [
        "--pretrained_model_name_or_path", str(tiny_sdxl_single_file), "--train_data_dir", str(tiny_dataset_dir),
        "--output_dir", str(tmp_path / "out"), "--network_module", "networks.lora", "--resolution", "64",
        "--caption_extention", ".txt", "--save_every_n_steps", "2", "--sample_prompts", str(prompts),
        "--sample_every_n_steps", "2", "--mixed_precision", "bf16", "--full_bf16", "--min_timestep", "300",
        "--max_timestep", "300", "--noise_offset", "0.05", "--min_snr_gamma", "5", "--validation_split", "0.25",
        "--logging_dir", str(tmp_path / "logs"), "--max_grad_norm", "0"])
    assert (args.caption_extension, args.caption_extention) == (".txt", None)
    before = copy.deepcopy(vars(args))
    train_util.verify_training_args(args)
    saving.validate_saving_args(args)
    sampling.check_sample_args(args)
    optimizers.check_optimizer_args(args)
    schedulers.check_scheduler_args(args)
    huggingface_util.validate_huggingface_args(args)
    precision.check_precision_args(args)
    trackers.check_tracker_args(args)
    losses.check_loss_args(args, ConfigError)
    noise.check_noise_args(args, ConfigError)
    validation.check_validation_args(args, ConfigError)
    offload_checkpointing.check_args(args, ConfigError)
    config_util.build_dataset_groups(args, "sdxl")
    assert vars(args) == before


@pytest.mark.parametrize("script, argv, normalised", [
    ("flux_train", ["--double_blocks_to_swap", "2", "--single_blocks_to_swap", "4", "--fused_backward_pass",
                    "--optimizer_type", "Adafactor", "--skip_latents_validity_check", "--torch_compile"],
     {"blocks_to_swap": 4, "skip_cache_check": True, "compile": True}),
    ("flux_train", ["--cpu_offload_checkpointing"], {"gradient_checkpointing": True}),
    ("flux_train_network", ["--split_mode", "--torch_compile", "--dynamo_backend", "aot_eager", "--network_module",
                            "networks.lora_flux"],
     {"blocks_to_swap": 18, "compile": True, "compile_backend": "aot_eager"}),
])
def test_trainer_checks_do_not_change_the_options(tmp_path, script, argv, normalised):
    """The deprecated FLUX.1 forms, flux_train.py's implied settings and the --torch_compile alias are set by
    parsing (train_util.normalise_args); the trainer's checks (common options, FLUX.1 full / family checks) then
    leave args as they found them."""
    module = importlib.import_module(script)
    args = train_util.parse_args(module.setup_parser(), [
        "--pretrained_model_name_or_path", str(tmp_path / "flux.safetensors"), "--output_dir", str(tmp_path / "out"),
        *argv])
    assert {key: getattr(args, key) for key in normalised} == normalised
    before = copy.deepcopy(vars(args))
    trainer = module.trainer(args)
    trainer.check_common_options(args)
    trainer.check_args(args)
    assert vars(args) == before

"""The training core is composed, not inherited (issue 24): each model family, target and objective is a plain
class with the same methods as the others of its kind, and each of the seven scripts names a family and a target."""
from __future__ import annotations

import importlib
import inspect

import pytest

from library.families.flux import Flux
from library.families.sd import SD
from library.families.sdxl import SDXL
from library.objectives.ddpm import DDPM
from library.objectives.flow_matching import FlowMatching
from library.run.trainer import Trainer
from library.targets.embedding import Embedding
from library.targets.full import Full
from library.targets.lora import LoRA


# what library.run asks of each kind (docs/ARCHITECTURE.md, "The training core")
FAMILY = {"name", "label", "bucket_reso_steps_multiple", "objective", "check_args", "load", "lora_text_encoders",
          "encode_images", "encode_prompts", "prediction_type", "predict", "enable_gradient_checkpointing",
          "place_denoiser", "apply_fp8", "set_attention_backend", "compile", "sample", "base_model_version",
          "metadata", "modelspec_variant", "latent_cache_format", "te_cache_format", "cache_signature",
          "full_output_format", "save_full_model"}
TARGET = {"default_output_name", "tracker_name", "dataset_kinds", "lora", "check_args", "fp8_targets", "output_ext",
          "steps_in_backward", "merge_base_weights", "setup_trainable", "optimizer_param_groups", "after_prepare",
          "on_step_start", "on_epoch_start", "keep_training_text_encoder", "metadata", "method_metadata",
          "save_model", "prepare_dataset", "sample_args"}
OBJECTIVE = {"flow_matching", "noise_scheduler", "num_train_timesteps", "noisy_input_pred_target", "huber_threshold",
             "weight_loss"}


@pytest.mark.parametrize("kind, interface", [((SD, SDXL, Flux), FAMILY), ((LoRA, Full, Embedding), TARGET),
                                             ((DDPM, FlowMatching), OBJECTIVE)],
                         ids=["families", "targets", "objectives"])
def test_one_interface_per_axis_and_no_base_classes(kind, interface):
    for cls in kind:
        assert cls.__bases__ == (object,), f"{cls.__name__} overrides a base class"
        missing = {n for n in interface if not hasattr(cls(), n)}
        assert not missing, f"{cls.__name__} lacks {sorted(missing)}"


@pytest.mark.parametrize("script, family, target", [
    ("train_network", SD, LoRA), ("sdxl_train_network", SDXL, LoRA), ("flux_train_network", Flux, LoRA),
    ("train_db", SD, Full), ("fine_tune", SD, Full), ("sdxl_train", SDXL, Full), ("flux_train", Flux, Full),
    ("train_textual_inversion", SD, Embedding), ("sdxl_train_textual_inversion", SDXL, Embedding)])
def test_each_script_names_a_family_and_a_target(script, family, target):
    module = importlib.import_module(script)
    trainer = module.trainer()
    assert isinstance(trainer, Trainer) and type(trainer.family) is family and type(trainer.target) is target
    assert trainer.objective is trainer.family.objective
    assert not [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == module.__name__]
    assert len(inspect.getsource(module).splitlines()) <= 70  # a few lines around the usage text

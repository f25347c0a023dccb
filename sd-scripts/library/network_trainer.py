"""The shared LoRA training loop (`NetworkTrainer`) for SD1.x / SD2.x / SDXL, subclassed per model family.

A subclass overrides only the per-family hooks:

    family_for(args) -> str                            model family: "sd1", "sd2", "sdxl", "flux" ...
    assert_extra_args(args)                            family checks, before any model loads (compile validation)
    load_target_model(args, accelerator, weight_dtype) -> components (SDComponents-like: unet, vae,
                                                       text_encoders, tokenizers, prediction_type)
    encode_images(args, components, images) -> latents
    encode_prompts(args, components, captions, with_grad) -> dict of tensors (also what is cached)
    get_noise_scheduler(args, components)              training noise schedule
    get_noise_pred_and_target(args, accelerator, noise_scheduler, latents, batch, te_outputs, components,
                              weight_dtype, fixed_timestep=None) -> (model_pred, target, timesteps, weighting)
                                                       noisy input + target (eps / v here; flow matching in FLUX);
                                                       fixed_timestep: every sample at that timestep (validation)
    call_unet(args, components, noisy_latents, timesteps, te_outputs, batch, weight_dtype) -> prediction
    huber_threshold(args, timesteps, noise_scheduler) -> [B] or None     (library.losses)
    apply_loss_mask(args, loss, batch) -> loss         element-wise loss before the per-sample mean (masked loss)
    post_process_loss(loss, args, timesteps, noise_scheduler) -> loss    (SNR weights, library.losses)
    enable_gradient_checkpointing(args, components, train_text_encoder)
    prepare_unet_with_accelerator(args, accelerator, components)         (SDXL: regional compile here)
    on_step_start(args)                                before every micro-step (the CUDA-graph step mark is
                                                       the loop's: once per accumulation window)
    keep_training_text_encoder(args, global_step) -> bool   False freezes the text encoder from this step on
    build_pipeline(args, components, scheduler)        diffusers pipeline for sample images
    update_metadata(metadata, args)                    family/compile ss_* keys
    default_output_name, lora_target_text_encoders(components)

The pieces a full-model trainer also needs (args, optimizer, scheduler, saving, metadata, progress line, run
TOML) live in train_util.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from library import (config_util, data_parallel, finite_guard, huggingface_util, losses, masks, network_options,
                     noise, optimizers, parity, run_requests, saving, schedulers, state_folders, stop_signal,
                     train_util, validation)
from library import metadata as metadata_util
from library.compile import graphs as compile_graphs
from library.captions import apply_token_weights, weighted_for, weighted_token_ids
from library.latent_cache import FAMILY_FORMATS, LatentCacheFormat
from library.late_loss import LateLosses
from library.network_options import parse_network_args  # noqa: F401  (re-exported)
from library.step_timer import StepTimer
from library.te_cache import TeCacheFormat
from library.errors import ConfigError, TrainingError, UserError  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------
# arguments


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--network_module", type=str, default=None, help="network module, e.g. networks.lora")
    parser.add_argument("--network_dim", type=int, default=None, help="LoRA rank (default 4)")
    parser.add_argument("--network_alpha", type=float, default=1, help="LoRA alpha (scale = alpha / dim)")
    parser.add_argument("--network_dropout", type=float, default=None, help="dropout on the LoRA down output")
    parser.add_argument("--network_args", type=str, default=None, nargs="*",
                        help="network options as key=value, e.g. conv_dim=4 conv_alpha=1")
    parser.add_argument("--network_weights", type=str, default=None, help="LoRA file to continue training from")
    parser.add_argument("--dim_from_weights", action="store_true", help="take the dims from --network_weights")
    parser.add_argument("--network_train_unet_only", action="store_true", help="train only the UNet LoRA")
    parser.add_argument("--network_train_text_encoder_only", action="store_true",
                        help="train only the text encoder LoRA")
    parser.add_argument("--unet_lr", type=float, default=None, help="UNet LoRA learning rate")
    parser.add_argument("--text_encoder_lr", type=float, default=None, nargs="*",
                        help="text encoder LoRA learning rate: one value for all text encoders, or one per text "
                             "encoder where the network module supports it (upstream: networks with "
                             "prepare_optimizer_params_with_multiple_te_lrs); default --learning_rate")
    parser.add_argument("--save_model_as", type=str, default="safetensors", choices=[None, "ckpt", "pt", "safetensors"],
                        help="file format of the LoRA")
    parser.add_argument("--no_metadata", action="store_true",
                        help="write only the minimum ss_* keys (base model, network) and the modelspec keys")
    parser.add_argument("--training_comment", type=str, default=None, help="ss_training_comment metadata")
    from library.network_options import add_network_option_arguments

    add_network_option_arguments(parser)  # --scale_weight_norms --base_weights --base_weights_multiplier


def base_parser() -> argparse.ArgumentParser:
    """The arguments of every trainer, LoRA and full (models, dataset, training, optimizer, --config_file)."""
    from library import console_log, option_dump, precision, trackers, validate_only
    from library.compile import options as compile_options

    parser = argparse.ArgumentParser(allow_abbrev=False)
    train_util.add_sd_models_arguments(parser)
    config_util.add_dataset_arguments(parser)
    train_util.add_training_arguments(parser)
    noise.add_noise_arguments(parser)
    losses.add_loss_arguments(parser)
    optimizers.add_optimizer_arguments(parser)
    schedulers.add_scheduler_arguments(parser)
    train_util.add_config_arguments(parser)
    parity.add_refused_arguments(parser)
    data_parallel.add_ddp_arguments(parser)
    saving.add_saving_arguments(parser)
    metadata_util.add_metadata_arguments(parser)
    huggingface_util.add_huggingface_arguments(parser)
    console_log.add_console_log_arguments(parser)
    trackers.add_tracker_arguments(parser)
    precision.add_fp8_base_argument(parser)
    precision.add_fp16_master_argument(parser)
    compile_options.add_torch_compile_arguments(parser)
    validate_only.add_validate_only_argument(parser)
    option_dump.add_dump_options_argument(parser)
    return parser


def setup_parser() -> argparse.ArgumentParser:
    """The arguments every LoRA trainer shares; scripts add family flags (e.g. compile) on top."""
    from library import offload_checkpointing, precision

    parser = base_parser()
    add_network_arguments(parser)
    validation.add_validation_arguments(parser)
    saving.add_initial_step_arguments(parser)
    masks.add_masked_loss_arguments(parser)
    precision.add_fp8_base_unet_argument(parser)
    offload_checkpointing.add_cpu_offload_checkpointing_argument(parser)
    compile_graphs.add_arguments(parser)
    return parser


def text_encoder_lr(args) -> float | None:
    """`--text_encoder_lr` for a network with one text-encoder learning rate: the first value (upstream reads
    the list this way, for config files that wrote one number too); None = --learning_rate."""
    value = getattr(args, "text_encoder_lr", None)  # the full trainers have none
    if value is None or isinstance(value, (int, float)):
        return value
    return value[0] if value else None


def import_network_module(name: str):
    """The --network_module; `lycoris.kohya` goes through networks.lycoris_kohya (sd-scripts' module set and
    names on our diffusers models; a clear error when the lycoris-lora package is missing)."""
    from networks import lycoris_kohya

    if name == lycoris_kohya.MODULE_NAME:
        lycoris_kohya.import_lycoris()
        return lycoris_kohya
    return importlib.import_module(name)


def save_network_state_dict(network, path: str, dtype, metadata: dict | None, overwrite: bool) -> None:
    """A network's state_dict (``_orig_mod.`` removed, cast to `dtype`) as .safetensors (metadata + hashes) or
    torch file, atomically."""
    from library.compile.regional import strip_orig_mod

    sd = {k: v.detach().to("cpu", dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
          for k, v in strip_orig_mod(network.state_dict()).items()}
    if os.path.splitext(path)[1] == ".safetensors":
        md = dict(metadata or {})
        if md:
            md["sshs_model_hash"], md["sshs_legacy_hash"] = train_util.model_hashes(sd, md)
        train_util.save_safetensors_atomic({k: v.contiguous() for k, v in sd.items()}, path, md or None,
                                           overwrite=overwrite)
    else:
        train_util.save_torch_atomic(sd, path, overwrite=overwrite)


# ----------------------------------------------------------------------------------------------------------
# text encoding shared by SD1.x / SD2.x / SDXL


def encode_clip(tokenizer, text_encoder, captions: list[str], max_token_length: int | None,
                hidden_layer: int | None, final_norm: bool, device, *, weighted: bool = False,
                pad_to_longest: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CLIP hidden states for captions, with kohya's long-prompt handling: `--max_token_length 150/225` is
    encoded as 2/3 chunks of 75 tokens (each with BOS/EOS) and concatenated to 1 + 75*n + 1 positions.

    hidden_layer: index into hidden_states (None = last_hidden_state); final_norm applies the final layer norm
    to it (SD1.x clip_skip). weighted: upstream's `(word:1.2)` syntax (--weighted_captions) scales each token's
    hidden state (the pooled output is not weighted, as upstream). pad_to_longest (train_db --no_token_padding):
    one chunk padded only to the longest caption of the batch. Returns (hidden [B, L, D], text_embeds of the
    first chunk or None).
    """
    max_len = (max_token_length or 75) + 2
    weights = None
    if weighted:
        ids, weights = weighted_token_ids(tokenizer, captions, max_len)
        ids = ids.to(device)
    elif pad_to_longest:
        ids = tokenizer(captions, padding="longest", truncation=True, max_length=tokenizer.model_max_length,
                        return_tensors="pt").input_ids.to(device)
        return _clip_hidden(text_encoder, ids, hidden_layer, final_norm)
    else:
        ids = tokenizer(captions, padding="max_length", truncation=True, max_length=max_len,
                        return_tensors="pt").input_ids.to(device)
    n_chunks = (max_len - 2) // 75
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    hiddens, pooled = [], None
    for c in range(n_chunks):
        body = ids[:, 1 + 75 * c: 1 + 75 * (c + 1)]
        last_real = body[:, -1:]
        # the chunk ends with EOS unless its text already ended (then padding continues)
        tail = torch.where((last_real == eos) | (last_real == pad), torch.full_like(last_real, pad),
                           torch.full_like(last_real, eos))
        chunk = torch.cat([ids[:, :1], body, tail], dim=1)
        # an empty chunk still needs an EOS (pooling position)
        chunk[:, 1] = torch.where(chunk[:, 1] == pad, torch.full_like(chunk[:, 1], eos), chunk[:, 1])
        h, chunk_pooled = _clip_hidden(text_encoder, chunk, hidden_layer, final_norm)
        if c == 0:
            pooled = chunk_pooled
        hiddens.append(h)
    if n_chunks == 1:
        hidden = hiddens[0]
    else:
        parts = [hiddens[0][:, :1]] + [h[:, 1:-1] for h in hiddens] + [hiddens[-1][:, -1:]]
        hidden = torch.cat(parts, dim=1)
    if weights is not None:  # positions of hidden and of the weighted token ids correspond one to one
        hidden = apply_token_weights(hidden, weights)
    return hidden, pooled


def _clip_hidden(text_encoder, ids, hidden_layer, final_norm):
    out = text_encoder(ids, output_hidden_states=True, return_dict=True)
    if hidden_layer is None:
        h = out.last_hidden_state
    else:
        h = out.hidden_states[hidden_layer]
        if final_norm:
            h = getattr(text_encoder, "text_model", text_encoder).final_layer_norm(h)
    return h, getattr(out, "text_embeds", None)


@dataclass
class Trainable:
    """What a trainer trains: `models` are registered for --save_state, accumulate gradients and have them
    averaged over the processes; `param_groups` go to the optimizer."""

    models: list
    param_groups: list
    train_text_encoder: bool
    lr_descriptions: list | None = None  # names of the param groups in the lr logs (lr/unet, lr/unet plus, ...)


class TrainState:
    """The step counter saved with `--save_state` (accelerate custom checkpoint object)."""

    def __init__(self):
        self.global_step = 0
        self.epoch = 0
        self.generator: torch.Generator | None = None

    def state_dict(self) -> dict:
        out = {"global_step": self.global_step, "epoch": self.epoch}
        if self.generator is not None:
            out["noise_rng"] = self.generator.get_state()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        if self.generator is not None and "noise_rng" in state:
            self.generator.set_state(state["noise_rng"])


# ----------------------------------------------------------------------------------------------------------


class NetworkTrainer:
    """SD1.x / SD2.x LoRA trainer; subclasses change the per-family hooks (see the module doc)."""

    default_output_name = "last"
    tracker_name = "network_train"
    dataset_kinds = (config_util.DREAMBOOTH, config_util.FINETUNING)  # what --dataset_config may hold
    model_label = "UNet"
    bucket_reso_steps_multiple = 64  # upstream's verify_bucket_reso_steps per script (SD 64, SDXL 32, FLUX 32/16)
    losses: list[float] = []  # per micro-step loss of the last train() call (tests, benchmarks)
    flow_matching = False  # FLUX: no DDPM schedule, so noise.DDPM_ONLY_OPTIONS and the SNR weights do nothing
    # noise, timesteps and VAE sampling draw from this generator; it is saved with --save_state, so a resumed
    # run continues with the same random numbers (the data order is seeded per epoch by the dataset)
    noise_generator: torch.Generator | None = None

    # -- per-family hooks --------------------------------------------------------------------------------
    def family_for(self, args) -> str:
        return "sd2" if args.v2 else "sd1"

    def assert_extra_args(self, args) -> None:
        if args.v_parameterization and not args.v2:
            logger.warning("--v_parameterization without --v2: training an SD1.x model with v-prediction")

    def load_target_model(self, args, accelerator, weight_dtype):
        from library.model_util import load_sd_components

        comps = load_sd_components(args.pretrained_model_name_or_path, self.family_for(args), vae=args.vae,
                                   tokenizer_cache_dir=args.tokenizer_cache_dir, dtype=torch.float32,
                                   v_parameterization=args.v_parameterization)
        layers = min(te.config.num_hidden_layers for te in comps.text_encoders)
        if args.clip_skip is not None and args.clip_skip > layers:
            raise ConfigError(f"--clip_skip {args.clip_skip}: the text encoder has only {layers} layers "
                              "(1 = the last layer, 2 = the one before, ...)")
        return comps

    def lora_target_text_encoders(self, components) -> list:
        return list(components.text_encoders)

    def encode_images(self, args, components, images: torch.Tensor) -> torch.Tensor:
        vae = components.vae
        with torch.no_grad():
            latents = vae.encode(images.to(vae.device, vae.dtype)).latent_dist.sample(generator=self.noise_generator)
        return latents * vae.config.scaling_factor

    def encode_prompts(self, args, components, captions: list[str], with_grad: bool = False, *,
                       pad_to_longest: bool | None = None) -> dict:
        te, tok = components.text_encoders[0], components.tokenizers[0]
        layer = -args.clip_skip if args.clip_skip and args.clip_skip > 1 else None
        if pad_to_longest is None:
            pad_to_longest = bool(getattr(args, "no_token_padding", False))
        with torch.set_grad_enabled(with_grad):
            hidden, _ = encode_clip(tok, te, captions, args.max_token_length, layer, True, te.device,
                                    weighted=weighted_for(args, self.family_for(args)), pad_to_longest=pad_to_longest)
        return {"encoder_hidden_states": hidden}

    def get_noise_scheduler(self, args, components):
        return noise.prepare_noise_scheduler(train_util.noise_scheduler_for(self.prediction_type(args, components)),
                                             getattr(args, "zero_terminal_snr", False))

    def prediction_type(self, args, components) -> str:
        if args.v_parameterization:
            return "v_prediction"
        return getattr(components, "prediction_type", None) or "epsilon"

    def call_unet(self, args, components, noisy_latents, timesteps, te_outputs, batch, weight_dtype):
        hidden = te_outputs["encoder_hidden_states"].to(weight_dtype)
        return components.unet(noisy_latents, timesteps, hidden).sample

    def get_noise_pred_and_target(self, args, accelerator, noise_scheduler, latents, batch, te_outputs, components,
                                  weight_dtype, fixed_timestep=None):
        g = self.noise_generator
        eps = noise.make_noise(args, latents, g)
        timesteps = noise.sample_timesteps(args, latents.shape[0], noise_scheduler.config.num_train_timesteps,
                                           latents.device, g, fixed=fixed_timestep)
        noisy = noise_scheduler.add_noise(latents, noise.input_perturbation(args, eps, g), timesteps)
        with accelerator.autocast():
            pred = self.call_unet(args, components, noisy.to(weight_dtype), timesteps, te_outputs, batch,
                                  weight_dtype)
        if noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, eps, timesteps)
        else:
            target = eps
        return pred, target, timesteps, None

    def huber_threshold(self, args, timesteps, noise_scheduler):
        return losses.huber_threshold(args, timesteps, noise_scheduler.config.num_train_timesteps,
                                      noise_scheduler.alphas_cumprod)

    def apply_loss_mask(self, args, loss, batch):
        """The element-wise loss [B, C, h, w] before its per-sample mean: times the batch's masks (alpha_mask /
        conditioning_data_dir images; upstream applies them whenever the batch has them)."""
        return masks.apply_masked_loss(loss, batch.get("alpha_masks"))

    def post_process_loss(self, loss, args, timesteps, noise_scheduler):
        v = noise_scheduler.config.prediction_type == "v_prediction"
        return losses.apply_snr_weights(loss, args, timesteps, noise_scheduler, v)

    def enable_gradient_checkpointing(self, args, components, train_text_encoder: bool) -> None:
        from library import offload_checkpointing

        if offload_checkpointing.enabled(args):
            offload_checkpointing.enable(components.unet)
        else:
            components.unet.enable_gradient_checkpointing()
        if train_text_encoder:
            for te in self.lora_target_text_encoders(components):
                if hasattr(te, "activation_checkpointing_enable"):  # transformers >= 5.x name
                    te.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
                else:
                    te.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def place_unet(self, args, components, device, weight_dtype) -> None:
        """Puts the frozen UNet on its device and dtype (FLUX: keeps fp8 weights, places only the blocks that
        --blocks_to_swap leaves on the GPU)."""
        from library import precision

        precision.to_device_dtype(components.unet, device, weight_dtype)

    def fp8_targets(self, args) -> tuple[bool, bool]:
        """(UNet/DiT, text encoders) kept in fp8: --fp8_base / --fp8_base_unet."""
        from library import precision

        return precision.fp8_targets(args)

    def apply_fp8(self, args, components) -> None:
        """Right after loading (before the LoRA wraps the Linear layers)."""
        from library import precision

        precision.apply_fp8_to_components(self.fp8_targets(args), components.unet, components.text_encoders)

    def set_attention_backend(self, args, components) -> None:
        """PyTorch SDPA is diffusers' default; --xformers switches the UNet to xformers when it is installed,
        --diffusers_xformers (fine_tune.py, sdxl_train.py) the UNet and the VAE."""
        unet = getattr(components, "unet", None)
        targets = {"--xformers": [unet] if args.xformers else []}
        if getattr(args, "diffusers_xformers", False):
            targets["--diffusers_xformers"] = [unet, getattr(components, "vae", None)]
        for flag, models in targets.items():
            for model in [m for m in models if m is not None]:
                try:
                    model.enable_xformers_memory_efficient_attention()
                    logger.info("xformers attention enabled in the %s (%s)", type(model).__name__, flag)
                except Exception as e:  # noqa: BLE001 - not installed / no CUDA: SDPA still works
                    logger.warning("%s: cannot use xformers (%s); using PyTorch scaled-dot-product attention",
                                   flag, e)
                    return

    compiled_blocks = 0

    def prepare_unet_with_accelerator(self, args, accelerator, components) -> None:
        """After accelerator.prepare: the UNet is frozen and on its device. Regional compilation of its repeated
        blocks with --compile (SDXL) or upstream's --torch_compile (every SD script)."""
        from library import offload_checkpointing
        from library.compile import environment as compile_environment, options as compile_options, regional

        cargs = compile_options.compile_args(args)
        if cargs is None:
            return
        compile_environment.setup_compile_environment(cargs)
        if cargs.compile:
            # regional compilation moves diffusers' checkpointing of these blocks inside the compiled region
            self.compiled_blocks = regional.compile_model_blocks(
                components.unet, cargs, model_name=self.model_label, gradient_checkpointing=args.gradient_checkpointing,
                offload_checkpointing=offload_checkpointing.enabled(args))

    def keep_training_text_encoder(self, args, global_step: int) -> bool:
        """Asked before each step while a text encoder is trained; False freezes it from this step on
        (train_db.py: --stop_text_encoder_training)."""
        return True

    def on_step_start(self, args) -> None:
        pass

    def build_pipeline(self, args, components, scheduler):
        from diffusers import StableDiffusionPipeline

        return StableDiffusionPipeline(vae=components.vae, text_encoder=components.text_encoders[0],
                                       tokenizer=components.tokenizers[0], unet=components.unet, scheduler=scheduler,
                                       safety_checker=None, feature_extractor=None, requires_safety_checker=False)

    def sample_prompt_embeds(self, args, components, prompt: str, negative_prompt: str) -> dict:
        """Sample prompts are encoded as captions are in training (--clip_skip, --max_token_length), padded
        (the pipeline needs prompt and negative prompt of one length)."""
        pos = self.encode_prompts(args, components, [prompt], pad_to_longest=False)
        neg = self.encode_prompts(args, components, [negative_prompt], pad_to_longest=False)
        return {"prompt_embeds": pos["encoder_hidden_states"], "negative_prompt_embeds": neg["encoder_hidden_states"]}

    def base_model_version(self, args) -> str:
        if args.v2:
            return "sd_v2" + ("_v" if args.v_parameterization else "")
        return "sd_v1"

    def update_metadata(self, metadata: dict, args) -> None:
        metadata["ss_v2"] = str(bool(args.v2))

    # -- the loop ----------------------------------------------------------------------------------------
    def check_objective_args(self, args) -> None:
        """Loss, noise and validation options (library.losses / noise / validation), before models load."""
        losses.check_loss_args(args, ConfigError, flow_matching=self.flow_matching)
        noise.check_noise_args(args, ConfigError, flow_matching=self.flow_matching)
        validation.check_validation_args(args, ConfigError)

    def use_prediction_type(self, args, prediction_type: str) -> None:
        """The prediction type that trains is the one the metadata reports: a v-prediction model (e.g. its
        diffusers scheduler config) trains as --v_parameterization, and every reader of that flag agrees."""
        if prediction_type == "v_prediction" and not args.v_parameterization:
            logger.info("the model is a v-prediction model: training with v-parameterization")
            if args.v_pred_like_loss:
                raise TrainingError("--v_pred_like_loss cannot be used with a v-prediction model")
            args.v_parameterization = True

    def check_args(self, args) -> None:
        """Everything that can be checked before data or models load."""
        train_util.verify_training_args(args)
        self.check_objective_args(args)
        if not args.network_module:
            raise ConfigError("--network_module is required, e.g. --network_module networks.lora")
        if args.network_train_unet_only and args.network_train_text_encoder_only:
            raise ConfigError("--network_train_unet_only and --network_train_text_encoder_only exclude each other")
        caching_te = args.cache_text_encoder_outputs or args.cache_text_encoder_outputs_to_disk
        if caching_te and not args.network_train_unet_only:
            raise ConfigError("--cache_text_encoder_outputs needs --network_train_unet_only (a trained text "
                              "encoder changes its outputs)")
        if args.network_dim is not None and (args.network_dim < 0 or (
                args.network_dim == 0 and args.network_module.startswith("networks.lora"))):
            # upstream's networks.lora skips every module of rank 0: nothing would train
            raise ConfigError(f"--network_dim must be 1 or more (the LoRA rank), got {args.network_dim}")
        if args.network_dropout is not None and not 0 <= args.network_dropout < 1:
            raise ConfigError(f"--network_dropout must be in [0, 1), got {args.network_dropout}")
        if args.network_weights and not os.path.isfile(args.network_weights):
            raise ConfigError(f"--network_weights: file not found: {args.network_weights}")
        if args.dim_from_weights and not args.network_weights:
            raise ConfigError("--dim_from_weights needs --network_weights")
        network_options.check_network_option_args(args, ConfigError)
        compile_graphs.check_args(args, ConfigError)
        if args.pretrained_model_name_or_path is None:
            raise ConfigError("--pretrained_model_name_or_path is required")
        try:
            import_network_module(args.network_module)
        except ImportError as e:
            raise ConfigError(f"--network_module {args.network_module}: cannot import it ({e})") from e
        module = import_network_module(args.network_module)
        families = getattr(module, "FAMILIES", None)  # the model families a module is made for, as upstream's
        if families and self.family_for(args) not in families:
            raise ConfigError(f"--network_module {args.network_module}: made for {'/'.join(families)} models (as "
                              f"upstream), this script trains {self.family_for(args)}"
                              + (f"; use {module.FOR_FLUX}" if self.family_for(args) == "flux" else ""))
        validate = getattr(module, "parse_network_kwargs", None)
        if validate is not None:
            validate(parse_network_args(args.network_args))
        if args.sample_prompts and (args.sample_every_n_steps or args.sample_every_n_epochs or args.sample_at_first):
            # read only when it will be used, as upstream (the kohya_ss GUI always passes a prompt file, empty
            # when its prompt box is)
            from library.sample_prompts import parse_prompt_file

            parse_prompt_file(args.sample_prompts)  # PromptFileError names the file and line
        if args.fused_backward_pass and not self.steps_in_backward(args):
            logger.info("--fused_backward_pass: checked as upstream; a LoRA is stepped after backward as upstream's "
                        "LoRA scripts do (its gradients are small)")
        self.assert_extra_args(args)

    def check_common_options(self, args) -> None:
        """Logging, tracker, precision, memory and compile-switch options of every trainer, before the
        script's own checks (which validate the compile settings --torch_compile sets)."""
        from library import console_log, precision, trackers
        from library.compile import options as compile_options

        console_log.apply_console_log_args(args)
        compile_options.apply_torch_compile_alias(args)
        trackers.check_tracker_args(args)
        precision.check_precision_args(args)

    def output_ext(self, args) -> str:
        return "." + args.save_model_as

    def steps_in_backward(self, args) -> bool:
        """Whether the optimizer(s) step inside backward (the full trainers' fused backward / optimizer groups).
        Upstream's LoRA scripts accept and check --fused_backward_pass, but their loop never fuses."""
        return False

    def optimizer_param_groups(self, args, trainable: Trainable) -> list[list[dict]]:
        """The param groups of each optimizer: one optimizer over all of them here."""
        return [trainable.param_groups]

    # -- what is trained (the LoRA network here; library.full_trainer trains the models themselves) -------
    def setup_trainable(self, args, accelerator, components, weight_dtype, caching_te: bool) -> Trainable:
        """Creates what is trained and puts the UNet and the text encoders on their device and dtype, with
        gradient checkpointing; returns the trained modules and the optimizer's param groups."""
        device = accelerator.device
        unet, vae = components.unet, components.vae
        text_encoders = self.lora_target_text_encoders(components)
        network_module = import_network_module(args.network_module)
        net_kwargs = parse_network_args(args.network_args)
        if args.dim_from_weights:
            network, _ = network_module.create_network_from_weights(1.0, args.network_weights, vae, text_encoders,
                                                                    unet, **net_kwargs)
        else:
            if not hasattr(network_module, "NETWORK_ARGS") and "dropout" not in net_kwargs:
                # sd-scripts hands --network_dropout to other modules (LyCORIS) as the "dropout" network arg
                net_kwargs["dropout"] = args.network_dropout
            network = network_module.create_network(1.0, args.network_dim, args.network_alpha, vae, text_encoders,
                                                    unet, neuron_dropout=args.network_dropout, **net_kwargs)
        if args.scale_weight_norms and not network_options.supports_max_norm(network):
            logger.warning("--scale_weight_norms: %s does not support it; ignored", args.network_module)
            args.scale_weight_norms = None
        train_unet = not args.network_train_text_encoder_only
        train_text_encoder = not args.network_train_unet_only
        network.apply_to(text_encoders, unet, train_text_encoder, train_unet)
        if args.network_weights:
            network.load_weights(args.network_weights)

        unet.requires_grad_(False)
        self.place_unet(args, components, device, weight_dtype)
        if args.gradient_checkpointing:
            self.enable_gradient_checkpointing(args, components, train_text_encoder)
        unet.train(args.gradient_checkpointing)
        for te in text_encoders:
            te.train(train_text_encoder and args.gradient_checkpointing)
        if train_text_encoder and caching_te:
            raise ConfigError("--cache_text_encoder_outputs needs --network_train_unet_only")
        if not caching_te:
            for te in components.text_encoders:
                te.to(device)

        if hasattr(network, "prepare_optimizer_params_with_multiple_te_lrs"):
            params = network.prepare_optimizer_params_with_multiple_te_lrs(args.text_encoder_lr, args.unet_lr,
                                                                          args.learning_rate)
        else:
            if args.text_encoder_lr and len(set(args.text_encoder_lr)) > 1:
                logger.warning("--text_encoder_lr %s: %s takes one learning rate for all text encoders; using %s",
                               " ".join(map(str, args.text_encoder_lr)), args.network_module, args.text_encoder_lr[0])
            params = network.prepare_optimizer_params(text_encoder_lr(args), args.unet_lr, args.learning_rate)
        params, lr_descriptions = params if isinstance(params, tuple) else (params, None)
        if not params:
            raise ConfigError("nothing to train: both learning rates are 0 or no LoRA modules were created")
        if args.full_fp16 or args.full_bf16:
            network.to(weight_dtype)
        network.prepare_grad_etc(text_encoders, unet)
        in_groups = {id(p) for g in params for p in g["params"]}
        for p in network.parameters():  # a group left out (lr 0) is not trained: no gradients for it
            if id(p) not in in_groups:
                p.requires_grad_(False)
        network.to(device)
        return Trainable(models=[network], param_groups=params, train_text_encoder=train_text_encoder,
                         lr_descriptions=lr_descriptions)

    def merge_base_weights(self, args, components, weight_dtype) -> None:
        """--base_weights: merged into the models right after they load (before any caching)."""
        if not getattr(args, "base_weights", None):
            return
        network_module = import_network_module(args.network_module)
        network_options.merge_base_weights(args, network_module, components.vae,
                                           list(components.text_encoders), components.unet)

    def after_prepare(self, args, accelerator, trainable: Trainable, optimizer) -> None:
        """After the optimizer is prepared and the UNet compiled (the full trainers add fused backward here)."""

    def on_epoch_start(self, args, trainable: Trainable, components) -> None:
        for network in trainable.models:
            network.on_epoch_start(self.lora_target_text_encoders(components), components.unet)

    def save_model(self, args, accelerator, trainable: Trainable, metadata, path, epoch, step) -> None:
        """Writes the result (main process only)."""
        self.save_lora(args, accelerator, trainable.models[0], metadata, path, epoch, step)

    def make_accelerator(self, args):
        """Data-parallel over the processes of `accelerate launch`. The trained modules are not wrapped in
        DDP (LoRA runs inside the UNet's forward, not the network's): their gradients are averaged by
        data_parallel.all_reduce_gradients instead; the dataloader is sharded by accelerate."""
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration

        from library import data_parallel, trackers

        log_with = trackers.log_with(args)
        logging_dir = None
        if args.logging_dir:
            logging_dir = os.path.join(args.logging_dir, (args.log_prefix or "") + time.strftime("%Y%m%d%H%M%S"))
        trackers.prepare_wandb(args, logging_dir)
        accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                                  mixed_precision=args.mixed_precision, log_with=log_with,
                                  project_config=ProjectConfiguration(project_dir=args.output_dir,
                                                                      logging_dir=logging_dir),
                                  kwargs_handlers=data_parallel.accelerator_kwargs_handlers(args))
        try:
            data_parallel.check_launch(accelerator)
        except RuntimeError as e:
            raise TrainingError(str(e)) from e
        return accelerator

    def train(self, args) -> str:
        """Runs the training; returns the path of the final result (the LoRA file here). SIGTERM / Ctrl+C
        during the loop stop it after the current step, with the results saved (library.stop_signal)."""
        self.stop = stop_signal.StopRequest()
        self.run_config_path, self.training_started = None, False
        try:
            return self._train(args)
        except BaseException:
            if self.run_config_path and not self.training_started and os.path.exists(self.run_config_path):
                os.remove(self.run_config_path)  # a run that never trained leaves no settings file behind
            raise
        finally:
            self.stop.restore()  # the handlers before this run (callers in the same process are unaffected)

    def _train(self, args) -> str:
        from library import data_parallel, trackers

        train_util.setup_logging()
        if getattr(args, "output_config", False):
            return train_util.write_output_config(args)
        if getattr(args, "validate_only", False):
            from library import validate_only

            return validate_only.run(self, args)
        self.check_common_options(args)
        self.check_args(args)
        args.output_name = args.output_name or self.default_output_name
        ext = self.output_ext(args)
        final_path = os.path.join(args.output_dir, train_util.last_file_name(args.output_name, ext))
        train_util.check_outputs_free(args.output_dir, args.output_name, ext, args.overwrite_output, bool(args.resume))
        state_folders.check_resume(args, ext)
        session_id = uuid.uuid4().int & ((1 << 31) - 1)
        training_started_at = time.time()

        accelerator = self.make_accelerator(args)
        if compile_graphs.cuda_graphs(args) == "step" and accelerator.num_processes > 1:
            raise ConfigError(f"--cuda_graph_step runs on one GPU; this run has {accelerator.num_processes} "
                              "processes: drop --cuda_graph_step or train on one GPU")
        if accelerator.is_main_process and not args.no_metadata:  # the one that saves (save_lora) needs the hashes
            metadata_util.start_file_hashes(args.pretrained_model_name_or_path, getattr(args, "vae", None))
        # before the dataset: its batch order and augmentations follow the seed (a random one without --seed)
        train_util.prepare_seed(args, accelerator)
        family = self.family_for(args)
        kinds = self.dataset_kinds + ((config_util.CONTROLNET,) if getattr(args, "masked_loss", False) else ())
        group, val_group = config_util.build_dataset_groups(args, family, kinds)  # upstream: ControlNet subsets
        # (conditioning_data_dir) with --masked_loss
        groups = [g for g in (group, val_group) if g is not None]  # what is cached
        for g in groups:
            g.verify_bucket_reso_steps(self.bucket_reso_steps_multiple)
        if len(group) == 0:
            raise TrainingError("the dataset has no batches: no training images found")
        if getattr(args, "debug_dataset", False):
            from library.datasets import debug_dataset

            debug_dataset(group)
            return None

        log_with = trackers.log_with(args)
        os.makedirs(args.output_dir, exist_ok=True)
        requests = run_requests.RunRequests(args.output_dir, accelerator.is_main_process)
        requests.clear_stale()  # before models load: a request sent while they load is this run's
        if accelerator.is_main_process:
            state_folders.remove_stale(args.output_dir, args.output_name)
            self.run_config_path = self.write_run_config(args)
        weight_dtype = train_util.weight_dtype_for(args)
        device = accelerator.device

        from library import precision, safetensors_io

        with safetensors_io.mmap_setting(args):
            components = self.load_target_model(args, accelerator, weight_dtype)
        self.merge_base_weights(args, components, weight_dtype)
        self.components = components
        self.apply_fp8(args, components)
        self.set_attention_backend(args, components)
        vae = components.vae
        prediction_type = self.prediction_type(args, components)
        self.use_prediction_type(args, prediction_type)
        self.trained_prediction_type = prediction_type  # what the modelspec metadata states

        vae_dtype = torch.float32 if args.no_half_vae else weight_dtype
        caching_latents = args.cache_latents or args.cache_latents_to_disk
        if caching_latents:
            vae.to(device, dtype=vae_dtype)
            vae.requires_grad_(False).eval()
            with data_parallel.main_process_first(accelerator, args.cache_latents_to_disk, "latents"):
                for g in groups:
                    g.cache_latents(lambda images: self.encode_images(args, components, images),
                                    to_disk=args.cache_latents_to_disk, signature=self.cache_signature(args, "vae"),
                                    batch_size=args.vae_batch_size, fmt=self.latent_cache_format(args, components),
                                    skip_check=args.skip_cache_check)
            vae.to("cpu")
        caching_te = args.cache_text_encoder_outputs or args.cache_text_encoder_outputs_to_disk
        for te in components.text_encoders:
            te.requires_grad_(False)
            precision.to_device_dtype(te, device, weight_dtype)  # fp8 weights stay fp8
        if caching_te:
            for te in components.text_encoders:
                te.eval()
            with data_parallel.main_process_first(accelerator, args.cache_text_encoder_outputs_to_disk,
                                                  "text encoder outputs"):
                for g in groups:
                    g.cache_text_encoder_outputs(lambda caps: self.encode_prompts(args, components, caps, False),
                                                 to_disk=args.cache_text_encoder_outputs_to_disk,
                                                 batch_size=getattr(args, "text_encoder_batch_size", None),
                                                 signature=self.cache_signature(args, "te"),
                                                 skip_check=args.skip_cache_check,
                                                 fmt=self.te_cache_format(args, components))
            for te in components.text_encoders:
                te.to("cpu")

        trainable = self.setup_trainable(args, accelerator, components, weight_dtype, caching_te)
        self.multiplier_models = [m for m in trainable.models if hasattr(m, "set_multiplier")]
        train_text_encoder = trainable.train_text_encoder
        if not caching_latents:
            vae.requires_grad_(False).eval()
            vae.to(device, dtype=vae_dtype)

        # one optimizer, or one per part of the model for the full trainers' fused optimizer groups
        built = [optimizers.get_optimizer(args, groups) for groups in self.optimizer_param_groups(args, trainable)]
        opt_name, opt_class = built[0][:2]
        # sharded over the processes: each sees len(group) / num_processes batches per epoch
        dataloader = accelerator.prepare(_make_dataloader(group, args))
        num_batches = len(dataloader)
        steps_per_epoch, max_train_steps, num_epochs = train_util.resolve_train_length(args, num_batches)
        args.max_train_steps = max_train_steps
        saving.apply_save_n_epoch_ratio(args, num_epochs)
        for g in groups:  # token warm-up (upstream's validation batches follow the training step too)
            g.set_max_train_steps(max_train_steps)
        # not prepared by accelerate (our loop steps it: schedulers.step follows accelerate's rule exactly)
        lr_scheduler = schedulers.group([schedulers.get_scheduler(args, b[2], max_train_steps,
                                                                  accelerator.num_processes) for b in built])
        self.optimizers = [accelerator.prepare(b[2]) for b in built]
        optimizer = self.optimizers[0]
        if args.full_fp16:
            _allow_fp16_grad_unscale(accelerator)
        self.prepare_unet_with_accelerator(args, accelerator, components)
        self.after_prepare(args, accelerator, trainable, optimizer)
        trained_params = [p for m in trainable.models for p in m.parameters() if p.requires_grad]

        optimizer_train, _ = optimizers.train_eval_fns(self.optimizers, args)
        state = TrainState()
        seed = args.seed
        self.noise_generator = torch.Generator(device=device).manual_seed(seed + accelerator.process_index)
        state.generator = self.noise_generator
        for model in trainable.models:
            accelerator.register_for_checkpointing(model)
        accelerator.register_for_checkpointing(lr_scheduler)
        accelerator.register_for_checkpointing(state)  # last: state_folders.resumed_position reads it so
        if args.resume:
            logger.info("resuming from %s", args.resume)
            state_folders.load_state(accelerator, huggingface_util.resume_state_dir(args))  # one line on a mismatch
            optimizer_train()  # a schedule-free optimizer's state was saved in eval mode
            logger.info("resumed at step %d (epoch %d)", state.global_step, state.epoch)

        noise_scheduler = self.get_noise_scheduler(args, components)
        validator = validation.build_validator(args, val_group, accelerator, lambda g: _make_dataloader(g, args),
                                               seed, self.num_train_timesteps(noise_scheduler))

        total_batch = args.train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
        metadata = self.build_metadata(args, group, session_id, training_started_at, opt_class, opt_name,
                                       num_batches, num_epochs, max_train_steps, total_batch)
        metadata.update({k: train_util.metadata_value(v) for k, v in validation.metadata(args, val_group).items()})
        if log_with:
            trackers.init_trackers(accelerator, args, self.tracker_name)

        logger.info("running training: %d batches per epoch, %d epochs, %d steps, batch size %d "
                    "(total with accumulation and processes %d)", num_batches, num_epochs, max_train_steps,
                    args.train_batch_size, total_batch)
        data_parallel.log_process(accelerator, num_batches)

        from tqdm.auto import tqdm

        start = saving.start_position(args, steps_per_epoch, state.global_step, max_train_steps)
        global_step, first_epoch, skip_batches = start.global_step, start.epoch, start.skip_batches
        progress = tqdm(total=max_train_steps, initial=global_step, smoothing=0,
                        disable=not accelerator.is_local_main_process, desc="steps", file=sys.stderr)
        line = train_util.ProgressLine(max_train_steps, num_epochs, start_step=global_step)
        losses: list[float] = []
        sample_kwargs = dict(components=components, accelerator=accelerator, models=trainable.models,
                             prediction_type=prediction_type)
        fused = self.steps_in_backward(args)
        from library.compile import options as compile_options, regional, step_graph

        compiled = compile_options.compile_args(args)
        shape_log = regional.ShapeLog(compiled) if compiled is not None and compiled.compile else None

        if args.sample_at_first:
            self.sample_images(args, epoch=None, steps=global_step, **sample_kwargs)

        last_loss = avr_loss = float("nan")
        # with compile on, the timer tells each input shape's setup steps (compile, graph recording) from the rest
        setup_steps = step_graph.WARMUP + 1 if compile_graphs.cuda_graphs(args) == "step" else \
            2 if compile_graphs.cuda_graphs(compiled) == "blocks" else 1
        timer = StepTimer(global_step, setup_steps_per_shape=setup_steps)
        on_gpu = device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)  # the summary's peak: the loop's, not loading's or caching's
        step_shapes: list = []  # input shapes of the micro-steps of the step in progress
        late = LateLosses(device)
        graphs = step_graph.StepGraphs(self.optimizers, device, [self.noise_generator]) \
            if compile_graphs.cuda_graphs(args) == "step" else None

        def run_step(batch):
            """Forward to optimizer step (no zero_grad): what a step graph captures."""
            loss = self.training_step(args, accelerator, noise_scheduler, batch, components, weight_dtype,
                                      train_text_encoder, caching_te, device)
            accelerator.backward(loss)  # with fused backward the optimizer steps in here, per parameter
            if not fused:
                if accelerator.sync_gradients:
                    data_parallel.all_reduce_gradients(trained_params, accelerator)
                    if args.max_grad_norm:
                        accelerator.clip_grad_norm_(trained_params, args.max_grad_norm)
                    network_options.after_grad_sync(trainable.models)
                optimizer.step()
            return loss

        def report(ready):
            """Progress line, progress bar and tracker logs of finished steps whose losses are now read."""
            nonlocal last_loss, avr_loss
            for (step, step_epoch, lr, postfix, logs), values in ready:
                finite_guard.check_losses(args, step, values)  # a NaN / inf loss: stop, no save (issue 26)
                losses.extend(values)
                self.losses = losses
                last_loss = values[-1]
                window = losses[-steps_per_epoch * args.gradient_accumulation_steps:]
                avr_loss = sum(window) / len(window)
                progress.set_postfix(loss=f"{last_loss:.4f}", avr_loss=f"{avr_loss:.4f}", lr=f"{lr:.2e}", **postfix)
                if accelerator.is_main_process and line.should_print(step):
                    progress.write(line.format(step, last_loss, avr_loss, lr, step_epoch + 1,
                                               validator.last_loss if validator else None), file=sys.stdout)
                    sys.stdout.flush()
                if log_with:
                    accelerator.log({"loss/current": last_loss, "loss/average": avr_loss, **logs}, step=step)

        def flush_losses():
            """Reads every pending loss (waits for the GPU); the wait is the last step's time, not the pause's."""
            report(late.flush())
            timer.waited()

        val_args = (args, accelerator, validator, noise_scheduler, components, weight_dtype, caching_te, device,
                    trainable.models)
        stop = self.stop.install()
        self.training_started = True
        stopping = False  # the ranks' agreed answer (a signal can reach one rank after the others' last check)
        for epoch in range(first_epoch, num_epochs):
            if global_step >= max_train_steps or stopping:
                break
            group.set_current_epoch(epoch + 1)
            for g in groups:
                g.set_current_step(global_step)
            self.on_epoch_start(args, trainable, components)
            timer.restart()  # epoch-end saves and samples are not step time
            loader = dataloader
            if skip_batches:
                from accelerate import skip_first_batches

                loader = skip_first_batches(dataloader, skip_batches)
                skip_batches = 0
            for batch in loader:
                if train_text_encoder and not self.keep_training_text_encoder(args, global_step):
                    train_text_encoder = False
                self.on_step_start(args)
                if compile_graphs.opens_accumulation_window(accelerator.step, args.gradient_accumulation_steps):
                    compile_graphs.mark_step_begin(compiled)  # once per optimizer step (CUDA graphs)
                if shape_log is not None:
                    shape_log.see(batch, global_step + 1)
                    step_shapes.append(shape_log.shape_of(batch))
                set_network_multiplier(trainable.models, batch)
                with accelerator.accumulate(*trainable.models):
                    if graphs is not None:  # a replay of the step's graph once captured (library.compile.step_graph)
                        loss = graphs.step(batch, run_step)
                    else:
                        loss = run_step(batch)
                        if not fused:
                            optimizer.zero_grad(set_to_none=True)
                    schedulers.step(lr_scheduler, self.optimizers, num_processes=accelerator.num_processes,
                                    sync_gradients=accelerator.sync_gradients)

                late.add(loss)  # read a step later: no wait for the GPU here
                if not accelerator.sync_gradients:
                    continue
                norm_postfix, norm_logs = network_options.after_optimizer_step(
                    args, [accelerator.unwrap_model(m) for m in trainable.models], device) if not fused else ({}, {})
                global_step += 1
                timer.step_done(step_shapes)
                step_shapes = []
                for g in groups:  # for the batches loaded from now on (token warm-up)
                    g.set_current_step(global_step)
                state.global_step, state.epoch = global_step, epoch
                progress.update(1)
                logs = dict(norm_logs)
                if log_with:  # this step's learning rates, logged with its loss once that is read
                    names = trainable.lr_descriptions
                    for i, g_lr in enumerate(lr_scheduler.get_last_lr()):
                        logs[f"lr/{names[i]}" if names and i < len(names) else f"lr/group{i}"] = g_lr
                    logs.update(optimizers.d_lr_logs(self.optimizers, names))
                report(late.step_done((global_step, epoch, lr_scheduler.get_last_lr()[0], norm_postfix, logs)))
                if validator is not None and validator.due_after_step(global_step):
                    flush_losses()
                    validator.report(accelerator, self.validation_loss(*val_args), avr_loss, global_step=global_step,
                                     epoch=epoch + 1, at_epoch_end=False)
                    timer.restart()

                asked = requests.take(accelerator, stop_flag=stop.flag)  # Save now / Sample now / Stop
                saved = args.save_every_n_steps and global_step % args.save_every_n_steps == 0  # the last step too
                if saved or "save" in asked:
                    flush_losses()
                    if not saved:
                        logger.info("save requested: saving at step %d", global_step)
                    self.save_checkpoint(args, accelerator, trainable, metadata, epoch + 1, global_step, ext,
                                         by_step=True, prune=bool(saved))
                    timer.restart()
                from library.sampling import should_sample

                sampled = should_sample(args, epoch=None, steps=global_step)
                if sampled or "sample" in asked:
                    flush_losses()
                    if not sampled:
                        logger.info("sample requested: sampling at step %d" if args.sample_prompts else
                                    "sample requested at step %d, but there is no --sample_prompts file", global_step)
                    self.sample_images(args, epoch=None, steps=global_step, **sample_kwargs)
                    timer.restart()
                if global_step >= max_train_steps:
                    break
                if "stop" in asked:
                    if not stop.flag:
                        logger.warning("stop requested: stopping after step %d and saving", global_step)
                    stop.flag = stopping = True
                    break
            flush_losses()
            if stopping:
                break  # mid-epoch: no epoch-end save, sample or validation

            done_epoch = epoch + 1
            state.epoch = done_epoch
            if validator is not None and validator.due_after_epoch(done_epoch):
                validator.report(accelerator, self.validation_loss(*val_args), avr_loss, global_step=global_step,
                                 epoch=done_epoch, at_epoch_end=True)
            if log_with:
                accelerator.log({"loss/epoch": sum(losses[-num_batches:]) / max(1, len(losses[-num_batches:]))},
                                step=global_step)
            if args.save_every_n_epochs and done_epoch % args.save_every_n_epochs == 0 and done_epoch < num_epochs \
                    and global_step < max_train_steps:
                self.save_checkpoint(args, accelerator, trainable, metadata, done_epoch, global_step, ext,
                                     by_step=False)
            from library.sampling import should_sample

            if should_sample(args, epoch=done_epoch, steps=global_step):
                self.sample_images(args, epoch=done_epoch, steps=global_step, **sample_kwargs)

        progress.close()
        summary = timer.summary(torch.cuda.max_memory_allocated(device) if on_gpu else None)
        if summary and accelerator.is_main_process:
            print(summary, flush=True)  # stdout, under the last progress line
        data_parallel.log_process_done(accelerator, global_step, last_loss, trained_params)
        final_epoch = max(state.epoch, 1)
        accelerator.wait_for_everyone()
        with self.eval_weights(args):
            if accelerator.is_main_process:
                with saving.explained_save_errors(final_path):
                    self.save_model(args, accelerator, trainable, metadata, final_path, final_epoch, global_step)
                huggingface_util.upload(args, final_path, os.path.basename(final_path), force_sync=True)
            if args.save_state or args.save_state_on_train_end:
                self.save_state(args, accelerator, train_util.state_dir_name(args.output_name))
        huggingface_util.wait_for_uploads()
        accelerator.wait_for_everyone()
        accelerator.end_training()
        logger.info("model saved: %s", final_path)
        if stop.flag and accelerator.is_main_process:
            line = stop_signal.stopped_line(global_step, final_path)
            logger.info("%s", line)
            print(line, flush=True)
        return final_path

    def num_train_timesteps(self, noise_scheduler) -> int:
        return noise_scheduler.config.num_train_timesteps if noise_scheduler is not None else 1000

    def validation_loss(self, args, accelerator, validator, noise_scheduler, components, weight_dtype, caching_te,
                        device, models) -> float:
        """One validation pass (library.validation): the training step's loss at each fixed timestep, without
        gradients (text encoders too), `models` in eval mode."""
        from library.compile import graphs as compile_graphs, options as compile_options

        def step(batch, timestep):
            self.on_step_start(args)
            compile_graphs.mark_step_begin(compile_options.compile_args(args))
            return self.training_step(args, accelerator, noise_scheduler, batch, components, weight_dtype, False,
                                      caching_te, device, fixed_timestep=timestep)

        return validator.run(step, models, self, accelerator)

    def training_step(self, args, accelerator, noise_scheduler, batch, components, weight_dtype,
                      train_text_encoder, caching_te, device, fixed_timestep=None) -> torch.Tensor:
        if batch.get("latents") is not None:  # cached by encode_images (checked for NaN then), already scaled
            latents = batch["latents"].to(device, dtype=torch.float32)
        else:
            latents = self.encode_images(args, components, batch["images"]).to(torch.float32)
            if torch.isnan(latents).any():  # as upstream: a warning, and zeros (only here: it waits for the GPU)
                accelerator.print("NaN found in latents, replacing with zeros")
                latents = torch.nan_to_num(latents, 0, out=latents)
        if batch.get("te_outputs") is not None:
            te_outputs = {k: v.to(device) for k, v in batch["te_outputs"].items()}
        else:
            with accelerator.autocast():
                te_outputs = self.encode_prompts(args, components, batch["captions"], with_grad=train_text_encoder)
        def forward():
            return self.get_noise_pred_and_target(args, accelerator, noise_scheduler, latents, batch, te_outputs,
                                                  components, weight_dtype, fixed_timestep=fixed_timestep)

        preserve = diff_output_preservation_indices(batch) if getattr(self, "multiplier_models", None) else []
        prior = base_model_prediction(self.multiplier_models, forward, self.noise_generator, device) \
            if preserve else None
        pred, target, timesteps, weighting = forward()
        if prior is not None:  # upstream's differential output preservation: those samples learn the base output
            target = target.clone()
            target[preserve] = prior[preserve].to(target.dtype)
        huber_c = self.huber_threshold(args, timesteps, noise_scheduler) if args.loss_type in losses.HUBER_TYPES \
            else None
        loss = losses.conditional_loss(pred.float(), target.float(), args.loss_type, huber_c)
        if weighting is not None:
            loss = loss * weighting
        loss = self.apply_loss_mask(args, loss, batch)
        loss = loss.mean(dim=list(range(1, loss.dim())))
        loss = loss * batch["loss_weights"].to(loss.device)
        loss = self.post_process_loss(loss, args, timesteps, noise_scheduler)
        return loss.mean()

    # -- outputs -----------------------------------------------------------------------------------------
    def latent_cache_format(self, args, components) -> LatentCacheFormat:
        """Upstream's latent cache file names and keys for this family; SD/SDXL files hold the unscaled sample."""
        fmt = FAMILY_FORMATS[self.family_for(args)]
        return dataclasses.replace(fmt, scale=float(components.vae.config.scaling_factor))

    def te_cache_format(self, args, components) -> TeCacheFormat:
        """Text-encoder cache files: upstream caches none for SD1.x/2.x, so our own layout here."""
        return TeCacheFormat()

    def cache_signature(self, args, what: str) -> str:
        weighted = ":weighted" if what == "te" and weighted_for(args, self.family_for(args)) else ""
        return f"{self.family_for(args)}:{os.path.basename(str(args.pretrained_model_name_or_path))}:" \
               f"{os.path.basename(str(args.vae or ''))}:{what}:{args.max_token_length}:{args.clip_skip}{weighted}"

    def write_run_config(self, args) -> str:
        """`<output_name>_config.toml`: the exact options of this run (runs again with --config_file)."""
        # written anew by every run of this name (its results were checked free by check_outputs_free, so a
        # config left here belongs to a run that did not finish, or to the run being resumed)
        path = os.path.join(args.output_dir, f"{args.output_name}_config.toml")
        train_util.atomic_write_text(path, train_util.dumps_config(args))
        logger.info("run options written to %s", path)
        return path

    def build_metadata(self, args, group, session_id, started_at, opt_class, opt_name, num_batches, num_epochs,
                       max_train_steps, total_batch_size) -> dict[str, str]:
        """The ss_* keys (library.metadata: every key upstream writes), then the trainer's own."""
        md = metadata_util.network_metadata(
            args, group=group, session_id=session_id, started_at=started_at, opt_class=opt_class,
            num_batches=num_batches, num_epochs=num_epochs, max_train_steps=max_train_steps,
            total_batch_size=total_batch_size, base_model_version=self.base_model_version(args),
            network_dim=args.network_dim if getattr(args, "network_dim", None) is not None else 4,
            text_encoder_lr=text_encoder_lr(args))
        owned = {**losses.metadata(args), **noise.metadata(args)}  # those options' keys, from their modules
        md.update({k: train_util.metadata_value(v) for k, v in owned.items()})  # None as "None", as upstream
        md.update({k: train_util.metadata_value(v) for k, v in self.method_metadata(args).items() if v is not None})
        self.update_metadata(md, args)
        return md

    def method_metadata(self, args) -> dict[str, Any]:
        """The ss_* keys of what is trained beyond the shared ones (the LoRA network's are shared)."""
        return {}

    def modelspec(self, args, lora: bool = True) -> dict[str, str]:
        """modelspec.* keys of a saved result (library.metadata; --metadata_* options)."""
        return metadata_util.modelspec_metadata(
            args, family=self.family_for(args), lora=lora, flux_variant=self.modelspec_variant(),
            v_prediction=getattr(self, "trained_prediction_type", None) == "v_prediction"
            or bool(getattr(args, "v_parameterization", False)))

    def modelspec_variant(self) -> str | None:
        """FLUX: "dev" or "schnell" (the modelspec architecture)."""
        return None

    def save_lora(self, args, accelerator, network, md, path, epoch, step) -> None:
        """ss_* (only upstream's minimum keys with --no_metadata) + modelspec.*, as upstream writes them."""
        md = dict(md)
        md["ss_training_finished_at"] = str(time.time())
        md["ss_steps"] = str(step)
        md["ss_epoch"] = str(epoch)
        if args.no_metadata:
            md = metadata_util.minimum_network_metadata(md)
        else:  # here, not in build_metadata: hashing a 23 GB base model must not delay the first step
            md.update(metadata_util.file_hash_metadata(args))
        md.update(self.modelspec(args))
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        network = accelerator.unwrap_model(network)
        if hasattr(network, "lora_state_dict"):
            network.save_weights(path, train_util.save_dtype_for(args), md, overwrite=args.overwrite_output)
        else:  # another module's network (LyCORIS): its tensors, written by our atomic writer with both hashes
            save_network_state_dict(network, path, train_util.save_dtype_for(args), md, args.overwrite_output)
        logger.info("saved %s", path)

    def save_state(self, args, accelerator, name: str) -> str:
        """accelerate's state (models, optimizer, scheduler, step, every process's RNG); all processes call it.
        --save_state_to_huggingface uploads it."""
        path = os.path.join(args.output_dir, name)
        with saving.explained_save_errors(path):
            state_folders.write_state(accelerator, path, args.overwrite_output)
        logger.info("training state saved: %s", path)
        if accelerator.is_main_process and getattr(args, "save_state_to_huggingface", False):
            huggingface_util.upload(args, path, name)
        return path

    def save_checkpoint(self, args, accelerator, trainable, metadata, epoch, step, ext, by_step: bool,
                        prune: bool = True) -> None:
        """An intermediate save (kohya names `-step00000010` / `-000001`), uploaded with --huggingface_repo_id,
        old ones pruned by --save_last_n_*(_state) (not after a Save now: `prune` False). Every process calls it;
        the main process writes the model."""
        with self.eval_weights(args):
            self._save_checkpoint(args, accelerator, trainable, metadata, epoch, step, ext, by_step, prune)

    def _save_checkpoint(self, args, accelerator, trainable, metadata, epoch, step, ext, by_step: bool,
                         prune: bool = True) -> None:
        accelerator.wait_for_everyone()
        out = args.output_dir
        if by_step:
            name = train_util.step_file_name(args.output_name, step, ext)
        else:
            name = train_util.epoch_file_name(args.output_name, epoch, ext)
        path = os.path.join(out, name)
        if accelerator.is_main_process:
            with saving.explained_save_errors(path):
                self.save_model(args, accelerator, trainable, metadata, path, epoch, step)
            huggingface_util.upload(args, path, name)
        if args.save_state:
            self.save_state(args, accelerator, train_util.state_dir_name(
                args.output_name, epoch=None if by_step else epoch, step=step if by_step else None))
        if accelerator.is_main_process and prune:
            self.prune_checkpoints(args, epoch, step, ext, by_step)
        accelerator.wait_for_everyone()

    def prune_checkpoints(self, args, epoch, step, ext, by_step: bool) -> None:
        """Removes the save that --save_last_n_epochs/_steps (models) and --save_last_n_*_state (states, default
        the same N) let go, with upstream's rules (library.saving); only names this run writes."""
        out, name = args.output_dir, args.output_name
        if by_step:
            every = args.save_every_n_steps
            old = saving.remove_step_no(step, every, args.save_last_n_steps)
            if old is not None:
                _remove(os.path.join(out, train_util.step_file_name(name, old, ext)))
            old = saving.remove_step_no(step, every, saving.state_keep_last(args, by_step=True))
            if old:  # upstream keeps a state of step 0 (there is none)
                _remove(os.path.join(out, train_util.state_dir_name(name, step=old)))
        else:
            every = args.save_every_n_epochs
            old = saving.remove_epoch_no(epoch, every, args.save_last_n_epochs)
            if old is not None:
                _remove(os.path.join(out, train_util.epoch_file_name(name, old, ext)))
            old = saving.remove_epoch_no(epoch, every, saving.state_keep_last(args, by_step=False))
            if old is not None:
                _remove(os.path.join(out, train_util.state_dir_name(name, epoch=old)))

    def eval_weights(self, args):
        """Context: the model holds a schedule-free optimizer's evaluation weights (sampling, saving), as
        upstream; nothing changes with other optimizers."""
        return optimizers.eval_mode(getattr(self, "optimizers", []), args)

    def sample_images(self, args, *, epoch, steps, components, accelerator, models, prediction_type) -> None:
        """Main process only; `models` (the trained modules) are put in eval mode while sampling."""
        if not args.sample_prompts or not accelerator.is_main_process:
            return
        from library import sampling

        with self.eval_weights(args):
            self._sample_images(args, sampling, epoch, steps, components, accelerator, models, prediction_type)

    def _sample_images(self, args, sampling, epoch, steps, components, accelerator, models, prediction_type) -> None:
        vae_device = components.vae.device
        components.vae.to(accelerator.device)
        tes_devices = [te.device for te in components.text_encoders]
        for te in components.text_encoders:
            te.to(accelerator.device)
        try:
            sampling.sample_images(args, build_pipeline=lambda sched: self.build_pipeline(args, components, sched),
                                   device=accelerator.device, epoch=epoch, steps=steps,
                                   prediction_type=prediction_type, autocast=accelerator.autocast,
                                   networks=[accelerator.unwrap_model(m) for m in models],
                                   encode_prompt=lambda pos, neg: self.sample_prompt_embeds(args, components, pos,
                                                                                            neg))
        finally:
            components.vae.to(vae_device)
            for te, d in zip(components.text_encoders, tes_devices):
                te.to(d)


# ----------------------------------------------------------------------------------------------------------


def set_network_multiplier(models: list, batch: dict) -> None:
    """The dataset's `network_multiplier` for this batch (a batch comes from one dataset). Only a network with
    `set_multiplier` (networks.lora) takes it, and only when it changes, so the default of 1.0 costs nothing."""
    multipliers = batch.get("network_multipliers")
    if multipliers is None or not len(multipliers):
        return
    value = float(multipliers[0])
    for model in models:
        if hasattr(model, "set_multiplier") and getattr(model, "multiplier", 1.0) != value:
            model.set_multiplier(value)


def diff_output_preservation_indices(batch: dict) -> list[int]:
    """Samples whose subset has custom_attributes.diff_output_preservation = true (upstream's DOP)."""
    return [i for i, a in enumerate(batch.get("custom_attributes") or []) if a.get("diff_output_preservation")]


def base_model_prediction(networks: list, forward, generator, device) -> torch.Tensor:
    """forward()'s prediction with the networks' multiplier at 0 (the base model), without gradients, drawing the
    same noise and timesteps as the forward() that follows (the RNG states are put back afterwards).
    Deliberately the whole batch (upstream predicts only the preserved samples): one code path for every family."""
    state = generator.get_state() if generator is not None else None
    saved = [m.multiplier for m in networks]
    devices = [device] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for m in networks:
                m.set_multiplier(0.0)
            prior = forward()[0].detach().clone()  # clone: a CUDA-graph output is overwritten by the next run
    finally:
        for m, value in zip(networks, saved):
            m.set_multiplier(value)
        if state is not None:
            generator.set_state(state)
    return prior


def _remove(path: str) -> None:
    import shutil

    huggingface_util.wait_for_uploads(path)  # an --async_upload of it still running
    if os.path.isdir(path):
        shutil.rmtree(path)
        logger.info("removed old state %s", path)
    elif os.path.isfile(path):
        os.remove(path)
        logger.info("removed old checkpoint %s", path)


def _make_dataloader(group, args):
    from library.datasets import make_dataloader

    # the group itself shuffles per epoch (seeded), so resumed runs see the same order
    return make_dataloader(group, num_workers=args.max_data_loader_n_workers,
                           persistent_workers=args.persistent_data_loader_workers, shuffle=False)


def _allow_fp16_grad_unscale(accelerator) -> None:
    """--full_fp16: the LoRA weights themselves are fp16, which GradScaler refuses to unscale by default."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None:
        return
    org = scaler._unscale_grads_

    def unscale(optimizer, inv_scale, found_inf, allow_fp16):
        return org(optimizer, inv_scale, found_inf, True)

    scaler._unscale_grads_ = unscale


def run(trainer: NetworkTrainer, parser: argparse.ArgumentParser, argv: list[str] | None = None) -> str | None:
    """Parse (with --config_file) and train; clear errors exit with status 2 instead of a traceback."""
    train_util.setup_logging()
    try:
        args = train_util.parse_args(parser, argv)
        return trainer.train(args)
    except UserError as e:
        _close_progress_bars()  # so the message starts its own line
        logger.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(e.exit_code) from e


def _close_progress_bars() -> None:
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def expected_errors() -> tuple:
    """The errors that mean bad settings or inputs (exit 2 with their message, no traceback): library.errors'
    one base class."""
    return (UserError,)

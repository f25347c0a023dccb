"""LoRA training for FLUX.1 (dev and schnell), kohya-ss/sd-scripts CLI, with regional torch.compile and block swap.

    accelerate launch sd-scripts/flux_train_network.py --pretrained_model_name_or_path flux1-dev.safetensors \
        --clip_l clip_l.safetensors --t5xxl t5xxl_fp16.safetensors --ae ae.safetensors \
        --network_module networks.lora_flux --network_dim 16 --train_data_dir data --output_dir out \
        --mixed_precision bf16 --gradient_checkpointing --fp8_base --blocks_to_swap 8 --compile

or `--config_file cfg.toml` (flags on the command line win). A diffusers FluxPipeline folder works as
--pretrained_model_name_or_path without --clip_l/--t5xxl/--ae.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import (flux_models, flux_train_utils, network_trainer,  # noqa: E402
                     offload_checkpointing, safetensors_io)
from library.compile import environment as compile_environment, options as compile_options, regional  # noqa: E402
from library.network_trainer import NetworkTrainer  # noqa: E402
from library.train_util import ConfigError  # noqa: E402
from library import te_cache  # noqa: E402
from library.latent_cache import FAMILY_FORMATS  # noqa: E402

logger = logging.getLogger(__name__)


class FluxNetworkTrainer(NetworkTrainer):
    """FLUX.1: flow matching on packed latents, T5-XXL + CLIP-L pooled conditioning, embedded guidance (dev),
    LoRA on the transformer (and CLIP-L), fp8 base, block swap, regional compile of the double/single blocks."""

    model_label = "FLUX"
    bucket_reso_steps_multiple = 32
    default_output_name = "last"
    flow_matching = True

    def __init__(self):
        self.compiled_blocks = 0
        self.swapper = None
        self._t5_len = 512
        self.train_t5xxl = False

    # -- checks and models -------------------------------------------------------------------------------
    def family_for(self, args) -> str:
        return "flux"

    def assert_extra_args(self, args) -> None:
        if args.v2 or args.v_parameterization:
            raise ConfigError("--v2 / --v_parameterization are for SD2.x; flux_train_network.py trains FLUX.1")
        if getattr(args, "network_module", None) == "lycoris.kohya":
            raise ConfigError("--network_module lycoris.kohya is not supported for FLUX.1 here (LyCORIS targets the "
                              "BFL block classes, the model here is diffusers'); use networks.lora_flux")
        if getattr(args, "network_module", None) not in (None, "networks.lora_flux", "networks.oft_flux"):
            logger.warning("--network_module %s: FLUX LoRA files in kohya's format come from networks.lora_flux",
                           args.network_module)
        self.train_t5xxl = _network_arg_true(args, "train_t5xxl")
        if getattr(args, "split_mode", False):  # upstream's deprecated form, mapped as upstream maps it
            if args.blocks_to_swap is not None:
                logger.warning("split_mode is deprecated. Because `--blocks_to_swap` is set, `--split_mode` is ignored.")
            else:
                logger.warning("split_mode is deprecated. Please use `--blocks_to_swap` instead. "
                               "`--blocks_to_swap 18` is automatically set.")
                args.blocks_to_swap = 18
        offload_checkpointing.check_args(args, ConfigError)
        flux_train_utils.check_flux_args(args, ConfigError)
        compile_options.validate_compile_args(args)

    def load_target_model(self, args, accelerator, weight_dtype):
        try:
            c = flux_models.load_flux_components(
                args.pretrained_model_name_or_path, args.clip_l, args.t5xxl, args.ae, dtype=weight_dtype,
                te_dtype=weight_dtype, ae_dtype=torch.float32 if args.no_half_vae else weight_dtype,
                fp8_base=self.fp8_targets(args)[0], tokenizer_cache_dir=args.tokenizer_cache_dir)
        except flux_models.FluxModelError as e:
            raise ConfigError(str(e)) from e
        self._t5_len = flux_train_utils.t5_max_length(args, c)
        logger.info("FLUX.1 %s: %d double + %d single blocks, width %d", "schnell" if c.is_schnell else "dev",
                    c.transformer.config.num_layers, c.transformer.config.num_single_layers,
                    c.transformer.inner_dim)
        return c

    def apply_fp8(self, args, components) -> None:
        from library import precision

        # the loader made the transformer fp8; --fp8_base also CLIP-L and T5-XXL
        precision.apply_fp8_to_components(self.fp8_targets(args), None, components.text_encoders)

    def lora_target_text_encoders(self, components) -> list:
        # T5-XXL only with --network_args train_t5xxl=True (in train mode its dropout would change the outputs)
        return [components.clip_l, components.t5xxl] if self.train_t5xxl else [components.clip_l]

    # -- data ------------------------------------------------------------------------------------------------
    def encode_images(self, args, components, images):
        return flux_train_utils.encode_latents(components.ae, images)

    def encode_prompts(self, args, components, captions, with_grad=False) -> dict:
        with torch.set_grad_enabled(with_grad):
            return flux_train_utils.encode_prompts(components.clip_l, components.t5xxl, components.clip_tokenizer,
                                                   components.t5_tokenizer, captions, self._t5_len,
                                                   args.apply_t5_attn_mask)

    def cache_signature(self, args, what: str) -> str:
        return flux_train_utils.cache_signature(args, what)

    def latent_cache_format(self, args, components):
        return FAMILY_FORMATS["flux"]  # the AE output, already shifted and scaled, as upstream stores it

    def te_cache_format(self, args, components):
        return te_cache.flux_format(args.apply_t5_attn_mask)  # upstream's <stem>_flux_te.npz

    # -- training --------------------------------------------------------------------------------------------
    def get_noise_scheduler(self, args, components):
        return None  # sigmas are drawn by flux_train_utils.sample_sigmas

    def get_noise_pred_and_target(self, args, accelerator, noise_scheduler, latents, batch, te_outputs, components,
                                  weight_dtype, fixed_timestep=None):
        return flux_train_utils.noisy_input_pred_target(args, components.transformer, latents, te_outputs,
                                                        weight_dtype, accelerator.autocast, fixed_timestep)

    def huber_threshold(self, args, timesteps, noise_scheduler):
        from library import losses

        return losses.huber_threshold(args, timesteps * 1000, 1000)  # upstream's FLUX timesteps are sigma * 1000

    def post_process_loss(self, loss, args, timesteps, noise_scheduler):
        return loss

    def place_unet(self, args, components, device, weight_dtype) -> None:
        from library.block_swap import BlockSwapError

        try:
            self.swapper = flux_train_utils.place_transformer(components.transformer, device, weight_dtype,
                                                              self.fp8_targets(args)[0], args.blocks_to_swap or 0)
        except BlockSwapError as e:
            raise ConfigError(str(e)) from e

    def prepare_unet_with_accelerator(self, args, accelerator, components) -> None:
        compile_environment.setup_compile_environment(args)
        if args.compile:
            self.compiled_blocks = regional.compile_model_blocks(
                components.transformer, args, model_name=self.model_label,
                gradient_checkpointing=args.gradient_checkpointing, disable_linear=(args.blocks_to_swap or 0) > 0,
                offload_checkpointing=offload_checkpointing.enabled(args))

    # -- outputs ---------------------------------------------------------------------------------------------
    def sample_images(self, args, *, epoch, steps, components, accelerator, prediction_type=None, **kwargs) -> None:
        if not args.sample_prompts or not accelerator.is_main_process:
            return
        models = kwargs.get("models") or ([kwargs["network"]] if kwargs.get("network") is not None else [])
        flux_train_utils.sample_images(args, components, device=accelerator.device, epoch=epoch, steps=steps,
                                       autocast=accelerator.autocast,
                                       networks=[accelerator.unwrap_model(m) for m in models])

    def base_model_version(self, args) -> str:
        return "flux1"

    def modelspec_variant(self) -> str | None:
        components = getattr(self, "components", None)
        return None if components is None else "schnell" if components.is_schnell else "dev"

    def update_metadata(self, metadata: dict, args) -> None:
        metadata.update(compile_options.compile_settings_metadata(args))
        metadata.update({
            "ss_model_type": str(getattr(args, "model_type", "flux")),  # upstream's --model_type (flux/chroma)
            "ss_guidance_scale": str(args.guidance_scale),
            "ss_timestep_sampling": args.timestep_sampling,
            "ss_sigmoid_scale": str(args.sigmoid_scale),
            "ss_discrete_flow_shift": str(args.discrete_flow_shift),
            "ss_model_prediction_type": args.model_prediction_type,
            "ss_weighting_scheme": args.weighting_scheme,
            "ss_logit_mean": str(args.logit_mean),
            "ss_logit_std": str(args.logit_std),
            "ss_mode_scale": str(args.mode_scale),
            "ss_apply_t5_attn_mask": str(bool(args.apply_t5_attn_mask)),
            "ss_t5xxl_max_token_length": str(self._t5_len),
            "ss_fp8_base": str(self.fp8_targets(args)[0]),  # upstream: --fp8_base_unet sets fp8_base for FLUX
            "ss_blocks_to_swap": str(args.blocks_to_swap or 0),
        })
        if self.compiled_blocks:
            metadata["ss_compile_blocks"] = str(self.compiled_blocks)


def _network_arg_true(args, key: str) -> bool:
    value = network_trainer.parse_network_args(getattr(args, "network_args", None)).get(key, "")
    return value.strip().lower() in ("true", "1", "yes")


def setup_parser() -> argparse.ArgumentParser:
    parser = network_trainer.setup_parser()
    flux_train_utils.add_flux_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    parser.add_argument("--split_mode", action="store_true",
                        help="deprecated upstream: same as --blocks_to_swap 18 (ignored when --blocks_to_swap is set)")
    return parser


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(FluxNetworkTrainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

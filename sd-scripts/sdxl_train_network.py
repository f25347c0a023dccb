"""LoRA training for SDXL, kohya-ss/sd-scripts CLI, with regional torch.compile (`--compile ...`).

    accelerate launch sd-scripts/sdxl_train_network.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors \
        --train_data_dir data --output_dir out --output_name mylora --network_module networks.lora \
        --network_dim 32 --network_alpha 16 --resolution 1024,1024 --max_train_steps 1000 --learning_rate 1e-4 \
        --mixed_precision bf16 --gradient_checkpointing --cache_latents --compile --compile_mode reduce-overhead

or `--config_file cfg.toml` (flags on the command line win).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import network_trainer, safetensors_io, te_cache  # noqa: E402
from library.compile import options as compile_options  # noqa: E402
from library.captions import weighted_for  # noqa: E402
from library.network_trainer import NetworkTrainer, encode_clip  # noqa: E402
from library.train_util import ConfigError  # noqa: E402

logger = logging.getLogger(__name__)


class SDXLNetworkTrainer(NetworkTrainer):
    """SDXL: two text encoders (penultimate hidden states, concatenated), TE2's pooled output plus the size
    conditioning (original size, crop top-left, target size) as added_cond_kwargs, regional compile."""

    model_label = "SDXL UNet"
    bucket_reso_steps_multiple = 32

    def family_for(self, args) -> str:
        return "sdxl"

    def assert_extra_args(self, args) -> None:
        if args.v2:
            raise ConfigError("--v2 is for SD2.x models; sdxl_train_network.py trains SDXL (drop --v2)")
        if args.clip_skip:
            logger.warning("--clip_skip is ignored for SDXL (it always uses the penultimate layers)")
        compile_options.validate_compile_args(args)

    def encode_prompts(self, args, components, captions, with_grad=False) -> dict:
        (te1, te2), (tok1, tok2) = components.text_encoders, components.tokenizers
        weighted = weighted_for(args, "sdxl")
        with torch.set_grad_enabled(with_grad):
            h1, _ = encode_clip(tok1, te1, captions, args.max_token_length, -2, False, te1.device, weighted=weighted)
            h2, pooled = encode_clip(tok2, te2, captions, args.max_token_length, -2, False, te2.device,
                                     weighted=weighted)
        return {"encoder_hidden_states": torch.cat([h1, h2.to(h1.dtype)], dim=-1), "pooled": pooled}

    def te_cache_format(self, args, components):
        # upstream's <stem>_te_outputs.npz keeps the two encoders' hidden states apart
        return te_cache.sdxl_format(components.text_encoders[0].config.hidden_size)

    def call_unet(self, args, components, noisy_latents, timesteps, te_outputs, batch, weight_dtype):
        b = noisy_latents.shape[0]
        if batch.get("original_sizes_hw") is not None:
            time_ids = torch.cat([batch["original_sizes_hw"], batch["crop_top_lefts"], batch["target_sizes_hw"]],
                                 dim=1)
        else:  # no size conditioning in the batch: the latent size, uncropped
            h, w = noisy_latents.shape[2] * 8, noisy_latents.shape[3] * 8
            time_ids = torch.tensor([[h, w, 0, 0, h, w]]).repeat(b, 1)
        # integer sizes go in as float32 (diffusers embeds them in float32 and casts the embedding to the UNet's
        # dtype afterwards, as upstream's get_size_embeddings): in bf16, 1023 would already be 1024
        time_ids = time_ids.to(noisy_latents.device, dtype=torch.float32)
        added = {"text_embeds": te_outputs["pooled"].to(weight_dtype), "time_ids": time_ids}
        hidden = te_outputs["encoder_hidden_states"].to(weight_dtype)
        return components.unet(noisy_latents, timesteps, hidden, added_cond_kwargs=added).sample

    def build_pipeline(self, args, components, scheduler):
        from diffusers import StableDiffusionXLPipeline

        (te1, te2), (tok1, tok2) = components.text_encoders, components.tokenizers
        return StableDiffusionXLPipeline(vae=components.vae, text_encoder=te1, text_encoder_2=te2, tokenizer=tok1,
                                         tokenizer_2=tok2, unet=components.unet, scheduler=scheduler)

    def sample_prompt_embeds(self, args, components, prompt: str, negative_prompt: str) -> dict:
        pos = self.encode_prompts(args, components, [prompt])
        neg = self.encode_prompts(args, components, [negative_prompt])
        return {"prompt_embeds": pos["encoder_hidden_states"], "pooled_prompt_embeds": pos["pooled"],
                "negative_prompt_embeds": neg["encoder_hidden_states"], "negative_pooled_prompt_embeds": neg["pooled"]}

    def base_model_version(self, args) -> str:
        return "sdxl_base_v1-0"

    def update_metadata(self, metadata: dict, args) -> None:
        metadata.update(compile_options.compile_settings_metadata(args))
        if self.compiled_blocks:
            metadata["ss_compile_blocks"] = str(self.compiled_blocks)


def setup_parser() -> argparse.ArgumentParser:
    parser = network_trainer.setup_parser()
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(SDXLNetworkTrainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

"""SDXL: two CLIP text encoders (penultimate hidden states, concatenated), TE2's pooled output plus the size
conditioning (original size, crop top-left, target size) as added_cond_kwargs, regional compile (--compile)."""
from __future__ import annotations

import logging

import torch

from library import latent_cache, precision, te_cache
from library.captions import weighted_for
from library.errors import ConfigError
from library.families import sd
from library.objectives.ddpm import DDPM

logger = logging.getLogger(__name__)


class SDXL:
    label = "SDXL UNet"
    bucket_reso_steps_multiple = 32

    def __init__(self):
        self.objective = DDPM()
        self.compiled_blocks = 0

    def name(self, args) -> str:
        return "sdxl"

    def check_args(self, args) -> None:
        from library.compile import options as compile_options

        if args.v2:
            raise ConfigError("--v2 is for SD2.x models; sdxl_train_network.py trains SDXL (drop --v2)")
        if args.clip_skip:
            logger.warning("--clip_skip is ignored for SDXL (it always uses the penultimate layers)")
        compile_options.validate_compile_args(args)

    def load(self, args, weight_dtype, fp8_denoiser: bool):
        return sd.load_components(args, "sdxl")

    def lora_text_encoders(self, components) -> list:
        return list(components.text_encoders)

    def encode_images(self, args, components, images: torch.Tensor, generator) -> torch.Tensor:
        return sd.encode_vae(components.autoencoder, images, generator)

    def encode_prompts(self, args, components, captions, with_grad=False, *, pad_to_longest=None) -> dict:
        (te1, te2), (tok1, tok2) = components.text_encoders, components.tokenizers
        weighted = weighted_for(args, "sdxl")
        with torch.set_grad_enabled(with_grad):
            h1, _ = sd.encode_clip(tok1, te1, captions, args.max_token_length, -2, False, te1.device,
                                   weighted=weighted)
            h2, pooled = sd.encode_clip(tok2, te2, captions, args.max_token_length, -2, False, te2.device,
                                        weighted=weighted)
        return {"encoder_hidden_states": torch.cat([h1, h2.to(h1.dtype)], dim=-1), "pooled": pooled}

    def prediction_type(self, args, components) -> str:
        return sd.prediction_type(args, components)

    def predict(self, args, components, noisy_latents, timesteps, te_outputs, batch, weight_dtype):
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
        return components.denoiser(noisy_latents, timesteps, hidden, added_cond_kwargs=added).sample

    def enable_gradient_checkpointing(self, args, components, text_encoders: list) -> None:
        sd.enable_gradient_checkpointing(args, components.denoiser, text_encoders)

    def place_denoiser(self, args, components, device, weight_dtype, fp8: bool) -> None:
        precision.to_device_dtype(components.denoiser, device, weight_dtype)

    def apply_fp8(self, args, components, fp8_targets) -> None:
        precision.apply_fp8_to_components(fp8_targets, components.denoiser, components.text_encoders)

    def set_attention_backend(self, args, components) -> None:
        sd.set_attention_backend(args, components)

    def compile(self, args, components) -> None:
        self.compiled_blocks = sd.compile_denoiser(args, components.denoiser, self.label)

    def sample(self, args, components, accelerator, *, epoch, steps, networks, prediction_type) -> None:
        sd.sample_with_pipeline(self, args, components, accelerator, epoch=epoch, steps=steps, networks=networks,
                                prediction_type=prediction_type)

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

    def metadata(self, args, fp8_targets) -> dict[str, str]:
        from library.compile import options as compile_options

        md = dict(compile_options.compile_settings_metadata(args))
        if self.compiled_blocks:
            md["ss_compile_blocks"] = str(self.compiled_blocks)
        return md

    def modelspec_variant(self) -> str | None:
        return None

    def latent_cache_format(self, args, components) -> latent_cache.LatentCacheFormat:
        return sd.sd_latent_cache_format("sdxl", components)

    def te_cache_format(self, args, components) -> te_cache.TeCacheFormat:
        # upstream's <stem>_te_outputs.npz keeps the two encoders' hidden states apart
        return te_cache.sdxl_format(components.text_encoders[0].config.hidden_size)

    def cache_signature(self, args, what: str) -> str:
        return sd.sd_cache_signature(args, "sdxl", what)

    def full_output_format(self, args) -> tuple[str, str]:
        return sd.sd_full_output_format(args)

    def save_full_model(self, args, components, path: str, metadata: dict | None, save_dtype) -> None:
        sd.save_sd_full_model(args, components, path, metadata, save_dtype)


# ----------------------------------------------------------------------------------------------------------
# sdxl_train.py --block_lr (the SDXL UNet's SGM blocks)

# upstream's --block_lr: one rate per SGM block of the UNet
UNET_NUM_BLOCKS_FOR_BLOCK_LR = 23


def parse_block_lr(text: str) -> list[float]:
    try:
        lrs = [float(v) for v in text.split(",")]
    except ValueError:
        lrs = []
    if len(lrs) != UNET_NUM_BLOCKS_FOR_BLOCK_LR or any(lr < 0 for lr in lrs):
        raise ConfigError(f"--block_lr needs {UNET_NUM_BLOCKS_FOR_BLOCK_LR} comma-separated learning rates of 0 or "
                          f"more (time/label embeddings, input_blocks 0-8, middle_block 0-2, output_blocks 0-8, "
                          f"out), got {text!r}")
    return lrs


def block_index(sgm_name: str) -> int:
    """Upstream's block of an SGM UNet parameter: 0 embeddings, 1-9 input_blocks, 10-12 middle_block,
    13-21 output_blocks, 22 out."""
    head, _, rest = sgm_name.partition(".")
    if head in ("time_embed", "label_emb"):
        return 0
    offsets = {"input_blocks": 1, "middle_block": 10, "output_blocks": 13}
    if head in offsets:
        return offsets[head] + int(rest.split(".")[0])
    if head == "out":
        return 22
    raise ValueError(f"unexpected SDXL UNet parameter {sgm_name}")


def block_lr_param_groups(unet, lrs: list[float]) -> tuple[list[dict], list[str]]:
    """One param group per block with a rate above 0, in block order, and their names (block<i>, upstream's log
    names); the blocks at 0 are frozen.
    (Upstream leaves them trainable but outside the optimizer: their gradients are computed, never applied
    nor cleared, and count in the clipping norm; freezing them trains the same blocks without that.)"""
    from library.model_util import unet_sgm_module_names

    sgm_modules = unet_sgm_module_names(unet)
    blocks: list[list] = [[] for _ in lrs]
    for name, param in unet.named_parameters():
        module, _, leaf = name.rpartition(".")
        blocks[block_index(f"{sgm_modules[module]}.{leaf}")].append(param)
    groups, names = [], []
    for i, (lr, params) in enumerate(zip(lrs, blocks)):
        if lr == 0:
            for p in params:
                p.requires_grad_(False)
        elif params:
            groups.append({"params": params, "lr": lr})
            names.append(f"block{i}")
    logger.info("--block_lr: %d UNet blocks trained, %d frozen", len(groups), lrs.count(0))
    return groups, names


def text_encoder_lrs(args) -> list[float | None]:
    """sdxl_train.py: --learning_rate_te1 / --learning_rate_te2 (default --learning_rate; 0 = frozen)."""
    def rate(value):
        return args.learning_rate if value is None else value

    return [rate(args.learning_rate_te1), rate(args.learning_rate_te2)]


def check_block_lr(args, target) -> None:
    if args.block_lr:
        parse_block_lr(args.block_lr)


def apply_block_lr(args, components, trainable, fused_groups: bool) -> None:
    """--block_lr: the UNet's group (the first) becomes one group per block; upstream's lr log names."""
    if not args.block_lr:
        return
    groups, names = block_lr_param_groups(components.denoiser, parse_block_lr(args.block_lr))
    trainable.param_groups[0:1] = groups
    if not fused_groups:  # upstream's lr log names: lr/block<i>, lr/text_encoder<n>
        trained_tes = [f"text_encoder{i + 1}" for i, te in enumerate(components.text_encoders)
                       if any(p.requires_grad for p in te.parameters())]
        trainable.lr_descriptions = names + trained_tes

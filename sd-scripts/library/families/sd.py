"""Stable Diffusion 1.x / 2.x (`--v2`, `--v_parameterization`): a CLIP text encoder (clip skip, long prompts in
75-token chunks), the UNet, DDPM noise prediction. The module functions are shared with library.families.sdxl."""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from library import latent_cache, precision, te_cache
from library.captions import apply_token_weights, weighted_for, weighted_token_ids
from library.objectives.ddpm import DDPM

logger = logging.getLogger(__name__)


class SD:
    label = "UNet"  # the denoiser's name in log lines
    bucket_reso_steps_multiple = 64  # upstream's verify_bucket_reso_steps for SD

    def __init__(self):
        self.objective = DDPM()
        self.compiled_blocks = 0

    def name(self, args) -> str:
        return "sd2" if args.v2 else "sd1"

    def check_args(self, args) -> None:
        if args.v_parameterization and not args.v2:
            logger.warning("--v_parameterization without --v2: training an SD1.x model with v-prediction")

    def load(self, args, weight_dtype, fp8_denoiser: bool):
        comps = load_components(args, self.name(args))
        layers = min(te.config.num_hidden_layers for te in comps.text_encoders)
        if args.clip_skip is not None and args.clip_skip > layers:
            from library.errors import ConfigError

            raise ConfigError(f"--clip_skip {args.clip_skip}: the text encoder has only {layers} layers "
                              "(1 = the last layer, 2 = the one before, ...)")
        return comps

    def lora_text_encoders(self, components) -> list:
        return list(components.text_encoders)

    def encode_images(self, args, components, images: torch.Tensor, generator) -> torch.Tensor:
        return encode_vae(components.autoencoder, images, generator)

    def encode_prompts(self, args, components, captions: list[str], with_grad: bool = False, *,
                       pad_to_longest: bool | None = None) -> dict:
        te, tok = components.text_encoders[0], components.tokenizers[0]
        layer = -args.clip_skip if args.clip_skip and args.clip_skip > 1 else None
        if pad_to_longest is None:
            pad_to_longest = bool(getattr(args, "no_token_padding", False))
        with torch.set_grad_enabled(with_grad):
            hidden, _ = encode_clip(tok, te, captions, args.max_token_length, layer, True, te.device,
                                    weighted=weighted_for(args, self.name(args)), pad_to_longest=pad_to_longest)
        return {"encoder_hidden_states": hidden}

    def prediction_type(self, args, components) -> str:
        return prediction_type(args, components)

    def predict(self, args, components, noisy_latents, timesteps, te_outputs, batch, weight_dtype):
        hidden = te_outputs["encoder_hidden_states"].to(weight_dtype)
        return components.denoiser(noisy_latents, timesteps, hidden).sample

    def enable_gradient_checkpointing(self, args, components, text_encoders: list) -> None:
        enable_gradient_checkpointing(args, components.denoiser, text_encoders)

    def place_denoiser(self, args, components, device, weight_dtype, fp8: bool) -> None:
        precision.to_device_dtype(components.denoiser, device, weight_dtype)

    def apply_fp8(self, args, components, fp8_targets) -> None:
        precision.apply_fp8_to_components(fp8_targets, components.denoiser, components.text_encoders)

    def set_attention_backend(self, args, components) -> None:
        set_attention_backend(args, components)

    def compile(self, args, components) -> None:
        """After accelerator.prepare: regional compilation of the UNet's repeated blocks (upstream's
        --torch_compile here; sdxl adds --compile)."""
        self.compiled_blocks = compile_denoiser(args, components.denoiser, self.label)

    def sample(self, args, components, accelerator, *, epoch, steps, networks, prediction_type) -> None:
        sample_with_pipeline(self, args, components, accelerator, epoch=epoch, steps=steps, networks=networks,
                             prediction_type=prediction_type)

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

    def metadata(self, args, fp8_targets) -> dict[str, str]:
        return {"ss_v2": str(bool(args.v2))}

    def modelspec_variant(self) -> str | None:
        return None

    def latent_cache_format(self, args, components) -> latent_cache.LatentCacheFormat:
        return sd_latent_cache_format(self.name(args), components)

    def te_cache_format(self, args, components) -> te_cache.TeCacheFormat:
        return te_cache.TeCacheFormat()  # upstream caches none for SD1.x/2.x: our own layout here

    def cache_signature(self, args, what: str) -> str:
        return sd_cache_signature(args, self.name(args), what)

    def full_output_format(self, args) -> tuple[str, str]:
        return sd_full_output_format(args)

    def save_full_model(self, args, components, path: str, metadata: dict | None, save_dtype) -> None:
        save_sd_full_model(args, components, path, metadata, save_dtype)


# ----------------------------------------------------------------------------------------------------------
# shared by the SD-like families (sd, sdxl)


def load_components(args, family: str):
    from library.model_util import load_sd_components

    return load_sd_components(args.pretrained_model_name_or_path, family, vae=args.vae,
                              tokenizer_cache_dir=args.tokenizer_cache_dir, dtype=torch.float32,
                              v_parameterization=args.v_parameterization)


def prediction_type(args, components) -> str:
    if args.v_parameterization:
        return "v_prediction"
    return getattr(components, "prediction_type", None) or "epsilon"


def encode_vae(vae, images: torch.Tensor, generator) -> torch.Tensor:
    with torch.no_grad():
        latents = vae.encode(images.to(vae.device, vae.dtype)).latent_dist.sample(generator=generator)
    return latents * vae.config.scaling_factor


def enable_gradient_checkpointing(args, denoiser, text_encoders: list) -> None:
    """The denoiser's (CPU-offloaded with --cpu_offload_checkpointing) and the trained text encoders'."""
    from library import offload_checkpointing

    if offload_checkpointing.enabled(args):
        offload_checkpointing.enable(denoiser)
    else:
        denoiser.enable_gradient_checkpointing()
    for te in text_encoders:
        if hasattr(te, "activation_checkpointing_enable"):  # transformers >= 5.x name
            te.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            te.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def set_attention_backend(args, components) -> None:
    """PyTorch SDPA is diffusers' default; --xformers switches the denoiser to xformers when it is installed,
    --diffusers_xformers (fine_tune.py, sdxl_train.py) the denoiser and the autoencoder."""
    denoiser = components.denoiser
    targets = {"--xformers": [denoiser] if args.xformers else []}
    if getattr(args, "diffusers_xformers", False):
        targets["--diffusers_xformers"] = [denoiser, components.autoencoder]
    for flag, models in targets.items():
        for model in [m for m in models if m is not None]:
            try:
                model.enable_xformers_memory_efficient_attention()
                logger.info("xformers attention enabled in the %s (%s)", type(model).__name__, flag)
            except Exception as e:  # noqa: BLE001 - not installed / no CUDA: SDPA still works
                logger.warning("%s: cannot use xformers (%s); using PyTorch scaled-dot-product attention", flag, e)
                return


def compile_denoiser(args, denoiser, label: str) -> int:
    """Regional compilation of the denoiser's repeated blocks with --compile / --torch_compile; the number of
    compiled blocks (0 = not compiled)."""
    from library import offload_checkpointing
    from library.compile import environment as compile_environment, options as compile_options, regional

    cargs = compile_options.compile_args(args)
    if cargs is None:
        return 0
    compile_environment.setup_compile_environment(cargs)
    if not cargs.compile:
        return 0
    # regional compilation moves diffusers' checkpointing of these blocks inside the compiled region
    return regional.compile_model_blocks(denoiser, cargs, model_name=label,
                                              gradient_checkpointing=args.gradient_checkpointing,
                                              offload_checkpointing=offload_checkpointing.enabled(args))


def sample_with_pipeline(family, args, components, accelerator, *, epoch, steps, networks, prediction_type) -> None:
    """Sample images through the family's diffusers pipeline over the live models (library.sampling)."""
    from library import sampling

    vae_device = components.autoencoder.device
    components.autoencoder.to(accelerator.device)
    tes_devices = [te.device for te in components.text_encoders]
    for te in components.text_encoders:
        te.to(accelerator.device)
    try:
        sampling.sample_images(args, build_pipeline=lambda sched: family.build_pipeline(args, components, sched),
                               device=accelerator.device, epoch=epoch, steps=steps, prediction_type=prediction_type,
                               autocast=accelerator.autocast, networks=networks,
                               encode_prompt=lambda pos, neg: family.sample_prompt_embeds(args, components, pos, neg))
    finally:
        components.autoencoder.to(vae_device)
        for te, d in zip(components.text_encoders, tes_devices):
            te.to(d)


def sd_latent_cache_format(family: str, components) -> latent_cache.LatentCacheFormat:
    """Upstream's latent cache file names and keys; SD/SDXL files hold the unscaled sample."""
    fmt = latent_cache.FAMILY_FORMATS[family]
    return dataclasses.replace(fmt, scale=float(components.autoencoder.config.scaling_factor))


def sd_cache_signature(args, family: str, what: str) -> str:
    weighted = ":weighted" if what == "te" and weighted_for(args, family) else ""
    return f"{family}:{os.path.basename(str(args.pretrained_model_name_or_path))}:" \
           f"{os.path.basename(str(args.vae or ''))}:{what}:{args.max_token_length}:{args.clip_skip}{weighted}"


def sd_full_output_format(args) -> tuple[str, str]:
    """("single", ".safetensors" | ".ckpt") or ("diffusers", ""): --save_model_as, unset = as the input model."""
    from library import saving

    return saving.full_model_format(args.save_model_as, getattr(args, "use_safetensors", False),
                                    args.pretrained_model_name_or_path)


def save_sd_full_model(args, components, path: str, metadata: dict | None, save_dtype) -> None:
    """A full SD/SDXL model: SGM/LDM single file or a diffusers folder (library.model_util)."""
    from library import model_util

    if sd_full_output_format(args)[0] == "diffusers":
        model_util.save_sd_diffusers(path, components, save_dtype=save_dtype, overwrite=args.overwrite_output)
    else:
        model_util.save_sd_checkpoint(path, components, save_dtype=save_dtype, metadata=metadata,
                                      overwrite=args.overwrite_output)


# ----------------------------------------------------------------------------------------------------------
# CLIP text encoding (SD1.x / SD2.x / SDXL)


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

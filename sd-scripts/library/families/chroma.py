"""Chroma (`--model_type chroma` on the FLUX.1 scripts, as upstream): FLUX.1's flow matching and latents, T5-XXL
only (no CLIP-L), the T5 attention mask required (each caption attends to its tokens plus one padding token, as
upstream's Chroma), the guidance scale fed to the distilled-guidance approximator (upstream: use 0.0). The
transformer is diffusers' ChromaTransformer2DModel (library.chroma_models); FLUX.1's pieces are reused as plain
functions of library.families.flux / flux_train_utils.

Speed: as upstream, the text is cut after the batch's longest caption + its padding token (trim_text), so a batch
of one needs no mask and attention runs on the flash kernel; the compiled blocks follow the caption length with
torch's automatic dynamic (Chroma.compile)."""
from __future__ import annotations

import contextlib
import logging

import torch

from library import chroma_models, flux_train_utils, latent_cache, te_cache
from library.families import flux
from library.objectives.flow_matching import FlowMatching

logger = logging.getLogger(__name__)


class Chroma:
    label = "Chroma"

    def __init__(self, bucket_reso_steps_multiple: int = 32):
        self.objective = FlowMatching()
        self.bucket_reso_steps_multiple = bucket_reso_steps_multiple
        self.compiled_blocks = 0
        self.swapper = None
        self.t5_len = 512
        self.train_t5xxl = False

    def name(self, args) -> str:
        return "flux"  # a FLUX.1 model type: the same LoRA module, scripts and metadata keys

    def check_args(self, args) -> None:
        from library.train_util import ConfigError

        if not args.apply_t5_attn_mask:  # upstream asserts the same
            raise ConfigError("--model_type chroma needs --apply_t5_attn_mask (Chroma is trained with the T5 "
                              "attention mask)")
        if args.clip_l:
            logger.warning("--clip_l is ignored: Chroma does not use CLIP-L")
        flux.check_args(args)
        self.train_t5xxl = flux.network_arg_true(args, "train_t5xxl")

    def load(self, args, weight_dtype, fp8_denoiser: bool):
        from library.flux_models import FluxModelError
        from library.train_util import ConfigError

        try:
            c = chroma_models.load_chroma_components(
                args.pretrained_model_name_or_path, args.t5xxl, args.ae, dtype=weight_dtype, te_dtype=weight_dtype,
                ae_dtype=torch.float32 if args.no_half_vae else weight_dtype, fp8_base=fp8_denoiser,
                tokenizer_cache_dir=args.tokenizer_cache_dir)
        except FluxModelError as e:
            raise ConfigError(str(e)) from e
        self.t5_len = args.t5xxl_max_token_length or 512  # upstream: Chroma is not schnell
        cfg = c.transformer.config
        logger.info("Chroma: %d double + %d single blocks, width %d", cfg.num_layers, cfg.num_single_layers,
                    c.transformer.inner_dim)
        return c

    def lora_text_encoders(self, components) -> list:
        return [components.t5xxl] if self.train_t5xxl else []  # no CLIP-L: nothing else to train

    def encode_images(self, args, components, images, generator):
        return flux_train_utils.encode_latents(components.ae, images, generator)

    def encode_prompts(self, args, components, captions, with_grad=False, **_) -> dict:
        """{"t5_out", "t5_attn_mask", "pooled": zeros [B, 1]} (upstream's Chroma cache keeps a dummy l_pooled);
        T5's outputs are not zeroed at padding: Chroma attends to one padding token."""
        t5, tok = components.t5xxl, components.t5_tokenizer
        with torch.set_grad_enabled(with_grad):
            t = tok(captions, padding="max_length", max_length=self.t5_len, truncation=True, return_tensors="pt")
            mask = t.attention_mask.to(t5.device)
            out = t5(t.input_ids.to(t5.device), attention_mask=mask).last_hidden_state
        return {"t5_out": out, "t5_attn_mask": mask, "pooled": torch.zeros(len(captions), 1, dtype=out.dtype)}

    def prediction_type(self, args, components) -> str:
        return "epsilon"

    def predict(self, args, components, noisy_latents, timesteps, te_outputs, batch, weight_dtype):
        return chroma_forward(components.transformer, noisy_latents, timesteps, te_outputs, args.guidance_scale,
                              weight_dtype)

    def enable_gradient_checkpointing(self, args, components, text_encoders: list) -> None:
        flux.enable_gradient_checkpointing(args, components, text_encoders)

    def place_denoiser(self, args, components, device, weight_dtype, fp8: bool) -> None:
        self.swapper = flux.place_denoiser(args, components, device, weight_dtype, fp8)

    def apply_fp8(self, args, components, fp8_targets) -> None:
        flux.apply_fp8(components, fp8_targets)

    def set_attention_backend(self, args, components) -> None:
        flux.set_attention_backend(args, components)

    def compile(self, args, components) -> None:
        # the text length follows each batch's longest caption (trim_text)
        self.compiled_blocks = flux.compile_denoiser(args, components, self.label, text_length_varies=True)

    def sample(self, args, components, accelerator, *, epoch, steps, networks, prediction_type) -> None:
        sample_images(args, components, self.t5_len, device=accelerator.device, epoch=epoch, steps=steps,
                      autocast=accelerator.autocast, networks=networks)

    def base_model_version(self, args) -> str:
        return "chroma"  # upstream's MODEL_VERSION_CHROMA

    def metadata(self, args, fp8_targets) -> dict[str, str]:
        return flux.metadata(args, fp8_targets, self.t5_len, self.compiled_blocks)  # ss_model_type = chroma from --model_type

    def modelspec_variant(self) -> str | None:
        return "chroma"  # modelspec.architecture "chroma", implementation lodestones/Chroma (as upstream)

    def latent_cache_format(self, args, components) -> latent_cache.LatentCacheFormat:
        return latent_cache.FAMILY_FORMATS["flux"]

    def te_cache_format(self, args, components) -> te_cache.TeCacheFormat:
        return te_cache.flux_format(args.apply_t5_attn_mask)

    def cache_signature(self, args, what: str) -> str:
        return "chroma:" + flux_train_utils.cache_signature(args, what)

    def full_output_format(self, args) -> tuple[str, str]:
        return "single", ".safetensors"

    def save_full_model(self, args, components, path: str, metadata, save_dtype) -> None:
        from library import saving
        from library.compile.regional import strip_orig_mod

        if self.swapper is not None:
            self.swapper.synchronize()
        sd = strip_orig_mod(components.transformer.state_dict())
        saving.save_safetensors_streaming(path, chroma_models.save_single_file_entries(sd, save_dtype), metadata,
                                          overwrite=args.overwrite_output)


def text_lengths(t5_mask: torch.Tensor) -> torch.Tensor:
    """[B] how many text tokens each sample attends to: its caption's tokens plus one padding token (upstream's
    attn_padding=1), at most the padded length."""
    return torch.clamp(t5_mask.sum(dim=1).long() + 1, max=t5_mask.shape[1])


def trim_text(t5_out: torch.Tensor, t5_mask: torch.Tensor, image_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The text tokens some sample of the batch attends to, and the attention mask the rest still needs.

    As upstream's Chroma, the text is cut after the batch's longest caption (+ its padding token): the tokens past
    it are masked keys for every image and text token, so leaving them out changes no output the loss sees (the
    model returns the image tokens only). Where every sample sees the same length (always with batch 1) no mask
    is left, so attention runs on the flash kernel; else [B, L_txt + L_img] bool over the cut sequence."""
    seen = text_lengths(t5_mask)
    shortest, longest = torch.stack([seen.min(), seen.max()]).tolist()  # one read from the device
    t5_out = t5_out[:, :longest]
    if shortest == longest:
        return t5_out, None
    txt = torch.arange(longest, device=seen.device)[None, :] < seen[:, None]
    mask = torch.cat([txt, torch.ones(len(seen), image_tokens, dtype=torch.bool, device=seen.device)], dim=1)
    return t5_out, mask


@contextlib.contextmanager
def single_blocks_masked(transformer, mask: torch.Tensor | None):
    """diffusers' Chroma passes no attention mask to its single blocks under its own gradient checkpointing (the
    checkpointed call gives them three arguments); while the context is open, its checkpoint function hands them
    the mask as their fourth (the checkpoint keeps it for the recompute). Only a batch whose captions differ in
    length has a mask (trim_text)."""
    from diffusers.models.transformers.transformer_chroma import ChromaSingleTransformerBlock

    func = getattr(transformer, "_gradient_checkpointing_func", None)
    if mask is None or func is None or not getattr(transformer, "gradient_checkpointing", False):
        yield
        return

    def with_mask(block, *args):
        if isinstance(block, ChromaSingleTransformerBlock) and len(args) == 3:
            args = (*args, mask)
        return func(block, *args)

    transformer._gradient_checkpointing_func = with_mask
    try:
        yield
    finally:
        transformer._gradient_checkpointing_func = func


@contextlib.contextmanager
def embedded_guidance(transformer, guidance: float | None):
    """diffusers' Chroma always feeds guidance 0 to the approximator; upstream feeds --guidance_scale / --g. A
    non-zero value replaces that part of the approximator's input while the context is open."""
    if not guidance:
        yield
        return
    embed = transformer.time_text_embed
    n = embed.time_proj.num_channels

    def hook(module, inputs, output):
        (timestep,) = inputs
        g = torch.full((timestep.shape[0],), float(guidance) * 1000, device=timestep.device)
        out = output.clone()
        out[..., n:2 * n] = module.guidance_proj(g).to(out.dtype)[:, None, :]
        return out

    handle = embed.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def chroma_forward(transformer, noisy: torch.Tensor, sigmas: torch.Tensor, te: dict, guidance: float | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """The transformer on unpacked latents [B, 16, h, w]; returns the prediction in the same layout."""
    b, _, h, w = noisy.shape
    t5_out, mask = trim_text(te["t5_out"], te["t5_attn_mask"], (h // 2) * (w // 2))
    t5_out = t5_out.to(noisy.device, dtype)
    mask = None if mask is None else mask.to(noisy.device)
    with embedded_guidance(transformer, guidance), single_blocks_masked(transformer, mask):
        out = transformer(hidden_states=flux_train_utils.pack_latents(noisy).to(dtype), encoder_hidden_states=t5_out,
                          timestep=sigmas.to(dtype), img_ids=flux_train_utils.image_ids(h, w, noisy.device, dtype),
                          txt_ids=torch.zeros(t5_out.shape[1], 3, device=noisy.device, dtype=dtype),
                          attention_mask=mask, return_dict=False)[0]
    return flux_train_utils.unpack_latents(out, h, w)


def sample_images(args, components, t5_len: int, *, device, epoch, steps, autocast=None, networks=()) -> list[str]:
    """Chroma samples with diffusers' ChromaPipeline over the live models: kohya prompt lines; --l is the CFG scale
    with --n (upstream's Chroma samples need a negative prompt), --g the embedded guidance (upstream: 0)."""
    from diffusers import ChromaPipeline

    from library.flux_tiny import flow_match_scheduler

    def make_pipeline():
        return ChromaPipeline(scheduler=flow_match_scheduler(), vae=components.ae, text_encoder=components.t5xxl,
                              tokenizer=components.t5_tokenizer, transformer=components.transformer)

    def draw(pipe, p, generator):
        with embedded_guidance(components.transformer, p.get("guidance_scale", 3.5)):
            return pipe(prompt=p["prompt"], negative_prompt=p.get("negative_prompt") or None,
                        guidance_scale=p.get("scale", 1.0), width=p.get("width", 512), height=p.get("height", 512),
                        num_inference_steps=p.get("sample_steps", 20), generator=generator,
                        max_sequence_length=t5_len).images[0]

    return flux_train_utils.sample_with_pipeline(args, make_pipeline, (components.ae, components.t5xxl), draw,
                                                 device=device, epoch=epoch, steps=steps, autocast=autocast,
                                                 networks=networks)


def family_for(args, bucket_reso_steps_multiple: int = 32):
    """The FLUX.1 scripts' family from upstream's --model_type (flux or chroma)."""
    if getattr(args, "model_type", "flux") == "chroma":
        return Chroma(bucket_reso_steps_multiple)
    return flux.Flux(bucket_reso_steps_multiple)

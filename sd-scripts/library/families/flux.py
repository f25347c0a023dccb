"""FLUX.1 (dev and schnell): flow matching on packed latents, T5-XXL + CLIP-L pooled conditioning, embedded
guidance (dev), fp8 base, block swap, regional compile of the double/single blocks, BFL-layout saves."""
from __future__ import annotations

import logging

import torch

from library import flux_models, flux_train_utils, latent_cache, offload_checkpointing, te_cache
from library.objectives import flow_matching
from library.objectives.flow_matching import FlowMatching

logger = logging.getLogger(__name__)


class Flux:
    label = "FLUX"

    def __init__(self, bucket_reso_steps_multiple: int = 32):
        self.objective = FlowMatching()
        self.bucket_reso_steps_multiple = bucket_reso_steps_multiple  # upstream: 32 for LoRA, 16 for flux_train
        self.compiled_blocks = 0
        self.swapper = None  # library.block_swap.BlockSwapper with --blocks_to_swap
        self.t5_len = 512
        self.train_t5xxl = False
        self.is_schnell = None

    def name(self, args) -> str:
        return "flux"

    def check_args(self, args) -> None:
        check_args(args)
        self.train_t5xxl = network_arg_true(args, "train_t5xxl")

    def load(self, args, weight_dtype, fp8_denoiser: bool):
        from library.errors import ConfigError

        try:
            c = flux_models.load_flux_components(
                args.pretrained_model_name_or_path, args.clip_l, args.t5xxl, args.ae, dtype=weight_dtype,
                te_dtype=weight_dtype, ae_dtype=torch.float32 if args.no_half_vae else weight_dtype,
                fp8_base=fp8_denoiser, tokenizer_cache_dir=args.tokenizer_cache_dir)
        except flux_models.FluxModelError as e:
            raise ConfigError(str(e)) from e
        self.t5_len = flux_train_utils.t5_max_length(args, c)
        self.is_schnell = c.is_schnell
        logger.info("FLUX.1 %s: %d double + %d single blocks, width %d", "schnell" if c.is_schnell else "dev",
                    c.transformer.config.num_layers, c.transformer.config.num_single_layers,
                    c.transformer.inner_dim)
        return c

    def lora_text_encoders(self, components) -> list:
        # T5-XXL only with --network_args train_t5xxl=True (in train mode its dropout would change the outputs)
        return [components.clip_l, components.t5xxl] if self.train_t5xxl else [components.clip_l]

    def encode_images(self, args, components, images, generator):
        return flux_train_utils.encode_latents(components.ae, images, generator)

    def encode_prompts(self, args, components, captions, with_grad=False, **_) -> dict:
        with torch.set_grad_enabled(with_grad):
            return flux_train_utils.encode_prompts(components.clip_l, components.t5xxl, components.clip_tokenizer,
                                                   components.t5_tokenizer, captions, self.t5_len,
                                                   args.apply_t5_attn_mask)

    def prediction_type(self, args, components) -> str:
        return "epsilon"  # not a DDPM prediction: flow matching (the modelspec keys say so from the family)

    def predict(self, args, components, noisy_latents, timesteps, te_outputs, batch, weight_dtype):
        return flux_train_utils.flux_forward(components.transformer, noisy_latents, timesteps, te_outputs,
                                             args.guidance_scale, weight_dtype, args.apply_t5_attn_mask)

    def enable_gradient_checkpointing(self, args, components, text_encoders: list) -> None:
        enable_gradient_checkpointing(args, components, text_encoders)

    def place_denoiser(self, args, components, device, weight_dtype, fp8: bool) -> None:
        self.swapper = place_denoiser(args, components, device, weight_dtype, fp8)

    def apply_fp8(self, args, components, fp8_targets) -> None:
        apply_fp8(components, fp8_targets)

    def set_attention_backend(self, args, components) -> None:
        set_attention_backend(args, components)

    def compile(self, args, components) -> None:
        self.compiled_blocks = compile_denoiser(args, components, self.label)

    def sample(self, args, components, accelerator, *, epoch, steps, networks, prediction_type) -> None:
        flux_train_utils.sample_images(args, components, device=accelerator.device, epoch=epoch, steps=steps,
                                       autocast=accelerator.autocast, networks=networks)

    def base_model_version(self, args) -> str:
        return "flux1"

    def metadata(self, args, fp8_targets) -> dict[str, str]:
        return metadata(args, fp8_targets, self.t5_len, self.compiled_blocks)


    def modelspec_variant(self) -> str | None:
        return None if self.is_schnell is None else "schnell" if self.is_schnell else "dev"

    def latent_cache_format(self, args, components) -> latent_cache.LatentCacheFormat:
        return latent_cache.FAMILY_FORMATS["flux"]  # the AE output, already shifted and scaled, as upstream

    def te_cache_format(self, args, components) -> te_cache.TeCacheFormat:
        return te_cache.flux_format(args.apply_t5_attn_mask)  # upstream's <stem>_flux_te.npz

    def cache_signature(self, args, what: str) -> str:
        return flux_train_utils.cache_signature(args, what)

    def full_output_format(self, args) -> tuple[str, str]:
        return "single", ".safetensors"  # a BFL single file, whatever --save_model_as says (as upstream)

    def save_full_model(self, args, components, path: str, metadata, save_dtype) -> None:
        flux_train_utils.save_transformer(args, components, path, metadata, save_dtype, self.swapper)


# FLUX.1's pieces as functions: Flux calls them, and so does Chroma (library.families.chroma), which shares them


def check_args(args) -> None:
    from library.compile import options as compile_options
    from library.errors import ConfigError

    if args.v2 or args.v_parameterization:
        raise ConfigError("--v2 / --v_parameterization are for SD2.x; flux_train_network.py trains FLUX.1")
    if getattr(args, "network_module", None) == "lycoris.kohya":  # the LyCORIS algos that run on FLUX.1 here
        from library.network_options import parse_network_args
        from networks import lycoris_kohya

        lycoris_kohya.check_flux_algo(parse_network_args(args.network_args), ConfigError)
    elif getattr(args, "network_module", None) not in (None, "networks.lora_flux", "networks.oft_flux"):
        logger.warning("--network_module %s: FLUX LoRA files in kohya's format come from networks.lora_flux",
                       args.network_module)
    offload_checkpointing.check_args(args, ConfigError)
    flux_train_utils.check_flux_args(args, ConfigError)
    compile_options.validate_compile_args(args)


def enable_gradient_checkpointing(args, components, text_encoders: list) -> None:
    from library.families import sd

    sd.enable_gradient_checkpointing(args, components.denoiser, text_encoders)


def place_denoiser(args, components, device, weight_dtype, fp8: bool):
    """Keeps fp8 weights; places only the blocks that --blocks_to_swap leaves on the GPU. Returns the block
    swapper (None without --blocks_to_swap)."""
    from library.block_swap import BlockSwapError
    from library.errors import ConfigError

    try:
        return flux_train_utils.place_transformer(components.transformer, device, weight_dtype, fp8,
                                                  args.blocks_to_swap or 0)
    except BlockSwapError as e:
        raise ConfigError(str(e)) from e


def apply_fp8(components, fp8_targets) -> None:
    from library import precision

    # the loader made the transformer fp8; --fp8_base also the text encoders
    precision.apply_fp8_to_components(fp8_targets, None, components.text_encoders)


def set_attention_backend(args, components) -> None:
    from library.families import sd

    sd.set_attention_backend(args, components)
    one_attention_grad_layout(components.transformer)


class _ContiguousGrad(torch.autograd.Function):
    """Identity in forward; hands a contiguous gradient back."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _contiguous_grad_hook(module, args, output):
    return _ContiguousGrad.apply(output)


def one_attention_grad_layout(transformer) -> int:
    """Gives every attention backward of a FLUX.1 transformer its output's gradient in one layout (contiguous);
    returns how many attention layers needed it.

    torch 2.11's cuDNN attention caches its backward plan by the q/k/v layout alone, but the plan holds the layout
    of the output's gradient too. A single block concatenates its attention output with the MLP branch, so that
    gradient arrives as a slice (row stride 15360 instead of 3072); a double block's arrives contiguous. Whichever
    backward runs first (a single block's) fixed the plan for both, and the double blocks then read their gradient
    with five times its row stride: an illegal memory access, or silently wrong gradients where the memory past the
    gradient was mapped (tools/probe_cudnn_sdpa.py --grad_layouts and --flux_blocks show both on an H100 with
    torch 2.11 + cuDNN 9.19; pytorch/pytorch#191576 proposed the gradient's strides in that key). With one layout
    every attention backward runs on the right plan; the copy costs one gradient-sized write a single block."""
    from diffusers.models.transformers.transformer_chroma import ChromaSingleTransformerBlock
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    n = 0
    for block in transformer.modules():  # Chroma's single blocks concatenate the same way
        single = isinstance(block, (FluxSingleTransformerBlock, ChromaSingleTransformerBlock))
        if single and not getattr(block.attn, "_one_grad_layout", False):
            block.attn.register_forward_hook(_contiguous_grad_hook)
            block.attn._one_grad_layout = True
            n += 1
    return n


def compile_denoiser(args, components, label: str, text_length_varies: bool = False) -> int:
    """Regional compile of the transformer's blocks with --compile; returns how many were compiled.
    text_length_varies: the blocks' token count follows each batch's longest caption, also with one bucket shape
    (--compile_dynamic auto then compiles with torch's automatic dynamic: options.dynamic_value)."""
    import copy

    from library.compile import environment as compile_environment, regional

    compile_environment.setup_compile_environment(args)
    if not args.compile:
        return 0
    if text_length_varies:
        args = copy.copy(args)  # the caller's settings are left as they were
        args._text_length_varies = True
    return regional.compile_model_blocks(
        components.transformer, args, model_name=label, gradient_checkpointing=args.gradient_checkpointing,
        disable_linear=(args.blocks_to_swap or 0) > 0, offload_checkpointing=offload_checkpointing.enabled(args))


def metadata(args, fp8_targets, t5_len: int, compiled_blocks: int) -> dict[str, str]:
    from library.compile import options as compile_options

    md = dict(compile_options.compile_settings_metadata(args))
    md.update({
        "ss_model_type": str(getattr(args, "model_type", "flux")),  # upstream's --model_type (flux/chroma)
        "ss_guidance_scale": str(args.guidance_scale),
        **flow_matching.metadata(args),
        "ss_apply_t5_attn_mask": str(bool(args.apply_t5_attn_mask)),
        "ss_t5xxl_max_token_length": str(t5_len),
        "ss_fp8_base": str(fp8_targets[0]),  # upstream: --fp8_base_unet sets fp8_base for FLUX
        "ss_blocks_to_swap": str(args.blocks_to_swap or 0),
    })
    if compiled_blocks:
        md["ss_compile_blocks"] = str(compiled_blocks)
    return md


def network_arg_true(args, key: str) -> bool:
    from library.network_options import parse_network_args

    value = parse_network_args(getattr(args, "network_args", None)).get(key, "")
    return value.strip().lower() in ("true", "1", "yes")

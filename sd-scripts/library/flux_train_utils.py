"""FLUX.1 training pieces shared by flux_train_network.py (LoRA) and flux_train.py (full fine-tune).

Flow matching: noisy = (1 - sigma) * latents + sigma * noise, the transformer predicts the velocity
noise - latents (the target for every --model_prediction_type, as in sd-scripts). Latents are the AE's
(mean - 0.1159) * 0.3611, packed 2x2 into tokens of 64 channels; text conditioning is T5-XXL's hidden states
plus CLIP-L's pooled output; dev models also get the guidance scale.
"""
from __future__ import annotations

import logging
import os

import torch

from library import dit_options, flux_models
from library.objectives import flow_matching

logger = logging.getLogger(__name__)

MODEL_TYPES = ("flux", "chroma")  # upstream's --model_type choices (chroma: library.families.chroma)


def add_flux_arguments(parser) -> None:
    g = parser.add_argument_group("FLUX.1")
    dit_options.add_text_encoder_file_arguments(g)
    dit_options.add_ae_argument(g)
    dit_options.add_t5_arguments(g)
    g.add_argument("--guidance_scale", type=float, default=3.5, help="guidance embedded into FLUX.1-dev while training")
    flow_matching.add_timestep_arguments(g, sampling_default="sigma", discrete_flow_shift=3.0,
                                         model_prediction_type="sigma_scaled")
    dit_options.add_memory_arguments(g)
    g.add_argument("--model_type", type=str, default="flux", choices=MODEL_TYPES,
                   help="flux (FLUX.1 dev/schnell) or chroma (Chroma: T5-XXL only, needs --apply_t5_attn_mask)")
    g.add_argument("--controlnet_model_name_or_path", type=str, default=None,
                   help="ignored, as in upstream's LoRA and fine-tune scripts (only its ControlNet trainer reads it)")


def check_flux_args(args, error_cls) -> None:
    if args.controlnet_model_name_or_path:
        logger.warning("--controlnet_model_name_or_path is ignored: upstream reads it only in its FLUX ControlNet "
                       "trainer (flux_train_control_net.py), which this project does not have")
    if args.blocks_to_swap is not None and args.blocks_to_swap < 0:
        raise error_cls(f"--blocks_to_swap must be 0 or more, got {args.blocks_to_swap}")
    if args.t5xxl_max_token_length is not None and not 1 <= args.t5xxl_max_token_length <= 512:
        raise error_cls(f"--t5xxl_max_token_length must be between 1 and 512, got {args.t5xxl_max_token_length}")
    flow_matching.check_args(args, error_cls)
    if args.fp8_base and not hasattr(torch, "float8_e4m3fn"):
        raise error_cls("--fp8_base needs torch >= 2.1 (float8_e4m3fn)")
    res = getattr(args, "resolution", None)
    if isinstance(res, str):
        for v in res.replace("x", ",").split(","):
            if v.strip().isdigit() and int(v) % 16:
                raise error_cls(f"--resolution {res}: FLUX needs sides that are multiples of 16")


def t5_max_length(args, components) -> int:
    if args.t5xxl_max_token_length:
        return args.t5xxl_max_token_length
    return 256 if components.is_schnell else 512


# ---------------------------------------------------------------------------------------------------------------
# conditioning


def encode_prompts(clip, t5, clip_tok, t5_tok, captions: list[str], t5_len: int, apply_t5_mask: bool) -> dict:
    """{"t5_out": [B, L, D], "pooled": [B, 768], "t5_attn_mask": [B, L]} (what is cached, too)."""
    dev_c, dev_t = clip.device, t5.device
    ids = clip_tok(captions, padding="max_length", max_length=clip_tok.model_max_length if clip_tok.model_max_length
                   < 1000 else 77, truncation=True, return_tensors="pt").input_ids.to(dev_c)
    pooled = clip(ids, output_hidden_states=False).pooler_output
    t = t5_tok(captions, padding="max_length", max_length=t5_len, truncation=True, return_tensors="pt")
    mask = t.attention_mask.to(dev_t)
    out = t5(t.input_ids.to(dev_t), attention_mask=mask if apply_t5_mask else None).last_hidden_state
    if apply_t5_mask:
        out = out * mask.unsqueeze(-1).to(out.dtype)
    return {"t5_out": out, "pooled": pooled, "t5_attn_mask": mask}


def encode_latents(ae, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The AE's latents, sampled with `generator` (the run's), shifted and scaled."""
    with torch.no_grad():
        lat = ae.encode(images.to(ae.device, ae.dtype)).latent_dist.sample(generator=generator)
    return (lat - flux_models.AE_SHIFT_FACTOR) * flux_models.AE_SCALING_FACTOR


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, C*4] (2x2 patches, the order FLUX and diffusers use)."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, d = x.shape
    c = d // 4
    x = x.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """Rope positions of the packed latent tokens: (0, row, column)."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] = torch.arange(h // 2)[:, None]
    ids[..., 2] = torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device, dtype)


def flux_forward(transformer, noisy: torch.Tensor, sigmas: torch.Tensor, te: dict, guidance: float | None,
                 dtype: torch.dtype, apply_t5_attn_mask: bool = False) -> torch.Tensor:
    """Run the transformer on unpacked latents [B, 16, h, w]; returns the prediction in the same layout.
    apply_t5_attn_mask: T5 padding tokens are masked out of the joint attention (te["t5_attn_mask"])."""
    b, _, h, w = noisy.shape
    t5_out = te["t5_out"].to(noisy.device, dtype)
    kwargs = None
    if apply_t5_attn_mask and te.get("t5_attn_mask") is not None:
        txt = te["t5_attn_mask"].to(noisy.device).bool()
        img = torch.ones(b, (h // 2) * (w // 2), dtype=torch.bool, device=noisy.device)
        kwargs = {"attention_mask": torch.cat([txt, img], dim=1)[:, None, None, :]}
    g = None
    if transformer.config.guidance_embeds:
        g = torch.full((b,), float(guidance if guidance is not None else 1.0), device=noisy.device, dtype=dtype)
    out = transformer(
        hidden_states=pack_latents(noisy).to(dtype),
        encoder_hidden_states=t5_out,
        pooled_projections=te["pooled"].to(noisy.device, dtype),
        timestep=sigmas.to(dtype),
        img_ids=image_ids(h, w, noisy.device, dtype),
        txt_ids=torch.zeros(t5_out.shape[1], 3, device=noisy.device, dtype=dtype),
        guidance=g,
        joint_attention_kwargs=kwargs,
        return_dict=False,
    )[0]
    return unpack_latents(out, h, w)


# ---------------------------------------------------------------------------------------------------------------
# sample images


def build_pipeline(components):
    from diffusers import FluxPipeline

    from library.flux_tiny import flow_match_scheduler

    return FluxPipeline(scheduler=flow_match_scheduler(), vae=components.ae, text_encoder=components.clip_l,
                        tokenizer=components.clip_tokenizer, text_encoder_2=components.t5xxl,
                        tokenizer_2=components.t5_tokenizer, transformer=components.transformer)


def sample_images(args, components, *, device, epoch, steps, autocast=None, networks=()) -> list[str]:
    """FLUX samples (flow-matching Euler, FluxPipeline over the live models): kohya prompt lines with --g for the
    embedded guidance and --l with --n for true CFG. Saved under <output_dir>/sample/; RNG states restored."""
    max_length = t5_max_length(args, components)

    def draw(pipe, p, generator):
        kwargs = dict(prompt=p["prompt"], width=p.get("width", 512), height=p.get("height", 512),
                      num_inference_steps=p.get("sample_steps", 20), guidance_scale=p.get("guidance_scale", 3.5),
                      generator=generator, max_sequence_length=max_length)
        if p.get("negative_prompt"):
            kwargs.update(negative_prompt=p["negative_prompt"], true_cfg_scale=p.get("scale", 1.0))
        return pipe(**kwargs).images[0]

    return sample_with_pipeline(args, lambda: build_pipeline(components),
                                (components.ae, components.clip_l, components.t5xxl), draw, device=device,
                                epoch=epoch, steps=steps, autocast=autocast, networks=networks)


@torch.no_grad()
def sample_with_pipeline(args, make_pipeline, models, draw, *, device, epoch, steps, autocast=None,
                         networks=(), prompt_defaults: dict | None = None) -> list[str]:
    """The sample loop of the flow-matching families (FLUX.1, library.families.chroma): the --sample_prompts
    lines, `models` on `device` while sampling (moved back after), `make_pipeline()` over the live models,
    `draw(pipe, prompt, generator)` -> one image per line, saved under <output_dir>/sample/; RNG states and the
    networks' modes restored."""
    from library.sample_prompts import parse_prompt_file
    from library.sampling import sampling_state, save_sample_image

    prompts = parse_prompt_file(args.sample_prompts, prompt_defaults)  # the family's defaults (--s, --l ...)
    if not prompts:
        return []
    os.makedirs(os.path.join(args.output_dir, "sample"), exist_ok=True)
    paths = []
    with sampling_state(networks):
        moved = [(m, m.device) for m in models if m.device != torch.device(device)]
        for m, _ in moved:
            m.to(device)
        try:
            pipe = make_pipeline()
            pipe.set_progress_bar_config(disable=True)
            for i, p in enumerate(prompts):
                seed = p.get("seed")
                gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
                ctx = autocast() if autocast is not None else torch.autocast(torch.device(device).type,
                                                                             enabled=False)
                with ctx:
                    image = draw(pipe, p, gen)
                paths.append(save_sample_image(image, args, epoch=epoch, steps=steps, index=i, seed=seed,
                                               prompt=p["prompt"]))
        finally:
            for m, d in moved:
                m.to(d)
    return paths


def place_transformer(transformer, device, dtype, fp8_base: bool, blocks_to_swap: int, blocks=None):
    """Cast the frozen transformer to the training dtype (fp8 weights stay fp8) and put it on the device; with
    block swap only the resident blocks go there (`blocks`: the swappable ones, FLUX.1's by default). Returns the
    BlockSwapper or None."""
    for t in list(transformer.parameters()) + list(transformer.buffers()):
        if t.is_floating_point() and t.dtype != flux_models.FP8_DTYPE and t.dtype != dtype:
            t.data = t.data.to(dtype)
    if blocks_to_swap:
        from library.block_swap import place_with_block_swap

        return place_with_block_swap(transformer, blocks_to_swap, device, blocks=blocks)
    for t in list(transformer.parameters()) + list(transformer.buffers()):
        t.data = t.data.to(device)
    return None


def cache_signature(args, what: str) -> str:
    return (f"flux:{os.path.basename(str(args.pretrained_model_name_or_path))}:{os.path.basename(str(args.ae or ''))}:"
            f"{what}:{args.t5xxl_max_token_length}:{args.apply_t5_attn_mask}")



def save_transformer(args, components, path: str, metadata, save_dtype, swapper=None) -> None:
    """The transformer as a BFL-layout .safetensors (flux_train.py); --mem_eff_save streams one tensor at a time
    from the live weights (no second copy of the model in memory)."""
    from library import saving, train_util
    from library.compile.regional import strip_orig_mod

    if swapper is not None:
        swapper.synchronize()  # block copies still in flight must land before the weights are read
    if getattr(args, "mem_eff_save", False):
        sd = strip_orig_mod(components.transformer.state_dict())
        saving.save_safetensors_streaming(path, flux_models.diffusers_to_bfl_entries(sd, save_dtype), metadata,
                                          overwrite=args.overwrite_output)
        return
    sd = {k: v.detach().to("cpu") for k, v in components.transformer.state_dict().items()}
    bfl = flux_models.diffusers_to_bfl(strip_orig_mod(sd))
    if save_dtype is not None:
        bfl = {k: v.to(save_dtype) for k, v in bfl.items()}
    train_util.save_safetensors_atomic(bfl, path, metadata, overwrite=args.overwrite_output)


# ---------------------------------------------------------------------------------------------------------------
# flux_train.py: the full fine-tune of the transformer

TRAIN_BLOCKS = ("all", "single", "double")


def check_full_args(args, target) -> None:
    """flux_train.py's own options, before the family's checks."""
    from library.errors import ConfigError

    if args.train_text_encoder:
        raise ConfigError("--train_text_encoder: flux_train.py trains the FLUX transformer only (CLIP-L and "
                          "T5-XXL stay frozen); train a CLIP-L LoRA with flux_train_network.py instead")
    if args.save_model_as not in (None, "safetensors"):
        # upstream's flux_train.py ignores --save_model_as the same way
        logger.warning("--save_model_as %s: flux_train.py writes a BFL .safetensors single file", args.save_model_as)
    check_swap_and_blockwise(args)
    if args.fused_optimizer_groups:
        logger.warning("--fused_optimizer_groups has no effect in flux_train.py (upstream: \"this option is not "
                       "working\"); use --blockwise_fused_optimizers")
    if args.train_blocks not in TRAIN_BLOCKS:
        raise ConfigError(f"--train_blocks {args.train_blocks}: allowed: {', '.join(TRAIN_BLOCKS)}")


def normalise_full_args(args) -> None:
    """flux_train.py's deprecated forms and implied settings (train_util.normalise_args runs it, as upstream's
    flux_train.py does before training)."""
    map_deprecated_swap_args(args)
    normalise_dit_full_args(args)


def normalise_dit_full_args(args) -> None:
    """What flux_train.py and lumina_train.py imply, as upstream's scripts do before training."""
    if args.cpu_offload_checkpointing and not args.gradient_checkpointing:
        logger.warning("cpu_offload_checkpointing is enabled, so gradient_checkpointing is also enabled")
        args.gradient_checkpointing = True
    if args.skip_latents_validity_check:
        logger.warning("--skip_latents_validity_check is deprecated: use --skip_cache_check")
        args.skip_cache_check = True


def map_split_mode(args) -> None:
    """flux_train_network.py's deprecated --split_mode, mapped as upstream maps it."""
    if not args.split_mode:
        return
    if args.blocks_to_swap is not None:
        logger.warning("split_mode is deprecated. Because `--blocks_to_swap` is set, `--split_mode` is ignored.")
    else:
        logger.warning("split_mode is deprecated. Please use `--blocks_to_swap` instead. "
                       "`--blocks_to_swap 18` is automatically set.")
        args.blocks_to_swap = 18


def map_deprecated_swap_args(args) -> None:
    """Upstream's deprecated --double_blocks_to_swap / --single_blocks_to_swap, converted as upstream converts
    them (double + single // 2) when --blocks_to_swap is not given."""
    if args.blocks_to_swap is not None:
        return
    blocks = (args.double_blocks_to_swap or 0) + (args.single_blocks_to_swap or 0) // 2
    if blocks > 0:
        logger.warning("double_blocks_to_swap and single_blocks_to_swap are deprecated. Use blocks_to_swap instead.")
        logger.info(f"double_blocks_to_swap={args.double_blocks_to_swap} and single_blocks_to_swap="
                    f"{args.single_blocks_to_swap} are converted to blocks_to_swap={blocks}.")
        args.blocks_to_swap = blocks


def check_swap_and_blockwise(args) -> None:
    """The DiT full fine-tunes' (flux_train.py, sd3_train.py) rules for block swap and blockwise fused optimizers."""
    from library import optimizers
    from library.errors import ConfigError

    if args.blocks_to_swap and not args.fused_backward_pass:
        raise ConfigError("--blocks_to_swap in a full fine-tune needs --fused_backward_pass (with --optimizer_type "
                          "Adafactor): each weight must be updated while its block is on the GPU")
    if blockwise_fused(args) and optimizers.is_schedulefree(args):
        raise ConfigError("--blockwise_fused_optimizers cannot be used with a schedule-free optimizer "
                          f"({optimizers.optimizer_type(args)}), as upstream")


def blockwise_fused(args) -> bool:
    """--blockwise_fused_optimizers (unless --fused_backward_pass wins, as upstream)."""
    return bool(args.blockwise_fused_optimizers) and not args.fused_backward_pass


def blockwise_optimizer_groups(args, components) -> list[list[dict]]:
    """--blockwise_fused_optimizers: one optimizer per double block, per single block, and one for the rest
    (upstream's grouping; one learning rate for all, as upstream)."""
    by_block: dict[tuple[str, int], list] = {}
    for name, param in components.transformer.named_parameters():
        if not param.requires_grad:
            continue
        head, _, rest = name.partition(".")
        key = {"transformer_blocks": "double", "single_transformer_blocks": "single"}.get(head, "other")
        by_block.setdefault((key, int(rest.split(".")[0]) if key != "other" else -1), []).append(param)
    return [[{"params": params, "lr": args.learning_rate}] for params in by_block.values()]


def place_for_full_training(args, accelerator, family, components, train_dtype):
    """The transformer (or its --train_blocks) is trained; with --blocks_to_swap only the resident blocks go to
    the device (the family's swapper then also syncs the blocks before a save)."""
    from library import sharding
    from library.block_swap import BlockSwapError, place_with_block_swap
    from library.network_trainer import Trainable
    from library.errors import ConfigError

    device = accelerator.device
    model = components.transformer
    model.to(dtype=train_dtype)
    keep = {"all": "", "single": "single_transformer_blocks.", "double": "transformer_blocks."}[args.train_blocks]
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(keep))
    if args.gradient_checkpointing:
        family.enable_gradient_checkpointing(args, components, [])
    model.train()
    if args.blocks_to_swap:
        try:
            family.swapper = place_with_block_swap(model, args.blocks_to_swap, device, trainable=True)
        except BlockSwapError as e:
            raise ConfigError(str(e)) from e
    elif not sharding.shards(args, accelerator):  # (--fsdp: fully_shard places it block by block)
        model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    logger.info("training the FLUX transformer (--train_blocks %s): %.2fM parameters in %s", args.train_blocks,
                sum(p.numel() for p in params) / 1e6, str(train_dtype).removeprefix("torch."))
    return Trainable(models=[model], param_groups=[{"params": params, "lr": args.learning_rate}],
                     train_text_encoder=False)

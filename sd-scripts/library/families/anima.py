"""Anima (upstream's anima_train_network.py): rectified flow on the Qwen-Image VAE's normalised latents, Qwen3-0.6B
conditioning (its last hidden state, padding zeroed) turned into the DiT's context by the LLM adapter over T5 token
ids, the Cosmos-Predict2 DiT (library.anima_models), bucket multiple 16. The DiT takes sigma as its time and predicts
noise - latents: our FlowMatching objective's convention, so its output is used as it is."""
from __future__ import annotations

import logging
import os

import torch

from library import anima_models, dit_options, flux_train_utils, latent_cache, offload_checkpointing, te_cache
from library.families import dit_family
from library.objectives import flow_matching

logger = logging.getLogger(__name__)

ATTN_MODES = ("torch", "xformers", "flash", "sageattn", "sdpa")  # upstream's choices ("sdpa" = "torch": both SDPA)
TE_KEYS = ("prompt_embeds", "attn_mask", "t5_input_ids", "t5_attn_mask")
LATENT_FORMAT = latent_cache.LatentCacheFormat("_anima.npz", 1.0, multi_resolution=True, legacy_name=False)
SAMPLE_FLOW_SHIFT = 3.0  # upstream's sampler default (the prompt line's --fs)


def add_anima_arguments(parser) -> None:
    """Upstream's add_anima_training_arguments (its defaults), the DiT options' --blocks_to_swap /
    --text_encoder_batch_size and --unsloth_offload_checkpointing."""
    g = parser.add_argument_group("Anima")
    g.add_argument("--qwen3", type=str, default=None,
                   help="Qwen3-0.6B text encoder (.safetensors file or a folder)")
    g.add_argument("--llm_adapter_path", type=str, default=None,
                   help="LLM adapter weights in their own file; default: the adapter inside the DiT file")
    for name, what in (("llm_adapter", "the LLM adapter"), ("self_attn", "self-attention layers"),
                       ("cross_attn", "cross-attention layers"), ("mlp", "MLP layers"),
                       ("mod", "AdaLN modulation layers")):
        g.add_argument(f"--{name}_lr", type=float, default=None,
                       help=f"learning rate for {what} in upstream's full fine-tune (anima_train.py); its LoRA "
                            "script accepts and ignores it, as here")
    g.add_argument("--t5_tokenizer_path", type=str, default=None,
                   help="T5 tokenizer folder (the LLM adapter's token ids); default: --tokenizer_cache_dir's t5/, "
                        "else google/t5-v1_1-xxl from the hub")
    g.add_argument("--qwen3_max_token_length", type=int, default=512, help="Qwen3 tokens (default 512)")
    g.add_argument("--t5_max_token_length", type=int, default=512, help="T5 tokens for the LLM adapter (default 512)")
    flow_matching.add_timestep_arguments(g, sampling_default="sigmoid", discrete_flow_shift=1.0,
                                         model_prediction_type=None)
    g.add_argument("--attn_mode", choices=ATTN_MODES, default=None,
                   help="attention implementation (upstream's names); training runs PyTorch's scaled-dot-product "
                        "attention, which picks FlashAttention kernels where it can; sageattn is inference only")
    g.add_argument("--split_attn", action="store_true",
                   help="upstream: split the attention batch to save memory (needed by its xformers mode); the "
                        "DiT's attention here has no padding mask, so one batched SDPA call is used")
    g.add_argument("--vae_chunk_size", type=int, default=None,
                   help="upstream's spatial chunking of its VAE; accepted, diffusers' Qwen-Image VAE encodes whole")
    g.add_argument("--vae_disable_cache", action="store_true",
                   help="upstream's switch for its VAE's feature cache; accepted, no effect here")
    g.add_argument("--unsloth_offload_checkpointing", action="store_true",
                   help="with gradient checkpointing (turned on): the checkpointed blocks' inputs kept in CPU "
                        "memory; not with --cpu_offload_checkpointing or --blocks_to_swap")
    dit_options.add_memory_arguments(g)


def normalise_args(args) -> None:
    """Upstream's fixed-ups before training (its __main__ and assert_extra_args)."""
    if getattr(args, "unsloth_offload_checkpointing", False) and not args.gradient_checkpointing:
        logger.warning("--unsloth_offload_checkpointing turns on --gradient_checkpointing")
        args.gradient_checkpointing = True


def normalise_full_args(args) -> None:
    """anima_train.py's fix-ups: the LoRA script's, and --cpu_offload_checkpointing / the deprecated
    --skip_latents_validity_check as upstream's full trainers."""
    normalise_args(args)
    flux_train_utils.normalise_dit_full_args(args)


def check_anima_args(args, error_cls) -> None:
    for name in ("qwen3_max_token_length", "t5_max_token_length"):
        if getattr(args, name) < 1:
            raise error_cls(f"--{name} must be 1 or more, got {getattr(args, name)}")
    if args.blocks_to_swap is not None and args.blocks_to_swap < 0:
        raise error_cls(f"--blocks_to_swap must be 0 or more, got {args.blocks_to_swap}")
    if args.attn_mode == "sageattn":
        raise error_cls("--attn_mode sageattn: Sage Attention does not support training (as upstream); allowed: "
                        "torch, sdpa, xformers, flash")
    if args.vae_chunk_size is not None and args.vae_chunk_size < 1:
        raise error_cls(f"--vae_chunk_size must be 1 or more, got {args.vae_chunk_size}")
    if args.unsloth_offload_checkpointing:
        if args.cpu_offload_checkpointing:
            raise error_cls("--unsloth_offload_checkpointing and --cpu_offload_checkpointing exclude each other")
        if args.blocks_to_swap:
            raise error_cls("--unsloth_offload_checkpointing cannot be used with --blocks_to_swap")
    flow_matching.check_args(args, error_cls)
    offload_checkpointing.check_args(args, error_cls)
    dit_family.check_resolution_multiple(args, error_cls, 16, "Anima")


def offloads_checkpoints(args) -> bool:
    return offload_checkpointing.enabled(args) or bool(getattr(args, "unsloth_offload_checkpointing", False))


class Anima:
    label = "Anima"

    def __init__(self):
        dit_family.init(self, 16)

    def name(self, args) -> str:
        return "anima"

    def check_args(self, args) -> None:
        dit_family.check_args(args, check_anima_args, self.label, "networks.lora_anima")
        if args.attn_mode in ("xformers", "flash") or args.split_attn:
            logger.info("--attn_mode %s%s: attention runs through PyTorch's SDPA", args.attn_mode,
                        " --split_attn" if args.split_attn else "")
        if args.fp8_base or getattr(args, "fp8_base_unet", False):
            logger.warning("--fp8_base / --fp8_base_unet are not supported for Anima (as upstream): training in the "
                           "weight dtype")
        if args.vae_chunk_size is not None or args.vae_disable_cache:
            logger.info("--vae_chunk_size / --vae_disable_cache tune upstream's own VAE code; diffusers' VAE is used "
                        "as it is")

    def load(self, args, weight_dtype, fp8_denoiser: bool):
        c = anima_models.load_anima_components(
            args.pretrained_model_name_or_path, args.qwen3, args.vae, llm_adapter_path=args.llm_adapter_path,
            t5_tokenizer_path=args.t5_tokenizer_path, dtype=weight_dtype, te_dtype=weight_dtype,
            vae_dtype=torch.float32 if args.no_half_vae else weight_dtype, fp8_base=False,
            tokenizer_cache_dir=args.tokenizer_cache_dir)
        cfg = c.transformer.config
        logger.info("Anima: %d blocks, width %d, %d heads; Qwen3 width %d", cfg.num_blocks, cfg.model_channels,
                    cfg.num_heads, c.qwen3.config.hidden_size)
        return c

    def lora_text_encoders(self, components) -> list:
        return [components.qwen3]

    def encode_images(self, args, components, images, generator):
        return anima_models.encode_pixels(components.vae, images)  # the posterior's mode, as upstream

    def encode_prompts(self, args, components, captions, with_grad=False, **_) -> dict:
        return encode_prompts(components, captions, args.qwen3_max_token_length, args.t5_max_token_length,
                              with_grad)

    def prediction_type(self, args, components) -> str:
        return "epsilon"  # flow matching (modelspec: no v-prediction)

    def predict(self, args, components, noisy_latents, timesteps, te_outputs, batch, weight_dtype):
        return dit_forward(components.transformer, noisy_latents, timesteps, te_outputs, weight_dtype)

    def enable_gradient_checkpointing(self, args, components, text_encoders: list) -> None:
        from library.families import sd

        sd.enable_gradient_checkpointing(args, components.transformer, text_encoders)
        if args.unsloth_offload_checkpointing:  # upstream's asynchronous variant: the offloading checkpoint here
            offload_checkpointing.enable(components.transformer)

    def place_denoiser(self, args, components, device, weight_dtype, fp8: bool) -> None:
        dit_family.place_denoiser(self, components, device, weight_dtype, fp8, args.blocks_to_swap or 0,
                                  list(components.transformer.blocks))

    def apply_fp8(self, args, components, fp8_targets) -> None:
        pass  # no fp8 for Anima (upstream turns --fp8_base / --fp8_base_unet off; check_args warns)

    def set_attention_backend(self, args, components) -> None:
        pass  # PyTorch SDPA (--attn_mode: see check_args)

    def compile(self, args, components) -> None:
        from library.compile import environment as compile_environment, regional

        compile_environment.setup_compile_environment(args)
        if args.compile:
            self.compiled_blocks = regional.compile_model_blocks(
                components.transformer, args, model_name=self.label, gradient_checkpointing=args.gradient_checkpointing,
                disable_linear=(args.blocks_to_swap or 0) > 0, offload_checkpointing=offloads_checkpoints(args))

    def sample(self, args, components, accelerator, *, epoch, steps, networks, prediction_type) -> None:
        sample_images(args, components, device=accelerator.device, epoch=epoch, steps=steps,
                      autocast=accelerator.autocast, networks=networks)

    def base_model_version(self, args) -> str:
        return "anima"  # upstream's load_target_model

    def metadata(self, args, fp8_targets) -> dict[str, str]:
        # upstream turns --fp8_base / --fp8_base_unet off before writing metadata
        return dit_family.metadata(self, args, {"ss_fp8_base": "False", "ss_fp8_base_unet": "False"})

    def modelspec_variant(self) -> str | None:
        return None

    def latent_cache_format(self, args, components) -> latent_cache.LatentCacheFormat:
        return LATENT_FORMAT  # upstream's <stem>_<w>x<h>_anima.npz, the normalised latents

    def te_cache_format(self, args, components) -> te_cache.TeCacheFormat:
        return TE_FORMAT

    def cache_signature(self, args, what: str) -> str:
        if what == "te":
            return (f"anima:te:{os.path.basename(str(args.qwen3 or ''))}:{args.qwen3_max_token_length}:"
                    f"{args.t5_max_token_length}")
        return f"anima:{what}:{os.path.basename(str(args.vae or ''))}"

    def full_output_format(self, args) -> tuple[str, str]:
        return "single", ".safetensors"  # upstream's layout, whatever --save_model_as says (as upstream)

    def save_full_model(self, args, components, path: str, metadata, save_dtype) -> None:
        anima_models.save_dit(path, dit_family.trained_state_dict(self, components), metadata, save_dtype)


def _te_to_file(o: dict) -> dict:
    arrays = {k: te_cache._numpy(o[k]) for k in TE_KEYS}
    arrays["t5_input_ids"] = arrays["t5_input_ids"].astype("int32")  # upstream's dtypes
    arrays["t5_attn_mask"] = arrays["t5_attn_mask"].astype("int32")
    arrays["caption_dropout_rate"] = torch.tensor(0.0).numpy()  # (cached captions have no dropout here)
    return arrays


def _te_from_file(a: dict) -> dict:
    out = {k: torch.from_numpy(a[k]) for k in TE_KEYS}
    for k in ("attn_mask", "t5_input_ids", "t5_attn_mask"):
        out[k] = out[k].long()
    return out


TE_FORMAT = te_cache.TeCacheFormat("_anima_te.npz", TE_KEYS + ("caption_dropout_rate",), _te_to_file, _te_from_file)


def encode_prompts(components, texts: list[str], qwen3_len: int, t5_len: int, with_grad: bool = False) -> dict:
    """Upstream's AnimaTokenizeStrategy + AnimaTextEncodingStrategy: Qwen3's last hidden state (padding rows zero)
    and its mask, and the T5 token ids / mask the LLM adapter embeds (both padded to their max length)."""
    qwen, qtok, ttok = components.qwen3, components.qwen3_tokenizer, components.t5_tokenizer
    q = qtok(texts, return_tensors="pt", truncation=True, padding="max_length", max_length=qwen3_len)
    t5 = ttok(texts, return_tensors="pt", truncation=True, padding="max_length", max_length=t5_len)
    mask = q.attention_mask.to(qwen.device)
    with torch.set_grad_enabled(with_grad):
        hidden = qwen(input_ids=q.input_ids.to(qwen.device), attention_mask=mask).last_hidden_state
        hidden = hidden * mask[..., None].to(hidden.dtype)
    return {"prompt_embeds": hidden, "attn_mask": mask, "t5_input_ids": t5.input_ids, "t5_attn_mask": t5.attention_mask}


def dit_forward(dit, noisy: torch.Tensor, sigmas: torch.Tensor, te: dict, dtype) -> torch.Tensor:
    """The DiT on latents [B, 16, h, w] at noise level sigma (its time); its output, the velocity noise - latents."""
    dev = noisy.device
    out = dit(noisy.to(dtype)[:, :, None], sigmas.to(dtype), te["prompt_embeds"].to(dev, dtype),
              te["attn_mask"].to(dev), te["t5_input_ids"].to(dev, torch.long), te["t5_attn_mask"].to(dev))
    return out[:, :, 0]


@torch.no_grad()
def denoise(dit, noise, cond: dict, uncond: dict | None, *, steps: int, scale: float, flow_shift: float,
            dtype=torch.float32) -> torch.Tensor:
    """Upstream's do_sample: Euler from sigma 1 to 0 over steps + 1 linear sigmas shifted by flow_shift, CFG when
    scale > 1 and a negative prompt is there."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1, device=noise.device, dtype=dtype)
    if flow_shift != 1.0:
        sigmas = sigmas * flow_shift / (1 + (flow_shift - 1) * sigmas)
    x = noise.to(dtype)
    for i in range(steps):
        s = sigmas[i].reshape(1)
        v = dit_forward(dit, x, s, cond, dtype).float()
        if uncond is not None:
            v_neg = dit_forward(dit, x, s, uncond, dtype).float()
            v = v_neg + scale * (v - v_neg)
        x = (x + v * (sigmas[i + 1] - sigmas[i])).to(dtype)
    return x


def sample_images(args, components, *, device, epoch, steps, autocast=None, networks=()) -> list[str]:
    """Anima samples: kohya prompt lines (--n, --w, --h, --s, --l CFG scale (7.5), --d, --fs flow shift (3.0)); sizes
    rounded down to multiples of 16 (at least 64), as upstream."""
    from PIL import Image

    def draw(_, p, generator):
        dev = torch.device(device)
        cond = encode_prompts(components, [p["prompt"]], args.qwen3_max_token_length, args.t5_max_token_length)
        scale = p.get("scale", 7.5)
        uncond = None
        if scale > 1.0:  # upstream: the negative prompt ("" when none given) only with CFG
            uncond = encode_prompts(components, [p.get("negative_prompt") or ""], args.qwen3_max_token_length,
                                    args.t5_max_token_length)
        h = max(64, p.get("height", 512) // 16 * 16) // 8
        w = max(64, p.get("width", 512) // 16 * 16) // 8
        noise = torch.randn(1, anima_models.LATENT_CHANNELS, h, w, generator=generator).to(dev)
        dtype = components.transformer.dtype
        if dtype == torch.float8_e4m3fn:
            dtype = torch.bfloat16
        latents = denoise(components.transformer, noise, cond, uncond, steps=p.get("sample_steps", 30), scale=scale,
                          flow_shift=p.get("flow_shift", SAMPLE_FLOW_SHIFT), dtype=dtype)
        image = anima_models.decode_latents(components.vae, latents)
        array = ((image[0].permute(1, 2, 0).float().cpu() + 1) * 127.5).round().to(torch.uint8).numpy()
        return Image.fromarray(array)

    return flux_train_utils.sample_with_pipeline(args, dit_family.NoPipeline, (components.vae, components.qwen3),
                                                 draw, device=device, epoch=epoch, steps=steps, autocast=autocast,
                                                 networks=networks)


# anima_train.py (full fine-tune of the DiT and its LLM adapter; Qwen3 and the VAE stay frozen, as upstream)

PARTS = ("self_attn", "cross_attn", "mlp", "mod", "llm_adapter")  # --<part>_lr


def param_part(name: str) -> str:
    """Upstream's get_anima_param_groups: the part (and so the learning rate) a DiT parameter belongs to."""
    if "llm_adapter" in name:
        return "llm_adapter"
    for part, marker in (("self_attn", ".self_attn"), ("cross_attn", ".cross_attn"), ("mlp", ".mlp"),
                         ("mod", ".adaln_modulation")):
        if marker in name:
            return part
    return "base"


def part_learning_rates(args) -> dict[str, float]:
    """base = --learning_rate; each --<part>_lr, unset = --learning_rate."""
    lrs = {"base": args.learning_rate}
    lrs.update({part: args.learning_rate if getattr(args, f"{part}_lr") is None else getattr(args, f"{part}_lr")
                for part in PARTS})
    return lrs


def full_metadata(args) -> dict[str, float]:
    """The per-part learning rates given (ss_self_attn_lr ...), so a fine-tune's file says how it was trained."""
    return {f"ss_{part}_lr": getattr(args, f"{part}_lr") for part in PARTS if getattr(args, f"{part}_lr") is not None}


def check_full_args(args, target) -> None:
    from library.errors import ConfigError

    if args.train_text_encoder:
        raise ConfigError("--train_text_encoder: anima_train.py trains the DiT only (Qwen3 stays frozen, as "
                          "upstream); train a Qwen3 LoRA with anima_train_network.py instead")
    for part in PARTS:
        value = getattr(args, f"{part}_lr")
        if value is not None and value < 0:
            raise ConfigError(f"--{part}_lr must be 0 (frozen) or more, got {value}")
    if not args.learning_rate or not any(part_learning_rates(args).values()):
        raise ConfigError(f"--learning_rate {args.learning_rate}: every part of the DiT would be frozen (upstream "
                          "then trains and saves nothing); give a learning rate above 0")
    if args.save_model_as not in (None, "safetensors"):
        logger.warning("--save_model_as %s: anima_train.py writes a .safetensors single file (as upstream)",
                       args.save_model_as)


def place_for_full_training(args, accelerator, family, components, train_dtype):
    """The DiT (with its LLM adapter) in upstream's six parameter groups (base, self_attn, cross_attn, mlp, mod,
    llm_adapter), a part at rate 0 frozen; with --blocks_to_swap only the resident blocks go to the device."""
    from library import sharding
    from library.block_swap import BlockSwapError, place_with_block_swap
    from library.errors import ConfigError
    from library.network_trainer import Trainable

    model = components.transformer
    model.to(dtype=train_dtype).requires_grad_(True)
    lrs = part_learning_rates(args)
    by_part: dict[str, list] = {part: [] for part in lrs}
    for name, p in model.named_parameters():
        by_part[param_part(name)].append(p)
    groups, names = [], []
    for part, params in by_part.items():
        if lrs[part] == 0:
            for p in params:
                p.requires_grad_(False)
            logger.info("%s: learning rate 0, %d tensors frozen", part, len(params))
        elif params:
            groups.append({"params": params, "lr": lrs[part]})
            names.append(part)  # upstream's lr log names: lr/base, lr/self_attn, ...
            logger.info("%s: %d tensors at learning rate %s", part, len(params), lrs[part])
    if args.gradient_checkpointing:
        family.enable_gradient_checkpointing(args, components, [])
    model.train()
    if args.blocks_to_swap:
        try:
            family.swapper = place_with_block_swap(model, args.blocks_to_swap, accelerator.device, trainable=True,
                                                   blocks=list(model.blocks))
        except BlockSwapError as e:
            raise ConfigError(str(e)) from e
    elif not sharding.shards(args, accelerator):  # (--fsdp: fully_shard places it block by block)
        model.to(accelerator.device)
    logger.info("training the Anima DiT: %.2fM parameters in %s",
                sum(p.numel() for g in groups for p in g["params"]) / 1e6, str(train_dtype).removeprefix("torch."))
    return Trainable(models=[model], param_groups=groups, train_text_encoder=False, lr_descriptions=names)

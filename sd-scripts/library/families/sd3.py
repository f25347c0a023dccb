"""SD3 / SD3.5 (medium, large), as upstream's sd3_train_network.py / sd3_train.py: the MMDiT on 16-channel latents
((sample - 0.0609) * 1.5305), conditioning from CLIP-L + CLIP-G (penultimate hidden states, pooled projections)
and T5-XXL (zeros when absent), each encoder's outputs dropped per sample by its --*_dropout_rate, upstream's
flow-matching timesteps (objectives.flow_matching.SD3FlowMatching). Models: library.sd3_models."""
from __future__ import annotations

import logging
import random

import torch

from library import dit_options, latent_cache, offload_checkpointing, sd3_models, te_cache
from library.families import flux as flux_family, sd as sd_family
from library.objectives import flow_matching
from library.objectives.flow_matching import SD3FlowMatching

logger = logging.getLogger(__name__)

CLIP_LENGTH = 77
T5_LENGTH = 256  # upstream's default --t5xxl_max_token_length
DROPOUT_RATES = ("clip_l_dropout_rate", "clip_g_dropout_rate", "t5_dropout_rate")
IGNORED = ("save_clip", "save_t5xxl", "t5xxl_device", "t5xxl_dtype")  # upstream: "[DOES NOT WORK]"


def add_sd3_arguments(parser) -> None:
    """Upstream's add_sd3_training_arguments (+ --blocks_to_swap and --text_encoder_batch_size of its DiT
    arguments); the flow-matching options are objectives.flow_matching's."""
    g = parser.add_argument_group("SD3")
    dit_options.add_text_encoder_file_arguments(g)
    g.add_argument("--clip_g", type=str, default=None, help="CLIP-G (.safetensors); default: the one in the checkpoint")
    g.add_argument("--save_clip", action="store_true", help="[does nothing, as upstream] unified checkpoints")
    g.add_argument("--save_t5xxl", action="store_true", help="[does nothing, as upstream] unified checkpoints")
    g.add_argument("--t5xxl_device", type=str, default=None, help="[does nothing, as upstream]")
    g.add_argument("--t5xxl_dtype", type=str, default=None, help="[does nothing, as upstream]")
    dit_options.add_t5_arguments(g)
    g.add_argument("--apply_lg_attn_mask", action="store_true",
                   help="CLIP-L and CLIP-G attend to the caption's tokens only (the attention mask in the encoders)")
    for name, what in zip(DROPOUT_RATES, ("CLIP-L", "CLIP-G", "T5-XXL")):
        g.add_argument(f"--{name}", type=float, default=0.0,
                       help=f"probability that a sample's {what} outputs are replaced by zeros (default 0.0)")
    g.add_argument("--pos_emb_random_crop_rate", type=float, default=0.0,
                   help="probability of a random (not centred) crop of the positional embeddings per step; for "
                        "SD3.5 medium (default 0.0)")
    g.add_argument("--enable_scaled_pos_embed", action="store_true",
                   help="positional embeddings scaled for each dataset's resolution (multi-resolution training); "
                        "for SD3.5 medium, as upstream")
    flow_matching.add_sd3_arguments(g)
    dit_options.add_memory_arguments(g)


def t5xxl_cache_only(args) -> bool:
    """sd3_train.py --use_t5xxl_cache_only (the LoRA script has no such option, as upstream)."""
    return bool(getattr(args, "use_t5xxl_cache_only", False))


def t5_length(args) -> int:
    """--t5xxl_max_token_length, empty = 256 (upstream's default)."""
    return args.t5xxl_max_token_length or T5_LENGTH


class SD3:
    label = "MMDiT"

    def __init__(self, bucket_reso_steps_multiple: int = 32):
        self.objective = SD3FlowMatching()
        self.bucket_reso_steps_multiple = bucket_reso_steps_multiple  # upstream: 32 for LoRA, 8 for sd3_train
        self.compiled_blocks = 0
        self.swapper = None
        self.model_type = None  # "medium" / "5-medium" / "5-large", after load
        self.train_t5xxl = False
        self.resolutions: list[tuple[int, int]] = []  # the datasets' (w, h), for --enable_scaled_pos_embed
        self.weight_dtype = torch.float32  # load's; T5-XXL read later (--use_t5xxl_cache_only) takes it

    def prepare_dataset(self, args, groups: list) -> None:
        """The training (and validation) datasets' resolutions, as upstream's get_resolutions."""
        self.resolutions = [r for g in groups for r in g.resolutions]

    def name(self, args) -> str:
        return "sd3"

    def check_args(self, args) -> None:
        from library.compile import options as compile_options
        from library.errors import ConfigError

        if args.v2 or args.v_parameterization:
            raise ConfigError("--v2 / --v_parameterization are for SD2.x; the SD3 scripts train SD3 / SD3.5")
        module = getattr(args, "network_module", None)
        if module not in (None, "networks.lora_sd3"):
            logger.warning("--network_module %s: SD3 LoRA files in kohya's format come from networks.lora_sd3", module)
        for name in DROPOUT_RATES + ("pos_emb_random_crop_rate",):
            if not 0.0 <= getattr(args, name) <= 1.0:
                raise ConfigError(f"--{name} must be between 0 and 1, got {getattr(args, name)}")
        if args.blocks_to_swap is not None and args.blocks_to_swap < 0:
            raise ConfigError(f"--blocks_to_swap must be 0 or more, got {args.blocks_to_swap}")
        if args.blocks_to_swap and getattr(args, "cpu_offload_checkpointing", False):
            raise ConfigError("--blocks_to_swap cannot be used with --cpu_offload_checkpointing (as upstream)")
        if args.t5xxl_max_token_length is not None and not 1 <= args.t5xxl_max_token_length <= 512:
            raise ConfigError(f"--t5xxl_max_token_length must be between 1 and 512, got {args.t5xxl_max_token_length}")
        if getattr(args, "max_token_length", None) is not None:
            logger.warning("--max_token_length is not used in SD3 training (CLIP: 77 tokens, T5: "
                           "--t5xxl_max_token_length)")
        for name in IGNORED:
            if getattr(args, name):
                logger.warning("--%s does nothing (upstream: \"[DOES NOT WORK]\")", name)
        if args.fp8_base and not hasattr(torch, "float8_e4m3fn"):
            raise ConfigError("--fp8_base needs torch >= 2.1 (float8_e4m3fn)")
        offload_checkpointing.check_args(args, ConfigError)
        flow_matching.check_args(args, ConfigError)
        compile_options.validate_compile_args(args)
        self.train_t5xxl = flux_family.network_arg_true(args, "train_t5xxl") or bool(getattr(args, "train_t5xxl",
                                                                                              False))

    def load(self, args, weight_dtype, fp8_denoiser: bool):
        from library.errors import ConfigError

        try:
            c = sd3_models.load_sd3_components(
                args.pretrained_model_name_or_path, args.clip_l, args.clip_g, args.t5xxl, args.vae,
                dtype=weight_dtype, te_dtype=weight_dtype,
                vae_dtype=torch.float32 if args.no_half_vae else weight_dtype, fp8_base=fp8_denoiser,
                tokenizer_cache_dir=args.tokenizer_cache_dir, with_t5xxl=not t5xxl_cache_only(args))
        except sd3_models.SD3ModelError as e:
            raise ConfigError(str(e)) from e
        self.model_type = c.model_type
        self.weight_dtype = weight_dtype
        cfg = c.transformer.config
        logger.info("SD3 (%s): %d joint blocks, width %d%s", self.model_type, cfg.num_layers,
                    cfg.num_attention_heads * cfg.attention_head_dim,
                    ", T5-XXL from the cache (--use_t5xxl_cache_only)" if t5xxl_cache_only(args)
                    else "" if c.t5xxl is not None else ", no T5-XXL")
        scaled = None
        if args.enable_scaled_pos_embed:
            stride = 2 ** (len(c.vae.config.block_out_channels) - 1)  # 8 for SD3's VAE (upstream: 8)
            latent_sizes = sorted({round((w * h) ** 0.5) // stride for w, h in self.resolutions})
            scaled = ScaledPosEmbeds(cfg.num_attention_heads * cfg.attention_head_dim,
                                     [s // cfg.patch_size for s in latent_sizes])
            logger.info("scaled positional embeddings for the resolutions %s (latent sizes %s)",
                        sorted(set(self.resolutions)), latent_sizes)
        if args.pos_emb_random_crop_rate or scaled is not None:
            set_pos_embed(c.transformer, args.pos_emb_random_crop_rate, scaled)
        return c

    def lora_text_encoders(self, components) -> list:
        """[CLIP-L, CLIP-G] (+ T5-XXL with train_t5xxl): their place gives the LoRA prefixes te1/te2/te3."""
        tes = [components.clip_l, components.clip_g]
        return tes + [components.t5xxl] if self.train_t5xxl and components.t5xxl is not None else tes

    def encode_images(self, args, components, images, generator):
        vae = components.vae
        with torch.no_grad():
            lat = vae.encode(images.to(vae.device, vae.dtype)).latent_dist.sample(generator=generator)
        return (lat - sd3_models.VAE_SHIFT_FACTOR) * sd3_models.VAE_SCALING_FACTOR

    def encode_prompts(self, args, components, captions, with_grad=False, cached=None, **_) -> dict:
        """With `cached` (--use_t5xxl_cache_only, each step): CLIP-L/CLIP-G live, T5-XXL's outputs from the
        cache. Without T5-XXL loaded (--use_t5xxl_cache_only, making the cache) it is read for the captions the
        cache lacks."""
        if cached is not None:
            with torch.set_grad_enabled(with_grad):
                live = encode_clip(components, captions, args.apply_lg_attn_mask)
            return {**live, "t5_out": cached["t5_out"], "t5_attn_mask": cached["t5_attn_mask"]}
        if t5xxl_cache_only(args) and components.t5xxl is None:
            components.t5xxl = self._t5xxl_for_cache(args, components)
        with torch.set_grad_enabled(with_grad):
            return encode_prompts(components, captions, t5_length(args), args.apply_lg_attn_mask,
                                  args.apply_t5_attn_mask)

    def _t5xxl_for_cache(self, args, components):
        from library.errors import ConfigError

        try:
            t5 = sd3_models.load_t5xxl(args.pretrained_model_name_or_path, args.t5xxl, self.weight_dtype)
        except sd3_models.SD3ModelError as e:
            raise ConfigError(f"--use_t5xxl_cache_only: captions without cached T5-XXL outputs, and T5-XXL cannot be "
                              f"read to make them ({e})") from e
        if t5 is None:
            raise ConfigError("--use_t5xxl_cache_only: captions without cached T5-XXL outputs (no "
                              "*_sd3_te.npz beside their images) and no T5-XXL to make them: give --t5xxl, or make "
                              "the cache first with --cache_text_encoder_outputs_to_disk")
        logger.info("--use_t5xxl_cache_only: T5-XXL loaded to cache its outputs (freed before training)")
        return t5.to(components.clip_l.device).requires_grad_(False).eval()

    def prediction_type(self, args, components) -> str:
        return "epsilon"  # modelspec: upstream writes "epsilon" for SD3 (no v-prediction)

    def predict(self, args, components, noisy_latents, timesteps, te_outputs, batch, weight_dtype):
        te = drop_outputs(args, te_outputs, components.clip_l.config.hidden_size,
                          components.clip_l.config.projection_dim)
        context, pooled = conditioning(te, components.transformer.config.joint_attention_dim)
        return components.transformer(hidden_states=noisy_latents.to(weight_dtype),
                                      encoder_hidden_states=context.to(weight_dtype),
                                      pooled_projections=pooled.to(weight_dtype), timestep=timesteps,
                                      return_dict=False)[0]

    def enable_gradient_checkpointing(self, args, components, text_encoders: list) -> None:
        sd_family.enable_gradient_checkpointing(args, components.denoiser, text_encoders)

    def place_denoiser(self, args, components, device, weight_dtype, fp8: bool) -> None:
        self.swapper = flux_family.place_denoiser(args, components, device, weight_dtype, fp8)

    def apply_fp8(self, args, components, fp8_targets) -> None:
        flux_family.apply_fp8(components, fp8_targets)

    def set_attention_backend(self, args, components) -> None:
        sd_family.set_attention_backend(args, components)

    def compile(self, args, components) -> None:
        self.compiled_blocks = flux_family.compile_denoiser(args, components, self.label)

    def sample(self, args, components, accelerator, *, epoch, steps, networks, prediction_type) -> None:
        sample_images(args, components, device=accelerator.device, epoch=epoch, steps=steps,
                      autocast=accelerator.autocast, networks=networks)

    def base_model_version(self, args) -> str:
        return self.model_type or "medium"  # upstream: the MMDiT's model type

    def metadata(self, args, fp8_targets) -> dict[str, str]:
        from library.compile import options as compile_options

        md = dict(compile_options.compile_settings_metadata(args))
        md.update(flow_matching.metadata(args))
        md.update({
            "ss_apply_lg_attn_mask": str(bool(args.apply_lg_attn_mask)),
            "ss_apply_t5_attn_mask": str(bool(args.apply_t5_attn_mask)),
            "ss_t5xxl_max_token_length": str(t5_length(args)),
            **{f"ss_{name}": str(getattr(args, name)) for name in DROPOUT_RATES + ("pos_emb_random_crop_rate",)},
            "ss_fp8_base": str(fp8_targets[0]),
            "ss_blocks_to_swap": str(args.blocks_to_swap or 0),
        })
        if self.compiled_blocks:
            md["ss_compile_blocks"] = str(self.compiled_blocks)
        return md

    def modelspec_variant(self) -> str | None:
        return self.model_type  # modelspec.architecture stable-diffusion-3-<model type>

    def latent_cache_format(self, args, components) -> latent_cache.LatentCacheFormat:
        return latent_cache.FAMILY_FORMATS["sd3"]

    def te_cache_format(self, args, components) -> te_cache.TeCacheFormat:
        return te_cache_format(args.apply_lg_attn_mask, args.apply_t5_attn_mask)

    def cache_signature(self, args, what: str) -> str:
        import os

        return (f"sd3:{os.path.basename(str(args.pretrained_model_name_or_path))}:{what}:"
                f"{t5_length(args)}:{args.apply_lg_attn_mask}:{args.apply_t5_attn_mask}")

    def full_output_format(self, args) -> tuple[str, str]:
        return "single", ".safetensors"  # upstream: the SAI single file whatever --save_model_as says

    def save_full_model(self, args, components, path: str, metadata, save_dtype) -> None:
        save_checkpoint(args, components, path, metadata, save_dtype, self.swapper)


# ---------------------------------------------------------------------------------------------------------------
# conditioning


def _clip(model, tok, captions, mask: bool):
    t = tok(captions, padding="max_length", max_length=CLIP_LENGTH, truncation=True, return_tensors="pt")
    ids, attn = t.input_ids.to(model.device), t.attention_mask.to(model.device)
    out = model(ids, attention_mask=attn if mask else None, output_hidden_states=True)
    return out.hidden_states[-2], out.text_embeds, attn


def encode_clip(components, captions: list[str], lg_mask: bool) -> dict:
    """CLIP-L's and CLIP-G's part of encode_prompts: lg_out, lg_pooled, l_attn_mask, g_attn_mask."""
    tok_l, tok_g = components.tokenizers[:2]
    l_out, l_pooled, l_mask = _clip(components.clip_l, tok_l, captions, lg_mask)
    g_out, g_pooled, g_mask = _clip(components.clip_g, tok_g, captions, lg_mask)
    return {"lg_out": torch.cat([l_out, g_out.to(l_out.device)], dim=-1),
            "lg_pooled": torch.cat([l_pooled, g_pooled.to(l_pooled.device)], dim=-1),
            "l_attn_mask": l_mask, "g_attn_mask": g_mask.to(l_mask.device)}


def encode_prompts(components, captions: list[str], t5_len: int, lg_mask: bool, t5_mask: bool) -> dict:
    """Upstream's Sd3TextEncodingStrategy without dropout: {"lg_out": [B, 77, L + G] (penultimate layers),
    "lg_pooled": [B, L + G], "t5_out": [B, t5_len, D] (without T5-XXL: 77 zero tokens), and the three attention
    masks}.
    The masks only mask inside the encoders (--apply_lg_attn_mask / --apply_t5_attn_mask); the outputs are kept."""
    lg = encode_clip(components, captions, lg_mask)
    t = components.tokenizers[2](captions, padding="max_length", max_length=t5_len, truncation=True,
                                 return_tensors="pt")
    if components.t5xxl is not None:
        t5 = components.t5xxl
        t5_attn = t.attention_mask.to(t5.device)
        t5_out = t5(t.input_ids.to(t5.device), attention_mask=t5_attn if t5_mask else None).last_hidden_state
    else:  # no T5-XXL: 77 zero tokens, as upstream's concat_encodings and diffusers' pipeline
        width, lg_out = components.transformer.config.joint_attention_dim, lg["lg_out"]
        t5_out = torch.zeros(len(captions), CLIP_LENGTH, width, device=lg_out.device, dtype=lg_out.dtype)
        t5_attn = torch.zeros(len(captions), CLIP_LENGTH, dtype=torch.long, device=lg_out.device)
    return {**lg, "t5_out": t5_out, "t5_attn_mask": t5_attn}


def drop_outputs(args, te: dict, l_width: int, l_pooled_width: int) -> dict:
    """Upstream's text-encoder dropout: per sample, CLIP-L's / CLIP-G's / T5-XXL's outputs (and mask) become
    zeros with --clip_l_dropout_rate / --clip_g_dropout_rate / --t5_dropout_rate (drawn in that order, from
    Python's generator as upstream). New tensors: a cached batch is never changed."""
    rates = [getattr(args, name) for name in DROPOUT_RATES]
    if not any(rates):
        return te
    b = te["lg_out"].shape[0]
    keep = torch.tensor([[not (r > 0 and random.random() < r) for r in rates] for _ in range(b)])
    kl, kg, kt = (keep[:, i].to(te["lg_out"].device) for i in range(3))

    def halves(x, width, dims):  # CLIP-L's part times kl, CLIP-G's part times kg
        shape = (b,) + (1,) * dims
        return torch.cat([x[..., :width] * kl.view(shape).to(x.dtype), x[..., width:] * kg.view(shape).to(x.dtype)],
                         dim=-1)

    out = dict(te)
    out["lg_out"] = halves(te["lg_out"], l_width, 2)
    out["lg_pooled"] = halves(te["lg_pooled"], l_pooled_width, 1)
    out["t5_out"] = te["t5_out"] * kt.view(b, 1, 1).to(te["t5_out"].dtype)
    for key, k in (("l_attn_mask", kl), ("g_attn_mask", kg), ("t5_attn_mask", kt)):
        out[key] = te[key] * k.view(b, 1).to(te[key].dtype)
    return out


def conditioning(te: dict, joint_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(context [B, 77 + L_t5, joint_dim]: CLIP outputs padded to the T5 width, then T5's; pooled [B, L + G])."""
    lg = torch.nn.functional.pad(te["lg_out"], (0, joint_dim - te["lg_out"].shape[-1]))
    return torch.cat([lg, te["t5_out"].to(lg.dtype)], dim=-2), te["lg_pooled"]


def te_cache_format(apply_lg_attn_mask: bool, apply_t5_attn_mask: bool) -> te_cache.TeCacheFormat:
    """Upstream's <stem>_sd3_te.npz: lg_out, lg_pooled, t5_out, clip_l_attn_mask, clip_g_attn_mask, t5_attn_mask,
    apply_lg_attn_mask, apply_t5_attn_mask."""
    from library.te_cache import _numpy

    names = {"lg_out": "lg_out", "lg_pooled": "lg_pooled", "t5_out": "t5_out", "l_attn_mask": "clip_l_attn_mask",
             "g_attn_mask": "clip_g_attn_mask", "t5_attn_mask": "t5_attn_mask"}

    def to_file(o):
        return {theirs: _numpy(o[ours]) for ours, theirs in names.items()}

    def from_file(a):
        return {ours: torch.from_numpy(a[theirs]) for ours, theirs in names.items()}

    return te_cache.TeCacheFormat("_sd3_te.npz", tuple(names.values()), to_file, from_file,
                                  {"apply_lg_attn_mask": bool(apply_lg_attn_mask),
                                   "apply_t5_attn_mask": bool(apply_t5_attn_mask)})


POS_EMBED_MAX_RATIO = 1.5  # upstream's MMDiT: a scaled table covers 1.5 times its resolution's side
POS_EMBED_BASE_SIZE = 16  # upstream's get_scaled_2d_sincos_pos_embed base_size


def scaled_pos_embed_table(dim: int, patched_size: int) -> torch.Tensor:
    """Upstream's scaled sin-cos table for a training side of `patched_size` patches: [1, n * n, dim], n = 1.5x
    the side; its centred `patched_size` square spans the positions 0..16 (base size) whatever the resolution."""
    from diffusers.models.embeddings import get_2d_sincos_pos_embed_from_grid

    n = int(patched_size * POS_EMBED_MAX_RATIO)
    coords = (torch.arange(n, dtype=torch.float64) - (n - patched_size) / 2) * POS_EMBED_BASE_SIZE / patched_size
    grid = torch.stack(torch.meshgrid(coords, coords, indexing="xy"), dim=0).reshape(2, 1, n, n)
    return get_2d_sincos_pos_embed_from_grid(dim, grid, output_type="pt").float().unsqueeze(0)


class ScaledPosEmbeds:
    """--enable_scaled_pos_embed (upstream's MMDiT.enable_scaled_pos_embed / cropped_scaled_pos_embed): one table
    per training side (patches); a latent takes the table whose area band holds its area (bands split halfway
    between neighbouring sides' areas, the largest up to its table's area), and a latent taller or wider than its
    table gets a new table for its longer side."""

    def __init__(self, dim: int, patched_sizes):
        self.dim = dim
        sizes = sorted(set(patched_sizes))
        bounds = [(a * a + b * b) // 2 for a, b in zip(sizes, sizes[1:])]
        bounds.append(int((sizes[-1] * POS_EMBED_MAX_RATIO) ** 2))
        self.bands = list(zip(bounds, sizes))
        self.tables = {s: scaled_pos_embed_table(dim, s) for s in sizes}

    def table_for(self, h: int, w: int, device) -> tuple[torch.Tensor, int]:
        """(table on `device`, its side) for a latent of h x w patches."""
        size = next((s for bound, s in self.bands if h * w <= bound), self.bands[-1][1])
        side = int(size * POS_EMBED_MAX_RATIO)
        if h > side or w > side:
            size = max(h, w)
            side = int(size * POS_EMBED_MAX_RATIO)
            logger.warning("scaled positional embeddings: a new table for %dx%d patches (taller or wider than the "
                           "training resolutions' tables)", h, w)
            if size not in self.tables:
                self.tables[size] = scaled_pos_embed_table(self.dim, size)
                self.bands = sorted(self.bands + [(side * side, size)])
        if self.tables[size].device != torch.device(device):
            self.tables[size] = self.tables[size].to(device)  # moved once, as upstream
        return self.tables[size], side


def set_pos_embed(transformer, crop_rate: float = 0.0, scaled: ScaledPosEmbeds | None = None) -> None:
    """The MMDiT's positional embeddings as upstream's: --pos_emb_random_crop_rate (while gradients are on, i.e.
    training steps, with this probability a random crop of the grid instead of the centred one) and
    --enable_scaled_pos_embed (`scaled`: the table for the latent's size instead of the model's own)."""
    patch = transformer.pos_embed
    centred = patch.cropped_pos_embed  # diffusers' (checks the size)

    def cropped_pos_embed(height, width):
        random_crop = bool(crop_rate) and torch.is_grad_enabled() and torch.rand(1).item() < crop_rate  # upstream's
        if scaled is None and not random_crop:
            return centred(height, width)
        h, w = height // patch.patch_size, width // patch.patch_size
        if scaled is not None:
            table, side = scaled.table_for(h, w, patch.pos_embed.device)
        else:
            table, side = patch.pos_embed, patch.pos_embed_max_size
        if random_crop:
            top = int(torch.randint(0, side - h + 1, (1,)).item())
            left = int(torch.randint(0, side - w + 1, (1,)).item())
        else:
            top, left = (side - h) // 2, (side - w) // 2
        grid = table.reshape(1, side, side, -1)[:, top:top + h, left:left + w, :]
        return grid.reshape(1, -1, grid.shape[-1])

    patch.cropped_pos_embed = cropped_pos_embed


# ---------------------------------------------------------------------------------------------------------------
# sampling and saving


def sample_images(args, components, *, device, epoch, steps, autocast=None, networks=()) -> list[str]:
    """Upstream's SD3 sampler (Euler on the discrete flow with shift 3.0, CFG) as diffusers'
    StableDiffusion3Pipeline over the live models: kohya prompt lines (--n, --l default 7.5, --s default 30, --w,
    --h, --d)."""
    from diffusers import StableDiffusion3Pipeline

    from library.flux_train_utils import sample_with_pipeline

    tok_l, tok_g, tok_t5 = components.tokenizers

    def make_pipeline():
        return StableDiffusion3Pipeline(
            transformer=components.transformer, scheduler=sd3_models.flow_match_scheduler(), vae=components.vae,
            text_encoder=components.clip_l, tokenizer=tok_l, text_encoder_2=components.clip_g, tokenizer_2=tok_g,
            text_encoder_3=components.t5xxl, tokenizer_3=tok_t5 if components.t5xxl is not None else None)

    def draw(pipe, p, generator):
        return pipe(prompt=p["prompt"], negative_prompt=p.get("negative_prompt") or "",
                    guidance_scale=p.get("scale", 7.5), width=p.get("width", 512), height=p.get("height", 512),
                    num_inference_steps=p.get("sample_steps", 30), generator=generator,
                    max_sequence_length=t5_length(args)).images[0]

    models = tuple(m for m in (components.vae, components.clip_l, components.clip_g, components.t5xxl)
                   if m is not None)
    return sample_with_pipeline(args, make_pipeline, models, draw, device=device, epoch=epoch, steps=steps,
                                autocast=autocast, networks=networks)


def save_checkpoint(args, components, path: str, metadata, save_dtype, swapper=None) -> None:
    """Upstream's sd3_train layout: the MMDiT and VAE in `path`; each trained text encoder beside it
    (<name>_clip_l.safetensors, _clip_g, _t5xxl)."""
    from library import files, saving

    if swapper is not None:
        swapper.synchronize()
    saving.save_safetensors_streaming(path, sd3_models.checkpoint_entries(components.transformer, components.vae,
                                                                          save_dtype),
                                      metadata, overwrite=args.overwrite_output)
    stem = path[: -len(".safetensors")] if path.endswith(".safetensors") else path
    for which in ("clip_l", "clip_g", "t5xxl"):
        model = getattr(components, which)
        if model is not None and any(p.requires_grad for p in model.parameters()):
            files.save_safetensors(sd3_models.text_encoder_state_dict(model, save_dtype), f"{stem}_{which}.safetensors",
                                   overwrite=True)


# ---------------------------------------------------------------------------------------------------------------
# sd3_train.py: the full fine-tune (the MMDiT, optionally CLIP-L/CLIP-G and T5-XXL)


def full_text_encoder_lrs(args) -> list[float]:
    """[CLIP-L, CLIP-G, T5-XXL]: --learning_rate_te1/2/3 (default --learning_rate; 0 = frozen); T5-XXL only with
    --train_t5xxl (upstream)."""
    def lr(value):
        return args.learning_rate if value is None else value

    return [lr(args.learning_rate_te1), lr(args.learning_rate_te2),
            lr(args.learning_rate_te3) if args.train_t5xxl else 0.0]


def check_full_args(args, target) -> None:
    """sd3_train.py's own options, before the family's checks."""
    from library.errors import ConfigError
    from library.flux_train_utils import check_swap_and_blockwise

    caching = args.cache_text_encoder_outputs or args.cache_text_encoder_outputs_to_disk
    if args.train_text_encoder and caching and not args.use_t5xxl_cache_only:
        raise ConfigError("--train_text_encoder cannot be used with --cache_text_encoder_outputs (as upstream; "
                          "--use_t5xxl_cache_only caches T5-XXL's outputs only)")
    if args.train_t5xxl and not args.train_text_encoder:
        raise ConfigError("--train_t5xxl needs --train_text_encoder (as upstream)")
    if args.use_t5xxl_cache_only:
        if args.train_t5xxl:
            raise ConfigError("--train_t5xxl cannot be used with --use_t5xxl_cache_only (T5-XXL's outputs are "
                              "cached), as upstream")
        if not caching:
            logger.warning("--use_t5xxl_cache_only: --cache_text_encoder_outputs is turned on (as upstream)")
            args.cache_text_encoder_outputs = True
    check_swap_and_blockwise(args)
    if args.fused_optimizer_groups:
        logger.warning("--fused_optimizer_groups has no effect in sd3_train.py (upstream: \"[DOES NOT WORK]\"); "
                       "use --blockwise_fused_optimizers")
    if args.num_last_block_to_freeze is not None and args.num_last_block_to_freeze < 0:
        raise ConfigError(f"--num_last_block_to_freeze must be 0 or more, got {args.num_last_block_to_freeze}")
    if args.save_model_as not in (None, "safetensors"):
        logger.warning("--save_model_as %s: sd3_train.py writes the SAI single file (as upstream)", args.save_model_as)


def normalise_full_args(args) -> None:
    """sd3_train.py's deprecated form (train_util.normalise_args runs it after parsing)."""
    if args.skip_latents_validity_check:
        logger.warning("--skip_latents_validity_check is deprecated: use --skip_cache_check")
        args.skip_cache_check = True


def place_for_full_training(args, accelerator, family, components, train_dtype):
    """The MMDiT (without its last --num_last_block_to_freeze joint blocks) and the text encoders whose learning
    rate is not 0 (with --train_text_encoder) are trained; with --blocks_to_swap only the resident blocks go to the
    device."""
    from library import sharding
    from library.block_swap import BlockSwapError, place_with_block_swap
    from library.errors import ConfigError
    from library.network_trainer import Trainable

    device = accelerator.device
    if args.use_t5xxl_cache_only and components.t5xxl is not None:
        components.t5xxl = None  # its outputs are cached: freed, as upstream
        logger.info("--use_t5xxl_cache_only: T5-XXL freed, its outputs come from the cache")
    model = components.transformer
    model.to(dtype=train_dtype).requires_grad_(True)
    frozen = min(args.num_last_block_to_freeze or 0, len(model.transformer_blocks))
    for block in list(model.transformer_blocks)[len(model.transformer_blocks) - frozen:]:
        block.requires_grad_(False)
    if frozen:
        logger.info("the last %d joint blocks are frozen (--num_last_block_to_freeze)", frozen)
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": args.learning_rate}]
    models, trained = [model], []
    if args.train_text_encoder:
        for te, lr, label in zip((components.clip_l, components.clip_g, components.t5xxl), full_text_encoder_lrs(args),
                                 ("CLIP-L", "CLIP-G", "T5-XXL")):
            if te is None or not lr:
                continue
            te.requires_grad_(True).to(device, dtype=train_dtype).train()
            groups.append({"params": list(te.parameters()), "lr": lr})
            models.append(te)
            trained.append(te)
            logger.info("training %s, learning rate %s", label, lr)
    if args.gradient_checkpointing:
        family.enable_gradient_checkpointing(args, components, trained)
    model.train()
    if args.blocks_to_swap:
        try:
            family.swapper = place_with_block_swap(model, args.blocks_to_swap, device, trainable=True)
        except BlockSwapError as e:
            raise ConfigError(str(e)) from e
    elif not sharding.shards(args, accelerator):  # (--fsdp: fully_shard places it block by block)
        model.to(device)
    logger.info("training the SD3 MMDiT: %.2fM parameters in %s",
                sum(p.numel() for g in groups for p in g["params"]) / 1e6, str(train_dtype).removeprefix("torch."))
    return Trainable(models=models, param_groups=groups, train_text_encoder=bool(trained))

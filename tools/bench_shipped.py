"""Times the SHIPPED trainers (what users run) on random full-size SDXL or FLUX.1 checkpoints, eager and compiled.

    python tools/bench_shipped.py prepare --workdir W [--family flux|sd3-medium|...] [--buckets] [--tiny]
    python tools/bench_shipped.py run --workdir W --steps 60 [--family flux] [--gradient_checkpointing]
           [--batch_size 4] [--phases eager,compiled] [--compile_mode reduce-overhead] [--scripts_dir OTHER/sd-scripts]
           [--buckets] [--recompiles] [--time_graphs] [--cache_tag T] [--timeout S] [--log_out FILE]
           [--json_out FILE] [--upstream_dir D --upstream_pythonpath P] [-- more trainer flags]
    python tools/bench_shipped.py report FILE.json ...  # the runs' --json_out files -> default-vs-best table
    python tools/bench_shipped.py table --workdir W --out DIR [--family sdxl|flux] [--rows a,b] [--budget S]
           [--steps 20] [-- trainer flags for every row]  # issue 25's whole table, see "The table" below

`prepare` writes random weights in users' file layouts (nothing is downloaded): SDXL `W/sdxl.safetensors` (SGM
keys, bf16); FLUX.1 `W/flux/` with the BFL dev transformer, CLIP-L, T5-XXL (bf16) and the AE, all full size. Plus
tokenizers and a kohya image folder (its images repeated `--repeats` times, so that the timed steps fall inside
one epoch, as on a user's dataset); `--family sd15`: an SD1.5 single file `W/sd15.safetensors` the same way, timed
with `train_network.py --torch_compile` (the SD1.x scripts' compile switch); `--family sd21`: an SD2.1 768-v single file
`W/sd21.safetensors` (v-prediction), timed the same way with `--v2 --v_parameterization`. `run` starts `sdxl_train_network.py`
(LoRA r32) or `flux_train_network.py` (LoRA r16) once per phase (bf16, AdamW, cached latents and text-encoder outputs) and reports two figures per phase:
- the trainer's own summary line ("median step ... ms"; library/step_timer.py), and
- a measurement from outside: the time between the progress lines the trainer prints (at most one a second)
  after the warm-up steps. It needs nothing from the trainer but its progress line, so it also times older
  versions of the scripts (`--scripts_dir`), for before/after comparisons in one call.
Run it on a CUDA machine; the figures go to docs/BENCHMARKS.md.

Bucketed datasets (`prepare --buckets`, `run --buckets`): `W/data_buckets` holds --bucket_images images of each of
BUCKET_SIZES (four 1024 px-area buckets), trained with --enable_bucket, so the compiled trainer meets four input
shapes in a shuffled order. A run then also reports, from the trainer's log: each new input shape and the step it
came at, the setup steps (compile, CUDA-graph recording) and their total time from the trainer's summary, and with
--recompiles (TORCH_LOGS=recompiles) torch's recompiles, counted by how many shapes had been seen when each came.
Every compiled run reports `compile_line_to_step2_done_s`: from the trainer's "Compiling ... with torch.compile"
line to its progress line for step 1, which it prints once step 2 has run (the loss is read a step late); step 3
done (issue 15's warm-restart target) is one more step, whose time the summary's median gives. `--cache_tag` runs on the compile
cache of another tag (a warm restart); `--time_graphs` runs the trainer through tools/graph_timing.py.

The families after FLUX.1 (issue 28 item 6; `--family sd3-medium|sd3-large|chroma|lumina|hunyuan-image|anima`):
`prepare` writes random full-size bf16 files in the layouts users download and upstream reads (shapes from each
model's published config, written down at SD35_MEDIUM and below): SD3.5 as SAI's single file (MMDiT + VAE) with
separate clip_l / clip_g / t5xxl files; Chroma as its distributed single file with FLUX.1's T5-XXL and AE; Lumina 2
as its single file with Gemma 2 2B and the AE; HunyuanImage 2.1's DiT, Qwen2.5-VL (QWEN25_VL_BENCH_LAYERS of its 28
layers: its outputs are cached before the loop), glyph byT5 and VAE; Anima's DiT (with its LLM adapter), Qwen3-0.6B
and the Qwen-Image VAE; tokenizers in both sides' layouts (HunyuanImage and Anima: upstream's own Qwen and T5
tokenizer files from `--upstream_dir`'s configs/; `--tiny`: the same at test size).
`run --phases upstream,compiled,eager` adds a phase that starts upstream kohya-ss/sd-scripts' own script from
`--upstream_dir` (no compile, as its users run it) with `--upstream_pythonpath` as its whole PYTHONPATH (its pinned
packages); its progress is a tqdm bar, read for the median step and the first step. Every run also polls
nvidia-smi for the peak memory.used, the same outside figure for both sides. `report` prints these families' rows
apart (ours compiled / ours eager / upstream, upstream's step over ours, memory, first step). gpu/README (not in
git) holds the device scripts.

The table (`table`, issue 25 item 5): prepares the family's random full-size model once, empties one compile cache
folder and runs every row of TABLES[family] in order, each as a user gets it (the GUI's Enable torch.compile:
`--compile --compile_mode reduce-overhead`, nothing else) or with the best opt-in where one still beats the default:
SDXL bs1 + GC cold, its warm restart (a new process on the same cache), AdamW8bit / Prodigy / Adafactor at bs1 + GC,
bs1, bs4 + GC, then `--compile_checkpoint_keep resnets` opt-ins; FLUX.1 1024 + GC cold and warm. Later rows start
warm where an earlier row compiled the same graphs (the cache column says what each got). `--budget` skips the rows
that no longer fit (TableRow.need_s). Writes DIR/table_<family>.json (every run's figures) and DIR/table_<family>.md:
per workload ours default, best opt-in, the issue's target and met/missed judged from the figures, then every run
(auto's choices, median step, peak by the trainer and by nvidia-smi, first step, compile line to step 2, cache,
wall). `report DIR/table_<family>.json` prints the table again.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
SD_SCRIPTS = REPO / "sd-scripts"

PROGRESS = re.compile(r"^steps: (\d+)/(\d+) ")
# upstream's progress: a tqdm bar ("steps:  10%|█         | 3/30 [00:05<00:45,  1.69s/it, avr_loss=0.5]"), redrawn
# after each step with a carriage return
TQDM = re.compile(r"^steps:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)\s*\[")
SUMMARY = re.compile(r"^median step ([\d.]+) ms \(steps (\d+)-(\d+)\)(?:; (.*))?$")
PEAK = re.compile(r"peak GPU memory ([\d.]+) GiB")
SETUP = re.compile(r"(\d+) input shapes: (\d+) setup steps \(([^)]*)\) ([\d.]+) s in all")
NEW_SHAPE = re.compile(r"torch\.compile: new input shape (\S+)(?: at step (\d+))? \((\d+) so far\)")
COMPILING = re.compile(r"Compiling .* with torch\.compile")
RECOMPILE = "Recompiling function"
GRAPH_TIMING = re.compile(r"^graph_timing: (\{.*\})$")
COUNTERS = re.compile(r"^graph_timing counters: (\{.*\})$")  # torch's cache hits/misses, frames (tools/graph_timing.py)
COMPILE_TIME = re.compile(r"^([A-Za-z_][\w.]*), ([\d.]+)$")  # a row of torch's compile_times table
# where the time to step 2 goes: the first line of each stage (seconds since the process started)
TIMELINE = {"first_log_line": re.compile(r" INFO "), "model_loaded": re.compile(r"loaded .*model from|FLUX\.1 \w+: \d+ double"), "caching_latents": re.compile(r"caching latents"),
            "caching_text": re.compile(r"caching text encoder outputs"), "compile_line": COMPILING}

# the image folder's repeats: an epoch longer than a run's steps, as on a user's dataset (an epoch's end waits for
# the GPU; a one-batch epoch would do that every step)
REPEATS = 40

# (width, height) of the bucketed set: four buckets of about 1024x1024 pixels, as SDXL users train
BUCKET_SIZES = ((1024, 1024), (896, 1152), (1152, 896), (832, 1216))


def prepare(workdir: Path, images: int, resolution: int, checkpoint: str | None = None, family: str = "sdxl",
            bucket_images: int = 0, repeats: int = REPEATS, tiny: bool = False) -> None:
    sys.path.insert(0, str(SD_SCRIPTS))
    if bucket_images:
        make_bucket_images(workdir, bucket_images)
    if family == "flux":
        prepare_flux(workdir / "flux")
        return make_images(workdir, images, resolution, repeats)
    if family in NEW_FAMILIES:
        prepare_family(workdir, family, tiny)
        return make_images(workdir, images, resolution, repeats)
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTokenizer

    from library import flux_tiny, model_util, tiny_models
    from library.model_util import SDComponents, load_arch_config

    workdir.mkdir(parents=True, exist_ok=True)
    arch = {"sd15": "sd1", "sd21": "sd2"}.get(family, "sdxl")  # library/configs' folder
    ckpt = workdir / f"{family}.safetensors"
    if checkpoint and not ckpt.exists():  # a single file (tokenizers beside it), e.g. the tests' tiny one
        os.symlink(Path(checkpoint).resolve(), ckpt)
        os.symlink(Path(checkpoint).resolve().parent / "tokenizers", workdir / "tokenizers")
    if not ckpt.exists():
        tok_dirs = [tiny_models.make_tiny_tokenizer(workdir / "tokenizers" / "tokenizer")] + \
            ([tiny_models.make_tiny_tokenizer(workdir / "tokenizers" / "tokenizer_2", pad_token="!")]
             if arch == "sdxl" else [])
        t0 = time.perf_counter()

        def random(module_fn, seed):  # full size, built without init and filled from a random pool
            with init_empty_weights():
                m = module_fn()
            return flux_tiny._randomize(m.to(torch.bfloat16).to_empty(device="cpu"), seed, std=0.02)

        tes = [random(lambda c=c: model_util._clip_class(load_arch_config(arch, c))(
            model_util._clip_config(load_arch_config(arch, c))), i)
            for i, c in enumerate(("text_encoder", "text_encoder_2")[:len(tok_dirs)])]
        unet = random(lambda: UNet2DConditionModel.from_config(load_arch_config(arch, "unet")), 2)
        vae = random(lambda: AutoencoderKL.from_config(load_arch_config(arch, "vae")), 3)
        comps = SDComponents(family=arch, unet=unet, vae=vae, text_encoders=tes,
                             tokenizers=[CLIPTokenizer.from_pretrained(str(d)) for d in tok_dirs],
                             prediction_type="v_prediction" if arch == "sd2" else "epsilon",
                             source=f"random full-size {family}")
        model_util.save_sd_checkpoint(ckpt, comps, save_dtype=torch.bfloat16)
        print(f"wrote {ckpt} ({ckpt.stat().st_size / 2**30:.1f} GiB) in {time.perf_counter() - t0:.0f} s")
    make_images(workdir, images, resolution, repeats)


# FLUX.1-dev's shapes (black-forest-labs/FLUX.1-dev): transformer, CLIP-L and T5-XXL v1.1 encoder, AE
FLUX_DEV = dict(width=3072, num_double=19, num_single=38, t5_dim=4096, clip_dim=768, guidance=True)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
FLUX_AE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
               up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
               latent_channels=16, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False)


def prepare_flux(dest: Path, shapes: dict | None = None) -> None:
    """The four FLUX.1 files a user passes (--pretrained_model_name_or_path, --clip_l, --t5xxl, --ae) with random
    weights, plus tokenizers (character vocabularies; ids stay inside the real vocabularies). `shapes` overrides
    the model sizes (the CPU test makes a small set)."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from library import flux_models, flux_tiny

    shapes = {"transformer": FLUX_DEV, "clip_l": CLIP_L, "t5xxl": T5_XXL, "ae": FLUX_AE, **(shapes or {})}
    if (dest / "ae.safetensors").exists():
        return
    dest.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    flux_tiny.make_clip_tokenizer(dest / "tokenizers" / "tokenizer")
    flux_tiny.make_t5_tokenizer(dest / "tokenizers" / "tokenizer_2")

    def random(module_fn, seed, dtype):
        with init_empty_weights():
            m = module_fn()
        return flux_tiny._randomize(m.to(dtype).to_empty(device="cpu"), seed, std=0.02)

    def write(name, sd):
        save_file({k: v.contiguous() for k, v in sd.items()}, str(dest / name))
        print(f"wrote {dest / name} ({(dest / name).stat().st_size / 2**30:.1f} GiB) "
              f"at {time.perf_counter() - t0:.0f} s", flush=True)

    transformer = flux_tiny.tiny_transformer(**shapes["transformer"], dtype=torch.bfloat16)
    write("flux.safetensors", flux_models.diffusers_to_bfl(transformer.state_dict()))
    del transformer
    clip = random(lambda: CLIPTextModel(CLIPTextConfig(**shapes["clip_l"])), 1, torch.bfloat16)
    write("clip_l.safetensors", {"text_model." + k.removeprefix("text_model."): v
                                 for k, v in clip.state_dict().items()})
    t5 = random(lambda: T5EncoderModel(T5Config(**shapes["t5xxl"])), 2, torch.bfloat16)
    write("t5xxl.safetensors", {k: v for k, v in t5.state_dict().items() if k != "encoder.embed_tokens.weight"})
    del t5
    ae = random(lambda: AutoencoderKL(**shapes["ae"], scaling_factor=flux_models.AE_SCALING_FACTOR,
                                      shift_factor=flux_models.AE_SHIFT_FACTOR), 3, torch.float32)
    write("ae.safetensors", flux_models.ae_diffusers_to_bfl(ae.state_dict()))


# ---------------------------------------------------------------------------------------------------------------
# The families after FLUX.1 (issue 28): SD3.5 medium / large, Chroma, Lumina 2. Shapes from each model's published
# config; TINY_SHAPES (prepare --tiny) are the same layouts at test size, for the CPU check of the GPU scripts.

# stabilityai/stable-diffusion-3.5-medium transformer/config.json (SD3Transformer2DModel)
SD35_MEDIUM = dict(num_layers=24, num_attention_heads=24, attention_head_dim=64, joint_attention_dim=4096,
                   caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384, sample_size=128,
                   qk_norm="rms_norm", dual_attention_layers=tuple(range(13)))
# stabilityai/stable-diffusion-3.5-large transformer/config.json
SD35_LARGE = dict(num_layers=38, num_attention_heads=38, attention_head_dim=64, joint_attention_dim=4096,
                  caption_projection_dim=2432, pooled_projection_dim=2048, pos_embed_max_size=192, sample_size=128,
                  qk_norm="rms_norm", dual_attention_layers=())
# stabilityai/stable-diffusion-3.5-large text_encoder_2/config.json (CLIP-G, CLIPTextModelWithProjection); CLIP-L is
# CLIP_L above (text_encoder/config.json)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
# lodestones/Chroma1-HD transformer/config.json (ChromaTransformer2DModel; upstream's chroma_params)
CHROMA = dict(num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
              joint_attention_dim=4096, approximator_num_channels=64, approximator_hidden_dim=5120,
              approximator_layers=5)
# Alpha-VLLM/Lumina-Image-2.0 transformer/config.json (Lumina2Transformer2DModel; upstream's NextDiT 2B)
LUMINA2 = dict(hidden_size=2304, num_layers=26, num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8,
               axes_dim_rope=(32, 32, 32), axes_lens=(300, 512, 512), cap_feat_dim=2304)
# google/gemma-2-2b config.json (upstream's lumina_util GEMMA2_CONFIG)
GEMMA2_2B = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                 hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, attn_logit_softcapping=50.0,
                 final_logit_softcapping=30.0, sliding_window=4096, max_position_embeddings=8192, pad_token_id=0,
                 eos_token_id=1, bos_token_id=2)

# HunyuanImage 2.1 (tencent/HunyuanImage-2.1 dit/hunyuanimage2.1.safetensors; upstream's fixed
# HYImageDiffusionTransformer): library.hunyuan_image_models.DiTConfig's defaults, 20 double + 40 single blocks, width
# 3584, 17.0B parameters. Its text encoders as upstream's fixed configs (hunyuan_image_text_encoder): Qwen2.5-VL 7B
# (Comfy-Org's qwen_2.5_vl_7b: language model, vision tower, lm_head) and the glyph byT5-small (vocabulary enlarged
# by upstream's 138 colour + 988 font tokens); the VAE as upstream's HunyuanVAE2D.
HUNYUAN_DIT = dict(width=3584, heads=28, double_blocks=20, single_blocks=40, refiner_blocks=2, in_channels=64,
                   text_dim=3584, byt5_dim=1472, byt5_hidden=2048, byt5_out=2048, mlp_ratio=4.0)
QWEN25_VL_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, rms_norm_eps=1e-6, max_position_embeddings=128000,
                      hidden_act="silu", rope_theta=1000000.0, mrope_section=[16, 24, 24])
QWEN25_VL_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                        patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                        fullatt_block_indexes=[7, 15, 23, 31], in_channels=3, hidden_act="silu")
# Qwen2.5-VL's layers in the benchmark's file: its outputs are cached before the training loop, so its depth only
# changes the caching time (upstream's encoder takes the third-last hidden state: 3 layers or more)
QWEN25_VL_BENCH_LAYERS = 4
BYT5_GLYPH = dict(vocab_size=384 + 138 + 988, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
                  feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, is_encoder_decoder=False,
                  use_cache=False)
HUNYUAN_VAE = dict(in_channels=3, out_channels=3, latent_channels=64,
                   block_out_channels=(128, 256, 512, 512, 1024, 1024), layers_per_block=2,
                   spatial_compression_ratio=32, sample_size=384)
# Anima (circlestone-labs/Anima; upstream's fixed dit_config: the Cosmos-Predict2 2B DiT with its LLM adapter) and
# Qwen3-0.6B (upstream's configs/qwen3_06b); the Qwen-Image VAE is diffusers' AutoencoderKLQwenImage default.
ANIMA = dict(model_channels=2048, num_blocks=28, num_heads=16)
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128)

# Test size, for the CPU check of the GPU scripts. Upstream builds the AE, the text encoders, Chroma and Lumina 2
# from fixed configs (gpu/cpu_shim/tiny_upstream.py sets those to these sizes on the CPU), infers an SD3 model's
# layers and heads both from its width (every SD3 model has as many of each) and pads CLIP's outputs to 4096
# (T5-XXL's width), so the AE, T5's width and the joint attention width stay full size.
TINY_SHAPES = {
    "clip_l": dict(CLIP_L, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   projection_dim=32),
    "clip_g": dict(CLIP_G, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   projection_dim=32),
    "t5xxl": dict(T5_XXL, d_kv=8, d_ff=64, num_layers=1, num_heads=2),  # d_model stays 4096: upstream pads CLIP to it
    "sd3-medium": dict(SD35_MEDIUM, num_layers=2, num_attention_heads=2,
                       caption_projection_dim=128, pooled_projection_dim=64, pos_embed_max_size=16,
                       dual_attention_layers=(0,)),
    "sd3-large": dict(SD35_LARGE, num_layers=2, num_attention_heads=2,
                      caption_projection_dim=128, pooled_projection_dim=64, pos_embed_max_size=16),
    "chroma": dict(CHROMA, num_layers=1, num_single_layers=1, num_attention_heads=1,
                   approximator_hidden_dim=64, approximator_layers=2),
    "lumina": dict(LUMINA2, hidden_size=48, num_layers=2, num_attention_heads=2, num_kv_heads=1,
                   axes_dim_rope=(8, 8, 8), cap_feat_dim=32),
    "gemma2": dict(GEMMA2_2B, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1),
    # HunyuanImage 2.1: upstream's byT5 width, Qwen's vocabulary and the whole VAE stay (cpu_shim shrinks the rest)
    "hunyuan-image": dict(HUNYUAN_DIT, width=64, heads=2, double_blocks=1, single_blocks=1, text_dim=64),
    "qwen25_vl_text": dict(QWEN25_VL_TEXT, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, mrope_section=[2, 3, 3]),
    "qwen25_vl_vision": dict(QWEN25_VL_VISION, depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                             out_hidden_size=64, fullatt_block_indexes=[0]),
    "byt5": dict(BYT5_GLYPH, d_kv=8, d_ff=64, num_layers=1, num_heads=2),
    # Anima: the LLM adapter is fixed upstream (1024 wide), so Qwen3's width stays; the whole VAE stays
    "anima": dict(ANIMA, model_channels=64, num_blocks=1, num_heads=2),
    "qwen3": dict(QWEN3_06B, intermediate_size=64, num_hidden_layers=1),
}
NEW_FAMILIES = ("sd3-medium", "sd3-large", "chroma", "lumina", "hunyuan-image", "anima")


def _random_module(module_fn, seed: int, dtype, on_gpu: bool = False):
    """A module built without init (full size costs nothing) and filled from a random pool (`on_gpu`: drawn on the
    GPU where there is one: HunyuanImage's 17B parameters take a minute from the CPU's pool, seconds this way); its
    buffers (computed ones such as SD3's positional embedding) are kept."""
    import torch
    from accelerate import init_empty_weights

    from library import flux_tiny

    with init_empty_weights():
        m = module_fn()
    buffers = {n: b.clone() for n, b in m.named_buffers()}
    m = m.to(dtype).to_empty(device="cpu")
    m = _draw_random(m, seed, std=0.02) if on_gpu else flux_tiny._randomize(m, seed, std=0.02)
    with torch.no_grad():
        for n, b in m.named_buffers():
            if n in buffers:
                b.copy_(buffers[n])
    return m


def _draw_random(model, seed: int, std: float):
    """Normal(0, std) weights, norm weights 1 + Normal(0, 0.1) (as flux_tiny._randomize's pools), drawn on the GPU
    if there is one and copied into the CPU module in its dtype."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, device=device)
            norm = p.ndim == 1 and "norm" in name and name.endswith(".weight")
            p.copy_((1 + 0.1 * r if norm else r * std).to(p.dtype))
    return model


class _Writer:
    def __init__(self, dest: Path):
        self.dest, self.t0 = dest, time.perf_counter()
        dest.mkdir(parents=True, exist_ok=True)

    def __call__(self, name: str, sd: dict) -> str:
        from safetensors.torch import save_file

        path = self.dest / name
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) at {time.perf_counter() - self.t0:.0f} s",
              flush=True)
        return str(path)


def make_family_tokenizers(dest: Path, which: tuple[str, ...]) -> None:
    """Character tokenizers (ids inside the real vocabularies) in the layouts both sides read from
    --tokenizer_cache_dir: ours (tokenizer/ = CLIP-L, tokenizer_2/ = CLIP-G or FLUX's T5, tokenizer_3/ = SD3's T5,
    a Gemma tokenizer at the top) and upstream's (a folder per hub id with "/" -> "_"; Gemma in the hub's cache
    layout, which upstream's AutoTokenizer.from_pretrained(GEMMA_ID, cache_dir=...) reads offline)."""
    import shutil

    from library import flux_tiny, lumina_models

    hub_dirs = {"clip_l": "openai_clip-vit-large-patch14", "clip_g": "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k",
                "t5xxl": "google_t5-v1_1-xxl"}
    ours = {"sd3": {"clip_l": "tokenizer", "clip_g": "tokenizer_2", "t5xxl": "tokenizer_3"},
            "flux": {"clip_l": "tokenizer", "t5xxl": "tokenizer_2"}}
    layout = ours["sd3" if "clip_g" in which else "flux"]
    for w in which:
        if w == "gemma2":
            lumina_models.make_gemma_tokenizer(dest)
            snap = dest / "models--google--gemma-2-2b" / "snapshots" / ("0" * 40)
            snap.mkdir(parents=True, exist_ok=True)
            (dest / "models--google--gemma-2-2b" / "refs").mkdir(exist_ok=True)
            (dest / "models--google--gemma-2-2b" / "refs" / "main").write_text("0" * 40)
            for f in ("tokenizer.json", "special_tokens_map.json", "tokenizer_config.json"):
                if (dest / f).exists():
                    shutil.copy(dest / f, snap / f)
            _config_for_transformers4(snap / "tokenizer_config.json", "GemmaTokenizerFast")
            (snap / "config.json").write_text(json.dumps({"model_type": "gemma2"}))  # AutoTokenizer asks for it
            continue
        make = flux_tiny.make_t5_tokenizer if w == "t5xxl" else flux_tiny.make_clip_tokenizer
        tok = make(dest / layout[w])
        shutil.copytree(dest / layout[w], dest / hub_dirs[w], dirs_exist_ok=True)
        if w != "t5xxl":  # upstream's slow CLIPTokenizer (transformers 4.x) reads vocab.json and merges.txt
            (dest / hub_dirs[w] / "vocab.json").write_text(json.dumps(tok.get_vocab()))
            (dest / hub_dirs[w] / "merges.txt").write_text("#version: 0.2\n")
        _config_for_transformers4(dest / hub_dirs[w] / "tokenizer_config.json")


def _config_for_transformers4(path: Path, tokenizer_class: str | None = None) -> None:
    """A tokenizer_config.json as transformers 4.x (upstream's pin) reads it: without the keys 5.x adds."""
    cfg = json.loads(path.read_text())
    for k in ("backend", "extra_special_tokens"):
        cfg.pop(k, None)
    if tokenizer_class:
        cfg["tokenizer_class"] = tokenizer_class
    path.write_text(json.dumps(cfg, indent=1))


def _text_encoder_files(w: _Writer, which: tuple[str, ...], shapes: dict) -> None:
    """Each text encoder as its own file, as users download them (transformers' keys: SD3's
    text_encoders/clip_l.safetensors, clip_g.safetensors, t5xxl_fp16.safetensors; FLUX.1's t5xxl_fp16; Gemma 2 2B)."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, Gemma2Config, Gemma2Model, T5Config
    from transformers import T5EncoderModel

    from library import sd3_models

    for i, name in enumerate(which):
        if (w.dest / f"{name}.safetensors").exists():
            continue
        if name in ("clip_l", "clip_g"):
            m = _random_module(lambda: CLIPTextModelWithProjection(CLIPTextConfig(**shapes[name])), i, torch.bfloat16)
        elif name == "t5xxl":
            m = _random_module(lambda: T5EncoderModel(T5Config(**shapes[name])), i, torch.bfloat16)
        else:
            m = _random_module(lambda: Gemma2Model(Gemma2Config(**shapes[name])), i, torch.bfloat16)
        w(f"{name}.safetensors", sd3_models.text_encoder_state_dict(m))
        del m


def prepare_family(workdir: Path, family: str, tiny: bool = False) -> None:
    """Random full-size (or tiny) files of one of NEW_FAMILIES in users' layouts under W/<sd3|chroma|lumina>/
    (family_argv names them). Skips files already there."""
    import torch

    from library import chroma_models, flux_models, lumina_models, sd3_models
    from library.model_util import vae_to_ldm_state_dict

    shapes = {"clip_l": CLIP_L, "clip_g": CLIP_G, "t5xxl": T5_XXL, "ae": FLUX_AE, "sd3-medium": SD35_MEDIUM,
              "sd3-large": SD35_LARGE, "chroma": CHROMA, "lumina": LUMINA2, "gemma2": GEMMA2_2B,
              **(TINY_SHAPES if tiny else {})}
    if family in ("hunyuan-image", "anima"):
        return prepare_qwen_family(workdir, family, tiny)
    dest = family_dir(workdir, family)
    w = _Writer(dest)
    if not (dest / "tokenizers").exists():
        make_family_tokenizers(dest / "tokenizers", {"chroma": ("clip_l", "t5xxl"), "lumina": ("gemma2",)}.get(
            family, ("clip_l", "clip_g", "t5xxl")))

    def ae():
        from diffusers import AutoencoderKL
        return _random_module(lambda: AutoencoderKL(**shapes["ae"], scaling_factor=sd3_models.VAE_SCALING_FACTOR,
                                                    shift_factor=sd3_models.VAE_SHIFT_FACTOR), 9, torch.float32)

    main = dest / f"{family}.safetensors"
    if family.startswith("sd3"):
        _text_encoder_files(w, ("clip_l", "clip_g", "t5xxl"), shapes)
        if not main.exists():  # SAI's single file: MMDiT (model.diffusion_model.*) and VAE (first_stage_model.*)
            from diffusers import SD3Transformer2DModel

            mmdit = _random_module(lambda: SD3Transformer2DModel(
                patch_size=2, in_channels=16, out_channels=16, **shapes[family]), 10, torch.bfloat16)
            sd = {sd3_models.MMDIT_PREFIX + k: v for k, v in sd3_models.diffusers_to_sai(mmdit.state_dict()).items()}
            del mmdit
            sd.update({sd3_models.VAE_PREFIX + k: v.to(torch.bfloat16) for k, v in vae_to_ldm_state_dict(ae()).items()})
            w(main.name, sd)
            del sd
        return
    if not (dest / "ae.safetensors").exists():  # FLUX.1's ae.safetensors (BFL keys)
        w("ae.safetensors", flux_models.ae_diffusers_to_bfl(ae().state_dict()))
    if family == "chroma":
        _text_encoder_files(w, ("t5xxl",), shapes)
        if not main.exists():  # as distributed (Chroma1-HD.safetensors: BFL-style keys, no prefix)
            from diffusers import ChromaTransformer2DModel

            model = _random_module(lambda: ChromaTransformer2DModel(
                patch_size=1, in_channels=64, axes_dims_rope=list(flux_models.ROPE_AXES), **shapes["chroma"]),
                11, torch.bfloat16)
            w(main.name, chroma_models.diffusers_to_single_file(model.state_dict()))
            del model
        return
    _text_encoder_files(w, ("gemma2",), shapes)
    if not main.exists():  # upstream's single file (Lumina-Image-2.0's consolidated keys)
        from diffusers import Lumina2Transformer2DModel

        model = _random_module(lambda: Lumina2Transformer2DModel(
            sample_size=128, patch_size=2, in_channels=16, **shapes["lumina"]), 12, torch.bfloat16)
        w(main.name, lumina_models.diffusers_to_single_file(model.state_dict()))
        del model


UPSTREAM_CONFIGS = None  # upstream's configs/ folder (prepare --upstream_dir): its Qwen3 and T5 tokenizer files


def _qwen_tokenizer_files(dest: Path, hub_id: str | None = None) -> None:
    """Upstream's Qwen tokenizer files (configs/qwen3_06b: the byte-level BPE Qwen2.5 and Qwen3 share, the same 151k
    vocabulary and merges, <|im_start|>/<|im_end|> at the same ids) in `dest` (our --tokenizer_cache_dir layout) and,
    with `hub_id`, in a hub cache beside it (upstream's HunyuanImage loads Qwen2Tokenizer.from_pretrained(hub id)
    with no cache dir: HF_HUB_CACHE points there in its runs)."""
    import shutil

    src = Path(UPSTREAM_CONFIGS or "") / "qwen3_06b"
    if not (src / "vocab.json").is_file():
        raise SystemExit(f"prepare: upstream's Qwen tokenizer files not found in {src} (pass --upstream_dir)")
    targets = [dest]
    if hub_id:
        targets.append(_hub_snapshot(dest.parent / "hub", hub_id))
    for t in targets:
        t.mkdir(parents=True, exist_ok=True)
        for f in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            shutil.copy(src / f, t / f)


def _hub_snapshot(hub: Path, hub_id: str) -> Path:
    """A hub-cache snapshot folder for `hub_id` (what from_pretrained(hub_id) reads offline)."""
    repo = hub / ("models--" + hub_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def prepare_qwen_family(workdir: Path, family: str, tiny: bool = False) -> None:
    """HunyuanImage 2.1 or Anima, random full-size (or TINY_SHAPES) bf16 files in the layouts upstream's guides name,
    plus the tokenizers both sides read (upstream's own Qwen and T5 tokenizer files)."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3Model

    dest = family_dir(workdir, family)
    w = _Writer(dest)
    sz = {**{"hunyuan-image": HUNYUAN_DIT, "anima": ANIMA, "qwen3": QWEN3_06B, "byt5": BYT5_GLYPH,
             "qwen25_vl_text": dict(QWEN25_VL_TEXT, num_hidden_layers=QWEN25_VL_BENCH_LAYERS),
             "qwen25_vl_vision": QWEN25_VL_VISION}, **(TINY_SHAPES if tiny else {})}
    if family == "hunyuan-image":
        from diffusers import AutoencoderKLHunyuanImage
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, T5Config, T5EncoderModel

        from library import hunyuan_image_models as hm

        _qwen_tokenizer_files(dest / "tokenizers" / "qwen", hub_id=hm.QWEN_ID)
        snap = _hub_snapshot(dest / "tokenizers" / "hub", "google/byt5-small")  # ByT5Tokenizer needs no vocabulary
        (snap / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer", "extra_ids": 125}))
        (snap / "config.json").write_text(json.dumps({"model_type": "t5"}))
        if not (dest / "qwen_2.5_vl_7b.safetensors").exists():  # Comfy-Org's keys: model.*, visual.*, lm_head
            text = dict(sz["qwen25_vl_text"])
            text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                                       "mrope_section": text.pop("mrope_section")}
            cfg = Qwen2_5_VLConfig(text_config=text, vision_config=sz["qwen25_vl_vision"],
                                   vocab_size=text["vocab_size"], tie_word_embeddings=False)
            m = _random_module(lambda: Qwen2_5_VLForConditionalGeneration(cfg), 1, torch.bfloat16, True)
            sd = {}
            for k, v in m.state_dict().items():
                for a, b in (("model.language_model.", "model."), ("model.visual.", "visual.")):
                    if k.startswith(a):
                        k = b + k[len(a):]
                        break
                sd[k] = v
            w("qwen_2.5_vl_7b.safetensors", sd)
            del m, sd
        if not (dest / "byt5.safetensors").exists():
            m = _random_module(lambda: T5EncoderModel(T5Config(**sz["byt5"])), 2, torch.float16, True)
            w("byt5.safetensors", {k: v for k, v in m.state_dict().items() if k != "encoder.embed_tokens.weight"})
            del m
        if not (dest / "vae.safetensors").exists():
            vae = _random_module(lambda: AutoencoderKLHunyuanImage(
                **HUNYUAN_VAE, scaling_factor=hm.LATENT_SCALING_FACTOR), 3, torch.float16, True)
            w("vae.safetensors", hm.vae_diffusers_to_upstream(vae.state_dict(), HUNYUAN_VAE["layers_per_block"]))
            del vae
        if not (dest / "hunyuan-image.safetensors").exists():
            dit = _random_module(lambda: hm.HunyuanImageDiT(hm.DiTConfig(**sz["hunyuan-image"])), 4, torch.bfloat16,
                                 True)
            w("hunyuan-image.safetensors", dit.state_dict())
            del dit
        return
    from diffusers import AutoencoderKLQwenImage

    from library import anima_models as am

    _qwen_tokenizer_files(dest / "tokenizers" / "qwen3")
    t5 = dest / "tokenizers" / "t5"  # upstream's configs/t5_old (T5-v1.1's sentencepiece), for --t5_tokenizer_path
    t5.mkdir(parents=True, exist_ok=True)
    for f in ("spiece.model", "tokenizer.json"):
        shutil.copy(Path(UPSTREAM_CONFIGS) / "t5_old" / f, t5 / f)
    (t5 / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer", "eos_token": "</s>",
                                                          "unk_token": "<unk>", "pad_token": "<pad>",
                                                          "extra_ids": 100, "model_max_length": 512}))
    if not (dest / "qwen3.safetensors").exists():  # Comfy-Org's qwen_3_06b_base: model.* keys (lm_head tied)
        cfg = Qwen3Config(**sz["qwen3"], tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0)
        m = _random_module(lambda: Qwen3Model(cfg), 1, torch.bfloat16, True)
        w("qwen3.safetensors", {"model." + k: v for k, v in m.state_dict().items()})
        del m
    if not (dest / "vae.safetensors").exists():  # diffusers' keys (upstream's "official" layout)
        w("vae.safetensors", _random_module(AutoencoderKLQwenImage, 3, torch.bfloat16, True).state_dict())
    if not (dest / "anima.safetensors").exists():
        dit = _random_module(lambda: am.Anima(am.AnimaConfig(**sz["anima"])), 4, torch.bfloat16, True)
        sd = {"net." + k: v for k, v in dit.state_dict().items()}
        w("anima.safetensors", sd)
        del dit, sd


def family_dir(workdir: Path, family: str) -> Path:
    return workdir / ("sd3" if family.startswith("sd3") else family)


def family_argv(workdir: Path, family: str) -> list[str]:
    """The model flags of one of NEW_FAMILIES, the same for our scripts and upstream's: the files prepare_family
    wrote, the family's LoRA module, and what upstream's docs say the family needs (Chroma: --guidance_scale 0.0,
    --apply_t5_attn_mask; SD3 and Chroma: --sdpa)."""
    d = family_dir(workdir, family)
    argv = ["--pretrained_model_name_or_path", str(d / f"{family}.safetensors"),
            "--tokenizer_cache_dir", str(d / "tokenizers")]
    if family.startswith("sd3"):
        return argv + ["--clip_l", str(d / "clip_l.safetensors"), "--clip_g", str(d / "clip_g.safetensors"),
                       "--t5xxl", str(d / "t5xxl.safetensors"), "--network_module", "networks.lora_sd3", "--sdpa"]
    if family == "chroma":
        return argv + ["--model_type", "chroma", "--t5xxl", str(d / "t5xxl.safetensors"),
                       "--ae", str(d / "ae.safetensors"), "--guidance_scale", "0.0", "--apply_t5_attn_mask",
                       "--network_module", "networks.lora_flux", "--sdpa"]
    if family == "hunyuan-image":
        # upstream's guide's attention flags (one sample: SDPA over its own tokens); the text-encoder outputs cached on
        # disk: upstream's in-memory cache fails as the batch is built (torch.FloatTensor(numpy.bool_) for ocr_mask)
        return ["--cache_text_encoder_outputs_to_disk",
                "--pretrained_model_name_or_path", str(d / "hunyuan-image.safetensors"),
                "--text_encoder", str(d / "qwen_2.5_vl_7b.safetensors"), "--byt5", str(d / "byt5.safetensors"),
                "--vae", str(d / "vae.safetensors"), "--tokenizer_cache_dir", str(d / "tokenizers" / "qwen"),
                "--attn_mode", "torch", "--split_attn", "--network_module", "networks.lora_hunyuan_image"]
    if family == "anima":
        return ["--pretrained_model_name_or_path", str(d / "anima.safetensors"),
                "--qwen3", str(d / "qwen3.safetensors"), "--vae", str(d / "vae.safetensors"),
                "--tokenizer_cache_dir", str(d / "tokenizers"),
                "--t5_tokenizer_path", str(d / "tokenizers" / "t5"), "--network_module", "networks.lora_anima"]
    return argv + ["--gemma2", str(d / "gemma2.safetensors"), "--ae", str(d / "ae.safetensors"),
                   "--network_module", "networks.lora_lumina"]


def make_images(workdir: Path, images: int, resolution: int, repeats: int = REPEATS) -> None:
    from library import tiny_models

    if not (workdir / "data").exists():
        tiny_models.make_captioned_images(workdir / "data", n=images, size=(resolution, resolution), repeats=repeats,
                                          name="bench")


def make_bucket_images(workdir: Path, per_size: int, sizes=BUCKET_SIZES) -> Path:
    """`per_size` captioned images of each (width, height) in `sizes`, one kohya folder per size, in W/data_buckets."""
    from library import tiny_models

    dest = workdir / "data_buckets"
    if not dest.exists():
        for w, h in sizes:
            tiny_models.make_captioned_images(dest, n=per_size, size=(w, h), repeats=1, name=f"b{w}x{h}")
    return dest


SCRIPTS = {"sdxl": "sdxl_train_network.py", "sd15": "train_network.py", "sd21": "train_network.py",
           "flux": "flux_train_network.py", "sd3-medium": "sd3_train_network.py", "sd3-large": "sd3_train_network.py",
           "chroma": "flux_train_network.py", "lumina": "lumina_train_network.py",
           "hunyuan-image": "hunyuan_image_train_network.py", "anima": "anima_train_network.py"}


def model_argv(family: str, workdir: Path) -> list[str]:
    if family in NEW_FAMILIES:
        return family_argv(workdir, family)
    if family == "flux":
        d = workdir / "flux"
        return ["--pretrained_model_name_or_path", str(d / "flux.safetensors"), "--clip_l", str(d / "clip_l.safetensors"),
                "--t5xxl", str(d / "t5xxl.safetensors"), "--ae", str(d / "ae.safetensors"),
                "--tokenizer_cache_dir", str(d / "tokenizers"), "--network_module", "networks.lora_flux"]
    return ["--pretrained_model_name_or_path", str(workdir / f"{family}.safetensors"),  # sdxl, sd15, sd21
            "--tokenizer_cache_dir", str(workdir / "tokenizers"), "--network_module", "networks.lora"] + \
        (["--v2", "--v_parameterization"] if family == "sd21" else [])


def trainer_argv(args, phase: str, workdir: Path) -> list[str]:
    out = workdir / f"out_{args.tag}_{phase}"
    dim = args.network_dim or (32 if args.family == "sdxl" else 16)
    argv = model_argv(args.family, workdir) + [
        "--train_data_dir", str(workdir / ("data_buckets" if args.buckets else "data")),
        "--resolution", f"{args.resolution},{args.resolution}", "--output_dir", str(out), "--output_name", "bench",
        "--network_dim", str(dim),
        "--network_alpha", str(dim / 2), "--network_train_unet_only",
        "--max_train_steps", str(args.steps), "--learning_rate", "1e-4", "--optimizer_type", "AdamW",
        "--mixed_precision", "bf16", "--cache_latents", "--cache_text_encoder_outputs",
        "--train_batch_size", str(args.batch_size), "--max_data_loader_n_workers", "0", "--seed", "0",
    ]
    if phase != "upstream":
        argv.append("--overwrite_output")  # ours only (upstream has no such option)
    if args.gradient_checkpointing:
        argv.append("--gradient_checkpointing")
    if args.buckets:
        sides = [side for size in BUCKET_SIZES for side in size]
        argv += ["--enable_bucket", "--min_bucket_reso", str(min(sides)), "--max_bucket_reso", str(max(sides))]
    if phase == "compiled" and args.family in ("sd15", "sd21"):  # train_network.py: upstream's compile switch only
        argv += ["--torch_compile"]
    elif phase == "compiled":
        argv += ["--compile", "--compile_mode", args.compile_mode]
        if args.family not in NEW_FAMILIES:  # the new families: what ticking Enable torch.compile gives, nothing more
            argv += ["--compile_cache_dir", str(workdir / f"compile_cache_{args.cache_tag or args.tag}")]
    return argv + args.extra


def read_log(lines: list[tuple[float, str]], warmup: int, bar: bool = False) -> dict:
    """The figures a run's timestamped output lines give (see the module's docstring). `bar`: the progress is
    upstream's tqdm bar, redrawn as each step ends (ours draws one too, a step late and in bursts: its
    "steps: N/M" lines are read instead)."""
    result: dict = {}
    points, shapes, recompiles = [], [], {}
    compiling = graph_timing = None
    timeline: dict = {}
    compile_times: dict = {}
    for t, line in lines:
        for stage, pattern in TIMELINE.items():
            if stage not in timeline and pattern.search(line):
                timeline[stage] = round(t, 1)
        if compile_times is not None and (m := COMPILE_TIME.match(line)) and graph_timing is not None:
            compile_times[m.group(1)] = float(m.group(2))  # the table follows the graph_timing line
        if m := COUNTERS.match(line):
            result["compile_counters"] = json.loads(m.group(1))
        if m := (TQDM if bar else PROGRESS).match(line):
            if not points or int(m.group(1)) != points[-1][0]:  # tqdm redraws a step on close
                points.append((int(m.group(1)), t))
        elif m := SUMMARY.match(line):
            result["trainer_summary"] = {"median_ms": float(m.group(1)), "steps": f"{m.group(2)}-{m.group(3)}",
                                         "first_steps": m.group(4)}
            if m.group(4) and (p := PEAK.search(m.group(4))):
                result["trainer_summary"]["peak_gib"] = float(p.group(1))
            if m.group(4) and (s := SETUP.search(m.group(4))):
                result["setup"] = {"shapes": int(s.group(1)), "steps": int(s.group(2)), "what": s.group(3),
                                   "seconds": float(s.group(4))}
        elif m := GRAPH_TIMING.match(line):
            graph_timing = json.loads(m.group(1))
        if compiling is None and COMPILING.search(line):
            compiling = t
        if m := NEW_SHAPE.search(line):
            shapes.append({"shape": m.group(1), "step": int(m.group(2)) if m.group(2) else None, "at_s": round(t, 1)})
        if RECOMPILE in line:
            recompiles[len(shapes)] = recompiles.get(len(shapes), 0) + 1
    if shapes:
        result["new_shapes"] = shapes
    if recompiles or shapes:
        # shapes seen when each recompile came -> how many: {"1": 1} is one recompile during the first shape's steps
        result["recompiles"] = sum(recompiles.values())
        result["recompiles_by_shapes_seen"] = {str(k): v for k, v in sorted(recompiles.items())}
    if graph_timing is not None:
        result["graph_timing"] = graph_timing
    if compile_times:
        result["compile_times"] = compile_times
    step1 = [t for s, t in points if s == 1]  # always printed, once step 2 has run (the loss is read late)
    if step1:
        timeline["step2_done"] = round(step1[0], 1)
    if timeline:
        result["timeline_s"] = timeline
    if compiling is not None and step1:
        result["compile_line_to_step2_done_s"] = round(step1[0] - compiling, 1)
    result.update(progress_figures(points, warmup, bar))
    return result


def progress_figures(points: list[tuple[int, float]], warmup: int, bar: bool = False) -> dict:
    """From (step, seconds since start) progress points: the mean step time after the warm-up and when step 1 was
    first shown; with a tqdm `bar` (redrawn as each step ends) also the median step time after the warm-up and the
    first step's time (from the step-0 bar, drawn as the loop starts). Ours prints at most one line a second, each
    a step late: its median and first step are its summary's."""
    out: dict = {}
    later = [(s, t) for s, t in points if s >= warmup]
    if len(later) >= 2 and later[-1][0] > later[0][0]:
        (s0, t0_), (s1, t1) = later[0], later[-1]
        out["outside_ms_per_step"] = round((t1 - t0_) / (s1 - s0) * 1000, 1)
        out["outside_steps"] = f"{s0}-{s1}"
    if bar and len(later) >= 2:
        per_step = []
        for (sa, ta), (sb, tb) in zip(later, later[1:]):
            per_step += [(tb - ta) / (sb - sa)] * (sb - sa)
        out["outside_median_ms"] = round(statistics.median(per_step) * 1000, 1)
    shown = [t for s, t in points if s >= 1]
    if shown:
        out["start_to_step1_shown_s"] = round(shown[0], 1)
        zero = [t for s, t in points if s == 0]
        if bar and zero and any(s == 1 for s, _ in points):
            out["first_step_s"] = round([t for s, t in points if s == 1][0] - zero[-1], 1)
    return out


def split_output(stream, chunk: int = 65536):
    """The lines of a byte stream, ended by a newline or a carriage return (tqdm redraws its bar with one), as
    each arrives."""
    buf = b""
    while data := stream.read1(chunk) if hasattr(stream, "read1") else stream.read(chunk):
        buf += data
        *done, buf = re.split(rb"\r\n|\r|\n", buf)
        for line in done:
            if line:
                yield line.decode("utf-8", "replace")
    if buf:
        yield buf.decode("utf-8", "replace")


class GpuMemoryPoll:
    """memory.used of GPU 0 as nvidia-smi reports it while a run goes (every 200 ms), as (seconds since `t0`, MiB):
    the same outside figure for any trainer (CUDA context and the allocator's reserve included). No samples where
    there is no nvidia-smi."""

    def __init__(self, t0: float):
        import shutil
        import threading

        self.t0, self.samples, self.proc = t0, [], None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                          "-i", "0", "-lms", "200"], stdout=subprocess.PIPE, text=True)
            self.thread = threading.Thread(target=self._read, daemon=True)
            self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.samples.append((time.perf_counter() - self.t0, int(line.strip())))

    def stop(self) -> list[tuple[float, int]]:
        if self.proc:
            self.proc.terminate()
            self.proc.wait()
            self.thread.join(timeout=5)
        return self.samples


def memory_figures(samples: list[tuple[float, int]], lines: list[tuple[float, str]]) -> dict:
    """nvidia-smi's peak over the whole run and over the training loop (from the first progress line on: the
    text-encoder caching before it can hold more, T5-XXL alone being 9.5 GB)."""
    if not samples:
        return {"smi_peak_mib": None}
    loop = next((t for t, line in lines if PROGRESS.match(line) or TQDM.match(line)), None)
    out = {"smi_peak_mib": max(m for _, m in samples)}
    if loop is not None and any(t >= loop for t, _ in samples):
        out["smi_loop_peak_mib"] = max(m for t, m in samples if t >= loop)
    return out


# Python's bytecode as a user's install has it: pip writes each package's .pyc files when it installs them, but a
# machine that runs with PYTHONDONTWRITEBYTECODE over packages installed without them (this workplace's GPU image)
# compiles torch's sources again in every process: torch + diffusers + transformers + accelerate imported in 13-15 s
# there, and inductor's import inside or outside the compile-line-to-step-2 window by where its first use falls.
BYTECODE_PACKAGES = ("torch", "diffusers", "transformers", "accelerate", "safetensors", "huggingface_hub", "tokenizers",
                     "numpy", "PIL", "tqdm", "sympy", "triton", "networkx", "jinja2", "filelock", "fsspec", "regex")


def installed_without_bytecode() -> bool:
    """Whether torch was installed without its .pyc files (where pip installs it, they are there)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return bool(spec and spec.origin) and not os.path.exists(importlib.util.cache_from_source(spec.origin))


def bytecode_env(workdir: Path, source_dirs: list[str]) -> dict:
    """The trainers' environment for a bytecode cache under workdir/pycache (PYTHONPYCACHEPREFIX, writing on),
    filled with compileall for BYTECODE_PACKAGES and `source_dirs` where not done before, as pip leaves an install.
    Empty (nothing to change) where torch has its .pyc files."""
    import importlib.util

    if not installed_without_bytecode():
        return {}
    prefix = workdir / "pycache"
    env = {"PYTHONPYCACHEPREFIX": str(prefix)}
    filled = prefix / "filled.txt"
    done = set(filled.read_text().split("\n")) if filled.exists() else set()
    dirs = [str(d) for d in source_dirs if d]
    for name in BYTECODE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs += [str(d) for d in spec.submodule_search_locations]
    todo = [d for d in dict.fromkeys(dirs) if d not in done]
    if todo:
        t0 = time.perf_counter()
        run_env = dict(os.environ, **env)
        run_env.pop("PYTHONDONTWRITEBYTECODE", None)
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *todo], env=run_env,
                       stdout=subprocess.DEVNULL, check=False)
        prefix.mkdir(parents=True, exist_ok=True)
        filled.write_text("\n".join(sorted(done | set(todo))) + "\n")
        print(f"bytecode cache {prefix}: {len(todo)} folders compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    return env


def run_phase(args, phase: str, workdir: Path) -> dict:
    upstream = phase == "upstream"
    scripts_dir = Path(args.upstream_dir if upstream else args.scripts_dir).resolve()
    script = scripts_dir / SCRIPTS[args.family]
    runner = [str(REPO / "tools" / "graph_timing.py")] if args.time_graphs and not upstream else []
    if upstream and args.upstream_runner:
        runner = [str(Path(args.upstream_runner).resolve())]
    cmd = [sys.executable] + runner + [str(script)] + trainer_argv(args, phase, workdir)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cache := bytecode_env(workdir, [str(scripts_dir)] + (
        (args.upstream_pythonpath or "").split(os.pathsep) if upstream else [])):
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env.update(cache)
    if upstream:  # upstream's own package set only (its pins), never ours
        env["PYTHONPATH"] = args.upstream_pythonpath or ""
        hub = family_dir(workdir, args.family) / "tokenizers" / "hub"
        if args.family in NEW_FAMILIES and hub.is_dir():  # tokenizers upstream loads by hub id, no cache dir
            env["HF_HUB_CACHE"] = str(hub)
    if args.recompiles:
        env["TORCH_LOGS"] = ",".join(filter(None, [env.get("TORCH_LOGS"), "recompiles"]))
    t0 = time.perf_counter()
    lines, timed_out = [], False
    memory = GpuMemoryPoll(t0)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=str(scripts_dir if upstream else scripts_dir.parent))
    timer = None
    if args.timeout:
        import threading

        def stop():
            nonlocal timed_out
            timed_out = True
            proc.kill()

        timer = threading.Timer(args.timeout, stop)
        timer.start()
    log = open(args.log_out, "a") if args.log_out else None
    for line in split_output(proc.stdout):
        now = time.perf_counter() - t0
        lines.append((now, line))
        if log:
            log.write(f"{now:8.2f} {line}\n")
    rc = proc.wait()
    if timer:
        timer.cancel()
    if log:
        log.close()
    result = {"phase": phase, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1), "trainer_summary": None,
              **memory_figures(memory.stop(), lines)}
    if timed_out:
        result["timed_out_after_s"] = args.timeout
    result.update(read_log(lines, args.warmup, bar=upstream))
    result["auto_chose"] = auto_choices([line for _, line in lines])
    result["compile_report"] = compile_report([line for _, line in lines])
    if rc != 0:
        result["log_tail"] = [line for _, line in lines[-40:]]
    return result


# what the trainer's log says auto chose (library.compile.graphs.resolve, library.compile.regional)
AUTO_CHOICE = re.compile(r"--cuda_graph_step auto: (on|off)")
STATIC = "static shapes (--compile_dynamic auto"
KEEP_CHOICE = re.compile(r"--compile_checkpoint_keep auto: (\w+)")


def auto_choices(lines: list[str]) -> str:
    """A few words on what the trainer's auto settings chose, from its log lines."""
    words = []
    for line in lines:
        if m := AUTO_CHOICE.search(line):
            words.append(f"step graph {m.group(1)}")
        if STATIC in line:
            words.append("static")
        if "image-size dimensions of their inputs dynamic" in line:
            words.append("inputs dynamic")
        if m := KEEP_CHOICE.search(line):
            words.append(f"keep {m.group(1)}")
    return ", ".join(dict.fromkeys(words))


def report(paths: list[str]) -> str:
    """One markdown row per run of the --json_out files: the workload, the trainer flags beyond the defaults, the
    scripts (their tag), what auto chose, the median step and peak memory; rows of one workload and flags side by
    side, the fastest in bold."""
    runs = [r for path in paths for r in json.loads(Path(path).read_text())]
    family_runs = [r for r in runs if r.get("family") in NEW_FAMILIES]
    runs = [r for r in runs if r.get("family") not in NEW_FAMILIES]
    if not runs:
        return family_report(family_runs)

    def key(r) -> tuple[str, str]:
        return r["workload"], " ".join(r.get("extra") or []) or "default"

    best: dict[tuple, float] = {}
    for r in runs:
        ms = (r.get("trainer_summary") or {}).get("median_ms")
        if ms is not None:
            best[key(r)] = min(best.get(key(r), ms), ms)
    rows = ["| workload | flags | scripts | auto chose | median step | peak | outside | first / second step | "
            "compile line to step 2 | from the compile cache |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (*key(r), r["tag"])):
        summary = r.get("trainer_summary") or {}
        ms = summary.get("median_ms")
        shown = "failed (rc %s)" % r["rc"] if ms is None else (f"**{ms} ms**" if ms == best[key(r)] else f"{ms} ms")
        peak = f"{summary['peak_gib']} GiB" if "peak_gib" in summary else ""
        outside = f"{r['outside_ms_per_step']} ms" if "outside_ms_per_step" in r else ""
        steps = SECOND_STEP.search(summary.get("first_steps") or "")
        firsts = f"{steps[1]} / {steps[2]} s" if steps else ""
        to_step2 = f"{r['compile_line_to_step2_done_s']} s" if "compile_line_to_step2_done_s" in r else ""
        rows.append(f"| {key(r)[0]} | {key(r)[1]} | {r['tag']} | {r.get('auto_chose') or ''} | {shown} | {peak} | "
                    f"{outside} | {firsts} | {to_step2} | {cache_served(r.get('compile_counters') or {})} |")
    return "\n".join(rows) + ("\n\n" + family_report(family_runs) if family_runs else "")


FIRST_STEP = re.compile(r"first step ([\d.]+) s")
SECOND_STEP = re.compile(r"first step ([\d.]+) s, second step ([\d.]+) s")


def cache_served(counters: dict) -> str:
    """What the persistent compile cache served, from torch's counters (tools/graph_timing.py): "FX 4/4, AOT 2/2"
    (hits of lookups), "" when the run printed none."""
    parts = []
    for name, group, prefix in (("FX", "inductor", "fxgraph_cache_"), ("AOT", "aot_autograd", "autograd_cache_")):
        c = counters.get(group) or {}
        looked = sum(c.get(prefix + k, 0) for k in ("hit", "miss", "bypass"))
        if looked:
            parts.append(f"{name} {c.get(prefix + 'hit', 0)}/{looked}")
    return ", ".join(parts)
PHASE_NAMES = {"compiled": "ours, Enable torch.compile", "eager": "ours, eager", "upstream": "upstream"}


def step_ms(r: dict) -> float | None:
    """A run's median step: ours' summary line; upstream's from its tqdm bar (outside; ours' outside figure is a
    mean over its once-a-second lines, for comparison only)."""
    if r["phase"] == "upstream":
        return r.get("outside_median_ms")
    return (r.get("trainer_summary") or {}).get("median_ms")


def family_report(runs: list[dict]) -> str:
    """The new families' rows (issue 28 item 6): per family ours compiled / ours eager / upstream, the median step
    after the warm-up, upstream's step over ours (the target: 2x or more), peak GPU memory (the trainer's own
    figure, ours only; nvidia-smi's for both, in the training loop and over the whole run), the first step and the
    time from the start to step 1 shown."""
    rows = ["| family | run | median step | upstream / this | peak (trainer) | peak (nvidia-smi: loop (whole run)) | "
            "first step | start to step 1 |", "|---|---|---|---|---|---|---|---|"]
    order = {f: i for i, f in enumerate(NEW_FAMILIES)}
    phases = list(PHASE_NAMES)
    runs = sorted(runs, key=lambda r: (order[r["family"]], phases.index(r["phase"]) if r["phase"] in phases else 9))
    upstream = {r["family"]: step_ms(r) for r in runs if r["phase"] == "upstream"}
    for r in runs:
        ms = step_ms(r)
        if ms is None:
            shown = f"failed (rc {r['rc']}" + (f", stopped at {r['timed_out_after_s']:.0f} s" if "timed_out_after_s" in r
                                                else "") + ")"
        else:
            shown = f"{ms:.1f} ms"
        up = upstream.get(r["family"])
        ratio = f"{up / ms:.2f}x" if ms and up and r["phase"] != "upstream" else ""
        summary = r.get("trainer_summary") or {}
        peak = f"{summary['peak_gib']:.2f} GiB" if "peak_gib" in summary else ""
        smi = f"{r['smi_loop_peak_mib'] / 1024:.2f} GiB" if r.get("smi_loop_peak_mib") else ""
        if r.get("smi_peak_mib"):
            smi += f" (run {r['smi_peak_mib'] / 1024:.2f})"
        first = r.get("first_step_s")
        if r["phase"] != "upstream":
            m = FIRST_STEP.search(summary.get("first_steps") or "")
            first = float(m.group(1)) if m else None
        first = f"{first:.1f} s" if first is not None else ""
        start = f"{r['start_to_step1_shown_s']:.0f} s" if "start_to_step1_shown_s" in r else ""
        name = PHASE_NAMES.get(r["phase"], r["phase"]) + (f", `{' '.join(r['extra'])}`" if r.get("extra") else "")
        rows.append(f"| {r['family']} {r.get('resolution', '')} px | {name} | "
                    f"{shown} | {ratio} | {peak} | {smi} | {first} | {start} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------------------
# `table` (issue 25 item 5): the default-vs-best table, every row, in one call per family. Each row starts the
# shipped trainer as a user gets it (the GUI's Enable torch.compile: --compile --compile_mode reduce-overhead, every
# other setting at its default), or with the best opt-in where one still beats the default, on one random full-size
# model and one compile cache folder, emptied at the start: the first row's first step is cold, later rows reuse what
# the rows before them compiled (the table's cache column says what each got from it).


class Target(NamedTuple):  # NamedTuple, not a dataclass: loaders of this file by path need no sys.modules entry
    """An issue-25 target; a row meets it when every bound given holds."""
    max_ms: float | None = None  # the trainer's median step
    max_gib: float | None = None  # the trainer's peak allocated memory
    max_first_step_s: float | None = None  # first step, cold compile cache
    max_to_step2_s: float | None = None  # the trainer's compile line to step 2 done (a warm restart)
    note: str = ""  # where a bound comes from, when the issue does not say it in numbers

    def text(self) -> str:
        parts = []
        if self.max_ms is not None:
            under = f" under {self.max_gib:g} GiB" if self.max_gib is not None else ""
            parts.append(f"<= {self.max_ms:g} ms{under}")
        elif self.max_gib is not None:
            parts.append(f"under {self.max_gib:g} GiB")
        if self.max_first_step_s is not None:
            parts.append(f"first step cold <= {self.max_first_step_s:g} s")
        if self.max_to_step2_s is not None:
            parts.append(f"warm restart <= {self.max_to_step2_s:g} s to step 2")
        return "; ".join(parts) + (f" ({self.note})" if self.note else "")


class TableRow(NamedTuple):
    name: str
    workload: str  # the row
    kind: str  # "default", "warm restart" (the default again, a new process on the same cache) or "best opt-in"
    flags: tuple = ()  # trainer flags beyond the GUI's default
    batch_size: int = 1
    gradient_checkpointing: bool = True
    target: Target = Target()
    need_s: int = 60  # seconds it needs on an H100 (run87's walls and a margin): a row that no longer fits is skipped

    def as_json(self) -> dict:
        return {**self._asdict(), "flags": list(self.flags), "target": self.target._asdict()}


ADAMW8BIT = ("--optimizer_type", "AdamW8bit")
PRODIGY = ("--optimizer_type", "Prodigy", "--learning_rate", "1.0")
# the kohya_ss presets' Adafactor (shared/parity/kohya_ss-presets)
ADAFACTOR = ("--optimizer_type", "AdaFactor", "--optimizer_args", "scale_parameter=False", "relative_step=False",
             "warmup_init=False")
RESNETS = ("--compile_checkpoint_keep", "resnets")  # faster than auto's bs1 choice (attention), 2 GiB more
SDXL_GC = Target(max_ms=130, max_gib=8)
TABLES = {
    # in the order they run: the cold row first, its warm restart next, the same-graph optimizer rows on its cache
    "sdxl": (
        TableRow("bs1_gc", "SDXL bs1 + GC", "default", target=Target(130, 8, max_first_step_s=20), need_s=75),
        TableRow("bs1_gc_warm", "SDXL bs1 + GC", "warm restart", target=Target(max_to_step2_s=8), need_s=45),
        TableRow("bs1_gc_adamw8bit", "SDXL bs1 + GC, AdamW8bit", "default", ADAMW8BIT, target=SDXL_GC, need_s=45),
        TableRow("bs1_gc_prodigy", "SDXL bs1 + GC, Prodigy", "default", PRODIGY, target=SDXL_GC, need_s=45),
        TableRow("bs1_gc_adafactor", "SDXL bs1 + GC, Adafactor", "default", ADAFACTOR, target=SDXL_GC, need_s=45),
        TableRow("bs1", "SDXL bs1", "default", gradient_checkpointing=False, target=Target(110), need_s=65),
        TableRow("bs4_gc", "SDXL bs4 + GC", "default", batch_size=4, target=Target(280), need_s=70),
        TableRow("bs1_gc_resnets", "SDXL bs1 + GC", "best opt-in", RESNETS, target=SDXL_GC, need_s=65),
        TableRow("bs1_gc_adamw8bit_resnets", "SDXL bs1 + GC, AdamW8bit", "best opt-in", ADAMW8BIT + RESNETS,
                 target=SDXL_GC, need_s=45),
        TableRow("bs1_gc_prodigy_resnets", "SDXL bs1 + GC, Prodigy", "best opt-in", PRODIGY + RESNETS,
                 target=SDXL_GC, need_s=45),
        TableRow("bs1_gc_adafactor_resnets", "SDXL bs1 + GC, Adafactor", "best opt-in", ADAFACTOR + RESNETS,
                 target=SDXL_GC, need_s=45),
    ),
    "flux": (
        # "peak memory no higher than today's default": the default when it was filed (585 ms / 27.3 GiB)
        TableRow("gc", "FLUX.1 1024 + GC", "default", target=Target(470, 27.3, max_first_step_s=40,
                                                                    note="27.3 GiB: the issue's default when filed"),
                 need_s=120),
        TableRow("gc_warm", "FLUX.1 1024 + GC", "warm restart", target=Target(max_to_step2_s=8), need_s=75),
    ),
}
# workloads with no "best opt-in" row: the levers for them are what auto now chooses (its column shows it)
NO_OPT_IN = {
    "SDXL bs1": "none left: the issue's lever (`--cuda_graph_step`) is auto's choice",
    "SDXL bs4 + GC": "none left: run62's three levers (step graph, cuDNN attention, keep resnets) are auto's choices",
    "FLUX.1 1024 + GC": "none left: the issue's levers (`--cudnn_sdp on`, keep projections) are auto's choices",
}


def judge(target: Target, result: dict | None) -> tuple[str, list[str]]:
    """("met" | "missed" | "no figure", the figures against the bounds) for one row's run."""
    summary = (result or {}).get("trainer_summary") or {}
    first = FIRST_STEP.search(summary.get("first_steps") or "")
    figures = [("median", summary.get("median_ms"), target.max_ms, "ms"),
               ("peak", summary.get("peak_gib"), target.max_gib, "GiB"),
               ("first step", float(first.group(1)) if first else None, target.max_first_step_s, "s"),
               ("to step 2", (result or {}).get("compile_line_to_step2_done_s"), target.max_to_step2_s, "s")]
    why, missed, unknown = [], False, False
    for name, value, bound, unit in figures:
        if bound is None:
            continue
        if value is None:
            unknown = True
            why.append(f"{name}: no figure")
        else:
            missed = missed or value > bound
            why.append(f"{name} {value:g} {unit} {'>' if value > bound else '<='} {bound:g}")
    return ("missed" if missed else "no figure" if unknown else "met"), why


COMPILE_REPORT = re.compile(r"torch\.compile after step \d+: (.*)$")
CACHE_COUNTS = {"aot_autograd": (re.compile(r"AOTAutograd cache (\d+) hit, (\d+) compiled, (\d+) bypassed"),
                                 "autograd_cache_"),
                "inductor": (re.compile(r"FX-graph cache (\d+) hit, (\d+) compiled, (\d+) bypassed"), "fxgraph_cache_")}


def compile_report(lines: list[str]) -> str | None:
    """The trainer's "torch.compile after step 2: ..." words (library.run.events.CompileReport), if it printed them."""
    return next((m.group(1) for line in lines if (m := COMPILE_REPORT.search(line))), None)


def report_cache_served(report: str | None) -> str:
    """What the compile cache served by the trainer's own report: "FX 4/4, AOT 2/2" (hits of lookups); without cache
    lookups (a backend without inductor) the report's first part ("2 graphs compiled in 5.4 s")."""
    if not report:
        return ""
    counters = {}
    for group, (pattern, prefix) in CACHE_COUNTS.items():
        if m := pattern.search(report):
            counters[group] = {prefix + k: int(v) for k, v in zip(("hit", "miss", "bypass"), m.groups())}
    return cache_served(counters) or report.split(" (")[0].split(";")[0]


def device_words() -> str:
    """The GPU as nvidia-smi names it (name, memory, driver), "no GPU" without one."""
    import shutil

    if not shutil.which("nvidia-smi"):
        return "no GPU (nvidia-smi not found)"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader",
                          "-i", "0"], capture_output=True, text=True)
    return out.stdout.strip() or out.stderr.strip()


def table_rows(family: str, names: str | None) -> list[TableRow]:
    """The rows to run, in the table's order (the cold row first); bad input: one line and exit 2."""
    def fail(message):
        print(message, file=sys.stderr)
        raise SystemExit(2)

    if family not in TABLES:
        fail(f"--family: the table has rows for {', '.join(TABLES)} only; got {family!r}")
    rows = TABLES[family]
    if not names:
        return list(rows)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in {r.name for r in rows}]
    if unknown or not wanted:
        fail(f"--rows: unknown row {', '.join(unknown) or repr(names)} for --family {family}; allowed: "
             f"{', '.join(r.name for r in rows)}")
    return [r for r in rows if r.name in wanted]


def run_table(args, workdir: Path) -> dict:
    """Prepares the family's model once, runs each row of TABLES[family] (or --rows) in order within --budget
    seconds, writes OUT/table_<family>.json (every run's figures) and OUT/table_<family>.md (render_table)."""
    import shutil

    t0 = time.perf_counter()
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = table_rows(args.family, args.rows)
    prepare(workdir, args.images, args.resolution, args.checkpoint, args.family, 0, args.repeats, args.tiny)
    cache_tag = f"table_{args.family}"
    shutil.rmtree(workdir / f"compile_cache_{cache_tag}", ignore_errors=True)  # the first row starts cold
    import torch

    doc = {"family": args.family, "device": device_words(), "torch": torch.__version__,
           "resolution": args.resolution, "steps": args.steps, "compile_mode": args.compile_mode,
           "common_flags": list(args.extra), "budget_s": args.budget,
           "prepare_s": round(time.perf_counter() - t0, 1), "rows": []}
    json_path, md_path = out_dir / f"table_{args.family}.json", out_dir / f"table_{args.family}.md"
    for row in rows:
        entry = {"row": row.as_json(), "result": None, "skipped": None}
        left = args.budget - (time.perf_counter() - t0) if args.budget else None
        if left is not None and left < row.need_s:
            entry["skipped"] = f"{left:.0f} s of the budget left, the row needs {row.need_s}"
        else:
            a = argparse.Namespace(**vars(args))
            a.batch_size, a.gradient_checkpointing = row.batch_size, row.gradient_checkpointing
            a.extra = list(row.flags) + list(args.extra)
            a.tag, a.cache_tag, a.buckets = f"table_{row.name}", cache_tag, False
            # a run that hangs ends inside the budget (at most three times what the row needs)
            a.timeout = max(1.0, min(left - 5, 3 * row.need_s)) if left is not None else args.timeout
            a.log_out = str(out_dir / f"table_{args.family}_{row.name}.log")
            Path(a.log_out).unlink(missing_ok=True)
            result = run_phase(a, "compiled", workdir)
            shutil.rmtree(workdir / f"out_{a.tag}_compiled", ignore_errors=True)  # the saved LoRA: disk, not a figure
            entry["result"] = result
            entry["verdict"], entry["why"] = judge(row.target, result)
            summary = result.get("trainer_summary") or {}
            print(f"table {args.family} {row.name}: rc {result['rc']}, {summary.get('median_ms')} ms, "
                  f"{summary.get('peak_gib')} GiB, {summary.get('first_steps')}; {entry['verdict']} "
                  f"({'; '.join(entry['why'])}); {time.perf_counter() - t0:.0f} s", flush=True)
        if entry["skipped"]:
            print(f"table {args.family} {row.name}: SKIPPED ({entry['skipped']})", flush=True)
        doc["rows"].append(entry)
        json_path.write_text(json.dumps(doc, indent=1))  # after every row: a cut call keeps what ran
    doc["total_s"] = round(time.perf_counter() - t0, 1)
    json_path.write_text(json.dumps(doc, indent=1))
    md_path.write_text(render_table(doc) + "\n")
    return doc


def _run_words(result: dict | None, with_smi: bool = True) -> str:
    """"109.1 ms, 7.13 GiB (nvidia-smi 9.02)" of one run, or why there is no figure."""
    summary = (result or {}).get("trainer_summary") or {}
    if summary.get("median_ms") is None:
        return f"failed (rc {result['rc']})" if result else ""
    words = f"{summary['median_ms']:.1f} ms"
    if "peak_gib" in summary:
        words += f", {summary['peak_gib']:.2f} GiB"
    if with_smi and result.get("smi_loop_peak_mib"):
        words += f" (nvidia-smi {result['smi_loop_peak_mib'] / 1024:.2f})"
    return words


def render_table(doc: dict) -> str:
    """The markdown of a `table` run: the issue's shape (per workload: default, best opt-in, target, met or missed),
    then every run with its figures. Every number comes from the runs' results in `doc`."""
    rows = doc["rows"]
    lines = [f"**{doc['family'].upper()} table (issue 25)**: {doc['device']}, torch {doc['torch']}; "
             f"{doc['resolution']} px, {doc['steps']} steps a row (the trainer's median leaves out the first "
             f"{min(10, doc['steps'] // 2)}); every row `--compile --compile_mode {doc['compile_mode']}`"
             + (f" `{' '.join(doc['common_flags'])}`" if doc["common_flags"] else "")
             + " plus its flags; one compile cache, empty before the first row (later rows start warm where an "
             "earlier row compiled the same graphs). Memory: the trainer's peak allocated (nvidia-smi's peak in "
             "the training loop).", ""]
    workloads = list(dict.fromkeys(e["row"]["workload"] for e in rows))
    lines += ["| workload | ours, default | ours, best opt-in | target (issue 25) | default | best opt-in |",
              "|---|---|---|---|---|---|"]

    def cell(entry):
        if entry is None:
            return ""
        if entry["skipped"]:
            return "skipped (budget)"
        words = _run_words(entry["result"])
        first = FIRST_STEP.search((entry["result"].get("trainer_summary") or {}).get("first_steps") or "")
        if first and entry["row"]["target"]["max_first_step_s"] is not None:
            words += f", first step {first.group(1)} s (cold)"
        flags = " ".join(entry["row"]["flags"])
        return words + (f" (`{flags}`)" if entry["row"]["kind"] == "best opt-in" and flags else "")

    def verdict(entry):  # judged again from the run's figures
        if entry is None or entry["skipped"]:
            return ""
        met, why = judge(Target(**entry["row"]["target"]), entry["result"])
        return met + (f": {'; '.join(why)}" if why else "")

    for w in workloads:
        default = next((e for e in rows if e["row"]["workload"] == w and e["row"]["kind"] == "default"), None)
        best = next((e for e in rows if e["row"]["workload"] == w and e["row"]["kind"] == "best opt-in"), None)
        warm = next((e for e in rows if e["row"]["workload"] == w and e["row"]["kind"] == "warm restart"), None)
        target = (default or best or warm)["row"]["target"]
        lines.append(f"| {w} | {cell(default)} | {cell(best) if best else NO_OPT_IN.get(w, '')} | "
                     f"{Target(**target).text()} | {verdict(default)} | {verdict(best)} |")
        if warm is not None:
            r = warm["result"] or {}
            words = "skipped (budget)" if warm["skipped"] else (
                f"{r['compile_line_to_step2_done_s']} s from the compile line to step 2, {_run_words(r, False)}"
                if "compile_line_to_step2_done_s" in r else _run_words(r, False))
            lines.append(f"| {w}, warm restart | {words} | | {Target(**warm['row']['target']).text()} | "
                         f"{verdict(warm)} | |")
    lines += ["", "| # | workload | run | flags beyond the default | auto chose | median step (steps) | peak: trainer "
              "/ nvidia-smi loop | first / second step | compile line to step 2 | compile cache (hits) | wall | met? |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, e in enumerate(rows, 1):
        row, r = e["row"], e["result"] or {}
        head = f"| {i} | {row['workload']} | {row['kind']} | {' '.join(row['flags'])} |"
        if e["skipped"]:
            lines.append(f"{head} | skipped: {e['skipped']} | | | | | | |")
            continue
        summary = r.get("trainer_summary") or {}
        median = (f"{summary['median_ms']:.1f} ms ({summary['steps']})" if summary.get("median_ms") is not None
                  else f"failed (rc {r.get('rc')})" + (f", stopped at {r['timed_out_after_s']:.0f} s"
                                                      if "timed_out_after_s" in r else ""))
        peak = f"{summary['peak_gib']:.2f}" if "peak_gib" in summary else "-"
        peak += f" / {r['smi_loop_peak_mib'] / 1024:.2f} GiB" if r.get("smi_loop_peak_mib") else " / - GiB"
        steps = SECOND_STEP.search(summary.get("first_steps") or "")
        firsts = f"{steps[1]} / {steps[2]} s" if steps else ""
        to_step2 = f"{r['compile_line_to_step2_done_s']} s" if "compile_line_to_step2_done_s" in r else ""
        lines.append(f"{head} {r.get('auto_chose') or ''} | {median} | {peak} | {firsts} | {to_step2} | "
                     f"{report_cache_served(r.get('compile_report'))} | {r.get('wall_s', '')} s | {verdict(e)} |")
    lines.append("")
    lines.append(f"Prepared in {doc['prepare_s']} s; the whole table took {doc.get('total_s', '?')} s.")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:
        tables = [p for p in argv[1:] if isinstance(json.loads(Path(p).read_text()), dict)]  # `table`'s files
        rest = [p for p in argv[1:] if p not in tables]
        print("\n\n".join([render_table(json.loads(Path(p).read_text())) for p in tables]
                          + ([report(rest)] if rest else [])))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("prepare", "run", "table"))
    p.add_argument("--workdir", default="bench_work")
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=REPEATS, help="prepare: the image folder's repeats")
    p.add_argument("--steps", type=int, default=None, help="default: 60 (run), 20 (table)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the outside measurement")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--family", choices=sorted(SCRIPTS), default="sdxl")
    p.add_argument("--tiny", action="store_true", help="prepare: the new families at test size (TINY_SHAPES)")
    p.add_argument("--network_dim", type=int, default=None, help="default: 32 (SDXL), 16 (the others)")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--phases", default="eager,compiled",
                   help="any of eager, compiled (ours) and upstream (--upstream_dir's script, as its users run it)")
    p.add_argument("--upstream_dir", default=None,
                   help="a copy of upstream kohya-ss/sd-scripts (phase upstream; prepare: its configs/ tokenizer files)")
    p.add_argument("--upstream_pythonpath", default=None,
                   help="PYTHONPATH of the upstream phase: its pinned packages (transformers 4.54, diffusers 0.32)")
    p.add_argument("--upstream_runner", default=None,
                   help="start upstream's script through this Python file (the CPU check's tiny-config shim)")
    p.add_argument("--compile_mode", default="reduce-overhead")
    p.add_argument("--scripts_dir", default=str(SD_SCRIPTS), help="the sd-scripts folder to time (default: ours)")
    p.add_argument("--tag", default="main", help="names the run in the output and its compile cache")
    p.add_argument("--checkpoint", default=None,
                   help="prepare: use this SDXL single file (tokenizers/ beside it) instead of a random full-size one")
    p.add_argument("--json_out", default=None)
    p.add_argument("--buckets", action="store_true",
                   help="prepare: also write the bucketed image set; run: train on it (--enable_bucket)")
    p.add_argument("--bucket_images", type=int, default=2, help="prepare --buckets: images of each bucket size")
    p.add_argument("--recompiles", action="store_true", help="count torch's recompiles (TORCH_LOGS=recompiles)")
    p.add_argument("--time_graphs", action="store_true",
                   help="run the trainer through tools/graph_timing.py (CUDA-graph recording and compile timers)")
    p.add_argument("--cache_tag", default=None, help="use the compile cache of this tag (default: --tag)")
    p.add_argument("--timeout", type=float, default=0, help="stop a phase after this many seconds (0: never)")
    p.add_argument("--log_out", default=None, help="append the trainer's output, each line timestamped, here")
    p.add_argument("--out", default="bench_table", help="table: the folder of table_<family>.json / .md and the logs")
    p.add_argument("--rows", default=None, help="table: these rows only (names, comma-separated; default: all)")
    p.add_argument("--budget", type=float, default=0,
                   help="table: seconds for the whole table, preparing included; rows that no longer fit are skipped "
                        "(0: no limit)")
    extra = argv[argv.index("--") + 1:] if "--" in argv else []  # more trainer flags, after --
    args = p.parse_args(argv[:len(argv) - len(extra) - (1 if extra else 0)])
    args.extra = extra
    args.steps = args.steps or (20 if args.action == "table" else 60)
    workdir = Path(args.workdir).resolve()
    if args.action == "table":
        doc = run_table(args, workdir)
        print(render_table(doc))
        return 0 if all(e["result"] and e["result"]["rc"] == 0 for e in doc["rows"]) else 1
    if args.action == "prepare":
        global UPSTREAM_CONFIGS
        UPSTREAM_CONFIGS = Path(args.upstream_dir) / "configs" if args.upstream_dir else None
        prepare(workdir, args.images, args.resolution, args.checkpoint, args.family,
                args.bucket_images if args.buckets else 0, args.repeats, args.tiny)
        return 0
    results = []
    for phase in args.phases.split(","):
        r = run_phase(args, phase, workdir)
        r.update(workload=f"{args.family.upper()} bs{args.batch_size}" + (" + GC" if args.gradient_checkpointing else "")
                 + (" buckets" if args.buckets else "") + ("" if phase == "compiled" else f" {phase}"),
                 resolution=args.resolution,
                 extra=args.extra, tag=args.tag, family=args.family, batch_size=args.batch_size,
                 gradient_checkpointing=args.gradient_checkpointing, buckets=args.buckets,
                 cache_tag=args.cache_tag or args.tag, scripts_dir=args.scripts_dir)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())

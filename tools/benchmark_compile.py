#!/usr/bin/env python
"""Time one LoRA training step with torch.compile off and on, in one process, on random full-size weights.

SDXL: the UNet from sd-scripts/library/configs/sdxl/unet/config.json. FLUX.1: FluxTransformer2DModel with
the FLUX.1-dev shape (19 double + 38 single blocks, width 3072, guidance embedding). Nothing is downloaded.
Frozen base weights in bf16, LoRA (rank 32 by default) in fp32, bf16 autocast, cached-latent shaped inputs
(random latents and text-encoder outputs), AdamW step. The compiled phase uses sd-scripts' own
library.compile (regional compilation of the repeated blocks), exactly as the trainers do.

Examples:
    python tools/benchmark_compile.py --family sdxl --resolution 1024 --batch_size 1 --compile_mode reduce-overhead
    python tools/benchmark_compile.py --family sdxl --batch_size 4 --gradient_checkpointing --compile_mode reduce-overhead
    python tools/benchmark_compile.py --family flux --resolution 512 --compile_mode reduce-overhead
    # data-parallel on 2 GPUs (gradients averaged by library.data_parallel, as under accelerate launch)
    torchrun --nproc_per_node 2 tools/benchmark_compile.py --family sdxl --phases compiled
    # warm start: a second process with the same cache, compiled phase only
    python tools/benchmark_compile.py --family sdxl --phases compiled --compile_cache_dir /tmp/cc --steps 3
    # full fine-tune step (sdxl_train.py's 24 GB setup): bf16 weights, Adafactor, fused backward pass
    python tools/benchmark_compile.py --family sdxl --full --gradient_checkpointing --compile_mode reduce-overhead
    # FLUX.1 LoRA presets: fp8 base (24 GB), fp8 base + block swap (16 / 12 GB; CUDA graphs are refused with it)
    python tools/benchmark_compile.py --family flux --rank 16 --gradient_checkpointing --fp8_base --phases compiled
    python tools/benchmark_compile.py --family flux --rank 16 --gradient_checkpointing --fp8_base --blocks_to_swap 18 \
        --compile_mode default --phases compiled

Prints the median step ms, it/s, cold-compile seconds (first compiled step), peak memory
(torch.cuda.max_memory_allocated and max_memory_reserved) for eager and compiled, and the ratio; --json_out
writes all figures. --fp8_base and --blocks_to_swap place the FLUX transformer as flux_train_network.py does
(library.flux_models.apply_fp8_base, library.flux_train_utils.place_transformer / library.block_swap).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "sd-scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from library import data_parallel  # noqa: E402
from library.compile import environment as compile_environment, graphs as compile_graphs  # noqa: E402
from library.compile import options as compile_options, regional  # noqa: E402

logger = logging.getLogger("benchmark_compile")

# Set by setup_data_parallel() when torchrun starts several processes (one per GPU); the gradients are then
# averaged with library.data_parallel exactly as the trainers do it under `accelerate launch`.
_DATA_PARALLEL = SimpleNamespace(num_processes=1)
_RANK = 0

FLUX_DEV_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# tiny shapes for a CPU smoke run of this script (--tiny)
SDXL_TINY_OVERRIDES = dict(
    block_out_channels=[32, 64, 64],
    transformer_layers_per_block=[1, 1, 2],
    attention_head_dim=[2, 4, 4],
    cross_attention_dim=64,
    projection_class_embeddings_input_dim=16 + 6 * 8,
    addition_time_embed_dim=8,
    norm_num_groups=8,
    layers_per_block=1,
)
FLUX_TINY_OVERRIDES = dict(
    num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
    pooled_projection_dim=16, axes_dims_rope=(4, 6, 6),
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("sdxl", "flux"), default="sdxl")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=20, help="timed steps per phase")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per phase (the first compiled one is the cold compile)")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank")
    p.add_argument("--attention_only_lora", action="store_true",
                   help="--family sdxl: LoRA on the attention projections only (to_q/to_k/to_v/to_out.0, what "
                        "diffusers' SDXL LoRA script trains), not on every Linear of the Transformer2DModels as kohya")
    p.add_argument("--network_module", choices=("networks.lora", "lycoris.kohya"), default="networks.lora",
                   help="--family sdxl: the kohya LoRA or LyCORIS (lycoris-lora, through networks.lycoris_kohya)")
    p.add_argument("--network_args", nargs="*", default=[], metavar="KEY=VALUE",
                   help="network args as in the trainers, e.g. algo=lokr factor=8 (LyCORIS)")
    p.add_argument("--lora_impl", choices=("auto", "kohya", "peft"), default="auto",
                   help="auto: the project's networks.lora / networks.lora_flux when present, else peft")
    p.add_argument("--phases", default="eager,compiled", help="comma list of eager, compiled")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model shapes (CPU smoke test of this script)")
    p.add_argument("--text_len", type=int, default=None, help="text tokens (default: 77 SDXL, 512 FLUX)")
    p.add_argument("--gc_blocks_only", action="store_true",
                   help="with --gradient_checkpointing: the compiled phase checkpoints only the compiled blocks "
                        "(diffusers' checkpointing of the resnets is turned off)")
    p.add_argument("--full", action="store_true",
                   help="full fine-tune instead of LoRA: every weight trained in bf16 (--full_bf16), Adafactor "
                        "(relative_step=False, lr 1e-6) stepped per parameter in backward (--fused_backward_pass) "
                        "with library.full_trainer's hooks, as sdxl_train.py does")
    p.add_argument("--no_fused", action="store_true", help="with --full: a plain optimizer step after backward")
    p.add_argument("--fp8_base", action="store_true",
                   help="--family flux: frozen Linear weights in float8_e4m3fn (flux_models.apply_fp8_base)")
    p.add_argument("--blocks_to_swap", type=int, default=0,
                   help="--family flux: blocks kept on the CPU and swapped in around their forward/backward")
    p.add_argument("--gc_freeze", action="store_true",
                   help="gc.collect(); gc.freeze() after the warm-up steps (measures Python GC pauses)")
    p.add_argument("--channels_last", action="store_true",
                   help="--family sdxl: the UNet in channels-last memory format (NHWC convolutions)")
    p.add_argument("--adamw", choices=("trainer", "foreach"), default="trainer",
                   help="LoRA optimizer: AdamW as library.train_util.get_optimizer builds it (fused), or torch's default foreach")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed steps of each phase, profile N more steps: top kernels and GPU busy share")
    p.add_argument("--inductor_config", action="append", default=[], metavar="KEY=VALUE",
                   help="experiment: set torch._inductor.config.KEY (dotted, e.g. triton.slow_path_cudagraph_asserts=False)")
    p.add_argument("--keep_cache_on_capture", action="store_true",
                   help="experiment: torch.cuda.empty_cache() is a no-op in the compiled phase (each CUDA graph capture calls it)")
    p.add_argument("--json_out", default=None)
    p.add_argument("--seed", type=int, default=0)
    compile_options.add_compile_arguments(p)
    p.set_defaults(compile_mode="reduce-overhead")
    args = p.parse_args(argv)
    args.compile = True  # for validation / environment; the eager phase simply does not call compile_model_blocks
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    bad = set(args.phases) - {"eager", "compiled"}
    if bad or not args.phases:
        p.error(f"--phases takes eager and/or compiled, got {sorted(bad) or args.phases}")
    if args.no_fused and not args.full:
        p.error("--no_fused applies only with --full")
    args.fused = args.full and not args.no_fused
    if (args.fp8_base or args.blocks_to_swap) and (args.family != "flux" or args.full):
        p.error("--fp8_base and --blocks_to_swap apply only to --family flux LoRA")
    if args.blocks_to_swap < 0:
        p.error(f"--blocks_to_swap must be 0 or more, got {args.blocks_to_swap}")
    if args.attention_only_lora and (args.family != "sdxl" or args.full or args.lora_impl == "peft"):
        p.error("--attention_only_lora applies only to --family sdxl LoRA with the project's networks.lora")
    if args.channels_last and args.family != "sdxl":
        p.error("--channels_last applies only to --family sdxl")
    return args


# ----------------------------------------------------------------------------------------------- models


def build_sdxl_unet(args):
    from diffusers import UNet2DConditionModel

    cfg = json.loads((REPO / "sd-scripts/library/configs/sdxl/unet/config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    if args.tiny:
        cfg.update(SDXL_TINY_OVERRIDES)
    with torch.device(args.device):
        model = UNet2DConditionModel.from_config(cfg)
    return model.to(torch.bfloat16)


def build_flux(args):
    from diffusers import FluxTransformer2DModel

    cfg = dict(FLUX_DEV_CONFIG)
    if args.tiny:
        cfg.update(FLUX_TINY_OVERRIDES)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 12B parameters: build directly in bf16
    try:
        with torch.device(args.device):
            model = FluxTransformer2DModel(**cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to(torch.bfloat16)
    if args.fp8_base:
        from library import flux_models

        n = flux_models.apply_fp8_base(model)
        logger.info(f"fp8 base: {n} Linear layers in {flux_models.FP8_DTYPE}")
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()  # give back the bf16 build to other processes on the GPU
    return model


def _lora_targets(model, family) -> list[str]:
    """Names of the Linear layers a kohya LoRA trains: Transformer2DModel (SDXL) / all transformer blocks (FLUX)."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if family == "sdxl" and ".attentions." in name:
            names.append(name)
        elif family == "flux" and "transformer_blocks." in name:
            names.append(name)
    return names


def apply_lora(model, args) -> tuple[str, list[torch.nn.Parameter]]:
    """Freeze the base, add LoRA; returns (implementation used, trainable params in fp32)."""
    model.requires_grad_(False)
    impl = args.lora_impl
    if impl in ("auto", "kohya"):
        try:
            params = _apply_kohya_lora(model, args)
            if args.network_module == "lycoris.kohya":
                return "LyCORIS " + " ".join(args.network_args or ["algo=lora"]), params
            return "kohya networks." + ("lora" if args.family == "sdxl" else "lora_flux"), params
        except Exception as e:  # auto: fall back to peft while the project's module is missing or incomplete
            if impl == "kohya" or args.attention_only_lora or args.network_module != "networks.lora":
                raise
            logger.warning(f"project LoRA module not usable ({type(e).__name__}: {e}); using peft LoRA")
    from peft import LoraConfig, inject_adapter_in_model

    cfg = LoraConfig(r=args.rank, lora_alpha=args.rank, lora_dropout=0.0, target_modules=_lora_targets(model, args.family))
    inject_adapter_in_model(cfg, model)
    params = []
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            p.requires_grad_(True)
            params.append(p)
    return "peft", params


_ATTENTION_PROJECTIONS = ("_to_q", "_to_k", "_to_v", "_to_out_0")  # kohya LoRA names of attn1/attn2 projections


def _apply_kohya_lora(model, args):
    """The project's own LoRA modules (networks/lora.py, networks/lora_flux.py), kohya's create_network API."""
    import importlib

    name = "networks.lora" if args.family == "sdxl" else "networks.lora_flux"
    if args.network_module == "lycoris.kohya":
        name = "networks.lycoris_kohya"
    mod = importlib.import_module(name)
    if not hasattr(mod, "create_network"):
        raise ImportError(f"{mod.__name__} has no create_network yet")
    kwargs = dict(a.split("=", 1) for a in args.network_args)
    network = mod.create_network(1.0, args.rank, args.rank, None, [], model, **kwargs)
    if args.attention_only_lora:
        network.unet_loras = [lora for lora in network.unet_loras if lora.lora_name.endswith(_ATTENTION_PROJECTIONS)]
    network.apply_to([], model, apply_text_encoder=False, apply_unet=True)
    network.to(args.device, dtype=torch.float32)
    network.requires_grad_(True)
    return [p for p in network.parameters() if p.requires_grad]


# ----------------------------------------------------------------------------------------------- inputs


def setup_full(model, args):
    """Every weight trainable in bf16, Adafactor as sdxl_train.py's 24 GB preset, optionally fused backward."""
    from transformers.optimization import Adafactor

    from library import full_trainer

    model.requires_grad_(True)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = Adafactor(params, lr=1e-6, relative_step=False, scale_parameter=False, warmup_init=False)
    if args.fused:
        # per-tensor clipping at 1.0 as the trainers do; each gradient is all-reduced first under torchrun
        full_trainer.register_fused_backward(SimpleNamespace(max_grad_norm=1.0), _DATA_PARALLEL, optimizer)
    return "full fine-tune, Adafactor" + (" fused backward" if args.fused else ""), params, optimizer


def make_inputs(args, n_sets=3):
    """A few input sets to rotate through (cached latents + text-encoder outputs, random)."""
    g = torch.Generator(device=args.device).manual_seed(args.seed)
    dev, b = args.device, args.batch_size
    sets = []
    for _ in range(n_sets):
        if args.family == "sdxl":
            h = w = args.resolution // 8
            ctx, pooled = (64, 16) if args.tiny else (2048, 1280)
            n_ids = 6
            sets.append(dict(
                latents=torch.randn(b, 4, h, w, device=dev, generator=g),
                noise=torch.randn(b, 4, h, w, device=dev, generator=g),
                timesteps=torch.randint(0, 1000, (b,), device=dev, generator=g),
                ctx=torch.randn(b, args.text_len or 77, ctx, device=dev, generator=g),
                pooled=torch.randn(b, pooled, device=dev, generator=g),
                time_ids=torch.tensor([args.resolution, args.resolution, 0, 0, args.resolution, args.resolution],
                                      device=dev, dtype=torch.float32).repeat(b, 1)[:, :n_ids],
            ))
        else:
            h = w = args.resolution // 16  # 8x VAE, then 2x2 packing
            txt = args.text_len or (8 if args.tiny else 512)
            ctx, pooled = (32, 16) if args.tiny else (4096, 768)
            img_ids = torch.zeros(h, w, 3, device=dev)
            img_ids[..., 1] = torch.arange(h, device=dev)[:, None]
            img_ids[..., 2] = torch.arange(w, device=dev)[None, :]
            sets.append(dict(
                latents=torch.randn(b, h * w, 64, device=dev, generator=g),
                noise=torch.randn(b, h * w, 64, device=dev, generator=g),
                t=torch.rand(b, device=dev, generator=g),
                ctx=torch.randn(b, txt, ctx, device=dev, generator=g),
                pooled=torch.randn(b, pooled, device=dev, generator=g),
                img_ids=img_ids.reshape(-1, 3),
                txt_ids=torch.zeros(txt, 3, device=dev),
                guidance=torch.full((b,), 3.5, device=dev),
            ))
    return sets


def loss_fn(model, batch, args):
    autocast = torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16)
    if args.family == "sdxl":
        noisy = batch["latents"] + batch["noise"]  # the scheduler's scaling does not change the cost
        with autocast:
            pred = model(
                noisy, batch["timesteps"], batch["ctx"],
                added_cond_kwargs={"text_embeds": batch["pooled"], "time_ids": batch["time_ids"]},
            ).sample
        target = batch["noise"]
    else:
        t = batch["t"][:, None, None]
        noisy = (1 - t) * batch["latents"] + t * batch["noise"]
        with autocast:
            pred = model(
                hidden_states=noisy, encoder_hidden_states=batch["ctx"], pooled_projections=batch["pooled"],
                timestep=batch["t"], img_ids=batch["img_ids"], txt_ids=batch["txt_ids"], guidance=batch["guidance"],
            ).sample
        target = batch["noise"] - batch["latents"]
    return torch.nn.functional.mse_loss(pred.float(), target.float())


# ----------------------------------------------------------------------------------------------- timing


def _sync(args):
    if torch.device(args.device).type == "cuda":
        torch.cuda.synchronize()


def train_step(model, optimizer, params, batch, args, compiled: bool) -> torch.Tensor:
    if compiled:
        compile_graphs.mark_step_begin(args)
    loss = loss_fn(model, batch, args)
    loss.backward()  # with --full (fused) the optimizer steps each parameter in here (after its all-reduce)
    if not args.fused:
        data_parallel.all_reduce_gradients(params, _DATA_PARALLEL)  # no-op in one process, as in the trainers
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def run_phase(model, optimizer, params, inputs, args, compiled: bool) -> dict:
    cuda = torch.device(args.device).type == "cuda"
    if cuda:  # drop cached blocks (the bf16 build before fp8 / block swap) so the reserved peak is this phase's
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = []
    losses = []
    total = args.warmup + args.steps
    for i in range(total):
        if i == args.warmup and args.gc_freeze:
            import gc

            gc.collect()
            gc.freeze()
        _sync(args)
        t0 = time.perf_counter()
        loss = train_step(model, optimizer, params, inputs[i % len(inputs)], args, compiled)
        _sync(args)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        if i == 0:
            logger.info(f"{'compiled' if compiled else 'eager'}: first step {times[0]:.2f} s")
            if compiled:
                first_step_compile_stats = _compile_stats()
    timed = times[args.warmup:] or times
    med = statistics.median(timed)
    out = dict(
        step_ms_median=med * 1000,
        step_ms_min=min(timed) * 1000,
        it_per_s=1.0 / med,
        images_per_s=_DATA_PARALLEL.num_processes * args.batch_size / med,
        first_step_s=times[0],
        step_s=times,
        loss_finite=all(map(lambda x: x == x and abs(x) != float("inf"), losses)),
    )
    if cuda:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    if compiled:
        out["compile_stats_after_first_step"] = first_step_compile_stats
        out["compile_stats_end"] = _compile_stats()
    if args.profile:
        out["profile"] = profile_steps(model, optimizer, params, inputs, args, compiled)
    return out


def profile_steps(model, optimizer, params, inputs, args, compiled: bool) -> dict:
    """Profiles --profile more steps: wall time, the share of it the GPU was busy, the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _sync(args)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(args.profile):
            train_step(model, optimizer, params, inputs[i % len(inputs)], args, compiled)
        _sync(args)
        wall_us = (time.perf_counter() - t0) * 1e6
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy_us, end = 0.0, float("-inf")
    for a, b in spans:  # union of kernel intervals (kernels on several streams may overlap)
        if b > end:
            busy_us += b - max(a, end)
            end = b
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
    if _RANK == 0:
        print(f"\nprofile ({'compiled' if compiled else 'eager'}, {args.profile} steps): wall {wall_us / 1e3:.1f} ms, "
              f"GPU busy {busy_us / 1e3:.1f} ms ({100 * busy_us / wall_us:.0f}%), {len(spans)} kernels\n{table}")
    return dict(steps=args.profile, wall_ms=wall_us / 1e3, gpu_busy_ms=busy_us / 1e3, kernels=len(spans), table=table)


class _BypassReasons(logging.Handler):
    """Collects inductor's 'Bypassing FX Graph Cache because ...' messages (why a warm start stays cold)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "Bypass" in msg and msg not in self.reasons:
            self.reasons.append(msg[:500])


_BYPASS = _BypassReasons()


def _compile_stats() -> dict:
    """Cache hits/misses and where the compile time went (for the warm-start figures)."""
    from torch._dynamo.utils import compile_times, counters

    keep = {"cache_bypass_reasons": list(_BYPASS.reasons)}
    for group in ("inductor", "aot_autograd", "stats", "frames"):
        for k, v in counters[group].items():
            if group != "inductor" or "cache" in k:
                keep[f"{group}.{k}"] = v
    try:
        keep["compile_times"] = compile_times(repr="str", aggregate=True)
    except Exception as e:  # diagnostic only
        keep["compile_times"] = f"unavailable: {e}"
    return keep


def setup_data_parallel(args) -> None:
    """Under torchrun (WORLD_SIZE > 1): one process per GPU, NCCL, different random inputs per process."""
    global _RANK
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return
    _RANK = int(os.environ["RANK"])
    if torch.device(args.device).type == "cuda":
        local = int(os.environ["LOCAL_RANK"])
        args.device = f"cuda:{local}"
        torch.cuda.set_device(local)
        torch.distributed.init_process_group("nccl", device_id=torch.device(args.device))
    else:  # CPU smoke run of this mode
        torch.distributed.init_process_group("gloo")
    _DATA_PARALLEL.num_processes = world
    args.seed += _RANK
    if _RANK != 0:
        logging.getLogger().setLevel(logging.WARNING)


def apply_inductor_config(items: list[str]) -> None:
    """--inductor_config KEY=VALUE: set torch._inductor.config.KEY (dotted) to the Python literal VALUE."""
    import ast

    import torch._inductor.config as inductor_config

    for item in items:
        key, sep, value = item.partition("=")
        target, *path = [inductor_config, *key.split(".")]
        for part in path[:-1]:
            target = getattr(target, part, None)
        if not sep or target is None or not hasattr(target, path[-1]):
            raise SystemExit(f"--inductor_config takes KEY=VALUE with KEY in torch._inductor.config; got {item!r}")
        try:
            setattr(target, path[-1], ast.literal_eval(value))
        except (ValueError, SyntaxError):
            raise SystemExit(f"--inductor_config {item!r}: VALUE must be a Python literal (True, 0, 'text')") from None


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    t_start = time.perf_counter()
    args = parse_args(argv)
    setup_data_parallel(args)
    compile_options.validate_compile_args(args)
    env = {**compile_environment.apply_process_settings(args), **compile_environment.setup_compile_environment(args)}
    apply_inductor_config(args.inductor_config)
    for name in ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache"):
        lg = logging.getLogger(name)
        lg.addHandler(_BYPASS)
        lg.setLevel(min(lg.getEffectiveLevel(), logging.INFO))
    torch.manual_seed(args.seed)

    model = build_sdxl_unet(args) if args.family == "sdxl" else build_flux(args)
    model.train()
    if args.channels_last:
        model.to(memory_format=torch.channels_last)
    if args.gradient_checkpointing:
        model.enable_gradient_checkpointing()  # diffusers' way, used by the eager phase
    if args.full:
        impl, params, optimizer = setup_full(model, args)
    else:
        impl, params = apply_lora(model, args)
        if args.adamw == "foreach":
            optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        else:
            from library import train_util

            opt_args = SimpleNamespace(optimizer_type="AdamW", optimizer_args=None, learning_rate=1e-4,
                                       lr_scheduler="constant", use_8bit_adam=False)
            optimizer = train_util.get_optimizer(opt_args, params)[2]
    if args.blocks_to_swap:  # after the LoRA is applied, as NetworkTrainer.setup_trainable -> place_unet
        from library import flux_train_utils

        flux_train_utils.place_transformer(model, args.device, torch.bfloat16, args.fp8_base, args.blocks_to_swap)
    inputs = make_inputs(args)
    _sync(args)
    t_loaded = time.perf_counter()
    n_lora = sum(p.numel() for p in params)
    logger.info(f"model ready in {t_loaded - t_start:.1f} s; {impl}: {n_lora / 1e6:.1f} M trained params")

    result = dict(
        device=torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        family=args.family,
        resolution=args.resolution,
        batch_size=args.batch_size,
        gradient_checkpointing=args.gradient_checkpointing,
        compile_backend=args.compile_backend,
        compile_mode=args.compile_mode,
        compile_dynamic=args.compile_dynamic,
        lora_impl=impl + (", attention projections only" if args.attention_only_lora else ""),
        full=args.full,
        fused_backward_pass=args.fused,
        optimizer=type(optimizer).__name__ + (" fused" if optimizer.defaults.get("fused") else
                                               " foreach" if optimizer.defaults.get("foreach") else ""),
        fp8_base=args.fp8_base,
        blocks_to_swap=args.blocks_to_swap,
        lora_rank=args.rank,
        lora_params=n_lora,
        cache_dir=env.get("cache_dir"),
        cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled() if torch.device(args.device).type == "cuda" else None,
        cudnn_benchmark=torch.backends.cudnn.benchmark,
        channels_last=args.channels_last,
        world_size=_DATA_PARALLEL.num_processes,
        inductor_config=args.inductor_config,
        keep_cache_on_capture=args.keep_cache_on_capture,
        model_ready_s=t_loaded - t_start,
    )
    if "eager" in args.phases:
        result["eager"] = run_phase(model, optimizer, params, inputs, args, compiled=False)
    if "compiled" in args.phases:
        name = "SDXL UNet" if args.family == "sdxl" else "FLUX"
        if args.gradient_checkpointing and args.gc_blocks_only:
            model.disable_gradient_checkpointing()
        result["gc_blocks_only"] = bool(args.gc_blocks_only)
        result["compiled_blocks"] = regional.compile_model_blocks(
            model, args, model_name=name, gradient_checkpointing=args.gradient_checkpointing,
            disable_linear=args.blocks_to_swap > 0,
        )
        if args.keep_cache_on_capture:
            torch.cuda.empty_cache()
            torch.cuda.empty_cache = lambda: None
        result["compiled"] = run_phase(model, optimizer, params, inputs, args, compiled=True)
        # time to first step after the model is loaded (the warm-start figure when the cache is warm)
        result["compiled"]["time_to_first_step_s"] = result["compiled"]["first_step_s"]
    if "eager" in result and "compiled" in result:
        result["speedup"] = result["eager"]["step_ms_median"] / result["compiled"]["step_ms_median"]

    if _RANK != 0:  # every process trained; one reports
        return result
    print_summary(result)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json_out + ".tmp"
        Path(tmp).write_text(json.dumps(result, indent=1))
        os.replace(tmp, args.json_out)
    return result


def print_summary(r):
    what = r["lora_impl"] if r.get("full") else f"LoRA r{r['lora_rank']} ({r['lora_impl']})"
    extra = (" fp8 base" if r.get("fp8_base") else "") + (f" swap {r['blocks_to_swap']}" if r.get("blocks_to_swap") else "")
    extra += (" channels-last" if r.get("channels_last") else "") + (" cudnn-sdp" if r.get("cudnn_sdp") else "")
    extra += " cudnn-benchmark" if r.get("cudnn_benchmark") else ""
    extra += f" x{r['world_size']} GPUs data-parallel" if r.get("world_size", 1) > 1 else ""
    head = (f"{r['family']} {r['resolution']}px bs{r['batch_size']}{' +GC' if r['gradient_checkpointing'] else ''}{extra} "
            f"{what} on {r['device']}, torch {r['torch']}, "
            f"compile {r['compile_backend']}/{r['compile_mode']}")
    print("\n" + head)
    print(f"{'phase':<10}{'step ms (median)':>18}{'it/s':>8}{'images/s':>10}{'first step s':>14}{'peak GiB':>10}"
          f"{'reserved GiB':>14}")
    for phase in ("eager", "compiled"):
        if phase in r:
            x = r[phase]
            peak = f"{x['peak_mem_gib']:.2f}" if "peak_mem_gib" in x else "-"
            res = f"{x['peak_reserved_gib']:.2f}" if "peak_reserved_gib" in x else "-"
            print(f"{phase:<10}{x['step_ms_median']:>18.1f}{x['it_per_s']:>8.2f}{x['images_per_s']:>10.2f}"
                  f"{x['first_step_s']:>14.2f}{peak:>10}{res:>14}")
    if "speedup" in r:
        print(f"speedup (eager / compiled): {r['speedup']:.2f}x; cold compile (first compiled step): "
              f"{r['compiled']['first_step_s']:.1f} s; compiled blocks: {r['compiled_blocks']}")


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()

"""Sample images during training: a diffusers pipeline built from the components being trained (so the LoRA
hooks are active), one image per prompt of `--sample_prompts`, saved under `<output_dir>/sample/`.

File names follow kohya: `<output_name>_<e000001 | 000010>_<i:02d>_<YYYYmmddHHMMSS>_<seed>.png`.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import random
import time
from typing import Callable, Iterator

import torch

from library import files

logger = logging.getLogger(__name__)

# kohya's sampler names -> diffusers scheduler class names (library.sampling builds them)
SAMPLER_CHOICES = ["ddim", "pndm", "lms", "euler", "euler_a", "heun", "dpm_2", "dpm_2_a", "dpmsolver",
                   "dpmsolver++", "dpmsingle", "k_lms", "k_euler", "k_euler_a", "k_dpm_2", "k_dpm_2_a"]


def add_sample_arguments(parser) -> None:
    parser.add_argument("--sample_every_n_steps", type=int, default=None, help="sample images every N steps")
    parser.add_argument("--sample_every_n_epochs", type=int, default=None, help="sample images every N epochs")
    parser.add_argument("--sample_prompts", type=str, default=None, help="prompt file (.txt/.toml/.json)")
    parser.add_argument("--sample_sampler", type=str, default="ddim", choices=SAMPLER_CHOICES,
                        help="sampler of the sample images")
    parser.add_argument("--sample_at_first", action="store_true", help="sample images before training")


def check_sample_args(args) -> None:
    """Before anything loads: positive intervals, an existing prompt file."""
    from library.errors import ConfigError

    for name in ("sample_every_n_steps", "sample_every_n_epochs"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"--{name} must be 1 or more, got {value}")
    if args.sample_prompts and not os.path.isfile(args.sample_prompts):
        raise ConfigError(f"--sample_prompts: file not found: {args.sample_prompts}")

# kohya's --sample_sampler names -> (diffusers scheduler class, extra kwargs)
_SAMPLERS = {
    "ddim": ("DDIMScheduler", {"clip_sample": False, "set_alpha_to_one": False, "steps_offset": 1}),
    "pndm": ("PNDMScheduler", {"skip_prk_steps": True, "steps_offset": 1}),
    "lms": ("LMSDiscreteScheduler", {}),
    "k_lms": ("LMSDiscreteScheduler", {}),
    "euler": ("EulerDiscreteScheduler", {}),
    "k_euler": ("EulerDiscreteScheduler", {}),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "k_euler_a": ("EulerAncestralDiscreteScheduler", {}),
    "heun": ("HeunDiscreteScheduler", {}),
    "dpm_2": ("KDPM2DiscreteScheduler", {}),
    "k_dpm_2": ("KDPM2DiscreteScheduler", {}),
    "dpm_2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    "k_dpm_2_a": ("KDPM2AncestralDiscreteScheduler", {}),
    "dpmsolver": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver"}),
    "dpmsolver++": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++"}),
    "dpmsingle": ("DPMSolverSinglestepScheduler", {}),
}


def make_sample_scheduler(sampler: str, prediction_type: str):
    """A diffusers scheduler for kohya's sampler name, on the SD/SDXL training noise schedule."""
    import diffusers

    key = (sampler or "ddim").lower()
    if key not in _SAMPLERS:
        raise ValueError(f"sampler {sampler!r} is not supported; allowed: {', '.join(_SAMPLERS)}")
    class_name, extra = _SAMPLERS[key]
    cls = getattr(diffusers, class_name)
    kwargs = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                  prediction_type=prediction_type, **extra)
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in kwargs.items() if k in accepted})


def sample_image_name(output_name: str | None, epoch: int | None, steps: int, index: int, seed: int | None) -> str:
    suffix = f"e{epoch:06d}" if epoch is not None else f"{steps:06d}"
    ts = time.strftime("%Y%m%d%H%M%S", time.localtime())
    seed_part = f"_{seed}" if seed is not None else ""
    prefix = f"{output_name}_" if output_name else ""
    return f"{prefix}{suffix}_{index:02d}_{ts}{seed_part}.png"


def should_sample(args, *, epoch: int | None, steps: int) -> bool:
    """kohya's rule: at step ends when steps % sample_every_n_steps == 0, at epoch ends by epoch count."""
    if not getattr(args, "sample_prompts", None):
        return False
    if epoch is None:
        n = getattr(args, "sample_every_n_steps", None)
        return bool(n) and steps % n == 0
    n = getattr(args, "sample_every_n_epochs", None)
    return bool(n) and epoch % n == 0


@contextlib.contextmanager
def sampling_state(networks=()) -> Iterator[None]:
    """`networks` in eval mode while sampling; afterwards their modes and the global RNG states (CPU, CUDA,
    Python) are restored, so sampling does not change the training run."""
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    py_state = random.getstate()
    was_training = [(n, n.training) for n in networks]
    for n in networks:
        n.eval()
    try:
        yield
    finally:
        for n, mode in was_training:
            n.train(mode)
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)
        random.setstate(py_state)


def save_sample_image(image, args, *, epoch: int | None, steps: int, index: int, seed: int | None,
                      prompt: str) -> str:
    """Writes a sample to <output_dir>/sample/ under kohya's name (temporary name, then renamed)."""
    out_dir = os.path.join(args.output_dir, "sample")
    path = os.path.join(out_dir, sample_image_name(args.output_name, epoch, steps, index, seed))
    with files.atomic_target(path) as tmp:
        image.save(tmp)
    logger.info("sample image: %s (prompt %r)", path, prompt)
    return path


@torch.no_grad()
def sample_images(args, *, build_pipeline: Callable[[object], object], device: torch.device, epoch: int | None,
                  steps: int, prediction_type: str = "epsilon", autocast=None, networks=(),
                  encode_prompt: Callable[[str, str], dict] | None = None) -> list[str]:
    """Generates one image per prompt of args.sample_prompts and returns the saved paths.

    build_pipeline(scheduler) -> a diffusers pipeline over the live training components.
    encode_prompt(prompt, negative_prompt) -> pipeline embedding kwargs (prompt_embeds, ...) encoded the way
    the trainer encodes captions (clip skip, long prompts); without it the pipeline encodes the text itself.
    The global RNG states are restored afterwards, so sampling does not change the training run.
    """
    from library.sample_prompts import parse_prompt_file

    prompts = parse_prompt_file(args.sample_prompts)
    replacement = getattr(args, "prompt_replacement", None)  # textual inversion (library.targets.embedding)
    if replacement:
        for p in prompts:
            for key in ("prompt", "negative_prompt"):
                if p.get(key):
                    p[key] = p[key].replace(*replacement)
    if not prompts:
        logger.warning("--sample_prompts %s has no prompts", args.sample_prompts)
        return []
    os.makedirs(os.path.join(args.output_dir, "sample"), exist_ok=True)
    paths = []
    with sampling_state(networks):
        for i, p in enumerate(prompts):
            sampler = p.get("sample_sampler") or args.sample_sampler
            pipe = build_pipeline(make_sample_scheduler(sampler, prediction_type))
            pipe.set_progress_bar_config(disable=True)
            seed = p.get("seed")
            generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
            kwargs = dict(width=p.get("width", 512), height=p.get("height", 512),
                          num_inference_steps=p.get("sample_steps", 30), guidance_scale=p.get("scale", 7.5),
                          generator=generator)
            ctx = autocast() if autocast is not None else torch.autocast(device.type, enabled=False)
            with ctx:
                if encode_prompt is not None:
                    kwargs.update(encode_prompt(p["prompt"], p.get("negative_prompt") or ""))
                else:
                    kwargs.update(prompt=p["prompt"], negative_prompt=p.get("negative_prompt") or None)
                image = pipe(**kwargs).images[0]
            paths.append(save_sample_image(image, args, epoch=epoch, steps=steps, index=i, seed=seed,
                                           prompt=p["prompt"]))
    return paths

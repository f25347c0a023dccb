"""Helpers for the LoRA trainer tests: load a kohya LoRA file into a diffusers pipeline built from the same
tiny components and check that every tensor landed (no key left over) and that it changes the output."""
from __future__ import annotations

import logging

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file


def read_lora(path):
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    return load_file(str(path)), metadata


def build_pipeline(components):
    from diffusers import DDIMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline

    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False, steps_offset=1, prediction_type=components.prediction_type)
    if components.family == "sdxl":
        (te1, te2), (tok1, tok2) = components.text_encoders, components.tokenizers
        return StableDiffusionXLPipeline(vae=components.vae, text_encoder=te1, text_encoder_2=te2, tokenizer=tok1,
                                         tokenizer_2=tok2, unet=components.unet, scheduler=scheduler)
    return StableDiffusionPipeline(vae=components.vae, text_encoder=components.text_encoders[0],
                                   tokenizer=components.tokenizers[0], unet=components.unet, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def run_pipeline(pipe, size=64):
    out = pipe(prompt="a red circle", num_inference_steps=2, guidance_scale=5.0, width=size, height=size,
               generator=torch.Generator().manual_seed(0), output_type="np")
    return np.asarray(out.images[0])


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _module_paths(root):
    return {id(m): name for name, m in root.named_modules()}


def check_loads_in_diffusers(lora_path, components):
    """Loads the LoRA with `load_lora_weights`; asserts no warning about keys, every LoRA module of the file
    landed with the same delta weight (up @ down * alpha / dim), and the output changes. Returns #modules."""
    from networks.lora import create_network

    sd, _ = read_lora(lora_path)
    pipe = build_pipeline(components)
    before = run_pipeline(pipe)

    # which diffusers module each kohya name belongs to (computed by our own naming on the same models)
    tes = list(components.text_encoders)
    net = create_network(1.0, 4, 1.0, components.vae, tes if len(tes) > 1 else tes[0], components.unet)
    roots = {"lora_unet": ("unet", components.unet)}
    if len(tes) == 1:
        roots["lora_te"] = ("text_encoder", tes[0])
    else:
        roots["lora_te1"] = ("text_encoder", tes[0])
        roots["lora_te2"] = ("text_encoder_2", tes[1])
    where = {}
    for lora in net.text_encoder_loras + net.unet_loras:
        prefix = next(p for p in sorted(roots, key=len, reverse=True) if lora.lora_name.startswith(p + "_"))
        attr, root = roots[prefix]
        where[lora.lora_name] = (attr, _module_paths(root)[id(lora.org_module)])

    names = sorted({k.split(".")[0] for k in sd})
    assert set(names) <= set(where), f"file has LoRA modules our naming does not know: {set(names) - set(where)}"

    capture = _Capture()
    loggers = [logging.getLogger(n) for n in ("diffusers", "peft", "diffusers.loaders.peft",
                                              "diffusers.loaders.lora_pipeline", "diffusers.utils.peft_utils")]
    for lg in loggers:
        lg.addHandler(capture)
    try:
        pipe.load_lora_weights(str(lora_path), adapter_name="trained")
    finally:
        for lg in loggers:
            lg.removeHandler(capture)
    # "No LoRA keys associated to <text encoder>" is expected for a UNet-only LoRA
    bad = [m for m in capture.messages if ("key" in m.lower() or "unexpected" in m.lower() or "missing" in m.lower())
           and not m.startswith("No LoRA keys associated to")]
    assert not bad, f"diffusers warned while loading: {bad}"

    for name in names:
        attr, path = where[name]
        module = getattr(pipe, attr).get_submodule(path)
        assert hasattr(module, "lora_A") and "trained" in module.lora_A, f"{name} -> {attr}.{path} got no LoRA"
        a = module.lora_A["trained"].weight.detach().float()
        b = module.lora_B["trained"].weight.detach().float()
        got = b.flatten(1) @ a.flatten(1) * module.scaling["trained"]
        down, up = sd[f"{name}.lora_down.weight"].float(), sd[f"{name}.lora_up.weight"].float()
        alpha = float(sd[f"{name}.alpha"]) if f"{name}.alpha" in sd else down.shape[0]
        want = up.flatten(1) @ down.flatten(1) * (alpha / down.shape[0])
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4), f"{name}: delta weight differs after loading"
    after = run_pipeline(pipe)
    assert np.abs(after - before).max() > 0, "the LoRA did not change the pipeline output"
    return len(names)

"""Where a Chroma LoRA step's GPU time goes, block by block: one full-size Chroma double block and one single block
(diffusers' classes, random bf16 weights, frozen as under LoRA), forward + backward at 1024 px batch 1, eager, with

- "masked 512": the text padded to 512 T5 tokens and the attention mask (what the trainer ran before it cut the
  text: the caption + 1 padding token seen),
- "cut": the text cut after the caption + its padding token, no mask (what it runs now, as upstream),
- FLUX.1's double and single blocks at 512 text tokens, no mask (the FLUX.1-dev LoRA step's blocks).

Prints per variant the median milliseconds of each block's forward + backward (stack_ms: 19 double + 38 single
blocks, the model's share of a step before any recompute), the peak memory above the inputs, and the CUDA kernels
of one double + one single block by time.

    python tools/profile_chroma_blocks.py [--caption_tokens 12] [--json OUT.json]    # one CUDA GPU
    python tools/profile_chroma_blocks.py --tiny                                      # CPU check, tiny widths
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def make_blocks(kind: str, width: int, heads: int, device, dtype):
    from diffusers.models.transformers import transformer_chroma as tc, transformer_flux as tf

    if kind == "chroma":
        double = tc.ChromaTransformerBlock(width, heads, width // heads)
        single = tc.ChromaSingleTransformerBlock(width, heads, width // heads)
    else:
        double = tf.FluxTransformerBlock(width, heads, width // heads)
        single = tf.FluxSingleTransformerBlock(width, heads, width // heads)
    return [b.to(device, dtype).requires_grad_(False) for b in (double, single)]


def block_inputs(kind: str, width: int, text: int, image: int, seen: int | None, device, dtype):
    """The blocks' inputs; `seen`: mask the text tokens from there on (None: no mask)."""
    from diffusers.models.embeddings import FluxPosEmbed

    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    ids = torch.zeros(text + image, 3)
    side = int(image ** 0.5)
    ids[text:, 1] = torch.arange(image) // side
    ids[text:, 2] = torch.arange(image) % side
    rope = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids.to(device))
    rope = tuple(r.to(device) for r in rope)
    attn_mask = None
    if seen is not None:  # the caption + 1 padding token seen, then every image token
        attn_mask = torch.cat([torch.arange(text) < seen, torch.ones(image, dtype=torch.bool)])[None].to(device)
    img, txt = rand(1, image, width), rand(1, text, width)
    temb_double = rand(1, 12, width) * 0.1 if kind == "chroma" else rand(1, width)
    temb_single = rand(1, 3, width) * 0.1 if kind == "chroma" else rand(1, width)
    return img, txt, rope, attn_mask, temb_double, temb_single


def run_double(kind, double, single, inputs):
    img, txt, rope, attn_mask, temb_double, _ = inputs
    img = img.detach().requires_grad_(True)
    txt = txt.detach().requires_grad_(True)
    extra = {"attention_mask": attn_mask} if kind == "chroma" else {}
    txt_out, img_out = double(hidden_states=img, encoder_hidden_states=txt, temb=temb_double,
                              image_rotary_emb=rope, **extra)
    (img_out.float().square().mean() + txt_out.float().square().mean()).backward()


def run_single(kind, double, single, inputs):
    img, txt, rope, attn_mask, _, temb_single = inputs
    if kind == "chroma":  # the text and image tokens as one sequence
        joint = torch.cat([txt, img], dim=1).detach().requires_grad_(True)
        out = single(hidden_states=joint, temb=temb_single, image_rotary_emb=rope, attention_mask=attn_mask)
        out.float().square().mean().backward()
    else:  # FLUX.1's single block joins them itself and returns them apart
        img, txt = img.detach().requires_grad_(True), txt.detach().requires_grad_(True)
        txt_out, img_out = single(hidden_states=img, encoder_hidden_states=txt, temb=temb_single,
                                  image_rotary_emb=rope)
        (img_out.float().square().mean() + txt_out.float().square().mean()).backward()


def measure(name, kind, text, args, device, dtype, seen=None) -> dict:
    width, heads = (128, 1) if args.tiny else (3072, 24)
    image = 16 if args.tiny else 4096
    double, single = make_blocks(kind, width, heads, device, dtype)
    inputs = block_inputs(kind, width, text, image, seen, device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result = {"variant": name, "text_tokens": text, "image_tokens": image}
    for label, fn in (("double", run_double), ("single", run_single)):
        for _ in range(2):
            fn(kind, double, single, inputs)
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn(kind, double, single, inputs)
            sync()
            times.append((time.perf_counter() - t0) * 1000)
        result[f"{label}_ms"] = round(statistics.median(times), 2)
        result[f"{label}_peak_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2) \
            if device.type == "cuda" else 0.0
    # forward + backward of the whole stack, without recompute (19 double + 38 single blocks)
    result["stack_ms"] = round(19 * result["double_ms"] + 38 * result["single_ms"], 1)
    activity = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activity.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activity) as prof:
        run_double(kind, double, single, inputs)
        run_single(kind, double, single, inputs)
        sync()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=70)
    print(json.dumps(result), flush=True)
    print(table, flush=True)
    del double, single, inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--caption_tokens", type=int, default=12, help="T5 tokens of the caption (the bench's is 12)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rows", type=int, default=14)
    p.add_argument("--tiny", action="store_true", help="tiny widths on the CPU (a check that it runs)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    full = 16 if args.tiny else 512
    cut = min(args.caption_tokens + 1, full)
    rows = [measure("chroma masked 512", "chroma", full, args, device, dtype, seen=cut),
            measure("chroma cut", "chroma", cut, args, device, dtype),
            measure("flux 512", "flux", full, args, device, dtype)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

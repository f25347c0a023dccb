"""Merge LoRAs into a FLUX.1 model (and its CLIP-L / T5-XXL), or several FLUX.1 LoRAs into one (kohya-ss/sd-scripts'
networks/flux_merge_lora.py, same options and files):

    python sd-scripts/networks/flux_merge_lora.py --flux_model flux1-dev.safetensors --save_to merged.safetensors \
        --models a.safetensors b.safetensors --ratios 1 0.5 [--clip_l clip_l.safetensors --clip_l_save_to c.safetensors]
    python sd-scripts/networks/flux_merge_lora.py --save_to ab.safetensors --models a.safetensors b.safetensors \
        --ratios 1 1 [--concat]

Into a model: W += ratio * up x down * alpha / rank for each module (kohya names: lora_unet_ = transformer,
lora_te1_ = CLIP-L, lora_te3_ = T5-XXL), in --precision on --working_device, the weights read onto
--loading_device; the transformer as a BFL single file (a diffusers folder is read too), written with its keys.
LoRAs in diffusers / ai-toolkit layout are converted to kohya's first (--diffusers, or found by their keys).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from library import lora_tools  # noqa: E402

logger = lora_tools.logger
PREFIXES = {"flux": "lora_unet", "clip_l": "lora_te1", "t5xxl": "lora_te3"}


def _kohya(sd: dict) -> dict:
    return lora_tools.flux_lora_from_diffusers(sd) if lora_tools.is_diffusers_flux_lora(sd) else sd


def _read_text_encoder(path: str, flag: str, device) -> dict:
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise lora_tools.ToolError(f"{flag}: file not found: {path}")
    try:
        return load_file(path, device=str(device))
    except Exception as e:  # noqa: BLE001
        raise lora_tools.ToolError(f"{flag} {path}: cannot read it as safetensors ({e})") from e


def merge_to_flux_model(args, merge_dtype, save_dtype) -> dict[str, dict]:
    """{"flux"/"clip_l"/"t5xxl": merged state dict} for the models given."""
    state_dicts, name_maps = {}, {}
    if args.flux_model is not None:
        logger.info("loading FLUX.1 model: %s", args.flux_model)
        state_dicts["flux"], _ = lora_tools.flux_transformer_state_dict(args.flux_model, "--flux_model",
                                                                        args.loading_device, merge_dtype)
    if args.clip_l is not None:
        state_dicts["clip_l"] = _read_text_encoder(args.clip_l, "--clip_l", args.loading_device)
    if args.t5xxl is not None:
        state_dicts["t5xxl"] = _read_text_encoder(args.t5xxl, "--t5xxl", args.loading_device)
    for what, sd in state_dicts.items():
        name_maps[what] = lora_tools.lora_name_map(sd, PREFIXES[what])
    for path, ratio in zip(args.models, args.ratios):
        logger.info("loading: %s", path)
        lora_sd, _ = lora_tools.load_lora(path, merge_dtype)
        lora_sd = _kohya(lora_sd)
        lora_tools.check_lora_family(path, lora_sd, ("flux",), "FLUX.1", lora_tools.family_hint(
            lora_tools.lora_family(lora_sd)))
        mods = lora_tools.lora_modules(lora_sd)
        unused = []
        for name, m in lora_tools.progress(mods.items(), "merging", total=len(mods)):
            target = next(((w, name_maps[w][name]) for w in name_maps if name in name_maps[w]), None)
            if target is None:
                unused.append(name)
                continue
            what, key = target
            sd = state_dicts[what]
            weight = sd[key].to(args.working_device, merge_dtype)
            delta = lora_tools.delta_weight(m.down.to(args.working_device, merge_dtype),
                                            m.up.to(args.working_device, merge_dtype))
            try:
                delta = lora_tools.as_layer_weight(delta, weight)
            except lora_tools.ToolError as e:
                raise lora_tools.ToolError(f"{path}: module {name}: {e}; a LoRA for another model?") from e
            sd[key] = (weight + ratio * m.scale * delta).to(args.loading_device, save_dtype)
        if unused:
            if len(unused) == len(mods):
                raise lora_tools.ToolError(f"{path}: none of its {len(mods)} modules is in the models given "
                                           f"(e.g. {unused[0]}); text-encoder modules need --clip_l / --t5xxl")
            logger.warning("Unused keys in LoRA model: %d modules, e.g. %s", len(unused), unused[:3])
    return state_dicts


def merge(args: argparse.Namespace) -> None:
    args.models, args.ratios = args.models or [], args.ratios or []
    lora_tools.check_models_ratios(args.models, args.ratios)
    merge_dtype = lora_tools.str_to_dtype(args.precision, "--precision")
    save_dtype = lora_tools.str_to_dtype(args.save_precision) or merge_dtype
    if not (args.save_to or args.clip_l_save_to or args.t5xxl_save_to):
        raise lora_tools.ToolError("--save_to (or --clip_l_save_to / --t5xxl_save_to) is required")
    for model, dest, flag in ((args.clip_l, args.clip_l_save_to, "clip_l"), (args.t5xxl, args.t5xxl_save_to, "t5xxl")):
        if (model is None) != (dest is None):
            raise lora_tools.ToolError(f"--{flag} and --{flag}_save_to go together: give both or neither")
    if args.flux_model is not None and not args.save_to:
        raise lora_tools.ToolError("--flux_model needs --save_to (the merged transformer's file)")
    if args.flux_model is not None or args.clip_l is not None or args.t5xxl is not None:
        outputs = {"flux": args.save_to if args.flux_model else None, "clip_l": args.clip_l_save_to,
                   "t5xxl": args.t5xxl_save_to}
        for what, dest in outputs.items():
            if dest:
                lora_tools.output_path(dest, "--save_to" if what == "flux" else f"--{what}_save_to", args.overwrite,
                                       suffixes=(".safetensors", ".sft"))
        state_dicts = merge_to_flux_model(args, merge_dtype, save_dtype)
        for what, sd in state_dicts.items():
            md = None
            if what == "flux" and not args.no_metadata:
                md = lora_tools.modelspec("flux", lora=False, title=Path(args.save_to).stem, flux_variant="dev",
                                          merged=lora_tools.merged_from([args.flux_model] + args.models))
            from library import train_util

            logger.info("saving %s to: %s", what, outputs[what])
            Path(outputs[what]).parent.mkdir(parents=True, exist_ok=True)
            train_util.save_safetensors_atomic(lora_tools.cast_floats(sd, save_dtype), outputs[what], md,
                                               overwrite=args.overwrite)
        return
    lora_tools.output_path(args.save_to, "--save_to", args.overwrite)
    state_dict, md, _ = lora_tools.merge_lora_files(args.models, args.ratios, merge_dtype, concat=args.concat,
                                                    shuffle=args.shuffle, module="networks.lora_flux",
                                                    families=("flux",), convert=_kohya)
    md["ss_v2"] = "False"
    state_dict = lora_tools.cast_floats(state_dict, save_dtype)
    if not args.no_metadata:
        md.update(lora_tools.modelspec("flux", lora=True, title=Path(args.save_to).stem, flux_variant="dev",
                                       merged=lora_tools.merged_from(args.models)))
    logger.info("saving model to: %s", args.save_to)
    lora_tools.save_lora(args.save_to, state_dict, md, overwrite=args.overwrite)


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Merge LoRAs into a FLUX.1 model, or into one LoRA")
    parser.add_argument("--save_precision", type=str, default=None,
                        help="precision in saving (default: --precision): float, fp16, bf16, fp8 (= fp8_e4m3fn), "
                             "fp8_e4m3fn, fp8_e5m2")
    parser.add_argument("--precision", type=str, default="float",
                        help="precision in merging (float is recommended)")
    parser.add_argument("--flux_model", type=str, default=None,
                        help="FLUX.1 model to merge into (BFL .safetensors or diffusers folder); omitted: the LoRAs "
                             "are merged into one LoRA")
    parser.add_argument("--clip_l", type=str, default=None, help="CLIP-L .safetensors to merge lora_te1_ modules into")
    parser.add_argument("--t5xxl", type=str, default=None, help="T5-XXL .safetensors to merge lora_te3_ modules into")
    parser.add_argument("--mem_eff_load_save", action="store_true",
                        help="accepted for compatibility: files are memory-mapped and written atomically anyway")
    parser.add_argument("--loading_device", type=str, default="cpu",
                        help="device the model weights are loaded to (LoRAs are read on the CPU)")
    parser.add_argument("--working_device", type=str, default="cpu", help="device the merging runs on")
    parser.add_argument("--save_to", type=str, default=None, help="output file: .safetensors")
    parser.add_argument("--clip_l_save_to", type=str, default=None, help="output file of the merged CLIP-L")
    parser.add_argument("--t5xxl_save_to", type=str, default=None, help="output file of the merged T5-XXL")
    lora_tools.add_models_arguments(parser, lbws=False)
    lora_tools.add_concat_arguments(parser)
    parser.add_argument("--diffusers", action="store_true",
                        help="the LoRAs are in diffusers / ai-toolkit layout (also found by their keys without it)")
    lora_tools.add_common_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return lora_tools.run_tool(setup_parser(), merge, argv)


if __name__ == "__main__":
    raise SystemExit(main())

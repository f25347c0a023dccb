"""What the flow-matching DiT families of upstream's later scripts (Lumina 2, HunyuanImage 2.1, Anima) do alike, as
plain functions their classes call (a family stays one class with sd.SD's methods, no base class): the state they
start with, the shared part of check_args, placing the frozen DiT (block swap), the shared metadata keys, the
weights of a full save and the pipeline slot of their own samplers."""
from __future__ import annotations

import logging

from library import flux_train_utils
from library.objectives import flow_matching
from library.objectives.flow_matching import FlowMatching

logger = logging.getLogger(__name__)


def init(family, bucket_reso_steps_multiple: int) -> None:
    """Flow matching, upstream's bucket multiple (its verify_bucket_reso_steps), nothing compiled or swapped yet."""
    family.objective = FlowMatching()
    family.bucket_reso_steps_multiple = bucket_reso_steps_multiple
    family.compiled_blocks = 0
    family.swapper = None


def check_args(args, check, label: str, lora_module: str) -> None:
    """No SD2.x flags, the family's own checks (`check(args, ConfigError)`), a warning when --network_module is not
    the one that writes this family's LoRA files in kohya's format, and the compile options' checks."""
    from library.compile import options as compile_options
    from library.errors import ConfigError

    if args.v2 or args.v_parameterization:
        raise ConfigError(f"--v2 / --v_parameterization are for SD2.x; this script trains {label}")
    check(args, ConfigError)
    module = getattr(args, "network_module", None)
    if module not in (None, lora_module):
        logger.warning("--network_module %s: %s LoRA files in kohya's format come from %s", module, label,
                       lora_module)
    compile_options.validate_compile_args(args)


def check_resolution_multiple(args, error_cls, multiple: int, label: str) -> None:
    """Every side given in --resolution must be a multiple of `multiple` (the DiT's patch times the VAE's stride)."""
    res = getattr(args, "resolution", None)
    if isinstance(res, str):
        for v in res.replace("x", ",").split(","):
            if v.strip().isdigit() and int(v) % multiple:
                raise error_cls(f"--resolution {res}: {label} needs sides that are multiples of {multiple}")


def place_denoiser(family, components, device, weight_dtype, fp8: bool, blocks_to_swap: int, blocks: list) -> None:
    """The frozen DiT in the training dtype on the device; with block swap only its resident blocks (`blocks`: the
    swappable ones), the swapper kept as family.swapper. A block swap that cannot work stops with one line."""
    from library.block_swap import BlockSwapError
    from library.errors import ConfigError

    try:
        family.swapper = flux_train_utils.place_transformer(components.transformer, device, weight_dtype, fp8,
                                                            blocks_to_swap, blocks=blocks)
    except BlockSwapError as e:
        raise ConfigError(str(e)) from e


def metadata(family, args, own: dict[str, str]) -> dict[str, str]:
    """The compile settings, the flow-matching keys, the family's `own` keys, ss_blocks_to_swap and (when blocks
    were compiled) ss_compile_blocks."""
    from library.compile import options as compile_options

    md = dict(compile_options.compile_settings_metadata(args))
    md.update(flow_matching.metadata(args))
    md.update(own)
    md["ss_blocks_to_swap"] = str(args.blocks_to_swap or 0)
    if family.compiled_blocks:
        md["ss_compile_blocks"] = str(family.compiled_blocks)
    return md


def trained_state_dict(family, components) -> dict:
    """The DiT's weights for a full save: swapped blocks synchronised first, compile's `_orig_mod.` stripped."""
    from library.compile.regional import strip_orig_mod

    if family.swapper is not None:
        family.swapper.synchronize()
    return strip_orig_mod(components.transformer.state_dict())


class NoPipeline:
    """flux_train_utils.sample_with_pipeline's pipeline slot, for a family whose sampler is its own function."""

    def set_progress_bar_config(self, **_):
        pass

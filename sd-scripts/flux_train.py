"""Full fine-tune / DreamBooth of the FLUX.1 transformer, kohya-ss/sd-scripts CLI, with regional torch.compile.

    accelerate launch sd-scripts/flux_train.py --pretrained_model_name_or_path flux1-dev.safetensors \
        --clip_l clip_l.safetensors --t5xxl t5xxl_fp16.safetensors --ae ae.safetensors \
        --train_data_dir data --output_dir out --output_name myflux --mixed_precision bf16 --full_bf16 \
        --optimizer_type Adafactor --fused_backward_pass --gradient_checkpointing --compile

The result is a BFL-layout single file (`double_blocks.N...`, `single_blocks.N...`) that ComfyUI/Forge, our
loader and diffusers' FluxTransformer2DModel.from_single_file read. `--train_blocks single|double` trains only
those blocks (everything else stays bit-identical to the base). The text encoders and the AE stay frozen.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from flux_train_network import FluxNetworkTrainer  # noqa: E402
from library import (flux_models, flux_train_utils, full_trainer, masks,  # noqa: E402
                     offload_checkpointing, optimizers, safetensors_io, saving, train_util)
from library.compile import options as compile_options, regional  # noqa: E402
from library.full_trainer import FullTrainer  # noqa: E402
from library.train_util import ConfigError  # noqa: E402

logger = logging.getLogger(__name__)

TRAIN_BLOCKS = ("all", "single", "double")


class FluxTrainer(FullTrainer, FluxNetworkTrainer):
    """The shared full-model loop (library.full_trainer) with the FLUX.1 hooks of the LoRA trainer."""

    model_label = "FLUX"
    bucket_reso_steps_multiple = 16

    def assert_extra_args(self, args) -> None:
        map_deprecated_swap_args(args)
        if args.cpu_offload_checkpointing and not args.gradient_checkpointing:
            logger.warning("cpu_offload_checkpointing is enabled, so gradient_checkpointing is also enabled")
            args.gradient_checkpointing = True
        if args.train_text_encoder:
            raise ConfigError("--train_text_encoder: flux_train.py trains the FLUX transformer only (CLIP-L and "
                              "T5-XXL stay frozen); train a CLIP-L LoRA with flux_train_network.py instead")
        if args.save_model_as not in (None, "safetensors"):
            # upstream's flux_train.py ignores --save_model_as the same way
            logger.warning("--save_model_as %s: flux_train.py writes a BFL .safetensors single file",
                           args.save_model_as)
        if args.blocks_to_swap and not args.fused_backward_pass:
            raise ConfigError("--blocks_to_swap in a full fine-tune needs --fused_backward_pass (with --optimizer_type "
                              "Adafactor): each weight must be updated while its block is on the GPU")
        if self.fused_optimizer_groups(args) and optimizers.is_schedulefree(args):
            raise ConfigError("--blockwise_fused_optimizers cannot be used with a schedule-free optimizer "
                              f"({optimizers.optimizer_type(args)}), as upstream")
        if args.fused_optimizer_groups:
            logger.warning("--fused_optimizer_groups has no effect in flux_train.py (upstream: \"this option is not "
                           "working\"); use --blockwise_fused_optimizers")
        if args.train_blocks not in TRAIN_BLOCKS:
            raise ConfigError(f"--train_blocks {args.train_blocks}: allowed: {', '.join(TRAIN_BLOCKS)}")
        if args.skip_latents_validity_check:
            logger.warning("--skip_latents_validity_check is deprecated: use --skip_cache_check")
            args.skip_cache_check = True
        super().assert_extra_args(args)

    def trained_model(self, components):
        return components.transformer

    def fused_optimizer_groups(self, args) -> bool:
        return bool(args.blockwise_fused_optimizers) and not args.fused_backward_pass

    def optimizer_param_groups(self, args, trainable):
        """--blockwise_fused_optimizers: one optimizer per double block, per single block, and one for the rest
        (upstream's grouping; one learning rate for all, as upstream)."""
        if not self.fused_optimizer_groups(args):
            return [trainable.param_groups]
        by_block: dict[tuple[str, int], list] = {}
        for name, param in self.components.transformer.named_parameters():
            if not param.requires_grad:
                continue
            head, _, rest = name.partition(".")
            key = {"transformer_blocks": "double", "single_transformer_blocks": "single"}.get(head, "other")
            by_block.setdefault((key, int(rest.split(".")[0]) if key != "other" else -1), []).append(param)
        return [[{"params": params, "lr": args.learning_rate}] for params in by_block.values()]

    def setup_trainable(self, args, accelerator, components, weight_dtype, caching_te: bool):
        """The transformer (or its --train_blocks) is trained; with --blocks_to_swap only the resident blocks go
        to the device (the shared FullTrainer.setup_trainable would move the whole model there first)."""
        from library.block_swap import BlockSwapError, place_with_block_swap
        from library.network_trainer import Trainable

        device = accelerator.device
        train_dtype = weight_dtype if (args.full_bf16 or args.full_fp16) else torch.float32
        self.components = components
        model = components.transformer
        model.to(dtype=train_dtype)
        keep = {"all": "", "single": "single_transformer_blocks.", "double": "transformer_blocks."}[args.train_blocks]
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith(keep))
        if args.gradient_checkpointing:
            self.enable_gradient_checkpointing(args, components, False)
        model.train()
        if args.blocks_to_swap:
            try:
                self.swapper = place_with_block_swap(model, args.blocks_to_swap, device, trainable=True)
            except BlockSwapError as e:
                raise ConfigError(str(e)) from e
        else:
            model.to(device)
        if not caching_te:
            for te in components.text_encoders:
                te.to(device)
        params = [p for p in model.parameters() if p.requires_grad]
        logger.info("training the FLUX transformer (--train_blocks %s): %.2fM parameters in %s", args.train_blocks,
                    sum(p.numel() for p in params) / 1e6, str(train_dtype).removeprefix("torch."))
        return Trainable(models=[model], param_groups=[{"params": params, "lr": args.learning_rate}],
                         train_text_encoder=False)

    def output_format(self, args) -> tuple[str, str]:
        return "single", ".safetensors"

    def save_full_model(self, args, components, path: str, metadata, save_dtype) -> None:
        if getattr(self, "swapper", None) is not None:
            self.swapper.synchronize()  # block copies still in flight must land before the weights are read
        if args.mem_eff_save:
            # one BFL tensor at a time, made from the live weights: no second copy of the model in memory
            sd = regional.strip_orig_mod(components.transformer.state_dict())
            saving.save_safetensors_streaming(path, flux_models.diffusers_to_bfl_entries(sd, save_dtype), metadata,
                                              overwrite=args.overwrite_output)
            return
        sd = {k: v.detach().to("cpu") for k, v in components.transformer.state_dict().items()}
        bfl = flux_models.diffusers_to_bfl(regional.strip_orig_mod(sd))
        if save_dtype is not None:
            bfl = {k: v.to(save_dtype) for k, v in bfl.items()}
        train_util.save_safetensors_atomic(bfl, path, metadata, overwrite=args.overwrite_output)

    def method_metadata(self, args):
        md = super().method_metadata(args)
        md["ss_train_blocks"] = args.train_blocks
        return md


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


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=1)
    flux_train_utils.add_flux_arguments(parser)
    saving.add_mem_eff_save_argument(parser)
    parser.add_argument("--train_blocks", type=str, default="all", choices=TRAIN_BLOCKS,
                        help="which transformer blocks are trained: all (the whole transformer), single or double")
    full_trainer.add_fused_optimizer_groups_argument(parser)
    parser.add_argument("--blockwise_fused_optimizers", action="store_true",
                        help="one optimizer per transformer block, each stepped inside backward as soon as its "
                             "block's gradients are complete (any optimizer; saves the memory of all gradients)")
    parser.add_argument("--skip_latents_validity_check", action="store_true",
                        help="[deprecated] the same as --skip_cache_check")
    masks.add_masked_loss_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    offload_checkpointing.add_cpu_offload_checkpointing_argument(parser)
    for name in ("double_blocks_to_swap", "single_blocks_to_swap"):
        parser.add_argument(f"--{name}", type=int, default=None, help="deprecated upstream: use --blocks_to_swap")
    return parser


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return full_trainer.run(FluxTrainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

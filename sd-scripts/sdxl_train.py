"""SDXL DreamBooth and fine-tuning (the full UNet, optionally both text encoders), kohya-ss/sd-scripts CLI,
with regional torch.compile (`--compile ...`).

    accelerate launch sd-scripts/sdxl_train.py --pretrained_model_name_or_path sd_xl_base_1.0.safetensors \
        --train_data_dir data --reg_data_dir reg --prior_loss_weight 1.0 --output_dir out --output_name mymodel \
        --resolution 1024,1024 --max_train_steps 2000 --learning_rate 1e-5 --optimizer_type Adafactor \
        --optimizer_args scale_parameter=False relative_step=False warmup_init=False --fused_backward_pass \
        --mixed_precision bf16 --full_bf16 --gradient_checkpointing --cache_latents \
        --cache_text_encoder_outputs --save_model_as safetensors --compile

Fine-tune with kohya's metadata JSON: `--in_json meta.json --train_data_dir images` (see
finetune/merge_captions_to_metadata.py). `--train_text_encoder` with `--learning_rate_te1/--learning_rate_te2`
also trains the text encoders. Or `--config_file cfg.toml` (flags on the command line win).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import full_trainer, masks, safetensors_io  # noqa: E402
from library.compile import options as compile_options  # noqa: E402
from library.full_trainer import FullTrainer  # noqa: E402
from library.train_util import ConfigError  # noqa: E402
from sdxl_train_network import SDXLNetworkTrainer  # noqa: E402

logger = logging.getLogger(__name__)

# upstream's --block_lr: one rate per SGM block of the UNet
UNET_NUM_BLOCKS_FOR_BLOCK_LR = 23


def parse_block_lr(text: str) -> list[float]:
    try:
        lrs = [float(v) for v in text.split(",")]
    except ValueError:
        lrs = []
    if len(lrs) != UNET_NUM_BLOCKS_FOR_BLOCK_LR or any(lr < 0 for lr in lrs):
        raise ConfigError(f"--block_lr needs {UNET_NUM_BLOCKS_FOR_BLOCK_LR} comma-separated learning rates of 0 or "
                          f"more (time/label embeddings, input_blocks 0-8, middle_block 0-2, output_blocks 0-8, "
                          f"out), got {text!r}")
    return lrs


def block_index(sgm_name: str) -> int:
    """Upstream's block of an SGM UNet parameter: 0 embeddings, 1-9 input_blocks, 10-12 middle_block,
    13-21 output_blocks, 22 out."""
    head, _, rest = sgm_name.partition(".")
    if head in ("time_embed", "label_emb"):
        return 0
    offsets = {"input_blocks": 1, "middle_block": 10, "output_blocks": 13}
    if head in offsets:
        return offsets[head] + int(rest.split(".")[0])
    if head == "out":
        return 22
    raise ValueError(f"unexpected SDXL UNet parameter {sgm_name}")


def block_lr_param_groups(unet, lrs: list[float]) -> tuple[list[dict], list[str]]:
    """One param group per block with a rate above 0, in block order, and their names (block<i>, upstream's log
    names); the blocks at 0 are frozen.
    (Upstream leaves them trainable but outside the optimizer: their gradients are computed, never applied
    nor cleared, and count in the clipping norm; freezing them trains the same blocks without that.)"""
    from library.model_util import unet_sgm_module_names

    sgm_modules = unet_sgm_module_names(unet)
    blocks: list[list] = [[] for _ in lrs]
    for name, param in unet.named_parameters():
        module, _, leaf = name.rpartition(".")
        blocks[block_index(f"{sgm_modules[module]}.{leaf}")].append(param)
    groups, names = [], []
    for i, (lr, params) in enumerate(zip(lrs, blocks)):
        if lr == 0:
            for p in params:
                p.requires_grad_(False)
        elif params:
            groups.append({"params": params, "lr": lr})
            names.append(f"block{i}")
    logger.info("--block_lr: %d UNet blocks trained, %d frozen", len(groups), lrs.count(0))
    return groups, names


class SDXLTrainer(FullTrainer, SDXLNetworkTrainer):
    """The SDXL family hooks (two text encoders, size conditioning, regional compile after
    accelerator.prepare) with the full-model training of library.full_trainer."""

    tracker_name = "sdxl_finetuning"

    def assert_extra_args(self, args) -> None:
        if args.block_lr:
            parse_block_lr(args.block_lr)
        super().assert_extra_args(args)

    def setup_trainable(self, args, accelerator, components, weight_dtype, caching_te: bool):
        trainable = super().setup_trainable(args, accelerator, components, weight_dtype, caching_te)
        if args.block_lr:  # the UNet's group (the first) becomes one group per block
            groups, names = block_lr_param_groups(components.unet, parse_block_lr(args.block_lr))
            trainable.param_groups[0:1] = groups
            if not self.fused_optimizer_groups(args):  # upstream's lr log names: lr/block<i>, lr/text_encoder<n>
                trained_tes = [f"text_encoder{i + 1}" for i, te in enumerate(components.text_encoders)
                               if any(p.requires_grad for p in te.parameters())]
                trainable.lr_descriptions = names + trained_tes
        return trainable

    def text_encoder_lrs(self, args) -> list[float | None]:
        def rate(value):
            return args.learning_rate if value is None else value

        return [rate(args.learning_rate_te1), rate(args.learning_rate_te2)]


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=2)
    parser.add_argument("--block_lr", type=str, default=None,
                        help=f"learning rates of the UNet's {UNET_NUM_BLOCKS_FOR_BLOCK_LR} blocks, comma-separated "
                             "(0 = the block is not trained)")
    full_trainer.add_fused_optimizer_groups_argument(parser)
    masks.add_masked_loss_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    full_trainer.add_diffusers_xformers_argument(parser)
    return parser


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return full_trainer.run(SDXLTrainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

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
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from library import full_trainer, masks, network_trainer, safetensors_io  # noqa: E402
from library.families import sdxl  # noqa: E402
from library.compile import options as compile_options  # noqa: E402
from library.run.trainer import Trainer  # noqa: E402
from library.targets.full import Full  # noqa: E402


def setup_parser() -> argparse.ArgumentParser:
    parser = full_trainer.setup_parser(text_encoders=2)
    parser.add_argument("--block_lr", type=str, default=None,
                        help=f"learning rates of the UNet's {sdxl.UNET_NUM_BLOCKS_FOR_BLOCK_LR} blocks, "
                             "comma-separated (0 = the block is not trained)")
    full_trainer.add_fused_optimizer_groups_argument(parser)
    masks.add_masked_loss_arguments(parser)
    compile_options.add_compile_arguments(parser)
    safetensors_io.add_mmap_argument(parser)
    full_trainer.add_diffusers_xformers_argument(parser)
    return parser


def trainer() -> Trainer:
    return Trainer(sdxl.SDXL(), Full(tracker_name="sdxl_finetuning", text_encoder_lrs=sdxl.text_encoder_lrs,
                                     check=sdxl.check_block_lr, param_groups=sdxl.apply_block_lr))


def main(argv: list[str] | None = None) -> str | None:
    """Train from command-line arguments; a bad option or input exits with status 2 and a clear message."""
    return network_trainer.run(trainer(), setup_parser(), argv)


if __name__ == "__main__":
    main()

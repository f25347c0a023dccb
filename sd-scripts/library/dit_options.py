"""Options the transformer (DiT) families share, declared once: the CLIP-L / T5-XXL files and T5 settings (FLUX.1,
Chroma, SD3), FLUX.1's AE (FLUX.1, Chroma, Lumina 2) and the memory options (--blocks_to_swap, --text_encoder_batch_size; upstream's
add_dit_training_arguments). Each family's module checks and reads them."""
from __future__ import annotations


def add_text_encoder_file_arguments(group) -> None:
    group.add_argument("--clip_l", type=str, default=None,
                       help="CLIP-L text encoder (.safetensors); not needed for a diffusers folder (SD3: nor for a "
                            "checkpoint that carries it)")
    group.add_argument("--t5xxl", type=str, default=None,
                       help="T5-XXL encoder (.safetensors); not needed for a diffusers folder (SD3: nor for a "
                            "checkpoint that carries it)")


def add_ae_argument(group) -> None:
    """--ae: FLUX.1's 16-channel autoencoder (FLUX.1, Chroma, Lumina 2)."""
    group.add_argument("--ae", type=str, default=None,
                       help="FLUX autoencoder ae.safetensors; not needed for a diffusers folder")


def add_t5_arguments(group) -> None:
    group.add_argument("--t5xxl_max_token_length", type=int, default=None,
                       help="T5-XXL tokens (default: FLUX.1 512 for dev, 256 for schnell; SD3 256)")
    group.add_argument("--apply_t5_attn_mask", action="store_true",
                       help="mask T5 padding in the encoder (FLUX.1: and zero its outputs)")


def add_memory_arguments(group) -> None:
    group.add_argument("--blocks_to_swap", type=int, default=None,
                       help="transformer blocks kept off the GPU and swapped in around their forward/backward (saves "
                            "memory; default none)")
    group.add_argument("--text_encoder_batch_size", type=int, default=None,
                       help="batch size for caching text encoder outputs (default: the training batch size)")

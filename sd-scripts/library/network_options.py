"""Trainer-side options of the LoRA scripts that act on the network as a whole (sd-scripts' train_network.py):

- `--base_weights F [F ...]` / `--base_weights_multiplier M [M ...]`: network files merged into the model before
  training (with the --network_module's `create_network_from_weights(..., for_inference=True)` and its
  `merge_to`); a missing multiplier is 1.0. Merged right after the models load, so cached latents / text-encoder
  outputs already see them (sd-scripts merges after caching, so a text-encoder part of a base LoRA does not
  reach its cached outputs there).
- `--scale_weight_norms X`: after every optimizer step the network's `apply_max_norm_regularization(X, device)`
  scales each module whose delta weight has a norm over X; the number of modules scaled and the mean/max norm
  go to the progress bar ("Keys Scaled", "Average key norm") and the trackers (max_norm/keys_scaled,
  max_norm/max_key_norm, norm/avg_key_norm), as in sd-scripts.
- networks with GGPO (networks.lora_flux ggpo_sigma/ggpo_beta) get `update_grad_norms()` / `update_norms()` after
  the gradients are synced and log norm/avg_key_norm, norm/avg_grad_norm, norm/avg_combined_norm.
"""
from __future__ import annotations

import argparse
import logging
import os

from library.errors import ConfigError

logger = logging.getLogger(__name__)


def add_network_option_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scale_weight_norms", type=float, default=None,
                        help="max norm of each LoRA module's delta weight; larger ones are scaled down after every "
                             "step (1 is a good start)")
    parser.add_argument("--base_weights", type=str, default=None, nargs="*",
                        help="network files merged into the model before training")
    parser.add_argument("--base_weights_multiplier", type=float, default=None, nargs="*",
                        help="multiplier of each --base_weights file (default 1.0)")


def parse_network_args(items: list[str] | None) -> dict[str, str]:
    """`--network_args key=value ...` as a dict (values are strings; each network module converts its own)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--network_args: {item!r} must be key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def check_network_option_args(args, error_cls) -> None:
    """Before any model loads."""
    if args.scale_weight_norms is not None and args.scale_weight_norms < 0:
        raise error_cls(f"--scale_weight_norms must be positive (0 or unset: off), got {args.scale_weight_norms}")
    for path in args.base_weights or []:
        if not os.path.isfile(path):
            raise error_cls(f"--base_weights: file not found: {path}")
    extra = len(args.base_weights_multiplier or []) - len(args.base_weights or [])
    if extra > 0:
        raise error_cls(f"--base_weights_multiplier has {extra} more value(s) than --base_weights has files")


def base_weight_multipliers(args) -> list[tuple[str, float]]:
    mults = list(args.base_weights_multiplier or [])
    return [(p, mults[i] if i < len(mults) else 1.0) for i, p in enumerate(args.base_weights or [])]


def merge_base_weights(args, network_module, vae, text_encoders, unet, dtype=None, device=None) -> int:
    """Merges every --base_weights file into the models; returns how many were merged."""
    pairs = base_weight_multipliers(args)
    for path, multiplier in pairs:
        logger.info("merging %s with multiplier %s into the model", path, multiplier)
        network, weights_sd = network_module.create_network_from_weights(multiplier, path, vae, text_encoders, unet,
                                                                         for_inference=True)
        network.merge_to(text_encoders, unet, weights_sd, dtype, device)
    if pairs:
        logger.info("all base weights merged: %s", ", ".join(p for p, _ in pairs))
    return len(pairs)


def after_grad_sync(networks) -> None:
    """GGPO: the networks that track weight/gradient norms update them once the gradients are final."""
    for network in networks:
        if hasattr(network, "update_grad_norms"):
            network.update_grad_norms()
        if hasattr(network, "update_norms"):
            network.update_norms()


def after_optimizer_step(args, networks, device) -> tuple[dict[str, float], dict[str, float]]:
    """--scale_weight_norms (or GGPO's norms): (progress-bar postfix, tracker logs)."""
    network = networks[0] if networks else None
    if network is None:
        return {}, {}
    if getattr(args, "scale_weight_norms", None):
        keys_scaled, mean_norm, max_norm = network.apply_max_norm_regularization(args.scale_weight_norms, device)
        return ({"Keys Scaled": keys_scaled, "Average key norm": mean_norm},
                {"max_norm/keys_scaled": keys_scaled, "max_norm/max_key_norm": max_norm,
                 "norm/avg_key_norm": mean_norm})
    logs = {}
    if hasattr(network, "weight_norms"):
        for key, fn in (("norm/avg_key_norm", "weight_norms"), ("norm/avg_grad_norm", "grad_norms"),
                        ("norm/avg_combined_norm", "combined_weight_norms")):
            values = getattr(network, fn)()
            if values is not None:
                logs[key] = values.mean().item()
    return {}, logs


def supports_max_norm(network) -> bool:
    # a subclass of networks.lora's network without it (networks.dylora, as upstream's) sets it to None
    return callable(getattr(network, "apply_max_norm_regularization", None))

"""The LoRA target (train_network.py, sdxl_train_network.py, flux_train_network.py): a --network_module network on
the frozen denoiser and text encoders; its parameter groups (UNet / text-encoder learning rates), its saves with
upstream's ss_* + modelspec metadata."""
from __future__ import annotations

import logging
import os
import time
from typing import Any

from library import config_util, network_options, precision, train_util
from library.compile import graphs as compile_graphs
from library import metadata as metadata_util
from library.network_options import parse_network_args
from library.network_trainer import Trainable, import_network_module, save_network_state_dict, text_encoder_lr
from library.errors import ConfigError

logger = logging.getLogger(__name__)


class LoRA:
    default_output_name = "last"
    tracker_name = "network_train"
    dataset_kinds = (config_util.DREAMBOOTH, config_util.FINETUNING)  # what --dataset_config may hold
    lora = True  # modelspec: a LoRA

    def check_args(self, args, family_name: str) -> None:
        """The network options, before any model loads."""
        if not args.network_module:
            raise ConfigError("--network_module is required, e.g. --network_module networks.lora")
        if args.network_train_unet_only and args.network_train_text_encoder_only:
            raise ConfigError("--network_train_unet_only and --network_train_text_encoder_only exclude each other")
        caching_te = args.cache_text_encoder_outputs or args.cache_text_encoder_outputs_to_disk
        if caching_te and not args.network_train_unet_only:
            raise ConfigError("--cache_text_encoder_outputs needs --network_train_unet_only (a trained text "
                              "encoder changes its outputs)")
        if args.network_dim is not None and (args.network_dim < 0 or (
                args.network_dim == 0 and args.network_module.startswith("networks.lora"))):
            # upstream's networks.lora skips every module of rank 0: nothing would train
            raise ConfigError(f"--network_dim must be 1 or more (the LoRA rank), got {args.network_dim}")
        if args.network_dropout is not None and not 0 <= args.network_dropout < 1:
            raise ConfigError(f"--network_dropout must be in [0, 1), got {args.network_dropout}")
        if args.network_weights and not os.path.isfile(args.network_weights):
            raise ConfigError(f"--network_weights: file not found: {args.network_weights}")
        if args.dim_from_weights and not args.network_weights:
            raise ConfigError("--dim_from_weights needs --network_weights")
        network_options.check_network_option_args(args, ConfigError)
        compile_graphs.check_args(args, ConfigError)
        if args.pretrained_model_name_or_path is None:
            raise ConfigError("--pretrained_model_name_or_path is required")
        self._check_network_module(args, family_name)
        if args.sample_prompts and (args.sample_every_n_steps or args.sample_every_n_epochs or args.sample_at_first):
            # read only when it will be used, as upstream (the kohya_ss GUI always passes a prompt file, empty
            # when its prompt box is)
            from library.sample_prompts import parse_prompt_file

            parse_prompt_file(args.sample_prompts)  # PromptFileError names the file and line
        if args.fused_backward_pass:
            logger.info("--fused_backward_pass: checked as upstream; a LoRA is stepped after backward as upstream's "
                        "LoRA scripts do (its gradients are small)")

    @staticmethod
    def _check_network_module(args, family_name: str) -> None:
        try:
            module = import_network_module(args.network_module)
        except ImportError as e:
            raise ConfigError(f"--network_module {args.network_module}: cannot import it ({e})") from e
        families = getattr(module, "FAMILIES", None)  # the model families a module is made for, as upstream's
        if families and family_name not in families:
            raise ConfigError(f"--network_module {args.network_module}: made for {'/'.join(families)} models (as "
                              f"upstream), this script trains {family_name}"
                              + (f"; use {module.FOR_FLUX}" if family_name == "flux" else ""))
        validate = getattr(module, "parse_network_kwargs", None)
        if validate is not None:
            validate(parse_network_args(args.network_args))

    def fp8_targets(self, args) -> tuple[bool, bool]:
        """(denoiser, text encoders) kept in fp8: --fp8_base / --fp8_base_unet."""
        return precision.fp8_targets(args)

    def output_ext(self, args, family) -> str:
        return "." + args.save_model_as

    def steps_in_backward(self, args) -> bool:
        return False  # upstream's LoRA scripts accept --fused_backward_pass, but never fuse

    def merge_base_weights(self, args, family, components) -> None:
        """--base_weights: merged into the models right after they load (before any caching)."""
        if not getattr(args, "base_weights", None):
            return
        network_options.merge_base_weights(args, import_network_module(args.network_module),
                                           components.autoencoder, list(components.text_encoders),
                                           components.denoiser)

    def setup_trainable(self, args, accelerator, family, components, weight_dtype, caching_te: bool) -> Trainable:
        """Creates the network on the denoiser and the family's LoRA text encoders, puts the models on their
        device and dtype (gradient checkpointing too); returns the network and the optimizer's param groups."""
        device = accelerator.device
        denoiser = components.denoiser
        text_encoders = family.lora_text_encoders(components)
        network = self._create_network(args, components, text_encoders)
        if args.scale_weight_norms and not network_options.supports_max_norm(network):
            logger.warning("--scale_weight_norms: %s does not support it; ignored", args.network_module)
            args.scale_weight_norms = None
        train_unet = not args.network_train_text_encoder_only
        train_text_encoder = not args.network_train_unet_only
        network.apply_to(text_encoders, denoiser, train_text_encoder, train_unet)
        if args.network_weights:
            network.load_weights(args.network_weights)

        denoiser.requires_grad_(False)
        family.place_denoiser(args, components, device, weight_dtype, self.fp8_targets(args)[0])
        if args.gradient_checkpointing:
            family.enable_gradient_checkpointing(args, components, text_encoders if train_text_encoder else [])
        denoiser.train(args.gradient_checkpointing)
        for te in text_encoders:
            te.train(train_text_encoder and args.gradient_checkpointing)
        if train_text_encoder and caching_te:
            raise ConfigError("--cache_text_encoder_outputs needs --network_train_unet_only")
        if not caching_te:
            for te in components.text_encoders:
                te.to(device)
        params, lr_descriptions = self._param_groups(args, network)
        if args.full_fp16 or args.full_bf16:
            network.to(weight_dtype)
        network.prepare_grad_etc(text_encoders, denoiser)
        in_groups = {id(p) for g in params for p in g["params"]}
        for p in network.parameters():  # a group left out (lr 0) is not trained: no gradients for it
            if id(p) not in in_groups:
                p.requires_grad_(False)
        network.to(device)
        return Trainable(models=[network], param_groups=params, train_text_encoder=train_text_encoder,
                         lr_descriptions=lr_descriptions)

    @staticmethod
    def _create_network(args, components, text_encoders):
        network_module = import_network_module(args.network_module)
        net_kwargs = parse_network_args(args.network_args)
        vae, denoiser = components.autoencoder, components.denoiser
        if args.dim_from_weights:
            network, _ = network_module.create_network_from_weights(1.0, args.network_weights, vae, text_encoders,
                                                                    denoiser, **net_kwargs)
            return network
        if not hasattr(network_module, "NETWORK_ARGS") and "dropout" not in net_kwargs:
            # sd-scripts hands --network_dropout to other modules (LyCORIS) as the "dropout" network arg
            net_kwargs["dropout"] = args.network_dropout
        return network_module.create_network(1.0, args.network_dim, args.network_alpha, vae, text_encoders,
                                             denoiser, neuron_dropout=args.network_dropout, **net_kwargs)

    @staticmethod
    def _param_groups(args, network) -> tuple[list, list | None]:
        if hasattr(network, "prepare_optimizer_params_with_multiple_te_lrs"):
            params = network.prepare_optimizer_params_with_multiple_te_lrs(args.text_encoder_lr, args.unet_lr,
                                                                          args.learning_rate)
        else:
            if args.text_encoder_lr and len(set(args.text_encoder_lr)) > 1:
                logger.warning("--text_encoder_lr %s: %s takes one learning rate for all text encoders; using %s",
                               " ".join(map(str, args.text_encoder_lr)), args.network_module, args.text_encoder_lr[0])
            params = network.prepare_optimizer_params(text_encoder_lr(args), args.unet_lr, args.learning_rate)
        params, lr_descriptions = params if isinstance(params, tuple) else (params, None)
        if not params:
            raise ConfigError("nothing to train: both learning rates are 0 or no LoRA modules were created")
        return params, lr_descriptions

    def prepare_dataset(self, args, groups: list) -> None:
        pass  # captions as they are (textual inversion rewrites them)

    def sample_args(self, args):
        return args  # sample prompts as they are

    def optimizer_param_groups(self, args, family, components, trainable: Trainable) -> list[list[dict]]:
        return [trainable.param_groups]  # one optimizer over all of them

    def after_prepare(self, args, accelerator, trainable: Trainable, optimizers: list) -> None:
        pass

    def on_step_start(self, args) -> None:
        pass

    def on_epoch_start(self, args, family, trainable: Trainable, components) -> None:
        for network in trainable.models:
            network.on_epoch_start(family.lora_text_encoders(components), components.denoiser)

    def keep_training_text_encoder(self, args, global_step: int, components) -> bool:
        return True

    def metadata(self, args, md: dict[str, str]) -> dict[str, str]:
        """The shared ss_* keys stay (the LoRA network's are among them)."""
        return md

    def method_metadata(self, args) -> dict[str, Any]:
        return {}

    def save_model(self, args, accelerator, trainable: Trainable, family, components, md, path, epoch, step,
                   modelspec) -> None:
        """ss_* (only upstream's minimum keys with --no_metadata) + modelspec.*, as upstream writes them."""
        md = dict(md)
        md["ss_training_finished_at"] = str(time.time())
        md["ss_steps"] = str(step)
        md["ss_epoch"] = str(epoch)
        if args.no_metadata:
            md = metadata_util.minimum_network_metadata(md)
        else:  # here, not in build_metadata: hashing a 23 GB base model must not delay the first step
            md.update(metadata_util.file_hash_metadata(args))
        md.update(modelspec)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        network = accelerator.unwrap_model(trainable.models[0])
        if hasattr(network, "lora_state_dict"):
            network.save_weights(path, train_util.save_dtype_for(args), md, overwrite=args.overwrite_output)
        else:  # another module's network (LyCORIS): its tensors, written by our atomic writer with both hashes
            save_network_state_dict(network, path, train_util.save_dtype_for(args), md, args.overwrite_output)
        logger.info("saved %s", path)

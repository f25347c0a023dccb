"""The phases of a run before step 1, in order: checks and output names, the accelerator and seed, the dataset,
torch's process-wide switches (TF32, cuDNN attention...: before any model runs), the models (loaded, merged, fp8,
attention), the caches, what is trained, optimizers and schedulers (prepared, compiled), the run's generator and
--resume, then validation, metadata and trackers. `prepare` returns the RunState the loop runs on, or
`Done(result)` for runs that end before training (--output_config, --validate_only, --debug_dataset)."""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from library import (config_util, data_parallel, huggingface_util, optimizers, run_requests, saving, schedulers,
                     sharding, state_folders, train_util, validation)
from library import ema, metadata as metadata_util
from library.errors import ConfigError
from library.run.state import RunState

logger = logging.getLogger(__name__)


@dataclass
class Done:
    """A run that ends before training; `result` is what train() returns."""

    result: Any


@dataclass
class Startup:
    """What the caller must undo if the run fails before its first step (library.run.loop.train)."""

    stop: Any  # the run's library.stop_signal.StopRequest
    run_config_path: str | None = None
    training_started: bool = False


def prepare(trainer, args, startup: Startup) -> RunState | Done:
    train_util.setup_logging()
    if getattr(args, "output_config", False):
        return Done(train_util.write_output_config(args))
    if getattr(args, "validate_only", False):
        from library import validate_only

        return Done(validate_only.run(trainer, args))
    trainer.check_common_options(args)
    trainer.check_args(args)
    args.output_name = args.output_name or trainer.default_output_name
    ext = trainer.output_ext(args)
    final_path = os.path.join(args.output_dir, train_util.last_file_name(args.output_name, ext))
    train_util.check_outputs_free(args.output_dir, args.output_name, ext, args.overwrite_output, bool(args.resume))
    state_folders.check_resume(args, ext)
    session_id = uuid.uuid4().int & ((1 << 31) - 1)
    started_at = time.time()

    accelerator = start_accelerator(trainer, args)
    data = build_data(trainer, args)
    if isinstance(data, Done):
        return data
    group, val_group, groups = data
    from library.compile import environment as compile_environment, graphs as compile_graphs

    # --cuda_graph_step auto and --compile_dynamic auto follow the dataset's bucket shapes
    compile_graphs.resolve(args, groups, accelerator.num_processes, trainer.family_for(args), ConfigError)
    compiled = compile_graphs.compile_args(args)
    # torch's process-wide switches (TF32, cuDNN attention...) before any model runs: the caching below uses them too
    compile_environment.apply_process_settings(compiled if compiled is not None else args)
    if compiled is not None:
        compile_environment.warm_compile_workers(compiled)  # inductor's compile workers start while the models load
    os.makedirs(args.output_dir, exist_ok=True)
    requests = run_requests.RunRequests(args.output_dir, accelerator.is_main_process)
    requests.clear_stale()  # before models load: a request sent while they load is this run's
    if accelerator.is_main_process:
        state_folders.remove_stale(args.output_dir, args.output_name)
        # a stop signal while the file is written waits until its path is kept: the clean-up then removes it
        with startup.stop.held():
            startup.run_config_path = trainer.write_run_config(args)
    weight_dtype = train_util.weight_dtype_for(args)
    components = trainer.load_models(args, weight_dtype)
    start_model_hashes(args, accelerator)
    prediction_type = trainer.family.prediction_type(args, components)
    trainer.use_prediction_type(args, prediction_type)  # the prediction type that trains, as the metadata says
    caching_te = cache(trainer, args, accelerator, components, groups, weight_dtype)
    trainable = trainer.target.setup_trainable(args, accelerator, trainer.family, components, weight_dtype, caching_te)
    if not (args.cache_latents or args.cache_latents_to_disk):
        components.autoencoder.requires_grad_(False).eval()
        components.autoencoder.to(accelerator.device, dtype=vae_dtype(args, weight_dtype))
    optimization = build_optimization(trainer, args, accelerator, components, trainable, group, groups)
    state = RunState(
        args=args, trainer=trainer, accelerator=accelerator, components=components, trainable=trainable,
        group=group, groups=groups, ext=ext, final_path=final_path, weight_dtype=weight_dtype, caching_te=caching_te,
        prediction_type=prediction_type, requests=requests, train_text_encoder=trainable.train_text_encoder,
        multiplier_models=[m for m in trainable.models if hasattr(m, "set_multiplier")], **optimization)
    state.ema = ema.build(args, trainable)  # before resume: --save_state carries it
    resume(trainer, args, state)
    state.noise_scheduler = trainer.objective.noise_scheduler(args, prediction_type)
    state.validator = validation.build_validator(args, val_group, accelerator,
                                                 lambda g: make_dataloader(g, args), args.seed,
                                                 trainer.objective.num_train_timesteps(state.noise_scheduler))
    describe(trainer, args, state, val_group, session_id, started_at)
    return state


def start_accelerator(trainer, args):
    """The accelerator (library.data_parallel) and the seed."""
    accelerator = trainer.make_accelerator(args)
    # before the dataset: its batch order and augmentations follow the seed (a random one without --seed)
    train_util.prepare_seed(args, accelerator)
    return accelerator


def start_model_hashes(args, accelerator) -> None:
    """The base model's and VAE's hashes for the ss_* metadata, in a child process from here to the first save: after
    the models are loaded, so that reading the 7-23 GB file again does not slow their loading (FLUX.1: ~2 s,
    docs/BENCHMARKS.md session 21). The one that saves (save_lora) needs them; the textual-inversion scripts (no
    --no_metadata) write none."""
    if accelerator.is_main_process and not getattr(args, "no_metadata", True):
        metadata_util.start_file_hashes(args.pretrained_model_name_or_path, getattr(args, "vae", None))


def build_data(trainer, args):
    """(training group, validation group or None, the groups that are cached) or Done for --debug_dataset."""
    from library.network_trainer import TrainingError

    family = trainer.family_for(args)
    # upstream: ControlNet subsets (conditioning_data_dir) with --masked_loss
    kinds = trainer.dataset_kinds + ((config_util.CONTROLNET,) if getattr(args, "masked_loss", False) else ())
    group, val_group = config_util.build_dataset_groups(args, family, kinds)
    groups = [g for g in (group, val_group) if g is not None]  # what is cached
    for g in groups:
        g.verify_bucket_reso_steps(trainer.bucket_reso_steps_multiple)
    trainer.prepare_dataset(args, groups)  # textual inversion's captions, SD3's training resolutions
    if len(group) == 0:
        raise TrainingError("the dataset has no batches: no training images found")
    if getattr(args, "debug_dataset", False):
        from library.datasets import debug_dataset

        debug_dataset(group)
        return Done(None)
    return group, val_group, groups


def vae_dtype(args, weight_dtype):
    return torch.float32 if args.no_half_vae else weight_dtype


def cache(trainer, args, accelerator, components, groups, weight_dtype) -> bool:
    """--cache_latents(_to_disk) and --cache_text_encoder_outputs(_to_disk); returns whether the text-encoder
    outputs are cached (then the encoders stay on the CPU)."""
    from library import precision

    device, vae, family = accelerator.device, components.autoencoder, trainer.family
    if args.cache_latents or args.cache_latents_to_disk:
        vae.to(device, dtype=vae_dtype(args, weight_dtype))
        vae.requires_grad_(False).eval()
        with data_parallel.main_process_first(accelerator, args.cache_latents_to_disk, "latents"):
            for g in groups:
                g.cache_latents(lambda images: family.encode_images(args, components, images, None),
                                to_disk=args.cache_latents_to_disk, signature=family.cache_signature(args, "vae"),
                                batch_size=args.vae_batch_size, fmt=family.latent_cache_format(args, components),
                                skip_check=args.skip_cache_check)
        vae.to("cpu")
    caching_te = args.cache_text_encoder_outputs or args.cache_text_encoder_outputs_to_disk
    for te in components.text_encoders:
        # frozen until the target trains it: eval mode, or T5-XXL's dropout would draw from the global generator
        te.requires_grad_(False).eval()
        precision.to_device_dtype(te, device, weight_dtype)  # fp8 weights stay fp8
    if caching_te:
        with data_parallel.main_process_first(accelerator, args.cache_text_encoder_outputs_to_disk,
                                              "text encoder outputs"):
            for g in groups:
                g.cache_text_encoder_outputs(lambda caps: family.encode_prompts(args, components, caps, False),
                                             to_disk=args.cache_text_encoder_outputs_to_disk,
                                             batch_size=getattr(args, "text_encoder_batch_size", None),
                                             signature=family.cache_signature(args, "te"),
                                             skip_check=args.skip_cache_check,
                                             fmt=family.te_cache_format(args, components))
        for te in components.text_encoders:
            te.to("cpu")
    if device.type == "cuda":  # give back what the VAE and the text encoders held (as upstream's clean_memory)
        torch.cuda.empty_cache()
    return bool(caching_te)


def build_optimization(trainer, args, accelerator, components, trainable, group, groups) -> dict:
    """Optimizers (one, or one per part for fused optimizer groups), the dataloader and the run's length, the
    LR schedulers, accelerate's prepare, the compile of the denoiser and the fused-backward hooks."""
    built = [optimizers.get_optimizer(args, g)
             for g in trainer.target.optimizer_param_groups(args, trainer.family, components, trainable)]
    sharding.init_optimizer_state([b[2] for b in built])  # --fsdp: Adafactor's statistics as sharded tensors
    # sharded over the processes: each sees len(group) / num_processes batches per epoch
    if sharding.deepspeed_enabled(args):  # accelerate prepares the models, the optimizer and the data together
        dataloader, prepared = sharding.prepare_deepspeed(accelerator, trainable.models, make_dataloader(group, args),
                                                          [b[2] for b in built])
    else:
        dataloader = accelerator.prepare(make_dataloader(group, args))
    num_batches = len(dataloader)
    steps_per_epoch, max_train_steps, num_epochs = train_util.resolve_train_length(args, num_batches)
    args.max_train_steps = max_train_steps
    saving.apply_save_n_epoch_ratio(args, num_epochs)
    for g in groups:  # token warm-up (upstream's validation batches follow the training step too)
        g.set_max_train_steps(max_train_steps)
    # not prepared by accelerate (our loop steps it: schedulers.step follows accelerate's rule exactly)
    lr_scheduler = schedulers.group([schedulers.get_scheduler(args, b[2], max_train_steps,
                                                              accelerator.num_processes) for b in built])
    if not sharding.deepspeed_enabled(args):
        prepared = [accelerator.prepare(b[2]) for b in built]
    if args.full_fp16:
        allow_fp16_grad_unscale(accelerator)
    trainer.family.compile(args, components)  # after prepare: the denoiser is frozen and on its device
    trainer.target.after_prepare(args, accelerator, trainable, prepared)
    return dict(optimizers=prepared, lr_scheduler=lr_scheduler, dataloader=dataloader, num_batches=num_batches,
                num_epochs=num_epochs, steps_per_epoch=steps_per_epoch, max_train_steps=max_train_steps,
                optimizer_names=(built[0][0], built[0][1]))


def resume(trainer, args, state: RunState) -> None:
    """The run's generator (noise, timesteps, VAE sampling), what --save_state saves, and --resume."""
    accelerator = state.accelerator
    optimizer_train, _ = optimizers.train_eval_fns(state.optimizers, args)
    state.generator = torch.Generator(device=accelerator.device).manual_seed(args.seed + accelerator.process_index)
    state.checkpoint.generator = state.generator
    if sharding.enabled(args):  # --fsdp: the models and optimizers are written sharded, not by accelerate
        state.sharded = sharding.ShardedState(state.trainable.models, state.optimizers)
    elif not sharding.deepspeed_enabled(args):  # (accelerate saves the DeepSpeed engine it prepared)
        for model in state.trainable.models:
            accelerator.register_for_checkpointing(model)
    accelerator.register_for_checkpointing(state.lr_scheduler)
    if state.ema is not None:
        accelerator.register_for_checkpointing(state.ema)
    accelerator.register_for_checkpointing(state.checkpoint)  # last: state_folders.resumed_position reads it so
    if args.resume:
        logger.info("resuming from %s", args.resume)
        state_folders.load_state(accelerator, huggingface_util.resume_state_dir(args), state.steps_per_epoch,
                                 load=state.sharded.load if state.sharded is not None else None)
        optimizer_train()  # a schedule-free optimizer's state was saved in eval mode
        logger.info("resumed at step %d (epoch %d)", state.checkpoint.global_step, state.checkpoint.epoch)
    start = saving.start_position(args, state.steps_per_epoch, state.checkpoint.global_step, state.max_train_steps)
    state.global_step, state.first_epoch, state.skip_batches = start.global_step, start.epoch, start.skip_batches


def describe(trainer, args, state: RunState, val_group, session_id, started_at) -> None:
    """The ss_* metadata of the results, the trackers, and the run's first log lines."""
    from library import trackers

    accelerator = state.accelerator
    total_batch = args.train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes
    opt_name, opt_class = state.optimizer_names
    state.metadata = trainer.build_metadata(args, state.group, session_id, started_at, opt_class, opt_name,
                                            state.num_batches, state.num_epochs, state.max_train_steps, total_batch)
    state.metadata.update({k: train_util.metadata_value(v)
                           for k, v in validation.metadata(args, val_group).items()})
    state.metadata.update(ema.metadata(args))
    state.log_with = trackers.log_with(args)
    if state.log_with:
        trackers.init_trackers(accelerator, args, trainer.tracker_name)
    logger.info("running training: %d batches per epoch, %d epochs, %d steps, batch size %d "
                "(total with accumulation and processes %d)", state.num_batches, state.num_epochs,
                state.max_train_steps, args.train_batch_size, total_batch)
    data_parallel.log_process(accelerator, state.num_batches)


def make_dataloader(group, args):
    from library.datasets import make_dataloader as dataloader_of

    # the group itself shuffles per epoch (seeded), so resumed runs see the same order
    return dataloader_of(group, num_workers=args.max_data_loader_n_workers,
                         persistent_workers=args.persistent_data_loader_workers, shuffle=False)


def allow_fp16_grad_unscale(accelerator) -> None:
    """--full_fp16: the LoRA weights themselves are fp16, which GradScaler refuses to unscale by default."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None:
        return
    org = scaler._unscale_grads_

    def unscale(optimizer, inv_scale, found_inf, allow_fp16):
        return org(optimizer, inv_scale, found_inf, True)

    scaler._unscale_grads_ = unscale

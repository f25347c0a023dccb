"""The composed trainer: a model family (library.families), a training target (library.targets) and the family's
objective (library.objectives). It answers the questions setup, the loop and the events ask, by asking the part
that owns the answer; nothing here is overridden per family or per target.

    Trainer(SDXL(), LoRA())            sdxl_train_network.py
    Trainer(Flux(16), Full(...))       flux_train.py
"""
from __future__ import annotations

import logging
import os
import time

import torch

from library import (huggingface_util, losses, masks, noise, optimizers, saving, state_folders, train_util,
                     validation)
from library import ema, metadata as metadata_util
from library.errors import ConfigError, TrainingError
from library.network_trainer import base_model_prediction, diff_output_preservation_indices, text_encoder_lr

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, family, target):
        self.family, self.target = family, target
        self.objective = family.objective
        self.state = None  # the last run's RunState (tests and benchmarks read its losses)

    # -- what the run asks of the parts --------------------------------------------------------------------
    @property
    def default_output_name(self) -> str:
        return self.target.default_output_name

    @property
    def tracker_name(self) -> str:
        return self.target.tracker_name

    @property
    def dataset_kinds(self) -> tuple:
        return self.target.dataset_kinds

    @property
    def bucket_reso_steps_multiple(self) -> int:
        return self.family.bucket_reso_steps_multiple

    @property
    def losses(self) -> list[float]:
        """Each micro-step's loss of the last train() call (tests, benchmarks)."""
        return self.state.losses if self.state is not None else []

    def family_for(self, args) -> str:
        return self.family.name(args)

    def train(self, args) -> str | None:
        from library.run import loop

        return loop.train(self, args)

    # -- checks ---------------------------------------------------------------------------------------------
    def check_common_options(self, args) -> None:
        """Logging, tracker, precision, memory and compile-switch options of every trainer, before the script's own
        checks (train_util.normalise_args mapped --torch_compile to the compile settings)."""
        from library import console_log, precision, sharding, trackers
        from library.compile import options as compile_options

        console_log.apply_console_log_args(args)  # a side effect (the log handler), not a setting
        compile_options.check_torch_compile_alias(args)
        trackers.check_tracker_args(args)
        precision.check_precision_args(args)
        ema.check_ema_args(args, ConfigError)
        sharding.from_accelerate_config(args)  # `accelerate launch --use_fsdp`: --fsdp, or data parallel (LoRA)
        sharding.check_deepspeed_args(args, ConfigError)  # --deepspeed: the package, what it cannot go with

    def check_objective_args(self, args) -> None:
        """Loss, noise and validation options (library.losses / noise / validation), before models load."""
        losses.check_loss_args(args, ConfigError, flow_matching=self.objective.flow_matching)
        noise.check_noise_args(args, ConfigError, flow_matching=self.objective.flow_matching)
        validation.check_validation_args(args, ConfigError)

    def check_args(self, args) -> None:
        """Everything that can be checked before data or models load: shared, objective, target, family."""
        train_util.verify_training_args(args)
        self.check_objective_args(args)
        self.target.check_args(args, self.family.name(args))
        self.family.check_args(args)

    def output_ext(self, args) -> str:
        return self.target.output_ext(args, self.family)

    def use_prediction_type(self, args, prediction_type: str) -> None:
        """The prediction type that trains is the one the metadata reports: a v-prediction model (e.g. its
        diffusers scheduler config) trains as --v_parameterization, and every reader of that flag agrees."""
        if prediction_type == "v_prediction" and not args.v_parameterization:
            logger.info("the model is a v-prediction model: training with v-parameterization")
            if args.v_pred_like_loss:
                raise TrainingError("--v_pred_like_loss cannot be used with a v-prediction model")
            args.v_parameterization = True

    # -- before step 1 (library.run.setup) ------------------------------------------------------------------
    def make_accelerator(self, args):
        """Data-parallel over the processes of `accelerate launch`. The trained modules are not wrapped in
        DDP (LoRA runs inside the UNet's forward, not the network's): their gradients are averaged by
        data_parallel.all_reduce_gradients instead; the dataloader is sharded by accelerate."""
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration

        from library import data_parallel, sharding, trackers

        logging_dir = None
        if args.logging_dir:
            logging_dir = os.path.join(args.logging_dir, (args.log_prefix or "") + time.strftime("%Y%m%d%H%M%S"))
        trackers.prepare_wandb(args, logging_dir)
        accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                                  mixed_precision=args.mixed_precision, log_with=trackers.log_with(args),
                                  project_config=ProjectConfiguration(project_dir=args.output_dir,
                                                                      logging_dir=logging_dir),
                                  kwargs_handlers=sharding.deepspeed_kwargs_handlers(
                                      args, data_parallel.accelerator_kwargs_handlers(args)),
                                  deepspeed_plugin=sharding.deepspeed_plugin(args))
        if problem := sharding.check_deepspeed_engaged(args, accelerator):
            raise TrainingError(problem)
        try:
            data_parallel.check_launch(accelerator)
        except RuntimeError as e:
            raise TrainingError(str(e)) from e
        return accelerator

    def write_run_config(self, args) -> str:
        """`<output_name>_config.toml`: the exact options of this run (runs again with --config_file)."""
        # written anew by every run of this name (its results were checked free by check_outputs_free, so a
        # config left here belongs to a run that did not finish, or to the run being resumed)
        path = os.path.join(args.output_dir, f"{args.output_name}_config.toml")
        train_util.atomic_write_text(path, train_util.dumps_config(args))
        logger.info("run options written to %s", path)
        return path

    def prepare_dataset(self, args, groups: list) -> None:
        """What the target (captions) and the family take from the datasets before the models load; a family's
        `prepare_dataset(args, groups)` is optional (SD3: the training resolutions, --enable_scaled_pos_embed)."""
        self.target.prepare_dataset(args, groups)
        family_hook = getattr(self.family, "prepare_dataset", None)
        if family_hook is not None:
            family_hook(args, groups)

    def te_cache_partial(self, args) -> bool:
        """Whether the target completes cached text-encoder outputs with live encoders each step (optional target
        method: Full's te_cache_partial, sd3_train.py --use_t5xxl_cache_only)."""
        partial = getattr(self.target, "te_cache_partial", None)
        return bool(partial is not None and partial(args))

    def load_models(self, args, weight_dtype):
        """The family's models, --base_weights merged (LoRA), fp8 and the attention backend applied."""
        from library import safetensors_io

        fp8 = self.target.fp8_targets(args)
        with safetensors_io.mmap_setting(args):
            components = self.family.load(args, weight_dtype, fp8[0])
        self.target.merge_base_weights(args, self.family, components)
        self.family.apply_fp8(args, components, fp8)
        self.family.set_attention_backend(args, components)
        return components

    def build_metadata(self, args, group, session_id, started_at, opt_class, opt_name, num_batches, num_epochs,
                       max_train_steps, total_batch_size) -> dict[str, str]:
        """The ss_* keys (library.metadata: every key upstream writes), then the target's and the family's."""
        md = metadata_util.network_metadata(
            args, group=group, session_id=session_id, started_at=started_at, opt_class=opt_class,
            num_batches=num_batches, num_epochs=num_epochs, max_train_steps=max_train_steps,
            total_batch_size=total_batch_size, base_model_version=self.family.base_model_version(args),
            network_dim=args.network_dim if getattr(args, "network_dim", None) is not None else 4,
            text_encoder_lr=text_encoder_lr(args))
        owned = {**losses.metadata(args), **noise.metadata(args)}  # those options' keys, from their modules
        md.update({k: train_util.metadata_value(v) for k, v in owned.items()})  # None as "None", as upstream
        md.update({k: train_util.metadata_value(v) for k, v in self.target.method_metadata(args).items()
                   if v is not None})
        md.update(self.family.metadata(args, self.target.fp8_targets(args)))
        return self.target.metadata(args, md)

    def modelspec(self, args, prediction_type: str | None = None) -> dict[str, str]:
        """modelspec.* keys of a saved result (library.metadata; --metadata_* options)."""
        return metadata_util.modelspec_metadata(
            args, family=self.family.name(args), lora=self.target.lora,
            flux_variant=self.family.modelspec_variant(),
            v_prediction=prediction_type == "v_prediction" or bool(getattr(args, "v_parameterization", False)))

    # -- a step ----------------------------------------------------------------------------------------------
    def training_step(self, state, batch, *, train_text_encoder: bool, fixed_timestep=None) -> torch.Tensor:
        args, accelerator, device = state.args, state.accelerator, state.device
        components, family = state.components, self.family
        if batch.get("latents") is not None:  # cached by encode_images (checked for NaN then), already scaled
            latents = batch["latents"].to(device, dtype=torch.float32)
        else:
            latents = family.encode_images(args, components, batch["images"], state.generator).to(torch.float32)
            if torch.isnan(latents).any():  # as upstream: a warning, and zeros (only here: it waits for the GPU)
                accelerator.print("NaN found in latents, replacing with zeros")
                latents = torch.nan_to_num(latents, 0, out=latents)
        if batch.get("te_outputs") is not None:
            te_outputs = {k: v.to(device) for k, v in batch["te_outputs"].items()}
            if self.te_cache_partial(args):  # the live encoders' outputs join the cached ones
                with accelerator.autocast():
                    te_outputs = family.encode_prompts(args, components, batch["captions"],
                                                       with_grad=train_text_encoder, cached=te_outputs)
        else:
            with accelerator.autocast():
                te_outputs = family.encode_prompts(args, components, batch["captions"], with_grad=train_text_encoder)

        def forward():
            return self.noisy_input_pred_target(state, latents, batch, te_outputs, fixed_timestep)

        networks = state.multiplier_models
        preserve = diff_output_preservation_indices(batch) if networks else []
        prior = base_model_prediction(networks, forward, state.generator, device) if preserve else None
        pred, target, timesteps, weighting = forward()
        if prior is not None:  # upstream's differential output preservation: those samples learn the base output
            target = target.clone()
            target[preserve] = prior[preserve].to(target.dtype)
        return self.loss(args, batch, state.noise_scheduler, pred, target, timesteps, weighting)

    def noisy_input_pred_target(self, state, latents, batch, te_outputs, fixed_timestep=None):
        """The objective's noisy input, prediction (the family's model call) and target, drawn from the run's
        generator."""
        args, components, dtype = state.args, state.components, state.weight_dtype

        def predict(noisy, timesteps):
            with state.accelerator.autocast():
                return self.family.predict(args, components, noisy.to(dtype), timesteps, te_outputs, batch, dtype)

        return self.objective.noisy_input_pred_target(args, state.noise_scheduler, latents, predict,
                                                      state.generator, fixed_timestep)

    def loss(self, args, batch, noise_scheduler, pred, target, timesteps, weighting) -> torch.Tensor:
        """--loss_type, the objective's weights, masks (element-wise), the dataset's loss weights, SNR weights."""
        huber_c = self.objective.huber_threshold(args, timesteps, noise_scheduler) \
            if args.loss_type in losses.HUBER_TYPES else None
        loss = losses.conditional_loss(pred.float(), target.float(), args.loss_type, huber_c)
        if weighting is not None:
            loss = loss * weighting
        # the element-wise loss times the batch's masks (alpha_mask / conditioning_data_dir images)
        loss = masks.apply_masked_loss(loss, batch.get("alpha_masks"))
        loss = loss.mean(dim=list(range(1, loss.dim())))
        loss = loss * batch["loss_weights"].to(loss.device)
        loss = self.objective.weight_loss(loss, args, timesteps, noise_scheduler)
        return loss.mean()

    def validation_loss(self, state) -> float:
        """One validation pass (library.validation): the training step's loss at each fixed timestep, without
        gradients (text encoders too), the trained modules in eval mode."""
        from library.compile import graphs as compile_graphs, options as compile_options

        def step(batch, timestep):
            self.target.on_step_start(state.args)
            compile_graphs.mark_step_begin(compile_options.compile_args(state.args))
            return self.training_step(state, batch, train_text_encoder=False, fixed_timestep=timestep)

        return state.validator.run(step, state.trainable.models, state, state.accelerator)

    # -- outputs ---------------------------------------------------------------------------------------------
    def full_weights(self, state):
        """Context entered by every process around a save: with --fsdp the main process's models hold the full
        weights inside (library.sharding.gathered); otherwise nothing changes."""
        from library import sharding

        return sharding.gathered(state.components, state.trainable.models, state.accelerator)

    def eval_weights(self, state):
        """Context: the model holds a schedule-free optimizer's evaluation weights (sampling, saving), as
        upstream; nothing changes with other optimizers."""
        return optimizers.eval_mode(state.optimizers, state.args)

    def save_model(self, state, path: str, epoch: int, step: int) -> None:
        """Writes the result (main process only); with --ema_decay the EMA weights (library.ema)."""
        def write(target_path):
            self.target.save_model(state.args, state.accelerator, state.trainable, self.family, state.components,
                                   state.metadata, target_path, epoch, step,
                                   self.modelspec(state.args, state.prediction_type))

        ema.save_model(state, write, path)

    def save_state(self, args, accelerator, name: str) -> str:
        """accelerate's state (models, optimizer, scheduler, step, every process's RNG); all processes call it.
        --save_state_to_huggingface uploads it."""
        path = os.path.join(args.output_dir, name)
        sharded = getattr(self.state, "sharded", None)  # --fsdp: models and optimizers written by each process
        with saving.explained_save_errors(path):
            state_folders.write_state(accelerator, path, args.overwrite_output,
                                      save=sharded.save if sharded is not None else None)
        logger.info("training state saved: %s", path)
        if accelerator.is_main_process and getattr(args, "save_state_to_huggingface", False):
            huggingface_util.upload(args, path, name)
        return path

    def save_checkpoint(self, state, epoch: int, step: int, by_step: bool, prune: bool = True) -> None:
        """An intermediate save (kohya names `-step00000010` / `-000001`), uploaded with --huggingface_repo_id,
        old ones pruned by --save_last_n_*(_state) (not after a Save now: `prune` False). Every process calls it;
        the main process writes the model."""
        with self.eval_weights(state):
            self._save_checkpoint(state, epoch, step, by_step, prune)

    def _save_checkpoint(self, state, epoch, step, by_step: bool, prune: bool) -> None:
        args, accelerator, ext = state.args, state.accelerator, state.ext
        accelerator.wait_for_everyone()
        if by_step:
            name = train_util.step_file_name(args.output_name, step, ext)
        else:
            name = train_util.epoch_file_name(args.output_name, epoch, ext)
        path = os.path.join(args.output_dir, name)
        with self.full_weights(state):
            if accelerator.is_main_process:
                with saving.explained_save_errors(path):
                    self.save_model(state, path, epoch, step)
        if accelerator.is_main_process:
            huggingface_util.upload(args, path, name)
        if args.save_state:
            self.save_state(args, accelerator, train_util.state_dir_name(
                args.output_name, epoch=None if by_step else epoch, step=step if by_step else None))
        if accelerator.is_main_process and prune:
            prune_checkpoints(args, epoch, step, ext, by_step)
        accelerator.wait_for_everyone()

    def sample_images(self, state, *, epoch: int | None) -> None:
        """Main process only, inside eval_weights; the trained modules are put in eval mode while sampling."""
        args, accelerator = state.args, state.accelerator
        if not args.sample_prompts or not accelerator.is_main_process:
            return
        with self.eval_weights(state):
            for sample_args, weights in ema.sample_passes(state):  # with --ema_decay: the EMA (and raw) weights
                with weights:
                    self.family.sample(self.target.sample_args(sample_args), state.components, accelerator, epoch=epoch,
                                       steps=state.global_step,
                                       networks=[accelerator.unwrap_model(m) for m in state.trainable.models],
                                       prediction_type=state.prediction_type)


def prune_checkpoints(args, epoch, step, ext, by_step: bool) -> None:
    """Removes the save that --save_last_n_epochs/_steps (models) and --save_last_n_*_state (states, default
    the same N) let go, with upstream's rules (library.saving); only names this run writes."""
    out, name = args.output_dir, args.output_name
    if by_step:
        every = args.save_every_n_steps
        old = saving.remove_step_no(step, every, args.save_last_n_steps)
        if old is not None:
            remove(os.path.join(out, train_util.step_file_name(name, old, ext)))
        old = saving.remove_step_no(step, every, saving.state_keep_last(args, by_step=True))
        if old:  # upstream keeps a state of step 0 (there is none)
            remove(os.path.join(out, train_util.state_dir_name(name, step=old)))
    else:
        every = args.save_every_n_epochs
        old = saving.remove_epoch_no(epoch, every, args.save_last_n_epochs)
        if old is not None:
            remove(os.path.join(out, train_util.epoch_file_name(name, old, ext)))
        old = saving.remove_epoch_no(epoch, every, saving.state_keep_last(args, by_step=False))
        if old is not None:
            remove(os.path.join(out, train_util.state_dir_name(name, epoch=old)))


def remove(path: str) -> None:
    import shutil

    huggingface_util.wait_for_uploads(path)  # an --async_upload of it still running
    if os.path.isdir(path):
        shutil.rmtree(path)
        logger.info("removed old state %s", path)
    elif os.path.isfile(path):
        os.remove(path)
        logger.info("removed old checkpoint %s", path)

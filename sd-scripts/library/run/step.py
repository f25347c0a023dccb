"""The micro-step: one batch forward, backward and (at the end of an accumulation window) the optimizer step,
with the CUDA-graph step mark once per window, the compile shape log, the dataset's network multiplier and the
whole-step CUDA graph of --cuda_graph_step (library.compile.step_graph)."""
from __future__ import annotations

from library import data_parallel, network_options, schedulers, sharding
from library.compile import graphs as compile_graphs, options as compile_options, regional, step_graph


class MicroStep:
    def __init__(self, state, late):
        args, trainer = state.args, state.trainer
        self.late = late  # library.late_loss.LateLosses: each micro-step's loss, read a step later
        self.fused = trainer.target.steps_in_backward(args)  # the optimizer steps inside backward (full trainers)
        self.compiled = compile_options.compile_args(args)
        self.shape_log = regional.ShapeLog(self.compiled) \
            if self.compiled is not None and self.compiled.compile else None
        self.trained_params = state.trained_params = [p for m in state.trainable.models for p in m.parameters()
                                                      if p.requires_grad]
        self.graphs = step_graph.StepGraphs(state.optimizers, state.device, [state.generator],
                                            accumulation_steps=args.gradient_accumulation_steps) \
            if compile_graphs.cuda_graphs(args) == "step" else None

    def forward_to_optimizer_step(self, state, batch):
        """Forward to optimizer step (no zero_grad): what a step graph captures."""
        args, accelerator = state.args, state.accelerator
        loss = state.trainer.training_step(state, batch, train_text_encoder=state.train_text_encoder)
        accelerator.backward(loss)  # with fused backward the optimizer steps in here, per parameter
        if not self.fused:
            if accelerator.sync_gradients:
                data_parallel.all_reduce_gradients(self.trained_params, accelerator)
                if args.max_grad_norm:
                    sharding.clip_grad_norm_(self.trained_params, args.max_grad_norm, accelerator)
                network_options.after_grad_sync(state.trainable.models)
            state.optimizers[0].step()
        return loss

    def __call__(self, state, batch) -> bool:
        """One micro-step; True when it ended an optimizer step (the step events are due then)."""
        args, accelerator, trainer = state.args, state.accelerator, state.trainer
        if state.train_text_encoder and \
                not trainer.target.keep_training_text_encoder(args, state.global_step, state.components):
            state.train_text_encoder = False
        trainer.target.on_step_start(args)
        if compile_graphs.opens_accumulation_window(accelerator.step, args.gradient_accumulation_steps):
            compile_graphs.mark_step_begin(self.compiled)  # once per optimizer step (CUDA graphs)
        if self.shape_log is not None:
            self.shape_log.see(batch, state.global_step + 1)
            state.step_shapes.append(self.shape_log.shape_of(batch))
        set_network_multiplier(state.trainable.models, batch)
        with accelerator.accumulate(*state.trainable.models):
            sharding.set_gradient_sync(state.trainable.models, accelerator.sync_gradients)
            if self.graphs is not None:  # a replay of the step's graph once captured (library.compile.step_graph)
                loss = self.graphs.step(batch, lambda b: self.forward_to_optimizer_step(state, b),
                                        sync=accelerator.sync_gradients)
            else:
                loss = self.forward_to_optimizer_step(state, batch)
                if not self.fused:
                    state.optimizers[0].zero_grad(set_to_none=True)
            schedulers.step(state.lr_scheduler, state.optimizers, num_processes=accelerator.num_processes,
                            sync_gradients=accelerator.sync_gradients)
        self.late.add(loss)  # read a step later: no wait for the GPU here
        if not accelerator.sync_gradients:
            return False
        state.norm_postfix, state.norm_logs = network_options.after_optimizer_step(
            args, [accelerator.unwrap_model(m) for m in state.trainable.models], state.device) \
            if not self.fused else ({}, {})
        return True

    def setup_steps_per_shape(self, args) -> int:
        """Steps of each input shape that are setup (compile, graph recording), for the step timer."""
        if compile_graphs.cuda_graphs(args) == "step":
            return step_graph.WARMUP + 1
        return 2 if compile_graphs.cuda_graphs(self.compiled) == "blocks" else 1


def set_network_multiplier(models: list, batch: dict) -> None:
    """The dataset's `network_multiplier` for this batch (a batch comes from one dataset). Only a network with
    `set_multiplier` (networks.lora) takes it, and only when it changes, so the default of 1.0 costs nothing."""
    multipliers = batch.get("network_multipliers")
    if multipliers is None or not len(multipliers):
        return
    value = float(multipliers[0])
    for model in models:
        if hasattr(model, "set_multiplier") and getattr(model, "multiplier", 1.0) != value:
            model.set_multiplier(value)

"""torch.compile and CUDA graphs for the trainers, one concern a module:

- ``options``: the compile flags (and upstream's --torch_compile / --dynamo_backend), their up-front validation
  (``validate_compile_args``: impossible settings raise ``CompileConfigError`` naming the flags and the allowed
  values, before any model loads) and their metadata.
- ``environment``: ``apply_process_settings(args)``: the process-wide switches (TF32 / cuDNN flags, the cuDNN SDPA
  work-around for torch 2.11 + CUDA 13 on Hopper, the dynamo recompile limit), set from torch's defaults every run;
  ``setup_compile_environment(args)``: the persistent compile cache, cheaper CUDA-graph recording, shorter dynamo
  tracing; ``warm_compile_workers(args)``: inductor's compile workers and triton's hash started while models load.
- ``regional``: ``compile_model_blocks(model, args, ...)`` after ``accelerator.prepare`` (and after the LoRA network
  is applied): each repeated transformer block is compiled in place with ``module.compile()``; identical blocks
  share one graph, LoRA modules inside are traced into it, and state_dict keys stay free of ``_orig_mod.``
  (``strip_orig_mod`` on every save path all the same). ``ShapeLog``: one line per new input shape.
- ``checkpoint``: gradient checkpointing inside the compiled blocks and what it keeps (--compile_checkpoint_keep).
- ``graphs``: which CUDA graphs a run uses (``cuda_graphs(args)``, the one answer), --cuda_graph_step and its
  ``auto`` decision, and ``mark_step_begin`` at the first micro-step of each optimizer step.
- ``step_graph``: the whole training step as one CUDA graph (--cuda_graph_step).
- ``recording``: cheaper CUDA-graph recording for the CUDA-graph compile modes.
- ``tracing``: dynamo's log-header lookups skipped while its trace logs are off.

What the trainers call, in this order: ``options.add_compile_arguments`` / ``graphs.add_arguments`` in the parser;
``options.validate_compile_args`` and ``graphs.check_args`` right after parsing; ``graphs.resolve`` once the
dataset's bucket shapes are known, then ``environment.apply_process_settings`` before any model loads;
``environment.setup_compile_environment`` and ``regional.compile_model_blocks``
after ``accelerator.prepare``; ``graphs.mark_step_begin`` at the start of each optimizer step.
"""

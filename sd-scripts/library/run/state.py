"""The run state: one explicit object that setup fills, the loop advances and the step events read, instead of
attributes set on the trainer for hooks to find.

`TrainState` is the part saved with --save_state (accelerate's custom checkpoint object): the step counter, the
epoch and the run's random generator, so a resumed run continues the same random stream.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class TrainState:
    """The step counter saved with `--save_state` (accelerate custom checkpoint object), and the run's generator.
    Each process draws its noise from its own generator (seeded seed + rank) but only the main process writes the
    file: with several processes every one's generator state is gathered into it (`noise_rng_per_rank`; every
    process calls state_dict in accelerate's save_state), and a resume on as many processes gives each its own."""

    def __init__(self):
        self.global_step = 0
        self.epoch = 0
        self.generator: torch.Generator | None = None

    def state_dict(self) -> dict:
        out = {"global_step": self.global_step, "epoch": self.epoch}
        if self.generator is not None:
            out["noise_rng"] = self.generator.get_state()
            if _world() > 1:
                per_rank = [None] * _world()
                torch.distributed.all_gather_object(per_rank, out["noise_rng"])
                out["noise_rng_per_rank"] = per_rank
        return out

    def load_state_dict(self, state: dict) -> None:
        self.global_step = int(state["global_step"])
        self.epoch = int(state["epoch"])
        if self.generator is None or "noise_rng" not in state:
            return
        per_rank = state.get("noise_rng_per_rank")
        if per_rank is not None and len(per_rank) == _world():
            self.generator.set_state(per_rank[torch.distributed.get_rank()])
        else:  # saved by one process, or resumed on another number of processes
            self.generator.set_state(state["noise_rng"])


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_available() and \
        torch.distributed.is_initialized() else 1


@dataclass
class RunState:
    """What a run knows once setup is done; the loop and the events change only the fields under "progress"."""

    args: Any
    trainer: Any  # the composed trainer: family, target and objective hooks
    accelerator: Any
    components: Any
    trainable: Any  # network_trainer.Trainable
    optimizers: list
    optimizer_names: tuple  # (name, class name) of the first optimizer, for the metadata
    lr_scheduler: Any
    dataloader: Any
    group: Any  # the training dataset group
    groups: list  # every group that is cached and told the step (training, validation)
    ext: str  # the result's file extension
    final_path: str
    weight_dtype: torch.dtype
    caching_te: bool
    prediction_type: str
    num_batches: int
    num_epochs: int
    steps_per_epoch: int
    max_train_steps: int
    requests: Any  # run_requests.RunRequests
    validator: Any = None
    ema: Any = None  # library.ema.EMA with --ema_decay
    sharded: Any = None  # library.sharding.ShardedState with --fsdp (what --save_state writes of the models)
    noise_scheduler: Any = None
    metadata: dict = field(default_factory=dict)
    log_with: Any = None
    checkpoint: TrainState = field(default_factory=TrainState)
    generator: torch.Generator | None = None  # noise, timesteps and VAE sampling draw from it (saved with --save_state)
    stop: Any = None  # stop_signal.StopRequest
    multiplier_models: list = field(default_factory=list)  # trained modules with set_multiplier (LoRA)
    trained_params: list = field(default_factory=list)  # what is trained, as the loop began (weights checksum)
    # -- progress: changed by the loop and the events ------------------------------------------------------
    global_step: int = 0
    epoch: int = 0  # the epoch in progress, counted from 0
    first_epoch: int = 0
    skip_batches: int = 0
    at_epoch_end: bool = False  # the events run after a step (False) or after an epoch (True)
    train_text_encoder: bool = False
    losses: list = field(default_factory=list)  # each micro-step's loss, read a step late
    last_loss: float = float("nan")
    avr_loss: float = float("nan")
    asked: set = field(default_factory=set)  # this step's Save now / Sample now / Stop requests
    stopping: bool = False  # the ranks' agreed answer to a stop request or signal
    paused: bool = False  # this step's events paused the loop (validation, a save, samples)
    norm_postfix: dict = field(default_factory=dict)  # --scale_weight_norms: progress bar postfix, tracker logs
    norm_logs: dict = field(default_factory=dict)
    step_shapes: list = field(default_factory=list)  # input shapes of the step in progress (compile shape log)
    reporter: Any = None  # events.Progress: progress line, bar, trackers; flush() reads every pending loss
    timer: Any = None  # step_timer.StepTimer

    @property
    def device(self):
        return self.accelerator.device

    @property
    def done_epoch(self) -> int:
        """Epochs finished (1-based number of the epoch in progress once it ends)."""
        return self.epoch + 1

    @property
    def noise_generator(self) -> torch.Generator:  # the name library.validation swaps during a validation pass
        return self.generator

    @noise_generator.setter
    def noise_generator(self, value: torch.Generator) -> None:
        self.generator = value

    def pause(self) -> None:
        """Before work that is not step time (validation, saving, sampling): every pending loss read."""
        self.paused = True
        self.reporter.flush(self)

    def resume(self) -> None:
        """After that work: the step timer starts again."""
        self.timer.restart()

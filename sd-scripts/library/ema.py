"""EMA of the trained weights (every trainer, LoRA and full): `--ema_decay D` (off when unset) keeps an exponential
moving average of what is trained, updated every `--ema_update_every N` optimizer steps by one fused foreach lerp,
on the GPU or (`--ema_device cpu`) in host memory. Warm-up as OneTrainer's: the k-th update uses
min(D, (1 + k) / (10 + k)), so early updates follow the weights closely. Samples are drawn and results saved
with the EMA weights (`--ema_save_raw` also writes the raw weights, as `<name>-raw<ext>`; `--ema_sample_raw` also draws
the samples with them, as `<output_name>-raw_...png`); `--save_state` folders
carry the average (accelerate custom checkpoint object) and `--resume` continues it; the metadata records the
settings (`ss_ema_*`). The update is the `EMAUpdate` step event (library.run.events)."""
from __future__ import annotations

import contextlib
import logging
import os

import torch

logger = logging.getLogger(__name__)

DEVICES = ("gpu", "cpu")


def add_ema_arguments(parser) -> None:
    parser.add_argument("--ema_decay", type=float, default=None,
                        help="keep an EMA of the trained weights with this decay (e.g. 0.999); samples and saves use "
                             "it. Unset = no EMA")
    parser.add_argument("--ema_update_every", type=int, default=1,
                        help="update the EMA every N optimizer steps (default 1)")
    parser.add_argument("--ema_device", choices=DEVICES, default="gpu",
                        help="where the EMA copy lives: gpu (the training device) or cpu (host memory, for full "
                             "fine-tuning of large models)")
    parser.add_argument("--ema_save_raw", action="store_true",
                        help="with --ema_decay: also save the raw (non-averaged) weights, as <name>-raw<ext>")
    parser.add_argument("--ema_sample_raw", action="store_true",
                        help="with --ema_decay: also draw the samples with the raw weights (files named "
                             "<output_name>-raw_...)")


def check_ema_args(args, error) -> None:
    decay = getattr(args, "ema_decay", None)
    if decay is None:
        return
    if not 0.0 < decay < 1.0:
        raise error(f"--ema_decay {decay}: must be between 0 and 1 (exclusive), e.g. 0.999")
    if args.ema_update_every < 1:
        raise error(f"--ema_update_every {args.ema_update_every}: must be 1 or more")


def metadata(args) -> dict[str, str]:
    if getattr(args, "ema_decay", None) is None:
        return {}
    return {"ss_ema_decay": str(args.ema_decay), "ss_ema_update_every": str(args.ema_update_every),
            "ss_ema_device": args.ema_device}


class EMA:
    """The average of `params` (a list of tensors; trained parameters). An accelerate custom checkpoint object."""

    def __init__(self, params: list[torch.Tensor], decay: float, update_every: int = 1, device: str = "gpu"):
        self.params = list(params)
        self.decay, self.update_every = decay, update_every
        self.on_cpu = device == "cpu"
        with torch.no_grad():
            self.shadow = [p.detach().to("cpu" if self.on_cpu else p.device, copy=True) for p in self.params]
        self.updates = 0

    def decay_at(self, update: int) -> float:
        """OneTrainer's warm-up: the decay of the update-th update (0-based)."""
        return min(self.decay, (1 + update) / (10 + update))

    @torch.no_grad()
    def update(self) -> None:
        weight = 1.0 - self.decay_at(self.updates)
        live = [p.detach() for p in self.params]
        if self.on_cpu:
            live = [p.to("cpu") for p in live]
        torch._foreach_lerp_(self.shadow, live, weight)  # shadow += (1 - decay) * (p - shadow), one fused kernel
        self.updates += 1

    @contextlib.contextmanager
    def swapped_in(self):
        """The live parameters hold the average inside the context, their own values again after it."""
        with torch.no_grad():
            raw = [p.detach().clone() for p in self.params]
            torch._foreach_copy_([p.data for p in self.params], [s.to(p.device) for s, p in
                                                                 zip(self.shadow, self.params)])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], raw)

    def state_dict(self) -> dict:
        return {"shadow": [s.cpu() for s in self.shadow], "updates": self.updates, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        shadow = state["shadow"]
        if len(shadow) != len(self.shadow) or any(a.shape != b.shape for a, b in zip(shadow, self.shadow)):
            from library.errors import TrainingError

            raise TrainingError("--resume: the state's EMA does not fit the trained weights (another network "
                                "shape?)")
        with torch.no_grad():
            for s, saved in zip(self.shadow, shadow):
                s.copy_(saved.to(s.device, s.dtype))
        self.updates = int(state["updates"])


def build(args, trainable) -> EMA | None:
    """The run's EMA over everything the optimizer trains, or None without --ema_decay."""
    if getattr(args, "ema_decay", None) is None:
        return None
    params = [p for g in trainable.param_groups for p in g["params"] if p.requires_grad]
    ema = EMA(params, args.ema_decay, args.ema_update_every, args.ema_device)
    size = sum(p.numel() * p.element_size() for p in params)
    logger.info("EMA: decay %s every %d step(s), %d tensors (%.1f MB) on the %s", args.ema_decay,
                args.ema_update_every, len(params), size / 2 ** 20, "CPU" if ema.on_cpu else "training device")
    return ema


def raw_path(path: str) -> str:
    """`<name>-raw<ext>` beside the result (a diffusers folder: `<folder>-raw`)."""
    stem, ext = os.path.splitext(path)
    return f"{stem}-raw{ext}"


def with_ema(state):
    """Context for sampling and saving: the EMA weights in the model (nothing without --ema_decay)."""
    ema = getattr(state, "ema", None)
    return ema.swapped_in() if ema is not None else contextlib.nullcontext()


def sample_passes(state) -> list:
    """(args, weights context) of each sampling pass: the EMA weights, and with --ema_sample_raw also the raw ones
    under `<output_name>-raw` (the sample file names start with it)."""
    args = state.args
    passes = [(args, with_ema(state))]
    if getattr(state, "ema", None) is not None and args.ema_sample_raw:
        import argparse

        raw_args = argparse.Namespace(**vars(args))
        raw_args.output_name = f"{args.output_name}-raw"
        passes.append((raw_args, contextlib.nullcontext()))
    return passes


def save_model(state, write, path: str) -> None:
    """`write(path)` with the EMA weights; with --ema_save_raw first the raw weights to raw_path(path)."""
    ema = getattr(state, "ema", None)
    if ema is None:
        write(path)
        return
    if state.args.ema_save_raw:
        write(raw_path(path))
    with ema.swapped_in():
        write(path)


class EMAUpdate:
    """After every --ema_update_every-th optimizer step: the EMA update (library.run.events' step-event API)."""

    def due(self, state) -> bool:
        ema = getattr(state, "ema", None)
        return ema is not None and not state.at_epoch_end and state.global_step % ema.update_every == 0

    def run(self, state) -> None:
        state.ema.update()

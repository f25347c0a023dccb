"""Save now, Sample now and Stop from outside a running trainer, on every platform: a request file in the output
folder, read at each step boundary (not in upstream; OneTrainer and ai-toolkit have such commands).

    <output_dir>/.train_requests     one word per line: save | sample | stop

Anyone may append lines (`python -m kohya_gui signal save OUTPUT_DIR`, the GUI's buttons, `echo save >> ...`).
The main process checks for the file once per optimizer step (one stat call), takes it by renaming it (so lines
appended meanwhile go to a new file, never lost) and acts after the step: "save" writes the usual step save
(`<name>-step00000123.safetensors`, and the state folder with --save_state), "sample" draws the --sample_prompts
images, "stop" stops and saves like SIGTERM (library.stop_signal). With several processes the ranks agree on the
requests at the same step. A file left by an earlier run is removed when training starts.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

FILE_NAME = ".train_requests"
REQUESTS = ("save", "sample", "stop")


def request_path(output_dir: str) -> str:
    return os.path.join(output_dir, FILE_NAME)


class RunRequests:
    def __init__(self, output_dir: str, is_main_process: bool = True):
        self.path = request_path(output_dir)
        self.is_main_process = is_main_process

    def clear_stale(self) -> None:
        """Requests written before this run started are not for it."""
        if self.is_main_process and os.path.exists(self.path):
            os.remove(self.path)
            logger.info("removed an earlier run's request file %s", self.path)

    def _read(self) -> set[str]:
        if not os.path.exists(self.path):
            return set()
        taking = self.path + ".taking"
        try:
            os.replace(self.path, taking)
            with open(taking, encoding="utf-8", errors="replace") as f:
                words = f.read().split()
            os.remove(taking)
        except OSError as e:  # a writer holding it open on Windows: next step
            logger.debug("request file not taken yet: %s", e)
            return set()
        unknown = sorted(set(words) - set(REQUESTS))
        if unknown:
            logger.warning("%s: ignored %s (allowed: %s)", self.path, ", ".join(unknown), ", ".join(REQUESTS))
        return set(words) & set(REQUESTS)

    def take(self, accelerator=None, stop_flag: bool = False) -> set[str]:
        """The requests made since the last call, plus "stop" when `stop_flag` (a stop signal) is set: the same
        set on every rank (one all-reduce per step with several processes, the one the stop flag needed anyway)."""
        found = self._read() if self.is_main_process else set()
        if stop_flag:
            found.add("stop")
        from library import data_parallel

        if accelerator is None or not data_parallel.is_distributed(accelerator):
            return found
        import torch

        t = torch.tensor([1.0 if r in found else 0.0 for r in REQUESTS], device=accelerator.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return {r for r, v in zip(REQUESTS, t.tolist()) if v}

    def stop_agreed(self, accelerator=None, stop_flag: bool = False) -> bool:
        """After a pause of the loop (a save, the sample images): whether a stop signal came meanwhile, the same
        answer on every rank (one all-reduce with several processes), without taking the request file (its save /
        sample requests wait for the next step's `take`). The loop then stops after this step, not the next."""
        if accelerator is None or not _distributed(accelerator):
            return stop_flag
        import torch

        t = torch.tensor([1.0 if stop_flag else 0.0], device=accelerator.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())


def _distributed(accelerator) -> bool:
    from library import data_parallel

    return data_parallel.is_distributed(accelerator)

"""What the run panel charts and shows, read from the trainer's output lines:

- each progress line `steps: 12/100 loss=0.1234 it/s=2.35 avr_loss=0.1300 val_loss=0.1400 lr=1.00e-04 ...`
  (train_util.ProgressLine) gives a point: step, loss, average, validation loss (when on) and learning rate;
- each `sample image: <path> (prompt '<text>')` line (sampling.save_sample_image) gives a gallery entry, with
  the step from kohya's sample name `<name>_<step>_<index>_<time>[_<seed>].png` (or `_e<epoch>_`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf)"
PROGRESS = re.compile(r"^steps: (\d+)/\d+ ")
METRIC = re.compile(r"\b(loss|avr_loss|val_loss|lr)=" + NUM)
SAMPLE = re.compile(r"sample image: (.+?) \(prompt (['\"])(.*)\2\)\s*$")
SAMPLE_STEP = re.compile(r"_(\d{6})_(\d{2})_\d")
SERIES = {"loss": "loss", "avr_loss": "average", "val_loss": "validation"}


@dataclass
class RunHistory:
    points: list[dict] = field(default_factory=list)  # {"step", "loss", "avr_loss", "val_loss"?, "lr"}
    samples: list[tuple[str, str]] = field(default_factory=list)  # (image path, caption)

    def feed(self, line: str) -> bool:
        """Takes one output line; True when it added a point or a sample."""
        m = PROGRESS.match(line)
        if m:
            step = int(m.group(1))
            if self.points and step <= self.points[-1]["step"]:
                return False  # the same step printed again (first and last step lines)
            values = {k: float(v) for k, v in METRIC.findall(line)}
            if "loss" not in values:
                return False
            self.points.append({"step": step, **values})
            return True
        m = SAMPLE.search(line)
        if m:
            path, prompt = m.group(1), m.group(3)
            where = SAMPLE_STEP.search(Path(path).name)
            self.samples.append((path, f"step {int(where.group(1))}: {prompt}" if where else prompt))
            return True
        return False

    def loss_rows(self) -> list[dict]:
        """Long-form rows for a line chart: {"step", "value", "series"} for loss, average and validation loss."""
        return [{"step": p["step"], "value": p[key], "series": name}
                for p in self.points for key, name in SERIES.items() if key in p]

    def lr_rows(self) -> list[dict]:
        return [{"step": p["step"], "value": p["lr"], "series": "learning rate"} for p in self.points if "lr" in p]

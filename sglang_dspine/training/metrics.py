"""Where training metrics go: `metrics.jsonl` always, TensorBoard beside it (`tensorboard/` in the run
folder, when the `tensorboard` package is installed), and Weights & Biases when asked for. Rank 0 only."""
from __future__ import annotations

import json
import os
import sys
from typing import Any

# metrics.jsonl keys that are bookkeeping, not curves
_NOT_SCALARS = {"step", "interval_steps", "interval_seconds"}


def _scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The record's numbers under TensorBoard-style names (train/loss, train/accuracy_pos/3, ...)."""
    out: dict[str, float] = {}
    for k, v in rec.items():
        if k in _NOT_SCALARS:
            continue
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"train/{k}"] = float(v)
        elif k == "accuracy_per_position" and isinstance(v, list):
            for i, a in enumerate(v, 1):
                out[f"train/accuracy_pos/{i}"] = float(a)
    return out


class MetricsSink:
    """Writes each log record to every destination; `close()` flushes them."""

    def __init__(self, output_dir: str | None, tensorboard: bool = True, wandb_project: str | None = None,
                 run_name: str | None = None, config: dict[str, Any] | None = None):
        self.jsonl = os.path.join(output_dir, "metrics.jsonl") if output_dir else None
        self.tb = None
        self.wandb = None
        if output_dir is None:
            return
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("train: TensorBoard logging off: the `tensorboard` package is not installed (pip install "
                      "'.[train]' from the repository, or pip install tensorboard); metrics go to metrics.jsonl",
                      file=sys.stderr)
            else:
                self.tb = SummaryWriter(log_dir=os.path.join(output_dir, "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ValueError("--wandb-project: the `wandb` package is not installed (pip install wandb)") from None
            self.wandb = wandb.init(project=wandb_project, name=run_name, config=config or {}, dir=output_dir,
                                    resume="allow")

    def write(self, rec: dict[str, Any]) -> None:
        if self.jsonl:
            with open(self.jsonl, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        if self.tb is None and self.wandb is None:
            return
        scalars = _scalars(rec)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, rec["step"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=rec["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None

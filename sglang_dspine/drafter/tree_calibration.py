"""A drafter's tree calibration: the file a server verifying trees wider than the block reads for greedy requests.

At T = 0 only the target's argmax path is accepted, and the drafter's own table rows are under-confident at some
block positions and over-confident at others, so a best-first tree over the raw rows spends its nodes on
siblings and loses to the walk (docs/tree.md, "Calibration"). Per block position i, a temperature t_i and the log
of the target's mean mass on the position's candidates, log m_i ≤ 0, make a node's score the log of its chance
of being accepted: Σ_i log_softmax(row / t_i) + log m_i (`tree.table_log_scores`). They are fitted once per
drafter and target, teacher-forced along the target's greedy text (`sglang-dspine tree-calibrate`), and kept
beside the drafter's weights as `FILE_NAME`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from .config import DrafterConfigError

FILE_NAME = "dspine_tree_calibration.json"
FORMAT = "sglang-dspine tree calibration"
VERSION = 1


@dataclass
class TreeCalibration:
    """block_size: the drafter's; temperature and log_mass: one per block position 1..B-1, for greedy requests
    (T = 0); fitted: where they came from (target, prompts, rows, commit, date)."""

    block_size: int
    temperature: list[float]
    log_mass: list[float]
    fitted: dict = field(default_factory=dict)

    def __post_init__(self):
        p = self.block_size - 1
        if len(self.temperature) != p or len(self.log_mass) != p:
            raise DrafterConfigError(f"tree calibration: {len(self.temperature)} temperatures and "
                                     f"{len(self.log_mass)} log masses for block size {self.block_size} "
                                     f"(want {p} of each)")
        bad = [t for t in self.temperature if not (math.isfinite(t) and t > 0)]
        if bad:
            raise DrafterConfigError(f"tree calibration: temperatures must be finite and > 0, found {bad}")
        bad = [m for m in self.log_mass if not (math.isfinite(m) and m <= 0)]
        if bad:
            raise DrafterConfigError(f"tree calibration: log masses must be finite and <= 0 (a node never "
                                     f"outscores its parent), found {bad}")

    def save(self, path: str) -> None:
        """Write the file to `path` (a server reads it from `<drafter>/FILE_NAME`)."""
        body = {"format": FORMAT, "version": VERSION, "block_size": self.block_size,
                "greedy": {"temperature": self.temperature, "log_mass": self.log_mass}, "fitted": self.fitted}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(body, f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, drafter_dir: str, block_size: int) -> TreeCalibration:
        """The calibration beside a drafter of `block_size`; DrafterConfigError (naming the file) if it is
        missing, unreadable, of another format or for another block size."""
        path = os.path.join(drafter_dir, FILE_NAME)
        if not os.path.isfile(path):
            raise DrafterConfigError(f"no tree calibration {path}: fit one with `sglang-dspine tree-calibrate "
                                     f"--drafter {drafter_dir} --target TARGET --prompts PROMPTS.jsonl`")
        try:
            with open(path, encoding="utf-8") as f:
                body = json.load(f)
        except (OSError, ValueError) as e:
            raise DrafterConfigError(f"tree calibration {path}: not readable JSON ({e})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
            raise DrafterConfigError(f"tree calibration {path}: not a `{FORMAT}` file of version {VERSION}")
        try:
            greedy = body["greedy"]
            cal = cls(int(body["block_size"]), [float(t) for t in greedy["temperature"]],
                      [float(m) for m in greedy["log_mass"]], dict(body.get("fitted") or {}))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, DrafterConfigError):
                raise DrafterConfigError(f"{path}: {e}") from None
            raise DrafterConfigError(f"tree calibration {path}: missing or malformed field ({e!r})") from None
        if cal.block_size != block_size:
            raise DrafterConfigError(f"tree calibration {path} is for block size {cal.block_size}, the drafter's "
                                     f"is {block_size}: fit it again for this drafter")
        return cal

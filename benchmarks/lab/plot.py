"""Plot a lab results JSON: acceptance per block position, DFlash vs DSpine, per suite and temperature.

    python benchmarks/lab/plot.py benchmarks/results/lab_cpu_pair.json   # writes <json stem>_positions.png
"""
from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot(path: str) -> str:
    res = json.load(open(path))
    temps = sorted(res["eval"])
    suites = sorted(res["eval"][temps[0]])
    fig, axes = plt.subplots(len(temps), len(suites), figsize=(4 * len(suites), 3 * len(temps)), squeeze=False)
    for r, t in enumerate(temps):
        for c, suite in enumerate(suites):
            ax = axes[r][c]
            for kind, style in (("dflash", "--o"), ("dspine", "-s")):
                acc = res["eval"][t][suite][kind]["position_acceptance"]
                tau = res["eval"][t][suite][kind]["tau"]
                ax.plot(range(1, len(acc) + 1), acc, style, ms=3, label=f"{kind} (τ {tau:.2f})")
            ax.set_title(f"{suite}, T={t[1:]}")
            ax.set_xlabel("block position")
            ax.set_ylabel("accepted fraction")
            ax.set_ylim(0, 1)
            ax.legend(fontsize=8)
    fig.suptitle(f"acceptance per block position ({res.get('device', '?')}, commit {res.get('commit', '?')[:8]})")
    fig.tight_layout()
    out = os.path.splitext(path)[0] + "_positions.png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(plot(p))

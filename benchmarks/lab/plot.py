"""Plots of lab results: acceptance per block position (an offline lab JSON), and SGLang throughput and tau
against concurrency (benchmarks/serve_step_cost.py's JSON).

    python benchmarks/lab/plot.py benchmarks/results/lab_cpu_pair.json       # <json stem>_positions.png
    python benchmarks/lab/plot.py benchmarks/results/serving_step_cost.json  # <json stem>.png
"""
from __future__ import annotations

import json
import os
import sys


def _pyplot():
    """matplotlib's pyplot, imported only to draw: --help and argument errors work without it (it comes with the
    `lab` extra, not with the package itself)."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot.py: drawing needs matplotlib, which is not installed: pip install '.[lab]' from the "
                 "repository (or pip install matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(path: str) -> str:
    plt = _pyplot()
    res = json.load(open(path))
    temps = sorted(res["eval"])
    suites = sorted({suite for t in temps for suite in res["eval"][t]})  # a cut-short run: some cells empty
    fig, axes = plt.subplots(len(temps), len(suites), figsize=(4 * len(suites), 3 * len(temps)), squeeze=False)
    for r, t in enumerate(temps):
        for c, suite in enumerate(suites):
            ax = axes[r][c]
            if suite not in res["eval"][t]:
                ax.set_title(f"{suite}, T={t[1:]}: not evaluated")
                ax.axis("off")
                continue
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


def plot_serving(path: str) -> str:
    """Output tokens/s (mean of the repeats, bars from min to max) and tau against concurrency, per server."""
    plt = _pyplot()
    res = json.load(open(path))
    table = res["summary"]["per_server"]
    fig, (ax_t, ax_tau) = plt.subplots(1, 2, figsize=(11, 4))
    for name, by_c in table.items():
        cs = sorted(by_c, key=int)
        x = [int(c) for c in cs]
        tps = [by_c[c]["tokens_per_s"] for c in cs]
        mean = [sum(v) / len(v) for v in tps]
        err = [[m - min(v) for m, v in zip(mean, tps)], [max(v) - m for m, v in zip(mean, tps)]]
        ax_t.errorbar(x, mean, yerr=err, marker="o", capsize=3, label=name)
        if all(by_c[c]["tau"] for c in cs):  # the server without speculation has no tau
            ax_tau.plot(x, [by_c[c]["tau"][0] for c in cs], marker="o", label=name)
    for ax, label in ((ax_t, "output tokens/s"), (ax_tau, "tau (tokens per verify step)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    prov = res["provenance"]
    pair = "/".join(res["models"].rstrip("/").split("/")[-2:])
    fig.suptitle(f"SGLang {prov['versions']['sglang']} on {prov['gpu']}, pair {pair}, T=0 "
                 f"({len(res['repeats'])} repeats; commit {prov['commit'][:8]})")
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("results", nargs="+", help="an offline lab JSON, or serve_step_cost.py's JSON")
    args = ap.parse_args(argv)
    for p in args.results:
        if not os.path.isfile(p):
            ap.error(f"{p}: not found")
        print(plot_serving(p) if "repeats" in json.load(open(p)) else plot(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Offline tau against training steps for one CPU pair: the pair's own run and `cpu_steps.sh`'s retrains of its
drafters (same target, data, suites and settings but the step count). Writes a JSON and a plot.

    python benchmarks/lab/steps_summary.py /tmp/labcpu /tmp/lab_cpu_steps --out benchmarks/results/lab_cpu_steps.json
    # writes that JSON and its .png (without --out: into $OUT or a temporary folder)
"""
from __future__ import annotations

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from sglang_dspine.provenance import default_output, provenance  # noqa: E402
from sglang_dspine.source_files import as_package  # noqa: E402

if not __package__:  # run as a file (python benchmarks/lab/x.py): the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

KINDS = ("dflash", "dspine")
SAME = ("target_args", "vocab", "block_size", "draft_layers", "transfer_rank", "message_size", "top_k",
        "train_batch", "num_anchors", "max_length", "train_lr", "eval_limit", "eval_tokens", "temperatures")


def point(res: dict, source: str) -> dict:
    """One training length: tau per temperature, suite and drafter, the ratios, the last training metrics."""
    return {
        "train_steps": int(res["settings"]["train_steps"]),
        "source": source,
        "commit": res.get("commit"),
        "tau_mean": {t: res[f"tau_{t}_mean"] for t in ("t0", "t1") if f"tau_{t}_mean" in res},
        "tau_ratio": {t: res[f"tau_ratio_{t}"] for t in ("t0", "t1") if f"tau_ratio_{t}" in res},
        "tau_per_suite": {t: {s: {k: v[k]["tau"] for k in KINDS} | {"ratio": v["ratio"]} for s, v in suites.items()}
                          for t, suites in res["eval"].items()},
        "train_accuracy": {k: round(res["train"][k]["accuracy"], 4) for k in KINDS},
        "train_loss": {k: round(res["train"][k]["loss"], 4) for k in KINDS},
        "train_seconds": res["stage_seconds"].get("train"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pair", help="the CPU pair's output folder (cpu_pair.sh OUT)")
    p.add_argument("steps", help="cpu_steps.sh's output folder")
    p.add_argument("--out", default=default_output("lab_cpu_steps.json"),
                   help="results JSON (default: $OUT or a temporary folder; the committed one: "
                        "benchmarks/results/lab_cpu_steps.json)")
    args = p.parse_args(argv)
    # run.py leaves its report in every run folder as results.json
    files = glob.glob(os.path.join(args.pair, "results.json"))
    files += sorted(glob.glob(os.path.join(args.steps, "steps_*", "results.json")))
    if not files:
        raise SystemExit(f"no lab results under {args.pair} or {args.steps}")
    runs = [(f, json.load(open(f))) for f in files]
    base = runs[0][1]["settings"]
    for f, r in runs[1:]:  # a curve over steps means nothing if anything else moved
        diff = [k for k in SAME if r["settings"].get(k) != base.get(k)]
        if diff:
            raise SystemExit(f"{f}: settings differ from {runs[0][0]} in {diff}")
    points = sorted((point(r, f) for f, r in runs), key=lambda x: x["train_steps"])
    steps = [x["train_steps"] for x in points]
    if len(set(steps)) < len(steps):
        raise SystemExit(f"two runs with the same step count among {files}")
    out = {"what": "offline tau (DSpine vs DFlash) of one CPU pair's drafters retrained at several step counts; "
                   "same target, data, suites and settings otherwise",
           **provenance(), "settings": {k: base.get(k) for k in SAME}, "points": points}
    write_json(args.out, out)

    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(10, 3.6))
    temps = [t for t in ("t0", "t1") if t in points[0]["tau_mean"]]
    for t, style in zip(temps, ("-", ":")):
        for k, marker in (("dflash", "o"), ("dspine", "s")):
            ax.plot(steps, [x["tau_mean"][t][k] for x in points], style + marker, label=f"{k} T={t[1:]}")
        ax_r.plot(steps, [x["tau_ratio"][t] for x in points], style + "o", label=f"T={t[1:]}")
    ax.set(xlabel="training steps", ylabel="offline τ (mean over suites)", title="acceptance length")
    ax_r.set(xlabel="training steps", ylabel="τ DSpine ÷ τ DFlash", title="ratio")
    ax_r.axhline(1.0, color="grey", lw=0.8)
    for a in (ax, ax_r):
        a.legend(fontsize=8)
        a.set_xscale("log")
        a.minorticks_off()
        a.set_xticks(steps, [str(s) for s in steps])
    fig.suptitle(f"CPU pair, drafters retrained at each length (commit {out['commit'][:8]})")
    fig.tight_layout()
    png = os.path.splitext(args.out)[0] + ".png"
    fig.savefig(png, dpi=110)
    print(f"{'steps':>6} " + " ".join(f"{h:>10}" for t in temps for h in (f"dflash_{t}", f"dspine_{t}", f"ratio_{t}")))
    for x in points:
        print(f"{x['train_steps']:>6} " + " ".join(f"{v:>10}" for t in temps for v in
                                               (x["tau_mean"][t]["dflash"], x["tau_mean"][t]["dspine"],
                                                x["tau_ratio"][t])))
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The README's "when speculation pays" tables, generated from benchmarks/results/adaptive_summary.json (the
summary `scripts/device/adaptive.py --merge` writes after a lease).

    python -m benchmarks.adaptive_table            # rewrite the tables between the README's markers
    python -m benchmarks.adaptive_table --check    # exit 1 where the README's tables are not what the JSON gives

Two tables: the built-in pair served end to end (T = 0, each server alone, median tokens/s; the last column the
adaptive server with the tree of 32 in its menu, SGLANG_DSPINE_TREE=1), and the Qwen3-8B geometry's projection on
the recipe lab's acceptance (the step table measured there × acceptance per shape). The caption names the GPU and
commit the summary gives, and marks the tables stale where the measured code changed since (as the headline table
does).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

from benchmarks.headline_table import README, RESULTS, stale_note, write_or_check_block

SUMMARY = os.path.join(RESULTS, "adaptive_summary.json")
BEGIN = ("<!-- adaptive tables: generated from benchmarks/results/adaptive_summary.json by "
         "`python -m benchmarks.adaptive_table`; edit the JSON, not these tables -->")
END = "<!-- end of adaptive tables -->"
PAIR_SERVERS = (("plain", "plain"), ("dflash", "DFLASH"), ("dspine", "DSPINE (block)"),
                ("dspine_tree32", "tree of 32"), ("dspine_adaptive", "DSPINE adaptive"),
                ("dspine_adaptive_tree32", "adaptive + tree of 32"))
GEOMETRY_SERVERS = (("plain", "plain"), ("dflash", "DFLASH"), ("dspine", "DSPINE (block)"),
                    ("dspine_adaptive", "DSPINE adaptive"))
PROJECTION = "geometry_projection_recipe_lab"


def _clients(table: dict) -> list[str]:
    """The client counts of a table keyed by client count (T = 0 only: `1_t1` and the like are left out)."""
    return sorted((c for c in table if c.isdigit()), key=int)


def _cell(value) -> str:
    return "–" if value is None else f"{value:.0f}"


def _table(header: tuple, rows: list[list[str]]) -> list[str]:
    return ["| clients | " + " | ".join(header) + " |", "| ---: |" + " ---: |" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows)]


def pair_rows(summary: dict) -> list[list[str]]:
    e2e = summary["end_to_end"]
    return [[c, *(_cell((e2e[c].get(s) or {}).get("tokens_per_s", {}).get("median")) for s, _ in PAIR_SERVERS)]
            for c in _clients(e2e)]


def geometry_rows(summary: dict) -> list[list[str]]:
    proj = summary[PROJECTION]
    rows = []
    for c in _clients(proj):
        row = proj[c]
        cells = [_cell(row.get(s)) for s, _ in GEOMETRY_SERVERS]
        if row.get("adaptive_shape") and row.get("dspine_adaptive") is not None:
            cells[-1] += f" ({row['adaptive_shape']})"
        rows.append([c, *cells])
    return rows


def render(summary: dict, until: str = "HEAD") -> str:
    commits = [c.strip() for c in str(summary["commit"]).split(",")]
    status = stale_note(commits, until) or "the measured code is as at HEAD"
    wrap = lambda text: textwrap.fill(text, 116, break_long_words=False, break_on_hyphens=False)  # noqa: E731
    lines = [BEGIN, "",
             wrap(f"Measured on {summary['gpu']} at {summary['commit']} ({status}), each server alone, output "
                  "tokens/s, median of 3 rounds (min–max in `benchmarks/results/adaptive_summary.json`). The built-in "
                  "pair, T=0:"),
             "", *_table(tuple(n for _, n in PAIR_SERVERS), pair_rows(summary)), "",
             wrap("Qwen3-8B geometry (random weights), projected from the step times measured there and the recipe "
                  "lab's acceptance per shape (a projection, not a served model; chain16 is the block):"),
             "", *_table(tuple(n for _, n in GEOMETRY_SERVERS), geometry_rows(summary)), "", END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summary", default=SUMMARY)
    ap.add_argument("--readme", default=README)
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 where they differ")
    args = ap.parse_args(argv)
    with open(args.summary) as f:
        summary = json.load(f)
    return write_or_check_block(args.readme, render(summary), BEGIN, END, "the adaptive tables'", args.check,
                                f"the adaptive tables differ from {args.summary}; run python -m "
                                "benchmarks.adaptive_table",
                                f"adaptive tables from {args.summary} ({summary['gpu']}, {summary['commit']})")


if __name__ == "__main__":
    sys.exit(main())

"""The README's headline table, generated from benchmarks/results/headline.json.

    python -m benchmarks.headline_table            # rewrite the table between the README's markers
    python -m benchmarks.headline_table --check    # exit 1 where the README's table is not what the JSON gives

headline.json holds one row per headline measurement: what was measured, the result as text with named
figures ({name}) filled from `figures`, the runs it comes from (commit, device, repeats, result file) and,
for a served draft tree, the sampling rule the server runs. Every figure names the result file and key it
was read from (tests/test_headline.py checks each against its file). A run whose measured code (SGLang
plugin, drafter, kernels: MEASURED_CODE) changed between its commit and HEAD is marked stale in the table;
where git cannot tell, the table says so.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from sglang_dspine.provenance import MEASURED_CODE, changed_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
HEADLINE = os.path.join(RESULTS, "headline.json")
README = os.path.join(ROOT, "README.md")
BEGIN = ("<!-- headline table: generated from benchmarks/results/headline.json by "
         "`python -m benchmarks.headline_table`; edit the JSON, not this table -->")
END = "<!-- end of headline table -->"


def lookup(data, key: list):
    for part in key:
        data = data[part]
    return data


def figure_value(spec: dict, results_dir: str = RESULTS) -> float:
    """A figure's value as its result file gives it: `key` (a path into the JSON), divided by `over` where
    given; `keys` (several such [key, over] pairs, over may be null) aggregated by `agg` (min, max, mean, median,
    sum)."""
    with open(os.path.join(results_dir, spec["file"])) as f:
        data = json.load(f)

    def one(key, over=None):
        value = float(lookup(data, key))
        return value / float(lookup(data, over)) if over else value

    if "keys" not in spec:
        return one(spec["key"], spec.get("over"))
    values = [one(key, over) for key, over in spec["keys"]]
    aggregate = {"min": min, "max": max, "sum": sum, "mean": statistics.mean, "median": statistics.median}
    return aggregate[spec["agg"]](values)


def shown(value: float, fmt: str) -> str:
    return format(value, fmt)


def run_status(commit: str, until: str = "HEAD") -> str | None:
    """None where the measured code is as it was at `commit`; else what changed (or that git cannot tell)."""
    files = changed_files(commit, until, MEASURED_CODE)
    if files is None:
        return "git cannot tell"
    return "changed" if files else None


def stale_note(commits: list[str], until: str = "HEAD") -> str | None:
    """None where the measured code at `until` is as at every one of `commits`; else the words a generated table
    says it with, each such commit once (by its short hash), with why where git cannot tell."""
    stale = []
    for commit in commits:
        status = run_status(commit, until)
        if status and commit[:7] not in [c[:7] for c in stale]:
            stale.append(commit[:7] + ("" if status == "changed" else f" ({status})"))
    return ("**stale**: the measured code (`sglang_dspine/`, `kernels/`) changed since " + ", ".join(stale)
            if stale else None)


def render_row(row: dict, until: str = "HEAD") -> str:
    result = row["result"].format(**{name: shown(spec["value"], spec["fmt"])
                                     for name, spec in row.get("figures", {}).items()})
    measurement = row["measurement"]
    if row.get("sampling_rule"):
        measurement += f"; the server's sampling rule: {row['sampling_rule']}"
    runs = [f"{run['commit'][:7]}, {run['device']}, {run['repeats']}" for run in row["runs"]]
    at_head = stale_note([run["commit"] for run in row["runs"]], until) or "current"
    cells = [measurement, result, "; ".join(runs), at_head, row["where"]]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def render_table(headline: dict, until: str = "HEAD") -> str:
    lines = [BEGIN, "", "| measurement | result | runs: commit, device, repeats | at HEAD | where |",
             "| --- | --- | --- | --- | --- |"]
    lines += [render_row(row, until) for row in headline["rows"]]
    return "\n".join(lines + ["", END])


def replace_block(readme: str, block: str, begin: str, end: str, what: str) -> str:
    """`readme` with what lies from its `begin` marker to its `end` marker (both included) replaced by `block`
    (which carries the markers again); `what` ("the headline table's") names them in the error where they are not
    there once each."""
    if readme.count(begin) != 1 or readme.count(end) != 1:
        raise ValueError(f"README.md: {what} markers must appear once each")
    head, rest = readme.split(begin)
    _, tail = rest.split(end)
    return head + block + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--headline", default=HEADLINE)
    ap.add_argument("--readme", default=README)
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 where they differ")
    args = ap.parse_args(argv)
    with open(args.headline) as f:
        headline = json.load(f)
    return write_or_check_block(args.readme, render_table(headline), BEGIN, END, "the headline table's", args.check,
                                f"the headline table differs from {args.headline}; run python -m "
                                "benchmarks.headline_table",
                                f"headline table from {args.headline} ({len(headline['rows'])} rows)")


def write_or_check_block(path: str, block: str, begin: str, end: str, what: str, check: bool, differs: str,
                         wrote: str) -> int:
    """A generated README block (`replace_block`'s arguments) into the README at `path`: with `check`, 1 (saying
    `differs`) where the README's text is not what the block gives, else 0; without, the README written where it
    differs (saying `wrote`), 0."""
    with open(path) as f:
        old = f.read()
    new = replace_block(old, block, begin, end, what)
    if check:
        if new != old:
            print(f"{path}: {differs}", file=sys.stderr)
            return 1
        return 0
    if new != old:
        with open(path, "w") as f:
            f.write(new)
    print(f"{path}: {wrote}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

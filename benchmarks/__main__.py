"""python -m benchmarks SCENARIO [--out DIR_OR_FILE] [the scenario's own arguments]

Runs one scenario module's main() with the arguments after its name (`python -m benchmarks SCENARIO --help`: its
own). From the repository root, with sglang_dspine installed (`pip install -e .`, or the GPU machine's layout):
the root leaves sys.path before a scenario is imported (its `kernels/` would shadow the `kernels` package).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys

# scenario -> (module under benchmarks, what it measures)
SCENARIOS = {
    "step_cost": ("serving_scale", "SGLang's per-step cost at a geometry (Qwen3-8B), servers side by side or alone"),
    "e2e": ("serve_e2e", "end-to-end serving evidence: greedy agreement, the T=1 test, load, refusals (a pair)"),
    "step_cost_pair": ("serve_step_cost", "a pair's servers side by side: tokens/s, tau and steps/s per client count"),
    "features": ("serving_features", "request features against the server without speculation"),
    "pressure": ("serving_pressure", "KV exhaustion, graph sizes, near-context prompts, disconnects, soak"),
    "versions": ("serving_versions", "the SGLang release x backend matrix, from the runs' results"),
    "trees": ("tree_offline", "draft trees over the transition lattice, offline"),
    "tree_served": ("tree_served", "the served trees' summary, from the runs' results"),
    "lab": ("lab.run", "the lab: corpus, tokenizer, target, data, both drafters, offline tau"),
    "lab_serving": ("lab.serve_bench", "the lab pair served side by side (SGLang's bench_serving)"),
    "train_step": ("train_step", "a training step, profiled"),
    "train_scale": ("train_scale", "drafter training at Qwen3-8B geometry"),
    "vocab_loss": ("vocab_loss", "the objective's vocabulary-sized work"),
    "kernels": ("kernels", "the draft step's kernels against DFlash's"),
    "headline": ("headline", "the README's GPU headline rows re-measured at one commit, in resumable parts"),
    "headline_table": ("headline_table", "the README's headline table from benchmarks/results/headline.json"),
    "verify_attention": ("verify_attention", "a verify step's attention kernels vs plain decode's (Qwen3-8B heads)"),
    "greedy_divergence": ("greedy_divergence", "a GPU run's greedy divergences from plain, judged by the fp32 target"),
    "step_timeline": ("step_timeline", "where a served step's time goes, from a trace of SGLang's profiler"),
    "policy_host": ("policy_host", "the adaptive policy's host work per decode step, on this machine's CPU"),
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def usage() -> str:
    width = max(map(len, SCENARIOS))
    return __doc__.split("\n\n")[0] + "\n\nscenarios:\n" + "\n".join(
        f"  {name:<{width}}  {what} (benchmarks/{module.replace('.', '/')}.py)"
        for name, (module, what) in SCENARIOS.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SCENARIOS:
        print(f"python -m benchmarks: no scenario {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == ROOT:
        sys.path.pop(0)  # put there by `python -m` run from the root; `benchmarks` is imported already
    if importlib.util.find_spec("sglang_dspine") is None:
        print("python -m benchmarks: sglang_dspine is not installed (pip install -e . from the repository root)",
              file=sys.stderr)
        return 2
    sys.argv = [f"python -m benchmarks {name}", *rest]  # before the import: some scenarios read it at import
    module = importlib.import_module(f"benchmarks.{SCENARIOS[name][0]}")
    return module.main() or 0


if __name__ == "__main__":
    sys.exit(main())

"""`headline`: one run that re-measures the README's GPU headline rows at one commit, on the GPU that is lent, in
parts that each fit one device call.

    python -m benchmarks headline --out DIR             # the next part not yet done, killed after --budget-s (540)
    python -m benchmarks headline --out DIR --part P    # part P (again)
    python -m benchmarks headline --out DIR --status    # the parts, done or not, and their seconds
    python -m benchmarks headline --out DIR --collect   # DIR/headline_parts.json: each done part's figures
        [--write benchmarks/results]                    # and their rows into headline.json (then headline_table)

Each part is one scenario run (PARTS) writing only under DIR/parts/P, which is emptied when the part starts; its
outcome goes to DIR/state.json when it ends. A part that did not end (a machine taken back, the time limit) is not
done, and the next call runs it again from its start: so the run resumes after a lost machine, part by part.
Servers side by side get `--mem-fraction-static` sized from the card's memory (`mem_fraction`), so one plan
starts on an H100 (80 GB) as on an H200 (141 GB). Every figure is the median of the part's repeats (≥ 3) with
their min and max, and the row names the commit and the GPU its part ran on; the lab pair's row has plain
decoding's tokens/s beside the speculative servers'.

`--collect` gives the repeats' spread for the step cost at Qwen3-8B geometry (part step_cost) and the lab pair's
and the served trees' tokens/s and τ (part pair); `--write` puts every done part's rows into headline.json
(ROW_BUILDERS). Not in the parts: the soak, features under SGLang's default backends, the other training recipes
(their rows say what the run measured). Not run on a GPU yet: the seconds in PARTS are estimates, and so is the
memory sizing.
The offline rows (the lab's τ, the trees offline) are CPU runs of their own (`python -m benchmarks lab`, `trees`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from benchmarks.output import write_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUDGET_S = 540  # one part: under a device call's 10 minutes, with the start and the copy back
REPEATS = 3


@dataclass
class Part:
    name: str
    rows: tuple[str, ...]  # the headline rows (headline.json ids) it re-measures
    seconds: int  # estimated
    servers: int  # servers side by side (for the memory each gets)
    argv: list[str] = field(default_factory=list)  # after the interpreter; {out} and {mem} filled in


PARTS = [
    Part("step_cost", ("step_cost_qwen3_8b",), 480, 2,
         ["-m", "benchmarks", "step_cost", "--out", "{out}", "--work", "{out}/work", "--servers", "dflash,dspine",
          "--clients", "1,4,16,64", "--temperatures", "0,1", "--repeats", str(REPEATS), "--profile-clients", ""]),
    Part("kv_alone", ("kv_cache_qwen3_8b",), 300, 1,
         ["-m", "benchmarks", "step_cost", "--out", "{out}", "--work", "{out}/work", "--servers", "dflash,dspine",
          "--alone-only", "--clients", "1", "--temperatures", "0", "--repeats", str(REPEATS)]),
    Part("pair", ("lab_pair_sglang_tokens_per_s", "tree_served"), 480, 5,
         ["-m", "benchmarks", "step_cost_pair", "--models", os.path.join("models", "default"),
          "--out", "{out}", "--servers", "plain,dflash,dspine,dspine_tree32,dspine_tree64",
          "--repeats", str(REPEATS), "--mem-fraction", "{mem}", "--pool", "60000"]),  # equal KV pools
    Part("features", ("request_features",), 420, 3, ["-m", "benchmarks", "features", "--out", "{out}"]),
    Part("pressure", ("pressure",), 420, 3, ["-m", "benchmarks", "pressure", "--out", "{out}"]),
    Part("train_step", ("training_step_qwen3_8b",), 300, 0,
         ["-m", "benchmarks", "train_scale", "--work", "{out}/work", "--out", "{out}/train_scale_summary.json"]),
]


def mem_fraction(card_gib: float, servers: int, want_gib: float = 16.0) -> float:
    """--mem-fraction-static for each of `servers` servers of the built-in pair side by side: `want_gib` each
    (weights, CUDA graphs and a KV pool far above the runs' needs), at most an equal share of 90% of the card."""
    return round(min(want_gib / card_gib, 0.9 / max(servers, 1)), 3)


def card() -> tuple[str, float]:
    """The GPU lent (name, GiB); ("none", 0) without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    if not out:
        return "none", 0.0
    name, mib = (x.strip() for x in out[0].rsplit(",", 1))
    return name, float(mib) / 1024


def load_state(out: str) -> dict:
    path = os.path.join(out, "state.json")
    return json.load(open(path)) if os.path.exists(path) else {}


def save_state(out: str, state: dict) -> None:
    write_json(os.path.join(out, "state.json"), state)  # whole: a machine lost mid-write leaves the previous state


def next_part(state: dict, parts: list[Part]) -> Part | None:
    return next((p for p in parts if state.get(p.name, {}).get("status") != "done"), None)


def run_part(part: Part, out: str, budget_s: float, gpu: tuple[str, float]) -> dict:
    """The part's command from the repository root, its output under out/parts/NAME (emptied first), killed with
    everything it started once budget_s has passed."""
    folder = os.path.join(out, "parts", part.name)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    mem = mem_fraction(gpu[1], part.servers) if gpu[1] else 0.0
    cmd = [sys.executable, *(a.format(out=folder, mem=mem) for a in part.argv)]
    t0 = time.time()
    with open(os.path.join(folder, "part.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return {"status": "done" if rc == 0 else ("timed out" if rc is None else "failed"), "rc": rc,
            "seconds": round(time.time() - t0, 1), "command": cmd, "gpu": gpu[0], "gpu_gib": round(gpu[1], 1),
            "mem_fraction": mem or None}


def spread(values: list[float], digits: int = 3) -> dict:
    """median, min, max (and n) of one figure's repeats."""
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "n": len(values)}


def collect_step_cost(folder: str) -> dict:
    """serving_scale.json's side-by-side rounds: DSPINE ÷ DFLASH step ms per temperature and client count, over
    the repeats."""
    res = json.load(open(os.path.join(folder, "serving_scale.json")))
    ratios: dict[str, list[float]] = {}
    for rnd in res["rounds"]:
        step = {s: {(r["temperature"], r["clients"]): r["step_ms"] for r in rows if r.get("step_ms")}
                for s, rows in rnd.items()}
        for key, ms in step["dspine"].items():
            if key in step["dflash"]:
                ratios.setdefault(f"T={key[0]:g} c={key[1]}", []).append(ms / step["dflash"][key])
    cells = {k: spread(v) for k, v in ratios.items()}
    return {"provenance": res["provenance"], "dspine_over_dflash_step": cells}


def collect_pair(folder: str) -> dict:
    """serve_step_cost's per-server tokens/s and τ per client count, each repeat: DSPINE ÷ DFLASH, the trees ÷
    DSPINE's chain, and plain decoding's tokens/s beside them."""
    res = json.load(open(os.path.join(folder, "serving_step_cost.json")))
    per = res["summary"]["per_server"]
    out: dict = {"provenance": res["provenance"], "tokens_per_s": {}, "ratios": {}}
    for server, by_clients in per.items():
        out["tokens_per_s"][server] = {c: spread(v["tokens_per_s"], 1) for c, v in by_clients.items()}
    pairs = [("dspine", "dflash")] + [(t, "dspine") for t in ("dspine_tree32", "dspine_tree64") if t in per]
    for num, den in pairs:
        for c in per[num]:
            for k in ("tokens_per_s", "tau"):
                values = [a / b for a, b in zip(per[num][c][k], per[den][c][k])]
                out["ratios"].setdefault(f"{num}/{den} {k}", {})[c] = spread(values)
    return out


COLLECTORS = {"step_cost": collect_step_cost, "pair": collect_pair}


# ------------------------------------------------------------------------------------------- headline.json rows
# Each builder reads a part's result file (copied to benchmarks/results/headline_<part>.json) and gives the rows it
# re-measures: figures as keys into that file, so tests/test_headline.py checks them like every other row's.
def _fig(file: str, keys: list, agg: str = "max", fmt: str = ".3f") -> dict:
    from benchmarks.headline_table import figure_value

    spec = {"file": os.path.basename(file), "fmt": fmt, "keys": keys, "agg": agg}
    value = figure_value(spec, os.path.dirname(file))
    return {"value": float(format(value, fmt.replace(",", ""))), **spec}  # as shown (rounded once)


def _run(res: dict, file: str, repeats: str = f"{REPEATS} repeats: each figure their median unless it says min / max"
         ) -> dict:
    p = res.get("provenance") or res  # a summary carries commit and gpu itself
    return {"commit": p["commit"], "device": p.get("gpu") or "no GPU", "files": [os.path.basename(file)],
            "repeats": repeats}


def rows_step_cost(file: str) -> list[dict]:
    res = json.load(open(file))
    cells: dict[tuple, list] = {}
    for i, rnd in enumerate(res["rounds"]):
        where = {s: {(r["temperature"], r["clients"]): j for j, r in enumerate(rows) if r.get("step_ms")}
                 for s, rows in rnd.items()}
        for key, j in where["dspine"].items():
            if key in where["dflash"]:
                cells.setdefault(key, []).append([["rounds", i, "dspine", j, "step_ms"],
                                                  ["rounds", i, "dflash", where["dflash"][key], "step_ms"]])
    figures, text = {}, []
    for temp in sorted({t for t, _ in cells}):
        clients = sorted(c for t, c in cells if t == temp)
        for c in clients:
            figures[f"t{temp:g}_c{c}"] = _fig(file, cells[(temp, c)], "median")
        text.append(" / ".join("{" + f"t{temp:g}_c{c}" + "}" for c in clients)
                    + f" at {' / '.join(map(str, clients))} clients, T={temp:g}")
    every = [k for keys in cells.values() for k in keys]
    figures["min"], figures["max"] = _fig(file, every, "min"), _fig(file, every, "max")
    return [{"id": "step_cost_qwen3_8b", "result": "DSPINE's step ÷ DFLASH's " + "; ".join(text)
             + " (single repeats {min}–{max})", "figures": figures, "runs": [_run(res, file)]}]


def rows_pair(file: str) -> list[dict]:
    res = json.load(open(file))
    per = res["summary"]["per_server"]

    def ratio_keys(num: str, den: str, c: str, what: str = "tokens_per_s") -> list:
        n = len(per[num][c][what])
        return [[["summary", "per_server", num, c, what, i], ["summary", "per_server", den, c, what, i]]
                for i in range(n)]

    clients = sorted(per["dspine"], key=int)
    run = [_run(res, file)]
    figures = {f"c{c}": _fig(file, ratio_keys("dspine", "dflash", c), "median") for c in clients}
    every = [k for c in clients for k in ratio_keys("dspine", "dflash", c)]
    taus = [k for c in clients for k in ratio_keys("dspine", "dflash", c, "tau")]
    figures.update(min=_fig(file, every, "min"), max=_fig(file, every, "max"),
                   tau_min=_fig(file, taus, "min"), tau_max=_fig(file, taus, "max"))
    result = ("DSPINE ÷ DFLASH " + " / ".join("{c" + c + "}" for c in clients) + f" at {' / '.join(clients)} clients "
              "(single repeats {min}–{max}); τ ratio {tau_min}–{tau_max}")
    if "plain" in per:
        figures.update({f"plain_c{c}": _fig(file, ratio_keys("dspine", "plain", c), "median") for c in clients})
        result += "; DSPINE ÷ no speculation " + " / ".join("{plain_c" + c + "}" for c in clients)
    rows = [{"id": "lab_pair_sglang_tokens_per_s", "result": result, "figures": figures, "runs": run}]
    trees = [t for t in ("dspine_tree32", "dspine_tree64") if t in per]
    if trees:
        tps = [k for t in trees for c in clients for k in ratio_keys(t, "dspine", c)]
        figures = {t: _fig(file, ratio_keys(t, "dspine", "1", "tau"), "median") for t in trees}
        figures.update(tps_min=_fig(file, tps, "min"), tps_max=_fig(file, tps, "max"))
        rows.append({"id": "tree_served", "figures": figures, "runs": run, "result":
                     "τ ÷ the chain's " + " / ".join("{" + t + "}" for t in trees) + " at N = "
                     + " / ".join(t.removeprefix("dspine_tree") for t in trees) + " (1 client); tokens/s ÷ the "
                     "chain's {tps_min}–{tps_max} (single repeats, " + f"{clients[0]}–{clients[-1]} clients)"})
    return rows


def rows_kv(file: str) -> list[dict]:
    res = json.load(open(file))
    key = lambda s: [["alone_default_graph_bs", s, "memory", "max_total_num_tokens"], None]
    ratio = [[key("dspine")[0], key("dflash")[0]]]
    figures = {"dspine": _fig(file, [key("dspine")], fmt=",.0f"), "dflash": _fig(file, [key("dflash")], fmt=",.0f"),
               "ratio": _fig(file, ratio)}
    return [{"id": "kv_cache_qwen3_8b", "result": "{dspine} tokens vs DFLASH's {dflash} ({ratio}×)",
             "figures": figures, "runs": [_run(res, file, "1 start each")]}]


def rows_features(file: str) -> list[dict]:
    res = json.load(open(file))
    key = lambda s, k: [["servers", s, k], None]
    figures = {s: _fig(file, [key(s, "features_ok")], fmt=".0f") for s in ("dspine", "dflash", "plain")}
    figures["total"] = _fig(file, [key("dspine", "features_total")], fmt=".0f")
    return [{"id": "request_features", "figures": figures, "runs": [_run(res, file, "1 run")],
             "result": "DSPINE {dspine} of {total}, stock DFLASH {dflash}, no speculation {plain} (the scripts' "
                       "backends, triton / pytorch)"}]


def rows_pressure(file: str) -> list[dict]:
    res = json.load(open(file))
    scen = res["servers"]["dspine"]["scenarios"]

    def keys(server: str, what: str) -> list:
        return [[["servers", server, "scenarios", n, what], None] for n in sorted(scen)
                if isinstance(res["servers"][server]["scenarios"].get(n, {}).get(what), (int, float))]

    figures = {"n": _fig(file, keys("dspine", "ok"), "sum", ".0f"),
               "errors": _fig(file, keys("dspine", "errors"), "sum", ".0f"),
               "mism": _fig(file, keys("dspine", "mismatches"), "sum", ".0f"),
               "near": _fig(file, keys("dspine", "mismatches_near_tie"), "sum", ".0f"),
               "leaked": _fig(file, keys("dspine", "leaked_tokens"), "sum", ".0f"),
               "dflash_ok": _fig(file, keys("dflash", "ok"), "sum", ".0f")}
    return [{"id": "pressure", "figures": figures, "runs": [_run(res, file, "1 run")],
             "measurement": "under pressure (built-in pair): " + ", ".join(sorted(scen)),
             "result": "DSPINE passes {n} of " + str(len(scen)) + " scenarios: {errors} errors, {mism} differences "
                       "from the server alone ({near} at near-ties), {leaked} leaked KV slots; stock DFLASH passes "
                       "{dflash_ok}"}]


def rows_train(file: str) -> list[dict]:
    res = json.load(open(file))
    figures = {"ratio": _fig(file, [[["dspine_over_dflash_step"], None]], fmt=".2f"),
               "accum": _fig(file, [[["settings", "grad_accum"], None]], fmt=".0f"),
               "steps": _fig(file, [[["settings", "steps"], None]], fmt=".0f")}
    return [{"id": "training_step_qwen3_8b", "figures": figures, "runs": [_run(res, file, "1 run")],
             "result": "{ratio}× DFlash's step with the " + res["settings"]["recipe"] + " recipe and {accum} "
                       "accumulation steps (mean of {steps} timed steps)"}]


ROW_BUILDERS = {"step_cost": ("serving_scale.json", rows_step_cost), "pair": ("serving_step_cost.json", rows_pair),
                "kv_alone": ("serving_scale_summary.json", rows_kv),
                "features": ("serving_features_summary.json", rows_features),
                "pressure": ("serving_pressure_summary.json", rows_pressure),
                "train_step": ("train_scale_summary.json", rows_train)}


def write_headline(out: str, results: str, parts: list[Part]) -> list[str]:
    """Every done part's rows into results/headline.json (a row keeps its measurement, link and sampling rule; its
    result, figures and runs are the new run's), its result file copied beside as headline_<part>.json. The ids of
    the rows written."""
    state = load_state(out)
    path = os.path.join(results, "headline.json")
    headline = json.load(open(path))
    by_id = {row["id"]: row for row in headline["rows"]}
    written = []
    for part in parts:
        if state.get(part.name, {}).get("status") != "done" or part.name not in ROW_BUILDERS:
            continue
        name, build = ROW_BUILDERS[part.name]
        dest = os.path.join(results, f"headline_{part.name}.json")
        shutil.copyfile(os.path.join(out, "parts", part.name, name), dest)
        for row in build(dest):
            by_id[row["id"]].update(row)
            written.append(row["id"])
    write_json(path, headline)
    return written


def collect(out: str, parts: list[Part]) -> dict:
    """Every done part's collected figures, with the part's GPU and commit, under out/headline_parts.json."""
    state, found = load_state(out), {}
    for part in parts:
        st = state.get(part.name, {})
        if st.get("status") == "done" and part.name in COLLECTORS:
            found[part.name] = {"rows": list(part.rows), "gpu": st["gpu"],
                                **COLLECTORS[part.name](os.path.join(out, "parts", part.name))}
    write_json(os.path.join(out, "headline_parts.json"), found)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the run's folder (kept between calls: its state and parts)")
    ap.add_argument("--part", choices=[p.name for p in PARTS], help="this part (default: the next not done)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="a part is killed after this many seconds")
    ap.add_argument("--status", action="store_true")
    ap.add_argument("--collect", action="store_true")
    ap.add_argument("--write", metavar="RESULTS", help="with --collect: the collected rows into RESULTS/headline.json "
                                                       "(benchmarks/results), then python -m benchmarks headline_table")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    state = load_state(args.out)
    if args.status:
        for p in PARTS:
            st = state.get(p.name, {})
            print(f"{p.name:<11} {st.get('status', 'not run'):<10} {st.get('seconds', '-')!s:>7} s  "
                  f"(estimate {p.seconds} s; rows {', '.join(p.rows)})")
        return 0
    if args.collect:
        found = collect(args.out, PARTS)
        print(f"headline: collected {', '.join(found) or 'no part'} -> {args.out}/headline_parts.json")
        written = write_headline(args.out, args.write, PARTS) if args.write else []
        if args.write:
            print(f"headline: rows {', '.join(written) or 'none'} -> {args.write}/headline.json")
        return 0 if found or written else 1
    part = next((p for p in PARTS if p.name == args.part), None) if args.part else next_part(state, PARTS)
    if part is None:
        print("headline: every part is done; --collect gathers them")
        return 0
    gpu = card()
    print(f"headline: part {part.name} on {gpu[0]} ({gpu[1]:.0f} GiB), at most {args.budget_s:.0f} s", flush=True)
    state[part.name] = run_part(part, args.out, args.budget_s, gpu)
    save_state(args.out, state)
    print(f"headline: part {part.name} {state[part.name]['status']} in {state[part.name]['seconds']} s; "
          f"next: {getattr(next_part(state, PARTS), 'name', 'none (--collect)')}")
    return 0 if state[part.name]["status"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main())

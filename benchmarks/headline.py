"""`headline`: one run that re-measures the README's GPU headline rows at one commit, on the GPU that is lent, in
parts that each fit one device call.

    python -m benchmarks headline --out DIR             # the next part not yet done, killed after --budget-s (540)
    python -m benchmarks headline --out DIR --part P    # part P (again)
    python -m benchmarks headline --out DIR --status    # the parts, done or not, and their seconds
    python -m benchmarks headline --out DIR --collect   # DIR/headline_parts.json: each done part's figures

Each part is one scenario run (PARTS) writing only under DIR/parts/P, which is emptied when the part starts; its
outcome goes to DIR/state.json when it ends. A part that did not end (a machine taken back, the time limit) is not
done, and the next call runs it again from its start: so the run resumes after a lost machine, part by part.
Servers side by side get `--mem-fraction-static` sized from the card's memory (`mem_fraction`), so one plan
starts on an H100 (80 GB) as on an H200 (141 GB). Every figure is the median of the part's repeats (≥ 3) with
their min and max, and the row names the commit and the GPU its part ran on; the lab pair's row has plain
decoding's tokens/s beside the speculative servers'.

Collected so far: the step cost at Qwen3-8B geometry (part step_cost) and the lab pair's and the served trees'
tokens/s and τ (part pair); the other parts run and keep their results uncollected. Not done yet: turning
headline_parts.json into benchmarks/results/headline.json's rows (until then the README's rows stay the earlier
runs', marked stale). Not run on a GPU yet: the seconds in PARTS are estimates, and so is the memory sizing.
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
         [os.path.join("scripts", "device", "serve_step_cost.py"), "--models", os.path.join("models", "default"),
          "--out", "{out}", "--servers", "plain,dflash,dspine,dspine_tree32,dspine_tree64",
          "--repeats", str(REPEATS), "--mem-fraction", "{mem}"]),
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
    tmp = os.path.join(out, "state.json.tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, os.path.join(out, "state.json"))  # a machine lost mid-write leaves the previous state


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


def collect(out: str, parts: list[Part]) -> dict:
    """Every done part's collected figures, with the part's GPU and commit, under out/headline_parts.json."""
    state, found = load_state(out), {}
    for part in parts:
        st = state.get(part.name, {})
        if st.get("status") == "done" and part.name in COLLECTORS:
            found[part.name] = {"rows": list(part.rows), "gpu": st["gpu"],
                                **COLLECTORS[part.name](os.path.join(out, "parts", part.name))}
    with open(os.path.join(out, "headline_parts.json"), "w") as f:
        json.dump(found, f, indent=1)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the run's folder (kept between calls: its state and parts)")
    ap.add_argument("--part", choices=[p.name for p in PARTS], help="this part (default: the next not done)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="a part is killed after this many seconds")
    ap.add_argument("--status", action="store_true")
    ap.add_argument("--collect", action="store_true")
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
        return 0 if found else 1
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

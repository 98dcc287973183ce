"""Adaptive verification (SGLANG_DSPINE_VERIFY=adaptive) against fixed servers, each server alone on the GPU.

Phases (`--phases`, in order; each server's cell is written to the JSON as soon as it is measured, and a rerun
with the same --out skips the servers already there, so a lost machine loses one server's work at most):
  pair      the built-in pair (or --models): plain, DFLASH, DSPINE at the block, the trees of 32 and 64
            (`dspine_tree32`, `dspine_tree64`), DSPINE adaptive (also with a tree in its menu:
            `dspine_adaptive_tree32`, `dspine_adaptive_tree64`), each DSPINE server
            again under SGLANG_DSPINE_SPLITKV_VERIFY=1 (`_splitkv`), =grouped (`_grouped`, patch 10, the default
            since a69f10b; a tree's too since the lease at 671b819, so `dspine_tree32` before it is the extend
            kernel's, `dspine_tree32_extend` after) and =0 (`_extend`, SGLang's extend kernel) and each adaptive
            one under =below-block (`_below_block`), each alone;
            before the cells, `--warm-rounds` untimed rounds at each T=0 client count, largest first, so that an
            adaptive policy has learned every batch bucket's shapes (a long-running server learns them once; the
            pair's rounds are short, and at 84ba46f, before this, learning took ~30% of its steps at 48 clients;
            0: as then);
            T=0 at --clients, `--repeats` rounds a cell (median, min, max tokens/s; τ), T=1 at 1 and 48; the
            adaptive server's shape counts per cell (its log lines); greedy outputs (24 prompts, 8 clients)
            against plain.
  geometry  Qwen3-8B geometry, random weights (--load-format dummy): plain, DSPINE at the block and adaptive
            (each also `_splitkv`, adaptive also `_below_block`; plain, DSPINE and adaptive also on SGLang's
            `_fa3` and `_flashinfer` attention backends, sampling still pytorch), and adaptive with the tree of 32
            or of 64 in its menu (its table times the tree too)
            alone; tokens/s per client count, and the adaptive servers' own step-time
            tables per (batch bucket, shape), which their policies measured online (every shape is run a few
            times per bucket before it decides); projected tokens/s with the pair's acceptance per width.
  switching the built-in pair: plain and an adaptive server side by side; while a background load on the
            adaptive server cycles 1 / 48 / 4 / 64 / 16 clients (so its policy switches shapes), greedy answers
            against plain (near-tie gaps) and the T=1 two-sample test (serve_e2e's); then a load ramp
            1 -> 64 -> 1 clients (--ramp-seconds a level): requests, errors and the shapes chosen per level, from
            SGLang's decode log lines (patch 7's suffix).
  pair_starts  the built-in pair again, each of --start-servers started --starts times (default fixed DSPINE and
            adaptive, 3 starts each), the starts interleaved (start i runs the servers in an order rotated by i, so
            no server always runs first or last), each start alone with its warm rounds and --start-repeats rounds
            per T=0 client count: on this host-bound pair a server's speed differs between two starts of it by
            15-62% (5a5e0e7), more than these servers differ, so one start per server cannot judge them. The
            summary's `pair_starts`: per server and client count the median over starts (min-max), and adaptive /
            fixed per start index (two starts near in time).
  profile   (with geometry) SGLang's profiler over 20 steps at 1 and 48 clients, adaptive and plain: GPU kernel
            time per step (each kernel's) against the wall time per step, and 40 steps of 12-token requests at 1
            client (prefills among them); the traces kept in $PROFILE_TRACES (else $OUT/traces) for their timelines
            (benchmarks/step_timeline.py). `profile_pair`: the same on the built-in pair at 48 clients.
            `--profile-clients`: other client counts for either.
Writes $OUT/adaptive.json. Usage (GPU machine, repo root, after `source scripts/device/setup.sh`):
    python3 scripts/device/adaptive.py --out $OUT [--phases pair,geometry]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import shutil
import statistics
import sys
import threading
import time

from sglang_dspine.provenance import MEASURED_CODE, changed_files, provenance
from sglang_dspine.serving.sglang_patches import verify_shapes_in_log
from sglang_dspine.source_files import load_package

_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
load_package("benchmarks", os.path.join(_root, "benchmarks"))  # the repository root stays off sys.path
import default_rules  # noqa: E402 - this folder's decision rules (a script beside this one)

from benchmarks import servers as bench  # noqa: E402
from benchmarks import serving_scale as scale  # noqa: E402
from benchmarks.greedy_divergence import GREEDY_ASKED, pair_prompts  # noqa: E402
from benchmarks.headline import spread  # noqa: E402
from benchmarks.serve_e2e import greedy_agreement, load_test, max_gap, model_layout, t1_test  # noqa: E402

ADAPTIVE_ENV = {"SGLANG_DSPINE_VERIFY": "adaptive"}
# the trees of 32 and 64 (N - 1 nodes over the lattice; the drafter folder holds its tree calibration),
# served fixed and in the adaptive menu: (arguments, environment) per N
TREES = {n: (["--speculative-num-draft-tokens", str(n)], {"SGLANG_DSPINE_TREE": "1"}) for n in (32, 64)}
SPLIT_KV_ENV = {"SGLANG_DSPINE_SPLITKV_VERIFY": "1"}  # the chain verifies on SGLang's split-KV kernel (patch 8)
# the adaptive server's shapes narrower than the block on the split-KV kernel, the block on the extend kernel
BELOW_BLOCK_ENV = {"SGLANG_DSPINE_SPLITKV_VERIFY": "below-block"}
GROUPED_ENV = {"SGLANG_DSPINE_SPLITKV_VERIFY": "grouped"}  # every chain on DSPINE's grouped kernel (patch 10)
# SGLang's extend kernel, what DSPINE servers ran before the grouped kernel became the default (a69f10b)
EXTEND_ENV = {"SGLANG_DSPINE_SPLITKV_VERIFY": "0"}
# the context upkeep after a step narrower than the block replayed from its CUDA graphs (context_upkeep.py), not
# DFlash's eager writer (the default since 97513c7); `_eager_upkeep` (=0) is what runs up to 97513c7 named
UPKEEP_GRAPHS_ENV = {"SGLANG_DSPINE_UPKEEP_GRAPHS": "1"}
# SGLang's prefill delayer batching fresh admissions at any cap (the `admission` rule of default_rules.py)
ADMISSION_BATCHING_ARGS = ["--enable-prefill-delayer", "--prefill-delayer-queue-min-ratio", "0.09",
                           "--prefill-delayer-max-delay-ms", "100"]
# SGLang's own attention backends for the geometry's step table beside the scripts' triton (issue 57's 5(b))
OTHER_BACKENDS = ("fa3", "flashinfer")
# The geometry's servers keep 15% of the GPU beside the KV pool (--mem-fraction-static 0.85). A menu with the tree of
# 64 needs ~3.8 GB more of it: its verify graphs for 1-64 requests took 7.40 GB against the tree of 32's 3.65 GB, and
# at 61da15d (H100 80 GB) capturing the last shape's graphs ran out of memory at 60 requests. 0.80 gives it ~4 GB
# more, at ~9% of the KV pool's tokens (far more than 64 clients need; a step's cost does not depend on it).
GEOMETRY_MEM_FRACTION, TREE64_MEM_FRACTION = "0.85", "0.80"


def with_mem_fraction(args: list[str], fraction: str) -> list[str]:
    """`args` with --mem-fraction-static's value replaced by `fraction` (refused where it is absent)."""
    i = args.index("--mem-fraction-static")
    return [*args[:i + 1], fraction, *args[i + 2:]]


def tree_servers(dspine_args: list[str]) -> dict:
    """Per tree of TREES, fixed DSPINE serving it (`dspine_treeN`) and the adaptive server with it in its menu
    (`dspine_adaptive_treeN`), from fixed DSPINE's arguments."""
    out = {}
    for n, (args, env) in TREES.items():
        out[f"dspine_tree{n}"] = (dspine_args + args, env)
        out[f"dspine_adaptive_tree{n}"] = (dspine_args + args, {**ADAPTIVE_ENV, **env})
    return out


def geometry_servers(target: str, dspine: str) -> dict:
    """The Qwen3-8B geometry's servers (random weights, `target` config only, `dspine` the drafter's folder):
    name -> (arguments, environment)."""
    common = ["--load-format", "dummy", "--skip-tokenizer-init", "--mem-fraction-static", GEOMETRY_MEM_FRACTION,
              "--cuda-graph-max-bs-decode", "64", "--disable-prefill-cuda-graph"]
    servers = {"plain": (["--model-path", target, *common], None),
               "dspine": (bench.spec_args(target, "DSPINE", dspine, *common,
                                          "--speculative-draft-load-format", "safetensors"), None)}
    servers["dspine_adaptive"] = (servers["dspine"][0], ADAPTIVE_ENV)
    servers.update({n: (with_mem_fraction(a, TREE64_MEM_FRACTION) if n.endswith("tree64") else a, e)
                    for n, (a, e) in tree_servers(servers["dspine"][0]).items() if "adaptive" in n})
    return with_backends(with_split_kv(servers), ("plain", "dspine", "dspine_adaptive"))


def with_split_kv(servers: dict) -> dict:
    """`servers` plus each DSPINE server again under SGLANG_DSPINE_SPLITKV_VERIFY=1, named <name>_splitkv, =grouped
    (the default since a69f10b, said explicitly), named <name>_grouped, and =0 (SGLang's extend kernel), named
    <name>_extend, and each adaptive one under =below-block, named <name>_below_block, and with its context upkeep
    replayed from CUDA graphs (SGLANG_DSPINE_UPKEEP_GRAPHS=1), named <name>_upkeep_graphs."""
    extra = {f"{n}_{kind}": (a, {**(e or {}), **env}) for n, (a, e) in servers.items() if n.startswith("dspine")
             for kind, env in (("splitkv", SPLIT_KV_ENV), ("grouped", GROUPED_ENV), ("extend", EXTEND_ENV))}
    for kind, env in (("below_block", BELOW_BLOCK_ENV), ("upkeep_graphs", UPKEEP_GRAPHS_ENV)):
        extra.update({f"{n}_{kind}": (a, {**(e or {}), **env}) for n, (a, e) in servers.items()
                      if n.startswith("dspine_adaptive")})
    return {**servers, **extra}


def with_backends(servers: dict, names: tuple[str, ...]) -> dict:
    """`servers` plus each of `names` again on each of OTHER_BACKENDS, named <name>_<backend> (the flag appended:
    the last --attention-backend wins over the harness's triton)."""
    extra = {f"{n}_{b}": (servers[n][0] + ["--attention-backend", b], servers[n][1]) for n in names
             for b in OTHER_BACKENDS}
    return {**servers, **extra}


POLICY_LINE = re.compile(r"DSPINE adaptive verify: steps by shape since start: (.*?); policy (\{.*\})")


def policy_state(server) -> tuple[dict, dict]:
    """(steps per shape since start, the policy's last summary) from the adaptive server's last log line."""
    lines = POLICY_LINE.findall(server.text())
    if not lines:
        return {}, {}
    counts, summary = lines[-1]
    return {k: int(v) for k, v in (c.rsplit(" ", 1) for c in counts.split(", "))}, json.loads(summary)


def switching(server, plain, prompts, args) -> dict:
    """Lossless while switching, then the ramp (the module docstring's `switching` phase)."""
    rec, stop = {}, threading.Event()
    cycle = []

    def varying_load():
        while not stop.is_set():
            for c in (1, 48, 4, 64, 16):
                if stop.is_set():
                    break
                cycle.append(load_test(server, c, 6))

    start = len(server.text())
    background = threading.Thread(target=varying_load, daemon=True)
    background.start()
    try:
        with cf.ThreadPoolExecutor(16) as pool:
            rec["greedy"] = greedy_agreement(plain, server, prompts[:GREEDY_ASKED], args.max_new, pool,
                                             keep_answers=True)  # judged in float32 by --merge
            print("switching: greedy", rec["greedy"].get("identical"), "/", GREEDY_ASKED, flush=True)
            rec["t1"] = t1_test(plain, server, prompts[:3], args.t1_samples, pool)
            print("switching: t1 p", rec["t1"]["bonferroni_min_pvalue"], flush=True)
    finally:
        stop.set()
        background.join()
    rec["background_load"] = {"levels": len(cycle), "requests": sum(r["requests"] for r in cycle),
                              "errors": sum(r["errors"] for r in cycle)}
    rec["shapes_during_tests"] = verify_shapes_in_log(server.text()[start:])
    ramp = []
    for c in (1, 4, 16, 48, 64, 48, 16, 4, 1):
        start = len(server.text())
        level = load_test(server, c, args.ramp_seconds)
        level["shapes"] = verify_shapes_in_log(server.text()[start:])
        ramp.append(level)
        print("ramp", c, level["requests"], "errors", level["errors"], level["shapes"], flush=True)
    rec["ramp"] = ramp
    rec["ramp_errors"] = sum(r["errors"] + r["lost"] for r in ramp)
    return rec


def cell(rounds: list[dict]) -> dict:
    tps = [r["tokens_per_s"] for r in rounds]
    taus = [r["tau"] for r in rounds if r.get("tau")]
    return {"tokens_per_s": {"median": statistics.median(tps), "min": min(tps), "max": max(tps), "all": tps},
            "tau": statistics.median(taus) if taus else None,
            "step_ms": statistics.median([r["step_ms"] for r in rounds if r.get("step_ms")] or [None])
            if any(r.get("step_ms") for r in rounds) else None}


def measure_server(name, server, prompts, clients, t1_clients, repeats, max_new, warm_rounds=0):
    """One server alone: `warm_rounds` untimed rounds at each client count (largest first: an adaptive policy
    learns each bucket's shapes there, as a long-running server would have), greedy answers, then per client
    count `repeats` rounds at T=0 (and T=1 at `t1_clients`), with the adaptive server's steps per shape."""
    rec = {"memory": server.memory(), "t0": {}, "t1": {}, "warm_rounds": warm_rounds}
    bench.wave_round(server, prompts, 8, 16)  # warm-up
    before = policy_state(server)[0]
    for c in sorted(clients, reverse=True) * warm_rounds:
        bench.wave_round(server, prompts, c, max_new)
    after = policy_state(server)[0]
    if after:
        rec["warm_up_shapes"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    # greedy answers to compare with plain decoding's: the first GREEDY_ASKED prompts, 8 at a time (the adaptive
    # server switches); benchmarks/greedy_divergence.py judges them
    rec["greedy_ids"] = [o["output_ids"] for o in
                         bench.wave_round(server, prompts, 8, max_new, 0.0, requests=GREEDY_ASKED)[1]]
    for temp, cs, key in ((0.0, clients, "t0"), (1.0, t1_clients, "t1")):
        for c in cs:
            before, log_start = policy_state(server)[0], len(server.text())
            rounds = [bench.wave_round(server, prompts, c, max_new, temp)[0] for _ in range(repeats)]
            rec[key][str(c)] = cell(rounds)
            # steady decoding alone (no prefill, queueing or request gaps): the like-for-like step beside the
            # adaptive servers' own step tables, which time decode steps alone
            rec[key][str(c)]["decode_ms_per_token"] = bench.decode_ms_per_token(server.text()[log_start:], c)
            after, summary = policy_state(server)
            if after:
                rec[key][str(c)]["shapes"] = {k: v - before.get(k, 0) for k, v in after.items()
                                              if v - before.get(k, 0)}
                rec[key][str(c)]["policy"] = summary
            print(name, key, c, {k: rec[key][str(c)][k] for k in ("tau",)},
                  round(rec[key][str(c)]["tokens_per_s"]["median"], 1), rec[key][str(c)].get("shapes"), flush=True)
    return rec


def started_server(started: list, name: str, port: int, entry: tuple, out: str) -> bench.Server:
    """`bench.Server` for a server table's entry (its arguments, its environment), appended to `started`."""
    args_, env = entry
    server = bench.Server(name, port, args_, out, env=env)
    started.append(server)
    return server


def traces_dir(out: str) -> str:
    """Where the profiles' traces are kept: $PROFILE_TRACES (a job keeps them outside its $OUT: tens of MiB each),
    else out/traces."""
    return os.environ.get("PROFILE_TRACES") or os.path.join(out, "traces")


def profile_cell(server, prompts, clients: int, out: str) -> dict:
    """One server's profile at `clients`: wall per step of a measured round, then SGLang's profiler over 20 steps of
    a steady load (GPU time per step and per kernel; the trace kept in `traces_dir` for its timeline). The load's
    requests outlast the profile: 2048 tokens at 1 client (~14 s), 1024 at 48 (~9 s; 48 x 1.5k tokens fit)."""
    wall = bench.wave_round(server, prompts, clients, 128)[0]
    start = len(server.text())
    prof = scale.profile(server, prompts, clients, 20, "/tmp/prof", 2048 if clients == 1 else 1024,
                         keep=traces_dir(out))
    return {"wall_ms_per_step": 1000 * wall["seconds"] * clients / wall["output_tokens"],
            # the adaptive server's shapes around the profiled steps (981bdc8: the profiler's slower steps made the
            # policy explore the chains inside the window, so a window is not `none` alone)
            "shapes_in_window": verify_shapes_in_log(server.text()[start:]),
            "gpu_us_per_step": prof.get("gpu_us_per_step"), "running": prof.get("running_requests_in_log"),
            "kernels_us_per_step": {k: v["us_per_step"] for k, v in prof.get("kernels", {}).items()},
            "trace": prof.get("kept_trace"), "error": prof.get("error")}


def boundary_profile(server, prompts, out: str, steps: int = 40, max_new: int = 12) -> dict:
    """Requests' boundaries at 1 client: `max_new`-token requests one after another while SGLang's profiler records
    `steps` forward steps, so the trace holds prefills and the decode steps around them (kept in `traces_dir`)."""
    stop, sent, errors = threading.Event(), [], []

    def one_after_another():
        while not stop.is_set():
            try:
                server.generate_ids(prompts[len(sent) % len(prompts)], max_new, 0.0)
                sent.append(1)
            except Exception as e:  # noqa: BLE001 - counted and reported; the load goes on
                errors.append(repr(e)[:200])
                time.sleep(0.5)

    t = threading.Thread(target=one_after_another, daemon=True)
    start = len(server.text())
    t.start()
    d = os.path.join("/tmp/prof", f"{server.name}_boundary")
    try:
        time.sleep(2.0)
        server.profile(d, steps)
        result = scale.wait_for_trace(d, 120)
    finally:
        stop.set()
        t.join(timeout=60)
    if result is None:
        return {"error": "no trace written", "requests": len(sent), "request_errors": errors[:3]}
    kept = scale.keep_trace(d, result, traces_dir(out), f"{server.name}_boundary")
    shutil.rmtree(d, ignore_errors=True)
    return {"requests": len(sent), "request_errors": errors[:3], "trace": kept,
            "shapes_in_window": verify_shapes_in_log(server.text()[start:]),
            "gpu_us_per_step": sum(v["us"] for v in result["kernels"].values()) / steps}


def profile_servers(res, key, servers, prompts, clients, out, out_path, names=("dspine_adaptive", "plain")) -> None:
    """SGLang's profiler on each of `names` (`servers`' entries: by default the adaptive server and plain decoding),
    each alone: per client count `profile_cell`, then `boundary_profile`; into res[key][name], the JSON written
    after each server."""
    for name in names:
        if name in res.setdefault(key, {}):
            continue
        tag = f"prof_{key[len('profile'):].lstrip('_') or 'geometry'}_{name}"
        server = bench.Server(tag, 34001, servers[name][0], out,
                              env={**(servers[name][1] or {}), "SGLANG_TORCH_PROFILER_DIR": "/tmp/prof"})
        try:
            if server.wait(600):
                res[key][name] = {str(c): profile_cell(server, prompts, c, out) for c in clients}
                res[key][name]["boundary_c1"] = boundary_profile(server, prompts, out)
                print(key, name, json.dumps(res[key][name])[:1500], flush=True)
        finally:
            server.stop()
            os.replace(server.log, os.path.join(out, f"server_{tag}.log"))
        json.dump(res, open(out_path, "w"), indent=1)


def run_alone(res, phase, name, args_, env, prompts, args, out_path, timeout=600, run=None):
    """Server `name` alone: started, measured into res[phase][name], stopped; the run (`run`, else `res`) written to
    `out_path` after it."""
    if name in res.setdefault(phase, {}):
        print(f"{phase}/{name}: already measured, skipped", flush=True)
        return
    server = bench.Server(name, 34000, args_, args.out, env=env)
    try:
        rec = server.start_record(timeout=timeout)
        if rec["up"]:
            rec.update(measure_server(name, server, prompts, args.clients, args.t1_clients if phase == "pair" else [],
                                      args.repeats, args.max_new, args.warm_rounds))
            counts, summary = policy_state(server)
            if counts:
                rec["shapes_total"], rec["policy_last"] = counts, summary
        res[phase][name] = rec
    finally:
        server.stop()
        os.replace(server.log, os.path.join(args.out, f"server_{phase}_{name}.log"))
    json.dump(res if run is None else run, open(out_path, "w"), indent=1)


def start_order(names: list[str], start: int) -> list[str]:
    """The order of the servers in start `start` of the pair_starts phase: `names` rotated by `start`."""
    k = start % len(names)
    return names[k:] + names[:k]


def run_starts(res, servers, prompts, args, out_path) -> None:
    """The pair_starts phase: res["pair_starts"]["start<i>"][server], each cell as the pair phase's (T=0 only)."""
    names = [n for n in args.start_servers.split(",") if n]
    once = argparse.Namespace(**{**vars(args), "repeats": args.start_repeats, "t1_clients": []})
    starts = res.setdefault("pair_starts", {})
    for i in range(args.starts):
        for name in start_order(names, i):
            run_alone(starts, f"start{i}", name, *servers[name], prompts, once, out_path, run=res)


def starts_summary(starts: dict, adaptive: str = "dspine_adaptive", fixed: str = "dspine") -> dict:
    """Per server and T=0 client count, the median over starts of each start's tokens/s (min, max, n); and per
    client count adaptive / fixed in each start where both ran (median, min, max, n)."""
    per: dict[str, dict[str, list[float]]] = {}
    ratios: dict[str, list[float]] = {}
    for start in starts.values():
        for name, rec in start.items():
            for c, v in rec.get("t0", {}).items():
                per.setdefault(name, {}).setdefault(c, []).append(v["tokens_per_s"]["median"])
        a, f = start.get(adaptive, {}).get("t0", {}), start.get(fixed, {}).get("t0", {})
        for c in a.keys() & f.keys():
            ratios.setdefault(c, []).append(a[c]["tokens_per_s"]["median"] / f[c]["tokens_per_s"]["median"])
    by_clients = lambda d: sorted(d, key=int)  # noqa: E731
    return {"starts": len(starts),
            "tokens_per_s": {n: {c: spread(cs[c], 1) for c in by_clients(cs)} for n, cs in per.items()},
            f"{adaptive}_to_{fixed}": {c: spread(ratios[c], 3) for c in by_clients(ratios)}}


class RunMismatch(SystemExit):
    """An earlier run's JSON that this run must not add cells to."""


def continued_provenance(res: dict, now: dict, path: str) -> dict:
    """This run's provenance, for a JSON that may hold an earlier run's cells (a lease that continues another's,
    or another call of the same lease). Its cells stay only where they describe what this run measures: the same
    GPU, the same SGLang, torch and Triton, and the same commit or at least the same measured code (`measured_code`,
    a digest: the GPU machine has no git). The earlier provenances are kept under `continues`, so no cell is
    credited to a commit it did not run."""
    before = res.get("provenance")
    if not before:
        return now
    if before.get("gpu") != now.get("gpu"):
        raise RunMismatch(f"adaptive.py: {path} was measured on {before.get('gpu')!r}, this run is on "
                          f"{now.get('gpu')!r}: numbers from two cards do not go in one run (use another --out)")
    stack = lambda p: {k: (p.get("versions") or {}).get(k) for k in ("sglang", "torch", "triton")}  # noqa: E731
    if stack(before) != stack(now):
        raise RunMismatch(f"adaptive.py: {path} was measured with {stack(before)}, this run has {stack(now)}: "
                          "numbers from two software stacks do not go in one run (use another --out)")
    same_code = before.get("measured_code") == now.get("measured_code") if before.get("measured_code") else \
        before.get("commit") == now.get("commit")  # a run from before the digest: only its own commit
    if not same_code:
        raise RunMismatch(f"adaptive.py: {path} was measured at {before.get('commit')} (code "
                          f"{before.get('measured_code') or 'not recorded'}), this run is at {now.get('commit')} (code "
                          f"{now.get('measured_code')}): the measured code differs (use another --out)")
    earlier = before.get("continues", [])
    if before.get("commit") != now.get("commit"):  # (another call of the same lease adds nothing)
        earlier = [*earlier, {k: v for k, v in before.items() if k != "continues"}]
    return {**now, **({"continues": earlier} if earlier else {})}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--models", default=os.path.join(_root, "models", "default"))
    ap.add_argument("--phases", default="pair,geometry")
    ap.add_argument("--pair-servers", default="plain,dspine_adaptive,dspine,dflash,dspine_tree32,"
                                              "dspine_adaptive_tree32,dspine_splitkv,dspine_adaptive_splitkv")
    ap.add_argument("--geometry-servers", default="plain,dspine_adaptive,dspine,dspine_splitkv,"
                                                  "dspine_adaptive_splitkv,dspine_adaptive_tree32")
    ap.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",") if c], default=[1, 4, 16, 48, 64])
    ap.add_argument("--t1-clients", type=lambda s: [int(c) for c in s.split(",") if c], default=[1, 48])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warm-rounds", type=int, default=1, help="untimed rounds at each client count before a "
                    "server's cells (every server alike; 0: none, as before 2026-12-07's stop 71)")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--switching-server", default="dspine_adaptive", help="the pair's adaptive server the "
                    "switching phase checks (dspine_adaptive, or its _splitkv or _below_block variant)")
    ap.add_argument("--profile-servers", type=lambda s: tuple(filter(None, s.split(","))),
                    default=("dspine_adaptive", "plain"),
                    help="the servers the profile phases profile, in order (e.g. dspine_adaptive,dspine,plain)")
    ap.add_argument("--profile-clients", type=lambda s: tuple(int(c) for c in s.split(",") if c), default=None,
                    help="the client counts the profile phases profile (default: 1,48 at the geometry, 48 on the "
                         "pair)")
    ap.add_argument("--starts", type=int, default=3, help="pair_starts: starts of each server")
    ap.add_argument("--start-servers", default="dspine,dspine_adaptive", help="pair_starts: the servers started")
    ap.add_argument("--start-repeats", type=int, default=1, help="pair_starts: timed rounds a client count a start")
    ap.add_argument("--t1-samples", type=int, default=300)
    ap.add_argument("--ramp-seconds", type=int, default=15)
    ap.add_argument("--merge", nargs="+", metavar="ADAPTIVE_JSON",
                    help="no GPU: merge these runs' phases (later files win) and write the summary to "
                         "--out/adaptive_summary.json")
    ap.add_argument("--across-code-changes", action="store_true",
                    help="with --merge: merge runs whose measured code differs (the summary lists what changed)")
    args = ap.parse_args()
    if args.merge:
        return merge(args.merge, args.out, args.models, args.across_code_changes)
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "adaptive.json")
    res = json.load(open(out_path)) if os.path.exists(out_path) else {}
    res["provenance"] = continued_provenance(res, provenance(sys.argv), out_path)
    phases = args.phases.split(",")
    if {"pair", "switching", "profile_pair", "pair_starts"} & set(phases):
        models = model_layout(args.models)
        target, prompts = pair_prompts(models)
        spec = lambda algo, d: bench.spec_args(target, algo, os.path.join(models, d), *bench.ADAPTIVE_PAIR_ARGS)
        cap128 = spec("DSPINE", "dspine") + ["--max-running-requests", "128"]  # the adaptive server's cap, fixed
        servers = {"plain": (["--model-path", target, *bench.ADAPTIVE_PAIR_ARGS], None),
                   "dflash": (spec("DFLASH", "dflash"), None),
                   "dspine": (spec("DSPINE", "dspine"), None), "dspine_adaptive": (spec("DSPINE", "dspine"),
                                                                                  ADAPTIVE_ENV),
                   **tree_servers(spec("DSPINE", "dspine")),
                   # where the adaptive server's time goes on the host-bound pair (84ba46f: 0.55-0.97x fixed): its
                   # step with a menu of the block and chain15 (the policy's bookkeeping and the adaptive step's
                   # work, with shapes that cost and carry about the same: a menu of the block alone runs the fixed
                   # step), and fixed DSPINE with the adaptive server's cap of running requests
                   "dspine_adaptive_wide": (spec("DSPINE", "dspine"), {**ADAPTIVE_ENV, "SGLANG_DSPINE_SHAPES": "15"}),
                   "dspine_cap128": (cap128, None),
                   # 671b819: the cap of 128 alone cost fixed DSPINE 0.87 / 0.86x at 1 / 16 clients, where it is
                   # never reached; the same cap with the cap of 48's graphs (none captured above 48 requests)
                   "dspine_cap128_graphs48": (cap128 + ["--cuda-graph-max-bs-decode", "48"], None),
                   # the cap of 128 with admissions batched as a full cap of 48 batches them (SGLang's
                   # MinFreeSlotsDelayer: 4 at a time), by SGLang's own prefill delayer: a fresh prefill waits
                   # until int(0.09 x running) requests queue (4 at 48 running, none below 12), 100 ms at most
                   "dspine_cap128_delayed": (cap128 + ADMISSION_BATCHING_ARGS, None)}
        servers = with_split_kv(servers)
        for name in filter(None, args.pair_servers.split(",")) if "pair" in phases else ():
            run_alone(res, "pair", name, *servers[name], prompts, args, out_path)
        if "pair_starts" in phases:
            run_starts(res, servers, prompts, args, out_path)
        if "profile_pair" in phases:  # the small pair's step is the host's: 48 clients unless told, a boundary
            profile_servers(res, "profile_pair", servers, prompts, args.profile_clients or (48,), args.out, out_path,
                            args.profile_servers)
        if "switching" in phases and "switching" not in res:
            name = args.switching_server
            started = []  # each server stopped however the phase ends: a leaked one holds its GPU memory
            try:
                base = started_server(started, "switch_plain", 34010, servers["plain"], args.out)
                adaptive = started_server(started, name, 34011, servers[name], args.out)
                if base.wait(600) and adaptive.wait(600):
                    bench.wave_round(adaptive, prompts, 8, 16)  # warm-up
                    res["switching"] = {"server": name, **switching(adaptive, base, prompts, args)}
                else:
                    res["switching"] = {"server": name, "error": "a server did not start"}
            finally:
                for server in started:
                    server.stop()
            json.dump(res, open(out_path, "w"), indent=1)
    if "geometry" in phases:
        work = "/tmp/adaptive_geometry"
        target = scale.write_target(work, scale.GEOMETRIES["qwen3-8b"])
        drafters = scale.write_drafters(work, scale.GEOMETRIES["qwen3-8b"], scale.DRAFTER, "cuda")
        prompts = scale.random_prompts(64, 512, scale.GEOMETRIES["qwen3-8b"]["vocab_size"])
        servers = geometry_servers(target, drafters["dspine"])
        for name in filter(None, args.geometry_servers.split(",")):
            run_alone(res, "geometry", name, *servers[name], prompts, args, out_path)
        if "profile" in phases:  # where a step's time goes: 1 and 48 clients, a request's boundary
            profile_servers(res, "profile", servers, prompts, args.profile_clients or (1, 48), args.out, out_path,
                            args.profile_servers)
    res["summary"] = summarize(res)
    json.dump(res, open(out_path, "w"), indent=1)
    print(json.dumps(res["summary"], indent=1))


def code_changes(provenances: list[dict]) -> dict[str, list[str] | None]:
    """For runs to be merged: the measured code's files that changed from each run's commit to the last run's
    (git on this machine), {} where the digests say it is the same code; None where git cannot tell."""
    last = provenances[-1]
    out = {}
    for p in provenances[:-1]:
        if p.get("measured_code") and p.get("measured_code") == last.get("measured_code"):
            continue
        if p.get("commit") != last.get("commit"):
            changed = changed_files(str(p.get("commit")), str(last.get("commit")), MEASURED_CODE)
            if changed != []:
                out[str(p.get("commit"))] = changed
    return out


# a run's phases that hold one record per server (or per start): --merge takes each server's from the later run
PER_SERVER_PHASES = ("pair", "geometry", "profile", "profile_pair", "pair_starts")


def merge(paths: list[str], out: str, models: str | None = None, across_code_changes: bool = False) -> None:
    """The phases of several runs in one summary (`summarize`), with each run's provenance and the GPU it names;
    with `models` (the pair's folder) each greedy divergence from plain decoding judged by the float32 target
    on this machine's CPU (benchmarks/greedy_divergence.py: near-tie or not). Runs from two GPUs are refused;
    runs whose measured code differs only with `across_code_changes` (the summary then lists the changes)."""
    loaded = [json.load(open(p)) for p in paths]
    provenances = [r.get("provenance") or {} for r in loaded]
    gpus = sorted({str(p.get("gpu")) for p in provenances})
    if len(gpus) > 1:
        raise RunMismatch(f"adaptive.py --merge: the runs were measured on {', '.join(gpus)}: one card a summary")
    changes = code_changes(provenances)
    if changes and not across_code_changes:
        raise RunMismatch("adaptive.py --merge: the measured code changed between the runs ("
                          + "; ".join(f"since {c}: {', '.join(f or ['git cannot tell'])}" for c, f in changes.items())
                          + "); pass --across-code-changes to merge them anyway, recorded in the summary")
    res, runs = {}, []
    for p, r in zip(paths, loaded):
        phases = [k for k in (*PER_SERVER_PHASES, "switching") if k in r]
        # a run is named by its file (a kept run: benchmarks/results/adaptive_run_*.json), or for a job's
        # $OUT/adaptive.json by the job's folder
        name = os.path.splitext(os.path.basename(p))[0]
        runs.append({"file": name if name != "adaptive" else os.path.basename(os.path.dirname(os.path.dirname(p))) or p,
                     "provenance": r.get("provenance"), "phases": phases})
        for phase in PER_SERVER_PHASES:
            res.setdefault(phase, {}).update(r.get(phase, {}))
        if "switching" in r:  # one server's record, not one per server: the later run's
            res["switching"] = r["switching"]
    summary = summarize(res)
    if models:  # the float32 target judges every greedy divergence (torch and the model only then)
        from benchmarks.greedy_divergence import judge_pair

        if res.get("pair", {}).get("plain", {}).get("greedy_ids"):
            summary["greedy_divergences_fp32"] = judge_pair(res["pair"], models)
        answers = (res.get("switching") or {}).get("greedy", {}).get("answers")
        if answers and "switching" in summary:  # the switching server's answers under load (since 2026-12-06)
            under_load = {"plain": {"greedy_ids": answers["base"]}, "switching": {"greedy_ids": answers["spec"]}}
            summary["switching"]["greedy_divergences_fp32"] = judge_pair(under_load, models)["switching"]
    pair = {n: {k: v for k, v in rec.items() if k != "greedy_ids"} for n, rec in res.get("pair", {}).items()}
    geo = res.get("geometry", {})
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "adaptive_summary.json")
    # the top-level keys: the GPU (one: checked above) and every commit measured
    # a run that continued an earlier lease's keeps that lease's provenance under `continues`: its commit counts too
    every = [q for r in runs for p in [r.get("provenance") or {}] for q in (p, *p.get("continues", []))]
    named = {k: ", ".join(sorted({str(p.get(k, "?")) for p in every})) for k in ("gpu", "commit")}
    summary["goals"] = goals(summary, res.get("switching"))
    json.dump({**named, **summary, "runs": runs, **({"measured_code_changed_since": changes} if changes else {}),
               "pair_cells": pair, "geometry_cells": geo}, open(path, "w"), indent=1)
    for g in summary["goals"]:
        print(f"goal {g['goal']}: {g['verdict']} ({g['detail']})")
    print(f"wrote {path}")
    plot(summary, os.path.join(out, "adaptive_tokens_per_s.png"), named)


def goals(summary: dict, switching_run: dict | None) -> list[dict]:
    """Issue 57's goals judged on a merged summary (and the switching phase's record as the run holds it), each
    {goal, verdict: met / not met / not measured, detail}:
      - pair_best_fixed: on the pair at T=0, adaptive >= 0.97x the best of plain, DSPINE at the block and the tree
        of 32 at every client count measured;
      - pair_where_plain_wins: wherever plain beats DSPINE at the block there, adaptive >= 1.10x DSPINE at the block;
      - geometry_* (per acceptance source, for adaptive and, where projected, adaptive with the tree in its menu):
        adaptive >= max(plain, DSPINE at the block) at every client count; >= 1.15x DSPINE at the block at 1
        client; >= plain at 48 and 64;
      - lossless_switching: under the varying load the T=1 test passes and every greedy divergence is a near-tie
        (default_rules.switching_lossless), and the ramp had 0 errors;
      - memory: each adaptive server at the geometry loses <= 3% of fixed DSPINE's KV-cache tokens
        (`geometry_memory`)."""
    out = []

    def judge(goal: str, cells: dict[str, tuple[float, float]], need: float, missing: bool = False) -> None:
        """cells: where -> (value, bar); met where value >= need x bar everywhere."""
        if missing or not cells:
            out.append({"goal": goal, "verdict": "not measured", "detail": "no cells"})
            return
        ratios = {k: round(v / b, 3) for k, (v, b) in cells.items()}
        met = all(r >= need for r in ratios.values())
        out.append({"goal": goal, "verdict": "met" if met else "not met",
                    "detail": f">= {need}x: " + ", ".join(f"{k} {r}" for k, r in ratios.items())})

    e2e = {c: row for c, row in summary.get("end_to_end", {}).items() if c.isdigit() and "dspine_adaptive" in row}
    med = lambda row, n: row[n]["tokens_per_s"]["median"]
    best = {c: max(med(row, n) for n in ("plain", "dspine", "dspine_tree32") if n in row) for c, row in e2e.items()
            if any(n in row for n in ("plain", "dspine", "dspine_tree32"))}
    judge("pair_best_fixed", {c: (med(e2e[c], "dspine_adaptive"), b) for c, b in best.items()}, 0.97)
    plain_wins = {c: (med(row, "dspine_adaptive"), med(row, "dspine")) for c, row in e2e.items()
                  if "plain" in row and "dspine" in row and med(row, "plain") > med(row, "dspine")}
    if plain_wins or not e2e:
        judge("pair_where_plain_wins", plain_wins, 1.10)
    else:
        out.append({"goal": "pair_where_plain_wins", "verdict": "met", "detail": "DSPINE at the block beats plain "
                    "at every client count measured"})
    for key in PROJECTIONS:
        proj = summary.get(key) or {}
        for adaptive in ("dspine_adaptive", "dspine_adaptive_tree32", "dspine_adaptive_tree32_grouped",
                         "dspine_adaptive_tree64"):
            cells = {c: row for c, row in proj.items() if adaptive in row and "dspine" in row and "plain" in row}
            if adaptive != "dspine_adaptive" and not cells:  # a tree server that did not run
                continue
            tag = f"{key}/{adaptive}"
            judge(f"{tag}: >= max(plain, block)",
                  {c: (r[adaptive], max(r["plain"], r["dspine"])) for c, r in cells.items()}, 1.0)
            judge(f"{tag}: >= 1.15x block at 1 client",
                  {c: (r[adaptive], r["dspine"]) for c, r in cells.items() if c == "1"}, 1.15)
            judge(f"{tag}: >= plain at 48 and 64",
                  {c: (r[adaptive], r["plain"]) for c, r in cells.items() if c in ("48", "64")}, 1.0,
                  missing=not {"48", "64"} <= set(cells))
    sw = summary.get("switching") or {}
    try:  # default_rules.py's lossless check (the T=1 test, every greedy divergence a near-tie), and the ramp
        lossless, why = default_rules.switching_lossless({"switching": switching_run}, summary)
        out.append({"goal": "lossless_switching", "verdict": "met" if lossless and sw.get("ramp_errors") == 0
                    else "not met", "detail": f"{sw.get('server')}: {why}; ramp errors {sw.get('ramp_errors')}"})
    except default_rules.Undecided as e:
        out.append({"goal": "lossless_switching", "verdict": "not measured", "detail": str(e)})
    memory = {n: m for n, m in (summary.get("geometry_memory") or {}).items() if m.get("kv_tokens_lost") is not None}
    if memory:
        lost = {n: m["kv_tokens_lost"] / (m["kv_tokens"] + m["kv_tokens_lost"]) for n, m in memory.items()}
        out.append({"goal": "memory", "verdict": "met" if all(v <= 0.03 for v in lost.values()) else "not met",
                    "detail": "KV tokens lost against fixed DSPINE (<= 3%): "
                              + ", ".join(f"{n} {v:.1%}" for n, v in lost.items())})
    else:
        out.append({"goal": "memory", "verdict": "not measured", "detail": "no adaptive server's memory beside "
                    "fixed DSPINE's at the geometry"})
    return out


PROJECTED = ("plain", "dflash", "dspine", "dspine_tree32", "dspine_tree32_grouped", "dspine_tree64", "dspine_splitkv",
             "dspine_adaptive", "dspine_adaptive_tree32", "dspine_adaptive_tree32_grouped", "dspine_adaptive_tree64",
             "dspine_adaptive_splitkv",
             "dspine_adaptive_below_block",
             "dspine_adaptive_below_block_composed",
             *(f"{n}_{b}" for b in OTHER_BACKENDS for n in ("plain", "dspine", "dspine_adaptive")))
PROJECTIONS = {"geometry_projection": "the pair's served acceptance", "geometry_projection_recipe_lab":
               "the recipe lab's acceptance"}


def plot(summary: dict, path: str, named: dict) -> None:
    """Tokens/s against clients, one line per server (median, min-max as error bars): the built-in pair end to
    end and, where measured, the Qwen3-8B geometry projection with each acceptance source (adaptive servers
    dashed: where one runs the block it lies on fixed DSPINE's line)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is missing (pip install '.[lab]')")
        return
    e2e = {int(c): row for c, row in summary.get("end_to_end", {}).items() if c.isdigit()}
    projs = {key: {int(c): row for c, row in summary[key].items()} for key in PROJECTIONS if summary.get(key)}
    fig, axes = plt.subplots(1, 1 + len(projs), figsize=(5.5 * (1 + len(projs)), 4.5), squeeze=False)
    order = ("plain", "dflash", "dspine", "dspine_tree32", "dspine_tree64", "dspine_splitkv", "dspine_adaptive",
             "dspine_adaptive_tree32", "dspine_adaptive_tree64", "dspine_adaptive_below_block")
    # one colour a server in every panel (matplotlib's ten-colour cycle, by the server's place in `order`)
    style = lambda name: {"marker": "o", "linestyle": "--" if "adaptive" in name else "-", "label": name,
                          "color": f"C{order.index(name) % 10}" if name in order else None}
    ax = axes[0][0]
    for name in order:
        cs = [c for c in sorted(e2e) if name in e2e[c]]
        if not cs:
            continue
        med = [e2e[c][name]["tokens_per_s"]["median"] for c in cs]
        lo = [m - e2e[c][name]["tokens_per_s"]["min"] for m, c in zip(med, cs)]
        hi = [e2e[c][name]["tokens_per_s"]["max"] - m for m, c in zip(med, cs)]
        ax.errorbar(cs, med, yerr=[lo, hi], capsize=3, **style(name))
    ax.set(xscale="log", yscale="log", xlabel="clients", ylabel="output tokens/s",
           title=f"built-in pair, T=0, each server alone\n{named['gpu']}, {named['commit']}, median of 3 (min-max)")
    ax.legend(fontsize=8)
    for ax, (key, proj) in zip(axes[0][1:], projs.items()):
        for name in PROJECTED:
            cs = [c for c in sorted(proj) if name in proj[c]]
            if cs:
                ax.plot(cs, [proj[c][name] for c in cs], **style(name))
        ax.set(xscale="log", yscale="log", xlabel="clients", ylabel="projected tokens/s",
               title=f"Qwen3-8B geometry: measured step times\n× {PROJECTIONS[key]} per shape")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def summarize(res: dict) -> dict:
    """The issue's shape: end_to_end[clients][server] = {tokens_per_s: {median, min, max}, tau, shapes};
    geometry step table per (bucket, shape) and the projection with the pair's acceptance."""
    e2e = {}
    for name, rec in res.get("pair", {}).items():
        for key, cells in (("t0", rec.get("t0", {})), ("t1", rec.get("t1", {}))):
            for c, v in cells.items():
                row = e2e.setdefault(c if key == "t0" else f"{c}_t1", {})
                row[name] = {"tokens_per_s": {k: round(v["tokens_per_s"][k], 1) for k in ("median", "min", "max")},
                             "tau": v["tau"], **({"shapes": v["shapes"]} if v.get("shapes") else {})}
    ref = res.get("pair", {}).get("plain", {}).get("greedy_ids")
    same = {n: [a == b for a, b in zip(r["greedy_ids"], ref)] for n, r in res.get("pair", {}).items()
            if ref and n != "plain" and r.get("greedy_ids")}
    out = {"end_to_end": e2e, "greedy_equal_to_plain": {n: f"{sum(v)}/{len(v)}" for n, v in same.items()}}
    if res.get("pair_starts"):
        out["pair_starts"] = starts_summary(res["pair_starts"])
    sw = res.get("switching")
    if sw and "ramp" in sw:
        out["switching"] = {"server": sw["server"], "greedy_identical": sw["greedy"].get("identical"),
                            "greedy_max_top2_gap": max_gap(sw["greedy"]),
                            "t1_bonferroni_min_pvalue": sw["t1"]["bonferroni_min_pvalue"],
                            "shapes_during_tests": sw["shapes_during_tests"], "ramp_errors": sw["ramp_errors"],
                            "ramp": [{"clients": r["clients"], "requests": r["requests"], "errors": r["errors"],
                                      "shapes": r["shapes"]} for r in sw["ramp"]]}
    geo = res.get("geometry", {})

    def plain_step_ms(name: str) -> dict:
        """A plain server's decode step per client count: from its decode log lines (steady decoding, as the
        adaptive servers' tables time their steps: `decode_ms_per_token`) where the run recorded it, else wall x
        clients / tokens of its rounds (before 2026-12-06's stop 67: that also holds the prefills and the gaps
        between requests, ~0.2-0.3 ms a token at 1-4 clients, and so favoured the tables' shapes over plain)."""
        return {c: v.get("decode_ms_per_token") or 1000.0 * int(c) / v["tokens_per_s"]["median"]
                for c, v in geo.get(name, {}).get("t0", {}).items()}

    plain = plain_step_ms("plain")
    # the extend-kernel verify, SGLang's split-KV kernel (patch 8), and the table of a server with the tree in
    # its menu (it times the tree beside the chains)
    tables = {suffix: cost_table(geo.get(f"dspine_adaptive{suffix}", {}).get("policy_last"))
              for suffix in ("", "_splitkv", "_tree32", "_tree32_grouped", "_tree64", "_below_block", "_grouped",
                             "_extend", "_eager_upkeep", "_upkeep_graphs")}
    if not tables["_below_block"] and tables[""] and tables["_splitkv"]:
        # not served yet: each shape's graphs are its own, so the narrower shapes' steps under split-KV and the
        # block's under the extend kernel are what SGLANG_DSPINE_SPLITKV_VERIFY=below-block would run
        tables["_below_block_composed"] = below_block_table(tables[""], tables["_splitkv"])
    for suffix, table in tables.items():
        if table:
            out.setdefault("geometry_step_ms", {"plain": {c: round(v, 3) for c, v in plain.items()}})
            out["geometry_step_ms"][f"dspine_shapes{suffix}"] = table
    # SGLang's other attention backends: each its own plain step and adaptive table (5(b)), projected alike
    backends = {b: (plain_step_ms(f"plain_{b}"), cost_table(geo.get(f"dspine_adaptive_{b}", {}).get("policy_last")))
                for b in OTHER_BACKENDS}
    for b, (plain_b, table) in backends.items():
        if plain_b:
            out.setdefault("geometry_step_ms", {})[f"plain_{b}"] = {c: round(v, 3) for c, v in plain_b.items()}
        if table:
            out.setdefault("geometry_step_ms", {})[f"dspine_shapes_{b}"] = table
    memory = menu_memory(geo)
    if memory:
        out["geometry_memory"] = memory
    sources = projection_sources(res)
    if sources and plain and any(tables.values()):
        out["projection_acceptance"] = sources
        for key, source in sources.items():
            out[key] = project(plain, tables, source["dspine"], source.get("dflash_block"))
            for suffix, steps in fixed_block_steps(geo).items():  # the fixed servers' own block steps
                for c, ms in steps.items():
                    if c in out[key]:
                        out[key][c][f"dspine_fixed{suffix}"] = round(1000 * int(c) * source["dspine"][BLOCK] / ms, 1)
            for b, (plain_b, table) in backends.items():
                if not (plain_b and table):
                    continue
                for c, cell_ in project(plain_b, {f"_{b}": table}, source["dspine"],
                                        source.get("dflash_block")).items():
                    out[key].setdefault(c, {}).update({f"plain_{b}" if k == "plain" else k: v
                                                       for k, v in cell_.items()})
    return out


def kv_bytes_a_token(geometry: dict) -> int:
    """The target's KV cache a token takes: K and V in every layer, bf16."""
    return 2 * geometry["num_hidden_layers"] * geometry["num_key_value_heads"] * geometry["head_dim"] * 2


def menu_memory(geo: dict) -> dict:
    """What the adaptive servers' verify shapes cost in memory at the Qwen3-8B geometry (the issue's goal: <= 3% of
    the KV cache's tokens against fixed DSPINE). Their other widths' backends and graphs are allocated after SGLang
    sizes the KV pool, so at the same memory fraction the pool keeps fixed DSPINE's size; a server the harness
    starts at a lower fraction (the tree of 64's, for its graphs) loses tokens. `kv_tokens_lost`: the pools'
    difference where fixed DSPINE ran in these runs (else None). `menu_share_of_pool`: the menu's memory as a share
    of the pool's own bytes, what it would cost in tokens had it been taken from the pool."""
    fixed = geo.get("dspine", {}).get("memory") or {}
    per_token = kv_bytes_a_token(scale.GEOMETRIES["qwen3-8b"])
    out = {}
    for name, rec in geo.items():
        mem = rec.get("memory") or {}
        tokens, menu = mem.get("max_total_num_tokens"), mem.get("verify_menu_gib")
        if not (name.startswith("dspine_adaptive") and tokens and menu is not None):
            continue
        out[name] = {"kv_tokens": tokens, "mem_fraction_static": mem.get("mem_fraction_static"),
                     "verify_menu_gib": menu, "target_verify_graphs_gb": mem.get("target_verify_graphs_gb"),
                     "menu_share_of_pool": round(menu * 2**30 / (tokens * per_token), 4),
                     "kv_tokens_lost": fixed["max_total_num_tokens"] - tokens if fixed.get("max_total_num_tokens")
                     else None}
    return out


def fixed_block_steps(geo: dict) -> dict:
    """Per fixed DSPINE server at the geometry (`dspine`, `dspine_grouped`, ...; by suffix): its block step per
    client count from steady decoding (decode_ms_per_token x τ, recorded since stop 67), where the run has it."""
    out = {}
    for name, rec in geo.items():
        if name == "dspine" or (name.startswith("dspine_") and not name.startswith(("dspine_adaptive", "dspine_tree"))
                                and name.count("_") == 1):
            steps = {c: v["decode_ms_per_token"] * v["tau"] for c, v in rec.get("t0", {}).items()
                     if v.get("decode_ms_per_token") and v.get("tau")}
            if steps:
                out[name[len("dspine"):]] = steps
    return out


def cost_table(policy: dict | None) -> dict | None:
    """A policy's step cost per (bucket, shape) as verify_shapes.StepCosts now weighs it: the larger of its wall
    and GPU parts. A policy that reports the parts beside (`wall_step_ms`) gives it as `step_ms`; before that,
    `step_ms` was the wall part alone (c615dca; `gpu_step_ms` beside it) or the GPU time alone (6f41609 and
    earlier), so the cell's larger of `step_ms` and `gpu_step_ms`."""
    if not policy or not policy.get("step_ms"):
        return None
    if "wall_step_ms" in policy:
        return policy["step_ms"]
    gpu = policy.get("gpu_step_ms") or {}
    return {b: {s: max(ms, (gpu.get(b) or {}).get(s, 0.0)) for s, ms in row.items()}
            for b, row in policy["step_ms"].items()}


BLOCK = "chain16"  # the block of the drafters projected (Qwen3-8B's DSpine and DFlash drafters: B = 16)
RECIPE_LAB = os.path.join(_root, "benchmarks", "results", "lab_recipe_summary.json")


def below_block_table(extend: dict, split_kv: dict) -> dict:
    """Step ms per (bucket, shape) of a below-block server composed from an extend-kernel server's table and a
    split-KV one's (the same menu, measured alone): the block's from the first, every other shape's from the
    second; buckets both measured."""
    return {b: {shape: (extend if shape == BLOCK else split_kv)[b][shape] for shape in split_kv[b]
                if shape in extend[b]} for b in split_kv if b in extend}


def projection_sources(res: dict) -> dict:
    """Acceptance to project the geometry's step table with, at T=0, by output key: E(shape) per DSPINE shape
    (`dspine`) and DFLASH's E at its block (`dflash_block`, where known), each with where it came from:
      - geometry_projection: the built-in pair served: its adaptive server's per-position acceptance after its
        last T=0 cell, and DFLASH's τ (median over client counts) where the pair phase measured it;
      - geometry_projection_recipe_lab: the recipe lab's pair offline (`RECIPE_LAB`): rounds accepting at least
        i drafts per position, mean over its seeds and suites; E(chainW) = 1 + the first W - 1 of them (no tree:
        the lab measured none)."""
    out = {}
    pair = res.get("pair", {})
    with_trees = {n: default_rules.last_t0_expected_tokens(res, f"dspine_adaptive_tree{n}") or {} for n in TREES}
    accept, server = default_rules.last_t0_expected_tokens(res, "dspine_adaptive"), "dspine_adaptive"
    for n, with_tree in with_trees.items():
        if not accept and with_tree:  # a tree server's chains learn the same per-position acceptance
            accept, server = {k: v for k, v in with_tree.items() if k != f"tree{n}"}, f"dspine_adaptive_tree{n}"
    for n, with_tree in with_trees.items():
        if accept and with_tree.get(f"tree{n}"):  # the tree's own mean tokens a request on the pair
            accept = {**accept, f"tree{n}": with_tree[f"tree{n}"]}
    if accept:
        taus = [v["tau"] for v in pair.get("dflash", {}).get("t0", {}).values() if v.get("tau")]
        out["geometry_projection"] = {
            "dspine": accept, "dflash_block": statistics.median(taus) if taus else None,
            "from": f"the built-in pair served: {server}'s per-position acceptance after its last T=0 cell "
                    "(treeN: the adaptive treeN server's mean tokens a tree step); DFLASH's tau, median over the "
                    "pair's client counts"}
    if os.path.exists(RECIPE_LAB):
        lab = json.load(open(RECIPE_LAB))
        per = {}
        for kind in ("dspine", "dflash"):
            lists = [v for seed in lab["position_acceptance"]["t0"].values() for v in seed[kind].values()]
            survival = [statistics.mean(x[i] for x in lists) for i in range(len(lists[0]))]
            per[kind] = {"none" if w == 1 else f"chain{w}": round(1 + sum(survival[: w - 1]), 4)
                         for w in range(1, len(survival) + 2)}
        out["geometry_projection_recipe_lab"] = {
            "dspine": per["dspine"], "dflash_block": per["dflash"][BLOCK],
            "from": f"the recipe lab's pair offline ({os.path.relpath(RECIPE_LAB, _root)}, commit "
                    f"{lab.get('commit')}): rounds accepting at least i drafts, mean over its seeds and suites"}
    return out


def project(plain: dict, tables: dict, accept: dict, dflash_block: float | None) -> dict:
    """Projected tokens/s per client count: plain's measured; DSPINE at the block, DSPINE adaptive (the shape of
    the step table's bucket with the most E(shape) / ms) and DFLASH (its E at the block over DSPINE's block step:
    the two steps measured 1.00-1.05x apart at this geometry) per table (`tables`: suffix -> step ms per bucket
    and shape); from a tree server's table (`_treeN`, `_treeN_<kernel>`), the tree of N fixed and adaptive with
    it."""
    proj = {}
    for c, plain_ms in plain.items():
        cell_ = proj.setdefault(c, {"plain": round(1000 * int(c) / plain_ms, 1)})
        for suffix, table in tables.items():
            if not table:
                continue
            bucket = min((int(b) for b in table if int(b) >= int(c)), default=None)
            row = table.get(str(bucket)) or {}
            rates = {s: accept[s] / ms for s, ms in row.items() if s in accept}
            if suffix.startswith("_tree"):  # a tree server's other shapes are the plain table's again: only
                tree = suffix.split("_")[1]  # what the tree adds (an acceptance source without it: nothing)
                if tree not in rates:
                    continue
                cell_[f"dspine{suffix}"] = round(1000 * int(c) * rates[tree], 1)  # the tree fixed
            elif BLOCK in rates:
                cell_[f"dspine{suffix}"] = round(1000 * int(c) * rates[BLOCK], 1)
                if dflash_block:
                    cell_[f"dflash{suffix}"] = round(1000 * int(c) * dflash_block / row[BLOCK], 1)
            if rates:
                best = max(rates, key=rates.get)
                cell_[f"dspine_adaptive{suffix}"] = round(1000 * int(c) * rates[best], 1)
                cell_[f"adaptive_shape{suffix}"] = best
    return proj


if __name__ == "__main__":
    main()

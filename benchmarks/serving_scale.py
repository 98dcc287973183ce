#!/usr/bin/env python3
"""DSPINE's per-step cost against DFLASH's in SGLang at a real target's geometry (GPU).

The target is a Qwen3 config served with `--load-format dummy` (random weights: no hub, no files), the
drafters are random drafters of the paper's shape made and saved by this package. Random weights accept
almost nothing (τ ≈ 1), so output tokens/s measures the cost of one draft + verify step. Reported per server
and client count: tokens/s, verify steps, and the step time = wall × clients ÷ verify steps (requests run in
whole waves of `clients`, so every batched step holds `clients` requests).

Phases (one GPU):
  1. side by side, equal KV pools: DFLASH, DSPINE and DSPINE on its PyTorch math (SGLANG_DSPINE_KERNELS=0)
     started one after the other, each with `--max-total-tokens POOL` and a static-memory fraction high enough
     that every server reaches that cap (checked in /server_info: the run stops if the pools differ); then
     measured in turn, `--repeats` alternating rounds, clients 1, 4, 16, 48, 64, T=0 and T=1.
  2. profile (`--profile-clients`): SGLang's torch profiler over `--profile-steps` steps of a steady load, GPU
     time per step by kernel name for each server, and DSPINE minus DFLASH per kernel.
  3. alone (`--alone`, or `--alone-only` without phases 1 and 2): DFLASH, then DSPINE, then DFlash2 (`--servers`
     dflash2, SGLang >= 0.5.23; started without this package's plugin, as SGLang alone runs it), each alone with
     SGLang's default `--cuda-graph-max-bs-decode` and the same `--mem-fraction-static`: their KV-cache tokens
     and max running requests, and one round. `--backends ATTENTION/SAMPLING,...` then starts DSPINE alone with
     each other pair of backends (`default` = the flag left out, SGLang's own choice) and records whether it
     starts, which backends it ran, and one round.

Every server gets `--attention-backend triton --sampling-backend pytorch` unless `--attention-backend` /
`--sampling-backend` say otherwise (`sglang-default`: the flag left out, as a user who passes none).

Usage on the GPU machine (repo root, carry .devbundle): `bash scripts/device/run.sh step_cost [args]`.
Results: $OUT/serving_scale.json, benchmarks/results/serving_scale.json and serving_scale_summary.json.
`--smoke` (CPU): makes the models at a tiny geometry and checks the summary code on synthetic timings.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

import torch

from sglang_dspine.provenance import provenance
from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/x.py) or loaded by its path: the package `benchmarks` first
    as_package(__file__)

from benchmarks import servers as _servers  # noqa: E402
from benchmarks.geometry import DFLASH2, DRAFTER, GEOMETRIES, TINY_DFLASH2, TINY_DRAFTER  # noqa: E402, F401
from benchmarks.models import write_dflash2, write_drafters, write_target  # noqa: E402, F401 - the harness' builder
from benchmarks.output import write_json, write_result  # noqa: E402

Server, archive_logs, graph_use, kernel_times, spec_args = (
    _servers.Server, _servers.archive_logs, _servers.graph_use, _servers.kernel_times, _servers.spec_args
)

# the servers this benchmark knows; dspine_treeN: SGLANG_DSPINE_TREE=1 verifying N rows a request (N = the block:
# greedy requests verify their walk through the tree verify; N > B: trees of N - 1 nodes)
TREE_SERVERS = {"dspine_tree16": 16, "dspine_tree32": 32, "dspine_tree64": 64}
SERVERS = ("dflash", "dspine", "dspine_torch", "dflash2", *TREE_SERVERS)
DEFAULT_SERVERS = ("dflash", "dspine", "dspine_torch")


def check_servers(names: list[str]) -> None:
    """Refuse, in one line, a server this benchmark does not know or that the installed SGLang cannot run."""
    if set(names) - set(SERVERS) or not names:
        raise SystemExit(f"--servers: choose from {','.join(SERVERS)}")
    if "dflash2" in names:
        from sglang_dspine.serving.versions import sglang_version

        if sglang_version() < (0, 5, 23):
            raise SystemExit("--servers dflash2: DFlash2 ships in SGLang 0.5.23; this is SGLang "
                             + ".".join(map(str, sglang_version())))
    if set(names) & set(TREE_SERVERS):
        from sglang_dspine.serving.versions import sglang_version

        if sglang_version() >= (0, 5, 23):
            raise SystemExit("--servers dspine_tree*: tree verification is built on SGLang 0.5.17; this is SGLang "
                             + ".".join(map(str, sglang_version())))


# ---------------------------------------------------------------------------------------- measuring
def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(n)]


def measure(server: Server, prompts: list[list[int]], clients: int, max_new: int, temperature: float) -> dict:
    """One round of the harness (servers.wave_round): whole waves of `clients` requests after a warm-up wave."""
    return _servers.wave_round(server, prompts, clients, max_new, temperature)[0]


def steady_load(server: Server, prompts, clients: int, max_new: int, temperature: float = 0.0):
    """A background load of `clients` requests of `max_new` tokens each: (the executor, to be shut down, and the
    requests' futures). `max_new` must let all of them fit in the KV pool at once, or SGLang runs fewer."""
    ex = cf.ThreadPoolExecutor(clients)
    futures = [ex.submit(server.generate_ids, prompts[i % len(prompts)], max_new, temperature)
               for i in range(clients)]
    return ex, futures


_RUNNING = re.compile(r"Decode batch, #running-req: (\d+)")


def wait_until_running(server: Server, futures, clients: int, since: int, timeout: float) -> tuple[int, list[str]]:
    """Waits until a decode log line after offset `since` of the server's log shows every one of `clients`
    requests running (the profile then records a steady batch), a request of the load has failed, or `timeout`
    seconds pass. Returns (the most requests running in those lines, the load's errors so far)."""
    deadline, most = time.time() + timeout, 0
    while True:
        most = max([most, *(int(n) for n in _RUNNING.findall(server.text()[since:]))])
        errors = [repr(f.exception())[:200] for f in futures if f.done() and f.exception() is not None]
        if most >= clients or errors or time.time() > deadline:
            return most, errors
        time.sleep(0.5)


def wait_for_trace(trace_dir: str, timeout: float) -> dict | None:
    """`kernel_times` of the trace SGLang's profiler writes under `trace_dir`, once it is whole (None after
    `timeout` seconds)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        time.sleep(2)
        try:
            return kernel_times(trace_dir)
        except (FileNotFoundError, EOFError, ValueError):  # not written yet, or still being written
            continue
    return None


def keep_trace(trace_dir: str, result: dict, keep: str, name: str) -> str:
    """Copy the trace `result` was read from (under `trace_dir`) into the folder `keep` as `name`_<its file name>;
    returns the copy's path."""
    src = sorted(glob.glob(os.path.join(trace_dir, "**", result["trace"]), recursive=True))[-1]
    os.makedirs(keep, exist_ok=True)
    return shutil.copy(src, os.path.join(keep, f"{name}_{result['trace']}"))


def profile(server: Server, prompts, clients: int, steps: int, out_dir: str, max_new: int,
            keep: str | None = None) -> dict:
    """SGLang's profiler over `steps` forward steps of a steady load of `clients` requests of `max_new` tokens: GPU
    time per kernel name and per step. `keep`: a folder the trace is copied into (for timelines read later; traces
    with Python stacks run to tens of MiB, so not under a device call's $OUT)."""
    since = len(server.text())
    ex, futures = steady_load(server, prompts, clients, max_new)
    # past the prefills, every request decoding: read from the server's log, not assumed after a fixed sleep (at
    # 671b819 the pair's adaptive server was profiled with no load running and the trace never came)
    most, errors = wait_until_running(server, futures, clients, since, 60.0 + 0.5 * clients)
    if most < clients:
        server.post("/abort_request", {"abort_all": True}, timeout=30)
        ex.shutdown(wait=True, cancel_futures=True)
        return {"error": f"the load of {clients} requests never ran whole (at most {most} in the decode log "
                         f"lines)", "load_errors": errors[:3], "log_tail": server.tail(20)}
    time.sleep(0.5)  # a few steps more: the batch settled
    d = os.path.join(out_dir, f"{server.name}_c{clients}")
    server.profile(d, steps)
    result = wait_for_trace(d, 240)
    server.post("/abort_request", {"abort_all": True}, timeout=30)
    ex.shutdown(wait=True, cancel_futures=True)
    if result is None:
        return {"error": "no trace written", "log_tail": server.tail(20)}
    total = sum(v["us"] for v in result["kernels"].values())
    running = [int(x) for x in re.findall(r"#running-req: (\d+)", server.text())[-steps:]]
    result.update(steps=steps, clients=clients, gpu_us_per_step=total / steps,
                  running_requests_in_log=max(running) if running else None,
                  kernels={k: {**v, "us_per_step": round(v["us"] / steps, 2)} for k, v in result["kernels"].items()})
    if keep:
        result["kept_trace"] = keep_trace(d, result, keep, f"{server.name}_c{clients}")
    shutil.rmtree(d, ignore_errors=True)
    return result


def kernel_diff(a: dict, b: dict, top: int = 25, names: tuple[str, str] = ("dspine", "dflash")) -> list[dict]:
    """Per kernel name: µs per step in `a` minus in `b` (largest differences first); `names`: a's and b's
    servers (the columns' names)."""
    ka, kb = a.get("kernels", {}), b.get("kernels", {})
    col_a, col_b = f"{names[0]}_us", f"{names[1]}_us"
    rows = []
    for name in set(ka) | set(kb):
        ua, ub = ka.get(name, {}).get("us_per_step", 0.0), kb.get(name, {}).get("us_per_step", 0.0)
        rows.append({"kernel": name, col_a: ua, col_b: ub, "diff_us": round(ua - ub, 2)})
    total = round(sum(r["diff_us"] for r in rows), 1)
    rows.sort(key=lambda r: -abs(r["diff_us"]))
    return [{"kernel": "(all kernels)", col_a: round(sum(v["us_per_step"] for v in ka.values()), 1),
             col_b: round(sum(v["us_per_step"] for v in kb.values()), 1), "diff_us": total}] + rows[:top]


# ------------------------------------------------------------------------------------------ summary
def alone_step_ratios(alone: dict) -> dict:
    """DSPINE's step ÷ each baseline's (DFLASH, SGLang's DFlash2), and each tree server's step ÷ DSPINE's, each
    server alone, per client count, from the rounds that ran (None for a baseline that did not)."""
    mine = {r["clients"]: r["step_ms"] for r in alone.get("dspine", {}).get("rounds", []) if r.get("step_ms")}
    out = {}
    for base in ("dflash", "dflash2"):
        theirs = {r["clients"]: r["step_ms"] for r in alone.get(base, {}).get("rounds", []) if r.get("step_ms")}
        ratios = {str(c): round(mine[c] / theirs[c], 4) for c in mine if theirs.get(c)}
        out[f"step_ratio_vs_{base}"] = ratios or None
    for tree in [n for n in TREE_SERVERS if n in alone]:  # a tree server's step ÷ DSPINE's (the chain)
        steps = {r["clients"]: r["step_ms"] for r in alone[tree].get("rounds", []) if r.get("step_ms")}
        out[f"{tree}_step_ratio"] = {str(c): round(steps[c] / mine[c], 4) for c in mine if steps.get(c)} or None
    return out


def summarize(res: dict) -> dict:
    """step_ratio_by_clients: DSPINE step ÷ DFLASH step at each client count (T=0 and T=1, mean of the
    repeats); step_ratio_max: the worst over clients and temperatures."""
    def mean_step(name, temp, c):
        vals = [r["step_ms"] for rnd in res.get("rounds", []) for r in rnd.get(name, [])
                if r["clients"] == c and r["temperature"] == temp and r.get("step_ms")]
        return sum(vals) / len(vals) if vals else None

    by = {}
    torch_by = {}
    by_dflash2 = {}
    for temp in res.get("temperatures", []):
        key = f"T{temp:g}"
        by[key], torch_by[key], by_dflash2[key] = {}, {}, {}
        for c in res.get("clients", []):
            d, s, t = mean_step("dflash", temp, c), mean_step("dspine", temp, c), mean_step("dspine_torch", temp, c)
            d2 = mean_step("dflash2", temp, c)
            if d and s:
                by[key][str(c)] = round(s / d, 4)
            if d and t:
                torch_by[key][str(c)] = round(t / d, 4)
            if d2 and s:
                by_dflash2[key][str(c)] = round(s / d2, 4)
    tree_by = {}  # each tree server's step ÷ DSPINE's chain step
    for name in TREE_SERVERS:
        for temp in res.get("temperatures", []):
            for c in res.get("clients", []):
                s, t = mean_step("dspine", temp, c), mean_step(name, temp, c)
                if s and t:
                    tree_by.setdefault(name, {}).setdefault(f"T{temp:g}", {})[str(c)] = round(t / s, 4)
    ratios = [v for d in by.values() for v in d.values()]
    spread = {}
    for name in SERVERS:  # repeat-to-repeat spread of each server's step time
        for temp in res.get("temperatures", []):
            for c in res.get("clients", []):
                vals = [r["step_ms"] for rnd in res.get("rounds", []) for r in rnd.get(name, [])
                        if r["clients"] == c and r["temperature"] == temp and r.get("step_ms")]
                if len(vals) > 1:
                    spread[f"{name} T{temp:g} c{c}"] = round(max(vals) / min(vals) - 1, 4)
    alone = res.get("alone", {})
    return {
        "geometry": res.get("geometry_name"), "target": res.get("geometry"), "drafter": res.get("drafter"),
        "server_backends": res.get("server_backends"),
        "sglang": res.get("provenance", {}).get("versions", {}).get("sglang"),
        "step_ratio_max": max(ratios) if ratios else None,
        "step_ratio_by_clients": by,
        "torch_path_step_ratio_by_clients": torch_by,
        "step_ratio_vs_dflash2_by_clients": {k: v for k, v in by_dflash2.items() if v},
        "tree_step_ratio_vs_dspine_by_clients": tree_by,
        "repeat_spread_max": max(spread.values()) if spread else None,
        "kv_pools_side_by_side": _servers.kv_pools(res.get("memory", {})),
        "alone_default_graph_bs": {n: {"memory": a.get("memory"),
                                       **(alone_step_ratios(alone) if n == "dspine" else
                                          {"step_ratio_vs_dflash": None, "step_ratio_vs_dflash2": None})}
                                   for n, a in alone.items()},
        "dspine_backends": {k: {"started": b.get("started"), "ran": b.get("ran"),
                                "step_ms": {str(r["clients"]): r.get("step_ms") for r in b.get("rounds", [])}}
                            for k, b in res.get("backends", {}).items()},
        "profile_gpu_us_per_step": {k: {n: p.get("gpu_us_per_step") for n, p in v.items() if n in SERVERS}
                                    for k, v in res.get("profile", {}).items()},
        "profile_dspine_minus_dflash": {k: v["diff"][:15] for k, v in res.get("profile", {}).items() if "diff" in v},
        "gpu_step_ratio_by_clients": {k[1:]: round(v["dspine"]["gpu_us_per_step"] / v["dflash"]["gpu_us_per_step"], 4)
                                      for k, v in res.get("profile", {}).items()
                                      if v.get("dspine", {}).get("gpu_us_per_step") and v.get("dflash",
                                                                                              {}).get("gpu_us_per_step")},
        "commit": res.get("provenance", {}).get("commit"),
        "gpu": res.get("provenance", {}).get("gpu"),
        "date": res.get("provenance", {}).get("date"),
        "command": res.get("provenance", {}).get("command"),
    }


def print_table(res: dict) -> None:
    s = summarize(res)
    # side by side where there are such rounds; else (--alone-only) each server's rounds alone
    side = bool(res.get("rounds"))
    rounds = res.get("rounds", []) if side else [{n: a.get("rounds", []) for n, a in res.get("alone", {}).items()}]
    ratios = s["step_ratio_by_clients"] if side else {
        "T0": (s["alone_default_graph_bs"].get("dspine") or {}).get("step_ratio_vs_dflash") or {}}
    print("\nstep ms (mean of rounds) and DSPINE/DFLASH ratio" + ("" if side else ", each server alone"))
    shown = [n for n in SERVERS if n not in TREE_SERVERS or any(n in rnd for rnd in rounds)]  # trees: if run
    for temp in res.get("temperatures", []):
        for c in res.get("clients", []):
            row = []
            for n in shown:
                vals = [r["step_ms"] for rnd in rounds for r in rnd.get(n, [])
                        if r["clients"] == c and r["temperature"] == temp and r.get("step_ms")]
                row.append(f"{n}={sum(vals) / len(vals):.2f}" if vals else f"{n}=-")
            ratio = ratios.get(f"T{temp:g}", {}).get(str(c))
            print(f"T={temp:g} c={c:3d}  " + "  ".join(row) + f"  ratio={ratio}")
    for key, prof in res.get("profile", {}).items():
        if "diff" in prof:
            print(f"\nprofile {key}: DSPINE - DFLASH µs/step, top kernels")
            for r in prof["diff"][:12]:
                print(f"  {r['diff_us']:+9.1f}  {r['kernel'][:110]}")
    if s["tree_step_ratio_vs_dspine_by_clients"]:
        print("\ntree step ÷ DSPINE step", json.dumps(s["tree_step_ratio_vs_dspine_by_clients"]))
    print("\nstep_ratio_max", s["step_ratio_max"], "kv pools", s["kv_pools_side_by_side"])


# --------------------------------------------------------------------------------------------- main
def plugins_but_ours() -> str:
    """SGLANG_PLUGINS (SGLang's whitelist of `sglang.srt.plugins` entry points) naming every installed plugin but
    this package's, so that a baseline server runs exactly what SGLang alone runs (its own plugins included)."""
    from importlib.metadata import entry_points

    ours = "sglang_dspine.serving.plugin:register"
    names = sorted({e.name for e in entry_points(group="sglang.srt.plugins") if e.value != ours})
    return ",".join(names) or "none-but-sglang-dspine-installed"  # an empty whitelist would load every plugin


def server_args_for(name: str, target: str, drafters: dict, extra: list[str]) -> tuple[list[str], dict | None]:
    common = ["--load-format", "dummy", "--skip-tokenizer-init", "--speculative-draft-load-format", "safetensors",
              *extra]
    if name == "dflash":
        return spec_args(target, "DFLASH", drafters[name], *common), None
    if name == "dflash2":  # SGLang's DFLASH algorithm with a DFlash2DraftModel drafter, as a user without us runs it
        return spec_args(target, "DFLASH", drafters[name], *common), {"SGLANG_PLUGINS": plugins_but_ours()}
    if name == "dspine":
        return spec_args(target, "DSPINE", drafters["dspine"], *common), None
    if name == "dspine_torch":
        return spec_args(target, "DSPINE", drafters["dspine"], *common), {"SGLANG_DSPINE_KERNELS": "0"}
    if name in TREE_SERVERS:
        return spec_args(target, "DSPINE", drafters["dspine"], *common, "--speculative-num-draft-tokens",
                         str(TREE_SERVERS[name])), {"SGLANG_DSPINE_TREE": "1"}
    raise ValueError(name)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3-8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--work", default="/tmp/serving_scale", help="where the target and drafter folders go")
    ap.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                    help=f"comma-separated, of {','.join(SERVERS)} (dflash2: SGLang >= 0.5.23)")
    ap.add_argument("--clients", default="1,4,16,48,64")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--pool", type=int, default=60000, help="--max-total-tokens of every side-by-side server")
    ap.add_argument("--graph-bs", type=int, default=64, help="--cuda-graph-max-bs-decode of the side-by-side servers")
    ap.add_argument("--profile-clients", default="1,16,64", help="'' for no profile")
    ap.add_argument("--profile-steps", type=int, default=30)
    ap.add_argument("--warmup-round", action=argparse.BooleanOptionalAction, default=True,
                    help="an uncounted short round at every client count and temperature first (default: on)")
    ap.add_argument("--torch-once", action="store_true",
                    help="DSPINE on its PyTorch math (the reference) in the first round at T=0 only")
    ap.add_argument("--alone", action="store_true",
                    help="phase 3: each server alone, default --cuda-graph-max-bs-decode")
    ap.add_argument("--alone-only", action="store_true", help="phase 3 alone (no side-by-side rounds, no profile)")
    ap.add_argument("--alone-mem-fraction", type=float, default=0.85)
    ap.add_argument("--start-timeout", type=float, default=600,
                    help="seconds a server alone (phase 3, --backends) may take to answer /health")
    ap.add_argument("--backends", default="",
                    help="after phase 3: DSPINE alone with these ATTENTION/SAMPLING backend pairs, e.g. "
                         "'default/default,flashinfer/flashinfer' (default = SGLang's own choice)")
    _servers.add_backend_args(ap)
    ap.add_argument("--results-dir", default=None,
                    help="also write the results there (benchmarks/results for the committed ones); "
                         "default: --out only")
    ap.add_argument("--smoke", action="store_true", help="CPU: make tiny models and check the summary")
    args = ap.parse_args(argv)
    args.backend_pairs = [tuple(b.split("/")) for b in args.backends.split(",") if b]
    if any(len(b) != 2 or not all(b) for b in args.backend_pairs):
        raise SystemExit(f"--backends {args.backends!r}: want ATTENTION/SAMPLING pairs separated by commas")
    args.alone = args.alone or args.alone_only
    return args


def side_by_side(args, res, names, servers, base, target, drafters, prompts, env_prof, save) -> None:
    """Phase 1: the servers side by side with equal KV pools, then `--repeats` rounds, the order alternating."""
    clients, temps = res["clients"], res["temperatures"]
    side = ["--cuda-graph-max-bs-decode", str(args.graph_bs), "--max-total-tokens", str(args.pool),
            "--max-running-requests", str(max(clients)),  # else SGLang derives a lower cap (48 at 60000)
            "--mem-fraction-static", "0.88", "--disable-prefill-cuda-graph"]
    for i, n in enumerate(names):
        a, env = server_args_for(n, target, drafters, side)
        servers[n] = Server(n, 31000 + i, a, args.out, env={**(env or {}), **env_prof}, base_args=base)
        ok = servers[n].wait()
        print(f"{n} up={ok} after {servers[n].up_after}", flush=True)
        if not ok:
            raise SystemExit(f"server {n} did not start:\n{servers[n].tail(60)}")
        res["memory"][n] = servers[n].memory()
    pools = _servers.kv_pools(res["memory"])
    print("kv pools", pools, flush=True)
    if len(set(pools.values())) > 1:
        raise SystemExit(f"KV pools differ side by side: {pools}")
    save()
    if args.warmup_round:  # first use of each batch size and sampling mode: not counted
        for n in names:
            for t in temps:
                for c in clients:
                    measure(servers[n], prompts, c, min(args.max_new, 16), t)
    for rnd in range(args.repeats):
        order = names if rnd % 2 == 0 else names[::-1]
        res["rounds"].append({})
        for n in order:
            ts = temps if not (n == "dspine_torch" and args.torch_once) else ([0.0] if rnd == 0 else [])
            res["rounds"][-1][n] = [measure(servers[n], prompts, c, args.max_new, t) for t in ts for c in clients]
            print(f"round {rnd} {n}", {f"T{r['temperature']:g}c{r['clients']}": round(r["step_ms"] or 0, 2)
                                       for r in res["rounds"][-1][n]}, flush=True)
            save()


def profiles(args, res, names, servers, prompts, profile_dir, block_size, save) -> None:
    """Phase 2: SGLang's profiler at each --profile-clients, per server, and DSPINE minus DFLASH per kernel."""
    for c in [int(x) for x in args.profile_clients.split(",") if x]:
        key = f"c{c}"
        fits = max(args.profile_steps * 4, args.pool // c - args.prompt_len - 2 * block_size)
        res["profile"][key] = {n: profile(servers[n], prompts, c, args.profile_steps, profile_dir, min(4096, fits))
                               for n in names}
        if "dspine" in names and "dflash" in names:
            res["profile"][key]["diff"] = kernel_diff(res["profile"][key]["dspine"], res["profile"][key]["dflash"])
        for n in [x for x in names if x.startswith("dspine_tree") and "dspine" in names]:  # what a tree adds
            res["profile"][key]["diff_" + n] = kernel_diff(res["profile"][key][n], res["profile"][key]["dspine"],
                                                           names=(n, "dspine"))
        save()


def alone(args, res, names, servers, base, target, drafters, prompts, save) -> None:
    """Phase 3: each server alone, SGLang's default --cuda-graph-max-bs-decode: memory, one round, graph use."""
    # DSPINE before DFlash2: at 35f24d8 DFlash2 hung starting under FA3 and DSPINE waited behind it
    for n in [x for x in ("dflash", "dspine", "dflash2", *TREE_SERVERS) if x in names]:
        a, env = server_args_for(n, target, drafters, ["--mem-fraction-static", str(args.alone_mem_fraction)])
        s = servers[n] = Server(n + "_alone", 31010, a, args.out, env=env, base_args=base)
        if s.wait(timeout=args.start_timeout):
            res["alone"][n] = {"memory": s.memory(),
                               "rounds": [measure(s, prompts, c, args.max_new, 0.0) for c in res["clients"]],
                               "graph_use": graph_use(s.text())}
        else:
            res["alone"][n] = {"error": s.tail(40), "start_timeout_s": args.start_timeout}
        s.stop()
        del servers[n]
        # a server that never answered is a result too (at 35f24d8 it was lost with the lease); the summary's alone
        # ratios come from the rounds saved so far (a lease may end mid-run)
        save()
    if "dspine" in res["alone"]:
        res["alone"]["dspine"].update(alone_step_ratios(res["alone"]))


def other_backends(args, res, servers, target, drafters, prompts, save) -> None:
    """DSPINE alone on each --backends ATTENTION/SAMPLING pair: whether it starts, what it ran, one round."""
    for attention, sampling in args.backend_pairs:
        key = f"{attention}/{sampling}"
        base = _servers.base_args(None if attention == "default" else attention,
                                  None if sampling == "default" else sampling)
        a, env = server_args_for("dspine", target, drafters, ["--mem-fraction-static", str(args.alone_mem_fraction)])
        s = servers["backend"] = Server("dspine_" + key.replace("/", "_"), 31020, a, args.out, env=env, base_args=base)
        rec: dict = {"started": s.wait(timeout=args.start_timeout)}
        if rec["started"]:
            info = s.info()
            rec["ran"] = {k: info.get(k) for k in ("attention_backend", "sampling_backend",
                                                   "speculative_algorithm", "max_total_num_tokens")}
            rec["draft_path_log"] = [l[-160:] for l in s.text().splitlines() if "DSPINE draft step" in l][:2]
            rec["rounds"] = [measure(s, prompts, c, args.max_new, 0.0) for c in res["clients"]]
        else:
            rec["error"] = s.tail(40)[-2000:]
        s.stop()
        del servers["backend"]
        res["backends"][key] = rec
        print(f"DSPINE on {key}: started={rec['started']}", rec.get("ran", ""), flush=True)
        save()


def main(argv=None) -> None:
    args = parse_args(argv)
    server_backends = _servers.backends_from_args(args)
    base = _servers.base_args(server_backends["attention"], server_backends["sampling"])
    names = [n for n in args.servers.split(",") if n]
    check_servers(names)
    clients = [int(c) for c in args.clients.split(",") if c]
    temps = [float(t) for t in args.temperatures.split(",") if t]
    geometry = GEOMETRIES["tiny" if args.smoke else args.geometry]
    shape = TINY_DRAFTER if args.smoke else DRAFTER
    os.makedirs(args.out, exist_ok=True)
    res = {"geometry_name": "tiny" if args.smoke else args.geometry, "geometry": geometry, "drafter": shape,
           "clients": clients, "temperatures": temps, "prompt_len": args.prompt_len, "max_new": args.max_new,
           "pool": args.pool, "graph_bs": args.graph_bs, "provenance": provenance(sys.argv), "rounds": [],
           "memory": {}, "profile": {}, "alone": {}, "backends": {},
           "server_backends": {k: v or _servers.SGLANG_DEFAULT for k, v in server_backends.items()}}
    t0 = time.time()
    shutil.rmtree(args.work, ignore_errors=True)
    target = write_target(args.work, geometry)
    drafters = write_drafters(args.work, geometry, shape, "cuda" if torch.cuda.is_available() else "cpu",
                              (TINY_DFLASH2 if args.smoke else DFLASH2) if "dflash2" in names else None)
    print(f"models written in {time.time() - t0:.0f} s", flush=True)
    if args.smoke:
        synthetic = {n: [{"clients": c, "temperature": t, "step_ms": 10.0 + (n != "dflash") * 0.1, "tokens_per_s": 1}
                         for c in clients for t in temps] for n in names}
        res["rounds"] = [synthetic, synthetic]
        print(json.dumps(summarize(res), indent=1))
        return

    def save():
        for d in [args.out] + ([args.results_dir] if args.results_dir else []):
            os.makedirs(d, exist_ok=True)
            write_result(os.path.join(d, "serving_scale.json"), res)
            write_json(os.path.join(d, "serving_scale_summary.json"), summarize(res))

    if "dflash2" in names or args.sampling_backend != "pytorch":  # FlashInfer's JIT modules before any server
        prebuild = _servers.start_prebuild(args.out)
        try:
            prebuild.wait(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(prebuild.pid, 15)
        res["flashinfer_prebuild"] = _servers.prebuild_record(prebuild, args.out)
        print(f"FlashInfer prebuild: rc {prebuild.poll()}", flush=True)
    prompts = random_prompts(64, args.prompt_len, geometry["vocab_size"])
    servers: dict[str, Server] = {}
    env_prof = {"SGLANG_TORCH_PROFILER_DIR": os.path.join(args.work, "profiles")}
    try:
        if not args.alone_only:
            side_by_side(args, res, names, servers, base, target, drafters, prompts, env_prof, save)
            profiles(args, res, names, servers, prompts, env_prof["SGLANG_TORCH_PROFILER_DIR"], shape["block_size"],
                     save)
        for n, s in servers.items():
            res["memory"][n]["graph_use"] = graph_use(s.text())
            res["memory"][n]["draft_path_log"] = [l[-160:] for l in s.text().splitlines()
                                                 if "DSPINE draft step" in l or "DSPINE candidate" in l][:4]
            s.stop()
        servers.clear()
        if args.alone:
            alone(args, res, names, servers, base, target, drafters, prompts, save)
        other_backends(args, res, servers, target, drafters, prompts, save)
    finally:
        for s in servers.values():
            s.stop()
        res["wall_seconds"] = time.time() - t0
        save()
        archive_logs(args.out, "serving_scale_logs.tar.gz")
    print_table(res)
    down = [n for n, a in res["alone"].items() if "error" in a] + [k for k, b in res["backends"].items()
                                                                  if not b.get("started")]
    if down:  # measured without them: the run fails, after writing what it has
        raise SystemExit(f"serving_scale: servers that did not start: {', '.join(down)} (their logs: {args.out})")


if __name__ == "__main__":
    main()

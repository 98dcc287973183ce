"""A lab pair in SGLang, measured by SGLang's own serving benchmark (`python -m sglang.bench_serving`).

Three servers side by side on one GPU (benchmarks/servers.py's Server): the target without speculation, DFLASH
and DSPINE on the lab's main pair (LAB/drafters/{dflash,dspine}). They start at once (one start-up wait), get
one warm-up burst each (greedy and T=1 requests mixed: the first such batch builds the sampling kernels), and
are then measured one at a time, the order reversed every other cell so drift favours no server: for each
temperature and client count, SGLang's bench_serving CLI (run in this process, `sglang.benchmark.serving`'s
`cli_main`, with the same arguments `python -m sglang.bench_serving` takes) sends `max(16, 2 x clients)`
prompts from a local dataset file at that concurrency. The dataset is the lab's held-out suites round-robin
(`custom` format: a user turn and a reference turn; the chat template applied by bench_serving); requests stop
at the end token or after --max-new tokens. Before each run the server's acceptance counters are reset
(`/set_internal_state` with no changes resets them), so the accept length bench_serving reads from
/server_info covers that run alone.

Writes OUT/lab_bench_serving.json: every run's bench_serving result (throughput, TTFT, TPOT, ITL, accept
length, the exact command) and the DSPINE ÷ DFLASH ratios of output throughput and accept length per cell.

    python benchmarks/lab/serve_bench.py --lab /tmp/lab2/lab --out /tmp/lab2/serving
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/lab/x.py) or loaded by its path: the package `benchmarks` first
    as_package(__file__)

from benchmarks import servers as _servers  # noqa: E402
from benchmarks.output import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BASE_ARGS, Server, archive_logs, post = _servers.BASE_ARGS, _servers.Server, _servers.archive_logs, _servers.post
kv_pools, start_warm_up, wait_all, warm_up_seconds = (_servers.kv_pools, _servers.start_warm_up, _servers.wait_all,
                                                      _servers.warm_up_seconds)

SERVERS = ("plain", "dflash", "dspine")
# Beside BASE_ARGS: no grammar backend (none needed), CUDA graphs and running requests up to the largest client
# count, and no prefill graphs (their capture cost 81 s of a fresh machine's first start and only changes
# prefill speed). Memory: servers started together on one GPU each size their KV pool from the memory free
# when they look (SGLang 0.5.17: free after loading minus (1 - fraction) x free before loading), so a
# small fraction can leave a later server nothing, and unequal pools would make unequal servers. So every
# server asks for the same pool (KV_POOL tokens: 48 requests of 2,700 tokens, far more than these prompts
# need) under a fraction large enough to hold it whatever the others (or a training beside them) took.
KV_POOL = 131072
SERVER_ARGS = ["--grammar-backend", "none", "--cuda-graph-max-bs-decode", "48", "--max-running-requests", "48",
               "--max-total-tokens", str(KV_POOL), "--mem-fraction-static", "0.5", "--disable-prefill-cuda-graph"]


def write_dataset(suites_dir: str, path: str) -> dict[str, int]:
    """The lab's held-out suites round-robin as bench_serving's `custom` JSONL; returns prompts per suite."""
    per: dict[str, list[dict]] = {}
    for f in sorted(os.listdir(suites_dir)):
        if f.endswith(".heldout.jsonl"):
            with open(os.path.join(suites_dir, f), encoding="utf-8") as fh:
                per[f.split(".")[0]] = [json.loads(x) for x in fh if x.strip()]
    if not per:
        raise SystemExit(f"serve_bench: no *.heldout.jsonl in {suites_dir}")
    rows = [(s, recs[i]) for i in range(max(map(len, per.values()))) for s, recs in per.items() if i < len(recs)]
    with open(path, "w", encoding="utf-8") as f:
        for suite, r in rows:
            # bench_serving drops a pair whose reference tokenizes to < 2 tokens even with a fixed output length
            ref = r.get("reference") or "(no reference answer)"
            f.write(json.dumps({"id": r.get("id"), "suite": suite, "conversations": [
                {"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": ref}]},
                ensure_ascii=False) + "\n")
    return {s: len(v) for s, v in per.items()}


def bench_argv(port: int, target: str, dataset: str, clients: int, temperature: float, max_new: int,
               out_file: str, seed: int = 42) -> list[str]:
    """bench_serving's arguments for one run (what follows `python -m sglang.bench_serving`)."""
    return ["--backend", "sglang", "--host", "127.0.0.1", "--port", str(port), "--model", target,
            "--tokenizer", target, "--dataset-name", "custom", "--dataset-path", dataset,
            "--num-prompts", str(max(16, 2 * clients)), "--sharegpt-output-len", str(max_new),
            "--apply-chat-template", "--max-concurrency", str(clients), "--temperature", f"{temperature:g}",
            "--disable-ignore-eos", "--disable-tqdm", "--seed", str(seed), "--output-file", out_file]


def run_bench(argv: list[str]) -> dict:
    """One bench_serving run in this process (its CLI, so the arguments are checked as on the command line);
    returns the result line it appended to --output-file."""
    from sglang.benchmark import serving

    out_file = argv[argv.index("--output-file") + 1]
    before = sum(1 for _ in open(out_file)) if os.path.isfile(out_file) else 0
    saved = sys.argv
    sys.argv = ["sglang.bench_serving"] + argv
    try:
        serving.cli_main()
    except SystemExit as e:
        raise RuntimeError(f"bench_serving exited with {e.code}") from None
    finally:
        sys.argv = saved
    lines = open(out_file).read().splitlines()
    if len(lines) <= before:
        raise RuntimeError(f"bench_serving wrote no result to {out_file}")
    return json.loads(lines[-1])


KEEP = ("completed", "duration", "total_output_tokens", "output_throughput", "request_throughput", "mean_ttft_ms",
        "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
        "median_itl_ms", "accept_length", "max_concurrency")


def reset_counters(server: Server) -> bool:
    try:
        r = post(server.url + "/set_internal_state", {"server_args": {}}, timeout=30)
        return bool(r.get("updated", True)) if isinstance(r, dict) else True
    except Exception as e:  # noqa: BLE001 - recorded: the accept length is then cumulative
        print(f"serve_bench: {server.name}: counters not reset ({e})", flush=True)
        return False


def measure(server: Server, argv: list[str]) -> dict:
    """One bench_serving run on `server` (a speculating server's acceptance counters reset first): the KEEP
    fields of its result, or `error`; and whether the counters were reset (None: no speculation)."""
    speculates = "--speculative-algorithm" in server.cmd
    out: dict = {"counters_reset": reset_counters(server) if speculates else None}
    try:
        r = run_bench(argv)
        out.update({key: r.get(key) for key in KEEP})
    except Exception as e:  # noqa: BLE001 - one failed run is recorded, the others go on
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def summarize(cells: dict) -> dict:
    ratios, tau_ratios = {}, {}
    for tk, by_c in cells.items():
        for c, row in by_c.items():
            a, b = row.get("dspine"), row.get("dflash")
            if a and b and b.get("output_throughput"):
                ratios.setdefault(tk, {})[c] = round(a["output_throughput"] / b["output_throughput"], 4)
            if a and b and a.get("accept_length") and b.get("accept_length"):
                tau_ratios.setdefault(tk, {})[c] = round(a["accept_length"] / b["accept_length"], 4)
    flat = [v for row in ratios.values() for v in row.values()]
    return {"throughput_ratio": ratios, "accept_length_ratio": tau_ratios,
            "throughput_ratio_mean": round(sum(flat) / len(flat), 4) if flat else None,
            "throughput_ratio_min": round(min(flat), 4) if flat else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lab", required=True, help="a lab --out folder (target/, drafters/, corpus/prompts/)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--clients", default="1,4,16,48")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--deadline", type=float, help="Unix time after which no new run starts (the runs not made "
                    "are listed under `skipped`); the servers' start-up wait ends then too")
    args = ap.parse_args(argv)
    names = [n for n in args.servers.split(",") if n]
    if set(names) - set(SERVERS):
        ap.error(f"--servers: choose from {','.join(SERVERS)}")
    lab = os.path.abspath(args.lab)
    target = os.path.join(lab, "target")
    for d in [target] + [os.path.join(lab, "drafters", n) for n in names if n != "plain"]:
        if not os.path.isfile(os.path.join(d, "config.json")):
            raise SystemExit(f"serve_bench: {d}: no config.json (build the lab first)")
    os.makedirs(args.out, exist_ok=True)
    dataset = os.path.join(args.out, "bench_prompts.jsonl")
    counts = write_dataset(os.path.join(lab, "corpus", "prompts"), dataset)
    clients = [int(c) for c in args.clients.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    from sglang_dspine.provenance import provenance

    res: dict = {"what": __doc__.split("\n\n")[0], "lab": lab, "dataset": {"file": dataset, "prompts": counts},
                 "max_new": args.max_new, "server_args": SERVER_ARGS, "provenance": provenance(sys.argv), "runs": []}
    out_json = os.path.join(args.out, "lab_bench_serving.json")
    algo = {"dflash": "DFLASH", "dspine": "DSPINE"}
    servers = {}
    for i, n in enumerate(names):
        model = ["--model-path", target]
        if n != "plain":
            model += ["--speculative-algorithm", algo[n],
                      "--speculative-draft-model-path", os.path.join(lab, "drafters", n)]
        servers[n] = Server(n, 31000 + i, model + SERVER_ARGS, args.out)
    t0 = time.time()
    start_timeout = args.start_timeout if args.deadline is None else min(args.start_timeout, args.deadline - t0)
    try:
        up = wait_all(servers, start_timeout)
        res["startup_seconds"] = {n: s.up_after for n, s in servers.items()}
        print(f"serve_bench: servers up {up} after {res['startup_seconds']}", flush=True)
        live = {n: s for n, s in servers.items() if up[n]}
        res["failed_to_start"] = {n: servers[n].tail(30) for n in servers if not up[n]}
        if not live:
            raise SystemExit("serve_bench: no server started")
        res["memory"] = {n: s.memory() for n, s in live.items()}
        pools = kv_pools(res["memory"])
        res["kv_pools_equal"] = len(set(pools.values())) == 1
        print(f"serve_bench: KV pools {pools}", flush=True)
        texts = [json.loads(x)["conversations"][0]["content"] for x in open(dataset)][:48]
        res["warm_up_seconds"] = warm_up_seconds(start_warm_up(live, texts, max_new=32), wait=True)
        print(f"serve_bench: warm-up {res['warm_up_seconds']}", flush=True)
        res["cells"], res["skipped"] = {}, []
        for k, (c, t) in enumerate([(c, t) for c in clients for t in temps]):  # both temperatures per load
            if args.deadline is not None and time.time() > args.deadline:
                res["skipped"].append({"clients": c, "temperature": t, "why": "past --deadline"})
                continue
            order = list(live.values())
            if k % 2:
                order.reverse()
            for s in order:
                bargs = bench_argv(s.port, target, dataset, c, t, args.max_new,
                                   os.path.join(args.out, f"bench_{s.name}.jsonl"))
                run = {"server": s.name, "temperature": t, "clients": c,
                       "command": "python -m sglang.bench_serving " + " ".join(shlex.quote(a) for a in bargs),
                       **measure(s, bargs)}
                res["runs"].append(run)
                res["cells"].setdefault(f"t{t:g}", {}).setdefault(str(c), {})[s.name] = \
                    {key: run.get(key) for key in KEEP if key in run} or {"error": run.get("error")}
                done = run.get("output_throughput") is not None
                print(f"serve_bench: T={t:g} clients {c:2d} {s.name:6s} " + (
                    f"{run['output_throughput']:.0f} tok/s, TTFT {run['mean_ttft_ms']:.1f} ms, TPOT "
                    f"{run['mean_tpot_ms']:.2f} ms, accept {run.get('accept_length')}"
                    if done else run.get("error", "?")), flush=True)
            res.update(summarize(res["cells"]))
            write_json(out_json, res)
    except SystemExit as e:  # what is known goes into the JSON too
        res["error"] = str(e)
        raise
    finally:
        for s in servers.values():
            s.stop()
        archive_logs(args.out, "bench_server_logs.tar.gz")
        write_json(out_json, res)
    res["seconds"] = round(time.time() - t0, 1)
    res.update(summarize(res.get("cells", {})))
    write_json(out_json, res)
    print(f"serve_bench: {out_json}: throughput DSPINE/DFLASH mean {res['throughput_ratio_mean']} "
          f"min {res['throughput_ratio_min']} ({res['seconds']} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end DSPINE serving evidence on the GPU machine (items a-g below).

Starts, side by side on one GPU, SGLang servers without speculation, with DSPINE and with DFLASH (plus the
same plain/DSPINE pair with --enable-deterministic-inference), tries to start servers on broken drafters,
and measures: greedy agreement with near-tie analysis (a), a T=1 two-sample test (b), a 48-client load
through the OpenAI API (c), CUDA graphs in the decode logs (d), accept length in /server_info and the logs
(e), DFLASH in the same build (f), refusals (g). Writes JSON to --out and benchmarks/results/.

Usage: `bash scripts/device/serve.sh e2e` on the GPU machine, or (from the repo root, after
`source scripts/device/setup.sh`):
    python3 -m benchmarks e2e --models DIR --out $OUT
DIR holds target/, dspine/ and dflash/ (a trained lab pair); without --models tiny random ones are made.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import functools
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import threading
import time

from benchmarks import models as bench_models
from benchmarks import servers as bench_servers
from benchmarks.output import write_json, write_result
from sglang_dspine.provenance import provenance

# The benchmark servers' flags (benchmarks/servers.py) and this script's own: no grammar backend, decode graphs up
# to the 48 load clients, a small KV pool so five servers fit on one GPU; no prefill graphs (they only change
# prefill speed, and capturing them slows every start).
E2E_ARGS = ["--grammar-backend", "none", "--cuda-graph-max-bs-decode", "48", "--mem-fraction-static", "0.12",
            "--disable-prefill-cuda-graph"]
SERVER_ARGS = [*bench_servers.BASE_ARGS, *E2E_ARGS]  # a Server's flags unless given others (main: the backends asked)
spec_args, archive_logs = bench_servers.spec_args, bench_servers.archive_logs


def server_args(backends: dict) -> list[str]:
    """Every server's flags for these backends ({'attention', 'sampling'}: a name, or None for SGLang's choice)."""
    return [*bench_servers.base_args(backends["attention"], backends["sampling"]), *E2E_ARGS]


# ----------------------------------------------------------------------------------------- models
make_tiny_models, model_layout, drafter_variant = (bench_models.make_tiny_models, bench_models.model_layout,
                                                   bench_models.drafter_variant)


def make_bad_drafters(root: str) -> dict[str, tuple[str, list[str], str]]:
    """name -> (drafter dir, extra args, message the refusal must contain)."""
    src = os.path.join(root, "dspine")
    bad = {}

    def variant(name, edit_cfg=None, edit_tensors=None):  # never inside the models directory
        return drafter_variant(src, os.path.join("/tmp/dspine_bad_drafters", name), edit_cfg, edit_tensors)

    bad["no_codes"] = (variant("no_codes", edit_tensors=lambda t: t.pop("transfer_codes")), [], "no transfer codes")
    bad["wrong_vocab"] = (variant("wrong_vocab", edit_cfg=lambda c: c.update(vocab_size=c["vocab_size"] + 64)), [],
                          "vocab_size: expected")
    # "block_size 16 but ..." (under SGLANG_DSPINE_TREE=1: "8 is below the drafter's block_size 16")
    bad["wrong_block_size"] = (src, ["--speculative-num-draft-tokens", "8"], "block_size 16")
    bad["zero_codes"] = (variant("zero_codes", edit_tensors=lambda t: t["transfer_codes"].zero_()), [], "all zeros")
    return bad


# ---------------------------------------------------------------------------------------- servers
class Server(bench_servers.Server):
    """A benchmark server with `base_args` (default SERVER_ARGS)."""

    def __init__(self, name, port, args, out, env=None, base_args=None):
        super().__init__(name, port, args, out, env, SERVER_ARGS if base_args is None else base_args)

    def wait(self, timeout=420) -> bool:
        return super().wait(timeout)

    def post(self, path, payload, timeout=120):
        return post(self.url + path, payload, timeout=timeout)


post = bench_servers.post  # the harness' HTTP client, whose watchdog has a stuck server dump its stacks


def wait_all(servers, results) -> dict[str, bool]:
    """Every server's start (the harness' wait_all); start-up seconds into the results."""
    up = bench_servers.wait_all(servers, 420)
    results["startup_seconds"] = {n: s.up_after for n, s in servers.items()}
    print("servers up:", up, results["startup_seconds"], flush=True)
    return up


def generate(server, input_ids, max_new, temperature=0.0, seed=None, logprobs=0, timeout=120, ignore_eos=True):
    """ignore_eos (default): every request runs max_new tokens, the same work for every server; False stops at
    the target's end token, as the offline lab's tau does (tokens past the end are drafted worse)."""
    seeded = {} if seed is None else {"sampling_seed": seed}
    body = bench_servers.generate_body(input_ids, max_new, temperature, ignore_eos=ignore_eos, **seeded)
    if logprobs:
        body.update(return_logprob=True, top_logprobs_num=logprobs, logprob_start_len=len(input_ids) - 1)
    return post(server.url + "/generate", body, timeout=timeout)


# ------------------------------------------------------------------------------------------ tests
# Code openings: the prompts when no lab suites are given; the short ones drive the load and warm-up clients.
CODE_OPENINGS = ["def forward(self, x):", "import torch\n", "class Linear(Module):", "    return F.", "# Copyright",
                 "def __init__(self, in_features, out_features", "    if bias is not None:", '"""Applies a',
                 "for i in range(", "    @property\n    def", "x = torch.", "        self.weight = Parameter("]
SHORT_OPENINGS = CODE_OPENINGS[:5]


def prompts_for(tokenizer, n, suites_dir=None, seed=0):
    """n prompts as token ids: the lab's held-out suites round-robin (chat template applied, as in training)
    when given, else code-like openings. Returns [(suite, ids)]."""
    if suites_dir and os.path.isdir(suites_dir):
        from sglang_dspine.training.jsonl import read_jsonl

        per = {}
        for f in sorted(os.listdir(suites_dir)):
            if f.endswith(".heldout.jsonl"):
                per[f.split(".")[0]] = [r["prompt"] for r in read_jsonl(os.path.join(suites_dir, f))]
        order = [(suite, texts[i]) for i in range(max(map(len, per.values()))) for suite,
                 texts in per.items() if i < len(texts)]
        from sglang_dspine.training.data import prompt_ids

        out = []
        for suite, text in order[:n]:
            ids = prompt_ids({"prompt": text}, tokenizer)  # as the training data was built
            out.append((suite, ids[-768:]))
        # suites shorter than n: topped up with code openings (suite "openings")
        return out + [("openings", ids) for _, ids in prompts_for(tokenizer, n - len(out), None, seed)]
    rng = random.Random(seed)
    starts = CODE_OPENINGS
    out = []
    for i in range(n):
        text = starts[i % len(starts)] + ("" if i < len(starts) else " " + " ".join(rng.sample(starts, 2)))
        out.append(("openings", tokenizer(text)["input_ids"]))
    return out


def throughput(servers, prompts, concurrencies, max_new, temperature=0.0, ignore_eos=True, rounds=1):
    """Output tokens/s at each concurrency, the same requests to each server, one server at a time, `rounds`
    rounds a cell with the servers taking turns round by round (a drift of the machine falls on each alike: one
    round of 4 waves at 48 clients lasts 1-2 s on the built-in pair); and the per-request accept length SGLang
    reports, per suite."""
    runs = {name: {c: [] for c in concurrencies} for name in servers}
    for c in concurrencies:
        count = max(4 * c, 12)
        for _ in range(rounds):
            for name, srv in servers.items():
                runs[name][c].append(bench_servers.wave_round(srv, [ids for _, ids in prompts], c, max_new,
                                                              temperature, requests=count, ignore_eos=ignore_eos))
    res = {name: {c: throughput_cell(runs[name][c], [suite for suite, _ in prompts]) for c in concurrencies}
           for name in servers}
    for name, cells in res.items():
        print("throughput", f"T={temperature}", name, {c: round(v["tokens_per_s"]) for c, v in cells.items()},
              "spread", {c: v["round_spread"] for c, v in cells.items()}, flush=True)
    return res


def throughput_cell(rounds, suites):
    """One server's cell from its rounds ((record, answers) of bench_servers.wave_round, requests round-robin over
    the prompts whose suites are `suites`): tokens/s over all rounds (tokens ÷ seconds summed), each round's,
    their spread (fastest ÷ slowest − 1), τ per suite (tokens over verify steps of its requests together, the
    offline lab's τ) and SGLang's per-request accept length averaged per suite."""
    acc, steps = collections.defaultdict(list), collections.defaultdict(lambda: [0, 0])
    for _, outs in rounds:
        for i, o in enumerate(outs):
            m = o["meta_info"]
            if m.get("spec_accept_length") is not None:
                suite = suites[i % len(suites)]
                acc[suite].append(float(m["spec_accept_length"]))
                steps[suite][0] += m["completion_tokens"]
                steps[suite][1] += m["spec_verify_ct"]
    recs = [rec for rec, _ in rounds]
    tokens, seconds = sum(r["output_tokens"] for r in recs), sum(r["seconds"] for r in recs)
    per_round = [r["tokens_per_s"] for r in recs]
    return {"requests": sum(r["requests"] for r in recs), "rounds": len(recs), "output_tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "tokens_per_s_rounds": per_round,
            "round_spread": round(max(per_round) / min(per_round) - 1, 4) if per_round and min(per_round) else None,
            "accept_length_by_suite": {k: sum(v) / len(v) for k, v in acc.items()},
            "tau_by_suite": {k: t / n for k, (t, n) in steps.items() if n},
            "verify_steps": sum(n for _, n in steps.values())}


def greedy_agreement(base, spec, prompts, max_new, pool, judge=None, keep_answers=False):
    """Greedy outputs of `spec` vs `base` on each prompt; at each first divergence (with its prompt's index), the
    top-2 log-prob gap of `judge`'s next-token distribution there (default `base`; it must be a server without
    speculation, which is what returns log-probs). `keep_answers`: both servers' answers too (`answers`: base,
    spec), for a float32 verdict afterwards (benchmarks/greedy_divergence.py)."""
    judge = judge or base
    outs_b = list(pool.map(lambda p: generate(base, p, max_new)["output_ids"], prompts))
    outs_s = list(pool.map(lambda p: generate(spec, p, max_new)["output_ids"], prompts))
    same = [a == b for a, b in zip(outs_b, outs_s)]
    gaps = []
    for n, (p, a, b) in enumerate(zip(prompts, outs_b, outs_s)):
        if a == b:
            continue
        k = next(i for i in range(min(len(a), len(b))) if a[i] != b[i])
        r = generate(judge, p + a[:k], 1, logprobs=2)
        top = r["meta_info"]["output_top_logprobs"][-1]
        gaps.append({"prompt": n, "position": k, "top2_logprob_gap": float(top[0][0] - top[1][0]),
                     "plain_token": a[k], "spec_token": b[k]})
    return {"prompts": len(prompts), "identical": sum(same), "match_rate": sum(same) / len(prompts),
            "divergences": gaps, **({"answers": {"base": outs_b, "spec": outs_s}} if keep_answers else {})}


def max_gap(agreement):
    """The largest top-2 log-prob gap at a first divergence of a `greedy_agreement` result (None: no divergence)."""
    return max((d["top2_logprob_gap"] for d in (agreement or {}).get("divergences", [])), default=None)


def _two_sample(a: collections.Counter, b: collections.Counter, min_count: int = 10):
    """Chi-square homogeneity test of two samples over the cells with >= min_count draws (rest pooled)."""
    from scipy.stats import chi2_contingency

    cells = sorted(set(a) | set(b), key=lambda c: -(a[c] + b[c]))
    big = [c for c in cells if a[c] + b[c] >= min_count]
    rest = [c for c in cells if a[c] + b[c] < min_count]
    rows = [[s[c] for c in big] + ([sum(s[c] for c in rest)] if rest else []) for s in (a, b)]
    if len(rows[0]) < 2:
        return {"cells": len(rows[0]), "pvalue": None}  # no power: every draw distinct (or all the same)
    return {"cells": len(rows[0]), "pvalue": float(chi2_contingency(rows)[1])}


def t1_test(base, spec, prompts, samples, pool):
    """T=1: the first three sampled tokens of each prompt, plain vs DSPINE, as two samples: chi-square on each
    position's marginal and on the joint; Bonferroni over every test that had at least two cells."""
    tests = []
    for i, p in enumerate(prompts):
        def draw(srv, s, p=p):
            return tuple(generate(srv, p, 3, temperature=1.0, seed=s)["output_ids"])

        a = list(pool.map(lambda s, draw=draw: draw(base, s), range(samples)))
        b = list(pool.map(lambda s, draw=draw: draw(spec, 10**6 + s), range(samples)))
        for pos in (0, 1, 2, "joint"):
            key = (lambda x: x) if pos == "joint" else (lambda x, pos=pos: x[pos])
            r = _two_sample(collections.Counter(map(key, a)), collections.Counter(map(key, b)))
            tests.append({"prompt": i, "position": pos, **r})
    valid = [t["pvalue"] for t in tests if t["pvalue"] is not None]
    adjusted = min(1.0, min(valid) * len(valid)) if valid else None
    return {"samples_per_server": samples, "tests": tests, "tests_with_power": len(valid),
            "bonferroni_min_pvalue": adjusted}


def start_warm_up(servers, prompts, clients=48):
    """The harness' warm-up burst on every server at once (benchmarks/servers.py start_warm_up): the first 16
    prompts and the short openings, greedy and T=1 mixed (the first batch mixing top-k values makes DFlash's
    verify JIT-build FlashInfer's sampling module, which stalls a server for minutes; timing the burst per
    server shows who pays for it: stock DFLASH does, DSPINE should not). {name: Future of its seconds}."""
    texts = [ids for _, ids in prompts[:16]] + SHORT_OPENINGS
    return bench_servers.start_warm_up(servers, texts, n=16 + clients, max_new=32)


warm, warm_up_seconds = bench_servers.warmed, bench_servers.warm_up_seconds


def load_test(server, clients, seconds):
    """`clients` concurrent OpenAI-API clients for `seconds`; every request must come back complete."""
    sent = ok = errors = 0
    lock = threading.Lock()
    err_msgs = []
    stop = time.time() + seconds
    texts = SHORT_OPENINGS

    def client(i):
        nonlocal sent, ok, errors
        rng = random.Random(i)
        while time.time() < stop:
            with lock:
                sent += 1
            try:
                r = post(server.url + "/v1/completions", {"model": "default", "prompt": rng.choice(texts),
                                                          "max_tokens": rng.randint(16, 128),
                                                          "temperature": rng.choice([0.0, 1.0])}, timeout=300)
                good = r["choices"][0]["text"] is not None and r["usage"]["completion_tokens"] > 0
                with lock:
                    ok += good
                    errors += not good
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                with lock:
                    errors += 1
                    err_msgs.append(repr(e)[:200])

    t = time.time()
    with cf.ThreadPoolExecutor(clients) as ex:
        list(ex.map(client, range(clients)))
    return {"clients": clients, "seconds": time.time() - t, "requests": sent, "completed": ok, "errors": errors,
            "lost": sent - ok - errors, "error_samples": err_msgs[:5]}


# ------------------------------------------------------------------------------------------- main
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--t1-samples", type=int, default=400)
    ap.add_argument("--t1-prompts", type=int, default=3)
    ap.add_argument("--load-seconds", type=int, default=120)
    ap.add_argument("--throughput-rounds", type=int, default=3, help="rounds a throughput cell, servers in turn")
    ap.add_argument("--no-deterministic", action="store_true")
    ap.add_argument("--dspine-args", default="",
                    help="more arguments for the DSPINE servers, e.g. '--speculative-num-draft-tokens 32' (with "
                         "SGLANG_DSPINE_TREE=1: trees of 31 nodes)")
    bench_servers.add_backend_args(ap)  # e.g. sglang-default for both: the T=1 test under FA3 and FlashInfer sampling
    return ap.parse_args()


def start_servers(args, models: str, serve) -> dict:
    """plain (alone first, so that the JIT kernel builds are cached before the others start), DSPINE, DFLASH and
    unless --no-deterministic the deterministic plain/DSPINE pair: {name: Server}, started."""
    target, dspine = os.path.join(models, "target"), os.path.join(models, "dspine")
    dspine_args = shlex.split(args.dspine_args)
    servers = {"plain": serve("plain", 30001, ["--model-path", target], args.out)}
    servers["plain"].wait()
    servers |= {
        "dspine": serve("dspine", 30002, spec_args(target, "DSPINE", dspine, *dspine_args), args.out),
        "dflash": serve("dflash", 30003, spec_args(target, "DFLASH", os.path.join(models, "dflash")), args.out),
    }
    if not args.no_deterministic:
        det = ["--enable-deterministic-inference"]
        servers["plain_det"] = serve("plain_det", 30004, ["--model-path", target, *det], args.out)
        servers["dspine_det"] = serve("dspine_det", 30005, spec_args(target, "DSPINE", dspine, *det, *dspine_args),
                                      args.out)
    return servers


def refusals_seen(refusals: dict, bad: dict) -> dict:
    """(g) each broken drafter's server: whether it exited with an error and its log says why."""
    refused = {}
    for n, s in refusals.items():
        try:
            s.proc.wait(300)
        except subprocess.TimeoutExpired:
            pass
        text = open(s.log, errors="ignore").read()
        refused[n] = {"exited": s.proc.poll() is not None and s.proc.returncode != 0,
                      "message_found": bad[n][2] in text,
                      "message": next((l.strip()[:300] for l in text.splitlines()
                                       if l.startswith(("ValueError: DSPINE",
                                                        "sglang_dspine.drafter.config.DrafterConfigError"))), None)}
    return refused


def correctness(args, servers: dict, up: dict, prompts: list, warming: dict, results: dict, checkpoint) -> None:
    """(a) greedy agreement (bf16, deterministic, DFLASH's), (b) the T=1 test and (c) the 48-client load, which
    runs beside them (they only get stronger with the DSPINE server under load); into `results`."""
    load_box = {}
    load = threading.Thread(target=lambda: load_box.update(load_test(servers["dspine"], 48, args.load_seconds)))
    with cf.ThreadPoolExecutor(16) as pool:
        results["greedy_bf16"] = greedy_agreement(servers["plain"], servers["dspine"], prompts, args.max_new, pool)
        print("greedy bf16:", results["greedy_bf16"]["identical"], "/", args.prompts, flush=True)
        checkpoint()
        load.start()
        results["t1"] = t1_test(servers["plain"], servers["dspine"], prompts[: args.t1_prompts], args.t1_samples,
                                pool)
        print("t1 p:", results["t1"]["bonferroni_min_pvalue"], flush=True)
        checkpoint()
        if up.get("plain_det") and up.get("dspine_det") and warm(warming, "plain_det", "dspine_det"):
            results["greedy_deterministic"] = greedy_agreement(servers["plain_det"], servers["dspine_det"], prompts,
                                                               args.max_new, pool)
            print("greedy det:", results["greedy_deterministic"]["identical"], "/", args.prompts, flush=True)
        checkpoint()
        if up["dflash"] and warm(warming, "dflash"):
            results["dflash_greedy_bf16"] = greedy_agreement(servers["plain"], servers["dflash"], prompts[:20],
                                                             args.max_new, pool)
        results["warm_up_seconds"] = warm_up_seconds(warming)
        print("warm-up burst seconds:", results["warm_up_seconds"], flush=True)
        checkpoint()
    load.join()
    results["load"] = load_box
    print("load:", results["load"], flush=True)


def main():
    args = parse_args()
    backends = bench_servers.backends_from_args(args)
    base = server_args(backends)
    serve = functools.partial(Server, base_args=base)  # every server of the run under the backends asked for
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    models = args.models
    label = "trained lab pair" if models else "tiny random target (head x8), random drafters"
    if models is None:
        models = "/tmp/e2e_models"
        shutil.rmtree(models, ignore_errors=True)
        make_tiny_models(models)
    model_layout(models)
    bad = make_bad_drafters(models)
    target = os.path.join(models, "target")
    servers = start_servers(args, models, serve)
    refusals = {n: serve("bad_" + n, 30010 + i, spec_args(target, "DSPINE", d, *extra), args.out)
                for i, (n, (d, extra, _)) in enumerate(bad.items())}
    results = {"models": label, "provenance": provenance(sys.argv), "server_args": base,
               "backends": {k: v or bench_servers.SGLANG_DEFAULT for k, v in backends.items()}}
    try:
        up = wait_all(servers, results)
        results["refusals"] = refusals_seen(refusals, bad)
        if not (up["plain"] and up["dspine"]):
            raise SystemExit("plain or DSPINE server did not start")
        from transformers import AutoTokenizer

        suite_prompts = prompts_for(AutoTokenizer.from_pretrained(target), args.prompts, os.path.join(models, "suites"))
        checkpoint = lambda: save_results(results, args.out)  # a call cut short by the device still returns these
        warming = start_warm_up({n: s for n, s in servers.items() if up.get(n)}, suite_prompts)
        warm(warming, "plain", "dspine")
        results["warm_up_seconds"] = warm_up_seconds(warming)
        print("warm-up burst seconds (so far):", results["warm_up_seconds"], flush=True)
        checkpoint()
        correctness(args, servers, up, [ids for _, ids in suite_prompts], warming, results, checkpoint)
        collect_server_info(servers, up, results)
        checkpoint()
        results["throughput"] = throughput({n: servers[n] for n in ("plain", "dflash", "dspine") if up.get(n)},
                                           suite_prompts, [1, 4, 16, 48], args.max_new,
                                           rounds=args.throughput_rounds)
        checkpoint()
        results["throughput_t1"] = throughput({n: servers[n] for n in ("dflash", "dspine") if up.get(n)},
                                              suite_prompts, [16], args.max_new, temperature=1.0,
                                              rounds=args.throughput_rounds)
        collect_server_info(servers, up, results)
    finally:
        for s in list(servers.values()) + list(refusals.values()):
            s.stop()
        results["wall_seconds"] = time.time() - t0
        save_results(results, args.out)
        archive_logs(args.out, "server_logs.tar.gz")
    print(json.dumps(summarize(results), indent=1))


def save_results(results, out):
    write_result(os.path.join(out, "serving_e2e.json"), results)
    write_json(os.path.join(out, "serving_e2e_summary.json"), summarize(results))


def collect_server_info(servers, up, results, names=("dspine", "dflash", "dspine_det")):
    """(d) CUDA graphs in the decode log lines, (e) accept length in /server_info and the logs."""
    for n in names:
        if n in servers and up.get(n):
            info = servers[n].info()
            log = open(servers[n].log, errors="ignore").read().splitlines()
            decode = [l for l in log if "Decode batch" in l]
            results[n + "_server"] = {
                "avg_spec_accept_length": [s.get("avg_spec_accept_length") for s in info.get("internal_states", [])],
                "decode_log_lines": len(decode),
                "cuda_graph_true_lines": sum("cuda graph: True" in l for l in decode),
                "cuda_graph_false_lines": sum("cuda graph: False" in l for l in decode),
                "last_decode_line": decode[-1][-300:] if decode else None,
                "graph_decoding_log": [l[-200:] for l in log
                                       if "folded into the draft cuda graph" in l or "kept eager" in l][:3],
            }


def _ratios(sweep, key):
    """DSPINE / DFLASH of `key` at each concurrency both were measured at."""
    a, b = sweep.get("dspine", {}), sweep.get("dflash", {})
    return {c: round(a[c][key] / b[c][key], 3) for c in a if c in b and b[c][key]}


def summarize(r):
    exact = r.get("greedy_deterministic") or r.get("greedy_bf16") or {}
    ref = r.get("refusals", {})
    srv = r.get("dspine_server", {})
    return {
        "models": r.get("models"),
        "backends": r.get("backends", {"attention": "triton", "sampling": "pytorch"}),
        "exact_setting": ("--enable-deterministic-inference (bf16)" if "greedy_deterministic" in r
                          else "plain bf16"),
        "exact_greedy_match": exact.get("match_rate"),
        "bf16_greedy_match": r.get("greedy_bf16", {}).get("match_rate"),
        "divergence_max_top2_gap": max_gap(exact),
        "t1_test_pvalue": r.get("t1", {}).get("bonferroni_min_pvalue"),
        "load_requests": r.get("load", {}).get("requests"),
        "load_errors": (r.get("load", {}).get("errors") or 0) + (r.get("load", {}).get("lost") or 0),
        "cuda_graph": bool(srv.get("cuda_graph_true_lines")) and not srv.get("cuda_graph_false_lines"),
        "accept_length": (srv.get("avg_spec_accept_length") or [None])[0],
        "dflash_served": r.get("dflash_greedy_bf16", {}).get("prompts"),
        "throughput_tokens_per_s": {n: {c: round(v["tokens_per_s"], 1) for c, v in d.items()}
                                    for n, d in r.get("throughput", {}).items()},
        "throughput_ratio_dspine_over_dflash": _ratios(r.get("throughput", {}), "tokens_per_s"),
        "throughput_round_spread_max": max((v["round_spread"] for d in r.get("throughput", {}).values()
                                            for v in d.values() if v.get("round_spread") is not None), default=None),
        "tau_by_suite": {t: {n: {c: v.get("tau_by_suite") for c, v in d.items()}
                             for n, d in r.get(key, {}).items() if n != "plain"}
                         for t, key in (("T0", "throughput"), ("T1", "throughput_t1"))},
        "accept_length_by_suite": {t: {n: {c: v["accept_length_by_suite"] for c, v in d.items()}
                                       for n, d in r.get(key, {}).items() if n != "plain"}
                                   for t, key in (("T0", "throughput"), ("T1", "throughput_t1"))},
        "warm_up_seconds": r.get("warm_up_seconds"),
        "bad_drafters_refused": sum(v["exited"] and v["message_found"] for v in ref.values()),
        "bad_drafters_tried": len(ref),
        "commit": r.get("provenance", {}).get("commit"),
    }


if __name__ == "__main__":
    main()

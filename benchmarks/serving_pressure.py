#!/usr/bin/env python3
"""SGLang servers without speculation ("plain"), with DFLASH and with DSPINE under memory and load pressure (GPU).

The built-in pair (models/default) served side by side on one GPU, every server with `servers.BASE_ARGS` and
FLAGS below: a KV pool of POOL_TOKENS tokens, an optimistic admission (--schedule-conservativeness), CUDA graphs
only up to batch 8, 64-token prefill chunks, the radix cache on. One configuration serves every scenario, so each
server starts once: plain first, alone (the kernel builds are cached), then DFLASH and DSPINE together while the
plain server runs its scenarios. Servers on one GPU share its time, not their numerics: every comparison is
within one server (a request under load against the same request alone on that server).

Scenarios, each isolated (an exception is recorded and the run goes on):
  kv_exhaustion   48 clients, ~300-token prompts, 128 greedy tokens each (ignore_eos): more than the pool holds,
                  so SGLang retracts and re-admits requests ("KV cache pool is full. Retract requests." in the log,
                  meta_info.num_retractions per request). Every request completes with 128 tokens, its tokens equal
                  the same request run alone (after a cache flush) except at near-ties, the accept length of the
                  retracted requests equals theirs alone (within ACCEPT_TOL), the pool's free tokens when idle after
                  the load equal those before.
  graph_overflow  64 requests at once, twice (greedy, T=1 with sampling parameters, regex, JSON schema, log-probs),
                  more than the largest captured decode graph (8): no error, valid answers, greedy tokens equal alone.
  long_prompts    4 prompts of 8+ prefill chunks and 2 that end at the context limit, concurrently and alone; 32
                  clients sharing a 450-token prefix (radix-cache hits, meta_info.cached_tokens), warm against cold
                  (a cache flush before each request): equal tokens and accept length.
  disconnects     24 clients of the mixed request load (serving_features' kinds) for 20 s while a stream of 1024
                  tokens is opened and closed after 3 chunks every second: no error, the server answers after,
                  the pool drains to its start (no leak).
  retraction      48 greedy streams of 384 tokens at once, in rounds, until 16 requests were retracted and
                  re-admitted (4 rounds at most); each retracted one alone after; its accept length after the
                  re-admission against alone's over the same tokens (each stream chunk carries the request's
                  counts), and before it (readmission_accept).
  soak            (--soak-seconds > 0) benchmarks/soak.py: the mixed load at 1-64 clients varying by the minute,
                  per minute requests/s, p50/p99, errors, the pool's peak, and at the idle end of each minute the
                  free KV tokens and the GPU's memory (the server's own processes' where nvidia-smi lists them);
                  goals: 0 errors, memory and free tokens flat, p99 not rising; the minutes so far and their plot
                  rewritten after each minute to serving_pressure[_TAG]_<server>_soak_minutes.json/.png.
After each scenario the server must still be alive: its process runs and /health answers (a dead server's
remaining scenarios are skipped with the exception its log ends with). In the mixed load an answer that ends by
length and keeps a stop string is counted apart (SGLang checks max_new_tokens before stop strings), not an error.

`--geometry qwen3-8b`: the memory scenario (kv_exhaustion) on a Qwen3-8B-shaped target with random weights
(--load-format dummy, --skip-tokenizer-init: random prompt ids) and random drafters of SpecForge's shape, written by
serving_scale.py's code; same pool, graphs, chunks and admission. Completion, retraction, no leak, the re-admitted
requests' acceptance and the server's life are checked; greedy outputs are compared for information only (random
weights give near-flat logits: nearly every position is a tie).

A near-tie: the server's own top log-probs (serving_features.TOP_K = 5) at the first differing position (the
prompt plus the reference tokens before it fed as the prompt, one token asked) hold both tokens, each within
NEAR_TIE_MARGIN of the best (a two-way tie: the top-2 and their gap; a three-way tie counts too).
DFLASH refuses log-prob requests, so its margins come from the plain server (same target weights).

Usage on the GPU machine (repo root, carry .devbundle): `GIT_COMMIT=<hash> bash scripts/device/run.sh pressure`;
the 20-minute soak on its own (longer than one device call: through scripts/device/job.sh):
`... run.sh pressure --servers dspine --scenarios soak --soak-seconds 1200 --tag soak1200`; the memory scenario
at Qwen3-8B geometry: `... run.sh pressure --geometry qwen3-8b`.
Results: $OUT/serving_pressure.json (everything), $OUT/serving_pressure_summary.json (also written to --results-dir
if given), the servers' logs in $OUT/serving_pressure_logs.tar.gz; with --tag (a geometry's name by default)
serving_pressure_TAG.json and so on.
`--smoke` (CPU, no servers): the inputs from the real tokenizer, every request body against SGLang's request
models, the flags through SGLang's parser, the log, load and accept-length readers on SGLang's own formats, the
mismatch, leak and per-minute arithmetic, and the summary; with --geometry, the tiny geometry's models written,
the ids-only prompts, the geometry's flags and an answer without text.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time

from sglang_dspine.provenance import provenance
from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/x.py) or loaded by its path: the package `benchmarks` first
    as_package(__file__)

from benchmarks import servers as _servers  # noqa: E402
from benchmarks import serving_features as sf  # noqa: E402
from benchmarks import soak  # noqa: E402
from benchmarks.servers import NEAR_TIE_MARGIN, is_near_tie  # noqa: E402, F401 - the harness' near-tie rule

_HERE = os.path.dirname(os.path.abspath(__file__))
BASE_ARGS, Server, archive_logs, graph_use, spec_args = (
    _servers.BASE_ARGS, _servers.Server, _servers.archive_logs, _servers.graph_use, _servers.spec_args
)

REPO = os.path.dirname(_HERE)
NAMES = ("plain", "dflash", "dspine")
PORTS = {"plain": 31011, "dflash": 31012, "dspine": 31013}  # --port-offset moves them (runs side by side)
SCENARIOS = ("kv_exhaustion", "graph_overflow", "long_prompts", "disconnects", "retraction", "soak")
CHUNK = 64
GRAPH_MAX_BS = 8
# 48 x (300 + 128) tokens is 3.3x this pool, and it still holds a request at the context limit (4096 + drafts).
POOL_TOKENS = 6144
# Admission charges running requests init_ratio (0.7 x this) of their remaining tokens: 0.1 over-admits (0.3 gave
# one retraction on the H200), so the pool runs out during decode and SGLang retracts (schedule_batch.retract_decode).
CONSERVATIVENESS = 0.1
FLAGS = ["--grammar-backend", "xgrammar", "--chunked-prefill-size", str(CHUNK),
         "--cuda-graph-max-bs-decode", str(GRAPH_MAX_BS), "--max-total-tokens", str(POOL_TOKENS),
         "--schedule-conservativeness", str(CONSERVATIVENESS), "--mem-fraction-static", "0.1",
         "--disable-prefill-cuda-graph", "--enable-cache-report", "--constrained-json-disable-any-whitespace"]
KV_CLIENTS, KV_PROMPT_TOKENS, KV_NEW = 48, 300, 128
BURST_CLIENTS, BURST_ROUNDS, BURST_GREEDY_NEW = 64, 2, 48
LONG_PROMPTS, LONG_MIN_TOKENS, LONG_NEW = 4, 8 * CHUNK, 32
NEAR_PROMPTS, NEAR_NEW = 2, 48
SHARED_CLIENTS, SHARED_PREFIX_TOKENS, SHARED_NEW = 32, 448, 48
DISCONNECT_SECONDS, DISCONNECT_CLIENTS, DISCONNECT_TOKENS, DISCONNECT_CHUNKS = 20.0, 24, 1024, 3
# Retraction of DSpine's per-request state: 48 streams of 384 tokens on the 6144-token pool, in rounds, until 16
# distinct requests were retracted and re-admitted; the server's new-token ratio decays in 20 steps (not 600) after a
# retraction (--server-env SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS=20: the device plan's retraction part), so admission
# over-commits again soon and the pool runs out again.
RETRACT_CLIENTS, RETRACT_NEW, RETRACT_MIN, RETRACT_ROUNDS = 48, 384, 16, 4
# Relative accept-length difference allowed between a request set under pressure and the same set alone/cold:
# the drafts see bf16 target features of another batch shape; a lost per-request state drops it toward 1.
ACCEPT_TOL = 0.05
REQUEST_TIMEOUT = 60.0  # seconds for one request under a 64-client burst on a 6144-token pool
IDLE_TIMEOUT = 90.0
# SGLang's launcher sleeps 5 s ("before crash diagnostics") after its scheduler dies, then exits: a server is
# alive while its process runs and /health answers within this many seconds.
HEALTH_GRACE_S = 15.0
# The issue's memory scenario at a real model's KV layout: a target of that geometry with random weights
# (--load-format dummy, config.json only, no tokenizer: ids in and out) and drafters of SpecForge's shape, written
# by serving_scale.py. Only kv_exhaustion runs there: random weights give near-flat logits, so greedy outputs under
# load and alone are compared for information only (nearly every position is a tie), while completion, retraction,
# the pool's free tokens and the re-admitted requests' acceptance are checked as on the pair.
GEOMETRY_SCENARIOS = ("kv_exhaustion",)
GEOMETRY_MEM_FRACTION = 0.6  # of the memory free at each start: an 8B target's 16 GB weights, three servers
GEOMETRY_TARGET_ARGS = ["--load-format", "dummy", "--skip-tokenizer-init"]
GEOMETRY_DRAFT_ARGS = ["--speculative-draft-load-format", "safetensors"]  # the drafters' random weights are files
RETRACT_RE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")
RUNNING_RE = re.compile(r"Decode batch.*?#running-req: (\d+)")
LEAK_MARK = "memory leak detected"
ERROR_LINE_RE = re.compile(r"^(\w+(?:Error|Exception)): .*$", re.M)


error_text = sf.error_text


# ------------------------------------------------------------------------------------------- inputs
def chat_frame(tokenizer) -> tuple[list[int], list[int]]:
    """The chat template's ids before and after a user message (the pair was trained on chat prompts)."""
    mark = "\u2063MARK\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)
    head, tail = text.split(mark)
    enc = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    return enc(head), enc(tail)


def _body(ids_of, texts: list[str], start: int, n: int) -> list[int]:
    """n ids of the texts joined from texts[start] on (cycling)."""
    out: list[int] = []
    k = start
    while len(out) < n:
        out += ids_of(texts[k % len(texts)] + "\n\n")
        k += 1
    return out[:n]


def build_inputs(tokenizer, models: str) -> dict:
    """serving_features' inputs (the mixed-load kinds, grammars and vocabulary use them) and this run's prompts as
    token ids: KV_CLIENTS distinct ~300-token prompts, short burst prompts, long prompts, a filler for prompts at
    the context limit and SHARED_CLIENTS prompts sharing a prefix."""
    ctx = sf.build_inputs(tokenizer, models)
    suites = sf.read_suites(os.path.join(models, "suites"))
    ids_of = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    head, tail = chat_frame(tokenizer)
    names = sorted(suites)
    texts = [suites[s][i] for i in range(max(map(len, suites.values()))) for s in names if i < len(suites[s])]
    frame = len(head) + len(tail)
    kv = [head + _body(ids_of, texts, i, KV_PROMPT_TOKENS - frame + (i % 5 - 2) * 8) + tail for i in range(KV_CLIENTS)]
    burst = [head + ids_of(t) + tail for t in texts[:16]]
    long = [head + _body(ids_of, texts, 7 * i, LONG_MIN_TOKENS + 40 + 16 * i) + tail for i in range(LONG_PROMPTS)]
    short = [t for t in texts if len(ids_of(t)) <= 130]
    if len(short) < SHARED_CLIENTS:
        raise SystemExit(f"{models}/suites: {len(short)} prompts of 130 tokens or fewer, want {SHARED_CLIENTS}")
    prefix = head + _body(ids_of, list(reversed(texts)), 0, SHARED_PREFIX_TOKENS)
    shared = [prefix + ids_of("\n\n" + q) + tail for q in short[:SHARED_CLIENTS]]
    ctx.update(kv_prompts=kv, burst_prompts=burst, long_prompts=long, shared_prompts_ids=shared,
               shared_common=min(sf.common_prefix_len(shared[0], s) for s in shared[1:]),
               filler=ids_of("\n\n".join(texts)), pressure_context_len=ctx["context_len"])
    return ctx


def near_context_input_len(max_req_input_len: int, context_len: int, new: int) -> int:
    """The longest prompt that still gets exactly `new` tokens: SGLang caps max_new_tokens at
    max_req_len - input - 1 (max_req_len = max_req_input_len + 5, scheduler.init_req_max_new_tokens), refuses
    input + new above the context (tokenizer_manager._validate_one_request) and inputs >= max_req_input_len."""
    max_req_len = max_req_input_len + 5
    n = min(max_req_len - 1 - new, context_len - new, max_req_input_len - 1)
    if n <= 0:
        raise ValueError(f"no prompt fits {new} new tokens (max_req_input_len {max_req_input_len}, "
                         f"context {context_len})")
    return n


def near_context_prompts(ctx: dict, input_len: int) -> list[list[int]]:
    f = ctx["filler"]
    return [[f[(997 * k + i) % len(f)] for i in range(input_len)] for k in range(NEAR_PROMPTS)]


# ----------------------------------------------------------------------------------------- requests
def greedy_req(ids: list[int], new: int) -> dict:
    """A greedy /generate request of exactly `new` tokens (ignore_eos: every client holds its KV to the end)."""
    return sf.generate_req(ids, new, ignore_eos=True)


def burst_requests(ctx: dict) -> list[dict]:
    """BURST_CLIENTS requests of every kind for one batch: 16 greedy, 16 T=1 with sampling parameters, 8 regex,
    8 JSON-schema chats, 16 log-prob requests (half greedy); each labelled with its kind."""
    bp = ctx["burst_prompts"]
    variants = [v for v in sf.SAMPLING_VARIANTS.values() if v["temperature"] > 0]
    out = []
    for i in range(16):
        out.append({"kind": "greedy", "index": i, **greedy_req(bp[i], BURST_GREEDY_NEW)})
        out.append({"kind": "sampled", **sf.generate_req(bp[i], 48, **{"temperature": 1.0,
                                                                         **variants[i % len(variants)]})})
        out.append({"kind": "logprobs", "greedy": i % 2 == 0,
                    **sf.generate_req(bp[i], sf.LP_MAX, temperature=float(i % 2), logprobs=True)})
    for i in range(8):
        out.append({"kind": "regex", **sf.generate_req(ctx["regex_prompt"], 64, temperature=float(i % 2),
                                                       regex=sf.REGEX)})
        out.append({"kind": "json", **sf.chat_req(ctx["json_messages"], 128, temperature=float(i % 2),
                                                  response_format=sf.RESPONSE_FORMAT)})
    return out


unsupported = sf.unsupported


def check_burst_answer(req: dict, answer, vocab_text: list[str]) -> list[int] | None:
    """Check one burst answer by kind; the emitted ids of a greedy request (None for the others)."""
    kind = req["kind"]
    body = req["body"]
    if kind == "json":
        c = sf.check_openai(sf.dump(answer), body["max_tokens"], chat=True)[0]
        sf.validate_json(c["message"]["content"])
        return None
    new = body["sampling_params"]["max_new_tokens"]
    r = sf.check_generate(answer, new, exact=bool(body["sampling_params"].get("ignore_eos")))
    if kind == "regex":
        sf.check_regex(r["text"])
    elif kind == "logprobs":
        sf.entries_generate(r, sf.TOP_K, req["greedy"])
    return r["output_ids"] if kind == "greedy" else None


# -------------------------------------------------------------------------------- comparing outputs
def greedy_mismatches(ref: list[list[int]], got: list[list[int]]) -> list[dict]:
    """Pairs of token lists that differ: index and first differing position (None when one is a prefix)."""
    out = []
    for i, (a, b) in enumerate(zip(ref, got)):
        if a is None or b is None or a == b:
            continue
        j = sf.common_prefix_len(a, b)
        out.append({"index": i, "position": j if j < min(len(a), len(b)) else None,
                    "ref_len": len(a), "got_len": len(b)})
    return out


def tie_margins(api, prompts: list[list[int]], ref: list[list[int]], got: list[list[int]],
                mismatches: list[dict]) -> None:
    """Top-2 at each mismatch's first differing position, into the mismatch record: serving_features'
    divergence_margins on the prompt plus the reference tokens before it (so one token is asked, at the very
    context where the two outputs part)."""
    for m in mismatches:
        j, i = m["position"], m["index"]
        if j is None:
            continue
        try:
            rec = sf.divergence_margins(api, {"greedy_prompts": [prompts[i] + ref[i][:j]]}, [ref[i][j:]],
                                        [got[i][j:]])[0]
            m.update({k: rec[k] for k in ("top1", "top2", "margin", "replayed_prefix_equal", "top")})
            m["ref_token"], m["got_token"] = ref[i][j], got[i][j]
        except Exception as e:  # noqa: BLE001 - an unexplained mismatch, with the reason
            m["margin_error"] = error_text(e)


def mismatch_counts(mismatches: list[dict], total: int) -> dict:
    near = sum(is_near_tie(m) for m in mismatches)
    return {"compared": total, "mismatches": len(mismatches), "near_tie": near,
            "unexplained": len(mismatches) - near, "details": mismatches}


def compare(api, prompts, ref, got) -> dict:
    mm = greedy_mismatches(ref, got)
    if api is not None:
        tie_margins(api, prompts, ref, got, mm)
    return mismatch_counts(mm, sum(a is not None and b is not None for a, b in zip(ref, got)))


# ------------------------------------------------------------------------------------ accept length
def accept_stats(metas: list[dict]) -> dict | None:
    """Accept length over requests, from /generate meta_info (tokenizer_manager._calculate_spec_decoding_metrics):
    tokens per verify step, the prefill's token and one per re-admission after a retraction left out
    (a retracted request's re-prefill emits a token without a verify step); SGLang's own
    completion_tokens / spec_verify_ct beside it. None without spec counters."""
    metas = [m for m in metas if m and m.get("spec_verify_ct")]
    if not metas:
        return None
    steps = sum(m["spec_verify_ct"] for m in metas)
    done = sum(m["completion_tokens"] for m in metas)
    verified = sum(m["completion_tokens"] - 1 - (m.get("num_retractions") or 0) for m in metas)
    return {"requests": len(metas), "verify_steps": steps, "accept_length": verified / steps,
            "sglang_accept_length": done / steps}


def accept_check(under: dict | None, ref: dict | None, tol: float = ACCEPT_TOL) -> dict | None:
    if not under or not ref:
        return None
    ratio = under["accept_length"] / ref["accept_length"]
    return {"accept_length": under["accept_length"], "reference": ref["accept_length"], "ratio": ratio,
            "tolerance": tol, "ok": abs(ratio - 1) <= tol}


def readmission_check(metas: list, ref_metas: list, got: list, ref: list, retracted: list[int],
                      tol: float = ACCEPT_TOL) -> dict | None:
    """Whether re-admitted requests draft as well as the others. Only requests whose greedy output equals their
    run alone are compared (a near-tie flip changes the text, and with it the acceptance); each one's accept
    length under load over alone. The same load changes every request's batch arithmetic, so the retracted ones
    pass when their pooled ratio is at least the lower of 1 - tol and the smallest ratio of a request that was
    not retracted: a lost per-request state would show as retracted requests alone falling below that."""
    same = [i for i in range(len(metas)) if got[i] is not None and got[i] == ref[i]]
    back = [i for i in retracted if i in same]
    pooled = accept_check(accept_stats([metas[i] for i in back]), accept_stats([ref_metas[i] for i in back]), tol)
    others = [accept_check(accept_stats([metas[i]]), accept_stats([ref_metas[i]]), tol)
              for i in same if i not in retracted]
    others = [c["ratio"] for c in others if c]
    if pooled is None:
        return None
    floor = min([1 - tol, *others])
    return {**pooled, "retracted_equal_output": len(back), "retracted": len(retracted),
            "others_ratio_min": min(others, default=None), "others_ratio_median": sorted(others)[len(others) // 2]
            if others else None, "floor": floor, "ok": pooled["ratio"] >= floor}


# ---------------------------------------------------------------------------------- log and memory
def log_stats(text: str) -> dict:
    """From a window of a server log: retraction events and requests (scheduler.update_running_batch's warning),
    decode lines, the largest running batch and graph use, SGLang's idle leak warnings, tracebacks."""
    retracts = [int(m.group(1)) for m in RETRACT_RE.finditer(text)]
    running = [int(m.group(1)) for m in RUNNING_RE.finditer(text)]
    return {"retract_events": len(retracts), "retracted_reqs": sum(retracts),
            "max_running_req": max(running, default=0), **graph_use(text), "leak_warnings": text.count(LEAK_MARK),
            "tracebacks": text.count("Traceback (most recent call")}


def health(url: str, timeout: float = 5.0) -> bool:
    """/health answers 200. SGLang's /health (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION, on by default) sends the
    scheduler a one-token request and answers 200 once anything comes back, 503 after 20 s without; a closed port
    or a hung launcher fails here at once or after `timeout`."""
    import httpx

    try:
        return httpx.get(url + "/health", timeout=timeout, trust_env=False).status_code == 200
    except Exception:  # noqa: BLE001 - refused, reset, timed out: not healthy
        return False


def server_alive(server, grace: float | None = None) -> bool:
    """The server's process runs and /health answers within `grace` seconds (HEALTH_GRACE_S). The process alone
    is not enough: at fc5c402 stock DFLASH's scheduler died at 15:53:32 (SGLang's idle leak check), its launcher
    slept 5 s before exiting at 15:53:37, and proc.poll() read at 15:53:35 called it alive, so the next scenario
    ran into 'connection refused' and both were recorded with server_alive true."""
    grace = HEALTH_GRACE_S if grace is None else grace
    t = time.time()
    while server.proc.poll() is None:
        if health(server.url):
            return True
        if time.time() - t >= grace:
            return False
        time.sleep(1.0)
    return False


def crash_reason(text: str) -> str | None:
    """The exception a dead server's log ends with: the first `...Error: ...` line after its last traceback (SGLang
    writes 'Scheduler hit an exception: Traceback ...' and the error, then SIGQUIT)."""
    i = text.rfind("Traceback (most recent call last)")
    m = ERROR_LINE_RE.search(text, i) if i >= 0 else None
    return m.group(0)[:400] if m else None


def free_tokens(load: dict) -> int:
    """Tokens the pool can give (free + evictable radix-cache tokens): max_total_num_tokens - num_used_tokens of
    /v1/loads (pool_stats_observer: num_used = total - available - evictable)."""
    return int(load["max_total_num_tokens"]) - int(load["num_used_tokens"])


def is_idle(load: dict) -> bool:
    """No running or waiting request (the queue counters of /v1/loads' sections are only refreshed by decode logs)."""
    return load.get("num_running_reqs", 0) == 0 and load.get("num_waiting_reqs", 0) == 0


def leaked(start: dict | None, checkpoints: list[dict]) -> int | None:
    """Tokens missing from the pool at idle checkpoints against the idle start (the worst); None unmeasured."""
    if start is None or not checkpoints:
        return None
    return max(free_tokens(start) - free_tokens(c) for c in checkpoints)


def no_leak(tokens: int | None) -> bool | None:
    """The leak check: None when the pool could not be read."""
    return None if tokens is None else tokens == 0


def get_load(api) -> dict | None:
    status, body = api.get("/v1/loads?include=core")
    if status != 200:
        return None
    loads = json.loads(body).get("loads") or []
    return loads[0] if loads else None


def wait_idle(api, timeout: float = IDLE_TIMEOUT) -> dict | None:
    """The load snapshot once the scheduler is idle (two idle readings in a row: the idle loop republishes it),
    None when /v1/loads gives nothing; raises if the server stays busy."""
    t, streak = time.time(), 0
    while time.time() - t < timeout:
        load = get_load(api)
        if load is None:
            return None
        streak = streak + 1 if is_idle(load) else 0
        if streak >= 2:
            load["idle_after_s"] = round(time.time() - t, 2)
            return load
        time.sleep(0.3)
    raise TimeoutError(f"server not idle after {timeout:.0f} s: {load}")


def flush(api) -> None:
    status, body = api.get("/flush_cache")
    if status != 200:
        raise sf.Malformed(f"/flush_cache answered {status}: {body[:200]}")


def session_pids(sid: int) -> set[int]:
    """The processes of a server's session (it starts in a session of its own: the launcher, scheduler and
    detokenizer), from /proc."""
    pids = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
            except OSError:  # gone meanwhile
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
            if int(fields[3]) == sid:
                pids.add(int(d))
    return pids


def gpu_memory_mib(sid: int | None = None) -> tuple[int | None, str]:
    """(MiB, scope): the GPU memory of a server's processes (`sid`: its session) where nvidia-smi lists them, so
    that other work on the GPU does not move it; else the whole GPU's used memory (a container whose process ids
    differ from the driver's lists none), with the scope saying which."""
    def smi(*query: str) -> list[str]:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20)
        return [x for x in out.stdout.strip().splitlines() if x.strip()]

    try:
        if sid is not None:
            mine = session_pids(sid)
            rows = [r.split(",") for r in smi("--query-compute-apps=pid,used_memory")]
            used = [int(m) for pid, m in rows if int(pid) in mine]
            if used:
                return sum(used), "server"
        return int(smi("--query-gpu=memory.used")[0]), "gpu"
    except Exception:  # noqa: BLE001 - no nvidia-smi: memory unmeasured
        return None, "none"


# --------------------------------------------------------------------------------- running requests
def burst(api, reqs: list, call=None) -> list[tuple]:
    """All requests at once (a barrier), each (answer, error text, seconds); `call(req)` sends one (api.call)."""
    call = call or api.call
    bar = threading.Barrier(len(reqs))

    def one(req):
        try:
            bar.wait(timeout=30)
        except threading.BrokenBarrierError:
            pass
        t = time.time()
        try:
            return call(req), None, time.time() - t
        except Exception as e:  # noqa: BLE001 - recorded per request
            return None, error_text(e), time.time() - t

    with cf.ThreadPoolExecutor(len(reqs)) as ex:
        return list(ex.map(one, reqs))


def alone(api, reqs: list[dict]) -> list[tuple]:
    """One at a time, after a cache flush (no KV computed under load is reused)."""
    flush(api)
    out = []
    for req in reqs:
        t = time.time()
        try:
            out.append((api.call(req), None, time.time() - t))
        except Exception as e:  # noqa: BLE001 - recorded per request
            out.append((None, error_text(e), time.time() - t))
    return out


def greedy_results(results: list[tuple], new: int, ids_only: bool = False) -> tuple[list, list, list[str]]:
    """Output ids and meta_info of greedy /generate answers checked for exactly `new` tokens; the errors. With
    `ids_only` (a server started with --skip-tokenizer-init: SGLang's BatchTokenIDOutput answers carry no text),
    an answer without text is checked as one with empty text."""
    ids, metas, errors = [], [], []
    for ans, err, _ in results:
        if ids_only and isinstance(ans, dict) and "text" not in ans:
            ans = {**ans, "text": ""}
        if err is None:
            try:
                sf.check_generate(ans, new, exact=True)
            except sf.Malformed as e:
                err = f"Malformed: {e}"
        if err is not None:
            errors.append(err)
            ids.append(None)
            metas.append(None)
        else:
            ids.append(ans["output_ids"])
            metas.append(ans["meta_info"])
    return ids, metas, errors


# ---------------------------------------------------------------------------------------- scenarios
class AfterEvent:
    """Another server's API used only once `event` is set (that server's own scenarios are done: a request from
    here must not join its alone runs or block its cache flushes)."""

    def __init__(self, api, event: threading.Event, timeout: float = 900.0):
        self.api, self.event, self.timeout = api, event, timeout

    def call(self, req: dict):
        if not self.event.wait(self.timeout):
            raise TimeoutError("the reference server's scenarios did not finish")
        return self.api.call(req)


class Session:
    """One server as the scenarios see it."""

    def __init__(self, name: str, server, ctx: dict, margin_api=None, progress_path: str | None = None):
        self.name, self.server, self.ctx = name, server, ctx
        self.progress_path = progress_path  # where a soak writes its minutes so far
        self.api = sf.Api(server.url, REQUEST_TIMEOUT)
        self.spec = name != "plain"
        # a target of a real geometry with random weights (ctx["geometry"]): ids only, greedy compared for information
        self.geometry = ctx.get("geometry")
        self.refusable = name == "dflash"  # stock DFLASH refuses log-prob requests (HTTP 400); DSPINE must not
        self.margin_api = margin_api or self.api  # a server that returns log-probs, for the near-tie rule

    def log_from(self, offset: int) -> str:
        return self.server.text()[offset:]


def s_kv_exhaustion(s: Session) -> dict:
    prompts = s.ctx["kv_prompts"]
    start = wait_idle(s.api)
    off = len(s.server.text())
    ids_only = bool(s.geometry)
    loaded = burst(s.api, [greedy_req(p, KV_NEW) for p in prompts])
    got, metas, errors = greedy_results(loaded, KV_NEW, ids_only)
    idle = wait_idle(s.api)
    log = log_stats(s.log_from(off))
    ref, ref_metas, ref_errors = greedy_results(alone(s.api, [greedy_req(p, KV_NEW) for p in prompts]), KV_NEW,
                                                ids_only)
    # random weights: no margins asked (near-flat logits, a tie nearly everywhere), the counts for information
    cmp = compare(None if s.geometry else s.margin_api, prompts, ref, got)
    retracted = [i for i, m in enumerate(metas) if m and m.get("num_retractions")]
    for m in cmp["details"]:  # a mismatch on a re-admitted request is where a lost per-request state would show
        m["retracted"] = m["index"] in retracted
    rec = {"requests": len(prompts), "errors": len(errors), "error_samples": errors[:3],
           "alone_errors": len(ref_errors), "greedy": cmp, "retracted_requests": len(retracted),
           "retracted_indices": retracted,
           "num_retractions": sum((m or {}).get("num_retractions") or 0 for m in metas), "log": log,
           "free_tokens_start": free_tokens(start) if start else None, "idle_after_s": (idle or {}).get("idle_after_s"),
           "leaked_tokens": leaked(start, [idle] if idle else []),
           "pool_tokens": start.get("max_total_num_tokens") if start else None,
           "latency_s_max": max(x[2] for x in loaded)}
    if s.spec:
        # random weights: every retracted request compared (outputs that differ at flat logits draft no worse)
        rec["accept_retracted"] = readmission_check(metas, ref_metas, got, got if s.geometry else ref, retracted)
        rec["accept_all"] = accept_check(accept_stats(metas), accept_stats(ref_metas))
    rec["checks"] = {"no_errors": not errors and not ref_errors, "retraction_seen": len(retracted) > 0,
                     "greedy_equal_or_near_tie": cmp["unexplained"] == 0, "no_leak": no_leak(rec["leaked_tokens"])}
    if s.geometry:
        del rec["checks"]["greedy_equal_or_near_tie"]
        rec["greedy_note"] = f"{s.geometry} with random weights: greedy outputs compared for information only"
    if s.spec:
        rec["checks"]["accept_after_readmission"] = bool(rec["accept_retracted"] and rec["accept_retracted"]["ok"])
    return rec


def s_graph_overflow(s: Session) -> dict:
    reqs = burst_requests(s.ctx)
    greedy_idx = [r["index"] for r in reqs if r["kind"] == "greedy"]
    prompts = [s.ctx["burst_prompts"][i] for i in greedy_idx]
    start = wait_idle(s.api)
    off = len(s.server.text())
    errors, refused, rounds = [], 0, []
    for _ in range(BURST_ROUNDS):
        ids = []
        for req, (ans, err, _) in zip(reqs, burst(s.api, [{"endpoint": r["endpoint"], "body": r["body"]}
                                                           for r in reqs])):
            if err is None:
                try:
                    out = check_burst_answer(req, ans, s.ctx["vocab_text"])
                except Exception as e:  # noqa: BLE001 - a malformed answer is an error
                    err = f"{req['kind']}: {error_text(e)}"
                    out = None
            elif s.refusable and unsupported(err):
                refused += 1
                err = None
                out = None
            else:
                err, out = f"{req['kind']}: {err}", None
            if err:
                errors.append(err)
            if req["kind"] == "greedy":
                ids.append(out)
        rounds.append(ids)
    idle = wait_idle(s.api)
    log = log_stats(s.log_from(off))
    ref, _, ref_errors = greedy_results(alone(s.api, [greedy_req(p, BURST_GREEDY_NEW) for p in prompts]),
                                        BURST_GREEDY_NEW)
    cmps = [compare(s.margin_api, prompts, ref, got) for got in rounds]
    cmp = {k: sum(c[k] for c in cmps) for k in ("compared", "mismatches", "near_tie", "unexplained")}
    cmp["details"] = [d for c in cmps for d in c["details"]]
    rec = {"requests": len(reqs) * BURST_ROUNDS, "errors": len(errors), "error_samples": errors[:5],
           "unsupported": refused, "alone_errors": len(ref_errors), "greedy": cmp, "log": log,
           "kinds": sorted({r["kind"] for r in reqs}), "leaked_tokens": leaked(start, [idle] if idle else [])}
    rec["checks"] = {"no_errors": not errors and not ref_errors, "greedy_equal_or_near_tie": cmp["unexplained"] == 0,
                     "batch_above_graphs": log["max_running_req"] > GRAPH_MAX_BS,
                     "no_leak": no_leak(rec["leaked_tokens"])}
    return rec


def s_long_prompts(s: Session) -> dict:
    ctx, api = s.ctx, s.api
    start = wait_idle(api)
    checkpoints, errors = [], []
    info = s.server.info()
    models = json.loads(api.get("/v1/models")[1])["data"]
    context_len = int(models[0].get("max_model_len") or ctx["pressure_context_len"])
    # scheduler_info's max_req_input_len: min(context - 1, pool - 1) - 5 (tp_worker.get_worker_info)
    max_input = info.get("max_req_input_len") or min(context_len - 1, int(info["max_total_num_tokens"]) - 1) - 5
    near_len = near_context_input_len(int(max_input), context_len, NEAR_NEW)
    near = near_context_prompts(ctx, near_len)
    off = len(s.server.text())
    parts = {}
    for label, prompts, new in (("long", ctx["long_prompts"], LONG_NEW), ("near_context", near, NEAR_NEW)):
        got, metas, e1 = greedy_results(burst(api, [greedy_req(p, new) for p in prompts]), new)
        checkpoints.append(wait_idle(api))
        ref, ref_metas, e2 = greedy_results(alone(api, [greedy_req(p, new) for p in prompts]), new)
        errors += e1 + e2
        parts[label] = {"prompt_tokens": [len(p) for p in prompts], "greedy": compare(s.margin_api, prompts, ref, got),
                        "accept": accept_check(accept_stats(metas), accept_stats(ref_metas)) if s.spec else None}
    # shared prefix: cold (a flush before each request) against warm (primed, then all clients at once)
    shared = ctx["shared_prompts_ids"]
    checkpoints.append(wait_idle(api))  # before the flushes, which would hide a leak
    cold = []
    for p in shared:
        cold += alone(api, [greedy_req(p, SHARED_NEW)])
    ref, ref_metas, e3 = greedy_results(cold, SHARED_NEW)
    api.call(greedy_req(shared[0], 1))
    got, metas, e4 = greedy_results(burst(api, [greedy_req(p, SHARED_NEW) for p in shared]), SHARED_NEW)
    checkpoints.append(wait_idle(api))
    errors += e3 + e4
    cached = [(m or {}).get("cached_tokens") for m in metas]
    cold_cached = [(m or {}).get("cached_tokens") for m in ref_metas]
    hits = sum((c or 0) >= ctx["shared_common"] // 2 for c in cached)
    cmp = compare(s.margin_api, shared, ref, got)
    parts["shared_prefix"] = {"common_tokens": ctx["shared_common"], "cached_tokens": cached,
                              "cold_cached_tokens": cold_cached, "hits": hits, "greedy": cmp,
                              "retracted_requests": sum(bool((m or {}).get("num_retractions")) for m in metas)}
    if s.spec:
        same = [i for i in range(len(shared)) if got[i] is not None and got[i] == ref[i]]
        parts["shared_prefix"]["accept"] = accept_check(accept_stats([metas[i] for i in same]),
                                                        accept_stats([ref_metas[i] for i in same]))
        parts["shared_prefix"]["accept_all"] = accept_check(accept_stats(metas), accept_stats(ref_metas))
    log = log_stats(s.log_from(off))
    checkpoints = [c for c in checkpoints if c]
    unexplained = sum(p["greedy"]["unexplained"] for p in parts.values())
    rec = {"requests": 2 * (LONG_PROMPTS + NEAR_PROMPTS + SHARED_CLIENTS) + 1, "errors": len(errors),
           "error_samples": errors[:3], "near_context_input_tokens": near_len, "context_len": context_len,
           "max_req_input_len": info.get("max_req_input_len"), "parts": parts, "log": log,
           "leaked_tokens": leaked(start, checkpoints)}
    rec["greedy"] = {k: sum(p["greedy"][k] for p in parts.values()) for k in ("compared", "mismatches", "near_tie",
                                                                               "unexplained")}
    rec["checks"] = {"no_errors": not errors, "greedy_equal_or_near_tie": unexplained == 0,
                     # under this pool a few clients may find the prefix evicted or be retracted
                     "radix_hits": hits >= SHARED_CLIENTS * 3 // 4 and not any(cold_cached),
                     "no_leak": no_leak(rec["leaked_tokens"])}
    if s.spec:
        acc = parts["shared_prefix"]["accept"]
        rec["checks"]["accept_warm_equals_cold"] = bool(acc and acc["ok"])
    return rec


def s_disconnects(s: Session) -> dict:
    api, ctx = s.api, s.ctx
    start = wait_idle(api)
    off = len(s.server.text())
    done = threading.Event()
    closes: list[dict] = []

    def disconnect(k: int) -> None:
        try:
            stream = api.call(sf.completion_req(ctx["greedy_prompts"][k % len(ctx["greedy_prompts"])],
                                                DISCONNECT_TOKENS, stream=True, ignore_eos=True))
            closes.append({"chunks": sf.close_after(stream, DISCONNECT_CHUNKS)})
        except Exception as e:  # noqa: BLE001 - recorded
            closes.append({"error": error_text(e)})

    def every_second() -> None:  # one new client a second, however long the earlier ones wait for chunks
        threads, k = [], 0
        while not done.wait(1.0 if k else 0.0):
            threads.append(threading.Thread(target=disconnect, args=(k,), daemon=True))
            threads[-1].start()
            k += 1
        for t in threads:
            t.join(REQUEST_TIMEOUT)

    th = threading.Thread(target=every_second, daemon=True)
    th.start()
    try:
        load = sf.mixed_load(api, ctx, DISCONNECT_SECONDS, DISCONNECT_CLIENTS, seed=7, refusable=s.refusable)
    finally:
        done.set()
        th.join(REQUEST_TIMEOUT + 5)
    idle = wait_idle(api)
    after = sf.serves_after_load(api, ctx)
    log = log_stats(s.log_from(off))
    bad_closes = [c for c in closes if "error" in c or c["chunks"] < DISCONNECT_CHUNKS]
    load.pop("records")
    rec = {"requests": load["requests"] + len(closes), "errors": load["errors"] + len(bad_closes),
           "disconnects": len(closes), "bad_disconnects": bad_closes[:3], "load": load, "after_load": after,
           "idle_after_s": (idle or {}).get("idle_after_s"), "log": log,
           "leaked_tokens": leaked(start, [idle] if idle else [])}
    rec["checks"] = {"no_errors": rec["errors"] == 0, "disconnects_every_second": len(closes) >= DISCONNECT_SECONDS - 2,
                     "no_leak": no_leak(rec["leaked_tokens"])}
    return rec


def s_soak(s: Session, seconds: float) -> dict:
    """soak.run_minutes on this server: the mixed load (serving_features' kinds) at soak.SCHEDULE's client counts,
    a minute each, the idle free KV tokens and the server's GPU memory after each minute; the minutes so far and
    their plot rewritten after each (Session.progress_path)."""
    api = s.api
    start = wait_idle(api)
    off = len(s.server.text())
    minutes = soak.schedule(max(1, math.ceil(seconds / soak.MINUTE_S)))
    alive = lambda: s.server.proc.poll() is None  # noqa: E731
    stop = threading.Event()
    samples: list = []

    def load(clients: int, secs: float, minute: int) -> list:
        stop.clear()

        def watch() -> None:  # a server that exits ends the minute's clients after their request in flight
            while not stop.wait(1.0):
                if not alive():
                    stop.set()

        threading.Thread(target=watch, daemon=True).start()
        rec = sf.mixed_load(api, s.ctx, secs, clients, seed=11 + minute, refusable=s.refusable, stop=stop)
        stop.set()
        samples.append({k: rec[k] for k in ("error_samples", "by_kind")})
        return rec["records"]

    def idle_sample() -> dict:
        load_ = wait_idle(api)
        mib, scope = gpu_memory_mib(s.server.proc.pid)
        return {"free_tokens": free_tokens(load_) if load_ else None, "gpu_mib": mib, "gpu_scope": scope}

    def progress(rows: list) -> None:
        if s.progress_path:
            soak.write_progress(s.progress_path, rows, len(minutes))

    rows, end = soak.run_minutes(minutes, load, idle_sample, lambda: get_load(api) or {}, alive, progress,
                                 answered=sf.ANSWERED)
    v = soak.verdict(rows, end["seconds"])
    errors = {}
    for x in samples:
        for k, msgs in x["error_samples"].items():
            errors.setdefault(k, []).extend(msgs[:3 - len(errors.get(k, []))])
    rec = {"requests": sum(r["requests"] for r in rows), "errors": sum(r["errors"] for r in rows),
           "unsupported": sum(r["unsupported"] for r in rows), "per_minute": rows, "verdict": v, **end,
           "schedule": minutes, "error_samples": errors, "log": log_stats(s.log_from(off)),
           "gpu_mib_scope": next((r["gpu_scope"] for r in rows if r.get("gpu_scope")), None)}
    if s.progress_path and rows:
        try:
            rec["plot"] = os.path.basename(soak.plot(rows, s.progress_path.replace(".json", ".png"),
                                                     f"{s.name} soak"))
        except Exception as e:  # noqa: BLE001 - the numbers stand without the picture
            rec["plot_error"] = error_text(e)
    if "server_exited_after_minute" in end:
        rec["checks"] = {"no_errors": rec["errors"] == 0, "lasted": False}
        return rec
    rec["leaked_tokens"] = leaked(start, [r for r in [wait_idle(api)] if r])
    rec["checks"] = {**soak.checks(v), "no_leak": no_leak(rec["leaked_tokens"])}
    return rec


# ------------------------------------------------------------------------------------- retraction
def stream_generate(api, ids: list[int], new: int) -> dict:
    """A greedy streamed /generate of exactly `new` tokens: every chunk's cumulative (completion tokens, verify
    steps, retractions) from its meta_info (SGLang sends them with each chunk), the output ids and the last
    meta_info."""
    body = {**greedy_req(ids, new)["body"], "stream": True}
    chunks, last = [], None
    with api.http.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            raise sf.HttpError(r.status_code, r.read().decode(errors="replace"))
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            last = json.loads(line[len("data:"):])
            mi = last.get("meta_info") or {}
            chunks.append((int(mi.get("completion_tokens") or 0), int(mi.get("spec_verify_ct") or 0),
                           int(mi.get("num_retractions") or 0)))
    if last is None:
        raise sf.Malformed("a stream without chunks")
    out = last.get("output_ids") or []
    if len(out) != last["meta_info"].get("completion_tokens"):
        raise sf.Malformed(f"stream ended with {len(out)} ids for {last['meta_info'].get('completion_tokens')} "
                           "tokens (incremental streaming output?)")
    return {"chunks": chunks, "output_ids": out, "meta_info": last["meta_info"]}


def split_at(chunks: list[tuple], tokens: int) -> dict | None:
    """A stream's accept length before and after the first chunk that holds `tokens` tokens: (tokens, verify
    steps) each side; the prefill's token is left out before, one token per re-admission after (a re-prefill
    emits a token without a verify step). None when the stream never reaches `tokens` or either side has no
    verify step."""
    at = next((c for c in chunks if c[0] >= tokens), None)
    if at is None or not chunks:
        return None
    end = chunks[-1]
    before = (at[0] - 1 - at[2], at[1])
    after = (end[0] - at[0] - (end[2] - at[2]), end[1] - at[1])
    if before[1] <= 0 or after[1] <= 0:
        return None
    return {"split_tokens": at[0], "before": before, "after": after}


def readmission_point(chunks: list[tuple]) -> int | None:
    """Tokens a retracted stream held when it was first retracted: the last chunk before its retraction count
    first rose (None: never retracted, or retracted before its first token)."""
    prev = None
    for c in chunks:
        if c[2] > 0:
            return prev[0] if prev else None
        prev = c
    return None


def readmission_accept(loaded: list[dict], alone: list[dict], tol: float = ACCEPT_TOL) -> dict:
    """Retracted requests' accept length after their re-admission against before it, and against the same
    request alone over the same tokens (split at the retraction point; alone at its first chunk holding as many
    tokens). After re-admission the re-prefill's token is left out (it took no verify step), so a request that
    drafts as alone reads 1/(its tokens after) below alone: under 1% for the scenario's ~200 tokens after. Only
    requests whose tokens equal their run alone are compared (a near-tie flip changes the text, and with it the
    acceptance). ok: the pooled accept length after re-admission within `tol` of alone's over the same tokens (a
    lost per-request drafting state would draw it toward 1 while the tokens before stay equal)."""
    rows, pools = [], {k: [0, 0] for k in ("before", "after", "alone_before", "alone_after")}
    for i, (a, b) in enumerate(zip(loaded, alone)):
        point = readmission_point(a["chunks"])
        if point is None or a["output_ids"] != b["output_ids"]:
            continue
        la, lb = split_at(a["chunks"], point), split_at(b["chunks"], point)
        if la is None or lb is None:
            continue
        for k, (n, v) in (("before", la["before"]), ("after", la["after"]), ("alone_before", lb["before"]),
                          ("alone_after", lb["after"])):
            pools[k][0] += n
            pools[k][1] += v
        rows.append({"index": i, "retracted_at_tokens": point, "retractions": a["chunks"][-1][2],
                     "before": la["before"][0] / la["before"][1], "after": la["after"][0] / la["after"][1],
                     "alone_after": lb["after"][0] / lb["after"][1]})
    acc = {k: (n / v if v else None) for k, (n, v) in pools.items()}
    ratio = acc["after"] / acc["alone_after"] if acc["after"] and acc["alone_after"] else None
    return {"compared": len(rows), "accept_before": acc["before"], "accept_after": acc["after"],
            "accept_alone_before": acc["alone_before"], "accept_alone_after": acc["alone_after"],
            "after_over_alone": ratio, "after_over_before": acc["after"] / acc["before"] if acc["after"] and
            acc["before"] else None, "tolerance": tol, "ok": ratio is not None and abs(ratio - 1) <= tol,
            "requests": rows}


def s_retraction(s: Session) -> dict:
    """RETRACT_CLIENTS greedy streams of RETRACT_NEW tokens at once, in rounds, until RETRACT_MIN distinct
    requests were retracted and re-admitted (or RETRACT_ROUNDS rounds); then each retracted one alone (after a
    cache flush), streamed too: readmission_accept on them. The pool's free tokens at idle against the start."""
    prompts = s.ctx["kv_prompts"][:RETRACT_CLIENTS]
    start = wait_idle(s.api)
    off = len(s.server.text())
    loaded, errors, rounds = [], [], 0
    while rounds < RETRACT_ROUNDS and sum(bool(readmission_point(x["chunks"])) for x in loaded) < RETRACT_MIN:
        rounds += 1
        for p, (out, err, _) in zip(prompts, burst(s.api, prompts, lambda p: stream_generate(s.api, p, RETRACT_NEW))):
            if err is None and len(out["output_ids"]) != RETRACT_NEW:
                err = f"{len(out['output_ids'])} tokens of {RETRACT_NEW}"
            if err is not None:
                errors.append(err)
            else:
                loaded.append({**out, "prompt": p})
    idle = wait_idle(s.api)
    retracted = [x for x in loaded if readmission_point(x["chunks"]) is not None]
    flush(s.api)
    alone_runs = []
    for x in retracted:
        try:
            alone_runs.append(stream_generate(s.api, x["prompt"], RETRACT_NEW))
        except Exception as e:  # noqa: BLE001 - recorded
            errors.append(f"alone: {error_text(e)}")
            alone_runs.append({"chunks": [], "output_ids": None})
    acc = readmission_accept(retracted, alone_runs) if s.spec else None
    rec = {"requests": len(prompts) * rounds + len(retracted), "rounds": rounds, "errors": len(errors),
           "error_samples": errors[:3], "retracted_requests": len(retracted),
           "retracted_equal_alone": sum(a["output_ids"] == b["output_ids"] for a, b in zip(retracted, alone_runs)),
           "accept_readmitted": acc, "log": log_stats(s.log_from(off)),
           "leaked_tokens": leaked(start, [idle] if idle else [])}
    rec["checks"] = {"no_errors": not errors, "retracted_enough": len(retracted) >= RETRACT_MIN,
                     "no_leak": no_leak(rec["leaked_tokens"])}
    if s.spec:
        rec["checks"]["accept_after_readmission"] = bool(acc and acc["ok"])
    return rec


SCENARIO_FNS = {"kv_exhaustion": s_kv_exhaustion, "graph_overflow": s_graph_overflow,
                "long_prompts": s_long_prompts, "disconnects": s_disconnects, "retraction": s_retraction}


def run_scenario(s: Session, name: str, soak_seconds: float = 0.0) -> dict:
    t = time.time()
    try:
        rec = s_soak(s, soak_seconds) if name == "soak" else SCENARIO_FNS[name](s)
    except Exception as e:  # noqa: BLE001 - a failing scenario is recorded and the run goes on
        rec = {"error": error_text(e), "checks": {"completed": False}}
    rec["server_alive"] = server_alive(s.server)
    if not rec["server_alive"]:
        rec["server_error"] = crash_reason(s.server.text())
    rec["checks"]["server_alive"] = rec["server_alive"]
    rec["ok"] = all(v is not False for v in rec["checks"].values())
    rec["seconds"] = round(time.time() - t, 1)
    return rec


def scenario_or_skip(s: Session, name: str, soak_seconds: float = 0.0) -> dict:
    """run_scenario, or a failed record without a request when the server is down already (the exception its log
    ends with as the reason)."""
    if not server_alive(s.server):
        why = crash_reason(s.server.text())
        return {"error": "skipped: the server is down" + (f" ({why})" if why else ""), "server_error": why,
                "checks": {"server_alive": False}, "server_alive": False, "ok": False, "seconds": 0.0}
    return run_scenario(s, name, soak_seconds)


# ------------------------------------------------------------------------------------------ summary
MINUTE_KEYS = ("minute", "clients", "requests", "errors", "rps", "p50_s", "p99_s", "used_tokens_peak", "free_tokens",
               "gpu_mib")


def explain_mismatches(scenarios: dict, server: str, scenario: str = "graph_overflow", other: str = "dflash") -> list:
    """Each greedy mismatch of `server` in `scenario`: the prompt, the first differing token, the top-2 margin there
    under the reference run (the server alone: tie_margins), whether that is a near-tie, and whether the same prompt
    differs under `other` in the same scenario (None where `other` did not run it)."""
    mine = ((scenarios.get(server) or {}).get(scenario) or {}).get("greedy") or {}
    theirs = ((scenarios.get(other) or {}).get(scenario) or {}).get("greedy")
    differs = None if theirs is None else {m["index"] for m in theirs.get("details") or []}
    return [{"index": m["index"], "position": m.get("position"), "margin": m.get("margin"),
             "near_tie": is_near_tie(m), "margin_error": m.get("margin_error"),
             f"{other}_differs": None if differs is None else m["index"] in differs}
            for m in mine.get("details") or []]


def summarize(res: dict) -> dict:
    """Per server and scenario: requests, errors, mismatches (near-ties among them, each explained), leaked tokens,
    accept length (the pressured set and its reference), retractions, failed checks; a soak's minutes and verdict.
    The run's SGLang release, backends and DSPINE variant beside."""
    out = {}
    scen = res.get("scenarios", {})
    for name in res.get("server_names", []):
        srv = res.get("servers", {}).get(name, {})
        rows = {}
        for sc, r in scen.get(name, {}).items():
            g = r.get("greedy") or {}
            acc = r.get("accept_retracted") or (r.get("parts", {}).get("shared_prefix", {}).get("accept")) \
                or r.get("accept_all")
            ra = r.get("accept_readmitted")
            if ra:
                acc = {"accept_length": ra["accept_after"], "reference": ra["accept_alone_after"]}
            load = r.get("load") or {}
            rows[sc] = {"ok": r.get("ok", False), "requests": r.get("requests"), "errors": r.get("errors"),
                        "refused_unsupported": r.get("unsupported", load.get("unsupported")),
                        "mismatches": g.get("mismatches"), "mismatches_near_tie": g.get("near_tie"),
                        "leaked_tokens": r.get("leaked_tokens"),
                        "accept_length": acc["accept_length"] if acc else None,
                        "accept_length_reference": acc["reference"] if acc else None,
                        "retracted_requests": r.get("retracted_requests", (r.get("log") or {}).get("retracted_reqs")),
                        "length_before_stop": load.get(sf.LENGTH_BEFORE_STOP),
                        "failed_checks": sorted(k for k, v in r.get("checks", {}).items() if v is False),
                        "error": r.get("error"), "server_error": r.get("server_error")}
            if g.get("details"):
                rows[sc]["mismatch_details"] = explain_mismatches(scen, name, sc)
            if ra:
                rows[sc]["accept_before_readmission"] = ra["accept_before"]
                rows[sc]["readmitted_compared"] = ra["compared"]
            if r.get("per_minute"):
                rows[sc]["per_minute"] = [{k: m.get(k) for k in MINUTE_KEYS} for m in r["per_minute"]]
                rows[sc].update({k: r.get(k) for k in ("gpu_mib_scope", "verdict", "plot", "seconds")})
        out[name] = {"up": srv.get("up", False), "start_error": srv.get("error"), "scenarios": rows,
                     "accept_length_server": srv.get("accept_length")}
    prov = res.get("provenance", {})
    return {"servers": out, "geometry": res.get("geometry"), "server_flags": res.get("server_flags", FLAGS),
            "release": res.get("release"), "backends": res.get("backends"), "variant": res.get("variant", "chain"),
            "near_tie_margin": NEAR_TIE_MARGIN, "accept_tolerance": ACCEPT_TOL,
            "commit": prov.get("commit"), "gpu": prov.get("gpu"), "date": prov.get("date"),
            "command": prov.get("command"), "wall_seconds": res.get("wall_seconds")}


ROW_KEYS = ("release", "attention", "sampling", "variant", "geometry", "server", "scenario")
RESULTS_SUMMARY = "serving_pressure_summary.json"


def result_rows(summary: dict) -> list[dict]:
    """One row per server and scenario of a run's summary, keyed by ROW_KEYS (release, backends, DSPINE variant,
    geometry, server, scenario), with the run's commit and GPU; a soak's minutes stay in its row."""
    b = summary.get("backends") or {}
    key = {"release": summary.get("release"), "attention": b.get("attention"), "sampling": b.get("sampling"),
           "variant": summary.get("variant") or "chain", "geometry": summary.get("geometry") or "pair"}
    return [{**key, "server": name, "scenario": sc, **row, "commit": summary.get("commit"), "gpu": summary.get("gpu"),
             "date": summary.get("date")}
            for name, srv in summary["servers"].items() for sc, row in srv["scenarios"].items()]


def merge_results(path: str, summary: dict) -> dict:
    """benchmarks/results/serving_pressure_summary.json with this run in it: `rows` (result_rows of every run so
    far; this run's replace those with its keys) and, for the reference run (SGLang 0.5.17, triton/pytorch, the
    chain, the pair: what docs/results.md and the headline's pressure row read), its summary at the top level
    as before. Other runs leave the top level as it was."""
    old = json.load(open(path)) if os.path.exists(path) else {}
    new = result_rows(summary)
    keys = {tuple(r[k] for k in ROW_KEYS) for r in new}
    rows = [r for r in old.get("rows", []) if tuple(r.get(k) for k in ROW_KEYS) not in keys] + new
    rows.sort(key=lambda r: tuple(str(r.get(k)) for k in ROW_KEYS))
    b = summary.get("backends") or {}
    reference = (str(summary.get("release") or "").startswith("0.5.17") and (summary.get("variant") or "chain") ==
                 "chain" and not summary.get("geometry") and (b.get("attention"), b.get("sampling")) in
                 ((None, None), ("triton", "pytorch")) and set(summary["servers"]) == set(NAMES))
    top = summary if reference or "servers" not in old else {k: v for k, v in old.items() if k != "rows"}
    merged = {**top, "rows": rows}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(merged, f, indent=1)
    os.replace(tmp, path)
    return merged


def _f(v, fmt="{}"):
    return "-" if v is None else fmt.format(v)


def print_table(summary: dict) -> None:
    print(f"\n{'server':7} {'scenario':15} {'ok':>3} {'reqs':>6} {'errs':>5} {'mism(tie)':>10} {'leak':>5} "
          f"{'accept/ref':>12} {'retracted':>9}")
    for name, srv in summary["servers"].items():
        if not srv["up"]:
            print(f"{name:7} did not start: {(srv.get('start_error') or '')[:200]}")
        for sc, r in srv["scenarios"].items():
            acc = (f"{r['accept_length']:.2f}/{r['accept_length_reference']:.2f}"
                   if r["accept_length"] is not None else "-")
            mm = f"{_f(r['mismatches'])}({_f(r['mismatches_near_tie'])})"
            print(f"{name:7} {sc:15} {'yes' if r['ok'] else 'NO':>3} {_f(r['requests']):>6} {_f(r['errors']):>5} "
                  f"{mm:>10} {_f(r['leaked_tokens']):>5} {acc:>12} {_f(r['retracted_requests']):>9}")
    for name, srv in summary["servers"].items():
        for sc, r in srv["scenarios"].items():
            if r["failed_checks"] or r["error"]:
                print(f"  {name} {sc}: failed {r['failed_checks']} {(r['error'] or '')[:240]}"
                      + (f" [server: {r['server_error'][:200]}]" if r.get("server_error") else ""))
            for m in r.get("per_minute") or []:
                print(f"  {name} {sc} minute {m['minute'] + 1}: {m['clients']} clients, {m['requests']} requests, "
                      f"{m['errors']} errors, {m['rps']} req/s, p99 {_f(m['p99_s'], '{:.2f}')} s, pool peak "
                      f"{_f(m['used_tokens_peak'])}, idle free {_f(m['free_tokens'])}, GPU {_f(m['gpu_mib'])} MiB")
            for m in r.get("mismatch_details") or []:
                if not m["near_tie"]:
                    print(f"  {name} {sc}: prompt {m['index']} differs at token {m['position']}, margin "
                          f"{_f(m['margin'], '{:.4f}')}: NOT a near-tie")


# --------------------------------------------------------------------------------------------- main
# GiB one server holds (weights, drafter, the 6144-token pool, CUDA graphs), and what each server beside it costs
# on top (CUDA context, activations): the pair's are small, Qwen3-8B's weights alone are 16.4 GB.
NEED_GIB = {"pair": 6.0, "geometry": 22.0}
OVERHEAD_GIB = 2.0
# --variant: what the DSPINE server runs (env set for it alone); see docs/verify_shapes.md for adaptive.
VARIANTS = {"chain": {}, "tree": {"SGLANG_DSPINE_TREE": "1"}, "adaptive": {"SGLANG_DSPINE_VERIFY": "adaptive"}}


def mem_fraction(card_gib: float, servers: int, need_gib: float) -> float:
    """--mem-fraction-static for `servers` servers side by side on a card of `card_gib`, each holding `need_gib`.
    SGLang (0.5.17, kv_cache_configurator._profile_available_bytes) gives weights and KV pool this fraction of the
    memory free when the server starts; the last of the servers to start finds the others' need and overhead gone.
    At most 0.88 (the rest: activations); 0.1 for the pair and 0.71 for Qwen3-8B on an H100 (80 GB), 0.24 on an
    H200, where 0.6 had been set for the H200 and would not start a third 8B server on an H100."""
    free_last = card_gib - (servers - 1) * (need_gib + OVERHEAD_GIB)
    if free_last <= need_gib:
        raise ValueError(f"{servers} servers of {need_gib} GiB do not fit a {card_gib:.0f} GiB card")
    return round(min(0.88, max(0.05, math.ceil(100 * need_gib / free_last) / 100)), 2)


def card_gib() -> float | None:
    """The GPU's memory in GiB (nvidia-smi), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout.split()
        return float(out[0]) / 1024 if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def geometry_flags(mem: float | None = None) -> list[str]:
    """FLAGS for a target of a real geometry with random weights: the same pool, graphs, chunks and admission, a
    static memory fraction for 8B weights (`mem`, else GEOMETRY_MEM_FRACTION), dummy weights and no tokenizer."""
    return with_mem(FLAGS, GEOMETRY_MEM_FRACTION if mem is None else mem) + GEOMETRY_TARGET_ARGS


def with_mem(flags: list[str], mem: float | None) -> list[str]:
    flags = list(flags)
    if mem is not None:
        flags[flags.index("--mem-fraction-static") + 1] = str(mem)
    return flags


def server_args(name: str, models: str, geometry_dirs: dict | None = None, mem: float | None = None) -> list[str]:
    """A server's arguments on the pair in `models`, or, with `geometry_dirs` (write_geometry_models), on a target
    of a real geometry with random weights and its random drafters; `mem`: the static memory fraction."""
    if geometry_dirs:
        target, flags = geometry_dirs["target"], geometry_flags(mem)
        drafter = geometry_dirs.get(name)
        flags += GEOMETRY_DRAFT_ARGS if name != "plain" else []
    else:
        target, flags, drafter = os.path.join(models, "target"), with_mem(FLAGS, mem), os.path.join(models, name)
    if name == "plain":
        return ["--model-path", target, *flags]
    algo = {"dflash": "DFLASH", "dspine": "DSPINE"}[name]
    return spec_args(target, algo, drafter, *flags)


def _scale():
    from benchmarks import serving_scale  # torch and the models' code: only where the geometry is asked for

    return serving_scale


def write_geometry_models(root: str, geometry: str, device: str) -> dict:
    """serving_scale.py's models for `geometry`: a target folder with config.json only (served with dummy weights)
    and DSpine and DFlash drafters of SpecForge's shape with random weights (the tiny shape for "tiny")."""
    scale = _scale()
    g = scale.GEOMETRIES[geometry]
    shape = scale.TINY_DRAFTER if geometry == "tiny" else scale.DRAFTER
    import shutil

    shutil.rmtree(root, ignore_errors=True)
    return {"target": scale.write_target(root, g), **scale.write_drafters(root, g, shape, device)}


def geometry_inputs(geometry: str) -> dict:
    """The memory scenario's prompts for a target without a tokenizer: KV_CLIENTS distinct prompts of random ids
    (below Qwen3's special tokens), the pair's lengths (KV_PROMPT_TOKENS, +-16)."""
    g = _scale().GEOMETRIES[geometry]
    rng = random.Random(0)
    top = min(g["vocab_size"], 151643)
    kv = [[rng.randrange(1, top) for _ in range(KV_PROMPT_TOKENS + (i % 5 - 2) * 8)] for i in range(KV_CLIENTS)]
    return {"geometry": geometry, "kv_prompts": kv, "context_len": g["max_position_embeddings"]}


def warm_up(url: str, ctx: dict) -> float:
    """serving_features' warm-up on the pair; on a geometry target (ids only) the harness' burst (servers.warm_up)
    of 16 short requests on its prompts."""
    if not ctx.get("geometry"):
        return sf.warm_up(url, ctx)
    api = sf.Api(url, _servers.WARM_UP_TIMEOUT)
    return _servers.warm_up(lambda body: api.call({"endpoint": "/generate", "body": body}), ctx["kv_prompts"], 16, 16)


def publish(results_dir: str, summary: dict, out: str) -> None:
    """The run into results_dir/serving_pressure_summary.json (merge_results) and a soak's plot beside it."""
    os.makedirs(results_dir, exist_ok=True)
    merge_results(os.path.join(results_dir, RESULTS_SUMMARY), summary)
    for srv in summary["servers"].values():
        plot = (srv["scenarios"].get("soak") or {}).get("plot")
        if plot and os.path.exists(os.path.join(out, plot)):
            import shutil

            shutil.copyfile(os.path.join(out, plot), os.path.join(results_dir, plot))


def output_names(tag: str) -> dict:
    """The result files of a run: serving_pressure.json, its summary and the logs' archive, or with a tag (a
    geometry run, a separate soak) serving_pressure_TAG.json and so on, so that runs do not overwrite each other."""
    base = "serving_pressure" + (f"_{tag}" if tag else "")
    return {"json": base + ".json", "summary": base + "_summary.json", "logs": base + "_logs.tar.gz"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sf.add_pair_args(ap)
    ap.add_argument("--scenarios", default=None,
                    help=f"comma-separated of {','.join(SCENARIOS)} (default: all; soak only with --soak-seconds)")
    ap.add_argument("--soak-seconds", type=float, default=0.0, help="0: no soak; 1200 for 20 minutes")
    ap.add_argument("--geometry", default="pair", choices=("pair", *sorted(_scale().GEOMETRIES)),
                    help="pair: the built-in pair (--models); else a target of that geometry with random weights "
                         "and random drafters (serving_scale.py's), memory scenario only (kv_exhaustion)")
    ap.add_argument("--work", default="/tmp/serving_pressure_models", help="where a geometry's models are written")
    ap.add_argument("--port-offset", type=int, default=0,
                    help="added to every server's port, for a run beside another on the same machine (a soak)")
    ap.add_argument("--tag", default=None,
                    help="results named serving_pressure_TAG*.json (default: none on the pair, the geometry's name)")
    ap.add_argument("--variant", default="chain", choices=sorted(VARIANTS),
                    help="the DSPINE server's step: chain, tree (SGLANG_DSPINE_TREE=1), adaptive verification "
                         "(SGLANG_DSPINE_VERIFY=adaptive)")
    ap.add_argument("--mem-fraction", default="auto",
                    help="every server's --mem-fraction-static; auto: from the card's memory (mem_fraction)")
    ap.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for every server (e.g. SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS=20)")
    _servers.add_backend_args(ap)
    args = ap.parse_args(argv)
    geometry = None if args.geometry == "pair" else args.geometry
    tag = (geometry or "") if args.tag is None else args.tag
    if geometry:
        names, models = [n for n in args.servers.split(",") if n], None
        if not names or set(names) - set(NAMES):
            raise SystemExit(f"--servers: choose from {','.join(NAMES)}")
    else:
        names, models = sf.servers_and_models(args.servers, args.models)
    allowed = GEOMETRY_SCENARIOS if geometry else SCENARIOS
    env = dict(x.split("=", 1) for x in args.server_env)
    backends = _servers.backends_from_args(args)
    base = _servers.base_args(backends["attention"], backends["sampling"])
    scenarios = [x for x in (args.scenarios or ",".join(allowed)).split(",") if x]
    if set(scenarios) - set(allowed):
        raise SystemExit(f"--scenarios: choose from {','.join(allowed)}"
                         + (f" (--geometry {geometry}: the memory scenario)" if geometry else ""))
    if args.soak_seconds <= 0:
        if args.scenarios and "soak" in scenarios:
            raise SystemExit("--scenarios soak needs --soak-seconds > 0")
        scenarios = [x for x in scenarios if x != "soak"]
    if args.smoke:
        return smoke_geometry(args.work) if geometry else smoke(models)

    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    files = output_names(tag)
    gib = card_gib()
    mem = (None if gib is None else mem_fraction(gib, len(names), NEED_GIB["geometry" if geometry else "pair"])) \
        if args.mem_fraction == "auto" else float(args.mem_fraction)
    from importlib.metadata import version
    dirs = None
    if geometry:
        import torch

        dirs = write_geometry_models(args.work, geometry, "cuda" if torch.cuda.is_available() else "cpu")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the drafters were made on the GPU: leave its memory to the servers
        print(f"{geometry} models written in {time.time() - t0:.0f} s", flush=True)
        ctx = geometry_inputs(geometry)
    else:
        from transformers import AutoTokenizer

        ctx = build_inputs(AutoTokenizer.from_pretrained(os.path.join(models, "target")), models)
    res = {"provenance": provenance(sys.argv if argv is None else ["serving_pressure.py", *argv]),
           "geometry": geometry, "server_names": names, "scenario_names": scenarios,
           "server_flags": geometry_flags(mem) if geometry else with_mem(FLAGS, mem), "base_flags": base,
           "release": version("sglang"), "variant": args.variant, "server_env": env, "card_gib": gib,
           "backends": {k: v or _servers.SGLANG_DEFAULT for k, v in backends.items()},
           "soak_seconds": args.soak_seconds, "near_tie_margin": NEAR_TIE_MARGIN, "accept_tolerance": ACCEPT_TOL,
           "inputs": {"kv_prompt_tokens": [len(p) for p in ctx["kv_prompts"]],
                      "long_prompt_tokens": [len(p) for p in ctx.get("long_prompts", [])],
                      "shared_common_tokens": ctx.get("shared_common"), "context_len": ctx["context_len"]},
           "servers": {}, "scenarios": {}, "timeline": {}}
    guard = threading.RLock()  # every change to `res` and every save: the servers' phases run in threads

    def save() -> None:
        with guard:
            res["wall_seconds"] = round(time.time() - t0, 1)
            summary = summarize(res)
            json.dump(res, open(os.path.join(args.out, files["json"]), "w"), indent=1)
            json.dump(summary, open(os.path.join(args.out, files["summary"]), "w"), indent=1)

    def stamp(what: str) -> None:
        with guard:
            res["timeline"][what] = round(time.time() - t0, 1)
            save()
        print(f"[{time.time() - t0:6.1f} s] {what}", flush=True)

    prebuild = None
    if "dflash" in names and not args.no_prebuild:
        prebuild = _servers.start_prebuild(args.out)
    servers: dict = {}

    def bring_up(name: str) -> bool:
        s = servers[name]
        rec = s.start_record(480)
        ok = rec["up"]
        with guard:
            res["servers"][name] = rec
        stamp(f"{name} up after {s.up_after:.0f} s" if ok else f"{name} did NOT start:\n{s.tail(40)}")
        return ok

    done = {n: threading.Event() for n in NAMES}

    def start(name: str) -> Server:
        return Server(name, PORTS[name] + args.port_offset, server_args(name, models, dirs, mem), args.out,
                      env={**env, **(VARIANTS[args.variant] if name == "dspine" else {})}, base_args=base)

    def phase(name: str) -> None:
        try:
            _phase(name)
        finally:
            done[name].set()

    def _phase(name: str) -> None:
        if not res["servers"].get(name, {}).get("up") and not bring_up(name):
            return
        try:
            warm = {"warm_up_seconds": warm_up(servers[name].url, ctx)}
        except Exception as e:  # noqa: BLE001 - recorded; the scenarios still run
            warm = {"warm_up_error": error_text(e)}
        with guard:
            res["servers"][name].update(warm)
        margin_api = None
        if name == "dflash" and "plain" in servers:  # DFLASH refuses log-probs
            margin_api = AfterEvent(sf.Api(servers["plain"].url, REQUEST_TIMEOUT), done["plain"])
        minutes = os.path.join(args.out, files["json"][:-len(".json")] + f"_{name}_soak_minutes.json")
        sess = Session(name, servers[name], ctx, margin_api, progress_path=minutes)
        for sc in scenarios:
            rec = scenario_or_skip(sess, sc, args.soak_seconds)
            with guard:
                res["scenarios"].setdefault(name, {})[sc] = rec
            stamp(f"{name} {sc}: {'ok' if rec['ok'] else 'FAILED'} ({rec.get('seconds', 0)} s)"
                  + (f" {rec['error'][:300]}" if rec.get("error") else ""))
        try:
            info = servers[name].info()
            with guard:
                res["servers"][name]["accept_length"] = next((x.get("avg_spec_accept_length")
                                                              for x in info.get("internal_states", [])), None)
                res["servers"][name]["server_info"] = {k: info.get(k) for k in (
                    "max_total_num_tokens", "max_req_input_len", "chunked_prefill_size", "cuda_graph_max_bs",
                    "schedule_conservativeness", "speculative_algorithm", "speculative_num_draft_tokens")}
                res["servers"][name]["memory"] = servers[name].memory()
        except Exception as e:  # noqa: BLE001 - information only
            with guard:
                res["servers"][name]["server_info_error"] = error_text(e)

    try:
        order = [n for n in NAMES if n in names]
        first = order[0]  # alone, so the kernel builds are cached for the others
        servers[first] = start(first)
        if not bring_up(first):
            with guard:
                for n in order[1:]:
                    res["servers"][n] = {"up": False, "error": f"not started: {first} did not start"}
        else:
            for n in order[1:]:
                servers[n] = start(n)
            with cf.ThreadPoolExecutor(len(order)) as ex:
                futs = {n: ex.submit(phase, n) for n in order}
                for n, f in futs.items():
                    try:
                        f.result()
                    except Exception as e:  # noqa: BLE001 - one server's fault leaves the others
                        with guard:
                            res["servers"].setdefault(n, {})["phase_error"] = error_text(e)
                        stamp(f"{n} phase FAILED: {error_text(e)}")
        for n, s in servers.items():
            with guard:
                res["servers"].setdefault(n, {})["log_totals"] = log_stats(s.text())
    finally:
        for s in servers.values():
            s.stop()
        if prebuild is not None and prebuild.poll() is None:
            os.killpg(prebuild.pid, 15)
        save()
        archive_logs(args.out, files["logs"])
        if args.results_dir:
            publish(args.results_dir, summarize(res), args.out)
    print_table(summarize(res))
    return 0


# -------------------------------------------------------------------------------------- CPU self-test
RETRACT_SOURCE = ('"KV cache pool is full. Retract requests. "',
                  'f"#retracted_reqs: {len(retracted_reqs)}, #new_tokens_gained: {new_token_gained}"')


def retract_line(n: int, gained: int = 300) -> str:
    """A retraction warning as scheduler.update_running_batch writes it (its pieces: RETRACT_SOURCE)."""
    return (f"[2026-01-01 00:00:00] WARNING scheduler.py:3450: KV cache pool is full. Retract requests. "
            f"#retracted_reqs: {n}, #new_tokens_gained: {gained}, #new_token_ratio: 0.2100 -> 0.9000")


def check_sglang_formats() -> None:
    """The SGLang text this run parses is still what 0.5.17 writes: the retraction warning, the leak warning, the
    decode line's running count, and /v1/loads' core keys from its LoadSnapshot."""
    import inspect

    from sglang.srt.managers import scheduler
    from sglang.srt.managers.load_snapshot import LoadSnapshot
    from sglang.srt.managers.scheduler_components import invariant_checker, metrics_reporter

    src = inspect.getsource(scheduler.Scheduler.update_running_batch)
    for piece in RETRACT_SOURCE:
        assert piece in src, f"scheduler.update_running_batch no longer writes {piece}"
    assert f'f"{{pool_name}} {LEAK_MARK}!' in inspect.getsource(invariant_checker), "leak warning changed"
    assert 'f"Decode batch{iter_msg}, #running-req: {num_running_reqs}' in inspect.getsource(metrics_reporter)
    d = LoadSnapshot(num_used_tokens=10, max_total_num_tokens=POOL_TOKENS).to_dict({"core"})
    assert free_tokens(d) == POOL_TOKENS - 10 and is_idle(d)


def check_flags(models: str | None, geometry_dirs: dict | None = None) -> None:
    """Every server's command line parses with SGLang's parser (DSPINE registers at server start, so its line is
    parsed with DFLASH's name); a geometry's lines with dummy weights, no tokenizer, the drafters' safetensors."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for name in NAMES:
        line = [a if a != "DSPINE" else "DFLASH" for a in server_args(name, models, geometry_dirs)]
        p = parser.parse_args([*BASE_ARGS, "--port", "1", *line])
        assert (p.max_total_tokens, p.cuda_graph_max_bs_decode, p.chunked_prefill_size) == (
            POOL_TOKENS, GRAPH_MAX_BS, CHUNK), p
        assert p.schedule_conservativeness == CONSERVATIVENESS and p.enable_cache_report
        if geometry_dirs:
            assert (p.load_format, p.skip_tokenizer_init, p.mem_fraction_static) == (
                "dummy", True, GEOMETRY_MEM_FRACTION), p
            assert p.model_path == geometry_dirs["target"]
            if name != "plain":
                assert (p.speculative_draft_model_path, p.speculative_draft_load_format) == (
                    geometry_dirs[name], "safetensors"), p


def spec_meta(completion: int, verify: int, correct: int, retractions: int = 0, draft_tokens: int = 16) -> dict:
    """meta_info of a finished request as SGLang's tokenizer manager fills it (its own spec-metrics code)."""
    from types import SimpleNamespace

    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    meta = {"completion_tokens": completion, "num_retractions": retractions}
    recv = SimpleNamespace(spec_verify_ct=[verify], spec_num_correct_drafts=[correct], completion_tokens=[completion],
                           spec_correct_drafts_histogram=None)
    me = SimpleNamespace(server_args=SimpleNamespace(speculative_num_draft_tokens=draft_tokens))
    TokenizerManager._calculate_spec_decoding_metrics(me, meta, recv, 0)
    return meta


def smoke(models: str) -> int:
    from transformers import AutoTokenizer

    t = time.time()
    ctx = build_inputs(AutoTokenizer.from_pretrained(os.path.join(models, "target")), models)
    kv = [len(p) for p in ctx["kv_prompts"]]
    assert len(set(map(tuple, ctx["kv_prompts"]))) == KV_CLIENTS and 270 <= min(kv) and max(kv) <= 330, kv
    assert KV_CLIENTS * (sum(kv) / len(kv) + KV_NEW) > 3 * POOL_TOKENS
    assert min(map(len, ctx["long_prompts"])) >= LONG_MIN_TOKENS and ctx["shared_common"] >= SHARED_PREFIX_TOKENS
    near = near_context_input_len(ctx["context_len"] - 6, ctx["context_len"], NEAR_NEW)
    assert near + NEAR_NEW <= ctx["context_len"] and near + NEAR_NEW + 32 < POOL_TOKENS
    print(f"inputs: {KV_CLIENTS} prompts of {min(kv)}-{max(kv)} tokens, long {[len(p) for p in ctx['long_prompts']]}, "
          f"shared prefix {ctx['shared_common']} tokens x {SHARED_CLIENTS}, near-context prompt {near} tokens")
    vocab = len(ctx["vocab_text"])
    reqs = [greedy_req(ctx["kv_prompts"][0], KV_NEW), greedy_req(near_context_prompts(ctx, near)[0], NEAR_NEW)]
    reqs += [{"endpoint": r["endpoint"], "body": r["body"]} for r in burst_requests(ctx)]
    for r in reqs:
        sf.validate_request(r, vocab)
    print(f"requests: {len(reqs)} bodies valid for SGLang's request models")
    check_flags(models)
    check_sglang_formats()
    print("flags parse with SGLang's parser; SGLang's log and load formats are the ones read here")
    log = "\n".join([retract_line(3), retract_line(2), "Decode batch, #running-req: 40, #token: 9, token usage: "
                     "0.50, cuda graph: False, gen throughput (token/s): 1.00, #queue-req: 0"])
    st = log_stats(log)
    assert (st["retract_events"], st["retracted_reqs"], st["max_running_req"], st["cuda_graph_false"]) == (2, 5, 40, 1)
    m = spec_meta(128, 64, 60, retractions=1)
    a = accept_stats([m])
    assert a["accept_length"] == (128 - 2) / 64 and a["sglang_accept_length"] == 2.0
    ref, got = [[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]
    mm = greedy_mismatches(ref, got)
    mm[0].update(top1=[5, -0.50], top2=[9, -0.53], margin=0.03, ref_token=5, got_token=9)
    assert mismatch_counts(mm, 2)["near_tie"] == 1
    load = {"max_total_num_tokens": POOL_TOKENS, "num_used_tokens": 0}
    assert leaked(load, [{**load, "num_used_tokens": 17}]) == 17
    rows = [soak.minute_row(m, 4, [(0.5, 1.0, "greedy", "ok"), (1.0, 2.0, "greedy", o)], 60.0, sf.ANSWERED)
            for m, o in enumerate(("ok", "errors"))]
    assert [r["errors"] for r in rows] == [0, 1] and soak.verdict(rows, 120.0)["no_errors"] is False
    res = {"server_names": list(NAMES), "provenance": {"commit": "smoke"}, "servers": {n: {"up": True} for n in NAMES},
           "scenarios": {n: {"kv_exhaustion": {"ok": True, "requests": 48, "errors": 0, "leaked_tokens": 0,
                                               "greedy": mismatch_counts(mm, 48), "retracted_requests": 9,
                                               "accept_retracted": accept_check(a, a), "checks": {}}}
                         for n in NAMES}}
    s = summarize(res)
    assert s["servers"]["dspine"]["scenarios"]["kv_exhaustion"]["mismatches_near_tie"] == 1
    print_table(s)
    print(f"smoke ok in {time.time() - t:.0f} s")
    return 0


def smoke_geometry(work: str) -> int:
    """CPU: the tiny geometry's models written by serving_scale's code (the GPU run writes qwen3-8b's), the
    memory scenario's ids-only prompts for qwen3-8b, every server's flags through SGLang's parser with those
    folders, and an answer without text (SGLang's --skip-tokenizer-init) read as ids."""
    t = time.time()
    dirs = write_geometry_models(os.path.join(work, "smoke"), "tiny", "cpu")
    for name in NAMES:
        folder = dirs["target"] if name == "plain" else dirs[name]
        assert os.path.isfile(os.path.join(folder, "config.json")), folder
    ctx = geometry_inputs("qwen3-8b")
    kv = [len(p) for p in ctx["kv_prompts"]]
    assert len(set(map(tuple, ctx["kv_prompts"]))) == KV_CLIENTS and KV_CLIENTS * (sum(kv) / len(kv) + KV_NEW) > \
        3 * POOL_TOKENS
    check_flags(None, dirs)
    ans = {"output_ids": list(range(KV_NEW)), "meta_info": {"finish_reason": {"type": "length"},
                                                            "completion_tokens": KV_NEW}}
    ids, _, errors = greedy_results([(ans, None, 0.1)], KV_NEW, ids_only=True)
    assert ids == [list(range(KV_NEW))] and not errors, errors
    print(f"geometry: models in {dirs['target']}, {KV_CLIENTS} random prompts of {min(kv)}-{max(kv)} ids, flags "
          f"parse with SGLang's parser, id-only answers read; smoke ok in {time.time() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

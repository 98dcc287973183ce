#!/usr/bin/env python3
"""Request conformance of SGLang servers without speculation ("plain"), with DFLASH and with DSPINE (GPU).

The built-in pair (models/default: target/, dflash/, dspine/) served side by side on one GPU, every server with
`servers.BASE_ARGS` and FLAGS below (xgrammar, 64-token prefill chunks, CUDA graphs up to 48, 0.1 of the GPU's
memory each). The plain server starts first, alone, so the kernel builds are cached; DFLASH and DSPINE then
start together while the plain server's features run. FlashInfer's sampling module, which stock DFLASH's
verify builds at its first batch mixing greedy and sampled requests (a ~2 minute stall), is built beforehand
in a separate process while the plain server starts.

Each server gets every feature in FEATURES, each isolated (a failure is recorded with its error text and the
run goes on), after a 48-request warm-up burst mixing greedy and T=1 requests. Then the three servers get a
48-client mixed load of all the request kinds at the same time (one client process per server: the servers
are independent processes), then one request each to show they still serve.

Against plain: the greedy texts (bf16 near-ties may flip a few: counted, not failed), and the log-probs of
greedy requests on the positions before the first token the two servers emit differently (same prompt): the
largest absolute difference of the emitted token's log-prob and of the top-5 log-probs matched by token id.

The pass/fail of each check and server (`verdict`: the server's start, each feature, the request after the load,
no error in the mixed load, greedy tokens equal to plain's but at near-ties) is a pytest test marked `gpu`:
tests/test_serving_conformance.py, whose session fixture runs `Conformance` (the run above) once. This script
runs that file under pytest with its arguments (SERVING_FEATURES_ARGS) and exits 1 only when a server did not
start or the tests did not run: failed checks are results (reported by pytest, in the summary).

Usage on the GPU machine (repo root, carry .devbundle): `GIT_COMMIT=<hash> bash scripts/device/run.sh features`.
Results: $OUT/serving_features.json (everything), $OUT/serving_features_summary.json (also written to
benchmarks/results/ on that machine), the tests' report in $OUT/serving_features_tests.xml (JUnit), the servers'
logs in $OUT/serving_features_logs.tar.gz.
`--smoke` (CPU, no servers): the inputs from the real tokenizer, the grammars through xgrammar, every request
body against SGLang's request models, the response checks and the log-prob comparison on responses built with
SGLang's response classes, and the summary.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time

from sglang_dspine.provenance import provenance
from sglang_dspine.source_files import OUTSIDE_REPO, as_package, load_package
from sglang_dspine.training.jsonl import read_jsonl

if not __package__:  # run as a file (python benchmarks/x.py) or loaded by its path: the package `benchmarks` first
    as_package(__file__)

from benchmarks import servers as _servers  # noqa: E402

BASE_ARGS, Server, archive_logs, graph_use, spec_args = (
    _servers.BASE_ARGS, _servers.Server, _servers.archive_logs, _servers.graph_use, _servers.spec_args
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("plain", "dflash", "dspine")
PORTS = {"plain": 31001, "dflash": 31002, "dspine": 31003}
FLAGS = ["--grammar-backend", "xgrammar", "--chunked-prefill-size", "64", "--cuda-graph-max-bs-decode", "48",
         "--mem-fraction-static", "0.1", "--disable-prefill-cuda-graph",
         # usage.prompt_tokens_details.cached_tokens in OpenAI answers (the radix-cache check reads it)
         "--enable-cache-report",
         # JSON output without free whitespace: a small model may otherwise emit whitespace until max_tokens
         "--constrained-json-disable-any-whitespace"]
MODEL = "default"
CHUNK = 64  # --chunked-prefill-size
TOP_K = 5
GREEDY_MAX = 48
LP_MAX = 24
EXACT_MAX_TOKENS = (1, 2, 3, 5, 7)  # all below the drafters' block of 16
LONG_MIN_TOKENS = 8 * CHUNK
PREFIX_MIN_TOKENS = 6 * CHUNK
ABORT_MAX_TOKENS = 2000
# Seconds one request may take: a few on these tiny models; a request past it means a stuck server.
REQUEST_TIMEOUT = 30.0
REGEX = r"(Yes|No), because [a-z]{2,10}( [a-z]{2,10}){0,3}\."
JSON_SCHEMA = {
    "type": "object",
    # a pattern, not just a length: a JSON string may not hold raw control characters (a tab, say), which
    # the grammar of a bare string lets a model emit
    "properties": {"name": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9 _-]{0,11}$"},
                   "count": {"type": "integer", "minimum": 0, "maximum": 999},
                   "valid": {"type": "boolean"},
                   "kind": {"enum": ["code", "math", "prose"]}},
    "required": ["name", "count", "valid", "kind"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": JSON_SCHEMA}}
SAMPLING_VARIANTS = {
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "top_k": {"temperature": 0.8, "top_k": 20},
    "min_p": {"temperature": 0.8, "min_p": 0.1},
    "presence_penalty": {"temperature": 0.8, "presence_penalty": 0.5},
    "frequency_penalty": {"temperature": 0.8, "frequency_penalty": 0.5},
    "repetition_penalty": {"temperature": 0.8, "repetition_penalty": 1.2},
    "all": {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "presence_penalty": 0.3,
            "frequency_penalty": 0.3, "repetition_penalty": 1.1},
    # greedy with penalties: the texts are compared with plain's (penalties applied inside verification)
    "greedy_repetition_penalty": {"temperature": 0.0, "repetition_penalty": 1.3},
    "greedy_frequency_penalty": {"temperature": 0.0, "frequency_penalty": 0.8},
}
LOAD_STOPS = ("\n", ".", " the", "(", ",")
LENGTH_BEFORE_STOP = "sglang_length_before_stop"  # a load outcome: see _load_stop
SHARED_ENDINGS = ("Summarise the text above in one sentence.", "What is the main point of the text above?",
                  "List three words from the text above.", "Rewrite the first sentence above.",
                  "Is the text above about code? Answer briefly.", "Give the text above a title.",
                  "What comes next after the text above?", "Name one person or thing in the text above.")
# Parameters the OpenAI client takes by name; everything else in a body travels in `extra_body`.
OPENAI_ARGS = {
    "/v1/completions": {"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "logprobs",
                        "presence_penalty", "frequency_penalty", "seed", "stream_options"},
    "/v1/chat/completions": {"model", "messages", "max_tokens", "temperature", "top_p", "n", "stream", "stop",
                             "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
                             "response_format", "seed", "stream_options"},
}


class Malformed(Exception):
    """An answer that came back (2xx) but does not do what the request asked."""


class HttpError(Exception):
    def __init__(self, status: int, body: str):
        self.status = status
        try:
            err = json.loads(body)
            err = err.get("error", err) if isinstance(err, dict) else err
            self.message = err.get("message", body) if isinstance(err, dict) else str(err)
        except (json.JSONDecodeError, AttributeError):
            self.message = body
        super().__init__(f"HTTP {status}: {self.message}")


def status_of(e: Exception) -> int | None:
    import openai

    if isinstance(e, openai.APIStatusError):
        return e.status_code
    if isinstance(e, HttpError):
        return e.status
    return None


def error_text(e: Exception) -> str:
    import openai

    if isinstance(e, openai.APIStatusError):
        body = e.body if isinstance(e.body, dict) else {}
        return f"HTTP {e.status_code}: {body.get('message') or e.message}"[:700]
    if isinstance(e, HttpError):
        return f"HTTP {e.status}: {e.message}"[:700]
    return f"{type(e).__name__}: {e}"[:700]


# ------------------------------------------------------------------------------------------- inputs
def read_suites(folder: str) -> dict[str, list[str]]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".heldout.jsonl"):
            out[f.split(".")[0]] = [r["prompt"] for r in read_jsonl(os.path.join(folder, f))]
    if not out:
        raise SystemExit(f"{folder}: no *.heldout.jsonl prompt files")
    return out


def common_prefix_len(a: list, b: list) -> int:
    return len(os.path.commonprefix([a, b]))  # element-wise on any sequences, not only strings


def build_inputs(tokenizer, models: str) -> dict:
    """Every prompt the run sends (chat template applied, as the pair was trained), the context length, and the
    text of every vocabulary id as SGLang decodes it for log-probs (one id at a time, special tokens kept), and
    as /v1/completions reports it (completion_token_texts)."""
    suites = read_suites(os.path.join(models, "suites"))
    cfg = json.load(open(os.path.join(models, "target", "config.json")))
    context_len, vocab = int(cfg["max_position_embeddings"]), int(cfg["vocab_size"])
    for name in ("code", "math", "prose"):
        if len(suites.get(name, [])) < 8:
            raise SystemExit(f"{models}/suites: want 8 prompts or more in {name}.heldout.jsonl")

    def chat_text(content: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def joined(texts: list[str], min_tokens: int, what: str) -> str:
        out = ""
        for t in texts:
            out = f"{out}\n\n{t}" if out else t
            if len(ids(out)) >= min_tokens:
                return out
        raise SystemExit(f"{models}/suites: {what} reaches only {len(ids(out))} tokens (want {min_tokens})")

    raw = [suites[s][i] for i in range(4) for s in ("code", "math", "prose")]
    chat_messages = [[{"role": "user", "content": t}] for t in raw[:4]]
    long_text = joined(suites["code"][4:] + suites["math"][4:], LONG_MIN_TOKENS + 64, "the long prompt")
    prefix = joined(suites["prose"][4:] + suites["math"][4:], PREFIX_MIN_TOKENS + 64, "the shared prefix")
    shared = [chat_text(f"{prefix}\n\n{e}") for e in SHARED_ENDINGS]
    shared_ids = [ids(p) for p in shared]
    filler = ids("\n\n".join(t for s in suites.values() for t in s))
    over = [filler[i % len(filler)] for i in range(context_len + 64)]
    vocab_text = tokenizer.batch_decode([[i] for i in range(vocab)])
    return {
        "greedy_prompts": [chat_text(t) for t in raw],
        "lp_prompts": [chat_text(t) for t in raw[:4]],
        "chat_messages": chat_messages,
        "chat_prompt_tokens": [len(ids(tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)))
                               for m in chat_messages],
        "json_messages": [{"role": "user", "content": raw[2] + "\n\nDescribe one item of the text above as JSON: "
                                                               "its name, a count, whether it is valid and its kind."}],
        "regex_prompt": chat_text(raw[1] + "\n\nIs this correct? Answer yes or no, and say why."),
        "long_prompt": chat_text(long_text),
        "long_prompt_tokens": len(ids(chat_text(long_text))),
        "shared_prompts": shared,
        "shared_common_tokens": min(common_prefix_len(shared_ids[0], s) for s in shared_ids[1:]),
        "over_context_ids": over,
        "context_len": context_len,
        "vocab_text": vocab_text,
        "completion_token_text": completion_token_texts(tokenizer, vocab_text),
        "sglang_length_first": sglang_checks_length_first(),
    }


def completion_token_texts(tokenizer, vocab_text: list[str]) -> list[str]:
    """The token text /v1/completions log-probs carry for each id, made by the installed SGLang's own conversion
    (utils.to_openai_style_logprobs, given the tokenizer where it takes one, as serving_completions does). The
    servers run this SGLang: servers.Server launches them with this Python. A partial UTF-8 byte of a byte-level
    BPE token decodes to U+FFFD: 0.5.17 reports that (vocab_text, the same text for every such id); 0.5.23
    reports the token's raw bytes as latin-1, one character per byte (utils._lossless_token_text), a text of
    that id alone. Other ids: vocab_text on both."""
    return completion_logprobs([(0.0, i, t) for i, t in enumerate(vocab_text)], None, tokenizer).tokens


def completion_logprobs(token_logprobs: list, top_logprobs: list | None, tokenizer):
    """SGLang's LogProbs of a /v1/completions answer from /generate's (log-prob, id, text) triples: the
    installed SGLang's utils.to_openai_style_logprobs, given the tokenizer where it takes one (0.5.23), as
    serving_completions calls it."""
    import inspect

    from sglang.srt.entrypoints.openai.utils import to_openai_style_logprobs

    kw = {"tokenizer": tokenizer} if "tokenizer" in inspect.signature(to_openai_style_logprobs).parameters else {}
    return to_openai_style_logprobs(output_token_logprobs=token_logprobs, output_top_logprobs=top_logprobs, **kw)


def text_to_id(vocab_text: list[str]) -> dict[str, int]:
    """Token text -> id for the texts only one id decodes to (OpenAI top log-probs are keyed by text)."""
    seen: dict[str, int] = {}
    dup = set()
    for i, t in enumerate(vocab_text):
        if t in seen:
            dup.add(t)
        seen[t] = i
    return {t: i for t, i in seen.items() if t not in dup}


# ----------------------------------------------------------------------------------------- requests
def completion_req(prompt, max_tokens: int, temperature: float = 0.0, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, **extra}
    if not body.get("stream"):
        body["return_token_ids"] = True  # the emitted ids, to check log-prob entries against
    return {"endpoint": "/v1/completions", "body": body}


def chat_req(messages, max_tokens: int, temperature: float = 0.0, **extra) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": temperature, **extra}
    if not body.get("stream"):
        body["return_token_ids"] = True
    return {"endpoint": "/v1/chat/completions", "body": body}


def generate_req(prompt, max_new: int, temperature: float = 0.0, logprobs: bool = False, **sampling) -> dict:
    sp = {"max_new_tokens": max_new, "temperature": temperature, **sampling}
    body = {"text" if isinstance(prompt, str) else "input_ids": prompt, "sampling_params": sp}
    if logprobs:
        body.update(return_logprob=True, top_logprobs_num=TOP_K)
    return {"endpoint": "/generate", "body": body}


def split_openai(endpoint: str, body: dict) -> tuple[dict, dict]:
    known = OPENAI_ARGS[endpoint]
    return {k: v for k, v in body.items() if k in known}, {k: v for k, v in body.items() if k not in known}


def dump(resp) -> dict:
    """An OpenAI client object as the JSON the server sent (extra fields such as token_ids included)."""
    return resp.model_dump() if hasattr(resp, "model_dump") else resp


class Api:
    """One server's endpoints: OpenAI ones through the OpenAI client, /generate through httpx."""

    def __init__(self, url: str, timeout: float = REQUEST_TIMEOUT):
        import httpx
        import openai

        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=timeout, trust_env=False, limits=limits)
        self.oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout,
                                http_client=httpx.Client(timeout=timeout, trust_env=False, limits=limits))

    def call(self, req: dict):
        endpoint, body = req["endpoint"], req["body"]
        if endpoint == "/generate":
            r = self.http.post(endpoint, json=body)
            if r.status_code != 200:
                raise HttpError(r.status_code, r.text)
            return r.json()
        named, extra = split_openai(endpoint, body)
        create = self.oa.completions.create if endpoint == "/v1/completions" else self.oa.chat.completions.create
        return create(**named, extra_body=extra or None)

    def get(self, path: str) -> tuple[int, str]:
        r = self.http.get(path)
        return r.status_code, r.text


# ------------------------------------------------------------------------------------------- checks
def _count_check(n_ids: int | None, max_tokens: int, finish: str, exact: bool, where: str) -> None:
    if n_ids is None:
        return
    if not 1 <= n_ids <= max_tokens:
        raise Malformed(f"{where}: {n_ids} tokens for max_tokens {max_tokens}")
    if (exact or finish == "length") and n_ids != max_tokens:
        raise Malformed(f"{where}: {n_ids} tokens, expected exactly {max_tokens} (finish_reason {finish!r})")


def emitted_ids(choice: dict) -> list[int] | None:
    """The emitted ids of an OpenAI choice asked with return_token_ids: `token_ids` (completions; chat on
    0.5.17), `response_token_ids` (chat on 0.5.23, serving_chat.py). None when there are none."""
    ids, resp = choice.get("token_ids"), choice.get("response_token_ids")
    if ids is not None and resp is not None and ids != resp:
        raise Malformed(f"choice {choice.get('index')}: token_ids {ids} and response_token_ids {resp} differ")
    return resp if ids is None else ids


def check_openai(r: dict, max_tokens: int, n: int = 1, exact: bool = False, chat: bool = False) -> list[dict]:
    """An OpenAI completion/chat answer: n choices, each finished by stop or length with at most max_tokens
    tokens (exactly max_tokens when `exact` or cut by length), usage consistent with the choices."""
    choices = r.get("choices") or []
    if sorted(c.get("index") for c in choices) != list(range(n)):
        raise Malformed(f"choices with indices {[c.get('index') for c in choices]}, expected {n}")
    total_ids = 0
    for c in choices:
        text = (c.get("message") or {}).get("content") if chat else c.get("text")
        if not isinstance(text, str):
            raise Malformed(f"choice {c.get('index')}: no text ({text!r})")
        if c.get("finish_reason") not in ("stop", "length"):
            raise Malformed(f"choice {c.get('index')}: finish_reason {c.get('finish_reason')!r}")
        ids = emitted_ids(c)
        _count_check(None if ids is None else len(ids), max_tokens, c["finish_reason"], exact, f"choice {c['index']}")
        total_ids += len(ids or [])
    usage = r.get("usage") or {}
    ct = usage.get("completion_tokens")
    if ct is None or not n <= ct <= n * max_tokens:
        raise Malformed(f"usage.completion_tokens {ct} for n={n}, max_tokens {max_tokens}")
    if exact and ct != n * max_tokens:
        raise Malformed(f"usage.completion_tokens {ct}, expected exactly {n * max_tokens}")
    if all(emitted_ids(c) is not None for c in choices) and total_ids != ct:
        raise Malformed(f"usage.completion_tokens {ct} but the choices hold {total_ids} token ids")
    return choices


def check_generate(r: dict, max_new: int, exact: bool = False) -> dict:
    """A /generate answer: text, output ids and meta_info agreeing, finished by stop or length."""
    if not isinstance(r.get("text"), str) or not isinstance(r.get("output_ids"), list):
        raise Malformed(f"/generate answer without text or output_ids: keys {sorted(r)}")
    mi = r.get("meta_info") or {}
    finish = (mi.get("finish_reason") or {}).get("type")
    if finish not in ("stop", "length"):
        raise Malformed(f"finish_reason {mi.get('finish_reason')!r}")
    _count_check(len(r["output_ids"]), max_new, finish, exact, "/generate")
    if mi.get("completion_tokens") != len(r["output_ids"]):
        raise Malformed(f"meta_info.completion_tokens {mi.get('completion_tokens')} "
                        f"for {len(r['output_ids'])} output ids")
    return r


def validate_json(text: str) -> dict:
    """The text parses as JSON and validates against JSON_SCHEMA."""
    import jsonschema

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise Malformed(f"not JSON ({e}): {text[:200]!r}") from None
    try:
        jsonschema.validate(obj, JSON_SCHEMA)
    except jsonschema.ValidationError as e:
        raise Malformed(f"JSON does not validate: {e.message}: {text[:200]!r}") from None
    return obj


def check_regex(text: str) -> None:
    if not re.fullmatch(REGEX, text):
        raise Malformed(f"output {text[:200]!r} does not match {REGEX!r}")


def pick_stop(text: str) -> str | None:
    """A stop string taken from a greedy output: 4 characters a third of the way in (at least 8 characters
    after the start), not blank; None if the text is too short."""
    if len(text) < 16:
        return None
    for i in range(max(8, len(text) // 3), len(text) - 4):
        s = text[i:i + 4]
        if s.strip() and "\ufffd" not in s:
            return s
    return None


# ---------------------------------------------------------------------------------------- log-probs
# An entry per emitted token: {"id": emitted id, "lp": its log-prob, "top": {str(id): log-prob}}.
LP_TOL = 1e-4  # one tensor's values read twice (token log-prob and its top-k entry); float32 printing


def check_entries(entries: list[dict], k: int, greedy: bool, where: str) -> None:
    """Log-probs are finite and ≤ 0, each top list holds 1..k entries in decreasing order, the emitted token's
    top-k entry (when listed) carries its log-prob, and a greedy token is the most likely one (ties allowed)."""
    for i, e in enumerate(entries):
        vals = list(e["top"].values())
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v <= LP_TOL for v in [e["lp"], *vals]):
            raise Malformed(f"{where} position {i}: log-probs not finite or above 0: {e['lp']}, {vals}")
        if not 1 <= len(vals) <= k:
            raise Malformed(f"{where} position {i}: {len(vals)} top log-probs, expected 1..{k}")
        if any(b > a + 1e-6 for a, b in zip(vals, vals[1:])):
            raise Malformed(f"{where} position {i}: top log-probs not in decreasing order: {vals}")
        own = e["top"].get(str(e["id"]))
        if own is not None and abs(own - e["lp"]) > LP_TOL:
            raise Malformed(f"{where} position {i}: token {e['id']} has log-prob {e['lp']} but {own} in the top-{k}")
        if greedy and max(vals) - e["lp"] > 1e-3:
            raise Malformed(f"{where} position {i}: greedy token {e['id']} (log-prob {e['lp']:.4f}) is not the most "
                            f"likely ({max(vals):.4f})")


def _same_ids(reported: list[int], emitted: list[int], where: str) -> None:
    if len(reported) != len(emitted):
        raise Malformed(f"{where}: {len(reported)} log-prob entries for {len(emitted)} emitted tokens")
    for i, (a, b) in enumerate(zip(reported, emitted)):
        if a != b:
            raise Malformed(f"{where}: log-prob entry {i} is for token {a}, the emitted token is {b}")


def entries_generate(r: dict, k: int, greedy: bool) -> list[dict]:
    mi = r["meta_info"]
    toks, tops, ids = mi.get("output_token_logprobs"), mi.get("output_top_logprobs"), r["output_ids"]
    if toks is None or tops is None:
        raise Malformed("/generate: no output_token_logprobs / output_top_logprobs in meta_info")
    _same_ids([int(t[1]) for t in toks], ids, "/generate")
    if len(tops) != len(ids):
        raise Malformed(f"/generate: {len(tops)} top log-prob lists for {len(ids)} emitted tokens")
    entries = []
    for i, (t, top) in enumerate(zip(toks, tops)):
        if not top or len(top) != k:
            raise Malformed(f"/generate position {i}: {len(top or [])} top log-probs, expected {k}")
        entries.append({"id": int(t[1]), "lp": t[0], "top": {str(int(x[1])): x[0] for x in top}})
    check_entries(entries, k, greedy, "/generate")
    return entries


def _entries_openai(tokens, lps, tops, ids, token_text, k, greedy, where) -> list[dict]:
    """`token_text`: the text the endpoint reports for each id. An entry's text must be the emitted id's, its
    top log-probs are keyed by id where the text is one id's."""
    if ids is None:
        raise Malformed(f"{where}: no token_ids / response_token_ids in the choice (return_token_ids)")
    if not len(tokens) == len(lps) == len(tops):
        raise Malformed(f"{where}: {len(tokens)} tokens, {len(lps)} log-probs, {len(tops)} top lists")
    if len(tokens) != len(ids):
        raise Malformed(f"{where}: {len(tokens)} log-prob entries for {len(ids)} emitted tokens")
    for i, (t, tid) in enumerate(zip(tokens, ids)):
        if t != token_text[tid]:
            raise Malformed(f"{where}: log-prob entry {i} is for {t!r}, the emitted token {tid} is {token_text[tid]!r}")
    by_text = text_to_id(token_text)
    entries = []
    for i, (tid, lp, top) in enumerate(zip(ids, lps, tops)):
        if not top:
            raise Malformed(f"{where} position {i}: no top log-probs")
        entries.append({"id": int(tid), "lp": lp, "top": {str(by_text[t]): v for t, v in top.items() if t in by_text}})
        if not entries[-1]["top"]:  # every listed text ambiguous: keep the values for the range checks
            entries[-1]["top"] = {f"?{j}": v for j, v in enumerate(top.values())}
    check_entries(entries, k, greedy, where)
    return entries


def entries_completion(choice: dict, token_text: list[str], k: int, greedy: bool) -> list[dict]:
    """/v1/completions log-probs against the choice's token_ids; `token_text`: ctx["completion_token_text"].
    Each entry's text is the emitted id's as the release renders it. 0.5.17: for a partial-UTF-8-byte id that
    text is U+FFFD, which proves only that the entry is for one of those ids; every other id's text is checked
    exactly. 0.5.23: such an id's text is its raw bytes (latin-1), so the entry is proven to be for that id."""
    lp = choice.get("logprobs")
    if not lp:
        raise Malformed("/v1/completions: no logprobs in the choice")
    return _entries_openai(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], choice.get("token_ids"),
                           token_text, k, greedy, "/v1/completions")


def entries_chat(choice: dict, vocab_text: list[str], k: int, greedy: bool) -> list[dict]:
    """/v1/chat/completions log-probs against the emitted ids (emitted_ids: token_ids on 0.5.17,
    response_token_ids on 0.5.23): each entry's `token` is the emitted id's per-id decode (vocab_text) on both
    releases (U+FFFD for a partial UTF-8 byte, as on /v1/completions of 0.5.17)."""
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        raise Malformed("/v1/chat/completions: no logprobs.content in the choice")
    tops = [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content]
    return _entries_openai([c["token"] for c in content], [c["logprob"] for c in content], tops,
                           emitted_ids(choice), vocab_text, k, greedy, "/v1/chat/completions")


def compare_entries(a: list[dict], b: list[dict]) -> dict:
    """Two servers' entries for one greedy prompt, on the positions before the first differing emitted token
    (after it the contexts differ): the largest |Δ| of the token log-prob and of the top-k log-probs matched
    by token id."""
    n = tops = 0
    tok_diff = top_diff = 0.0
    for ea, eb in zip(a, b):
        if ea["id"] != eb["id"]:
            break
        n += 1
        tok_diff = max(tok_diff, abs(ea["lp"] - eb["lp"]))
        for key in ea["top"].keys() & eb["top"].keys():
            if not key.startswith("?"):
                tops += 1
                top_diff = max(top_diff, abs(ea["top"][key] - eb["top"][key]))
    return {"positions": n, "of": min(len(a), len(b)), "top_pairs": tops, "token_max_abs_diff": tok_diff,
            "top_max_abs_diff": top_diff}


def logprobs_vs_plain(plain: dict, other: dict) -> dict:
    """Per log-prob feature (endpoint) and overall, from both servers' features."""
    out = {}
    for feat in ("logprobs_completions", "logprobs_chat", "logprobs_generate"):
        pa, pb = plain.get(feat, {}), other.get(feat, {})
        ea = pa.get("details", {}).get("greedy_entries") if pa.get("ok") else None
        eb = pb.get("details", {}).get("greedy_entries") if pb.get("ok") else None
        if not (ea and eb):
            continue
        per = [compare_entries(x, y) for x, y in zip(ea, eb)]
        out[feat] = {"prompts": len(per), "positions": sum(p["positions"] for p in per),
                     "of": sum(p["of"] for p in per), "top_pairs": sum(p["top_pairs"] for p in per),
                     "token_max_abs_diff": max((p["token_max_abs_diff"] for p in per), default=0.0),
                     "top_max_abs_diff": max((p["top_max_abs_diff"] for p in per), default=0.0)}
    if out:
        out["max_abs_diff"] = max(max(v["token_max_abs_diff"], v["top_max_abs_diff"]) for v in out.values())
    return out


def text_agreement(a: list[str], b: list[str]) -> dict:
    diffs = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            j = common_prefix_len(list(x), list(y))
            diffs.append({"prompt": i, "first_diff_char": j, "plain": x[max(0, j - 20):j + 30],
                          "other": y[max(0, j - 20):j + 30]})
    return {"identical": min(len(a), len(b)) - len(diffs), "total": min(len(a), len(b)), "differences": diffs}


def divergence_margins(plain_api, ctx: dict, plain_ids: list, other_ids: list) -> list[dict]:
    """For each greedy prompt where a server's tokens leave plain's: plain's own top log-probs (5) at the first
    differing position (plain regenerates its answer up to there with log-probs). A small margin with the
    other server's token second (or, for three-way ties, within the margin of the first) is a near-tie that
    bf16 arithmetic of another batch shape can flip."""
    out = []
    for i, (a, b) in enumerate(zip(plain_ids, other_ids)):
        if not a or not b or a == b:
            continue
        j = common_prefix_len(a, b)
        if j >= min(len(a), len(b)):
            continue  # one answer is a prefix of the other: a length difference, not a token choice
        req = generate_req(ctx["greedy_prompts"][i], j + 1, logprobs=True)
        req["body"]["top_logprobs_num"] = TOP_K
        r = plain_api.call(req)
        top = r["meta_info"]["output_top_logprobs"][j]
        rec = {"prompt": i, "position": j, "plain_token": a[j], "other_token": b[j],
               "replayed_prefix_equal": r["output_ids"][:j + 1] == a[:j + 1],
               "top1": [int(top[0][1]), top[0][0]], "top2": [int(top[1][1]), top[1][0]],
               "margin": top[0][0] - top[1][0], "other_token_is_second": int(top[1][1]) == b[j],
               "top": [[int(t[1]), t[0]] for t in top]}
        out.append(rec)
    return out


# ----------------------------------------------------------------------------------------- features
def _completion(api, ctx, prompt, max_tokens, exact=False, n=1, **kw) -> list[dict]:
    """A completion request, its answer checked; the choices."""
    if n != 1:
        kw["n"] = n
    return check_openai(dump(api.call(completion_req(prompt, max_tokens, **kw))), max_tokens, n=n, exact=exact)


def f_greedy_completions(api, ctx) -> dict:
    """/v1/completions at T=0 on the 12 prompts (48 tokens): every answer valid; the texts are compared with
    plain's in the summary (near-ties may flip a few, counted, not failed)."""
    out = [_completion(api, ctx, p, GREEDY_MAX)[0] for p in ctx["greedy_prompts"]]
    return {"texts": [c["text"] for c in out], "tokens": [len(c["token_ids"] or []) for c in out],
            "ids": [c["token_ids"] for c in out]}


def f_chat_completions(api, ctx) -> dict:
    """/v1/chat/completions at T=0: valid answers, and usage.prompt_tokens is what the chat template gives."""
    texts = []
    for msgs, expect in zip(ctx["chat_messages"], ctx["chat_prompt_tokens"]):
        r = dump(api.call(chat_req(msgs, GREEDY_MAX)))
        c = check_openai(r, GREEDY_MAX, chat=True)[0]
        if r["usage"]["prompt_tokens"] != expect:
            raise Malformed(f"usage.prompt_tokens {r['usage']['prompt_tokens']}, the chat template gives {expect}")
        texts.append(c["message"]["content"])
    return {"texts": texts}


def _lp_feature(api, ctx, kind: str) -> dict:
    """Log-probs (top 5) on one endpoint, 4 greedy and 2 T=1 requests: one entry per emitted token, for the
    emitted token (ids from token_ids, response_token_ids or output_ids; see entries_completion/entries_chat for
    what the token texts prove on each release), finite, ordered, the emitted token's top-5 entry equal to
    its log-prob, a greedy token the most likely. The greedy entries are compared with plain's in the summary."""
    vt = ctx["vocab_text"]
    greedy, sampled = [], []
    for temp, prompts, sink in ((0.0, ctx["lp_prompts"], greedy), (1.0, ctx["lp_prompts"][:2], sampled)):
        for i, p in enumerate(prompts):
            if kind == "completions":
                c = _completion(api, ctx, p, LP_MAX, temperature=temp, logprobs=TOP_K)[0]
                e = entries_completion(c, ctx["completion_token_text"], TOP_K, greedy=temp == 0.0)
            elif kind == "chat":
                r = dump(api.call(chat_req(ctx["chat_messages"][i], LP_MAX, temperature=temp, logprobs=True,
                                           top_logprobs=TOP_K)))
                e = entries_chat(check_openai(r, LP_MAX, chat=True)[0], vt, TOP_K, greedy=temp == 0.0)
            else:
                r = check_generate(api.call(generate_req(p, LP_MAX, temperature=temp, logprobs=True)), LP_MAX)
                e = entries_generate(r, TOP_K, greedy=temp == 0.0)
            sink.append(e)
    return {"greedy_entries": greedy, "t1_tokens": [len(e) for e in sampled]}


def f_logprobs_completions(api, ctx) -> dict:
    return _lp_feature(api, ctx, "completions")


def f_logprobs_chat(api, ctx) -> dict:
    return _lp_feature(api, ctx, "chat")


def f_logprobs_generate(api, ctx) -> dict:
    return _lp_feature(api, ctx, "generate")


def f_n2(api, ctx) -> dict:
    """n=2 at T=1 and T=0: two valid choices each (indices 0 and 1), usage counting both."""
    p = ctx["greedy_prompts"][1]
    sampled = _completion(api, ctx, p, 24, n=2, temperature=1.0)
    greedy = _completion(api, ctx, p, 24, n=2)
    return {"t1_texts": [c["text"] for c in sampled], "greedy_pair_identical": greedy[0]["text"] == greedy[1]["text"]}


def f_stop_strings(api, ctx) -> dict:
    """A stop string taken from the server's own greedy output: the output ends before it, finish_reason stop."""
    for p in ctx["greedy_prompts"]:
        ref = _completion(api, ctx, p, 64)[0]["text"]  # same cache state as the request with the stop string
        stop = pick_stop(ref)
        if stop:
            break
    else:
        raise Malformed("no greedy output long enough to take a stop string from")
    c = _completion(api, ctx, p, 64, stop=[stop])[0]
    if stop in c["text"]:
        raise Malformed(f"output {c['text']!r} contains the stop string {stop!r}")
    if c["finish_reason"] != "stop":
        raise Malformed(f"finish_reason {c['finish_reason']!r}: the stop string {stop!r} was not hit "
                        f"(greedy output without it: {ref!r})")
    return {"stop": stop, "text": c["text"], "matched_stop": c.get("matched_stop"),
            "equals_greedy_prefix": c["text"] == ref[:ref.index(stop)]}


def f_max_tokens(api, ctx) -> dict:
    """max_tokens 1, 2, 3, 5, 7 (below the drafters' block of 16), T=0 and T=1, ignore_eos: exactly that many
    tokens from /v1/completions (usage and token_ids) and from /generate (output_ids, meta_info)."""
    bad, done = [], []
    p = ctx["greedy_prompts"][2]
    for k in EXACT_MAX_TOKENS:
        for temp in (0.0, 1.0):
            try:
                _completion(api, ctx, p, k, exact=True, temperature=temp, ignore_eos=True)
                check_generate(api.call(generate_req(p, k, temperature=temp, ignore_eos=True)), k, exact=True)
                done.append(f"{k}@T{temp:g}")
            except Malformed as e:
                bad.append(f"max_tokens {k} T={temp:g}: {e}")
    if bad:
        raise Malformed("; ".join(bad))
    return {"exact": done}


def f_regex(api, ctx) -> dict:
    """/generate with sampling_params.regex (T=0 twice, T=1): the text matches REGEX in full."""
    texts = []
    for p, temp in ((ctx["regex_prompt"], 0.0), (ctx["greedy_prompts"][0], 0.0), (ctx["regex_prompt"], 1.0)):
        r = check_generate(api.call(generate_req(p, 64, temperature=temp, regex=REGEX)), 64)
        check_regex(r["text"])
        texts.append(r["text"])
    return {"texts": texts}


def f_json_schema(api, ctx) -> dict:
    """Chat with response_format json_schema (xgrammar), T=0 and T=1: the content parses and validates."""
    objs = []
    for temp in (0.0, 1.0):
        r = dump(api.call(chat_req(ctx["json_messages"], 128, temperature=temp, response_format=RESPONSE_FORMAT)))
        objs.append(validate_json(check_openai(r, 128, chat=True)[0]["message"]["content"]))
    return {"objects": objs}


def stream_text(stream) -> tuple[str, int, str | None]:
    """A streamed answer's text, chunk count and finish reason; the stream is closed however the reading ends.
    An unclosed stream is closed by the garbage collector, which may run inside httpcore's connection-pool lock
    on another client thread: the close then waits on that lock forever (the soak test hung CI that way)."""
    text, chunks, finish = "", 0, None
    with stream:
        for chunk in stream:
            chunks += 1
            for c in dump(chunk).get("choices") or []:
                text += c.get("text") or ""
                finish = c.get("finish_reason") or finish
    return text, chunks, finish


def f_stream_equals_nonstream(api, ctx) -> dict:
    """Greedy /v1/completions streamed: the chunks joined equal the non-streamed text (two prompts)."""
    out = []
    for p in ctx["greedy_prompts"][:2]:
        ref = _completion(api, ctx, p, GREEDY_MAX)[0]["text"]
        text, chunks, finish = stream_text(api.call(completion_req(p, GREEDY_MAX, stream=True)))
        if finish not in ("stop", "length"):
            raise Malformed(f"stream ended with finish_reason {finish!r} after {chunks} chunks")
        if text != ref:
            d = text_agreement([ref], [text])["differences"][0]
            raise Malformed(f"streamed text differs from the non-streamed one at character {d['first_diff_char']}: "
                            f"{d['other']!r} vs {d['plain']!r}")
        out.append({"chunks": chunks, "chars": len(text)})
    return {"streams": out}


def f_sampling_params(api, ctx) -> dict:
    """top_p, top_k, min_p, presence/frequency/repetition penalties, all together, and greedy with penalties:
    each accepted with a valid answer (greedy-with-penalty texts are compared with plain's in the summary)."""
    bad, texts = [], {}
    for name, params in SAMPLING_VARIANTS.items():
        try:
            texts[name] = _completion(api, ctx, ctx["greedy_prompts"][3], 24, **params)[0]["text"]
        except Exception as e:  # noqa: BLE001 - each variant is reported on its own
            bad.append(f"{name}: {error_text(e)}")
    if bad:
        raise Malformed("; ".join(bad))
    return {"texts": texts}


def f_over_context_400(api, ctx) -> dict:
    """A prompt 64 tokens over the context: HTTP 400 from /v1/completions and from /generate."""
    msgs = {}
    ids = ctx["over_context_ids"]
    for name, req in (("completions", completion_req(ids, 16)), ("generate", generate_req(ids, 16))):
        try:
            api.call(req)
        except Exception as e:  # noqa: BLE001 - the answer expected is an error
            if status_of(e) != 400:
                raise Malformed(f"{name}: expected HTTP 400, got {error_text(e)}") from None
            msgs[name] = error_text(e)
            continue
        raise Malformed(f"{name}: a {len(ids)}-token prompt (context {ctx['context_len']}) was answered")
    return msgs


def f_long_prompt(api, ctx) -> dict:
    """A prompt of 600+ tokens (ten 64-token prefill chunks): a valid answer, the prompt counted in full."""
    r = dump(api.call(completion_req(ctx["long_prompt"], 32)))
    c = check_openai(r, 32)[0]
    pt = r["usage"]["prompt_tokens"]
    if pt < LONG_MIN_TOKENS:
        raise Malformed(f"the long prompt is {pt} tokens, expected at least {LONG_MIN_TOKENS}")
    return {"prompt_tokens": pt, "prefill_chunks": math.ceil(pt / CHUNK), "text": c["text"]}


def f_shared_prefix(api, ctx) -> dict:
    """Five prompts sharing 500+ leading tokens, one after another: from the second on, meta_info.cached_tokens
    (/generate) and usage.prompt_tokens_details.cached_tokens (/v1/completions) cover at least half of it."""
    common = ctx["shared_common_tokens"]
    need = common // 2
    cached, prompt_tokens = [], []
    for p in ctx["shared_prompts"][:4]:
        r = check_generate(api.call(generate_req(p, 16)), 16)
        cached.append(r["meta_info"].get("cached_tokens"))
        prompt_tokens.append(r["meta_info"].get("prompt_tokens"))
    if any((c or 0) < need for c in cached[1:]):
        raise Malformed(f"meta_info.cached_tokens {cached} for prompts of {prompt_tokens} tokens sharing their first "
                        f"{common}: expected at least {need} after the first")
    r = dump(api.call(completion_req(ctx["shared_prompts"][4], 16)))
    check_openai(r, 16)
    usage_cached = (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    if (usage_cached or 0) < need:
        raise Malformed(f"usage.prompt_tokens_details.cached_tokens {usage_cached}, expected at least {need}")
    return {"common_tokens": common, "cached_tokens": cached, "prompt_tokens": prompt_tokens,
            "usage_cached_tokens": usage_cached}


def close_after(stream, n: int) -> int:
    """Read at most `n` chunks of a streamed answer, then close the stream (an abort; closed on an error too, as
    in stream_text); how many came."""
    chunks = 0
    with stream:
        for _ in stream:
            chunks += 1
            if chunks >= n:
                break
    return chunks


def f_abort_midstream(api, ctx) -> dict:
    """A 2000-token stream closed after 3 chunks, then a new request answered and /health 200."""
    stream = api.call(completion_req(ctx["greedy_prompts"][3], ABORT_MAX_TOKENS, stream=True, ignore_eos=True))
    chunks = close_after(stream, 3)
    if chunks < 3:
        raise Malformed(f"the stream ended after {chunks} chunks ({ABORT_MAX_TOKENS} tokens were asked)")
    c = _completion(api, ctx, ctx["greedy_prompts"][0], 16)[0]
    status, body = api.get("/health")
    if status != 200:
        raise Malformed(f"/health answered {status} after the abort: {body[:200]}")
    return {"chunks_read": chunks, "next_text": c["text"]}


# Order matters only for comparisons: the log-prob prompts are the first greedy prompts, so both servers
# compute them in the same cache state; the abort comes last so nothing runs beside the others.
FEATURES = {
    "greedy_completions": f_greedy_completions,
    "chat_completions": f_chat_completions,
    "logprobs_completions": f_logprobs_completions,
    "logprobs_chat": f_logprobs_chat,
    "logprobs_generate": f_logprobs_generate,
    "n2": f_n2,
    "stop_strings": f_stop_strings,
    "max_tokens_exact": f_max_tokens,
    "regex_generate": f_regex,
    "json_schema_chat": f_json_schema,
    "stream_equals_nonstream": f_stream_equals_nonstream,
    "sampling_params": f_sampling_params,
    "long_prompt": f_long_prompt,
    "shared_prefix_cache": f_shared_prefix,
    "over_context_400": f_over_context_400,
    "abort_midstream": f_abort_midstream,
}
AFTER_LOAD = "serves_after_load"
ALL_FEATURES = (*FEATURES, AFTER_LOAD)


def timed_out(e: BaseException) -> bool:
    import httpx
    import openai

    return isinstance(e, (openai.APITimeoutError, httpx.TimeoutException))


def run_feature(fn, api, ctx) -> dict:
    t = time.time()
    try:
        rec = {"ok": True, "details": fn(api, ctx)}
    except Exception as e:  # noqa: BLE001 - a failing feature is recorded and the run goes on
        rec = {"ok": False, "error": error_text(e), "timed_out": timed_out(e)}
    rec["seconds"] = round(time.time() - t, 2)
    return rec


def answers(url: str, ctx: dict, timeout: float = 15.0) -> bool:
    """Whether the server still answers a one-token request."""
    try:
        _completion(Api(url, timeout), ctx, ctx["greedy_prompts"][0], 1)
        return True
    except Exception:  # noqa: BLE001 - any failure means no
        return False


def run_features(url: str, ctx: dict, log=print, name: str = "") -> dict:
    """Every feature in turn. After a request timed out, the server must still answer a one-token request, or
    the remaining features are recorded as skipped: one stuck server must not hold the run past the device's
    time limit."""
    api = Api(url, timeout=REQUEST_TIMEOUT)
    out = {}
    stuck = None
    for fname, fn in FEATURES.items():
        if stuck:
            out[fname] = {"ok": False, "error": f"skipped: the server stopped answering in {stuck}", "seconds": 0.0}
            continue
        out[fname] = run_feature(fn, api, ctx)
        if out[fname].get("timed_out") and not answers(url, ctx):
            stuck = fname
        log(f"  {name} {fname}: {'ok' if out[fname]['ok'] else 'FAILED ' + out[fname]['error'][:200]}"
            f" ({out[fname]['seconds']} s)")
    return out


def serves_after_load(api, ctx) -> dict:
    status, body = api.get("/health")
    if status != 200:
        raise Malformed(f"/health answered {status}: {body[:200]}")
    return {"text": _completion(api, ctx, ctx["greedy_prompts"][0], 16)[0]["text"]}


# --------------------------------------------------------------------------------------- mixed load
def _lp_kind(kind):
    def run(api, ctx, rng):
        temp = rng.choice((0.0, 1.0))
        i = rng.randrange(len(ctx["lp_prompts"]))
        if kind == "completions":
            c = _completion(api, ctx, ctx["lp_prompts"][i], LP_MAX, temperature=temp, logprobs=TOP_K)[0]
            entries_completion(c, ctx["completion_token_text"], TOP_K, greedy=temp == 0.0)
        elif kind == "chat":
            r = dump(api.call(chat_req(ctx["chat_messages"][i], LP_MAX, temperature=temp, logprobs=True,
                                       top_logprobs=TOP_K)))
            entries_chat(check_openai(r, LP_MAX, chat=True)[0], ctx["vocab_text"], TOP_K, greedy=temp == 0.0)
        else:
            r = check_generate(api.call(generate_req(ctx["lp_prompts"][i], LP_MAX, temperature=temp, logprobs=True)),
                               LP_MAX)
            entries_generate(r, TOP_K, greedy=temp == 0.0)
        return "ok"
    return run


def sglang_checks_length_first(source: str | None = None) -> bool:
    """Whether Req.update_finish_state (the installed SGLang's, or `source`) checks max_new_tokens before stop
    strings: 0.5.17 does, so an answer whose last step reaches the limit keeps a stop string those tokens hold
    (the load's stop kind counts it apart, LENGTH_BEFORE_STOP); 0.5.23 checks stops first (sglang#33758), and there such
    an answer is an error."""
    if source is None:
        import inspect

        from sglang.srt.managers.schedule_batch import Req

        source = inspect.getsource(Req.update_finish_state)
    cap = re.search(r"len\(self\.output_ids\)\s*>=\s*self\.sampling_params\.max_new_tokens", source)
    stop = source.find("self._check_str_based_finish(")
    if cap is None or stop < 0:
        raise RuntimeError("Req.update_finish_state no longer has the length cap or the stop-string check read here")
    return cap.start() < stop


def _load_stop(api, ctx, rng):
    stop = rng.choice(LOAD_STOPS)
    c = _completion(api, ctx, rng.choice(ctx["greedy_prompts"]), 48, temperature=rng.choice((0.0, 1.0)), stop=[stop])[0]
    if stop in c["text"]:
        length_first = ctx["sglang_length_first"] if "sglang_length_first" in ctx else sglang_checks_length_first()
        if c.get("finish_reason") == "length" and length_first:
            # 0.5.17 checks max_tokens before stop strings: the last step's tokens end the request by length and
            # keep a stop string they hold, with or without speculation. Counted apart, not as this server's error.
            return LENGTH_BEFORE_STOP
        raise Malformed(f"output contains the stop string {stop!r} (finish_reason {c.get('finish_reason')!r}): "
                        f"{c['text'][:200]!r}")
    return "ok"


def _load_stream(api, ctx, rng):
    text, chunks, finish = stream_text(api.call(completion_req(rng.choice(ctx["greedy_prompts"]), rng.randint(8, 48),
                                                               temperature=rng.choice((0.0, 1.0)), stream=True)))
    if finish not in ("stop", "length"):
        raise Malformed(f"stream ended with finish_reason {finish!r} after {chunks} chunks")
    return "ok"


def _load_abort(api, ctx, rng):
    stream = api.call(completion_req(rng.choice(ctx["greedy_prompts"]), 512, temperature=rng.choice((0.0, 1.0)),
                                     stream=True, ignore_eos=True))
    chunks = close_after(stream, 2)
    if chunks < 2:
        raise Malformed(f"stream ended after {chunks} chunks of 512 tokens asked")
    return "ok"


def _load_over_context(api, ctx, rng):
    try:
        api.call(completion_req(ctx["over_context_ids"], 16))
    except Exception as e:  # noqa: BLE001 - the answer expected is an error
        if status_of(e) == 400:
            return "expected_400"
        raise
    raise Malformed("an over-context prompt was answered")


def _load_max_tokens(api, ctx, rng):
    k = rng.choice(EXACT_MAX_TOKENS)
    _completion(api, ctx, rng.choice(ctx["greedy_prompts"]), k, exact=True, temperature=rng.choice((0.0, 1.0)),
                ignore_eos=True)
    return "ok"


def _load_sampled(api, ctx, rng):
    params = SAMPLING_VARIANTS[rng.choice(sorted(SAMPLING_VARIANTS))]
    _completion(api, ctx, rng.choice(ctx["greedy_prompts"]), rng.randint(8, 48), **params)
    return "ok"


def _load_greedy(api, ctx, rng):
    _completion(api, ctx, rng.choice(ctx["greedy_prompts"]), rng.randint(8, 48))
    return "ok"


def _load_chat(api, ctx, rng):
    check_openai(dump(api.call(chat_req(rng.choice(ctx["chat_messages"]), 32, temperature=rng.choice((0.0, 1.0))))),
                 32, chat=True)
    return "ok"


def _load_n2(api, ctx, rng):
    _completion(api, ctx, rng.choice(ctx["greedy_prompts"]), 24, n=2, temperature=rng.choice((0.0, 1.0)))
    return "ok"


def _load_regex(api, ctx, rng):
    r = check_generate(api.call(generate_req(ctx["regex_prompt"], 64, temperature=rng.choice((0.0, 1.0)),
                                             regex=REGEX)), 64)
    check_regex(r["text"])
    return "ok"


def _load_json(api, ctx, rng):
    r = dump(api.call(chat_req(ctx["json_messages"], 128, temperature=rng.choice((0.0, 1.0)),
                               response_format=RESPONSE_FORMAT)))
    validate_json(check_openai(r, 128, chat=True)[0]["message"]["content"])
    return "ok"


def _load_long(api, ctx, rng):
    _completion(api, ctx, ctx["long_prompt"], 16, temperature=rng.choice((0.0, 1.0)))
    return "ok"


def _load_shared(api, ctx, rng):
    check_generate(api.call(generate_req(rng.choice(ctx["shared_prompts"]), 16, temperature=rng.choice((0.0, 1.0)))),
                   16)
    return "ok"


LOAD_KINDS = {
    "greedy": _load_greedy,
    "sampled": _load_sampled,
    "chat": _load_chat,
    "n2": _load_n2,
    "stop": _load_stop,
    "max_tokens_exact": _load_max_tokens,
    "regex": _load_regex,
    "json_schema": _load_json,
    "stream": _load_stream,
    "abort": _load_abort,
    "over_context": _load_over_context,
    "long_prompt": _load_long,
    "shared_prefix": _load_shared,
    "logprobs_completions": _lp_kind("completions"),
    "logprobs_chat": _lp_kind("chat"),
    "logprobs_generate": _lp_kind("generate"),
}


ANSWERED = ("ok", "expected_400", LENGTH_BEFORE_STOP)  # load outcomes that are answers (their latency counts)


def unsupported(msg: str) -> bool:
    """An HTTP 400 refusing a feature (stock DFLASH: "... does not support return_logprob yet.")."""
    return msg.startswith("HTTP 400") and "does not support" in msg


def mixed_load(api, ctx: dict, seconds: float, clients: int, seed: int = 0, refusable: bool = False,
               records: list | None = None, stop: threading.Event | None = None) -> dict:
    """LOAD_KINDS from `clients` threads for `seconds`, every answer checked; per request (start second, latency,
    kind, outcome). An error: any non-2xx answer but the over-context 400, any exception, any answer failing its
    check; with `refusable`, a refused feature (`unsupported`) is counted apart. records: a list the per-request
    records are appended to as they come; stop: once set, each client ends after its request in flight."""
    kinds = sorted(LOAD_KINDS)
    records = [] if records is None else records
    samples: dict[str, list[str]] = {}
    lock = threading.Lock()
    t0 = time.time()
    deadline = t0 + seconds

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.time() < deadline and not (stop and stop.is_set()):
            kind = rng.choice(kinds)
            t, msg = time.time(), None
            try:
                outcome = LOAD_KINDS[kind](api, ctx, rng)
                if outcome not in ANSWERED:
                    raise Malformed(f"check returned {outcome!r}")
            except Exception as e:  # noqa: BLE001 - counted and sampled
                msg = error_text(e)
                outcome = "unsupported" if refusable and unsupported(msg) else "errors"
            with lock:
                records.append((t - t0, time.time() - t, kind, outcome))
                if outcome == "errors" and len(samples.setdefault(kind, [])) < 3:
                    samples[kind].append(msg)

    with cf.ThreadPoolExecutor(clients) as ex:
        list(ex.map(client, range(clients)))
    by_kind: dict[str, dict] = {}
    for _, _, kind, outcome in records:
        d = by_kind.setdefault(kind, {"requests": 0, "errors": 0, "unsupported": 0})
        d["requests"] += 1
        d[outcome] = d.get(outcome, 0) + 1
    count = lambda o: sum(r[3] == o for r in records)  # noqa: E731
    return {"clients": clients, "seconds": round(time.time() - t0, 1), "requests": len(records),
            "errors": count("errors"), "unsupported": count("unsupported"), "expected_400": count("expected_400"),
            LENGTH_BEFORE_STOP: count(LENGTH_BEFORE_STOP), "by_kind": by_kind, "error_samples": samples,
            "records": records}


def load_worker(url: str, ctx: dict, seconds: float, clients: int, seed: int = 0) -> dict:
    """mixed_load on one server from a client process (load_in_processes), without its per-request records."""
    rec = mixed_load(Api(url, timeout=REQUEST_TIMEOUT), ctx, seconds, clients, seed)
    rec.pop("records")
    return rec


def warm_up(url: str, ctx: dict, n: int = 48) -> float:
    """The harness' warm-up burst (servers.warm_up: n requests at once, greedy and T=1 alternating) on the greedy
    prompts, every answer checked; seconds until all are answered."""
    api = Api(url, timeout=_servers.WARM_UP_TIMEOUT)
    return _servers.warm_up(lambda body: check_generate(api.call({"endpoint": "/generate", "body": body}), 16),
                            ctx["greedy_prompts"], n, 16)


# ------------------------------------------------------------------------------------------- verdicts
# What the GPU tests assert, one test per server and check (tests/test_serving_conformance.py); in the summary too.
# Every server: its start, each feature, the request after the load, and no error in the mixed load; every server
# but plain, when plain runs: greedy tokens equal to plain's but at near-ties.
SERVER_CHECKS = ("server_start", *ALL_FEATURES, "mixed_load")
VS_PLAIN_CHECKS = ("greedy_vs_plain",)


def check_cases(names) -> list[tuple[str, str]]:
    """(server, check) for the servers `names`, in NAMES order."""
    out = []
    for n in (n for n in NAMES if n in names):
        out += [(n, c) for c in SERVER_CHECKS]
        if n != "plain" and "plain" in names:
            out += [(n, c) for c in VS_PLAIN_CHECKS]
    return out


def plan(cases) -> tuple[list[str], bool]:
    """What a selection of (server, check) cases needs run: the servers (NAMES order; plain too for a comparison
    with it) and whether the mixed load."""
    need = {n for n, _ in cases} | {"plain" for _, c in cases if c in VS_PLAIN_CHECKS}
    return [n for n in NAMES if n in need], any(c == "mixed_load" for _, c in cases)


def _short(obj, n: int = 300) -> str:
    text = obj if isinstance(obj, str) else json.dumps(obj, default=str)
    return text if len(text) <= n else text[:n] + "..."


def greedy_vs_plain(res: dict, name: str) -> tuple[bool, str]:
    """The server's greedy /v1/completions tokens equal plain's on every prompt, or leave them at a near-tie:
    the harness' rule (servers.is_near_tie, NEAR_TIE_MARGIN) on plain's top log-probs at the first differing
    position (divergence_margins). A difference without a margin (one answer a prefix of the other, or margins
    that could not be measured) is not explained."""
    feats = res.get("features", {})
    a, b = feats.get("plain", {}).get("greedy_completions", {}), feats.get(name, {}).get("greedy_completions", {})
    if not (a.get("ok") and b.get("ok")):
        which = [n for n, r in (("plain", a), (name, b)) if not r.get("ok")]
        return False, f"no greedy tokens to compare: greedy_completions failed or did not run on {', '.join(which)}"
    if a["details"].get("ids") is None or b["details"].get("ids") is None:
        return False, "no greedy token ids recorded"
    srv = res.get("servers", {}).get(name, {})
    margins = {m["prompt"]: m for m in srv.get("greedy_divergence_margins") or []}
    texts = {d["prompt"]: d for d in text_agreement(a["details"]["texts"], b["details"]["texts"])["differences"]}
    near, unexplained = [], []
    pairs = list(zip(a["details"]["ids"], b["details"]["ids"]))
    for i, (x, y) in enumerate(pairs):
        if x == y:
            continue
        t = texts.get(i)
        where = f"prompt {i}" + (f" (text: plain {t['plain']!r}, {name} {t['other']!r})" if t else "")
        m = margins.get(i)
        if m is None:
            j = common_prefix_len(x or [], y or [])
            why = (f"one answer is a prefix of the other ({len(x or [])} and {len(y or [])} tokens)"
                   if j >= min(len(x or []), len(y or [])) else
                   f"no margin measured: {srv.get('greedy_divergence_margins_error') or 'no record'}")
            unexplained.append(f"{where}: {why}")
        elif _servers.is_near_tie({**m, "ref_token": m["plain_token"], "got_token": m["other_token"]}):
            near.append(f"prompt {i} token {m['position']} (margin {m['margin']:.4f})")
        else:
            unexplained.append(f"{where}: token {m['position']} is {m['other_token']}, plain's {m['plain_token']}; "
                               f"plain's top log-probs there {m['top']} (margin {m['margin']:.4f}, near-tie "
                               f"margin {_servers.NEAR_TIE_MARGIN})")
    same = len(pairs) - len(near) - len(unexplained)
    evidence = (f"{same}/{len(pairs)} identical, {len(near)} near-ties"
                + (f" ({'; '.join(near)})" if near else "")
                + (f", {len(unexplained)} not near-ties: " + "; ".join(unexplained) if unexplained else ""))
    return not unexplained, evidence


def verdict(res: dict, name: str, check: str) -> tuple[bool, str]:
    """Whether server `name` passed `check` (SERVER_CHECKS, VS_PLAIN_CHECKS) in a run's results, and the evidence:
    the error, the log's tail, the load's errors by kind and samples, the differing tokens."""
    srv = res.get("servers", {}).get(name, {})
    if check == "server_start":
        if srv.get("up"):
            return True, f"up after {srv.get('start_seconds')} s"
        return False, srv.get("error") or "did not start"
    if not srv.get("up"):
        return False, f"the {name} server did not start: {srv.get('error') or 'not started'}"
    if check in ALL_FEATURES:
        rec = res.get("features", {}).get(name, {}).get(check)
        if rec is None:
            why = srv.get("phase_error") or "the run ended before it"
            return False, f"{check} did not run on {name}: {why}"
        if rec.get("ok"):
            details = {k: v for k, v in (rec.get("details") or {}).items() if k not in ("greedy_entries", "ids")}
            return True, f"{rec.get('seconds')} s: {_short(details)}"
        return False, rec.get("error") or "failed"
    if check == "mixed_load":
        load = res.get("load", {}).get(name)
        if not load:
            return False, f"no mixed load ran (--load-seconds {res.get('load_seconds')})"
        if load.get("error"):
            return False, f"the load's client process failed: {load['error']}"
        by_kind = {k: v["errors"] for k, v in load.get("by_kind", {}).items() if v.get("errors")}
        evidence = (f"{load['requests']} requests from {load.get('clients')} clients in {load.get('seconds')} s, "
                    f"{load['errors']} errors" + (f" by kind {by_kind}" if by_kind else "")
                    + f"; {load.get('expected_400')} expected HTTP 400, {load.get(LENGTH_BEFORE_STOP)} ended by "
                      "length before a stop string")
        if load.get("error_samples"):
            evidence += f"; samples: {_short(load['error_samples'], 1500)}"
        return load["errors"] == 0, evidence
    if check == "greedy_vs_plain":
        return greedy_vs_plain(res, name)
    raise ValueError(f"unknown check {check!r}")


# ------------------------------------------------------------------------------------------ summary
def summarize(res: dict) -> dict:
    """Per server: features_ok / features_total, the failed features with their messages, agreement with plain
    (greedy texts, chat texts, long prompt, greedy with penalties), log-prob differences with plain, and the
    mixed load's requests and errors."""
    feats = res.get("features", {})
    plain = feats.get("plain", {})
    out = {}
    for name in res.get("server_names", []):
        f = feats.get(name, {})
        srv = res.get("servers", {}).get(name, {})
        failed = [{"feature": k, "message": v.get("error")} for k, v in f.items() if not v.get("ok")]
        if not srv.get("up", False):
            failed.insert(0, {"feature": "server_start", "message": srv.get("error", "did not start")})
        row = {"up": srv.get("up", False), "features_ok": sum(1 for v in f.values() if v.get("ok")),
               "features_total": len(ALL_FEATURES), "failed_features": failed}
        if name != "plain" and plain:
            def texts(d, feat, key="texts"):
                v = d.get(feat, {})
                return v.get("details", {}).get(key) if v.get("ok") else None
            agree = {}
            for feat in ("greedy_completions", "chat_completions"):
                a, b = texts(plain, feat), texts(f, feat)
                if a is not None and b is not None:
                    agree[feat] = text_agreement(a, b)
            a, b = texts(plain, "long_prompt", "text"), texts(f, "long_prompt", "text")
            if a is not None and b is not None:
                agree["long_prompt"] = text_agreement([a], [b])
            a, b = texts(plain, "sampling_params"), texts(f, "sampling_params")
            if a and b:
                greedy_keys = [k for k in SAMPLING_VARIANTS if SAMPLING_VARIANTS[k]["temperature"] == 0.0]
                agree["greedy_with_penalties"] = text_agreement([a[k] for k in greedy_keys],
                                                                [b[k] for k in greedy_keys])
            g = agree.get("greedy_completions")
            row["greedy_match_vs_plain"] = f"{g['identical']}/{g['total']}" if g else None
            row["greedy_differences_vs_plain"] = g["differences"] if g else None
            margins = res.get("servers", {}).get(name, {}).get("greedy_divergence_margins")
            if margins is not None:
                row["greedy_divergence_margins"] = margins
                row["greedy_divergence_max_margin"] = max((m["margin"] for m in margins), default=None)
            row["text_agreement_vs_plain"] = {k: f"{v['identical']}/{v['total']}" for k, v in agree.items()}
            lp = logprobs_vs_plain(plain, f)
            row["logprob_max_abs_diff_vs_plain"] = lp.get("max_abs_diff")
            row["logprob_vs_plain"] = lp
        load = res.get("load", {}).get(name)
        row["mixed_load_requests"] = load.get("requests") if load else None
        row["mixed_load_errors"] = load.get("errors") if load else None
        if load:
            row["mixed_load_expected_400"] = load.get("expected_400")
            row["mixed_load_errors_by_kind"] = {k: v["errors"] for k, v in load["by_kind"].items() if v["errors"]}
            row["mixed_load_error_samples"] = {k: v[:1] for k, v in load.get("error_samples", {}).items()}
            if load.get("error"):
                row["mixed_load_error"] = load["error"]
        row["accept_length"] = srv.get("accept_length")
        row["warm_up_seconds"] = srv.get("warm_up_seconds")
        checks = {c: verdict(res, name, c)[0] for n, c in check_cases(res.get("server_names", [])) if n == name}
        row["checks"] = checks
        row["checks_ok"], row["checks_total"] = sum(checks.values()), len(checks)
        out[name] = row
    prov = res.get("provenance", {})
    return {"servers": out, "load": {"clients": res.get("clients"), "seconds": res.get("load_seconds"),
                                     "mode": res.get("load_mode")},
            "features": list(ALL_FEATURES), "server_flags": FLAGS,
            "backends": res.get("backends", {"attention": "triton", "sampling": "pytorch"}),
            "commit": prov.get("commit"), "gpu": prov.get("gpu"), "date": prov.get("date"),
            "command": prov.get("command"), "wall_seconds": res.get("wall_seconds")}


def print_table(summary: dict) -> None:
    print(f"\n{'server':8} {'up':>3} {'checks':>7} {'features':>9} {'greedy=plain':>12} {'logprob Δ':>10} "
          f"{'load reqs':>9} {'load errs':>9}")
    for name, r in summary["servers"].items():
        lp = r.get("logprob_max_abs_diff_vs_plain")
        print(f"{name:8} {'yes' if r['up'] else 'no':>3} {r['checks_ok']:>3}/{r['checks_total']:<3} "
              f"{r['features_ok']:>4}/{r['features_total']:<4} "
              f"{r.get('greedy_match_vs_plain') or '-':>12} {f'{lp:.4f}' if lp is not None else '-':>10} "
              f"{r['mixed_load_requests'] if r['mixed_load_requests'] is not None else '-':>9} "
              f"{r['mixed_load_errors'] if r['mixed_load_errors'] is not None else '-':>9}")
    for name, r in summary["servers"].items():
        failed = [c for c, ok in r["checks"].items() if not ok and c not in ALL_FEATURES and c != "server_start"]
        if failed:
            print(f"  {name} FAILED checks: {', '.join(failed)}")
        for f in r["failed_features"]:
            print(f"  {name} FAILED {f['feature']}: {(f['message'] or '')[:240]}")
        if r.get("mixed_load_errors_by_kind"):
            print(f"  {name} load errors by kind: {r['mixed_load_errors_by_kind']}")
        for m in r.get("greedy_divergence_margins") or []:
            print(f"  {name} greedy prompt {m['prompt']} leaves plain at token {m['position']}: plain's top-2 margin "
                  f"{m['margin']:.4f} (log-prob), {name}'s token is plain's "
                  f"{'second' if m['other_token_is_second'] else 'NOT second'}")


# --------------------------------------------------------------------------------------------- main
def servers_and_models(servers: str, models: str) -> tuple[list[str], str]:
    """--servers (a comma list of NAMES) and --models (a folder with target/, suites/ and each drafter's folder),
    refused in one line before anything starts."""
    names = [n for n in servers.split(",") if n]
    if not names or set(names) - set(NAMES):
        raise SystemExit(f"--servers: choose from {','.join(NAMES)}")
    models = os.path.abspath(models)
    for sub in ("target", "suites", *[n for n in names if n != "plain"]):
        if not os.path.isdir(os.path.join(models, sub)):
            raise SystemExit(f"--models {models}: no {sub}/")
    return names, models


def add_pair_args(ap: argparse.ArgumentParser) -> None:
    """The arguments of a run of servers on a pair (this file and serving_pressure.py): the models, where results
    go, which servers, FlashInfer's prebuild, the CPU self-test."""
    ap.add_argument("--models", default=os.path.join(REPO, "models", "default"),
                    help="folder with target/, dflash/, dspine/ and suites/")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--servers", default=",".join(NAMES))
    ap.add_argument("--results-dir", default=None,
                    help="also write the summary there (benchmarks/results for the committed one); default: --out only")
    ap.add_argument("--no-prebuild", action="store_true", help="do not build FlashInfer's sampling module first")
    ap.add_argument("--smoke", action="store_true", help="CPU self-test of the pure parts, no servers")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_pair_args(ap)
    ap.add_argument("--clients", type=int, default=48)
    ap.add_argument("--load-seconds", type=float, default=120.0, help="the mixed load's length; 0: no mixed load")
    _servers.add_backend_args(ap)
    ap.add_argument("--tag", default="",
                    help="results named serving_features_TAG*.json instead of serving_features*.json")
    ap.add_argument("--dspine-args", default="",
                    help="more arguments for the DSPINE server, e.g. '--speculative-num-draft-tokens 32' (with "
                         "SGLANG_DSPINE_TREE=1: trees of 31 nodes)")
    return ap


def stem_of(args) -> str:
    return "serving_features" + (f"_{args.tag}" if args.tag else "")


def load_in_processes(urls: dict[str, str], ctx: dict, seconds: float, clients: int, done=None) -> dict:
    """load_worker on every server of `urls` at the same time, one spawned client process each (the servers are
    independent processes); a client process that fails is recorded as that server's load error. `done(name,
    record)` after each server's record. The client processes import this folder as the package `benchmarks`
    first, so that load_worker unpickles there (as benchmarks.serving_features) with the repository root off their
    sys.path; run as the main script, it unpickles from the script, as spawn runs it again."""
    out = {}
    with cf.ProcessPoolExecutor(len(urls), mp_context=mp.get_context("spawn"), initializer=load_package,
                                initargs=("benchmarks", os.path.dirname(os.path.abspath(__file__)))) as ex:
        futs = {n: ex.submit(load_worker, url, ctx, seconds, clients, i) for i, (n, url) in enumerate(urls.items())}
        for n, fut in futs.items():
            try:
                out[n] = fut.result()
            except Exception as e:  # noqa: BLE001 - recorded per server
                out[n] = {"error": error_text(e), "requests": None, "errors": None, "by_kind": {}}
            if done is not None:
                done(n, out[n])
    return out


class Conformance:
    """One run: the servers of args.servers on the pair started (plain first, alone, so the kernel builds are
    cached; FlashInfer's prebuild beside it), then each server's warm-up burst and FEATURES (a thread each, DFLASH
    and DSPINE starting meanwhile), the mixed load on all of them at once, the after-load request and the
    near-tie margins of greedy differences; everything in `res`, saved with its summary under args.out after
    every step. main() and the GPU tests (tests/test_serving_conformance.py) both run it; the tests' pass/fail
    is `verdict` on `res`."""

    def __init__(self, args, command: list[str]):
        from transformers import AutoTokenizer

        self.args = args
        backends = _servers.backends_from_args(args)
        self.base = _servers.base_args(backends["attention"], backends["sampling"])
        self.stem = stem_of(args)
        self.names, models = servers_and_models(args.servers, args.models)
        os.makedirs(args.out, exist_ok=True)
        self.t0 = time.time()
        self.target = os.path.join(models, "target")
        self.drafters = {"dflash": ("DFLASH", os.path.join(models, "dflash")),
                         "dspine": ("DSPINE", os.path.join(models, "dspine"))}
        self.ctx = ctx = build_inputs(AutoTokenizer.from_pretrained(self.target), models)
        self.res = {"provenance": provenance(command),
                    "server_names": self.names, "server_flags": FLAGS, "base_flags": self.base,
                    "backends": {k: v or _servers.SGLANG_DEFAULT for k, v in backends.items()},
                    "clients": args.clients, "load_seconds": args.load_seconds,
                    "load_mode": "the servers loaded at the same time, one client process each",
                    "inputs": {"greedy_prompts": len(ctx["greedy_prompts"]),
                               "long_prompt_tokens": ctx["long_prompt_tokens"],
                               "shared_common_tokens": ctx["shared_common_tokens"], "context_len": ctx["context_len"],
                               "over_context_tokens": len(ctx["over_context_ids"]), "regex": REGEX,
                               "json_schema": JSON_SCHEMA},
                    "servers": {}, "features": {}, "load": {}, "timeline": {}}
        # The servers' phases run in threads: every change to `res` and every save holds this lock (json.dump
        # iterating a dict another thread is adding to would raise).
        self.guard = threading.RLock()
        self.servers: dict[str, Server] = {}
        self.prebuild = None

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.1f} s] {msg}", flush=True)

    def save(self) -> None:
        args, res = self.args, self.res
        with self.guard:
            res["wall_seconds"] = round(time.time() - self.t0, 1)
            summary = summarize(res)
            json.dump(res, open(os.path.join(args.out, f"{self.stem}.json"), "w"), indent=1)
            json.dump(summary, open(os.path.join(args.out, f"{self.stem}_summary.json"), "w"), indent=1)
            if args.results_dir:
                os.makedirs(args.results_dir, exist_ok=True)
                json.dump(summary, open(os.path.join(args.results_dir, f"{self.stem}_summary.json"), "w"), indent=1)

    def stamp(self, what: str) -> None:
        with self.guard:
            self.res["timeline"][what] = round(time.time() - self.t0, 1)
            self.save()
        self.log(what)

    def server_args(self, name: str) -> list[str]:
        if name == "plain":
            return ["--model-path", self.target, *FLAGS]
        extra = shlex.split(self.args.dspine_args) if name == "dspine" else []
        return spec_args(self.target, self.drafters[name][0], self.drafters[name][1], *FLAGS, *extra)

    def bring_up(self, name: str) -> bool:
        s = self.servers[name]
        rec = s.start_record(480)
        with self.guard:
            self.res["servers"][name] = rec
        if not rec["up"]:
            self.stamp(f"{name} did NOT start:\n{s.tail(40)}")
            return False
        self.stamp(f"{name} up after {s.up_after:.0f} s")
        return True

    def phase(self, name: str) -> None:
        """Start-up wait, warm-up burst and the features of one server (a thread each)."""
        res = self.res
        if not res["servers"].get(name, {}).get("up") and not self.bring_up(name):
            return
        try:
            warm = {"warm_up_seconds": warm_up(self.servers[name].url, self.ctx)}
        except Exception as e:  # noqa: BLE001 - recorded; the features still run
            warm = {"warm_up_error": error_text(e)}
        with self.guard:
            res["servers"][name].update(warm)
        self.stamp(f"{name} warm-up burst: {warm.get('warm_up_seconds', warm.get('warm_up_error'))} s")
        feats = run_features(self.servers[name].url, self.ctx, self.log, name)
        with self.guard:
            res["features"][name] = feats
        self.stamp(f"{name} features: {sum(v['ok'] for v in feats.values())}/{len(FEATURES)} ok")

    def serve(self) -> list[str]:
        """FlashInfer's prebuild, the servers started and each one's phase; the servers that are up."""
        res, out = self.res, self.args.out
        if "dflash" in self.names and not self.args.no_prebuild:
            self.prebuild = _servers.start_prebuild(out)
        order = [n for n in NAMES if n in self.names]
        first = order[0]  # plain when it is asked for: alone, so the kernel builds are cached for the others
        self.servers[first] = Server(first, PORTS[first], self.server_args(first), out, base_args=self.base)
        if not self.bring_up(first):
            with self.guard:
                for n in order[1:]:
                    res["servers"][n] = {"up": False, "error": f"not started: {first} did not start"}
        else:
            for n in order[1:]:
                self.servers[n] = Server(n, PORTS[n], self.server_args(n), out, base_args=self.base)
            with cf.ThreadPoolExecutor(len(order)) as ex:
                threads = {n: ex.submit(self.phase, n) for n in order}
                for n, t in threads.items():
                    try:
                        t.result()
                    except Exception as e:  # noqa: BLE001 - a fault in one server's phase leaves the others
                        with self.guard:
                            res["servers"].setdefault(n, {})["phase_error"] = error_text(e)
                        self.stamp(f"{n} phase FAILED: {error_text(e)}")
        if self.prebuild is not None:
            res["flashinfer_prebuild"] = _servers.prebuild_record(self.prebuild, out)
        return [n for n in order if res["servers"].get(n, {}).get("up")]

    def mixed_load(self, up: list[str]) -> None:
        """All servers at once (independent processes, one client process each); none with --load-seconds 0."""
        args = self.args
        if not up or args.load_seconds <= 0 or args.clients <= 0:
            return
        self.stamp(f"mixed load: {args.clients} clients x {args.load_seconds:.0f} s on {', '.join(up)} at once")

        def done(n: str, rec: dict) -> None:
            self.res["load"][n] = rec
            self.stamp(f"{n} load: {rec.get('requests')} requests, {rec.get('errors')} errors")

        load_in_processes({n: self.servers[n].url for n in up}, self.ctx, args.load_seconds, args.clients, done)

    def after_load(self, up: list[str]) -> None:
        """One request each (still serving?), server information, and plain's margins where a server's greedy
        tokens leave plain's."""
        res, ctx = self.res, self.ctx
        for n in up:
            res["features"].setdefault(n, {})[AFTER_LOAD] = run_feature(serves_after_load,
                                                                        Api(self.servers[n].url, REQUEST_TIMEOUT), ctx)
            try:
                info = self.servers[n].info()
                res["servers"][n]["accept_length"] = next((s.get("avg_spec_accept_length")
                                                           for s in info.get("internal_states", [])), None)
                res["servers"][n]["server_info"] = {k: info.get(k) for k in (
                    "chunked_prefill_size", "disable_radix_cache", "page_size", "cuda_graph_max_bs", "grammar_backend",
                    "speculative_algorithm", "speculative_num_draft_tokens", "max_total_num_tokens", "context_length")}
            except Exception as e:  # noqa: BLE001 - information only
                res["servers"][n]["server_info_error"] = error_text(e)
            res["servers"][n]["graph_use"] = graph_use(self.servers[n].text())
        g_plain = res["features"].get("plain", {}).get("greedy_completions", {})
        for n in up:
            g = res["features"][n].get("greedy_completions", {})
            if n == "plain" or not (g.get("ok") and g_plain.get("ok")):
                continue
            try:
                res["servers"][n]["greedy_divergence_margins"] = divergence_margins(
                    Api(self.servers["plain"].url, REQUEST_TIMEOUT), ctx, g_plain["details"]["ids"],
                    g["details"]["ids"])
            except Exception as e:  # noqa: BLE001 - recorded; a diagnostic of the differences only
                res["servers"][n]["greedy_divergence_margins_error"] = error_text(e)
        self.stamp("after-load checks done")

    def stop(self) -> None:
        """The servers and the prebuild stopped, the results saved, the servers' logs archived."""
        for s in self.servers.values():
            s.stop()
        if self.prebuild is not None and self.prebuild.poll() is None:
            os.killpg(self.prebuild.pid, 15)
        self.save()
        archive_logs(self.args.out, f"{self.stem}_logs.tar.gz")

    def run(self) -> dict:
        try:
            up = self.serve()
            self.mixed_load(up)
            self.after_load(up)
        finally:
            self.stop()
        print_table(summarize(self.res))
        return self.res


# The run as pytest tests (one per check and server), which main() runs: their arguments travel in ARGS_ENV.
TESTS = os.path.join(REPO, "tests", "test_serving_conformance.py")
ARGS_ENV = "SERVING_FEATURES_ARGS"


def script_status(pytest_rc: int, summary: dict | None) -> tuple[int, str]:
    """The script's exit status after the tests: pytest's own when it did not run them (2 interrupted, 3 internal
    error, 4 usage error, 5 no tests); 1 when the run measured nothing (no summary: the run did not get as far as
    its first save) or a server did not start; 0 otherwise, failed checks included: they are the run's results,
    in the tests' report and the summary (scripts/device/versions.sh goes on to its next step after them, as
    before the tests)."""
    if pytest_rc not in (0, 1):
        return pytest_rc, f"pytest exited {pytest_rc}: the checks did not run"
    if summary is None:
        return 1, "no summary written: the run did not start"
    down = [n for n, r in summary["servers"].items() if not r["up"]]
    failed = sum(r.get("checks_total", 0) - r.get("checks_ok", 0) for r in summary["servers"].values())
    if down:  # a run whose servers did not start measured nothing: not a success
        return 1, f"servers that did not start: {', '.join(down)}"
    return 0, f"{failed} checks failed" if failed else "every check passed"


def run_tests(args, argv: list[str]) -> int:
    """TESTS under pytest, from outside the repository root (sglang_dspine.source_files says why), with this
    run's arguments (paths made absolute), each check reported; then script_status."""
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    summary_path = os.path.join(out, f"{stem_of(args)}_summary.json")
    if os.path.exists(summary_path):
        os.remove(summary_path)  # an earlier run's summary must not stand for this one
    child = [*argv, "--out", out, "--models", os.path.abspath(args.models)]
    if args.results_dir:
        child += ["--results-dir", os.path.abspath(args.results_dir)]
    cmd = [sys.executable, "-m", "pytest", TESTS, "-m", "gpu", "-v", "-s", "-rfE", "--tb=short", "-p",
           "no:cacheprovider", "--junitxml", os.path.join(out, f"{stem_of(args)}_tests.xml")]
    print(f"serving_features: {' '.join(cmd)} with {ARGS_ENV}={shlex.join(child)}", flush=True)
    rc = subprocess.run(cmd, cwd=OUTSIDE_REPO, env={**os.environ, ARGS_ENV: shlex.join(child)}).returncode
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else None
    status, why = script_status(rc, summary)
    print(f"serving_features: {why} (pytest exit status {rc}); results in {out}")
    return status


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    names, models = servers_and_models(args.servers, args.models)
    if args.smoke:
        return smoke(models)
    return run_tests(args, argv)


# -------------------------------------------------------------------------------------- CPU self-test
def _ret_item(ids: list[int], vocab_text: list[str], k: int, seed: int, greedy: bool) -> dict:
    """A /generate answer in SGLang's shape for emitted `ids`: log-probs from a random distribution per
    position in which a greedy token is the most likely."""
    rng = random.Random(seed)
    toks, tops = [], []
    for tid in ids:
        logits = {j: rng.gauss(0, 2) for j in range(64)}
        logits[tid] = max(logits.values()) + (1.0 if greedy else -0.5)
        z = math.log(sum(math.exp(v) for v in logits.values()))
        lp = {j: v - z for j, v in logits.items()}
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:k]
        toks.append((lp[tid], tid, vocab_text[tid]))
        tops.append([(v, j, vocab_text[j]) for j, v in top])
    return {"text": "".join(vocab_text[i] for i in ids), "output_ids": list(ids),
            "meta_info": {"id": "x", "finish_reason": {"type": "length", "length": len(ids)},
                          "prompt_tokens": 10, "completion_tokens": len(ids), "cached_tokens": 0,
                          "output_token_logprobs": toks, "output_top_logprobs": tops, "weight_version": "default"}}


def _sglang_chat_logprobs(ret: dict, tokenizer):
    """The ChoiceLogprobs the installed SGLang's chat server builds for a /generate answer: its own
    OpenAIServingChat._process_response_logprobs and the helpers it calls (0.5.17: _process_logprobs_tokens on
    to_openai_style_logprobs; 0.5.23: _build_token_logprobs_from_raw, bytes from the token id), compiled from
    serving_chat.py's source in the namespace of its protocol and utils modules, on an object holding the
    tokenizer as the server's tokenizer_manager does. (Compiled, not imported: the module's imports need
    xgrammar, which SGLang 0.5.23's test environment does not hold.)"""
    import ast
    import importlib.util
    import typing
    from types import MethodType, SimpleNamespace

    from sglang.srt.entrypoints.openai import protocol, utils

    path = importlib.util.find_spec("sglang.srt.entrypoints.openai.serving_chat").origin
    cls = next(n for n in ast.walk(ast.parse(open(path).read()))
               if isinstance(n, ast.ClassDef) and n.name == "OpenAIServingChat")
    names = ("_process_response_logprobs", "_process_logprobs_tokens", "_build_token_logprobs_from_raw")
    defs = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name in names]
    ns = {**vars(typing), **vars(protocol), **vars(utils)}
    exec(compile(ast.Module(body=defs, type_ignores=[]), path, "exec"), ns)
    server = SimpleNamespace(tokenizer_manager=SimpleNamespace(tokenizer=tokenizer))
    for f in defs:
        setattr(server, f.name, MethodType(ns[f.name], server))
    return server._process_response_logprobs(ret)


def openai_answers(ret: dict, chat: bool, tokenizer) -> dict:
    """The OpenAI answer the installed SGLang builds from a /generate answer (its own response classes and
    log-prob conversion, given the tokenizer where it takes one), passed through the OpenAI client's types as
    the client would. The emitted ids go where the release puts them for return_token_ids: `token_ids`, or
    `response_token_ids` on 0.5.23's chat."""
    import openai.types as ot
    import openai.types.chat as otc
    from sglang.srt.entrypoints.openai import protocol as P

    mi = ret["meta_info"]
    usage = P.UsageInfo(prompt_tokens=mi["prompt_tokens"], completion_tokens=mi["completion_tokens"],
                        total_tokens=mi["prompt_tokens"] + mi["completion_tokens"])
    finish = mi["finish_reason"]["type"]
    if chat:
        ids_field = "response_token_ids" if "response_token_ids" in P.ChatCompletionResponseChoice.model_fields \
            else "token_ids"
        choice = P.ChatCompletionResponseChoice(index=0, message=P.ChatMessage(role="assistant", content=ret["text"]),
                                                logprobs=_sglang_chat_logprobs(ret, tokenizer), finish_reason=finish,
                                                **{ids_field: ret["output_ids"]})
        resp = P.ChatCompletionResponse(id="x", model=MODEL, choices=[choice], usage=usage)
        return otc.ChatCompletion.model_validate(json.loads(resp.model_dump_json())).model_dump()
    lp = completion_logprobs(mi["output_token_logprobs"], mi["output_top_logprobs"], tokenizer)
    choice = P.CompletionResponseChoice(index=0, text=ret["text"], logprobs=lp, finish_reason=finish,
                                        token_ids=ret["output_ids"])
    resp = P.CompletionResponse(id="x", model=MODEL, choices=[choice], usage=usage)
    return ot.Completion.model_validate(json.loads(resp.model_dump_json())).model_dump()


def request_catalogue(ctx: dict) -> list[dict]:
    """Every request body the features and the load send (one of each shape)."""
    p, m = ctx["greedy_prompts"][0], ctx["chat_messages"][0]
    reqs = [completion_req(p, GREEDY_MAX), completion_req(p, 24, n=2, temperature=1.0),
            completion_req(p, 64, stop=["abc"]), completion_req(p, 3, temperature=1.0, ignore_eos=True),
            completion_req(p, GREEDY_MAX, stream=True), completion_req(p, LP_MAX, logprobs=TOP_K),
            completion_req(ctx["over_context_ids"], 16),
            completion_req(p, ABORT_MAX_TOKENS, stream=True, ignore_eos=True),
            chat_req(m, GREEDY_MAX), chat_req(m, LP_MAX, temperature=1.0, logprobs=True, top_logprobs=TOP_K),
            chat_req(ctx["json_messages"], 128, response_format=RESPONSE_FORMAT),
            generate_req(p, 64, regex=REGEX), generate_req(p, LP_MAX, temperature=1.0, logprobs=True),
            generate_req(p, 5, ignore_eos=True), generate_req(ctx["over_context_ids"], 16)]
    reqs += [completion_req(p, 24, **params) for params in SAMPLING_VARIANTS.values()]
    return reqs


def validate_request(req: dict, vocab_size: int) -> None:
    """The body against SGLang's own request model: every field known to it (pydantic would drop a misspelt
    one silently) and valid; /generate's sampling parameters through SamplingParams.verify."""
    import dataclasses

    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    body = req["body"]
    if req["endpoint"] == "/generate":
        unknown = set(body) - {f.name for f in dataclasses.fields(GenerateReqInput)}
        GenerateReqInput(**body)
        sp = SamplingParams(**body["sampling_params"])
        sp.normalize(None)
        sp.verify(vocab_size)
    else:
        model = CompletionRequest if req["endpoint"] == "/v1/completions" else ChatCompletionRequest
        unknown = set(body) - set(model.model_fields) - {f.alias for f in model.model_fields.values() if f.alias}
        model.model_validate(body)
        named, extra = split_openai(req["endpoint"], body)
        if set(named) | set(extra) != set(body):
            raise AssertionError(f"split_openai lost fields of {req}")
    if unknown:
        raise AssertionError(f"{req['endpoint']}: fields SGLang does not know: {sorted(unknown)}")


def check_flags(models: str) -> None:
    """Every server's command line parses with SGLang's own argument parser (a misspelt flag would stop a
    server on the GPU). DSPINE's algorithm name is registered by the plugin at server start, so its line is
    parsed with DFLASH's."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    target = os.path.join(models, "target")
    for args in (["--model-path", target, *FLAGS], spec_args(target, "DFLASH", os.path.join(models, "dflash"), *FLAGS)):
        parsed = parser.parse_args([*BASE_ARGS, "--port", "1", *args])
        assert parsed.chunked_prefill_size == CHUNK and parsed.grammar_backend == "xgrammar", parsed


def check_grammars(target: str) -> None:
    """REGEX and JSON_SCHEMA compile in xgrammar with the target's tokenizer, as the server compiles them, and
    accept (or refuse) sample outputs as expected; the sample JSON validates against the schema."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from xgrammar.testing import _is_grammar_accept_string as accepts

    tok = AutoTokenizer.from_pretrained(target)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    compiler.compile_regex(REGEX)
    compiler.compile_json_schema(json.dumps(JSON_SCHEMA), any_whitespace=False)
    regex_g = xgr.Grammar.from_regex(REGEX)
    json_g = xgr.Grammar.from_json_schema(json.dumps(JSON_SCHEMA), any_whitespace=False)
    good = '{"name": "alpha 1", "count": 12, "valid": true, "kind": "math"}'
    assert accepts(regex_g, "No, because it is wrong.") and not accepts(regex_g, "Maybe.")
    assert accepts(json_g, good) and not accepts(json_g, good.replace("12", "1200"))
    assert not accepts(json_g, good.replace("alpha", "al\tpha")) and not accepts(json_g, good.replace(": ", ":  "))
    validate_json(good)
    check_regex("Yes, because it works.")


def smoke(models: str) -> int:
    from transformers import AutoTokenizer

    target = os.path.join(models, "target")
    t = time.time()
    tok = AutoTokenizer.from_pretrained(target)
    ctx = build_inputs(tok, models)
    assert ctx["long_prompt_tokens"] >= LONG_MIN_TOKENS and ctx["shared_common_tokens"] >= PREFIX_MIN_TOKENS
    assert len(ctx["over_context_ids"]) > ctx["context_len"]
    print(f"inputs: {len(ctx['greedy_prompts'])} greedy prompts, long prompt {ctx['long_prompt_tokens']} tokens, "
          f"shared prefix {ctx['shared_common_tokens']} tokens, over-context {len(ctx['over_context_ids'])} tokens")
    check_flags(models)
    print("flags: the servers' command lines parse with SGLang's argument parser")
    check_grammars(target)
    print("grammars: regex and JSON schema compile in xgrammar and accept/refuse the samples")
    for req in request_catalogue(ctx):
        validate_request(req, len(ctx["vocab_text"]))
    print(f"requests: {len(request_catalogue(ctx))} bodies valid for SGLang's request models")
    vt = ctx["vocab_text"]
    ids = [5, 17, 300, 2]
    for greedy in (True, False):
        ret = _ret_item(ids, vt, TOP_K, 0, greedy)
        check_generate(ret, 4, exact=True)
        e = entries_generate(ret, TOP_K, greedy)
        for chat in (False, True):
            c = check_openai(openai_answers(ret, chat, tok), 4, exact=True, chat=chat)[0]
            e2 = entries_chat(c, vt, TOP_K, greedy) if chat else entries_completion(c, ctx["completion_token_text"],
                                                                                    TOP_K, greedy)
            assert compare_entries(e, e2)["positions"] == len(ids) and compare_entries(e,
                                                                                       e2)["token_max_abs_diff"] < 1e-6
    shifted = _ret_item(ids, vt, TOP_K, 0, True)
    shifted["meta_info"]["output_token_logprobs"] = shifted["meta_info"]["output_token_logprobs"][1:] + [(-0.1, 2, "")]
    try:
        entries_generate(shifted, TOP_K, True)
        raise AssertionError("log-probs one position off were not caught")
    except Malformed as e:
        print(f"checks: off-by-one log-probs caught ({e})")
    res = {"server_names": list(NAMES), "provenance": {"commit": "smoke"}, "features": {}, "servers": {}, "load": {}}
    for n in NAMES:
        res["servers"][n] = {"up": True}
        res["features"][n] = {f: {"ok": True, "details": {}} for f in ALL_FEATURES}
        res["features"][n]["logprobs_generate"]["details"] = {"greedy_entries": [entries_generate(
            _ret_item(ids, vt, TOP_K, 1 if n == "dspine" else 0, True), TOP_K, True)]}
        res["load"][n] = {"requests": 10, "errors": 0, "expected_400": 1, "by_kind": {}}
    res["features"]["dflash"]["logprobs_generate"] = {"ok": False, "error": "HTTP 400: no log-probs"}
    s = summarize(res)
    assert s["servers"]["dflash"]["features_ok"] == len(ALL_FEATURES) - 1
    assert s["servers"]["dspine"]["logprob_max_abs_diff_vs_plain"] > 0
    print_table(s)
    print(f"smoke ok in {time.time() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

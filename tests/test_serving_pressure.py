"""The pure parts of the pressure run (benchmarks/serving_pressure.py) on CPU: its prompts from the default pair's
tokenizer, request bodies against SGLang's request models, server flags against SGLang's parser, the readers of
SGLang's retraction/leak/decode log lines, /v1/loads and per-request spec counters on SGLang's own code, the
mismatch/near-tie, leak, accept-length and per-minute arithmetic, and the summary."""
import importlib
import os
import socket
import time
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models", "default")
TARGET = os.path.join(MODELS, "target")


@pytest.fixture(scope="module")
def sp():
    return importlib.import_module("benchmarks.serving_pressure")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def ctx(sp, tok):
    return sp.build_inputs(tok, MODELS)


def test_prompts_fill_the_pool_span_chunks_and_share_a_prefix(sp, ctx, tok):
    kv = ctx["kv_prompts"]
    assert len(kv) == sp.KV_CLIENTS == len(set(map(tuple, kv)))
    assert all(284 <= len(p) <= 316 for p in kv)
    # the load wants more than three pools, one request alone fits with its drafts
    assert sum(len(p) + sp.KV_NEW for p in kv) > 3 * sp.POOL_TOKENS
    assert max(map(len, kv)) + sp.KV_NEW + 2 * 16 < sp.POOL_TOKENS
    assert all(len(p) >= sp.LONG_MIN_TOKENS == 8 * sp.CHUNK for p in ctx["long_prompts"])
    shared = ctx["shared_prompts_ids"]
    n = ctx["shared_common"]
    assert len(shared) == sp.SHARED_CLIENTS and n >= sp.SHARED_PREFIX_TOKENS
    assert all(p[:n] == shared[0][:n] for p in shared) and len(set(map(tuple, shared))) == len(shared)
    assert len(ctx["burst_prompts"]) == 16
    # the ids are a chat prompt as the template writes it
    head, tail = sp.chat_frame(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False,
                                   add_generation_prompt=True)
    assert tok.decode(head + tok("hello there", add_special_tokens=False)["input_ids"] + tail) == text
    assert kv[0][:len(head)] == head and kv[0][-len(tail):] == tail


def test_near_context_length_gets_exactly_the_new_tokens(sp):
    # context 4096, pool 6144: max_req_len 4095, max_req_input_len 4090
    n = sp.near_context_input_len(4090, 4096, 48)
    assert n == 4046
    assert min(48, 4095 - n - 1) == 48  # scheduler.init_req_max_new_tokens' cap leaves all 48
    assert n + 48 <= 4096 and n < 4090  # tokenizer manager's and scheduler's length checks pass
    assert sp.near_context_input_len(4090, 4096, 49) == 4045
    # a pool smaller than the context bounds it
    assert sp.near_context_input_len(2994, 4096, 48) == 2950
    with pytest.raises(ValueError):
        sp.near_context_input_len(40, 4096, 48)
    f = list(range(100))
    ps = sp.near_context_prompts({"filler": f}, 30)
    assert len(ps) == sp.NEAR_PROMPTS and all(len(p) == 30 for p in ps) and ps[0] != ps[1]


def test_request_bodies_are_valid_sglang_requests(sp, ctx):
    sf = sp.sf
    reqs = sp.burst_requests(ctx)
    kinds = [r["kind"] for r in reqs]
    assert len(reqs) == sp.BURST_CLIENTS
    assert {k: kinds.count(k) for k in set(kinds)} == {"greedy": 16, "sampled": 16, "logprobs": 16, "regex": 8,
                                                       "json": 8}
    for r in reqs + [sp.greedy_req(ctx["kv_prompts"][0], sp.KV_NEW)]:
        sf.validate_request({"endpoint": r["endpoint"], "body": r["body"]}, len(ctx["vocab_text"]))
    g = sp.greedy_req([1, 2, 3], 7)["body"]
    assert g == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 7, "temperature": 0.0,
                                                              "ignore_eos": True}}
    assert all(r["body"]["sampling_params"]["temperature"] > 0 for r in reqs if r["kind"] == "sampled")


def test_server_flags_parse(sp):
    sp.check_flags(MODELS)
    assert sp.server_args("dspine", MODELS)[sp.server_args("dspine", MODELS).index("--speculative-algorithm") + 1] \
        == "DSPINE"


def test_sglang_formats_and_log_reading(sp):
    sp.check_sglang_formats()
    decode = ("Decode batch, #running-req: {n}, #token: 900, token usage: 0.15, accept len: 1.80, accept rate: 0.05, "
              "cuda graph: {g}, gen throughput (token/s): 100.00, #queue-req: 3")
    text = "\n".join([sp.retract_line(4), decode.format(n=12, g=False), decode.format(n=6, g=True),
                      "WARNING Testing retraction. #retracted_reqs: 9, #new_tokens_gained: 1",
                      sp.retract_line(1), "full memory leak detected! [full] total=6144"])
    st = sp.log_stats(text)
    assert (st["retract_events"], st["retracted_reqs"]) == (2, 5)  # the test-mode retraction is not KV exhaustion
    assert st["max_running_req"] == 12 and st["cuda_graph_false"] == 1 and st["cuda_graph_true"] == 1
    assert st["leak_warnings"] == 1 and st["tracebacks"] == 0
    assert sp.log_stats("")["max_running_req"] == 0


def test_leak_arithmetic_on_sglang_load_snapshots(sp):
    from sglang.srt.managers.load_snapshot import LoadSnapshot

    def snap(used, running=0, waiting=0):
        return LoadSnapshot(num_used_tokens=used, max_total_num_tokens=6144, num_running_reqs=running,
                            num_waiting_reqs=waiting).to_dict({"core"})

    start = snap(0)
    assert sp.free_tokens(start) == 6144 and sp.is_idle(start)
    assert not sp.is_idle(snap(10, running=1)) and not sp.is_idle(snap(0, waiting=2))
    assert sp.leaked(start, [snap(0)]) == 0
    assert sp.leaked(start, [snap(0), snap(33), snap(5)]) == 33
    assert sp.leaked(None, [snap(3)]) is None and sp.leaked(start, []) is None
    assert sp.no_leak(0) is True and sp.no_leak(1) is False and sp.no_leak(None) is None


def test_accept_length_from_sglang_spec_counters(sp):
    # SGLang's own meta_info: 128 tokens in 64 verify steps, once retracted
    m = sp.spec_meta(128, 64, 60, retractions=1)
    assert m["spec_verify_ct"] == 64 and m["spec_accept_length"] == 2.0
    a = sp.accept_stats([m, sp.spec_meta(50, 20, 10)])
    assert a["requests"] == 2 and a["verify_steps"] == 84
    assert a["accept_length"] == pytest.approx((126 + 49) / 84)
    assert a["sglang_accept_length"] == pytest.approx(178 / 84)
    assert sp.accept_stats([{"completion_tokens": 10}, None]) is None  # no speculation
    ref = {"accept_length": 2.0}
    assert sp.accept_check({"accept_length": 2.09}, ref)["ok"]
    c = sp.accept_check({"accept_length": 1.8}, ref)
    assert c["ratio"] == pytest.approx(0.9) and not c["ok"]
    assert sp.accept_check(None, ref) is None


def test_mismatches_and_the_near_tie_rule(sp):
    ref = [[1, 2, 3], [4, 5, 6], [7, 8], [1], None]
    got = [[1, 2, 3], [4, 9, 6], [7, 8, 9], [2], [5]]
    mm = sp.greedy_mismatches(ref, got)
    assert [(m["index"], m["position"]) for m in mm] == [(1, 1), (2, None), (3, 0)]
    tie = dict(top1=[5, -0.60], top2=[9, -0.64], margin=0.04, ref_token=5, got_token=9)
    mm[0].update(tie)
    assert sp.is_near_tie(mm[0])
    assert not sp.is_near_tie({**mm[0], "margin": 0.2})
    assert not sp.is_near_tie({**mm[0], "top2": [11, -0.64]})  # the other token is not the runner-up
    assert sp.is_near_tie({**mm[0], "top1": [9, -0.60], "top2": [5, -0.64]})  # the reference is the odd one
    assert not sp.is_near_tie(mm[1])  # a length difference has no margin
    # with the top 5 recorded: a three-way tie (the H200's prompt 30: 711 / 86 / 497 within 0.07) counts,
    # a token further down or absent does not
    three = {**mm[0], "ref_token": 711, "got_token": 497, "margin": 0.031,
             "top": [[711, -4.129], [86, -4.160], [497, -4.18], [3, -4.5], [4, -4.6]]}
    assert sp.is_near_tie(three)
    assert not sp.is_near_tie({**three, "got_token": 3})  # 0.371 below the best
    assert not sp.is_near_tie({**three, "got_token": 99})  # not among the top
    c = sp.mismatch_counts(mm, 4)
    assert (c["compared"], c["mismatches"], c["near_tie"], c["unexplained"]) == (4, 3, 1, 2)


def test_tie_margins_ask_one_token_after_the_reference_prefix(sp, ctx):
    """The replay is the prompt plus the reference tokens before the difference, one token, its top log-probs."""
    sent = []

    class Replay:
        def call(self, req):
            sent.append(req)
            body = req["body"]
            ans = sp.sf._ret_item([42], ctx["vocab_text"], 2, 0, greedy=True)
            mi = ans["meta_info"]
            mi["output_top_logprobs"] = [[(-0.50, 42, "a"), (-0.52, 17, "b")]]
            assert body["sampling_params"]["max_new_tokens"] == 1 and body["top_logprobs_num"] == sp.sf.TOP_K
            return ans

    prompts, ref, got = [[9, 9], [8, 8]], [[1, 2, 3], [1, 42, 5]], [[1, 2, 3], [1, 17, 5]]
    cmp = sp.compare(Replay(), prompts, ref, got)
    assert [r["body"]["input_ids"] for r in sent] == [[8, 8, 1]]
    d = cmp["details"][0]
    assert d["margin"] == pytest.approx(0.02) and (d["ref_token"], d["got_token"]) == (42, 17)
    assert cmp["near_tie"] == 1 and cmp["unexplained"] == 0

    class Refuses:
        def call(self, req):
            raise sp.sf.HttpError(400, '{"message": "DFLASH speculative decoding does not support return_logprob yet."}')

    cmp = sp.compare(Refuses(), prompts, ref, got)
    assert cmp["unexplained"] == 1 and "does not support" in cmp["details"][0]["margin_error"]


def test_answer_checks(sp, ctx):
    sf = sp.sf
    ok = {"text": "ab", "output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"},
                                                            "completion_tokens": 2, "num_retractions": 1}}
    short = {**ok, "output_ids": [1], "meta_info": {**ok["meta_info"], "completion_tokens": 1}}
    ids, metas, errors = sp.greedy_results([(ok, None, 0.1), (short, None, 0.1), (None, "HTTP 500: x", 0.1)], 2)
    assert ids == [[1, 2], None, None] and metas[0]["num_retractions"] == 1 and len(errors) == 2
    assert errors[0].startswith("Malformed") and errors[1] == "HTTP 500: x"
    reqs = {r["kind"]: r for r in sp.burst_requests(ctx)}
    def lp_answer(greedy):  # three tokens, stopped (an EOS) before max_new_tokens
        ans = sf._ret_item([5, 17, 300], ctx["vocab_text"], sf.TOP_K, 0, greedy=greedy)
        ans["meta_info"]["finish_reason"] = {"type": "stop"}
        return ans

    assert sp.check_burst_answer({**reqs["logprobs"], "greedy": True}, lp_answer(True), ctx["vocab_text"]) is None
    with pytest.raises(sf.Malformed, match="not the most likely"):
        sp.check_burst_answer({**reqs["logprobs"], "greedy": True}, lp_answer(False), ctx["vocab_text"])
    with pytest.raises(sf.Malformed, match="expected exactly"):  # a greedy request must give all its tokens
        sp.check_burst_answer(reqs["greedy"], lp_answer(True), ctx["vocab_text"])
    regex = {"text": "Maybe.", "output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"},
                                                                "completion_tokens": 1}}
    with pytest.raises(sf.Malformed, match="does not match"):
        sp.check_burst_answer(reqs["regex"], regex, ctx["vocab_text"])
    g = {"text": "x", "output_ids": list(range(sp.BURST_GREEDY_NEW)),
         "meta_info": {"finish_reason": {"type": "length"}, "completion_tokens": sp.BURST_GREEDY_NEW}}
    assert sp.check_burst_answer(reqs["greedy"], g, ctx["vocab_text"]) == list(range(sp.BURST_GREEDY_NEW))
    assert sp.unsupported("HTTP 400: DFLASH speculative decoding does not support return_logprob yet.")
    assert not sp.unsupported("HTTP 400: The input (5000 tokens) is longer than the model's context length")


def test_soak_analysis_on_synthetic_minutes(sp):
    """The soak's verdict: a slope fitted over the minutes against 1% of the fitted start (a pool losing 2% over
    the run fails, one flat within noise passes), p99 against its own load's median (a p99 that doubles over the
    run fails, one that scatters passes), the minutes' rows from the load's records."""
    soak = sp.soak
    assert soak.percentile([], 99) is None and soak.percentile(list(range(1, 101)), 99) == 99
    assert soak.schedule(12) == list(soak.SCHEDULE) + list(soak.SCHEDULE[:2])
    assert min(soak.SCHEDULE) == 1 and max(soak.SCHEDULE) == 64
    assert soak.fit_line([0, 1, 2], [1, 3, 5]) == (1.0, 2.0) and soak.fit_line([1, 1], [1, 2]) is None
    flat = soak.flatness([6100, 6102, 6099, 6101, None, 6100, 6098, 6101, 6100, 6099, 6102, 6100, 6101, 6099, 6100])
    assert flat["ok"] is True and flat["readings"] == 14 and flat["relative"] < 0.001
    leak = soak.flatness([6100 - 9 * m for m in range(16)])  # 135 tokens of 6100 over 15 minutes: 2.2%
    assert leak["ok"] is False and leak["slope_per_minute"] == -9.0 and abs(leak["relative"] - 135 / 6100) < 1e-4
    assert soak.flatness([None, 5])["ok"] is None
    base = {1: 0.5, 16: 1.0, 64: 3.0, 32: 2.0, 4: 0.6, 48: 2.5, 8: 0.8, 24: 1.5, 2: 0.5}
    clients = soak.schedule(20)
    steady = [{"clients": c, "p99_s": base[c] * (1.05 if m % 3 else 0.95)} for m, c in enumerate(clients)]
    rising = [{"clients": c, "p99_s": base[c] * (1 + m / 10)} for m, c in enumerate(clients)]
    assert soak.p99_trend(steady)["ok"] is True
    r = soak.p99_trend(rising)
    assert r["ok"] is False and r["per_clients"]["64"] == {"minutes": 4, "first_p99_s": base[64] * (1 + 2 / 10),
                                                            "last_p99_s": base[64] * (1 + 17 / 10)}
    recs = [(1.0, 0.2, "greedy", "ok"), (2.0, 0.4, "stop", sp.sf.LENGTH_BEFORE_STOP), (3.0, 9.0, "json", "errors"),
            (4.0, 1.0, "logprobs_chat", "unsupported"), (5.0, 0.3, "over_context", "expected_400")]
    row = soak.minute_row(3, 16, recs, 50.0, sp.sf.ANSWERED)
    assert (row["minute"], row["clients"], row["requests"], row["errors"], row["unsupported"]) == (3, 16, 5, 1, 1)
    assert row["rps"] == 0.1 and row["p50_s"] == 0.3 and row["p99_s"] == 0.4  # answered outcomes' latencies
    rows = [{**soak.minute_row(m, c, recs[:1], 60.0, ("ok",)), "gpu_mib": 1840, "free_tokens": 6100}
            for m, c in enumerate(clients)]
    v = soak.verdict(rows, 20 * 60.0)
    assert soak.checks(v) == {"lasted": True, "no_errors": True, "gpu_memory_flat": True,
                              "free_kv_tokens_flat": True, "p99_not_rising": True}
    assert soak.checks(soak.verdict(rows[:5], 300.0))["lasted"] is False


def test_soak_plot_draws_every_series(sp, tmp_path):
    rows = [{"minute": m, "clients": c, "requests": 10 * c, "errors": 0, "rps": c / 2, "p50_s": 0.1, "p99_s": 0.3,
             "gpu_mib": 1840, "free_tokens": 6100 if m != 2 else None} for m, c in enumerate(sp.soak.schedule(6))]
    path = sp.soak.plot(rows, str(tmp_path / "soak.png"), "dspine soak")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_failing_scenario_is_recorded_and_isolated(sp, ctx, monkeypatch):
    monkeypatch.setattr(sp, "HEALTH_GRACE_S", 0.5)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: every request fails at once
    server = SimpleNamespace(url=f"http://127.0.0.1:{port}", proc=SimpleNamespace(poll=lambda: None),
                             text=lambda: "")
    assert sp.Session("dflash", server, ctx).refusable and not sp.Session("dspine", server, ctx).refusable
    rec = sp.run_scenario(sp.Session("dspine", server, ctx), "kv_exhaustion")
    assert rec["ok"] is False and rec["error"]
    # a process that runs but answers nothing is not a live server (at fc5c402 this read "alive")
    assert rec["server_alive"] is False and rec["checks"] == {"completed": False, "server_alive": False}


def test_summary_and_table(sp, capsys):
    mm = sp.mismatch_counts([{"index": 0, "position": 3, "ref_len": 5, "got_len": 5, "top1": [1, -0.1],
                              "top2": [2, -0.12], "margin": 0.02, "ref_token": 1, "got_token": 2}], 48)
    acc = sp.accept_check({"accept_length": 1.9}, {"accept_length": 2.0})
    res = {"server_names": ["plain", "dspine"], "provenance": {"commit": "abc"},
           "servers": {"plain": {"up": False, "error": "did not start: boom"}, "dspine": {"up": True}},
           "scenarios": {"dspine": {
               "kv_exhaustion": {"ok": False, "requests": 48, "errors": 0, "greedy": mm, "leaked_tokens": 12,
                                 "retracted_requests": 7, "accept_retracted": acc,
                                 "checks": {"no_leak": False, "no_errors": True, "accept_after_readmission": False}},
               "disconnects": {"ok": True, "requests": 300, "errors": 0, "leaked_tokens": None,
                               "load": {"unsupported": 40},
                               "log": {"retracted_reqs": 2}, "checks": {"no_leak": None}}}}}
    s = sp.summarize(res)
    kv = s["servers"]["dspine"]["scenarios"]["kv_exhaustion"]
    assert (kv["mismatches"], kv["mismatches_near_tie"], kv["leaked_tokens"], kv["retracted_requests"]) == (1, 1, 12, 7)
    assert kv["accept_length"] == 1.9 and kv["accept_length_reference"] == 2.0
    assert kv["failed_checks"] == ["accept_after_readmission", "no_leak"]
    d = s["servers"]["dspine"]["scenarios"]["disconnects"]
    assert d["failed_checks"] == [] and d["retracted_requests"] == 2 and d["accept_length"] is None
    assert d["refused_unsupported"] == 40 and kv["refused_unsupported"] is None
    assert s["servers"]["plain"]["up"] is False and s["commit"] == "abc" and s["server_flags"] == sp.FLAGS
    sp.print_table(s)
    out = capsys.readouterr().out
    assert "plain   did not start: did not start: boom" in out
    assert "1.90/2.00" in out and "failed ['accept_after_readmission', 'no_leak']" in out


def test_arguments_refused(sp):
    with pytest.raises(SystemExit, match="--servers"):
        sp.main(["--servers", "eagle", "--smoke"])
    with pytest.raises(SystemExit, match="--scenarios"):
        sp.main(["--scenarios", "kv", "--smoke"])
    with pytest.raises(SystemExit, match="soak-seconds"):
        sp.main(["--scenarios", "soak", "--smoke"])


def test_readmission_compares_only_equal_outputs_against_the_others_spread(sp):
    """Re-admitted requests pass when their pooled accept ratio (under load / alone) is at least the lower of
    1 - tol and the worst ratio among requests that were not retracted; outputs that differ from alone are left
    out (a flipped near-tie changes the acceptance legitimately)."""
    def meta(steps, retractions=0):  # 101 tokens: the prefill's, one per re-admission, the rest from verify steps
        return {"spec_verify_ct": steps, "completion_tokens": 101 + retractions, "num_retractions": retractions}

    alone = [meta(50), meta(50), meta(50), meta(50)]
    ref = [[1], [2], [3], [4]]
    # request 3 differs from its run alone: its ratio (0.5) is not one of the others
    under = [meta(50, 1), meta(53), meta(50), meta(100)]
    got = [[1], [2], [3], [9]]
    ok = sp.readmission_check(under, alone, got, ref, retracted=[0])
    assert ok["ok"] and ok["retracted_equal_output"] == 1 and ok["ratio"] == pytest.approx(1.0)
    assert ok["others_ratio_min"] == pytest.approx(50 / 53) and ok["floor"] == pytest.approx(50 / 53)
    worse = sp.readmission_check([meta(60, 1), *under[1:]], alone, got, ref, retracted=[0])
    assert not worse["ok"] and worse["ratio"] == pytest.approx(50 / 60)
    assert sp.readmission_check(under, alone, got, ref, retracted=[3]) is None  # its output differs: nothing to say


def test_flashinfer_prebuild_calls_what_the_installed_flashinfer_has():
    """benchmarks/servers.py's PREBUILD (run on the GPU before servers that would JIT-build FlashInfer modules
    while starting) compiles, and every flashinfer function it calls exists with the keywords it passes."""
    import ast
    import inspect

    import flashinfer
    import flashinfer.sampling as sampling

    from benchmarks import servers

    calls = [n for n in ast.walk(ast.parse(servers.PREBUILD)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
             and n.func.value.id in ("flashinfer", "s")]
    assert {c.func.attr for c in calls} == {"top_k", "top_k_renorm_probs", "top_p_renorm_probs"}
    for c in calls:
        fn = getattr(flashinfer if c.func.value.id == "flashinfer" else sampling, c.func.attr)
        params = inspect.signature(fn).parameters
        assert all(k.arg in params for k in c.keywords), (c.func.attr, [k.arg for k in c.keywords])


# ------------------------------------------------------------------------ the fc5c402 H200 run's failures
class FakeSglang:
    """A local HTTP server answering what the pressure run asks of SGLang: /health, /v1/loads, /flush_cache and
    /generate by `generate(body) -> answer`; `healthy` False makes /health answer 503."""

    def __init__(self, generate=None):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        fake = self
        self.healthy, self.generate, self.calls = True, generate, []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.calls.append(self.path)
                if self.path == "/health":
                    self._send(200 if fake.healthy else 503, {})
                elif self.path.startswith("/v1/loads"):
                    self._send(200, {"loads": [{"num_used_tokens": 0, "max_total_num_tokens": 6144,
                                                "num_running_reqs": 0, "num_waiting_reqs": 0}]})
                elif self.path == "/flush_cache":
                    self._send(200, {})
                else:
                    self._send(404, {})

            def do_POST(self):
                fake.calls.append(self.path)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                answer = fake.generate(body)
                if not body.get("stream"):
                    return self._send(200, answer)
                self.send_response(200)  # SSE as SGLang streams /generate: a data line a chunk, then [DONE]
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for chunk in answer:
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # 48 clients connect at once (the default backlog, 5, resets some)

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def server(self, poll=lambda: None, text=""):
        return SimpleNamespace(url=self.url, proc=SimpleNamespace(poll=poll), text=lambda: text)

    def close(self):
        self.httpd.shutdown()


# The end of stock DFLASH's log at fc5c402 (server_dflash.log, lines 1609-1631): a near-context request left 16
# tokens (one draft block) out of the pool, SGLang's idle leak check raised, SIGQUIT; the launcher exited at 15:53:37.
DFLASH_DEATH = """[2026-12-02 15:53:32] Decode batch, #running-req: 1, #token: 4125, token usage: 0.67, accept len: 1.00, \
accept rate: 0.00, cuda graph: True, gen throughput (token/s): 393.55, #queue-req: 0
[2026-12-02 15:53:32] Scheduler hit an exception: Traceback (most recent call last):
  File "/tmp/site/sglang/srt/managers/scheduler.py", line 3946, in on_idle
    self.invariant_checker._report_leak("pool", "\\n".join(messages))
  File "/tmp/site/sglang/srt/utils/common.py", line 4521, in raise_error_or_warn
    raise ValueError(message)
ValueError: pool memory leak detected! [full] total=6144, available=52, evictable=6076, protected=0, session_held=0, \
uncached=0

[2026-12-02 15:53:32] INFO:     127.0.0.1:58492 - "POST /generate HTTP/1.1" 200 OK
[2026-12-02 15:53:32] SIGQUIT received. signum=None, frame=None. It usually means one child failed.
[2026-12-02 15:53:32] Sleeping 5 seconds before crash diagnostics to let GPU activity settle.
"""


def test_a_server_is_alive_while_its_process_runs_and_health_answers(sp, monkeypatch):
    """At fc5c402 stock DFLASH's scheduler died (15:53:32), its launcher slept 5 s, and proc.poll() at 15:53:35
    called it alive: long_prompts and disconnects were both recorded with server_alive true."""
    monkeypatch.setattr(sp, "HEALTH_GRACE_S", 0.5)
    fake = FakeSglang()
    try:
        assert sp.server_alive(fake.server())
        assert not sp.server_alive(fake.server(poll=lambda: 0))  # the process exited
        fake.healthy = False  # the launcher lingers, its scheduler is gone
        t = time.time()
        assert not sp.server_alive(fake.server())
        assert time.time() - t < 5
    finally:
        fake.close()


def test_the_scenarios_of_a_dead_server_are_skipped_with_its_crash(sp, ctx, monkeypatch):
    monkeypatch.setattr(sp, "HEALTH_GRACE_S", 0.5)
    assert sp.crash_reason(DFLASH_DEATH) == ("ValueError: pool memory leak detected! [full] total=6144, available=52, "
                                             "evictable=6076, protected=0, session_held=0, uncached=0")
    assert sp.crash_reason("no trouble here\nValueError: not after a traceback") is None
    fake = FakeSglang(generate=lambda body: pytest.fail("a request to a dead server"))
    fake.healthy = False
    try:
        rec = sp.scenario_or_skip(sp.Session("dflash", fake.server(text=DFLASH_DEATH), ctx), "disconnects")
    finally:
        fake.close()
    assert rec["ok"] is False and rec["checks"] == {"server_alive": False}
    assert rec["error"].startswith("skipped: the server is down (ValueError: pool memory leak detected!")
    assert [c for c in fake.calls if c != "/health"] == []
    s = sp.summarize({"server_names": ["dflash"], "servers": {"dflash": {"up": True}},
                      "scenarios": {"dflash": {"disconnects": rec}}})
    row = s["servers"]["dflash"]["scenarios"]["disconnects"]
    assert row["failed_checks"] == ["server_alive"] and row["server_error"].startswith("ValueError: pool memory")


def test_the_load_counts_answers_ended_by_length_with_a_stop_string_apart(sp, ctx, monkeypatch):
    """DSPINE's one disconnects error at fc5c402: a T=0/1 'stop' answer of 48 tokens whose last token is ',' (its
    stop string), finished by length since SGLang checks max_new_tokens first (Req.update_finish_state). Since
    6cd0b93 serving_features' stop kind returns LENGTH_BEFORE_STOP for it; the load counts those apart, per minute
    too, with their latency, and not as errors."""
    sf = sp.sf

    def boom(api, ctx, rng):
        raise sf.Malformed("output contains the stop string ',' (finish_reason 'stop')")

    monkeypatch.setattr(sf, "LOAD_KINDS", {"stop_kept": lambda api, ctx, rng: sf.LENGTH_BEFORE_STOP,
                                           "ok": lambda api, ctx, rng: "ok", "bad": boom,
                                           "odd": lambda api, ctx, rng: "maybe"})
    load = sf.mixed_load(SimpleNamespace(), ctx, 0.3, 3)
    by = load["by_kind"]
    assert load["errors"] == by["bad"]["requests"] + by["odd"]["requests"] and by["stop_kept"]["errors"] == 0
    assert load[sf.LENGTH_BEFORE_STOP] == by["stop_kept"]["requests"] > 0
    assert "check returned 'maybe'" in load["error_samples"]["odd"][0]
    row = sp.soak.minute_row(0, 3, load["records"], 0.3, sf.ANSWERED)
    assert row["errors"] == load["errors"] and row["p99_s"] is not None
    s = sp.summarize({"server_names": ["dspine"], "servers": {"dspine": {"up": True}},
                      "scenarios": {"dspine": {"disconnects": {"ok": True, "requests": 9, "errors": 0, "checks": {},
                                                               "load": {sf.LENGTH_BEFORE_STOP: 2}}}}})
    assert s["servers"]["dspine"]["scenarios"]["disconnects"]["length_before_stop"] == 2


def test_the_fc5c402_unexplained_mismatches_are_three_way_ties(sp):
    """The two mismatches the fc5c402 run left unexplained under the top-2 rule (its records hold no top 5): DSPINE
    and DFLASH kv_exhaustion prompt 30 at position 50 (711 alone, 497 under load; the H200's top-2 711/86, gap
    0.031) and DFLASH graph_overflow prompt 13 at 17 (1269 alone, 1300 under load; top-2 1289/1269, gap 0). The
    target on CPU in bf16 on the same contexts: 497 -4.1300, 711 -4.1300, 86 -4.1612 and 1289 -1.1089,
    1300 -1.1714, 1269 -1.1714 (fp32: gaps 0.062 and 0.033): three-way near-ties, which the top-5 rule counts."""
    kv30 = {"index": 30, "position": 50, "top1": [711, -4.1288], "top2": [86, -4.1601], "margin": 0.03125,
            "ref_token": 711, "got_token": 497}
    g13 = {"index": 13, "position": 17, "top1": [1289, -1.1509], "top2": [1269, -1.1509], "margin": 0.0,
           "ref_token": 1269, "got_token": 1300}
    assert not sp.is_near_tie(kv30) and not sp.is_near_tie(g13)  # fc5c402's records: only the top-2
    assert sp.is_near_tie({**kv30, "top": [[497, -4.1300], [711, -4.1300], [86, -4.1612], [87, -4.2550],
                                           [473, -4.3487]]})
    assert sp.is_near_tie({**g13, "top": [[1289, -1.1089], [1300, -1.1714], [1269, -1.1714], [550, -5.6089],
                                          [682, -6.1401]]})
    # the rule stays the margin: the same tokens 0.08 below the best are not a tie
    assert not sp.is_near_tie({**g13, "top": [[1289, -1.10], [1269, -1.10], [1300, -1.18], [550, -5.6],
                                              [682, -6.1]]})


# -------------------------------------------------------------------------- the memory scenario at 8B geometry
def test_geometry_inputs_models_and_flags(sp, tmp_path):
    ctx = sp.geometry_inputs("qwen3-8b")
    kv = ctx["kv_prompts"]
    assert ctx["geometry"] == "qwen3-8b" and ctx["context_len"] == 40960
    assert len(kv) == sp.KV_CLIENTS == len(set(map(tuple, kv))) and all(284 <= len(p) <= 316 for p in kv)
    assert all(1 <= t < 151643 for p in kv for t in p)  # below Qwen3's special tokens
    assert sum(len(p) + sp.KV_NEW for p in kv) > 3 * sp.POOL_TOKENS
    dirs = sp.write_geometry_models(str(tmp_path / "m"), "tiny", "cpu")
    assert set(dirs) == {"target", "dflash", "dspine"}
    sp.check_flags(None, dirs)
    plain = sp.server_args("plain", None, dirs)
    assert "--speculative-draft-load-format" not in plain and "--skip-tokenizer-init" in plain
    assert sp.output_names("qwen3-8b") == {"json": "serving_pressure_qwen3-8b.json",
                                           "summary": "serving_pressure_qwen3-8b_summary.json",
                                           "logs": "serving_pressure_qwen3-8b_logs.tar.gz"}
    assert sp.output_names("")["summary"] == "serving_pressure_summary.json"
    with pytest.raises(SystemExit, match="the memory scenario"):
        sp.main(["--geometry", "qwen3-8b", "--scenarios", "disconnects", "--smoke"])
    assert sp.main(["--geometry", "qwen3-8b", "--smoke", "--work", str(tmp_path / "w")]) == 0


def test_kv_exhaustion_on_a_random_weight_geometry_server(sp, monkeypatch):
    """The memory scenario against a server answering as SGLang does with --skip-tokenizer-init (ids, no text):
    every request complete, retractions seen, the pool back to its start, the re-admitted requests' acceptance
    against alone; outputs that differ (flat logits) counted for information, not failed."""
    monkeypatch.setattr(sp, "HEALTH_GRACE_S", 0.5)
    ctx = sp.geometry_inputs("tiny")
    index = {tuple(p): i for i, p in enumerate(ctx["kv_prompts"])}
    seen: set = set()

    def generate(body):
        i, new = index[tuple(body["input_ids"])], body["sampling_params"]["max_new_tokens"]
        loaded = i not in seen  # the first call of each prompt is the one under load
        seen.add(i)
        retractions = int(loaded and i % 4 == 0)
        ids = [(i * 7 + k + (loaded and i % 3 == 0)) % 500 for k in range(new)]
        return {"output_ids": ids, "meta_info": {"finish_reason": {"type": "length"}, "completion_tokens": new,
                                                 "num_retractions": retractions,
                                                 "spec_verify_ct": new - 1 - retractions}}

    fake = FakeSglang(generate)
    try:
        rec = sp.run_scenario(sp.Session("dspine", fake.server(), ctx), "kv_exhaustion")
    finally:
        fake.close()
    assert rec["ok"], rec
    assert rec["errors"] == 0 and rec["retracted_requests"] == 12 and rec["leaked_tokens"] == 0
    assert rec["greedy"]["mismatches"] == 16 and "greedy_equal_or_near_tie" not in rec["checks"]
    assert rec["retracted_indices"] == list(range(0, 48, 4))
    assert [m["index"] for m in rec["greedy"]["details"] if m["retracted"]] == [0, 12, 24, 36]
    assert rec["accept_retracted"]["retracted_equal_output"] == 12 and rec["accept_retracted"]["ratio"] == 1.0
    assert set(rec["checks"]) == {"no_errors", "retraction_seen", "no_leak", "accept_after_readmission",
                                  "server_alive"}


def test_a_servers_processes_are_found_by_its_session(sp):
    """The soak's memory is the server's own where nvidia-smi lists its processes: they are found by the session
    the server starts in (a launcher and its children), and no process outside that session is."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                             "print(c.pid, flush=True); time.sleep(30)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        assert sp.session_pids(proc.pid) == {proc.pid, child}
        assert os.getpid() not in sp.session_pids(proc.pid)
        mib, scope = sp.gpu_memory_mib(proc.pid)
        assert scope in ("server", "gpu", "none") and (mib is None) == (scope == "none")
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def test_a_soak_runs_its_minutes_at_the_scheduled_clients(sp, ctx, monkeypatch, tmp_path):
    """Each minute at its client count, then an idle reading (free tokens, GPU memory); the minutes so far and
    their plot on disk after each minute (a lease can end inside the soak); the summary carries the minutes."""
    monkeypatch.setattr(sp.soak, "MINUTE_S", 0.3)
    monkeypatch.setattr(sp.soak, "SCHEDULE", (1, 4, 2))
    monkeypatch.setattr(sp.sf, "LOAD_KINDS", {"generate": lambda api, ctx, rng: api.call(
        sp.sf.generate_req([1, 2], 1)) and "ok"})
    fake = FakeSglang(generate=lambda body: {"text": "x", "meta_info": {"finish_reason": {"type": "length"}}})
    path = tmp_path / "soak_minutes.json"
    server = SimpleNamespace(url=fake.url, proc=SimpleNamespace(poll=lambda: None, pid=os.getpid()), text=lambda: "")
    try:
        rec = sp.s_soak(sp.Session("dspine", server, ctx, progress_path=str(path)), 1.2)
    finally:
        fake.close()
    rows = rec["per_minute"]
    assert [r["clients"] for r in rows] == [1, 4, 2, 1] == rec["schedule"]
    assert all(r["requests"] > 0 and r["errors"] == 0 and r["free_tokens"] == 6144 for r in rows)
    assert rec["requests"] == sum(r["requests"] for r in rows) and rec["leaked_tokens"] == 0
    assert rec["checks"]["lasted"] is False and rec["checks"]["free_kv_tokens_flat"] is True
    assert sp.json.load(open(path))["per_minute"] == sp.json.loads(sp.json.dumps(rows))
    assert os.path.getsize(tmp_path / "soak_minutes.png") > 0 and rec["plot"] == "soak_minutes.png"
    s = sp.summarize({"server_names": ["dspine"], "servers": {"dspine": {"up": True}},
                      "scenarios": {"dspine": {"soak": {**rec, "ok": False}}}})["servers"]["dspine"]["scenarios"]["soak"]
    assert [m["clients"] for m in s["per_minute"]] == [1, 4, 2, 1] and s["verdict"]["lasted"] is False
    assert "lasted" in s["failed_checks"] and set(s["failed_checks"]) <= {"lasted", "p99_not_rising"}


def test_a_soak_ends_when_its_server_exits(sp, ctx, monkeypatch):
    """A server that exits inside the soak (at stop 47 another job's cleanup killed it 10 minutes in) ends the
    soak at the next sample: the rest of the 20 minutes would only count refused connections on the GPU's time.
    The record keeps the minutes served and says when the server went."""
    monkeypatch.setattr(sp.soak, "MINUTE_S", 2.0)
    monkeypatch.setattr(sp.soak, "SCHEDULE", (2,))
    served = []

    def generate(body):
        served.append(1)
        return {"text": "x", "meta_info": {"finish_reason": {"type": "length"}}}

    fake = FakeSglang(generate=generate)
    # the server "exits" once it has answered a few of the soak's requests (whatever the machine's speed)
    proc = SimpleNamespace(poll=lambda: None if len(served) < 5 else -9, pid=os.getpid())
    server = SimpleNamespace(url=fake.url, proc=proc, text=lambda: "")
    t0 = time.time()
    try:
        rec = sp.s_soak(sp.Session("dspine", server, ctx), 60.0)
    finally:
        fake.close()
    assert time.time() - t0 < 30
    assert rec["server_exited_after_minute"] == 0 and len(rec["per_minute"]) == 1
    assert rec["checks"]["lasted"] is False and rec["requests"] > 0 and rec["per_minute"][0]["requests"] > 0


def chunks_of(steps: list[int], retract_after: int | None = None) -> list[tuple]:
    """A stream's cumulative (tokens, verify steps, retractions) chunks: the prefill's token, then a verify step
    emitting each of `steps` tokens; a retraction after chunk `retract_after`, whose re-prefill emits the next
    step's first token (so the total stays that of the steps)."""
    out, tokens, verify, retr = [(1, 0, 0)], 1, 0, 0
    for k, n in enumerate(steps):
        if k == retract_after:
            retr, tokens, n = retr + 1, tokens + 1, n - 1
            out.append((tokens, verify, retr))
        tokens, verify = tokens + n, verify + 1
        out.append((tokens, verify, retr))
    return out


def test_readmission_accept_splits_each_stream_where_it_was_retracted(sp):
    """Accept length before and after a request's re-admission from its stream's cumulative counts, against the
    same request alone split at the same token: equal (but for the re-prefill's one token) when the request drafts
    after re-admission as alone (its per-request state kept), far below when re-admission lost it (τ toward 1); a
    request whose tokens differ from alone's (a near-tie flip) or that was never retracted is not compared."""
    steps = [3, 4, 2, 5, 3, 4, 3, 2, 4, 3] * 8
    kept = chunks_of(steps, retract_after=4)
    lost = chunks_of(steps[:4] + [1] * 250, retract_after=4)
    alone = chunks_of(steps)
    assert kept[-1][0] == alone[-1][0] == lost[-1][0] == 265
    assert sp.readmission_point(kept) == 15 and sp.readmission_point(alone) is None
    assert sp.split_at(alone, 16) == {"split_tokens": 18, "before": (17, 5), "after": (265 - 18, 75)}
    assert sp.split_at(alone, 10_000) is None
    same = {"output_ids": [7] * 265}
    ok = sp.readmission_accept([{"chunks": kept, **same}], [{"chunks": alone, **same}])
    assert ok["compared"] == 1 and ok["ok"] is True and 0.99 < ok["after_over_alone"] < 1.0
    assert ok["accept_before"] == ok["accept_alone_before"] == 14 / 4
    assert ok["requests"][0]["retracted_at_tokens"] == 15 and ok["requests"][0]["retractions"] == 1
    bad = sp.readmission_accept([{"chunks": lost, **same}], [{"chunks": alone, **same}])
    assert bad["ok"] is False and bad["accept_after"] < 1.01 and bad["accept_before"] == ok["accept_before"]
    other = sp.readmission_accept([{"chunks": kept, **same}], [{"chunks": alone, "output_ids": [8] * 265}])
    never = sp.readmission_accept([{"chunks": alone, **same}], [{"chunks": alone, **same}])
    assert other["compared"] == never["compared"] == 0 and other["ok"] is never["ok"] is False


def test_retraction_streams_until_enough_requests_came_back(sp, ctx, monkeypatch):
    """The retraction scenario on a streaming stand-in for SGLang: rounds until RETRACT_MIN distinct requests were
    retracted, each retracted one streamed again alone after a cache flush, the re-admitted requests' accept
    length compared with alone's; greedy streams whose tokens end short are errors."""
    monkeypatch.setattr(sp, "RETRACT_CLIENTS", 6)
    monkeypatch.setattr(sp, "RETRACT_NEW", 265)
    monkeypatch.setattr(sp, "RETRACT_MIN", 4)
    steps = [3, 4, 2, 5, 3, 4, 3, 2, 4, 3] * 8
    seen = {"flushed": False, "calls": 0}

    def generate(body):
        seen["calls"] += 1
        i = ctx["kv_prompts"].index(body["input_ids"])
        assert body["stream"] and body["sampling_params"]["max_new_tokens"] == 265
        retracted = not seen["flushed"] and i % 2 == 0 and seen["calls"] > 6  # two per round, from round 2
        ch = chunks_of(steps, retract_after=4 if retracted else None)
        return [{"text": "", "output_ids": [7] * c[0],
                 "meta_info": {"completion_tokens": c[0], "spec_verify_ct": c[1], "num_retractions": c[2]}}
                for c in ch]

    fake = FakeSglang(generate=generate)
    real_flush = sp.flush
    monkeypatch.setattr(sp, "flush", lambda api: (seen.update(flushed=True), real_flush(api)))
    try:
        rec = sp.s_retraction(sp.Session("dspine", fake.server(), ctx))
    finally:
        fake.close()
    assert rec["rounds"] == 3 and rec["retracted_requests"] == 6 and rec["errors"] == 0
    assert rec["accept_readmitted"]["compared"] == 6 and rec["accept_readmitted"]["ok"] is True
    assert rec["checks"] == {"no_errors": True, "retracted_enough": True, "no_leak": True,
                             "accept_after_readmission": True}
    row = sp.summarize({"server_names": ["dspine"], "servers": {"dspine": {"up": True}},
                        "scenarios": {"dspine": {"retraction": {**rec, "ok": True}}}})["servers"]["dspine"]
    r = row["scenarios"]["retraction"]
    assert r["retracted_requests"] == 6 and r["accept_length"] == 249 / 76 and r["accept_length_reference"] == 250 / 76


def test_memory_fractions_are_sized_from_the_card(sp):
    """--mem-fraction-static from the card's memory: the pair's 0.1 and Qwen3-8B's three servers on an H100 (80 GB),
    less on an H200; a card too small for the servers is refused before any starts."""
    assert sp.mem_fraction(79.2, 3, sp.NEED_GIB["pair"]) == 0.1
    h100 = sp.mem_fraction(79.2, 3, sp.NEED_GIB["geometry"])
    h200 = sp.mem_fraction(139.8, 3, sp.NEED_GIB["geometry"])
    assert 0.6 < h100 <= 0.88 and h200 < 0.3
    # the last 8B server on an H100 finds two others' weights gone: its share of what is free covers its need
    assert h100 * (79.2 - 2 * (sp.NEED_GIB["geometry"] + sp.OVERHEAD_GIB)) >= sp.NEED_GIB["geometry"]
    with pytest.raises(ValueError, match="do not fit"):
        sp.mem_fraction(40.0, 3, sp.NEED_GIB["geometry"])
    line = sp.server_args("dspine", MODELS, None, 0.13)
    assert line[line.index("--mem-fraction-static") + 1] == "0.13" and "0.13" not in sp.FLAGS


def test_results_merge_per_release_backends_and_variant(sp, tmp_path):
    """benchmarks/results/serving_pressure_summary.json keeps a row per (release, backends, variant, geometry,
    server, scenario): a later run replaces its own rows only; the reference run (0.5.17, triton/pytorch, chain,
    pair) stays the file's top level, which the headline's pressure row reads."""
    def run(release, backends, variant, errors, servers=("plain", "dflash", "dspine")):
        return {"release": release, "backends": backends, "variant": variant, "geometry": None, "commit": "c",
                "gpu": "G", "servers": {n: {"up": True, "scenarios": {"kv_exhaustion": {"ok": True, "errors": errors}}}
                                        for n in servers}}
    path = str(tmp_path / "serving_pressure_summary.json")
    ref = run("0.5.17", {"attention": "triton", "sampling": "pytorch"}, "chain", 0)
    sp.merge_results(path, ref)
    sp.merge_results(path, run("0.5.23", {"attention": "sglang-default", "sampling": "sglang-default"}, "chain", 1))
    sp.merge_results(path, run("0.5.17", {"attention": "triton", "sampling": "pytorch"}, "tree", 2, ("dspine",)))
    merged = sp.merge_results(path, run("0.5.17", {"attention": "triton", "sampling": "pytorch"}, "tree", 3,
                                        ("dspine",)))
    assert merged["servers"] == ref["servers"] and merged["release"] == "0.5.17"
    keys = [(r["release"], r["attention"], r["variant"], r["server"], r["errors"]) for r in merged["rows"]]
    assert len(keys) == 7 and ("0.5.17", "triton", "tree", "dspine", 3) in keys
    assert ("0.5.17", "triton", "tree", "dspine", 2) not in keys
    assert ("0.5.23", "sglang-default", "chain", "dflash", 1) in keys


def test_overflow_mismatches_are_explained_with_margins_and_dflash(sp):
    """Each graph-overflow mismatch: its margin under the reference run, near-tie or not, and whether DFLASH
    differs on that prompt too (None where DFLASH did not run the scenario)."""
    def mm(index, margin, ref=5, got=9):
        return {"index": index, "position": 3, "top1": [ref, -0.5], "top2": [got, -0.5 - margin], "margin": margin,
                "ref_token": ref, "got_token": got}
    scen = {"dspine": {"graph_overflow": {"greedy": {"details": [mm(1, 0.03), mm(4, 0.5), mm(6, 0.0)]}}},
            "dflash": {"graph_overflow": {"greedy": {"details": [mm(1, 0.03), mm(2, 0.01)]}}}}
    got = sp.explain_mismatches(scen, "dspine")
    assert [(m["index"], m["near_tie"], m["dflash_differs"]) for m in got] == [
        (1, True, True), (4, False, False), (6, True, False)]
    assert [m["dflash_differs"] for m in sp.explain_mismatches({"dspine": scen["dspine"]}, "dspine")] == [None] * 3

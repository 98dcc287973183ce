"""The pure parts of the pressure run (benchmarks/serving_pressure.py) on CPU: its prompts from the default pair's
tokenizer, request bodies against SGLang's request models, server flags against SGLang's parser, the readers of
SGLang's retraction/leak/decode log lines, /v1/loads and per-request spec counters on SGLang's own code, the
mismatch/near-tie, leak, accept-length and per-minute arithmetic, and the summary."""
import os
import socket
from types import SimpleNamespace

import pytest

from sglang_dspine.source_files import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models", "default")
TARGET = os.path.join(MODELS, "target")


@pytest.fixture(scope="module")
def sp():
    return load_file(os.path.join(ROOT, "benchmarks", "serving_pressure.py"))


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


def test_per_minute_rows(sp):
    assert sp.percentile([], 99) is None
    assert sp.percentile(list(range(1, 101)), 99) == 99 and sp.percentile(list(range(1, 101)), 50) == 50
    recs = [(1.0, 0.2, "greedy", "ok"), (2.0, 0.4, "greedy", "ok"), (59.9, 9.0, "json", "errors"),
            (130.0, 1.0, "logprobs_chat", "unsupported"), (131.0, 0.3, "over_context", "expected_400")]
    rows = sp.buckets(recs, 60)
    assert [r["requests"] for r in rows] == [3, 0, 2] and [r["errors"] for r in rows] == [1, 0, 0]
    assert rows[0]["p99_s"] == 0.4 and rows[1]["p99_s"] is None and rows[2]["p50_s"] == 0.3
    assert rows[2]["unsupported"] == 1 and rows[0]["rps"] == 0.05


def test_a_failing_scenario_is_recorded_and_isolated(sp, ctx):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: every request fails at once
    server = SimpleNamespace(url=f"http://127.0.0.1:{port}", proc=SimpleNamespace(poll=lambda: None),
                             text=lambda: "")
    assert sp.Session("dflash", server, ctx).refusable and not sp.Session("dspine", server, ctx).refusable
    rec = sp.run_scenario(sp.Session("dspine", server, ctx), "kv_exhaustion")
    assert rec["ok"] is False and rec["error"] and rec["server_alive"] is True
    assert rec["checks"] == {"completed": False, "server_alive": True}


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

    servers = load_file(os.path.join(ROOT, "benchmarks", "servers.py"))
    calls = [n for n in ast.walk(ast.parse(servers.PREBUILD)) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
             and n.func.value.id in ("flashinfer", "s")]
    assert {c.func.attr for c in calls} == {"top_k", "top_k_renorm_probs", "top_p_renorm_probs"}
    for c in calls:
        fn = getattr(flashinfer if c.func.value.id == "flashinfer" else sampling, c.func.attr)
        params = inspect.signature(fn).parameters
        assert all(k.arg in params for k in c.keywords), (c.func.attr, [k.arg for k in c.keywords])

"""The pure parts of the request-conformance run (benchmarks/serving_features.py) on CPU: its inputs from the
default pair's tokenizer, request bodies against SGLang's request models, server flags against SGLang's
parser, grammars through xgrammar, answer checks and log-prob extraction on answers built by SGLang's own
response code, the comparison with the server without speculation, and the summary."""
import copy
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models", "default")
TARGET = os.path.join(MODELS, "target")


def _module():
    """benchmarks/serving_features.py as a module."""
    from benchmarks import serving_features

    return serving_features


@pytest.fixture(scope="module")
def sf():
    return _module()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def ctx(sf, tok):
    return sf.build_inputs(tok, MODELS)


def test_inputs_span_chunks_share_a_prefix_and_overflow_the_context(sf, ctx):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    assert len(ctx["greedy_prompts"]) == 12 and ctx["lp_prompts"] == ctx["greedy_prompts"][:4]
    assert ctx["long_prompt_tokens"] >= sf.LONG_MIN_TOKENS > 4 * sf.CHUNK
    assert ctx["shared_common_tokens"] >= sf.PREFIX_MIN_TOKENS
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in ctx["shared_prompts"]]
    assert all(i[:ctx["shared_common_tokens"]] == ids[0][:ctx["shared_common_tokens"]] for i in ids)
    assert len(set(map(tuple, ids))) == len(ids)  # different endings
    assert ctx["context_len"] == 4096 and len(ctx["over_context_ids"]) > ctx["context_len"]
    assert all(0 <= i < len(ctx["vocab_text"]) for i in ctx["over_context_ids"])
    # the chat prompt length the chat check expects is what the chat template gives
    m = ctx["chat_messages"][0]
    assert ctx["chat_prompt_tokens"][0] == len(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True,
                                                                       return_dict=False))


def test_vocab_text_is_what_sglang_reports_for_log_prob_tokens(ctx):
    """The OpenAI log-prob tokens are SGLang's per-id decode (tokenizer_manager.detokenize_logprob_tokens)."""
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer

    tok = get_tokenizer(TARGET)
    assert tok.batch_decode([[i] for i in range(len(ctx["vocab_text"]))]) == ctx["vocab_text"]


def test_request_bodies_are_valid_sglang_requests(sf, ctx):
    reqs = sf.request_catalogue(ctx)
    assert {r["endpoint"] for r in reqs} == {"/v1/completions", "/v1/chat/completions", "/generate"}
    for req in reqs:
        sf.validate_request(req, len(ctx["vocab_text"]))
    bad = sf.completion_req("x", 4, top_kk=3)  # a misspelt field SGLang would drop silently
    with pytest.raises(AssertionError, match="top_kk"):
        sf.validate_request(bad, len(ctx["vocab_text"]))
    with pytest.raises(Exception):
        sf.validate_request(sf.generate_req("x", 4, top_kk=3), len(ctx["vocab_text"]))
    named, extra = sf.split_openai("/v1/completions", sf.completion_req("x", 4, top_k=3, logprobs=5)["body"])
    assert extra == {"top_k": 3, "return_token_ids": True} and named["logprobs"] == 5


def test_server_flags_parse(sf):
    sf.check_flags(MODELS)


def test_dspine_args_reach_the_dspine_server_only(sf, tmp_path):
    """`--dspine-args` (e.g. a tree's width) ends DSPINE's server arguments, and no other server's."""
    args = sf.parser().parse_args(["--out", str(tmp_path), "--dspine-args", "--speculative-num-draft-tokens 32"])
    run = sf.Conformance(args, ["test"])
    assert run.server_args("dspine")[-2:] == ["--speculative-num-draft-tokens", "32"]
    assert "--speculative-num-draft-tokens" not in run.server_args("dflash") + run.server_args("plain")


def test_grammars_compile_and_samples(sf):
    sf.check_grammars(TARGET)
    with pytest.raises(sf.Malformed, match="does not validate"):
        sf.validate_json('{"name": "a", "count": 1000, "valid": true, "kind": "math"}')
    with pytest.raises(sf.Malformed, match="not JSON"):
        sf.validate_json('{"name": "a", ')
    with pytest.raises(sf.Malformed, match="does not match"):
        sf.check_regex("Yes because.")


def test_answer_checks_count_tokens(sf):
    def answer(n_ids, finish="length", ct=None, n=1):
        choices = [{"index": i, "text": "t", "finish_reason": finish, "token_ids": list(range(n_ids))} for i in range(n)]
        return {"choices": choices, "usage": {"completion_tokens": n * n_ids if ct is None else ct}}

    sf.check_openai(answer(3), 3, exact=True)
    sf.check_openai(answer(2, "stop"), 3)
    sf.check_openai(answer(3, n=2), 3, n=2, exact=True)
    for bad, kw in ((answer(2), {}), (answer(4), {}), (answer(2, "stop"), {"exact": True}),
                    (answer(3, "abort"), {}), (answer(3, ct=2), {}), (answer(3), {"n": 2})):
        with pytest.raises(sf.Malformed):
            sf.check_openai(bad, 3, **kw)
    gen = {"text": "ab", "output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"}, "completion_tokens": 2}}
    sf.check_generate(gen, 2, exact=True)
    with pytest.raises(sf.Malformed):
        sf.check_generate(gen, 3, exact=True)
    with pytest.raises(sf.Malformed):
        sf.check_generate({**gen, "meta_info": {**gen["meta_info"], "completion_tokens": 3}}, 2)


def test_pick_stop(sf):
    text = "def forward(self, x):\n    return self.linear(x)"
    s = sf.pick_stop(text)
    assert s and s.strip() and text.index(s) >= 4 and len(s) == 4
    assert sf.pick_stop("short") is None


@pytest.mark.parametrize("greedy", [True, False])
def test_log_prob_entries_from_sglang_answers(sf, ctx, tok, greedy):
    """The same log-probs read from /generate, /v1/completions and /v1/chat/completions answers (built by
    SGLang's response code, parsed by the OpenAI client's types) give the same entries."""
    vt = ctx["vocab_text"]
    ids = [5, 17, 300, 2]
    ret = sf._ret_item(ids, vt, sf.TOP_K, 0, greedy)
    e = sf.entries_generate(ret, sf.TOP_K, greedy)
    assert [x["id"] for x in e] == ids and all(len(x["top"]) == sf.TOP_K for x in e)
    for chat, fn, texts in ((False, sf.entries_completion, ctx["completion_token_text"]), (True, sf.entries_chat, vt)):
        answer = sf.openai_answers(ret, chat, tok)
        c = sf.check_openai(answer, len(ids), exact=True, chat=chat)[0]
        e2 = fn(c, texts, sf.TOP_K, greedy)
        cmp = sf.compare_entries(e, e2)
        assert cmp["positions"] == len(ids) and cmp["token_max_abs_diff"] < 1e-9 and cmp["top_max_abs_diff"] < 1e-9
        assert cmp["top_pairs"] > 0
        # the reported tokens must be the emitted ones
        wrong = copy.deepcopy(c)
        sf.emitted_ids(wrong)[1] = 18
        with pytest.raises(sf.Malformed, match="entry 1"):
            fn(wrong, texts, sf.TOP_K, greedy)


def test_log_prob_checks_catch_shifted_missing_and_non_argmax(sf, ctx):
    vt = ctx["vocab_text"]
    ids = [5, 17, 300, 2]
    shifted = sf._ret_item(ids, vt, sf.TOP_K, 0, True)
    mi = shifted["meta_info"]
    mi["output_token_logprobs"] = mi["output_token_logprobs"][1:] + [(-0.1, 2, None)]
    with pytest.raises(sf.Malformed, match="entry 0 is for token 17"):
        sf.entries_generate(shifted, sf.TOP_K, True)
    short = sf._ret_item(ids, vt, sf.TOP_K, 0, True)
    short["meta_info"]["output_token_logprobs"].pop()
    with pytest.raises(sf.Malformed, match="3 log-prob entries for 4"):
        sf.entries_generate(short, sf.TOP_K, True)
    sampled = sf._ret_item(ids, vt, sf.TOP_K, 0, False)  # emitted tokens below the top one
    sf.entries_generate(sampled, sf.TOP_K, False)
    with pytest.raises(sf.Malformed, match="not the most likely"):
        sf.entries_generate(sampled, sf.TOP_K, True)
    disagree = sf._ret_item(ids, vt, sf.TOP_K, 0, True)
    lp, tid, txt = disagree["meta_info"]["output_token_logprobs"][0]
    disagree["meta_info"]["output_token_logprobs"][0] = (lp - 0.01, tid, txt)
    with pytest.raises(sf.Malformed, match="in the top"):
        sf.entries_generate(disagree, sf.TOP_K, False)


def test_compare_entries_stops_at_the_first_different_token(sf):
    a = [{"id": 1, "lp": -0.1, "top": {"1": -0.1, "2": -2.0}}, {"id": 3, "lp": -0.5, "top": {"3": -0.5, "4": -1.0}},
         {"id": 5, "lp": -0.2, "top": {"5": -0.2}}, {"id": 6, "lp": -9.0, "top": {"6": -9.0}}]
    b = [{"id": 1, "lp": -0.12, "top": {"1": -0.12, "7": -2.5}}, {"id": 3, "lp": -0.45, "top": {"3": -0.45, "4": -1.3}},
         {"id": 8, "lp": -0.3, "top": {"8": -0.3}}, {"id": 6, "lp": -1.0, "top": {"6": -1.0}}]
    c = sf.compare_entries(a, b)
    assert c["positions"] == 2 and c["of"] == 4 and c["top_pairs"] == 3
    assert c["token_max_abs_diff"] == pytest.approx(0.05)
    assert c["top_max_abs_diff"] == pytest.approx(0.3)  # token 4 at position 1; token 2/7 unmatched


def _result(sf, dspine_lp_shift=0.0):
    vt = [str(i) for i in range(400)]
    res = {"server_names": list(sf.NAMES), "provenance": {"commit": "c0ffee", "gpu": "H200", "date": "d"},
           "features": {}, "servers": {}, "load": {}, "clients": 48, "load_seconds": 120.0}
    for n in sf.NAMES:
        res["servers"][n] = {"up": True}
        feats = {f: {"ok": True, "details": {}} for f in sf.ALL_FEATURES}
        feats["greedy_completions"]["details"] = {"texts": ["abc", "def", "ghi" if n != "dflash" else "ghx"],
                                                  "ids": [[1, 2, 3], [4, 5, 6], [7, 8, 9 if n != "dflash" else 10]]}
        entries = sf.entries_generate(sf._ret_item([5, 17, 300], vt, sf.TOP_K, 0, True), sf.TOP_K, True)
        if n == "dspine":
            for e in entries:
                e["lp"] += dspine_lp_shift
                e["top"] = {k: v + dspine_lp_shift for k, v in e["top"].items()}
        feats["logprobs_generate"]["details"] = {"greedy_entries": [entries]}
        res["features"][n] = feats
        res["load"][n] = {"requests": 100, "errors": 0, "expected_400": 6,
                          "by_kind": {"greedy": {"requests": 94, "ok": 94, "expected_400": 0, "errors": 0}}}
    return res


def test_summary(sf):
    res = _result(sf, dspine_lp_shift=0.03)
    res["features"]["dflash"]["logprobs_chat"] = {"ok": False, "error": "HTTP 400: DFLASH ... return_logprob yet."}
    res["load"]["dflash"]["errors"] = 7
    res["load"]["dflash"]["by_kind"]["logprobs_chat"] = {"requests": 7, "ok": 0, "expected_400": 0, "errors": 7}
    res["load"]["dflash"]["error_samples"] = {"logprobs_chat": ["HTTP 400: DFLASH"]}
    s = sf.summarize(res)
    assert s["commit"] == "c0ffee" and s["gpu"] == "H200" and s["load"]["clients"] == 48
    total = len(sf.ALL_FEATURES)
    p, d, sp = s["servers"]["plain"], s["servers"]["dflash"], s["servers"]["dspine"]
    assert p["features_ok"] == p["features_total"] == total and p["failed_features"] == []
    assert "logprob_max_abs_diff_vs_plain" not in p
    assert d["features_ok"] == total - 1
    assert d["failed_features"] == [{"feature": "logprobs_chat", "message": "HTTP 400: DFLASH ... return_logprob yet."}]
    assert d["greedy_match_vs_plain"] == "2/3" and sp["greedy_match_vs_plain"] == "3/3"
    assert d["mixed_load_errors"] == 7 and d["mixed_load_errors_by_kind"] == {"logprobs_chat": 7}
    assert sp["mixed_load_errors"] == 0 and sp["mixed_load_requests"] == 100
    assert sp["logprob_max_abs_diff_vs_plain"] == pytest.approx(0.03)
    assert d["logprob_max_abs_diff_vs_plain"] == pytest.approx(0.0)
    sf.print_table(s)


def test_summary_of_a_server_that_did_not_start(sf):
    res = _result(sf)
    res["servers"]["dspine"] = {"up": False, "error": "did not start: ValueError: DSPINE ..."}
    res["features"].pop("dspine")
    res["load"].pop("dspine")
    s = sf.summarize(res)["servers"]["dspine"]
    assert s["up"] is False and s["features_ok"] == 0 and s["features_total"] == len(sf.ALL_FEATURES)
    assert s["failed_features"][0]["feature"] == "server_start" and s["mixed_load_errors"] is None
    assert s["logprob_max_abs_diff_vs_plain"] is None


class _ReplayPlain:
    """Answers /generate as the server without speculation would for these greedy answers: its ids, and at
    each position top-2 log-probs (the emitted token first) with the given margins."""

    def __init__(self, ids: list[list[int]], margins: dict[tuple[int, int], float], second: dict[tuple[int, int], int]):
        self.ids, self.margins, self.second, self.prompts = ids, margins, second, []

    def call(self, req):
        i = self.prompts_index[req["body"]["text"]]
        n = req["body"]["sampling_params"]["max_new_tokens"]
        self.prompts.append((i, n))
        tops = [[(-0.1, t, ""), (-0.1 - self.margins.get((i, j), 5.0), self.second.get((i, j), 0), "")]
                for j, t in enumerate(self.ids[i][:n])]
        return {"output_ids": self.ids[i][:n], "meta_info": {"output_top_logprobs": tops}}


def test_divergence_margins(sf):
    prompts = ["p0", "p1", "p2", "p3"]
    ctx = {"greedy_prompts": prompts}
    plain = [[5, 6, 7, 8], [1, 2, 3], [9, 9, 9], [4, 4]]
    other = [[5, 6, 7, 8], [1, 2, 30], [9, 11, 9], [4, 4, 4]]  # same; differs at 2; differs at 1; a longer answer
    api = _ReplayPlain(plain, {(1, 2): 0.02, (2, 1): 1.5}, {(1, 2): 30, (2, 1): 12})
    api.prompts_index = {p: i for i, p in enumerate(prompts)}
    m = sf.divergence_margins(api, ctx, plain, other)
    assert [(r["prompt"], r["position"]) for r in m] == [(1, 2), (2, 1)]
    assert api.prompts == [(1, 3), (2, 2)]  # regenerated up to and including the differing token
    assert m[0]["margin"] == pytest.approx(0.02) and m[0]["other_token_is_second"]
    assert m[1]["margin"] == pytest.approx(1.5) and not m[1]["other_token_is_second"]
    assert all(r["replayed_prefix_equal"] for r in m)
    assert m[0]["plain_token"] == 3 and m[0]["other_token"] == 30


@pytest.mark.parametrize("finish,text,outcome", [
    ("length", "x = f(a, b)", "sglang_length_before_stop"),  # 0.5.17 ends by length before it checks stop strings
    ("stop", "x = f(a, b)", "Malformed"),  # a stop that ended the request must not stay in the text
    ("length", "xyz", "ok"),
])
def test_load_stop_counts_sglangs_length_before_stop_apart(sf, ctx, tok, finish, text, outcome):
    """The mixed load's stop-string request: an answer that keeps a stop string is an error unless SGLang ended
    it by length on a release that checks max_tokens first (0.5.17's Req.update_finish_state; 0.5.23 checks stop
    strings first, so there it is an error too). Answers built by SGLang's own response classes and read through
    the OpenAI client's types."""
    import random

    if outcome == "sglang_length_before_stop" and not ctx["sglang_length_first"]:
        outcome = "Malformed"

    ret = sf._ret_item(list(range(48)), [f"t{i}" for i in range(64)], 5, 0, True)
    ret["text"], ret["meta_info"]["finish_reason"] = text, {"type": finish}

    class Answers:  # what the server would answer, for any request
        def call(self, req):
            assert req["body"]["stop"] and req["endpoint"] == "/v1/completions"
            return sf.openai_answers(ret, chat=False, tokenizer=tok)

    rng = random.Random(0)
    rng.choice = lambda seq: "," if seq == sf.LOAD_STOPS else seq[0]
    if outcome == "Malformed":
        with pytest.raises(sf.Malformed, match=f"finish_reason '{finish}'"):
            sf._load_stop(Answers(), ctx, rng)
    else:
        assert sf._load_stop(Answers(), ctx, rng) == outcome


def test_which_sglang_checks_the_length_cap_before_stop_strings(sf):
    """sglang_checks_length_first reads Req.update_finish_state's order: the installed release's (0.5.17: the cap
    first; 0.5.23: stop strings first, sglang#33758) and 0.5.23's as written there; a rewritten method that no
    longer holds either check is refused, not guessed."""
    import sglang

    assert sf.sglang_checks_length_first() == (sglang.__version__ == "0.5.17")
    v0523 = ("new_accepted_tokens = self.output_ids[-new_accepted_len:]\n"
             "if self._check_str_based_finish(new_accepted_len):\n    return\n"
             "if self._check_token_based_finish(new_accepted_tokens):\n    return\n"
             "if len(self.output_ids) >= self.sampling_params.max_new_tokens:\n    return\n")
    assert not sf.sglang_checks_length_first(v0523)
    v0517 = ("if len(self.output_ids) >= self.sampling_params.max_new_tokens:\n    return\n"
             "if self._check_str_based_finish(new_accepted_len):\n    return\n")
    assert sf.sglang_checks_length_first(v0517)
    with pytest.raises(RuntimeError, match="no longer has"):
        sf.sglang_checks_length_first("def update_finish_state(self):\n    return\n")


# Partial UTF-8 bytes in the default pair's vocabulary (byte-level BPE): each decodes alone to U+FFFD. The two a
# plain SGLang 0.5.23 server emitted when its /v1/completions log-probs failed the old check.
BYTE_IDS = (254, 235)


def _lp_answers(sf, tok, ret):
    """A server that answers every log-prob request of serving_features with the answer the installed SGLang
    builds from `ret` (the /generate answer), for the endpoint asked."""
    class Answers:
        def call(self, req):
            body = req["body"]
            assert body["return_token_ids"] and body["logprobs"] and body["max_tokens"] == len(ret["output_ids"])
            return sf.openai_answers(ret, req["endpoint"] == "/v1/chat/completions", tok)
    return Answers()


def _byte_token_answer(sf, ctx):
    ids = [5, BYTE_IDS[0], 17, 300, BYTE_IDS[1], 2] * 4
    assert len(ids) == sf.LP_MAX and all(ctx["vocab_text"][i] == "\ufffd" for i in BYTE_IDS)
    return ids, sf._ret_item(ids, ctx["vocab_text"], sf.TOP_K, 0, True)


def _sglang_0523():
    import sglang
    from packaging.version import Version

    return Version(sglang.__version__) >= Version("0.5.23")


def test_completion_log_probs_of_partial_byte_tokens(sf, ctx, tok):
    """/v1/completions log-probs of partial-UTF-8-byte tokens, as the installed SGLang renders them (0.5.17: the
    per-id decode, U+FFFD; 0.5.23: the raw bytes as latin-1, utils._lossless_token_text): the feature accepts
    the release's rendering of the emitted id, and on 0.5.23 refuses another byte token's."""
    ids, ret = _byte_token_answer(sf, ctx)
    answer = sf.openai_answers(ret, False, tok)
    texts = answer["choices"][0]["logprobs"]["tokens"]
    if _sglang_0523():
        from sglang.srt.entrypoints.openai.utils import token_id_to_bytes

        assert [texts[1], texts[4]] == [bytes(token_id_to_bytes(tok, i)).decode("latin-1") for i in BYTE_IDS]
        assert texts[1] == "\x9c" and texts[4] == "\x89"  # what the GPU run's failures showed
    else:
        assert texts[1] == texts[4] == "\ufffd"
    assert ctx["completion_token_text"][BYTE_IDS[0]] == texts[1]
    out = sf.f_logprobs_completions(_lp_answers(sf, tok, ret), ctx)
    assert all([e["id"] for e in entries] == ids for entries in out["greedy_entries"]) and out["t1_tokens"] == [24, 24]
    # the emitted ids one byte token off: 0.5.23's texts tell them apart, 0.5.17's cannot
    c = sf.check_openai(answer, sf.LP_MAX)[0]
    swapped = copy.deepcopy(c)
    swapped["token_ids"][1] = BYTE_IDS[1]
    if _sglang_0523():
        with pytest.raises(sf.Malformed, match=r"entry 1 is for '\\x9c', the emitted token 235 is '\\x89'"):
            sf.entries_completion(swapped, ctx["completion_token_text"], sf.TOP_K, True)
    else:
        sf.entries_completion(swapped, ctx["completion_token_text"], sf.TOP_K, True)
    swapped["token_ids"][1] = 17  # another token than a byte token: refused on both
    with pytest.raises(sf.Malformed, match="entry 1 is for"):
        sf.entries_completion(swapped, ctx["completion_token_text"], sf.TOP_K, True)


def test_chat_log_probs_read_the_ids_where_the_release_puts_them(sf, ctx, tok):
    """/v1/chat/completions with return_token_ids: the emitted ids in `token_ids` (0.5.17) or
    `response_token_ids` (0.5.23, serving_chat.py); the log-prob entries are checked against them and the
    token count against usage on both."""
    ids, ret = _byte_token_answer(sf, ctx)
    answer = sf.openai_answers(ret, True, tok)
    field, other = ("response_token_ids", "token_ids") if _sglang_0523() else ("token_ids", "response_token_ids")
    choice = answer["choices"][0]
    assert choice[field] == ids and choice.get(other) is None
    entry = choice["logprobs"]["content"][1]
    assert entry["token"] == "\ufffd"  # the per-id decode on both; 0.5.23's bytes are the token's true bytes
    assert entry["bytes"] == ([0x9c] if _sglang_0523() else list("\ufffd".encode()))
    out = sf.f_logprobs_chat(_lp_answers(sf, tok, ret), ctx)
    assert all([e["id"] for e in entries] == ids for entries in out["greedy_entries"]) and out["t1_tokens"] == [24, 24]
    c = sf.check_openai(answer, sf.LP_MAX, chat=True)[0]
    wrong = copy.deepcopy(c)
    wrong[field][2] = 18
    with pytest.raises(sf.Malformed, match="entry 2 is for"):
        sf.entries_chat(wrong, ctx["vocab_text"], sf.TOP_K, True)
    del wrong[field]
    with pytest.raises(sf.Malformed, match="no token_ids / response_token_ids"):
        sf.entries_chat(wrong, ctx["vocab_text"], sf.TOP_K, True)
    short = copy.deepcopy(answer)
    short["choices"][0][field].pop()
    with pytest.raises(sf.Malformed, match="choice 0: 23 tokens, expected exactly 24"):
        sf.check_openai(short, sf.LP_MAX, chat=True)


# ---------------------------------------------------------------- the GPU tests' verdicts and how they are run
def test_check_cases_and_what_a_selection_needs(sf):
    """One GPU test per server and check (tests/test_serving_conformance.py): every server's start, features,
    request after the load and mixed load; the comparison with plain for the others when plain runs."""
    cases = sf.check_cases(sf.NAMES)
    assert len(cases) == 3 * (len(sf.ALL_FEATURES) + 2) + 2 == 59
    assert ("plain", "greedy_vs_plain") not in cases and ("dspine", "greedy_vs_plain") in cases
    assert sf.check_cases(["dspine", "plain"])[0] == ("plain", "server_start")
    assert ("dspine", "greedy_vs_plain") not in sf.check_cases(["dspine"])
    assert sf.plan([("dspine", "greedy_vs_plain")]) == (["plain", "dspine"], False)
    assert sf.plan([("dflash", "n2"), ("dflash", "mixed_load")]) == (["dflash"], True)
    assert sf.plan(cases) == (list(sf.NAMES), True)


def _margin(prompt, position, plain_token, other_token, top):
    return {"prompt": prompt, "position": position, "plain_token": plain_token, "other_token": other_token,
            "replayed_prefix_equal": True, "top1": top[0], "top2": top[1], "margin": top[0][1] - top[1][1],
            "other_token_is_second": top[1][0] == other_token, "top": top}


def test_verdicts_and_their_evidence(sf):
    """serving_features.verdict, what each GPU test asserts, on a run's results: a failed feature with its error,
    mixed-load errors with their kinds and samples, greedy differences passed only at near-ties (serving_pressure's
    rule), and a server that did not start failing every check with its log; the summary holds the same."""
    res = _result(sf)
    res["features"]["dflash"]["logprobs_chat"] = {"ok": False, "error": "HTTP 400: DFLASH ... return_logprob yet."}
    res["load"]["dflash"]["errors"] = 7
    res["load"]["dflash"]["by_kind"]["logprobs_chat"] = {"requests": 7, "ok": 0, "expected_400": 0, "errors": 7}
    res["load"]["dflash"]["error_samples"] = {"logprobs_chat": ["HTTP 400: DFLASH"]}
    # dflash leaves plain at prompt 2, token 2: a near-tie (plain's top-2 0.02 apart, dflash's token second)
    res["servers"]["dflash"]["greedy_divergence_margins"] = [_margin(2, 2, 9, 10, [[9, -0.70], [10, -0.72], [3, -4.0]])]
    assert sf.verdict(res, "plain", "server_start")[0]
    assert sf.verdict(res, "plain", "greedy_completions")[0] and sf.verdict(res, "plain", "mixed_load")[0]
    assert sf.verdict(res, "dflash", "logprobs_chat") == (False, "HTTP 400: DFLASH ... return_logprob yet.")
    ok, ev = sf.verdict(res, "dflash", "mixed_load")
    assert not ok and "7 errors by kind {'logprobs_chat': 7}" in ev and "HTTP 400: DFLASH" in ev
    ok, ev = sf.verdict(res, "dflash", "greedy_vs_plain")
    assert ok and ev.startswith("2/3 identical, 1 near-ties (prompt 2 token 2 (margin 0.0200))")
    # the same difference with plain's top-2 0.5 apart is no near-tie: the test fails with the tokens
    res["servers"]["dflash"]["greedy_divergence_margins"] = [_margin(2, 2, 9, 10, [[9, -0.2], [10, -0.7]])]
    ok, ev = sf.verdict(res, "dflash", "greedy_vs_plain")
    assert not ok and "token 2 is 10, plain's 9" in ev and "margin 0.5000" in ev and "'ghi', dflash 'ghx'" in ev
    res["servers"]["dflash"].pop("greedy_divergence_margins")
    res["servers"]["dflash"]["greedy_divergence_margins_error"] = "ReadTimeout: timed out"
    ok, ev = sf.verdict(res, "dflash", "greedy_vs_plain")
    assert not ok and "no margin measured: ReadTimeout: timed out" in ev
    res["features"]["dflash"]["greedy_completions"]["details"]["ids"][2] = [7, 8]  # a prefix of plain's
    assert "one answer is a prefix of the other (3 and 2 tokens)" in sf.verdict(res, "dflash", "greedy_vs_plain")[1]
    assert sf.verdict(res, "dspine", "greedy_vs_plain") == (True, "3/3 identical, 0 near-ties")
    res["features"]["plain"]["greedy_completions"] = {"ok": False, "error": "x"}
    assert "failed or did not run on plain" in sf.verdict(res, "dspine", "greedy_vs_plain")[1]
    res["features"]["dspine"].pop("abort_midstream")
    res["servers"]["dspine"]["phase_error"] = "RuntimeError: boom"
    assert sf.verdict(res, "dspine", "abort_midstream") == (False, "abort_midstream did not run on dspine: "
                                                                   "RuntimeError: boom")
    res["load"].pop("dspine")
    assert sf.verdict(res, "dspine", "mixed_load") == (False, "no mixed load ran (--load-seconds 120.0)")
    s = sf.summarize(res)["servers"]
    assert s["plain"]["checks_total"] == len(sf.SERVER_CHECKS) and not s["plain"]["checks"]["greedy_completions"]
    assert s["dflash"]["checks_total"] == len(sf.SERVER_CHECKS) + 1
    assert {c for c, ok in s["dflash"]["checks"].items() if not ok} == {"logprobs_chat", "mixed_load",
                                                                          "greedy_vs_plain"}
    res["servers"]["dspine"] = {"up": False, "error": "did not start: ValueError: DSPINE ..."}
    assert sf.verdict(res, "dspine", "server_start") == (False, "did not start: ValueError: DSPINE ...")
    assert sf.verdict(res, "dspine", "n2") == (False, "the dspine server did not start: did not start: "
                                                      "ValueError: DSPINE ...")
    assert sf.summarize(res)["servers"]["dspine"]["checks_ok"] == 0
    with pytest.raises(ValueError, match="unknown check"):
        sf.verdict(res, "plain", "speed")


def test_script_status(sf):
    """The script's exit status after the GPU tests: failed checks are results (0), a server that did not start
    or tests that did not run are not."""
    up = {"servers": {"plain": {"up": True, "checks_ok": 19, "checks_total": 19},
                      "dflash": {"up": True, "checks_ok": 15, "checks_total": 20}}}
    assert sf.script_status(1, up) == (0, "5 checks failed")
    assert sf.script_status(0, {"servers": {"plain": up["servers"]["plain"]}}) == (0, "every check passed")
    up["servers"]["dflash"]["up"] = False
    assert sf.script_status(1, up) == (1, "servers that did not start: dflash")
    assert sf.script_status(1, None)[0] == 1
    assert sf.script_status(2, up)[0] == 2 and sf.script_status(5, None)[0] == 5


STUB_SERVERS = '''
"""pytest plugin: serving_features' servers replaced by stubs at a port nothing listens on (up, except
STUB_DOWN's), for a CPU run of tests/test_serving_conformance.py."""
import importlib
import os
import socket

from sglang_dspine.source_files import load_package

load_package("benchmarks", os.path.join({repo!r}, "benchmarks"))
sf = importlib.import_module("benchmarks.serving_features")
_s = socket.socket()
_s.bind(("127.0.0.1", 0))
PORT = _s.getsockname()[1]
_s.close()


class Server:
    def __init__(self, name, port, args, out, base_args=None):
        self.name, self.url, self.up_after = name, f"http://127.0.0.1:{{PORT}}", 0.5
        self.cmd = ["python", "-m", "sglang.launch_server", *args]
        open(os.path.join(out, f"server_{{name}}.log"), "w").write("stub log\\n")

    def start_record(self, timeout=480):
        if self.name == os.environ.get("STUB_DOWN"):
            return {{"up": False, "start_seconds": None, "args": self.cmd[3:], "error": "did not start: stub"}}
        return {{"up": True, "start_seconds": 0.5, "args": self.cmd[3:]}}

    def tail(self, n=40):
        return "stub log"

    def text(self):
        return "stub log\\n"

    def info(self):
        raise ConnectionError("stub: no /server_info")

    def stop(self):
        pass


sf.Server = Server
'''


def test_main_runs_the_gpu_tests_and_writes_the_summary(sf, tmp_path, monkeypatch, capsys):
    """serving_features.main (scripts/device/run.sh features) runs tests/test_serving_conformance.py under
    pytest with its arguments: on CPU, with the GPU skip left out (--noconftest) and the servers replaced by stubs
    at a port nothing listens on (DSPINE's not starting), the whole chain runs: the tests' fixture runs
    serving_features' Conformance once for the selected servers, every feature and the mixed load (its spawned
    client processes) fail on connection errors, each check is one test with its evidence, the JSON and summary
    are written, the logs archived; the script exits 1 (a server did not start)."""
    import json
    import xml.etree.ElementTree as ET

    (tmp_path / "conformance_stub.py").write_text(STUB_SERVERS.format(repo=ROOT))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("PYTEST_ADDOPTS", "--noconftest -p conformance_stub -W ignore::pytest.PytestUnknownMarkWarning")
    monkeypatch.setenv("STUB_DOWN", "dspine")
    out = tmp_path / "out"
    rc = sf.main(["--servers", "plain,dspine", "--no-prebuild", "--load-seconds", "1", "--clients", "2",
                  "--out", str(out), "--tag", "cpu"])
    printed = capsys.readouterr().out
    assert rc == 1, printed
    assert "servers that did not start: dspine (pytest exit status 1)" in printed
    cases = {c.get("name"): c for c in ET.parse(out / "serving_features_cpu_tests.xml").iter("testcase")}
    assert sorted(cases) == sorted(f"test_check[{s}-{c}]" for s, c in sf.check_cases(["plain", "dspine"]))
    passed = [n for n, c in cases.items() if not list(c)]
    assert passed == ["test_check[plain-server_start]"]
    failure = cases["test_check[plain-regex_generate]"].find("failure").get("message")  # /generate: httpx
    assert "plain regex_generate: ConnectError" in failure and "Connection refused" in failure
    failure = cases["test_check[plain-mixed_load]"].find("failure").get("message")
    assert "requests from 2 clients" in failure and "errors by kind" in failure
    assert "dspine server did not start: did not start: stub" in cases["test_check[dspine-n2]"].find(
        "failure").get("message")
    res = json.loads((out / "serving_features_cpu.json").read_text())
    assert res["server_names"] == ["plain", "dspine"] and res["load"]["plain"]["errors"] > 0
    assert res["provenance"]["command"].startswith("tests/test_serving_conformance.py --servers plain,dspine ")
    assert res["load_seconds"] == 1.0 and res["features"]["plain"]["serves_after_load"]["ok"] is False
    s = json.loads((out / "serving_features_cpu_summary.json").read_text())["servers"]
    assert s["plain"]["checks_ok"] == 1 and s["plain"]["checks_total"] == 19 and s["dspine"]["up"] is False
    assert (out / "serving_features_cpu_logs.tar.gz").exists() and not list(out.glob("server_*.log"))

"""The serving benchmarks' harness (benchmarks/servers.py): warm-up bursts, KV pools and the measured round,
against a real HTTP server on this machine that answers /generate as SGLang does (output ids, verify steps)."""
from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

servers = importlib.import_module("benchmarks.servers")

ACCEPT = 3  # tokens per verify step the answering server reports


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):  # /health answers in plain text
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.bodies.append(body)
            if srv.order is not None:  # several servers' requests in the order they came
                srv.order.append(srv.name)
            srv.active += 1
            srv.peak = max(srv.peak, srv.active)
        time.sleep(srv.delay)
        with srv.lock:
            srv.active -= 1
        prompt = body.get("text", body.get("input_ids"))
        if prompt == srv.refuse:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "refused"}')
            return
        n = body["sampling_params"]["max_new_tokens"]
        answer = {"output_ids": list(range(n)),
                  "meta_info": {"completion_tokens": n, "spec_verify_ct": math.ceil(n / ACCEPT),
                                "spec_accept_length": n / math.ceil(n / ACCEPT)}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Answering:
    """A server on 127.0.0.1 with the harness' request side of `servers.Server` (post, generate_ids)."""

    def __init__(self, name: str, delay: float = 0.05, refuse=None, order: list | None = None):
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.http.lock, self.http.bodies, self.http.active, self.http.peak = threading.Lock(), [], 0, 0
        self.http.delay, self.http.refuse, self.http.name, self.http.order = delay, refuse, name, order
        self.name, self.url = name, f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    post = servers.Server.post
    generate_ids = servers.Server.generate_ids

    @property
    def bodies(self) -> list[dict]:
        return self.http.bodies

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def answering():
    made = []

    def make(*args, **kw):
        made.append(_Answering(*args, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_warm_up_mixes_greedy_and_t1_over_the_prompts_at_once(answering):
    s = answering("a", delay=0.2)
    prompts = ["def f():", [5, 6, 7]]
    seconds = servers.warm_up(lambda body: s.post("/generate", body), prompts, n=6, max_new=4)
    assert len(s.bodies) == 6 and s.http.peak == 6  # all in flight together
    assert [b["sampling_params"]["temperature"] for b in s.bodies].count(1.0) == 3
    assert sorted(map(str, (b.get("text", b.get("input_ids")) for b in s.bodies))) == \
        sorted(map(str, prompts * 3))
    assert all(b["sampling_params"]["max_new_tokens"] == 4 for b in s.bodies)
    assert 0.2 <= seconds < 5


def test_warm_up_raises_on_an_error_and_refuses_no_prompts(answering):
    s = answering("a", refuse="bad")
    with pytest.raises(Exception, match="400"):
        servers.warm_up(lambda body: s.post("/generate", body), ["ok", "bad"], n=4)
    with pytest.raises(ValueError, match="no prompts"):
        servers.warm_up(lambda body: s.post("/generate", body), [], n=4)


def test_start_warm_up_records_each_server(answering):
    good, bad = answering("good"), answering("bad", refuse="x")
    futures = servers.start_warm_up({"good": good, "bad": bad}, ["x", "y"], n=4, max_new=2)
    assert servers.warmed(futures, "good") and not servers.warmed(futures, "good", "bad")
    secs = servers.warm_up_seconds(futures, wait=True)
    assert isinstance(secs["good"], float) and secs["bad"].startswith("failed: <HTTPError 400")


def test_wave_round_counts_whole_waves_after_an_unmeasured_one(answering):
    s = answering("a", delay=0.05)
    prompts = [[1, 2], [3, 4, 5]]
    rec, outs = servers.wave_round(s, prompts, clients=4, max_new=9)
    warm, measured = s.bodies[:4], s.bodies[4:]
    assert [b["sampling_params"]["max_new_tokens"] for b in warm] == [8] * 4
    assert len(measured) == 16 == rec["requests"] == len(outs)  # 4 waves of 4 up to 4 clients
    assert all(b["sampling_params"]["ignore_eos"] for b in measured)
    assert rec["output_tokens"] == 16 * 9 and rec["verify_steps"] == 16 * 3 and rec["tau"] == 3.0
    assert rec["step_ms"] == pytest.approx(1000 * rec["seconds"] * 4 / 48)
    assert s.http.peak <= 4
    rec, _ = servers.wave_round(s, prompts, clients=8, max_new=3, temperature=1.0, requests=10, ignore_eos=False)
    assert rec["requests"] == 10 and rec["temperature"] == 1.0 and rec["tau"] == 3.0
    assert not s.bodies[-1]["sampling_params"]["ignore_eos"]
    rec, _ = servers.wave_round(s, prompts, clients=8, max_new=3)
    assert rec["requests"] == 16  # 2 waves above 4 clients


def test_e2e_throughput_cells_take_rounds_in_turn(answering):
    """serve_e2e.throughput: each cell is `rounds` measured rounds, the servers taking turns round by round (a drift
    of the machine falls on each alike); tokens/s over all rounds, each round's and their spread, τ and SGLang's
    accept length per suite from the answers."""
    from benchmarks import serve_e2e as e2e
    order = []
    a, b = answering("a", delay=0.01, order=order), answering("b", delay=0.01, order=order)
    prompts = [("code", [1, 2]), ("math", [3, 4, 5, 6]), ("code", [7])]
    res = e2e.throughput({"a": a, "b": b}, prompts, [1, 4], max_new=7, rounds=2)
    turns = [n for i, n in enumerate(order) if i == 0 or order[i - 1] != n]
    assert turns == ["a", "b"] * 4  # 2 client counts x 2 rounds, a then b each time
    for srv in (a, b):
        assert len(srv.bodies) == 2 * (1 + 12) + 2 * (4 + 16)  # per round: a warm wave, then the measured requests
    for name in ("a", "b"):
        one, four = res[name][1], res[name][4]
        assert one["rounds"] == 2 and one["requests"] == 24 and four["requests"] == 32
        assert one["output_tokens"] == 24 * 7 and four["verify_steps"] == 32 * 3
        assert four["tokens_per_s"] == pytest.approx(four["output_tokens"] / four["seconds"])
        assert len(four["tokens_per_s_rounds"]) == 2 and four["round_spread"] >= 0
        assert four["tau_by_suite"] == {"code": pytest.approx(7 / 3), "math": pytest.approx(7 / 3)}
        assert four["accept_length_by_suite"] == {"code": pytest.approx(7 / 3), "math": pytest.approx(7 / 3)}
    rounds = [({"requests": 3, "output_tokens": 30, "seconds": 1.0, "tokens_per_s": 30.0},
               [{"meta_info": {"completion_tokens": 10, "spec_verify_ct": 5, "spec_accept_length": 2.0}}] * 3),
              ({"requests": 3, "output_tokens": 30, "seconds": 2.0, "tokens_per_s": 15.0},
               [{"meta_info": {"completion_tokens": 10}}] * 3)]  # a server without speculation reports no steps
    cell = e2e.throughput_cell(rounds, ["code", "math"])
    assert cell["tokens_per_s"] == 20.0 and cell["round_spread"] == 1.0
    assert cell["tau_by_suite"] == {"code": 2.0, "math": 2.0} and cell["verify_steps"] == 15


def test_http_client_watchdog_has_a_stuck_server_dump_its_stacks(answering):
    """servers.request: a request slower than stuck_after has the harness' server at that address dump its stacks
    (once the watchdog fires, not for a fast request, and the answer still comes back); GET answers in plain text
    come back as {"text": ...}."""
    s = answering("slow", delay=0.4)
    dumps = []
    s.dump_stacks = lambda: dumps.append(s.name)
    servers.Server.running[s.url] = s
    try:
        body = servers.generate_body([1, 2], 3)
        assert servers.request(s.url + "/generate", body, stuck_after=5)["output_ids"] == [0, 1, 2] and dumps == []
        assert servers.request(s.url + "/generate", body, stuck_after=0.1)["output_ids"] == [0, 1, 2]
        assert dumps == ["slow"]
        assert servers.request(s.url + "/health", stuck_after=None) == {"text": "ok"}
    finally:
        del servers.Server.running[s.url]


def test_kv_pools_from_memory_records():
    memory = {"dflash": {"max_total_num_tokens": 60000, "max_running_requests": 64},
              "dspine": {"max_total_num_tokens": 59000}}
    assert servers.kv_pools(memory) == {"dflash": 60000, "dspine": 59000}
    assert servers.kv_pools({"x": {}}) == {"x": None}


def test_memory_reads_the_pool_and_the_verify_graphs_from_the_servers_log():
    """benchmarks.servers.Server.memory on an adaptive server's start-up lines (as SGLang 0.5.17 and the plugin
    print them at Qwen3-8B geometry, 5a5e0e7); a plain server's log has neither verify line."""
    from types import SimpleNamespace

    log = ("[2026-12-07 17:47:30] max_total_num_tokens=606022, chunked_prefill_size=8192, max_prefill_tokens=16384, "
           "max_running_requests=128, context_len=40960\n"
           "[2026-12-07 17:47:44] Capture target verify CUDA graph end. elapsed=13.38 s, mem usage=3.66 GB, "
           "avail mem=16.30 GB.\n"
           "[2026-12-07 17:48:05] DSPINE adaptive verify: shapes none, chain4, chain8, chain16, tree32, 2.46 GiB for "
           "the other widths' backends and graphs and the context upkeep's graphs, batch buckets [1, 2, 64]\n")
    info = {"mem_fraction_static": 0.85, "cuda_graph_max_bs": None}
    mem = servers.Server.memory(SimpleNamespace(text=lambda: log, info=lambda: info))
    assert mem == {"max_total_num_tokens": 606022, "max_running_requests": 128, "mem_fraction_static": 0.85,
                   "cuda_graph_max_bs": None, "verify_menu_gib": 2.46, "target_verify_graphs_gb": 3.66}
    plain = servers.Server.memory(SimpleNamespace(text=lambda: log.splitlines()[0], info=lambda: info))
    assert plain["verify_menu_gib"] is None and plain["target_verify_graphs_gb"] is None


def test_e2e_servers_take_the_backends_asked_for():
    """benchmarks/serve_e2e.py (the T=1 two-sample test among its items): its servers' flags name the backends
    given, and leave a flag out for 'sglang-default' (SGLang's own choice, FA3 and FlashInfer on an H200), with the
    script's own flags after them either way."""
    import argparse

    from benchmarks import serve_e2e as e2e
    ap = argparse.ArgumentParser()
    servers.add_backend_args(ap)
    default = e2e.server_args(servers.backends_from_args(ap.parse_args([])))
    assert default == e2e.SERVER_ARGS  # what it ran with before the flags: triton, pytorch
    assert default[default.index("--attention-backend") + 1] == "triton"
    assert default[default.index("--sampling-backend") + 1] == "pytorch"
    chosen = e2e.server_args(servers.backends_from_args(ap.parse_args(
        ["--attention-backend", "sglang-default", "--sampling-backend", "sglang-default"])))
    assert "--attention-backend" not in chosen and "--sampling-backend" not in chosen
    assert chosen[-len(e2e.E2E_ARGS):] == e2e.E2E_ARGS == default[-len(e2e.E2E_ARGS):]


def test_result_writer_stamps_provenance_once_and_writes_whole_files(tmp_path):
    """benchmarks.output: write_result adds provenance (command, commit, versions, date) where a record has none
    and keeps one it has; the file is whole JSON, its folders made, no temporary file left."""
    from benchmarks import output

    path = str(tmp_path / "a" / "b" / "r.json")
    output.write_result(path, {"x": 1}, argv=["bench", "--flag"])
    rec = json.load(open(path))
    assert rec["x"] == 1 and rec["provenance"]["command"] == "bench --flag"
    assert {"commit", "gpu", "versions", "date"} <= set(rec["provenance"])
    output.write_result(path, {"x": 2, "provenance": {"commit": "abc"}})
    assert json.load(open(path)) == {"x": 2, "provenance": {"commit": "abc"}}
    assert os.listdir(tmp_path / "a" / "b") == ["r.json"]


def test_greedy_divergence_judges_each_first_divergence_with_the_float32_target(tmp_path):
    """benchmarks/greedy_divergence.py on a run of its own making: plain's answer is the float32 target's greedy
    continuation of a prompt; one server's answer takes the target's second choice at position 3 (the verdict
    must report both log-probs as the target gives them, and a near-tie exactly when both are within the margin),
    another's is plain's own (no divergence), a third's is plain's cut short (a divergence at its end). Then
    adaptive.py --merge puts the same verdicts into its summary."""
    import torch
    from transformers import AutoModelForCausalLM

    gd = importlib.import_module("benchmarks.greedy_divergence")
    assert gd.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert gd.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert gd.first_divergence([1, 2, 3], [1, 2]) == 2
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    models = os.path.join(repo, "models", "default")
    target, prompts = gd.pair_prompts(models)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    prompts = prompts[: gd.GREEDY_ASKED]

    def logprobs(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)

    plain = []
    for p in prompts[:3]:  # 6 greedy tokens each, by hand
        out = []
        for _ in range(6):
            out.append(int(logprobs(p + out).argmax()))
        plain.append(out)
    lp = logprobs(prompts[0] + plain[0][:3])
    second = int(lp.topk(2).indices[1])
    spec = [plain[0][:3] + [second, 0, 0], list(plain[1]), plain[2][:4]]
    # the other prompts: both answers the same token (the script reads an answer for every prompt asked)
    run = {"provenance": {"commit": "x"}, "pair": {
        "plain": {"greedy_ids": plain + [[7]] * (gd.GREEDY_ASKED - 3)},
        "dspine": {"greedy_ids": spec + [[7]] * (gd.GREEDY_ASKED - 3)}}}
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps(run))
    gd.main([str(path), "--models", models, "--out", str(tmp_path / "out")])
    res = json.loads((tmp_path / "out" / "greedy_divergence.json").read_text())["servers"]["dspine"]
    assert res["identical"] == gd.GREEDY_ASKED - 2
    first, cut = res["divergences"]
    assert (first["prompt"], first["position"], first["plain_token"], first["spec_token"]) == (0, 3, plain[0][3], second)
    assert first["fp32_top_token"] == plain[0][3]
    assert first["plain_logprob"] == pytest.approx(float(lp[plain[0][3]]), abs=1e-4)
    assert first["spec_logprob"] == pytest.approx(float(lp[second]), abs=1e-4)
    assert first["near_tie"] == (float(lp[plain[0][3]] - lp[second]) <= gd.NEAR_TIE_MARGIN)
    assert (cut["prompt"], cut["position"], cut["near_tie"]) == (2, 4, False)
    assert res["near_ties"] == int(first["near_tie"])
    # scripts/device/adaptive.py --merge (on this machine, after a GPU run) writes the same verdicts into the
    # issue's summary, beside the tokens/s cells
    cell = {"tokens_per_s": {"median": 10.0, "min": 9.0, "max": 11.0}, "tau": None}
    run["pair"]["plain"]["t0"] = {"1": cell}
    run["pair"]["dspine"]["t0"] = {"1": {**cell, "tau": 2.0}}
    # and the switching phase's answers (under a varying load, against a plain server beside it) alike
    run["switching"] = {"server": "dspine_adaptive", "greedy": {"identical": gd.GREEDY_ASKED - 2, "answers": {
        "base": run["pair"]["plain"]["greedy_ids"], "spec": run["pair"]["dspine"]["greedy_ids"]}},
        "t1": {"bonferroni_min_pvalue": 0.5}, "shapes_during_tests": {}, "ramp": [], "ramp_errors": 0}
    summary = merged_summary(tmp_path / "merge", run, "--models", models)
    assert summary["greedy_divergences_fp32"]["dspine"] == res
    assert summary["switching"]["greedy_divergences_fp32"] == res
    assert summary["end_to_end"]["1"]["dspine"]["tau"] == 2.0 and summary["greedy_equal_to_plain"]["dspine"] == "22/24"


@pytest.mark.parametrize("rows", [1, 4])
def test_verify_attention_times_the_kernels_on_causal_attention_over_context_and_chain(rows):
    """benchmarks/verify_attention.py's calls (Triton's interpreter here, float32, small heads): the extend and
    split-KV kernels compute causal attention over [context, chain] and the decode kernel attention over the
    context, on the inputs the benchmark builds: what it times is the work a verify or decode step does. The
    split-KV kernel also with the index array as the server's verify graphs hold it (`splitkv_graph`), where it
    runs SGLang's largest number of KV splits, 16, against 4 at the batch's own length, and through patch 8's
    split count for graphs (`splitkv_graph_dspine`), and DSPINE's grouped kernel through patch 10's dispatch
    (`grouped`) and at a tuning variant's settings (2 splits, 32-token loop steps)."""
    import torch
    from sglang.kernels.ops.attention.verify_splitkv import choose_n_splits

    va = importlib.import_module("benchmarks.verify_attention")
    shape = va.HQ, va.HKV, va.D
    va.HQ, va.HKV, va.D = 4, 2, 32
    try:
        bs, context = 2, 20
        t = va.inputs(bs, rows, context, torch.Generator().manual_seed(rows), dev="cpu")
        got, graph_len = {}, 1 << 17  # longer than bs x va.MAX_CONTEXT: a capture buffer to patch 8
        assert choose_n_splits(t["kv_indices"].numel() / bs) == 4 and choose_n_splits(graph_len / bs) == 16
        for kernel in ("decode",) * (rows == 1) + va.VERIFY_KERNELS + ("grouped_2s_32n_4w",):
            t["o"].zero_()
            va.calls(kernel, [t], bs, rows, 4, dev="cpu", graph_kv_len=graph_len)()
            got[kernel] = t["o"].clone()
        assert set(got) >= {"extend", "splitkv", "splitkv_graph", "splitkv_graph_dspine", "grouped",
                            "grouped_2s_32n_4w"}
        group = va.HQ // va.HKV
        for kernel, out in got.items():
            for b in range(bs):
                slots = t["kv_indices"][t["kv_indptr"][b]: t["kv_indptr"][b + 1]].long()
                keys = torch.cat([t["k_pool"][slots], t["k"][b * rows: (b + 1) * rows]])
                values = torch.cat([t["v_pool"][slots], t["v"][b * rows: (b + 1) * rows]])
                for j in range(rows):
                    seen = context if kernel == "decode" else context + j + 1
                    for h in range(va.HQ):
                        p = torch.softmax(keys[:seen, h // group] @ t["q"][b * rows + j, h] / va.D ** 0.5, 0)
                        torch.testing.assert_close(out[b * rows + j, h], p @ values[:seen, h // group],
                                                   atol=1e-5, rtol=1e-5)
    finally:
        va.HQ, va.HKV, va.D = shape


def merged_summary(tmp_path, run: dict, *extra: str) -> dict:
    """`scripts/device/adaptive.py --merge` of the run `run` (an adaptive.json of the test's making): its summary."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = tmp_path / "run" / "adaptive.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(run))
    subprocess.run([sys.executable, os.path.join(repo, "scripts", "device", "adaptive.py"), "--merge", str(path),
                    "--out", str(tmp_path / "merged"), *extra], check=True, capture_output=True, text=True)
    return json.loads((tmp_path / "merged" / "adaptive_summary.json").read_text())


def test_adaptive_merge_composes_the_below_block_table_from_the_two_kernels_servers(tmp_path):
    """Where the geometry measured an adaptive server on the extend kernel and one on SGLang's split-KV kernel
    but not SGLANG_DSPINE_SPLITKV_VERIFY=below-block, the merge projects that server from a table composed of
    the two (each shape's graphs are its own): the block's step from the extend server, every narrower shape's
    from the split-KV one."""
    extend = {"1": {"none": 7.0, "chain4": 8.0, "chain16": 9.0}, "64": {"none": 28.0, "chain4": 35.0, "chain16": 50.0}}
    split = {"1": {"none": 6.0, "chain4": 8.5, "chain16": 12.0}, "64": {"none": 12.0, "chain4": 23.0, "chain16": 60.0}}
    accept = {"none": 1.0, "chain4": 2.0, "chain16": 3.0}
    cell = lambda tps, tau=None: {"tokens_per_s": {"median": tps, "min": tps, "max": tps}, "tau": tau}
    run = {"provenance": {"gpu": "G", "commit": "c"},
           # only the adaptive tree server on the pair: its chains' acceptance is the source (the tree's E beside)
           "pair": {"dspine_adaptive_tree32": {"t0": {"1": {**cell(100.0, 3.0), "policy": {
               "expected_tokens": {**accept, "tree32": 3.5}}}}}},
           "geometry": {"plain": {"t0": {"1": cell(150.0), "48": cell(5000.0)}},
                        "dspine_adaptive": {"policy_last": {"step_ms": extend}},
                        "dspine_adaptive_splitkv": {"policy_last": {"step_ms": split}}}}
    out = merged_summary(tmp_path, run)
    assert out["geometry_step_ms"]["dspine_shapes_below_block_composed"] == {
        "1": {"none": 6.0, "chain4": 8.5, "chain16": 9.0}, "64": {"none": 12.0, "chain4": 23.0, "chain16": 50.0}}
    assert out["projection_acceptance"]["geometry_projection"]["dspine"] == {**accept, "tree32": 3.5}
    assert out["projection_acceptance"]["geometry_projection"]["from"].startswith(
        "the built-in pair served: dspine_adaptive_tree32's per-position acceptance")
    proj = out["geometry_projection"]
    # 1 client: the block on the extend kernel, 3/9 per ms, beats chain4 2/8.5 and none 1/6; 48 clients
    # (bucket 64): chain4 on split-KV 2/23 beats none 1/12 and the block 3/50 (on split-KV alone: 3/60)
    assert (proj["1"]["adaptive_shape_below_block_composed"], proj["1"]["dspine_adaptive_below_block_composed"]) \
        == ("chain16", round(1000 * 3 / 9.0, 1))
    assert (proj["48"]["adaptive_shape_below_block_composed"], proj["48"]["dspine_adaptive_below_block_composed"]) \
        == ("chain4", round(48000 * 2 / 23.0, 1))
    assert proj["1"]["dspine_adaptive_splitkv"] == round(1000 * 3 / 12.0, 1)


def test_adaptive_merge_costs_a_step_as_the_policy_now_does_and_keeps_the_switching_record(tmp_path):
    """The projection's step cost is verify_shapes.StepCosts': the larger of the wall and GPU parts. A run of
    c615dca reported the wall part as `step_ms` and the GPU part beside it: the merge takes each cell's larger
    (there the block's 28.5 wall against 39.2 GPU at 48 requests); a newer policy (`wall_step_ms` beside) already
    reports the cost as `step_ms`. The switching phase's record reaches the summary."""
    cell = lambda tps, tau=None: {"tokens_per_s": {"median": tps, "min": tps, "max": tps}, "tau": tau}
    accept = {"none": 1.0, "chain16": 3.0}
    old = {"step_ms": {"48": {"none": 11.1, "chain16": 28.5}}, "gpu_step_ms": {"48": {"none": 11.0, "chain16": 39.2}}}
    new = {"step_ms": {"48": {"none": 11.1, "chain16": 30.0}}, "wall_step_ms": {"48": {"none": 11.1, "chain16": 30.0}},
           "gpu_step_ms": {"48": {"none": 11.0, "chain16": 20.0}}}
    switching = {"server": "dspine_adaptive", "greedy": {"identical": 20, "divergences": [{"top2_logprob_gap": 0.03}]},
                 "t1": {"bonferroni_min_pvalue": 0.5}, "shapes_during_tests": {"none": 3}, "ramp_errors": 0,
                 "ramp": [{"clients": 1, "requests": 5, "errors": 0, "shapes": {"none": 3}}]}
    for policy, block_ms in ((old, 39.2), (new, 30.0)):
        run = {"provenance": {"gpu": "G", "commit": "c"}, "switching": switching,
               "pair": {"dspine_adaptive": {"t0": {"1": {**cell(100.0, 3.0), "policy": {"expected_tokens": accept}}}}},
               "geometry": {"plain": {"t0": {"48": cell(5000.0)}}, "dspine_adaptive": {"policy_last": policy}}}
        out = merged_summary(tmp_path / str(block_ms), run)
        assert out["geometry_step_ms"]["dspine_shapes"]["48"] == {"none": 11.1, "chain16": block_ms}
        proj = out["geometry_projection"]["48"]
        assert proj["dspine"] == round(48000 * 3 / block_ms, 1)
        assert proj["adaptive_shape"] == ("none" if block_ms > 3 * 11.1 else "chain16")
        assert out["switching"]["greedy_identical"] == 20 and out["switching"]["ramp_errors"] == 0
        assert out["runs"][0]["phases"] == ["pair", "geometry", "switching"]


def test_adaptive_merge_projects_each_attention_backend_on_its_own_plain_step(tmp_path):
    """The geometry's servers on SGLang's FA3 backend (`plain_fa3`, `dspine_adaptive_fa3`): their step table and
    projection sit beside triton's, each against its own backend's plain decoding."""
    cell = lambda tps, tau=None: {"tokens_per_s": {"median": tps, "min": tps, "max": tps}, "tau": tau}
    accept = {"none": 1.0, "chain4": 2.0, "chain16": 3.0}
    triton = {"1": {"none": 8.0, "chain4": 9.0, "chain16": 10.0}}
    fa3 = {"1": {"none": 5.0, "chain4": 6.0, "chain16": 6.5}}
    run = {"provenance": {"gpu": "G", "commit": "c"},
           "pair": {"dspine_adaptive": {"t0": {"1": {**cell(100.0, 3.0), "policy": {"expected_tokens": accept}}}}},
           "geometry": {"plain": {"t0": {"1": cell(125.0)}}, "plain_fa3": {"t0": {"1": cell(200.0)}},
                        "dspine_adaptive": {"policy_last": {"step_ms": triton}},
                        "dspine_adaptive_fa3": {"policy_last": {"step_ms": fa3}}}}
    out = merged_summary(tmp_path, run)
    assert out["geometry_step_ms"]["plain_fa3"] == {"1": 5.0} and out["geometry_step_ms"]["plain"] == {"1": 8.0}
    assert out["geometry_step_ms"]["dspine_shapes_fa3"] == fa3
    proj = out["geometry_projection"]["1"]
    assert (proj["plain"], proj["dspine_adaptive"]) == (125.0, 300.0)  # triton: 3 / 10 ms
    assert (proj["plain_fa3"], proj["dspine_fa3"], proj["adaptive_shape_fa3"]) == (200.0, round(3000 / 6.5, 1),
                                                                                   "chain16")


def test_adaptive_merge_projects_each_tree_from_its_own_server(tmp_path):
    """The trees of 32 and 64 side by side: each tree's E comes from the pair's adaptive server with that tree in
    its menu, its step from the geometry's such server, and neither tree's cells borrow the other's (the tree of
    64 wins at 1 client on its own numbers, the tree of 32 does not)."""
    table = {"1": {"none": 5.0, "chain16": 8.0}, "64": {"none": 20.0, "chain16": 60.0}}
    accept = {"none": 1.0, "chain16": 3.0}
    cell = lambda tps, tau=None: {"tokens_per_s": {"median": tps, "min": tps, "max": tps}, "tau": tau}
    tree = lambda n, e: {"t0": {"1": {**cell(90.0, e), "policy": {"expected_tokens": {**accept, f"tree{n}": e}}}}}
    with_step = lambda n, ms: {"policy_last": {"step_ms": {k: {**v, f"tree{n}": ms[k]} for k, v in table.items()}}}
    run = {"provenance": {"gpu": "G", "commit": "c"},
           "pair": {"dspine_adaptive": {"t0": {"1": {**cell(100.0, 3.0), "policy": {"expected_tokens": accept}}}},
                    "dspine_adaptive_tree32": tree(32, 3.1), "dspine_adaptive_tree64": tree(64, 4.5)},
           "geometry": {"plain": {"t0": {"1": cell(200.0), "48": cell(4800.0)}},
                        "dspine_adaptive": {"policy_last": {"step_ms": table}},
                        "dspine_adaptive_tree32": with_step(32, {"1": 8.4, "64": 70.0}),
                        "dspine_adaptive_tree64": with_step(64, {"1": 9.0, "64": 120.0})}}
    out = merged_summary(tmp_path, run)
    assert out["projection_acceptance"]["geometry_projection"]["dspine"] == {**accept, "tree32": 3.1, "tree64": 4.5}
    assert out["geometry_step_ms"]["dspine_shapes_tree64"]["1"] == {"none": 5.0, "chain16": 8.0, "tree64": 9.0}
    one, many = out["geometry_projection"]["1"], out["geometry_projection"]["48"]
    assert (one["dspine_tree64"], one["adaptive_shape_tree64"]) == (500.0, "tree64")  # 4.5 / 9.0 beats 3 / 8
    assert (one["dspine_tree32"], one["adaptive_shape_tree32"]) == (round(1000 * 3.1 / 8.4, 1), "chain16")
    assert one["dspine_adaptive_tree32"] == one["dspine"] == 375.0
    assert many["dspine_tree64"] == 1800.0 and many["adaptive_shape_tree64"] == "none"  # 48 x 4.5 / 120
    goals = {g["goal"]: g["verdict"] for g in out["goals"]}
    assert goals["geometry_projection/dspine_adaptive_tree64: >= 1.15x block at 1 client"] == "met"  # 500 / 375
    assert goals["geometry_projection/dspine_adaptive_tree32: >= 1.15x block at 1 client"] == "not met"


def test_adaptive_merge_projects_the_geometry_step_table_with_each_acceptance(tmp_path):
    """scripts/device/adaptive.py --merge on a run of its own making: the geometry's step table (ms per batch
    bucket and shape) times E(shape) gives tokens/s per client count, for the pair's served acceptance and for
    the recipe lab's offline one (E(chainW) = 1 + the mean survival of its first W - 1 positions, from
    benchmarks/results/lab_recipe_summary.json); adaptive takes the best shape of the bucket a client count pads
    to; DFLASH its E at the block over the block's step; the tree of 32 from the table of a server with it in
    its menu and the tree's E from the pair's such server."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    table = {"1": {"none": 5.0, "chain4": 6.0, "chain16": 8.0}, "64": {"none": 20.0, "chain4": 30.0, "chain16": 60.0}}
    accept = {"none": 1.0, "chain4": 2.0, "chain16": 3.0}
    cell = lambda tps, tau=None: {"tokens_per_s": {"median": tps, "min": tps, "max": tps}, "tau": tau}
    run = {"provenance": {"gpu": "G", "commit": "c"},
           "pair": {"dspine_adaptive": {"t0": {"1": {**cell(100.0, 3.0), "policy": {"expected_tokens": accept}}}},
                    "dspine_adaptive_tree32": {"t0": {"1": {**cell(90.0, 3.5),
                                                            "policy": {"expected_tokens": {"tree32": 3.6}}}}},
                    "dflash": {"t0": {"1": cell(90.0, 2.5), "16": cell(800.0, 2.7), "48": cell(1500.0, 2.9)}}},
           "geometry": {"plain": {"t0": {"1": cell(200.0), "48": cell(4800.0)}},
                        "dspine_adaptive": {"policy_last": {"step_ms": table}},
                        "dspine_adaptive_tree32": {"policy_last": {"step_ms": {
                            k: {**v, "tree32": {"1": 8.4, "64": 70.0}[k]} for k, v in table.items()}}}}}
    out = merged_summary(tmp_path, run)
    pair = out["geometry_projection"]
    # 1 client: bucket 1, chain16 3/8 beats chain4 2/6 and none 1/5 per ms; 48 clients: bucket 64, chain4 2/30
    # beats none 1/20 and chain16 3/60
    # the tree: 3.6/8.4 beats the block at 1 client, and loses to chain4 at 48
    assert pair["1"] == {"plain": 200.0, "dspine": 375.0, "dflash": round(1000 * 2.7 / 8.0, 1),
                         "dspine_adaptive": 375.0, "adaptive_shape": "chain16",
                         "dspine_tree32": round(1000 * 3.6 / 8.4, 1), "dspine_adaptive_tree32": round(1000 * 3.6 / 8.4, 1),
                         "adaptive_shape_tree32": "tree32"}
    assert pair["48"] == {"plain": 4800.0, "dspine": 2400.0, "dflash": round(48000 * 2.7 / 60.0, 1),
                          "dspine_adaptive": 3200.0, "adaptive_shape": "chain4",
                          "dspine_tree32": round(48000 * 3.6 / 70.0, 1), "dspine_adaptive_tree32": 3200.0,
                          "adaptive_shape_tree32": "chain4"}
    lab = json.load(open(os.path.join(repo, "benchmarks", "results", "lab_recipe_summary.json")))

    def e(kind, w):
        lists = [v for seed in lab["position_acceptance"]["t0"].values() for v in seed[kind].values()]
        return 1 + sum(sum(x[i] for x in lists) / len(lists) for i in range(w - 1))

    recipe = out["geometry_projection_recipe_lab"]
    rates = {"none": 1 / 5.0, "chain4": e("dspine", 4) / 6.0, "chain16": e("dspine", 16) / 8.0}
    best = max(rates, key=rates.get)
    assert recipe["1"]["dspine"] == pytest.approx(1000 * rates["chain16"], abs=0.1)
    assert recipe["1"]["dflash"] == pytest.approx(1000 * e("dflash", 16) / 8.0, abs=0.1)
    assert (recipe["1"]["adaptive_shape"], recipe["1"]["dspine_adaptive"]) == (best, pytest.approx(1000 * rates[best],
                                                                                                    abs=0.1))
    assert out["projection_acceptance"]["geometry_projection_recipe_lab"]["dspine"]["chain4"] == \
        pytest.approx(e("dspine", 4), abs=1e-4)


def test_plain_is_projected_on_its_steady_decode_step_and_each_fixed_server_on_its_own(tmp_path):
    """Where a run recorded each cell's `decode_ms_per_token` (steady decoding from SGLang's decode log lines),
    plain's step is that, not clients / its tokens/s (which also holds prefills and request gaps), and each fixed
    DSPINE server's block step is its own decode_ms_per_token x τ, projected with the block's E beside the
    adaptive table's."""
    cell = lambda tps, tau=None, log=None: {"tokens_per_s": {"median": tps, "min": tps, "max": tps}, "tau": tau,
                                            "decode_ms_per_token": log}
    accept = {"none": 1.0, "chain4": 2.0, "chain16": 3.0}
    run = {"provenance": {"gpu": "G", "commit": "c"},
           "pair": {"dspine_adaptive": {"t0": {"1": {**cell(100.0, 3.0), "policy": {"expected_tokens": accept}}}}},
           "geometry": {"plain": {"t0": {"1": cell(125.0, None, 6.25), "48": cell(4000.0)}},  # 48: no log value
                        "dspine_grouped": {"t0": {"1": cell(110.0, 1.01, 8.0)}},
                        "dspine_adaptive_grouped": {"t0": {"1": cell(120.0, 1.0, 6.5)}},  # not a fixed server
                        "dspine_adaptive": {"policy_last": {"step_ms": {"1": {"none": 6.4, "chain16": 9.0},
                                                                        "64": {"none": 11.0}}}}}}
    out = merged_summary(tmp_path, run)
    assert out["geometry_step_ms"]["plain"] == {"1": 6.25, "48": 12.0}
    proj = out["geometry_projection"]
    assert proj["1"]["plain"] == 160.0 and proj["48"]["plain"] == 4000.0
    assert proj["1"]["dspine_fixed_grouped"] == round(1000 * 3.0 / (8.0 * 1.01), 1)
    assert proj["1"]["dspine"] == round(1000 * 3.0 / 9.0, 1)
    assert "dspine_fixed_adaptive_grouped" not in proj["1"] and "dspine_fixed_grouped" not in proj["48"]


def test_steady_decoding_is_read_from_the_decode_log_lines():
    """servers.decode_ms_per_token: only intervals that begin on a decode line at the same running count with no
    prefill between count (each line's tokens/s covers the interval since the line before)."""
    from benchmarks import servers

    line = "[t] Decode batch, #running-req: {r}, #token: 9, cuda graph: True, gen throughput (token/s): {t}, #queue-req: 0"
    log = "\n".join([line.format(r=4, t=10.0),  # the first line: its interval began elsewhere
                     line.format(r=4, t=400.0), line.format(r=4, t=500.0),
                     "[t] Prefill batch, #new-seq: 1, #new-token: 1",
                     line.format(r=4, t=50.0),  # after a prefill: not counted
                     line.format(r=4, t=800.0), line.format(r=2, t=300.0), line.format(r=4, t=1.0)])
    assert servers.decode_ms_per_token(log, 4) == 8.0  # median of 10, 8, 5 ms
    assert servers.decode_ms_per_token(log, 4, least=4) is None
    assert servers.decode_ms_per_token(log, 2) is None


def default_rules(tmp_path, run: dict, rep2: dict | None = None, gpu_log: str | None = None) -> dict:
    """`scripts/device/default_rules.py` on runs of the test's making: rule -> verdict."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = [sys.executable, os.path.join(repo, "scripts", "device", "default_rules.py")]
    for flag, obj in (("", run), ("--rep2", rep2), ("--gpu-tests-log", gpu_log)):
        if obj is None:
            continue
        path = tmp_path / f"arg{len(args)}"
        path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
        args += [flag, str(path)] if flag else [str(path)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return {line.split()[0]: line.split()[1] if line.split()[1] != "not" else "not met" for line in out.splitlines()}


def test_default_rules_judge_each_default_from_the_runs_and_never_pass_without_data(tmp_path):
    """The decision rules of scripts/device/issue57.sh: each verdict follows its thresholds (a cell just past one
    flips it), and a rule whose data is missing is `undecided`, not met."""
    cell = lambda tps, shapes=None: {"tokens_per_s": {"median": tps, "min": tps, "max": tps}, "tau": 1.0,
                                     **({"shapes": shapes} if shapes else {})}
    counts = (1, 4, 16, 48, 64)
    plain = {c: 100.0 * c for c in counts}
    row = lambda scale, first=None: {"t0": {str(c): cell(plain[c] * scale, first if c == 1 else None) for c in counts}}

    def geometry(below=1.0, none_share=0.99, split=1.05, split_1=1.0, vs_plain=0.96, grouped=1.06, grouped_4=0.99,
                 upkeep=1.0):
        # below-block: vs_plain x plain everywhere, 1.2 x below the extend-kernel adaptive server from 4 clients
        adaptive = lambda scale: {"t0": {str(c): cell(plain[c] * scale * (0.6 if c == 1 else vs_plain / (1.2 * below)))
                                         for c in counts}}
        return {"plain": row(1.0), "dspine": row(0.5), "dspine_adaptive": adaptive(1.0),
                "dspine_adaptive_upkeep_graphs": adaptive(upkeep),
                "dspine_adaptive_below_block": {"t0": {str(c): cell(plain[c] * vs_plain,
                                                                    {"none": 100 * none_share,
                                                                     "chain4": 100 * (1 - none_share)})
                                                        for c in counts}},
                "dspine_splitkv": {"t0": {str(c): cell(plain[c] * 0.5 * (split_1 if c == 1 else split))
                                          for c in counts}},
                "dspine_grouped": {"t0": {str(c): cell(plain[c] * 0.5 * (grouped_4 if c <= 4 else grouped))
                                          for c in counts}}}

    switching = {"greedy": {"divergences": [{"top2_logprob_gap": 0.0}]}, "t1": {"bonferroni_min_pvalue": 0.4}}
    greedy = lambda equal: [[1, 2]] * equal + [[3, 4]] * (24 - equal)  # 24 prompts, `equal` of them plain's

    def pair(ratio, grouped_equal=20, upkeep=1.0):
        return {"pair": {"plain": {"greedy_ids": greedy(24)}, "dspine": {**row(1.0), "greedy_ids": greedy(21)},
                         "dspine_adaptive": row(ratio), "dspine_adaptive_upkeep_graphs": row(ratio * upkeep),
                         "dspine_grouped": {"greedy_ids": greedy(grouped_equal)}}}

    run = {"geometry": geometry(), "switching": switching, **pair(1.0)}
    log = "....\n22 passed, 122 deselected in 92.49s\n"
    assert default_rules(tmp_path, run, pair(0.98), log) == {
        "new_cost": "met", "below_block": "met", "split_kv": "met", "floors": "met", "grouped": "met",
        "upkeep": "met", "adaptive": "met", "wrapper": "undecided", "tree_grouped": "undecided",
        "cap_cost": "undecided", "cap_graphs": "undecided", "admission": "undecided", "tree64": "undecided"}
    # one threshold crossed at a time
    assert default_rules(tmp_path, {**run, "geometry": geometry(none_share=0.79)}, pair(0.98), log)["new_cost"] \
        == "not met"
    assert default_rules(tmp_path, {**run, "geometry": geometry(below=0.9)}, pair(0.98), log)["below_block"] \
        == "not met"  # 1.08x the extend server at 48/64
    assert default_rules(tmp_path, {**run, "switching": {**switching, "t1": {"bonferroni_min_pvalue": 0.01}}},
                         pair(0.98), log)["below_block"] == "not met"
    far = {**switching, "greedy": {"divergences": [{"top2_logprob_gap": 0.5}]}}
    assert default_rules(tmp_path, {**run, "switching": far}, pair(0.98), log)["below_block"] == "not met"
    assert default_rules(tmp_path, {**run, "geometry": geometry(split_1=0.96)}, pair(0.98), log)["split_kv"] \
        == "not met"
    assert default_rules(tmp_path, run, pair(0.98), "21 passed, 1 failed in 90s\n")["split_kv"] == "not met"
    assert default_rules(tmp_path, run, pair(0.96), log)["adaptive"] == "not met"
    assert default_rules(tmp_path, {**run, "geometry": geometry(none_share=0.97)}, pair(0.98), log) == {
        "new_cost": "met", "below_block": "met", "split_kv": "met", "floors": "not met", "grouped": "met",
        "upkeep": "met", "adaptive": "met", "wrapper": "undecided", "tree_grouped": "undecided",
        "cap_cost": "undecided", "cap_graphs": "undecided", "admission": "undecided", "tree64": "undecided"}
    assert default_rules(tmp_path, {**run, "geometry": geometry(upkeep=0.975)}, pair(0.98), log)["upkeep"] \
        == "not met"  # the graphs 0.975x the eager upkeep at the geometry
    assert default_rules(tmp_path, {**run, "geometry": geometry(upkeep=0.985)}, pair(0.98), log)["upkeep"] == "met"
    # the pair's cells are not judged (identical servers differed by up to 28% there at 97513c7)
    assert default_rules(tmp_path, {**run, **pair(1.0, upkeep=0.8)}, pair(0.98), log)["upkeep"] == "met"
    assert default_rules(tmp_path, run, pair(0.98), "21 passed, 1 failed in 90s\n")["upkeep"] == "not met"
    assert default_rules(tmp_path, {**run, "geometry": geometry(grouped=1.04)}, pair(0.98), log)["grouped"] \
        == "not met"  # 1.04x fixed from 16 clients
    assert default_rules(tmp_path, {**run, "geometry": geometry(grouped_4=0.97)}, pair(0.98), log)["grouped"] \
        == "not met"
    assert default_rules(tmp_path, {**run, **pair(1.0, grouped_equal=19)}, pair(0.98), log)["grouped"] == "not met"
    assert default_rules(tmp_path, run, pair(0.98), "21 passed, 1 failed in 90s\n")["grouped"] == "not met"
    assert default_rules(tmp_path, {**run, "geometry": geometry(vs_plain=0.94)}, pair(0.98), log)["floors"] \
        == "not met"
    # missing data never passes
    bare = default_rules(tmp_path, {"geometry": {"plain": row(1.0)}})
    assert bare == {"new_cost": "undecided", "below_block": "undecided", "split_kv": "undecided",
                    "floors": "undecided", "grouped": "undecided", "upkeep": "undecided", "adaptive": "undecided",
                    "wrapper": "undecided", "tree_grouped": "undecided", "cap_cost": "undecided",
                    "cap_graphs": "undecided", "admission": "undecided", "tree64": "undecided"}


def test_the_wrapper_diagnosis_and_the_grouped_tree_rule_follow_their_thresholds(tmp_path):
    """`wrapper`: the wide-menu adaptive server (the block and chain15) at <= 0.90x fixed DSPINE at 16 and 48 clients in both passes of the
    pair says the adaptive step's own work costs the pair. `tree_grouped`: the grouped tree's tree32 step <= 0.95x
    the extend kernel's at buckets 1, 4 and 16 of the geometry, its greedy outputs on >= 17 of 24 prompts, the GPU
    tests passed."""
    cell = lambda tps: {"tokens_per_s": {"median": tps, "min": tps, "max": tps}, "tau": 3.0}
    pair = lambda block_only: {"pair": {
        "dspine": {"t0": {str(c): cell(1000.0) for c in (1, 16, 48)}},
        "dspine_adaptive_wide": {"t0": {str(c): cell(1000.0 * block_only) for c in (1, 16, 48)}}}}
    greedy = lambda equal: [[1, 2]] * equal + [[3, 4]] * (24 - equal)
    table = lambda ms: {"policy_last": {"step_ms": {str(b): {"chain16": 9.0, "tree32": ms * b} for b in (1, 4, 16)}}}

    def run(block_only=0.85, grouped_ms=9.5, equal=17):
        return {**pair(block_only), "geometry": {"dspine_adaptive_tree32": table(10.0),
                                                 "dspine_adaptive_tree32_grouped": table(grouped_ms)},
                "pair": {**pair(block_only)["pair"], "plain": {"greedy_ids": greedy(24)},
                         "dspine_tree32_grouped": {"greedy_ids": greedy(equal)}}}

    log = "....\n34 passed, 165 deselected in 135.37s\n"
    verdicts = default_rules(tmp_path, run(), pair(0.9), log)
    assert (verdicts["wrapper"], verdicts["tree_grouped"]) == ("met", "met")
    assert default_rules(tmp_path, run(), pair(0.91), log)["wrapper"] == "not met"  # the second pass above 0.90
    assert default_rules(tmp_path, run(block_only=0.95), pair(0.85), log)["wrapper"] == "not met"
    assert default_rules(tmp_path, run())["wrapper"] == "undecided"  # one pass
    assert default_rules(tmp_path, run(grouped_ms=9.6), pair(0.9), log)["tree_grouped"] == "not met"  # 0.96x
    assert default_rules(tmp_path, run(equal=16), pair(0.9), log)["tree_grouped"] == "not met"
    assert default_rules(tmp_path, run(), pair(0.9), "33 passed, 1 failed in 90s\n")["tree_grouped"] == "not met"
    no_grouped = run()
    del no_grouped["geometry"]["dspine_adaptive_tree32_grouped"]
    assert default_rules(tmp_path, no_grouped, pair(0.9), log)["tree_grouped"] == "undecided"


def test_the_cap_diagnoses_follow_their_thresholds(tmp_path):
    """`cap_cost`: fixed DSPINE with a cap of 128 at <= 0.95x the cap of 48 at 1 and 16 clients in both passes.
    `cap_graphs` (judged only where cap_cost is met): the cap of 128 with graphs to 48 at >= 0.97x there. Both are
    undecided where fixed DSPINE's two instances differ by more than 5%."""
    cell = lambda tps: {"tokens_per_s": {"median": tps, "min": tps, "max": tps}, "tau": 3.0}

    def run(cap128=0.9, graphs48=0.98, clients=(1, 16, 48), fixed=1.0):
        ratios_ = {"dspine": 1.0, "dspine_cap128": cap128, "dspine_cap128_graphs48": graphs48}
        return {"pair": {n: {"t0": {str(c): cell(1000.0 * fixed * r) for c in clients}} for n, r in ratios_.items()}}

    verdicts = default_rules(tmp_path, run(), run())
    assert (verdicts["cap_cost"], verdicts["cap_graphs"]) == ("met", "met")
    assert default_rules(tmp_path, run(), run(cap128=0.95, graphs48=0.97))["cap_graphs"] == "met"  # the edges
    verdicts = default_rules(tmp_path, run(), run(cap128=0.96))  # the second pass above 0.95
    assert (verdicts["cap_cost"], verdicts["cap_graphs"]) == ("not met", "undecided")
    assert default_rules(tmp_path, run(), run(graphs48=0.96))["cap_graphs"] == "not met"
    assert default_rules(tmp_path, run())["cap_cost"] == "undecided"  # one pass
    assert default_rules(tmp_path, run(), run(clients=(48,)))["cap_cost"] == "undecided"
    # fixed DSPINE's two instances 6% apart: more than the effect looked for, so neither rule decides
    assert default_rules(tmp_path, run(), run(fixed=1.06))["cap_cost"] == "undecided"
    assert default_rules(tmp_path, run(), run(fixed=1.05))["cap_cost"] == "met"


def test_the_tree64_rule_compares_each_tree_within_its_own_table(tmp_path):
    """`tree64`: the tree of 64 is recommended where E(tree64) / (its step ÷ chain16's) >= 1.05x the same for the
    tree of 32 at 1 request (E from this run's pair, each step ratio within one geometry table), its greedy outputs
    equal plain's on >= 17 of 24 prompts and the GPU tests passed. Without a tree32 table in the run, 671b819's
    kept grouped tree server's (tree32 9.24 ms against chain16 8.99 at 1 request) and plain's greedy outputs."""
    greedy = lambda equal: [[1, 2]] * equal + [[3, 4]] * (24 - equal)
    e = lambda n, v: {"t0": {"1": {"policy": {"expected_tokens": {f"tree{n}": 99.0}}},
                             "16": {"policy": {"expected_tokens": {"chain16": 3.0, f"tree{n}": v}}}}}
    table = lambda n, tree_ms, chain_ms=10.0: {"policy_last": {"step_ms": {"1": {"chain16": chain_ms,
                                                                                 f"tree{n}": tree_ms}}}}

    def run(e64=5.0, step64=10.5, equal=18, tree32_table=True, plain=True):
        out = {"pair": {"dspine_adaptive_tree32": e(32, 4.5), "dspine_adaptive_tree64": {**e(64, e64),
                                                                                         "greedy_ids": greedy(equal)}},
               "geometry": {"dspine_adaptive_tree64": table(64, step64)}}
        if tree32_table:  # a table that runs 20% slower than tree64's: only the ratio within it counts
            out["geometry"]["dspine_adaptive_tree32"] = table(32, 12.36, chain_ms=12.0)
        if plain:
            out["pair"]["plain"] = {"greedy_ids": greedy(24)}
        return out

    log = "....\n35 passed, 165 deselected in 135.37s\n"
    # 5.0 / 1.05 = 4.762 against 4.5 / 1.03 = 4.369: 1.090x (the last T=0 cell's E, not the first's)
    assert default_rules(tmp_path, run(), gpu_log=log)["tree64"] == "met"
    assert default_rules(tmp_path, run(e64=4.8), gpu_log=log)["tree64"] == "not met"  # 1.046x
    assert default_rules(tmp_path, run(equal=16), gpu_log=log)["tree64"] == "not met"
    assert default_rules(tmp_path, run(), gpu_log="34 passed, 1 failed in 90s\n")["tree64"] == "not met"
    assert default_rules(tmp_path, run())["tree64"] == "undecided"  # no GPU tests log
    # 671b819's kept tree32 table (1.028x chain16) and its plain (the pair's first greedy answers)
    kept = json.load(open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                                       "results", "adaptive_run_h100_671b819.json")))["pair"]["plain"]["greedy_ids"]
    fallback = {**run(tree32_table=False, plain=False), "provenance": {"gpu": "NVIDIA H100 80GB HBM3"}}
    fallback["pair"]["dspine_adaptive_tree64"]["greedy_ids"] = kept
    assert default_rules(tmp_path, fallback, gpu_log=log)["tree64"] == "met"  # 4.762 / (4.5 / 1.0278) = 1.088x
    fallback["pair"]["dspine_adaptive_tree64"]["greedy_ids"] = greedy(24)  # none equal to the kept plain's
    assert default_rules(tmp_path, fallback, gpu_log=log)["tree64"] == "not met"
    fallback["provenance"]["gpu"] = "NVIDIA H200"  # 671b819's references are an H100's
    assert default_rules(tmp_path, fallback, gpu_log=log)["tree64"] == "undecided"
    assert default_rules(tmp_path, {"pair": run()["pair"]}, gpu_log=log)["tree64"] == "undecided"  # no tables


def test_the_admission_rule_follows_its_thresholds(tmp_path):
    """`admission`: the cap of 128 with SGLang's prefill delayer at >= 1.10x the same cap without at 48 clients and
    >= 0.97x at 1 and 16, in both passes; undecided with one pass, a client count missing, or the undelayed
    server's two instances more than 5% apart at 48."""
    cell = lambda tps: {"tokens_per_s": {"median": tps, "min": tps, "max": tps}, "tau": 3.0}

    def run(at48=1.15, light=0.98, base48=1.0, clients=(1, 16, 48)):
        delayed = {1: light, 16: light, 48: at48}
        return {"pair": {"dspine_cap128": {"t0": {str(c): cell(1000.0 * (base48 if c == 48 else 1.0))
                                                  for c in clients}},
                         "dspine_cap128_delayed": {"t0": {str(c): cell(1000.0 * delayed[c] *
                                                                       (base48 if c == 48 else 1.0))
                                                          for c in clients}}}}

    assert default_rules(tmp_path, run(), run())["admission"] == "met"
    assert default_rules(tmp_path, run(), run(at48=1.10, light=0.97))["admission"] == "met"  # the edges
    assert default_rules(tmp_path, run(), run(at48=1.09))["admission"] == "not met"
    assert default_rules(tmp_path, run(light=0.96), run())["admission"] == "not met"  # it costs light loads
    assert default_rules(tmp_path, run())["admission"] == "undecided"
    assert default_rules(tmp_path, run(), run(clients=(1, 16)))["admission"] == "undecided"
    assert default_rules(tmp_path, run(), run(base48=1.06))["admission"] == "undecided"


def test_adaptive_merge_judges_the_issues_goals_from_the_cells(tmp_path):
    """`goals` in the merged summary: the pair's adaptive against the best fixed server per client count (0.97x)
    and against the block where plain beats it (1.10x); the geometry's projection against max(plain, block), 1.15x
    the block at 1 client and plain at 48 and 64; a goal whose cells are missing is `not measured`, never met."""
    cell = lambda tps, tau=None: {"tokens_per_s": {"median": tps, "min": tps, "max": tps}, "tau": tau}
    accept = {"none": 1.0, "chain16": 3.0}
    run = {"provenance": {"gpu": "G", "commit": "c"},
           "pair": {"plain": {"t0": {"1": cell(100.0), "48": cell(1000.0)}},
                    "dspine": {"t0": {"1": cell(200.0, 3.0), "48": cell(800.0, 3.0)}},
                    # 1 client: 195 / 200 = 0.975 of the best (met); 48: 970 / 1000 = 0.97 (met), and 970 / 800
                    # = 1.2125 of the block where plain beats it (met)
                    "dspine_adaptive": {"t0": {"1": cell(195.0, 3.0),  # acceptance: the last cell's policy
                                               "48": {**cell(970.0, 1.0), "policy": {"expected_tokens": accept}}}}},
           # the table: at 1 client the block (3 / 9 ms) beats none (1 / 8): adaptive = the block (1.0x, not 1.15x);
           # at 48 (bucket 48) none (1 / 10) against plain's 9.5 ms: below plain
           "geometry": {"plain": {"t0": {"1": cell(125.0), "48": {**cell(5052.6), "decode_ms_per_token": 9.5}}},
                        "dspine_adaptive": {"policy_last": {"step_ms": {"1": {"none": 8.0, "chain16": 9.0},
                                                                        "48": {"none": 10.0, "chain16": 40.0}}}}}}
    goals = {g["goal"]: g for g in merged_summary(tmp_path, run)["goals"]}
    assert goals["pair_best_fixed"]["verdict"] == "met" and "1 0.975, 48 0.97" in goals["pair_best_fixed"]["detail"]
    assert goals["pair_where_plain_wins"]["verdict"] == "met" and "48 1.212" in goals["pair_where_plain_wins"]["detail"]
    geo = "geometry_projection/dspine_adaptive"
    assert goals[f"{geo}: >= 1.15x block at 1 client"]["verdict"] == "not met"
    assert goals[f"{geo}: >= 1.15x block at 1 client"]["detail"].endswith("1 1.0")
    assert goals[f"{geo}: >= plain at 48 and 64"]["verdict"] == "not measured"  # no 64 clients
    assert goals[f"{geo}: >= max(plain, block)"]["verdict"] == "not met"  # 48: 4800 / 5052.6 = 0.95
    assert goals["lossless_switching"]["verdict"] == "not measured"


def test_a_profile_waits_for_its_whole_load_in_the_servers_log(tmp_path):
    """serving_scale.wait_until_running reads the decode log lines written after the load began: it returns once
    they show every request running, as soon as a request of the load fails (with its error), and after its
    timeout otherwise (with the most it saw), so a profile never records a batch that is not the one asked for."""
    import concurrent.futures as cf

    scale = importlib.import_module("benchmarks.serving_scale")
    log = tmp_path / "server.log"
    log.write_text("Decode batch, #running-req: 48, #token: 9\n")  # an earlier round's line: before `since`
    server = _server_with_log(log)
    since = len(server.text())

    def later(text, delay):
        time.sleep(delay)
        with open(log, "a") as f:
            f.write(text)

    with cf.ThreadPoolExecutor(2) as ex:
        fine = [ex.submit(lambda: None)]
        ex.submit(later, "Decode batch, #running-req: 7, #token: 1\nDecode batch, #running-req: 48, #token: 2 "
                         "verify shapes: chain16 10\n", 0.3)
        t = time.time()
        assert scale.wait_until_running(server, fine, 48, since, 10.0) == (48, [])
        assert time.time() - t < 5
    since = len(server.text())
    assert scale.wait_until_running(server, fine, 48, since, 0.6) == (0, [])  # nothing new: the timeout
    with open(log, "a") as f:
        f.write("Decode batch, #running-req: 12, #token: 3\n")
    failed = cf.Future()
    failed.set_exception(ConnectionError("refused"))
    most, errors = scale.wait_until_running(server, [failed], 48, since, 10.0)
    assert most == 12 and errors == ["ConnectionError('refused')"]


def _server_with_log(log):
    """What wait_until_running reads of a benchmarks.servers.Server: its log's text."""
    from types import SimpleNamespace

    return SimpleNamespace(text=lambda: open(log).read())


def test_geometry_servers_give_the_tree_of_64_the_memory_its_graphs_need():
    """scripts/device/adaptive.py's Qwen3-8B geometry servers: every one keeps 15% of the GPU beside the KV pool but
    the adaptive servers with the tree of 64 in their menu, which keep 20% (at 0.85 it ran out of memory capturing its
    graphs on an 80 GB H100, 61da15d); the rest of each server's arguments are the same as the tree of 32's."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import adaptive; "
            "print(json.dumps({n: a for n, (a, e) in adaptive.geometry_servers('/t', '/d').items()}))")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(repo, "scripts", "device")], check=True,
                         capture_output=True, text=True, cwd=repo).stdout
    servers = json.loads(out)

    def fraction(args):
        return args[args.index("--mem-fraction-static") + 1]

    tree64 = {n: fraction(a) for n, a in servers.items() if "tree64" in n}  # its kernel variants too
    others = {n: fraction(a) for n, a in servers.items() if "tree64" not in n}
    assert set(tree64.values()) == {"0.80"} and "dspine_adaptive_tree64" in tree64
    assert set(others.values()) == {"0.85"} and {"plain", "dspine", "dspine_adaptive_tree32"} <= set(others)
    t32, t64 = servers["dspine_adaptive_tree32"], servers["dspine_adaptive_tree64"]
    width = t64.index("--speculative-num-draft-tokens") + 1
    assert t64[width] == "64" and t32[width] == "32"
    assert ["0.85" if x == "0.80" else x for x in [*t64[:width], "32", *t64[width + 1:]]] == t32


def test_measured_code_digest_follows_the_code_not_its_layout(tmp_path):
    """sglang_dspine.provenance.measured_code_digest: the GPU machine lays the package out with the kernels inside
    it (scripts/device/layout_package.sh), a checkout keeps them in kernels/; the same files give the same digest
    either way, caches do not count, and one changed byte changes it."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "from sglang_dspine.provenance import measured_code_digest as d; print(d())"

    def digest(site):
        env = {**os.environ, "PYTHONPATH": str(site)}
        return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path,
                              env=env).stdout.strip()

    site = tmp_path / "site"
    subprocess.run(["bash", os.path.join(repo, "scripts", "device", "layout_package.sh"), str(site)], check=True)
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(repo, "sglang_dspine"), checkout / "sglang_dspine",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(repo, "kernels"), checkout / "sglang_dspine" / "kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    laid_out = digest(site)
    assert len(laid_out) == 16 and digest(checkout) == laid_out
    (site / "sglang_dspine" / "kernels" / "__pycache__").mkdir(exist_ok=True)
    (site / "sglang_dspine" / "kernels" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"cache")
    assert digest(site) == laid_out
    env_py = site / "sglang_dspine" / "env.py"
    env_py.write_text(env_py.read_text() + "\n")
    assert digest(site) != laid_out


def _adaptive_script():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(repo, "scripts", "device"))
    try:
        import adaptive
    finally:
        sys.path.pop(0)
    return adaptive


def test_a_run_continues_an_earlier_one_only_on_its_card_and_its_code():
    """scripts/device/adaptive.py on an $OUT/adaptive.json that holds an earlier run's cells (a second lease
    continuing the first): refused on another GPU or software stack, or where the measured code differs (a run from
    before the digest: where the commit differs); otherwise this run's provenance, the earlier one under
    `continues`."""
    adaptive = _adaptive_script()
    first = {"commit": "aaa", "gpu": "NVIDIA H100 80GB HBM3", "measured_code": "d1", "date": "1"}
    same_code = {**first, "commit": "bbb", "date": "2"}
    assert adaptive.continued_provenance({}, first, "p") == first
    cont = adaptive.continued_provenance({"provenance": first}, same_code, "p")
    assert cont == {**same_code, "continues": [first]}
    third = {**same_code, "commit": "ccc", "date": "3"}
    assert adaptive.continued_provenance({"provenance": cont}, third, "p")["continues"] == [first, same_code]
    # another call of the same lease: nothing to keep
    assert adaptive.continued_provenance({"provenance": first}, {**first, "date": "9"}, "p") == {**first, "date": "9"}
    with pytest.raises(adaptive.RunMismatch, match="NVIDIA H200"):
        adaptive.continued_provenance({"provenance": first}, {**same_code, "gpu": "NVIDIA H200"}, "p")
    with pytest.raises(adaptive.RunMismatch, match="two software stacks"):  # SGLang 0.5.23's lease, say
        adaptive.continued_provenance({"provenance": first}, {**same_code, "versions": {"sglang": "0.5.23"}}, "p")
    with pytest.raises(adaptive.RunMismatch, match="measured code differs"):
        adaptive.continued_provenance({"provenance": first}, {**same_code, "measured_code": "d2"}, "p")
    with pytest.raises(adaptive.RunMismatch, match="measured code differs"):  # the same commit, edited code
        adaptive.continued_provenance({"provenance": first}, {**first, "measured_code": "d2"}, "p")
    old = {k: v for k, v in first.items() if k != "measured_code"}
    assert "continues" not in adaptive.continued_provenance({"provenance": old}, first, "p")
    with pytest.raises(adaptive.RunMismatch, match="not recorded"):
        adaptive.continued_provenance({"provenance": old}, same_code, "p")


def test_adaptive_merge_refuses_two_cards_and_code_changes_unless_asked(tmp_path):
    """`adaptive.py --merge`: runs from two GPUs never make one summary; runs at two commits whose measured code
    (sglang_dspine, kernels) differs only with --across-code-changes, which the summary records (git on this
    machine: 5509f56 -> aa1a580 changed no measured code, 84ba46f -> 5a5e0e7 changed the serving code); the
    summary's commit names every commit a run measured at, those it continued included."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def merge(*runs, extra=()):
        paths = []
        for i, prov in enumerate(runs):
            p = tmp_path / f"run{i}.json"
            p.write_text(json.dumps({"provenance": prov, "pair": {}}))
            paths.append(str(p))
        return subprocess.run([sys.executable, os.path.join(repo, "scripts", "device", "adaptive.py"), "--merge",
                               *paths, "--out", str(tmp_path / "m"), *extra], capture_output=True, text=True)

    h100 = "NVIDIA H100 80GB HBM3"
    out = merge({"gpu": h100, "commit": "5509f56"}, {"gpu": "NVIDIA H200", "commit": "5509f56"})
    assert out.returncode != 0 and "one card a summary" in out.stderr
    assert merge({"gpu": h100, "commit": "5509f56"}, {"gpu": h100, "commit": "aa1a580"}).returncode == 0
    assert "measured_code_changed_since" not in json.loads((tmp_path / "m" / "adaptive_summary.json").read_text())
    out = merge({"gpu": h100, "commit": "84ba46f"}, {"gpu": h100, "commit": "5a5e0e7"})
    assert out.returncode != 0 and "sglang_dspine/serving/worker.py" in out.stderr
    assert merge({"gpu": h100, "commit": "84ba46f"}, {"gpu": h100, "commit": "5a5e0e7"},
                 extra=["--across-code-changes"]).returncode == 0
    changed = json.loads((tmp_path / "m" / "adaptive_summary.json").read_text())["measured_code_changed_since"]
    assert "sglang_dspine/serving/worker.py" in changed["84ba46f"]
    # a run that continued an earlier lease's: the summary names both commits
    first = {"gpu": h100, "commit": "5509f56", "measured_code": "d"}
    assert merge({"gpu": h100, "commit": "aa1a580", "measured_code": "d", "continues": [first]}).returncode == 0
    assert json.loads((tmp_path / "m" / "adaptive_summary.json").read_text())["commit"] == "5509f56, aa1a580"


def test_the_summary_reports_what_the_verify_menu_costs_in_memory():
    """adaptive.py's summary at the geometry: each adaptive server's KV tokens lost against fixed DSPINE (its pool
    is sized before the menu's graphs, so 0 at the same memory fraction) and the menu's memory as a share of the
    pool's bytes (144 KiB a token at Qwen3-8B: 36 layers x 8 KV heads x 128 x K and V x bf16)."""
    adaptive = _adaptive_script()
    assert adaptive.kv_bytes_a_token(adaptive.scale.GEOMETRIES["qwen3-8b"]) == 144 * 1024
    mem = lambda tokens, frac, menu=None: {"memory": {"max_total_num_tokens": tokens,  # noqa: E731
                                                      "mem_fraction_static": frac, "verify_menu_gib": menu}}
    geo = {"dspine": mem(276560, 0.85), "plain": mem(400000, 0.85), "dspine_adaptive": mem(276560, 0.85, 1.14),
           "dspine_adaptive_tree64": mem(251000, 0.80, 2.46), "dspine_adaptive_old": mem(276560, 0.85)}
    out = adaptive.menu_memory(geo)
    assert set(out) == {"dspine_adaptive", "dspine_adaptive_tree64"}  # a record from before the menu's line: none
    assert out["dspine_adaptive"]["kv_tokens_lost"] == 0
    assert out["dspine_adaptive"]["menu_share_of_pool"] == pytest.approx(1.14 * 2**30 / (276560 * 147456), abs=1e-4)
    assert out["dspine_adaptive_tree64"]["kv_tokens_lost"] == 25560
    del geo["dspine"]
    assert adaptive.menu_memory(geo)["dspine_adaptive"]["kv_tokens_lost"] is None
    summary = adaptive.summarize({"geometry": geo})
    assert summary["geometry_memory"]["dspine_adaptive_tree64"]["verify_menu_gib"] == 2.46
    assert [g for g in adaptive.goals(summary, None) if g["goal"] == "memory"][0]["verdict"] == "not measured"
    geo["dspine"] = mem(276560, 0.85)
    goal = [g for g in adaptive.goals(adaptive.summarize({"geometry": geo}), None) if g["goal"] == "memory"][0]
    assert goal["verdict"] == "not met" and "dspine_adaptive 0.0%" in goal["detail"]  # the tree of 64 loses 9.2%
    del geo["dspine_adaptive_tree64"]
    assert [g for g in adaptive.goals(adaptive.summarize({"geometry": geo}), None)
            if g["goal"] == "memory"][0]["verdict"] == "met"


def test_the_pair_starts_phase_interleaves_starts_and_summarises_them_over_starts(tmp_path, monkeypatch):
    """adaptive.py's pair_starts: start i runs the servers rotated by i (over len(servers) starts each server is
    first once and last once), and --merge's summary gives, per server and client count, the median over starts of
    each start's tokens/s with min, max and n, and adaptive / fixed per start (statistics-free references: the
    middle of a sorted list)."""
    from sglang_dspine.source_files import load_file

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(repo, "scripts", "device"))  # its folder, as when run as a script
    adaptive = load_file(os.path.join(repo, "scripts", "device", "adaptive.py"))
    names = ["dspine", "dspine_adaptive", "plain"]
    orders = [adaptive.start_order(names, i) for i in range(3)]
    assert orders[0] == names and all(sorted(o) == sorted(names) for o in orders)
    assert {o[0] for o in orders} == {o[-1] for o in orders} == set(names)

    def rec(tps: dict) -> dict:
        return {"t0": {c: {"tokens_per_s": {"median": v, "min": v, "max": v, "all": [v]}, "tau": 3.0}
                       for c, v in tps.items()}}

    fixed = [{"4": 2900.0, "16": 4500.0}, {"4": 2100.0, "16": 4400.0}, {"4": 2500.0, "16": 6000.0}]
    adapt = [{"4": 2000.0, "16": 4400.0}, {"4": 2800.0, "16": 4300.0}, {"4": 2600.0}]
    starts = {f"start{i}": {"dspine": rec(f), "dspine_adaptive": rec(a)} for i, (f, a) in enumerate(zip(fixed, adapt))}
    summary = merged_summary(tmp_path, {"pair_starts": starts})["pair_starts"]
    mid = lambda v: sorted(v)[len(v) // 2]  # noqa: E731  (odd counts here)
    assert summary["starts"] == 3
    assert summary["tokens_per_s"]["dspine"]["4"] == {"median": 2500.0, "min": 2100.0, "max": 2900.0, "n": 3}
    assert summary["tokens_per_s"]["dspine_adaptive"]["16"] == {"median": 4350.0, "min": 4300.0, "max": 4400.0,
                                                                "n": 2}
    ratios4 = [a["4"] / f["4"] for f, a in zip(fixed, adapt)]
    assert summary["dspine_adaptive_to_dspine"]["4"] == {"median": round(mid(ratios4), 3),
                                                         "min": round(min(ratios4), 3),
                                                         "max": round(max(ratios4), 3), "n": 3}
    assert summary["dspine_adaptive_to_dspine"]["16"]["n"] == 2  # the third start has no adaptive cell at 16

"""benchmarks/train_scale.py --profile on the CPU: the parts of a step found and charged (forward, backward by the
forward region that made each node, checkpoint recomputation), DSpine minus DFlash for every part."""
import importlib
import json
import os
import subprocess
import sys

import torch
from torch.utils.checkpoint import checkpoint

from sglang_dspine.profiling import region

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tp = importlib.import_module("benchmarks.train_profile")


def test_regions_cost_nothing_outside_a_profile():
    assert not torch.autograd._profiler_enabled()
    assert region("a") is region("b")  # the shared no-op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert region("a") is not region("a")


def test_backward_is_charged_to_the_forward_region():
    torch.manual_seed(0)
    big, small = torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
    x = torch.randn(32, 64)

    def chunk(y):
        with region("obj.chunk"):
            return (y.tanh() * 2).sum()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with region("train.forward"):
            with region("obj.big"):
                h = big(x).relu()
            with region("obj.small"):
                y = small(h)
            loss = checkpoint(chunk, y, use_reentrant=False)
        with region("train.backward"):
            loss.backward()
    rows = tp.attribute(prof.events(), on_device=False)["rows"]
    for name in ("train.forward/obj.big", "train.forward/obj.small", "train.forward/obj.chunk",
                 "train.backward/obj.big", "train.backward/obj.small", "train.backward/recompute/obj.chunk",
                 "train.backward/(accumulate_grad)"):
        assert name in rows, (name, sorted(rows))
    assert all(t >= 0 and n >= 0 for t, n in rows.values())
    # the big layer's backward (two matrix products and relu's) has more operators than its forward
    assert rows["train.backward/obj.big"][1] > rows["train.forward/obj.big"][1] >= 1
    assert "train.backward/(unattributed)" not in rows


def test_profile_mode_smoke(tmp_path):
    out = tmp_path / "tp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "train_scale.py"), "--smoke", "--profile",
           "--trace-dir", str(tmp_path / "traces"), "--work", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.load(open(out))
    assert res["commit"] and res["command"] and res["date"] and res["versions"]["torch"]
    a, b = res["per_kind"]["dflash"], res["per_kind"]["dspine"]
    for kind in (a, b):
        assert kind["device"] == "cpu operators" and kind["total_ms"] > 0 and kind["wall_ms_per_step"] > 0
        assert all(v["ms"] >= 0 and v["launches"] >= 0 for v in kind["rows"].values())
        for name in ("train.target", "train.optimizer", "train.forward/drafter.attention", "train.forward/obj.vocab",
                     "train.backward/drafter.mlp", "train.backward/obj.context_kv"):
            assert name in kind["rows"], (name, sorted(kind["rows"]))
        assert os.path.getsize(tmp_path / "traces" / kind["trace"]["file"]) <= tp.TRACE_CAP_BYTES
    # DSpine's own parts: the injection (forward and backward), refinement, alignment, the CE prepass (β > 0)
    assert b["profiled_steps"][0]["beta"] > 0
    for name in ("train.forward/drafter.injection", "train.backward/drafter.injection", "train.forward/obj.refinement",
                 "train.forward/obj.alignment", "train.ce_prepass/drafter.attention"):
        assert name in b["rows"] and name not in a["rows"], name
    diff = res["dspine_minus_dflash"]
    assert set(diff["rows"]) == set(a["rows"]) | set(b["rows"])
    for name, d in diff["rows"].items():
        want = b["rows"].get(name, {"ms": 0.0})["ms"] - a["rows"].get(name, {"ms": 0.0})["ms"]
        assert abs(d["ms"] - want) < 2e-3, name
    assert abs(diff["total_ms"] - (b["total_ms"] - a["total_ms"])) < 1e-2
    # the table comes last, then the file it went to
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("->") and any(l.startswith("train.backward/drafter.injection") for l in lines)
    for kind in (a, b):  # a CPU trace holds no device work: the timeline is empty, the ratio undefined
        assert kind["timeline"]["launches"] == 0 and kind["table_total_over_trace_busy"] is None


MAIN, AUTOGRAD, GPU = 2525, 2623, 0


def _x(cat, name, ts, dur, tid=MAIN, pid=MAIN, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _launch(ts, corr, tid=MAIN, cat="cuda_runtime", name="cudaLaunchKernel"):
    return [_x(cat, name, ts, 2, tid=tid, correlation=corr, cbid=211),
            {"ph": "s", "id": corr, "pid": MAIN, "tid": tid, "ts": ts, "cat": "ac2g", "name": "ac2g"}]


def _device(cat, name, ts, dur, corr, stream=7):
    return _x(cat, name, ts, dur, tid=stream, pid=GPU, correlation=corr, device=0, stream=stream)


def synthetic_trace() -> dict:
    """One profiled step in torch's chrome-trace shapes. The device (µs): k1 10-20 (train.forward/obj.a);
    k2 45-50, launched at 26 inside train.forward but run while the CPU is in train.backward, after 25 idle;
    k3 60-68, the backward of obj.a's mm, launched by the autograd thread via the driver, after 10 idle;
    a memcpy 88-90 after 20 idle and a memset 89-91 on a second stream (train.optimizer). Busy 27, union 26,
    span 81, idle 55, five launches."""
    ev = [{"name": "process_name", "ph": "M", "ts": 0, "pid": MAIN, "tid": 0, "args": {"name": "python3"}},
          _x("user_annotation", "ProfilerStep#3", 0, 100),
          _x("user_annotation", "train.forward", 0, 40),
          _x("user_annotation", "obj.a", 1, 20),
          _x("cpu_op", "aten::mm", 2, 10, **{"Sequence number": 5, "Fwd thread id": 0}),
          *_launch(3, 101),
          _x("cpu_op", "aten::add", 25, 5, **{"Sequence number": 6, "Fwd thread id": 0}),
          *_launch(26, 102),
          _x("user_annotation", "train.backward", 42, 40),
          _x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 50, 10, tid=AUTOGRAD,
             **{"Sequence number": 5, "Fwd thread id": 1}),
          *_launch(52, 103, tid=AUTOGRAD, cat="cuda_driver", name="cuLaunchKernel"),
          _x("user_annotation", "train.optimizer", 84, 10),
          *_launch(86, 104, name="cudaMemcpyAsync"),
          *_launch(87, 105, name="cudaMemsetAsync"),
          _device("kernel", "k1", 10, 10, 101),
          _device("kernel", "k2", 45, 5, 102),
          _device("kernel", "k3", 60, 8, 103),
          _device("gpu_memcpy", "Memcpy DtoH", 88, 2, 104),
          _device("gpu_memset", "Memset (Device)", 89, 2, 105, stream=8),
          _x("gpu_user_annotation", "obj.a", 10, 10, tid=7, pid=GPU)]  # the GPU's copy of a region: not work
    return {"schemaVersion": 1, "traceEvents": ev}


def test_timeline_counts_the_device_and_charges_gaps_to_the_launching_region():
    t = tp.timeline(synthetic_trace(), steps=1)
    assert (t["busy_ms"], t["idle_ms"], t["launches"]) == (0.027, 0.055, 5)
    assert (t["union_ms"], t["span_ms"], t["streams"]) == (0.026, 0.081, 2)
    assert t["rows"] == {
        "train.forward": {"busy_ms": 0.005, "idle_ms": 0.025, "launches": 1},  # run in backward, launched here
        "train.optimizer": {"busy_ms": 0.004, "idle_ms": 0.02, "launches": 2},
        "train.backward/obj.a": {"busy_ms": 0.008, "idle_ms": 0.01, "launches": 1},  # by sequence number
        "train.forward/obj.a": {"busy_ms": 0.01, "idle_ms": 0.0, "launches": 1}}
    assert list(t["rows"]) == ["train.forward", "train.optimizer", "train.backward/obj.a", "train.forward/obj.a"]
    assert t["per_profiler_step"] == {"ProfilerStep#3": {"busy_ms": 0.027, "idle_ms": 0.055, "launches": 5}}
    # per optimizer step: the same window read as two steps halves every figure
    half = tp.timeline(synthetic_trace(), steps=2)
    assert (half["launches"], half["idle_ms"], half["rows"]["train.forward"]["idle_ms"]) == (2.5, 0.028, 0.013)


def test_timeline_cli_reads_plain_and_gzipped_traces(tmp_path, capsys):
    import gzip
    plain, zipped = tmp_path / "train_profile_dflash.json", tmp_path / "train_profile_dspine.json.gz"
    plain.write_text(json.dumps(synthetic_trace()))
    with gzip.open(zipped, "wt") as f:
        json.dump(synthetic_trace(), f)
    out = tmp_path / "tl.json"
    assert tp.main(["timeline", str(plain), str(zipped), "--steps", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dflash: per step (mean of 1) GPU busy 0.0 ms, idle 0.1 ms, 5 launches (2 stream(s))" in printed
    assert "train.forward " in printed and "dspine:" in printed
    res = json.load(open(out))
    assert set(res["per_kind"]) == {"dflash", "dspine"} and res["per_kind"]["dspine"]["idle_ms"] == 0.055
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "train_profile.py"), "timeline", "--help"],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert proc.returncode == 0 and "--steps" in proc.stdout and "--out" in proc.stdout


def test_table_puts_the_device_truth_first_and_flags_an_over_count():
    t = tp.timeline(synthetic_trace(), steps=1)
    kind = {"device": "gpu kernels", "total_ms": 0.054, "total_launches": 9, "tops": {}, "rows": {},
            "_kernels_all": {}, "timeline": t, "table_total_over_trace_busy": 2.0}
    per_kind = {"dflash": kind, "dspine": {**kind, "table_total_over_trace_busy": 1.0}}
    lines = tp.table(per_kind, tp.difference(kind, per_kind["dspine"])).splitlines()
    assert lines[1].startswith("-- the device truth") and lines[2].startswith("GPU busy")
    assert lines.index("-- the attribution table (profiler events; rows within a kind)") < \
        next(i for i, l in enumerate(lines) if l.startswith("TOTAL"))
    assert "disagrees with the trace's busy time: DFlash x2.00)" in "\n".join(lines)

"""benchmarks/step_timeline.py on a hand-built trace whose account is worked out below by hand: graph and eager
kernels, the GPU's idle gaps charged to the Python frames that launched the kernel after them, host runtime calls,
and one trace minus another."""
import gzip
import importlib
import json

st = importlib.import_module("benchmarks.step_timeline")


def _trace(extra_eager: bool) -> dict:
    """Two steps. Each: the host's `worker.py(10): step` frame runs 0..1000 µs (+ step start) and launches a CUDA
    graph at +100 whose two kernels run +200..+500 and +500..+700; with `extra_eager`, `dflash_step.py(5): commit`
    runs inside it +750..+900 and launches one eager kernel at +800 that runs +900..+950 (idle gap 200 µs before it,
    charged to commit's frames); then a cudaStreamSynchronize of 30 µs at +960."""
    ev = []
    corr = 0
    for step in range(2):
        t0 = 2000 * step
        ev.append({"ph": "X", "cat": "python_function", "name": "/x/sglang_dspine/serving/worker.py(10): step",
                   "ts": t0, "dur": 1000, "tid": 1})
        ev.append({"ph": "X", "cat": "python_function", "name": "/x/torch/foo.py(3): helper",  # not ours: skipped
                   "ts": t0 + 50, "dur": 100, "tid": 1})
        corr += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t0 + 100, "dur": 10,
                   "tid": 1, "args": {"correlation": corr}})
        ev += [{"ph": "X", "cat": "kernel", "name": name, "ts": t0 + s, "dur": d, "tid": 7,
                "args": {"correlation": corr}} for name, s, d in (("gemm", 200, 300), ("attn", 500, 200))]
        if extra_eager:
            ev.append({"ph": "X", "cat": "python_function", "name": "/x/sglang_dspine/serving/dflash_step.py(5): commit",
                       "ts": t0 + 750, "dur": 150, "tid": 1})
            corr += 1
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t0 + 800, "dur": 5,
                       "tid": 1, "args": {"correlation": corr}})
            ev.append({"ph": "X", "cat": "kernel", "name": "kv_write_0x7f12", "ts": t0 + 900, "dur": 50, "tid": 7,
                       "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": t0 + 960, "dur": 30,
                   "tid": 1})
    return {"traceEvents": ev}


def test_a_steps_account(tmp_path):
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(True), f)
    r = st.timeline(str(path), steps=2, gap_us=20)
    # span: 200 .. 2950 = 2750 µs over 2 steps; busy 300 + 200 + 50 a step; idle = span - busy
    assert r["span_us"] == 1375.0 and r["busy_us"] == 550.0 and r["idle_us"] == 825.0
    assert r["graph_kernels"] == 2.0 and r["eager_kernels"] == 1.0
    assert r["eager_us"] == {"kv_write_#": {"us": 50.0, "count": 1.0}}
    # gaps: 200 µs before each kv_write (commit's frames), 1250 µs before the second step's gemm (launched in step)
    assert r["idle_by_caller_us"] == {"worker.py:step": {"us": 625.0, "gaps": 0.5},
                                      "worker.py:step > dflash_step.py:commit": {"us": 200.0, "gaps": 1.0}}
    assert r["idle_gaps_over_threshold"] == {"gap_us": 20, "count_per_step": 1.5, "median_us": 200.0,
                                             "max_us": 1250.0}
    assert r["runtime_us"]["cudaStreamSynchronize"] == {"us": 30.0, "count": 1.0}
    assert r["runtime_us"]["cudaGraphLaunch"] == {"us": 10.0, "count": 1.0}
    # host time: sglang / sglang_dspine frames only (torch's helper is not one)
    assert r["host_us_by_frame"] == {"worker.py:step": {"us": 1000.0, "calls": 1.0},
                                     "dflash_step.py:commit": {"us": 150.0, "calls": 1.0}}


def test_one_trace_minus_another():
    a, b = st.timeline(_trace(False), steps=2), st.timeline(_trace(True), steps=2)
    d = st.difference(a, b)
    assert a["eager_kernels"] == 0 and a["busy_us"] == 500.0
    assert d["busy_us"] == 50.0 and d["eager_kernels"] == 1.0
    assert d["eager_us"] == {"kv_write_#": 50.0}
    assert d["idle_by_caller_us"]["worker.py:step > dflash_step.py:commit"] == 200.0
    assert d["host_us_by_frame"] == {"dflash_step.py:commit": 150.0, "worker.py:step": 0.0}

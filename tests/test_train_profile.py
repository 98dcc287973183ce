"""benchmarks/train_scale.py --profile on the CPU: the parts of a step found and charged (forward, backward by the
forward region that made each node, checkpoint recomputation), DSpine minus DFlash for every part."""
import json
import os
import subprocess
import sys

import torch
from torch.utils.checkpoint import checkpoint

from sglang_dspine.profiling import region
from sglang_dspine.source_files import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tp = load_file(os.path.join(ROOT, "benchmarks", "train_profile.py"))


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

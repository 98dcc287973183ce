"""benchmarks/kernels.py --smoke on CPU (TRITON_INTERPRET): it runs the server's draft step, its tokens equal the
plain drafter's, and its summary and serving comparison are complete."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "kernels.py")


def run(*args, cwd):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=cwd, timeout=900)


def test_kernel_benchmark_smoke(tmp_path):
    out = tmp_path / "res"
    r = run("--smoke", "--bs", "2", "--out", str(out), cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.load(open(out / "kernels.json"))
    summary = json.load(open(out / "kernels_summary.json"))
    assert res["errors"] == [] and res["batch_sizes"] == [2]
    check = res["draft_check"]
    assert check["ok"] and check["exact"] and set(check["token_agreement"]) == {"dspine", "dspine_torch", "dflash"}
    step = res["draft_step"]["2"]
    for name in ("dflash", "dspine", "dspine_torch", "dspine_injection_only", "dspine_tree_15", "dspine_tree_63"):
        assert step[name] > 0, name
    assert check["tree_agreement"] == 1.0  # the timed tree variant builds tree.lattice_tree's trees
    assert set(summary["draft_tree_over_dflash_step"]["2"]) == {"15", "31", "63"}
    assert summary["draft_step_overhead_us"]["2"] == round(step["dspine"] - step["dflash"], 1)
    assert summary["commit"] and summary["versions"]["torch"] and summary["date"] and summary["command"]
    sections = {r["section"] for r in res["results"]}
    assert sections == {"injection", "inj_layer", "transition", "topk"}
    variants = {r["variant"] for r in res["results"]}
    assert {"gate_message triton", "gate_message torch", "injection_delta triton", "AdjacentInjection.forward",
            "score_walk torch", "transition_walk triton (as served)", "topk triton", "torch.topk"} <= variants

    # the serving comparison, on a server whose DSPINE step is DFLASH's plus 1 ms
    serving = {"clients": [2], "temperatures": [0.0], "rounds": [{
        "dflash": [{"clients": 2, "temperature": 0.0, "step_ms": 10.0}],
        "dspine": [{"clients": 2, "temperature": 0.0, "step_ms": 11.0}]}],
        "profile": {"c2": {"dflash": {"gpu_us_per_step": 9000.0}, "dspine": {"gpu_us_per_step": 9900.0}}}}
    (tmp_path / "serving_scale.json").write_text(json.dumps(serving))
    r = run("--compare-serving", str(tmp_path / "serving_scale.json"), "--summary", str(out / "kernels_summary.json"),
            cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    row = [l.split() for l in r.stdout.splitlines() if l.strip().startswith("2 ")]
    assert len(row) == 1 and row[0][5] == "1000" and row[0][8] == "900", r.stdout  # server overheads, µs

    r = run("--compare-serving", str(out / "kernels.json"), "--summary", str(out / "kernels_summary.json"),
            cwd=str(tmp_path))
    assert r.returncode != 0 and "not a serving_scale.json" in r.stderr

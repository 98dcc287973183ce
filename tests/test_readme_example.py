"""The README's worked example (data -> train -> export -> eval on models/default), its exact commands run at
toy size: the same flags, then fewer prompts, tokens and steps appended (a later flag wins)."""
import json
import os
import re
import shlex

import torch

from sglang_dspine.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = {"data": ["--limit", "2", "--max-new-tokens", "24", "--no-progress"],
       "train": ["--max-steps", "2", "--num-anchors", "8", "--no-progress"],
       "export": [],
       "eval": ["--limit", "1", "--max-new-tokens", "16"]}


def readme_commands() -> list[list[str]]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = re.search(r"<!-- worked-example -->\s*```bash\n(.*?)```\s*<!-- /worked-example -->", text, re.S)
    assert block, "README.md: no worked-example block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def test_readme_worked_example_at_toy_size(tmp_path, monkeypatch, capsys):
    cmds = readme_commands()
    assert [c[:2] for c in cmds] == [["sglang-dspine", s] for s in ("data", "train", "export", "eval")]
    monkeypatch.chdir(ROOT)  # the README's commands run from the repository root
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for cmd in cmds:
            args = [a.replace("demo/", f"{tmp_path}/demo/") for a in cmd[1:]] + TOY[cmd[1]]
            assert cli_main(args) == 0, " ".join(args)
    finally:
        torch.set_num_threads(n)
    out = capsys.readouterr().out
    result = json.loads(out[out.rindex("\n{\n") + 1:])  # eval prints its JSON last
    assert result["prompts"] == 1 and result["tau"] >= 1.0 and result["kind"] == "dspine"
    used = json.load(open(tmp_path / "demo" / "run" / "train_config.json"))["drafter"]
    assert used["target_layer_ids"] == [1, 2] and used["mask_token_id"] == 3
    assert os.path.isfile(tmp_path / "demo" / "drafter" / "model.safetensors")

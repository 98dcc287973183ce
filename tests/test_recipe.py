"""Training recipes (`sglang-dspine train --recipe`): what each sets, what the exported config records, and the
offline verify step they are measured with."""
import json

import pytest
import torch

from sglang_dspine.drafter.checkpoint import load_drafter, save_drafter
from sglang_dspine.drafter.config import DSpineSettings
from sglang_dspine.training.drafter_setup import RECIPE_KEY, build_drafter, recipe_line
from sglang_dspine.training.generate import verify
from sglang_dspine.training.teacher import TargetTeacher
from sglang_dspine.training.train_config import DEFAULT_RECIPE, RECIPES, TrainConfig
from sglang_dspine.training.trainer import train

SMALL = dict(transfer_rank=16, message_size=8, top_k=4)


def _build(target, **kw):
    tc = TrainConfig(num_draft_layers=2, block_size=4, target_layer_ids=[1, 2], **kw)
    tc.validate()
    return build_drafter(tc, TargetTeacher(target))[0]


def test_recipes_set_the_backbone_weight_and_flags_win(target):
    assert DEFAULT_RECIPE == "ce_anneal" and RECIPES["specforge"] == {}
    default = _build(target, dspine=dict(SMALL))
    assert default.cfg.dspine.ce_weight == 1.0  # the default recipe: CE, the alignment faded out
    assert default.cfg.raw[RECIPE_KEY] == {"name": "ce_anneal", "overrides": SMALL, "alignment_decay": "cosine"}
    d = _build(target, recipe="ce", dspine=dict(SMALL))
    assert d.cfg.raw[RECIPE_KEY] == {"name": "ce", "overrides": SMALL, "alignment_decay": "none"}
    sf = _build(target, recipe="specforge", dspine=dict(SMALL))
    ref = DSpineSettings()
    assert sf.cfg.dspine.ce_weight == ref.ce_weight == 0.1  # SpecForge's reference value, untouched
    assert (sf.cfg.dspine.alignment_weight, sf.cfg.dspine.alignment_warmup_steps) == (0.5, 146)
    assert sf.cfg.raw[RECIPE_KEY]["name"] == "specforge"
    # a given flag wins over the recipe, and is recorded as an override
    mixed = _build(target, recipe="ce", dspine=dict(SMALL, ce_weight=0.4))
    assert mixed.cfg.dspine.ce_weight == 0.4 and mixed.cfg.raw[RECIPE_KEY]["overrides"]["ce_weight"] == 0.4
    assert "recipe ce" in recipe_line(mixed.cfg) and "ce_weight 0.4" in recipe_line(mixed.cfg)
    # a DFlash drafter has no recipe record (its objective is --dflash-ce-weight)
    assert RECIPE_KEY not in _build(target, kind="dflash").cfg.raw
    # ce_anneal: ce's settings, the alignment faded out (recorded, printed); --alignment-decay wins over it
    an = _build(target, recipe="ce_anneal", dspine=dict(SMALL))
    assert an.cfg.dspine == d.cfg.dspine and an.cfg.raw[RECIPE_KEY]["alignment_decay"] == "cosine"
    assert "faded out by a cosine" in recipe_line(an.cfg) and "faded" not in recipe_line(d.cfg)
    assert _build(target, recipe="ce_anneal", alignment_decay="none").cfg.raw[RECIPE_KEY]["alignment_decay"] == "none"
    assert _build(target, recipe="ce", alignment_decay="cosine").cfg.raw[RECIPE_KEY]["alignment_decay"] == "cosine"
    assert _build(target, alignment_decay="none").cfg.raw[RECIPE_KEY]["alignment_decay"] == "none"
    with pytest.raises(ValueError, match="--recipe bogus: expected 'ce' or 'ce_anneal' or 'specforge'"):
        TrainConfig(recipe="bogus").validate()
    with pytest.raises(ValueError, match="--alignment-decay linear: expected 'none' or 'cosine'"):
        TrainConfig(alignment_decay="linear").validate()
    with pytest.raises(ValueError, match="--alignment-decay: a DFlash drafter has no alignment term"):
        TrainConfig(kind="dflash", alignment_decay="cosine").validate()


def test_recipe_record_survives_save_and_init(target, tmp_path):
    """The record goes through save/load (so through export); a DSpine --init keeps its recipe unless another
    is given; a DFlash --init becomes a DSpine on the recipe asked for."""
    sf = _build(target, recipe="specforge", dspine=dict(SMALL))
    save_drafter(sf, str(tmp_path / "sf"))
    assert json.load(open(tmp_path / "sf" / "config.json"))[RECIPE_KEY]["name"] == "specforge"
    assert load_drafter(str(tmp_path / "sf")).cfg.raw[RECIPE_KEY]["name"] == "specforge"
    kept = _build(target, init=str(tmp_path / "sf"))
    assert kept.cfg.dspine.ce_weight == 0.1 and kept.cfg.raw[RECIPE_KEY]["name"] == "specforge"
    flagged = _build(target, init=str(tmp_path / "sf"), dspine={"alignment_weight": 0.25})
    assert flagged.cfg.dspine.ce_weight == 0.1 and flagged.cfg.raw[RECIPE_KEY] == {
        "name": "specforge", "overrides": {**SMALL, "alignment_weight": 0.25}, "alignment_decay": "none"}
    switched = _build(target, init=str(tmp_path / "sf"), recipe="ce")
    assert switched.cfg.dspine.ce_weight == 1.0 and switched.cfg.raw[RECIPE_KEY] == {
        "name": "ce", "overrides": {}, "alignment_decay": "none"}
    # an annealed drafter trained on keeps its schedule, unless --alignment-decay says otherwise
    save_drafter(_build(target, recipe="ce_anneal", dspine=dict(SMALL)), str(tmp_path / "an"))
    assert _build(target, init=str(tmp_path / "an")).cfg.raw[RECIPE_KEY]["alignment_decay"] == "cosine"
    assert _build(target, init=str(tmp_path / "an"), alignment_decay="none").cfg.raw[RECIPE_KEY][
        "alignment_decay"] == "none"
    save_drafter(_build(target, kind="dflash"), str(tmp_path / "df"))
    warm = _build(target, kind="dspine", init=str(tmp_path / "df"), dspine=dict(SMALL))
    assert warm.cfg.dspine.ce_weight == 1.0 and warm.cfg.raw[RECIPE_KEY]["name"] == "ce_anneal"


def test_training_runs_the_recipe_objective(target, tmp_path):
    """The recipe reaches the loss: SpecForge's trains the L1 term, ce does not; the trainer prints the recipe and
    the run's final drafter carries the record."""
    g = torch.Generator().manual_seed(3)
    data = tmp_path / "d.jsonl"
    with open(data, "w") as f:
        for _ in range(4):
            ids = torch.randint(0, 62, (20,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 6 + [1] * 14}) + "\n")
    base = dict(data=str(data), num_draft_layers=2, block_size=4, num_anchors=4, target_layer_ids=[1, 2],
                batch_size=2, max_steps=2, log_every=1, progress=False, tensorboard=False, dspine=dict(SMALL))
    last = {}
    for recipe in ("ce", "ce_anneal", "specforge"):
        out = tmp_path / recipe
        train(TrainConfig(output_dir=str(out), recipe=recipe, **base), target=target)
        last[recipe] = [json.loads(x) for x in open(out / "metrics.jsonl") if x.strip()][-1]
        assert load_drafter(str(out / "final")).cfg.raw[RECIPE_KEY]["name"] == recipe
    assert "l1" in last["specforge"] and "l1" not in last["ce"]
    # ce_anneal's β at the last of 2 steps: ce's times the cosine at half the run, ½(1 + cos(π/2)) = ½
    assert last["ce"]["beta"] > 0 and last["ce_anneal"]["beta"] == pytest.approx(last["ce"]["beta"] / 2)


def _verify_one_position_at_a_time(logits, draft, temperature, generator):
    """The verify rule written position by position (the reference the batched host copy must equal)."""
    for i, d in enumerate(draft):
        row = logits[i]
        if temperature == 0:
            t = int(row.argmax())
            if t != d:
                return i, t
            continue
        p = torch.softmax(row.float() / temperature, dim=-1)
        if torch.rand((), generator=generator) < p[d]:
            continue
        residual = p.clone()
        residual[d] = 0
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    last = logits[len(draft)]
    if temperature == 0:
        return len(draft), int(last.argmax())
    p = torch.softmax(last.float() / temperature, dim=-1)
    return len(draft), int(torch.multinomial(p, 1, generator=generator))


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0, 1.3])
def test_verify_equals_the_position_by_position_rule(temperature):
    """Same draws from the same generator: verify's one host copy decides exactly as reading row by row."""
    g = torch.Generator().manual_seed(11)
    for case in range(200):
        logits = torch.randn(6, 9, generator=g) * 2
        draft = [int(x) for x in torch.randint(0, 9, (int(case % 6),), generator=g)]
        if case % 3 == 0:  # drafts the target likes: long acceptances too
            draft = [int(x) for x in logits[: len(draft)].argmax(-1)]
        seed = 1000 + case
        got = verify(logits, draft, temperature, torch.Generator().manual_seed(seed))
        want = _verify_one_position_at_a_time(logits, draft, temperature, torch.Generator().manual_seed(seed))
        assert got == want, (case, draft)

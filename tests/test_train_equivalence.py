"""The trainer's step against the former math, float32 on the CPU: the same loss and the same gradients.

The former step ran a no-grad CE pass over every micro-batch before the graded passes (the alignment term is
scaled by the mean CE of the whole step), read the teacher for the refinement whatever its L1 weight, and
selected the live blocks even when all were live. Now the first micro-batch's CE comes from its graded
pass, the teacher is read only where an L1 half has weight (ce_weight < 1), and an all-live selection is
skipped; the refinement's CE and L1 halves were mixed inside the objective, and the numerator assembled apart
from the step CE, where LossAssembly now does both. The former step is rebuilt here from the trainer's own
micro-batches, its numerator written out as it was (former_numerator)."""
import json
import random

import pytest
import torch
from conftest import randomize_injection

from sglang_dspine.training import objective as objective_mod
from sglang_dspine.training.objective import DrafterObjective
from sglang_dspine.training.schedules import alignment_beta, replacement_probability
from sglang_dspine.training.train_config import TrainConfig
from sglang_dspine.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


computed_now = DrafterObjective.computed_terms


def former_computed_terms(self, ce_only):
    """The refinement's L1 half (and so the teacher) whatever its weight."""
    want = computed_now(self, ce_only)
    return want | {"refinement_l1"} if "refinement_ce" in want else want


def former_select_rows(tensors, rows):
    return [t.index_select(0, rows) for t in tensors]


def former_numerator(terms, cw, switches, beta, mean_ce):
    """The loss numerator of one micro-batch as it was assembled before LossAssembly (DSpine): the backbone's
    CE and L1 mixed by cw, the refinement's CE and L1 halves mixed the same way, β · mean CE · alignment."""
    zero = terms["ce"] * 0.0
    num = zero
    if switches.backbone:
        num = num + cw * terms["ce"]
        if cw < 1:
            num = num + (1 - cw) * terms.get("l1", zero)
    if switches.refinement:
        num = num + (cw * terms["refinement_ce"] + (1 - cw) * terms.get("refinement_l1", zero))
    if switches.alignment and beta > 0:
        num = num + beta * mean_ce * terms.get("alignment", zero)
    return num


def former_gradients(tr: Trainer, step: int):
    """The former `_train_step` up to the optimizer: a CE prepass over every micro-batch, then the graded ones."""
    s = tr.cfg.dspine
    beta = alignment_beta(step, s)
    p_rep = replacement_probability(step, tr.total_steps, s)
    micro, _ = tr._micro_batches(step, p_rep)
    denom = torch.stack([b.denominator for *_, b in micro]).sum().detach().clone()
    scale = 1 / denom.clamp_min(1.0)
    with torch.no_grad():
        ce_sum = sum(tr.objective(f, h, b, ce_only=True)["ce"] for f, h, b in micro)
    mean_ce = ce_sum.detach().float().clone() / denom.clamp_min(1.0)
    loss_num = 0.0
    for f, h, b in micro:
        terms = tr.objective(f, h, b)
        num = former_numerator(terms, tr.objective.ce_weight, tr.switches, beta, mean_ce)
        (num * scale).backward()
        loss_num = loss_num + num.detach().float()
    return beta, p_rep, loss_num


def write_data(path, n, vocab, seed, short_every=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            length = 14 if short_every and i % short_every == 0 else 40
            f.write(json.dumps({"input_ids": [rng.randrange(vocab - 2) for _ in range(length)],
                                "loss_mask": [0] * 8 + [1] * (length - 8)}) + "\n")


@pytest.mark.parametrize("recipe,accum,anchors,backbone", [("ce", 2, 6, True), ("specforge", 3, 6, True),
                                                           ("ce", 2, 40, True), ("specforge", 2, 6, False)])
def test_step_equals_the_former_math(target, tmp_path, monkeypatch, recipe, accum, anchors, backbone):
    """anchors 40 > valid anchors: padding blocks, so the live selection runs; 6: every block live. Without the
    backbone term the refinement's L1 half alone reads the teacher (specforge)."""
    data = tmp_path / "d.jsonl"
    write_data(data, 4 * accum, int(target.config.vocab_size), seed=accum, short_every=3)
    tc = TrainConfig(data=str(data), output_dir=str(tmp_path / "run"), num_draft_layers=2, block_size=4,
                     num_anchors=anchors, target_layer_ids=[1, 2], batch_size=2, grad_accum=accum, max_steps=6,
                     recipe=recipe, backbone_loss=backbone, progress=False, save=False, tensorboard=False,
                     dspine=dict(transfer_rank=16, message_size=8, top_k=4, alignment_warmup_steps=1))
    tr = Trainer(tc, target=target)
    randomize_injection(tr.drafter, seed=3)  # the injection and the replacement then change the states
    step = 1  # β > 0 and replacement p > 0 at step 1 of 6
    grads = {}
    for which in ("now", "former"):
        tr.opt.zero_grad(set_to_none=True)
        with monkeypatch.context() as m, torch.enable_grad():
            if which == "former":
                m.setattr(DrafterObjective, "computed_terms", former_computed_terms)
                m.setattr(objective_mod, "select_rows", former_select_rows)
                beta, p_rep, loss = former_gradients(tr, step)
            else:
                acc = {}
                beta, p_rep, _ = tr._gradients(step, acc)
                loss = acc["loss_num"]
        grads[which] = ({n: p.grad.clone() for n, p in tr.drafter.named_parameters() if p.grad is not None}, loss)
    assert beta > 0 and p_rep > 0
    (g_now, loss_now), (g_old, loss_old) = grads["now"], grads["former"]
    assert torch.allclose(loss_now, loss_old, rtol=1e-6, atol=0), (float(loss_now), float(loss_old))
    assert set(g_now) == set(g_old) and any(k.startswith("injection.") for k in g_now)
    # the skipped selection changes the order autograd sums a state's gradients in: rounding, at ~1e-7
    for k in g_old:
        tol = 1e-5 * float(g_old[k].abs().max())
        assert torch.allclose(g_now[k], g_old[k], rtol=1e-5, atol=tol), (k, (g_now[k] - g_old[k]).abs().max(), tol)

"""The objective's vocabulary-sized terms (sglang_dspine.kernels.vocab_objective, objective.vocab_terms).

- the Triton kernel (Triton's interpreter without a GPU) against its PyTorch math: forward values, argmax and
  gradients, with ties and labels at tile boundaries, a vocabulary that is no multiple of the tile, rows where
  the drafter equals the teacher (sign(0)), float32 and bf16;
- that PyTorch math against autograd through the formulas the objective used to write out (log_softmax,
  softmax, |p - t|) in float64;
- the objective's terms and gradients on a tiny drafter: kernel path = PyTorch path, and `vocab_terms` = the
  former float32 formulation (kept in benchmarks/vocab_loss.py), both kernel and PyTorch;
- benchmarks/vocab_loss.py at a tiny size; on a GPU (marked `gpu`) the kernel at Qwen3-8B's shape.
"""
import copy
import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import randomize_injection  # noqa: E402

from sglang_dspine.drafter.tiny import tiny_drafter  # noqa: E402
from sglang_dspine.kernels import vocab_objective as kvl  # noqa: E402
from sglang_dspine.training.blocks import make_blocks, sample_anchors  # noqa: E402
from sglang_dspine.training.objective import DrafterObjective, ObjectiveSwitches  # noqa: E402
from sglang_dspine.training.teacher import TargetTeacher  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter converts its one-element arrays with a NumPy deprecation warning, thousands of times
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(kvl._fwd_kernel, InterpretedFunction)


if DEVICE == "cpu" and not _interpreted():  # imported before TRITON_INTERPRET was set: decorate again
    importlib.reload(kvl)


def test_interpreter_is_used_on_cpu():
    if DEVICE == "cpu":
        assert _interpreted() and isinstance(kvl._bwd_kernel, type(kvl._fwd_kernel))
    else:
        assert not _interpreted()


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


V, BLOCK = 203, 64  # tiles [0,64) [64,128) [128,192) [192,203): the last one partial


def boundary_rows(dtype):
    """Rows (z, y, labels) with the cases a tile-streaming pass can get wrong."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(8, V, generator=g) * 3
    y = torch.randn(8, V, generator=g) * 3
    z[0, 63] = z[0, 64] = 20.0           # a tie across the first tile boundary: torch.argmax takes 63
    z[1, [64, 128, 130]] = 20.0          # ties in two later tiles: 64
    z[2, V - 1] = 20.0                   # the maximum in the partial last tile
    z[3, [5, 200]] = 20.0                # a tie between the first and the partial last tile: 5
    y[4] = z[4]                          # the teacher equals the drafter: p = t everywhere, sign 0
    z[5] *= 30                           # a peaked row (exp underflows for most of the vocabulary)
    y[6] *= 30
    labels = torch.tensor([63, 64, V - 1, 0, 128, 5, 191, 192])
    return z.to(dtype).to(DEVICE), y.to(dtype).to(DEVICE), labels.to(DEVICE)


def run(kernel, z, labels, y, l1=True, w=(1.0, 1.0), block_v=BLOCK):
    """Outputs and dz of loss = Σ w_ce·ce + Σ w_l1·l1 with per-row weights."""
    zz = z.detach().clone().requires_grad_()
    ce, l1v, lse_y, amax = kvl.vocab_loss(zz, labels, y, l1=l1, kernel=kernel, block_v=block_v)
    n = z.shape[0]
    wce = torch.linspace(0.2, 1.0, n, device=z.device) * w[0]
    loss = (ce * wce).sum() if w[0] else 0.0
    if l1v is not None and w[1]:
        loss = loss + (l1v * torch.linspace(1.0, 0.3, n, device=z.device) * w[1]).sum()
    loss.backward()
    return ce, l1v, lse_y, amax, zz.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["ce", "ce+l1", "lse_y only", "l1 only"])
def test_kernel_matches_pytorch_math(dtype, mode):
    z, y, labels = boundary_rows(dtype)
    yy = None if mode == "ce" else y
    l1 = mode in ("ce+l1", "l1 only")
    w = (0.0, 1.0) if mode == "l1 only" else (1.0, 1.0)  # "l1 only": the CE's gradient arrives as None
    got = run(True, z, labels, yy, l1, w)
    ref = run(False, z, labels, yy, l1, w)
    assert got[3].tolist() == ref[3].tolist() == z.float().argmax(-1).tolist()
    assert got[3][:4].tolist() == [63, 64, V - 1, 5]
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    for i in (1, 2):
        assert (got[i] is None) == (ref[i] is None) == {1: not l1, 2: yy is None}[i]
        if got[i] is not None:
            torch.testing.assert_close(got[i], ref[i], rtol=1e-5, atol=1e-5)
    dz, dz_ref = got[4], ref[4]
    assert dz.dtype == dtype
    # float32 sums in another order; where most of p sits on tokens with s = 1 (row 1's three-way tie),
    # S ≈ 1 and p·(s - S) keeps only float32's relative 1e-7 of S: that row's L1 gradient agrees to ~2%
    # of its own (tiny) size, the whole tensor to ~1e-5. Without the CE's gradient the whole tensor is L1
    # gradient and that row weighs in: 2.2e-4 measured on an H200 (a dropped S term gives O(1)).
    f32_bound = 1e-3 if mode == "l1 only" else 5e-5
    assert rel_err(dz, dz_ref) < (f32_bound if dtype == torch.float32 else 1e-2)
    if dtype == torch.bfloat16:  # each element: the same float32 value up to noise, rounded: at most one ulp apart
        torch.testing.assert_close(dz.float(), dz_ref.float(), rtol=2 ** -7, atol=1e-3 * float(dz_ref.abs().max()))
    if mode == "ce+l1":
        assert float(got[1][4].detach()) == 0.0  # teacher = drafter
        # with p = t, sign 0: row 4's gradient is the CE's alone, weight 0.2 + 4·0.8/7
        p = torch.softmax(z[4].double(), -1)
        want = (0.2 + 4 * 0.8 / 7) * (p - torch.nn.functional.one_hot(labels[4], V).double())
        assert rel_err(dz[4], want) < (1e-5 if dtype == torch.float32 else 4e-3)
        assert float(got[1][5].detach()) > 0.5  # the peaked row is far from its teacher: the L1 really is computed


@pytest.mark.parametrize("block_v", [16, 128, None])
def test_kernel_tile_sizes_agree(block_v):
    z, y, labels = boundary_rows(torch.float32)
    ref = run(False, z, labels, y)
    got = run(True, z, labels, y, block_v=block_v)
    assert got[3].tolist() == ref[3].tolist()
    for a, b in zip(got[:3] + got[4:], ref[:3] + ref[4:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def former_formulas(z, labels, y, wce, wl1):
    """What the objective wrote out before, through autograd (float64)."""
    zz = z.double().detach().requires_grad_()
    logp = zz.log_softmax(-1)
    ce = -logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    t = y.double().softmax(-1)
    l1 = (logp.exp() - t).abs().sum(-1)
    ((ce * wce).sum() + (l1 * wl1).sum()).backward()
    return ce, l1, zz.grad


def test_pytorch_math_matches_autograd_of_the_former_formulas():
    g = torch.Generator().manual_seed(1)
    n, v = 9, 500
    z = torch.randn(n, v, generator=g) * 2
    y = torch.randn(n, v, generator=g) * 2
    labels = torch.randint(0, v, (n,), generator=g)
    wce, wl1 = torch.rand(n, generator=g), torch.rand(n, generator=g)
    ce_ref, l1_ref, dz_ref = former_formulas(z, labels, y, wce.double(), wl1.double())
    zz = z.clone().requires_grad_()
    ce, l1, lse_y, amax = kvl.vocab_loss_torch(zz, labels, y)
    ((ce * wce).sum() + (l1 * wl1).sum()).backward()
    torch.testing.assert_close(ce.double(), ce_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(l1.double(), l1_ref, rtol=1e-5, atol=1e-5)
    assert rel_err(zz.grad, dz_ref) < 1e-5
    torch.testing.assert_close(lse_y, y.logsumexp(-1))
    assert amax.tolist() == z.argmax(-1).tolist()
    # the L1 alone, and the CE alone
    _, _, dz_l1 = former_formulas(z, labels, y, torch.zeros(n).double(), wl1.double())
    zz = z.clone().requires_grad_()
    (kvl.vocab_loss_torch(zz, labels, y)[1] * wl1).sum().backward()
    assert rel_err(zz.grad, dz_l1) < 1e-5
    zz = z.clone().requires_grad_()
    ce, l1, lse_y, _ = kvl.vocab_loss_torch(zz, labels)
    assert l1 is None and lse_y is None
    (ce * wce).sum().backward()
    assert rel_err(zz.grad, dz_ref - dz_l1) < 1e-5


def test_bad_inputs_are_refused():
    z = torch.zeros(3, 10, device=DEVICE)
    with pytest.raises(ValueError, match="labels must be int64"):
        kvl.vocab_loss(z, torch.zeros(3, dtype=torch.int32, device=DEVICE), kernel=False)
    with pytest.raises(ValueError, match="y must be"):
        kvl.vocab_loss(z, torch.zeros(3, dtype=torch.long, device=DEVICE), torch.zeros(3, 11, device=DEVICE),
                       kernel=False)
    with pytest.raises(ValueError, match="z must be"):
        kvl.vocab_loss(z[None], torch.zeros(3, dtype=torch.long, device=DEVICE), kernel=False)
    with pytest.raises(ValueError, match="power of two"):
        kvl.launch_settings(1000, 100)


# ------------------------------------------------------------------------------------------- the objective
def _setup(target, kind, ce_weight):
    d = tiny_drafter(target, kind, seed=1).train()
    if kind == "dspine":
        randomize_injection(d, 1)
        d.cfg.dspine.ce_weight, d.cfg.dspine.replacement_layers = ce_weight, 1
        d.cfg.dspine.candidate_mass_threshold = 0.2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 62, (2, 22), generator=g)
    mask = torch.zeros(2, 22)
    mask[0, 6:] = 1
    mask[1, 4:15] = 1
    anchors, keep = sample_anchors(mask, 6, torch.Generator().manual_seed(0))
    blocks = make_blocks(ids, mask, anchors, keep, 4, d.cfg.mask_token_id, 2.5)
    tensors = {f.name: getattr(blocks, f.name) for f in dataclasses.fields(blocks)}
    blocks = dataclasses.replace(blocks, **{k: v.to(DEVICE) for k, v in tensors.items() if isinstance(v, torch.Tensor)})
    return d.to(DEVICE), ids.to(DEVICE), blocks


def _terms_and_grads(target, d, ids, blocks, kernel, ce_weight):
    if DEVICE != "cpu":  # the session's target stays on the CPU for the other modules
        target = copy.deepcopy(target).to(DEVICE)
    obj = DrafterObjective(d, TargetTeacher(target), ObjectiveSwitches(), dflash_ce_weight=ce_weight, coverage_k=4,
                           chunk_blocks=3, vocab_kernel=kernel)
    feats, last = obj.teacher.run(ids, d.cfg.target_layer_ids)
    d.zero_grad()
    with torch.enable_grad():
        terms = obj(feats, last, blocks)
        loss = obj.assembly(beta=0.5).numerator(terms, step_ce=1.3) / terms["denominator"]
        loss.backward()
    grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    return {k: v.detach().clone() for k, v in terms.items()}, grads


@pytest.mark.parametrize("kind,ce_weight", [("dspine", 0.3), ("dflash", 0.4), ("dflash", 1.0)])
def test_objective_kernel_path_equals_pytorch_path(target, kind, ce_weight):
    d, ids, blocks = _setup(target, kind, ce_weight)
    got, g_got = _terms_and_grads(target, d, ids, blocks, True, ce_weight)
    ref, g_ref = _terms_and_grads(target, d, ids, blocks, False, ce_weight)
    assert got.keys() == ref.keys()
    assert ("l1" in got) == (ce_weight < 1) and ("refinement_ce" in got) == (kind == "dspine")
    assert ("refinement_l1" in got) == (kind == "dspine" and ce_weight < 1)
    for k in got:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
    assert float(got["ce"]) > 0 and float(got["count_pos"].sum()) > 0
    assert g_got.keys() == g_ref.keys() and len(g_got) > 0
    for n in g_got:
        assert rel_err(g_got[n], g_ref[n]) < 1e-5, n
    assert any(float(g.abs().sum()) > 0 for g in g_got.values())


@pytest.mark.parametrize("kernel", [True, False])
def test_vocab_terms_equal_the_former_formulation(kernel):
    """benchmarks/vocab_loss.py keeps the objective's former float32 code (teacher logits per row, inside the
    chunk): the objective's code now gives the same loss, gradient, argmax, candidates and teacher
    probabilities of the candidates (their sum: the refinement's candidate mass), over several chunks."""
    from benchmarks import vocab_loss as bench

    inp, h = bench.make_inputs(2, 40, 6, 300, 32, torch.device(DEVICE))
    head, last, t_pos, labels, weights = inp
    inp = (head.float(), last.float(), t_pos, labels, weights)
    assert t_pos.unique().numel() < t_pos.numel()  # blocks overlap: positions are shared
    for cw, teacher in ((0.1, True), (1.0, False), (1.0, True)):
        outs, grads = [], []
        for fn in (lambda x: bench.old_microbatch(x, inp, 5, cw, 5, teacher),
                   lambda x: bench.new_microbatch(x, inp, 5, cw, 5, teacher, kernel)):
            x = h.float().clone().requires_grad_()
            with torch.enable_grad():
                out = fn(x)
                assert len(out) == 3  # 12 blocks in chunks of 5
                sum(o[0] for o in out).backward()
            outs.append([torch.stack([o[0] for o in out])] + [None if out[0][i] is None else
                                                              torch.cat([o[i] for o in out]) for i in range(1, 5)])
            grads.append(x.grad)
        (lo, ao, co, to, mo), (ln, an, cn, tn, mn) = outs
        torch.testing.assert_close(ln, lo, rtol=1e-5, atol=1e-5)
        assert rel_err(grads[1], grads[0]) < 1e-5
        assert an.tolist() == ao.tolist()
        assert cn.sort(-1).values.tolist() == co.sort(-1).values.tolist()
        assert (tn is None) == (not teacher)
        if teacher:
            # the same candidates in each one's order: compare the probabilities as sorted by candidate id
            so, sn = co.sort(-1), cn.sort(-1)
            torch.testing.assert_close(tn.gather(-1, sn.indices), to.gather(-1, so.indices), rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(mn, mo, rtol=1e-5, atol=1e-7)
            assert 0 < float(mo.min()) and float(mo.max()) < 1


def test_vocab_path_is_chosen_by_device(target, monkeypatch):
    d, _, _ = _setup(target, "dflash", 1.0)
    obj = DrafterObjective(d, TargetTeacher(target), ObjectiveSwitches())
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setenv("SGLANG_DSPINE_KERNELS", "1")
    assert obj.vocab_on_kernel(cuda) and not obj.vocab_on_kernel(cpu)
    assert obj.vocab_path(cuda) == "the Triton kernel (sglang_dspine.kernels.vocab_objective)"
    assert obj.vocab_path(cpu) == "the PyTorch math (no CUDA: cpu)"
    monkeypatch.setenv("SGLANG_DSPINE_KERNELS", "0")
    assert not obj.vocab_on_kernel(cuda)
    assert obj.vocab_path(cuda) == "the PyTorch math (SGLANG_DSPINE_KERNELS=0)"
    obj.vocab_kernel = True
    assert obj.vocab_on_kernel(cpu)


def test_benchmark_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "v.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks", "vocab_loss", "--seq-len", "40", "--anchors", "6", "--chunk-blocks", "5",
                        "--vocab", "500", "--hidden", "32", "--path", "torch", "--iters", "2", "--warmup", "1",
                        "--device", "cpu", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["vocab"] == 500 and res["new_path"] == "torch" and res["chunks"] == 3 and res["rows_per_chunk"] == 75
    assert 15 < res["teacher_positions"] < 2 * 6 * 15  # overlapping blocks share teacher positions
    assert res["commit"] and res["versions"]["torch"] and res["date"] and res["command"]
    for kind in ("dspine", "dflash"):
        k = res["kinds"][kind]
        assert k["old"]["ms"] > 0 and k["new"]["ms"] > 0 and len(k["new"]["ms_all"]) == 2
        a = k["agreement"]
        assert a["loss_rel"] < 1e-5 and a["grad_hidden_rel"] < 1e-5 and a["argmax_agree"] == 1.0
        assert a["topk_set_agree"] == 1.0
    assert res["kinds"]["dspine"]["agreement"]["mass_max_abs"] < 1e-6
    assert "teacher_cand_max_abs" not in res["kinds"]["dflash"]["agreement"]


# ------------------------------------------------------------------------------------ GPU, the real shape
@pytest.mark.gpu
def test_kernel_at_qwen3_8b_shape():
    """1920 rows × 151936 in bf16 (one chunk): the kernel against the PyTorch math, and its bf16 dz against
    the float64 gradient of the former formulas (printed: the error of writing dz in bf16)."""
    g = torch.Generator().manual_seed(0)
    n, v = 1920, 151936
    z = (torch.randn(n, v, generator=g) * 2).to(torch.bfloat16).cuda()
    y = (torch.randn(n, v, generator=g) * 2).to(torch.bfloat16).cuda()
    labels = torch.randint(0, v, (n,), generator=g).cuda()
    got = run(True, z, labels, y, block_v=None)
    ref = run(False, z, labels, y, block_v=None)
    assert got[3].tolist() == ref[3].tolist()
    for i in range(3):
        torch.testing.assert_close(got[i], ref[i], rtol=1e-4, atol=1e-4)
    assert rel_err(got[4], ref[4]) < 4e-3
    rows = slice(0, 64)
    wce = torch.linspace(0.2, 1.0, n, device="cuda", dtype=torch.float64)[rows]
    wl1 = torch.linspace(1.0, 0.3, n, device="cuda", dtype=torch.float64)[rows]
    *_, dz64 = former_formulas(z[rows], labels[rows], y[rows], wce, wl1)
    err = rel_err(got[4][rows], dz64)
    print(f"bf16 dz vs float64 autograd of the former formulas: relative error {err:.2e}")
    assert err < 4e-3

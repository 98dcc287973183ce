"""Log-probabilities under DSPINE (CPU, SGLang imported for real): what a verify step reports for each emitted
token, the scheduler's admission of log-prob requests in a DSPINE server, and the batch DFlash's code sees.

Where SGLang's DFlash verify step returns log-probs itself (0.5.23), DSPINE's come from it; where it refuses
them (0.5.17), from DSPINE's worker. The same expectations hold for both."""
import subprocess
import sys
from types import SimpleNamespace

import pytest
import sglang  # noqa: F401  (SGLang imported for real: a broken install fails these tests, never skips them)
import torch

from sglang_dspine.serving.plugin import dflash_returns_logprobs
from sglang_dspine.serving.worker import _LogprobsHidden, _TargetWorker, verify_logprobs


def _verify_step_logprobs(batch, result, block):
    """The log-probs a DSPINE verify step reports on this SGLang: DFlash's own verify-step computation where it
    has one (its call, on the tokens the step emits), DSPINE's worker's elsewhere."""
    if dflash_returns_logprobs():
        from sglang.srt.layers.logprob_processor import compute_spec_logprobs

        compute_spec_logprobs(batch, result.logits_output, result.next_token_ids, chain_stride=block)
    else:
        verify_logprobs(batch, result)


def _verify_result(bs, block, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs * block, vocab, generator=g) * 3
    tokens = torch.randint(0, vocab, (bs, block), generator=g)
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    out = LogitsProcessorOutput(next_token_logits=logits.clone())
    return SimpleNamespace(logits_output=out, next_token_ids=tokens.view(-1), speculative_num_draft_tokens=block), \
        logits, tokens


def _batch(bs, temperatures, greedy, top=None, token_ids=None):
    info = SimpleNamespace(is_all_greedy=greedy, temperatures=torch.tensor(temperatures).view(-1, 1))
    return SimpleNamespace(seq_lens=torch.zeros(bs), sampling_info=info, top_logprobs_nums=top or [0] * bs,
                           token_ids_logprobs=token_ids or [None] * bs)


@pytest.mark.parametrize("greedy", [True, False])
def test_verify_logprobs_are_the_target_distribution_of_each_emitted_token(greedy):
    """Row n·B + j of the verify logits is request n's j-th emitted token's distribution: its log-softmax (after
    the temperature, as SGLang's sampler reports them), the emitted token's entry, the top-k and asked-for ids,
    laid out the way the scheduler reads them (request n, token j at n·B + j)."""
    bs, block, vocab = 3, 4, 50
    result, logits, tokens = _verify_result(bs, block, vocab)
    temps = [1.0, 1.0, 1.0] if greedy else [0.7, 1.0, 1.3]
    batch = _batch(bs, temps, greedy, top=[2, 0, 5], token_ids=[None, [3, 7], None])
    _verify_step_logprobs(batch, result, block)
    out = result.logits_output
    t = torch.tensor(temps).repeat_interleave(block).view(-1, 1)
    want = torch.log_softmax(logits / t, dim=-1)
    assert out.next_token_logprobs.shape == (bs, block)
    for n in range(bs):
        for j in range(block):
            row = n * block + j
            assert out.next_token_logprobs[n, j].item() == pytest.approx(want[row, tokens[n, j]].item(), abs=1e-5)
            k = batch.top_logprobs_nums[n]
            vals, idx = out.next_token_top_logprobs_val[row], out.next_token_top_logprobs_idx[row]
            assert len(vals) == k and len(idx) == k
            if k:
                ref = want[row].topk(k)
                torch.testing.assert_close(torch.as_tensor(vals), ref.values, atol=1e-5, rtol=0)
                assert torch.as_tensor(idx).tolist() == ref.indices.tolist()
            if n == 1:
                got = torch.as_tensor(out.next_token_token_ids_logprobs_val[row])
                torch.testing.assert_close(got, want[row, [3, 7]], atol=1e-5, rtol=0)
    # the verify logits themselves are left as they were (the scheduler and the next step do not see a change)
    torch.testing.assert_close(out.next_token_logits, logits)


def test_dspine_server_admits_logprob_requests():
    """In a DSPINE server's scheduler process log-prob requests are admitted and hidden states under overlap are
    refused. On 0.5.17 stock SGLang refuses both, so DSPINE lifts the first refusal (worded for DSPINE); where
    SGLang admits them itself, its check is left as it is."""
    code = (
        "from types import SimpleNamespace as R\n"
        "from sglang.srt.managers import scheduler\n"
        "from sglang_dspine.serving.plugin import dflash_returns_logprobs\n"
        "stock = scheduler.validate_dflash_request\n"
        "lp = R(return_logprob=True, return_hidden_states=False)\n"
        "hs = R(return_logprob=False, return_hidden_states=True)\n"
        "assert (stock(lp, True) is None) == dflash_returns_logprobs(), stock(lp, True)\n"
        "from sglang_dspine.serving import sglang_patches\n"
        "assert sglang_patches.admit_logprob_requests() != dflash_returns_logprobs()\n"
        "assert (scheduler.validate_dflash_request is stock) == dflash_returns_logprobs()\n"
        "assert scheduler.validate_dflash_request(lp, True) is None\n"
        "msg = scheduler.validate_dflash_request(hs, True)\n"
        "assert msg.startswith('DFLASH ' if dflash_returns_logprobs() else 'DSPINE '), msg\n"
        "assert scheduler.validate_dflash_request(hs, False) is None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.parametrize("supplies", [False, True], ids=["dflash-returns-them", "dspine-supplies-them"])
def test_log_probs_are_computed_once(supplies, monkeypatch):
    """Where DFlash's verify step returns log-probs (0.5.23: the worker's `supplies_logprobs` False), DSPINE's
    worker hands DFlash's step the batch itself and computes nothing after it; where DFlash refuses them (0.5.17),
    DFlash's step sees a view that hides them and the worker computes them once, after the step."""
    from sglang.srt.layers import logprob_processor
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    bs, block, vocab = 2, 4, 30
    result, _, _ = _verify_result(bs, block, vocab)
    seen, computed = [], []
    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation",
                        lambda self, batch, on_publish=None, grammar_barrier=None: seen.append(batch) or result)
    # (0.5.23 names it otherwise: this case only asks whether the worker calls it)
    monkeypatch.setattr(logprob_processor, "compute_spec_v2_logprobs", lambda *a: computed.append(a), raising=False)
    worker = _worker_shell(block, supplies)
    batch = _batch(bs, [1.0, 1.0], True)
    batch.return_logprob, batch.is_extend_in_batch, batch.forward_mode = True, False, ForwardMode.DECODE
    assert worker.forward_batch_generation(batch) is result
    assert isinstance(seen[0], _LogprobsHidden) == supplies and (seen[0] is batch) == (not supplies)
    assert len(computed) == int(supplies)


def _worker_shell(block: int, supplies: bool):
    """A DSpineWorker as its step's dispatch sees it (no model runners on a CPU): a fixed server of the block."""
    from sglang_dspine.serving.verify_shapes import Shape
    from sglang_dspine.serving.worker import DSpineWorker

    worker = DSpineWorker.__new__(DSpineWorker)
    worker._target_worker, worker.block_size = SimpleNamespace(), block
    worker.supplies_logprobs, worker.shapes = supplies, (Shape(block),)
    return worker


def test_dflash_code_sees_no_logprob_request_and_the_target_sees_the_batch():
    batch = SimpleNamespace(return_logprob=True, top_logprobs_nums=[3], out_cache_loc=None)
    hidden = _LogprobsHidden(batch)
    assert hidden.return_logprob is False and hidden.top_logprobs_nums == [3]
    hidden.out_cache_loc = "written"  # DFlash's worker writes to the batch: it reaches the real one
    assert batch.out_cache_loc == "written"
    seen = []
    target = _TargetWorker(SimpleNamespace(forward_batch_generation=lambda b, *a, **k: seen.append(b) or "out",
                                           model_runner="runner"))
    assert target.forward_batch_generation(hidden, capture_hidden_mode=1) == "out"
    assert seen == [batch] and seen[0].return_logprob is True
    assert target.model_runner == "runner"


@pytest.mark.parametrize("mode,verify", [("DECODE", True), ("EXTEND", False), ("IDLE", False)])
def test_verify_log_probs_follow_the_mode_the_batch_came_in(mode, verify, monkeypatch):
    """Where DSPINE supplies the log-probs (0.5.17), its worker decides whether a step is a verify step before
    DFlash's code runs: DFlash's verify sets the batch's mode to TARGET_VERIFY, which SGLang's ForwardMode counts as
    an extend mode (a decode batch asking for log-probs then came back without them and the scheduler failed on
    it). Where DFlash's verify step returns them (0.5.23), DSPINE's worker hands DFlash the batch as it came and
    adds nothing. The parent's forward is replaced by what it does to the batch: the verify step's mode change,
    and its result."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    upstream = dflash_returns_logprobs()
    assert ForwardMode.TARGET_VERIFY.is_extend()  # the trap, as SGLang defines it
    bs, block, vocab = 2, 4, 30
    result, logits, tokens = _verify_result(bs, block, vocab)

    def parent_forward(self, batch, on_publish=None, grammar_barrier=None):
        # DFlash's up-front refusal (0.5.17) sees no log-prob request; DFlash's own log-prob path (0.5.23) sees it
        assert batch.return_logprob is upstream
        assert (self.target_worker is self._target_worker) == upstream  # else the target gets the real batch
        if batch.forward_mode == ForwardMode.DECODE:
            batch.forward_mode = ForwardMode.TARGET_VERIFY  # what prepare_for_verify does
        return result

    monkeypatch.setattr(DFlashWorkerV2, "forward_batch_generation", parent_forward)
    worker = _worker_shell(block, supplies=not upstream)  # what the worker's __init__ sets on this release
    batch = _batch(bs, [1.0, 1.0], True)
    batch.return_logprob, batch.is_extend_in_batch, batch.forward_mode = True, False, getattr(ForwardMode, mode)
    assert worker.forward_batch_generation(batch) is result
    assert (result.logits_output.next_token_logprobs is not None) == (verify and not upstream)
    assert worker.target_worker is worker._target_worker


# ------------------------------------------------------------------ against SGLang's own non-speculative sampler
V = 64


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A DSPINE launch's server arguments (PyTorch sampling) published, SGLang's parallel state on one rank: what
    SGLang's Sampler and SamplingBatchInfo read."""
    import sglang_on_cpu
    from conftest import randomize_injection

    from sglang_dspine.drafter.checkpoint import save_drafter
    from sglang_dspine.drafter.tiny import make_target, tiny_drafter

    root = tmp_path_factory.mktemp("logprobs")
    target = make_target(vocab=V)
    target.save_pretrained(root / "target")
    save_drafter(randomize_injection(tiny_drafter(target)), root / "dspine")
    args = sglang_on_cpu.server_args(root / "target", root / "dspine", "DSPINE", "--sampling-backend", "pytorch")
    sglang_on_cpu.setup(args)
    return args


def _allowed_tokens_grammar(allowed):
    """A grammar allowing the same tokens at every step, in xgrammar's packed-bitmask layout (what SGLang's
    speculative grammar traversal reads): a grammar backend's part, so that SGLang's own mask plumbing runs (its
    traversal along the draft chain for the verify, `update_regex_vocab_mask` for the sampler)."""
    from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject

    words = (V + 31) // 32
    bits = torch.zeros(words * 32, dtype=torch.int64)
    bits[list(allowed)] = 1
    packed = (bits.view(words, 32) << torch.arange(32)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)

    class AllowedTokens(BaseGrammarObject):
        def accept_token(self, token):
            assert token in allowed, token

        def rollback(self, k):
            pass

        def allocate_vocab_mask(self, vocab_size, batch_size, device):
            return torch.full((batch_size, words), -1, dtype=torch.int32)  # every token allowed

        def fill_vocab_mask(self, vocab_mask, idx):
            vocab_mask[idx] = packed

        @staticmethod
        def move_vocab_mask(vocab_mask, device):
            return vocab_mask.to(device)

        @staticmethod
        def apply_vocab_mask(logits, vocab_mask):
            unpacked = (vocab_mask.long().unsqueeze(-1) >> torch.arange(32)) & 1
            logits.masked_fill_(unpacked.view(vocab_mask.shape[0], -1)[:, : logits.shape[1]] == 0, float("-inf"))

    return AllowedTokens()


class _Batch:
    """The parts of a ScheduleBatch these steps read (SGLang's penalizers keep a weak reference to it)."""


def _logprob_batch(params, grammars, outputs, top, token_ids):
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    batch = _Batch()
    batch.device = "cpu"
    batch.reqs = [SimpleNamespace(sampling_params=p, custom_logit_processor=None, return_sampling_mask=False,
                                  origin_input_ids=[1, 2, 3], output_ids=list(o), grammar=g)
                  for p, g, o in zip(params, grammars, outputs)]
    info = SamplingBatchInfo.from_schedule_batch(batch, V)
    for step in zip(*outputs):  # the tokens each request emitted so far, one decode step at a time
        info.penalizer_orchestrator.cumulate_output_tokens(torch.tensor(step))
    batch.sampling_info, batch.seq_lens = info, torch.full((len(params),), 10)
    batch.top_logprobs_nums, batch.token_ids_logprobs, batch.return_logprob = top, token_ids, True
    batch.has_grammar = any(g is not None for g in grammars)
    batch.spec_algorithm = SpeculativeAlgorithm.from_string("DSPINE")
    return batch


def _served_verify_logprobs(batch, logits, candidates, accept_len, bonus, block):
    """A DSPINE verify step's log-probs on this SGLang, its steps in DFlash's worker's order: the grammar bitmask
    along the draft chain (`build_grammar_vocab_mask`), the verify logit adjustments (penalties, logit bias), the
    mask, the emitted tokens (accepted drafts, the bonus at the accept length, DFlash's layout), then the log-probs:
    DFlash's own (0.5.23) or DSPINE's worker's (0.5.17)."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
    from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

    bs = candidates.shape[0]
    out = LogitsProcessorOutput(next_token_logits=logits.clone())
    grammar_mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=GrammarTree.from_linear_chain(candidates),
                                            sampling_info=batch.sampling_info, device="cpu", barrier=None)
    apply_dflash_verify_logits_adjustments(next_token_logits=out.next_token_logits, sampling_info=batch.sampling_info,
                                           draft_token_num=block)
    if grammar_mask is not None:
        grammar_mask.apply(out.next_token_logits)
    tokens = torch.cat([candidates[:, 1:], torch.zeros(bs, 1, dtype=torch.long)], 1)
    tokens.scatter_(1, accept_len.view(-1, 1), bonus.view(-1, 1))
    _verify_step_logprobs(batch, SimpleNamespace(logits_output=out, next_token_ids=tokens.view(-1),
                                                 speculative_num_draft_tokens=block), block)
    return out, tokens


def _scheduler_reads(batch, out, tokens, accept_len):
    """What the scheduler hands each request (SchedulerBatchResultProcessor._apply_decode_logprobs, after
    _normalize_decode_outputs' conversion to lists): its first accept length + 1 emitted tokens' log-probs."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor

    logprobs = out.next_token_logprobs.tolist()
    if out.next_token_top_logprobs_val:
        out.next_token_top_logprobs_val = [torch.as_tensor(v).tolist() for v in out.next_token_top_logprobs_val]
        out.next_token_top_logprobs_idx = [torch.as_tensor(x).tolist() for x in out.next_token_top_logprobs_idx]
    if out.next_token_token_ids_logprobs_val:
        out.next_token_token_ids_logprobs_val = [torch.as_tensor(v).tolist()
                                                 for v in out.next_token_token_ids_logprobs_val]
    reqs = []
    for i in range(len(batch.reqs)):
        req = SimpleNamespace(logprob=SimpleNamespace(
            output_token_logprobs_val=[], output_token_logprobs_idx=[], top_logprobs_num=batch.top_logprobs_nums[i],
            output_top_logprobs_val=[], output_top_logprobs_idx=[], token_ids_logprob=batch.token_ids_logprobs[i],
            output_token_ids_logprobs_val=[], output_token_ids_logprobs_idx=[]))
        accepted = tokens[i, : int(accept_len[i]) + 1].tolist()
        SchedulerBatchResultProcessor._apply_decode_logprobs(None, req=req, i=i, batch=batch, next_token_id=accepted,
                                                             next_token_logprobs=logprobs, logits_output=out)
        reqs.append(req.logprob)
    return reqs


def _sampler_logprobs(batch, logits, tokens, block):
    """SGLang without speculation on the same logits and SamplingBatchInfo, one position at a time: the model
    runner's logit preprocessing (`update_regex_vocab_mask`, `apply_logits_bias`: penalties, grammar mask, logit
    bias), then its Sampler with log-probs asked for (the emitted token's among the token-id log-probs)."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.layers.sampler import Sampler

    info, bs = batch.sampling_info, tokens.shape[0]
    grammars = [r.grammar for r in batch.reqs]
    sampler, rows = Sampler(), []
    for j in range(block):
        step = logits.view(bs, block, V)[:, j].clone()
        info.grammars = grammars if any(g is not None for g in grammars) else None
        info.update_regex_vocab_mask()
        info.apply_logits_bias(step)
        info.grammar_mask = None
        out = LogitsProcessorOutput(next_token_logits=step)
        asked = [[int(tokens[i, j])] + list(batch.token_ids_logprobs[i] or []) for i in range(bs)]
        sampler(out, info, True, batch.top_logprobs_nums, asked, torch.zeros(bs, dtype=torch.long))
        rows.append(out)
    info.grammars = None
    return rows


@pytest.mark.parametrize("penalty", ["additive", pytest.param("repetition", marks=pytest.mark.xfail(
    strict=True, raises=AssertionError,
    reason="SGLang's DFlash verify drops scaling penalties (apply_dflash_verify_logits_adjustments)"))])
def test_verify_logprobs_equal_sglang_sampler(published, penalty):
    """Every emitted token's log-prob (and the top-k and asked-for ids) from a verify step equals what SGLang's own
    non-speculative sampler reports on the same logits and SamplingBatchInfo: a greedy request beside sampled ones
    (T = 0.7, 1.3, 1.0), frequency and presence penalties over earlier outputs, a logit bias, a grammar mask; and
    the scheduler hands each request exactly its accepted tokens' values (accept lengths 0..B-1). (The verify
    applies the step's penalties at every position, as SGLang's DFlash does: the sampler is given the same state.)

    A repetition penalty (a scaling penalty) is lost by SGLang's DFlash verify adjustments, which build the
    penalties on a zero tensor and add them: strict xfail, so a fix upstream shows."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    block, bs = 4, 4
    pen = dict(frequency_penalty=0.8, presence_penalty=0.6) if penalty == "additive" else dict(repetition_penalty=1.6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, **pen),
              SamplingParams(temperature=1.3, logit_bias={"5": 3.0, "9": -2.0}), SamplingParams(temperature=1.0)]
    allowed = set(range(0, V, 3))
    grammars = [None, None, None, _allowed_tokens_grammar(allowed)]
    outputs = [[4, 7], [5, 5], [6, 2], [9, 3]]  # two earlier decode steps
    top, token_ids = [3, 0, 2, 4], [None, [5, 7], [5, 9], None]
    batch = _logprob_batch(params, grammars, outputs, top, token_ids)
    sampler_batch = _logprob_batch(params, grammars, outputs, top, token_ids)  # its own state: nothing shared
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(bs * block, V, generator=g) * 2
    logits[block: 2 * block, 5] += 4  # request 1's earlier outputs are likely again: the penalties matter
    accept_len = torch.tensor([0, 3, 1, 2])
    # drafts: the greedy request's is rejected; the others' accepted ones respect the grammar
    candidates = torch.tensor([[4, 1, 2, 3], [7, 5, 11, 6], [2, 8, 20, 30], [3, 9, 12, 40]])
    bonus = torch.tensor([-1, 13, 17, 21])
    adjusted = logits.clone()
    batch.sampling_info.apply_logits_bias(adjusted.view(bs, block, V)[0])  # greedy request 0: its argmax
    bonus[0] = int(adjusted[0].argmax())
    out, tokens = _served_verify_logprobs(batch, logits, candidates, accept_len, bonus, block)
    reqs = _scheduler_reads(batch, out, tokens, accept_len)
    ref = _sampler_logprobs(sampler_batch, logits, tokens, block)
    for i in range(bs):
        n = int(accept_len[i]) + 1
        assert reqs[i].output_token_logprobs_idx == tokens[i, :n].tolist()
        want = [float(torch.as_tensor(ref[j].next_token_token_ids_logprobs_val[i])[0]) for j in range(n)]
        assert reqs[i].output_token_logprobs_val == pytest.approx(want, abs=2e-5), i
        assert all(v > -1e30 for v in reqs[i].output_token_logprobs_val)  # every emitted token is allowed
        assert len(reqs[i].output_top_logprobs_val) == (n if top[i] else 0)
        for j in range(n if top[i] else 0):
            assert reqs[i].output_top_logprobs_idx[j] == torch.as_tensor(ref[j].next_token_top_logprobs_idx[i]).tolist()
            assert reqs[i].output_top_logprobs_val[j] == pytest.approx(
                torch.as_tensor(ref[j].next_token_top_logprobs_val[i]).tolist(), abs=2e-5)
        for j in range(n if token_ids[i] else 0):
            assert reqs[i].output_token_ids_logprobs_val[j] == pytest.approx(
                torch.as_tensor(ref[j].next_token_token_ids_logprobs_val[i])[1:].tolist(), abs=2e-5)

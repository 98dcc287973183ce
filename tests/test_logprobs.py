"""Log-probabilities under DSPINE (CPU, SGLang imported for real): what a verify step reports for each emitted
token, the scheduler's admission of log-prob requests in a DSPINE server, and the batch DFlash's code sees.

Where SGLang's DFlash verify step returns log-probs itself (0.5.23), DSPINE's come from it; where it refuses
them (0.5.17), from DSPINE's worker. The same expectations hold for both."""
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang_dspine.serving.plugin import dflash_returns_logprobs  # noqa: E402
from sglang_dspine.serving.worker import _LogprobsHidden, _TargetWorker, verify_logprobs  # noqa: E402


def _verify_step_logprobs(batch, result, block):
    """The log-probs a DSPINE verify step reports on this SGLang: DFlash's own verify-step computation where it
    has one (its call, on the tokens the step emits), DSPINE's worker's elsewhere."""
    if dflash_returns_logprobs():
        from sglang.srt.layers.logprob_processor import compute_spec_logprobs

        compute_spec_logprobs(batch, result.logits_output, result.next_token_ids, chain_stride=block)
    else:
        verify_logprobs(batch, result, block)


def _verify_result(bs, block, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs * block, vocab, generator=g) * 3
    tokens = torch.randint(0, vocab, (bs, block), generator=g)
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    out = LogitsProcessorOutput(next_token_logits=logits.clone())
    return SimpleNamespace(logits_output=out, next_token_ids=tokens.view(-1)), logits, tokens


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


def test_log_probs_are_computed_once():
    """Where DFlash's verify step returns log-probs, DSPINE's worker runs DFlash's step as it is (it neither hides
    the request from it nor computes them again); elsewhere the worker that supplies them is the one used."""
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

    from sglang_dspine.serving.worker import DSpineLogprobWorker, DSpineWorker

    assert DSpineWorker.forward_batch_generation is DFlashWorkerV2.forward_batch_generation
    assert DSpineWorker.target_worker is DFlashWorkerV2.target_worker
    assert DSpineLogprobWorker.forward_batch_generation is not DFlashWorkerV2.forward_batch_generation


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

    from sglang_dspine.serving.worker import DSpineLogprobWorker, DSpineWorker

    upstream = dflash_returns_logprobs()
    worker_class = DSpineWorker if upstream else DSpineLogprobWorker  # what plugin._worker_factory returns
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
    worker = worker_class.__new__(worker_class)  # the wrapper's dispatch only: no model runners on a CPU
    worker._target_worker, worker.block_size = SimpleNamespace(), block
    batch = _batch(bs, [1.0, 1.0], True)
    batch.return_logprob, batch.is_extend_in_batch, batch.forward_mode = True, False, getattr(ForwardMode, mode)
    assert worker.forward_batch_generation(batch) is result
    assert (result.logits_output.next_token_logprobs is not None) == (verify and not upstream)
    assert worker.target_worker is worker._target_worker

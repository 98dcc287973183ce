"""Candidate decoding with the head split over two ranks (gloo, CPU) equals decoding with the whole head."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_dspine.drafter.decoding import decode_block
from sglang_dspine.drafter.injection import AdjacentInjection
from sglang_dspine.drafter.sharding import TorchGroup, VocabShard

V, H, R, M, K, N, P = 50, 16, 8, 6, 5, 3, 4


def problem():
    g = torch.Generator().manual_seed(0)
    inj = AdjacentInjection(H, R, M, 2)
    with torch.no_grad():
        for p in inj.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    head = torch.randn(V, H, generator=g)
    codes = torch.nn.functional.normalize(torch.randn(V, R, generator=g), dim=-1)
    states = torch.randn(N, P, H, generator=g)
    pre = torch.randn(N, P, H, generator=g)
    anchors = torch.randint(0, V, (N,), generator=g)
    refine = lambda h, c: torch.nn.functional.layer_norm(inj.refine(h, c), (H,))
    return head, codes, states, pre, anchors, refine


def _rank(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    head, codes, states, pre, anchors, refine = problem()
    bounds = [0, 23, V]  # uneven shards, as vocabularies padded to the TP size are not
    lo, hi = bounds[rank], bounds[rank + 1]
    local_head = head[lo:hi]
    draft = decode_block(states @ local_head.T, pre, anchors, K, refine, codes, local_head,
                         VocabShard(lo, hi - lo, TorchGroup()))
    out[rank] = (draft.tokens.tolist(), draft.candidates.tolist(), draft.scores.tolist())  # plain data crosses processes
    dist.destroy_process_group()


def test_two_rank_decoding_equals_full_vocabulary():
    head, codes, states, pre, anchors, refine = problem()
    full = decode_block(states @ head.T, pre, anchors, K, refine, codes, head)
    with mp.Manager() as manager:
        out = manager.dict()
        port = 29600 + os.getpid() % 200
        mp.spawn(_rank, args=(2, port, out), nprocs=2, join=True)
        for rank in range(2):
            tokens, candidates, scores = out[rank]
            assert candidates == full.candidates.tolist()
            assert tokens == full.tokens.tolist()
            torch.testing.assert_close(torch.tensor(scores), full.scores)
    # candidates come from both shards, and the walk left the backbone's argmax somewhere
    assert (full.candidates < 23).any() and (full.candidates >= 23).any()
    assert (full.choice != 0).any()

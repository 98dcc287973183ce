"""A tree step's accepted path brought to the front, in one kernel: `serving/tree_verify.committed_rows` followed
by `bring_to_front`, one program per request (otherwise a few dozen small PyTorch operations a step, each a
kernel launched from Python).

Per request, with R verify rows [anchor, nodes...], the acceptance's flat rows `accept_index` [W] (the anchor,
then each accepted node; -1 past them) and its count `accepted` (draft nodes accepted):
  - order: the committed rows first (the anchor, then the accepted nodes root's child first), then every other
    row ascending. A row on the path goes to its place k on it; any other row j to accepted + 1 + the number of
    rows before j that are not on the path (a prefix sum), so every row is written once, no sort;
  - out_tokens: the accepted nodes' tokens, the bonus token after them, 0 past it; commit_lens = accepted + 1;
  - front: the request's verify slots `loc` [R] in that order, and `req_to_token[pool index, seq_len + k]` = the
    k-th of them (no K/V moves: a node's K/V was written for position seq_len + its depth, its place on the path).
The outputs equal the PyTorch reference's exactly (tests/test_tree_verify.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _commit_path_kernel(acc_idx_ptr, accepted_ptr, bonus_ptr, tokens_ptr, loc_ptr, r2t_ptr, rpi_ptr, seq_ptr,
                        order_ptr, out_ptr, front_ptr, R, W, stride_r2t, BLOCK_R: tl.constexpr,
                        BLOCK_W: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    k = tl.arange(0, BLOCK_W)
    rows_ok = j < R
    accepted = tl.load(accepted_ptr + b).to(tl.int64)
    on = (k < W) & (k <= accepted)  # the path's places: the anchor and the accepted nodes
    local = tl.load(acc_idx_ptr + b * W + k, mask=on, other=0).to(tl.int64) - b * R  # the request's own rows
    # each row: on the path or not (k's rows against j's)
    hit = (local[:, None] == j[None, :]) & on[:, None]
    on_path = tl.max(hit.to(tl.int32), axis=0) > 0
    off = rows_ok & (on_path == 0)
    place = accepted + tl.cumsum(off.to(tl.int64), axis=0)  # accepted + 1 + earlier rows off the path
    loc = tl.load(loc_ptr + b * R + j, mask=rows_ok, other=0)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    pool = tl.load(rpi_ptr + b).to(tl.int64)
    # rows off the path, then the path's
    tl.store(order_ptr + b * R + place, j.to(tl.int64), mask=off)
    tl.store(front_ptr + b * R + place, loc, mask=off)
    tl.store(r2t_ptr + pool * stride_r2t + seq + place, loc.to(r2t_ptr.dtype.element_ty), mask=off)
    path_loc = tl.load(loc_ptr + b * R + local, mask=on, other=0)
    tl.store(order_ptr + b * R + k, local, mask=on)
    tl.store(front_ptr + b * R + k, path_loc, mask=on)
    tl.store(r2t_ptr + pool * stride_r2t + seq + k, path_loc.to(r2t_ptr.dtype.element_ty), mask=on)
    # tokens out: the accepted nodes' (path places 1..accepted), the bonus at `accepted`, 0 past it
    node = on & (k >= 1)
    tok = tl.load(tokens_ptr + b * R + local, mask=node, other=0)
    tl.store(out_ptr + b * R + k - 1, tok, mask=node)
    tl.store(out_ptr + b * R + accepted, tl.load(bonus_ptr + b).to(tl.int64))
    tl.store(out_ptr + b * R + j, tl.zeros_like(j).to(tl.int64), mask=rows_ok & (j > accepted))


def commit_path_kernel(accept_index: torch.Tensor, accepted: torch.Tensor, bonus: torch.Tensor,
                       tokens: torch.Tensor, loc_2d: torch.Tensor, req_to_token: torch.Tensor,
                       req_pool_indices: torch.Tensor, seq_lens: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [bs, R] int64, commit_lens [bs] int32, out_tokens [bs, R] int64, front [bs, R]) and
    `req_to_token` rewritten in place (module docstring). accept_index [bs, W] (flat verify rows b·R + row, -1
    past the path), accepted [bs], bonus [bs], tokens [bs, R] (the verify rows' tokens), loc_2d [bs, R] (the
    requests' verify slots), req_pool_indices [bs], seq_lens [bs] (committed lengths)."""
    bs, rows = tokens.shape
    width = accept_index.shape[1]
    if width > rows or loc_2d.shape != (bs, rows) or accept_index.shape[0] != bs:
        raise ValueError(f"commit_path_kernel: accept_index {tuple(accept_index.shape)}, tokens {(bs, rows)}, "
                         f"loc_2d {tuple(loc_2d.shape)}")
    if req_to_token.stride(1) != 1:
        raise ValueError("commit_path_kernel: req_to_token must be contiguous along its rows")
    dev = tokens.device
    order = torch.empty(bs, rows, dtype=torch.int64, device=dev)
    out = torch.empty(bs, rows, dtype=torch.int64, device=dev)
    loc = loc_2d.contiguous()
    front = torch.empty_like(loc)
    _commit_path_kernel[(bs,)](accept_index.contiguous(), accepted.contiguous(), bonus.contiguous(),
                               tokens.to(torch.int64).contiguous(), loc, req_to_token, req_pool_indices.contiguous(),
                               seq_lens.contiguous(), order, out, front, rows, width, req_to_token.stride(0),
                               BLOCK_R=triton.next_power_of_2(rows), BLOCK_W=triton.next_power_of_2(width),
                               num_warps=1)
    return order, accepted.to(torch.int32) + 1, out, front

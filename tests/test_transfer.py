"""Transfer space: codes against an independent numpy computation and the properties docs/algorithm.md states."""
import numpy as np
import pytest
import torch

from sglang_dspine.config import DrafterConfigError
from sglang_dspine.transfer import check_codes, compute_transfer_space


def head(v=200, h=32, seed=0):
    return torch.randn(v, h, generator=torch.Generator().manual_seed(seed))


def test_codes_are_unit_and_whitened_on_top_directions():
    w, r = head(), 12
    space = compute_transfer_space(w, r, chunk_rows=37)
    codes = space.codes
    torch.testing.assert_close(codes.norm(dim=1), torch.ones(len(w)), atol=1e-5, rtol=0)
    # independent: numpy SVD of the centred unit rows
    x = w.double().numpy()
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    x = x - x.mean(0)
    _, sv, vt = np.linalg.svd(x, full_matrices=False)
    top = vt[:r].T  # [H, r], descending
    lam = sv[:r] ** 2 / len(x)
    np.testing.assert_allclose(np.sort(space.eigenvalues.double().numpy()), np.sort(lam), rtol=1e-5)
    # same subspace: |D^T top| is a permutation matrix up to sign
    overlap = np.abs(space.directions.double().numpy().T @ top)
    np.testing.assert_allclose(np.sort(overlap.max(1)), np.ones(r), atol=1e-5)
    # whitened: before the final normalisation the projections have identity covariance
    z = x @ space.directions.double().numpy() / np.sqrt(space.eigenvalues.double().numpy())
    np.testing.assert_allclose(z.T @ z / len(x), np.eye(r), atol=1e-4)
    want = z / np.linalg.norm(z, axis=1, keepdims=True)
    np.testing.assert_allclose(codes.double().numpy(), want, atol=1e-5)


def test_codes_ignore_row_scale_and_chunking():
    w = head(seed=1)
    scale = torch.rand(len(w), 1, generator=torch.Generator().manual_seed(2)) * 10 + 0.1
    a = compute_transfer_space(w, 8, chunk_rows=1000).codes
    b = compute_transfer_space(w * scale, 8, chunk_rows=23).codes
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # deterministic: the same call twice gives the same bits
    assert torch.equal(a, compute_transfer_space(w, 8, chunk_rows=1000).codes)


def test_refuses_rank_above_the_heads_directions():
    low = torch.randn(100, 3) @ torch.randn(3, 16)  # rows span 3 dims -> centred unit rows span <= 3
    with pytest.raises(DrafterConfigError, match="principal directions"):
        compute_transfer_space(low, 8)
    compute_transfer_space(low, 2)  # fewer than the available directions is fine


@pytest.mark.parametrize("bad,msg", [
    (None, "missing"), (torch.zeros(10, 4), "all zeros"),
    (torch.full((10, 4), float("nan")), "NaN"), (torch.ones(10, 5), "shape"),
])
def test_check_codes_refuses(bad, msg):
    with pytest.raises(DrafterConfigError, match=msg):
        check_codes(bad, 10, 4)

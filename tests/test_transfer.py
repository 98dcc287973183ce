"""Transfer space: codes against an independent numpy computation and the properties docs/algorithm.md states."""
import numpy as np
import pytest
import torch

from sglang_dspine.drafter.config import DrafterConfigError
from sglang_dspine.drafter.transfer import check_codes, compute_transfer_space


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


def test_space_is_computed_on_the_heads_device_in_its_dtype():
    """The result lives where the head lives; a bf16 head gives the codes of its float32 copy (the statistics
    are float64 whatever the head's dtype)."""
    w = head(v=300, h=24, seed=3).bfloat16()
    space = compute_transfer_space(w, 6, chunk_rows=64)
    for t in (space.codes, space.directions, space.eigenvalues):
        assert t.device == w.device and t.dtype == torch.float32
    torch.testing.assert_close(space.codes, compute_transfer_space(w.float(), 6, chunk_rows=300).codes,
                               atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_cuda_head_gives_the_cpu_codes():
    """A head on the GPU: same codes, directions and eigenvalues as on the CPU, and a drafter on the GPU takes
    them through init_dspine_transfer without a copy of the head to the CPU."""
    from sglang_dspine.drafter.checkpoint import init_dspine_transfer
    from sglang_dspine.drafter.model import DSpineDrafter
    from sglang_dspine.drafter.tiny import drafter_config_for, make_target

    w = head(v=5000, h=64, seed=4)
    cpu = compute_transfer_space(w, 16, chunk_rows=1024)
    gpu = compute_transfer_space(w.cuda(), 16, chunk_rows=1024)
    assert gpu.codes.is_cuda
    torch.testing.assert_close(gpu.codes.cpu(), cpu.codes, atol=1e-5, rtol=0)
    torch.testing.assert_close(gpu.directions.cpu(), cpu.directions, atol=1e-5, rtol=0)
    torch.testing.assert_close(gpu.eigenvalues.cpu(), cpu.eigenvalues, rtol=1e-6, atol=0)

    target = make_target(seed=0)
    drafters = {}
    for dev in ("cpu", "cuda"):
        d = DSpineDrafter(drafter_config_for(target)).to(dev)
        init_dspine_transfer(d, target.lm_head.weight.detach().to(dev))
        drafters[dev] = d
    torch.testing.assert_close(drafters["cuda"].transfer_codes.cpu(), drafters["cpu"].transfer_codes, atol=1e-5, rtol=0)

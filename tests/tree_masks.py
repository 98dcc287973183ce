"""Random draft trees in SGLang's TARGET_VERIFY mask layout, for the verify-attention tests (the kernel's own and
the served backend's)."""
import torch


def tree_mask(rows: int, contexts: list[int], seed: int, device="cpu"):
    """A random tree per request in SGLang's TARGET_VERIFY mask layout: request b's rows × (context + rows) cells
    from mask_indptr[b], the context's all set; row r sees itself and its ancestors (a random parent < r each).
    Returns (mask, mask_indptr)."""
    g = torch.Generator().manual_seed(seed)
    cells, indptr = [], [0]
    for n in contexts:
        seen = torch.eye(rows, dtype=torch.bool)
        for r in range(1, rows):
            seen[r] |= seen[int(torch.randint(0, r, (1,), generator=g))]
        cells.append(torch.cat([torch.ones(rows, n, dtype=torch.bool), seen], 1).reshape(-1))
        indptr.append(indptr[-1] + rows * (n + rows))
    return torch.cat(cells).to(device), torch.tensor(indptr, dtype=torch.int32, device=device)

"""Where training runs: the device and precision rule, and torchrun's process group (one rank per GPU)."""
from __future__ import annotations

import os

import torch

from .train_config import TrainConfig


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over the ranks in place (nothing without a process group); returns `t`."""
    d = _dist()
    if d is not None:
        d.all_reduce(t)
    return t


def barrier() -> None:
    d = _dist()
    if d is not None:
        d.barrier()


def local_rank() -> int:
    """This process's GPU index on its host: LOCAL_RANK under torchrun (WORLD_SIZE > 1), else 0."""
    return int(os.environ.get("LOCAL_RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def setup_distributed() -> tuple[int, int, int]:
    """(rank, world size, local rank); initialises the process group under torchrun (WORLD_SIZE > 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, 0
    import torch.distributed as dist

    local = local_rank()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), local


def train_device(tc: TrainConfig) -> tuple[torch.device, bool]:
    """Where training runs, and whether in bf16: `tc.device`, else this rank's GPU (cuda:LOCAL_RANK under
    torchrun), else the CPU; bf16 when `precision` says so, or on 'auto' on a GPU. The CLI loads the target
    by the same rule before training starts."""
    if tc.device:
        device = torch.device(tc.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", local_rank())
    else:
        device = torch.device("cpu")
    return device, tc.precision == "bf16" or (tc.precision == "auto" and device.type == "cuda")

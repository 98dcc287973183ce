"""Shared fixtures: tiny random Qwen3 targets and drafters built on the spot (no hub, float32, CPU)."""
import faulthandler
import os

import pytest
import torch

# Without a GPU, Triton kernels run through Triton's interpreter. Triton picks the interpreter when a kernel
# is decorated, so this must be set before any module of sglang_dspine.kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sglang_dspine.drafter.model import DSpineDrafter
from sglang_dspine.drafter.tiny import make_target, tiny_drafter


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device by scripts/device/*.sh)")


# A test that hangs (a deadlock: stop 59's CI ran into its 90-minute limit on one) ends the run at once, with every
# thread's stack in the log, instead of silently using up CI's time. Far above any test's duration (the slowest,
# a training run, takes about a minute here); the clock is restarted for each test.
TEST_HANG_S = 600


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(TEST_HANG_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_grad():
    """No autograd for one test (modules that only run models ask for it; other modules' tests train)."""
    with torch.no_grad():
        yield


@pytest.fixture(scope="session")
def target():
    return make_target(seed=0)


def randomize_injection(drafter: DSpineDrafter, seed: int = 0, std: float = 0.2) -> DSpineDrafter:
    """Give the zero-initialised injection weights random values so the injection does something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.injection.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return drafter


def edit_drafter_dir(path, tensors=None, config=None):
    """Edit a drafter folder in place: `tensors(state)` on its model.safetensors, `config(cfg)` on its config.json."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    path = Path(path)
    if tensors is not None:
        state = load_file(path / "model.safetensors")
        tensors(state)
        save_file(state, path / "model.safetensors")
    if config is not None:
        cfg = json.loads((path / "config.json").read_text())
        config(cfg)
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture
def dspine(target):
    return randomize_injection(tiny_drafter(target, seed=1))


@pytest.fixture(scope="module")
def one_thread():
    """The models of a module are tiny: one intra-op thread is fastest, and immune to a busy machine's thread
    contention (modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

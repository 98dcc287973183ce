"""The environment variables this package reads, each declared once, typed, and documented in the README.

Values are read when asked for (not at import), so a test or a launcher can set them for one process.
A malformed value is an error naming the variable, never a silent default.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"{name}: expected 0 or 1, found {raw!r}")
    return raw == "1"


@dataclass(frozen=True)
class _Variable:
    name: str
    default: object
    help: str


VARIABLES = (
    _Variable("SGLANG_DSPINE_KERNELS", True,
              "1 (default): DSPINE's draft step and the training objective's vocabulary-sized terms run on the "
              "Triton kernels on CUDA; 0: on the plain PyTorch math"),
    _Variable("SGLANG_DSPINE_TREE", False,
              "1: decode steps verify a best-first tree of N-1 nodes over the transition lattice, N = "
              "--speculative-num-draft-tokens: at N = B (the block) sampled requests verify the tree and greedy "
              "ones their walk; at N > B every request a tree, a greedy one's scored with the drafter's tree "
              "calibration (docs/tree.md; experimental: more tokens per step, slower steps so far; refused at start "
              "where it is not built)"),
    _Variable("SGLANG_DSPINE_VERIFY", "fixed",
              "fixed (default): every decode step verifies the drafter's whole block; adaptive: each step verifies "
              "the shape (none, a chain of the walk's first W tokens, with SGLANG_DSPINE_TREE=1 the tree) that "
              "maximises expected tokens per second at the batch's size, from acceptance seen on recent steps and "
              "step times measured on this GPU "
              "(docs/verify_shapes.md; one rank, the tree on SGLang 0.5.17 only; the default cap of 48 running "
              "requests becomes 128)"),
    _Variable("SGLANG_DSPINE_SHAPES", "none,4,8",
              "the shapes SGLANG_DSPINE_VERIFY=adaptive chooses from, comma-separated: 'none' and chain widths "
              "2..B; the block itself is always one of them (unset: none, 4 and 8 where below the block)"),
    _Variable("SGLANG_DSPINE_SPLITKV_VERIFY", "grouped",
              "which kernel the target's chain verify passes read the committed context with, on the triton "
              "attention backend. Unset or grouped: DSPINE's own kernel for every chain, which reads each KV head's "
              "context once for all the rows and query heads that share it (kernels/verify_attention.py; none "
              "keeps SGLang's decode kernel; unset, it applies where the backend is triton and is skipped, with a "
              "log line, elsewhere); 0: SGLang's serial-prefix extend kernel (SGLang's own choice); 1: SGLang's "
              "split-KV verify kernel for every chain (what SGLang runs on AMD's MI350); below-block: SGLang's "
              "split-KV kernel for the adaptive server's shapes narrower than the block, the block on the extend "
              "kernel. Unset or grouped, a tree verifies on the grouped kernel too (it reads the tree's mask), "
              "otherwise on the extend kernel "
              "(docs/verify_shapes.md; set explicitly, refused at start on another attention backend, and "
              "below-block without SGLANG_DSPINE_VERIFY=adaptive)"),
    _Variable("SGLANG_DSPINE_UPKEEP_GRAPHS", False,
              "1: under SGLANG_DSPINE_VERIFY=adaptive, the drafter's context upkeep after a step narrower than the "
              "block (none, a short chain) replays a CUDA graph per width and captured batch size instead of "
              "DFlash's eager writer (its GPU tests pass; at Qwen3-8B geometry it measured 0.98-1.00x the eager "
              "writer, 5a5e0e7); 0 (default): the eager writer "
              "(docs/verify_shapes.md)"),
    _Variable("SGLANG_DSPINE_STACKS_ON_SIGUSR1", False,
              "1: `kill -USR1 <scheduler pid>` prints every thread's Python stack to the server log"),
    _Variable("DSPINE_SUITES_DIR", None,
              "folder the benchmark suite loaders read local copies of the paper's suites from"),
)


class _Env:
    @property
    def kernels(self) -> bool:
        return _flag("SGLANG_DSPINE_KERNELS", True)

    @property
    def tree(self) -> bool:
        return _flag("SGLANG_DSPINE_TREE", False)

    @property
    def adaptive(self) -> bool:
        raw = os.environ.get("SGLANG_DSPINE_VERIFY") or "fixed"
        if raw not in ("fixed", "adaptive"):
            raise ValueError(f"SGLANG_DSPINE_VERIFY: expected fixed or adaptive, found {raw!r}")
        return raw == "adaptive"

    @property
    def verify_shapes(self) -> str | None:
        return os.environ.get("SGLANG_DSPINE_SHAPES") or None

    @property
    def split_kv_verify(self) -> str | None:
        """None (0: the extend kernel), "all" (1: every chain width on SGLang's split-KV kernel), "below-block"
        (the widths narrower than the block) or "grouped" (every chain width, on DSPINE's grouped kernel; unset)."""
        raw = os.environ.get("SGLANG_DSPINE_SPLITKV_VERIFY") or "grouped"
        modes = {"0": None, "1": "all", "below-block": "below-block", "grouped": "grouped"}
        if raw not in modes:
            raise ValueError(f"SGLANG_DSPINE_SPLITKV_VERIFY: expected 0, 1, below-block or grouped, found {raw!r}")
        return modes[raw]

    @property
    def split_kv_verify_set(self) -> bool:
        """Whether SGLANG_DSPINE_SPLITKV_VERIFY was set (a user's explicit choice: refused where it cannot apply)."""
        return bool(os.environ.get("SGLANG_DSPINE_SPLITKV_VERIFY"))

    @property
    def upkeep_graphs(self) -> bool:
        return _flag("SGLANG_DSPINE_UPKEEP_GRAPHS", False)

    @property
    def stacks_on_sigusr1(self) -> bool:
        return _flag("SGLANG_DSPINE_STACKS_ON_SIGUSR1", False)

    @property
    def suites_dir(self) -> str | None:
        return os.environ.get("DSPINE_SUITES_DIR") or None


ENV = _Env()

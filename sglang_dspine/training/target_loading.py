"""The target model and tokenizer that offline commands (data, train, export, eval) and benchmarks load, with
bad input refused in one line naming the flag."""
from __future__ import annotations

import os
import re


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


# `namespace/name`: what transformers fetches from the Hugging Face hub when no such local path exists
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model_dir(flag: str, path: str) -> None:
    """Refuse a target that is not a model directory before transformers reads it (for a file or a missing
    path transformers talks about hub repo ids; for a truncated weight file it names no file)."""
    from ..drafter.checkpoint import INDEX_FILE, MODEL_FILE, model_files, safetensors_shapes
    from ..drafter.config import DrafterConfigError, read_json

    if not os.path.isdir(path):
        if os.path.exists(path):
            raise CLIError(f"{flag} {path}: a file; expected a model directory (config.json and weights)")
        if _HUB_ID.fullmatch(path):
            return  # a hub repo id: transformers fetches it (load_target reports a failure)
        raise CLIError(f"{flag} {path}: no such directory")
    try:
        read_json(os.path.join(path, "config.json"))
        if any(os.path.isfile(os.path.join(path, f)) for f in (MODEL_FILE, INDEX_FILE)):
            for f in model_files(path):
                safetensors_shapes(f)
    except DrafterConfigError as e:
        raise CLIError(f"{flag} {e}") from None


def dtype_of(name: str):
    """The torch dtype a --dtype value names."""
    import torch

    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "fp32": torch.float32, "float32": torch.float32}
    if name not in table:
        raise CLIError(f"--dtype: expected one of {sorted(table)}, found {name!r}")
    return table[name]


def default_device(name: str | None) -> str:
    """The --device value, else cuda where there is one, else cpu."""
    import torch

    return name or ("cuda" if torch.cuda.is_available() else "cpu")


def load_target(path: str, dtype: str | None = None, device: str | None = None):
    """A transformers causal LM from `path` (--target) in eval mode; dtype: bf16 on CUDA, else fp32 by default."""
    import torch
    from transformers import AutoModelForCausalLM

    dev = default_device(device)
    dt = dtype_of(dtype) if dtype else (torch.bfloat16 if dev.startswith("cuda") else torch.float32)
    check_model_dir("--target", path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dt)
    except (OSError, ValueError) as e:
        raise CLIError(f"--target {path}: cannot load a transformers causal LM ({e})") from e
    return model.to(dev).eval()


def load_tokenizer(path: str | None, fallback: str | None):
    """The tokenizer at `path` (--tokenizer; an error if it fails), else at `fallback`, else None."""
    from transformers import AutoTokenizer

    for p in [x for x in (path, fallback) if x]:
        try:
            return AutoTokenizer.from_pretrained(p)
        except (OSError, ValueError, TypeError) as e:
            if p == path:
                raise CLIError(f"--tokenizer {p}: cannot load a tokenizer ({e})") from e
    return None

"""The one JSONL reader: one JSON object per line, blank lines skipped, a bad line named by file and line;
a `.gz` file is read through gzip."""
from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from typing import Any


class DataError(ValueError):
    """An input record or file that cannot be turned into training data."""


def iter_jsonl(path: str, what: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number from 1, record) for each non-blank line of `path`, streamed.

    `what` names the file in the not-found message (e.g. "training data"); a line that is not a JSON object
    raises DataError with `path:line`."""
    if not os.path.isfile(path):
        raise DataError(f"{what + ' ' if what else ''}{path}: not found")
    opener = gzip.open if path.lower().endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, found {type(rec).__name__}")
            yield lineno, rec


def read_jsonl(path: str, what: str = "") -> list[dict[str, Any]]:
    """Every record of `path` (see iter_jsonl)."""
    return [rec for _, rec in iter_jsonl(path, what)]

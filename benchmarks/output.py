"""The benchmarks' one result writer: JSON files written whole (a temporary file, then renamed, so that a run
killed mid-write leaves the previous file), folders made, and a measurement stamped with its provenance
(sglang_dspine.provenance: command, commit, GPU, versions, date) unless it carries one already."""
from __future__ import annotations

import json
import os

from sglang_dspine.provenance import provenance


def write_json(path: str, obj, indent: int | None = 1) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent, ensure_ascii=False)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def write_result(path: str, record: dict, argv: list[str] | None = None, indent: int | None = 1) -> str:
    """`record` at `path` with a "provenance" entry (provenance(argv)) where it has none."""
    if "provenance" not in record and "commit" not in record:
        record = {"provenance": provenance(argv), **record}
    return write_json(path, record, indent)

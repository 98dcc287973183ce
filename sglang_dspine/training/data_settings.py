"""What made a `data` output, recorded beside it (`OUTPUT.settings.json`): a rerun into the same output resumes it
(the ids already written are skipped) only with the same prompts file and the settings that shape a record, and is
refused otherwise naming what differs; records made two ways would be mixed into one file silently."""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from .outputs import read_record
from .target_loading import CLIError

SUFFIX = ".settings.json"
PROMPTS_DIGEST = "prompts sha256"
# Settings recorded but free to change on a resume: they change how fast, not what is written (--limit: a
# rerun may go further into the same prompts).
FREE = {"--prompts", "--limit", "--backend", "--batch-size", "--hf-batch-size", "--tp-size", "--dp-size",
        "--mem-fraction-static", "--dtype", "--device", "--max-seconds"}


def settings_path(output: str) -> str:
    return output + SUFFIX


def digest(path: str) -> str | None:
    """sha256 of a prompts file's bytes (None for a `datasets` name): the same file under another name resumes,
    another file under the same name does not."""
    if not os.path.isfile(path):
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _differences(now: dict[str, Any], was: dict[str, Any]) -> list[str]:
    out = []
    if now.get(PROMPTS_DIGEST) != was.get(PROMPTS_DIGEST) or (now[PROMPTS_DIGEST] is None
                                                              and now["--prompts"] != was.get("--prompts")):
        out.append(f"--prompts: another file ({now['--prompts']}; the output's: {was.get('--prompts')})")
    for key, value in now.items():
        if key in FREE or key == PROMPTS_DIGEST or key not in was or value == was[key]:  # not in was: a newer flag
            continue
        if key == "--target" and os.path.realpath(value) == os.path.realpath(str(was[key])):
            continue
        out.append(f"{key} {value} (the output's: {was[key]})")
    return out


def check_and_record(output: str, settings: dict[str, Any]) -> None:
    """Refuse (CLIError) an existing `output` made otherwise than `settings` say; record them for a new one."""
    side = settings_path(output)
    if os.path.isfile(output) and os.path.getsize(output) > 0:
        if not os.path.isfile(side):
            raise CLIError(f"--output {output}: holds records but no {os.path.basename(side)} saying what made "
                           "them; give another --output, or remove it to make it again")
        was = read_record("--output", side, "give another --output")
        diffs = _differences(settings, was)
        if diffs:
            raise CLIError(f"--output {output}: made with other settings: {'; '.join(diffs)}; to add to it give "
                           "the same ones, else another --output")
        return
    with open(side, "w", encoding="utf-8") as f:
        json.dump(settings, f, indent=2)

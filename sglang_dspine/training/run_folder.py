"""A training run's folder (`--output-dir`) met again: what it holds decides whether a `train` starts, resumes or is
refused, so that the weights in a folder and the `train_config.json` beside them always come from the same
settings. Checked before the target loads (minutes for an 8B one).

- empty or absent: a new run;
- an unfinished run (checkpoints, no `final/`: stopped by a signal, a crash or a deadline): resumed, as a rerun of
  the same command (what the interrupted run's message says to do);
- a finished run (`final/`): refused unless `--resume` (nothing left to do: reported, nothing rewritten) or
  `--overwrite` (its files removed, a new run);
- resuming with a setting other than the run's is refused naming the flag: the weights would be trained under
  two settings while train_config.json names one.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Any

from .outputs import read_record
from .target_loading import CLIError
from .train_config import TrainConfig, flag

CONFIG_FILE = "train_config.json"
# Settings that change how a run is watched, saved or where it runs, not what it trains: a resumed run may
# change them.
RUNTIME = {"output_dir", "progress", "tensorboard", "wandb_project", "run_name", "log_every", "save_every",
           "save_minutes", "keep_checkpoints", "device", "resume", "save"}
PATHS = {"target", "data", "init", "tokenizer", "chat_template"}
NEGATED = {"backbone_loss", "refinement_loss", "alignment_loss", "replacement"}  # flags --no-NAME


def _is_checkpoint(name: str) -> bool:
    return re.fullmatch(r"checkpoint-\d+(\.tmp)?", name) is not None


def run_state(output_dir: str) -> str:
    """"none", "unfinished" or "finished" (see the module's docstring)."""
    if not os.path.isdir(output_dir):
        return "none"
    if os.path.isfile(os.path.join(output_dir, "final", "config.json")):
        return "finished"
    names = os.listdir(output_dir)
    return "unfinished" if CONFIG_FILE in names or any(_is_checkpoint(n) for n in names) else "none"


def _same(name: str, now: Any, was: Any) -> bool:
    if now == was:
        return True
    # the same file named from another working directory, or as an absolute path
    return (name in PATHS and isinstance(now, str) and isinstance(was, str)
            and os.path.realpath(now) == os.path.realpath(was))


def _shown(name: str, value: Any) -> str:
    if name == "enable_thinking":
        return {True: "on", False: "off", None: "auto"}[value]
    if name in NEGATED or isinstance(value, bool):
        return "given" if value is (name not in NEGATED) else "not given"
    if value is None:
        return "not given"
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def changed_settings(tc: TrainConfig, recorded: dict[str, Any]) -> list[str]:
    """`--flag now (the run's: then)` for each training setting of `tc` that differs from the recorded run's."""
    now = tc.to_dict()
    out = []
    for name, value in now.items():
        if name in RUNTIME or name not in recorded:  # a field newer than the run's record: nothing to compare
            continue
        if name == "dspine":
            was = recorded["dspine"] or {}
            for key in sorted(set(value) | set(was)):
                if not _same(key, value.get(key), was.get(key)):
                    out.append(f"{flag(key)} {_shown(key, value.get(key))} (the run's: {_shown(key, was.get(key))})")
            continue
        if not _same(name, value, recorded[name]):
            shown = {"enable_thinking": "--thinking"}.get(name, "--no-" + name.replace("_", "-") if name in NEGATED
                                                          else flag(name))
            out.append(f"{shown} {_shown(name, value)} (the run's: {_shown(name, recorded[name])})")
    return out


def check_rerun(tc: TrainConfig, resume: bool, overwrite: bool) -> str:
    """What `train` does with `tc.output_dir`: "new", "overwrite", "resume" or "finished" (nothing to do);
    raises CLIError (one line) when it must not train there."""
    d = tc.output_dir
    if os.path.exists(d) and not os.path.isdir(d):
        raise CLIError(f"--output-dir {d}: a file; expected a folder")
    state = run_state(d)
    if state == "none":
        return "new"
    if overwrite:
        return "overwrite"
    if state == "finished" and not resume:
        raise CLIError(f"--output-dir {d}: holds a finished run (final/); --overwrite trains a new one there "
                       "(its files are removed), --resume checks it is the same run, or give another --output-dir")
    path = os.path.join(d, CONFIG_FILE)
    if os.path.isfile(path):
        recorded = read_record("--output-dir", path, "--overwrite trains a new run there")
        diffs = changed_settings(tc, recorded)
        if diffs:
            raise CLIError(f"--output-dir {d}: holds a run trained with other settings: {'; '.join(diffs)}; give "
                           "its settings to resume it, --overwrite to train a new run there, or another --output-dir")
    return "finished" if state == "finished" else "resume"


def clear_run(output_dir: str) -> None:
    """Remove a run's files from its folder (--overwrite): checkpoints, final/, the config, the metrics and
    TensorBoard logs; anything else in the folder is left alone."""
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if _is_checkpoint(name) or name in ("final", "tensorboard", "wandb"):
            shutil.rmtree(path, ignore_errors=True)
        elif name in (CONFIG_FILE, "metrics.jsonl"):
            os.remove(path)

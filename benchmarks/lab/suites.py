"""Prompts of the paper's seven suites, from local files or the `datasets` library.

    gsm8k, math500, humaneval, mbpp, livecodebench, mtbench, arenahard

Each loads as records `{"id", "prompt", "suite", ...}` (MT-Bench and Arena-Hard keep every turn in
`turns`; the prompt is the first turn, which is what an offline evaluation can ask without the model's own
first answer). A suite is looked up, in order:

1. `--path`: a `.jsonl` / `.jsonl.gz` / `.json` (a list, or `{"data"|"rows"|"questions": [...]}`) / `.parquet`
   file, or a directory holding one of the suite's usual file names (or test.jsonl, question.jsonl, ...),
   or a `datasets.save_to_disk` folder;
2. `--data-dir` (or `$DSPINE_SUITES_DIR`): a folder holding one of the suite's usual file names
   (e.g. `gsm8k.jsonl`, `HumanEval.jsonl.gz`, `mt_bench/question.jsonl`, or `<suite>/test.jsonl`), or a
   `datasets.save_to_disk` folder named after the suite;
3. `datasets.load_dataset` on the suite's Hub name (needs the Hub or a local Hugging Face cache).

When none of these gives the suite, `SuiteError` says what was tried and how to provide it.

    python benchmarks/lab/suites.py gsm8k --data-dir ~/suites --limit 80 --out prompts/gsm8k.jsonl
    sglang-dspine eval --target T --drafter D --prompts prompts/gsm8k.jsonl
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_dspine.training.jsonl import DataError, read_jsonl


class SuiteError(RuntimeError):
    """A suite that cannot be loaded from anything given or installed."""


def _s(rec: dict[str, Any], *keys: str) -> str | None:
    for k in keys:
        v = rec.get(k)
        if isinstance(v, str) and v.strip():
            return v
    return None


def _gsm8k(r):
    q = _s(r, "question", "problem", "prompt")
    return q and {"prompt": f"{q}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
                  "answer": r.get("answer")}


def _math500(r):
    q = _s(r, "problem", "question", "prompt")
    return q and {"prompt": f"{q}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
                  "answer": r.get("answer"), "id": r.get("unique_id")}


def _humaneval(r):
    q = _s(r, "prompt")
    return q and {"prompt": "Write a solution to the following problem and make sure that it passes the tests:\n"
                            f"```python\n{q}\n```", "id": r.get("task_id")}


def _mbpp(r):
    q = _s(r, "text", "prompt", "question")
    if not q:
        return None
    tests = r.get("test_list") or []
    t = ("\nYour code should pass these tests:\n" + "\n".join(tests)) if tests else ""
    return {"prompt": f"{q}{t}", "id": r.get("task_id")}


def _livecodebench(r):
    q = _s(r, "question_content", "content", "prompt", "question")
    if not q:
        return None
    title = _s(r, "question_title")
    starter = _s(r, "starter_code")
    p = (f"### {title}\n\n" if title else "") + q
    if starter:
        p += f"\n\nYou will use the following starter code to write the solution:\n```python\n{starter}\n```"
    return {"prompt": p, "id": r.get("question_id")}


def _turns(r) -> list[str]:
    t = r.get("turns")
    if t is None:
        t = r.get("prompt")
    if isinstance(t, str):
        return [t]
    out = []
    for x in t or []:
        if isinstance(x, dict):
            x = x.get("content") or x.get("value")
        if isinstance(x, str):
            out.append(x)
    return out


def _chat_suite(r):
    turns = _turns(r)
    return turns and {"prompt": turns[0], "turns": turns, "category": r.get("category"),
                      "id": r.get("question_id", r.get("prompt_id", r.get("uid")))}


@dataclass(frozen=True)
class Suite:
    name: str
    hub: tuple[str, str | None, str]  # (path, config, split) for datasets.load_dataset
    files: tuple[str, ...]  # usual local file names (relative to a data dir)
    convert: Callable[[dict[str, Any]], dict[str, Any] | None]
    domain: str


SUITES: dict[str, Suite] = {s.name: s for s in [
    Suite("gsm8k", ("openai/gsm8k", "main", "test"), ("gsm8k.jsonl", "gsm8k/test.jsonl", "gsm8k_test.jsonl"),
          _gsm8k, "math"),
    Suite("math500", ("HuggingFaceH4/MATH-500", None, "test"),
          ("math500.jsonl", "MATH-500/test.jsonl", "math_500.jsonl"), _math500, "math"),
    Suite("humaneval", ("openai/openai_humaneval", None, "test"),
          ("humaneval.jsonl", "HumanEval.jsonl", "HumanEval.jsonl.gz",
                                                                 "humaneval/test.jsonl"), _humaneval, "code"),
    Suite("mbpp", ("google-research-datasets/mbpp", "full", "test"),
          ("mbpp.jsonl", "mbpp/test.jsonl", "mbpp_test.jsonl",
                                                                    "sanitized-mbpp.json"), _mbpp, "code"),
    Suite("livecodebench", ("livecodebench/code_generation_lite", None, "test"),
          ("livecodebench.jsonl", "livecodebench/test.jsonl", "code_generation_lite.jsonl"), _livecodebench, "code"),
    Suite("mtbench", ("HuggingFaceH4/mt_bench_prompts", None, "train"),
          ("mtbench.jsonl", "mt_bench/question.jsonl", "mt_bench.jsonl"), _chat_suite, "chat"),
    Suite("arenahard", ("lmarena-ai/arena-hard-auto-v0.1", None, "train"),
          ("arenahard.jsonl", "arena-hard-v0.1/question.jsonl", "arena_hard/question.jsonl",
           "arena-hard.jsonl"), _chat_suite, "chat"),
]}
ALIASES = {"math-500": "math500", "math_500": "math500", "human_eval": "humaneval", "openai_humaneval": "humaneval",
           "lcb": "livecodebench", "mt-bench": "mtbench", "mt_bench": "mtbench", "arena-hard": "arenahard",
           "arena_hard": "arenahard"}


def suite_of(name: str) -> Suite:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in SUITES:
        raise SuiteError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    return SUITES[key]


# ------------------------------------------------------------------------------------------- reading
def read_records(path: str) -> list[dict[str, Any]]:
    """Records of a JSONL (optionally gzipped), JSON or Parquet file."""
    low = path.lower()
    if low.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise SuiteError(f"{path}: reading Parquet needs pyarrow") from None
        return pq.read_table(path).to_pylist()
    opener = gzip.open if low.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if low.endswith((".json", ".json.gz")) and stripped[:1] in "[{":
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if data is not None:
            if isinstance(data, dict):
                for k in ("data", "rows", "questions", "examples", "test"):
                    if isinstance(data.get(k), list):
                        data = data[k]
                        break
                else:
                    data = [dict(v, id=v.get("id", k)) if isinstance(v, dict) else {"id": k, "prompt": v}
                            for k, v in data.items()]
            if not isinstance(data, list):
                raise SuiteError(f"{path}: expected a JSON list of records")
            return [r for r in data if isinstance(r, dict)]
    try:
        return read_jsonl(path)
    except DataError as e:
        raise SuiteError(str(e)) from None


GENERIC_FILES = ("test.jsonl", "question.jsonl", "data.jsonl", "train.jsonl", "test.json", "test.parquet")


def _find_file(folder: str, suite: Suite, generic: bool = False) -> str | None:
    """One of the suite's usual files in `folder`; generic names (test.jsonl, ...) only where the folder is the
    suite's own (--path DIR, or DATA_DIR/<suite>/)."""
    names = list(suite.files) + [os.path.join(suite.name,
                                              g) for g in GENERIC_FILES] + (list(GENERIC_FILES) if generic else [])
    for rel in names:
        p = os.path.join(folder, rel)
        if os.path.isfile(p):
            return p
    return None


def _from_disk_dataset(folder: str, split: str) -> list[dict[str, Any]] | None:
    if not (os.path.isfile(os.path.join(folder, "dataset_info.json")) or os.path.isfile(os.path.join(folder,
                                                                                                     "dataset_dict.json"))):
        return None
    import datasets

    ds = datasets.load_from_disk(folder)
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[split] if split in ds else ds[next(iter(ds))]
    return [dict(r) for r in ds]


def _convert(suite: Suite, raw: list[dict[str, Any]], source: str, limit: int | None) -> list[dict[str, Any]]:
    out = []
    for i, r in enumerate(raw):
        c = suite.convert(r)
        if not c:
            continue
        rid = c.pop("id", None)
        rid = r.get("id") if rid is None else rid
        out.append({"id": f"{suite.name}:{rid if rid is not None else i}", "suite": suite.name, "domain": suite.domain,
                    **{k: v for k, v in c.items() if v is not None}})
        if limit is not None and len(out) >= limit:
            break
    if not out:
        keys = sorted(raw[0]) if raw else []
        raise SuiteError(f"suite {suite.name}: {source} has no usable records (first record's keys: {keys})")
    seen: set[str] = set()
    for r in out:  # unique ids (sglang-dspine resumes by id)
        base, n = r["id"], 1
        while r["id"] in seen:
            n += 1
            r["id"] = f"{base}#{n}"
        seen.add(r["id"])
    return out


def load_suite(name: str, path: str | None = None, *, data_dir: str | None = None, limit: int | None = None,
               use_datasets: bool = True, split: str | None = None) -> list[dict[str, Any]]:
    """The suite's prompt records (see the module docstring for where they are looked up)."""
    suite = suite_of(name)
    hub_path, hub_config, hub_split = suite.hub
    split = split or hub_split
    tried = []
    if path is not None:
        if os.path.isfile(path):
            return _convert(suite, read_records(path), path, limit)
        if os.path.isdir(path):
            f = _find_file(path, suite, generic=True)
            if f:
                return _convert(suite, read_records(f), f, limit)
            raw = _from_disk_dataset(path, split)
            if raw is not None:
                return _convert(suite, raw, path, limit)
            raise SuiteError(f"suite {suite.name}: --path {path} is a folder without any of {list(suite.files)} "
                             "and is not a datasets.save_to_disk folder")
        raise SuiteError(f"suite {suite.name}: --path {path} does not exist")
    data_dir = data_dir or os.environ.get("DSPINE_SUITES_DIR")
    if data_dir:
        f = _find_file(data_dir, suite)
        if f:
            return _convert(suite, read_records(f), f, limit)
        sub = os.path.join(data_dir, suite.name)
        if os.path.isdir(sub):
            raw = _from_disk_dataset(sub, split)
            if raw is not None:
                return _convert(suite, raw, sub, limit)
        tried.append(f"no {' / '.join(suite.files)} in {data_dir}")
    else:
        tried.append("no --data-dir / $DSPINE_SUITES_DIR")
    if use_datasets:
        try:
            import datasets
        except ImportError:
            tried.append("the `datasets` package is not installed")
        else:
            try:
                ds = datasets.load_dataset(hub_path, hub_config, split=split)
                return _convert(suite, [dict(r) for r in ds], f"datasets:{hub_path}", limit)
            except Exception as e:  # noqa: BLE001 - offline hubs and missing caches end up here
                msg = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                tried.append(f"datasets.load_dataset({hub_path!r}, {hub_config!r}, split={split!r}) failed: {msg}")
    else:
        tried.append("the datasets library was not asked")
    raise SuiteError(
        f"suite {suite.name}: not found ({'; '.join(tried)}). Provide it with --path FILE (JSONL/JSON/Parquet with "
        f"the suite's fields), or put {suite.files[0]} in --data-dir, or run where the Hugging Face Hub "
        f"({hub_path}) or a local datasets cache is available.")


def write_prompts(records: list[dict[str, Any]], out: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("suite", nargs="?", help=f"one of {', '.join(SUITES)} (or 'all')")
    p.add_argument("--path", help="a file or folder with the suite")
    p.add_argument("--data-dir", help="folder with the suites' usual file names (default $DSPINE_SUITES_DIR)")
    p.add_argument("--limit", type=int)
    p.add_argument("--split")
    p.add_argument("--no-datasets", action="store_true", help="never call datasets.load_dataset")
    p.add_argument("--out", help="JSONL to write (for 'all': a folder, one <suite>.jsonl each)")
    p.add_argument("--list", action="store_true", help="list the suites and where they are looked for")
    args = p.parse_args(argv)
    if args.list or not args.suite:
        for s in SUITES.values():
            print(f"{s.name:14s} {s.domain:5s} hub {s.hub[0]}{'/' + s.hub[1] if s.hub[1] else ''} [{s.hub[2]}]; "
                  f"files {', '.join(s.files)}")
        return 0
    names = list(SUITES) if args.suite == "all" else [args.suite]
    rc = 0
    for n in names:
        try:
            recs = load_suite(n, args.path if args.suite != "all" else None, data_dir=args.data_dir, limit=args.limit,
                              use_datasets=not args.no_datasets, split=args.split)
        except SuiteError as e:
            print(f"suites: {e}", file=sys.stderr)
            rc = 2
            continue
        if args.out:
            out = os.path.join(args.out, f"{suite_of(n).name}.jsonl") if args.suite == "all" else args.out
            write_prompts(recs, out)
            print(f"suites: {suite_of(n).name}: {len(recs)} prompts -> {out}")
        else:
            print(f"suites: {suite_of(n).name}: {len(recs)} prompts; first: {json.dumps(recs[0])[:200]}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

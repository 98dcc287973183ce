"""Lab stage 1: a corpus from text already on the machine, plus generated arithmetic word problems.

Three domains, each with a train and a held-out split:

- **code**: Python source files of the machine's site-packages (whole files), and chat pairs
  "function header + docstring" -> "function body" cut out of them with `ast`;
- **prose**: docstrings (modules, classes, functions; long ones only) and package documentation
  (`*.md`, `*.rst`, `*.txt` files and the long descriptions in `*.dist-info/METADATA`), as whole documents
  and as chat pairs "opening" -> "continuation";
- **math**: arithmetic word problems with worked, step-by-step solutions, generated from templates (chat
  pairs "problem" -> "solution").

Held-out splits are deterministic: whole packages (chosen by a hash of the package name, up to
`--heldout-package-frac` of the files, skipping packages too big for that share) and single files (a hash of
the path under `--heldout-file-frac`); math problems come from a separate random stream and never repeat a
training problem. Sizes are bounded by `--max-mb` (split between the domains by `--mix`); files are taken in
a fixed hash order, so a smaller budget gives a spread over packages rather than the first ones
alphabetically.

Outputs under `--out`:
  {code,prose,math}.{train,heldout}.jsonl   documents: {"id", "text"} or {"id", "messages"} (a chat pair)
  prompts/{code,prose,math}.train.jsonl     training prompts (the drafters' data: `sglang-dspine data`)
  prompts/{code,prose,math}.heldout.jsonl   the lab's suites: {"id", "prompt", "reference", "source"}
  prompts/{code,prose,math}.val.jsonl       with --val-prompts: validation prompts from the training split
  prompts/train_mix.jsonl                   the three training prompt files interleaved
  manifest.json                             sizes, sources, split rules (written last: marks the stage done)

    python benchmarks/lab/corpus.py --out lab_out/corpus --max-mb 120
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import re
import site
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

DOMAINS = ("code", "prose", "math")
DOC_SUFFIXES = (".md", ".rst", ".txt")
SKIP_DOC_NAMES = re.compile(r"(licen[cs]e|copying|notice|authors|record|top_level|entry_points|requires|"
                            r"sources|dependency_links|installer|wheel|requested|direct_url|vocab|merges)",
                            re.IGNORECASE)
SKIP_DIRS = {"__pycache__", ".git", "node_modules"}


# ------------------------------------------------------------------------------------------ utilities
def unit_hash(s: str, salt: str = "") -> float:
    """A deterministic number in [0, 1) for a string (md5; independent of PYTHONHASHSEED)."""
    return int.from_bytes(hashlib.md5((salt + s).encode("utf-8")).digest()[:8], "big") / 2.0 ** 64


def site_package_dirs() -> list[str]:
    """The site-packages / dist-packages directories of this Python, deduplicated by real path."""
    cands = list(getattr(site, "getsitepackages", lambda: [])())
    cands += [site.getusersitepackages()] if hasattr(site, "getusersitepackages") else []
    cands += [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))]
    out, seen = [], set()
    for p in cands:
        if p and os.path.isdir(p):
            r = os.path.realpath(p)
            if r not in seen:
                seen.add(r)
                out.append(p)
    return out


def package_of(rel: str) -> str:
    """The distribution-ish name a path under site-packages belongs to (its first path component)."""
    top = rel.replace("\\", "/").split("/", 1)[0]
    for suf in (".dist-info", ".egg-info", ".data"):
        if top.endswith(suf):
            top = top[: -len(suf)].split("-", 1)[0]
    if top.endswith(".py"):
        top = top[:-3]
    return top.lower().replace("-", "_")


def scan(roots: list[str], max_file_bytes: int) -> tuple[list[tuple[str, str, str, int]],
                                                         list[tuple[str, str, str, int]]]:
    """(python files, doc files) as (root, rel path, package, size); each rel path once over all roots."""
    py, docs, seen = [], [], set()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
            for name in filenames:
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)
                if rel in seen:
                    continue
                is_py = name.endswith(".py")
                is_doc = name == "METADATA" or (name.endswith(DOC_SUFFIXES) and not SKIP_DOC_NAMES.search(name))
                if not (is_py or is_doc):
                    continue
                try:
                    size = os.stat(full).st_size
                except OSError:
                    continue
                if size < 64 or size > max_file_bytes:
                    continue
                seen.add(rel)
                (py if is_py else docs).append((root, rel, package_of(rel), size))
    return py, docs


def heldout_packages(files: list[tuple[str, str, str, int]], frac: float) -> set[str]:
    """Whole packages held out: in hash order, as long as they fit in `frac` of the files (big ones skipped)."""
    counts: dict[str, int] = {}
    for _, _, pkg, _ in files:
        counts[pkg] = counts.get(pkg, 0) + 1
    budget = frac * len(files)
    out, used = set(), 0
    for pkg in sorted(counts, key=lambda p: unit_hash(p, "pkg")):
        if used + counts[pkg] <= budget:
            out.add(pkg)
            used += counts[pkg]
    return out


def read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "\x00" in text:
        return None
    return text


# --------------------------------------------------------------------------------------- code & prose
def _cut_functions(lines: list[str], tree: ast.AST, max_prompt_chars: int
                   ) -> list[tuple[str, str, str]]:
    """(name, header + docstring, body) of functions with a docstring and a body after it, dedented."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if len(body) < 2 or not (isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                                              ast.Constant)
                                 and isinstance(body[0].value.value, str)):
            continue
        start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
        doc_end = body[0].end_lineno
        end = node.end_lineno
        if doc_end is None or end is None or end - doc_end < 2 or end - doc_end > 60:
            continue
        head = lines[start:doc_end]
        rest = lines[doc_end:end]
        indent = len(head[0]) - len(head[0].lstrip())
        if any(ln.strip() and len(ln) - len(ln.lstrip()) < indent for ln in head + rest):
            continue
        head_s = "\n".join(ln[indent:] for ln in head)
        body_s = "\n".join(ln[indent:] if ln.strip() else "" for ln in rest).rstrip()
        if len(head_s) > max_prompt_chars or len(head_s) < 40 or len(body_s) < 40 or len(body_s) > 3000:
            continue
        out.append((node.name, head_s, body_s))
    return out


def _docstrings(tree: ast.AST, min_chars: int) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= min_chars:
                out.append(doc.strip())
    return out


def process_py(args: tuple[str, str, int, int]) -> dict[str, Any] | None:
    """One Python file -> its text, cut functions and long docstrings (worker; no shared state)."""
    path, rel, max_prompt_chars, min_doc_chars = args
    text = read_text(path)
    if text is None or not text.strip():
        return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return {"rel": rel, "text": text, "functions": [], "docstrings": []}
    lines = text.splitlines()
    try:
        funcs = _cut_functions(lines, tree, max_prompt_chars)
        docs = _docstrings(tree, min_doc_chars)
    except RecursionError:
        funcs, docs = [], []
    return {"rel": rel, "text": text, "functions": funcs, "docstrings": docs}


_METADATA_HEADER = re.compile(r"^[A-Za-z][A-Za-z0-9-]*: ")


def doc_text(path: str, name: str) -> str | None:
    text = read_text(path)
    if text is None:
        return None
    if name == "METADATA":  # RFC-822 headers, a blank line, then the long description
        head, sep, body = text.partition("\n\n")
        if not sep or not all(_METADATA_HEADER.match(ln) or ln.startswith((" ",
                                                                           "\t")) for ln in head.splitlines() if ln):
            return None
        text = body
    text = text.replace("\r\n", "\n").strip()
    return text or None


def split_opening(text: str, opening_chars: int, continuation_chars: int) -> tuple[str, str] | None:
    """(opening, continuation) of a prose document, cut at whitespace."""
    if len(text) < opening_chars + 80:
        return None
    cut = text.rfind(" ", opening_chars // 2, opening_chars)
    nl = text.rfind("\n", opening_chars // 2, opening_chars)
    cut = max(cut, nl)
    if cut <= 0:
        cut = opening_chars
    opening, rest = text[:cut].rstrip(), text[cut:]
    rest = rest[:continuation_chars]
    end = max(rest.rfind("\n"), rest.rfind(". "))
    if end > len(rest) // 2:
        rest = rest[: end + 1]
    rest = rest.rstrip()
    if len(rest.strip()) < 40:
        return None
    return opening, rest


# ---------------------------------------------------------------------------------------------- math
NAMES = ["Maya", "Liam", "Ava", "Noah", "Emma", "Omar", "Sofia", "Ravi", "Chen", "Lucas", "Zara", "Ines", "Kofi",
         "Hana", "Mateo", "Priya", "Jonas", "Leila", "Tomas", "Yuki", "Amara", "Felix", "Nora", "Diego"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "cookies", "pencils", "cards", "shells", "stamps",
         "beads", "candles", "plums", "balloons", "bolts", "tickets"]
CONTAINERS = ["boxes", "bags", "packs", "jars", "crates", "baskets"]
FRIENDS = ["a friend", "a neighbour", "a classmate", "her brother", "his sister", "a teacher"]


def _pronoun(name: str) -> tuple[str, str]:
    she = {"Maya", "Ava", "Emma", "Sofia", "Zara", "Ines", "Hana", "Priya", "Leila", "Yuki", "Amara", "Nora"}
    return ("She", "her") if name in she else ("He", "his")


def _story_problem(r: random.Random) -> tuple[str, list[str], int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    he, _ = _pronoun(name)
    n = r.randint(3, 60)
    text = [f"{name} has {n} {item}."]
    steps: list[str] = []
    for _ in range(r.randint(2, 4)):
        op = r.choice(["buy", "get", "give", "double", "share", "lose", "triple"])
        if op == "buy":
            k, m, c = r.randint(2, 9), r.randint(2, 12), r.choice(CONTAINERS)
            text.append(f"{he} buys {k} {c} with {m} {item} in each.")
            steps.append(f"{name} buys {k} × {m} = {k * m} {item}.")
            steps.append(f"Now {he.lower()} has {n} + {k * m} = {n + k * m} {item}.")
            n += k * m
        elif op == "get":
            m = r.randint(2, 40)
            text.append(f"{r.choice(FRIENDS).capitalize()} gives {name} {m} more {item}.")
            steps.append(f"After getting {m} more, {name} has {n} + {m} = {n + m} {item}.")
            n += m
        elif op == "give" and n > 2:
            m = r.randint(1, n - 1)
            text.append(f"{he} gives {m} {item} to {r.choice(FRIENDS)}.")
            steps.append(f"After giving away {m}, {name} has {n} − {m} = {n - m} {item}.")
            n -= m
        elif op == "lose" and n > 2:
            m = r.randint(1, n - 1)
            text.append(f"{he} loses {m} of them.")
            steps.append(f"After losing {m}, {name} has {n} − {m} = {n - m} {item}.")
            n -= m
        elif op == "double" and n < 500:
            text.append(f"Then the number of {item} {name} has doubles.")
            steps.append(f"Doubling gives {n} × 2 = {n * 2} {item}.")
            n *= 2
        elif op == "triple" and n < 300:
            text.append(f"Then {he.lower()} ends up with three times as many {item}.")
            steps.append(f"Three times as many is {n} × 3 = {n * 3} {item}.")
            n *= 3
        elif op == "share":
            ks = [k for k in range(2, 9) if n % k == 0 and n // k >= 1]
            if not ks:
                continue
            k = r.choice(ks)
            text.append(f"{he} splits the {item} into {k} equal groups and keeps one group.")
            steps.append(f"One group has {n} ÷ {k} = {n // k} {item}.")
            n //= k
    text.append(f"How many {item} does {name} have now?")
    return " ".join(text), steps, n


def _shop_problem(r: random.Random) -> tuple[str, list[str], int]:
    name = r.choice(NAMES)
    he, _ = _pronoun(name)
    goods = r.sample(["notebooks", "pens", "sandwiches", "lamps", "shirts", "mugs", "plants", "batteries"],
                     r.randint(2, 3))
    text, steps, total = [f"{name} goes shopping."], [], 0
    for g in goods:
        k, p = r.randint(2, 9), r.randint(2, 25)
        text.append(f"{he} buys {k} {g} at ${p} each.")
        steps.append(f"The {g} cost {k} × ${p} = ${k * p}.")
        total += k * p
    parts = " + ".join(f"${s.split('= $')[1][:-1]}" for s in steps)
    steps.append(f"Altogether {he.lower()} spends {parts} = ${total}.")
    if r.random() < 0.5:
        paid = ((total // 50) + 1 + r.randint(0, 2)) * 50
        text.append(f"{he} pays with ${paid}. How much change does {he.lower()} get?")
        steps.append(f"The change is ${paid} − ${total} = ${paid - total}.")
        return " ".join(text), steps, paid - total
    text.append(f"How much does {he.lower()} spend in total?")
    return " ".join(text), steps, total


def _rate_problem(r: random.Random) -> tuple[str, list[str], int]:
    name = r.choice(NAMES)
    he, _ = _pronoun(name)
    if r.random() < 0.5:
        v, h1, h2 = r.randint(20, 90), r.randint(1, 6), r.randint(1, 5)
        text = (f"{name} drives at {v} km per hour for {h1} hours, then at {v + 10} km per hour for {h2} hours. "
                f"How many kilometres does {he.lower()} drive?")
        steps = [f"First part: {v} × {h1} = {v * h1} km.", f"Second part: {v + 10} × {h2} = {(v + 10) * h2} km.",
                 f"In total: {v * h1} + {(v + 10) * h2} = {v * h1 + (v + 10) * h2} km."]
        return text, steps, v * h1 + (v + 10) * h2
    w, d, rate = r.randint(2, 8), r.randint(2, 6), r.randint(8, 30)
    text = (f"{name} works {w} hours a day for {d} days and earns ${rate} per hour. "
            f"How much does {he.lower()} earn?")
    steps = [f"{name} works {w} × {d} = {w * d} hours.", f"{he} earns {w * d} × ${rate} = ${w * d * rate}."]
    return text, steps, w * d * rate


def _geometry_problem(r: random.Random) -> tuple[str, list[str], int]:
    a, b = r.randint(2, 30), r.randint(2, 30)
    if r.random() < 0.5:
        text = f"A rectangle is {a} metres long and {b} metres wide. What is its perimeter in metres?"
        steps = [f"The perimeter is 2 × ({a} + {b}).", f"{a} + {b} = {a + b}.", f"2 × {a + b} = {2 * (a + b)}."]
        return text, steps, 2 * (a + b)
    c = r.randint(2, 9)
    text = (f"A garden is {a} metres by {b} metres. Tiles cost ${c} per square metre. "
            f"How much do tiles for the whole garden cost?")
    steps = [f"The area is {a} × {b} = {a * b} square metres.", f"The tiles cost {a * b} × ${c} = ${a * b * c}."]
    return text, steps, a * b * c


def math_problem(r: random.Random) -> tuple[str, str, int]:
    """(problem, worked solution, answer)."""
    gen = r.choices([_story_problem, _shop_problem, _rate_problem, _geometry_problem], weights=[4, 2, 1, 1])[0]
    problem, steps, answer = gen(r)
    solution = "\n".join(steps + [f"The answer is {answer}."])
    return problem, solution, answer


def math_split(n_train: int, n_heldout: int, seed: int) -> tuple[list[tuple[str, str, int]],
                                                                 list[tuple[str, str, int]]]:
    """Train problems from one stream; held-out ones from another, never equal to a training problem."""
    seen: set[str] = set()

    def draw(stream: str, n: int, tries: int) -> list[tuple[str, str, int]]:
        r, out = random.Random(f"{stream}-{seed}"), []
        for _ in range(tries):
            if len(out) >= n:
                break
            p = math_problem(r)
            if p[0] not in seen:
                seen.add(p[0])
                out.append(p)
        return out

    train = draw("math-train", n_train, n_train * 3)
    held = draw("math-heldout", n_heldout, n_heldout * 20)
    return train, held


# --------------------------------------------------------------------------------------------- build
class Writer:
    def __init__(self, path: str):
        self.path, self.n, self.bytes = path, 0, 0
        self.f = open(path + ".tmp", "w", encoding="utf-8")

    def write(self, rec: dict[str, Any]) -> None:
        line = json.dumps(rec, ensure_ascii=False)
        self.f.write(line + "\n")
        self.n += 1
        self.bytes += len(line)

    def close(self) -> None:
        self.f.close()
        os.replace(self.path + ".tmp", self.path)


def interleave(lists: list[list[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    its = [iter(x) for x in lists]
    while its:
        nxt = []
        for it in its:
            v = next(it, None)
            if v is not None:
                yield v
                nxt.append(it)
        its = nxt


def build(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.time()
    out = args.out
    os.makedirs(os.path.join(out, "prompts"), exist_ok=True)
    roots = args.source or site_package_dirs()
    if not roots:
        raise SystemExit("corpus: no site-packages directory found; give --source DIR")
    budget = int(args.max_mb * 1e6)
    mix = dict(zip(DOMAINS, [float(x) for x in args.mix.split(",")]))
    total_mix = sum(mix.values())
    share = {d: budget * mix[d] / total_mix for d in DOMAINS}

    py, docs = scan(roots, int(args.max_file_kb * 1024))
    held_pkgs = heldout_packages(py + docs, args.heldout_package_frac)

    def is_heldout(rel: str, pkg: str) -> bool:
        return pkg in held_pkgs or unit_hash(rel, "file") < args.heldout_file_frac

    # code: files in hash order up to the code share (the held-out part counted too)
    py.sort(key=lambda x: unit_hash(x[1], "order"))
    chosen, used = [], 0
    for root, rel, pkg, size in py:
        if used >= share["code"]:
            break
        chosen.append((root, rel, pkg, size))
        used += size
    w = {(d, s): Writer(os.path.join(out, f"{d}.{s}.jsonl")) for d in DOMAINS for s in ("train", "heldout")}
    prompts: dict[tuple[str, str], list[dict[str, Any]]] = {(d, s): [] for d in DOMAINS for s in ("train", "heldout")}
    prose_used = 0
    n_files = {"train": 0, "heldout": 0}
    pkgs_seen: dict[str, set[str]] = {"train": set(), "heldout": set()}
    jobs = [(os.path.join(root, rel), rel, args.max_prompt_chars, args.min_doc_chars) for root, rel, _, _ in chosen]
    pkg_of = {rel: pkg for _, rel, pkg, _ in chosen}
    workers = max(1, args.workers or (os.cpu_count() or 1))
    results: Iterable[dict[str, Any] | None]
    if workers > 1 and len(jobs) > 64:
        ex = ProcessPoolExecutor(workers)
        results = ex.map(process_py, jobs, chunksize=32)
    else:
        ex = None
        results = map(process_py, jobs)
    for res in results:
        if res is None:
            continue
        rel = res["rel"]
        pkg = pkg_of[rel]
        split = "heldout" if is_heldout(rel, pkg) else "train"
        n_files[split] += 1
        pkgs_seen[split].add(pkg)
        w["code", split].write({"id": f"code:{rel}", "text": res["text"]})
        for name, head, body in res["functions"]:
            rid = f"code:{rel}:{name}:{unit_hash(head, 'f'):.8f}"
            if split == "train":
                w["code", "train"].write({"id": rid, "messages": [{"role": "user", "content": head},
                                                                   {"role": "assistant", "content": body}]})
            prompts["code", split].append({"id": rid, "prompt": head, "reference": body, "source": rel})
        for doc in res["docstrings"]:
            if prose_used >= share["prose"]:
                break
            prose_used += _add_prose(w, prompts, split, f"prose:{rel}:{unit_hash(doc, 'd'):.8f}", rel, doc, args)
    if ex is not None:
        ex.shutdown()
    # prose: documentation files in hash order until the prose share is full
    docs.sort(key=lambda x: unit_hash(x[1], "order"))
    n_docs = 0
    for root, rel, pkg, _ in docs:
        if prose_used >= share["prose"]:
            break
        text = doc_text(os.path.join(root, rel), os.path.basename(rel))
        if not text or len(text) < args.min_doc_chars:
            continue
        text = text[: args.max_doc_chars]
        split = "heldout" if is_heldout(rel, pkg) else "train"
        pkgs_seen[split].add(pkg)
        n_docs += 1
        prose_used += _add_prose(w, prompts, split, f"prose:{rel}", rel, text, args)
    # math: as many problems as the math share holds (≈ 400 bytes of JSON each)
    n_math = max(8, int(share["math"] / 400))
    train_p, held_p = math_split(n_math, args.suite_size * 4 + 64, args.seed)
    for split, problems in (("train", train_p), ("heldout", held_p)):
        for i, (q, a, ans) in enumerate(problems):
            rid = f"math:{split}:{i}"
            w["math", split].write({"id": rid, "messages": [{"role": "user", "content": q},
                                                            {"role": "assistant", "content": a}]})
            prompts["math", split].append({"id": rid, "prompt": q, "reference": a, "answer": ans})
    for x in w.values():
        x.close()

    # a tiny budget can leave a domain without held-out prompts: then a few training prompts stand in (the
    # target has seen them; the manifest says so)
    fallback = []
    for d in DOMAINS:
        if not prompts[d, "heldout"] and len(prompts[d, "train"]) > 1:
            k = max(1, min(args.suite_size, len(prompts[d, "train"]) // 4))
            prompts[d, "heldout"] = prompts[d, "train"][-k:]
            prompts[d, "train"] = prompts[d, "train"][:-k]
            fallback.append(d)
            print(f"corpus: warning: no held-out {d} prompts at this budget; {k} training prompts stand in",
                  file=sys.stderr)
    # prompt files: a fixed-seed sample of each, suites from the held-out splits
    counts: dict[str, Any] = {}
    train_lists = []
    for d in DOMAINS:
        for s, n in (("train", args.train_prompts), ("heldout", args.suite_size)):
            recs = list({r["id"]: r for r in prompts[d, s]}.values())  # a text seen twice in one file: one prompt
            random.Random(f"{d}-{s}-{args.seed}").shuffle(recs)
            files = {s: recs[:n]}
            if s == "train" and args.val_prompts:
                # validation: the shuffled list's tail, never among the training prompts (which stay the first n
                # whenever there are n + val_prompts)
                v = min(args.val_prompts, max(len(recs) - 1, 0))
                files = {"train": recs[: min(n, len(recs) - v)], "val": recs[len(recs) - v:]}
            for name, part in files.items():
                with open(os.path.join(out, "prompts", f"{d}.{name}.jsonl"), "w", encoding="utf-8") as f:
                    for r in part:
                        f.write(json.dumps({"domain": d, **r}, ensure_ascii=False) + "\n")
                counts[f"prompts.{d}.{name}"] = len(part)
            if s == "train":
                train_lists.append(files["train"])
    with open(os.path.join(out, "prompts", "train_mix.jsonl"), "w", encoding="utf-8") as f:
        for r in interleave(train_lists):
            f.write(json.dumps({"id": r["id"], "prompt": r["prompt"], "domain": r["id"].split(":", 1)[0]},
                               ensure_ascii=False) + "\n")
    manifest = {
        "roots": roots,
        "max_mb": args.max_mb, "mix": mix, "seed": args.seed,
        "heldout_package_frac": args.heldout_package_frac, "heldout_file_frac": args.heldout_file_frac,
        "heldout_packages": sorted(held_pkgs),
        "python_files_available": len(py), "doc_files_available": len(docs),
        "python_files_used": n_files, "doc_files_used": n_docs,
        "packages": {s: len(v) for s, v in pkgs_seen.items()},
        "documents": {f"{d}.{s}": w[d, s].n for d, s in w},
        "megabytes": {f"{d}.{s}": round(w[d, s].bytes / 1e6, 3) for d, s in w},
        **counts, "heldout_fallback": fallback,
        "seconds": round(time.time() - t0, 2),
    }
    for d in DOMAINS:
        if counts[f"prompts.{d}.heldout"] == 0 or counts[f"prompts.{d}.train"] == 0:
            raise SystemExit(f"corpus: no {d} prompts in a split ({counts}); raise --max-mb or the held-out fractions")
    with open(os.path.join(out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def _add_prose(w, prompts, split: str, rid: str, rel: str, text: str, args) -> int:
    w["prose", split].write({"id": rid, "text": text})
    pair = split_opening(text, args.opening_chars, args.continuation_chars)
    if pair is not None:
        opening, cont = pair
        if split == "train":
            w["prose", "train"].write({"id": rid + ":chat", "messages": [{"role": "user", "content": opening},
                                                                        {"role": "assistant", "content": cont}]})
        prompts["prose", split].append({"id": rid, "prompt": opening, "reference": cont, "source": rel})
    return len(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--source", action="append", help="directory of Python sources (repeatable; default: site-packages)")
    p.add_argument("--max-mb", type=float, default=120.0, help="total text budget over the three domains (MB)")
    p.add_argument("--mix", default="0.6,0.25,0.15", help="shares of code,prose,math in --max-mb")
    p.add_argument("--max-file-kb", type=float, default=256.0, help="skip files larger than this")
    p.add_argument("--heldout-package-frac", type=float, default=0.04, help="share of files in held-out packages")
    p.add_argument("--heldout-file-frac", type=float, default=0.03, help="share of other files held out")
    p.add_argument("--train-prompts", type=int, default=4000, help="training prompts per domain (at most)")
    p.add_argument("--suite-size", type=int, default=64, help="held-out prompts per suite (at most)")
    p.add_argument("--val-prompts", type=int, default=0,
                   help="validation prompts per domain, drawn from the training split but not among the training "
                        "prompts (prompts/DOMAIN.val.jsonl): for choosing settings without the held-out suites")
    p.add_argument("--max-prompt-chars", type=int, default=1200, help="longest function header + docstring")
    p.add_argument("--min-doc-chars", type=int, default=300, help="shortest docstring / doc file used as prose")
    p.add_argument("--max-doc-chars", type=int, default=20000, help="doc files are cut to this length")
    p.add_argument("--opening-chars", type=int, default=300, help="prose prompts: length of the opening")
    p.add_argument("--continuation-chars", type=int, default=1200, help="prose chat pairs: continuation length")
    p.add_argument("--workers", type=int, default=0, help="parser processes (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if manifest.json exists")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    man = os.path.join(args.out, "manifest.json")
    if os.path.isfile(man) and not args.force:
        print(f"corpus: {man} exists, skipped (--force rebuilds)")
        return 0
    m = build(args)
    print("corpus: " + json.dumps({k: m[k] for k in ("documents", "megabytes", "python_files_used", "doc_files_used",
                                                      "seconds")}))
    print("corpus: prompts " + json.dumps({k: v for k, v in m.items() if k.startswith("prompts.")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

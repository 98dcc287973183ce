"""The lab pipeline, stage by stage: corpus -> tokenizer -> target -> data -> train -> export -> eval -> report.

Each stage is one command (printed as it runs), skips itself when its output exists (`--force STAGE` redoes
it) and prints a short summary. Everything lands under `--out` (default `lab_out/`), the results JSON too
unless `--results DIR` puts it elsewhere (e.g. `benchmarks/results/`, to commit it), and `--pack DIR` writes
the built models (target + tokenizer, the two exported drafters, the suites' prompts, the results) as
`lab_models.tar.gz`, split into parts of at most 15 MB (`cat lab_models.tar.gz.part* | tar xz` puts them back
together).

  stage      command                                                   output
  corpus     benchmarks/lab/corpus.py                                  OUT/corpus (train/held-out, suites)
  tokenizer  benchmarks/lab/tokenizer.py                               OUT/tokenizer
  target     benchmarks/lab/target.py                                  OUT/target (HF model dir, SGLang-servable)
  data       sglang-dspine data (target regenerates the responses)     OUT/data/train.jsonl
  train      sglang-dspine train --kind dflash / --kind dspine          OUT/runs/{dflash,dspine}
  export     sglang-dspine export (bf16)                               OUT/drafters/{dflash,dspine}
  eval       sglang-dspine eval, per drafter × suite × temperature     OUT/eval/*.json (offline τ)
  report     results JSON (+ --pack)                                   OUT/lab_<preset>.json (or --results)

Presets: `tiny` (CPU, tests: < 3 minutes on 2 cores), `budget` (one H200; run detached by
`scripts/device/lab_gpu.sh`), `full` (one H200, stage by stage: the target gets its 7 minutes, more data and
steps), `second` (one H200 lease, `scripts/device/lab2.sh`: a 46M target trained 8 minutes, 5-layer drafters
and the grid of grid.py: curve, seeds, depth, the DFlash -> DSpine upgrade). Any preset value can be overridden
with `--set key=value` (e.g. `--set target_seconds=120 --set
train_steps=300`). `--set deadline_s=S` kills a step still running S seconds after the start; the report
(marked `failed`) and the pack are written anyway.
Timings on an H200 (benchmarks/results): `lab_budget.json`, 400 training steps with the loss in chunks of 128
blocks, 609 s in all (corpus 7, tokenizer 10, target 213, data 69, two drafters side by side 146, export 16,
eval 139 s); `train_step_gpu_chunk*.json`, a DSpine step in 329 ms with chunks of 128 blocks and 68 ms in one
chunk. The budget preset trains 2000 steps in one chunk (`chunk_blocks=0`; same loss, more memory), about the
time 400 steps take in chunks; it has no end-to-end timing of its own.

    python benchmarks/lab/run.py --preset tiny --out /tmp/lab_tiny
    python benchmarks/lab/run.py --preset budget --out lab_out --pack $OUT --results $OUT
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/lab/x.py) or loaded by its path: the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
STAGES = ["corpus", "tokenizer", "target", "data", "train", "export", "eval", "report"]
KINDS = ("dflash", "dspine")
SUITES = ("code", "math", "prose")

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        corpus_mb=1.5, train_prompts=40, suite_size=4, corpus_workers=1,
        vocab=512, tokenizer_mb=1.0,
        target_args=["--tiny"], target_seconds=10.0, target_steps=60,
        gen_tokens=40, gen_batch=64, data_seconds=None, max_prompt_len=192,
        draft_layers=2, block_size=8, target_layer_ids="1,2", transfer_rank=16, message_size=8, top_k=4,
        train_steps=30, train_batch=4, num_anchors=16, max_length=256, train_lr=3e-3, chunk_blocks=128,
        eval_limit=3, eval_tokens=24, temperatures="0", threads=1, jobs=1, deadline_s=None,
    ),
    "budget": dict(
        corpus_mb=160.0, train_prompts=2000, suite_size=64, corpus_workers=0,
        vocab=8192, tokenizer_mb=24.0,
        target_args=[], target_seconds=180.0,
        gen_tokens=192, gen_batch=768, data_seconds=75.0, max_prompt_len=448,
        draft_layers=2, block_size=16, target_layer_ids=None, transfer_rank=96, message_size=48, top_k=16,
        train_steps=2000, train_batch=16, num_anchors=128, max_length=640, train_lr=1e-3, chunk_blocks=0,
        eval_limit=40, eval_tokens=128, temperatures="0,1", threads=0, jobs=12, deadline_s=None,
    ),
    # The second edition (one H200 lease, run detached by scripts/device/lab2.sh): a 46M-parameter target trained
    # 8 minutes (lr 1e-3: 2e-3, the smaller targets' rate, diverges at this size); drafters shaped like
    # SpecForge's qwen3-8b-dspine (5 layers, replacement in the first 3, block 16, lr 6e-4 with 4% warm-up and
    # cosine decay, gamma 7, alignment warm-up 146 steps; transfer rank H/4 and message size half of it, the
    # trainer's defaults, = 128/64 here; anchors at SpecForge's density, 512 in 3072 tokens -> 128 in 640);
    # DFlash on the same everything; the grid (grid.py): a training-length curve, a second seed, 2 vs 5 layers,
    # the upgrade. Sized to the lease from measured step costs (benchmarks/lab/README.md): 600 steps of 16
    # sequences (the 9,000 regenerated, about once), 4 trainings at a time, evaluations after them.
    "second": dict(
        corpus_mb=300.0, train_prompts=3000, suite_size=64, corpus_workers=0,
        vocab=8192, tokenizer_mb=32.0,
        target_args=["--hidden", "512", "--layers", "12", "--heads", "8", "--kv-heads", "4", "--head-dim", "64",
                     "--intermediate", "1536", "--batch-size", "64", "--lr", "1e-3"],
        target_seconds=480.0,
        gen_tokens=192, gen_batch=1024, data_seconds=75.0, max_prompt_len=448,
        draft_layers=5, block_size=16, target_layer_ids=None, transfer_rank=None, message_size=None, top_k=16,
        train_steps=600, train_batch=16, num_anchors=128, max_length=640, train_lr=6e-4, chunk_blocks=0,
        eval_limit=16, eval_tokens=80, temperatures="0,1", threads=0, jobs=16, deadline_s=None,
        suites="code,math,prose,humaneval", curve_steps="150,300", seeds="1", depth_layers="2", depth_steps=300,
        upgrade_frac=0.15, grid_temperatures="0", eval_jobs=16, train_jobs=4, step_threads=2,
        eval_after_training=True, walk_off="dspine,dspine_seed1",
    ),
    "full": dict(
        corpus_mb=200.0, train_prompts=6000, suite_size=128, corpus_workers=0,
        vocab=8192, tokenizer_mb=40.0,
        target_args=[], target_seconds=420.0,
        gen_tokens=256, gen_batch=1024, data_seconds=480.0, max_prompt_len=512,
        draft_layers=2, block_size=16, target_layer_ids=None, transfer_rank=96, message_size=48, top_k=16,
        train_steps=2000, train_batch=16, num_anchors=128, max_length=768, train_lr=1e-3, chunk_blocks=0,
        eval_limit=128, eval_tokens=256, temperatures="0,1", threads=0, jobs=12, deadline_s=None,
    ),
}

# The recipe lab (benchmarks/lab/recipe.py reads it; docs/training_recipe.md): the second edition's corpus,
# target and drafter shape, with 3x the training prompts (9,600 a domain, regenerated in batches of 3,072) and
# 16 validation prompts a domain set apart; the main pair trained 3x longer (1,800 steps, DSpine on the `ce`
# recipe) at seeds 0 and 1; and two 600-step DSpine arms, SpecForge's recipe and `ce`, evaluated on the
# validation prompts too, where the default recipe is chosen. No curve, depth, upgrade or walk-off. Evaluations:
# one process per drafter and temperature over every suite (eval_suites.py), 12 prompts a suite, 24 on math.
PRESETS["recipe"] = {
    **{k: v for k, v in PRESETS["second"].items()
       if k not in ("curve_steps", "depth_layers", "depth_steps", "upgrade_frac", "grid_temperatures", "walk_off")},
    "train_prompts": 9600, "val_prompts": 16, "gen_batch": 3072, "data_seconds": 110.0, "train_steps": 1800,
    "eval_limit": 12, "suite_limits": "math=24", "suites": "math,code,prose,humaneval", "dspine_recipe": "ce",
    "arms": [{"name": "dspine_specforge_s600", "kind": "dspine", "steps": 600, "flags": ["--recipe", "specforge"],
              "val": True},
             {"name": "dspine_ce_s600", "kind": "dspine", "steps": 600, "flags": ["--recipe", "ce"], "val": True}],
    "val_suites": "code,math,prose", "eval_batched": True, "eval_jobs": 14, "train_jobs": 6,
}


# The objective cross of the recipe lab, replicated: every arm at 600 steps and seeds 0 and 1, at T=0 and T=1
# (the cross of the recipe issue was one seed, T=0). The main pair is DFlash (CE, its own best; arm A) and DSpine on
# the `ce` recipe (C), both at seeds 0 and 1; the arms: B SpecForge's recipe, D SpecForge's without alignment,
# E `ce` with the injection alone (no alignment, refinement or replacement), F DFlash on SpecForge's 0.1·CE +
# 0.9·L1 mix. The recipe choice: the main DSpine (ce) against B on the validation prompts, both seeds
# (`main_val`). 12 trainings of 600 steps, 6 at once under CUDA MPS (7,200 steps at the 15.6 steps/s six
# trainings gave together under MPS at f462d5c: ~460 s); recipe.py's summary adds each run's ratio to the DFlash
# run of its seed (`cross`).
_CROSS_ARMS = [("dspine_specforge", "dspine", ["--recipe", "specforge"], True),
               ("dspine_specforge_noalign", "dspine", ["--recipe", "specforge", "--no-alignment-loss"], False),
               ("dspine_ce_injection_only", "dspine", ["--recipe", "ce", "--no-alignment-loss", "--no-refinement-loss",
                                                       "--no-replacement"], False),
               ("dflash_mix", "dflash", ["--dflash-ce-weight", "0.1"], False)]
PRESETS["recipe_cross"] = {
    **PRESETS["recipe"], "train_steps": 600, "seeds": "1", "main_val": True, "mps": True, "eval_jobs": 16,
    "arms": [{"name": f"{name}_seed{seed}", "kind": kind, "steps": 600, "seed": seed, "flags": flags, "val": val}
             for seed in (0, 1) for name, kind, flags, val in _CROSS_ARMS],
}


# The recipe at the longer length (the recipe issue's item 2): the recipe preset's corpus, data and 1,800-step
# main pair (DFlash CE and DSpine `ce` at seeds 0 and 1, main_val), against one candidate trained as long at both
# seeds, `ce_anneal` (the alignment term faded out over the run: at 1,800 steps DFlash had caught up with `ce`,
# so the auxiliary term's share of the end of the run is the suspect). The default recipe is the one with the
# higher mean validation τ over both seeds. Six 1,800-step trainings at once do not fit the lease beside the
# recipe preset's 480-s target: the target trains 300 s here (every drafter of the run on the same target), the
# validation suites are evaluated at T=0 only (where the choice is made), and the six trainings run under CUDA MPS
# (mps.py: side by side without it, six gave ~11.5 steps/s together at 320944e, four ~15.5).
PRESETS["recipe_long"] = {
    **PRESETS["recipe"], "target_seconds": 300.0, "seeds": "1", "main_val": True, "val_temperatures": "0",
    "mps": True, "eval_jobs": 16,
    "arms": [{"name": f"dspine_ce_anneal_seed{seed}", "kind": "dspine", "seed": seed,
              "flags": ["--recipe", "ce_anneal"], "val": True} for seed in (0, 1)],
}


# The draft-tree lab (scripts/device/lab2.sh with PRESET=tree STAGE2=tree): the second edition's corpus, target
# and drafter shape, only the main pair (DFlash, and DSpine on the trainer's default recipe), trained 1,200 steps
# two at a time, then benchmarks/tree_offline.py on it (the lab's own evaluations left out: tree_offline
# evaluates the chains on the same prompts as the trees).
PRESETS["tree"] = {
    **{k: v for k, v in PRESETS["second"].items()
       if k not in ("curve_steps", "seeds", "depth_layers", "depth_steps", "upgrade_frac", "grid_temperatures",
                    "walk_off")},
    "train_steps": 1200, "train_jobs": 2,
}


# Keys every preset has (the grid's, grid.py; off unless a preset or --set turns them on).
# train_jobs: trainings of the grid in flight at once (0: all); step_threads: CPU threads of each step run as a
# subprocess (OMP_NUM_THREADS; 0: torch's default, one per core, which oversubscribes the cores when many steps
# run at once); eval_after_training: the grid's evaluations wait until every training is done (grid.run);
# walk_off: DSpine variants also evaluated with the backbone's argmax instead of the walk (grid_temperatures, queued
# after every other evaluation), to tell the walk's share of their τ from the backbone's.
# arms: trainings with their own flags (grid.arms_of); val_prompts: validation prompts a domain (corpus.py), the
# suites `val_suites` (DOMAIN_val) an arm with "val" is also evaluated on; suite_limits: prompts of a suite other
# than eval_limit ("math=24"); eval_batched: one evaluation process per drafter and temperature over all its
# suites (eval_suites.py) instead of one per suite; dspine_recipe: `--recipe` of the DSpine trainings (None: the
# trainer's default); main_val: the main (and seed) DSpine drafters are evaluated on the validation suites too;
# val_temperatures: the temperatures the validation suites are evaluated at ("": every evaluation temperature);
# mps: the grid's trainings and evaluations run as clients of one CUDA MPS daemon (mps.py).
GRID_DEFAULTS: dict[str, Any] = dict(suites="code,math,prose", curve_steps="", seeds="", depth_layers="",
                                     depth_steps=0, upgrade_frac=0.0, grid_temperatures="0", eval_jobs=0,
                                     train_jobs=0, step_threads=0, eval_after_training=False, walk_off="",
                                     arms=[], val_prompts=0, val_suites="", suite_limits="", eval_batched=False,
                                     dspine_recipe=None, main_val=False, val_temperatures="", mps=False)
# target_steps: train the target for this many steps instead of target_seconds (the tiny preset: the same target
# on a fast or a loaded machine, so its tests do not depend on how busy the CPU is).
for _p in PRESETS.values():
    for _k, _v in {**GRID_DEFAULTS, "target_steps": None}.items():
        _p.setdefault(_k, _v)
# Suites beyond the corpus's own: prompt files shipped in benchmarks/lab/data (humaneval.py writes them).
EXTRA_SUITES = {"humaneval": os.path.join(HERE, "data", "humaneval.jsonl")}


def _lab_module(name: str):
    """A sibling module (corpus, ...) of the package benchmarks.lab."""
    return importlib.import_module(f"benchmarks.lab.{name}")


# -------------------------------------------------------------------------------------------- running
class Runner:
    """Runs step commands: in this process (jobs == 1; CPU, tests) or as subprocesses (jobs > 1; GPU, in
    parallel where independent). Output goes to OUT/logs/<name>.log; the driver prints summaries only."""

    def __init__(self, out: str, jobs: int, log, deadline: float | None = None, threads: int = 0):
        self.out, self.jobs, self.log, self.deadline = out, jobs, log, deadline
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
        self.t0 = time.time()
        self.step_times: dict[str, dict[str, Any]] = {}  # name -> start (s after the runner's start), seconds, ok
        self.logs = os.path.join(out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.commands: list[str] = []

    @staticmethod
    def argv(kind: str, args: list[str]) -> list[str]:
        if kind == "cli":
            return ["sglang-dspine"] + args
        return [f"benchmarks/lab/{kind}.py"] + args

    def run(self, name: str, kind: str, args: list[str]) -> None:
        shown = " ".join(shlex.quote(a) for a in self.argv(kind, args))
        self.commands.append(shown)
        self.log(f"  $ {shown}")
        log_path = os.path.join(self.logs, f"{name}.log")
        t0 = time.time()
        if self.deadline is not None and t0 >= self.deadline:
            raise RuntimeError(f"step {name} not started: the run's deadline (deadline_s) has passed")
        if self.jobs <= 1:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                try:
                    rc = self._main(kind)(args)
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else 1
                except Exception as e:  # noqa: BLE001 - reported with the step's log below
                    import traceback

                    traceback.print_exc()
                    rc = f"{type(e).__name__}: {e}"
            with open(log_path, "w", encoding="utf-8") as f:
                f.write(buf.getvalue())
        else:
            if kind == "cli":
                cmd = [sys.executable, "-m", "sglang_dspine.cli"] + args
            else:
                cmd = [sys.executable, os.path.join(HERE, f"{kind}.py")] + args
            with open(log_path, "w", encoding="utf-8") as f:
                # cwd: the logs folder, never the repo root (sglang_dspine.source_files says why)
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=self.logs, env=self.env)
                try:
                    rc = proc.wait(timeout=None if self.deadline is None else max(1.0, self.deadline - time.time()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    rc = "killed at the run's deadline (deadline_s)"
        self.step_times[name] = {"start": round(t0 - self.t0, 1), "seconds": round(time.time() - t0, 1),
                                 "ok": rc in (0, None)}
        if rc not in (0, None):
            with open(log_path, encoding="utf-8") as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"step {name} failed ({rc}) after {time.time() - t0:.0f} s; log {log_path}:\n{tail}")

    def run_many(self, steps: list[tuple[str, str, list[str]]]) -> None:
        if not steps:
            return
        if self.jobs <= 1 or len(steps) == 1:
            for s in steps:
                self.run(*s)
            return
        with ThreadPoolExecutor(min(self.jobs, len(steps))) as ex:
            futures = [ex.submit(self.run, *s) for s in steps]
            errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]

    @staticmethod
    def _main(kind: str):
        if kind == "cli":
            from sglang_dspine.cli import main

            return main
        return _lab_module(kind).main


def _set_value(kv: str, old: Any, v: str) -> Any:
    """The value of `--set key=v`, of the type of the preset's value for that key (a list as JSON; `none`
    unsets the key)."""
    if v.lower() == "none":
        return None
    if isinstance(old, bool):
        if v.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise SystemExit(f"--set {kv}: expected true or false")
        return v.lower() in ("1", "true", "yes")
    if isinstance(old, list) or (old is None and v.startswith("[")):
        try:
            return json.loads(v)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--set {kv}: expected a JSON list ({e})") from None
    return v if old is None else type(old)(v)


def preset_with(name: str, sets: list[str] | None) -> dict[str, Any]:
    """A preset's values with `--set key=value` overrides (each of the preset value's type)."""
    p = dict(PRESETS[name])
    for kv in sets or []:
        k, _, v = kv.partition("=")
        if k not in p:
            raise SystemExit(f"--set {kv}: unknown key; known: {sorted(p)}")
        p[k] = _set_value(kv, p[k], v)
    return p


# --------------------------------------------------------------------------------------------- stages
class Lab:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.p = preset_with(args.preset, args.set)
        if args.jobs is not None:
            self.p["jobs"] = args.jobs
        self.out = os.path.abspath(args.out)
        os.makedirs(self.out, exist_ok=True)
        self.log_file = open(os.path.join(self.out, "logs_run.txt"), "a", encoding="utf-8")
        self.t_start = time.time()
        deadline = self.t_start + float(self.p["deadline_s"]) if self.p.get("deadline_s") else None
        self.runner = Runner(self.out, int(self.p["jobs"]), self.log, deadline, int(self.p["step_threads"]))
        self.suites = [x for x in str(self.p["suites"]).split(",") if x]
        unknown = [x for x in self.suites if x not in SUITES and x not in EXTRA_SUITES]
        if unknown:
            raise SystemExit(f"--set suites: unknown {unknown}; known {list(SUITES) + sorted(EXTRA_SUITES)}")
        self.force = set((args.force or "").split(",")) - {""}
        self.summary: dict[str, Any] = {}
        self.times: dict[str, float] = {}

    def log(self, msg: str) -> None:
        line = f"[lab {time.time() - self.t_start:6.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def path(self, *parts: str) -> str:
        return os.path.join(self.out, *parts)

    def done(self, stage: str, marker: str) -> bool:
        if stage in self.force and os.path.exists(marker):
            for d in {"corpus": ["corpus", "tokens"], "tokenizer": ["tokenizer", "tokens"],
                      "target": ["target", "tokens"],
                      "data": ["data"], "train": ["runs"], "export": ["drafters"], "eval": ["eval"]}.get(stage, []):
                shutil.rmtree(self.path(d), ignore_errors=True)
        return os.path.exists(marker)

    # ---- 1 corpus
    def corpus(self) -> None:
        if self.done("corpus", self.path("corpus", "manifest.json")):
            self.log("corpus: exists, skipped")
        else:
            p = self.p
            args = ["--out", self.path("corpus"), "--max-mb", str(p["corpus_mb"]), "--train-prompts",
                    str(p["train_prompts"]),
                    "--suite-size", str(p["suite_size"]), "--workers", str(p["corpus_workers"])]
            if p["val_prompts"]:
                args += ["--val-prompts", str(p["val_prompts"])]
            for s in self.args.source or []:
                args += ["--source", s]
            self.runner.run("corpus", "corpus", args)
        for suite in self.suites:
            dest = self.path("corpus", "prompts", f"{suite}.heldout.jsonl")
            if suite in EXTRA_SUITES and not os.path.isfile(dest):
                if not os.path.isfile(EXTRA_SUITES[suite]):
                    raise OSError(f"suite {suite}: {EXTRA_SUITES[suite]} not found "
                                  "(benchmarks/lab/humaneval.py writes it)")
                shutil.copy(EXTRA_SUITES[suite], dest)
        m = json.load(open(self.path("corpus", "manifest.json")))
        self.summary["corpus"] = {k: m[k] for k in ("megabytes", "documents", "python_files_used", "doc_files_used",
                                                    "packages", "roots")}
        self.summary["corpus"].update({k: v for k, v in m.items() if k.startswith("prompts.")})
        self.log("corpus: " + json.dumps({"MB": m["megabytes"],
                                          **{k: v for k, v in m.items() if k.startswith("prompts.")}}))

    # ---- 2a tokenizer
    def tokenizer(self) -> None:
        if self.done("tokenizer", self.path("tokenizer", "lab_tokenizer.json")):
            self.log("tokenizer: exists, skipped")
        else:
            self.runner.run("tokenizer", "tokenizer", ["--corpus", self.path("corpus"), "--out", self.path("tokenizer"),
                                                       "--vocab-size", str(self.p["vocab"]),
                                                       "--sample-mb", str(self.p["tokenizer_mb"])])
        s = json.load(open(self.path("tokenizer", "lab_tokenizer.json")))
        self.summary["tokenizer"] = s
        self.log("tokenizer: " + json.dumps(s))

    # ---- 2b target
    def target(self) -> None:
        if self.done("target", self.path("target", "lab_target.json")):
            self.log("target: exists, skipped")
        else:
            args = ["--corpus", self.path("corpus"), "--tokenizer", self.path("tokenizer"), "--out",
                    self.path("target"),
                    "--token-cache", self.path("tokens")]
            if self.p["target_steps"]:
                args += ["--steps", str(self.p["target_steps"])]
            else:
                args += ["--seconds", str(self.p["target_seconds"])]
            args += list(self.p["target_args"])
            if self.p["threads"]:
                args += ["--threads", str(self.p["threads"])]
            self.runner.run("target", "target", args)
        s = json.load(open(self.path("target", "lab_target.json")))
        self.summary["target"] = {k: v for k, v in s.items() if k != "history"}
        self.log("target: " + json.dumps({k: s[k] for k in ("parameters", "steps", "tokens", "tokens_per_s",
                                                             "heldout_loss", "size_mb_bf16")}))

    # ---- 3a data
    def data(self) -> None:
        out = self.path("data", "train.jsonl")
        if self.done("data", self.path("data", "summary.json")):
            self.log("data: exists, skipped")
        else:
            p = self.p
            args = ["data", "--target", self.path("target"), "--prompts",
                    self.path("corpus", "prompts", "train_mix.jsonl"),
                    "--output", out, "--backend", "hf", "--max-new-tokens", str(p["gen_tokens"]),
                    "--hf-batch-size", str(p["gen_batch"]), "--batch-size", str(p["gen_batch"]),
                    "--max-prompt-len", str(p["max_prompt_len"]), "--no-progress"]
            if p["data_seconds"]:
                args += ["--max-seconds", str(p["data_seconds"])]
            t0 = time.time()
            self.runner.run("data", "cli", args)
            from sglang_dspine.training.jsonl import iter_jsonl

            n, toks, resp = 0, 0, 0
            for _, r in iter_jsonl(out):
                n += 1
                toks += len(r["input_ids"])
                resp += sum(r["loss_mask"])
            write_json(self.path("data", "summary.json"), {"sequences": n, "tokens": toks, "response_tokens": resp,
                                                           "seconds": round(time.time() - t0, 1)}, indent=None)
        s = json.load(open(self.path("data", "summary.json")))
        self.summary["data"] = s
        self.log("data: " + json.dumps(s))

    # ---- 3b train (both drafters, same data / steps / backbone)
    def _layer_ids(self, layers: int | None = None) -> str:
        if self.p["target_layer_ids"]:
            return str(self.p["target_layer_ids"])
        from sglang_dspine.drafter.config import default_target_layer_ids

        n = json.load(open(self.path("target", "config.json")))["num_hidden_layers"]
        return ",".join(str(i) for i in default_target_layer_ids(n, int(layers or self.p["draft_layers"])))

    def train_args(self, kind: str, name: str | None = None, layers: int | None = None, steps: int | None = None,
                   seed: int = 0, init: str | None = None, freeze: bool = False,
                   flags: list[str] | None = None) -> list[str]:
        """`sglang-dspine train` for drafter `kind` into runs/NAME (default: runs/KIND, the main pair's settings);
        init/freeze: start from that drafter and train only the injection (the upgrade path); flags: an arm's
        own, last (a DSpine arm's --recipe replaces the preset's dspine_recipe)."""
        p = self.p
        steps = int(steps or p["train_steps"])
        layers = int(layers or p["draft_layers"])
        mask = json.load(open(self.path("tokenizer", "lab_tokenizer.json")))["special"]["mask"]
        args = ["train", "--target", self.path("target"), "--data", self.path("data", "train.jsonl"),
                "--output-dir", self.path("runs", name or kind), "--kind", kind,
                "--num-draft-layers", str(layers), "--block-size", str(p["block_size"]),
                "--target-layer-ids", self._layer_ids(layers), "--mask-token-id", str(mask),
                "--max-steps", str(steps), "--batch-size", str(p["train_batch"]),
                "--num-anchors", str(p["num_anchors"]), "--max-length", str(p["max_length"]), "--lr",
                str(p["train_lr"]),
                "--objective-chunk-blocks", str(p["chunk_blocks"]),
                "--log-every", str(max(1, steps // 10)), "--no-progress"]
        if seed:
            args += ["--seed", str(seed)]
        if init:
            args += ["--init", init]
        if freeze:
            args += ["--freeze-backbone"]
        if kind == "dspine":
            for key in ("transfer_rank", "message_size"):  # None: the trainer's defaults (scaled to the width)
                if p.get(key) is not None:
                    args += [f"--{key.replace('_', '-')}", str(p[key])]
            args += ["--top-k", str(p["top_k"]), "--alignment-warmup-steps", str(min(146, max(1, steps // 4)))]
            if p.get("dspine_recipe") and "--recipe" not in (flags or []):
                args += ["--recipe", str(p["dspine_recipe"])]
        return args + list(flags or [])

    def export_args(self, name: str) -> list[str]:
        return ["export", "--checkpoint", self.path("runs", name, "final"), "--output", self.path("drafters", name),
                "--dtype", "bf16", "--target", self.path("target")]

    def train(self) -> None:
        grid = _lab_module("grid")
        if grid.active(self.p):  # the main pair and the grid, trained, exported and evaluated as parallel chains
            vs = grid.variants(self.p)
            if self.force & {"train", "export", "eval"}:  # once here: the chains run at once and must not clear
                for d in ("runs", "drafters", "eval"):     # each other's folders
                    shutil.rmtree(self.path(d), ignore_errors=True)
                self.force -= {"train", "export", "eval"}
            os.makedirs(self.path("eval"), exist_ok=True)
            failed = grid.run(self, vs)
            self.summary["grid_failed"] = failed
            for name, err in failed.items():
                self.log(f"grid {name}: FAILED {err.splitlines()[0][:300]}")
            main_failed = [k for k in KINDS if k in failed]
            if main_failed:
                raise RuntimeError(f"main pair failed: {', '.join(main_failed)}: {failed[main_failed[0]][:2000]}")
        todo = [k for k in KINDS if not self.done("train", self.path("runs", k, "final", "config.json"))]
        for k in KINDS:
            if k not in todo:
                self.log(f"train {k}: exists, skipped")
        self.runner.run_many([(f"train_{k}", "cli", self.train_args(k)) for k in todo])
        self.summary["train"] = {}
        for k in KINDS:
            from sglang_dspine.training.jsonl import read_jsonl

            last = read_jsonl(self.path("runs", k, "metrics.jsonl"))[-1]
            keep = {x: last[x] for x in ("step", "loss", "ce", "accuracy", "accuracy_per_position",
                                         "candidate_coverage",
                                          "backbone_accept_len", "tokens_per_s") if x in last}
            self.summary["train"][k] = keep
            self.log(f"train {k}: " + json.dumps({x: keep[x] for x in ("step", "loss", "accuracy",
                                                                       "backbone_accept_len") if x in keep}))

    # ---- 3c export
    def export(self) -> None:
        steps = []
        for k in KINDS:
            if self.done("export", self.path("drafters", k, "config.json")):
                self.log(f"export {k}: exists, skipped")
                continue
            steps.append((f"export_{k}", "cli", self.export_args(k)))
        self.runner.run_many(steps)
        self.summary["export"] = {k: {"size_mb": round(sum(os.path.getsize(os.path.join(self.path("drafters", k), f))
                                                            for f in os.listdir(self.path("drafters", k))) / 1e6, 2)}
                                  for k in KINDS}
        self.log("export: " + json.dumps(self.summary["export"]))

    # ---- 5 (offline) eval
    def suite_prompts(self, val: bool = False) -> list[tuple[str, str, int]]:
        """(suite, prompts file, prompts used) of the held-out suites, and with val the validation ones first
        (settings are chosen on them: a deadline should cut held-out suites of those drafters instead)."""
        limits = {k: int(v) for k, _, v in (x.partition("=") for x in str(self.p["suite_limits"]).split(",") if x)}
        out = [(s, self.path("corpus", "prompts", f"{s}.heldout.jsonl"), limits.get(s, int(self.p["eval_limit"])))
               for s in self.suites]
        if val:
            out = [(f"{d}_val", self.path("corpus", "prompts", f"{d}.val.jsonl"),
                    limits.get(f"{d}_val", int(self.p["eval_limit"])))
                   for d in str(self.p["val_suites"]).split(",") if d] + out
        return out

    def eval_steps(self, name: str, temps: list[float], decoding: str = "walk",
                   val: bool = False) -> list[tuple[str, str, list[str]]]:
        """The evaluation steps of drafter NAME on every suite (with val, the validation suites too) at these
        temperatures, those not done: `sglang-dspine eval` per suite, or with eval_batched one eval_suites.py
        per temperature. decoding "argmax": the walk-off ablation of a DSpine drafter, filed as `NAME_argmax`
        (grid.eval_name)."""
        steps = []
        label = _lab_module("grid").eval_name(name, decoding)
        common = ["--target", self.path("target"), "--drafter", self.path("drafters", name),
                  "--max-new-tokens", str(self.p["eval_tokens"]), "--seed", "0"]
        common += ["--decoding", decoding] if decoding != "walk" else []
        val_temps = _lab_module("grid").temps_of(self.p["val_temperatures"]) if self.p["val_temperatures"] else None
        for t in temps:
            todo = [(s, f, n) for s, f, n in self.suite_prompts(val and (val_temps is None or t in val_temps))
                    if not self.done("eval", self.path("eval", f"{label}_{s}_t{t:g}.json"))]
            if todo and self.p["eval_batched"]:  # the validation suites in a process of their own, queued first
                for part, group in (("_val", [x for x in todo if x[0].endswith("_val")]),
                                    ("", [x for x in todo if not x[0].endswith("_val")])):
                    if group:
                        steps.append((f"eval_{label}{part}_t{t:g}", "eval_suites", common + [
                            "--label", label, "--temperature", f"{t:g}", "--out-dir", self.path("eval")]
                            + [a for s, f, n in group for a in ("--suite", f"{s}={f}:{n}")]))
                continue
            for suite, f, n in todo:
                out = self.path("eval", f"{label}_{suite}_t{t:g}.json")
                steps.append((f"eval_{label}_{suite}_t{t:g}", "cli", ["eval"] + common + [
                    "--prompts", f, "--limit", str(n), "--temperature", f"{t:g}", "--output", out]))
        return steps

    def temperatures(self) -> list[float]:
        return _lab_module("grid").temps_of(self.p["temperatures"])

    def eval_table(self, require: bool) -> dict[str, Any]:
        """The main pair's τ per temperature and suite from the evaluation files. require=False (a report after
        a failure or a deadline): only the (temperature, suite) cells where both drafters were evaluated."""
        table: dict[str, Any] = {}
        for t in self.temperatures():
            for suite in self.suites:
                files = {k: self.path("eval", f"{k}_{suite}_t{t:g}.json") for k in KINDS}
                if not require and not all(os.path.isfile(f) for f in files.values()):
                    continue
                row = {}
                for k, f in files.items():
                    r = json.load(open(f))
                    row[k] = {"tau": round(r["tau"], 4),
                              "position_acceptance": [round(x, 4) for x in r["position_acceptance"]],
                              "rounds": r["rounds"], "tokens": r["tokens"], "prompts": r["prompts"],
                              "seconds": round(r["seconds"], 1)}
                row["ratio"] = round(row["dspine"]["tau"] / max(row["dflash"]["tau"], 1e-9), 4)
                table.setdefault(f"t{t:g}", {})[suite] = row
        return table

    def eval(self) -> None:
        steps = [s for k in KINDS for s in self.eval_steps(k, self.temperatures())]
        os.makedirs(self.path("eval"), exist_ok=True)
        self.runner.run_many(steps)
        table = self.eval_table(require=True)
        self.summary["eval"] = table
        for tk, rows in table.items():
            for suite, row in rows.items():
                self.log(f"eval {tk} {suite:5s}: tau DFlash {row['dflash']['tau']:.3f}"
                         f"  DSpine {row['dspine']['tau']:.3f}"
                         f"  ratio {row['ratio']:.3f}")

    # ---- report
    def report(self, failed: str | None = None) -> str:
        import importlib.metadata as md

        import torch

        from sglang_dspine.provenance import git_commit

        versions = {"python": sys.version.split()[0]}
        for name in ("torch", "transformers", "tokenizers", "sglang", "triton", "numpy"):
            try:
                versions[name] = md.version(name)
            except md.PackageNotFoundError:
                versions[name] = None
        here_kind = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"  # target.py's naming
        here = here_kind if here_kind != "cpu" else f"cpu ({os.cpu_count()} cores)"
        # The machine that trained the target (and so ran the lab), which need not be where this report is
        # written: a report-only run over a lab folder brought back from the GPU.
        target_report = self.path("target", "lab_target.json")
        built = json.load(open(target_report)).get("device") if os.path.isfile(target_report) else None
        device = built if built and built != here_kind else here
        if "eval" not in self.summary and os.path.isdir(self.path("eval")):  # the eval stage did not finish
            self.summary["eval"] = self.eval_table(require=False)
        res: dict[str, Any] = {
            "what": "lab pipeline: corpus, tokenizer, target, regenerated data, DFlash vs DSpine drafters, offline tau",
            "preset": self.args.preset, "settings": self.p,
            "command": " ".join(shlex.quote(a) for a in ["python", "benchmarks/lab/run.py"] + self.args.argv),
            "commit": git_commit(), "device": device, "versions": versions,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "stage_seconds": self.times, "step_times": self.runner.step_times, "step_commands": self.runner.commands,
            **self.summary,
        }
        if device != here:  # this process only re-read the lab's files: its timings are not the lab's
            res["report_written_on"] = here
            res["stage_seconds"] = res["step_times"] = res["step_commands"] = None
        if failed:
            res["failed"] = failed
        grid = _lab_module("grid")
        if grid.active(self.p) and os.path.isdir(self.path("eval")):  # also after a failure: what was evaluated
            g = grid.summarize(self, grid.variants(self.p))
            res["grid"] = g
            plot_path = os.path.join(self.args.results, f"lab_{self.args.preset}_steps.png")
            os.makedirs(self.args.results, exist_ok=True)
            if grid.curve_measured(g) > 1:
                res["grid_plot"] = os.path.basename(grid.plot_curve(
                    g, plot_path, f"lab {self.args.preset}: τ against training steps (seed 0; bar: seed spread)"))
        ev = self.summary.get("eval") or {}
        for tk, rows in ev.items():
            # the paper's statistic first: mean τ over the suites of DSpine ÷ that of DFlash; beside it the mean
            # of the per-suite ratios (which weighs a suite where both accept little as much as math)
            means = {k: sum(r[k]["tau"] for r in rows.values()) / len(rows) for k in KINDS}
            res[f"tau_ratio_of_means_{tk}"] = round(means["dspine"] / max(means["dflash"], 1e-9), 4)
            ratios = [r["ratio"] for r in rows.values()]
            res[f"tau_ratio_{tk}"] = round(sum(ratios) / len(ratios), 4)
            res[f"tau_{tk}_mean"] = {k: round(v, 4) for k, v in means.items()}
        path = write_json(os.path.join(self.args.results, f"lab_{self.args.preset}.json"), res, indent=2)
        shutil.copy(path, self.path("results.json"))
        self.log(f"report: {path}" + "".join(f"  tau_ratio_of_means_{tk} {res[f'tau_ratio_of_means_{tk}']:.3f}"
                                             f" (mean of suite ratios {res[f'tau_ratio_{tk}']:.3f})" for tk in ev))
        return path

    def pack(self, dest: str, part_mb: float = 15.0) -> list[str]:
        os.makedirs(dest, exist_ok=True)
        members = [("target", self.path("target")), ("drafters/dflash", self.path("drafters", "dflash")),
                   ("drafters/dspine", self.path("drafters", "dspine")),
                   ("suites", self.path("corpus", "prompts")), ("results.json", self.path("results.json")),
                   ("eval", self.path("eval")), ("corpus_manifest.json", self.path("corpus", "manifest.json"))]
        members += [(f"runs/{k}/{f}", self.path("runs", k, f)) for k in KINDS for f in ("metrics.jsonl",
                                                                                        "train_config.json")]
        members += [("logs", self.path("logs")), ("logs_run.txt", self.path("logs_run.txt"))]
        tmp = os.path.join(dest, "lab_models.tar.gz")
        with tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
            for arc, src in members:
                if not os.path.exists(src):
                    continue
                if arc == "suites":  # only the held-out prompts (the training prompts are large and rebuildable)
                    for f in sorted(os.listdir(src)):
                        if f.endswith(".heldout.jsonl"):
                            tar.add(os.path.join(src, f), arcname=f"lab_models/suites/{f}")
                    continue
                tar.add(src, arcname=f"lab_models/{arc}")
        size = os.path.getsize(tmp)
        limit = int(part_mb * 1e6)
        if size <= limit:
            self.log(f"pack: {tmp} ({size / 1e6:.1f} MB)")
            return [tmp]
        parts = []
        with open(tmp, "rb") as f:
            i = 0
            while chunk := f.read(limit):
                p = f"{tmp}.part{i:02d}"
                with open(p, "wb") as g:
                    g.write(chunk)
                parts.append(p)
                i += 1
        os.remove(tmp)
        self.log(f"pack: {len(parts)} parts of ≤ {part_mb:g} MB in {dest} ({size / 1e6:.1f} MB; "
                 f"`cat lab_models.tar.gz.part* | tar xz`)")
        return parts

    def run(self, stages: list[str]) -> str | None:
        """Run the stages; returns None, or what failed (after a partial report and the pack)."""
        import torch

        threads = torch.get_num_threads()
        if self.p["threads"] and self.runner.jobs <= 1:
            torch.set_num_threads(int(self.p["threads"]))
        self.log(f"preset {self.args.preset} -> {self.out} (jobs {self.runner.jobs})")
        failed = None
        try:
            for st in stages:
                t0 = time.time()
                getattr(self, st)()
                self.times[st] = round(time.time() - t0, 1)
        except (RuntimeError, OSError, KeyError, ValueError) as e:
            failed = f"{type(e).__name__}: {e}"
            self.log(f"FAILED: {failed}")
            if "report" in stages:  # what was done so far, marked as failed
                self.report(failed=failed)
        finally:
            torch.set_num_threads(threads)
        if self.args.pack:
            self.pack(self.args.pack, self.args.pack_part_mb)
        self.log(f"{'failed' if failed else 'done'} in {time.time() - self.t_start:.0f} s: " + json.dumps(self.times))
        return failed


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--preset", choices=sorted(PRESETS), default="budget")
    p.add_argument("--tiny", dest="preset", action="store_const", const="tiny", help="same as --preset tiny")
    p.add_argument("--budget", dest="preset", action="store_const", const="budget", help="same as --preset budget")
    p.add_argument("--out", default="lab_out", help="working and model directory (default lab_out/)")
    p.add_argument("--results", help="where the results JSON goes (default: --out; nothing is written into the "
                                      "source tree unless this names a folder there)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--force", help="comma-separated stages to redo even if their output exists")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a preset value (repeatable)")
    p.add_argument("--jobs", type=int, help="parallel steps as subprocesses (default: the preset's; 1 = in process)")
    p.add_argument("--source", action="append", help="corpus source directory (default: site-packages)")
    p.add_argument("--pack", help="write the built models as lab_models.tar.gz(.partNN) into this directory")
    p.add_argument("--pack-part-mb", type=float, default=15.0, help="largest part of the pack (MB)")
    p.add_argument("--show-preset", action="store_true", help="print the preset's values and exit")
    args = p.parse_args(argv)
    args.argv = argv
    args.results = args.results or args.out
    if args.show_preset:  # with the --set values applied
        print(json.dumps(preset_with(args.preset, args.set), indent=2))
        return 0
    stages = [s for s in args.stages.split(",") if s]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        p.error(f"--stages: unknown {bad}; known {STAGES}")
    lab = Lab(args)
    return 1 if lab.run([s for s in STAGES if s in stages]) else 0


if __name__ == "__main__":
    sys.exit(main())

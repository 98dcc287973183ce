#!/usr/bin/env python3
"""Drafter training at a real target's geometry: step time, tokens/s and peak memory of 5-layer DFlash and
DSpine drafters trained by the project's trainer (`sglang_dspine.training.trainer.train`, the target forward included).

The target is a Qwen3 of Qwen3-8B's geometry (hidden 4096, 36 layers, vocabulary 151936, 32 query / 8 KV
heads of 128, intermediate 12288) with random weights made directly on the GPU in bf16 (no hub; a step costs
the same whatever the weights). Data: random token sequences of exactly `--seq-len` tokens (the first quarter
prompt, the rest response). Settings follow SpecForge's Qwen3-8B DSpine run: micro-batch 2 per GPU,
2 accumulation steps, 512 anchors per sequence, block 16, the loss in chunks of 128 blocks; its sequences
are up to 3072 tokens, here 2048. Training runs in bf16 autocast with float32 master weights (the trainer's
GPU default).

Each kind trains `--warmup` + `--steps` optimizer steps; the step time is the mean of the timed steps'
wall time as the trainer's metrics log records it. Under torchrun with N > 1 processes (NCCL), each kind
first trains on rank 0 alone with N times the accumulation (the same global batch), the other ranks waiting,
then on all N ranks; the summary adds `scaling_efficiency_{N}gpu` (N-GPU tokens/s ÷ N × one-GPU tokens/s)
and `loss_diff_{N}gpu_vs_1gpu` (largest |loss| difference over the steps: both runs see the same blocks).

    python benchmarks/train_scale.py --out $OUT/train_scale_summary.json          # one GPU
    torchrun --nproc_per_node 2 benchmarks/train_scale.py --out ...                 # 2 GPUs, with the 1-GPU run
    python benchmarks/train_scale.py --smoke --out /tmp/ts.json                     # toy geometry on CPU (a check)
    python benchmarks/train_scale.py --merge-recipes ce_anneal.json specforge.json --out summary.json  # per recipe
    python benchmarks/train_scale.py --merge-recipes ... --later run.json --out summary.json   # + a later commit's run

`--profile` (one process): instead of the timing runs, each kind trains `--warmup` + `--profile-steps` steps under
torch.profiler and the last `--profile-steps` are read: time and launches per part of a step and per kernel,
DSpine minus DFlash per part (benchmarks/train_profile.py says how kernels are charged to parts); JSON to --out
(default $OUT or a temporary folder), `--trace-dir` adds gzipped chrome traces (dropped over 16 MiB),
and the comparison table is printed last.

    python benchmarks/train_scale.py --profile --trace-dir $OUT --out $OUT/train_profile.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import sys
import time

import torch

from sglang_dspine.provenance import changed_files, default_output
from sglang_dspine.source_files import as_package
from sglang_dspine.training.train_config import DEFAULT_RECIPE, RECIPES

if not __package__:  # run as a file (python benchmarks/x.py) or loaded by its path: the package `benchmarks` first
    as_package(__file__)

from benchmarks.geometry import short  # noqa: E402
from benchmarks.models import random_target as build_target  # noqa: E402
from benchmarks.output import write_json  # noqa: E402

QWEN3_8B, TOY = short("qwen3-8b"), short("tiny")


def write_data(path: str, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
    """n random sequences of exactly seq_len tokens: a quarter prompt (loss 0), the rest response (loss 1)."""
    rng = random.Random(seed)
    prompt = seq_len // 4
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(seq_len)],
                                "loss_mask": [0] * prompt + [1] * (seq_len - prompt)}) + "\n")


def run_kind(args, kind: str, target, data: str, out_dir: str, device: torch.device, grad_accum: int,
             single_process: bool, world: int, rank: int) -> dict:
    """Train one kind through the trainer; its timing, memory and per-step losses (read from the metrics log,
    which rank 0 writes: the other ranks return nothing)."""
    from sglang_dspine.training.jsonl import read_jsonl
    from sglang_dspine.training.trainer import train

    tc = train_config(args, kind, data, out_dir, device, grad_accum, args.warmup + args.steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.time()
    summary = train(tc, target=target, single_process=single_process)
    if rank != 0:
        return {}
    res: dict = {"seconds_total": round(time.time() - t0, 1)}
    recs = read_jsonl(os.path.join(out_dir, "metrics.jsonl"))
    timed = [r for r in recs if r["step"] > args.warmup]
    seconds = sum(r["interval_seconds"] for r in timed)
    n_gpus = 1 if single_process else world
    tokens = len(timed) * args.batch_size * grad_accum * n_gpus * args.seq_len
    res["ms_per_step"] = round(1000 * seconds / len(timed), 2)
    res["tokens_per_s"] = round(tokens / seconds, 1)  # every sequence token (the target reads them all)
    res["response_tokens_per_s"] = round(sum(r["tokens_per_s"] * r["interval_seconds"] for r in timed) / seconds, 1)
    res["steps_timed"] = len(timed)
    res["losses"] = [round(r["loss"], 5) for r in recs]
    res["final_accuracy"] = round(recs[-1]["accuracy"], 4)
    res["gpus"] = n_gpus
    res["global_batch_sequences"] = args.batch_size * grad_accum * n_gpus
    if device.type == "cuda":
        res["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    res["steps"] = summary["steps"]
    return res


def train_config(args, kind: str, data: str, out_dir: str, device: torch.device, grad_accum: int, steps: int):
    from sglang_dspine.training.train_config import TrainConfig

    return TrainConfig(data=data, output_dir=out_dir, kind=kind, num_draft_layers=args.layers,
                       block_size=args.block_size, num_anchors=args.num_anchors, batch_size=args.batch_size,
                       grad_accum=grad_accum, max_length=args.seq_len, max_steps=steps,
                       objective_chunk_blocks=args.objective_chunk_blocks, lr=6e-4, log_every=1, save=False,
                       progress=False, resume=False, tensorboard=False, device=str(device),
                       precision="bf16" if device.type == "cuda" else "fp32", seed=0, recipe=args.recipe)


def profile_kinds(args, kinds: list[str], target, data: str, device: torch.device) -> dict:
    """The --profile mode: each kind's profiled steps, and DSpine minus DFlash."""
    from benchmarks import train_profile as tp
    from sglang_dspine.training.jsonl import read_jsonl
    from sglang_dspine.training.trainer import train

    per_kind: dict[str, dict] = {}
    for kind in kinds:
        out_dir = os.path.join(args.work, f"{kind}_profile")
        shutil.rmtree(out_dir, ignore_errors=True)
        tc = train_config(args, kind, data, out_dir, device, args.grad_accum, args.warmup + args.profile_steps)
        trace = os.path.join(args.trace_dir, f"train_profile_{kind}.json.gz") if args.trace_dir else None
        t0 = time.time()
        res = tp.profile_kind(train, tc, target, args.warmup, args.profile_steps, device, trace)
        recs = read_jsonl(os.path.join(out_dir, "metrics.jsonl"))[-args.profile_steps:]
        res["wall_ms_per_step"] = round(1000 * sum(r["interval_seconds"] for r in recs) / len(recs), 1)
        res["profiled_steps"] = [{k: r.get(k) for k in ("step", "beta", "replacement_p", "loss")} for r in recs]
        res["seconds_total"] = round(time.time() - t0, 1)
        per_kind[kind] = res
        print(f"profile {kind}: {res['total_ms']:.1f} ms of {res['device']} per step, wall "
              f"{res['wall_ms_per_step']:.1f} ms (profiled), {res['seconds_total']} s", file=sys.stderr)
    out: dict = {"method": " ".join(tp.__doc__.split("\n\n", 1)[1].split()), "per_kind": per_kind}
    if {"dflash", "dspine"} <= set(per_kind):
        out["dspine_minus_dflash"] = tp.difference(per_kind["dflash"], per_kind["dspine"])
        out["table"] = tp.table(per_kind, out["dspine_minus_dflash"])
    for v in per_kind.values():
        v.pop("_kernels_all", None)
    return out


NO_DEFAULT_RUN = 3  # merge_recipes' exit status without a run of the default recipe


def merge_recipes(paths: list[str]) -> dict:
    """One summary from timing runs of several DSpine recipes (one file each, same commit and settings but the
    recipe): the default recipe's run whole, and per recipe its step time, peak memory and DSpine ÷ DFlash.
    Runs that differ from the default recipe's first run in --grad-accum as well (no CE prepass at 1) are kept
    apart, per recipe and accumulation (`by_grad_accum`)."""
    runs = [(json.load(open(p)), p) for p in paths]
    defaults = [(r, p) for r, p in runs if r["settings"]["recipe"] == DEFAULT_RECIPE]
    if not defaults:  # exit status NO_DEFAULT_RUN: train_scale.sh ends with this hint, not as a failure
        print(f"--merge-recipes: no run of the default recipe {DEFAULT_RECIPE} in {paths}: no summary (a summary is "
              "built on the default recipe's run; the others join one later: --merge-recipes ... --later)",
              file=sys.stderr)
        raise SystemExit(NO_DEFAULT_RUN)
    base = defaults[0][0]
    accum = base["settings"]["grad_accum"]
    same = ("commit", "gpu", "versions", "geometry", "world_size")
    loose = ("recipe", "grad_accum")
    by: dict = {}
    other: dict = {}
    for r, p in runs:
        settings = {k: v for k, v in r["settings"].items() if k not in loose}
        if settings != {k: v for k, v in base["settings"].items() if k not in loose} or any(
                r.get(k) != base.get(k) for k in same):
            raise SystemExit(f"--merge-recipes: {p} differs from the {DEFAULT_RECIPE} run in more than the recipe "
                             "and the accumulation")
        recipe, ga = r["settings"]["recipe"], r["settings"]["grad_accum"]
        into, key = (by, recipe) if ga == accum else (other, f"{recipe}, grad_accum {ga}")
        if key in into:
            raise SystemExit(f"--merge-recipes: {key} appears twice in {paths}")
        into[key] = {"file": os.path.basename(p), "ms_per_step": r["ms_per_step"], "tokens_per_s": r["tokens_per_s"],
                     "peak_mem_gb": r["peak_mem_gb"], "dspine_over_dflash_step": r["dspine_over_dflash_step"],
                     "date": r["date"]}
    out = dict(base)
    out["by_recipe"] = dict(sorted(by.items()))
    out["dspine_over_dflash_step_by_recipe"] = {k: v["dspine_over_dflash_step"] for k, v in out["by_recipe"].items()}
    if other:
        out["by_grad_accum"] = dict(sorted(other.items()))
    return out


# What a training run times: a run at another commit is comparable only where none of this changed in between.
TRAINING_CODE = ("sglang_dspine", "kernels", "benchmarks/train_scale.py")


def later_runs(summary: dict, paths: list[str]) -> list[dict]:
    """Runs timed after the summary's base run, at a later commit (a repeat of one recipe and accumulation, when a
    lease had no time for the whole set): each with its own commit and date, kept beside by_recipe and
    by_grad_accum rather than in them, and the files under TRAINING_CODE that changed between the base commit and
    its own (git; None where this checkout cannot tell), so that a reader sees whether the two compare."""
    base_settings = {k: v for k, v in summary["settings"].items() if k not in ("recipe", "grad_accum")}
    out = []
    for p in paths:
        r = json.load(open(p))
        if {k: v for k, v in r["settings"].items() if k not in ("recipe", "grad_accum")} != base_settings or any(
                r.get(k) != summary.get(k) for k in ("gpu", "geometry", "world_size")):
            raise SystemExit(f"--later: {p} differs from the summary's run in more than the recipe, the accumulation "
                             "and the commit")
        out.append({"file": os.path.basename(p), "commit": r["commit"], "date": r["date"],
                    "recipe": r["settings"]["recipe"], "grad_accum": r["settings"]["grad_accum"],
                    "ms_per_step": r["ms_per_step"], "tokens_per_s": r["tokens_per_s"],
                    "peak_mem_gb": r["peak_mem_gb"], "dspine_over_dflash_step": r["dspine_over_dflash_step"],
                    "versions": r.get("versions"),
                    "training_code_changed_since_base": changed_files(summary["commit"], r["commit"], TRAINING_CODE)})
    return out


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--smoke", action="store_true", help="toy geometry and sizes on the CPU (a check of this script)")
    ap.add_argument("--kinds", default="dflash,dspine")
    ap.add_argument("--layers", type=int, default=5, help="drafter layers")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per micro-batch per GPU")
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--objective-chunk-blocks", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3, help="steps before the timed ones")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--no-compare", action="store_true", help="under torchrun, skip the one-GPU run")
    ap.add_argument("--recipe", choices=sorted(RECIPES), help=f"DSpine's training recipe (default {DEFAULT_RECIPE})")
    ap.add_argument("--profile", action="store_true", help="profile each kind instead of timing it (one process)")
    ap.add_argument("--profile-steps", type=int, default=2, help="with --profile: steps recorded after --warmup")
    ap.add_argument("--trace-dir", help="with --profile: write gzipped chrome traces here")
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "train_scale_work"),
                    help="scratch folder (data, run folders)")
    ap.add_argument("--out", help="results JSON (default: train_scale_summary.json, --profile: train_profile.json, in "
                                  "$OUT or a temporary folder; the committed one: benchmarks/results/...)")
    ap.add_argument("--merge-recipes", nargs="+", metavar="RUN_JSON",
                    help="no training: one summary (--out) from timing runs of several recipes, one file each "
                         f"(the {DEFAULT_RECIPE} run's whole, per recipe its ratio)")
    ap.add_argument("--later", nargs="+", metavar="RUN_JSON", default=[],
                    help="with --merge-recipes: runs at a later commit, kept apart with their commit and the "
                         "training code changed since the base run (`later_runs`)")
    args = ap.parse_args(argv)
    if args.later and not args.merge_recipes:
        ap.error("--later goes with --merge-recipes")
    return ap, args


def merge(args: argparse.Namespace) -> int:
    """--merge-recipes: one summary from timing runs of several recipes (and --later runs), no training."""
    out = merge_recipes(args.merge_recipes)
    if args.later:
        out["later_runs"] = later_runs(out, args.later)
    write_json(args.out or default_output("train_scale_summary.json"), out)
    print(json.dumps(out["dspine_over_dflash_step_by_recipe"]))
    return 0


def start(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """torch.distributed under torchrun (the other ranks wait at a barrier while rank 0 trains alone: a longer
    timeout than the default); (rank, world size, this rank's device)."""
    import torch.distributed as dist

    from sglang_dspine.training.distributed import setup_distributed

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and not args.smoke else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    rank, world, local = setup_distributed()
    device = torch.device("cuda", local) if torch.cuda.is_available() and not args.smoke else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return rank, world, device


def time_kinds(args, kinds, target, data, device, world: int, rank: int) -> dict[str, dict]:
    """Each kind's timed run on every rank; under torchrun (unless --no-compare) first rank 0 alone on the same
    global batch, and the scaling efficiency and loss difference between the two."""
    import torch.distributed as dist

    per_kind: dict[str, dict] = {}
    compare = world > 1 and not args.no_compare
    for kind in kinds:
        row: dict = {}
        if compare:  # rank 0 alone, the same global batch; the others wait
            if rank == 0:
                row["one_gpu"] = run_kind(args, kind, target, data, os.path.join(args.work, f"{kind}_1gpu"), device,
                                          args.grad_accum * world, True, world, rank)
            dist.barrier()
        row["run"] = run_kind(args, kind, target, data, os.path.join(args.work, f"{kind}_{world}gpu"), device,
                              args.grad_accum, False, world, rank)
        if compare and rank == 0:
            one, many = row["one_gpu"], row["run"]
            row[f"scaling_efficiency_{world}gpu"] = round(many["tokens_per_s"] / (world * one["tokens_per_s"]), 3)
            row[f"loss_diff_{world}gpu_vs_1gpu"] = max(abs(a - b) for a, b in zip(one["losses"], many["losses"]))
        per_kind[kind] = row
    return per_kind


def timing_record(head: dict, per_kind: dict, target, device: torch.device, world: int) -> dict:
    """The timing run's record: the head, each kind's rows, and tokens/s, ms per step, peak memory and DSpine's
    step over DFlash's across kinds."""
    res: dict = {**head, "per_kind": per_kind}
    if device.type == "cuda":
        res["target_weights_gb"] = round(sum(p.numel() * p.element_size() for p in target.parameters()) / 1e9, 2)
    run = {k: v["run"] for k, v in per_kind.items()}
    res["tokens_per_s"] = {k: v["tokens_per_s"] for k, v in run.items()}
    res["ms_per_step"] = {k: v["ms_per_step"] for k, v in run.items()}
    if device.type == "cuda":
        res["peak_mem_gb"] = {k: v["peak_mem_gb"] for k, v in run.items()}
    if {"dflash", "dspine"} <= set(run):
        res["dspine_over_dflash_step"] = round(run["dspine"]["ms_per_step"] / run["dflash"]["ms_per_step"], 3)
    for k, v in per_kind.items():
        for key in (f"scaling_efficiency_{world}gpu", f"loss_diff_{world}gpu_vs_1gpu"):
            if key in v:
                res.setdefault(key, {})[k] = v[key]
    return res


def main(argv: list[str] | None = None) -> int:
    ap, args = parse_args(argv)
    if args.merge_recipes:
        return merge(args)
    args.recipe = args.recipe or DEFAULT_RECIPE  # recorded by name in the results
    args.out = args.out or default_output("train_profile.json" if args.profile else "train_scale_summary.json")
    geom = dict(QWEN3_8B)
    if args.smoke:
        geom = dict(TOY)
        args.seq_len, args.batch_size, args.num_anchors = min(args.seq_len, 96), min(args.batch_size, 2), 16
        args.layers, args.warmup, args.steps = min(args.layers, 2), min(args.warmup, 1), min(args.steps, 2)
        args.profile_steps = min(args.profile_steps, 1)

    from sglang_dspine.provenance import provenance

    t_start = time.time()
    rank, world, device = start(args)
    if args.profile and world > 1:
        ap.error("--profile runs in one process (not under torchrun)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.time()
    target = build_target(geom, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    target_build_s = round(time.time() - t0, 1)
    kinds = [k for k in args.kinds.split(",") if k]
    if rank == 0:  # run folders of an earlier run would be appended to
        for kind in kinds:
            for n in (1, world):
                shutil.rmtree(os.path.join(args.work, f"{kind}_{n}gpu"), ignore_errors=True)
    if world > 1:
        torch.distributed.barrier()
    os.makedirs(args.work, exist_ok=True)
    # every rank writes the same data to its own file (no shared file system needed)
    data = os.path.join(args.work, f"data_rank{rank}.jsonl")
    n_seq = args.batch_size * args.grad_accum * world * (args.warmup + max(args.steps, args.profile_steps))
    write_data(data, n_seq, args.seq_len, geom["vocab"])
    head = {
        "what": __doc__.split("\n\n")[0].replace("\n", " "),
        "geometry": {**geom, "preset": "toy (smoke)" if args.smoke else "Qwen3-8B"},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work", "trace_dir")},
        "precision": "bf16 autocast, float32 master weights" if dtype == torch.bfloat16 else "float32",
        "device": str(device), "world_size": world, "target_build_seconds": target_build_s,
        "target_parameters": sum(p.numel() for p in target.parameters()),
        **provenance(argv if argv is not None else sys.argv),
    }
    if args.profile:
        prof = profile_kinds(args, kinds, target, data, device)
        table = prof.pop("table", None)
        what = ("A profile of drafter training steps at a real target's geometry (train_scale.py --profile): "
                "device time and launches per part of a step and per kernel, DSpine minus DFlash.")
        res = {**head, "what": what, **prof, "seconds": round(time.time() - t_start, 1)}
        write_json(args.out, res)
        print(table or json.dumps({k: v["total_ms"] for k, v in prof["per_kind"].items()}))
        print("->", args.out)
        return 0

    per_kind = time_kinds(args, kinds, target, data, device, world, rank)
    if rank != 0:
        return 0
    res = timing_record(head, per_kind, target, device, world)
    res["seconds"] = round(time.time() - t_start, 1)
    write_json(args.out, res)
    print(json.dumps({k: res[k] for k in ("ms_per_step", "tokens_per_s", "peak_mem_gb", "dspine_over_dflash_step")
                      if k in res}), "->", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""What one drafter training step costs: DFlash vs DSpine through the project's trainer, same target, data
and backbone.

For each kind, two runs of `sglang_dspine.training.trainer.train`:
  * timed: `--warmup` steps, then `--steps` steps whose wall time the trainer's metrics log records
    (interval_seconds; the log's float() reads synchronise a GPU), so steps/s and response tokens/s, and on a
    GPU its peak memory;
  * profiled: one step after a warm-up under torch.profiler: operator calls (every aten:: event, nested ones
    included), on a GPU also kernel launches (cudaLaunchKernel / cuLaunchKernel runtime calls), and the time
    in each part of the step (the trainer's record_function regions: data, target, blocks, forward,
    backward, optimizer; CPU time, and on a GPU the device time the profiler attributes to the region, which
    misses backward's kernels: autograd launches them from its own thread).
Settings default to the lab's budget preset (2 layers, block 16, batch 16, 128 anchors, max length 640,
transfer rank 96, message 48, top-K 16). Data: `--data` (regenerated JSONL), or random tokens shaped like the
budget lab's (prompt 79, response 108 tokens on average).

    python benchmarks/train_step.py --target lab_out/target              # a lab target (GPU if present)
    python benchmarks/train_step.py --random-target --objective-chunk-blocks 0   # lab-sized, the loss in one chunk
    python benchmarks/train_step.py --tiny --out /tmp/train_step.json    # a random small target (a check)
Writes JSON (command, commit, device, versions, date) to --out (default benchmarks/results/train_step.json).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

from sglang_dspine.cli import _int_list
from sglang_dspine.provenance import default_output
from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/x.py) or loaded by its path: the package `benchmarks` first
    as_package(__file__)

from benchmarks.output import write_result  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REGIONS = ("train.data", "train.target", "train.blocks", "train.forward", "train.backward", "train.optimizer")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cudaMemsetAsync")


def random_data(path: str, n: int, vocab: int, prompt: int, response: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            p = max(1, prompt + rng.randint(-prompt // 2, prompt // 2))
            r = max(2, response + rng.randint(-response // 2, response // 2))
            f.write(json.dumps({"input_ids": [rng.randrange(4, vocab) for _ in range(p + r)],
                                "loss_mask": [0] * p + [1] * r}) + "\n")


def random_target(lab_size: bool, vocab: int):
    """A randomly initialised Qwen3 built as the lab's target is (benchmarks/lab/target.py): its DEFAULT size
    (a step costs the same whatever the weights) or its TINY one with 6 layers (room for two spread target
    layer ids)."""
    from transformers import Qwen3ForCausalLM

    from benchmarks.lab import target as lab_target
    dims = lab_target.DEFAULT if lab_size else {**lab_target.TINY, "layers": 6}
    torch.manual_seed(0)
    return Qwen3ForCausalLM(lab_target.make_config(dims, vocab)).eval()


def train_config(args, kind: str, data: str, out: str, steps: int, log_every: int):
    from sglang_dspine.training.train_config import TrainConfig

    dspine = dict(transfer_rank=args.transfer_rank, message_size=args.message_size, top_k=args.top_k,
                  alignment_warmup_steps=1) if kind == "dspine" else {}
    return TrainConfig(data=data, output_dir=out, kind=kind, num_draft_layers=args.layers, block_size=args.block_size,
                       target_layer_ids=args.target_layer_ids, mask_token_id=args.mask_token_id, dspine=dspine,
                       num_anchors=args.anchors, batch_size=args.batch_size, max_length=args.max_length,
                       max_steps=steps, log_every=log_every, lr=1e-3, progress=False, resume=False,
                       device=args.device, objective_chunk_blocks=args.objective_chunk_blocks)


def measure(args, kind: str, target, data: str, work: str) -> dict:
    from sglang_dspine.training.trainer import train

    res: dict = {}
    # timed: the trainer's own interval clock over the last `steps` steps
    n = args.steps * (1 + -(-args.warmup // args.steps))  # warm-up rounded up to whole log intervals
    if target.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target.device)
    summary = train(train_config(args, kind, data, os.path.join(work, f"{kind}_timed"), n, args.steps), target)
    last = summary["last_metrics"]  # the metrics log's last record
    if last["interval_steps"] != args.steps:
        raise RuntimeError(f"{kind}: expected a last interval of {args.steps} steps, got {last['interval_steps']}")
    res["steps_per_s"] = round(last["interval_steps"] / last["interval_seconds"], 3)
    res["ms_per_step"] = round(1000 * last["interval_seconds"] / last["interval_steps"], 2)
    res["response_tokens_per_s"] = round(last["tokens_per_s"], 1)
    res["steps_timed"] = last["interval_steps"]
    res["final_loss"] = round(last["loss"], 4)
    if target.device.type == "cuda":
        res["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(target.device) / 2**30, 2)
    # profiled: one step after a warm-up
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.device.type == "cuda" else [])
    with profile(activities=acts, schedule=schedule(wait=0, warmup=args.profile_warmup, active=1, repeat=1)) as prof:
        # the active step is not the run's last (whose final metrics record syncs and logs)
        train(train_config(args, kind, data, os.path.join(work, f"{kind}_prof"), args.profile_warmup + 2, 10**9),
              target, on_step=lambda _s: prof.step())
    events = prof.key_averages()
    res["aten_calls_per_step"] = sum(e.count for e in events if e.key.startswith("aten::"))
    top = sorted((e for e in events if e.key.startswith("aten::")), key=lambda e: -e.count)[:15]
    res["aten_calls_top"] = {e.key: e.count for e in top}
    if target.device.type == "cuda":
        res["kernel_launches_per_step"] = sum(e.count for e in events if e.key in LAUNCHES)
    # a region can appear twice on a GPU (its CPU range and its GPU user annotation): keep the larger of each
    res["regions_ms"] = {}
    for e in events:
        if e.key in REGIONS:
            row = res["regions_ms"].setdefault(e.key.split(".", 1)[1], {"cpu": 0.0})
            row["cpu"] = max(row["cpu"], round(e.cpu_time_total / 1000, 2))
            dev = getattr(e, "device_time_total", 0) or 0
            if dev:
                row["device"] = max(row.get("device", 0.0), round(dev / 1000, 2))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--target", help="a transformers target directory (e.g. a lab's target/)")
    ap.add_argument("--random-target", action="store_true",
                    help="a random target of the lab target's size (benchmarks/lab/target.py DEFAULT, --vocab)")
    ap.add_argument("--vocab", type=int, default=8192, help="with --random-target (the budget lab's 8192)")
    ap.add_argument("--tiny", action="store_true", help="a random 6-layer, 64-wide target and small settings")
    ap.add_argument("--data", help="regenerated JSONL (default: random tokens)")
    ap.add_argument("--kinds", default="dflash,dspine")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile-warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=640)
    ap.add_argument("--transfer-rank", type=int, default=96)
    ap.add_argument("--message-size", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--target-layer-ids", type=_int_list, help="comma-separated (default: the trainer's spread)")
    ap.add_argument("--mask-token-id", type=int, default=3, help="the lab tokenizer's <|MASK|> (3)")
    ap.add_argument("--objective-chunk-blocks", type=int, default=128,
                    help="blocks per chunk of the vocabulary-sized loss work (the trainer's default 128; 0: one chunk)")
    ap.add_argument("--device", help="default: cuda if present, else cpu")
    ap.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--out", default=default_output("train_step.json"),
                    help="results JSON (default: $OUT or a temporary folder)")
    args = ap.parse_args()
    if sum(map(bool, (args.target, args.random_target, args.tiny))) != 1:
        ap.error("give one of --target DIR, --random-target, --tiny")
    if args.tiny:
        args.batch_size, args.anchors, args.max_length = min(args.batch_size, 4), min(args.anchors, 16), 256
        args.transfer_rank, args.message_size, args.top_k = 16, 8, 4
        args.warmup, args.steps, args.profile_warmup = min(args.warmup, 2), min(args.steps, 3), 1
    if args.threads:
        torch.set_num_threads(args.threads)
    from sglang_dspine.provenance import provenance
    from sglang_dspine.training.target_loading import load_target

    t0 = time.time()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.tiny or args.random_target:
        target = random_target(args.random_target, args.vocab if args.random_target else 512).to(device)
    else:
        target = load_target(args.target, device=str(device))  # bf16 on a GPU, fp32 on CPU, as the trainer
    with tempfile.TemporaryDirectory() as work:
        data = args.data
        if data is None:
            data = os.path.join(work, "data.jsonl")
            random_data(data, max(64, 4 * args.batch_size), target.config.vocab_size, 79, 108)
        per_kind = {k: measure(args, k, target, data, work) for k in args.kinds.split(",") if k}
    res = {"what": __doc__.split("\n\n")[0].replace("\n", " "),
           "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
           "target": args.target or ("random Qwen3, lab size" if args.random_target else "tiny random Qwen3"),
           "target_parameters": sum(p.numel() for p in target.parameters()),
           "data": args.data or "random tokens", "device": str(device), **provenance(sys.argv),
           "per_kind": per_kind, "seconds": round(time.time() - t0, 1)}
    if {"dflash", "dspine"} <= set(per_kind):
        a, b = per_kind["dflash"], per_kind["dspine"]
        res["dspine_over_dflash"] = {"ms_per_step": round(b["ms_per_step"] / a["ms_per_step"], 3),
                                     "aten_calls_per_step": round(b["aten_calls_per_step"] / a["aten_calls_per_step"],
                                                                  3)}
        if "kernel_launches_per_step" in a:
            res["dspine_over_dflash"]["kernel_launches_per_step"] = round(
                b["kernel_launches_per_step"] / max(a["kernel_launches_per_step"], 1), 3)
    write_result(args.out, res)
    print(json.dumps({k: {x: v[x] for x in ("ms_per_step", "aten_calls_per_step", "kernel_launches_per_step",
                                             "regions_ms") if x in v}
                      for k, v in per_kind.items()}, indent=1))
    print(json.dumps(res.get("dspine_over_dflash")), "->", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

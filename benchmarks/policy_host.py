"""The adaptive policy's host work per decode step, on this machine's CPU: what `SGLANG_DSPINE_VERIFY=adaptive` adds
to each step in Python before and after the step's GPU work (worker.py `_step`): the policy's choice for the batch,
the step clock, and the policy's update from the step's accept lengths and GPU time. The CUDA events and the pinned
copy of the accept lengths are not in it (no GPU here); on a host-bound model (the built-in pair: ~2 ms a step) the
rest of the adaptive step's cost is theirs or DFlash's, which the pair's profile (`scripts/device/adaptive.py
--phases profile_pair`) shows.

    python -m benchmarks policy_host [--batch 4,48] [--steps 20000] [--repeats 5] [--out FILE]

Each repeat runs `--steps` decode steps of a steady batch through a fresh policy (the server's menu: none, chains of
4 and 8, the block of 16; its batch buckets), accept lengths drawn at random; prints and writes per batch size the
median µs a step with min–max over the repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

from sglang_dspine.provenance import provenance
from sglang_dspine.serving.verify_shapes import ShapePolicy, StepClock, parse_menu

BLOCK = 16
# the batch buckets: the sizes SGLang captures a speculative server's decode graphs at (its server_args), to the
# adaptive server's cap of 128; the worker reads them from its graph runner
BUCKETS = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 129, 8)]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def us_per_step(bs: int, steps: int, seed: int) -> float:
    """One repeat: `steps` decode steps of `bs` requests through a fresh policy, as worker.py runs them (the
    accept lengths drawn beforehand, so the draw is not timed)."""
    rng = random.Random(seed)
    policy, clock = ShapePolicy(parse_menu(None, BLOCK), BUCKETS, BLOCK), StepClock()
    draws = [[rng.randrange(BLOCK) for _ in range(bs)] for _ in range(256)]
    gpu_ms = [5.0 + rng.random() for _ in range(256)]
    now, t0 = 0.0, time.perf_counter()
    for i in range(steps):
        shape = policy.choose(bs)
        now += 0.005
        closed = clock.start(bs, shape, now)
        if closed is not None:
            policy.observe(*closed, accepted=None)
        accepted = [min(a, shape.rows - 1) for a in draws[i % 256]]
        policy.observe(bs, shape, None, accepted, gpu_ms=gpu_ms[i % 256])
    return 1e6 * (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=lambda s: [int(b) for b in s.split(",") if b], default=[4, 48])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="a JSON file (or a folder: policy_host.json in it)")
    args = ap.parse_args(argv)
    if args.repeats < 3 or args.steps < 1 or not args.batch or min(args.batch) < 1:
        ap.error("--repeats must be at least 3, --steps and every --batch at least 1")
    result = {"provenance": provenance(), "cpu": cpu_name(), "steps": args.steps, "repeats": args.repeats,
              "us_per_step": {}}
    for bs in args.batch:
        runs = [us_per_step(bs, args.steps, seed) for seed in range(args.repeats)]
        result["us_per_step"][str(bs)] = {"median": round(statistics.median(runs), 2), "min": round(min(runs), 2),
                                          "max": round(max(runs), 2)}
        print(f"batch {bs}: {statistics.median(runs):.1f} us a step (min {min(runs):.1f}, max {max(runs):.1f})",
              flush=True)
    if args.out:
        path = os.path.join(args.out, "policy_host.json") if os.path.isdir(args.out) else args.out
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

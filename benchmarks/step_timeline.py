"""Where a served decode step's time goes, from a trace of SGLang's profiler (`/start_profile`, torch.profiler with
Python stacks): `python -m benchmarks step_timeline TRACE.json.gz [...] --steps N [--out FILE]`.

Per trace, per forward step (the profiler's `num_steps`):
  * the GPU's account: busy (the union of kernel, memcpy and memset intervals), the span from the first to the
    last, idle = span - busy (time the GPU waited for the host), and launches: kernels replayed by a CUDA graph
    and kernels launched one by one (eager);
  * eager kernels by name: GPU time and count (what a step runs outside its graphs);
  * host runtime calls by name (cudaGraphLaunch, cudaLaunchKernel, cudaStreamSynchronize, ...): count and host
    time, so a synchronisation shows;
  * idle by caller: each GPU idle gap over `--gap-us` charged to the Python frames that were running when the
    kernel after the gap was launched (the innermost frames of sglang and sglang_dspine; the GPU waited on
    them);
  * host time by frame: each sglang / sglang_dspine Python function's time (inclusive, summed over its calls),
    which under overlap scheduling the GPU's work may hide, and where the step is the host's (a small model)
    is the step.
Two traces (`--diff`, e.g. the adaptive server's `none` steps and plain decoding at the same load): the second
minus the first per eager kernel and per caller.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict

from sglang_dspine.source_files import as_package

if not __package__:  # run as a file: the package first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402
from benchmarks.train_profile import DEVICE_CATS, LAUNCH_CATS, _ns, load_trace  # noqa: E402

_OURS = re.compile(r"(sglang_dspine|sglang)/")  # the frames a row is named after
_NOISE = re.compile(r"0x[0-9a-f]+|\d{3,}")


def _frame(name: str) -> str:
    """A python_function event's name (`path/to/file.py(123): func`) without its directories and line."""
    m = re.match(r"(?:.*/)?([^/(]+)\(\d+\): (.+)", name)
    return f"{m.group(1)}:{m.group(2)}" if m else name


def _callers(events: list[dict], launches: dict[int, dict], depth: int) -> dict[int, str]:
    """{correlation: the innermost `depth` sglang/sglang_dspine Python frames around that launch, outermost first}:
    one sweep in start order with a stack of open frames per thread."""
    items = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "python_function" and "ts" in e:
            items.append((_ns(e["ts"]), 0, -_ns(e.get("dur", 0)), e))
    for e in launches.values():
        items.append((_ns(e["ts"]), 1, 0, e))
    items.sort(key=lambda t: t[:3])
    stacks: dict = defaultdict(list)  # tid -> [(end ns, frame or None)]
    out: dict[int, str] = {}
    for start, is_launch, neg_dur, e in items:
        stack = stacks[e.get("tid")]
        while stack and stack[-1][0] < start:
            stack.pop()
        if is_launch:
            ours = [f for _, f in stack if f is not None]
            out[e["args"]["correlation"]] = " > ".join(ours[-depth:]) or "(no sglang frame)"
            continue
        name = e.get("name", "")
        stack.append((start - neg_dur, _frame(name) if _OURS.search(name) else None))
    return out


def timeline(src, steps: int, gap_us: float = 20.0, depth: int = 2, top: int = 25) -> dict:
    events = load_trace(src)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
    callers = _callers(events, launches, depth)
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS),
                 key=lambda e: _ns(e["ts"]))
    eager: dict[str, list] = defaultdict(lambda: [0, 0])  # kernel name -> [GPU ns, count]
    idle_by: dict[str, list] = defaultdict(lambda: [0, 0])  # caller -> [idle ns, gaps]
    busy = graph_kernels = eager_kernels = 0
    end = None
    gaps = []
    for k in dev:
        s, d = _ns(k["ts"]), _ns(k.get("dur", 0))
        corr = k.get("args", {}).get("correlation")
        launch = launches.get(corr, {}).get("name", "")
        if "GraphLaunch" in launch:
            graph_kernels += 1
        else:
            eager_kernels += 1
            acc = eager[_NOISE.sub("#", k.get("name", "?"))[:140]]
            acc[0] += d
            acc[1] += 1
        if end is not None and s > end:
            gap = s - end
            if gap >= gap_us * 1000:
                row = idle_by[callers.get(corr, "(no launch event)")]
                row[0] += gap
                row[1] += 1
                gaps.append(gap)
        busy += d if end is None else max(0, s + d - max(s, end))
        end = s + d if end is None else max(end, s + d)
    span = end - _ns(dev[0]["ts"]) if dev else 0
    host: dict[str, list] = defaultdict(lambda: [0, 0])  # frame -> [inclusive ns, calls]
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "python_function" and _OURS.search(e.get("name", "")):
            row = host[_frame(e["name"])]
            row[0] += _ns(e.get("dur", 0))
            row[1] += 1
    runtime: dict[str, list] = defaultdict(lambda: [0, 0])
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS:
            runtime[e.get("name", "?")][0] += _ns(e.get("dur", 0))
            runtime[e.get("name", "?")][1] += 1

    def per_step_us(ns: int) -> float:
        return round(ns / 1e3 / steps, 1)

    gaps.sort()
    return {
        "steps": steps, "span_us": per_step_us(span), "busy_us": per_step_us(busy),
        "idle_us": per_step_us(span - busy),
        "graph_kernels": round(graph_kernels / steps, 1), "eager_kernels": round(eager_kernels / steps, 1),
        "idle_gaps_over_threshold": {"gap_us": gap_us, "count_per_step": round(len(gaps) / steps, 1),
                                     "median_us": round(gaps[len(gaps) // 2] / 1e3, 1) if gaps else None,
                                     "max_us": round(gaps[-1] / 1e3, 1) if gaps else None},
        "eager_us": {n: {"us": per_step_us(v[0]), "count": round(v[1] / steps, 2)}
                     for n, v in sorted(eager.items(), key=lambda kv: -kv[1][0])[:top]},
        "runtime_us": {n: {"us": per_step_us(v[0]), "count": round(v[1] / steps, 2)}
                       for n, v in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:top]},
        "idle_by_caller_us": {n: {"us": per_step_us(v[0]), "gaps": round(v[1] / steps, 2)}
                              for n, v in sorted(idle_by.items(), key=lambda kv: -kv[1][0])[:top]},
        "host_us_by_frame": {n: {"us": per_step_us(v[0]), "calls": round(v[1] / steps, 2)}
                             for n, v in sorted(host.items(), key=lambda kv: -kv[1][0])[:2 * top]},
    }


def difference(a: dict, b: dict, top: int = 20) -> dict:
    """b minus a, per step: the totals, each eager kernel, idle caller and host frame (largest first)."""
    out = {k: round(b[k] - a[k], 1) for k in ("span_us", "busy_us", "idle_us", "graph_kernels", "eager_kernels")}
    for part in ("eager_us", "idle_by_caller_us", "host_us_by_frame"):
        names = set(a[part]) | set(b[part])
        rows = {n: round(b[part].get(n, {}).get("us", 0.0) - a[part].get(n, {}).get("us", 0.0), 1) for n in names}
        out[part] = dict(sorted(rows.items(), key=lambda kv: -abs(kv[1]))[:top])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--steps", type=int, required=True, help="the forward steps each trace holds (num_steps)")
    ap.add_argument("--gap-us", type=float, default=20.0)
    ap.add_argument("--diff", action="store_true", help="two traces: the second minus the first")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = {t: timeline(t, args.steps, args.gap_us) for t in args.traces}
    if args.diff:
        if len(args.traces) != 2:
            ap.error("--diff takes two traces")
        res["difference"] = difference(res[args.traces[0]], res[args.traces[1]])
    if args.out:
        write_json(args.out, res)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

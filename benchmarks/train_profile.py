"""The profile mode of benchmarks/train_scale.py (`--profile`): torch.profiler over a few training steps of each
drafter kind after a warm-up, the time of every named part of a step, DSpine minus DFlash per part.

The parts are the `region(...)` names of the trainer, the objective and the drafter (sglang_dspine/profiling.py):
train.* (data, target, blocks, ce_prepass, forward, backward, optimizer) around obj.* (context_kv, embed,
drafter, select, teacher_logits, vocab, metrics, refinement, alignment) around drafter.* (mask, attention, mlp,
injection, norm). Each kernel (on the CPU: each operator's self time) is charged to a row:
  * `TOP/LEAF`: forward work, TOP the outermost train.* region, LEAF the innermost region;
  * `train.backward/LEAF`: a backward node's work, LEAF the region of the forward operator that made the node
    (matched by autograd's sequence number, as the profiler records it); `(accumulate_grad)` the gradient sums;
  * `train.backward/recompute/LEAF`: forward work re-run inside backward (the checkpointed loss chunks);
  * `(outside regions)`: the rest (metrics, the loss's assembly).
Times are per optimizer step (the mean over the profiled steps); on a GPU the kernels' device time, with
launches the number of kernels (memcpy and memset included); on the CPU the operators' self CPU time, with
launches the number of aten operator calls.

Those device times come from FunctionEvent.kernels, which can list one kernel under several CPU events (issue 29:
the totals exceeded the device's by a quarter). The chrome trace is the device truth: timeline() reads it (GPU
busy, idle, launches per step; per row the idle time before its kernels, charged to the region that launched
them), and `python benchmarks/train_profile.py timeline TRACE.json.gz ... --steps N` prints it.
"""
from __future__ import annotations

import bisect
import os
from collections import defaultdict

import torch

from sglang_dspine.source_files import as_package

if not __package__:  # run as a file (python benchmarks/train_profile.py timeline ...): the package first
    as_package(__file__)

from benchmarks.output import write_json  # noqa: E402

EVAL = "autograd::engine::evaluate_function: "
REGION_PREFIXES = ("train.", "obj.", "drafter.")
OUTSIDE = "(outside regions)"
TRACE_CAP_BYTES = 16 * 2**20  # what a device call can bring back per file


def _is_region(name: str) -> bool:
    return name.startswith(REGION_PREFIXES)


class _Charger:
    """The row a CPU event's work is charged to, from its parent's state: shared by attribute() (profiler
    events) and timeline() (a chrome trace), so that both name the rows alike. Events must come in start order
    (parents before children, forward operators before the backward nodes they made)."""

    def __init__(self) -> None:
        self.made_by: dict = defaultdict(lambda: ([], []))  # thread -> (sequence numbers, leaves)

    def forward_leaf(self, thread, seq: int) -> str:
        if thread not in self.made_by and len(self.made_by) == 1:  # a thread id the profiler did not carry over
            thread = next(iter(self.made_by))
        seqs, leaves = self.made_by[thread]
        i = bisect.bisect_right(seqs, seq) - 1
        return leaves[i] if i >= 0 else "(unattributed)"

    def state(self, name: str, parent: tuple | None, thread, seq: int, fwd_thread) -> tuple:
        """(phase, top, leaf) of an event named `name` inside `parent`'s state (None: outside any event)."""
        phase, top, leaf = parent or ("fwd", None, None)
        if name.startswith(EVAL):
            node = name[len(EVAL):]
            leaf = "(accumulate_grad)" if "AccumulateGrad" in node else (
                self.forward_leaf(fwd_thread, seq) if seq >= 0 else "(unattributed)")
            phase, top = "bwd", "train.backward"
        elif _is_region(name):
            if phase == "fwd":
                top = top or name
                leaf = name
            else:  # a region entered inside backward: the checkpoint's recomputation
                phase, leaf = "recompute", name
        if phase == "fwd" and seq >= 0:
            seqs, leaves = self.made_by[thread]
            if seqs and seqs[-1] == seq:  # the last operator with a number is the node's maker
                leaves[-1] = leaf or OUTSIDE
            elif not seqs or seq > seqs[-1]:
                seqs.append(seq)
                leaves.append(leaf or OUTSIDE)
        return phase, top, leaf

    @staticmethod
    def row(state: tuple | None) -> str:
        phase, top, leaf = state or ("fwd", None, None)
        if top is None:
            return OUTSIDE
        if phase == "recompute":
            return f"train.backward/recompute/{leaf}"
        return top if leaf == top else f"{top}/{leaf}"


def attribute(events, on_device: bool) -> dict:
    """Rows {name: [microseconds, launches]} and kernels {name: [microseconds, count]} from a profile's events
    (`prof.events()`), for the whole profiled window (not per step). On a GPU, FunctionEvent.kernels can hold
    a kernel under several CPU events (issue 29: the fused optimizer's kernels many times over), so the totals
    can exceed the device's; timeline() reads the chrome trace, the device truth."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    cpu.sort(key=lambda e: (e.time_range.start, -e.time_range.end))  # parents before their children
    charger = _Charger()
    state: dict[int, tuple] = {}  # id(event) -> (phase, top, leaf)
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in cpu:
        parent = state.get(id(e.cpu_parent)) if e.cpu_parent is not None else None
        state[id(e)] = charger.state(e.name, parent, e.thread, e.sequence_nr, e.fwd_thread)
        row = charger.row(state[id(e)])
        if on_device:
            for k in e.kernels:
                rows[row][0] += k.duration
                rows[row][1] += 1
                kernels[k.name][0] += k.duration
                kernels[k.name][1] += 1
        else:
            rows[row][0] += e.self_cpu_time_total
            rows[row][1] += e.name.startswith("aten::")
    return {"rows": dict(rows), "kernels": dict(kernels)}


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # what occupies the device
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # what launched it (Triton kernels go through cuLaunchKernel)
HOST_CATS = ("cpu_op", "user_annotation")  # what the rows are named after
NO_LAUNCH = "(no launch event)"


def load_trace(src) -> list[dict]:
    """A chrome trace's events, from a path (gzipped or not) or an already loaded dict."""
    if isinstance(src, dict):
        return src["traceEvents"]
    import gzip
    import json

    with (gzip.open(src, "rt") if str(src).endswith(".gz") else open(src)) as f:
        return json.load(f)["traceEvents"]


def _ns(us) -> int:
    """Trace times are microseconds with nanosecond fractions: integer nanoseconds make nesting exact."""
    return round(float(us) * 1000)


def launch_rows(events: list[dict]) -> tuple[dict, dict]:
    """{correlation: row} for every launch, the row that of the CPU event innermost around it on its thread
    (named by _Charger, as attribute() names them), and {correlation: the ProfilerStep# running then, on any
    thread: the autograd thread's launches belong to the main thread's step}. One sweep in start order with a
    stack per thread: launches are points, so a launch event that outlasts its operator by a clock's rounding
    still counts as inside it."""
    items = []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat = e.get("cat")
        if cat in HOST_CATS:
            items.append((_ns(e["ts"]), 0, -_ns(e["ts"]) - _ns(e.get("dur", 0)), e))
        elif cat in LAUNCH_CATS and "correlation" in e.get("args", {}):
            items.append((_ns(e["ts"]), 1, 0, e))
    items.sort(key=lambda t: t[:3])  # parents before children, operators before the launches they start with
    charger = _Charger()
    stacks: dict = defaultdict(list)  # tid -> [(end ns, state)]
    step = (None, 0)  # (name, end ns) of the last ProfilerStep# begun
    rows: dict[int, str] = {}
    steps: dict[int, str] = {}
    for start, is_launch, neg_end, e in items:
        stack = stacks[e.get("tid")]
        while stack and (stack[-1][0] < start if is_launch else stack[-1][0] <= start or stack[-1][0] < -neg_end):
            stack.pop()
        parent = stack[-1][1] if stack else None
        if is_launch:
            rows[e["args"]["correlation"]] = charger.row(parent)
            steps[e["args"]["correlation"]] = step[0] if start <= step[1] else None
            continue
        if e["name"].startswith("ProfilerStep#"):
            step = (e["name"], -neg_end)
        args = e.get("args", {})
        st = charger.state(e["name"], parent, e.get("tid"), args.get("Sequence number", -1),
                           args.get("Fwd thread id"))
        stack.append((-neg_end, st))
    return rows, steps


def timeline(src, steps: int) -> dict:
    """The device's own account of the profiled window, per optimizer step: busy (kernels, memcpy, memset),
    idle (the span of device work minus the union of its intervals), launches; and per row the busy time and
    the idle time just before each of the row's kernels. A gap is charged to the row that was running on the
    CPU when the kernel after it was launched (its launch event, found by correlation id): the GPU waited
    for that launch. Backward kernels (the autograd thread) go to train.backward/LEAF, LEAF the forward region
    that made the node, by the trace's 'Sequence number' and 'Fwd thread id', as attribute() does."""
    events = load_trace(src)
    rows_of, step_of = launch_rows(events)
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS),
                 key=lambda e: _ns(e["ts"]))
    rows: dict[str, list] = defaultdict(lambda: [0, 0, 0])  # row -> [busy ns, idle ns, launches]
    per_step: dict[str, list] = defaultdict(lambda: [0, 0, 0])
    busy = idle = union = 0
    end = None
    for k in dev:
        s, d = _ns(k["ts"]), _ns(k.get("dur", 0))
        gap = max(0, s - end) if end is not None else 0
        corr = k.get("args", {}).get("correlation")
        for acc in (rows[rows_of.get(corr, NO_LAUNCH)], per_step[step_of.get(corr) or "(no step)"]):
            acc[0] += d
            acc[1] += gap
            acc[2] += 1
        busy, idle = busy + d, idle + gap
        union += max(0, s + d - max(s, end)) if end is not None else d
        end = s + d if end is None else max(end, s + d)
    span = (end - _ns(dev[0]["ts"])) if dev else 0

    def ms(ns: int) -> float:
        return round(ns / 1e6 / steps, 3)

    return {"steps": steps, "busy_ms": ms(busy), "idle_ms": ms(idle), "union_ms": ms(union),
            "span_ms": ms(span), "launches": round(len(dev) / steps, 1),
            "streams": len({(k.get("pid"), k.get("tid")) for k in dev}),
            "per_profiler_step": {n: {"busy_ms": round(v[0] / 1e6, 3), "idle_ms": round(v[1] / 1e6, 3),
                                      "launches": v[2]} for n, v in sorted(per_step.items())},
            "rows": {n: {"busy_ms": ms(v[0]), "idle_ms": ms(v[1]), "launches": round(v[2] / steps, 1)}
                     for n, v in sorted(rows.items(), key=lambda kv: (-kv[1][1], -kv[1][0]))}}


def summarise(att: dict, steps: int, top_kernels: int = 25) -> dict:
    """Per optimizer step: rows (ms, launches), totals per top-level region, the largest kernels."""
    rows = {k: {"ms": round(v[0] / 1000 / steps, 3), "launches": round(v[1] / steps, 1)}
            for k, v in sorted(att["rows"].items(), key=lambda kv: -kv[1][0])}
    tops: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "launches": 0.0})
    for k, v in rows.items():
        t = tops[k.split("/", 1)[0]]
        t["ms"] = round(t["ms"] + v["ms"], 3)
        t["launches"] = round(t["launches"] + v["launches"], 1)
    kern = sorted(att["kernels"].items(), key=lambda kv: -kv[1][0])
    return {"total_ms": round(sum(v["ms"] for v in rows.values()), 3),
            "total_launches": round(sum(v["launches"] for v in rows.values()), 1),
            "tops": dict(tops), "rows": rows,
            "kernels_top": [{"name": n[:200], "ms": round(v[0] / 1000 / steps, 3), "count": round(v[1] / steps, 1)}
                            for n, v in kern[:top_kernels]],
            "_kernels_all": {n[:200]: v[0] / 1000 / steps for n, v in kern}}


def difference(a: dict, b: dict, top_kernels: int = 20) -> dict:
    """b minus a (DSpine minus DFlash) for every row, top-level region and kernel either has."""
    def diff(x: dict, y: dict) -> dict:
        keys = set(x) | set(y)
        out = {k: {"ms": round(y.get(k, {}).get("ms", 0.0) - x.get(k, {}).get("ms", 0.0), 3),
                   "launches": round(y.get(k, {}).get("launches", 0.0) - x.get(k, {}).get("launches", 0.0), 1)}
               for k in keys}
        return dict(sorted(out.items(), key=lambda kv: -abs(kv[1]["ms"])))

    ka, kb = a["_kernels_all"], b["_kernels_all"]
    kd = sorted(((n, kb.get(n, 0.0) - ka.get(n, 0.0)) for n in set(ka) | set(kb)), key=lambda t: -abs(t[1]))
    return {"total_ms": round(b["total_ms"] - a["total_ms"], 3),
            "total_launches": round(b["total_launches"] - a["total_launches"], 1),
            "tops": diff(a["tops"], b["tops"]), "rows": diff(a["rows"], b["rows"]),
            "kernels": [{"name": n, "ms": round(d, 3)} for n, d in kd[:top_kernels]]}


def profile_kind(train_fn, tc, target, warmup: int, steps: int, device: torch.device,
                 trace_path: str | None = None) -> dict:
    """Train `warmup + steps` steps of `tc` under torch.profiler, the last `steps` recorded; a summary of
    them. trace_path: also a gzipped chrome trace of them, dropped if over TRACE_CAP_BYTES."""
    from torch.profiler import ProfilerActivity, profile, schedule

    on_device = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    got: dict = {}

    def ready(prof) -> None:
        got["att"] = attribute(prof.events(), on_device)
        if trace_path:
            os.makedirs(os.path.dirname(os.path.abspath(trace_path)), exist_ok=True)
            prof.export_chrome_trace(trace_path)
            size = os.path.getsize(trace_path)
            got["trace"] = {"file": os.path.basename(trace_path), "bytes": size}
            got["timeline"] = timeline(trace_path, steps)  # read before a trace over the cap is dropped
            if size > TRACE_CAP_BYTES:
                os.remove(trace_path)
                got["trace"]["dropped"] = f"over {TRACE_CAP_BYTES // 2**20} MiB"

    # the first period holds the trainer's set-up and step 0: skipped, like the rest of the warm-up
    sched = schedule(wait=max(warmup - 1, 0), warmup=min(warmup, 1), active=steps, repeat=1)
    if on_device:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with profile(activities=acts, schedule=sched, on_trace_ready=ready) as prof:
        train_fn(tc, target=target, on_step=lambda _s: prof.step())
    if "att" not in got:
        raise RuntimeError(f"the profile recorded nothing ({warmup} + {steps} steps)")
    res = summarise(got["att"], steps)
    res["device"] = "gpu kernels" if on_device else "cpu operators"
    if on_device:
        res["peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
    if "trace" in got:
        res["trace"] = got["trace"]
        res["timeline"] = got["timeline"]
        busy = got["timeline"]["busy_ms"]
        res["table_total_over_trace_busy"] = round(res["total_ms"] / busy, 3) if busy else None
    return res


def table(per_kind: dict, diff: dict, rows: int = 40) -> str:
    """The comparison as text: totals, then the rows with the largest |difference|."""
    a, b = per_kind["dflash"], per_kind["dspine"]
    unit = "GPU ms" if a["device"] == "gpu kernels" else "CPU ms"
    lines = [f"{'per optimizer step, ' + unit:<58} {'DFlash':>9} {'DSpine':>9} {'diff':>9} {'launches':>15}"]
    ta, tb = a.get("timeline"), b.get("timeline")
    if on_device := (ta and tb and (ta["launches"] or tb["launches"])):
        lines.append("-- the device truth (the chrome trace's kernels, memcpy, memset)")
        for key, what in (("busy_ms", "GPU busy"), ("idle_ms", "GPU idle (span minus busy)")):
            lines.append(f"{what:<58} {ta[key]:>9.2f} {tb[key]:>9.2f} {tb[key] - ta[key]:>+9.2f}")
        lines.append(f"{'launches':<58} {ta['launches']:>9.0f} {tb['launches']:>9.0f} "
                     f"{tb['launches'] - ta['launches']:>+9.0f}")
        lines.append("-- the attribution table (profiler events; rows within a kind)")

    def line(name: str, x: dict, y: dict, d: dict) -> str:
        la, lb = x.get("launches", 0), y.get("launches", 0)
        return (f"{name[:58]:<58} {x.get('ms', 0.0):>9.2f} {y.get('ms', 0.0):>9.2f} {d['ms']:>+9.2f} "
                f"{la:>7.0f}/{lb:<7.0f}")

    lines.append(line("TOTAL (kernel time)", {"ms": a["total_ms"], "launches": a["total_launches"]},
                      {"ms": b["total_ms"], "launches": b["total_launches"]}, {"ms": diff["total_ms"]}))
    if on_device:
        over = [f"{n} x{k['table_total_over_trace_busy']:.2f}" for n, k in (("DFlash", a), ("DSpine", b))
                if abs((k.get("table_total_over_trace_busy") or 1.0) - 1.0) > 0.01]
        if over:
            lines.append(f"   (the table's total disagrees with the trace's busy time: {', '.join(over)})")
    if "wall_ms_per_step" in a:
        lines.append(f"{'wall per step (profiled)':<58} {a['wall_ms_per_step']:>9.1f} {b['wall_ms_per_step']:>9.1f} "
                     f"{b['wall_ms_per_step'] - a['wall_ms_per_step']:>+9.1f}")
    lines.append("-- by top-level region")
    for k, d in diff["tops"].items():
        lines.append(line(k, a["tops"].get(k, {}), b["tops"].get(k, {}), d))
    lines.append(f"-- rows by |diff| (first {rows} of {len(diff['rows'])})")
    for k, d in list(diff["rows"].items())[:rows]:
        lines.append(line(k, a["rows"].get(k, {}), b["rows"].get(k, {}), d))
    return "\n".join(lines)


def kind_name(path: str) -> str:
    """train_profile_dspine.json.gz -> dspine (train_scale.py's trace names); any other file: its name."""
    base = os.path.basename(path).split(".json")[0]
    return base[len("train_profile_"):] if base.startswith("train_profile_") else base


def timeline_table(per_kind: dict, rows: int = 12) -> str:
    """Per kind: busy, idle, launches per step, then the rows with the most idle time before their kernels."""
    lines = []
    for kind, t in per_kind.items():
        lines.append(f"{kind}: per step (mean of {t['steps']}) GPU busy {t['busy_ms']:.1f} ms, idle {t['idle_ms']:.1f} "
                     f"ms, {t['launches']:.0f} launches ({t['streams']} stream(s))")
        lines.append(f"  {'row, by idle before its kernels':<52} {'idle ms':>9} {'busy ms':>9} {'launches':>9}")
        for name, r in list(t["rows"].items())[:rows]:
            lines.append(f"  {name[:52]:<52} {r['idle_ms']:>9.2f} {r['busy_ms']:>9.2f} {r['launches']:>9.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Read train_scale.py --profile's chrome traces (the device truth).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    tl = sub.add_parser("timeline", help="GPU busy, idle and launches per step, and idle per row, of chrome traces",
                        description=timeline.__doc__.split("\n\n")[0])
    tl.add_argument("traces", nargs="+", help="chrome traces (.json or .json.gz), e.g. train_profile_dspine.json.gz")
    tl.add_argument("--steps", type=int, required=True, help="optimizer steps the traces hold (--profile-steps)")
    tl.add_argument("--rows", type=int, default=12, help="rows printed per kind")
    tl.add_argument("--out", help="write the timelines as JSON here")
    args = ap.parse_args(argv)
    per_kind = {kind_name(p): timeline(p, args.steps) for p in args.traces}
    print(timeline_table(per_kind, args.rows))
    if args.out:
        print("->", write_json(args.out, {"what": "train_profile.py timeline: per optimizer step, from chrome traces",
                                          "traces": args.traces, "per_kind": per_kind}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

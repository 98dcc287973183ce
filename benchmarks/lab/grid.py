"""The lab's drafter grid: the main DFlash/DSpine pair plus the runs that say how far its result holds.

Variants (each a full training run with its own cosine schedule; names are folders under runs/, drafters/):
  dflash, dspine            the main pair: `draft_layers` layers, `train_steps` steps, seed 0
  KIND_sN                   the training-length curve: N steps for each N in `curve_steps` (T in grid_temperatures)
  KIND_seedK                the main pair again with seed K, for each K in `seeds` (all temperatures)
                            (with `main_val`, the DSpine drafters of these pairs are also evaluated on the
                            validation suites: a recipe candidate that needs no arm of its own)
  KIND_lD                   depth ablation: D layers for each D in `depth_layers`, `depth_steps` steps (default
                            train_steps; else one of curve_steps, whose pair it is compared with)
  NAME (an arm)              one of the preset's `arms`: {"name", "kind", "steps", "seed", "flags", "val"}, a
                            training with its own `sglang-dspine train` flags (e.g. another recipe); `val`: also
                            evaluated on the validation suites (`val_suites`), where settings are chosen
  upgrade                   the trained main DFlash drafter warm-started to DSpine, only its injection trained
                            (`--init runs/dflash/final --freeze-backbone`) for `upgrade_frac` of `train_steps`
  NAME_argmax               not a training: the DSpine variants named in `walk_off` evaluated again with the
                            backbone's argmax instead of the transition-table walk (`eval --decoding argmax`), at
                            grid_temperatures, after every other evaluation
Every variant is trained, exported and evaluated on the lab's suites as one chain. At most `train_jobs`
trainings run at once (0: all), started in priority order (PRIORITY: the main pair, then the seeds, the curve
from the longest run down, depth, the upgrade), so that when the GPU is the bottleneck the main pair finishes
first and a deadline cuts the cheap variants, not the headline. The upgrade starts after the main DFlash
drafter. The evaluations share a pool of `eval_jobs` processes: queued as each variant is exported, or, with
`eval_after_training`, all after the last training, in the same priority order. With jobs == 1 (CPU, tests)
the trainings run one after another in this process, in that order, then the evaluations.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

KINDS = ("dflash", "dspine")


@dataclass
class Variant:
    name: str
    kind: str
    layers: int
    steps: int
    seed: int
    group: str  # main, curve, seed, depth, upgrade
    temps: list[float] = field(default_factory=list)
    init: str | None = None  # the variant whose final drafter this one starts from
    freeze: bool = False
    flags: list[str] = field(default_factory=list)  # more `sglang-dspine train` flags (an arm's)
    val: bool = False  # also evaluated on the validation suites


# Which trainings start first when only `train_jobs` may run at once (lower first).
PRIORITY = {"main": 0, "seed": 1, "arm": 2, "curve": 3, "depth": 4, "upgrade": 5}


def by_priority(vs: list[Variant]) -> list[Variant]:
    """The variants in the order their trainings start: by group (PRIORITY), longer runs first within a group,
    DFlash before DSpine within a pair (stable otherwise)."""
    return sorted(vs, key=lambda v: (PRIORITY[v.group], -v.steps))


def eval_name(name: str, decoding: str = "walk") -> str:
    """The name a drafter's evaluations are filed under: NAME, or NAME_argmax for the walk-off ablation."""
    return name if decoding == "walk" else f"{name}_{decoding}"


def walk_off_of(p: dict[str, Any], vs: list[Variant]) -> list[Variant]:
    """The DSpine variants the preset's `walk_off` names (also evaluated with the backbone's argmax)."""
    names = [x for x in str(p.get("walk_off") or "").split(",") if x.strip()]
    by_name = {v.name: v for v in vs}
    bad = [n for n in names if n not in by_name or by_name[n].kind != "dspine"]
    if bad:
        raise ValueError(f"walk_off {','.join(bad)}: expected DSpine variants of this grid "
                         f"({', '.join(v.name for v in vs if v.kind == 'dspine')})")
    return [by_name[n] for n in names]


def _ints(value: Any) -> list[int]:
    return [int(x) for x in str(value or "").split(",") if x.strip()]


def temps_of(value: Any) -> list[float]:
    return [float(t) for t in str(value or "").split(",") if t.strip()]


def grid_temps(p: dict[str, Any]) -> list[float]:
    """The temperatures of the grid's side runs (curve, depth, walk-off): `grid_temperatures`, default T=0."""
    return temps_of(p.get("grid_temperatures") or "0")


def active(p: dict[str, Any]) -> bool:
    """Whether a preset asks for more than the main pair."""
    return bool(_ints(p.get("curve_steps")) or _ints(p.get("seeds")) or _ints(p.get("depth_layers"))
                or float(p.get("upgrade_frac") or 0) > 0 or p.get("arms"))


ARM_KEYS = {"name", "kind", "steps", "seed", "flags", "val", "layers"}


def arms_of(p: dict[str, Any], layers: int, temps: list[float]) -> list[Variant]:
    """The preset's `arms` (a list of {"name", "kind", "steps", "seed", "flags", "val"}) as variants."""
    out = []
    for a in p.get("arms") or []:
        bad = set(a) - ARM_KEYS
        if bad or not {"name", "kind"} <= set(a) or a["kind"] not in KINDS:
            raise ValueError(f"arms: {a}: expected keys name, kind ({'/'.join(KINDS)}) and any of "
                             f"{sorted(ARM_KEYS - {'name', 'kind'})}")
        out.append(Variant(a["name"], a["kind"], int(a.get("layers") or layers),
                           int(a.get("steps") or p["train_steps"]), int(a.get("seed") or 0), "arm", temps,
                           flags=[str(f) for f in a.get("flags") or []], val=bool(a.get("val"))))
    return out


def variants(p: dict[str, Any]) -> list[Variant]:
    """The runs a preset asks for, the main pair first."""
    steps, layers = int(p["train_steps"]), int(p["draft_layers"])
    all_t = temps_of(p["temperatures"])
    grid_t = grid_temps(p)
    main_val = bool(p.get("main_val"))
    out = [Variant(k, k, layers, steps, 0, "main", all_t, val=main_val and k == "dspine") for k in KINDS]
    out += arms_of(p, layers, all_t)
    for n in _ints(p.get("curve_steps")):
        if n != steps:
            out += [Variant(f"{k}_s{n}", k, layers, n, 0, "curve", grid_t) for k in KINDS]
    for s in _ints(p.get("seeds")):
        if s != 0:
            out += [Variant(f"{k}_seed{s}", k, layers, steps, s, "seed", all_t, val=main_val and k == "dspine")
                    for k in KINDS]
    depth_steps = int(p.get("depth_steps") or 0) or steps
    if _ints(p.get("depth_layers")) and depth_steps != steps and depth_steps not in _ints(p.get("curve_steps")):
        raise ValueError(f"depth_steps {depth_steps}: expected train_steps or one of curve_steps (the "
                         f"{layers}-layer pair it is compared with must be trained at that length)")
    for d in _ints(p.get("depth_layers")):
        if d != layers:
            out += [Variant(f"{k}_l{d}", k, d, depth_steps, 0, "depth", grid_t) for k in KINDS]
    frac = float(p.get("upgrade_frac") or 0)
    if frac > 0:
        if not 0 < frac <= 1:
            raise ValueError(f"upgrade_frac {frac}: expected in (0, 1]")
        out.append(Variant("upgrade", "dspine", layers, max(1, round(frac * steps)), 0, "upgrade", all_t,
                           init="dflash", freeze=True))
    names = [v.name for v in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"arms: the names {dup} are taken (each variant is a folder under runs/)")
    return out


# --------------------------------------------------------------------------------------------- running
def run(lab, todo: list[Variant]) -> dict[str, str]:
    """_schedule under the preset's `mps`: the grid's processes (several at once) as clients of one CUDA MPS
    daemon (mps.py; where none can start, time-sliced as without it, and the log says why)."""
    if lab.runner.jobs < 2 or not lab.p.get("mps"):
        return _schedule(lab, todo)
    from benchmarks.lab import mps

    mps_env = mps.start(lab.path("mps"), lab.log)
    if mps_env:
        lab.runner.env = {**(lab.runner.env or os.environ), **mps_env}
    try:
        return _schedule(lab, todo)
    finally:
        if mps_env:
            mps.stop(mps_env)
            lab.runner.env = {k: v for k, v in lab.runner.env.items() if k not in mps_env}


def _schedule(lab, todo: list[Variant]) -> dict[str, str]:
    """Train, export and evaluate every variant (skipping what exists); returns {variant: error} of the failed.

    Trainings start in priority order (by_priority), at most `train_jobs` at once: a training starts only when
    every variant ranked above it has started, except one still waiting for the drafter it starts from. With
    `eval_after_training` the evaluations wait until no training is left (launch-bound evaluations and
    GPU-bound trainings sharing the GPU slow each other down) and are queued in the same order; otherwise each
    variant's evaluations are queued as soon as it is exported."""
    failed: dict[str, str] = {}
    todo = by_priority(todo)
    walk_off = walk_off_of(lab.p, todo)  # a bad name fails before any training
    trained = {v.name: threading.Event() for v in todo}
    ok = {v.name: False for v in todo}
    parallel = lab.runner.jobs > 1
    after = bool(lab.p.get("eval_after_training"))
    eval_pool = ThreadPoolExecutor(max(1, int(lab.p.get("eval_jobs") or lab.p["jobs"]))) if parallel else None
    limit = [int(lab.p.get("train_jobs") or 0) or len(todo)]  # trainings allowed in flight
    running = [0]  # trainings in flight
    # trainings not started yet, in priority order; `blocked`: those still waiting for their starting point
    pending = [v.name for v in todo if not lab.done("train", lab.path("runs", v.name, "final", "config.json"))]
    blocked = {v.name for v in todo if v.init and v.init in trained}
    cond = threading.Condition()
    evals: dict[str, list] = {}  # variant -> its queued evaluations (futures), or the steps to run in order

    def first_pending() -> str | None:
        return next((n for n in pending if n not in blocked), None)

    def train_once(v: Variant, args: list[str]) -> None:
        """One training, once a slot is free and it is the first pending one."""
        with cond:
            cond.wait_for(lambda: running[0] < limit[0] and first_pending() == v.name)
            pending.remove(v.name)
            running[0] += 1
            cond.notify_all()
        try:
            lab.runner.run(f"train_{v.name}", "cli", args)
        finally:
            with cond:
                running[0] -= 1
                cond.notify_all()

    def train(v: Variant) -> None:
        """A training that ran out of GPU memory beside the others is retried once, with at most half as many
        trainings in flight from then on (its log says so)."""
        args = lab.train_args(v.kind, name=v.name, layers=v.layers, steps=v.steps, seed=v.seed,
                              init=lab.path("runs", v.init, "final") if v.init else None, freeze=v.freeze,
                              flags=v.flags)
        try:
            train_once(v, args)
        except RuntimeError as e:
            if not parallel or "out of memory" not in str(e).lower():
                raise
            with cond:
                limit[0] = max(1, min(limit[0], len(todo)) // 2)
                pending.insert(0, v.name)
            lab.log(f"grid {v.name}: out of GPU memory; retried once, at most {limit[0]} trainings in flight")
            shutil.rmtree(lab.path("runs", v.name), ignore_errors=True)
            train_once(v, args)

    def queue_evals(v: Variant, temps: list[float] | None = None, decoding: str = "walk") -> None:
        steps = lab.eval_steps(v.name, v.temps if temps is None else temps, decoding, val=v.val)
        evals[eval_name(v.name, decoding)] = (
            steps if eval_pool is None else [eval_pool.submit(lab.runner.run, *s) for s in steps])

    def chain(v: Variant) -> None:
        """Train (after its starting point, if any) and export; queue the evaluations unless they wait."""
        try:
            if v.init:
                if v.init in trained:
                    trained[v.init].wait()
                    with cond:
                        blocked.discard(v.name)
                        cond.notify_all()
                    if not ok[v.init]:
                        raise RuntimeError(f"{v.init} (its starting point) failed")
                if not os.path.isfile(lab.path("runs", v.init, "final", "config.json")):
                    raise RuntimeError(f"no {lab.path('runs', v.init, 'final')} to start from")
            if v.name in pending:
                train(v)
            ok[v.name] = True
        finally:
            with cond:  # a chain that failed before its training must not hold the others back
                if v.name in pending:
                    pending.remove(v.name)
                cond.notify_all()
            trained[v.name].set()
        if not lab.done("export", lab.path("drafters", v.name, "config.json")):
            lab.runner.run(f"export_{v.name}", "cli", lab.export_args(v.name))
        if not after:
            queue_evals(v)

    def record(name: str, e: BaseException) -> None:
        failed.setdefault(name, f"{type(e).__name__}: {e}")

    if parallel:
        with ThreadPoolExecutor(len(todo)) as ex:
            futures = {v.name: ex.submit(chain, v) for v in todo}
            for name, f in futures.items():
                if f.exception() is not None:
                    record(name, f.exception())
    else:
        for v in todo:
            try:
                chain(v)
            except (RuntimeError, OSError, ValueError) as e:
                record(v.name, e)
    if after:
        for v in todo:
            if v.name not in failed:
                queue_evals(v)
    # the walk-off ablation last: a deadline cuts it before any evaluation the grid's results need
    for v in walk_off:
        if v.name not in failed:
            queue_evals(v, grid_temps(lab.p), decoding="argmax")
    for name, queued in evals.items():  # in priority order when queued after training
        for q in queued:
            try:
                q.result() if eval_pool is not None else lab.runner.run(*q)
            except (RuntimeError, OSError, ValueError) as e:
                record(name, e)
    if eval_pool is not None:
        eval_pool.shutdown()
    return failed


# --------------------------------------------------------------------------------------------- results
def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 4) if xs else None


def _spread(xs: list[float]) -> dict[str, Any]:
    return {"values": [round(x, 4) for x in xs], "min": round(min(xs), 4), "max": round(max(xs), 4),
            "std": round(statistics.stdev(xs), 4) if len(xs) > 1 else 0.0} if xs else {}


def summarize(lab, vs: list[Variant]) -> dict[str, Any]:
    """τ of every variant per temperature and suite, and what they say: the curve, the seed spread, depth, the
    upgrade. A ratio is DSpine ÷ DFlash per suite, averaged over the suites (each suite counts once)."""
    suites = lab.suites
    tau: dict[str, dict[str, dict[str, float]]] = {}
    positions: dict[str, dict[str, dict[str, list[float]]]] = {}

    def read(label: str, temps: list[float]) -> None:
        for t in temps:
            tk = f"t{t:g}"
            for s in suites:
                f = lab.path("eval", f"{label}_{s}_{tk}.json")
                if os.path.isfile(f):
                    r = json.load(open(f))
                    tau.setdefault(label, {}).setdefault(tk, {})[s] = round(r["tau"], 4)
                    acc = [round(x, 4) for x in r["position_acceptance"]]
                    positions.setdefault(label, {}).setdefault(tk, {})[s] = acc

    for v in vs:
        read(v.name, v.temps)
    walk_off = walk_off_of(lab.p, vs)
    for v in walk_off:
        read(eval_name(v.name, "argmax"), grid_temps(lab.p))

    def ratio(a: str, b: str, tk: str) -> float | None:
        ta, tb = tau.get(a, {}).get(tk, {}), tau.get(b, {}).get(tk, {})
        common = [s for s in suites if s in ta and s in tb]
        return _mean([ta[s] / max(tb[s], 1e-9) for s in common]) if common and len(common) == len(suites) else None

    def mean_tau(name: str, tk: str) -> float | None:
        row = tau.get(name, {}).get(tk, {})
        return _mean([row[s] for s in suites if s in row]) if all(s in row for s in suites) else None

    def ratio_of_means(a: str, b: str, tk: str) -> float | None:
        """The paper's statistic: mean τ over the suites of a ÷ that of b."""
        ma, mb = mean_tau(a, tk), mean_tau(b, tk)
        return round(ma / mb, 4) if ma is not None and mb else None

    by_name = {v.name: v for v in vs}
    train = {}
    for v in vs:
        m = lab.path("runs", v.name, "metrics.jsonl")
        if os.path.isfile(m):
            lines = [json.loads(x) for x in open(m) if x.strip()]
            if lines:
                last = lines[-1]
                train[v.name] = {k: round(last[k], 4) if isinstance(last[k], float) else last[k]
                                 for k in ("step", "loss", "accuracy", "backbone_accept_len") if k in last}
    out: dict[str, Any] = {
        "variants": {v.name: {"group": v.group, "kind": v.kind, "layers": v.layers, "steps": v.steps, "seed": v.seed,
                              "init": v.init, "freeze_backbone": v.freeze, "tau": tau.get(v.name, {}),
                              "train": train.get(v.name)} for v in vs},
        "position_acceptance": positions,
    }
    temps = sorted({f"t{t:g}" for v in vs for t in v.temps})
    # training-length curve: (steps) -> mean τ and ratio; the main pair is its last point
    curve: dict[str, Any] = {}
    for v in vs:
        if v.group in ("main", "curve") and v.kind == "dspine":
            other = v.name.replace("dspine", "dflash", 1)
            curve[str(v.steps)] = {tk: {"dflash": mean_tau(other, tk), "dspine": mean_tau(v.name, tk),
                                        "ratio": ratio(v.name, other, tk)}
                                   for tk in temps if tk in tau.get(v.name, {})}
    out["curve"] = dict(sorted(curve.items(), key=lambda kv: int(kv[0])))
    # seeds at the last point: the main pair is seed 0
    seeds = {0: ("dspine", "dflash")}
    for v in vs:
        if v.group == "seed" and v.kind == "dspine":
            seeds[v.seed] = (v.name, v.name.replace("dspine", "dflash", 1))
    out["seeds"] = {}
    for tk in temps:
        per = {str(s): ratio(a, b, tk) for s, (a, b) in seeds.items()}
        vals = [x for x in per.values() if x is not None]
        of_means = {str(s): ratio_of_means(a, b, tk) for s, (a, b) in seeds.items()}
        om = [x for x in of_means.values() if x is not None]
        out["seeds"][tk] = {"ratio_of_means_per_seed": of_means, "tau_ratio_of_means": _mean(om),
                            "ratio_of_means_spread": _spread(om),
                            "ratio_per_seed": per, "tau_ratio": _mean(vals), "spread": _spread(vals),
                            "tau_mean_per_seed": {str(s): {"dflash": mean_tau(b, tk), "dspine": mean_tau(a, tk)}
                                                  for s, (a, b) in seeds.items()}}
    # depth: each depth variant beside the main-depth pair trained for as many steps (main or a curve point)
    depth = {}
    for v in vs:
        if v.group == "depth" and v.kind == "dspine":
            ref = next((r for r in vs if r.group in ("main", "curve") and r.kind == "dspine" and r.steps == v.steps),
                       None)
            for u in (v, ref) if ref else (v,):
                other = u.name.replace("dspine", "dflash", 1)
                depth[str(u.layers)] = {tk: {"dflash": mean_tau(other, tk), "dspine": mean_tau(u.name, tk),
                                             "ratio": ratio(u.name, other, tk)} for tk in tau.get(v.name, {})}
            out["depth_steps"] = v.steps
    out["depth"] = dict(sorted(depth.items(), key=lambda kv: int(kv[0])))
    # the walk-off ablation: τ with the backbone's argmax ÷ τ with the walk, per suite (below 1: the walk helps)
    out["walk_off"] = {}
    for v in walk_off:
        a = eval_name(v.name, "argmax")
        out["walk_off"][v.name] = {
            tk: {"tau_walk": tau.get(v.name, {}).get(tk, {}), "tau_argmax": tau.get(a, {}).get(tk, {}),
                 "argmax_over_walk": {s: round(r / max(tau[v.name][tk][s], 1e-9), 4) for s, r in row.items()
                                      if s in tau.get(v.name, {}).get(tk, {})},
                 "ratio_mean": ratio(a, v.name, tk)}
            for tk, row in tau.get(a, {}).items()}
    if "upgrade" in by_name:
        out["upgrade"] = {tk: {"tau_mean": mean_tau("upgrade", tk), "vs_dflash": ratio("upgrade", "dflash", tk),
                               "vs_dspine_scratch": ratio("upgrade", "dspine", tk)} for tk in temps
                          if tk in tau.get("upgrade", {})}
        out["upgrade_steps"] = by_name["upgrade"].steps
    return out


def curve_measured(summary: dict[str, Any]) -> int:
    """How many points of the training-length curve hold a measured τ (a plot needs two)."""
    return sum(any(v is not None for row in point.values() for v in row.values())
               for point in summary["curve"].values())


def plot_curve(summary: dict[str, Any], path: str, title: str = "") -> str:
    """Mean τ over the suites against training steps, per drafter and temperature, and the ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = summary["curve"]
    steps = [int(s) for s in curve]
    temps = sorted({tk for row in curve.values() for tk in row})
    fig, (ax, axr) = plt.subplots(1, 2, figsize=(10, 4))
    for tk in temps:
        for kind, style in (("dflash", "--o"), ("dspine", "-s")):
            ys = [curve[str(s)].get(tk, {}).get(kind) for s in steps]
            pts = [(x, y) for x, y in zip(steps, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{kind} T={tk[1:]}")
        rs = [(x, curve[str(x)].get(tk, {}).get("ratio")) for x in steps]
        rs = [(x, y) for x, y in rs if y is not None]
        if rs:
            axr.plot(*zip(*rs), "-o", label=f"T={tk[1:]}")
    seeds = summary.get("seeds", {})
    for tk, row in seeds.items():  # the seed spread at the last point
        sp = row.get("spread") or {}
        if sp.get("values") and steps:
            axr.errorbar([max(steps)], [row["tau_ratio"]],
                         yerr=[[row["tau_ratio"] - sp["min"]], [sp["max"] - row["tau_ratio"]]],
                         fmt="kx", capsize=4, label="mean over seeds" if tk == "t0" else None)
    ax.set_xlabel("training steps")
    ax.set_ylabel("τ (mean over suites)")
    axr.set_xlabel("training steps")
    axr.set_ylabel("τ ratio DSpine ÷ DFlash")
    axr.axhline(1.0, color="gray", lw=0.8)
    for a in (ax, axr):
        a.legend(fontsize=8)
    fig.suptitle(title or "τ against training steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


"""The soak (issue 56): a server under the mixed request load for ≥ 15 minutes, the load varying between 1 and 64
clients, one row a minute; and the verdict on those rows. serving_pressure.py runs it (`--scenarios soak
--soak-seconds 960`) with its own load and readers passed in; everything here but `run_minutes` is arithmetic on
the rows, tested on CPU (tests/test_serving_pressure.py).

A minute: `clients` clients (SCHEDULE, a cycle) send serving_features' request kinds for MINUTE_S seconds, each
answer checked (greedy, sampled, grammar-constrained, log-probs, streaming, streams closed after two chunks,
long prompts, ...), then the clients finish the requests they hold and the server drains: at that idle point the
minute's free KV tokens and GPU memory are read, so a slot lost in that minute shows as a token missing from the
next reading, whatever the load was. The row: clients, requests, requests/s, p50/p99 latency, errors, the pool's
peak use under load, then the idle free tokens and GPU MiB.

The goals (`verdict`): it lasted MIN_SECONDS; 0 errors; GPU memory and free KV tokens flat (the least-squares
slope over the minutes times the run's span under FLAT_TOL of the fitted start); p99 not rising (`p99_trend`:
each minute's p99 over the median p99 of the minutes that had its client count, fitted over the run, rises
less than P99_RISE_TOL). `plot` draws the per-minute series (matplotlib).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time

# Clients per minute, cycled: every count returns every len(SCHEDULE) minutes (p99_trend compares like with like),
# from 1 to 64 and back, high and low loads interleaved.
SCHEDULE = (1, 16, 64, 32, 4, 48, 8, 64, 24, 2)
MINUTE_S = 60.0
MIN_SECONDS = 900.0  # the 15 minutes of load
FLAT_TOL = 0.01  # |fitted change over the run| under 1% of the fitted start
P99_RISE_TOL = 0.25  # p99 relative to its load's median may rise by a quarter over the run (p99 is noisy)


def schedule(minutes: int, cycle: tuple[int, ...] | None = None) -> list[int]:
    cycle = cycle or SCHEDULE
    return [cycle[m % len(cycle)] for m in range(minutes)]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope); None with fewer than two distinct xs."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def flatness(values: list, tol: float = FLAT_TOL) -> dict:
    """A per-minute series (None: unmeasured, left out) is flat when its fitted change over the run's span is
    under `tol` of its fitted start. ok None: fewer than two readings."""
    pts = [(float(m), float(v)) for m, v in enumerate(values) if v is not None]
    fit = fit_line([p[0] for p in pts], [p[1] for p in pts])
    if fit is None:
        return {"readings": len(pts), "ok": None}
    a, b = fit
    span = pts[-1][0] - pts[0][0]
    start = a + b * pts[0][0]
    change = b * span
    rel = abs(change) / abs(start) if start else (0.0 if change == 0 else math.inf)
    return {"readings": len(pts), "first": pts[0][1], "last": pts[-1][1], "fitted_start": round(start, 2),
            "slope_per_minute": round(b, 4), "change_over_run": round(change, 2), "relative": round(rel, 5),
            "tolerance": tol, "ok": rel < tol}


def p99_trend(rows: list[dict], tol: float = P99_RISE_TOL) -> dict:
    """Whether p99 rises over the run at equal load: each minute's p99 over the median p99 of the minutes with its
    client count; the fitted change of that ratio over the run under `tol` (a steady server's ratios scatter
    around 1 with no trend). Per client count, the first and last minute's p99 beside."""
    by_clients: dict[int, list[tuple[int, float]]] = {}
    for m, r in enumerate(rows):
        if r.get("p99_s") is not None:
            by_clients.setdefault(r["clients"], []).append((m, r["p99_s"]))
    ratios = []
    for pts in by_clients.values():
        med = statistics.median(p for _, p in pts)
        ratios += [(m, p / med) for m, p in pts if med > 0]
    ratios.sort()
    fit = fit_line([m for m, _ in ratios], [r for _, r in ratios])
    per = {str(c): {"minutes": len(p), "first_p99_s": p[0][1], "last_p99_s": p[-1][1]}
           for c, p in sorted(by_clients.items())}
    if fit is None:
        return {"ok": None, "per_clients": per}
    rise = fit[1] * (ratios[-1][0] - ratios[0][0])
    return {"ok": rise < tol, "ratio_rise_over_run": round(rise, 4), "tolerance": tol, "per_clients": per}


def verdict(rows: list[dict], seconds: float, min_seconds: float | None = None) -> dict:
    """The soak's goals over its minutes: lasted, no errors, GPU memory and idle free KV tokens flat, p99 not
    rising (each check None where nothing was measured)."""
    return {"lasted": seconds >= (MIN_SECONDS if min_seconds is None else min_seconds),
            "no_errors": sum(r["errors"] for r in rows) == 0,
            "gpu_memory_flat": flatness([r.get("gpu_mib") for r in rows]),
            "free_kv_tokens_flat": flatness([r.get("free_tokens") for r in rows]),
            "p99_not_rising": p99_trend(rows)}


def checks(v: dict) -> dict:
    """verdict() as the scenario's checks (True / False / None)."""
    return {k: (x["ok"] if isinstance(x, dict) else x) for k, x in v.items()}


def minute_row(minute: int, clients: int, records: list[tuple], seconds: float, answered: tuple) -> dict:
    """One minute's row from its load's (start s, latency s, kind, outcome) records: answered outcomes count
    toward the latency percentiles."""
    lat = [r[1] for r in records if r[3] in answered]
    return {"minute": minute, "clients": clients, "requests": len(records),
            "errors": sum(r[3] == "errors" for r in records),
            "unsupported": sum(r[3] == "unsupported" for r in records), "load_seconds": round(seconds, 1),
            "rps": round(len(records) / seconds, 2) if seconds > 0 else None,
            "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99)}


def run_minutes(minutes: list[int], load, idle_sample, peak_sample=None, alive=lambda: True,
                progress=None, minute_s: float | None = None, sample_s: float = 15.0,
                answered: tuple = ("ok",)) -> tuple[list[dict], dict]:
    """The soak: for each entry of `minutes` (its client count), `load(clients, seconds, minute)` (returns that
    load's records, all requests finished), then `idle_sample()` ({"free_tokens", "gpu_mib", "gpu_scope"} once
    the server is idle) into the row; `peak_sample()` every `sample_s` during the load ({"used_tokens"}: the
    row's peak). Stops early when `alive()` turns False. `progress(rows)` after each minute (the minutes so far on
    disk, should the lease end first). Returns the rows and {"seconds", "server_exited_after_minute"?}."""
    minute_s = MINUTE_S if minute_s is None else minute_s
    rows: list[dict] = []
    t0 = time.time()
    end: dict = {}
    for m, clients in enumerate(minutes):
        if not alive():
            end["server_exited_after_minute"] = m - 1
            break
        peaks: list = []
        done = threading.Event()

        def sampler(peaks=peaks, done=done):
            while peak_sample is not None and not done.is_set():
                try:
                    peaks.append(peak_sample().get("used_tokens"))
                except Exception:  # noqa: BLE001 - a missed sample
                    pass
                done.wait(sample_s)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        t = time.time()
        try:
            records = load(clients, minute_s, m)
        finally:
            done.set()
            th.join(30)
        row = minute_row(m, clients, records, time.time() - t, answered)
        row["used_tokens_peak"] = max((p for p in peaks if p is not None), default=None)
        try:
            row.update(idle_sample() if alive() else {})
        except Exception as e:  # noqa: BLE001 - an unread minute, not a lost soak
            row["idle_error"] = f"{type(e).__name__}: {e}"[:300]
        row["end_s"] = round(time.time() - t0, 1)
        rows.append(row)
        if progress is not None:
            progress(rows)
    end["seconds"] = round(sum(r["load_seconds"] for r in rows), 1)
    end["wall_seconds"] = round(time.time() - t0, 1)
    return rows, end


def write_progress(path: str, rows: list[dict], of_minutes: int) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"minutes": len(rows), "of_minutes": of_minutes, "per_minute": rows}, f, indent=1)
    os.replace(tmp, path)


def plot(rows: list[dict], path: str, title: str = "soak") -> str:
    """The per-minute series in four panels (requests/s with the clients; p50/p99; GPU MiB; idle free KV
    tokens) as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["minute"] + 1 for r in rows]
    fig, ax = plt.subplots(4, 1, figsize=(8, 10), sharex=True)
    ax[0].plot(x, [r["rps"] for r in rows], "o-", label="requests/s")
    ax[0].set_ylabel("requests/s")
    twin = ax[0].twinx()
    twin.step(x, [r["clients"] for r in rows], "--", color="grey", where="mid", label="clients")
    twin.set_ylabel("clients")
    for key, label in (("p50_s", "p50"), ("p99_s", "p99")):
        ax[1].plot(x, [r.get(key) for r in rows], "o-", label=label)
    ax[1].set_ylabel("latency (s)")
    ax[1].legend()
    ax[2].plot(x, [r.get("gpu_mib") for r in rows], "o-")
    ax[2].set_ylabel("GPU MiB (idle)")
    ax[3].plot(x, [r.get("free_tokens") for r in rows], "o-")
    ax[3].set_ylabel("free KV tokens (idle)")
    ax[3].set_xlabel("minute")
    errors = sum(r["errors"] for r in rows)
    fig.suptitle(f"{title}: {len(rows)} minutes, {sum(r['requests'] for r in rows)} requests, {errors} errors")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path

"""Verify shapes and the policy that picks one per decode step (SGLANG_DSPINE_VERIFY=adaptive).

A DSPINE step drafts a block of B tokens and the target verifies some of them. What that costs depends on the
load: at small batches the verify is memory-bound and nearly free in its width, at large ones it is
compute-bound and grows with batch × width, so a fixed width is wrong somewhere (docs/verify_shapes.md). The
shapes an adaptive server can run, for the whole batch:
  - `none`: the batch verifies only its bonus token: a plain decode step, no draft forward; the target's
    features of that token still go into the drafter's context, so speculation can resume on the next step;
  - `chainW`: the walk's first W - 1 draft tokens after the anchor (W verify rows a request), 2 <= W <= B;
  - `treeN`: with SGLANG_DSPINE_TREE=1, the server's tree of N - 1 nodes (N = --speculative-num-draft-tokens).
Verifying a prefix of a deterministic draft with the target-only rule is still lossless (each emitted token is
the target's own sample or argmax where the draft disagrees), so switching shapes between steps changes speed,
never text.

The policy maximises expected tokens per second: E(shape) / t(batch, shape), with
  - E(chainW) = 1 + Σ_{j=1}^{W-1} Π_{k<j} p_k: p_k the conditional acceptance at draft position k (accepted k+1
    given the first k were), counted on recent steps. A step of width W observes positions k < W - 1 only
    (later ones were not verified), so counts are kept per position and a narrow shape never erases what a wide
    one learned; E(none) = 1; E(treeN): the tree steps' own mean tokens per request (a tree's accepted path is
    not a prefix of the walk), E(chainB) before the first;
  - t(bucket, shape): what a step costs in a steady stream of such steps, measured online by the worker per batch
    bucket (the captured CUDA-graph batch size the batch pads to) and shape: the larger of the median of its
    recent wall intervals (`StepClock`: from the step's launch to the next decode step's, the scheduler's whole
    iteration) and the median of its recent GPU times (CUDA events around the step). Each is a lower bound of
    that steady cost: a stream of steps can go no faster than the host iterates, nor than the GPU runs each
    step. Neither alone suffices: where the host bounds the step, GPU time misses what differs (on the built-in
    pair, H100, 6f41609, the events gave the tree of 32 2.7-3.0 ms at one request, near the block's 2.4-2.7,
    while the fixed tree server's wall step was 5.9 ms against the block's 3.1); where the GPU bounds it, a
    short run's wall intervals miss GPU work that spills past the next launch (Qwen3-8B geometry, H100,
    c615dca: the block's wall 28.5 ms at 48 requests, its GPU time 39.2). A wall interval counts only when the
    decode step before it ran the same shape with nothing between (`StepClock`): after a change it also holds
    the previous shape's GPU work (where prefills void nearly every interval, a heavy load, a cell is known from
    its GPU time alone: `StepCosts`). Medians, so that one slow interval (a compile, a pause) does not stand for
    the cell; and each shape is measured again now and then (`refresh`), so that an estimate the policy stopped
    choosing on is not kept forever: at c615dca one bucket's `none` kept the 19.5 ms of its first intervals
    (its GPU time 7.5) and the policy ran chain4 instead, at 0.76x plain decoding, for the whole run. Online,
    not a start-up table, because it times what the server really runs (draft, verify, acceptance, context
    upkeep, at the requests' real context lengths) on this GPU and backend; the price is a few exploration
    steps per (bucket, shape) the first time a bucket is seen, and the same again for one other shape every
    `refresh` decisions at a bucket. Only the shape being run gets samples, so a burst of slow steps raises the
    current shape's estimate alone and can switch the policy away from it: the shape it leaves is measured
    again `recheck` decisions later, once (39171fe: one request, three slow `none` steps of 9.6 ms against its
    usual 6.9 switched it to chain4 until the refresh);
  - hysteresis: a challenger replaces the current shape only after beating it by `margin` on `patience`
    consecutive decisions.
Everything here is host-side Python on small numbers: no GPU, no SGLang (tests/test_verify_shapes.py).
"""
from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Shape:
    """Verify rows a request: 1 for `none`, W for `chainW` (W = B: the block, DFlash's own step), N for `treeN`
    (a tree of N - 1 nodes over the lattice, tree_verify.py; served fixed, SGLANG_DSPINE_TREE=1)."""

    rows: int
    tree: bool = False

    @property
    def drafts(self) -> bool:
        return self.rows > 1

    @property
    def name(self) -> str:
        if self.tree:
            return f"tree{self.rows}"
        return "none" if self.rows == 1 else f"chain{self.rows}"


DEFAULT_MENU = "none,4,8"


def parse_menu(spec: str | None, block: int) -> tuple[Shape, ...]:
    """The shapes of SGLANG_DSPINE_SHAPES, e.g. "none,4,8,16" ("block" names B), sorted, the block included
    (the widest shape is the fixed server's: the menu never makes adaptive narrower than that can be). Unset
    (None): DEFAULT_MENU's widths that are below the block."""
    if spec is None:
        return tuple(sorted({Shape(block), Shape(1), *(Shape(w) for w in (4, 8) if w < block)}))
    shapes = {Shape(block)}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item == "none":
            shapes.add(Shape(1))
            continue
        if item == "block":
            continue
        try:
            w = int(item.removeprefix("chain"))
        except ValueError:
            raise ValueError(f"SGLANG_DSPINE_SHAPES: {item!r} is not 'none', 'block' or a width") from None
        if not 2 <= w <= block:
            raise ValueError(f"SGLANG_DSPINE_SHAPES: width {w} outside 2..{block} (the drafter's block)")
        shapes.add(Shape(w))
    return tuple(sorted(shapes))


@dataclass
class AcceptanceCounts:
    """Per draft position k (0 .. B-2): decayed counts of requests that reached k (the first k drafts accepted,
    position k verified) and of those that passed it (accepted k + 1). `decay` per update: recent steps weigh
    more. `prior`/`prior_weight`: what p_k reads before any evidence (pseudo-counts)."""

    positions: int
    decay: float = 0.98
    prior: float = 0.5
    prior_weight: float = 1.0
    reached: list[float] = field(default_factory=list)
    passed: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.reached = [0.0] * self.positions
        self.passed = [0.0] * self.positions

    def update(self, rows: int, accepted: list[int]) -> None:
        """One step of width `rows` over a batch: `accepted[i]` draft tokens accepted for request i (0 .. rows-1).
        Only verified positions (k < rows - 1) change."""
        seen = min(rows - 1, self.positions)
        if seen <= 0 or not accepted:
            return
        # at_least[k]: requests that accepted k drafts or more (one pass over the batch, not one per position)
        at_least = [0] * (seen + 2)
        for a in accepted:
            at_least[min(a, seen + 1)] += 1
        for k in range(seen, -1, -1):
            at_least[k] += at_least[k + 1]
        for k in range(seen):
            self.reached[k] = self.decay * self.reached[k] + at_least[k]
            self.passed[k] = self.decay * self.passed[k] + at_least[k + 1]

    def p(self, k: int) -> float:
        return (self.passed[k] + self.prior * self.prior_weight) / (self.reached[k] + self.prior_weight)

    def expected_tokens(self, shape: Shape) -> float:
        """Tokens a request emits per step of `shape`: the accepted drafts plus the bonus."""
        e, alive = 1.0, 1.0
        for k in range(min(shape.rows - 1, self.positions)):
            alive *= self.p(k)
            e += alive
        return e


@dataclass
class TreeAcceptance:
    """Tokens a request emits per step of one tree shape (accepted drafts + the bonus): a decayed mean over recent
    tree steps' requests. A tree's accepted path is not a prefix of the walk, so its steps never touch the chain's
    per-position counts; before any tree step, E is `prior`."""

    decay: float = 0.98
    _sum: float = 0.0
    _weight: float = 0.0

    def update(self, accepted: list[int]) -> None:
        if accepted:
            self._sum = self.decay * self._sum + sum(a + 1 for a in accepted)
            self._weight = self.decay * self._weight + len(accepted)

    def expected_tokens(self, prior: float) -> float:
        return self._sum / self._weight if self._weight else prior


@dataclass
class StepCosts:
    """t(bucket, shape) in ms: max(median of the last `window` wall samples, median of the last `window` GPU
    samples) (see the module's docstring). A cell is unknown (the policy runs it to learn it) until it has
    `explore` wall samples, or a full `window` of GPU samples: under a heavy load new requests arrive nearly every
    step, their prefills void most wall intervals (`StepClock`), and there the GPU bounds the step anyway.
    `updated(bucket, shape)`: when the cell last got a sample (a running count of samples over all cells), for
    the policy's refresh of the stalest one."""

    explore: int = 3
    window: int = 5
    _wall: dict = field(default_factory=dict)
    _gpu: dict = field(default_factory=dict)
    _updated: dict = field(default_factory=dict)
    _samples: int = 0

    def add(self, bucket: int, shape: Shape, wall_ms: float | None = None, gpu_ms: float | None = None) -> None:
        for table, ms in ((self._wall, wall_ms), (self._gpu, gpu_ms)):
            if ms is not None and ms > 0 and math.isfinite(ms):
                recent = table.setdefault((bucket, shape), [])
                recent.append(ms)
                del recent[: -self.window]
                self._samples += 1
                self._updated[(bucket, shape)] = self._samples

    def forget(self, bucket: int, shape: Shape) -> None:
        """Drop the cell's samples (it is unknown again; `updated` keeps when it was last measured)."""
        self._wall.pop((bucket, shape), None)
        self._gpu.pop((bucket, shape), None)

    def known(self, bucket: int, shape: Shape) -> bool:
        key = (bucket, shape)
        return len(self._wall.get(key, ())) >= self.explore or len(self._gpu.get(key, ())) >= self.window

    def updated(self, bucket: int, shape: Shape) -> int:
        return self._updated.get((bucket, shape), 0)

    def ms(self, bucket: int, shape: Shape) -> float | None:
        parts = [statistics.median(t[(bucket, shape)]) for t in (self._wall, self._gpu) if t.get((bucket, shape))]
        return max(parts) if parts else None

    def table(self, part: str = "cost") -> dict[int, dict[str, float]]:
        """Per bucket and shape name: the cost (`cost`), or the median of one part (`wall`, `gpu`)."""
        cells = set(self._wall) | set(self._gpu)
        out: dict[int, dict[str, float]] = {}
        for bucket, shape in sorted(cells):
            if part == "cost":
                ms = self.ms(bucket, shape)
            else:
                recent = (self._wall if part == "wall" else self._gpu).get((bucket, shape))
                ms = statistics.median(recent) if recent else None
            if ms is not None:
                out.setdefault(bucket, {})[shape.name] = round(ms, 3)
        return out


class StepClock:
    """Each decode step's wall time on the host: from its launch to the next decode step's launch, i.e. the
    scheduler's whole iteration (the step's host work, and any wait for the GPU's work before it), attributed to
    the step the interval began with. In a steady stream of steps that is what a step costs in throughput,
    whichever of host and GPU is the bottleneck. A prefill or idle step between two decode steps voids the
    interval (it is not a decode step's). Where SGLang overlaps a step's launch with the previous step's GPU work,
    an interval also holds the wait for the step before it: so an interval is reported only when the decode step
    before its own ran the same shape, with nothing between (a settled interval)."""

    def __init__(self):
        self._open: tuple[int, Shape, float, bool] | None = None  # bs, shape, launch, settled

    def start(self, bs: int, shape: Shape, now: float) -> tuple[int, Shape, float] | None:
        """A decode step of `shape` for `bs` requests launches at `now` (seconds): the step before it, if its
        interval is settled, as (bs, shape, ms)."""
        closed = self._open
        self._open = (bs, shape, now, closed is not None and closed[1] == shape)
        if closed is None or not closed[3]:
            return None
        return closed[0], closed[1], 1000.0 * (now - closed[2])

    def interrupt(self) -> None:
        """Another kind of step runs: the open interval is not a decode step's, and the next one is unsettled."""
        self._open = None


class ShapePolicy:
    """Picks each step's shape for a batch of `bs` requests (see the module's docstring). `refresh`: every that
    many decisions at a bucket, the cost there of the shape measured longest ago (not the current one) is
    forgotten, and so explored again like a new cell (a few steps in a row), so that no estimate outlives the
    conditions it was measured in. At 500, such a probe costs at most ~2% at Qwen3-8B geometry (the block's four
    steps beside `none`'s at 48 requests, 4 x 28 ms over 500 x 11 ms), less in rotation with cheaper shapes.
    `recheck`: that many decisions after the policy switches away from a shape at a bucket, that shape is
    measured again, once. Only the shape being run gets samples, so a short burst of slow steps (39171fe: three
    of `none`'s last five at one request, 9.6 ms against its usual 6.9) raises the current shape's estimate
    alone and can switch the policy away; the estimate of the shape it left would then stand until `refresh`."""

    def __init__(self, menu: tuple[Shape, ...], buckets: list[int], block: int, margin: float = 0.05,
                 patience: int = 3, refresh: int = 500, recheck: int = 50):
        if not menu:
            raise ValueError("ShapePolicy: an empty menu")
        self.menu, self.buckets = tuple(sorted(menu)), sorted(set(buckets))
        self.block = block
        self.acceptance = AcceptanceCounts(block - 1)
        self.trees = {s: TreeAcceptance() for s in self.menu if s.tree}
        self.costs = StepCosts()  # wall and GPU time: what the choice uses
        self.margin, self.patience = margin, patience
        self.refresh, self.recheck = refresh, recheck
        self._rechecks: dict[int, tuple[Shape, int]] = {}  # bucket -> (the shape left there, when to measure it)
        self.current = self.menu[-1]  # the widest: what the fixed server runs
        self._challenger, self._wins = None, 0
        self._decisions: dict[int, int] = {}  # per bucket, since start (exploration steps excluded)

    def bucket(self, bs: int) -> int:
        """The captured batch size `bs` pads to; above the largest, `bs` itself (eager steps)."""
        i = bisect.bisect_left(self.buckets, bs)
        return self.buckets[i] if i < len(self.buckets) else bs

    def rate(self, bucket: int, shape: Shape) -> float | None:
        """Expected tokens per ms a request, or None while the cell's cost is unknown."""
        ms = self.costs.ms(bucket, shape) if self.costs.known(bucket, shape) else None
        return None if ms is None else self.expected_tokens(shape) / ms

    def expected_tokens(self, shape: Shape) -> float:
        """E(shape): the chain's from per-position acceptance; a tree's its own mean, the block chain's before any
        tree step (the walk is the best guess of the tree's best path)."""
        if shape.tree:
            return self.trees[shape].expected_tokens(self.acceptance.expected_tokens(Shape(self.block)))
        return self.acceptance.expected_tokens(shape)

    def choose(self, bs: int) -> Shape:
        bucket = self.bucket(bs)
        for shape in self.menu:  # learn every shape's cost at this bucket first (a few steps each)
            if not self.costs.known(bucket, shape):
                return shape
        n = self._decisions[bucket] = self._decisions.get(bucket, 0) + 1
        left, due = self._rechecks.get(bucket, (None, 0))
        if left is not None and n >= due:
            del self._rechecks[bucket]
            if left != self.current:
                self.costs.forget(bucket, left)
                return left  # explored again from this step on
        if self.refresh and n % self.refresh == 0 and len(self.menu) > 1:
            stale = min((s for s in self.menu if s != self.current), key=lambda s: self.costs.updated(bucket, s))
            self.costs.forget(bucket, stale)
            return stale  # explored again from this step on
        rates = {s: self.rate(bucket, s) for s in self.menu}
        best = max(self.menu, key=lambda s: rates[s])
        if best == self.current or rates[best] <= rates[self.current] * (1 + self.margin):
            self._challenger, self._wins = None, 0
            return self.current
        self._wins = self._wins + 1 if best == self._challenger else 1
        self._challenger = best
        if self._wins >= self.patience:
            if self.recheck:
                self._rechecks[bucket] = (self.current, n + self.recheck)
            self.current, self._challenger, self._wins = best, None, 0
        return self.current

    def observe(self, bs: int, shape: Shape, ms: float | None, accepted: list[int] | None,
                gpu_ms: float | None = None) -> None:
        """A finished step: its settled wall time (None when not measured), accepted drafts per request, its GPU
        time."""
        self.costs.add(self.bucket(bs), shape, wall_ms=ms, gpu_ms=gpu_ms)
        if accepted is not None and shape.tree:
            self.trees[shape].update(accepted)
        elif accepted is not None:
            self.acceptance.update(shape.rows, accepted)

    def summary(self) -> dict:
        """`step_ms`: the cost the choice uses; `wall_step_ms` and `gpu_step_ms`: its two parts' medians."""
        return {"current": self.current.name,
                "expected_tokens": {s.name: round(self.expected_tokens(s), 3) for s in self.menu},
                "step_ms": self.costs.table(), "wall_step_ms": self.costs.table("wall"),
                "gpu_step_ms": self.costs.table("gpu")}

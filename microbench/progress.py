"""Work as a list of items with estimated durations, run in order with progress lines, and the
measured durations kept as a typed result (`run.wall`) that the next run's estimates come from.

An Item is one unit of a stage (a microbenchmark, a check point, a timed point, a compile batch),
enumerated before anything runs, so the whole run's estimate is known at the start and the
remainder can be printed after every item:

    [ 12/31   87.3 s] megakernel: shard8 T=16 ctx=2048 mega (est 3.1 s)
    [ 12/31   90.1 s] megakernel: shard8 T=16 ctx=2048 mega done in 2.8 s; ~139 s left, ~229 s of 300 s

Estimates (Estimates.load): an item's measured seconds in the newest `run.wall` result of the
same GPU model and mode (quick or full) under the results roots given (the run's own and the
repository's), else its seed: the seconds recorded for it in code (`seeds`, from committed
evidence) or its kind's seconds per unit times its size (the work's size, e.g. builds to
compile). Each estimate says where it came from; the plan line counts them.

Failures: an item that raises is reported and the run goes on, except that the later items that
share one of its `groups` are skipped (saying so): a preset whose correctness check failed is not
timed. Items marked `always` run anyway (freeing memory, saving what was measured).
"""
from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .results import Bound, Derived, Env, Result, Series, load, scan

BENCHMARK = "run.wall"


def _n(k: int, word: str) -> str:
    return f"{k} {word}{'' if k == 1 else 's'}"


@dataclass
class Item:
    stage: str
    name: str
    fn: Callable[[], object]
    kind: str = ""  # the seed's class when neither the last run nor `seeds` has this item
    size: float = 1.0  # units of `kind` (seconds per unit in the kind seeds)
    groups: tuple[str, ...] = ()  # a failure skips the later items that share a group with it
    always: bool = False  # runs even after a failure in its groups
    skip: str | None = None  # planned but not run: the reason (no GPU, --no-report, ...)

    @property
    def key(self) -> str:
        return f"{self.stage}/{self.name}"


@dataclass(frozen=True)
class Estimate:
    seconds: float
    source: str  # "last run" | "seed" | "work size"


class Estimates:
    """Seconds per item: measured in the last run, else the seeds (see the module docstring)."""

    def __init__(self, measured: Mapping[str, float] | None = None, seeds: Mapping[str, float] | None = None,
                 kind_seeds: Mapping[str, float] | None = None, last_run: str = ""):
        self.measured = dict(measured or {})
        self.seeds = dict(seeds or {})
        self.kind_seeds = dict(kind_seeds or {})
        self.last_run = last_run  # "2026-12-02T10:00:00Z of 1a2b3c4", or "" when none was found

    def of(self, item: Item) -> Estimate:
        if item.skip:
            return Estimate(0.0, "skipped")
        if item.key in self.measured:
            return Estimate(self.measured[item.key], "last run")
        if item.key in self.seeds:
            return Estimate(self.seeds[item.key], "seed")
        if item.kind in self.kind_seeds:
            return Estimate(self.kind_seeds[item.kind] * item.size, "work size")
        return Estimate(self.kind_seeds.get("", 5.0) * item.size, "work size")

    @classmethod
    def load(cls, gpu: str | None, quick: bool, roots: Iterable[Path], seeds=None, kind_seeds=None) -> Estimates:
        """From the newest run.wall result of `gpu` in `quick` mode under any of `roots` (missing
        roots and unreadable files are passed over: an estimate must never stop a run)."""
        best = None
        for root in dict.fromkeys(Path(r) for r in roots):
            if not root.is_dir():
                continue
            for p, d in scan(root, BENCHMARK):
                env = (d or {}).get("env") or {}
                if d is None or env.get("gpu") != gpu or bool(d.get("quick", True)) != quick:
                    continue
                if best is None or env.get("date", "") > best[0]:
                    best = (env.get("date", ""), p)
        measured, last = {}, ""
        if best is not None:
            try:
                r = load(best[1])
                measured = {s.name[len("item/"):]: float(s.summary.median) for s in r.series
                            if s.name.startswith("item/") and not s.metrics.get("failed")}
                last = f"{r.env.date} of {r.env.git_sha}"
            except Exception:
                measured = {}
        return cls(measured, seeds, kind_seeds, last)


@dataclass
class Done:
    item: Item
    seconds: float
    estimate: Estimate
    status: str  # "done" | "failed" | "skipped"
    value: object = None
    error: str = ""


@dataclass
class Progress:
    """Runs items in order, printing one line as each starts and one as it ends (stage, item,
    elapsed, its estimate, the estimated remainder and total against the budget)."""

    items: Sequence[Item]
    estimates: Estimates
    budget_s: float | None = None
    out: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    done: list[Done] = field(default_factory=list)

    def __post_init__(self):
        self._est = [self.estimates.of(i) for i in self.items]
        self._t0 = None

    # ------------------------------------------------------------------ plan
    def total_estimate(self) -> float:
        return sum(e.seconds for e in self._est)

    def stages(self) -> list[str]:
        return list(dict.fromkeys(i.stage for i in self.items))

    def plan_lines(self) -> list[str]:
        src: dict[str, int] = {}
        for it, e in zip(self.items, self._est):
            if not it.skip:
                src[e.source] = src.get(e.source, 0) + 1
        origin = ", ".join(f"{v} from {'the last run (' + self.estimates.last_run + ')' if k == 'last run' else k}"
                           for k, v in src.items())
        budget = f" (budget {self.budget_s:.0f} s)" if self.budget_s else ""
        n_run = sum(not i.skip for i in self.items)
        lines = [f"plan: {_n(n_run, 'item')} in {_n(len(self.stages()), 'stage')}, estimated "
                 f"{self.total_estimate():.0f} s{budget}; estimates: {origin or 'none'}"]
        for st in self.stages():
            idx = [k for k, i in enumerate(self.items) if i.stage == st]
            run = [k for k in idx if not self.items[k].skip]
            est = sum(self._est[k].seconds for k in idx)
            why = next((self.items[k].skip for k in idx if self.items[k].skip), "")
            lines.append(f"  {st}: " + (f"{_n(len(run), 'item')}, ~{est:.0f} s" if run else f"skipped ({why})"))
        return lines

    # ------------------------------------------------------------------ run
    def _head(self, k: int) -> str:
        el = self.clock() - self._t0
        return f"[{k + 1:3d}/{len(self.items)} {el:7.1f} s]"

    def _left(self, k: int, failed_groups=()) -> float:
        """Estimated seconds of the items after k that will still run (not those a failure skips)."""
        return sum(e.seconds for i, e in zip(self.items[k + 1:], self._est[k + 1:])
                   if i.always or not any(g in failed_groups for g in i.groups))

    def run(self) -> list[Done]:
        self._t0 = self.clock()
        for line in self.plan_lines():
            self.out(line)
        failed_groups: dict[str, str] = {}
        stage = None
        for k, (it, est) in enumerate(zip(self.items, self._est)):
            if it.stage != stage:
                stage = it.stage
                same = [e.seconds for i, e in zip(self.items, self._est) if i.stage == stage and not i.skip]
                if same:
                    self.out(f"-- {stage}: {_n(len(same), 'item')}, ~{sum(same):.0f} s")
            label = f"{it.stage}: {it.name}"
            hit = next((g for g in it.groups if g in failed_groups), None) if not it.always else None
            why = it.skip or (f"an earlier item of {hit} failed ({failed_groups[hit]})" if hit else None)
            if why:
                self.out(f"{self._head(k)} {label}: skipped ({why})")
                self.done.append(Done(it, 0.0, est, "skipped", error=why))
                continue
            self.out(f"{self._head(k)} {label} (est {est.seconds:.1f} s)")
            t = self.clock()
            try:
                value = it.fn()
            except Exception as e:
                dt = self.clock() - t
                msg = f"{e.__class__.__name__}: {e}"
                self.out(f"{self._head(k)} {label} FAILED after {dt:.1f} s: {msg}")
                self.out("".join(traceback.format_exc(limit=4)).rstrip())
                for g in it.groups:
                    failed_groups.setdefault(g, it.name)
                self.done.append(Done(it, dt, est, "failed", error=msg))
                continue
            dt = self.clock() - t
            self.done.append(Done(it, dt, est, "done", value))
            left = self._left(k, failed_groups)
            total = self.clock() - self._t0 + left
            budget = ""
            if self.budget_s:
                budget = f" of {self.budget_s:.0f} s" + (" (over the budget)" if total > self.budget_s else "")
            self.out(f"{self._head(k)} {label} done in {dt:.1f} s; ~{left:.0f} s left, ~{total:.0f} s{budget}")
        return self.done

    @property
    def failed(self) -> list[Done]:
        return [d for d in self.done if d.status == "failed"]

    def elapsed(self) -> float:
        return self.clock() - self._t0 if self._t0 is not None else 0.0

    # ------------------------------------------------------------------ the typed result
    def result(self, quick: bool, budget_note: str = ""):
        """run.wall: one series per item (`item/<stage>/<name>`: its seconds, its estimate and where
        that came from) and per stage (`stage/<stage>`), and `total`, bound by the budget (time
        bound: fraction_of_bound = budget / wall, at least 1 within the budget). Host clock; not
        gated (a run's wall time is not a kernel's performance)."""
        series = []
        for d in self.done:
            if d.status == "skipped":
                continue
            series.append(Series.from_samples(
                f"item/{d.item.key}", [d.seconds], timer="host", unit="s",
                params={"stage": d.item.stage, "item": d.item.name, "kind": d.item.kind, "size": d.item.size},
                metrics={"estimate_s": d.estimate.seconds, "estimate_source": d.estimate.source,
                         "failed": d.status == "failed", "gate_direction": "none"}))
        for st in self.stages():
            ds = [d for d in self.done if d.item.stage == st and d.status != "skipped"]
            if not ds:
                continue
            series.append(Series.from_samples(
                f"stage/{st}", [sum(d.seconds for d in ds)], timer="host", unit="s", params={"stage": st},
                metrics={"items": len(ds), "failed_items": sum(d.status == "failed" for d in ds),
                         "estimate_s": sum(d.estimate.seconds for d in ds), "gate_direction": "none"}))
        wall = self.elapsed()
        bound = None
        if self.budget_s:
            bound = Bound("time", float(self.budget_s), "s", budget_note or f"time budget of {self.budget_s:g} s")
        series.append(Series.from_samples("total", [wall], timer="host", unit="s", bound=bound,
                                          params={"mode": "quick" if quick else "full"},
                                          metrics={"estimate_s": self.total_estimate(),
                                                   "failed_items": len(self.failed), "gate_direction": "none"}))
        derived = {"wall_s": Derived(wall, "s", "host monotonic clock from the first item's start to the last "
                                     "item's end (the plan's enumeration before it excluded)")}
        if self.budget_s:
            derived["budget_fraction_used"] = Derived(wall / self.budget_s, "", f"wall_s / the {self.budget_s:g} s "
                                                      "budget (<= 1: within it)")
        derived["estimate_error"] = Derived(wall / self.total_estimate() - 1 if self.total_estimate() else math.nan,
                                            "", "wall_s / the estimate printed at the start - 1")
        notes = [f"estimates from {self.estimates.last_run or 'seeds (no earlier run.wall result)'}"]
        notes += [f"FAILED {d.item.key}: {d.error}" for d in self.failed]
        notes += [f"skipped {d.item.key}: {d.error}" for d in self.done if d.status == "skipped"]
        return Result(BENCHMARK, Env.capture(), tuple(series), derived, quick=quick, notes=tuple(notes))

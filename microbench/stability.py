"""Do the constants the megakernel build reads come out the same on two machines?

For every constant with `feeds_build` (microbench/constants.py), take the latest result of its
benchmark on each machine that ran it (machines told apart by GPU UUID: every H200 run is on a
fresh lent machine), the value the current rule derives from that result's samples
(microbench/rederive.py), and compare them: two runs agree when their values are equal or their
stated spreads overlap (a spread is the rule's own uncertainty: a bootstrap range, or the bracket
between two measured sizes). A constant pinned for the GPU (microbench/adopt.py) is held by its
pin, whatever the runs say; the table still shows them.

`check` answers for one constant, `table` for all of them (the report's stability rows);
`main` exits 1 when an unpinned constant flips between machines (a measured outcome, not a
test's assertion, so a new run cannot fail CI). `recorded=True` compares the values the files
record instead (what tune used before its rules were fixed), under which a constant can flip
where the current rule agrees.
"""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import rederive
from .constants import BY_NAME, SPECS, ConstantSpec
from .pins import load_pins
from .results import REPO_ROOT, find, load, results_root


@dataclass(frozen=True)
class Run:
    machine: str  # GPU UUID (short)
    date: str
    file: str
    sha: str
    quick: bool
    value: float
    spread: tuple[float, float] | None
    rederived: bool  # the value is the current rule's, not the one the file records
    rule: str = ""


@dataclass(frozen=True)
class Verdict:
    name: str
    status: str  # "pinned" | "agree" | "flips" | "one machine" | "not measured"
    runs: tuple[Run, ...]
    pin: object | None = None
    older_rule: tuple[Run, ...] = ()  # runs whose recorded value came from a rule since changed (not compared)

    @property
    def ok(self) -> bool:
        return self.status in ("pinned", "agree")

    def describe(self) -> str:
        vals = ", ".join(f"{r.value:g} ({r.machine}, {r.date[:16]})" for r in self.runs)
        old = (f"; {len(self.older_rule)} run(s) under an older rule not compared" if self.older_rule else "")
        return f"{self.name}: {self.status}" + (f" [{vals}]" if vals else "") + old


def agree(a: Run, b: Run, rel: float = 1e-9) -> bool:
    """Equal values, or overlapping spreads (a run without a spread is the point [value, value])."""
    if abs(a.value - b.value) <= rel * max(abs(a.value), abs(b.value), 1e-300):
        return True
    lo_a, hi_a = a.spread or (a.value, a.value)
    lo_b, hi_b = b.spread or (b.value, b.value)
    return max(min(lo_a, a.value), min(lo_b, b.value)) <= min(max(hi_a, a.value), max(hi_b, b.value))


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


def runs(spec: ConstantSpec, root=None, gpu: str | None = None, recorded: bool = False,
         _cache: dict | None = None) -> list[Run]:
    """The latest run of `spec`'s benchmark on each machine, oldest first."""
    roots = [Path(x) for x in root] if isinstance(root, (list, tuple)) else [Path(root) if root else results_root()]
    cache = _cache if _cache is not None else {}
    latest: dict[str, tuple] = {}
    files = {p.resolve(): p for r in roots if r.is_dir() for p in find(spec.benchmark, r, gpu)}
    for p in files.values():
        if p not in cache:
            r = load(p)
            cache[p] = (r, r.derived if recorded else rederive.derived(r), rederive.rederived_keys(r))
        r, derived, redone = cache[p]
        if spec.derived_key not in derived:
            continue
        m = (r.env.gpu_uuid or r.env.host or "?")[:12]
        if m not in latest or r.env.date >= latest[m][0].env.date:
            latest[m] = (r, p, derived[spec.derived_key], spec.derived_key in redone and not recorded)
    out = [Run(m, r.env.date, _rel(p), r.env.git_sha, r.quick, float(d.value),
               tuple(map(float, d.spread)) if d.spread else None, red, d.rule)
           for m, (r, p, d, red) in latest.items()]
    return sorted(out, key=lambda x: x.date)


def current_rule_runs(rs: list[Run]) -> tuple[list[Run], list[Run]]:
    """(runs judged by the newest run's rule, runs recorded under another rule). A value the
    current rule cannot re-derive from the samples (the watchdog bound needs every wait, which a
    result does not keep) is comparable only with values of the same rule."""
    if not rs:
        return [], []
    ref = rs[-1].rule
    return [r for r in rs if r.rule == ref], [r for r in rs if r.rule != ref]


def check(name: str, root: Path | None = None, gpu: str | None = "NVIDIA H200", pins: Mapping | None = None,
          recorded: bool = False, _cache: dict | None = None) -> Verdict:
    spec = BY_NAME[name]
    cur, old = current_rule_runs(runs(spec, root, gpu, recorded, _cache))
    rs, old = tuple(cur), tuple(old)
    if pins and name in pins:
        return Verdict(name, "pinned", rs, pins[name], old)
    if not rs:
        return Verdict(name, "not measured", rs, None, old)
    if len(rs) < 2:
        return Verdict(name, "one machine", rs, None, old)
    ok = all(agree(a, b) for i, a in enumerate(rs) for b in rs[i + 1:])
    return Verdict(name, "agree" if ok else "flips", rs, None, old)


def table(root: Path | None = None, gpu: str | None = "NVIDIA H200", pins: Mapping | None = None,
          names=None, recorded: bool = False) -> list[Verdict]:
    """A verdict for every constant the build reads (or `names`)."""
    if pins is None:
        pins = load_pins(gpu)
    cache: dict = {}
    todo = names if names is not None else [s.name for s in SPECS if s.feeds_build]
    return [check(n, root, gpu, pins, recorded, cache) for n in todo]


def main(argv=None, prog: str = "python -m microbench.stability") -> int:
    """`python -m microbench.stability [--root DIR ...] [--gpu NAME]`: the table, and exit 1 when
    an unpinned build constant flips between machines (one-machine constants are listed, not failed)."""
    ap = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    ap.add_argument("--root", action="append", default=None, help="results folder(s) (default the results root)")
    ap.add_argument("--gpu", default="NVIDIA H200")
    a = ap.parse_args(argv)
    vs = table(a.root, a.gpu)
    for v in vs:
        print(v.describe())
    flips = [v.name for v in vs if v.status == "flips"]
    print(("FLIPS: " + ", ".join(flips)) if flips else "no unpinned build constant flips between machines")
    return 1 if flips else 0


if __name__ == "__main__":
    raise SystemExit(main())

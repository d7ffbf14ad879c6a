"""In-run A/B of megakernel variants: how every kept or dropped change of this project was measured
(the verdicts: reports/LEVERS.md).

A variant is a kernel source tree (a copy of megakernel/csrc with an edit: `cp -r megakernel/csrc
/tmp/v && $EDITOR /tmp/v/...`) and/or Plan switches (`keys_per_split=48`). For each point (preset,
T, ctx) every variant is built and checked, then timed:

- checks first, on the point's fresh random inputs: mega == chain bitwise (the mega step twice on
  one engine, as the timing replays run it, so a build that carries state from one step into the
  next is checked with that state), close to the fp32 reference with the reference's routing
  forced (`runtime.check_close`), and whether its logits equal the first variant's bitwise (a pure
  speed change must say True); a variant that fails is reported and not timed;
- then `rounds` rounds; a round times every variant once (a CUDA graph of two steps, replayed
  under the harness's budget; timer: CUDA events around each replay, microbench.harness, the
  stream held so host submission is not counted) and the order alternates between rounds, so
  drift over the minutes of a run falls on all variants alike. A variant's figure is the median
  of its round medians, its change is against the first variant's, and the rounds are kept: their
  spread is the noise a difference must clear.

Variants differing only in code layout move the step: the kernel's code is fetched from L2 every
layer, so where an edit moves code matters, and edits that do little or no work move it through
code generation too. So an A/B measures the compiled kernel truthfully, but a difference of a
few percent does not show the mechanism an edit was meant to exercise. A layout placebo measures
that floor in the same run: `pad1024:layout_pad=1024` (Plan.layout_pad) is the first variant with
~1 KB of never-run code ahead of the kernel's body, every later instruction moved, the same work
and bits; a variant's change inside the placebos' is layout. An edit in the middle of the kernel
also moves code against other code, which the pad does not: `gap512:layout_gap=512`
(Plan.layout_gap) puts the never-run code in the middle of the ops' code (at expert GEMM 1's case
of run_unit). A code edit's change inside the placebos' range is not evidence of its mechanism;
compare it with the same code with its work gated off at run time where one can build that.
Where the variants include layout placebos of the first (`is_placebo`: the same tree and switches
but for `layout_pad` / `layout_gap`), the table says for every other variant whether its change
lies beyond the range the first and its placebos span, widened by the rounds' spread
(`PointResult.verdict`).

`build_variants` compiles every (preset, T, variant) into the kernel cache on a machine without a
GPU (`MEGABENCH_CACHE`), so the GPU's minutes go to timing. Each point runs the build for its T
(plan_for tokens=T: the expert units follow the tree size, plan.expert1_unit_rows). A batched point
PRESET:T:CTX:B is B requests of T tokens at CTX in one step (batch.batch_context's requests and
forced routing), checked the same way on every request's rows and timed the same way, on the build
for its B x T rows (past 16: row groups, plans.rows_switches), e.g. `--variant base --variant
pergroup:union_experts=0 --point small:16:512:8` (the per-group ablation of row groups).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import statistics
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from microbench.errors import CompileError, CorrectnessError, KernelDoesNotFitError, ResultsFileError, SpinTimeoutError
from microbench.harness import Harness, Policy
from microbench.results import Bound, Derived, Result, Series

from .config import ConfigError
from .config import preset as get_preset
from .roofline import batch_roofline, roofline


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    csrc: Path | None = None  # None: the repository's megakernel/csrc
    switches: tuple[tuple[str, object], ...] = ()  # Plan switches (plan_for keyword arguments)

    @property
    def switch_dict(self) -> dict:
        return dict(self.switches)


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_variant(text: str) -> Variant:
    """NAME[=CSRC_DIR][:KEY=VALUE[,KEY=VALUE...]], e.g. `base`, `edit=/tmp/v`, `k48:keys_per_split=48`."""
    head, _, sw = text.partition(":")
    name, _, tree = head.partition("=")
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(f"variant {text!r}: want NAME[=CSRC_DIR][:KEY=VALUE,...] with a plain name")
    csrc = None
    if tree:
        csrc = Path(tree).expanduser().resolve()
        if not (csrc / "megakernel.cu").is_file():
            raise ConfigError(f"variant {name}: {csrc} is not a kernel source tree (no megakernel.cu; "
                              "copy megakernel/csrc and edit the copy)")
    switches = []
    for item in filter(None, sw.split(",")):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"variant {name}: switch {item!r} is not KEY=VALUE")
        switches.append((key, _value(val)))
    return Variant(name, csrc, tuple(switches))


def parse_point(text: str) -> tuple:
    """PRESET:T:CTX, e.g. shard8:16:2048, or PRESET:T:CTX:B, B requests of T tokens at CTX in one
    step (batch.batch_context; past 16 rows in row groups): (preset, T, ctx[, B])."""
    try:
        parts = text.split(":")
        if len(parts) not in (3, 4):
            raise ValueError
        preset, t, ctx, *b = parts
        out = (preset, int(t), int(ctx), *(int(x) for x in b))
    except ValueError:
        raise ConfigError(f"point {text!r}: want PRESET:T:CTX or PRESET:T:CTX:B, e.g. shard8:16:2048 or "
                          "small:16:512:8") from None
    if len(out) == 4 and out[3] < 1:
        raise ConfigError(f"point {text!r}: B must be a positive number of requests")
    return out


def point_parts(p) -> tuple[str, int, int, int]:
    """(preset, T, ctx, B) of a point (B = 1 where the point gives none)."""
    return (p[0], int(p[1]), int(p[2]), int(p[3]) if len(p) > 3 else 1)


def point_label(preset: str, t: int, ctx: int, b: int = 1) -> str:
    return f"{preset} T={t} ctx={ctx}" + (f" B={b}" if b > 1 else "")


def _series_stem(preset: str, t: int, ctx: int, b: int = 1) -> str:
    return f"{preset}/B{b}/T{t}/ctx{ctx}" if b > 1 else f"{preset}/T{t}/ctx{ctx}"


@contextlib.contextmanager
def kernel_tree(csrc: Path | None) -> Iterator[None]:
    """Build from `csrc` (None: the repository's) inside the block."""
    from . import build  # heavy: torch (megakernel.build)

    old = build.CSRC
    build.CSRC = csrc or old
    try:
        yield
    finally:
        build.CSRC = old


@dataclasses.dataclass
class Checked:
    rel_err: float
    same_as_first: bool


# Plan switches that move code and change nothing else (Plan.layout_pad, Plan.layout_gap)
PLACEBO_SWITCHES = ("layout_pad", "layout_gap")


def is_placebo(v: Variant, first: Variant) -> bool:
    """`v` is a layout placebo of `first`: the same source tree and switches but for a layout
    switch (PLACEBO_SWITCHES) that differs."""
    return _placebo_of((tree_id(v.csrc), v.switch_dict), (tree_id(first.csrc), first.switch_dict))


def _placebo_of(v: tuple[str, dict], first: tuple[str, dict]) -> bool:
    """is_placebo on (tree, switches) pairs, as a saved A/B's params hold them."""
    def split(sw: dict) -> tuple[dict, dict]:
        return ({k: x for k, x in sw.items() if k not in PLACEBO_SWITCHES},
                {k: x for k, x in sw.items() if k in PLACEBO_SWITCHES and x})

    (rv, lv), (rf, lf) = split(v[1]), split(first[1])
    return v[0] == first[0] and rv == rf and lv != lf


@dataclasses.dataclass
class PointResult:
    preset: str
    n_tokens: int
    ctx: int
    checks: dict[str, Checked]
    rounds: dict[str, list[float]]  # seconds per step, one median per round
    bound: tuple[float, str] | None = None  # the point's roofline: (seconds per step, its source)
    placebos: tuple[str, ...] = ()  # variants that are layout placebos of the first (is_placebo)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)  # variant -> why its check failed (not timed)
    batch: int = 1  # requests in the point's step (B)

    @property
    def label(self) -> str:
        return point_label(self.preset, self.n_tokens, self.ctx, self.batch)

    def median(self, name: str) -> float:
        return statistics.median(self.rounds[name])

    def change(self, name: str) -> float:
        """Relative change of `name` against the first variant (negative: faster)."""
        first = next(iter(self.rounds))
        return self.median(name) / self.median(first) - 1.0

    def layout_range(self) -> tuple[float, float] | None:
        """The changes the layout alone gave in this run: min and max over the first variant (0)
        and its placebos; None without placebos."""
        if not self.placebos:
            return None
        xs = [0.0] + [self.change(n) for n in self.placebos]
        return min(xs), max(xs)

    def spread(self, name: str) -> float:
        """(max - min) / median of `name`'s round medians."""
        xs = self.rounds[name]
        return (max(xs) - min(xs)) / self.median(name)

    def verdict(self, name: str) -> str:
        """`name`'s change against the layout range (layout_range) widened by the rounds' spread
        (the larger of `name`'s and the first variant's): inside it the change is not evidence of
        what the variant was meant to do (module docstring)."""
        first = next(iter(self.rounds))
        if name == first:
            return "reference"
        if name in self.placebos:
            return "placebo"
        lo, hi = self.layout_range()
        c, noise = self.change(name), max(self.spread(name), self.spread(first))
        where = f"layout {100 * lo:+.2f}..{100 * hi:+.2f}%, rounds {100 * noise:.2f}%"
        if c < lo - noise:
            return f"faster beyond ({where})"
        return f"slower beyond ({where})" if c > hi + noise else f"inside ({where})"


def check_switches(variants: Sequence[Variant]) -> None:
    """Refuse, before anything is built, a variant whose switch is no Plan switch (make_plan's
    keyword arguments): a misspelt switch, or a lever removed from the code (reports/LEVERS.md)."""
    from .plan import make_plan  # heavy: torch (megakernel.plan)

    known = set(inspect.signature(make_plan).parameters) - {"cfg", "n_sm"}
    for v in variants:
        bad = sorted(set(v.switch_dict) - known)
        if bad:
            what = "is no Plan switch" if len(bad) == 1 else "are no Plan switches"
            raise ConfigError(f"variant {v.name}: {', '.join(bad)} {what} (make_plan's keyword arguments: "
                              f"{', '.join(sorted(known))}; removed levers: reports/LEVERS.md)")


def _plan(preset: str, v: Variant, n_sm: int | None, rows: int):
    from .plans import plan_for, rows_switches  # heavy: torch (megakernel.plans)

    # the build for the point's B x T rows (past max_tree: row groups), then the variant's switches
    return plan_for(preset, None, n_sm, **{**rows_switches(get_preset(preset), rows), **v.switch_dict})


def build_variants(points: Sequence[tuple[str, int, int]], variants: Sequence[Variant], n_sm: int = 132,
                   plan_of: Callable | None = None) -> list[tuple[str, int, str, object]]:
    """Compile every (preset, T, variant) of the points for sm_90a into the kernel cache; no GPU
    needed (the plan may depend on T: plan.expert1_unit_rows). Returns (preset, T, variant name,
    ResourceUsage). A batched point builds for its B x T rows (T in the tuple is then B x T)."""
    from .build import build_gpu  # heavy: torch (megakernel.build)

    check_switches(variants)
    plan_of = plan_of or (lambda preset, v, t: _plan(preset, v, n_sm, t))
    out = []
    for preset, t in sorted({(p[0], point_parts(p)[1] * point_parts(p)[3]) for p in points}):
        for v in variants:
            with kernel_tree(v.csrc):
                out.append((preset, t, v.name, build_gpu(plan_of(preset, v, t)).usage))
    return out


def _gpu_context(preset: str, n_tokens: int, ctx: int):
    from .bench_baselines import step_context, weights_for  # heavy: torch (megakernel.bench_baselines)

    sc = step_context(preset, n_tokens, ctx)
    return weights_for(preset), sc.cache0, sc.tokens, sc.parents, [r.cuda() for r in sc.routes], sc.ref_logits


def _gpu_timer(policy=None):
    from .measure import graph_of  # heavy: torch (megakernel.measure)

    h = Harness(policy=policy or Policy(budget_s=0.3, max_samples=100, chunk=8))
    graphs = {}

    def time_one(name: str, eng) -> float:
        if name not in graphs:
            graphs[name] = graph_of(eng, "mega")
        g, per = graphs[name]
        return float(np.median(h.time(g.replay).samples_s)) / per

    return time_one


def _gpu_batch_context(preset: str, n_tokens: int, ctx: int, batch: int):
    """(weights, caches0, requests, routes, reference logits) of B requests (batch.batch_context)."""
    from .batch import batch_context  # heavy: torch (megakernel.batch)
    from .bench_baselines import weights_for  # heavy: torch (megakernel.bench_baselines)

    bc = batch_context(preset, batch, n_tokens, ctx)
    return weights_for(preset), bc.caches0, bc.requests, bc.routes, bc.ref_logits


def _gpu_bound(preset: str, n_tokens: int, ctx: int, batch: int = 1) -> tuple[float, str]:
    from .bench_baselines import step_context, weights_for  # heavy: torch (megakernel.bench_baselines)

    if batch > 1:
        from .batch import batch_context  # heavy: torch (megakernel.batch)

        bc = batch_context(preset, batch, n_tokens, ctx)
        rf = batch_roofline(weights_for(preset).cfg, bc.shape, bc.distinct)
        return rf.seconds, rf.source
    rf = roofline(weights_for(preset).cfg, n_tokens, ctx, step_context(preset, n_tokens, ctx).distinct)
    return rf.seconds, rf.source


def run_ab(points: Sequence[tuple], variants: Sequence[Variant], rounds: int = 5,
           n_sm: int | None = None, backend: str = "gpu", context: Callable | None = None,
           timer: Callable | None = None, plan_of: Callable | None = None,
           log: Callable[[str], None] = print, bound_of: Callable | None = None,
           batch_context: Callable | None = None) -> list[PointResult]:
    """Check, then time, every variant at every point (module docstring). `context(preset, T, ctx)`
    -> (weights, cache0, tokens, parents, routes, reference logits); a batched point (preset, T,
    ctx, B) takes `batch_context(preset, T, ctx, B)` -> (weights, caches0, requests, routes,
    reference logits of every row) and runs in batch.engine_for's engine (past 16 rows a
    GroupEngine); `plan_of(preset, variant, rows)` -> the variant's build for the step's rows;
    `timer()` -> a function (variant name, engine) -> seconds per step; `bound_of(preset, T, ctx,
    B)` -> the point's roofline (seconds per step, source) or None; all default to the GPU's (the
    roofline only with the GPU's context). A variant whose build or check fails (mega != chain,
    too far from the reference, a wait that gave up, an emulation error) is reported in
    PointResult.failed and not timed, so one broken variant does not cost the others' run; the
    first variant's failure raises (there is nothing to compare against)."""
    import torch  # heavy: torch

    from .runtime import EmulationError, Engine, check_close  # heavy: torch (megakernel.runtime)

    if len({v.name for v in variants}) != len(variants) or not variants:
        raise ConfigError("A/B: give one or more variants with distinct names")
    if rounds < 1:
        raise ConfigError(f"A/B: rounds must be >= 1, got {rounds}")
    check_switches(variants)
    if bound_of is None and context is None and batch_context is None:
        bound_of = _gpu_bound
    context = context or _gpu_context
    batch_context = batch_context or _gpu_batch_context
    plan_of = plan_of or (lambda preset, v, t: _plan(preset, v, n_sm, t))
    results = []
    for point in points:
        preset, t, ctx, nb = point_parts(point)
        where = point_label(preset, t, ctx, nb)
        if nb > 1:
            from .batch import engine_for  # heavy: torch (megakernel.batch)

            w, caches0, reqs, routes, ref = batch_context(preset, t, ctx, nb)

            def run(eng, mode):
                return eng.step_batch(reqs, mode=mode, routes=routes).logits.clone()

            def fresh(plan):
                return engine_for(w, plan, [c.clone() for c in caches0], backend=backend)
        else:
            w, cache0, tokens, parents, routes, ref = context(preset, t, ctx)

            def run(eng, mode):
                return eng.step(tokens, parents, ctx, mode=mode, routes=routes).logits.clone()

            def fresh(plan):
                return Engine(w, plan, cache0.clone(), backend=backend)
        engines, checks, first_logits, failed = {}, {}, None, {}
        for v in variants:
            try:
                with kernel_tree(v.csrc):
                    plan = plan_of(preset, v, t * nb)
                    out = {}
                    for mode in ("mega", "chain"):
                        eng = fresh(plan)
                        out[mode] = run(eng, mode)
                        if mode == "mega":
                            engines[v.name] = eng
                            # the same step again, as the timing replays run it: state a step
                            # leaves for the next (counters' parity, sentinel slots) is checked too
                            out["again"] = run(eng, mode)
                if not (torch.equal(out["mega"], out["chain"]) and torch.equal(out["again"], out["chain"])):
                    raise CorrectnessError(f"A/B {where}: variant {v.name}: mega != chain bitwise "
                                           f"(first step {torch.equal(out['mega'], out['chain'])}, repeated step "
                                           f"{torch.equal(out['again'], out['chain'])})")
                err = check_close(out["mega"], ref, f"A/B variant {v.name}", rel=1e-2)
            except (CorrectnessError, SpinTimeoutError, EmulationError, CompileError, KernelDoesNotFitError,
                    ValueError) as e:
                if v is variants[0]:
                    raise
                failed[v.name] = f"{type(e).__name__}: {e}"
                engines.pop(v.name, None)
                log(f"{where} {v.name}: CHECK FAILED, not timed: {failed[v.name]}")
                continue
            first_logits = out["mega"] if first_logits is None else first_logits
            checks[v.name] = Checked(err, torch.equal(out["mega"], first_logits))
            log(f"{where} {v.name}: mega == chain bitwise, rel err {err:.3e}, "
                f"logits == {variants[0].name}'s: {checks[v.name].same_as_first}")
        timed = [v for v in variants if v.name not in failed]
        time_one = (timer or _gpu_timer)()
        times: dict[str, list[float]] = {v.name: [] for v in timed}
        for r in range(rounds):
            for v in (timed if r % 2 == 0 else list(reversed(timed))):
                times[v.name].append(time_one(v.name, engines[v.name]))
        bound = (bound_of(preset, t, ctx, nb) if nb > 1 else bound_of(preset, t, ctx)) if bound_of else None
        res = PointResult(preset, t, ctx, checks, times, bound,
                          tuple(v.name for v in timed[1:] if is_placebo(v, variants[0])), failed, nb)
        for v in timed:
            log(f"{where} {v.name:10s} {res.median(v.name) * 1e3:.3f} ms "
                f"{100 * res.change(v.name):+.2f}%  rounds {[round(x * 1e3, 3) for x in times[v.name]]}")
        results.append(res)
    return results


def table(results: Sequence[PointResult]) -> str:
    """Markdown: one row per (point, variant); a verdict column where some point has placebos."""
    import pandas as pd  # heavy: pandas

    rows, verdicts = [], any(x.placebos for x in results)  # the column only where some point has placebos
    for r in results:
        for name, ck in r.checks.items():
            rows.append({"point": r.label, "variant": name,
                         "step (median of rounds)": f"{r.median(name) * 1e3:.3f} ms",
                         "change": f"{100 * r.change(name):+.2f}%",
                         "rounds spread": f"{100 * r.spread(name):.2f}%",
                         "rel err": f"{ck.rel_err:.2e}", "same bits as first": ck.same_as_first})
            if verdicts:
                rows[-1]["vs layout placebos"] = r.verdict(name) if r.placebos else "-"
        for name, why in r.failed.items():  # checked, failed, not timed (run_ab)
            rows.append({"point": r.label, "variant": name,
                         "step (median of rounds)": "not timed", "change": "-", "rounds spread": "-",
                         "rel err": "-", "same bits as first": f"CHECK FAILED: {why}"})
            if verdicts:
                rows[-1]["vs layout placebos"] = "-"
    return pd.DataFrame(rows).to_markdown(index=False)


# ------------------------------------------------------------------ the A/B as a typed result
AB_BENCHMARK = "megakernel.ab"
TREE_SUFFIXES = (".cu", ".cuh", ".h")


def tree_id(csrc: Path | None) -> str:
    """Content hash of a kernel source tree (relative paths and bytes of its .cu/.cuh/.h files;
    None: the repository's), so that a saved A/B names exactly what each variant built."""
    from . import build  # heavy: torch (megakernel.build)

    root = Path(csrc) if csrc else build.CSRC
    h = hashlib.sha256()
    for p in sorted(x for x in root.rglob("*") if x.is_file() and x.suffix in TREE_SUFFIXES):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def to_result(results: Sequence[PointResult], variants: Sequence[Variant], env=None, timer: str = "cuda_event",
              notes: Sequence[str] = ()):
    """A megabench Result (benchmark megakernel.ab): one series per (point, variant) whose samples
    are the round medians, the checks and the variant's tree and switches in its params, the
    point's roofline as its bound; derived change_<preset>_T<t>_ctx<ctx>_<variant>, the change
    against the first variant. `table(from_result(r))` gives the markdown `ab --out` writes. Not
    gated across runs (gate_direction none): a variant's name means a different tree in each A/B,
    and its verdict is its change against the first variant of the same run."""
    if env is None:
        from .plans import constants_env  # heavy: torch (megakernel.plans)

        env = constants_env()  # which constants revision the variants' builds read
    by_name = {v.name: v for v in variants}
    series, derived = [], {}
    notes = tuple(notes) + tuple(f"{r.label} variant {name}: not timed, its check failed: "
                                 f"{why}" for r in results for name, why in r.failed.items())
    for r in results:
        first = next(iter(r.rounds))
        for name, xs in r.rounds.items():
            v, ck = by_name[name], r.checks[name]
            bound = (Bound("time", r.bound[0], "s", f"roofline of one step ({r.bound[1]})") if r.bound else None)
            stem = _series_stem(r.preset, r.n_tokens, r.ctx, r.batch)
            sname = f"{stem}/{name}"
            series.append(Series.from_samples(
                sname, xs, timer=timer, unit="s", bound=bound,
                params={"preset": r.preset, "T": r.n_tokens, "ctx": r.ctx, "B": r.batch, "variant": name,
                        "csrc": str(v.csrc) if v.csrc else None, "tree": tree_id(v.csrc),
                        "switches": {k: val for k, val in v.switches}, "rel_err": ck.rel_err,
                        "same_bits_as_first": ck.same_as_first, "order": "alternating rounds"},
                metrics={"gate_direction": "none"}))
            bkey = f"_B{r.batch}" if r.batch > 1 else ""
            derived[f"change_{r.preset}{bkey}_T{r.n_tokens}_ctx{r.ctx}_{name}"] = Derived(
                r.change(name), "ratio", f"median of {name}'s round medians / {first}'s - 1",
                inputs=(sname, f"{stem}/{first}"))
    return Result(AB_BENCHMARK, env, tuple(series), derived, quick=False, notes=tuple(notes))


def from_result(res) -> list[PointResult]:
    """The PointResults a saved A/B holds (variants in their run order)."""
    if res.benchmark != AB_BENCHMARK:
        raise ResultsFileError(f"{res.benchmark}: not an A/B result ({AB_BENCHMARK})")
    points: dict[tuple, PointResult] = {}
    firsts: dict[tuple, tuple] = {}
    for s in res.series:
        p = s.params
        try:
            key = (str(p["preset"]), int(p["T"]), int(p["ctx"]), int(p.get("B", 1)))
            ck = Checked(float(p["rel_err"]), bool(p["same_bits_as_first"]))
            name = str(p["variant"])
            ident = (p.get("tree"), dict(p.get("switches") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise ResultsFileError(f"A/B series {s.name}: malformed params ({e})") from None
        pr = points.setdefault(key, PointResult(*key[:3], {}, {}, None, batch=key[3]))
        first = firsts.setdefault(key, ident)
        if pr.rounds and ident[0] is not None and _placebo_of(ident, first):
            pr.placebos += (name,)
        pr.checks[name] = ck
        pr.rounds[name] = list(s.samples)
        if s.bound is not None and pr.bound is None:
            pr.bound = (s.bound.value, s.bound.source)
    return list(points.values())

"""Weight streaming: read ceiling, shared-memory ring, L2 capacity/latency/hints, L2 prefetch,
and the hot-expert bet (the study's second overhead class: reports/paper_figures.json).

- weights.read_ceiling: best plain streaming read (16-byte loads, UNROLL in flight, persistent
  grid sized by the occupancy calculator) over 2 GiB (34x the H200's L2), every word summed and
  checked. Bound: the datasheet HBM rate (labelled). Derives read_ceiling_bytes_per_s, the
  roofline denominator every other bandwidth here is judged against.
- weights.ring: mb/ring.cuh streaming 1 GiB, one block per SM, a producer lane issuing
  cp.async.bulk on mbarriers into S x B slots, 4 consumer warps summing every word (checked) and
  releasing slots. Sweep planned on the CPU (plan.py: what fits in shared memory, what is refused
  and why). Bound: the read ceiling measured in the same run. Derives ring_stages and
  ring_stage_bytes (smallest ring within 95% of the best). The same stream from fewer blocks
  (ring_blocks/: a half, a third, a quarter of the SMs, at the chosen and the deepest ring)
  derives ring_blocks_at_full_rate_<ring>: how few blocks stream at the full grid's rate.
- weights.l2: read bandwidth vs working set 1-256 MiB (warm, repeated passes, ld.global.cg);
  latency by pointer chase (one thread, random single cycle at 128-B stride, ld.global.cg;
  cycles by %clock64, ns by %globaltimer, their ratio the measured clock); eviction hints
  (evict_first on a streamed buffer, evict_last on a reused one) and the persisting-L2 window,
  judged by how fast a reused set reads after a 256 MiB stream. Derives l2_usable_bytes and
  evict_first_pays. Leaves no evict_last lines and no persisting set-aside behind.
- weights.prefetch: phase A busy for t us while the producer lane prefetches the next phase's
  P bytes into L2 (cp.async.bulk.prefetch.L2); phase B streams them through the ring. Time saved
  against no prefetch over P and t, each sample after a clean L2 scrub. Bound: t + P / read
  ceiling (the best a no-prefetch run can do). Derives l2_prefetch_budget_bytes.
- weights.hot_experts: synthetic routing with a chosen overlap f between the k prefetched
  experts and the m read in the next step; saving when right, cost when wrong, break-even f, for
  expert sizes 3.5 MiB (the study's per-GPU slice) and smaller, with phase A as slack (busy) or
  bandwidth-bound (streaming other data through the ring). Derives hot_expert_break_even_overlap.
"""
from __future__ import annotations

import datetime as _dt
from dataclasses import replace

import numpy as np

from ..datasheet import hbm_peak
from ..errors import CorrectnessError, KernelDoesNotFitError, MegabenchError
from ..harness import Case, Harness, Policy, full_sweeps
from ..launch import LaunchSpec, launch
from ..results import Bound, Derived, Env, Result, Series, latest
from ..stats import bootstrap_ci, fit_steps
from . import plan, rules
from . import kernels as K
from .l2policy import persisting_window
from .plan import KiB, MiB, RingConfig

CEILING_BYTES = 2 << 30  # 2 GiB: >= 8x L2 on every GPU this project targets
RING_BYTES = 1 << 30
STUDY_RING = RingConfig(5, 32 * KiB)  # the study's 5 x 32 KB (reports/paper_figures.json), used when no ring was tuned
CONSUMER_WARPS = 4

# Results measured earlier in this process, per harness, so later benchmarks of the same run are
# judged against the same ceiling and use the same ring (keys: id(harness)).
_CEILING: dict[int, tuple[float, str]] = {}
_RING: dict[int, tuple[RingConfig, str]] = {}
_BUDGET: dict[int, tuple[int, str]] = {}


def _quick(quick):
    return (not full_sweeps()) if quick is None else quick


def _stamp() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _run(h: Harness, case: Case, policy: Policy | None = None) -> Series:
    """harness.run_case plus the case's after-check (watchdog record and last timed output)."""
    p = case.prepare(h)
    s = h.series(case.name, p.launch, params=case.params, bound=p.bound, work=p.work, batch=p.batch,
                 cold=p.cold, policy=policy, before_each=p.before_each, metrics=p.metrics)
    after = getattr(p, "after", None)
    if after is not None:
        import torch  # heavy: torch

        torch.cuda.synchronize()
        after()
    return s


def _release() -> None:
    import torch  # heavy: torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _bw_samples(s: Series, work: float) -> np.ndarray:
    return work / np.asarray(s.samples)


def _phase_policy(quick: bool) -> Policy:
    # phase kernels are 20-100 us and each sample follows a 180 MiB scrub: fewer, cheaper samples
    return Policy(warmup_s=0.01, budget_s=0.03, min_samples=20, max_samples=120) if quick else \
        Policy(warmup_s=0.02, budget_s=0.15, min_samples=40, max_samples=400)


# ============================================================================ read ceiling
def read_case(nbytes: int, cfg: plan.ReadConfig, reps: int = 1, bound: Bound | None = None,
              name: str | None = None) -> Case:
    def prepare(h: Harness):
        return K.read_case_prepare(h, nbytes, cfg, reps, bound)

    return Case(name or f"read/{cfg.label}/{nbytes // MiB}MiB", {"config": cfg.label, "load": cfg.load,
                "unroll": cfg.unroll, "threads": cfg.threads, "bytes": nbytes, "reps": reps}, prepare)


def _datasheet(h: Harness) -> Bound | None:
    peak = hbm_peak(h.info.name)
    return Bound("bandwidth", peak, "B/s", f"datasheet HBM peak for {h.info.name} (not measured)") if peak else None


def run_read_ceiling(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = _quick(quick)
    ds = _datasheet(h)
    series, notes = [], []
    for cfg in plan.ceiling_sweep(quick):
        try:
            series.append(_run(h, read_case(CEILING_BYTES, cfg, bound=ds, name=f"read_ceiling/{cfg.label}")))
        except KernelDoesNotFitError as e:
            notes.append(f"{cfg.label} not run: {e}")
    if not series:
        raise KernelDoesNotFitError("no read configuration could run: " + "; ".join(notes))
    works = [float(s.params["bytes"]) for s in series]
    c = rules.read_ceiling(works, [np.asarray(s.samples) for s in series])
    best = series[c.best]
    note = f"best configuration {best.params['config']} ({best.metrics['grid']} blocks)"
    if ds:
        note += f"; {c.value / ds.value:.1%} of the datasheet {ds.value / 1e12:.2f} TB/s"
    derived = {"read_ceiling_bytes_per_s": Derived(c.value, "B/s", c.rule, c.spread, tuple(s.name for s in series),
                                                   note)}
    _CEILING[id(h)] = (c.value, f"weights.read_ceiling measured in this run ({_stamp()}, config "
                                f"{best.params['config']}, {CEILING_BYTES} B)")
    res = Result("weights.read_ceiling", Env.capture(h.device_index), tuple(series), derived, quick=quick,
                 notes=tuple(notes))
    _release()
    if save:
        res.save()
    return res


def ceiling_bound(h: Harness) -> Bound:
    """The read ceiling of this run; measured here (best quick configuration only) if
    weights.read_ceiling has not run in this process."""
    if id(h) not in _CEILING:
        cfg = plan.ceiling_sweep(True)[0]
        s = _run(h, read_case(CEILING_BYTES, cfg, name=f"read_ceiling/{cfg.label}"))
        _CEILING[id(h)] = (CEILING_BYTES / s.summary.median,
                           f"read ceiling measured in this run ({_stamp()}) with {cfg.label} only "
                           "(weights.read_ceiling did not run first)")
    v, src = _CEILING[id(h)]
    return Bound("bandwidth", v, "B/s", src)


# ============================================================================ ring
def ring_case(cfg: RingConfig, nbytes: int | None = None, consumer_warps: int = CONSUMER_WARPS,
              bound: Bound | None = None, kernel: str = "mb_ring_stream") -> Case:
    nbytes = nbytes or RING_BYTES

    def prepare(h: Harness):
        return K.ring_case_prepare(h, cfg, nbytes, consumer_warps, bound, kernel)

    return Case(f"ring/{cfg.label}/cw{consumer_warps}", {"stages": cfg.stages, "stage_bytes": cfg.stage_bytes,
                "ring_bytes": cfg.ring_bytes, "consumer_warps": consumer_warps, "bytes": nbytes}, prepare)


# The megakernel fills a stage with one bulk copy per padded weight row (512 B .. 2 KB): does that
# cost bandwidth against one copy per stage? Swept at 4 x 16 KB, a ring whose single copy per stage
# streams close to the best ring's rate, so the pieces are what moves.
PIECES_RING = RingConfig(4, 16384)
PIECES = (1, 2, 4, 8, 16, 32)
QUICK_PIECES = (1, 16, 32)


def ring_pieces_case(cfg: RingConfig, pieces: int, nbytes: int | None = None, bound: Bound | None = None) -> Case:
    nbytes = nbytes or RING_BYTES

    def prepare(h: Harness):
        return K.ring_case_prepare(h, cfg, nbytes, CONSUMER_WARPS, bound, pieces=pieces)

    return Case(f"ring_pieces/{cfg.label}/x{pieces}", {"stages": cfg.stages, "stage_bytes": cfg.stage_bytes,
                "copies_per_stage": pieces, "copy_bytes": cfg.stage_bytes // pieces, "bytes": nbytes}, prepare)


# How few blocks stream at the read ceiling? A megakernel whose blocks take roles (each block's
# layer code within its SM's instruction cache; a lever built and removed, reports/LEVERS.md) streams
# a dense op from a third of the SMs. Swept at the chosen ring and at the deepest ring that fits, over
# these shares of the SMs (one block per SM).
BLOCK_SHARES = (1.0, 0.5, 1 / 3, 0.25)
BLOCKS_AT_CEILING = 0.95  # a share "streams at the ceiling" within this much of the full grid's rate


def ring_blocks_case(cfg: RingConfig, grid: int, nbytes: int | None = None, bound: Bound | None = None) -> Case:
    nbytes = nbytes or RING_BYTES

    def prepare(h: Harness):
        return K.ring_case_prepare(h, cfg, nbytes, CONSUMER_WARPS, bound, grid=grid)

    return Case(f"ring_blocks/{cfg.label}/g{grid}", {"stages": cfg.stages, "stage_bytes": cfg.stage_bytes,
                "ring_bytes": cfg.ring_bytes, "grid": grid, "bytes": nbytes}, prepare)


def ring_blocks_derived(series, sm_count: int) -> dict[str, Derived]:
    """Per ring of the ring_blocks/ series: the fewest blocks (one per SM) streaming within
    BLOCKS_AT_CEILING of the full grid's median bandwidth, and each share's fraction of it."""
    out: dict[str, Derived] = {}
    by: dict[str, dict[int, float]] = {}
    names: dict[str, list[str]] = {}
    for s in series:
        if s.name.startswith("ring_blocks/"):
            label = s.name.split("/")[1]
            by.setdefault(label, {})[int(s.params["grid"])] = float(s.metrics["bytes_read"]) / s.summary.median
            names.setdefault(label, []).append(s.name)
    for label, bw in by.items():
        full = bw.get(sm_count)
        if not full:
            continue
        ok = [g for g, v in bw.items() if v >= BLOCKS_AT_CEILING * full]
        fr = ", ".join(f"{g} blocks {v / full:.1%}" for g, v in sorted(bw.items()))
        out[f"ring_blocks_at_full_rate_{label}"] = Derived(
            min(ok), "blocks", f"fewest blocks (one per SM) whose median bandwidth is >= {BLOCKS_AT_CEILING:.0%} of "
            f"{sm_count} blocks' ({full / 1e12:.3f} TB/s) with the {label} ring", (min(bw), sm_count),
            tuple(names[label]), fr)
    return out


def ring_budget(h: Harness) -> plan.SmemBudget:
    k = K.module("ring", h.info.arch).kernel("mb_ring_stream")
    return plan.SmemBudget.from_device(h.info, int(k.attributes.shared_size_bytes))


def run_ring(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = _quick(quick)
    bound = ceiling_bound(h)
    budget = ring_budget(h)
    sweep = plan.ring_sweep(quick, budget)
    notes = [f"refused {c.label}: {why}" for c, why in sweep.refused]
    series = [_run(h, ring_case(cfg, bound=bound)) for cfg in sweep.fits]
    derived, chosen = ring_derived(series, bound.value, bound.source)
    pieces = QUICK_PIECES if quick else PIECES
    ps = [_run(h, ring_pieces_case(PIECES_RING, n, bound=bound)) for n in pieces]
    cc = rules.min_copy_bytes([PIECES_RING.stage_bytes // n for n in pieces],
                              [_bw_samples(s, s.metrics["bytes_read"]) for s in ps])
    worst = ps[-1]
    derived["ring_min_copy_bytes"] = Derived(
        cc.value, "B", cc.rule, cc.spread, tuple(s.name for s in ps),
        f"{PIECES_RING.label}: one copy per stage {cc.base / 1e12:.3f} TB/s; threshold {cc.threshold / 1e12:.3f} TB/s")
    derived["ring_copies_512B_fraction"] = Derived(
        float(worst.metrics["bytes_read"] / worst.summary.median) / cc.base, "",
        f"median bandwidth with {PIECES_RING.stage_bytes // pieces[-1]} B copies / with one copy per stage "
        f"({PIECES_RING.label})", None, (worst.name, ps[0].name))
    series.extend(ps)
    deepest = max(sweep.fits, key=lambda c: (c.ring_bytes, c.stage_bytes))
    n = h.info.sm_count
    grids = sorted({max(1, round(n * f)) for f in BLOCK_SHARES}, reverse=True)
    bs = [_run(h, ring_blocks_case(cfg, g, bound=bound)) for cfg in dict.fromkeys((chosen, deepest)) for g in grids]
    derived.update(ring_blocks_derived(bs, n))
    series.extend(bs)
    if not quick:  # consumer-warp count at the chosen ring (informative; not part of the rule)
        for cw in (2, 8):
            series.append(_run(h, ring_case(chosen, consumer_warps=cw, bound=bound)))
    _RING[id(h)] = (chosen, f"weights.ring of this run ({_stamp()})")
    res = Result("weights.ring", Env.capture(h.device_index), tuple(series), derived, quick=quick, notes=tuple(notes))
    _release()
    if save:
        res.save()
    return res


def ring_derived(series, ceiling: float, ceiling_source: str) -> tuple[dict[str, Derived], RingConfig]:
    """The ring constants from the ring/<cfg>/cw4 series (what run_ring measured; also applied to
    recorded results by microbench/rederive.py): the rule chooses among plan.ring_candidate
    configurations only."""
    ring = [s for s in series if s.name.startswith("ring/") and int(s.params.get("consumer_warps", 0)) == CONSUMER_WARPS]
    cands = [s for s in ring if plan.ring_candidate(RingConfig(int(s.params["stages"]), int(s.params["stage_bytes"])))]
    if not cands:
        raise ValueError("no candidate ring configuration measured (plan.ring_candidate)")
    bws = [_bw_samples(s, s.metrics["bytes_read"]) for s in cands]
    ch = rules.choose_ring([int(s.params["stages"]) for s in cands], [int(s.params["stage_bytes"]) for s in cands], bws)
    names = tuple(s.name for s in cands)
    chosen = RingConfig(ch.stages, ch.stage_bytes)
    ib = int(np.argmax([np.median(b) for b in bws]))
    best_s = cands[ib]
    extra = len(ring) - len(cands)
    note = (f"chosen {chosen.label} at {ch.chosen_bandwidth / 1e12:.3f} TB/s = {ch.chosen_bandwidth / ceiling:.1%} "
            f"of the read ceiling; best {best_s.name.split('/')[1]} at {ch.best_bandwidth / 1e12:.3f} TB/s = "
            f"{ch.best_bandwidth / ceiling:.1%}; threshold {ch.threshold / 1e12:.3f} TB/s; "
            f"{len(ch.qualifying)} of {len(cands)} candidate configurations qualify"
            + (f" ({extra} more measured off the candidate grid, shown, not chosen from)" if extra else ""))
    derived = {
        "ring_stages": Derived(ch.stages, "", ch.rule, ch.stages_spread, names, note),
        "ring_stage_bytes": Derived(ch.stage_bytes, "B", ch.rule, ch.bytes_spread, names, note),
        "ring_best_bandwidth_bytes_per_s": Derived(
            ch.best_bandwidth, "B/s", "highest median bandwidth over the candidate rings",
            tuple(float(best_s.metrics["bytes_read"] / t) for t in bootstrap_ci(best_s.samples)[::-1]),
            (best_s.name,)),
        "ring_fraction_of_ceiling": Derived(ch.chosen_bandwidth / ceiling, "", "chosen ring's median bandwidth / "
                                            "read ceiling of this run", None, (*names, ceiling_source)),
    }
    return derived, chosen


def ring_for_phases(h: Harness) -> tuple[RingConfig, str]:
    return _RING.get(id(h), (STUDY_RING, "the study's 5 x 32 KB (weights.ring did not run first in this process)"))


# ============================================================================ L2
L2_READ = plan.ReadConfig("cg", 4, 512)


def _l2_bandwidth(h: Harness, quick: bool, bound: Bound) -> tuple[list[Series], rules.L2Usable]:
    series = []
    for ws in plan.l2_sizes(quick):
        reps = plan.reps_for(ws)
        series.append(_run(h, read_case(ws, L2_READ, reps, bound, name=f"l2_bandwidth/{ws // MiB}MiB")))
    series = l2_rebound(series)
    return series, l2_usable_of(series, h.info.l2_bytes)


def l2_usable_of(series, l2_bytes: int | None) -> rules.L2Usable:
    """rules.l2_usable over the l2_bandwidth/<size> series (run_l2; microbench/rederive.py)."""
    bw = [s for s in series if s.name.startswith("l2_bandwidth/")]
    return rules.l2_usable([s.params["bytes"] for s in bw], [_bw_samples(s, s.metrics["bytes_read"]) for s in bw],
                           l2_bytes)


def l2_rebound(series: list[Series]) -> list[Series]:
    """The L2 read-bandwidth series judged against the L2's own ceiling, not the HBM read ceiling
    (which L2 hits beat by 2.5x: a 'fraction of bound' of 250% says the bound is not one). The
    ceiling is the highest median of the sweep (the smallest working sets, served from the L2
    partition next to the SMs): measured, since no datasheet gives an H200 L2 bandwidth."""
    rates = [float(s.metrics["bytes_read"] / s.summary.median) for s in series]
    i = int(np.argmax(rates))
    b = Bound("bandwidth", rates[i], "B/s", f"the L2's own read ceiling: the highest median of this sweep "
              f"({series[i].name}, L2-resident, near partition); the HBM read ceiling stays in metrics")
    out = []
    for s, r in zip(series, rates):
        m = {**s.metrics, "hbm_read_ceiling_bytes_per_s": s.bound.value if s.bound else None}
        out.append(replace(s, bound=b, achieved=r, fraction_of_bound=r / b.value, metrics=m))
    return out


def _l2_latency(h: Harness, quick: bool) -> tuple[list[Series], dict]:
    import torch  # heavy: torch

    rng = np.random.default_rng(20261129)
    steps, n_samples, n_lat = (1 << 14, 5, 256) if quick else (1 << 18, 5, 1024)
    rows = []
    for ws in plan.chase_sizes(quick):
        ch = K.Chase(h, ws, rng)
        warm = K.ReadJob(h, ch.n * ch.stride, "mb_read_cg_u4", 512, reps=2, buf=ch.buf)
        warm.first_check()
        ch.run(int(rng.integers(ch.n)), 256)  # untimed: loads the chase kernel, ramps the clock
        lat = torch.zeros(n_lat, dtype=torch.int32, device=K.DEVICE)
        ns, cyc, sms = [], [], []
        for i in range(n_samples):
            warm()
            r = ch.run(int(rng.integers(ch.n)), steps, n_lat if i == 0 else 0, lat)
            ns.append(r["ns"] / steps)
            cyc.append(r["cycles"] / steps)
            sms.append(r["smid"])
        per_load = lat.cpu().numpy().astype(np.float64)
        rows.append((ws, np.asarray(ns), np.asarray(cyc), sms, per_load))
        del ch, warm
    base_ns = float(np.median(rows[0][1]))
    series = []
    for ws, ns, cyc, sms, per_load in rows:
        clock = float(np.median(cyc / ns)) * 1e3  # cycles per ns -> MHz
        p10, p50, p90 = np.percentile(per_load, [10, 50, 90])
        metrics = {"clock_mhz_measured": clock, "cycles_per_load_median": float(np.median(cyc)),
                   "smids": sorted(set(sms)), "loads_per_sample": steps,
                   "single_load_cycles_p10_p50_p90_incl_overhead": [float(p10), float(p50), float(p90)]}
        b = Bound("latency", base_ns * 1e-9, "s",
                  f"chase latency at {rows[0][0] // MiB} MiB (all L2 hits) measured in this run")
        params = {"working_set_bytes": ws, "stride": plan.CHASE_STRIDE, "steps": steps}
        series.append(Series.from_samples(f"l2_latency/{ws // MiB}MiB", ns * 1e-9, timer="globaltimer", unit="s",
                                          params=params, bound=b, metrics=metrics))
        series.append(Series.from_samples(f"l2_latency_cycles/{ws // MiB}MiB", cyc, timer="clock64", unit="cycles",
                                          params=params, metrics={"clock_mhz_measured": clock}))
    sizes = np.array([r[0] for r in rows], dtype=np.float64)
    meds = np.array([np.median(r[1]) for r in rows])
    fit = fit_steps(np.log2(sizes), meds, max_levels=3)
    info = {"hit_ns": float(meds[0]), "miss_ns": float(meds[-1]), "fit": fit, "rows": rows}
    return series, info


EVICT_KINDS = {"normal": 0, "evict_first": 1, "evict_last": 2}
STREAM_BYTES = 256 * MiB  # the stream between two reads of the reused set (> 4x L2)


def _l2_hints(h: Harness, quick: bool, bound: Bound, scrub: K.Scrubber) -> tuple[list[Series], dict]:
    """Does a reused set survive a 256 MiB stream? Timed: reading the reused set H; untimed
    before each sample: the stream S (or nothing / a clean scrub for the two references)."""
    import torch  # heavy: torch

    l2 = h.info.l2_bytes
    hbytes = max(1, round(0.4 * l2 / MiB)) * MiB
    sbytes = STREAM_BYTES
    H = K.ReadJob(h, hbytes, "mb_read_hint_u4", 512)
    S = K.ReadJob(h, sbytes, "mb_read_hint_u4", 512)
    H.first_check()
    S.first_check()
    norm = K.module("read", h.info.arch).kernel("mb_l2_priority_normal")

    def normalise():
        launch(norm, LaunchSpec(grid=h.info.sm_count * 4, block=256), H.buf, np.uint64(hbytes // 128))
        scrub()
        torch.cuda.synchronize()

    pol = replace(h.policy, budget_s=min(h.policy.budget_s, 0.05)) if quick else h.policy
    out: list[Series] = []

    def measure(name, h_kind, before, extra=None):
        params = {"reused_bytes": hbytes, "streamed_bytes": sbytes, "reused_policy": h_kind, **(extra or {})}
        s = h.series(f"l2_hints/{name}", lambda: H(EVICT_KINDS[h_kind]), params=params, bound=bound,
                     work=float(hbytes), before_each=before, policy=pol)
        torch.cuda.synchronize()
        H.check()
        out.append(s)
        return s

    T = {}
    try:
        T["hot"] = measure("hot", "normal", None)
        T["flushed"] = measure("flushed", "normal", scrub)
        for s_kind, h_kind in (("normal", "normal"), ("evict_first", "normal"), ("normal", "evict_last"),
                               ("evict_first", "evict_last")):
            key = f"S_{s_kind}/H_{h_kind}"
            T[key] = measure(key, h_kind, lambda k=s_kind: S(EVICT_KINDS[k]), {"streamed_policy": s_kind})
            if h_kind == "evict_last":
                normalise()
        S.check()
        for kind in ("normal", "evict_first"):  # does the hint slow the stream itself?
            s = h.series(f"l2_hints/stream_{kind}", lambda k=kind: S(EVICT_KINDS[k]), bound=bound, work=float(sbytes),
                         params={"streamed_bytes": sbytes, "streamed_policy": kind}, policy=pol)
            torch.cuda.synchronize()
            S.check()
            out.append(s)
            T[f"stream_{kind}"] = s
    finally:
        normalise()

    # persisting-L2 window on H (plain ld.global.cg, no per-load hints, so the window decides)
    maxp = h.info.persisting_l2_max_bytes
    notes = []
    if maxp > 0:
        Hp = K.ReadJob(h, hbytes, "mb_read_cg_u4", 512, buf=H.buf)
        Sp = K.ReadJob(h, sbytes, "mb_read_cg_u4", 512, buf=S.buf)
        Hp.first_check()
        Sp.first_check()
        plain = h.series("l2_hints/plain_S_then_H", Hp, before_each=Sp, bound=bound, work=float(hbytes), policy=pol,
                         params={"reused_bytes": hbytes, "streamed_bytes": sbytes})
        torch.cuda.synchronize()
        Hp.check()
        out.append(plain)
        T["plain"] = plain
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        set_aside = min(hbytes, maxp)
        s = None
        try:
            with torch.cuda.stream(side):
                with persisting_window(side.cuda_stream, H.buf.data_ptr(), hbytes, set_aside, maxp) as st:
                    s = h.series("l2_hints/persisting_window_S_then_H", Hp, before_each=Sp, bound=bound,
                                 work=float(hbytes), policy=pol,
                                 params={"reused_bytes": hbytes, "streamed_bytes": sbytes, "set_aside": set_aside,
                                         "granted_limit": st["granted_limit"], "hit_ratio": 1.0})
                    torch.cuda.synchronize()
                    Hp.check()
        except MegabenchError as e:  # the driver refused the set-aside: report it, keep the rest
            if isinstance(e, CorrectnessError):
                raise
            notes.append(f"persisting-L2 window not measured: {e}")
            s = None
        finally:
            torch.cuda.current_stream().wait_stream(side)
            scrub()
            torch.cuda.synchronize()
        if s is not None:
            out.append(s)
            T["persisting"] = s
    else:
        notes.append("persisting-L2 window not measured: the device reports MAX_PERSISTING_L2_CACHE_SIZE = 0")
    return out, {"T": T, "notes": notes, "hbytes": hbytes, "sbytes": sbytes}


EVICT_FIRST_RULE = ("1 if reading the reused set after a {sbytes} B stream is faster with the stream loaded "
                    "evict_first than evict_normal: Mann-Whitney p < 0.01 and median gain > max(2%, 2x relative "
                    "IQR); spread: range of the decision over 200 bootstrap resamples")


def _protected(T, key) -> float:
    hot, cold, x = (float(np.median(T[k].samples)) for k in ("hot", "flushed", key))
    return (cold - x) / (cold - hot) if cold > hot else float("nan")


def run_l2(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = _quick(quick)
    bound = ceiling_bound(h)
    bw_series, usable = _l2_bandwidth(h, quick, bound)
    _release()
    lat_series, lat = _l2_latency(h, quick)
    _release()
    scrub = K.Scrubber(h)
    hint_series, hints = _l2_hints(h, quick, bound, scrub)
    del scrub
    _release()
    T = hints["T"]
    bw_names = tuple(s.name for s in bw_series)
    pays, d, dec_spread = rules.hint_pays(np.asarray(T["S_normal/H_normal"].samples),
                                          np.asarray(T["S_evict_first/H_normal"].samples))
    last, dl, last_spread = rules.hint_pays(np.asarray(T["S_normal/H_normal"].samples),
                                            np.asarray(T["S_normal/H_evict_last"].samples))
    fit = lat["fit"]
    prot = {k: _protected(T, k) for k in T if k.startswith("S_") or k == "persisting"}
    stream_cost = rules.faster(np.asarray(T["stream_evict_first"].samples), np.asarray(T["stream_normal"].samples))
    hint_note = ("protected fraction of the reused set's L2 benefit ((flushed - x) / (flushed - hot)): " +
                 ", ".join(f"{k} {v:.2f}" for k, v in prot.items()) +
                 f"; evict_first on the stream itself: {stream_cost.rel:+.1%} time vs normal "
                 f"({'significant' if stream_cost.significant else 'within noise'})")
    derived = {
        "l2_usable_bytes": Derived(usable.value, "B", usable.rule, usable.spread, bw_names,
                                   usable.note + f"; datasheet/driver L2 {h.info.l2_bytes} B"),
        "evict_first_pays": Derived(pays, "", EVICT_FIRST_RULE.format(sbytes=hints["sbytes"]), dec_spread,
                                    ("l2_hints/S_normal/H_normal", "l2_hints/S_evict_first/H_normal"),
                                    f"gain {d.rel:+.1%} (p = {d.p:.2g}, noise {d.noise:.1%}); " + hint_note),
        "evict_last_protects": Derived(last, "", "same rule, reused set loaded evict_last vs evict_normal", last_spread,
                                       ("l2_hints/S_normal/H_normal", "l2_hints/S_normal/H_evict_last"),
                                       f"gain {dl.rel:+.1%} (p = {dl.p:.2g})"),
        "l2_bandwidth_bytes_per_s": Derived(usable.plateau, "B/s", "level of the L2 bandwidth plateau: the median "
                                            "of the point medians over the working sets up to the L2 size", None,
                                            bw_names, usable.note),
        "l2_hit_latency_s": Derived(lat["hit_ns"] * 1e-9, "s", "median pointer-chase latency per load at the smallest "
                                    "working set (%globaltimer)", None, (lat_series[0].name,)),
        "dram_latency_s": Derived(lat["miss_ns"] * 1e-9, "s", "median pointer-chase latency per load at the largest "
                                  "working set (%globaltimer; includes TLB misses)", None, (lat_series[-2].name,)),
        "l2_latency_step_bytes": Derived(float(2 ** fit.breakpoints[0]) if fit.breakpoints else float("nan"), "B",
                                         "first breakpoint of a BIC step fit of chase latency vs log2(working set)",
                                         None, tuple(s.name for s in lat_series[::2]),
                                         f"levels {', '.join(f'{v:.0f} ns' for v in fit.levels)}"),
    }
    if "persisting" in T:
        pp, dp, psp = rules.hint_pays(np.asarray(T["plain"].samples), np.asarray(T["persisting"].samples))
        derived["persisting_window_protects"] = Derived(
            pp, "", "same rule, persisting access-policy window over the reused set vs none (plain loads)", psp,
            ("l2_hints/plain_S_then_H", "l2_hints/persisting_window_S_then_H"), f"gain {dp.rel:+.1%} (p = {dp.p:.2g})")
    notes = list(hints["notes"]) + ["state restored after the hint experiment: reused set reset to evict_normal "
                                    "(applypriority), persisting limit/window restored and verified, L2 scrubbed"]
    res = Result("weights.l2", Env.capture(h.device_index), tuple(bw_series + lat_series + hint_series), derived,
                 quick=quick, notes=tuple(notes))
    if save:
        res.save()
    return res


# ============================================================================ prefetch
def prefetch_grid(quick: bool) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(prefetched bytes, overlap in us)."""
    if quick:
        return tuple(m * MiB for m in (8, 24, 40, 56)), (5.0, 25.0)
    return tuple(m * MiB for m in (4, 8, 16, 24, 32, 40, 48, 56, 64)), (0.0, 5.0, 10.0, 25.0, 50.0)


def _busy_cycles(h: Harness, us: float) -> tuple[int, float]:
    mhz = h.info.sm_clock_max_mhz or 1500.0  # NVML max clock; the phase length itself is measured
    return int(round(us * mhz)), float(mhz)


def phase_case(name: str, params: dict, cfg: RingConfig, expert_bytes: int, n_experts: int, prefetch, read,
               busy_us: float, pa_bytes: int, scrub: K.Scrubber, bound: Bound) -> Case:
    def prepare(h: Harness):
        cyc, mhz = _busy_cycles(h, busy_us)
        job = K.PhaseJob(h, cfg, expert_bytes, n_experts, prefetch, read, cyc, pa_bytes, CONSUMER_WARPS)
        times = job.first_check(before=scrub)
        m = {"busy_cycles": cyc, "busy_clock_mhz_nominal": mhz, "ring": cfg.label,
             "bytes_phase_b": len(read) * expert_bytes, "bytes_prefetched": len(prefetch) * expert_bytes, **times}
        return K.Checked(launch=job, bound=bound, before_each=scrub, metrics=m, after=job.check)

    return Case(name, params, prepare)


def run_prefetch(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = _quick(quick)
    ceil = ceiling_bound(h)
    cfg, cfg_src = ring_for_phases(h)
    sizes, overlaps = prefetch_grid(quick)
    scrub = K.Scrubber(h)
    pol = _phase_policy(quick)
    series = []
    table: dict[tuple[float, int], tuple[Series, Series]] = {}
    for t in overlaps:
        for P in sizes:
            b = Bound("time", t * 1e-6 + P / ceil.value, "s", f"busy {t} us + {P} B at the read ceiling "
                      f"({ceil.source}): the best a run without prefetch can do")
            pair = []
            for pf in (False, True):
                nm = f"prefetch/{P // MiB}MiB/t{t:g}us/{'pf' if pf else 'nopf'}"
                params = {"prefetch_bytes": P, "overlap_us": t, "prefetch": pf, "ring": cfg.label}
                pair.append(_run(h, phase_case(nm, params, cfg, P, 1, [0] if pf else [], [0], t, 0, scrub, b), pol))
            series += pair
            table[(t, P)] = (pair[0], pair[1])
    del scrub
    _release()
    derived = {}
    notes = [f"phase-B ring {cfg.label}: {cfg_src}"]
    tmax = max(overlaps)
    for t in overlaps:
        nopf = [np.asarray(table[(t, P)][0].samples) for P in sizes]
        pf = [np.asarray(table[(t, P)][1].samples) for P in sizes]
        bud = rules.prefetch_budget(sizes, nopf, pf)
        rows = []
        for P, a, b2 in zip(sizes, nopf, pf):
            d = rules.faster(a, b2)
            rows.append(f"{P // MiB} MiB: {d.delta * 1e6:+.2f} us [{d.ci[0] * 1e6:+.2f}, {d.ci[1] * 1e6:+.2f}]"
                        f"{'*' if d.significant else ''}")
        notes.append(f"overlap {t:g} us, saving (nopf - pf; * = significant): " + "; ".join(rows))
        inputs = tuple(s.name for P in sizes for s in table[(t, P)])
        key = "l2_prefetch_budget_bytes" if t == tmax else f"l2_prefetch_budget_bytes_at_{t:g}us"
        derived[key] = Derived(bud.value, "B", bud.rule + (f" (overlap {t:g} us)" if t != tmax else
                                                           f"; overlap {t:g} us, the longest measured"),
                               bud.spread, inputs, f"best saving {bud.best_saving * 1e6:.2f} us")
        if t == tmax:
            _BUDGET[id(h)] = (bud.value, f"weights.prefetch of this run ({_stamp()}), overlap {t:g} us")
            if bud.value:
                a, b2 = table[(t, bud.value)]
                d = rules.faster(np.asarray(a.samples), np.asarray(b2.samples))
                derived["l2_prefetch_saving_s"] = Derived(d.delta, "s", "median no-prefetch minus prefetch time at "
                                                          "the budget and the longest overlap; spread: 5-95% bootstrap",
                                                          d.ci, (a.name, b2.name), f"{d.rel:.1%} of the phase pair")
    res = Result("weights.prefetch", Env.capture(h.device_index), tuple(series), derived, quick=quick,
                 notes=tuple(notes))
    if save:
        res.save()
    return res


# ============================================================================ hot experts
STUDY_EXPERT_BYTES = 3584 * KiB  # 3.5 MiB: the study's per-GPU slice of one expert (about 50 MB / 14)


def _budget_for_bet(h: Harness) -> tuple[int, str]:
    if id(h) in _BUDGET and _BUDGET[id(h)][0] > 0:
        return _BUDGET[id(h)]
    r = latest("weights.prefetch", gpu=h.info.name)
    if r is not None and r.derived.get("l2_prefetch_budget_bytes") and r.derived["l2_prefetch_budget_bytes"].value > 0:
        return int(r.derived["l2_prefetch_budget_bytes"].value), f"weights.prefetch result of {r.env.date}"
    v = int(0.6 * h.info.l2_bytes) // MiB * MiB
    return v, "0.6 x L2 (no positive prefetch budget measured on this GPU yet)"


def hot_grid(quick: bool):
    """[(expert bytes, scenario, overlaps)]; scenario 'slack' = busy phase A, 'membound' = phase A
    streams 64 MiB of other data through the ring with no busy time."""
    if quick:
        return [(STUDY_EXPERT_BYTES, "slack", (0.0, 0.5, 1.0)), (1 * MiB, "slack", (0.0, 1.0)),
                (STUDY_EXPERT_BYTES, "membound", (0.0, 1.0))]
    fs = (0.0, 0.25, 0.5, 0.75, 1.0)
    return [(STUDY_EXPERT_BYTES, "slack", fs), (2 * MiB, "slack", fs), (1 * MiB, "slack", fs),
            (512 * KiB, "slack", fs), (STUDY_EXPERT_BYTES, "membound", fs), (1 * MiB, "membound", fs)]


SLACK_US = 20.0
MEMBOUND_BYTES = 64 * MiB


def run_hot_experts(h: Harness | None = None, quick: bool | None = None, save: bool = True) -> Result:
    h = h or Harness()
    quick = _quick(quick)
    ceil = ceiling_bound(h)
    cfg, cfg_src = ring_for_phases(h)
    budget, budget_src = _budget_for_bet(h)
    scrub = K.Scrubber(h)
    pol = _phase_policy(quick)
    rng = np.random.default_rng(4)
    series, derived = [], {}
    notes = [f"phase-B ring {cfg.label}: {cfg_src}", f"prefetch budget {budget} B: {budget_src}"]
    for X, scen, fs in hot_grid(quick):
        k = max(1, budget // X)
        m = 2 * k
        E = plan.expert_pool(X, k, m, h.info.l2_bytes)
        busy = SLACK_US if scen == "slack" else 0.0
        pa = 0 if scen == "slack" else MEMBOUND_BYTES // cfg.stage_bytes * cfg.stage_bytes
        tag = f"{X / MiB:g}MiB/{scen}"
        base = {"expert_bytes": X, "k_prefetch": k, "m_read": m, "n_experts": E, "scenario": scen,
                "busy_us": busy, "phase_a_bytes": pa, "ring": cfg.label}
        b = Bound("time", busy * 1e-6 + (m * X + pa) / ceil.value, "s",
                  f"busy {busy} us + phase A/B bytes at the read ceiling ({ceil.source}): no-prefetch best case")
        r1 = plan.make_routing(E, k, m, 1.0, rng)
        nopf = _run(h, phase_case(f"hot/{tag}/nopf", {**base, "overlap": None, "prefetch": False}, cfg, X, E, [],
                                  r1.read, busy, pa, scrub, b), pol)
        series.append(nopf)
        pfs = []
        for f in fs:
            r = plan.make_routing(E, k, m, f, rng)
            s = _run(h, phase_case(f"hot/{tag}/f{f:g}", {**base, "overlap": r.overlap, "prefetch": True}, cfg, X, E,
                                   r.prefetch, r.read, busy, pa, scrub, b), pol)
            series.append(s)
            pfs.append((r.overlap, s))
        ov = [o for o, _ in pfs]
        be = rules.break_even(ov, np.asarray(nopf.samples), [np.asarray(s.samples) for _, s in pfs])
        right = rules.faster(np.asarray(nopf.samples), np.asarray(pfs[-1][1].samples))
        wrong = rules.faster(np.asarray(pfs[0][1].samples), np.asarray(nopf.samples))  # > 0: the wrong bet costs
        inputs = (nopf.name, *(s.name for _, s in pfs))
        note = (f"k={k} prefetched ({k * X / MiB:.1f} MiB), m={m} read; saving when right (f={ov[-1]:g}) "
                f"{right.delta * 1e6:+.2f} us [{right.ci[0] * 1e6:+.2f}, {right.ci[1] * 1e6:+.2f}]; cost when wrong "
                f"(f={ov[0]:g}) {wrong.delta * 1e6:+.2f} us [{wrong.ci[0] * 1e6:+.2f}, {wrong.ci[1] * 1e6:+.2f}]; "
                f"fit saving = {be.intercept * 1e6:+.2f} us + {be.slope * 1e6:+.2f} us * f")
        key = f"hot_expert_break_even_overlap_{X // KiB}KiB_{scen}"
        derived[key] = Derived(be.value, "", be.rule, be.spread, inputs, note)
        if X == STUDY_EXPERT_BYTES and scen == "slack":
            derived["hot_expert_break_even_overlap"] = Derived(
                be.value, "", be.rule + f"; expert size {X} B (the study's per-GPU slice), phase A = {busy:g} us "
                "of slack (the study's warp uses its slack; see the membound variant for a bandwidth-bound phase A)",
                be.spread, inputs, note)
            derived["hot_expert_saving_right_s"] = Derived(right.delta, "s", "median no-prefetch minus fully right "
                                                           "bet time; spread 5-95% bootstrap", right.ci,
                                                           (nopf.name, pfs[-1][1].name))
            derived["hot_expert_cost_wrong_s"] = Derived(wrong.delta, "s", "median fully wrong bet minus no-prefetch "
                                                         "time (> 0 costs); spread 5-95% bootstrap", wrong.ci,
                                                         (nopf.name, pfs[0][1].name))
            worth = 0 if be.value >= 1.0 else int(budget // X)
            derived["hot_experts_worth_prefetching"] = Derived(
                worth, "", "floor(l2 prefetch budget / expert size) when the bet can pay (break-even < 1), else 0",
                None, inputs, f"expert size {X} B, budget {budget} B ({budget_src})")
    del scrub
    _release()
    res = Result("weights.hot_experts", Env.capture(h.device_index), tuple(series), derived, quick=quick,
                 notes=tuple(notes))
    if save:
        res.save()
    return res


BENCHMARKS = {
    "weights.read_ceiling": run_read_ceiling,
    "weights.ring": run_ring,
    "weights.l2": run_l2,
    "weights.prefetch": run_prefetch,
    "weights.hot_experts": run_hot_experts,
}

"""An independent check of each class: a second method of ours, a public measurement of this GPU
(or of its architecture), or the datasheet, beside our figure, with whether they agree.

`rows(ctx)` returns the rows (class, quantity, ours, independent, agree?, note); `section(ctx)`
renders them together with the stability of the build's constants between machines
(microbench/stability.py); `adoption_lines(ctx)` says which constants revision the megakernel
builds from and which constants are pinned. Published numbers come from reports/references.json
(each with its source), datasheet figures from microbench/datasheet.py. Where two methods
disagree the row says so and why that is expected or not; nothing is hidden for disagreeing.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from microbench import rederive
from microbench.adopt import load_adoption
from microbench.datasheet import hbm_peak
from microbench.fmt import Footnotes, fmt, fmt_spread, md_table, wrap
from microbench.pins import load_pins
from microbench.stability import table as stability_table
from microbench.weights import rules

REFERENCES = Path(__file__).with_name("references.json")
KiB, MiB = 1024, 1 << 20


@functools.lru_cache(maxsize=1)
def references() -> dict:
    return json.loads(REFERENCES.read_text())["sources"]


def _d(ctx, bench, key):
    got = ctx.cat.latest(bench)
    return rederive.derived(got[1]).get(key) if got else None


def _s(ctx, bench, name):
    got = ctx.cat.latest(bench)
    if not got:
        return None
    return next((s for s in got[1].series if s.name == name), None)


def _overlap(a, b) -> bool:
    return max(a[0], b[0]) <= min(a[1], b[1])


def _within(x, ref, rel) -> bool:
    return abs(x / ref - 1.0) <= rel


def _row(cls, quantity, ours, other, agree, note):
    return {"class": cls, "quantity": quantity, "ours": ours, "independent": other,
            "agree?": agree if isinstance(agree, str) else ("yes" if agree else "NO"), "note": note}


def _icache(ctx):
    out = []
    sm = _d(ctx, "icache.capacity", "icache_sm_bytes")
    mc = _d(ctx, "icache.spliced", "max_code_bytes_per_launch")
    if sm and mc:
        # the largest splice at solo speed and the first one that slowed, as code bytes: a second
        # design (two blocks in one loop) bracketing the same SM instruction cache
        out.append(_row("icache", "SM instruction cache capacity", f"{fmt_spread(sm.spread, 'B')} (capacity curve, 1 "
                        "warp/SM: last body on the level - first body off it)", f"{fmt_spread(mc.spread, 'B')} "
                        "(spliced blocks: largest splice whose large block kept its solo speed - the next, which did "
                        "not)", _overlap(sm.spread, mc.spread), "two kernel designs; the splice sizes include the "
                        "loop's own code"))
    if sm:
        ref = references()["study-icache"]
        out.append(_row("icache", "SM instruction cache capacity", f"{fmt_spread(sm.spread, 'B')}",
                        f"about {fmt(ref['bytes'], 'B')} (the study, on GB300)", sm.spread[0] <= ref["bytes"] <= sm.spread[1],
                        "a different GPU (Blackwell Ultra); the same level of the hierarchy"))
    return out


def _weights(ctx):
    out = []
    ref = references()["gpu-benches-h200-l2"]
    pts = [(kb * KiB, gbs * 1e9) for kb, gbs in ref["points_kB_GBps"]]
    u = _d(ctx, "weights.l2", "l2_usable_bytes")
    lvl = _d(ctx, "weights.l2", "l2_bandwidth_bytes_per_s")
    if u:
        theirs = rules.l2_usable([p[0] for p in pts], [np.full(3, p[1]) for p in pts], 62914560)
        out.append(_row("weights", "end of the L2 bandwidth plateau", fmt_spread(u.spread, "B"),
                        f"{fmt_spread(theirs.spread, 'B')} (te42kyfo/gpu-benches H200 curve, the same rule)",
                        _overlap(u.spread, theirs.spread), "their plateau ~10 TB/s over 4-40 MB, falling at 44-58 MB"))
        if lvl:
            out.append(_row("weights", "L2 plateau read bandwidth", fmt(lvl.value, "B/s"),
                            f"{fmt(theirs.plateau, 'B/s')} (te42kyfo/gpu-benches H200)",
                            _within(lvl.value, theirs.plateau, 0.05), "ours reads with ld.global.cg, 4 x 16 B per thread, "
                            "512 threads per block; a 10% lower plateau is the kernel's, not the cache's, until a second "
                            "load width is measured"))
    step = _d(ctx, "weights.l2", "l2_latency_step_bytes")
    if u and step:
        out.append(_row("weights", "where L2 hits stop", fmt_spread(u.spread, "B") + " (bandwidth plateau)",
                        f"{fmt(step.value, 'B')} (pointer-chase latency step, same run: a second method)",
                        u.spread[0] * 0.8 <= step.value <= u.spread[1], "latency rises between 32 and 48 MiB"))
    rc = _d(ctx, "weights.read_ceiling", "read_ceiling_bytes_per_s")
    if rc:
        peak = hbm_peak(ctx.cat.gpu)
        if peak:
            out.append(_row("weights", "HBM read ceiling", fmt(rc.value, "B/s"), f"{fmt(peak, 'B/s')} (datasheet)",
                            rc.value <= peak, f"{rc.value / peak:.1%} of the datasheet; a measured ceiling must not exceed it"))
        dram = pts[-1][1]
        out.append(_row("weights", "HBM read bandwidth", fmt(rc.value, "B/s"),
                        f"{fmt(dram, 'B/s')} (te42kyfo/gpu-benches H200, its L2 kernel past 63 MB)",
                        _within(rc.value, dram, 0.05), "theirs is the L2 benchmark's tail, not a streaming kernel tuned "
                        "for HBM (ours: the best of several load widths and grids over 2 GiB)"))
    rb = _d(ctx, "weights.ring", "ring_best_bandwidth_bytes_per_s")
    if rb and rc:
        out.append(_row("weights", "streaming read, two designs", fmt(rb.value, "B/s") + " (bulk copies through the "
                        "shared-memory ring)", fmt(rc.value, "B/s") + " (plain loads, the read ceiling)",
                        _within(rb.value, rc.value, 0.05), f"{rb.value / rc.value:.1%}"))
    hit = _d(ctx, "weights.l2", "l2_hit_latency_s")
    cg = _s(ctx, "sync.flags", "poll_load/cg")
    if hit and cg:
        out.append(_row("weights", "L2 hit latency", f"{fmt(hit.value, 's')} (pointer chase, one thread)",
                        f"{fmt(cg.summary.median, 's')} (sync.flags ld.global.cg from every SM: another kernel)",
                        _within(hit.value, cg.summary.median, 0.10), "L2 latency depends on which SM asks and which "
                        "slice holds the line"))
    lat = references()["gpu-benches-h100-latency"]
    cyc = _s(ctx, "weights.l2", "l2_latency_cycles/1MiB")
    dr = [s for s in (ctx.cat.latest("weights.l2") or (None, None))[1].series
          if s.name.startswith("l2_latency_cycles/")] if ctx.cat.latest("weights.l2") else []
    if cyc:
        out.append(_row("weights", "L2 hit latency (cycles)", f"{cyc.summary.median:.0f} cycles",
                        f"{lat['l2_near_cycles']:.0f} cycles (te42kyfo/gpu-benches, H100 PCIe)",
                        _within(cyc.summary.median, lat["l2_near_cycles"], 0.10), "another Hopper part; cycles compare, "
                        "nanoseconds would not (1755 vs 1980 MHz)"))
    if dr:
        far = dr[-1]
        out.append(_row("weights", "DRAM latency (cycles)", f"{far.summary.median:.0f} cycles ({far.name.split('/')[-1]})",
                        f"{lat['dram_cycles']:.0f} cycles (te42kyfo/gpu-benches, H100 PCIe)",
                        _within(far.summary.median, lat["dram_cycles"], 0.10), "includes TLB misses in both"))
    return out


def _sync(ctx):
    out = []
    poll = _d(ctx, "sync.flags", "poll_load_latency_s")
    flag = _d(ctx, "sync.flags", "flag_latency_s")
    if poll and flag:
        out.append(_row("sync", "one-way flag vs one acquire poll", f"{fmt(flag.value, 's')} (ping-pong / 2)",
                        f">= {fmt(poll.value, 's')} (one ld.acquire.gpu, poll_load: a flag handoff needs at least one)",
                        flag.value >= poll.value, "a physical floor from a second kernel"))
    s = _s(ctx, "sync.flags", "pingpong/one_way/by_pair")
    if s and s.clocks.get("sm_mhz_inkernel") and s.clocks.get("sm_mhz_nvml_after_warmup"):
        a, b = s.clocks["sm_mhz_inkernel"], s.clocks["sm_mhz_nvml_after_warmup"]
        out.append(_row("sync", "SM clock that converts %clock64", f"{b:.0f} MHz (NVML after warm-up)",
                        f"{a:.0f} MHz (cycles / %globaltimer inside the same kernels)", _within(a, b, 0.02),
                        "two timers"))
    return out


def _clocks(ctx):
    out = []
    tick = _d(ctx, "clocks.timers", "globaltimer_tick_ns")
    step = _d(ctx, "xgpu.clocks", "globaltimer_step_ns")
    if tick and step:
        out.append(_row("clocks", "%globaltimer step", f"{tick.value:g} ns (clocks.timers, 1-GPU machines)",
                        f"{step.value:g} ns (xgpu.clocks, 2-GPU machines)", "differs (expected)",
                        "the step depends on the machine and profiler state (ANCHORS.md): each result states its own"))
    cost = _d(ctx, "clocks.instrumentation", "profiler_cost_per_launch_s")
    mk = _d(ctx, "megakernel.timeline", "profiler_cost_per_launch_s")
    if cost and mk:
        out.append(_row("clocks", "profiler cost per launch", f"{fmt(cost.value, 's')} (microbenchmark, per-phase stamps)",
                        f"{fmt(mk.value, 's')} (the megakernel's own profiled vs unprofiled launches)", "differs (expected)",
                        "the megakernel stamps more phases and spills more registers when profiled"))
    return out


def _xgpu(ctx):
    out = []
    bw = _d(ctx, "xgpu.collectives", "xgpu_peer_copy_bw")
    ref = references()["datasheet-nvlink-h200"]
    if bw:
        out.append(_row("xgpu", "peer copy bandwidth, one way", fmt(bw.value, "B/s"),
                        f"{fmt(ref['bytes_per_s_one_way'], 'B/s')} (datasheet NVLink, one way)",
                        bw.value <= ref["bytes_per_s_one_way"], f"{bw.value / ref['bytes_per_s_one_way']:.0%} of the "
                        "datasheet"))
    return out


def _basics(ctx):
    out = []
    mem = _d(ctx, "basics.copy", "memcpy_bandwidth")
    own = _d(ctx, "basics.copy", "mb_copy_v4_bandwidth")
    if mem and own:
        out.append(_row("basics", "device copy bandwidth", f"{fmt(own.value, 'B/s')} (our copy kernel)",
                        f"{fmt(mem.value, 'B/s')} (the driver's memcpy)", _within(own.value, mem.value, 0.10),
                        f"{own.value / mem.value:.1%} of the driver's"))
    return out


def rows(ctx) -> list[dict]:
    """Every class's independent check that the results allow."""
    out = []
    for fn in (_basics, _icache, _weights, _sync, _clocks, _xgpu):
        try:
            out += fn(ctx)
        except (KeyError, ValueError, IndexError) as e:  # shown, not hidden
            out.append(_row(fn.__name__.strip("_"), "cross-check", "", "", "not computed", f"{type(e).__name__}: {e}"))
    return out


def stability_rows(ctx) -> list[dict]:
    if not ctx.cat.gpu:
        return []
    out = []
    for v in stability_table(ctx.cat.root, ctx.cat.gpu, load_pins(ctx.cat.gpu)):
        out.append({"constant": f"`{v.name}`", "verdict": v.status,
                    "runs (machine: value, spread)": "; ".join(
                        f"{r.machine[:8]}: {r.value:g} ({fmt_spread(r.spread, '') if r.spread else 'no spread'})"
                        + (" re-derived" if r.rederived else "") for r in v.runs),
                    "not compared": f"{len(v.older_rule)} run(s) under an older rule" if v.older_rule else ""})
    return out


def section(ctx) -> list[str]:
    out = ["## Independent cross-checks", "",
           *wrap("Each class's figures beside a second method of ours, a public measurement of this GPU (or of its "
                 "architecture), or the datasheet. Sources: `reports/references.json`, `microbench/datasheet.py`."), ""]

    notes = Footnotes("Notes")
    rs = [{k: (notes.cell(v, 60) if k in ("ours", "independent", "note") else v) for k, v in r.items()}
          for r in rows(ctx)]  # long cells become numbered notes: the section's lines stay readable
    out += [md_table(rs), "", *notes.lines()] if rs else ["Nothing to cross-check yet (no results).", ""]
    st = stability_rows(ctx)
    if st:
        out += ["### The build's constants on two machines", "",
                *wrap("For every constant the megakernel build reads: the latest run on each machine (GPU UUID), "
                      "valued by the current rule from its samples; two runs agree when equal or their spreads "
                      "overlap (`microbench/stability.py`, tests/test_stability.py). `one machine`: needs a second "
                      "run (`.ci/gpu-session stability45`)."), "", md_table(st), ""]
    return out


def adoption_lines(ctx) -> list[str]:
    if not ctx.cat.gpu:
        return []
    out = []
    try:
        rec = load_adoption(ctx.cat.gpu)
    except Exception as e:  # shown: a broken adoption file is what the report is for
        return [f"**The adoption file is invalid:** {e}", ""]
    if rec is None:
        out += [f"> **No adopted constants revision for {ctx.cat.gpu}:** the megakernel builds from the current file, "
                "unmeasured (`megabench adopt`).", ""]
    else:
        out += [*wrap(f"The megakernel builds from the **adopted revision {rec['revision']}** (`reports/constants/"
                      f"{rec['revision_file']}`, adopted {rec['adopted']}), not from the latest tune: {rec['reason']} "
                      "A new revision reaches the build only with `megabench adopt --measured-by <megakernel results "
                      "built with it>` (microbench/adopt.py)."), ""]
    pins = load_pins(ctx.cat.gpu)
    for p in pins.values():
        e = ctx.tune_entries.get(p.name)
        mv = e.provenance.get("measured_value") if e is not None else None
        out += wrap(f"`{p.name}` is **pinned** at {fmt(p.value, e.spec.unit if e else '')} (since {p.since}; the "
                    f"latest result derives {fmt(mv, e.spec.unit) if e is not None and mv is not None else 'nothing'}): "
                    f"{p.reason}", first="- ", rest="  ")
    return out + ([""] if pins else [])

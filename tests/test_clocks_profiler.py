"""CPU tests of the in-kernel profiler's host side: event registry and generated headers, buffer
layout, decoding (and its refusal of corrupted buffers), the timeline, the clock64 calibration,
the Chrome/Perfetto trace export validated against the trace-event rules, and the plot."""
from __future__ import annotations

import json

import numpy as np
import pytest
from clocks_emulate import emulate

from microbench.clocks.calibrate import CalibrationError, fit_clock_calibration, quantisation_floor_ns
from microbench.clocks.events import ALL_EVENTS, header_path
from microbench.clocks.profiler import (ProfileEvents, ProfileFormatError, ProfileLayout, Timeline, TraceFormatError,
                                        check_trace, decode, layout_constants, to_trace_events, validate_trace)

GT0 = 1_764_000_000_000_000_000  # a realistic absolute %globaltimer (ns since 1970)


def demo_events() -> ProfileEvents:
    ev = ProfileEvents("demo", prefix="DEMO_EV", doc="test registry")
    ev.phase("load", "load weights")
    ev.phase("gemm")
    ev.instant("flag")
    return ev


# ------------------------------------------------------------------------------------ registry
def test_layout_constants_come_from_the_header():
    c = layout_constants()
    assert c["VALID"] == 0x80000000 and c["RECORD_WORDS"] == 8 and c["HEADER_BYTES"] == 64
    assert c["META_CAP_SHIFT"] == c["META_WARPS_SHIFT"] + 6 and c["META_EPOCH_SHIFT"] == c["META_CAP_SHIFT"] + 20


def test_event_ids_names_and_rendering():
    ev = demo_events()
    assert [(e.id, e.name, e.kind, e.phase) for e in ev.events] == [
        (1, "load_begin", "begin", "load"), (2, "load_end", "end", "load"), (3, "gemm_begin", "begin", "gemm"),
        (4, "gemm_end", "end", "gemm"), (5, "flag", "instant", "flag")]
    assert ev.phases == ("load", "gemm")
    assert ev.macro("gemm_end") == "DEMO_EV_GEMM_END" and ev.id("flag") == 5
    assert ev.by_id(0) is None and ev.by_id(6) is None and ev.by_id(3).name == "gemm_begin"
    d = ev.defines()
    assert d["DEMO_EV_LOAD_BEGIN"] == 1 and d["DEMO_EV_COUNT"] == 5
    text = ev.header_text()
    for macro, val in d.items():
        assert f"#define {macro}" in text and f" {val}u" in text.split(f"#define {macro}")[1].splitlines()[0]
    assert "#pragma once" in text and "static_assert(DEMO_EV_COUNT" in text


@pytest.mark.parametrize("bad", [lambda e: e.phase("load"), lambda e: e.instant("load"),
                                 lambda e: e.instant("flag"), lambda e: e.phase("Bad"),
                                 lambda e: e.instant("9x"), lambda e: e.phase("load_begin")])
def test_registry_refuses_duplicates_and_bad_names(bad):
    with pytest.raises(ProfileFormatError):
        bad(demo_events())


def test_registry_refuses_bad_prefix_and_unknown_lookup():
    with pytest.raises(ProfileFormatError, match="UPPER_SNAKE"):
        ProfileEvents("x", prefix="lower")
    with pytest.raises(KeyError, match="no event"):
        demo_events()["nope"]


def test_generated_headers_are_current(tmp_path):
    for ev in ALL_EVENTS:
        ev.check_header(header_path(ev))
    p = tmp_path / "stale.cuh"
    p.write_text(ALL_EVENTS[0].header_text().replace("1u", "7u", 1))
    with pytest.raises(ProfileFormatError, match="stale"):
        ALL_EVENTS[0].check_header(p)
    with pytest.raises(ProfileFormatError, match="missing"):
        ALL_EVENTS[0].check_header(tmp_path / "absent.cuh")


# ------------------------------------------------------------------------------------ layout
def test_layout_meta_roundtrip_and_sizes():
    lay = ProfileLayout(blocks=132, warps=12, cap=300)
    for epoch in (1, 77, layout_constants()["META_EPOCH_MASK"]):
        assert ProfileLayout.unpack_meta(lay.meta(epoch)) == (lay, epoch)
    assert lay.records_offset % 32 == 0 and lay.slice_bytes % 256 == 0
    assert lay.slice_bytes >= 64 + 4 * 132 * 12 + 132 * 12 * 300 * 32


@pytest.mark.parametrize("kw", [dict(blocks=0), dict(blocks=1, warps=33), dict(blocks=1, cap=0),
                                dict(blocks=1, cap=1 << 20), dict(blocks=1 << 24)])
def test_layout_refuses_out_of_range(kw):
    with pytest.raises(ProfileFormatError, match="must be an integer"):
        ProfileLayout(**kw)


def test_layout_refuses_epoch_zero_and_too_big_grids():
    from microbench.launch import LaunchSpec

    lay = ProfileLayout.for_launch(LaunchSpec(grid=8, block=96), cap=4)
    assert (lay.blocks, lay.warps, lay.cap) == (8, 3, 4)
    with pytest.raises(ProfileFormatError, match="epoch"):
        lay.meta(0)
    with pytest.raises(ProfileFormatError, match="9 blocks"):
        lay.check_launch(LaunchSpec(grid=9, block=32))


# ------------------------------------------------------------------------------------ decoding
def random_stamps(rng, layout, launches, per_warp=(0, 9), with_c64=True):
    st = {}
    for L in range(launches):
        for b in range(layout.blocks):
            for w in range(layout.warps):
                n = int(rng.integers(*per_warp))
                t = GT0 + int(rng.integers(0, 10**6))
                recs = []
                for i in range(n):
                    t += int(rng.integers(0, 5000))
                    recs.append((int(rng.integers(1, 6)), int(rng.integers(0, 2**32)), t,
                                 int(rng.integers(1, 2**60)) if with_c64 else 0, int(rng.integers(0, 132))))
                st[(L, b, w)] = recs
    return st


def test_decode_roundtrip_with_overflow():
    rng = np.random.default_rng(1)
    lay = ProfileLayout(blocks=3, warps=2, cap=5)
    st = random_stamps(rng, lay, 2)
    s = decode(emulate(lay, st, launches=2, epoch=9), lay, 2)
    assert s.epoch == 9
    want = [(L, b, w, i, *r) for (L, b, w), recs in sorted(st.items()) for i, r in enumerate(recs[:5])]
    got = list(zip(s.launch, s.block, s.warp, s.slot, s.event, s.arg, s.gt, s.c64, s.sm))
    assert [tuple(int(v) for v in g) for g in got] == [(a, b, c, d, e, f, g, h, i) for a, b, c, d, e, f, g, h, i in want]
    for (L, b, w), recs in st.items():
        assert s.overflow[L, b, w] == max(0, len(recs) - 5)
    assert s.counts().sum() == len(s) and s.has_clock64


def test_decode_accepts_bytes_and_int_views():
    lay = ProfileLayout(blocks=1, warps=1, cap=2)
    buf = emulate(lay, {(0, 0, 0): [(1, 5, GT0, 7, 3)]})
    for raw in (buf, buf.view(np.int32), buf.view(np.uint8)):
        assert len(decode(raw, lay)) == 1
    with pytest.raises(ProfileFormatError, match="integer words"):
        decode(buf.astype(np.float32), lay)


def _one(lay=None):
    lay = lay or ProfileLayout(blocks=2, warps=2, cap=3)
    st = {(0, 1, 1): [(1, 0, GT0 + i, 10 + i, 4) for i in range(3)], (0, 0, 0): [(2, 0, GT0, 1, 2)]}
    return lay, emulate(lay, st)


def _rec_index(lay, b, w, n):
    return lay.records_offset // 4 + ((b * lay.warps + w) * lay.cap + n) * 8


def test_decode_refuses_a_gap_in_the_records():
    lay, buf = _one()
    buf[_rec_index(lay, 1, 1, 1)] = 0  # middle record lost its valid tag
    with pytest.raises(ProfileFormatError, match=r"block 1 warp 1: records at slots \[0, 2\] are not contiguous"):
        decode(buf, lay)


def test_decode_refuses_records_out_of_place():
    lay, buf = _one()
    c = layout_constants()
    buf[_rec_index(lay, 1, 1, 0) + c["W_EPOCH_BLOCK"]] ^= 1  # says block 0
    with pytest.raises(ProfileFormatError, match="written out of place"):
        decode(buf, lay)
    lay, buf = _one()
    buf[_rec_index(lay, 1, 1, 0) + c["W_TAG"]] ^= 1 << c["TAG_WARP_SHIFT"]  # says warp 0
    with pytest.raises(ProfileFormatError, match="out of place"):
        decode(buf, lay)


def test_decode_refuses_bad_headers_and_short_buffers():
    lay, buf = _one()
    bad = buf.copy()
    bad[0] = 0
    with pytest.raises(ProfileFormatError, match="magic"):
        decode(bad, lay)
    other = ProfileLayout(blocks=2, warps=2, cap=2)
    assert other.slice_bytes == lay.slice_bytes  # same size, different layout: only the header tells
    with pytest.raises(ProfileFormatError, match="does not match the layout"):
        decode(buf, other)
    with pytest.raises(ProfileFormatError, match="need"):
        decode(buf[:-8], lay)
    with pytest.raises(ProfileFormatError, match="epoch"):
        decode(buf, lay, epoch=2)


def test_decode_refuses_overflow_without_full_records():
    lay, buf = _one()
    buf[64 // 4 + 0] = 3  # block 0 warp 0 claims overflow but wrote 1 of 3 records
    with pytest.raises(ProfileFormatError, match="overflow counter 3"):
        decode(buf, lay)


def test_stale_records_of_an_earlier_epoch_are_not_read_as_new():
    lay = ProfileLayout(blocks=1, warps=1, cap=6)
    old = emulate(lay, {(0, 0, 0): [(1, i, GT0 + i, 1, 0) for i in range(5)]}, epoch=1)
    new = emulate(lay, {(0, 0, 0): [(2, 100 + i, GT0 + 10 + i, 1, 0) for i in range(2)]}, epoch=2, buf=old)
    s = decode(new, lay)
    assert s.event.tolist() == [2, 2] and s.arg.tolist() == [100, 101] and s.stale == 3


def test_the_device_resets_a_slice_and_unrecorded_slices_yield_nothing():
    """ProfileBuffer.reset() writes nothing: a recording launch zeroes its counters and stamps its
    slice's header epoch (profile.cuh). A slice no launch of the epoch was handed keeps an older
    epoch and decodes as not recorded; one that was handed out must carry the epoch."""
    lay = ProfileLayout(blocks=2, warps=1, cap=2)
    first = {(L, b, 0): [(1, L, GT0 + b, 1, 0)] * 3 for L in range(2) for b in range(2)}  # all overflow
    buf = emulate(lay, first, launches=2, epoch=1)
    # epoch 2: only slice 1 recorded, and only by block 0 (block 1 keeps epoch 1's overflow count)
    buf = emulate(lay, {(1, 0, 0): [(2, 7, GT0 + 50, 1, 0)]}, launches=2, epoch=2, buf=buf)
    s = decode(buf, lay, 2, epoch=2, recorded={1})
    assert s.launch.tolist() == [1] and s.arg.tolist() == [7] and s.stale == 4 + 1 + 2  # slice 0; block 0, 1 of slice 1
    assert s.overflow.sum() == 0  # slice 0 not recorded; block 1 of slice 1 did not run
    with pytest.raises(ProfileFormatError, match="header epoch 1, reader expected 2"):
        decode(buf, lay, 2, epoch=2)  # without `recorded` every slice must carry the epoch
    with pytest.raises(ProfileFormatError, match="did not record"):
        decode(buf, lay, 2, epoch=2, recorded={0, 1})
    bad = buf.copy()
    bad[(lay.slice_bytes + 64) // 4] = 5  # block 0 of slice 1 ran (1 of 2 records) yet claims overflow
    with pytest.raises(ProfileFormatError, match="overflow counter 5"):
        decode(bad, lay, 2, epoch=2, recorded={1})


def test_buffer_reset_bumps_the_epoch_and_enqueues_nothing():
    from microbench.clocks.profiler import ProfileBuffer

    pb = ProfileBuffer(ProfileLayout(blocks=2, warps=1, cap=4), launches=3, device="cpu")
    before = pb.tensor.clone()
    pb.args(2)
    assert pb.armed == {2}
    pb.reset()
    assert pb.epoch == 2 and pb.armed == set() and bool((pb.tensor == before).all())
    assert len(pb.read()) == 0  # nothing handed out: no slice must carry epoch 2
    pb.args(1)
    with pytest.raises(ProfileFormatError, match="slice 1: header epoch 1, reader expected 2"):
        pb.read()  # handed out, but no launch recorded into it


# ------------------------------------------------------------------------------------ timeline
def _timeline_input():
    ev = demo_events()
    lay = ProfileLayout(blocks=2, warps=2, cap=8)
    E = {e.name: e.id for e in ev.events}
    st = {
        (0, 0, 0): [(E["load_begin"], 1, GT0 + 100, 0, 5), (E["gemm_begin"], 2, GT0 + 150, 0, 5),
                    (E["gemm_end"], 3, GT0 + 300, 0, 5), (E["flag"], 9, GT0 + 320, 0, 5),
                    (E["load_end"], 4, GT0 + 400, 0, 5)],
        (0, 1, 1): [(E["load_end"], 0, GT0 + 50, 0, 7), (E["load_begin"], 0, GT0 + 60, 0, 7),
                    (99, 0, GT0 + 70, 0, 7)],
    }
    return ev, lay, st


def test_timeline_matches_spans_and_lists_every_problem():
    ev, lay, st = _timeline_input()
    tl = Timeline.build(decode(emulate(lay, st), lay), ev)
    assert tl.clock == "globaltimer" and tl.origin_gt == GT0 + 50
    spans = sorted((s.phase, s.block, s.begin_ns, s.end_ns, s.arg, s.end_arg) for s in tl.spans)
    assert spans == [("gemm", 0, 100.0, 250.0, 2, 3), ("load", 0, 50.0, 350.0, 1, 4)]
    assert sorted((i.name, i.arg, i.t_ns) for i in tl.instants) == [("flag", 9, 270.0), ("unknown_event_99", 0, 20.0)]
    probs = "\n".join(tl.problems)
    assert "end of phase 'load'" in probs and "never ended" in probs and "unknown event id 99" in probs
    assert len(tl.problems) == 3
    with pytest.raises(ProfileFormatError, match="3 profile problems"):
        Timeline.build(decode(emulate(lay, st), lay), ev, strict=True)
    assert list(tl.spans_df().columns) == ["launch", "block", "warp", "sm", "phase", "arg", "begin_ns", "end_ns",
                                           "end_arg", "dur_ns"]
    d = tl.stamps_df()
    assert {"name", "kind", "t_ns", "gt_ns", "c64", "sm"} <= set(d.columns) and len(d) == 8
    assert set(tl.phase_summary().index) == {"load", "gemm"}
    assert tl.first("load_begin") == {(0, 0, 0): 50.0, (0, 1, 1): 10.0}


def test_timeline_reports_overflow_and_time_going_backwards():
    ev = demo_events()
    lay = ProfileLayout(blocks=1, warps=1, cap=2)
    st = {(0, 0, 0): [(1, 0, GT0 + 10, 0, 0), (2, 0, GT0 + 5, 0, 0), (5, 0, GT0 + 20, 0, 0)]}
    tl = Timeline.build(decode(emulate(lay, st), lay), ev)
    assert any("backwards" in p for p in tl.problems) and any("1 stamps overflowed" in p for p in tl.problems)


def test_timeline_clock64_mapping_uses_per_sm_offsets():
    ev = demo_events()
    lay = ProfileLayout(blocks=4, warps=1, cap=64)
    rng = np.random.default_rng(3)
    tick, ghz = 32, 1.98
    off = {sm: int(rng.integers(10**9, 10**12)) for sm in range(4)}
    st, truth = {}, {}
    for b in range(4):
        recs = []
        t = 1000.0 + 37 * b
        for i in range(32):
            t += float(rng.uniform(50, 400))
            ev_id = ev.id("load_begin") if i % 2 == 0 else ev.id("load_end")
            recs.append((ev_id, i, GT0 + int(t // tick * tick), off[b] + int(round(t * ghz)), b))
            truth[(b, i)] = t
        st[(0, b, 0)] = recs
    s = decode(emulate(lay, st), lay)
    tl = Timeline.build(s, ev, clock="clock64")
    assert tl.clock == "clock64->globaltimer" and tl.calibration.key_fields == ("sm",)
    true = np.array([truth[(int(b), int(i))] for b, i in zip(s.block, s.slot)]) - (tl.origin_gt - GT0)
    err = tl.t_ns - true
    # one common shift (floor quantisation, ~tick/2), then agreement well inside a tick
    assert abs(np.median(err) + tick / 2) < tick / 2
    assert np.std(err) < tick / 3
    assert abs(tl.calibration.sm_mhz - ghz * 1e3) < 2
    with pytest.raises(ProfileFormatError, match="no clock64"):
        Timeline.build(decode(emulate(lay, {(0, 0, 0): [(1, 0, GT0, 0, 0)]}), lay), ev, clock="clock64")


# ------------------------------------------------------------------------------------ calibration
def synthetic_pairs(rng, n_sm=16, n=200, tick=1000, ghz=1.98, span_ns=5e6):
    off = rng.integers(10**10, 10**12, size=n_sm)
    t = np.sort(rng.uniform(0, span_ns, size=(n, 1)), axis=0) + rng.uniform(0, 300, size=(n, n_sm))
    sm = np.broadcast_to(np.arange(n_sm), (n, n_sm))
    c64 = (off[None, :] + np.round(t * ghz)).astype(np.uint64)
    gt = np.uint64(GT0) + ((t // tick) * tick).astype(np.uint64)  # integer add: GT0 is past float64's 2^53
    return sm, c64, gt, t


@pytest.mark.parametrize("tick", [32, 1000])
def test_calibration_recovers_rate_and_reaches_the_quantisation_floor(tick):
    rng = np.random.default_rng(7)
    sm, c64, gt, t = synthetic_pairs(rng, tick=tick)
    tr, te = slice(0, None, 2), slice(1, None, 2)
    cal = fit_clock_calibration(sm[tr].ravel(), c64[tr].ravel(), gt[tr].ravel())
    assert abs(cal.sm_mhz - 1980) < 0.5
    res = cal.residual_ns(sm[te].ravel(), c64[te].ravel(), gt[te].ravel())
    floor = quantisation_floor_ns(tick)
    assert 0.8 * floor < np.sqrt(np.mean(res ** 2)) < 1.25 * floor
    # mapped clock64 reproduces the true instants up to one common shift
    mapped = cal.to_ns(sm[te].ravel(), c64[te].ravel()) - (t[te].ravel() - (cal.origin_gt - GT0))
    assert np.std(mapped) < floor / 3
    s = cal.summary()
    assert s["groups"] == 16 and s["group_rate_ppm_p10_p90"] is not None


def test_calibration_with_a_given_rate_and_its_errors():
    rng = np.random.default_rng(2)
    sm, c64, gt, _ = synthetic_pairs(rng, tick=32)
    cal = fit_clock_calibration(sm.ravel(), c64.ravel(), gt.ravel(), ns_per_cycle=1 / 1.98)
    assert cal.rate_given and cal.rms_ns < 32
    with pytest.raises(CalibrationError, match="clock64 = 0"):
        fit_clock_calibration([0, 0], [0, 5], [GT0, GT0 + 1])
    with pytest.raises(CalibrationError, match="does not vary"):
        fit_clock_calibration([0, 1], [5, 5], [GT0, GT0 + 1])
    with pytest.raises(CalibrationError, match="no calibration"):
        cal.to_ns([99], [5])
    with pytest.raises(CalibrationError, match="lengths"):
        fit_clock_calibration([0], [1, 2], [3, 4])


# ------------------------------------------------------------------------------------ trace export
def _rich_timeline(launches=2):
    ev = demo_events()
    lay = ProfileLayout(blocks=3, warps=2, cap=16)
    rng = np.random.default_rng(5)
    st = {}
    for L in range(launches):
        for b in range(3):
            for w in range(2):
                t = GT0 + 10_000 * L + int(rng.integers(0, 500))
                recs = []
                for rep in range(2):  # load [ gemm ] flag load  ... nested and sequential spans, equal stamps
                    recs.append((ev.id("load_begin"), rep, t, 0, 10 + b))
                    recs.append((ev.id("gemm_begin"), rep, t, 0, 10 + b))  # same ts as its parent
                    t += int(rng.integers(0, 300))
                    recs.append((ev.id("gemm_end"), rep, t, 0, 10 + b))
                    recs.append((ev.id("flag"), rep, t, 0, 10 + b))
                    t += int(rng.integers(0, 300))
                    recs.append((ev.id("load_end"), rep, t, 0, 10 + b))
                st[(L, b, w)] = recs
    return Timeline.build(decode(emulate(lay, st, launches=launches), lay, launches), ev,
                          launch_names=[f"layer {i}" for i in range(launches)])


@pytest.mark.parametrize("by", ["launch", "sm"])
@pytest.mark.parametrize("style", ["X", "BE"])
def test_exported_trace_follows_the_trace_event_format(by, style, tmp_path):
    tl = _rich_timeline()
    assert not tl.problems
    obj = to_trace_events(tl, by=by, style=style)
    assert validate_trace(obj) == []
    evs = obj["traceEvents"]
    assert obj["displayTimeUnit"] == "ns"
    body = [e for e in evs if e["ph"] != "M"]
    if style == "X":
        assert sum(e["ph"] == "X" for e in body) == len(tl.spans)
    else:
        assert sum(e["ph"] == "B" for e in body) == sum(e["ph"] == "E" for e in body) == len(tl.spans)
    assert sum(e["ph"] == "i" for e in body) == len(tl.instants)
    names = {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == ({"layer 0", "layer 1"} if by == "launch" else {"SM 10", "SM 11", "SM 12"})
    # timestamps are microseconds from the origin
    first = min(e["ts"] for e in body)
    assert first == pytest.approx(min(s.begin_ns for s in tl.spans) / 1e3)
    p = tl.write_trace(tmp_path / "t.json", by=by, style=style)
    assert validate_trace(json.loads(p.read_text())) == []


def test_overlapping_but_unnested_phases_get_their_own_track():
    ev = demo_events()
    lay = ProfileLayout(blocks=1, warps=1, cap=8)
    st = {(0, 0, 0): [(ev.id("load_begin"), 0, GT0, 0, 0), (ev.id("gemm_begin"), 0, GT0 + 5, 0, 0),
                      (ev.id("load_end"), 0, GT0 + 10, 0, 0), (ev.id("gemm_end"), 0, GT0 + 15, 0, 0)]}
    tl = Timeline.build(decode(emulate(lay, st), lay), ev)
    assert len(tl.spans) == 2 and not tl.problems
    for style in ("X", "BE"):
        obj = to_trace_events(tl, style=style)
        assert validate_trace(obj) == []
        tids = {e["tid"] for e in obj["traceEvents"] if e["ph"] in ("X", "B")}
        assert len(tids) == 2


def _base_trace():
    return {"traceEvents": [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "p"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "t"}},
        {"name": "a", "ph": "B", "ts": 1.0, "pid": 0, "tid": 1},
        {"name": "b", "ph": "X", "ts": 1.5, "dur": 0.5, "pid": 0, "tid": 1},
        {"name": "c", "ph": "i", "s": "t", "ts": 2.0, "pid": 0, "tid": 1},
        {"name": "a", "ph": "E", "ts": 3.0, "pid": 0, "tid": 1},
    ], "displayTimeUnit": "ns"}


def _mut(fn):
    t = _base_trace()
    fn(t)
    return t


BAD_TRACES = {
    "never ends": lambda t: t["traceEvents"].pop(),
    "E without a matching B": lambda t: t["traceEvents"].pop(2),
    "goes back in time": lambda t: t["traceEvents"][4].update(ts=0.5),
    "needs a finite 'dur'": lambda t: t["traceEvents"][3].pop("dur"),
    "'pid' must be an integer": lambda t: t["traceEvents"][2].update(pid=True),
    "'ts' must be a finite number": lambda t: t["traceEvents"][4].update(ts=float("nan")),
    "not one of": lambda t: t["traceEvents"][4].update(ph="Q"),
    "without nesting": lambda t: t["traceEvents"].insert(4, {"name": "d", "ph": "X", "ts": 1.8, "dur": 1.0,
                                                               "pid": 0, "tid": 1}),
    "displayTimeUnit": lambda t: t.update(displayTimeUnit="us"),
    "closes B named": lambda t: t["traceEvents"][5].update(name="zzz"),
    "'name' must be a string": lambda t: t["traceEvents"][3].update(name=7),
    "'tid' must be an integer": lambda t: t["traceEvents"][3].pop("tid"),
    "args must carry": lambda t: t["traceEvents"][1].update(args={}),
    "instant scope": lambda t: t["traceEvents"][4].update(s="x"),
}


def test_validator_accepts_the_reference_trace():
    assert validate_trace(_base_trace()) == []


@pytest.mark.parametrize("what", sorted(BAD_TRACES))
def test_validator_catches_each_broken_trace(what):
    errs = validate_trace(_mut(BAD_TRACES[what]))
    assert errs and any(what in e for e in errs), errs
    with pytest.raises(TraceFormatError):
        check_trace(_mut(BAD_TRACES[what]))


def test_validator_refuses_non_objects():
    assert validate_trace([]) and validate_trace({"traceEvents": {}})


def test_plot_writes_a_png(tmp_path):
    tl = _rich_timeline()
    for by in ("sm", "block"):
        p = tl.plot(tmp_path / f"t-{by}.png", by=by, title="test")
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_plot_of_a_later_launch_spans_what_it_draws():
    """The origin is the step's first stamp: a plot of launch 1 alone (10 us later) must not start
    at 0, where nothing is drawn (the megakernel's middle-launch PNGs were ~90% empty)."""
    from microbench.clocks.profiler import _x_range

    tl = _rich_timeline()
    spans = [s for s in tl.spans if s.launch == 1]
    insts = [s for s in tl.instants if s.launch == 1]
    lo, hi = _x_range(spans, insts)
    first = min(s.begin_ns for s in spans) / 1e3
    last = max(s.end_ns for s in spans) / 1e3
    assert first >= 9.0  # launch 1 begins ~10 us after the origin
    assert lo < first and hi > last  # everything drawn is inside
    assert (first - lo) < 0.1 * (last - first) + 2e-3 and (hi - last) < 0.1 * (last - first) + 2e-3
    assert _x_range([], []) == (0.0, 1.0)


def test_empty_buffer_and_an_external_calibration():
    ev = demo_events()
    lay = ProfileLayout(blocks=2, warps=1, cap=4)
    empty = decode(emulate(lay, {}), lay)
    for clock in ("globaltimer", "clock64"):
        tl = Timeline.build(empty, ev, clock=clock)
        assert len(tl.spans) == 0 and not tl.problems and tl.spans_df().empty
    # a calibration fitted elsewhere (e.g. by the skew benchmark, keyed by SM) maps these stamps
    st = {(0, b, 0): [(ev.id("load_begin"), 0, GT0 + 1000 * i, 5_000 + 2000 * i + 77 * b, b) for i in range(2)]
          for b in range(2)}
    cal = fit_clock_calibration([0, 0, 1, 1], [5_000, 7_000, 5_077, 7_077], [GT0, GT0 + 1000, GT0, GT0 + 1000])
    tl = Timeline.build(decode(emulate(lay, st), lay), ev, clock=cal, key_fields=("launch", "sm"))
    assert tl.calibration is cal and np.allclose(tl.t_ns, [0, 1000, 0, 1000])
    with pytest.raises(CalibrationError, match="no calibration"):
        Timeline.build(decode(emulate(lay, {(0, 0, 0): [(1, 0, GT0, 9, 5)]}), lay), ev, clock=cal)

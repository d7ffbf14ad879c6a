"""CPU tests of the sync class: parameter-block layouts parsed from the kernels, the derivation
rules on synthetic data (each must be able to give both answers), the one-way split, GPC
grouping, payload coverage, configuration checks, and that every constant in
microbench/constants.py owned by sync is produced under its exact key."""
from __future__ import annotations

import re

import numpy as np
import pytest

from microbench.sync import analysis as A
from microbench.sync import params as P
from microbench.sync import runners as R


def test_parse_enum_values_comments_and_errors(tmp_path):
    f = tmp_path / "e.cu"
    f.write_text("enum E : int {\n  A = 0, // first\n  B,   /* two */\n  C = 0x10,\n  D,\n  E_N\n};\n"
                 "enum Bad { X = 1, X = 2 };\n")
    assert P.parse_enum(str(f), "E") == {"A": 0, "B": 1, "C": 16, "D": 17, "E_N": 18}
    with pytest.raises(ValueError, match="twice"):
        P.parse_enum(str(f), "Bad")
    with pytest.raises(ValueError, match="no enum"):
        P.parse_enum(str(f), "Missing")


@pytest.mark.parametrize("layout", [R.PP, R.PB, R.FC, R.BR, R.PL], ids=lambda l: l.prefix)
def test_kernel_layouts_are_dense_and_pack_checks_names(layout):
    assert layout.n == len(layout.index) > 3
    full = {k: i + 1 for i, k in enumerate(layout.index)}
    arr = layout.pack(full)
    assert arr.dtype == np.uint64 and arr.shape == (layout.n,)
    for k, i in layout.index.items():
        assert arr[i] == full[k]
    with pytest.raises(KeyError, match="missing"):
        layout.pack({k: 0 for k in list(layout.index)[1:]})
    with pytest.raises(KeyError, match="unknown"):
        layout.pack({**full, "nonsense": 1})
    assert layout.pack({**full, next(iter(full)): -1})[0] == np.uint64(2**64 - 1)


def test_describe_what_names_waits():
    w = (R.SYNC_WAIT["SW_SLOT"] << 24) | 17
    assert "sentinel slot of round 17" in R.describe_what(w)
    assert "pong of round 3" in R.describe_what((R.SYNC_WAIT["SW_PONG"] << 24) | 3)
    assert "unknown" in R.describe_what(0xEE000000)


def test_split_one_way_recovers_asymmetric_trips():
    rng = np.random.default_rng(0)
    calib, settle, meas = 16, 4, 64
    n = calib + settle + meas
    off = 123456.0  # responder clock ahead of the initiator's
    fwd = np.r_[np.full(calib, 400.0), np.full(settle, 9e9), np.full(meas, 300.0)] + rng.integers(0, 3, n)
    back = np.r_[np.full(calib, 400.0), np.full(settle, 9e9), np.full(meas, 900.0)] + rng.integers(0, 3, n)
    react = 20.0
    t0 = np.cumsum(np.full(n, 5000.0))
    init = np.stack([t0, t0 + fwd + react + back], axis=1).astype(np.int64)
    resp = np.stack([t0 + fwd + off, t0 + fwd + off + react], axis=1).astype(np.int64)
    ow = A.split_one_way(init, resp, calib, settle)
    assert abs(ow.offset - off) < 3
    assert ow.rtt.size == meas
    assert abs(np.median(ow.a_to_b) - 301) < 3 and abs(np.median(ow.b_to_a) - 901) < 3
    with pytest.raises(ValueError):
        A.split_one_way(init, resp, 0, 0)
    with pytest.raises(ValueError):
        A.split_one_way(init, resp[:-1], calib, settle)


def test_gpc_groups_union_find():
    g = A.gpc_groups([[0, 1], [2, 3], [1, 4], [5, 6, 7]], sm_ids=range(9))
    assert g[0] == g[1] == g[4] and g[2] == g[3] and g[5] == g[6] == g[7]
    assert len(set(g.values())) == 4  # {0,1,4} {2,3} {5,6,7} {8}
    assert g[0] == 0 and g[2] == 1 and g[8] == 3


def test_backoff_rule_both_ways():
    rng = np.random.default_rng(1)
    base = 1e-6
    flat = {b: base * (1 + 0.01 * rng.standard_normal(500)) + (0.02e-6 if b == 512 else 0) for b in (0, 32, 128, 512)}
    pick, med = A.choose_backoff(flat)
    assert pick == 512  # 2% slower is inside the 5% tolerance: back off all the way
    steep = {b: base * (1 + b / 256) * (1 + 0.01 * rng.standard_normal(500)) for b in (0, 32, 128, 512)}
    assert A.choose_backoff(steep)[0] == 0
    helps = {0: base * 2 * (1 + 0.01 * rng.standard_normal(500)), 32: base * (1 + 0.01 * rng.standard_normal(500)),
             128: base * 1.5 * (1 + 0.01 * rng.standard_normal(500))}
    assert A.choose_backoff(helps)[0] == 32
    lo, hi = A.choose_backoff_spread(flat, n_boot=30)
    assert lo <= 512 <= hi


def test_spin_bound_rule():
    small = np.full(10000, 1e-6)
    b, (lo, hi), p = A.spin_bound_ns(small)
    assert b == A.SPIN_BOUND_FLOOR_NS == lo == hi  # 1000 x 1 us = 1 ms: the floor
    slow = np.r_[np.full(9000, 1e-6), np.full(1000, 5e-6)]
    b2, _, p2 = A.spin_bound_ns(slow)
    assert b2 == 5_000_000 and abs(p2 - 5e-6) < 1e-12
    with pytest.raises(ValueError):
        A.spin_bound_ns([])
    # the H200's tail (p99.9 6.8 us, 2026-11-29) and a second machine's 5.2 or 9.6 us give one bound
    rng = np.random.default_rng(0)
    for tail in (5.2e-6, 6.8e-6, 9.6e-6):
        w = np.r_[rng.normal(6e-7, 5e-8, 99_800), np.full(200, tail)]
        assert A.spin_bound_ns(w)[0] == 10_000_000
    assert [A.step_125(x) for x in (1, 1.5, 2, 2.1, 7e6, 1e7, 1.2e7)] == [1, 2, 2, 5, 10**7, 10**7, 2 * 10**7]


def test_sentinel_rule_both_ways():
    rng = np.random.default_rng(2)
    rel = {s: 1e-6 * (1 + 0.02 * rng.standard_normal(128)) for s in (16, 256, 4096, 65536)}
    fast = {s: 0.7 * v for s, v in rel.items()}
    val, spread, per = A.sentinel_pays(fast, rel)
    assert val == 1 and spread == (1, 1) and set(per) == {16, 256, 4096}
    slow_at_4k = dict(fast)
    slow_at_4k[4096] = 1.2 * rel[4096]
    assert A.sentinel_pays(slow_at_4k, rel)[0] == 0
    same = {s: v.copy() for s, v in rel.items()}
    assert A.sentinel_pays(same, rel)[0] == 0  # not significantly faster
    with pytest.raises(ValueError):
        A.sentinel_pays({65536: rel[65536]}, rel)


def test_per_stop_seconds_and_flag_latency():
    x = A.per_stop_seconds([2000.0, 4000.0], 10, 1000.0, baseline_s=1e-8)
    assert np.allclose(x, [2e-7 - 1e-8, 4e-7 - 1e-8])
    v, (lo, hi) = A.flag_latency([1e-6, 2e-6, 3e-6])
    assert v == 2e-6 and lo <= v <= hi
    with pytest.raises(ValueError):
        A.per_stop_seconds([1.0], 0, 1000.0)


def test_payload_generators_cover_the_special_classes():
    rng = np.random.default_rng(4)
    h = R.special_bf16(rng, 3 * 65536)
    assert len(np.unique(h)) == 65536 and (h == 0xFFFF).mean() > 0.05
    f = R.special_f32(rng, 200000)
    fv = f.view(np.float32)
    assert (f == 0x80000000).mean() > 0.05 and (f == 0).any()
    assert np.isnan(fv).sum() > 10000 and np.isinf(fv).any()
    sub = (f & 0x7F800000) == 0
    assert (sub & ((f & 0x7FFFFF) != 0)).sum() > 10000
    assert len(np.unique(f[np.isnan(fv)])) > 5000, "NaN payloads vary"


def test_publish_configs_are_valid_and_refuse_nonsense():
    from microbench.sync.bench import publish_configs, verify_rounds

    cfgs = publish_configs(list(range(132)), quick=True)
    for c in cfgs:
        c.validate()
        assert verify_rounds(c) >= c.copies + 2
    assert {c.mode for c in cfgs} == set(R.PUB_MODES)
    with pytest.raises(ValueError, match="needs 2 agents"):
        R.PubConfig("release_flag", "ping", (1, 2, 3), 64).validate()
    with pytest.raises(ValueError, match="sentinel slots need"):
        R.PubConfig("sentinel_f32", "ping", (1, 2), 0).validate()
    with pytest.raises(ValueError, match="multiple of 16"):
        R.PubConfig("fence_flag", "ping", (1, 2), 20).validate()
    with pytest.raises(ValueError, match="distinct"):
        R.PubConfig("fence_flag", "alltoall", (1, 1, 2), 16).validate()


def test_every_sync_constant_is_derived_under_its_key():
    from microbench.constants import SPECS
    from microbench.registry import CLASSES
    from microbench.sync import bench

    assert CLASSES["sync"] is bench.BENCHMARKS
    src = open(bench.__file__).read()
    mine = [s for s in SPECS if s.benchmark.startswith("sync.")]
    assert {s.name for s in mine} == {"flag_latency_s", "poll_backoff_ns", "sync_stop_cost_s", "sentinel_pays",
                                      "spin_bound_ns"}
    for s in mine:
        assert s.benchmark in bench.BENCHMARKS, s.benchmark
        fn = bench.BENCHMARKS[s.benchmark].__name__
        body = src[src.index(f"def {fn}("):]
        body = body[:body.index("\ndef ", 1)]
        assert re.search(r'derived\[\s*"' + re.escape(s.derived_key) + r'"\s*\]', body), \
            f"{s.benchmark} does not set derived[{s.derived_key!r}]"

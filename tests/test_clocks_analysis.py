"""CPU tests of the clocks analysis: tick, rate, skew (spread estimator and held-out calibration
on synthetic SMs with known delays), launch-chain metrics, the instrumentation reference and the
cost fits. Each checker is also shown to fail on broken data."""
from __future__ import annotations

import numpy as np
import pytest
from clocks_emulate import emulate

from microbench.clocks import analysis as an
from microbench.clocks.events import LAUNCH
from microbench.clocks.profiler import ProfileLayout, Timeline, decode
from microbench.errors import CorrectnessError

GT0 = 1_764_000_000_000_000_000


# ------------------------------------------------------------------------------------ tick / rate
def tick_data(incs_per_block, period=64):
    B = len(incs_per_block)
    M = max(len(x) for x in incs_per_block)
    inc = np.zeros((B, M), dtype=np.uint64)
    cyc = np.zeros((B, M), dtype=np.uint64)
    info = np.zeros((B, 4), dtype=np.int64)
    for b, x in enumerate(incs_per_block):
        inc[b, :len(x)] = x
        cyc[b, :len(x)] = 10**9 + np.arange(1, len(x) + 1) * period
        info[b] = (len(x), 50 * len(x), b, 1)
    return inc, cyc, info


def test_tick_is_the_smallest_increment_and_the_rest_is_reported():
    rng = np.random.default_rng(0)
    blocks = [rng.choice([32, 32, 32, 64, 96], size=200) for _ in range(3)]
    blocks[1][5] = 32
    st = an.analyse_tick(*tick_data(blocks))
    assert st.tick_ns == 32 and st.gcd_ns == 32 and st.mode_ns == 32
    assert st.per_block_min_ns == (32, 32, 32) and st.changes == 600 and st.reads_per_change == 50
    assert st.period_cycles.size == 597 and np.all(st.period_cycles == 64)
    assert st.stop_reasons == {"max_changes": 3}
    d = st.to_dict()
    assert d["hist"]["32"] > d["hist"]["64"] and d["tick_ns"] == 32


def test_tick_checker_fails_on_a_stalled_or_broken_probe():
    with pytest.raises(CorrectnessError, match="changed only 3 times"):
        an.analyse_tick(*tick_data([np.array([1000, 1000, 1000])]))
    inc, cyc, info = tick_data([np.full(20, 1000)])
    inc[0, 4] = 0
    with pytest.raises(CorrectnessError, match="zero increment"):
        an.analyse_tick(inc, cyc, info)
    inc, cyc, info = tick_data([np.full(20, 1000)])
    cyc[0, 7] = cyc[0, 6]
    with pytest.raises(CorrectnessError, match="clock64 did not increase"):
        an.analyse_tick(inc, cyc, info)


def test_rate_analysis_and_its_checks():
    out = np.array([[GT0, 10**9, GT0 + 50_000_000, 10**9 + 99_000_000, 3]], dtype=np.uint64)
    r = an.analyse_rate(out)
    assert r["mhz"][0] == pytest.approx(1980.0) and r["sm"][0] == 3
    bad = out.copy()
    bad[0, 2] = GT0
    with pytest.raises(CorrectnessError, match="globaltimer advanced 0"):
        an.analyse_rate(bad)
    bad = out.copy()
    bad[0, 3] = 10**9 + 1
    with pytest.raises(CorrectnessError, match="implausible"):
        an.analyse_rate(bad)


# ------------------------------------------------------------------------------------ skew
def synthetic_skew(rng, T=400, B=32, tick=1000, ghz=1.98, poll=150.0):
    delay = np.linspace(0, 400, B)  # true per-SM lateness of the release (propagation), ns
    rng.shuffle(delay)
    release = np.cumsum(rng.uniform(3000, 7000, size=T))  # random phase against the tick
    true = release[:, None] + delay[None, :] + rng.uniform(0, poll, size=(T, B))
    off = rng.integers(10**10, 10**12, size=B)
    c64 = (off[None, :] + np.round(true * ghz)).astype(np.uint64)
    gt = np.uint64(GT0) + ((true // tick) * tick).astype(np.uint64)
    sm = rng.permutation(132)[:B]
    return gt, c64, sm, true, delay


@pytest.mark.parametrize("tick", [32, 1000])
def test_skew_spread_and_calibration_on_synthetic_sms(tick):
    rng = np.random.default_rng(11)
    gt, c64, sm, true, delay = synthetic_skew(rng, tick=tick)
    an.check_skew(gt, c64, sm, sm_count=32)
    st = an.analyse_skew(gt, c64, sm, tick)
    truth = float(np.mean(an.spread(true)))
    # the mean over trials resolves the spread even when one tick is 2.5x larger than it
    assert st.sm_skew_ns == pytest.approx(truth, rel=0.15), (st.sm_skew_ns, truth)
    assert st.sm_skew_ci[0] <= st.sm_skew_ns <= st.sm_skew_ci[1]
    # held-out residual sits at the quantisation floor; calibrated spreads match the truth
    assert 0.8 * st.quantisation_floor_ns < st.residual_rms_ns < 1.3 * st.quantisation_floor_ns
    true_test = an.spread(true[1::2])
    assert np.median(st.calibrated_spread_p90_p10) == pytest.approx(np.median(true_test), abs=max(15, tick * 0.08))
    # the late SMs are found
    assert np.corrcoef(st.per_sm_lateness_ns, delay)[0, 1] > 0.95
    assert abs(st.calibration.sm_mhz - 1980) < 1


def test_skew_checker_fails_on_bad_stamps():
    rng = np.random.default_rng(1)
    gt, c64, sm, _, _ = synthetic_skew(rng, T=8, B=4)
    an.check_skew(gt, c64, sm)
    g = gt.copy()
    g[3, 2] = 0
    with pytest.raises(CorrectnessError, match="block 2 did not stamp trial 4"):
        an.check_skew(g, c64, sm)
    s = sm.copy()
    s[1] = s[0]
    with pytest.raises(CorrectnessError, match="more than one stamper"):
        an.check_skew(gt, c64, s)
    c = c64.copy()
    c[5, 1] = c[4, 1]
    with pytest.raises(CorrectnessError, match="backwards between trials 5 and 6"):
        an.check_skew(gt, c, sm)
    with pytest.raises(CorrectnessError, match="4 stamper blocks for 132 SMs"):
        an.check_skew(gt, c64, sm, sm_count=132)
    with pytest.raises(CorrectnessError, match="at least 4 trials"):
        an.analyse_skew(gt[:3], c64[:3], sm, 1000)


# ------------------------------------------------------------------------------------ launch chains
def chain_timeline(pdl_overlap_ns=0.0, launches=3, blocks=4):
    """Synthetic chain: launch k's blocks exit at staggered times; k+1's blocks land on the same
    SMs `gap` ns after the same-SM exit (negative with overlap)."""
    lay = ProfileLayout(blocks=blocks, warps=1, cap=4)
    E = {e.name: e.id for e in LAUNCH.events}
    st = {}
    exits = {}
    for L in range(launches):
        for b in range(blocks):
            sm = 20 + b
            land = 1000.0 if L == 0 else exits[(L - 1, b)] + 500 - pdl_overlap_ns
            go = land + 100 if L == 0 else max(land, max(exits[(L - 1, x)] for x in range(blocks)) + 700)
            end = go + 20_000 + 1000 * b
            exits[(L, b)] = end
            st[(L, b, 0)] = [(E["griddep_wait_begin"], 0, GT0 + int(land), 1, sm),
                             (E["griddep_wait_end"], 0, GT0 + int(go), 1, sm),
                             (E["work_begin"], 0, GT0 + int(go), 1, sm), (E["work_end"], 0, GT0 + int(end), 1, sm)]
    return Timeline.build(decode(emulate(lay, st, launches=launches), lay, launches), LAUNCH, strict=True)


def test_chain_metrics_on_a_known_chain():
    m = an.analyse_chain(chain_timeline())
    assert set(m) == set(an.CHAIN_METRICS)
    assert np.all(m["land_after_same_sm_exit"] == 500)
    # block b's SM frees 1000*b after the first exit; the last exit is block 3's
    assert sorted(m["land_after_last_exit"][:4].tolist()) == [500 - 3000, 500 - 2000, 500 - 1000, 500]
    assert np.all(m["release_after_last_exit"] == 700)
    o = an.analyse_chain(chain_timeline(pdl_overlap_ns=3000))
    assert np.all(o["land_after_same_sm_exit"] == -2500) and np.all(o["wait_in_griddepcontrol"] > 0)
    assert m["land_after_first_exit"].size == 2 * 4


def test_chain_checker_fails_when_a_block_never_exits():
    lay = ProfileLayout(blocks=2, warps=1, cap=4)
    E = {e.name: e.id for e in LAUNCH.events}
    st = {(0, 0, 0): [(E["griddep_wait_begin"], 0, GT0, 1, 0), (E["griddep_wait_end"], 0, GT0 + 1, 1, 0),
                      (E["work_begin"], 0, GT0 + 1, 1, 0), (E["work_end"], 0, GT0 + 9, 1, 0)],
          (0, 1, 0): [(E["griddep_wait_begin"], 0, GT0, 1, 1)]}
    tl = Timeline.build(decode(emulate(lay, st), lay), LAUNCH)
    with pytest.raises(CorrectnessError, match="launch 0 block 1 has no release stamp"):
        an.analyse_chain(tl)


# ------------------------------------------------------------------------------------ instrumentation
def test_instr_reference_matches_a_scalar_model():
    import torch

    rng = np.random.default_rng(4)
    nb, per, phases = 5, 8, 4
    x0 = rng.integers(-2**31, 2**31 - 1, size=nb * per, dtype=np.int64).astype(np.int32)
    coef = [int(v) for v in rng.integers(-2**31, 2**31 - 1, size=2 * phases)]
    ref = an.instr_reference(torch.from_numpy(x0), coef, phases, nb).numpy()
    x = [[int(v) & 0xFFFFFFFF for v in x0[b * per:(b + 1) * per]] for b in range(nb)]
    for p in range(phases):
        a, c = coef[2 * p] & 0xFFFFFFFF, coef[2 * p + 1] & 0xFFFFFFFF
        x = [[(v * a + c) & 0xFFFFFFFF for v in x[(b + p + 1) % nb]] for b in range(nb)]
    assert ref.tolist() == [v for row in x for v in row]
    assert an.expected_instr_stamps(4, 1) == 14 and an.expected_instr_stamps(4, 8) == 112


def test_cost_fits_recover_a_known_slope_and_difference():
    rng = np.random.default_rng(9)
    base, per = 80e-6, 20e-9
    stamps = np.array([0, 14, 112])
    samples = [base + s * per + rng.normal(0, 0.2e-6, size=300) for s in stamps]
    slope, icpt, (lo, hi) = an.fit_cost_per_stamp(stamps, samples)
    assert slope == pytest.approx(per, rel=0.15) and lo < per < hi and icpt == pytest.approx(base, rel=0.01)
    d, (dlo, dhi) = an.median_difference_ci(samples[0], samples[1])
    assert d == pytest.approx(14 * per, abs=0.1e-6) and dlo < d < dhi

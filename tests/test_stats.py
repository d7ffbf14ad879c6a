"""Statistics used by derivations and the gate, checked on synthetic data with known answers."""
from __future__ import annotations

import numpy as np
import pytest

from microbench.stats import Summary, bootstrap_ci, fit_affine, fit_steps, mann_whitney


def test_summary():
    s = Summary.of([1, 2, 3, 4, 5])
    assert s.median == 3 and s.q1 == 2 and s.q3 == 4 and s.iqr == 2
    assert s.rel_iqr == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        Summary.of([])


def test_fit_steps_recovers_known_levels():
    rng = np.random.default_rng(0)
    x = np.geomspace(2e3, 1e6, 40)
    true_bps = [32e3, 128e3]
    levels = [1.0, 2.5, 9.0]
    y = np.array([levels[np.searchsorted(true_bps, v, side="right")] for v in x])
    y = y * (1 + 0.02 * rng.standard_normal(x.size))
    fit = fit_steps(x, y, max_levels=5)
    assert len(fit.levels) == 3
    for got, want in zip(fit.breakpoints, true_bps):
        assert want / 1.3 < got < want * 1.3
    for got, want in zip(fit.levels, levels):
        assert got == pytest.approx(want, rel=0.05)


def test_fit_steps_flat_curve_is_one_level():
    rng = np.random.default_rng(1)
    x = np.geomspace(1, 1000, 20)
    fit = fit_steps(x, 5 + 0.05 * rng.standard_normal(20))
    assert len(fit.levels) == 1


def test_mann_whitney_detects_shift_and_not_noise():
    rng = np.random.default_rng(2)
    a = rng.normal(1.0, 0.01, 40)
    b = rng.normal(1.05, 0.01, 40)
    _, p = mann_whitney(b, a, "greater")
    assert p < 1e-6
    _, p2 = mann_whitney(a, rng.normal(1.0, 0.01, 40), "greater")
    assert p2 > 0.01
    # ties everywhere: no evidence
    _, p3 = mann_whitney([1.0] * 10, [1.0] * 10)
    assert p3 == 1.0


def test_fit_affine():
    v = np.array([1e6, 1e7, 1e8, 1e9])
    t = 5e-6 + v / 3e12
    f = fit_affine(v, t)
    assert f.a == pytest.approx(5e-6, rel=1e-3) and f.b == pytest.approx(3e12, rel=1e-3)


def test_bootstrap_ci_contains_median():
    x = np.random.default_rng(3).normal(10, 1, 200)
    lo, hi = bootstrap_ci(x)
    assert lo < np.median(x) < hi

"""Whether the constants the megakernel build reads come out the same on two machines (issue 45).

Whether they agree is a measurement, and a new run on a new machine can change it: it is judged by
`python -m microbench.stability` (exit 1 when an unpinned build constant flips) and shown in the
report's stability table, not asserted here. Here: every `feeds_build` constant gets a verdict
from the committed results (a pinned one is held by its pin, with its reason; microbench/adopt.py),
synthetic runs check the comparison itself, and the two committed ring runs of 2026-11-29 (named
below by file, so the retention rule keeps them) show the flip the old rule had."""
from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest

from microbench import stability
from microbench.pins import load_pins
from microbench.constants import FEEDS_BUILD, SPECS
from microbench.results import REPO_ROOT

ROOT = REPO_ROOT / "reports" / "results"
GPU = "NVIDIA H200"


@pytest.mark.parametrize("name", FEEDS_BUILD)
def test_every_build_constant_gets_a_verdict_from_the_committed_results(name):
    v = stability.check(name, ROOT, GPU, load_pins(GPU))
    assert v.status in ("pinned", "agree", "flips", "one machine", "not measured"), v.status
    assert v.describe().startswith(f"{name}: {v.status}")
    if v.status == "pinned":
        assert v.pin.reason.strip(), f"{name} is pinned without a reason"
    elif v.status in ("agree", "flips"):  # two machines or more, each run with its value and file
        assert len({r.machine for r in v.runs}) >= 2 and all(r.file for r in v.runs), v.describe()


def test_every_build_constant_is_checked():
    assert set(FEEDS_BUILD) == {"max_code_bytes_per_launch", "ring_stages", "ring_stage_bytes", "evict_first_pays",
                                "poll_backoff_ns", "sentinel_pays", "spin_bound_ns", "pdl_pays"}
    # every one is something megakernel/plans.py reads
    import inspect

    import megakernel.plans as p

    src = inspect.getsource(p)
    assert all(f'"{n}"' in src for n in FEEDS_BUILD)


def test_the_old_ring_rule_flipped_between_the_two_committed_machines():
    """weights.ring on 2026-11-29: the quick grid (one machine) recorded 2 x 32 KiB, the full grid
    (another) 3 x 16 KiB. The current rule gives 2 x 32 KiB from both."""
    import shutil
    import tempfile

    two = [ROOT / "weights" / n for n in ("weights.ring-20261129T115546Z-nvidia-h200-fe6e526.json",
                                          "weights.ring-20261129T144453Z-nvidia-h200-54c0fed.json")]
    if not all(f.is_file() for f in two):
        pytest.skip("the two committed weights.ring runs of 2026-11-29 are not in this checkout")
    with tempfile.TemporaryDirectory() as td:  # those two runs alone: later machines recorded the new rule's ring
        (Path(td) / "weights").mkdir()
        for f in two:
            shutil.copy(f, Path(td) / "weights" / f.name)
        recorded = stability.check("ring_stage_bytes", Path(td), GPU, {}, recorded=True)
        now = stability.check("ring_stage_bytes", Path(td), GPU, {})
    assert recorded.status == "flips" and {r.value for r in recorded.runs} == {32768.0, 16384.0}
    assert now.status == "agree" and {r.value for r in now.runs} == {32768.0} and all(r.rederived for r in now.runs)


def _run(v, spread, machine="a", rule="r", date="2026-12-01T00:00:00Z"):
    return stability.Run(machine, date, "f", "abc", True, v, spread, False, rule)


def test_agreement_is_equal_values_or_overlapping_spreads():
    assert stability.agree(_run(2, (2, 2)), _run(2, (2, 2)))
    assert not stability.agree(_run(2, (2, 2)), _run(3, (3, 3)))
    assert stability.agree(_run(40, (40, 48)), _run(44, (44, 48)))  # brackets of one plateau end
    assert not stability.agree(_run(2, (2, 2)), _run(40, (40, 48)))  # 2 MiB vs 40 MiB
    assert stability.agree(_run(1.0, None), _run(1.0, None))
    assert not stability.agree(_run(0.0, None), _run(1.0, None))
    # a spread that misses its own value still counts the value
    assert stability.agree(_run(5, (6, 7)), _run(5, None))


def test_runs_under_an_older_rule_are_not_compared():
    cur, old = stability.current_rule_runs([_run(6787000, (6573000, 6938000), "a", rule="old", date="2026-11-29"),
                                            _run(10_000_000, (1e7, 1e7), "b", rule="new"),
                                            _run(10_000_000, (1e7, 1e7), "c", rule="new")])
    assert [r.machine for r in cur] == ["b", "c"] and [r.machine for r in old] == ["a"]


def test_check_on_synthetic_runs_of_two_machines(tmp_path):
    from megabench_synth import class_results, env, save_all

    def on(uuid, date, overrides=None):
        rs = class_results(date=date, overrides=overrides)
        return [dataclasses.replace(r, env=dataclasses.replace(env(date=date), gpu_uuid=uuid)) for r in rs]

    save_all(on("gpu-a", "2026-12-01T00:00:00Z"), tmp_path)
    save_all(on("gpu-b", "2026-12-01T01:00:00Z"), tmp_path)
    for v in stability.table(tmp_path, GPU, {}):
        assert v.status == "agree" and len(v.runs) == 2, v.describe()
    # one machine's ring differs beyond its spread: flagged
    save_all(on("gpu-b", "2026-12-01T02:00:00Z", {"ring_stages": 99}), tmp_path)
    v = stability.check("ring_stages", tmp_path, GPU, {})
    assert v.status == "flips" and {r.value for r in v.runs} == {3.0, 99.0}
    assert stability.check("ring_stages", tmp_path, GPU, {"ring_stages": object()}).status == "pinned"
    assert {s.name for s in SPECS if s.feeds_build} == set(FEEDS_BUILD)

"""GPU checks of the gate: the injected slowdown (mb/inject.cuh) slows a kernel by about its ppm and
keeps its output; an in-run A/B of this tree against itself built with a 5% injection finds the
regression, and against itself as built finds none. About a minute on an H200 (a megakernel
build with the hook, the small preset's weights)."""
from __future__ import annotations

import json

import pytest

from microbench.compiler import INJECT_ENV
from microbench.gate import EXIT_OK, EXIT_REGRESSION
from microbench.results import REPO_ROOT

pytestmark = pytest.mark.gpu
MiB = 1 << 20
CASES = ["--classes", "basics,megakernel", "-k", "mb_copy_v4-1024MiB or small-16-512-mega", "--rounds", "10"]


def test_injected_copy_is_slower_by_its_ppm_and_still_correct(harness, monkeypatch):
    from microbench.basics.bench import copy_case
    from microbench.harness import run_case

    monkeypatch.delenv(INJECT_ENV, raising=False)
    base = run_case(harness, copy_case(256 * MiB)).summary.median
    monkeypatch.setenv(INJECT_ENV, "100000")  # 10% of each launch
    slow = run_case(harness, copy_case(256 * MiB)).summary.median  # prepare() checks the copy bit-exact
    assert 1.06 < slow / base < 1.14, (base, slow)


def test_in_run_ab_catches_an_injected_5pct(tmp_path):
    from reports.cli import main

    js = tmp_path / "ab.json"
    code = main(["gate", "--ab-tree", str(REPO_ROOT), "--inject-ppm", "50000", *CASES, "--json", str(js)])
    d = json.loads(js.read_text())
    got = {v["key"].split("::")[1]: v for v in d["verdicts"]}
    assert code == EXIT_REGRESSION and len(got) == 2, d["summary"]
    for name, v in got.items():
        assert v["verdict"] == "regression" and 0.03 < v["slowdown"] < 0.08, (name, v)


def test_in_run_aa_finds_nothing(tmp_path):
    from reports.cli import main

    js = tmp_path / "aa.json"
    code = main(["gate", "--ab-tree", str(REPO_ROOT), *CASES, "--json", str(js)])
    d = json.loads(js.read_text())
    assert code == EXIT_OK, d["summary"]
    assert all(abs(v["slowdown"]) < 0.03 for v in d["verdicts"])

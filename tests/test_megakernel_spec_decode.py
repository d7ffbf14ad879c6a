"""Speculative decoding on the device against plain greedy decoding, in the host emulation: tiny, 64
tokens, mega and chain, the random and adversarial schedules, from poisoned buffers (NaN scratch and
caches, wrong row inputs): the speculative run's tokens equal the plain T=1 megakernel run's, and
every committed KV row is that run's row (within the router near-tie bound, far below another
node's row). A mutated kernel whose compaction skips one accepted token must fail that check. And
`megabench decode --check`, at B = 1 and B = 4. Each run takes tens of seconds on a CPU: slow (CI
runs them)."""
from __future__ import annotations


import pytest

from megakernel import ab, speculative
from megakernel.decode import KV_ROW_TOL
from megakernel_cases import mutated_csrc, spec_decode, spec_setup

pytestmark = pytest.mark.slow

N = 64
STUDY = speculative.agreement("study", "tiny")
# the compaction of path row 2 skipped (ops/compact.cuh): the row at ctx + 2 keeps the tree's node 2
# (the depth-1 sibling), whenever a step accepts 3 tokens or more down the main chain
SKIP_ONE = ("ops/compact.cuh", "      const bool moved = src != i;", "      const bool moved = src != i && i != 2;")


@pytest.fixture(scope="module")
def setup():
    return spec_setup(N, prompt_seed=0)


def _decode(setup, mode, schedule, n=N, seed=3):
    return spec_decode(setup, mode, schedule, n, seed=seed)[1]


@pytest.mark.parametrize("mode,schedule", [("mega", "random"), ("mega", "last"), ("mega", "block"),
                                           ("chain", "random")])
def test_speculative_decoding_is_plain_greedy_decoding(setup, mode, schedule):
    out = _decode(setup, mode, schedule)
    c = out.check
    assert c.ok, c.problems
    assert all(c.tokens_equal) and len(out.read.tokens[0]) == N
    assert c.kv_rel_err <= KV_ROW_TOL and c.kv_rows > 2 * N
    rep = out.report
    # the acceptance the device counted: whole steps, both short and long paths on tiny's 'study' pair
    assert sum(rep.histogram) == len(out.stats.steps) and sum(rep.lengths) == out.read.emitted[0] >= N
    assert min(rep.lengths) < max(rep.lengths) <= 13


def test_the_check_fails_when_compaction_skips_an_accepted_token(setup, tmp_path):
    with ab.kernel_tree(mutated_csrc(tmp_path, *SKIP_ONE)):
        out = _decode(setup, "mega", "random", n=32)
    assert not out.check.ok
    assert out.check.kv_rel_err > 1.0  # another node's K/V at ctx + 2: not a near-tie


def test_decode_command_checks_against_plain_greedy(capsys):
    """`megabench decode --preset tiny --tokens 64 --check` in the emulation: the check passes and
    the acceptance, its histogram and the step's split are printed."""
    from microbench.device import no_gpu_reason

    from reports.cli import main

    if not no_gpu_reason():
        pytest.skip("a GPU is present: the command runs there, not in the emulation")
    assert main(["decode", "--preset", "tiny", "--tokens", "64", "--check"]) == 0
    out = capsys.readouterr().out
    for what in ("acceptance 'study' on tiny: agree 0.87 (measured on tiny", "host emulation", "accepted tokens/s",
                 "mean acceptance", "histogram", "acceptance rate by depth", "step split", "check: passed",
                 "saved "):
        assert what in out, what


def test_decode_command_checks_a_batch_of_four(capsys):
    """`megabench decode --preset tiny --batch 4 --tokens 32 --check`: four requests of a 4-token tree
    each, each with its own acceptance, every one equal to its plain greedy run."""
    from microbench.device import no_gpu_reason

    from reports.cli import main

    if not no_gpu_reason():
        pytest.skip("a GPU is present: the command runs there, not in the emulation")
    assert main(["decode", "--preset", "tiny", "--batch", "4", "--tokens", "32", "--check"]) == 0
    out = capsys.readouterr().out
    assert "4 request(s) of a 4-token tree" in out and "check: passed" in out
    assert sum(f"request {r}: 32 tokens" in out for r in range(4)) == 4

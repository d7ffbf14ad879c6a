"""Speculative decoding with the verifier as tensor-parallel ranks, in the host emulation: tiny at
R = 2 (its two kv heads, one a rank), the drafter once and unsharded, every rank running the verify
spec program on its own copy of the speculative state and its kv heads of the cache. From poisoned
buffers, in mega and chain mode, under the random schedule and the "rank" one (one rank starved for
whole launches), the run's tokens equal plain greedy decoding by the unsharded build (the same TP
build at R = 1, T=1 steps), every committed KV row is that run's, and every rank's speculative state
is rank 0's. Mutated kernels where only rank 1 skips a compaction or accepts a token fewer must fail
that check. And `megabench decode --preset tiny --ranks 2 --check`, and where the command runs its
ranks. Each run takes tens of seconds on a CPU: slow (CI runs them)."""
from __future__ import annotations

import shutil

import pytest
import torch

from megakernel import abi, ab, speculative
from megakernel.build import CSRC
from megakernel.config import ConfigError, preset
from megakernel.decode import KV_ROW_TOL, SpecPair, decode, plain_run
from megakernel.draft import DraftConfig, draft_model_config
from megakernel.plan import make_plan
from megakernel.ranks import RankEngine
from megakernel.reference import KVCache
from megakernel.weights import generate

SLOW = pytest.mark.slow

N = 32
R = 2
STUDY = speculative.agreement("study", "tiny")
BOUND_NS = 60_000_000_000  # a starved rank ("rank" schedule) waits through the others' whole launch
# rank 1 alone skips the compaction of path row 2 (ops/compact.cuh): its kv head's row at ctx + 2
# keeps the tree's node 2 (the depth-1 sibling) whenever a step accepts 3 tokens or more down the
# main chain; rank 0's rows are right, so every rank's state stays equal, but the KV check fails
SKIP_ON_RANK1 = ("ops/compact.cuh", "      const bool moved = src != i;",
                 "      const bool moved = src != i && !(p.rank == 1 && i == 2);")
# rank 1's accept records a path one node shorter than the one it walked (ops/accept.cuh)
SHORT_ON_RANK1 = ("ops/accept.cuh", "    st[SPEC_LEN] = active ? len : 0;",
                  "    st[SPEC_LEN] = active ? (p.rank == 1 && len > 2 ? len - 1 : len) : 0;")


@pytest.fixture(scope="module")
def setup():
    """tiny's weights, the R = 2 TP plan, the drafter's plan, a random prompt and the unsharded
    build's plain greedy run of N tokens from its prefill (shared by the runs: the same prefill)."""
    cfg = preset("tiny")
    w = generate(cfg)
    plan = make_plan(cfg, 4, tp_ranks=R, launch_ranks=R, spin_bound_ns=BOUND_NS)
    dplan = make_plan(draft_model_config(cfg, DraftConfig(agree=STUDY)), 4, spin_bound_ns=3_000_000_000)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab, (8,), generator=g).tolist()]
    pair = SpecPair(w, plan, dplan, [KVCache(cfg)], agree=STUDY, backend="emu", ranks=R)
    pair.poison()
    ctx = pair.prefill(prompts)
    plain = plain_run(pair, prompts, N, ctx, [c.clone() for c in pair.caches])
    return cfg, w, plan, dplan, prompts, plain


def _decode(setup, mode, schedule, n=N, seed=3):
    cfg, w, plan, dplan, prompts, plain = setup
    pair = SpecPair(w, plan, dplan, [KVCache(cfg)], agree=STUDY, backend="emu", emu_schedule=schedule,
                    emu_seed=seed, ranks=R)
    return pair, decode(pair, prompts, n, mode, check=True, poison=True, plain=plain)


@SLOW
@pytest.mark.parametrize("mode,schedule", [("mega", "random"), ("mega", "rank"), ("chain", "random"),
                                           ("chain", "rank")])
def test_tp_speculative_decoding_is_plain_greedy_decoding(setup, mode, schedule):
    pair, out = _decode(setup, mode, schedule)
    c = out.check
    assert c.ok, c.problems
    assert all(c.tokens_equal) and out.read.tokens[0] == out.plain.tokens[0][:N] and len(out.read.tokens[0]) == N
    assert c.kv_rel_err <= KV_ROW_TOL and c.kv_rows > 2 * N
    # every rank's copy of the state is rank 0's, bit for bit, and holds the emitted tokens
    o = abi.spec_offsets()
    for k in range(1, R):
        assert torch.equal(pair.states[k], pair.states[0]), k
        assert pair.states[k] is not pair.states[0]
    assert pair.states[1][0, o["out"]:o["out"] + N].tolist() == out.read.tokens[0]
    # a path off the main chain was accepted (compaction moved rows), and more than one step ran
    assert len(out.stats.steps) > 1 and min(out.report.lengths) < max(out.report.lengths)


def _mutated(setup, tmp_path, edit):
    rel, old, new = edit
    d = tmp_path / "csrc"
    shutil.copytree(CSRC, d)
    f = d / rel
    assert f.read_text().count(old) == 1, f"{rel} no longer has {old!r} once"
    f.write_text(f.read_text().replace(old, new))
    with ab.kernel_tree(d):
        return _decode(setup, "mega", "random")


@SLOW
def test_the_check_fails_when_one_rank_skips_a_compaction(setup, tmp_path):
    pair, out = _mutated(setup, tmp_path, SKIP_ON_RANK1)
    assert not out.check.ok
    assert out.check.kv_rel_err > KV_ROW_TOL  # rank 1's kv head holds another node's K/V at ctx + 2


@SLOW
def test_the_check_fails_when_one_rank_accepts_a_different_count(setup, tmp_path):
    pair, out = _mutated(setup, tmp_path, SHORT_ON_RANK1)
    assert not out.check.ok
    assert any(p.startswith("rank 1's speculative state differs from rank 0's: len") for p in out.check.problems), \
        out.check.problems


@SLOW
def test_a_pair_of_ranks_refuses_a_plan_that_is_not_theirs(setup):
    cfg, w, plan, dplan, prompts, plain = setup
    with pytest.raises(ConfigError, match="TP build of 2 ranks in one launch"):
        SpecPair(w, make_plan(cfg, 4), dplan, [KVCache(cfg)], agree=STUDY, backend="emu", ranks=2)
    with pytest.raises(ConfigError, match="pass ranks= to match"):
        SpecPair(w, plan, dplan, [KVCache(cfg)], agree=STUDY, backend="emu")
    with pytest.raises(ConfigError, match="one SpecLink"):
        RankEngine(w, plan, KVCache(cfg), backend="emu", spec=[])


@SLOW
def test_decode_command_runs_two_ranks_with_its_check(capsys):
    """`megabench decode --preset tiny --ranks 2 --tokens 32 --check` in the emulation: it says where
    the ranks run, and the check against plain greedy decoding and across the ranks passes."""
    from microbench.device import no_gpu_reason
    from microbench.results import load

    from reports.cli import main

    if not no_gpu_reason():
        pytest.skip("a GPU is present: the command runs there, not in the emulation")
    assert main(["decode", "--preset", "tiny", "--ranks", "2", "--tokens", "32", "--check"]) == 0
    out = capsys.readouterr().out
    for what in ("2 tensor-parallel ranks of the verifier: the CPU emulation", "the drafter runs once, unsharded",
                 "the verifier 2 ranks", "of the unsharded build (R = 1)", "tokens equal",
                 "check across ranks: every rank's speculative state", "equal to rank 0's", "check: passed", "saved "):
        assert what in out, what
    saved = out.split("saved ")[-1].split()[0]
    res = load(saved)
    s = res.series[0]
    assert s.params["ranks"] == 2 and s.name.endswith("/R2") and s.metrics["check"] == "passed"
    assert any("2 tensor-parallel ranks" in n for n in res.notes)


@pytest.mark.parametrize("forced", [True, False])
def test_decode_command_never_starts_torchrun(monkeypatch, capsys, forced):
    """On a node of 2 GPUs where_ranks picks torchrun for 2 ranks, which the decode loop does not
    build: forced (--where torchrun) it is refused naming what is not built; picked, the command
    says so and runs the ranks on one GPU (here the run stops at the GPU-only weights, which this
    test replaces by a refusal of its own)."""
    from megakernel import cli as mk_cli, ranks

    from reports.cli import main

    monkeypatch.setattr(ranks, "no_gpu_reason", lambda: None)
    monkeypatch.setattr(ranks, "gpu_count", lambda: 2)
    monkeypatch.setattr(mk_cli, "no_gpu_reason", lambda: None)

    def no_gpu_weights(*a, **k):
        raise ConfigError("stopped before the GPU: the test's refusal")

    monkeypatch.setattr("megakernel.bench_baselines.weights_for", no_gpu_weights)
    argv = ["decode", "--preset", "tiny", "--ranks", "2"] + (["--where", "torchrun"] if forced else [])
    if forced:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "torchrun, one process per GPU) is not built for the decode loop" in err and "--where gpu" in err
        return
    assert main(argv) != 0
    cap = capsys.readouterr()
    assert "the test's refusal" in cap.err and "is not built for the decode loop" in cap.err and "running them on one GPU instead" in cap.err
    assert "2 tensor-parallel ranks of the verifier: one GPU" in cap.out

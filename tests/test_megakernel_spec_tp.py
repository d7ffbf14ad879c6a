"""Speculative decoding with the verifier as tensor-parallel ranks, in the host emulation: tiny at
R = 2 (its two kv heads, one a rank), the drafter once and unsharded, every rank running the verify
spec program on its own copy of the speculative state and its kv heads of the cache. From poisoned
buffers, in mega and chain mode, under the random schedule and the "rank" one (one rank starved for
whole launches), the run's tokens equal plain greedy decoding by the unsharded build (the same TP
build at R = 1, T=1 steps), every committed KV row is that run's, and every rank's speculative state
is rank 0's. Mutated kernels where only rank 1 skips a compaction or accepts a token fewer must fail
that check. And `megabench decode --preset tiny --ranks 2 --check`, and where the command runs its
ranks. Each run takes tens of seconds on a CPU: slow (CI runs them). One process per GPU (torchrun): what
each rank builds, rank 0's gather check (with mutations), the command line and exit codes, here on
the CPU with synthetic data and torchrun replaced; its run is tests/gpu/'s."""
from __future__ import annotations

import copy

import pytest
import torch

from microbench.errors import MegabenchError

from megakernel import abi, ab, speculative
from megakernel.config import ConfigError, preset
from megakernel.decode import KV_ROW_TOL, SpecPair
from megakernel.draft import DraftConfig, draft_model_config
from megakernel.plan import make_plan
from megakernel.ranks import RankEngine
from megakernel.reference import KVCache
from megakernel.weights import generate
from megakernel_cases import mutated_csrc, spec_decode, spec_setup

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
    return spec_setup(N, prompt_seed=1, ranks=R, bound_ns=BOUND_NS)


def _decode(setup, mode, schedule, n=N, seed=3):
    return spec_decode(setup, mode, schedule, n, seed=seed, ranks=R)


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
    with ab.kernel_tree(mutated_csrc(tmp_path, *edit)):
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


# ---------------------------------------------------------------------- one process per GPU (torchrun)
# What runs only on R GPUs (the processes, their peer memory) is in tests/gpu/; here, on the CPU,
# with synthetic data: what each rank builds, rank 0's gather check, and the command line and exit
# codes of the torchrun run, through `megabench decode --ranks R` with torchrun replaced by a fake.
def test_each_process_builds_its_own_rank():
    """rank_role: rank k of R writes kv heads [k*h, (k+1)*h) (together every head once), only rank
    0 gathers, and only rank 0 with a check builds the unsharded reference; rank_plans: the
    verifier a TP build of R ranks, one a launch, the drafter unsharded."""
    from megakernel.decode import rank_plans
    from megakernel.ranks import rank_role

    cfg = preset("tinytp")
    for r in (2, 4, 8):
        for check in (False, True):
            roles = [rank_role(cfg, k, r, (k + 3) % r, check=check) for k in range(r)]
            heads = [h for x in roles for h in x.kv_heads]
            assert heads == list(range(cfg.n_kv_heads)), (r, heads)
            assert [x.gathers for x in roles] == [True] + [False] * (r - 1)
            assert [x.unsharded for x in roles] == [check] + [False] * (r - 1)
            assert [x.device for x in roles] == [(k + 3) % r for k in range(r)] and {x.ranks for x in roles} == {r}
    with pytest.raises(ConfigError, match="does not shard over 4 ranks: 2 kv heads"):
        rank_role(preset("tiny"), 0, 4, 0, check=False)
    with pytest.raises(ConfigError, match="2 or more"):
        rank_role(cfg, 0, 1, 0, check=False)
    with pytest.raises(ConfigError, match="rank 2 .* outside a world of 2"):
        rank_role(cfg, 2, 2, 0, check=False)
    plan, dplan = rank_plans("tiny", STUDY, 2, n_sm=132)
    assert (plan.tp_ranks, plan.launch_ranks, plan.n_sm) == (2, 1, 132)
    assert dplan.tp_ranks == 0 and dplan.launch_ranks == 1
    assert dplan.cfg == draft_model_config(preset("tiny"), DraftConfig(agree=STUDY))


def test_a_pair_of_one_process_refuses_a_plan_of_one_launch():
    from megakernel.runtime import RankLink

    cfg = preset("tiny")
    w = generate(cfg)
    dplan = make_plan(draft_model_config(cfg, DraftConfig(agree=STUDY)), 4)
    for plan in (make_plan(cfg, 4, tp_ranks=2, launch_ranks=2), make_plan(cfg, 4)):
        with pytest.raises(ConfigError, match="one a launch"):
            SpecPair(w, plan, dplan, [KVCache(cfg)], agree=STUDY, backend="emu", ranks=2, link=RankLink(0, None))
    with pytest.raises(ConfigError, match="link: rank 3"):
        SpecPair(w, make_plan(cfg, 4, tp_ranks=2), dplan, [KVCache(cfg)], agree=STUDY, backend="emu", ranks=2,
                 link=RankLink(3, None))


class _RankPair:
    """What decode.rank_record reads of a SpecPair of one process's rank: its link's rank, its
    caches (the model's, this rank's kv heads written), its state and step contexts."""

    def __init__(self, cfg, rank, ranks, caches, state, ctx):
        from megakernel.runtime import RankLink

        self.cfg, self.ranks, self.caches, self.link = cfg, ranks, caches, RankLink(rank, None)
        self._state, self._ctx = state, ctx

    def rank_records(self):
        from megakernel.decode import CONTEXTS, STATE
        from megakernel.ranks import RankRecord

        return [RankRecord(self.link.rank, None, {STATE: self._state.clone(), CONTEXTS: self._ctx.clone()})]


def _gathered(ranks=4, batch=2, seed=0):
    """Every rank's record of one run as rank 0 gathers it: the same random state, contexts and
    tokens on every rank (their copies), each rank's own random KV caches (only its heads sent)."""
    from megakernel.decode import SpecRead, rank_record

    cfg = preset("tinytp")
    g = torch.Generator().manual_seed(seed)
    state = torch.randint(-2**31, 2**31 - 1, (batch, abi.SPEC_INTS), generator=g, dtype=torch.int32)
    ctx = torch.randint(0, 1000, (batch,), generator=g, dtype=torch.int32)
    toks = [torch.randint(0, cfg.vocab, (20,), generator=g).tolist() for _ in range(batch)]
    got = SpecRead(toks, [20] * batch, [[0] * 17] * batch, [50] * batch)
    caches = [[KVCache(cfg).fill_random(torch.Generator().manual_seed(100 * seed + 10 * k + r)) for r in range(batch)]
              for k in range(ranks)]
    # each rank's own copies, as the gather pickles them
    recs = [copy.deepcopy(rank_record(_RankPair(cfg, k, ranks, caches[k], state, ctx), got, None, kv=True))
            for k in range(ranks)]
    return cfg, recs, caches


def test_rank_zero_gathers_equal_ranks_and_assembles_their_kv_heads():
    from megakernel.decode import assemble_kv, gathered_problems

    cfg, recs, caches = _gathered()
    assert gathered_problems(recs, 4) == []  # the kv heads differ (each rank's own): not compared
    out = [KVCache(cfg) for _ in range(2)]
    for c in out:
        for t in c.k + c.v:
            t.fill_(float("nan"))
    assemble_kv(out, recs, 4)
    h = cfg.n_kv_heads // 4
    for k in range(4):
        for mine, theirs in zip(out, caches[k]):
            for a, b in zip(mine.k + mine.v, theirs.k + theirs.v):
                assert torch.equal(a[k * h:(k + 1) * h], b[k * h:(k + 1) * h])
    assert all(not t.isnan().any() for c in out for t in c.k + c.v)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_gather_check_fails_where_one_rank_differs(seed):
    """Mutations of one rank's record: a word of its speculative state (a random field and
    request), one emitted token, one step context, its error, a rank missing or twice: each named."""
    from megakernel.decode import CONTEXTS, STATE, TOKENS, gathered_problems
    from megakernel.ranks import RankRecord

    rng = torch.Generator().manual_seed(seed)
    o = abi.spec_offsets()
    names = [n for n, _ in abi.SPEC_FIELDS]
    name = names[int(torch.randint(0, len(names), (1,), generator=rng))]
    width = dict(abi.SPEC_FIELDS)[name]
    k = 1 + int(torch.randint(0, 3, (1,), generator=rng))
    r = int(torch.randint(0, 2, (1,), generator=rng))
    col = o[name] + int(torch.randint(0, width, (1,), generator=rng))

    cfg, recs, _ = _gathered(seed=seed)
    recs[k].data[STATE][r, col] ^= 1 << int(torch.randint(0, 31, (1,), generator=rng))
    bad = gathered_problems(recs, 4)
    assert len(bad) == 1 and bad[0].startswith(f"rank {k}'s {STATE} differs from rank 0's: {name} of request {r} "), bad
    other = names[(names.index(name) + 1) % len(names)]  # a second field: a problem of its own
    recs[k].data[STATE][1 - r, o[other]] += 1
    bad = gathered_problems(recs, 4)
    assert sorted(p.split(": ")[1].split(" of request")[0] for p in bad) == sorted([name, other]), bad

    cfg, recs, _ = _gathered(seed=seed)
    recs[k].data[TOKENS][r][7] += 1
    bad = gathered_problems(recs, 4)
    assert bad == [f"rank {k}'s {TOKENS} differs from rank 0's: entry {r}: entry 7: {recs[k].data[TOKENS][r][7]} "
                   f"against {recs[0].data[TOKENS][r][7]}"], bad

    cfg, recs, _ = _gathered(seed=seed)
    recs[k].data[CONTEXTS][r] += 1
    assert [p.split(":")[0] for p in gathered_problems(recs, 4)] == [f"rank {k}'s {CONTEXTS} differs from rank 0's"]

    cfg, recs, _ = _gathered(seed=seed)
    recs[k] = RankRecord(k, "megakernel: rank 1 gave up waiting", {})
    assert gathered_problems(recs, 4) == [f"rank {k}: megakernel: rank 1 gave up waiting"]
    assert any("missing [3]" in p for p in gathered_problems(recs[:3], 4))
    assert any("twice [2]" in p for p in gathered_problems(recs[:2] + [recs[2], recs[2]], 4))
    cfg, recs, _ = _gathered(seed=seed)
    del recs[k].data[CONTEXTS]
    assert gathered_problems(recs, 4) == [f"rank {k} sent no {CONTEXTS}"]


def test_torchrun_exit_codes_and_summaries():
    from megakernel.ranks import torchrun_outcome

    ok = {"error": None, "tokens": [[1, 2]]}
    assert torchrun_outcome(0, ok, 2, "decode") is ok
    with pytest.raises(MegabenchError, match="exit code 3 and no summary from rank 0"):
        torchrun_outcome(3, None, 2, "decode")
    with pytest.raises(MegabenchError, match="decode across 2 GPUs .torchrun.: rank 1: gave up"):
        torchrun_outcome(0, {"error": "rank 1: gave up"}, 2, "decode")
    with pytest.raises(MegabenchError, match="wrote its summary but torchrun ended with exit code 1"):
        torchrun_outcome(1, ok, 2, "decode")


def _outcome(n=32, seed=0, check_problems=None):
    """A synthetic outcome of a decode run of n tokens on tiny (random tokens, histogram, times)."""
    from megakernel.decode import DecodeCheck, DecodeOutcome, RunStats, SpecRead, StepTimes

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 17, (6,), generator=g).tolist()
    hist = [0] * 17
    for a in lens:
        hist[a] += 1
    toks = torch.randint(0, 512, (n,), generator=g).tolist()
    read = SpecRead([toks], [sum(lens)], [hist], [7 + sum(lens)])
    t = torch.rand(6, 4, generator=g).tolist()
    stats = RunStats([StepTimes(a, b, c, a + b + c + d) for a, b, c, d in t], [6], "cuda_event")
    check = None if check_problems is None else DecodeCheck([not check_problems], [None], 0.01, "here", 100, 0,
                                                            list(check_problems))
    return DecodeOutcome(read, stats, speculative.summarise(read.lengths(), 0.5, 1, 16, 3), check)


def test_rank_zero_summary_says_what_failed():
    from microbench.results import Env, Result

    from megakernel.decode import rank0_summary

    kw = dict(preset="tiny", batch=1, mode="mega", agree=STUDY, acceptance="study", acceptance_source="src",
              prompt_len=8, n=32, ranks=2, launches=(5, 3, 1), env=Env.capture())
    s = rank0_summary(_outcome(check_problems=[]), [], **kw)
    assert s["error"] is None and s["check"] == "passed" and s["lines"][0].startswith("accepted tokens/s:")
    res = Result.from_json(s["result"])
    p = res.series[0].params
    assert (p["ranks"], p["where"], p["backend"]) == (2, "torchrun", "gpu") and res.series[0].name.endswith("/R2")
    assert any("a drafter in each process" in x for x in res.notes)
    s = rank0_summary(_outcome(check_problems=["rank 1's emitted tokens differs from rank 0's: entry 0"]),
                      ["rank 1's emitted tokens differs from rank 0's: entry 0"], **kw)
    assert s["check"] == "FAILED" and s["problems"] and s["error"] is None
    assert Result.from_json(s["result"]).series[0].metrics["check"] == "FAILED"
    s = rank0_summary(_outcome(), ["rank 1: gave up"], **kw)  # no check: ranks unlike rank 0 fail the run
    assert s["error"] == "rank 1: gave up" and s["result"] is None
    assert rank0_summary(None, [], **kw)["error"]


class _FakeTorchrun:
    """subprocess.run for torchrun: records the command and environment, parses the arguments with
    rank_main's parser and writes `summary(args)` where rank 0 would; exits `rc`."""

    def __init__(self, summary, rc=0):
        self.summary, self.rc, self.calls = summary, rc, []

    def __call__(self, cmd, env=None, timeout=None):
        from types import SimpleNamespace

        from microbench.atomic import write_json
        from megakernel.decode import rank_parser

        self.calls.append((cmd, env))
        i = cmd.index("-m", 2)
        a = rank_parser().parse_args(cmd[i + 2:])
        s = self.summary(a)
        if s is not None:
            write_json(a.summary, s)
        return SimpleNamespace(returncode=self.rc)


def _two_gpus(monkeypatch, tmp_path, n=2):
    from megakernel import cli as mk_cli, ranks

    monkeypatch.setattr(ranks, "no_gpu_reason", lambda: None)
    monkeypatch.setattr(ranks, "gpu_count", lambda: n)
    monkeypatch.setattr(mk_cli, "no_gpu_reason", lambda: None)
    monkeypatch.setenv("MEGABENCH_RESULTS", str(tmp_path / "results"))
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("forced", [True, False])
def test_decode_command_runs_its_ranks_under_torchrun(monkeypatch, capsys, tmp_path, forced):
    """On a node of 2 GPUs `megabench decode --ranks 2` (torchrun picked, or forced with --where)
    starts torchrun with one process per GPU, multicast off, rank_main's arguments for its
    settings; rank 0's lines, check and typed result come back, saved with ranks and where."""
    from microbench.results import Env, load

    from megakernel import ranks
    from megakernel.decode import rank0_summary

    from reports.cli import main

    _two_gpus(monkeypatch, tmp_path)
    seen = []

    def summary(a):
        seen.append(a)
        return rank0_summary(_outcome(n=a.tokens, check_problems=[] if a.check else None), [], preset=a.preset,
                             batch=a.batch, mode=a.mode, agree=a.agree, acceptance=a.acceptance,
                             acceptance_source=a.acceptance_source, prompt_len=a.prompt_len, n=a.tokens, ranks=2,
                             launches=(5, 3, 1), env=Env.capture())

    fake = _FakeTorchrun(summary)
    monkeypatch.setattr(ranks.subprocess, "run", fake)
    argv = ["decode", "--preset", "tiny", "--ranks", "2", "--tokens", "40", "--agree", "0.5", "--seed", "9",
            "--check"] + (["--where", "torchrun"] if forced else [])
    assert main(argv) == 0
    out = capsys.readouterr().out
    (cmd, env), = fake.calls
    assert cmd[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "megakernel.decode"]
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["NVSHMEM_DISABLE_NVLS"] == "1"
    a, = seen
    assert (a.preset, a.tokens, a.agree, a.seed, a.check, a.batch, a.mode) == ("tiny", 40, 0.5, 9, True, 1, "mega")
    for what in ("2 tensor-parallel ranks of the verifier: torchrun, one process per GPU", "a drafter in each process",
                 "accepted tokens/s:", "request 0: 40 tokens", "check: passed", "saved "):
        assert what in out, (what, out)
    res = load(out.split("saved ")[-1].split()[0])
    assert res.series[0].params["where"] == "torchrun" and res.series[0].params["ranks"] == 2
    assert str(tmp_path) in out


def test_decode_command_under_torchrun_fails_as_its_ranks_did(monkeypatch, capsys, tmp_path):
    """A failed check comes back as exit 1 with its mismatches; a rank's error, a process that
    failed after the summary, no summary: exit 2 naming it; too few GPUs for --where torchrun: 2."""
    from microbench.results import Env

    from megakernel import ranks
    from megakernel.decode import rank0_summary

    from reports.cli import main

    _two_gpus(monkeypatch, tmp_path)
    bad = "rank 1's speculative state differs from rank 0's: len of request 0 ([4] against [5])"

    def summary(a, problems=(bad,), check=True):
        return rank0_summary(_outcome(n=a.tokens, check_problems=list(problems) if check else None), list(problems),
                             preset=a.preset, batch=a.batch, mode=a.mode, agree=a.agree, acceptance=a.acceptance,
                             acceptance_source=a.acceptance_source, prompt_len=a.prompt_len, n=a.tokens, ranks=2,
                             launches=(5, 3, 1), env=Env.capture())

    argv = ["decode", "--preset", "tiny", "--ranks", "2", "--tokens", "32"]
    monkeypatch.setattr(ranks.subprocess, "run", _FakeTorchrun(summary))
    assert main(argv + ["--check"]) == 1
    out = capsys.readouterr().out
    assert f"MISMATCH: {bad}" in out and "check: FAILED (1 mismatches)" in out
    monkeypatch.setattr(ranks.subprocess, "run", _FakeTorchrun(lambda a: summary(a, ("rank 1: gave up",), False)))
    assert main(argv) == 2
    assert "decode across 2 GPUs (torchrun): rank 1: gave up" in capsys.readouterr().err
    monkeypatch.setattr(ranks.subprocess, "run", _FakeTorchrun(lambda a: summary(a, (), False), rc=1))
    assert main(argv) == 2
    assert "wrote its summary but torchrun ended with exit code 1" in capsys.readouterr().err
    monkeypatch.setattr(ranks.subprocess, "run", _FakeTorchrun(lambda a: None, rc=-9))
    assert main(argv) == 2
    assert "exit code -9 and no summary from rank 0" in capsys.readouterr().err
    monkeypatch.setattr(ranks, "gpu_count", lambda: 1)
    assert main(argv + ["--where", "torchrun"]) == 2
    assert "2 ranks need 2 GPUs, this node has 1" in capsys.readouterr().err

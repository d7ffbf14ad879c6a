"""Ranks of the megakernel in the CPU emulation (megakernel/ranks.py): several ranks in one launch,
each with its own parameter block and rank-local block indices, and tensor parallelism over them
(the tinytp preset): every R, N-sharded or expert-parallel, gives the bits of R = 1, which agrees
with the reference; mutations of the collectives fail the checks or trip named bounded waits; the
profiled step's collective waits, where the ranks run, and the step command."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from megakernel import ab
from megakernel.config import ConfigError, preset
from megakernel.plan import OP, make_plan, max_tp_ranks
from megakernel.program import DEP_ALL
from megakernel.ranks import COLLECTIVES, RankEngine, collective_waits, skews, stalls, tp_waits_result
from megakernel.reference import KVCache, Request
from megakernel.runtime import Engine, check_close
from megakernel.weights import generate
from microbench.errors import CorrectnessError, SpinTimeoutError
from microbench.results import Env
from reports import build as report_build, cli as report_cli

from megakernel_cases import mutated_csrc, reference_logits, step_inputs, tiny


@pytest.mark.parametrize("ranks,mode,schedule", [(2, "mega", "random"), (2, "chain", "random"), (3, "mega", "rank"),
                                                 (2, "mega", "last")])
def test_ranks_of_one_launch_each_run_their_own_step(tiny, ranks, mode, schedule):
    """R copies of the unsharded model in one emulated launch (Plan.launch_ranks, no tensor
    parallelism), each on its own KV cache from poisoned buffers: every rank's logits, tokens and
    cache are bitwise those of one rank alone, so each block found its rank's parameter block and
    its rank-local index and count (the "rank" schedule starves one rank for the whole launch)."""
    cfg, w, base, _ = tiny
    toks, par = step_inputs(cfg, 8, 2)
    ref_cache = base.clone()
    ref = Engine(w, make_plan(cfg, 4), ref_cache, backend="emu", grid=2).step(toks, par, 40, mode=mode)
    caches = [base.clone() for _ in range(ranks)]
    eng = RankEngine(w, make_plan(cfg, 4, launch_ranks=ranks), caches, backend="emu", grid=2, emu_schedule=schedule)
    eng.poison()
    eng.step(toks, par, 40, mode=mode)
    for k, out in enumerate(eng.rank_outputs()):
        assert torch.equal(out.logits, ref.logits) and torch.equal(out.tokens, ref.tokens), k
        assert caches[k].equal(ref_cache), k


def test_a_rank_that_can_never_finish_trips_a_wait_naming_its_rank(tiny):
    """Rank 1's last op made to wait for itself (its own program table): its bounded wait gives
    up, the launch ends (rank 0 finishes), and the error names rank 1, the op and the dependency."""
    cfg, w, base, _ = tiny
    plan = make_plan(cfg, 4, spin_bound_ns=300_000_000, launch_ranks=2)
    eng = RankEngine(w, plan, [base.clone(), base.clone()], backend="emu", grid=2)
    e1 = eng.engines[1]
    i = len(e1.program.ops) - 1
    enc = e1.program.encode().reshape(-1, 16)
    enc[i, 7] = 1
    enc[i, 8], enc[i, 9] = i, DEP_ALL
    e1.prog_t.copy_(torch.from_numpy(np.ascontiguousarray(enc.reshape(-1))))
    toks, par = step_inputs(cfg, 4, 1)
    with pytest.raises(SpinTimeoutError, match=r"rank 1 block [23] .*argmax\(L2\) \[op \d+\] dependency 0"):
        eng.step(toks, par, 10, mode="mega")


# ---------------------------------------------------------------- tensor parallelism
TP_BOUND_NS = 60_000_000_000  # a starved rank ("rank" schedule) waits through the others' whole launch


@pytest.fixture(scope="module")
def tinytp():
    """The tinytp preset (heads and expert widths shard over up to 8 ranks), its weights, a random
    KV cache, a T=8 step and the reference's logits and routing."""
    cfg = preset("tinytp")
    w = generate(cfg)
    base = KVCache(cfg).fill_random(torch.Generator().manual_seed(3))
    toks, par = step_inputs(cfg, 8, 2)
    ref, routes = reference_logits(w, base.clone(), toks, par, 40)
    return cfg, w, base, toks, par, ref, routes


def tp_run(tinytp, ranks, mode="mega", schedule="random", seed=1, bound_ns=TP_BOUND_NS, grid=2, **plan_kw):
    """One step of the TP build at `ranks` ranks in one emulated launch (`grid` blocks a rank), from
    poisoned buffers, the reference's routing forced: (rank 0's StepOut, the cache, the engine)."""
    cfg, w, base, toks, par, _, routes = tinytp
    plan = make_plan(cfg, 4, tp_ranks=ranks, launch_ranks=ranks, spin_bound_ns=bound_ns, **plan_kw)
    cache = base.clone()
    eng = RankEngine(w, plan, cache, backend="emu", grid=grid, emu_schedule=schedule, emu_seed=seed)
    eng.poison()
    return eng.step(toks, par, 40, mode=mode, routes=routes), cache, eng


@pytest.fixture(scope="module")
def tp_one(tinytp):
    """The unsharded result: R = 1 of the TP build (mega mode)."""
    out, cache, _ = tp_run(tinytp, 1)
    return out, cache


def assert_same_step(got, want, what):
    (g, gc, eng), (w, wc) = got, want
    for k, o in enumerate(eng.rank_outputs()):
        assert torch.equal(o.logits, w.logits) and torch.equal(o.tokens, w.tokens), f"{what}: rank {k}"
    assert gc.equal(wc), f"{what}: KV cache"
    eng.check_slots_empty()


def test_the_unsharded_tp_build_matches_the_reference(tinytp, tp_one):
    """R = 1 of the TP build (oproj's K groups summed in group order, its slots' encoding) is within
    the megakernel's tolerance of the torch reference, and leaves its receive slots empty."""
    *_, ref, _ = tinytp
    out, _ = tp_one
    check_close(out.logits, ref, "TP build, R = 1", rel=1e-2)
    assert torch.equal(out.tokens, ref.argmax(-1))


SLOW = pytest.mark.slow


# (ranks, mode, schedule, blocks a rank); the "rank" schedule starves one rank for whole launches
# (its waits then last the other ranks' work: TP_BOUND_NS), and costs most with more blocks
@pytest.mark.parametrize("ranks,mode,schedule,grid", [
    (1, "chain", "random", 2), (2, "mega", "random", 2), (2, "chain", "random", 2), (2, "mega", "rank", 1),
    (2, "mega", "last", 2), (4, "mega", "random", 2), (8, "chain", "random", 1),
    pytest.param(4, "mega", "block", 2, marks=SLOW), pytest.param(4, "mega", "rank", 2, marks=SLOW),
    pytest.param(4, "chain", "random", 2, marks=SLOW), pytest.param(8, "mega", "random", 2, marks=SLOW),
    pytest.param(8, "mega", "last", 2, marks=SLOW), pytest.param(8, "mega", "block", 2, marks=SLOW),
    pytest.param(8, "mega", "rank", 1, marks=SLOW)])
def test_tp_ranks_compute_the_bits_of_one_rank(tinytp, tp_one, ranks, mode, schedule, grid):
    """R ranks in one emulated launch, from poisoned buffers: every rank's logits and tokens, and
    the KV cache (each rank writes its kv heads), are bitwise those of R = 1; every receive slot is
    empty again afterwards (each reader reset what it read)."""
    assert_same_step(tp_run(tinytp, ranks, mode, schedule, grid=grid), tp_one, f"R={ranks} {mode} {schedule}")


def test_tp_plans_refuse_what_cannot_shard(tiny):
    cfg = tiny[0]
    with pytest.raises(ValueError, match="2 kv heads do not divide over 4 ranks"):
        make_plan(cfg, 4, tp_ranks=4)
    with pytest.raises(ValueError, match="split expert GEMMs"):
        make_plan(preset("tinytp"), 4, tp_ranks=2, fused_experts=True)
    with pytest.raises(ValueError, match="launches one rank"):
        make_plan(preset("tinytp"), 4, tp_ranks=4, launch_ranks=2)
    assert max_tp_ranks(preset("tinytp")) == 8 and max_tp_ranks(cfg) == 2


def kernel_with(tmp_path, rel: str, old: str, new: str):
    """A copy of the kernel's source tree with `old` replaced by `new` once in csrc/`rel`."""
    return mutated_csrc(tmp_path, rel, old, new)


def test_a_sentinel_never_reset_fails_the_check(tinytp, tmp_path):
    """Mutation: the all-reduce's reader no longer resets the partials it read. The step's slots
    are left written, and the check after the step (which every TP test runs) names the rank and
    the region; the same check passes on the repository's kernel (test_tp_ranks_compute_...)."""
    tree = kernel_with(tmp_path, "ops/tp_oproj.cuh",
                       "    for (int g = 0; g < TP_GROUPS; ++g) tp_store(slot[g], F32_EMPTY);  // this thread alone read them",
                       "")
    with ab.kernel_tree(tree):
        _, _, eng = tp_run(tinytp, 2, "chain")
    with pytest.raises(CorrectnessError, match=r"rank 0: ar \d+.*rank 1: ar \d+"):
        eng.check_slots_empty()


def test_a_gather_that_reads_the_idle_copy_trips_a_named_wait(tinytp, tmp_path):
    """Mutation: the down projection polls the gathered activations in the other copy of its
    layer's slots (the idle one, empty). Its bounded wait gives up, and the error names the rank
    that waited, the op and the slot: whose activations, of which expert slot."""
    tree = kernel_with(tmp_path, "ops/tp_experts.cuh", "const uint16_t* rows = act_slot(p.recv, cp, s, 0, 0);",
                       "const uint16_t* rows = act_slot(p.recv, cp ^ 1, s, 0, 0);")
    with ab.kernel_tree(tree), pytest.raises(SpinTimeoutError, match=(
            r"rank [01] block \d+ thread \d+ gave up waiting for expert2\(L0\) \[op \d+\]: rank [01]'s gate/up "
            r"activations of expert slot \d+ \(gather\) in the waiting rank's receive slots")):
        tp_run(tinytp, 2, "chain", bound_ns=1_500_000_000)


def test_a_rank_that_never_pushes_trips_a_wait_naming_it(tinytp):
    """Rank 1's oproj of layer 0 turned into an op that pushes nothing (its program table's record
    says embed): the all-reduce's poll of rank 1's partials gives up at the bound, and the error
    names the op, rank 1 and one of its K groups (tp_groups / 2 .. of 8 at R = 2)."""
    cfg, w, base, toks, par, _, routes = tinytp
    plan = make_plan(cfg, 4, tp_ranks=2, launch_ranks=2, spin_bound_ns=1_500_000_000)
    eng = RankEngine(w, plan, base.clone(), backend="emu", grid=2)
    e1 = eng.engines[1]
    i = next(o.index for o in e1.program.ops if o.kind == "oproj" and o.layer == 0)
    enc = e1.program.encode().reshape(-1, 16)
    enc[i, 0] = OP["embed"]
    e1.prog_t.copy_(torch.from_numpy(np.ascontiguousarray(enc.reshape(-1))))
    with pytest.raises(SpinTimeoutError, match=r"attn_reduce\(L0\) \[op \d+\]: rank 1's oproj partial of K group [4-7] \("):
        eng.step(toks, par, 40, mode="chain", routes=routes)


@pytest.mark.parametrize("ranks,mode,schedule", [(2, "mega", "random"), (4, "chain", "random"),
                                                 pytest.param(2, "mega", "block", marks=SLOW),
                                                 pytest.param(8, "mega", "random", marks=SLOW),
                                                 pytest.param(8, "mega", "rank", marks=SLOW)])
def test_the_expert_parallel_arrangement_computes_the_same_bits(tinytp, tp_one, ranks, mode, schedule):
    """Plan.expert_parallel: each slot's expert GEMM units all on the rank that owns its expert
    (expert e on rank e % R, whole rows), over that rank's own slots (top-k's rank_slots): the same
    units, so the bits of the N-sharded build and of R = 1."""
    assert_same_step(tp_run(tinytp, ranks, mode, schedule, expert_parallel=True), tp_one,
                     f"expert-parallel R={ranks} {mode} {schedule}")


def test_the_expert_parallel_arrangement_puts_each_slot_on_its_owner(tinytp):
    """The arrangement really differs: each rank runs the down-projection units of the slots whose
    expert it owns (its expert2 counter, which the MoE combine waits for), per layer; over the ranks
    they are every unit of the layer's slots, as the N-sharded ranks' are."""
    cfg, *_, routes = tinytp
    ranks = 2
    out = {ep: tp_run(tinytp, ranks, expert_parallel=ep)[2] for ep in (False, True)}
    tiles = {ep: e.plan.expert_rows[1] // e.plan.tiles["expert2"].rows for ep, e in out.items()}
    for o in out[True].program.ops:
        if o.kind != "expert2":
            continue
        experts = sorted(set(routes[o.layer].flatten().tolist()))
        done = {ep: [int(e.counters[e.parity ^ 1][o.counter]) for e in eng.engines] for ep, eng in out.items()}
        assert done[True] == [tiles[True] * sum(1 for x in experts if x % ranks == k) for k in range(ranks)], o.layer
        assert done[False] == [tiles[False] * len(experts)] * ranks, o.layer
        assert sum(done[True]) == sum(done[False])


def test_a_profiled_step_times_every_collective_of_every_rank(tinytp):
    """The profiled TP build (emulated, so on the emulation's clock): a wait and a readiness for
    every (layer, collective, rank), a skew per (layer, collective), stalls per (layer, rank); as
    megakernel.tp_waits they make a wait series per collective and rank, a stall series per rank,
    a skew series per collective, and the two derived values the report sets beside the study's."""
    cfg = tinytp[0]
    _, _, eng = tp_run(tinytp, 2, profile=True, profile_cap=256)
    tl = eng.timeline("mega")
    assert not tl.problems
    waits = collective_waits(tl, eng.program, eng.rank_of("mega"))
    keys = {(w.layer, w.collective, w.rank) for w in waits if w.wait_ns is not None and w.ready_ns is not None}
    assert keys == {(l, c, r) for l in range(cfg.n_layers) for c, *_ in COLLECTIVES for r in range(2)}
    assert all(w.wait_ns >= 0 for w in waits)
    sk, st = skews(waits), stalls(waits)
    assert set(sk) == {(l, c) for l in range(cfg.n_layers) for c, *_ in COLLECTIVES} and min(sk.values()) >= 0
    assert set(st) == {(l, r) for l in range(cfg.n_layers) for r in range(2)}
    res = tp_waits_result(waits, preset="tinytp", ranks=2, where="emu", one_clock=True, tokens=8, ctx=40,
                          env=Env.capture(None))
    names = {s.name for s in res.series}
    assert {f"tinytp/R2/{c}/rank{r}/wait" for c, *_ in COLLECTIVES for r in range(2)} <= names
    assert {"tinytp/R2/rank0/stall", "tinytp/R2/allreduce/skew"} <= names
    assert set(res.derived) == {"tp_skew_max_s", "tp_stall_per_layer_s"}
    apart = tp_waits_result(waits, preset="tinytp", ranks=2, where="torchrun", one_clock=False, tokens=8, ctx=40,
                            env=Env.capture(None))
    assert "tp_skew_max_s" not in apart.derived and any("skew not measured" in n for n in apart.notes)

    class Cat:  # the report's catalogue, holding this result or none
        def __init__(self, r):
            self.r = r

        def latest(self, name):
            return (None, self.r) if self.r is not None and name == self.r.benchmark else None

    class Ctx:
        def __init__(self, r):
            self.cat = Cat(r)

    shown = "\n".join(report_build.section_tp(Ctx(res)))
    assert "4 us" in shown and "12.5 us" in shown and "not measured yet" not in shown
    assert "not measured yet" in "\n".join(report_build.section_tp(Ctx(None)))


def test_where_ranks_run_follows_the_gpus_present(monkeypatch):
    """torchrun where the node has R GPUs, else one GPU shared, else the emulation; each says why,
    and a forced choice that cannot run here is refused with the reason."""
    from megakernel import ranks

    def node(n):
        monkeypatch.setattr(ranks, "gpu_count", lambda: n)
        monkeypatch.setattr(ranks, "no_gpu_reason", lambda: None if n else "no NVIDIA driver")

    node(0)
    assert ranks.where_ranks(2)[0] == "emu" and "no NVIDIA driver" in ranks.where_ranks(2)[1]
    with pytest.raises(ConfigError, match="gpu needs a GPU: no NVIDIA driver"):
        ranks.where_ranks(2, "gpu")
    node(1)
    where, why = ranks.where_ranks(2)
    assert where == "gpu" and "share its SMs" in why
    assert ranks.where_ranks(2, "emu")[0] == "emu"
    with pytest.raises(ConfigError, match="2 ranks need 2 GPUs, this node has 1"):
        ranks.where_ranks(2, "torchrun")
    node(8)
    assert ranks.where_ranks(8)[0] == "torchrun" and ranks.where_ranks(1)[0] == "gpu"
    cmd = ranks.torchrun_command(4, ["--check"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "megakernel.ranks",
                       "--check"]


@SLOW
def test_the_step_command_runs_two_ranks_with_its_check_on_the_cpu(capsys):
    """`megabench mk step --ranks 2 --check` here (no GPU): it says it runs the emulation, checks the
    two ranks bitwise against the unsharded build and the expert-parallel arrangement, and decodes
    a second step."""
    assert report_cli.main(["mk", "step", "--ranks", "2", "--check", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 ranks: the CPU emulation" in out
    assert out.count("check passed") == 3 and "step 1: tokens [" in out


def test_the_torch_interpreter_refuses_a_program_of_ranks(tinytp):
    from megakernel.interp import Interpreter
    from megakernel.program import build

    cfg, w, base, *_ = tinytp
    with pytest.raises(ConfigError, match="runs in the emulation"):
        Interpreter(w, build(make_plan(cfg, 4, tp_ranks=2, launch_ranks=2)), base.clone())


def test_tp_steps_batches_of_requests_bitwise(tinytp):
    """Two requests in one step (their own trees, contexts and caches: Engine's batches) at R = 2:
    bitwise R = 1's batched step on every rank, each request's rows and cache bitwise its own step
    alone, every receive slot empty."""
    cfg, w, *_ = tinytp
    caches = [KVCache(cfg).fill_random(torch.Generator().manual_seed(s)) for s in (3, 4)]
    g = torch.Generator().manual_seed(1)
    reqs = [Request(torch.randint(0, cfg.vocab, (5,), generator=g).tolist(), [-1, 0, 1, 1, 2], 30),
            Request(torch.randint(0, cfg.vocab, (3,), generator=g).tolist(), [-1, 0, 1], 70)]
    got = {}
    for ranks in (1, 2):
        cs = [c.clone() for c in caches]
        eng = RankEngine(w, make_plan(cfg, 4, tp_ranks=ranks, launch_ranks=ranks, spin_bound_ns=TP_BOUND_NS), cs,
                         backend="emu", grid=2)
        eng.poison()
        eng.step_batch(reqs, mode="mega")
        eng.check_slots_empty()
        got[ranks] = (eng.rank_outputs(), cs)
    (one, c1), (two, c2) = got[1], got[2]
    for k, o in enumerate(two):
        assert torch.equal(o.logits, one[0].logits) and torch.equal(o.tokens, one[0].tokens), k
    assert all(a.equal(b) for a, b in zip(c1, c2))
    for r, req in enumerate(reqs):
        alone = RankEngine(w, make_plan(cfg, 4, tp_ranks=2, launch_ranks=2, spin_bound_ns=TP_BOUND_NS),
                           caches[r].clone(), backend="emu", grid=2).step(req.tokens, req.parents, req.ctx)
        assert torch.equal(alone.logits, two[0].request(r).logits), r

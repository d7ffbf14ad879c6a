"""Batched steps: B requests in one megakernel step, each with its own tree, context and KV cache,
through the host emulation (the GPU's source on CPU fibers) and the torch interpreter. Each
request's logits, greedy tokens and KV cache are bitwise those of its own B=1 step; mega is bitwise
chain at the random and adversarial schedules; each request agrees with the reference. Mutations
(a request's attention reading another request's cache, its K/V written at another position, the
attention group waited for short) must make those checks fail."""
from __future__ import annotations


import pytest
import torch

from megakernel import ab, abi, reference
from megakernel.batch import check_batch, make_requests, mix, random_caches
from megakernel.build import CSRC
from megakernel.config import ConfigError, preset
from megakernel.interp import Interpreter
from megakernel.program import attn_span, attn_unit, build, group_size, n_units, splits, unit_group
from megakernel.reference import Trace
from megakernel.roofline import batch_step_bytes, kv_row_bytes, step_bytes
from megakernel.runtime import Engine, check_close

from megakernel_cases import mutated_csrc, tiny

# (T_r, ctx_r) per request: mixed trees and contexts, one at 0 and ones past tiny's window of 16
SHAPES = {2: ((7, 0), (9, 40)), 3: ((1, 17), (8, 0), (4, 100)), 4: ((4, 3), (1, 0), (6, 64), (5, 20))}
MIX_SEED = 10  # megakernel.batch.mix's random mix of 3 requests (tiny: contexts 4, 61, 1)


def _tree(tmp_path, rel: str, old: str, new: str):
    """A copy of the kernel's source with `old` (once in csrc/`rel`) replaced by `new`."""
    return mutated_csrc(tmp_path, rel, old, new)


@pytest.mark.parametrize("b", [2, 3, 4, "mix"])
def test_batched_requests_are_bitwise_their_own_b1_steps(tiny, b):
    """The whole check (megakernel.batch.check_batch) at B = 2, 3, 4 and a seeded random mix:
    each request alone at B=1 against the batch (bitwise logits, tokens, KV cache, with the
    kernel's own routing, so the batch's expert slots are the union), mega against chain at the
    random and adversarial schedules (bitwise), and each request against the reference with its
    routing forced."""
    cfg, w, _, plan = tiny
    shape = SHAPES[b] if b != "mix" else tuple(mix(cfg, 3, seed=MIX_SEED))
    b = len(shape)
    res = check_batch(w, plan, random_caches(cfg, b, seed=b), make_requests(cfg, shape, seed=b),
                      schedules=("random", "last", "block") if b == 4 else ("random", "last"), seed=b)
    assert res.ok, res.lines()
    assert res.shape == shape and all(res.alone) and all(res.greedy) and len(res.chain) == (3 if b == 4 else 2)
    assert all(e < 1e-2 for e in res.rel_err), res.rel_err


def test_b1_through_the_batch_api_is_the_single_request_step(tiny):
    """One request through step_batch (and a one-cache list) is the plain step, bit for bit; the
    per-request views of a step cover its rows in order."""
    cfg, w, base, plan = tiny
    (q,) = make_requests(cfg, [(6, 30)], seed=4)
    c1, c2 = base.clone(), base.clone()
    a = Engine(w, plan, c1, backend="emu").step(q.tokens, q.parents, q.ctx)
    out = Engine(w, plan, [c2], backend="emu").step_batch([q])
    assert torch.equal(a.logits, out.logits) and torch.equal(a.tokens, out.tokens) and c1.equal(c2)
    assert out.n_requests == 1 and out.row0 == (0, 6) and torch.equal(out.request(0).logits, a.logits)
    with pytest.raises(IndexError, match="request 1"):
        out.request(1)


def test_batched_steps_refuse_what_they_cannot_hold(tiny):
    cfg, w, base, plan = tiny
    caches = random_caches(cfg, 4)
    eng = Engine(w, plan, caches, backend="emu")
    two = make_requests(cfg, [(8, 0), (9, 5)], seed=1)
    with pytest.raises(ConfigError, match=r"2 requests of 8\+9 = 17 token rows.*at most 16 \(B x T <= 16.*GroupEngine"):
        eng.step_batch(two)
    with pytest.raises(ConfigError, match="5 requests but this engine has 4 KV caches"):
        eng.step_batch(make_requests(cfg, [(1, 0)] * 5))
    with pytest.raises(ConfigError, match="request 1: tiny: context 127 \\+ 2 tree tokens exceeds the cache"):
        eng.step_batch(make_requests(cfg, [(1, 0), (2, 127)]))
    with pytest.raises(ConfigError, match="the same KV cache twice"):
        Engine(w, plan, [caches[0], caches[0]], backend="emu")
    with pytest.raises(ConfigError, match="a list of 1..16"):
        Engine(w, plan, [], backend="emu")
    with pytest.raises(ConfigError, match=r"B x T = 16 x 9 = 144 token rows.*at most 128 \(8 row groups"):
        mix(cfg, 16, tokens=9)
    assert sum(t for t, _ in mix(cfg, 8, tokens=16)) == 128  # row groups (groups.GroupEngine)
    with pytest.raises(ConfigError, match="route shape"):  # forced routing covers every row of the batch
        eng.step_batch(make_requests(cfg, [(2, 0), (3, 1)]), routes=[torch.zeros(2, cfg.top_k)] * cfg.n_layers)


def test_program_rules_cover_every_request_split_once(tiny):
    """program.attn_unit (attention.cuh's mirror): each kv head's units are the requests' splits in
    request order, every (kv head, request, split) exactly once; a request's splits are those of
    its own context and rows, never of the batch; groups and unit counts follow."""
    cfg, _, _, plan = tiny
    ts, cs = (4, 1, 6, 5), (3, 0, 64, 20)
    for layer in range(cfg.n_layers):
        per = [splits(cfg, plan, layer, c, t) for t, c in zip(ts, cs)]
        span = attn_span(plan, layer, ts, cs)
        assert span == sum(per) and n_units(plan, "attn", layer, ts, cs, 0) == cfg.n_kv_heads * span
        seen = [attn_unit(plan, layer, u, ts, cs) for u in range(cfg.n_kv_heads * span)]
        assert sorted((k, r, s) for k, r, s, _ in seen) == [(k, r, s) for k in range(cfg.n_kv_heads)
                                                            for r in range(4) for s in range(per[r])]
        assert all(ns == per[r] for _, r, _, ns in seen)
        assert group_size(plan, "attn", layer, ts, cs) == span
        assert [unit_group(plan, "attn", layer, u, ts, cs) for u in range(cfg.n_kv_heads * span)] == \
            [k for k, _, _, _ in seen]
        # one request: the int form, as before the batch
        assert n_units(plan, "attn", layer, 5, 20, 0) == n_units(plan, "attn", layer, (5,), (20,), 0)
    assert n_units(plan, "embed", 0, ts, cs, 0) == 16 and n_units(plan, "attn_combine", 0, ts, cs, 0) == 16 * cfg.n_heads


@pytest.mark.parametrize("seed", [0, 1])
def test_interpreter_runs_a_batch_in_random_orders(tiny, seed):
    """The torch interpreter of the schedule on a batch: any order the declared dependencies allow
    gives the program order's bits, each request close to the reference and its cache too."""
    cfg, w, _, plan = tiny
    shape = SHAPES[3 + seed]
    reqs, caches = make_requests(cfg, shape, seed=7 + seed), random_caches(cfg, len(shape), seed=seed)
    traces = [Trace() for _ in reqs]
    ref_caches = [c.clone() for c in caches]
    ref = reference.step_batch(w, ref_caches, reqs, traces=traces)
    routes = [torch.cat([tr.tensors[f"L{l}.route"] for tr in traces]) for l in range(cfg.n_layers)]
    prog = build(plan)
    c_order = [c.clone() for c in caches]
    in_order = Interpreter(w, prog, c_order).run_batch(reqs, routes=routes, order="program")
    shuffled = Interpreter(w, prog, [c.clone() for c in caches]).run_batch(reqs, routes=routes, seed=seed)
    assert torch.equal(in_order, shuffled)
    check_close(in_order, ref, "batched interpreter vs reference", rel=5e-3)
    for mine, want in zip(c_order, ref_caches):
        for a, b in zip(mine.k + mine.v, want.k + want.v):
            check_close(a, b, "batched interpreter KV cache", rel=5e-3)


def test_reference_step_batch_is_each_request_on_its_own_cache(tiny):
    cfg, w, _, _ = tiny
    reqs, caches = make_requests(cfg, SHAPES[2], seed=2), random_caches(cfg, 2, seed=5)
    alone = [reference.step(w, c, q.tokens, q.parents, q.ctx) for q, c in zip(reqs, [c.clone() for c in caches])]
    assert torch.equal(reference.step_batch(w, [c.clone() for c in caches], reqs), torch.cat(alone))
    with pytest.raises(ConfigError, match="2 requests but 1 caches"):
        reference.step_batch(w, caches[:1], reqs)


# Mutations of the kernel's source the batch checks must catch: (csrc file, line, its mutation,
# the emulated mega schedule it runs under, what must fail)
MUTATIONS = {
    # every request's attention reads request 0's keys
    "attention reads another request's cache": (
        "ops/attention.cuh", "  const uint16_t* k_cache = p.kv[(layer * B_MAX + au.req) * 2];",
        "  const uint16_t* k_cache = p.kv[(layer * B_MAX + 0) * 2];", "random", "alone"),
    # a row's K/V go to its row of the step, not its row of its request
    "K/V written at another request's position": (
        "ops/qkv_rope.cuh", "      const int r = row_req(b, t), seq = req_ctx(b, r) + t - req_row0(b, r);",
        "      const int r = row_req(b, t), seq = req_ctx(b, r) + t;", "random", "alone"),
    # the attention combine waits for request 0's splits of its kv head, not the batch's: the
    # other requests' partials may be read before they are written (adversarial schedules)
    "attention group waited for short": (
        "mk/program.cuh", "    case OP_ATTN: return attn_span(b, o.layer);\n    case OP_EXPERT1: return EXP1_TILES;",
        "    case OP_ATTN: return req_splits(b, o.layer, 0);\n    case OP_EXPERT1: return EXP1_TILES;", "block",
        "chain"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_batch_checks_catch_a_mutated_kernel(tiny, tmp_path, name):
    rel, old, new, schedule, what = MUTATIONS[name]
    cfg, w, _, plan = tiny
    shape = SHAPES[4]
    reqs, caches0 = make_requests(cfg, shape, seed=4), random_caches(cfg, 4, seed=4)
    good = check_batch(w, plan, caches0, reqs, schedules=(schedule,), seed=3)
    assert good.ok, good.lines()
    with ab.kernel_tree(_tree(tmp_path, rel, old, new)):
        bad = check_batch(w, plan, caches0, reqs, schedules=(schedule,), seed=3)
    assert not bad.ok
    if what == "alone":
        assert not all(bad.alone), bad.lines()
    else:
        assert not all(bad.chain.values()), bad.lines()


def test_roofline_of_a_batch_by_hand():
    """tiny: 3 layers (layer 2 global, window 16), 2 kv heads x 64: a K+V row is 2*2*64*2 = 512 B
    per layer. Two requests (T=2 at ctx 30, T=1 at ctx 5), 5 distinct experts per layer over the
    batch: dense weights and the LM head once, the union of experts, each request's KV."""
    cfg = preset("tiny")
    row = kv_row_bytes(cfg)
    assert row == 512
    got = batch_step_bytes(cfg, [(2, 30), (1, 5)], 5)
    # request 0: sliding layers min(30, 15) + 2 = 17 rows, global 30 + 2 = 32; request 1: 5 + 1 = 6 each
    assert got.kv_read == (17 + 17 + 32 + 6 + 6 + 6) * 512
    assert got.kv_write == 3 * 3 * 512
    assert got.experts == 3 * 5 * cfg.expert_bytes
    assert got.dense == 3 * cfg.dense_layer_bytes() and got.embed == 2 * 3 * cfg.d_model
    assert got.lm_head == 2 * cfg.vocab * cfg.d_model + 2 * cfg.d_model
    # B separate steps move the dense weights and the LM head B times; a batch once
    one = step_bytes(cfg, 1, 5, 2)
    assert batch_step_bytes(cfg, [(1, 5)] * 4, 8).total == 4 * one.total - 3 * (one.dense + one.lm_head) \
        + (8 - 4 * 2) * 3 * cfg.expert_bytes
    assert step_bytes(cfg, 2, 30, 4) == batch_step_bytes(cfg, [(2, 30)], 4)
    with pytest.raises(ConfigError, match="routes to 1 distinct experts"):
        batch_step_bytes(cfg, [(1, 5), (1, 6)], 1)
    # past the megakernel's 16 rows (the peer's batches): the experts' bound grows with the rows
    assert batch_step_bytes(cfg, [(16, 0), (16, 0)], cfg.n_experts).experts == 3 * cfg.n_experts * cfg.expert_bytes


def test_step_block_packs_each_request(tiny):
    w = abi.pack_step([30, 5, 0], [2, 1, 4])
    o = abi.step_offsets()
    assert w[o["rows"]] == 7 and w[o["n_req"]] == 3 and w[o["ctx"]:o["ctx"] + 3] == [30, 5, 0]
    assert w[o["row0"]:o["row0"] + 4] == [0, 2, 3, 7] and len(w) == abi.STEP_INTS
    with pytest.raises(ValueError, match="1..16"):
        abi.pack_step([0] * 17, [1] * 17)


def test_mk_step_command_checks_a_batch_in_the_emulation(capsys):
    """`megabench mk step --batch 4 --check`: tiny in the emulation without a GPU, every check
    passes (exit 0), past 16 rows too (row groups); other presets need a GPU (exit 2); a batch of
    more rows than row groups hold is refused by name (exit 2)."""
    from megakernel import cli
    from microbench.device import no_gpu_reason

    if not no_gpu_reason():
        pytest.skip("a GPU is present: the command runs there, not in the emulation")
    assert cli.main(["step", "--preset", "tiny", "--batch", "4", "--check", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "host emulation" in out and "check: passed" in out and out.count("bitwise its own B=1 step") == 4
    assert cli.main(["step", "--preset", "small", "--batch", "2"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    assert cli.main(["step", "--batch", "2", "--tree-sizes", "9,8", "--check", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "17 rows in 2 row groups" in out and "check: passed" in out and out.count("bitwise its own B=1 step") == 2
    assert cli.main(["step", "--batch", "9", "--tree-sizes", ",".join(["16"] * 9), "--ctxs", ",".join(["0"] * 9)]) == 2
    assert "144 token rows pack into 9 row groups" in capsys.readouterr().err
    # --profile: the profiled build's op time by row group, labelled as the emulation's clock
    assert cli.main(["step", "--batch", "2", "--tokens", "16", "--profile", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "the emulation's CPU time: not a GPU's timing" in out and "problems" not in out
    assert "qkv          group 1: work" in out and "lm_head      group 0: work" in out


def test_schedule_options_are_refused_for_a_run_on_the_gpu(monkeypatch, capsys):
    """--schedule picks the host emulation's fiber schedule. `mk step` and `decode` on a GPU would
    ignore it, as would the tensor-parallel steps (`mk step --ranks R`), so they refuse it by name
    (exit 2) before building anything; without it they go on."""
    from megakernel import cli
    from reports.cli import main

    monkeypatch.setattr(cli, "no_gpu_reason", lambda: None)
    built = []
    monkeypatch.setattr("megakernel.bench_baselines.weights_for", lambda *a, **k: built.append(a) or 1 / 0)
    assert cli.main(["step", "--preset", "tiny", "--batch", "2", "--schedule", "last"]) == 2
    assert "--schedule picks the host emulation's schedule" in capsys.readouterr().err
    assert main(["decode", "--preset", "tiny", "--tokens", "8", "--schedule", "block"]) == 2
    assert "--schedule picks the host emulation's schedule" in capsys.readouterr().err
    assert main(["mk", "step", "--ranks", "2", "--schedule", "last"]) == 2  # not taken by the rank steps either
    assert "--ranks with --schedule" in capsys.readouterr().err
    assert built == []
    with pytest.raises(ZeroDivisionError):  # without --schedule the step goes on to the GPU's weights
        cli.main(["step", "--preset", "tiny", "--batch", "2"])
    assert len(built) == 1


def test_mk_step_command_exits_1_on_a_mismatch(monkeypatch, capsys):
    """A batched step whose request 1 differs from its own B=1 step (its logits nudged here) fails
    the command's check with exit 1."""
    from megakernel import batch, cli
    from microbench.device import no_gpu_reason

    if not no_gpu_reason():
        pytest.skip("a GPU is present: the command runs there, not in the emulation")

    class Nudged(Engine):
        def step_batch(self, requests, **kw):
            out = super().step_batch(requests, **kw)
            if len(requests) > 1:
                out.request(1).logits[0, 0] += 1.0
            return out

    monkeypatch.setattr(batch, "Engine", Nudged)
    assert cli.main(["step", "--batch", "2", "--tree-sizes", "3,2", "--ctxs", "40,0", "--check",
                     "--schedule", "random"]) == 1
    out = capsys.readouterr().out
    assert "request 1 differs from its own B=1 step" in out and "check: FAILED" in out


def test_report_draws_the_batch_curve_from_results_and_says_when_it_has_none(tmp_path):
    """reports.megakernel.batch_curve: per (preset, ctx, step shape) the megakernel's, chain's and
    peer's rows at each B against their own B=1 row, mega's speed-up over the others at the same B;
    nothing without a batched row. The study's figures stay compared with batch-1 rows (pick) when
    batched rows of the same T and context exist. Synthetic series only."""
    from megabench_synth import env, series
    from microbench.results import Bound, Result

    from reports import megakernel as mk

    def row(impl, b, t, step, groups=None, streams=None, union=None):
        m = {**({"row_groups": groups} if groups else {}), **({"expert_streams_per_layer": streams} if streams else {}),
             **({"union_experts": union} if union is not None else {})}
        return series(f"shard8/B{b}/T{t}/ctx2048/{impl}", step, params={"impl": impl, "preset": "shard8", "tokens": t,
                                                                          "context": 2048, "batch": b},
                      bound=Bound("time", 1e-3, "s", "roofline"), metrics=m or None)

    one = [row("mega", 1, 1, 2e-3), row("chain", 1, 1, 3e-3), row("mega", 1, 16, 4e-3)]
    rows = mk.step_rows([Result("megakernel.step", env(), tuple(one))])
    assert mk.batch_curve(rows) == []
    more = one + [row("mega", 4, 1, 2.5e-3), row("chain", 4, 1, 4.5e-3), row("mega", 4, 4, 4.4e-3)]
    rows = mk.step_rows([Result("megakernel.step", env(), tuple(more))])
    curve = mk.batch_curve(rows)
    got = {(c["shape"], c["B"], c["impl"]): c for c in curve}
    assert set(got) == {("T=1", 1, "mega"), ("T=1", 4, "mega"), ("T=1", 1, "chain"), ("T=1", 4, "chain"),
                        ("B x T = 16", 1, "mega"), ("B x T = 16", 4, "mega")}
    assert got[("T=1", 4, "mega")]["step vs B=1"] == "x1.25" and got[("T=1", 4, "mega")]["tokens/s vs B=1"] == "x3.20"
    assert got[("B x T = 16", 4, "mega")]["tokens/s vs B=1"] == "x0.91"
    assert got[("T=1", 4, "chain")]["mega speed-up"] == "x1.80" and got[("T=1", 4, "mega")]["mega speed-up"] == ""
    assert mk.pick(rows, "mega", tokens=1).batch == 1  # the study's batch-1 figures
    # the peer's rows where results hold one: at B = 1 and 4 at T = 1 (its B=1 row: a plain step row);
    # a peer with only a B=1 row has no curve of its own
    peer = more + [row("peer", 1, 1, 3e-3), row("peer", 4, 1, 5e-3), row("peer", 1, 16, 6e-3)]
    curve = mk.batch_curve(mk.step_rows([Result("megakernel.step", env(), tuple(peer))]))
    got = {(c["shape"], c["B"], c["impl"]): c for c in curve}
    assert {k for k in got if k[2] == "peer"} == {("T=1", 1, "peer"), ("T=1", 4, "peer")}
    assert got[("T=1", 4, "peer")]["step vs B=1"] == "x1.67" and got[("T=1", 4, "peer")]["mega speed-up"] == "x2.00"
    assert got[("T=1", 1, "peer")]["mega speed-up"] == "x1.50"
    # T = 16 trees at B = 2 (32 rows) where only the peer's results hold one: against its own T = 16
    # B = 1 row, no mega speed-up; B = 1 T = 16 also stays the base of the 16-row curve
    t16 = peer + [row("peer", 2, 16, 9e-3)]
    curve = mk.batch_curve(mk.step_rows([Result("megakernel.step", env(), tuple(t16))]))
    got = {(c["shape"], c["B"], c["impl"]): c for c in curve}
    assert {k for k in got if k[0] == "T=16"} == {("T=16", 1, "peer"), ("T=16", 2, "peer")}
    assert got[("T=16", 2, "peer")]["step vs B=1"] == "x1.50" and got[("T=16", 2, "peer")]["mega speed-up"] == ""
    assert ("B x T = 16", 1, "mega") in got and ("B x T = 16", 4, "mega") in got
    # the megakernel at 32 rows in row groups: its column names them, mega's speed-up over the peer
    grouped = t16 + [row("mega", 2, 16, 7.5e-3, groups=2, union=1)]
    got = {(c["shape"], c["B"], c["impl"]): c for c in mk.batch_curve(mk.step_rows([Result("megakernel.step", env(),
                                                                                         tuple(grouped))]))}
    assert got[("T=16", 2, "mega")]["row groups"] == "2" and got[("T=16", 1, "mega")]["row groups"] == "1"
    assert got[("T=16", 2, "peer")]["row groups"] == "" and got[("T=16", 2, "peer")]["mega speed-up"] == "x1.20"
    # a mega step in row groups without the union (union_experts 0, or a result older than it) is the
    # per-group ablation: a row of its own, against mega's B = 1 row; a result that named the union
    # build mega_union (while it was a variant) is mega's
    abl = t16 + [row("mega", 2, 16, 1e-2, groups=2, streams=60.0, union=0),
                 row("mega_union", 2, 16, 5e-3, groups=2, streams=43.3)]
    got = {(c["shape"], c["B"], c["impl"]): c for c in mk.batch_curve(mk.step_rows([Result("megakernel.step", env(),
                                                                                         tuple(abl))]))}
    assert {k[2] for k in got if k[:2] == ("T=16", 2)} == {"mega", "mega_per_group", "peer"}
    assert got[("T=16", 2, "mega_per_group")]["step vs B=1"] == "x2.50"
    assert got[("T=16", 2, "mega_per_group")]["mega speed-up"] == "x2.00"
    assert got[("T=16", 2, "mega")]["expert streams"] == "43.3"
    assert got[("T=16", 2, "mega_per_group")]["expert streams"] == "60.0"
    # before the union (no union_experts metric) mega and chain in row groups were the per-group
    # build: named so, the chain against its own B = 1 row
    older = t16 + [row("mega", 2, 16, 1e-2, groups=2), row("chain", 1, 16, 5e-3), row("chain", 2, 16, 2e-2, groups=2)]
    got = {(c["shape"], c["B"], c["impl"]): c for c in mk.batch_curve(mk.step_rows([Result("megakernel.step", env(),
                                                                                         tuple(older))]))}
    assert {k[2] for k in got if k[:2] == ("T=16", 2)} == {"mega_per_group", "chain_per_group", "peer"}
    assert got[("T=16", 2, "chain_per_group")]["step vs B=1"] == "x4.00"


def test_bench_cases_time_the_full_runs_batch_grid():
    """tests/bench/test_bench_megakernel.py writes the batched grid out (collecting it needs no
    torch): it must be plans.BATCH_FULL, which `megabench run --full` times."""
    import importlib.util

    from megakernel.plans import BATCH_FULL

    path = CSRC.parents[1] / "tests" / "bench" / "test_bench_megakernel.py"
    spec = importlib.util.spec_from_file_location("bench_megakernel_cases", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    assert m.BATCH_POINTS == [(p, b, t, c) for p in ("small", "shard8") for b, t, c in BATCH_FULL[p]]

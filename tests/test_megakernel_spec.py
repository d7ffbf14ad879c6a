"""Speculative decoding on the device, through the host emulation (the GPU's source on CPU fibers):
the spec programs' structure, the drafter's megakernel (mega == chain bitwise at the random and
adversarial schedules, its logits within the bound of the drafter's torch reference, its top-2 by
(logit desc, index asc)), the device step's acceptance against the host's rule on the same logits,
and `megabench decode`'s refusals. The long runs (64 tokens against plain greedy decoding, the
compaction mutation, the command's --check) are in test_megakernel_spec_decode.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megakernel import abi, draft, reference, speculative, tree
from megakernel.config import ConfigError, preset
from megakernel.decode import SpecPair, max_tokens, seed_table, tree_shape, tree_table
from megakernel.draft import DraftConfig, draft_model_config
from megakernel.interp import Interpreter, SpecIO
from megakernel.plan import make_plan
from megakernel.plans import REL_TOL
from megakernel.program import Program, build, check
from megakernel.reference import KVCache, Trace
from megakernel.runtime import check_close
from megakernel.weights import generate

STUDY = speculative.agreement("study", "tiny")


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny")
    w = generate(cfg)
    return cfg, w, make_plan(cfg, 4, spin_bound_ns=3_000_000_000)


def _pair(model, batch=1, agree=STUDY, schedule="random", seed=1):
    cfg, w, plan = model
    dplan = make_plan(draft_model_config(cfg, DraftConfig(agree=agree)), 4, spin_bound_ns=3_000_000_000)
    return SpecPair(w, plan, dplan, [KVCache(cfg) for _ in range(batch)], batch=batch, agree=agree, backend="emu",
                    emu_schedule=schedule, emu_seed=seed)


def _prompts(cfg, batch, seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab, (n,), generator=g).tolist() for _ in range(batch)]


# ---------------------------------------------------------------------- programs and tables
@pytest.mark.parametrize("mode", ["layer", "step"])
def test_spec_programs_hold_their_ops_where_the_design_puts_them(model, mode):
    cfg, _, plan = model
    plain = build(plan, mode)
    assert not {o.kind for o in plain.ops} & {"seed", "tree", "accept", "compact", "advance"}
    verify = build(plan, mode, spec="verify")
    kinds = [o.kind for o in verify.ops]
    assert kinds[:2] == ["tree", "embed"] and kinds[-3:] == ["accept", "compact", "advance"]
    assert verify.launches[-1] == (len(kinds) - 3, 3)  # accept / compaction / advance: a launch of their own
    assert len(verify.launches) == len(plain.launches) + 1
    assert [o.kind for o in verify.ops[1:-3]] == [o.kind for o in plain.ops]  # the plain step in between
    from megakernel.profile_events import EVENTS

    assert all(EVENTS.macro(f"{k}_begin") for k in ("seed", "tree", "accept", "compact", "advance"))  # profiled ops
    dplan = make_plan(draft_model_config(cfg), 4)
    d = build(dplan, mode, spec="draft")
    assert [o.kind for o in d.ops][:3] == ["seed", "embed", "qkv"]
    # one launch per draft layer (mega mode), or one
    assert len(d.launches) == (dplan.cfg.n_layers == 5 and 5 if mode == "layer" else 1)
    # every op of the last launch waits for the one before it: advance after every compact unit
    acc, comp, adv = verify.ops[-3:]
    assert comp.deps[0].producer == acc.index and adv.deps[0].producer == comp.index


def test_program_check_refuses_a_spec_program_whose_advance_is_not_last(model):
    _, _, plan = model
    prog = build(plan, spec="verify")
    ops = list(prog.ops)
    first, n = prog.launches[-1]
    ops[first + 1], ops[first + 2] = dataclasses.replace(ops[first + 2], index=first + 1, deps=()), \
        dataclasses.replace(ops[first + 1], index=first + 2, deps=())
    with pytest.raises(AssertionError, match="accept launch last"):
        check(Program(plan, tuple(ops), prog.launches, prog.n_counters, prog.mode, "verify"))
    with pytest.raises(AssertionError, match="no speculative op"):
        check(dataclasses.replace(prog, spec=None))


@pytest.mark.parametrize("batch,t,depth", [(1, 16, 3), (2, 8, 3), (4, 4, 1), (8, 2, 0)])
def test_tree_shapes_and_tables(model, batch, t, depth):
    cfg, w, _ = model
    tt, parents, bd = tree_shape(cfg, batch)
    assert (tt, bd) == (t, depth) and len(parents) == t
    assert parents == (tree.binary_ish(t, depth) if depth else tree.chain(t))
    tab = tree_table(parents, batch, cfg.max_tree, "cpu")
    o = abi.tree_offsets()
    props = torch.tensor([[100 + j, 200 + j] for j in range(t - 1)])
    tokens, _ = speculative.build_tree(7, props, t, bd)
    for r in range(batch):
        for i in range(t):
            row = tab[r * t + i]
            assert int(row[o["parent"]]) == parents[i]
            d, k = int(row[o["depth"]]), int(row[o["rank"]])
            # the tree op's rule (ops/tree.cuh): node i's token is entry `rank` of draft row depth - 1
            assert (7 if i == 0 else int(props[d - 1, k])) == tokens[i]
            anc = tree.ancestor_mask(parents)[i]
            assert int(row[o["anc"]]) == sum(1 << j for j in range(t) if anc[j])
    assert not tab[batch * t:].any()
    succ = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(2))
    seeds = seed_table(succ)
    assert seeds.shape == (cfg.vocab, abi.SEED_COLS) and torch.equal(seeds[:, 0], torch.arange(cfg.vocab).int())
    assert torch.equal(seeds[:, 5].long(), succ[succ[succ[succ[succ]]]])
    with pytest.raises(ConfigError, match="batch 3"):
        tree_shape(cfg, 3)


def test_run_limits_are_refused_by_name(model):
    cfg, _, _ = model
    most = max_tokens(cfg, 1, 8)
    # the last step may overshoot by 12 and an inactive one verifies 16 past that: 128 - 7 - 13 - 16 + 1
    assert most == 93 and max_tokens(preset("small"), 1, 8) == abi.MAX_OUT - 16
    pair = _pair(model)
    with pytest.raises(ConfigError, match="holds 1..93"):
        pair.start(_prompts(cfg, 1), 94, 7)


def _interp_verify(model, top2, order, seed, program=None):
    cfg, w, plan = model
    t, parents, bd = tree_shape(cfg, 1)
    cache = KVCache(cfg).fill_random(torch.Generator().manual_seed(6))
    st = torch.zeros(1, abi.SPEC_INTS, dtype=torch.long)
    o = abi.spec_offsets()
    st[0, o["root"]], st[0, o["want"]] = 7, 50
    io = SpecIO(st, tree_table(parents, 1, cfg.max_tree, "cpu").long(), top2.clone())
    it = Interpreter(w, build(plan, spec="verify"), [cache])
    logits = it.run_spec(io, [t], [20], order, seed, program=program)
    return logits, io.state, cache, it.ctxs


def _interp_draft(model, agree, order, seed):
    """The drafter's pass from root 7 in the interpreter: (logits, top-2)."""
    cfg, w, _ = model
    dm = draft.DraftModel(w, DraftConfig(agree=agree))
    st = torch.zeros(1, abi.SPEC_INTS, dtype=torch.long)
    st[0, abi.spec_offsets()["root"]] = 7
    io = SpecIO(st, seed_table(dm.w.succ).long(), torch.zeros(16, 2, dtype=torch.long))
    logits = Interpreter(dm.w, build(make_plan(dm.cfg, 4), spec="draft"), [KVCache(dm.cfg)]).run_spec(
        io, [15], [0], order, seed)
    return logits, io.top2[:15]


def test_interpreter_runs_spec_programs_in_random_orders(model):
    """The drafter's pass and the verifier's step in the torch interpreter: any order their declared
    dependencies allow gives the program order's bits (logits, top-2, state, cache, contexts); the
    pass's top-2 is draft.top2 of its logits and the step's path speculative.accept's."""
    cfg, w, plan = model
    logits, top2 = _interp_draft(model, STUDY, "program", 0)
    for seed in (1, 2):
        again = _interp_draft(model, STUDY, "random", seed)
        assert torch.equal(again[0], logits) and torch.equal(again[1], top2)
    assert torch.equal(top2, draft.top2(logits))
    ref = _interp_verify(model, top2, "program", 0)
    for seed in (1, 2):
        got = _interp_verify(model, top2, "random", seed)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]) and got[2].equal(ref[2]) and got[3] == ref[3]
    t, parents, bd = tree_shape(cfg, 1)
    tokens, _ = speculative.build_tree(7, top2, t, bd)
    path, bonus = speculative.accept(tokens, parents, ref[0])
    o = abi.spec_offsets()
    assert int(ref[1][0, o["len"]]) == len(path) and int(ref[1][0, o["bonus"]]) == bonus and ref[3] == [20 + len(path)]


def test_a_missing_spec_dependency_is_caught_by_random_orders(model):
    """advance not waiting for the compaction: some order advances ctx first and the compaction
    moves the wrong rows. Proves the random-order check of the spec program can fail."""
    _, _, plan = model
    top2 = _interp_draft(model, 1.0, "program", 0)[1]  # a perfect drafter: the whole main chain is accepted
    prog = build(plan, spec="verify")
    ops = list(prog.ops)
    ops[-1] = dataclasses.replace(ops[-1], deps=())
    broken = Program(plan, tuple(ops), prog.launches, prog.n_counters, prog.mode, "verify")
    good = _interp_verify(model, top2, "program", 0)
    assert int(good[1][0, abi.spec_offsets()["len"]]) == 13
    caught = 0
    for seed in range(8):
        got = _interp_verify(model, top2, "random", seed, program=broken)
        caught += not got[2].equal(good[2])
    assert caught


# ---------------------------------------------------------------------- the drafter's megakernel
def _draft_reference(pair, roots):
    """The drafter's torch reference per request (DraftModel.forward: a chain of the seeds at
    context 0), its logits and routing over the pass's rows."""
    logits, routes = [], []
    for root in roots:
        tr = Trace()
        seeds = pair.dm.seeds(root)
        logits.append(reference.step(pair.dm.w, KVCache(pair.dm.cfg), seeds, tree.chain(len(seeds)), 0, trace=tr))
        routes.append([tr.tensors[f"L{l}.route"] for l in range(pair.dm.cfg.n_layers)])
    return torch.cat(logits), [torch.cat([r[l] for r in routes]) for l in range(pair.dm.cfg.n_layers)]


def _draft_pass(model, batch, mode, schedule, roots, routes=None):
    pair = _pair(model, batch, schedule=schedule, seed=len(schedule) + batch)
    pair.poison()
    o = abi.spec_offsets()
    pair.state[:, o["root"]] = torch.tensor(roots, dtype=torch.int32)
    pair.draft.tokens_t.fill_(pair.cfg.vocab - 1)
    pair.draft.force_routes(routes)
    pair.draft.launch_step(mode)
    rows = batch * (pair.T - 1)
    return pair, pair.draft.buf["logits"][:rows].clone(), pair.top2[:rows].long().clone()


@pytest.mark.parametrize("batch", [1, 2])
def test_draft_megakernel_mega_equals_chain_and_matches_its_reference(model, batch):
    """The drafter's pass as a megakernel from poisoned buffers: its seed op writes the rows'
    tokens from the roots, mega == chain bitwise (logits and top-2) at the random and adversarial
    schedules; with the reference's routing forced, its logits within the bound of the drafter's
    torch reference, and its top-2 the two best by (logit desc, index asc) of its own logits and of
    the reference's."""
    cfg = model[0]
    roots = [int(x) for x in torch.randint(0, cfg.vocab, (batch,), generator=torch.Generator().manual_seed(batch))]
    pair, chain_logits, chain_top2 = _draft_pass(model, batch, "chain", "random", roots)
    seeds = torch.cat([pair.dm.seeds(r) for r in roots])
    assert torch.equal(pair.draft.tokens_t[:len(seeds)].long(), seeds)  # the seed op's rows
    for schedule in ("random", "last", "block"):
        _, logits, top2 = _draft_pass(model, batch, "mega", schedule, roots)
        assert torch.equal(logits, chain_logits), schedule
        assert torch.equal(top2, chain_top2), schedule
    assert torch.equal(chain_top2, draft.top2(chain_logits))
    ref, routes = _draft_reference(pair, roots)
    _, forced, forced_top2 = _draft_pass(model, batch, "mega", "random", roots, routes)
    check_close(forced, ref, "drafter megakernel vs its torch reference", rel=REL_TOL)
    # the reference's top-2 too, but where its own pick and the kernel's are closer than the two
    # logits' difference: a near-tie either may break its way
    err = float((forced - ref).abs().max())
    ref_top2 = draft.top2(ref)
    differ = (forced_top2 != ref_top2).nonzero().tolist()
    for i, k in differ:
        assert abs(float(ref[i, forced_top2[i, k]] - ref[i, ref_top2[i, k]])) <= 2 * err, (i, k)
    assert len(differ) <= 2


def test_top2_breaks_ties_toward_the_lower_index(model):
    """Equal logits inside an LM-head unit and across units: the argmax op's top-2 follows
    draft.top2 (stable sort, the lower index first). The LM head's rows of tokens 3, 20 and 21
    (units 0 and 1) are made equal to that of row 0's greedy token v, so where v led, four tie."""
    cfg, w, plan = model
    dplan = make_plan(draft_model_config(cfg), 4, spin_bound_ns=3_000_000_000)

    def top2_of(weights):
        pair = SpecPair(weights, plan, dplan, [KVCache(cfg)], backend="emu")
        pair.state[:, abi.spec_offsets()["root"]] = 11
        pair.draft.launch_step("mega")
        return pair.draft.buf["logits"][:15].clone(), pair.top2[:15].long().clone()

    logits, top2 = top2_of(w)
    v = int(top2[0, 0])
    tied = {3, 20, 21, v}
    w2 = dataclasses.replace(w, lm_head=w.lm_head.clone())
    for t in tied - {v}:
        w2.lm_head[t] = w.lm_head[v]
    logits2, top2_2 = top2_of(w2)
    assert torch.equal(top2_2, draft.top2(logits2))
    led = top2[:, 0] == v
    assert bool(led[0]) and torch.equal(top2_2[led], torch.tensor([sorted(tied)[:2]] * int(led.sum())))
    assert torch.equal(logits2[:, sorted(tied)].min(dim=1).values, logits2[:, sorted(tied)].max(dim=1).values)


# the argmax op's merge of its threads' top-2s (ops/argmax.cuh): a mutation must fail the tie test
# or the top-2 check against draft.top2 of the pass's own logits
ARGMAX_MUTATIONS = {
    "ties toward the higher index": ("MK_DEV bool ranks_before(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }",
                                     "MK_DEV bool ranks_before(float v, int i, float bv, int bi) { return v > bv || (v == bv && i > bi); }"),
    "a partner's second best dropped": ("      k.insert(o.v0, o.i0);\n      k.insert(o.v1, o.i1);\n",
                                         "      k.insert(o.v0, o.i0);\n"),
}


@pytest.mark.parametrize("name", list(ARGMAX_MUTATIONS))
def test_argmax_mutations_are_caught(model, tmp_path, name):
    from megakernel import ab

    from megakernel_cases import mutated_csrc

    old, new = ARGMAX_MUTATIONS[name]
    with ab.kernel_tree(mutated_csrc(tmp_path, "ops/argmax.cuh", old, new)):
        with pytest.raises(AssertionError):
            test_top2_breaks_ties_toward_the_lower_index(model)
            roots = [3, 77]
            _, logits, top2 = _draft_pass(model, 2, "mega", "random", roots)
            assert torch.equal(top2, draft.top2(logits))


# ---------------------------------------------------------------------- the device step
@pytest.mark.parametrize("batch,agree", [(1, STUDY), (2, 0.7)])
def test_device_acceptance_is_the_host_rule_on_the_same_logits(model, batch, agree):
    """Step by step (nothing but this test reads between them): the device's path, bonus, emitted
    tokens and histogram equal speculative.accept on the verifier's logits and tree tokens of that
    step; the compaction moves the path's K/V as KVCache.compact does; ctx and root advance."""
    cfg = model[0]
    pair = _pair(model, batch, agree=agree)
    prompts = _prompts(cfg, batch, seed=batch)
    ctx0 = pair.prefill(prompts)
    pair.start(prompts, 40, ctx0, poison=True)
    o = abi.spec_offsets()
    t = pair.T
    lengths = [[] for _ in range(batch)]
    emitted = [[] for _ in range(batch)]
    ctx = [ctx0] * batch
    for _ in range(3):
        roots = pair.state[:, o["root"]].tolist()
        pair.launch_part(0, "mega")  # draft
        pair.launch_part(1, "mega")  # verify: the tree's K/V written at ctx_r + row
        before = [c.clone() for c in pair.caches]
        pair.launch_part(2, "mega")  # accept, compaction, advance
        st = pair.state.cpu()
        for r in range(batch):
            rows = slice(r * t, (r + 1) * t)
            toks = pair.target.tokens_t[rows].tolist()
            props = pair.top2[r * (t - 1):(r + 1) * (t - 1)]  # this step's drafts
            assert toks == speculative.build_tree(roots[r], props, t, pair.branch_depth)[0]  # the tree op's tokens
            path, bonus = speculative.accept(toks, pair.parents, pair.target.buf["logits"][rows])
            n = int(st[r, o["len"]])
            assert n == len(path) and st[r, o["path"]:o["path"] + n].tolist() == path
            assert int(st[r, o["bonus"]]) == bonus == int(st[r, o["root"]])
            emitted[r] += [toks[i] for i in path[1:]] + [bonus]
            lengths[r].append(len(path))
            want = before[r].clone()
            want.compact(ctx[r], path)
            mine = pair.caches[r]
            for l in range(cfg.n_layers):
                pos = torch.tensor([mine.slot(l, ctx[r] + i) for i in range(len(path))])
                assert torch.equal(mine.k[l][:, pos], want.k[l][:, pos]) and torch.equal(mine.v[l][:, pos], want.v[l][:, pos])
            ctx[r] += len(path)
    got = pair.read()
    assert got.ctx == ctx
    for r in range(batch):
        assert got.tokens[r] == emitted[r][:40] and got.emitted[r] == len(emitted[r])
        assert got.hist[r] == [0] + speculative.histogram(lengths[r], t)
    assert sorted(got.lengths()) == sorted(a for ls in lengths for a in ls)


def test_a_perfect_drafter_has_the_whole_main_chain_accepted(model):
    """agree 1.0 ('perfect'): the drafter's successor table is the target's backbone, which tiny's
    target always follows: every step accepts the 12-deep main chain and the bonus."""
    cfg = model[0]
    pair = _pair(model, agree=speculative.agreement("perfect", "tiny"))
    prompts = _prompts(cfg, 1, seed=3)
    pair.start(prompts, 26, pair.prefill(prompts))
    stats = pair.run("mega")
    got = pair.read()
    assert got.hist[0][13] == 2 and sum(got.hist[0]) == 2 and stats.rounds == [2]
    assert len(got.tokens[0]) == 26 and got.emitted[0] == 26


def test_a_finished_request_stays_put(model):
    """A request that has what it wants is inactive on the device: further steps emit nothing,
    move no K/V and leave its context, root and histogram alone."""
    cfg = model[0]
    pair = _pair(model, agree=1.0)
    prompts = _prompts(cfg, 1, seed=4)
    pair.start(prompts, 5, pair.prefill(prompts))
    pair.launch_step("mega")
    first = pair.read()
    state, caches = pair.state.clone(), [c.clone() for c in pair.caches]
    pair.launch_step("mega")
    o = abi.spec_offsets()
    assert int(pair.state[0, o["len"]]) == 0
    for name, n in abi.SPEC_FIELDS:
        if name not in ("len", "path", "bonus"):
            assert torch.equal(pair.state[:, o[name]:o[name] + n], state[:, o[name]:o[name] + n]), name
    again = pair.read()
    assert again.ctx == first.ctx and again.tokens == first.tokens and again.hist == first.hist
    # a wait of the spec program is named by its op, program and producer (the watchdog's message)
    comp = next(o for o in pair.target.spec_program.ops if o.kind == "compact")
    assert pair.target.describe_wait(comp.index * 16) == (f"compact(L{comp.layer}) [op {comp.index} of the verify "
                                                          f"program] dependency 0: all units of accept(L{comp.layer}) "
                                                          f"[op {comp.index - 1}]")
    c0 = first.ctx[0]
    for l in range(cfg.n_layers):  # the committed rows stay what they were
        a, b = pair.caches[0], caches[0]
        pos = torch.tensor([a.slot(l, p) for p in range(c0 - 5, c0)])
        assert torch.equal(a.k[l][:, pos], b.k[l][:, pos])


# ---------------------------------------------------------------------- the command's refusals
@pytest.mark.parametrize("argv,msg", [
    (["--preset", "small"], "needs a GPU"),
    (["--tokens", "94"], "holds 1..93"),
    (["--ranks", "4"], "2 kv heads do not divide over 4 ranks"),
    (["--where", "emu"], "add --ranks R"),
    (["--batch", "3"], "--batch 3"),
    (["--agree", "1.5"], "agree"),
    (["--acceptance", "stduy"], "unknown acceptance"),
])
def test_decode_command_refuses_bad_input(argv, msg, capsys):
    from microbench.device import no_gpu_reason

    from reports.cli import main

    if not no_gpu_reason() and argv[0] == "--preset":
        pytest.skip("a GPU is present: small runs there")
    assert main(["decode", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_decode_no_save_writes_no_result(monkeypatch, tmp_path, capsys):
    """`decode --no-save` (the sanitizer's runs: their timings are not the kernel's) runs and reports,
    and never reaches Result.save; --json still writes the file it names."""
    from microbench.results import Result

    from reports.cli import main

    def refuse(self, root=None):
        raise AssertionError(f"decode --no-save saved a {self.benchmark} result")

    monkeypatch.setattr(Result, "save", refuse)
    out_json = tmp_path / "d.json"
    assert main(["decode", "--preset", "tiny", "--tokens", "4", "--no-save", "--json", str(out_json)]) == 0
    assert "not saved (--no-save)" in capsys.readouterr().out
    assert out_json.is_file() and '"megakernel.decode"' in out_json.read_text()


def test_the_named_acceptance_says_where_it_comes_from():
    assert "6.95" in speculative.agreement_source("study", "tiny")
    assert "6.92" in speculative.agreement_source("study", "small")
    assert "small's value" in speculative.agreement_source("study", "shard8")
    assert speculative.agreement("study", "shard8") == speculative.agreement("study", "small")
    with pytest.raises(ConfigError, match="no agreement for preset"):
        speculative.agreement_source("study", "shard9")


# ---------------------------------------------------------------------- the report
def test_report_reads_gpu_decode_runs_and_keeps_projections_labelled(tmp_path):
    """A GPU `megabench decode` run becomes the measured accepted tokens/s (the study's throughput
    rows, the draft half, tokens accepted) with the projection beside it; an emulated run is never
    read; without a GPU run the projection stays, labelled as one."""
    from megabench_synth import env, save_all, series

    from microbench.results import Result
    from reports import megakernel as mk
    from reports.build import build

    step = Result("megakernel.step", env(), (series("shard8/T16/ctx2048/mega", 6e-3, params={
        "impl": "mega", "preset": "shard8", "tokens": 16, "context": 2048}),))
    metrics = {"accepted_tokens_per_s": 812.0, "accepted_tokens_per_step": 6.5, "draft_s": 1.2e-3, "verify_s": 6.6e-3,
               "accept_s": 2.5e-5, "gaps_s": 1.5e-4, "draft_launches": 5, "verify_launches": 64, "accept_launches": 1,
               "check": "passed"}
    params = {"preset": "shard8", "batch": 1, "tree_tokens": 16, "mode": "mega", "agree": 0.83, "acceptance": "study",
              "backend": "gpu"}
    dec = Result("megakernel.decode", env(date="2026-11-30T10:00:00Z", sha="dec0000"),
                 (series("shard8/B1/T16/mega/agree0.83", 8e-3, params=params, metrics=metrics),))
    emu = Result("megakernel.decode", env(gpu=None, date="2026-11-30T11:00:00Z"),
                 (series("tiny/B1/T16/mega/agree0.87", 3.0, timer="host", params={**params, "backend": "emu"},
                         metrics=metrics),))
    rows = mk.decode_rows([dec, emu])
    assert len(rows) == 1 and rows[0].tok_s == 812.0 and mk.pick_decode(rows).commit == "dec0000"
    curve = mk.acceptance_curve(mk.step_rows([step]), rows)
    assert curve["study"][1] == pytest.approx(6.6 / 6e-3, rel=0.05) and curve["measured"][0][:2] == (6.5, 812.0)

    def report(results):
        root = tmp_path / f"results{len(results)}"
        save_all(results, root)
        return build(root, tmp_path / f"out{len(results)}", bench_dir=root).read_text()

    text = report([step, dec])
    row = next(line for line in text.splitlines() if line.startswith("| decode throughput, megakernel"))
    assert "812 tok/s" in row and "projection" not in row
    assert "MEASURED by `megabench decode`" in text and "beside it the PROJECTION" in text
    assert "| draft half of the step, megakernel" in text and "1.2 ms" in text
    assert "| tokens accepted per step on average" in text and "6.5 tokens" in text
    assert "megakernel-acceptance.png" in text and (tmp_path / "out2" / "figures" / "megakernel-acceptance.png").exists()
    text = report([step])
    row = next(line for line in text.splitlines() if line.startswith("| decode throughput, megakernel"))
    assert "(projection)" in row and "Not measured yet" in text

"""Speculative decoding with full trees past max_tree rows, in the host emulation: B requests, each
its own 16-token verify tree and 15 draft rows in a row group of its own (decode.SpecPair over two
groups.GroupEngines). Two checks on every run, from poisoned buffers:
- plain greedy decoding: the speculative tokens equal the plain T=1 run's, every committed KV row
  that run's (decode's own check);
- each request alone: its emitted tokens, acceptance histogram, final context and committed KV rows
  are bitwise those of the same request decoded at B = 1 (a plain Engine, the same tree). The
  greedy check cannot see a request verifying another request's drafts (its tokens stay right,
  its acceptance does not): this one does, and the mutation below proves it.
tiny, mega at the random, `last` and `block` schedules and chain; 2 and 3 requests; the union
experts build too. Each run takes
tens of seconds on a CPU: slow (CI runs them). The programs' structure and the refusals: fast."""
from __future__ import annotations

import pytest
import torch

from megakernel import decode as decode_mod
from megakernel import speculative
from megakernel.config import ConfigError, preset
from megakernel.decode import SpecPair, decode, prompts_for, tree_shape
from megakernel.draft import DraftConfig, draft_model_config
from megakernel.groups import GroupEngine
from megakernel.plan import make_plan
from megakernel.program import build, check, grouped
from megakernel.reference import KVCache
from megakernel.runtime import SpecLink
from megakernel.weights import generate

N = 24  # tokens per request: two to three steps of a 16-token tree on tiny's 'study' pair
B_MOST = 3
BOUND = 3_000_000_000


@pytest.fixture(scope="module")
def model():
    cfg = preset("tiny")
    agree = speculative.agreement("study", "tiny")
    return cfg, generate(cfg), agree, draft_model_config(cfg, DraftConfig(agree=agree))


def _plans(model, groups: int, union: bool = True):
    cfg, _, _, dcfg = model
    kw = {"row_groups": groups, "union_experts": union} if groups > 1 else {}
    return make_plan(cfg, 4, spin_bound_ns=BOUND, **kw), make_plan(dcfg, 4, spin_bound_ns=BOUND, **kw)


def _pair(model, b: int, union: bool = True, grid: int = 8, **kw) -> SpecPair:
    """The plans are for 4 SMs (their tiles, so the bits, those of the B = 1 runs); `grid` blocks run them."""
    cfg, w, agree, _ = model
    plan, dplan = _plans(model, b, union)
    return SpecPair(w, plan, dplan, [KVCache(cfg) for _ in range(b)], batch=b, agree=agree, backend="emu",
                    grid=grid, **kw)


def _committed(cache: KVCache, ctx: int) -> list[torch.Tensor]:
    """The K and V rows of every position the cache still holds at context ctx: every committed one
    in a global layer, the window's last positions in a sliding one (trees verified past ctx, also
    by a request that has finished while others have not, overwrite the older ring slots)."""
    cfg = cache.cfg
    out = []
    for layer in range(cfg.n_layers):
        slots = cache.slot(layer, torch.tensor(list(decode_mod._resident(cfg, layer, ctx, ctx)), dtype=torch.long))
        out += [cache.k[layer][..., slots, :].clone(), cache.v[layer][..., slots, :].clone()]
    return out


@pytest.fixture(scope="module")
def alone(model):
    """Each of the B_MOST requests decoded by itself (B = 1, the same 16-token tree, mega, random):
    its tokens, histogram, final context and committed KV rows."""
    prompts = prompts_for(model[0], B_MOST, 8, 0)
    out = []
    for p in prompts:
        pair = _pair(model, 1)
        got = decode(pair, [p], N, "mega", poison=True).read
        out.append((got.tokens[0], got.hist[0], got.ctx[0], _committed(pair.caches[0], got.ctx[0])))
    return prompts, out


def _run(model, alone, b: int, mode: str, schedule: str, union: bool = True):
    prompts, _ = alone
    # the union on 8 blocks: more than tiny's MoE combine units, so some block runs another
    # group's combine units and none of group 0's (the union's wait for its slot count shows there)
    pair = _pair(model, b, union, 8 if union else 4, emu_schedule=schedule, emu_seed=5)
    assert pair.T == model[0].max_tree and isinstance(pair.target, GroupEngine)
    return pair, decode(pair, prompts[:b], N, mode, check=True, poison=True)


def _differences_from_alone(pair, got, alone) -> list[str]:
    out = []
    for r, (tokens, hist, ctx, kv) in enumerate(alone[1][:pair.B]):
        if got.tokens[r] != tokens:
            out.append(f"request {r}: tokens")
        if got.hist[r] != hist:
            out.append(f"request {r}: histogram {got.hist[r]} against {hist}")
        if got.ctx[r] != ctx:
            out.append(f"request {r}: context {got.ctx[r]} against {ctx}")
        elif not all(torch.equal(a, b) for a, b in zip(_committed(pair.caches[r], ctx), kv)):
            out.append(f"request {r}: committed KV rows")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("b,mode,schedule,union", [(2, "mega", "random", True), (3, "mega", "last", True),
                                                   (2, "mega", "block", True), (3, "chain", "random", True),
                                                   (3, "mega", "random", False)])
def test_each_request_of_full_trees_decodes_as_alone_and_as_plain_greedy(model, alone, b, mode, schedule, union):
    """union (the default with row groups): both engines' routed experts once over the union of
    their groups' routing (Plan.union_experts), on 8 blocks: a token's expert output is the same
    dot products wherever its slot is; without it, the per-group ablation."""
    pair, out = _run(model, alone, b, mode, schedule, union)
    assert out.check.ok, out.check.problems
    assert [len(t) for t in out.read.tokens] == [N] * b
    assert _differences_from_alone(pair, out.read, alone) == []
    # every request its own acceptance: whole steps of the full tree, counted per request
    assert all(sum(h) >= 2 and len(h) == pair.T + 1 for h in out.read.hist)


@pytest.mark.slow
def test_a_request_verifying_another_requests_drafts_is_caught(model, alone, monkeypatch):
    """Mutation: every verify group's tree op reads group 0's top-2. The tokens stay plain greedy
    decoding's (a wrong draft is only rejected), so decode's check passes; request 1's acceptance
    is no longer its own, and the comparison with its B = 1 run fails."""
    first = {}

    def link(role, state, rows, table, top2):
        if role == "verify":
            top2 = first.setdefault("top2", top2)
        return SpecLink(role, state, rows, table, top2)

    monkeypatch.setattr(decode_mod, "SpecLink", link)
    pair, out = _run(model, alone, 2, "mega", "random")
    assert out.check.ok, out.check.problems
    assert any(d.startswith("request 1: histogram") for d in _differences_from_alone(pair, out.read, alone))


def test_grouped_spec_programs_keep_each_groups_spec_ops_where_the_design_puts_them(model):
    plan, dplan = _plans(model, 3)
    for p, spec in ((plan, "verify"), (dplan, "draft")):
        for mode in ("layer", "step"):
            prog = grouped(build(p, mode, spec=spec), 3)
            check(prog)
            kinds = [o.kind for o in prog.ops]
            first = ["tree"] * 3 if spec == "verify" else ["seed"] * 3
            assert kinds[:6] == first + ["embed"] * 3 and [o.group for o in prog.ops[:3]] == [0, 1, 2]
            if spec == "verify":
                f, n = prog.launches[-1]
                assert kinds[f:] == ["accept"] * 3 + ["compact"] * 3 + ["advance"] * 3 and n == 9
    # a verify program whose last launch lost one group's advance is refused
    prog = grouped(build(plan, "layer", spec="verify"), 2)
    f, n = prog.launches[-1]
    bad = type(prog)(prog.plan, prog.ops[:-1], prog.launches[:-1] + ((f, n - 1),), prog.n_counters, prog.mode,
                     prog.spec, prog.groups)
    with pytest.raises(AssertionError, match="accept launch last"):
        check(bad)


def test_full_trees_refuse_what_they_cannot_run(model):
    cfg, w, agree, dcfg = model
    assert tree_shape(cfg, 8, full=True)[0] == cfg.max_tree
    with pytest.raises(ConfigError, match="full trees take 1..8"):
        tree_shape(cfg, 9, full=True)
    plan, dplan = _plans(model, 2)
    with pytest.raises(ConfigError, match="both plans of at least 3 row groups"):
        SpecPair(w, plan, dplan, [KVCache(cfg) for _ in range(3)], batch=3, agree=agree, backend="emu")
    seeds = torch.zeros(cfg.vocab, 16, dtype=torch.int32)
    top2 = torch.zeros(2, 16, 2, dtype=torch.int32)
    state = torch.zeros(2, 2088, dtype=torch.int32)[:, :2086]
    mixed = [SpecLink("draft", state[0:1], (15,), seeds, top2[0]), SpecLink("verify", state[1:2], (16,), seeds, top2[1])]
    with pytest.raises(ConfigError, match="of one role"):
        GroupEngine(w, plan, [KVCache(cfg) for _ in range(2)], backend="emu", specs=mixed)
    profiled = make_plan(cfg, 4, spin_bound_ns=BOUND, row_groups=2, profile=True)
    links = [SpecLink("verify", state[g:g + 1], (16,), seeds, top2[g]) for g in range(2)]
    with pytest.raises(ConfigError, match="unprofiled"):
        GroupEngine(w, profiled, [KVCache(cfg) for _ in range(2)], backend="emu", specs=links)


@pytest.mark.parametrize("argv,msg", [(["--batch", "1", "--full-trees"], "--full-trees: a row group per request"),
                                      (["--batch", "2", "--ranks", "2", "--full-trees"], "--full-trees: a row group"),
                                      (["--batch", "9", "--full-trees"], "full trees take at most 8"),
                                      (["--batch", "4", "--per-group-experts"], "with --full-trees only")])
def test_decode_command_refuses_full_trees_it_cannot_run(argv, msg, capsys):
    from reports.cli import main

    assert main(["decode", "--preset", "tiny", *argv]) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.slow
def test_decode_command_checks_full_trees(capsys):
    """`megabench decode --preset tiny --batch 2 --full-trees --tokens 16 --check` in the emulation."""
    from microbench.device import no_gpu_reason

    from reports.cli import main

    if not no_gpu_reason():
        pytest.skip("a GPU is present: the command runs there, not in the emulation")
    assert main(["decode", "--preset", "tiny", "--batch", "2", "--full-trees", "--tokens", "16", "--check"]) == 0
    out = capsys.readouterr().out
    assert "2 request(s) of a 16-token tree" in out and "a row group per request (2 groups a step)" in out
    assert "routed experts over the union of the groups' routing" in out
    assert "check: passed" in out and "per request: 0:" in out


def test_a_new_spec_step_shape_keeps_the_parameter_blocks_where_the_graphs_read_them(model):
    """SpecPair captures CUDA graphs of the spec step's launches, which hold the address of each
    engine's parameter blocks; start() sets every run's contexts and caches afterwards. The blocks
    must change in place: a new buffer leaves the graphs replaying freed memory (an illegal address
    on the GPU, seen there; the emulation launches no graph, so this test holds the invariant)."""
    pair = _pair(model, 2)
    prompts = prompts_for(model[0], 2, 8, 0)
    at = {e: e._spec_params_dev.data_ptr() for e in (pair.target, pair.draft)}
    before = pair.target._spec_params_dev.clone()
    pair.start(prompts, 8, 7)
    assert {e: e._spec_params_dev.data_ptr() for e in (pair.target, pair.draft)} == at
    assert pair.draft._params_dev is pair.draft._spec_params_dev
    assert not torch.equal(before, pair.target._spec_params_dev)  # the contexts' caches, repacked in place

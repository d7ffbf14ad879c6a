"""Speculative decoding on the device: the drafter's pass, the verify tree, greedy acceptance, KV
compaction and the next step's state, all in megakernel launches, nothing read back between steps.

One step (SpecPair.launch_step), three parts:
  draft   the drafter's Engine (draft.DraftModel's weights, its own Plan and build of the same
          kernel source, reading the target's embedding, final norm and tiled LM head): `seed`
          writes request r's rows s_j = succ_d^j(root_r), then the pass (one launch per draft layer
          in mega mode); its argmax writes every row's top-2 into the pair's top-2 buffer;
  verify  the target's Engine, its spec program: `tree` builds each request's verify tree from its
          root and the draft's top-2 (speculative.build_tree's rule), then the target's step;
  accept  a launch of its own: `accept` (greedy walk: the path, the bonus, the emitted tokens),
          `compact` (the path's K/V to consecutive positions), `advance` (ctx, root, counts).
What a step reads is on the device (abi.py SPEC_FIELDS and the step block), so a run of steps is
the same launches again: on the GPU two CUDA graphs of each part, one per parity of the dependency
counters, replayed alternately; in the emulation the same launches in the same order. The parity
stays a launch parameter, baked into each graph: the loader warp's routing wait reads the counters
of its parity before the previous launch has ended (it never waits for that launch), so a parity
kept in device memory would be read before the launch that flips it has finished.

What the drafter conditions on: the root (the target's last emitted token) and its own successor
table, which agrees with the target's backbone on a fraction `agree` of the tokens (draft.py). It
reads none of the target's hidden features (DFlash conditions on those); `agree` is the knob that
sets how often the synthetic target departs from what the drafter can guess, so an acceptance
measured here is a property of the synthetic pair.

A run (SpecPair.run) is rounds of steps: a round launches k steps and reads nothing until its end,
then reads the requests' emitted counts. k is the most steps after which no request can finish
before the round's last step (a step emits at most the tree's depth + 1 tokens), so no step of a
round runs for a finished request at B = 1. A request that has emitted what it wants turns inactive
on the device (accept): its later steps emit and move nothing.

Correctness (decode(check=True)): greedy speculative output equals plain greedy decoding token for
token, the plain run being T=1 megakernel steps of the same Engine (its plain program) from the same
prefill, and the KV rows of every position both runs committed agree within REL_TOL (a skipped
compaction leaves another node's K/V there, far outside it). With the verifier as R tensor-parallel
ranks (SpecPair's ranks), the plain run is the unsharded build (the same TP build at R = 1) and
every rank's copy of the speculative state and its step contexts must also be rank 0's, bitwise.

One process per GPU (torchrun, `megabench decode --ranks R --where torchrun`; rank_main): each
process holds a SpecPair of its rank (SpecPair's link): the verifier a plain Engine of the rank's
shard with its RankLink (receive slots in peer memory) and its copy of the state, and a drafter of
its own. Every process runs the same steps; rank 0 gathers every rank's emitted tokens, state and
kv heads, checks them (decode_rank) and writes the summary that the launching process prints
and saves (run_torchrun).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from microbench.atomic import write_json
from microbench.errors import MegabenchError
from microbench.results import Derived, Env, Result, Series
from microbench.xgpu import world

from . import abi, speculative, tree as treelib
from .config import ConfigError, ModelConfig
from .config import preset as get_preset
from .draft import DraftConfig, DraftModel, draft_model_config
from .groups import GroupEngine
from .plan import MAX_ROW_GROUPS, Plan
from .plans import REL_TOL, constants_env, plan_for
from .ranks import (RankEngine, RankRecord, end_rank, gather_problems, launch_torchrun, open_rank, rank_engine,
                    rank_role, start_rank)
from .reference import KVCache, Request
from .runtime import Engine, RankLink, SpecLink
from .weights import ModelWeights, generate

BATCHES = (1, 2, 4, 8)  # requests of a speculative step: max_tree / B tree tokens each
PROMPT_LEN = 8  # tokens of each request's random prompt (decode's default)
BENCHMARK = "megakernel.decode"
DECODE_MODULE = "megakernel.decode"  # what torchrun starts in each process (rank_main)
PARTS = ("draft", "verify", "accept")
# The committed KV rows of the speculative run against the plain run's: a row of the same token
# agrees within REL_TOL unless a router near-tie flipped one of its experts in one run and not the
# other (real routing: the runs' rows see different batch shapes), which moves it by a fraction of
# this bound; a row left by a missed compaction or a stale step is another node's K/V, an unrelated
# vector about sqrt(2) away. Rows above REL_TOL are counted and printed as flips.
KV_ROW_TOL = 0.5


def tree_shape(cfg: ModelConfig, batch: int, full: bool = False) -> tuple[int, list[int], int]:
    """(T, parents, branch depth) of each request's verify tree in a step of `batch` requests: T =
    max_tree / B tokens on binary_ish(T, min(3, (T - 2) // 2)), the study's binary_ish(16, 3) at B =
    1 (a 12-deep main chain, top-2 siblings at depths 1-3), a chain where no sibling fits (T = 2).
    full: every request the whole max_tree-token tree (the study's at every B), one request per row
    group (SpecPair's full trees). The drafter guesses T - 1 slots per request."""
    if full:
        if not (isinstance(batch, int) and 1 <= batch <= MAX_ROW_GROUPS):
            raise ConfigError(f"batch {batch!r}: full trees take 1..{MAX_ROW_GROUPS} requests (a row group each)")
        batch = 1  # each request's tree is a B = 1 step's
    if batch not in BATCHES or cfg.max_tree % batch or cfg.max_tree // batch < 2:
        raise ConfigError(f"batch {batch!r}: a speculative step takes {', '.join(map(str, BATCHES))} requests of "
                          f"{cfg.max_tree} / B >= 2 tree tokens each")
    t = cfg.max_tree // batch
    bd = max(0, min(3, (t - 2) // 2))
    parents = treelib.binary_ish(t, bd) if bd else treelib.chain(t)
    speculative.tree_ranks(parents)  # the drafter's top-2 names every node
    return t, parents, bd


def seed_table(succ: torch.Tensor) -> torch.Tensor:
    """[V][SEED_COLS] int32: row v holds succ^j(v) for j = 0..SEED_COLS-1 (the seed op's table)."""
    cols = [torch.arange(succ.numel(), device=succ.device)]
    for _ in range(abi.SEED_COLS - 1):
        cols.append(succ[cols[-1]])
    return torch.stack(cols, dim=1).to(torch.int32).contiguous()


def tree_table(parents: Sequence[int], n_req: int, max_tree: int, device) -> torch.Tensor:
    """[max_tree][TREE_INTS] int32: each step row's node of its request's tree (every request the
    same shape): parent and ancestor bits relative to the request's first row, depth, rank."""
    assert [n for n, _ in abi.TREE_FIELDS] == ["parent", "depth", "rank", "anc"]
    ranks = speculative.tree_ranks(parents)
    anc = treelib.ancestor_mask(parents)
    node = [[int(p), d, k, sum(1 << j for j in range(len(parents)) if anc[i, j])]
            for i, (p, (d, k)) in enumerate(zip(parents, ranks))]
    rows = node * n_req
    if len(rows) > max_tree:
        raise ConfigError(f"{n_req} trees of {len(parents)} tokens: more than the step's {max_tree} rows")
    rows += [[0] * abi.TREE_INTS] * (max_tree - len(rows))
    return torch.tensor(rows, dtype=torch.int32, device=device)


def max_tokens(cfg: ModelConfig, batch: int, prompt_len: int, full: bool = False) -> int:
    """The most tokens a request of a run may ask for: its emitted tokens fit MAX_OUT, and every
    step, also one after the request has finished, fits the target's cache (the last active step
    may overshoot by the tree's depth; later ones verify a whole tree past that)."""
    t, parents, _ = tree_shape(cfg, batch, full)
    emit = max(treelib.depths(parents)) + 1
    by_cache = cfg.max_context - (prompt_len - 1) - emit - t + 1
    return max(0, min(abi.MAX_OUT - t, by_cache))


def prefill_steps(engine, cfg: ModelConfig, batch: int, prompts: Sequence[Sequence[int]], mode: str = "mega",
                  full: bool = False) -> int:
    """Cache every request's prompt but its last token with `engine`'s plain steps (an Engine, a
    RankEngine, or with full trees a GroupEngine): chain-shaped chunks of max_tree / B tokens a
    request (full: max_tree, a row group each). Returns the context."""
    lens = {len(p) for p in prompts}
    if len(prompts) != batch or len(lens) != 1 or min(lens) < 1:
        raise ConfigError(f"{len(prompts)} prompts of lengths {sorted(lens)}: want {batch} of one length >= 1")
    n, chunk, ctx = min(lens) - 1, cfg.max_tree // (1 if full else batch), 0
    while ctx < n:
        k = min(chunk, n - ctx)
        engine.step_batch([Request([int(x) for x in p[ctx:ctx + k]], treelib.chain(k), ctx) for p in prompts],
                          mode=mode)
        ctx += k
    return n


def prompts_for(cfg: ModelConfig, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`batch` random prompts of `prompt_len` tokens from `seed` (the same in every process)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]


# what rank 0 compares of every rank's copy (ranks.gather_problems keys)
STATE, CONTEXTS, TOKENS = "speculative state", "step context", "emitted tokens"


def spec_state_differences(a, b) -> list[str]:
    """Where speculative state `a` (int32 [B, SPEC_INTS], abi.SPEC_FIELDS) differs from `b`,
    bitwise: each field that differs, with its first request that does and both values."""
    a, b = torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()
    if a.shape != b.shape:
        return [f"shape {tuple(a.shape)} against {tuple(b.shape)}"]
    o = abi.spec_offsets()
    out = []
    for name, n in abi.SPEC_FIELDS:
        x, y = a[:, o[name]:o[name] + n], b[:, o[name]:o[name] + n]
        if not torch.equal(x, y):
            r = int((x != y).any(dim=1).nonzero()[0])
            out.append(f"{name} of request {r} ({x[r].tolist()[:8]} against {y[r].tolist()[:8]})")
    return out


RANK_COMPARE = {STATE: spec_state_differences}


@dataclass
class StepTimes:
    """One step's parts (s): the draft launches, the verify launches, the accept launch, and the
    step's wall time (to the next step's start within a round). GPU: CUDA events between the
    parts' graph replays; emulation: host time of the emulated launches, not a GPU timing."""
    draft: float
    verify: float
    accept: float
    wall: float

    @property
    def gaps(self) -> float:
        return self.wall - self.draft - self.verify - self.accept


@dataclass
class RunStats:
    steps: list[StepTimes] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # steps per round
    timer: str = "host"  # "cuda_event" (GPU) or "host" (emulation)

    @property
    def seconds(self) -> float:
        return float(sum(s.wall for s in self.steps))


@dataclass
class SpecRead:
    """What the host reads at the end of a run, per request."""
    tokens: list[list[int]]  # emitted tokens, cut to what the run asked for
    emitted: list[int]  # tokens emitted (the last step may overshoot what was asked)
    hist: list[list[int]]  # hist[r][a]: steps of request r that emitted a tokens
    ctx: list[int]  # each request's cached positions after the run

    def lengths(self) -> list[int]:
        """Every step's acceptance length (tokens emitted), all requests, from the device counts."""
        return [a for h in self.hist for a, n in enumerate(h) for _ in range(n)]


class SpecPair:
    """The drafter's Engine and the target's for B requests (request r on caches[r]), sharing the
    speculative state (abi.SPEC_FIELDS), the draft's top-2 and the target's embedding / LM head.

    ranks R > 1 (the plan a TP build of R ranks in one launch: make_plan(tp_ranks=R,
    launch_ranks=R)): the verifier is a RankEngine (ranks.py), R ranks in one launch (the CPU
    emulation, or one GPU with its SMs shared out), each rank its kv heads of caches[r] and its
    expert-row shard. Each rank runs the verify spec program (tree, the TP step, accept / compact /
    advance) on its own copy of the speculative state (`states[k]`): every rank's LM head and
    argmax compute the same bits (the all-reduce and gathers sum in one fixed order), so every
    rank's accept walks the same path, and the copies stay equal (decode(check=True) asserts it);
    compact on rank k moves only its kv heads (units: layers x its kv heads x requests).
    The drafter runs once, unsharded, in launches of its own before the ranks' verify launches:
    its seed reads rank 0's state (equal to every rank's) and its argmax writes the one top-2 that
    every rank's tree op reads. Replicating it on each rank would compute the same bits R times in
    launches that share the same device (the emulation, one GPU).

    `link` (one process per GPU, torchrun: the plan a TP build of R ranks, one a launch,
    make_plan(tp_ranks=R)): this process's rank link.rank alone. Its verifier is a plain Engine
    (ranks.rank_engine: its shard, its kv heads of caches[r], the RankLink whose receive slots are
    in peer memory) with its one copy of the state, and the pair holds a drafter of its own: the
    tree op reads the top-2 from this GPU's memory, and the drafter is a small fraction of a step,
    so each process computing the same top-2 costs less than sending it across GPUs every step
    (and needs no step of one GPU to wait for another's drafter). Every process runs the same
    steps; the ranks meet only at the verifier's collectives, so a process that runs a step the
    others do not waits at its first collective until its watchdog's bound (a wait that gives
    up). The caches' other kv heads are not written here (decode_rank gathers them on rank 0)."""

    def __init__(self, w: ModelWeights, plan: Plan, draft_plan: Plan, caches: Sequence[KVCache], *, batch: int = 1,
                 agree: float = 1.0, backend: str = "gpu", grid: int | None = None, emu_seed: int = 1,
                 emu_schedule: str = "random", ranks: int = 1, link: RankLink | None = None):
        if plan.row_groups > 1 or draft_plan.row_groups > 1:
            if ranks != 1 or link is not None or plan.row_groups < batch or draft_plan.row_groups < batch or batch < 2:
                raise ConfigError(f"full trees for {batch} requests: one rank, and both plans of at least {batch} row "
                                  f"groups, B >= 2 (got {plan.row_groups} and {draft_plan.row_groups}, {ranks} ranks)")
        if not isinstance(ranks, int) or ranks < 1:
            raise ConfigError(f"ranks {ranks!r}: want a positive number of tensor-parallel ranks")
        if link is not None:
            if ranks < 2 or plan.tp_ranks != ranks or plan.launch_ranks != 1 or not 0 <= link.rank < ranks:
                raise ConfigError(f"a pair of one process's rank (link: rank {link.rank}) of {ranks}: the verifier's "
                                  f"plan must be a TP build of {ranks} ranks, one a launch (make_plan(tp_ranks={ranks}))"
                                  f", got tp_ranks {plan.tp_ranks}, launch_ranks {plan.launch_ranks}")
        elif ranks > 1 and (plan.tp_ranks != ranks or plan.launch_ranks != ranks):
            raise ConfigError(f"{ranks} ranks: the verifier's plan must be a TP build of {ranks} ranks in one launch "
                              f"(make_plan(tp_ranks={ranks}, launch_ranks={ranks})), got tp_ranks {plan.tp_ranks}, "
                              f"launch_ranks {plan.launch_ranks}")
        if ranks == 1 and (plan.tp_ranks > 1 or plan.launch_ranks > 1):
            raise ConfigError(f"a plan of {max(plan.tp_ranks, plan.launch_ranks)} ranks: pass ranks= to match")
        cfg = w.cfg
        self.w, self.cfg, self.B, self.ranks, self.link = w, cfg, batch, ranks, link
        self.full = plan.row_groups > 1  # each request the whole tree, in a row group of its own
        self.T, self.parents, self.branch_depth = tree_shape(cfg, batch, self.full)
        self.dm = DraftModel(w, DraftConfig(agree=agree, n_slots=self.T - 1))
        if draft_plan.cfg != self.dm.cfg:
            raise ConfigError(f"draft plan for {draft_plan.cfg.name}, the drafter is {self.dm.cfg.name}")
        if draft_plan.tp_ranks or draft_plan.launch_ranks > 1:
            raise ConfigError("the drafter runs unsharded: its plan is one rank (no tp_ranks, launch_ranks 1)")
        if len(caches) != batch:
            raise ConfigError(f"{len(caches)} KV caches for {batch} requests (one each)")
        dev = w.device
        self._caches = list(caches)
        if self.full:
            self._init_groups(plan, draft_plan, backend, grid, emu_seed, emu_schedule)
            return
        # one copy of the speculative state per rank here (rank k's accept and advance write states[k]);
        # one process's rank (link): its own copy alone
        here = 1 if link is not None else ranks
        self.states = [torch.zeros(batch, abi.SPEC_INTS, dtype=torch.int32, device=dev) for _ in range(here)]
        self.state = self.states[0]  # what the drafter reads and the host reads back
        self.top2 = torch.zeros(self.dm.cfg.max_tree, 2, dtype=torch.int32, device=dev)
        kw = dict(backend=backend, grid=grid, emu_seed=emu_seed, emu_schedule=emu_schedule)
        table = tree_table(self.parents, batch, cfg.max_tree, dev)
        links = [SpecLink("verify", st, (self.T,) * batch, table, self.top2) for st in self.states]
        if link is not None:
            self.target = rank_engine(w, plan, list(caches), link, spec=links[0], **kw)
            self.verifiers = [self.target]
        elif ranks == 1:
            self.target = Engine(w, plan, list(caches), spec=links[0], **kw)
            self.verifiers = [self.target]
        else:
            self.target = RankEngine(w, plan, list(caches), spec=links, **kw)
            self.verifiers = list(self.target.engines)
        self.draft_caches = [KVCache(self.dm.cfg, device=dev) for _ in range(batch)]
        # the drafter under the 'rank' schedule (one rank of its own) gets the random one
        dkw = {**kw, "emu_schedule": "random" if emu_schedule == "rank" else emu_schedule}
        self.draft = Engine(self.dm.w, draft_plan, self.draft_caches, spec=SpecLink(
            "draft", self.state, (self.T - 1,) * batch, seed_table(self.dm.w.succ), self.top2),
            share=self.verifiers[0], **dkw)
        self.gpu = backend == "gpu"
        self._graphs = {}

    def _init_groups(self, plan: Plan, draft_plan: Plan, backend: str, grid, emu_seed: int, emu_schedule: str) -> None:
        """Full trees: the verifier and the drafter as GroupEngines, request g in row group g of
        each, with its own SpecLink: its row of the state, the one tree table (every request's tree
        is the B = 1 shape), its own top-2 rows (its draft group's argmax writes them, its verify
        group's tree reads them). Each group's spec ops see a step of one request, so every request
        runs its B = 1 speculative step, bit for bit (test_megakernel_spec_groups)."""
        B, cfg, dev = self.B, self.cfg, self.w.device
        # request g's state row at a 16-byte aligned address (Params.spec, runtime._ptr): rows padded
        # to a multiple of 4 ints, each group's link a one-row view
        pad = -(-abi.SPEC_INTS // 4) * 4
        self._state_rows = torch.zeros(B, pad, dtype=torch.int32, device=dev)
        self.state = self._state_rows[:, :abi.SPEC_INTS]
        self.states = [self.state]
        self.top2 = torch.zeros(B, self.dm.cfg.max_tree, 2, dtype=torch.int32, device=dev)
        table = tree_table(self.parents, 1, cfg.max_tree, dev)
        seeds = seed_table(self.dm.w.succ)
        kw = dict(backend=backend, grid=grid, emu_seed=emu_seed, emu_schedule=emu_schedule)
        vlinks = [SpecLink("verify", self.state[g:g + 1], (self.T,), table, self.top2[g]) for g in range(B)]
        self.target = GroupEngine(self.w, plan, list(self._caches), specs=vlinks, **kw)
        self.verifiers = [self.target]
        self.draft_caches = [KVCache(self.dm.cfg, device=dev) for _ in range(B)]
        dlinks = [SpecLink("draft", self.state[g:g + 1], (self.T - 1,), seeds, self.top2[g]) for g in range(B)]
        self.draft = GroupEngine(self.dm.w, draft_plan, self.draft_caches, specs=dlinks, share=self.target.lead, **kw)
        self.gpu = backend == "gpu"
        self._graphs = {}

    @property
    def caches(self) -> list[KVCache]:
        """The requests' KV caches (at R ranks, every rank writes its kv heads of them in place)."""
        return self._caches

    @property
    def max_emit(self) -> int:
        """Tokens a step emits at most per request: the tree's depth + 1 (the bonus)."""
        return max(treelib.depths(self.parents)) + 1

    # ------------------------------------------------------------------ setup
    def poison(self) -> None:
        """NaN in every float scratch buffer and KV cache of both engines, so a read of a row no
        step wrote shows in the result (before prefill: it writes the prompt's rows)."""
        self.target.poison()
        self.draft.poison()
        for c in (*self.caches, *self.draft.caches):
            for t in (*c.k, *c.v):
                t.fill_(float("nan"))

    def _poison_rows(self) -> None:
        """Wrong (in-range) values in what the spec ops write before it is read: the verify rows'
        tokens, depths and ancestor masks (tree), the draft rows' tokens (seed), the top-2 (the
        draft's argmax) and each request's path, length and bonus (accept)."""
        v = self.cfg.vocab - 1
        groups = lambda e: e.members if isinstance(e, GroupEngine) else [e]  # noqa: E731
        for e in (m for x in self.verifiers for m in groups(x)):
            e.tokens_t.fill_(v)
            e.depth_t.fill_(0)
            e.anc_t.fill_(1)
        for e in groups(self.draft):
            e.tokens_t.fill_(v)
        self.top2.fill_(v)
        o = abi.spec_offsets()
        for st in self.states:
            st[:, o["path"]:o["path"] + dict(abi.SPEC_FIELDS)["path"]] = self.T - 1
            st[:, o["len"]] = self.T
            st[:, o["bonus"]] = v

    def prefill(self, prompts: Sequence[Sequence[int]], mode: str = "mega") -> int:
        """Cache every request's prompt but its last token (the first root) with the target's plain
        steps: chain-shaped chunks of max_tree / B tokens a request. Returns the context."""
        return prefill_steps(self.target, self.cfg, self.B, prompts, mode, self.full)

    def start(self, prompts: Sequence[Sequence[int]], want: int, ctx: int, *, poison: bool = False) -> None:
        """The state of a run: request r's root is prompts[r][-1] at context `ctx` (prefill cached the
        rest), wanting `want` tokens; both engines' spec rows set (after any plain step)."""
        if len(prompts) != self.B or not all(len(p) for p in prompts):
            raise ConfigError(f"{len(prompts)} prompts for {self.B} requests: one non-empty prompt each")
        most = max_tokens(self.cfg, self.B, ctx + 1, self.full)
        if not 1 <= want <= most:
            raise ConfigError(f"{want} tokens per request: {self.cfg.name} with a prompt of {ctx + 1} holds 1..{most} "
                              f"({abi.MAX_OUT} emitted tokens at most, {self.cfg.max_context} cached positions)")
        st = torch.zeros(self.B, abi.SPEC_INTS, dtype=torch.int32)
        o = abi.spec_offsets()
        st[:, o["root"]] = torch.tensor([int(p[-1]) for p in prompts], dtype=torch.int32)
        st[:, o["want"]] = want
        for x in self.states:
            x.copy_(st)
        if poison:
            self._poison_rows()
        self.target.set_spec_rows([ctx] * self.B)
        self.draft.set_spec_rows([0] * self.B)

    # ------------------------------------------------------------------ steps
    def launch_part(self, i: int, mode: str) -> None:
        """Part i of a step (PARTS: 0 the draft pass, 1 the verify launches, 2 the accept launch),
        reading nothing. The parts of a step run in order (the target's counters turn after 2)."""
        n = len(self.target.launches(mode, self.target.spec_program))
        if i == 0:
            self.draft.launch_step(mode)
        elif i == 1:
            self.target.launch_step(mode, spec=True, part=range(n - 1))
        else:
            self.target.launch_step(mode, spec=True, part=range(n - 1, n))

    def part_launches(self, mode: str = "mega") -> tuple[int, int, int]:
        """Kernel launches of each part of a step (draft, verify, accept) in `mode`."""
        n = len(self.target.launches(mode, self.target.spec_program))
        return len(self.draft.launches(mode)), n - 1, 1

    def launch_step(self, mode: str = "mega") -> None:
        """One step's launches, in order (draft, verify, accept), reading nothing."""
        for i in range(len(PARTS)):
            self.launch_part(i, mode)

    def _capture(self, mode: str):
        """Two CUDA graphs of each part (draft, verify, accept), for the counters' two parities (the
        capture leaves the engines' parity bookkeeping where it was: two steps). Danger: the
        launches' parameters (the parity, the buffers) are baked in: a graph replays only with this
        pair's buffers alive, in the parity order it was captured in, starting from the parity the
        engines are at when it is captured (run replays from graphs[0] after an even number of
        replayed steps, which note_replayed keeps true)."""
        now = (self.draft.parity, self.target.parity)
        got = self._graphs.get(mode)
        if got is not None and now == got[1]:
            return got[0]
        if got is not None and now == (got[1][0] ^ 1, got[1][1] ^ 1):
            return got[0][1:] + got[0][:1]  # the engines are one step on: graphs[1] first
        graphs = []
        for _ in range(2):
            parts = []
            for i in range(len(PARTS)):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self.launch_part(i, mode)
                parts.append(g)
            graphs.append(parts)
        self._graphs[mode] = (graphs, now)
        return graphs

    def step_graph(self, mode: str = "mega", steps: int = 2):
        """One CUDA graph of `steps` whole steps (an even number: the counters' parities alternate
        and every replay starts from clean counters), for timing a step as a benchmark case does
        (each replay advances the state like the steps it holds). warm_up() first."""
        if not self.gpu or steps < 2 or steps % 2:
            raise ConfigError(f"step_graph: an even number of steps >= 2 on the GPU, got {steps} ({self.target.backend})")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(steps):
                self.launch_step(mode)
        return g

    def _mark(self):
        if self.gpu:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _between(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.gpu else b - a

    def _counts(self) -> tuple[list[int], list[int]]:
        o = abi.spec_offsets()
        st = self.state[:, [o["n_out"], o["want"]]].cpu()
        return st[:, 0].tolist(), st[:, 1].tolist()

    def _check_watchdogs(self, mode: str) -> None:
        if self.gpu:
            torch.cuda.synchronize()
        self.draft._check_watchdog(mode == "mega")
        self.target._check_watchdog(mode == "mega")

    def warm_up(self, mode: str = "mega") -> None:
        """GPU: one step outside any graph (module loads, shared-memory attributes, co-residency
        checks) and the graphs captured. It advances the state: start() the run afterwards."""
        if self.gpu:
            self.launch_step(mode)
            self._check_watchdogs(mode)
            self._capture(mode)

    def run(self, mode: str = "mega", progress: Callable[[str], None] | None = None) -> RunStats:
        """Steps until every request has emitted what it wants (start()), in rounds (module
        docstring). GPU: the captured graphs (warm_up), CUDA events between the parts."""
        graphs = self._capture(mode) if self.gpu else None
        stats = RunStats(timer="cuda_event" if self.gpu else "host")
        k_all = 0
        while True:
            n_out, want = self._counts()
            left = [w - n for n, w in zip(n_out, want) if n < w]
            if progress is not None:
                progress(f"round {len(stats.rounds)}: {sum(min(n, w) for n, w in zip(n_out, want))}/{sum(want)} tokens "
                         f"after {len(stats.steps)} steps")
            if not left:
                break
            k = max(1, -(-min(left) // self.max_emit))
            marks = []
            for j in range(k):
                m = [self._mark()]
                for i in range(len(PARTS)):
                    if graphs is not None:
                        graphs[k_all % 2][i].replay()
                    else:
                        self.launch_part(i, mode)
                    m.append(self._mark())
                marks.append(m)
                k_all += 1
                if progress is not None and not self.gpu:
                    progress(f"  step {len(stats.steps) + j + 1} launched (round {len(stats.rounds)}, {j + 1} of {k})")
            self._check_watchdogs(mode)
            for j, m in enumerate(marks):
                end = marks[j + 1][0] if j + 1 < len(marks) else m[3]
                stats.steps.append(StepTimes(*(self._between(m[i], m[i + 1]) for i in range(3)),
                                             self._between(m[0], end)))
            stats.rounds.append(k)
        if graphs is not None:  # the graphs' steps ran without launch_step: its bookkeeping follows them
            for eng in (self.draft, self.target):
                eng.note_replayed(k_all, mode)
        return stats

    def read(self) -> SpecRead:
        """The requests' emitted tokens, counts, acceptance histograms and contexts (one copy)."""
        o = abi.spec_offsets()
        st = self.state.cpu()
        ctx = (self.target.contexts() if self.full
               else self.verifiers[0].step_t.cpu()[abi.step_offsets()["ctx"]:][:self.B].tolist())
        out = []
        for r in range(self.B):
            n, want = int(st[r, o["n_out"]]), int(st[r, o["want"]])
            out.append(st[r, o["out"]:o["out"] + min(n, want)].tolist())
        return SpecRead(out, st[:, o["n_out"]].tolist(), st[:, o["hist"]:o["hist"] + self.T + 1].tolist(), ctx)

    def rank_records(self) -> list[RankRecord]:
        """Each rank's speculative state and step contexts held here (one process's rank: its own),
        as rank 0 compares them (rank_problems, decode_rank)."""
        ctx_at = abi.step_offsets()["ctx"]
        k0 = self.link.rank if self.link is not None else 0
        return [RankRecord(k0 + k, None, {STATE: st.cpu(), CONTEXTS: e.step_t.cpu()[ctx_at:ctx_at + self.B]})
                for k, (st, e) in enumerate(zip(self.states, self.verifiers))]

    def rank_problems(self) -> list[str]:
        """At R ranks in one launch: where a rank's speculative state (abi.SPEC_FIELDS: its emitted
        tokens, counts, path, root, histogram) or its step contexts differ from rank 0's, bitwise;
        empty when every rank's copy is rank 0's (each rank's accept decided the same path every
        step). One process's rank: empty (decode_rank compares the gathered copies)."""
        if self.full:  # one rank
            return []
        recs = self.rank_records()
        return gather_problems(recs, len(recs), RANK_COMPARE) if self.link is None else []

    def plain_greedy(self, prompts: Sequence[Sequence[int]], n: int, ctx: int, mode: str = "mega") -> list[list[int]]:
        """Plain greedy decoding of n tokens per request from the prefilled caches: T=1 steps of the
        target's plain program (all requests in one step, each bitwise its own B=1 step)."""
        return greedy(self.target, prompts, n, ctx, mode)

    def unsharded(self) -> tuple[RankEngine, list[KVCache]]:
        """At R ranks: the unsharded build of the verifier's plan (the same TP build at R = 1: one
        rank holding every head and expert row, whose bits every R reproduces, test_megakernel_tp)
        and its KV caches (one per request, its own), for the check's plain run."""
        if self.ranks == 1:
            raise ConfigError("unsharded: the pair's verifier is one rank already")
        plan = replace(self.target.plan, tp_ranks=1, launch_ranks=1)
        caches = [KVCache(self.cfg, device=self.w.device) for _ in range(self.B)]
        return RankEngine(self.w, plan, caches, backend=self.target.backend, emu_seed=self.target.emu_seed,
                          emu_schedule=self.target.emu_schedule), caches


def greedy(engine, prompts: Sequence[Sequence[int]], n: int, ctx: int, mode: str = "mega") -> list[list[int]]:
    """n T=1 greedy steps of `engine`'s plain program (an Engine or a RankEngine: its rank 0's
    tokens) for every request at once, from context `ctx`, each request's root its prompt's last."""
    roots = [int(p[-1]) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for k in range(n):
        step = engine.step_batch([Request([t], [-1], ctx + k) for t in roots], mode=mode)
        roots = step.tokens.tolist()
        for r, t in enumerate(roots):
            out[r].append(int(t))
    return out


# ---------------------------------------------------------------------- a whole run, checked
@dataclass
class DecodeCheck:
    tokens_equal: list[bool]  # per request: speculative == plain greedy, token for token
    first_diff: list[int | None]  # per request: the first position where they differ
    kv_rel_err: float  # the worst per-position relative error of the committed KV rows, spec vs plain
    kv_worst: str  # where it is
    kv_rows: int  # rows compared (positions x layers x K and V x requests)
    kv_flips: int  # of them, rows above REL_TOL (a router near-tie: KV_ROW_TOL)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class PlainRun:
    """Plain greedy decoding from a prefill: each request's tokens and its KV caches afterwards."""
    tokens: list[list[int]]
    caches: list[KVCache]
    ctx: int  # the cached positions after the run (prefill + the tokens' roots)


@dataclass
class DecodeOutcome:
    read: SpecRead
    stats: RunStats
    report: speculative.AcceptanceReport
    check: DecodeCheck | None
    plain: PlainRun | None = None


def _resident(cfg: ModelConfig, layer: int, c_spec: int, c_plain: int) -> range:
    """Positions whose K/V both runs still hold in `layer`: every committed one in a global layer;
    in a sliding one the last W before the spec run's end (later trees overwrote the older ring
    slots) that the plain run's ring also holds."""
    hi = min(c_spec, c_plain)
    if cfg.is_global(layer):
        return range(0, hi)
    return range(max(0, c_spec - cfg.window, c_plain - cfg.ring_slots), hi)


def compare_kv(cfg: ModelConfig, spec: Sequence[KVCache], plain: Sequence[KVCache], c_spec: Sequence[int],
               c_plain: Sequence[int]) -> tuple[float, str, int, int]:
    """Per committed position both runs hold, the relative error (over heads and head_dim) of the
    speculative run's K row and V row against the plain run's: (the worst, where, rows compared,
    rows above REL_TOL). A row that is not finite counts as inf."""
    worst, where, rows, over = 0.0, "no rows compared", 0, 0
    for r, (a, b) in enumerate(zip(spec, plain)):
        for l in range(cfg.n_layers):
            pos = list(_resident(cfg, l, c_spec[r], c_plain[r]))
            if not pos:
                continue
            for name, ta, tb in (("K", a.k[l], b.k[l]), ("V", a.v[l], b.v[l])):
                sl = torch.tensor([a.slot(l, p) for p in pos], device=ta.device)
                x, y = ta[:, sl].double().cpu(), tb[:, sl].double().cpu()  # [Hkv, n, hd]
                num = (x - y).pow(2).sum(dim=(0, 2)).sqrt()
                den = y.pow(2).sum(dim=(0, 2)).sqrt().clamp_min(1e-30)
                err = torch.where(torch.isfinite(num), num / den, torch.full_like(num, float("inf")))
                rows, over = rows + len(pos), over + int((~(err <= REL_TOL)).sum())
                i = int(torch.argmax(err))
                if not float(err[i]) <= worst:
                    worst, where = float(err[i]), f"request {r} layer {l} {name} position {pos[i]}"
    return worst, where, rows, over


def decode(pair: SpecPair, prompts: Sequence[Sequence[int]], n: int, mode: str = "mega", *, check: bool = False,
           poison: bool = False, progress: Callable[[str], None] | None = None,
           plain: PlainRun | None = None) -> DecodeOutcome:
    """Prefill, a speculative run of n tokens per request, its acceptance from the device counts,
    and with `check` the plain greedy run from the same prefill compared token for token and KV
    row for KV row (`plain`: that run already made, of at least n tokens, from the same prompts
    and weights). `poison`: NaN scratch and caches, wrong row inputs (SpecPair.poison)."""
    if poison:
        pair.poison()
    ctx = pair.prefill(prompts, mode)
    snap = [c.clone() for c in pair.caches] if check else None
    got, stats = _spec_run(pair, prompts, n, ctx, mode, poison, progress)
    rep = acceptance(pair, prompts, got)
    if not check:
        return DecodeOutcome(got, stats, rep, None)
    if plain is None:
        plain = plain_run(pair, prompts, n, ctx, snap, mode, progress)
    c = check_against_plain(pair.cfg, got, plain, pair.caches, n, pair.rank_problems())
    return DecodeOutcome(got, stats, rep, c, plain)


def _spec_run(pair: SpecPair, prompts, n: int, ctx: int, mode: str, poison: bool, progress) -> tuple[SpecRead, RunStats]:
    """From the prefill: the warm-up (GPU), the run's state, its steps and what it read."""
    pair.start(prompts, n, ctx)  # the warm-up step (GPU) verifies past the prefill, not over it
    pair.warm_up(mode)
    pair.start(prompts, n, ctx, poison=poison)
    stats = pair.run(mode, progress)
    return pair.read(), stats


def acceptance(pair: SpecPair, prompts, got: SpecRead) -> speculative.AcceptanceReport:
    """The run's acceptance from the device counts, and how often the emitted tokens follow the
    drafter's successor table."""
    f = t_all = 0
    for p, t in zip(prompts, got.tokens):
        a, b = speculative.follow_rate(pair.w.succ, [int(p[-1])] + t)
        f, t_all = f + a, t_all + b
    return speculative.summarise(got.lengths(), f / max(t_all, 1), len(prompts), pair.T, pair.branch_depth)


def check_against_plain(cfg: ModelConfig, got: SpecRead, plain: PlainRun, caches: Sequence[KVCache], n: int,
                        rank_problems: Sequence[str] = ()) -> DecodeCheck:
    """The speculative run (`got`, its KV `caches`) against plain greedy decoding, token for token
    and committed KV row for row, with the ranks' disagreements (`rank_problems`) among its problems."""
    equal, first = [], []
    for s, p in zip(got.tokens, plain.tokens):
        p = p[:n]
        equal.append(s == p)
        first.append(next((i for i, (x, y) in enumerate(zip(s, p)) if x != y), None if s == p else min(len(s), len(p))))
    c_spec, c_plain = got.ctx, [plain.ctx] * len(got.tokens)
    err, where, rows, flips = compare_kv(cfg, caches, plain.caches, c_spec, c_plain)
    problems = [f"request {r}: speculative tokens differ from plain greedy decoding from token {first[r]}"
                for r in range(len(got.tokens)) if not equal[r]]
    if not err <= KV_ROW_TOL:
        problems.append(f"a committed KV row differs from the plain run's: relative error {err:.3g} at {where} (another "
                        f"node's row, not a router near-tie: bound {KV_ROW_TOL:g})")
    if any(len(t) != n for t in got.tokens):
        problems.append(f"emitted {[len(t) for t in got.tokens]} tokens, asked for {n} per request")
    problems += list(rank_problems)
    return DecodeCheck(equal, first, err, where, rows, flips, problems)


def plain_run(pair: SpecPair, prompts: Sequence[Sequence[int]], n: int, ctx: int, prefilled: Sequence[KVCache],
              mode: str = "mega", progress: Callable[[str], None] | None = None) -> PlainRun:
    """Plain greedy decoding of n tokens per request from the prefilled caches `prefilled`. One
    rank: the pair's target (its plain program, T=1 steps), its caches given `prefilled` in place
    (the kernel holds their addresses) and afterwards what they held before. R ranks: the
    unsharded build (SpecPair.unsharded) on copies of `prefilled`; the pair is not touched."""
    if pair.ranks > 1:
        eng, caches = pair.unsharded()
        for c, s in zip(caches, prefilled):
            for a, b in zip(c.k + c.v, s.k + s.v):
                a.copy_(b)
        if progress is not None:
            progress(f"plain greedy decoding: {n} T=1 steps ({mode}) of the unsharded build (R = 1)")
        toks = greedy(eng, prompts, n, ctx, mode)
        return PlainRun(toks, [c.clone() for c in caches], ctx + n)
    before = [c.clone() for c in pair.caches]
    for c, s in zip(pair.caches, prefilled):
        for a, b in zip(c.k + c.v, s.k + s.v):
            a.copy_(b)
    if progress is not None:
        progress(f"plain greedy decoding: {n} T=1 steps ({mode})")
    toks = pair.plain_greedy(prompts, n, ctx, mode)
    out = PlainRun(toks, [c.clone() for c in pair.caches], ctx + n)
    for c, s in zip(pair.caches, before):
        for a, b in zip(c.k + c.v, s.k + s.v):
            a.copy_(b)
    return out


def plain_from_prompts(pair: SpecPair, prompts: Sequence[Sequence[int]], n: int, mode: str = "mega",
                       progress: Callable[[str], None] | None = None) -> PlainRun:
    """Plain greedy decoding of n tokens per request by the unsharded build (SpecPair.unsharded)
    from a prefill of its own (the same chunks as the pair's: the TP build's bits are the
    unsharded build's): the check of one process's rank, whose caches hold its kv heads alone."""
    eng, caches = pair.unsharded()
    ctx = prefill_steps(eng, pair.cfg, pair.B, prompts, mode)
    if progress is not None:
        progress(f"plain greedy decoding: a prefill and {n} T=1 steps ({mode}) of the unsharded build (R = 1)")
    toks = greedy(eng, prompts, n, ctx, mode)
    return PlainRun(toks, [c.clone() for c in caches], ctx + n)


def rank_record(pair: SpecPair, got: SpecRead | None, error: str | None, *, kv: bool) -> RankRecord:
    """What this process's rank sends rank 0 after a run: its error, or its emitted tokens, its
    state and step contexts (compared with rank 0's) and, with `kv`, its kv heads of every
    request's cache (not compared: rank 0 assembles the caches from them), under "kv"."""
    if error is not None or got is None:
        return RankRecord(pair.link.rank, error or "no run", {})
    data = {TOKENS: got.tokens, **pair.rank_records()[0].data}
    rec = RankRecord(pair.link.rank, None, data)
    if kv:
        h = pair.cfg.n_kv_heads // pair.ranks
        k = pair.link.rank
        return RankRecord(rec.rank, None, {**data, "kv": [[t[k * h:(k + 1) * h].cpu() for t in c.k + c.v]
                                                          for c in pair.caches]})
    return rec


def gathered_problems(records: Sequence[RankRecord], ranks: int) -> list[str]:
    """Rank 0's check of every rank's record (rank_record): every rank ran, and its emitted tokens,
    speculative state and step contexts are rank 0's, bitwise (the KV heads are each rank's own)."""
    strip = [RankRecord(r.rank, r.error, {k: v for k, v in r.data.items() if k != "kv"}) for r in records]
    return gather_problems(strip, ranks, RANK_COMPARE)


def assemble_kv(caches: Sequence[KVCache], records: Sequence[RankRecord], ranks: int) -> None:
    """Every rank's kv heads (rank_record's "kv") written into its heads of `caches` in place."""
    h = caches[0].cfg.n_kv_heads // ranks
    for rec in records:
        k = rec.rank
        for c, heads in zip(caches, rec.data["kv"]):
            for t, x in zip(c.k + c.v, heads):
                t[k * h:(k + 1) * h].copy_(x)


def decode_rank(pair: SpecPair, prompts: Sequence[Sequence[int]], n: int, mode: str = "mega", *, check: bool = False,
                poison: bool = False, gather: Callable[[object], list] = world.all_gather_object,
                barrier: Callable[[], None] = lambda: None,
                progress: Callable[[str], None] | None = None) -> tuple[DecodeOutcome | None, list[str]]:
    """decode() for one process's rank (SpecPair's link), every process calling it alike: the
    prefill, the run and its read; then every rank's record gathered (`gather`: a collective,
    world.all_gather_object) and, on rank 0, checked (gathered_problems) and with `check` the
    run against the unsharded build's plain greedy decoding on rank 0's GPU, KV rows assembled
    from every rank's heads. Returns (rank 0: the outcome, the other ranks: None; the problems of
    the gather, also inside the check's problems with `check`). `barrier` (a collective): after
    the poison, before the first step, so no rank pushes into a peer's slots being poisoned.
    A wait that gives up is caught and gathered as the rank's error (the others' waits give up too,
    each after its watchdog's bound)."""
    if pair.link is None:
        raise ConfigError("decode_rank: a pair of one process's rank (SpecPair(..., link=...)); decode() runs the rest")
    if poison:
        pair.poison()
    if pair.gpu:
        torch.cuda.synchronize()
    barrier()
    got, stats, err = None, None, None
    try:
        ctx = pair.prefill(prompts, mode)
        got, stats = _spec_run(pair, prompts, n, ctx, mode, poison, progress)
    except MegabenchError as e:
        err = str(e)
    records = gather(rank_record(pair, got, err, kv=check))
    if pair.link.rank != 0:
        return None, []
    problems = gathered_problems(records, pair.ranks)
    if got is None:
        return None, problems
    rep = acceptance(pair, prompts, got)
    if not check:
        return DecodeOutcome(got, stats, rep, None), problems
    if any(r.error or "kv" not in r.data for r in records):
        return None, problems
    assemble_kv(pair.caches, records, pair.ranks)
    plain = plain_from_prompts(pair, prompts, n, mode, progress)
    return DecodeOutcome(got, stats, rep, check_against_plain(pair.cfg, got, plain, pair.caches, n, problems),
                         plain), problems


def rank_main(argv=None) -> int:
    """One rank of `megabench decode --ranks R` under torchrun (RANK, WORLD_SIZE, LOCAL_RANK from
    its environment; run_torchrun starts it): a SpecPair of this rank on its GPU (its verifier's
    receive slots in peer memory, a drafter of its own), the run (decode_rank); rank 0 writes the
    summary: the printed lines, the check, the typed result (megakernel.decode) as JSON."""
    a = rank_parser().parse_args(argv)
    wld, dev = start_rank()
    cfg = get_preset(a.preset)
    role = rank_role(cfg, wld.rank, wld.size, wld.local_rank, check=a.check)
    w = generate(cfg, device=dev)
    plan, dplan = rank_plans(a.preset, a.agree, role.ranks)
    link, buf = open_rank(wld, plan, dev)
    pair = SpecPair(w, plan, dplan, [KVCache(cfg, device=dev) for _ in range(a.batch)], batch=a.batch, agree=a.agree,
                    backend="gpu", ranks=role.ranks, link=link)
    prompts = prompts_for(cfg, a.batch, a.prompt_len, a.seed)
    out, problems = decode_rank(pair, prompts, a.tokens, a.mode, check=a.check, poison=a.check,
                                barrier=torch.distributed.barrier)
    if role.gathers:
        s = rank0_summary(out, problems, preset=a.preset, batch=a.batch, mode=a.mode, agree=a.agree,
                          acceptance=a.acceptance, acceptance_source=a.acceptance_source, prompt_len=a.prompt_len,
                          n=a.tokens, ranks=role.ranks, launches=pair.part_launches(a.mode))
        if a.summary:
            write_json(a.summary, s)
        print(json.dumps({k: s[k] for k in ("ranks", "error", "check")}))
    end_rank(buf)
    return 0


def rank_plans(preset: str, agree: float, ranks: int, n_sm: int | None = None) -> tuple[Plan, Plan]:
    """The plans of one process's rank: the verifier's TP build of `ranks` ranks, one a launch
    (the GPU's SMs all its own), and the drafter's, unsharded (plans.plan_for: the tuned constants)."""
    cfg = get_preset(preset)
    dcfg = draft_model_config(cfg, DraftConfig(agree=agree))
    return (plan_for(preset, n_sm=n_sm, tokens=cfg.max_tree, tp_ranks=ranks),
            plan_for(dcfg, n_sm=n_sm, tokens=dcfg.max_tree - 1))


def rank_parser() -> argparse.ArgumentParser:
    """rank_main's command line (decode_rank_args writes it)."""
    ap = argparse.ArgumentParser(prog="torchrun ... -m megakernel.decode", description=rank_main.__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--mode", default="mega", choices=["mega", "chain"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--agree", type=float, required=True)
    ap.add_argument("--acceptance", required=True, help="the acceptance's name (recorded)")
    ap.add_argument("--acceptance-source", required=True, help="where its agreement comes from (recorded)")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--summary", help="rank 0 writes its summary (JSON) here")
    return ap


def rank0_summary(out: DecodeOutcome | None, problems: Sequence[str], *, preset: str, batch: int, mode: str,
                  agree: float, acceptance: str, acceptance_source: str, prompt_len: int, n: int, ranks: int,
                  launches: tuple[int, int, int], env: Env | None = None) -> dict:
    """What rank 0 of a torchrun decode writes: `error` (a rank's error or, without a check, a rank
    unlike rank 0: the run fails), else the printed lines, each request's tokens, the check
    ("not run", "passed", "FAILED") and its problems, and the typed result (to_result) as JSON."""
    s = {"ranks": ranks, "preset": preset, "error": None, "check": "not run", "problems": list(problems),
         "lines": [], "tokens": [], "result": None}
    if out is None or (problems and out.check is None):
        s["error"] = "; ".join(problems) or "rank 0 has no outcome"
        return s
    s["lines"] = summary_lines(out, emulated=False)
    s["tokens"] = out.read.tokens
    if out.check is not None:
        s["check"] = "passed" if out.check.ok else "FAILED"
        s["problems"] = list(out.check.problems)
    res = to_result(out, preset=preset, batch=batch, mode=mode, agree=agree, acceptance=acceptance,
                    acceptance_source=acceptance_source, prompt_len=prompt_len, n=n,
                    env=constants_env() if env is None else env, emulated=False, launches=launches, ranks=ranks,
                    where="torchrun", where_why=f"torchrun, one process per GPU ({ranks} GPUs), a drafter in each")
    s["result"] = res.to_json()
    return s


def run_torchrun(ranks: int, *, preset: str, tokens: int, mode: str, batch: int, agree: float, acceptance: str,
                 acceptance_source: str, prompt_len: int, seed: int, check: bool,
                 timeout: float | None = 1800) -> tuple[dict, Result]:
    """`megabench decode --ranks R` across R GPUs of this node, one process each (rank_main under
    torchrun, ranks.launch_torchrun); rank 0's summary and its typed result."""
    args = decode_rank_args(preset=preset, tokens=tokens, mode=mode, batch=batch, agree=agree, acceptance=acceptance,
                            acceptance_source=acceptance_source, prompt_len=prompt_len, seed=seed, check=check)
    s = launch_torchrun(ranks, args, module=DECODE_MODULE, what="decode",
                        timeout=timeout)
    return s, Result.from_json(s["result"], source="rank 0 of the torchrun decode")


def decode_rank_args(*, preset: str, tokens: int, mode: str, batch: int, agree: float, acceptance: str,
                     acceptance_source: str, prompt_len: int, seed: int, check: bool) -> list[str]:
    """rank_main's command line for these settings (torchrun's arguments after the module)."""
    return ["--preset", preset, "--tokens", str(tokens), "--mode", mode, "--batch", str(batch), "--agree", repr(agree),
            "--acceptance", acceptance, "--acceptance-source", acceptance_source, "--prompt-len", str(prompt_len),
            "--seed", str(seed)] + ["--check"] * check


# ---------------------------------------------------------------------- the typed result
def summary_lines(out: DecodeOutcome, *, emulated: bool) -> list[str]:
    """What `megabench decode` prints at the end: accepted tokens/s, the mean acceptance and its
    histogram, the per-depth rates and the step's split."""
    st, rep = out.stats, out.report
    tokens = sum(len(t) for t in out.read.tokens)
    committed = sum(out.read.emitted)
    rate = committed / st.seconds if st.seconds > 0 else float("nan")
    label = " (host emulation: the CPU's time, not a GPU rate)" if emulated else ""
    lines = [f"accepted tokens/s: {rate:,.1f}{label}: {committed} tokens committed by {len(st.steps)} steps in "
             f"{st.seconds:.3f} s ({tokens} asked for)",
             f"mean acceptance: {rep.mean:.2f} of {rep.n_tree} tokens per step (90% interval {rep.ci[0]:.2f}-"
             f"{rep.ci[1]:.2f}, bonus included); a property of the synthetic draft/target pair",
             "histogram (tokens per step: steps): " + ", ".join(f"{a}: {n}" for a, n in enumerate(rep.histogram, 1) if n),
             "acceptance rate by depth: " + ", ".join(f"{x:.2f}" if x == x else "-" for x in rep.depth_rates)]
    if len(out.read.hist) > 1:  # each request its own acceptance
        lines.append("per request: " + ", ".join(
            f"{r}: {sum(a * n for a, n in enumerate(h)) / max(1, sum(h)):.2f} over {sum(h)} steps"
            for r, h in enumerate(out.read.hist)))
    med = {p: float(np.median([getattr(s, p) for s in st.steps])) for p in (*PARTS, "wall", "gaps")}
    what = "host emulation, not a GPU timing" if emulated else "CUDA events, median per step"
    lines.append(f"step split ({what}): draft {med['draft'] * 1e3:.3f} ms, verify {med['verify'] * 1e3:.3f} ms, "
                 f"accept and compaction {med['accept'] * 1e3:.3f} ms, gaps {med['gaps'] * 1e3:.3f} ms "
                 f"(step {med['wall'] * 1e3:.3f} ms)")
    return lines


def to_result(out: DecodeOutcome, *, preset: str, batch: int, mode: str, agree: float, acceptance: str,
              acceptance_source: str, prompt_len: int, n: int, env: Env, emulated: bool,
              launches: tuple[int, int, int], ranks: int = 1, where: str | None = None,
              where_why: str | None = None, row_groups: int = 1) -> Result:
    """The run as a typed `megakernel.decode` result: one series of step wall times with the
    acceptance (histogram, per-depth rates), the split and the check in its metrics; derived the
    accepted tokens/s and the mean acceptance. The report draws GPU runs only (emulated ones are
    the CPU's time). `ranks`: the verifier's tensor-parallel ranks (params; a run of R > 1 names
    its series .../R{ranks}); `where`: where it ran (params: "emu", "gpu" (at R > 1 the ranks
    sharing one GPU's SMs) or "torchrun" (one process per GPU); default by `emulated`), `where_why`
    the sentence that says so (notes); `row_groups`: full trees, a row group per request (params;
    1: every request's tree in one step of max_tree rows)."""
    where = where or ("emu" if emulated else "gpu")
    if where not in ("emu", "gpu", "torchrun"):
        raise ConfigError(f"where {where!r}: emu, gpu or torchrun")
    st, rep = out.stats, out.report
    committed = sum(out.read.emitted)
    rate = committed / st.seconds if st.seconds > 0 else 0.0
    med = {p: float(np.median([getattr(s, p) for s in st.steps])) for p in (*PARTS, "gaps")}
    t = len(out.read.hist[0]) - 1
    name = f"{preset}/B{batch}/T{t}/{mode}/agree{agree:g}" + (f"/R{ranks}" if ranks > 1 else "")
    check = "not run" if out.check is None else ("passed" if out.check.ok else "FAILED")
    params = {"preset": preset, "batch": batch, "tree_tokens": t, "branch_depth": rep.branch_depth, "mode": mode,
              "agree": agree, "acceptance": acceptance, "prompt_len": prompt_len, "tokens": n,
              "backend": "emu" if emulated else "gpu", "ranks": ranks, "where": where, "row_groups": row_groups}
    metrics = {"accepted_tokens_per_s": rate, "accepted_tokens": committed, "steps": len(st.steps),
               "rounds": list(st.rounds), "accepted_tokens_per_step": rep.mean, "histogram": list(rep.histogram),
               "depth_rates": [x if x == x else None for x in rep.depth_rates], "follow_rate": rep.follow_rate,
               "acceptance_source": acceptance_source, "check": check, "emulated": emulated,
               **{f"{p}_s": v for p, v in med.items()}, **{f"{p}_launches": k for p, k in zip(PARTS, launches)}}
    s = Series.from_samples(name, [x.wall for x in st.steps], timer=st.timer, unit="s", params=params, metrics=metrics)
    how = "host emulation: the CPU's time, not a GPU rate" if emulated else "CUDA events around the steps' graphs"
    derived = {
        "accepted_tokens_per_s": Derived(rate, "tok/s", f"tokens committed / the steps' wall time ({how})",
                                         inputs=(name,)),
        "mean_acceptance": Derived(rep.mean, "tokens/step", "mean tokens committed per verify step, bonus included "
                                   "(device counts); bootstrap 90% interval", spread=rep.ci, inputs=(name,),
                                   note="a property of the synthetic draft/target pair, not the study's workload"),
    }
    notes = (f"acceptance {acceptance!r}: agree {agree:g} ({acceptance_source})",
             f"{len(st.steps)} steps in {len(st.rounds)} rounds; nothing read back between the steps of a round")
    if ranks > 1:
        drafter = "a drafter in each process" if where == "torchrun" else "the drafter once, unsharded"
        notes += (f"the verifier as {ranks} tensor-parallel ranks: {where_why or where}; {drafter}",)
    return Result(BENCHMARK, env, (s,), derived, quick=True, notes=notes)


if __name__ == "__main__":
    sys.exit(rank_main())

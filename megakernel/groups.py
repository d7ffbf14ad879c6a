"""Steps of more token rows than one m16 tile: row groups in one launch.

An Engine's step holds at most max_tree (16) token rows: every GEMM of the kernel takes its
activations as one m16 tile of tokens. A GroupEngine serves more (B = 8 requests of a 16-token
tree: 128 rows) by packing whole requests, in order, into groups of at most 16 rows
(`pack_groups`). Each group has an Engine of its own (its buffers, step block, routing and
expert slots, in its own parameter block) and every group's op instances run in one launch per
launch of the plain step, interleaved instance by instance (program.grouped): qkv of group 0, qkv
of group 1, ..., so that a block that just streamed a weight tile for one group streams it again
for the next while L2 may still hold it, and a group waiting on its attention leaves other
groups' units ready to run.

Bits: each op of a group reads and writes that group's rows only, its units are those of the
group's own step, and so are its reductions: a request's logits, tokens and KV cache are bitwise
those of the same request in its group's step alone, and so of its B=1 step (batch.py). Mega
and chain are bitwise equal as for any program.

Bound: the weights are read once per group (the dense projections of every group, the union of
each group's experts), from HBM or L2. A group is not a token tile inside a unit: that would
read each weight tile once for all rows (roofline.batch_roofline counts the weights once).

Speculative steps (decode.SpecPair with full trees past max_tree rows): `specs`, one SpecLink per
group, each of one request (request g is group g's alone: a 16-token verify tree, or its 15 draft
rows, fills a group). Each group's spec ops (seed, tree, accept, compact, advance) read and write
its own request's state and tables through its own parameter block, so a request's speculative
step is its B=1 step's, bit for bit, as for plain steps.

Usage:
    eng = GroupEngine(weights, make_plan(cfg, n_sm, row_groups=8), caches)   # one cache per request
    out = eng.step_batch(requests)        # request r on caches[r], out.request(r)
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from microbench.clocks.profiler import ProfileBuffer, ProfileLayout
from microbench.errors import SpinTimeoutError

from . import abi
from .config import ConfigError
from .plan import Plan
from .program import Program, grouped
from .reference import KVCache, Request
from .runtime import Engine, SpecLink, StepOut, step_launches
from .weights import ModelWeights


def pack_groups(rows: Sequence[int], cap: int) -> list[range]:
    """Consecutive requests packed greedily into groups of at most `cap` rows (a request's rows
    never split: its attention and tree are one group's). Returns each group's request range."""
    out, start, n = [], 0, 0
    for r, t in enumerate(rows):
        if not 1 <= int(t) <= cap:
            raise ConfigError(f"request {r}: {t} token rows; a request takes 1..{cap} (one m16 tile)")
        if n + t > cap:
            out.append(range(start, r))
            start, n = r, 0
        n += int(t)
    if rows:
        out.append(range(start, len(rows)))
    return out


def groups_needed(cfg_max_tree: int, rows: Sequence[int]) -> int:
    """How many row groups a step of requests with these row counts takes (pack_groups)."""
    return len(pack_groups(rows, cfg_max_tree))


class GroupEngine:
    """B requests in row groups (module docstring), with Engine's step API: step_batch,
    prepare_batch + launch_step (what a timing replays), poison; with `specs`, the speculative
    step's: set_spec_rows, launch_step(spec=True, part=...), note_replayed."""

    def __init__(self, weights: ModelWeights, plan: Plan, caches: Sequence[KVCache], *, backend: str = "gpu",
                 program_mode: str = "layer", grid: int | None = None, emu_seed: int = 1,
                 emu_schedule: str = "random", specs: Sequence[SpecLink] | None = None,
                 share: Engine | None = None):
        if plan.row_groups < 2:
            raise ConfigError(f"a GroupEngine needs a plan of 2 or more row groups (make_plan(row_groups=...)), got "
                              f"{plan.row_groups}: a step of one group runs in an Engine")
        self.caches = list(caches)
        if not self.caches or len({id(c) for c in self.caches}) != len(self.caches):
            raise ConfigError("a GroupEngine takes one distinct KV cache per request")
        self.plan, self.cfg, self.backend = plan, weights.cfg, backend
        self.specs = list(specs) if specs is not None else None
        if self.specs is not None:
            roles = {s.role for s in self.specs}
            if not 2 <= len(self.specs) <= plan.row_groups or len(roles) != 1 \
                    or any(len(s.rows) != 1 for s in self.specs) or len(self.specs) != len(self.caches):
                raise ConfigError(f"speculative row groups: one SpecLink of one request per group and per KV cache, "
                                  f"2..{plan.row_groups} of one role (got {len(self.specs)} links of roles "
                                  f"{sorted(roles)}, {len(self.caches)} caches)")
            if plan.profile:
                raise ConfigError("speculative row groups run unprofiled (no profile)")
        kw = dict(backend=backend, program_mode=program_mode, grid=grid, emu_seed=emu_seed,
                  emu_schedule=emu_schedule, group_member=True, share=share)
        # a group's engine starts on one cache; prepare_batch gives it its requests' caches (a
        # speculative group: its request's, set_spec_rows)
        self.members = [Engine(weights, plan, [KVCache(weights.cfg, device=weights.device)],
                               spec=self.specs[g] if self.specs is not None and g < len(self.specs) else None, **kw)
                        for g in range(plan.row_groups)]
        lead = self.lead = self.members[0]
        for m in self.members[1:]:
            m.wd = lead.wd  # one watchdog record for the launch (packed into every group's block below)
        if plan.union_experts:  # ops/topk.cuh union_build: rows and outputs addressed from group 0's buffers
            c, dev = weights.cfg, lead.dev
            pooled = torch.zeros(plan.row_groups, c.max_tree, c.d_pool, dtype=torch.bfloat16, device=dev)
            yexp = torch.zeros(plan.row_groups, plan.max_slots, 16, c.d_pool, dtype=torch.bfloat16, device=dev)
            ypart = (torch.zeros(plan.row_groups, plan.max_slots, plan.fused_parts, 16, c.d_pool, device=dev)
                     if plan.fused_experts else None)
            for g, m in enumerate(self.members):
                m.buf["pooled"], m.buf["yexp"] = pooled[g], yexp[g]
                if ypart is not None:
                    m.buf["ypart"] = ypart[g]
            lead.buf["act"] = torch.zeros(plan.max_uslots, 16, c.d_expert, dtype=torch.bfloat16, device=dev)
        self.grid = lead.grid
        self.base = lead.program
        if plan.profile:
            # one buffer, the lead's, passed to every launch: a slice per launch of the most groups'
            # program in either mode (chain: one launch per op instance, so groups times the plain
            # step's). Each block records its units of every group's instances, so a launch holds
            # about groups times a plain step's records a block: make_plan(profile_cap=...) sizes
            # them, and a slice that fills counts its overflow (Timeline problems) instead of
            # writing past its end
            most = grouped(self.base, plan.row_groups)
            lead.prof = ProfileBuffer(ProfileLayout(lead.grid, 1, plan.profile_cap),
                                      launches=max(len(most.launches), len(most.ops)),
                                      device="cpu" if backend == "emu" else (lead.dev.index or 0))
            for m in self.members[1:]:
                m.prof = None  # their launches are the lead's
        self._programs: dict[tuple[int, bool], tuple[Program, torch.Tensor]] = {}
        nc = max(self.base.n_counters, lead.spec_program.n_counters if lead.spec_program is not None else 0)
        self.counters = torch.zeros(2, nc * plan.row_groups, dtype=torch.int32, device=lead.dev)
        self.parity = 0
        self._dirty = [False, False]
        self.program: Program | None = None
        self.spec_program: Program | None = None
        self._params_dev: torch.Tensor | None = None
        self._spec_params_dev: torch.Tensor | None = None
        self._row0: tuple[int, ...] = ()
        self._rows: list[int] = []
        self._groups: list[range] = []
        if self.specs is not None:
            self.set_spec_rows([0] * len(self.specs))

    def _program(self, groups: int, spec: bool = False) -> tuple[Program, torch.Tensor]:
        if (groups, spec) not in self._programs:
            prog = grouped(self.lead.spec_program if spec else self.base, groups)
            self._programs[groups, spec] = (prog, torch.from_numpy(prog.encode()).to(self.lead.dev))
        return self._programs[groups, spec]

    def set_spec_rows(self, ctxs: Sequence[int]) -> None:
        """The speculative step's shape: group g runs request g (caches[g]) at context ctxs[g]
        (Engine.set_spec_rows), and the spec step's parameter blocks are packed. The verifier's
        plain steps (prefill, plain decoding) repack its groups: call this again before spec steps
        that follow plain ones. The drafter's step is its pass: its plain program is that pass."""
        if self.specs is None:
            raise ConfigError("set_spec_rows: this engine has no speculative role (GroupEngine(specs=...))")
        if len(ctxs) != len(self.specs):
            raise ConfigError(f"{len(ctxs)} contexts for {len(self.specs)} speculative groups (one request each)")
        n = len(self.specs)
        prog, prog_t = self._program(n, spec=True)
        for g, m in enumerate(self.members[:n]):
            m.caches = [self.caches[g]]
            m._kv_blob = m._kv_table()
            m.set_spec_rows([int(ctxs[g])])
        # every group's block, the unused ones too (prepare_batch); an unused group has no spec role.
        # Written into the same device buffer every time: a captured CUDA graph (decode.SpecPair)
        # holds that buffer's address, and a new one would leave it replaying freed memory
        blob = torch.cat([m._params(False, m.spec_program if g < n else None, shared=(prog_t, self.counters),
                                    n_active=n) for g, m in enumerate(self.members)])
        if self._spec_params_dev is None or self._spec_params_dev.shape != blob.shape:
            self._spec_params_dev = blob
        else:
            self._spec_params_dev.copy_(blob)
        self.spec_program = prog
        if self.specs[0].role == "draft":  # its pass is its step (launch_step runs it)
            self.program, self._params_dev = prog, self._spec_params_dev
            self._groups = [range(g, g + 1) for g in range(n)]
            self._rows = [self.specs[g].rows[0] for g in range(n)]
            self._row0 = tuple(sum(self._rows[:r]) for r in range(n + 1))

    def poison(self) -> None:
        """Every group's scratch buffers NaN (Engine.poison)."""
        for m in self.members:
            m.poison()

    def prepare_batch(self, requests: Sequence[Request], routes=None) -> int:
        """Pack the requests into groups, copy each group's rows and step block to its engine and
        pack the launch's parameter blocks (one per group, in group order). `routes` (forced):
        per layer [rows, top_k] over all the requests' rows in order. Returns the step's rows."""
        reqs = list(requests)
        if self.specs is not None and self.specs[0].role == "draft":
            raise ConfigError("the drafter's step is its pass (its rows' tokens come from its seed op): launch_step "
                              "runs it")
        if not reqs:
            raise ConfigError("a step needs at least one request")
        if len(reqs) > len(self.caches):
            raise ConfigError(f"{len(reqs)} requests but this engine has {len(self.caches)} KV caches (one per request)")
        rows = [len(q.tokens) for q in reqs]
        groups = pack_groups(rows, self.cfg.max_tree)
        if len(groups) > self.plan.row_groups:
            raise ConfigError(f"{len(reqs)} requests of {'+'.join(map(str, rows))} = {sum(rows)} token rows pack into "
                              f"{len(groups)} groups of at most {self.cfg.max_tree} rows; this build has "
                              f"{self.plan.row_groups} (make_plan(row_groups=...))")
        prog, prog_t = self._program(len(groups))
        starts = [sum(rows[:g.start]) for g in groups] + [sum(rows)]
        for k, (g, m) in enumerate(zip(groups, self.members)):
            m.caches = [self.caches[r] for r in g]
            m._kv_blob = m._kv_table()
            gr = None if routes is None else [rl[starts[k]:starts[k + 1]] for rl in routes]
            m._row0 = m._set_inputs([reqs[r] for r in g], gr)
        # every group's block, the unused ones too: the kernel loads every group's step block
        # (block.cuh load_step); an unused group's is its last step's (or the empty one)
        blobs = [m._params(routes is not None and k < len(groups), shared=(prog_t, self.counters),
                           n_active=len(groups)) for k, m in enumerate(self.members)]
        self.program = prog
        self._params_dev = torch.cat(blobs)
        self._groups = groups
        self._rows = rows
        self._row0 = tuple(sum(rows[:r]) for r in range(len(rows) + 1))
        return sum(rows)

    def launch_step(self, mode: str = "mega", *, spec: bool = False, part: range | None = None) -> None:
        """Enqueue the kernels of the prepared step (Engine.launch_step's counter bookkeeping).
        spec: the verifier's spec step (set_spec_rows); part: only these launches of the step, in
        order (the counters are cleaned before its first launch and the parity turns after its last,
        so the parts of one step go in order)."""
        if spec and self.spec_program is None:
            raise ConfigError("launch_step(spec=True): this engine has no spec step (GroupEngine(specs=...))")
        lead = self.lead
        # this engine's grouped program and parameter blocks, the lead's launch table
        prog, params, todo, part = step_launches(self, lead, mode, spec, part)
        if not part:
            return
        if part[0] == 0:
            if mode == "mega" and self._dirty[self.parity]:
                self.counters[self.parity].zero_()
            if lead.prof is not None:
                lead.prof.reset()
        lead.parity = self.parity
        lead._last_program = prog
        for li in part:
            (first, n, wait, grid), pdl = todo[li]
            lead._launch(first, n, wait, grid, li, pdl=pdl, params=params)
        if mode == "mega" and part[-1] == len(todo) - 1:
            self._dirty[self.parity] = True
            self._dirty[self.parity ^ 1] = False  # every group's argmax cleared it
            self.parity ^= 1

    def note_replayed(self, steps: int, mode: str) -> None:
        """Engine.note_replayed: a CUDA graph ran `steps` whole steps launch_step did not see."""
        if mode == "mega":
            for _ in range(steps):
                self._dirty[self.parity] = True
                self._dirty[self.parity ^ 1] = False
                self.parity ^= 1

    def launches(self, mode: str = "mega", program: Program | None = None) -> list[tuple[int, int, int, int]]:
        """(first op, ops, wait, grid) of each launch of the prepared step, or of `program` (one of
        this engine's grouped programs: self.spec_program) (Engine.launches)."""
        prog = program or self.program
        if prog is None:
            raise ConfigError("launches: no step prepared (prepare_batch first)")
        return self.lead.launches(mode, prog)

    def contexts(self) -> list[int]:
        """Speculative groups: each request's cached positions as the device's step blocks hold them
        (advance moves them): request g's from group g's."""
        if self.specs is None:
            raise ConfigError("contexts: this engine has no speculative role")
        at = abi.step_offsets()["ctx"]
        return [int(m.step_t[at].item()) for m in self.members[:len(self.specs)]]

    def _launch(self, first, n, wait, grid, li=0) -> None:
        """One launch of the prepared step over every group's parameter blocks, PDL off: the
        profiling path (cli._launches_profiled) runs a step's launches one by one through this, the
        counters zeroed first by the caller, as for Engine._launch. Danger: a launch whose
        predecessors did not run waits on counters nobody bumps, until the watchdog stops it."""
        self.lead.parity = self.parity
        self.lead._last_program = self.program
        self.lead._launch(first, n, wait, grid, li, pdl=False, params=self._params_dev)

    def timeline(self, mode: str = "mega"):
        """The profiler's stamps of the last step (a plan built with profile=True) as a Timeline;
        an op phase's arg is its op index in the step's grouped program (`self.program.ops[i].group`
        names the group)."""
        if self.program is None:
            raise ConfigError("timeline: no step prepared (prepare_batch first)")
        return self.lead.timeline(mode, self.program)

    def _check_watchdog(self, wait=True) -> None:
        try:
            self.lead.wd.check(self.lead.describe_wait, context=f"megakernel ({self.cfg.name}, {self.backend}, "
                                                               f"{len(self._groups)} row groups)")
        except SpinTimeoutError:
            self.lead.wd.reset()
            self.counters.zero_()
            for m in self.members:
                m.empty_sentinel_slots()
            self._dirty = [False, False]
            raise

    def step_batch(self, requests: Sequence[Request], *, mode: str = "mega", routes=None) -> StepOut:
        """A step of these requests (request r on caches[r]); out.request(r) is request r's."""
        self.prepare_batch(requests, routes)
        self.launch_step(mode)
        if self.backend == "gpu":
            torch.cuda.synchronize()
        self._check_watchdog()
        logits, tokens = [], []
        for g, m in zip(self._groups, self.members):
            n = sum(self._rows[r] for r in g)
            logits.append(m.buf["logits"][:n].clone())
            tokens.append(m.buf["out_tokens"][:n].to(torch.int64).clone())
        return StepOut(torch.cat(logits), torch.cat(tokens), self._row0)

"""The schedule: which op instances run in which launch, how their units map onto blocks, and
what each unit waits for. Built here, encoded as an int32 table the kernel interprets, and
executed by the torch interpreter (interp.py) in any order the dependencies allow.

Units and groups (the same rules are written in csrc/mk/program.cuh; tests cross-check them):
  op           units                        group of a unit (counter it bumps besides total)
  embed        T                            -
  qkv          QKV_ROWS/16                   kv head its rows feed (HKV groups)
  attn         HKV * S, S = sum over the    kv head (HKV groups)
               requests of splits(layer, ctx_r, T_r)
  attn_combine HQ * T                       -
  oproj        D/Rr         router E/8      pool P/Rp         topk 1
  expert1      count * F/(R1/2) (dynamic)   slot (MAX_SLOTS groups)
  expert2      count * P/R2 (dynamic)       -   (Plan.fused_experts: count * F/(R1/2), expert1's)
  moe_combine  P/16         unpool D/Rr     lm_head V/16      argmax 1
  seed, tree, accept  B (one per request)   compact L * HKV * B   advance 1
(row counts: the plan's tiles, R1 / R2 its expert units' rows, Rp the pooler's (plan.pool_rows),
Rr oproj's and unpool's (plan.residual_rows);
MOE_COMBINE_COLS; B the step's requests)
Spec programs (build's `spec`): the drafter's ("draft") opens with `seed` before embed; the
verifier's ("verify") opens with `tree` before embed and ends with a launch of its own holding
`accept`, `compact` and `advance` (in every mode, so that a timing can split them off). Plain
programs hold none of these.
Tensor parallelism (Plan.tp_ranks R, tp_groups NG; the heads and expert rows are one rank's):
  oproj        NG/R * D/Rr: (the rank's K group, feature tile), the group's fp32 partial, pushed
               into every rank's receive slots (csrc/ops/tp_oproj.cuh)
  attn_reduce  D/Rr         sums the NG partials in group order into x ("sentinel" <- oproj: it
                            polls its receive slots, which every rank's oproj fills)
  expert1      count * (F/R)/(R1/2), pushed into every rank's slots (the activations' gather)
  expert2      count * (P/R)/R2, "sentinel" <- expert1: polls the gathered activations; pushes
  moe_combine  also polls the gathered expert outputs (and resets the layer's activations)
  (expert_parallel: count = the rank's own slots, whole rows: F/(R1/2) and P/R2 units a slot)
A step holds B requests (abi.py's step block): T is the step's token rows, the requests' trees
concatenated; an attention unit is (kv head, request, split), each kv head's units the requests'
splits in request order (attn_unit). The rules take t and ctx as ints (one request) or as one of
each per request.
A dependency is ("all", producer): every unit of the producer instance, or ("group", producer):
the one group of the producer the consumer unit needs (attn <- qkv by kv head, attn_combine <-
attn by kv head, expert2 <- expert1 by slot), or ("sentinel", producer): every unit of it, but
the consumer polls the data itself (sentinel slots, plan.sentinel_route: top-k <- router), so no
counter is waited for, or ("local", producer): the producer's unit of the consumer unit's index,
which the same block ran before it (plan.fused_experts: expert2 <- expert1, both contiguous over
as many units), not waited for either. An op bumps only the counters some consumer waits for (OpInst.signal:
SIGNAL_TOTAL, SIGNAL_GROUPS), each a release that waits for the block's stores to drain: attn and
expert1 (and qkv in "step" mode) are waited for by group only, so their total's release, which
would come second, stays off the op's critical path. Counters are per step and per parity (the
argmax unit of step k clears the other parity's counters, which no launch is using). Only
dependencies inside a launch are kept: the launches run in stream order (build).

Deadlock freedom: every block walks the op instances of a launch in the same (topological)
order, and a unit only waits for units of earlier instances; the earliest unfinished unit of
the launch therefore never waits, so the launch always progresses (given co-residency).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from .config import ModelConfig
from .plan import MOE_COMBINE_COLS, OP, OP_KINDS, SPEC_KINDS, UNION_OPS, UNION_SHARED, Plan

OPINST_INTS = 16
MAX_DEPS = 3
OPREC_DEPS = 8  # an encoded op record's (producer, mode) pairs start at this int (OpInst.encode)
# top-k's done-counter carries the layer's slot count above this bit (it has one unit, so the
# low half is its units-done count): program.cuh signal_op_end and the routed ops' waits
ROUTE_SHIFT = 16
ASSIGN_STRIDED, ASSIGN_CONTIG = 0, 1
SIGNAL_TOTAL, SIGNAL_GROUPS = 1, 2  # OpInst.signal bits: its total counter / its group counters are waited for
# DEP_LOCAL: unit u of the consumer needs unit u of the producer, which the same block ran before
# it (both contiguous, with as many units: Plan.fused_experts' down projection <- gate/up); not
# waited for, program order and the block's barriers order it
DEP_ALL, DEP_GROUP, DEP_SENTINEL, DEP_LOCAL = 0, 1, 2, 3
# A wait's id for the watchdog record: op index * 16 + code; codes below MAX_DEPS name the op's
# dependency, these name the ring and the loader (rendered into the kernel by build.py)
WHAT_RING_FULL, WHAT_RING_EMPTY, WHAT_LOADER_ROUTE, WHAT_LOADER_GATE, WHAT_SENTINEL, WHAT_NORM_ROWS = 8, 9, 10, 11, 12, 13
WHAT_LOADER_PACE = 14
# TP's collective waits (csrc/mk/tp.cuh): the id also carries the rank whose data is awaited (bits
# 16..19) and the slot (bits 20..31: the all-reduce's K group, or a gather's expert slot), and the
# op index is 12 bits (MAX_TP_OPS)
WHAT_AR, WHAT_GATHER_ACT, WHAT_GATHER_Y = 5, 6, 7
MAX_TP_OPS = 4096
# consumer <- producer edges on which the consumer polls sentinel slots (plan.sentinel_route: top-k
# <- router; TP: the all-reduce <- oproj, and each gather's readers <- its producers)
SENTINEL_EDGES = (("topk", "router"), ("attn_reduce", "oproj"), ("expert2", "expert1"))


@dataclass(frozen=True)
class Dep:
    producer: int  # index of the producing op instance
    mode: int  # DEP_ALL, DEP_GROUP, DEP_SENTINEL or DEP_LOCAL


@dataclass(frozen=True)
class OpInst:
    index: int
    kind: str
    layer: int
    deps: tuple[Dep, ...]
    counter: int  # its "units done" counter
    group_base: int  # first group counter (or -1)
    n_groups: int
    rot: int  # block rotation of the strided assignment
    assign: int
    signal: int = 3  # which counters some consumer waits for: SIGNAL_TOTAL | SIGNAL_GROUPS (0: none is bumped)
    group: int = 0  # row groups (grouped): whose rows and parameter block the instance runs

    def encode(self) -> list[int]:
        row = [OP[self.kind], self.layer, self.counter, self.group_base, self.n_groups, self.rot, self.assign,
               len(self.deps)]
        assert len(row) == OPREC_DEPS
        for d in self.deps:
            row += [d.producer, d.mode]
        row += [0] * (2 * (MAX_DEPS - len(self.deps)))
        assert len(row) == OPREC_DEPS + 2 * MAX_DEPS  # the signal's int (program.cuh load_op)
        row += [int(self.signal), int(self.group)]  # the group: program.cuh op_group
        row += [0] * (OPINST_INTS - len(row))
        return row


# ------------------------------------------------------------------ the unit / group rules
def splits(cfg: ModelConfig, plan: Plan, layer: int, ctx: int, t: int) -> int:
    """Attention splits of one kv head's keys: the cached prefix it sees followed by the t new tree
    keys, cut into equal runs (a function of ctx and t only, so chain and mega modes split
    identically). The new keys are spread over the runs, not tacked onto the last split: that
    split would take a staging round more than every other, and the op ends with its slowest."""
    nkeys = cached_keys(cfg, layer, ctx) + t
    return max(1, min(plan.max_splits, math.ceil(nkeys / plan.keys_per_split)))


def cached_keys(cfg: ModelConfig, layer: int, ctx: int) -> int:
    return ctx if cfg.is_global(layer) else min(ctx, cfg.window - 1)


def requests(t: int | Sequence[int], ctx: int | Sequence[int]) -> list[tuple[int, int]]:
    """(T_r, ctx_r) of each request of a step: t and ctx are ints (one request) or one per request."""
    ts = [int(t)] if isinstance(t, (int, np.integer)) else [int(x) for x in t]
    cs = [int(ctx)] if isinstance(ctx, (int, np.integer)) else [int(x) for x in ctx]
    if len(ts) != len(cs) or not ts:
        raise ValueError(f"{len(ts)} requests' tree sizes but {len(cs)} contexts")
    return list(zip(ts, cs))


def attn_span(plan: Plan, layer: int, t, ctx) -> int:
    """Attention units per kv head: every request's splits, each as if it ran alone (splits of its
    own ctx and T only, so its partials and bits are those of its B=1 step)."""
    return sum(splits(plan.cfg, plan, layer, c, n) for n, c in requests(t, ctx))


def attn_unit(plan: Plan, layer: int, unit: int, t, ctx) -> tuple[int, int, int, int]:
    """(kv head, request, split, the request's splits) of attention unit `unit` (attention.cuh attn_unit)."""
    kvh, v = divmod(unit, attn_span(plan, layer, t, ctx))
    reqs = requests(t, ctx)
    for r, (n, c) in enumerate(reqs):
        ns = splits(plan.cfg, plan, layer, c, n)
        if v < ns or r + 1 == len(reqs):
            return kvh, r, v, ns
        v -= ns
    raise AssertionError("unreachable")


def n_units(plan: Plan, kind: str, layer: int, t, ctx, count: int) -> int:
    c = plan.rcfg  # the heads of one rank (Plan.tp_ranks), else the model's
    f_sh, p_sh = plan.expert_rows
    reqs = requests(t, ctx)
    rows = sum(n for n, _ in reqs)
    if kind == "attn":
        return c.n_kv_heads * attn_span(plan, layer, t, ctx)
    return {
        "seed": len(reqs), "tree": len(reqs), "accept": len(reqs),
        "compact": c.n_layers * c.n_kv_heads * len(reqs), "advance": 1,
        "embed": rows,
        "qkv": c.qkv_rows // plan.tiles["qkv"].rows,
        "attn_combine": c.n_heads * rows,
        # TP: a unit per (K group of the rank, feature tile): the group's fp32 partial
        "oproj": tp_groups_of_rank(plan) * c.d_model // plan.tiles["oproj"].rows,
        "attn_reduce": c.d_model // plan.tiles["oproj"].rows,
        "router": c.n_experts // plan.tiles["router"].rows,
        "pool": c.d_pool // plan.tiles["pool"].rows,
        "topk": 1,
        "expert1": count * (f_sh // (plan.tiles["expert1"].rows // 2)),
        "expert2": count * (c.d_expert // (plan.tiles["expert1"].rows // 2) if plan.fused_experts
                            else p_sh // plan.tiles["expert2"].rows),
        "moe_combine": c.d_pool // MOE_COMBINE_COLS,
        "unpool": c.d_model // plan.tiles["unpool"].rows,
        "lm_head": c.vocab // 16,
        "argmax": 1,
    }[kind]


def tp_groups_of_rank(plan: Plan) -> int:
    """oproj's K groups one rank computes (Plan.tp_groups / tp_ranks; 1 without TP)."""
    return plan.tp_groups // plan.tp_ranks if plan.tp_ranks else 1


def unit_group(plan: Plan, kind: str, layer: int, unit: int, t, ctx) -> int | None:
    """Group counter (relative) a unit bumps, or None."""
    c = plan.rcfg
    if kind == "qkv":
        head = unit * plan.tiles["qkv"].rows // c.head_dim
        if head < c.n_heads:
            return head // c.group
        if head < c.n_heads + c.n_kv_heads:
            return head - c.n_heads
        return head - c.n_heads - c.n_kv_heads
    if kind == "attn":
        return unit // attn_span(plan, layer, t, ctx)
    if kind == "expert1":
        return unit // (plan.expert_rows[0] // (plan.tiles["expert1"].rows // 2))
    return None


def group_size(plan: Plan, kind: str, layer: int, t, ctx) -> int:
    c = plan.rcfg
    if kind == "attn":
        return attn_span(plan, layer, t, ctx)
    return {"qkv": (c.group + 2) * c.head_dim // plan.tiles["qkv"].rows,
            "expert1": plan.expert_rows[0] // (plan.tiles["expert1"].rows // 2)}[kind]


def needed_group(plan: Plan, consumer: str, producer: str, layer: int, unit: int, t, ctx) -> int:
    """Which group of `producer` the consumer unit waits for."""
    c = plan.cfg
    if consumer == "attn" and producer == "qkv":  # by kv head
        return unit // attn_span(plan, layer, t, ctx)
    if consumer == "attn_combine" and producer == "attn":  # by kv head (unit: q head x row)
        return (unit // sum(n for n, _ in requests(t, ctx))) // c.group
    if consumer == "expert2" and producer == "expert1":
        return unit // (plan.expert_rows[1] // plan.tiles["expert2"].rows)
    raise ValueError(f"no group dependency rule {consumer} <- {producer}")


def n_groups(plan: Plan, kind: str) -> int:
    """Group counters of an op. Plan.union_experts: gate/up's are per union slot, and top-k's one
    is the union's ticket (each group's top-k takes a number from it; the last builds the union:
    csrc/ops/topk.cuh), which no consumer waits for."""
    c = plan.rcfg
    if plan.union_experts and kind in ("expert1", "topk"):
        return plan.max_uslots if kind == "expert1" else 1
    return {"qkv": c.n_kv_heads, "attn": c.n_kv_heads, "expert1": plan.max_slots}.get(kind, 0)


def assigned_units(inst: OpInst, block: int, n_blocks: int, total: int) -> range:
    """Units of `inst` that `block` runs (same formula as program.cuh my_units)."""
    if inst.assign == ASSIGN_CONTIG:  # rotated by row groups only (build leaves a contiguous op's rot 0)
        m = (block - inst.rot) % n_blocks
        return range(m * total // n_blocks, (m + 1) * total // n_blocks)
    return range((block - inst.rot) % n_blocks, total, n_blocks)


def pool_rotation(plan: Plan, router: OpInst) -> int | None:
    """Rotate the pooler's strided units off the router's blocks. Where both fit the grid side by
    side (plan.pool_rows sizes the pool units for that), the pool units start right after the
    router's: no block runs both, and top-k goes to a block that runs neither (lightest_block).
    Otherwise the blocks with one pool unit fewer than the rest come right after the router's."""
    nb = plan.n_sm
    r, p = n_units(plan, "router", router.layer, 1, 0, 0), n_units(plan, "pool", router.layer, 1, 0, 0)
    if r + p <= nb:
        return (router.rot + r) % nb
    rem = p % nb
    return (router.rot + r - rem) % nb if rem else None


def lightest_block(plan: Plan, insts: list[OpInst]) -> int:
    """The block with the fewest units of these (static-size, strided) op instances, lowest index
    on ties. Top-k (one unit, on the critical path of every layer) goes there: on a block that also
    runs router and pool units it starts only after them."""
    load = [0] * plan.n_sm
    for o in insts:
        total = n_units(plan, o.kind, o.layer, 1, 0, 0)
        for b in range(plan.n_sm):
            load[b] += len(assigned_units(o, b, plan.n_sm, total))
    return min(range(plan.n_sm), key=lambda b: (load[b], b))


# ------------------------------------------------------------------ building the program
@dataclass(frozen=True)
class Program:
    plan: Plan
    ops: tuple[OpInst, ...]
    launches: tuple[tuple[int, int], ...]  # (first op, number of ops) per launch
    n_counters: int  # per parity
    mode: str  # "layer" (one launch per layer) or "step" (one launch)
    spec: str | None = None  # None (a plain step), "draft" or "verify" (build's `spec`)
    groups: int = 1  # row groups whose instances it interleaves (grouped)

    def encode(self) -> np.ndarray:
        rows = [o.encode() for o in self.ops]
        return np.asarray(rows, dtype=np.int32).reshape(-1)

    def describe(self) -> str:
        out = []
        for li, (first, n) in enumerate(self.launches):
            names = ", ".join(f"{o.kind}(L{o.layer})" for o in self.ops[first:first + n])
            out.append(f"launch {li}: {names}")
        return "\n".join(out)


SPECS = (None, "draft", "verify")


def build(plan: Plan, mode: str = "layer", spec: str | None = None) -> Program:
    """Op instances of one decode step, their dependencies, counters and launches.

    mode "layer": launch 0 = embed + qkv(0); launch l+1 = attention(l) .. qkv(l+1) (the study's
    shape: attention of layer l through the qkv projection and KV write of layer l+1); the last
    layer's launch ends with the LM head and argmax. mode "step": the whole step in one launch.
    spec "draft": the drafter's pass, `seed` (its rows' tokens) before embed; in "layer" mode
    launch 0 runs through qkv(1), so a pass is one launch per draft layer. spec "verify": the
    verifier's step, `tree` before embed, and after argmax a launch of `accept`, `compact` and
    `advance` (in "step" mode too). None: the plain step, none of these ops.
    """
    if mode not in ("layer", "step"):
        raise ValueError(f"program mode {mode!r}: 'layer' or 'step'")
    if spec not in SPECS:
        raise ValueError(f"program spec {spec!r}: one of {SPECS}")
    c = plan.cfg
    ops: list[OpInst] = []
    counters = 0
    last: dict[str, int] = {}

    def add(kind: str, layer: int, deps: list[tuple[str, int]], assign: int = ASSIGN_STRIDED,
            rot: int | None = None) -> int:
        nonlocal counters
        idx = len(ops)
        ng = n_groups(plan, kind)
        counter = counters
        gb = counters + 1 if ng else -1
        counters += 1 + ng
        ds = tuple(Dep(last[k], m) for k, m in deps)
        if len(ds) > MAX_DEPS:
            raise ValueError(f"{kind}: too many deps")
        if assign == ASSIGN_CONTIG:  # a contiguous share starts at block 0 (program.grouped rotates it)
            rot = 0
        elif rot is None:  # rotate the strided assignment so consecutive small ops start on different blocks
            rot = (idx * 17) % plan.n_sm
        ops.append(OpInst(idx, kind, layer, ds, counter, gb, ng, rot, assign))
        last[kind] = idx
        return idx

    launches: list[tuple[int, int]] = []
    start = 0

    def cut():
        nonlocal start
        launches.append((start, len(ops) - start))
        start = len(ops)

    if spec == "draft":
        add("seed", 0, [])
        add("embed", 0, [("seed", DEP_ALL)])
    elif spec == "verify":
        add("tree", 0, [])
        add("embed", 0, [("tree", DEP_ALL)])
    else:
        add("embed", 0, [])
    add("qkv", 0, [("embed", DEP_ALL)])
    if mode == "layer" and spec != "draft":
        cut()
    for l in range(c.n_layers):
        add("attn", l, [("qkv", DEP_GROUP)])
        add("attn_combine", l, [("attn", DEP_GROUP)])
        add("oproj", l, [("attn_combine", DEP_ALL)])
        x = "oproj"  # the op whose x the ffn norm reads
        if plan.tp_ranks:  # the attention all-reduce: polls every rank's partials in its receive slots
            add("attn_reduce", l, [("oproj", DEP_SENTINEL)])
            x = "attn_reduce"
        add("router", l, [(x, DEP_ALL)])
        add("pool", l, [(x, DEP_ALL)], rot=pool_rotation(plan, ops[last["router"]]))
        add("topk", l, [("router", DEP_SENTINEL if plan.sentinel_route else DEP_ALL)],
            rot=lightest_block(plan, [ops[last["router"]], ops[last["pool"]]]))
        add("expert1", l, [("topk", DEP_ALL), ("pool", DEP_ALL)], ASSIGN_CONTIG)
        # TP: the gathered activations are polled (every rank's gate/up units push them)
        add("expert2", l, [("topk", DEP_ALL), ("expert1", DEP_SENTINEL if plan.tp_ranks else
                                                DEP_LOCAL if plan.fused_experts else DEP_GROUP)], ASSIGN_CONTIG)
        # TP: also polls the gathered expert outputs; its wait for this rank's expert2 orders the
        # reset of the activations those units read (csrc/ops/tp_experts.cuh)
        add("moe_combine", l, [("topk", DEP_ALL), ("expert2", DEP_ALL)])
        add("unpool", l, [("moe_combine", DEP_ALL)])
        if l + 1 < c.n_layers:
            add("qkv", l + 1, [("unpool", DEP_ALL)])
        else:
            add("lm_head", l, [("unpool", DEP_ALL)])
            add("argmax", l, [("lm_head", DEP_ALL)])
        if mode == "layer":
            cut()
    if mode == "step":
        cut()
    if spec == "verify":  # its own launch: the step's split times it apart (megakernel/decode.py)
        last_layer = c.n_layers - 1
        add("accept", last_layer, [])  # reads argmax's tokens: the previous launch
        add("compact", last_layer, [("accept", DEP_ALL)])
        add("advance", last_layer, [("compact", DEP_ALL)])
        cut()
    # A dependency on an op of an earlier launch is met before the launch's compute warps start:
    # by stream order, and with PDL by griddepcontrol.wait (the previous grid complete, its memory
    # visible; megakernel.cu). So it is not waited for, and its producer bumps no counter for it:
    # in "layer" mode a wait for the previous launch's qkv groups would cost an acquire round trip
    # at every launch's start, and qkv's release fence would end every launch (interp.py walks the
    # launches in order, as the stream does).
    launch_of = {i: li for li, (first, n) in enumerate(launches) for i in range(first, first + n)}
    ops = [replace(o, deps=tuple(d for d in o.deps if launch_of[d.producer] == launch_of[o.index])) for o in ops]
    total = {d.producer for o in ops for d in o.deps if d.mode == DEP_ALL}
    group = {d.producer for o in ops for d in o.deps if d.mode == DEP_GROUP}
    ops = [replace(o, signal=(SIGNAL_TOTAL if o.index in total else 0) | (SIGNAL_GROUPS if o.index in group else 0))
           for o in ops]
    prog = Program(plan, tuple(ops), tuple(launches), counters, mode, spec)
    check(prog)
    return prog


def grouped(prog: Program, groups: int) -> Program:
    """The program of a step of `groups` row groups (Plan.row_groups, groups.GroupEngine): each
    instance of `prog` once per group, with the group's own counters and dependencies only on its
    own group's instances, interleaved instance by instance inside each launch so that the groups'
    units of one weight tile run close together (the later ones' weights may still be in L2).
    Group g's instances are rotated a further g / groups of the grid (both assignments): an op of
    fewer units than blocks puts each group's units on blocks of their own, not every group's on
    the same blocks one after another (a fused pair by the same amount, so its units stay together).
    A fused gate/up and its down projection stay adjacent per group: the down projection's units
    run on the blocks that ran the gate/up units of its index (DEP_LOCAL) and read the
    activations those kept (block.cuh enter_group forgets every kept unit on a change of group).
    Every group's instances are those of its own step, so a group's bits are those of its step
    alone; the launches are `prog`'s, each `groups` times as long.

    A spec program (the drafter's pass, the verify step) is grouped the same way: each group's
    seed / tree first, its accept, compact and advance in the last launch, every one on its own
    group's state (decode.SpecPair with full trees: one request a group).

    Plan.union_experts: each layer's gate/up and down projection are one instance (group 0's)
    over the union of every group's routing, after every group's top-k; each group's MoE combine
    waits for it. Every group's top-k and pooler bump group 0's counters (one counter each,
    plan.UNION_SHARED): the union's units wait for all of them at once (program.cuh all_target)."""
    if not isinstance(groups, int) or not 1 <= groups <= prog.plan.row_groups:
        raise ValueError(f"{groups!r} row groups: the plan's build takes 1..{prog.plan.row_groups}")
    if groups == 1:
        return prog
    union = prog.plan.union_experts
    order: list[tuple[int, int]] = []  # (instance of prog, group)
    launches = []
    for first, n in prog.launches:
        start = len(order)
        for i in range(first, first + n):
            o = prog.ops[i]
            if o.kind == "expert2" and any(d.mode == DEP_LOCAL for d in o.deps):
                continue  # emitted right after its gate/up, group by group
            pair = (i + 1 < first + n and prog.ops[i + 1].kind == "expert2"
                    and any(d.mode == DEP_LOCAL and d.producer == i for d in prog.ops[i + 1].deps))
            for g in range(1 if union and o.kind in UNION_OPS else groups):
                order.append((i, g))
                if pair:
                    order.append((i + 1, g))
        launches.append((start, len(order) - start))
    at = {key: k for k, key in enumerate(order)}
    nc = prog.n_counters

    def producer(d: Dep, g: int) -> int:  # a union op is group 0's only instance
        return at[(d.producer, 0 if union and prog.ops[d.producer].kind in UNION_OPS else g)]

    ops = []
    for k, (i, g) in enumerate(order):
        o = prog.ops[i]
        gc = 0 if union and o.kind in UNION_SHARED else g  # whose counters it bumps
        ops.append(replace(o, index=k, group=g, deps=tuple(Dep(producer(d, g), d.mode) for d in o.deps),
                           rot=(o.rot + g * prog.plan.n_sm // groups) % prog.plan.n_sm,
                           counter=o.counter + gc * nc, group_base=o.group_base + gc * nc if o.n_groups else -1))
    out = Program(prog.plan, tuple(ops), tuple(launches), nc * groups, prog.mode, prog.spec, groups)
    check(out)
    return out


def check(prog: Program) -> None:
    """Structural checks: deps point backwards within the same launch (a dependency on an
    earlier launch is satisfied by stream order), kinds and groups are consistent."""
    launch_of = {}
    for li, (first, n) in enumerate(prog.launches):
        for i in range(first, first + n):
            launch_of[i] = li
    assert sorted(launch_of) == list(range(len(prog.ops))), "every op in exactly one launch"
    kinds = [o.kind for o in prog.ops]
    if prog.spec is None:
        assert not set(kinds) & set(SPEC_KINDS), "a plain program holds no speculative op"
    elif prog.spec == "draft":
        g = prog.groups  # row groups (grouped): each instance once per group, group after group
        assert kinds[:2 * g] == ["seed"] * g + ["embed"] * g and kinds.count("seed") == g \
            and not {"tree", "accept", "compact", "advance"} & set(kinds), "draft: seed, then the plain step"
    else:
        # advance is the only writer of the state the next step reads: every op that reads it
        # (tree, accept, compact) runs before it, and the last launch holds the three alone (a
        # group's three: each group's advance writes its own group's state and step block)
        g, (first, n) = prog.groups, prog.launches[-1]
        assert kinds[:2 * g] == ["tree"] * g + ["embed"] * g \
            and kinds[first:] == ["accept"] * g + ["compact"] * g + ["advance"] * g \
            and n == 3 * g and kinds.count("tree") == g and "seed" not in kinds, "verify: tree first, accept launch last"
    # a collective wait's id keeps the op index in 12 bits (csrc/mk/tp.cuh what_x; runtime.describe_wait)
    assert not prog.plan.tp_ranks or len(prog.ops) <= MAX_TP_OPS, f"{len(prog.ops)} op instances, TP takes {MAX_TP_OPS}"
    for o in prog.ops:
        assert o.kind in OP_KINDS
        if o.kind in ("expert1", "expert2"):
            # the routed ops learn their slot count from dependency 0 (program.cuh compute_loop):
            # top-k must run in their launch
            assert o.deps and prog.ops[o.deps[0].producer].kind == "topk", \
                f"{o.kind}(L{o.layer}): routing not waited for"
        for d in o.deps:
            assert d.producer < o.index, f"{o.kind}(L{o.layer}) depends on a later op"
            assert launch_of[d.producer] == launch_of[o.index], f"{o.kind}(L{o.layer}) waits for an earlier launch"
            p = prog.ops[d.producer]
            if d.mode == DEP_SENTINEL:  # the kernel polls sentinel slots on these edges only (ops/topk.cuh, TP's)
                assert (o.kind, p.kind) in SENTINEL_EDGES and (p.kind == "router" or prog.plan.tp_ranks), \
                    f"{o.kind} <- {p.kind}: no sentinel slots"
            # union experts: every group's MoE combine reads the union's expert outputs
            assert p.group == o.group or (prog.plan.union_experts and p.kind in UNION_OPS and p.group == 0), \
                f"{o.kind}(L{o.layer}) of group {o.group} waits for group {p.group}"
            if d.mode == DEP_LOCAL:  # unit u of both on the same block: same assignment, same count
                assert (o.kind, p.kind) == ("expert2", "expert1") and o.assign == p.assign == ASSIGN_CONTIG \
                    and o.rot == p.rot and prog.plan.fused_experts, f"{o.kind} <- {p.kind}: no block-local rule"
                # the gate/up it reads kept units of runs right before it (block.cuh enter_group)
                assert d.producer == o.index - 1, f"{o.kind}(L{o.layer}): its gate/up is not the instance before it"
            if d.mode == DEP_GROUP:
                needed_group(prog.plan, o.kind, p.kind, o.layer, 0, 1, 0)  # raises if no rule
                assert p.n_groups > 0

"""Batched decode steps: B requests in one megakernel step (runtime.Engine.step_batch), their shapes,
their check and their timing.

The contract is reference.step_batch: request r's logits, greedy tokens and KV cache are those of
its own step on its own cache. The kernel keeps them bitwise equal to request r run alone (B=1):
every op but attention is row-independent (the dense projections and the expert GEMMs compute each
row's dot products in one fixed order whatever the other rows hold; the routing is per row, its
slots the union over the batch), and attention splits each request's keys by its own context and
tree size only (program.attn_span), so nothing of another request enters a request's reductions.
`check_batch` checks all three: each request against the reference (within REL_TOL), against its
own B=1 step (bitwise: logits, tokens, KV cache) and mega against chain (bitwise, at every emulated
schedule given).

Rows: the requests' trees are concatenated. Up to T_MAX = 16 rows they are one m16 tile of tokens in
every GEMM: B = 1..16 at T = 1, B = 2 at T <= 8, B = 4 at T <= 4, B = 8 at T <= 2, one Engine. Past
16 rows (B = 2, 4, 8 at T = 16) whole requests are packed into row groups of up to 16 rows, their op
instances interleaved in one launch (groups.GroupEngine, Plan.row_groups): each request's bits are
still those of its B=1 step, and the weights are read once per group, not once per step.

The peer at the same B (peer.BatchPeerRunner, timed by peer_bench.peer_batch_point on this
module's batch_context): norms, dense GEMMs and the fused MoE once over all rows, RoPE + KV write
and attention one launch per request; no tile limit; checked per request against the reference
(logits and KV caches within REL_TOL; not bitwise its B=1 step, its GEMMs run over other row counts).
"""
from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from microbench.errors import CorrectnessError
from microbench.results import Bound, Series

from . import bench_baselines, reference, tree
from .bench_baselines import study_like_distinct, weights_for
from .config import ConfigError, ModelConfig
from .kernel_count import count_kernels
from .measure import graph_of
from .groups import GroupEngine, pack_groups
from .plan import MAX_ROW_GROUPS, Plan
from .plans import REL_TOL
from .reference import KVCache, Request, Trace
from .results_names import step_params
from .roofline import batch_roofline
from .routing import distinct_per_layer, expert_streams_per_layer, synthetic_routes
from .runtime import Engine, StepOut, check_close
from .weights import ModelWeights

def mix(cfg: ModelConfig, batch: int, seed: int = 0, tokens: int | None = None,
        ctx: int | None = None, max_rows: int | None = None) -> list[tuple[int, int]]:
    """(T_r, ctx_r) of `batch` requests: `tokens` / `ctx` for every request where given, else a
    seeded random mix (trees of 1..T_MAX // B tokens; contexts anywhere the cache allows, so past
    the sliding window too). Refuses a batch of more rows than max_rows where given (the peer's
    steps take any row count), else than row groups hold (plan.MAX_ROW_GROUPS groups of T_MAX rows)."""
    if not isinstance(batch, int) or not 1 <= batch <= cfg.max_tree:
        raise ConfigError(f"batch {batch!r}: want 1..{cfg.max_tree} requests (each has at least one row)")
    g = random.Random(seed)
    out = []
    for _ in range(batch):
        t = tokens if tokens is not None else g.randint(1, max(1, cfg.max_tree // batch))
        c = ctx if ctx is not None else g.randint(0, cfg.max_context - t)
        out.append((int(t), int(c)))
    rows = sum(t for t, _ in out)
    if max_rows is not None:
        if rows > max_rows:
            raise ConfigError(f"B x T = {batch} x {tokens} = {rows} token rows; this step takes at most {max_rows}")
    elif rows > cfg.max_tree * MAX_ROW_GROUPS:
        raise ConfigError(f"B x T = {batch} x {tokens} = {rows} token rows in one step; a step holds at most "
                          f"{cfg.max_tree * MAX_ROW_GROUPS} ({MAX_ROW_GROUPS} row groups of {cfg.max_tree})")
    return out


def make_requests(cfg: ModelConfig, shape: Sequence[tuple[int, int]], seed: int = 0) -> list[Request]:
    """Random tokens on a binary-ish tree of T_r tokens at context ctx_r, one request per (T_r, ctx_r)."""
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(0, cfg.vocab, (t,), generator=g), tree.binary_ish(t) if t > 1 else [-1], c)
            for t, c in shape]


def random_caches(cfg: ModelConfig, n: int, seed: int = 0, device="cpu") -> list[KVCache]:
    """n KV caches of random slots (a prefilled prompt's stand-in), each from its own seed."""
    return [KVCache(cfg, device=device).fill_random(torch.Generator(device=device).manual_seed(seed + 7919 * r))
            for r in range(n)]


def _routes(traces: Sequence[Trace], n_layers: int) -> list[torch.Tensor]:
    """The reference's routing of every request, per layer over the batch's rows in order."""
    return [torch.cat([tr.tensors[f"L{l}.route"] for tr in traces]) for l in range(n_layers)]


@dataclass
class BatchCheck:
    shape: tuple[tuple[int, int], ...]  # (T_r, ctx_r) per request
    rel_err: tuple[float, ...] = ()  # per request: batched mega (reference routing) vs reference.step
    greedy: tuple[bool, ...] = ()  # per request: its greedy tokens equal the reference's
    alone: tuple[bool, ...] = ()  # per request: logits, tokens and KV cache bitwise those of its B=1 step
    chain: dict[str, bool] = field(default_factory=dict)  # per mega run: bitwise equal to chain (logits, tokens, caches)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        out = []
        for r, (t, c) in enumerate(self.shape):
            out.append(f"request {r}: T={t} ctx={c}: rel err {self.rel_err[r]:.2e} vs reference, greedy tokens "
                       f"{'equal' if self.greedy[r] else 'DIFFER'}, {'bitwise' if self.alone[r] else 'NOT bitwise'} "
                       "its own B=1 step (logits, tokens, KV cache)")
        for name, eq in self.chain.items():
            out.append(f"mega ({name}) {'==' if eq else '!='} chain bitwise (logits, tokens, KV caches)")
        return out + [f"MISMATCH: {p}" for p in self.problems]


def engine_for(w: ModelWeights, plan: Plan, caches: Sequence[KVCache], **kw) -> Engine | GroupEngine:
    """The engine a plan's build runs in: row groups (Plan.row_groups > 1) a GroupEngine, else an Engine."""
    return (GroupEngine if plan.row_groups > 1 else Engine)(w, plan, list(caches), **kw)


def _same(a: StepOut, b: StepOut, ca: KVCache, cb: KVCache) -> bool:
    return torch.equal(a.logits, b.logits) and torch.equal(a.tokens, b.tokens) and ca.equal(cb)


def check_batch(w: ModelWeights, plan: Plan, caches0: Sequence[KVCache], requests: Sequence[Request], *,
                backend: str = "emu", schedules: Sequence[str] = ("random", "last"), grid: int | None = None,
                rel: float = REL_TOL, seed: int = 1) -> BatchCheck:
    """A batched step checked three ways (module docstring), from poisoned buffers: each request
    against the reference with its routing forced (within `rel`, greedy tokens equal), against
    its own B=1 step (bitwise, the kernel's own routing: the batch's expert slots are the union),
    and mega against chain (bitwise, one mega run per emulated schedule; the GPU runs one).
    Returns the findings; nothing raises on a mismatch (BatchCheck.ok)."""
    reqs = list(requests)
    shape = tuple((len(q.tokens), int(q.ctx)) for q in reqs)
    res = BatchCheck(shape)
    n = len(reqs)

    def engine(caches, schedule="random", pl=plan):
        kw = {"emu_schedule": schedule, "emu_seed": seed} if backend == "emu" else {}
        return engine_for(w, pl, caches, backend=backend, grid=grid, **kw)

    # each request alone (B=1, mega), the kernel's own routing, on the build without row groups
    # (the same op code: groups only choose which rows and parameter block an op instance runs)
    alone = []
    for r, q in enumerate(reqs):
        c = caches0[r].clone()
        alone.append((engine([c], pl=replace(plan, row_groups=1)).step_batch([q], mode="mega"), c))
    # the batch: chain, then mega per schedule
    runs = {}
    for name, mode, sched in [("chain", "chain", "random")] + [(s, "mega", s) for s in
                                                                (schedules if backend == "emu" else ("gpu",))]:
        cs = [c.clone() for c in caches0[:n]]
        eng = engine(cs, sched if backend == "emu" else "random")
        eng.poison()
        runs[name] = (eng.step_batch(reqs, mode=mode), cs)
    ch_out, ch_caches = runs.pop("chain")
    for name, (out, cs) in runs.items():
        res.chain[name] = torch.equal(out.logits, ch_out.logits) and torch.equal(out.tokens, ch_out.tokens) and all(
            a.equal(b) for a, b in zip(cs, ch_caches))
        if not res.chain[name]:
            res.problems.append(f"mega ({name}) differs from chain")
    res.alone = tuple(_same(ch_out.request(r), alone[r][0], ch_caches[r], alone[r][1]) for r in range(n))
    res.problems += [f"request {r} differs from its own B=1 step" for r in range(n) if not res.alone[r]]
    # the reference, its routing forced on the kernel (a router near-tie must not flip an expert)
    traces = [Trace() for _ in reqs]
    ref_caches = [c.clone() for c in caches0[:n]]
    ref = reference.step_batch(w, ref_caches, reqs, traces=traces)
    routes = _routes(traces, w.cfg.n_layers)
    cs = [c.clone() for c in caches0[:n]]
    eng = engine(cs)
    eng.poison()
    forced = eng.step_batch(reqs, mode="mega", routes=routes)
    errs, greedy = [], []
    b = forced.row0
    for r in range(n):
        got, want = forced.request(r), ref[b[r]:b[r + 1]]
        try:
            errs.append(check_close(got.logits, want, f"request {r} vs reference", rel=rel))
            for x, y in zip(cs[r].k + cs[r].v, ref_caches[r].k + ref_caches[r].v):
                check_close(x, y, f"request {r}: KV cache vs reference", rel=rel)
        except CorrectnessError as e:
            errs.append(float("nan"))
            res.problems.append(str(e))
        greedy.append(bool(torch.equal(got.tokens.cpu(), reference.argmax(want).cpu())))
        if not greedy[-1]:
            res.problems.append(f"request {r}: greedy tokens differ from the reference's")
    res.rel_err, res.greedy = tuple(errs), tuple(greedy)
    return res


# ---------------------------------------------------------------------- timing on a GPU
@dataclass
class BatchContext:
    preset: str
    shape: tuple[tuple[int, int], ...]
    requests: list[Request]
    caches0: list[KVCache]
    routes: list[torch.Tensor]  # per layer [rows, top_k] on the GPU: every request's synthetic routing
    distinct: list[int]  # per layer: the union of the batch's experts
    ref_logits: torch.Tensor  # [rows, V]: reference.step_batch with that routing
    ref_caches: list[KVCache]  # each request's cache after that reference step (the peer's KV check)


# The newest batch contexts, least recently used first. Bound: MAX_CONTEXTS of them. Danger: each
# holds two KV caches per request on the GPU (shard8: 0.5 GB each, 8 GB at B = 8), and a run over
# the batch curve's points would otherwise keep every point's beside the weights (60 GB at shard8)
# until its GPU ran out of memory.
_CONTEXTS: OrderedDict = OrderedDict()
MAX_CONTEXTS = 2


def batch_context(preset: str, batch: int, tokens: int, ctx: int, seed: int = 0,
                  max_rows: int | None = None) -> BatchContext:
    """B requests of T tokens at context ctx with the study-like synthetic routing of a T-token step
    each (bench_baselines.study_like_distinct; independent requests, so the batch's union is up to B
    times a request's experts), random caches, and the reference's logits. Cached per process, the
    MAX_CONTEXTS most recently used.
    max_rows: as mix's (the peer's points past the megakernel's 16 rows pass B x T)."""
    key = (preset, batch, tokens, ctx, seed)
    if key in _CONTEXTS:
        _CONTEXTS.move_to_end(key)
    else:
        while len(_CONTEXTS) >= MAX_CONTEXTS:  # the oldest goes before this one takes its memory
            _CONTEXTS.popitem(last=False)
        w = weights_for(preset)
        cfg = w.cfg
        shape = tuple(mix(cfg, batch, seed, tokens, ctx, max_rows))
        reqs = make_requests(cfg, shape, seed)
        per = []
        for r in range(batch):
            g = torch.Generator().manual_seed(seed + 7919 * r + 1000 * tokens + ctx)
            per.append(synthetic_routes(cfg, tokens, study_like_distinct(cfg, tokens), g))
        dev = bench_baselines.DEVICE  # read at the call: the CPU dry runs set "cpu"
        routes = [torch.cat([p[l] for p in per]).to(dev) for l in range(cfg.n_layers)]
        caches0 = random_caches(cfg, batch, seed, device=dev)
        ref_caches = [c.clone() for c in caches0]
        ref = reference.step_batch(w, ref_caches, reqs, routes=routes)
        _CONTEXTS[key] = BatchContext(preset, shape, reqs, caches0, routes, distinct_per_layer(routes), ref, ref_caches)
    return _CONTEXTS[key]


def release(preset: str | None = None) -> None:
    """Forget the batch contexts of a preset (all when None): their caches, the reference's caches
    and logits go with the next collection (bench_baselines.release calls this)."""
    for k in [k for k in _CONTEXTS if preset is None or k[0] == preset]:
        del _CONTEXTS[k]


bench_baselines.RELEASE_HOOKS.append(release)  # bench_baselines.release frees the batch contexts too


def batch_series_name(preset: str, batch: int, tokens: int, ctx: int, impl: str) -> str:
    """`{preset}/B{B}/T{T}/ctx{ctx}/{impl}` (the report reads the params; B=1 steps keep the
    results_names.step_series_name form)."""
    return f"{preset}/B{int(batch)}/T{int(tokens)}/ctx{int(ctx)}/{impl}"


def bench_batch_point(h, preset: str, batch: int, tokens: int, ctx: int, plan: Plan, mode: str, ceiling) -> Series:
    """A batched step of `mode` ("mega" or "chain") replayed from a CUDA graph, checked per request
    against the reference before it is timed, against the batch's roofline (roofline.batch_roofline:
    the union of routed experts, the dense weights once, each request's KV reads). Past 16 rows the
    step runs in row groups (groups.GroupEngine), which read the dense weights once per group and
    the routed experts once per 16 of an expert's tokens over every group (Plan.union_experts; off,
    the per-group ablation, once per group that routes to it): the roofline counts each once, so
    its fraction shows what the groups cost."""
    if mode not in ("mega", "chain"):
        raise ConfigError(f"{mode!r}: a batched step runs in mode mega or chain")
    bc = batch_context(preset, batch, tokens, ctx)
    w = weights_for(preset)
    eng = engine_for(w, plan, [c.clone() for c in bc.caches0], backend="gpu")
    out = eng.step_batch(bc.requests, mode=mode, routes=bc.routes)
    for r in range(batch):  # this very engine, per request, before its timing counts
        b = out.row0
        check_close(out.request(r).logits, bc.ref_logits[b[r]:b[r + 1]],
                    f"{preset} B={batch} T={tokens} ctx={ctx} {mode} request {r}: before timing", rel=REL_TOL)
    kc = count_kernels(lambda: eng.launch_step(mode))
    g, per = graph_of(eng, mode)
    t = h.time(g.replay)
    rf = batch_roofline(w.cfg, bc.shape, bc.distinct, ceiling=ceiling)
    samples = np.asarray(t.samples_s) / per
    bound = Bound("time", rf.seconds, "s", f"roofline of {batch} requests: {rf.bytes.total} B (experts: the union "
                  f"over the batch, dense weights once, each request's KV) / {rf.read_ceiling:.3e} B/s ({rf.source})")
    return Series.from_samples(
        batch_series_name(preset, batch, tokens, ctx, mode), samples, timer="cuda_event", unit="s",
        params=step_params(preset, tokens, ctx, mode, int(round(float(np.mean(bc.distinct)))), batch=batch,
                           launch="cuda_graph"),
        bound=bound, clocks=t.clocks, warnings=t.warnings,
        metrics={"launches_per_step": kc.kernels_per_step, "bytes_per_step": rf.bytes.total, "roofline_s": rf.seconds,
                 "tokens_per_step": batch * tokens, "requests": batch, "grid": eng.grid,
                 "distinct_experts_union_max": max(bc.distinct), "smem_bytes": plan.smem_bytes,
                 "row_groups": plan.row_groups, "union_experts": int(plan.union_experts),
                 # the build's expert weight streams a layer (a model from the routing), against the
                 # roofline's distinct experts: what the row groups cost
                 "expert_streams_per_layer": float(np.mean(expert_streams_per_layer(
                     bc.routes, group_rows_of(eng, bc.shape), plan.union_experts)))})


def layer_weight_model(cfg: ModelConfig, layers: Sequence[int], routes: Sequence[torch.Tensor],
                       group_rows: Sequence[int], union: bool) -> dict[str, int]:
    """Weight bytes of these layers under a batched step's routing (a model to hold a profiled
    launch's DRAM reads against, ncu-mega --batch): the dense weights once (the roofline's) and
    once per row group (what the groups stream unless L2 serves the later ones), and the routed
    experts' bytes as the build streams them (routing.expert_streams_per_layer) and as the
    roofline counts them (the distinct experts of every row)."""
    layers = sorted(set(layers))
    if not layers or not all(0 <= l < cfg.n_layers for l in layers):
        raise ConfigError(f"{cfg.name}: layers {layers}: want some of 0..{cfg.n_layers - 1}")
    sel = [routes[l] for l in layers]
    streams = expert_streams_per_layer(sel, list(group_rows), union)
    dense = len(layers) * cfg.dense_layer_bytes()
    return {"dense_once": dense, "dense_per_group": dense * len(group_rows),
            "experts_streamed": sum(streams) * cfg.expert_bytes,
            "experts_distinct": sum(distinct_per_layer(sel)) * cfg.expert_bytes}


def group_rows_of(eng, shape) -> list[int]:
    """The rows of each row group the engine's step ran in (one group: an Engine's)."""
    rows = [t for t, _ in shape]
    if not isinstance(eng, GroupEngine):
        return [sum(rows)]
    return [sum(rows[r] for r in g) for g in pack_groups(rows, eng.cfg.max_tree)]

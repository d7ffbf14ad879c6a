"""pytest-benchmark cases of the megakernel step (device time): chain mode and mega mode on small
and shard8, T=1 and T=16, and batched steps of B requests (plans.BATCH_FULL: B = 2, 4, 8 at T = 1,
B = 2 at T = 8, B = 4 at T = 4, and B = 2, 4, 8 at T = 16 in row groups; B = 1 is the plain cases'
T = 1 and T = 16). Each states its roofline as its bound (a batch's: the union of routed experts,
the dense weights once, each request's KV reads) and tokens per step (B x T). The peer at the same
batched points (test_peer_batched_step: peer.BatchPeerRunner, one CUDA graph a step, block sizes from
peer_bench.tuned_configs at B x T rows; skips without triton). A megakernel launch is a CUDA-graph
replay of 2 steps (the counters' parities alternate); device_bench reports per step, so one round
is one step (extra_info time_per)."""
from __future__ import annotations

import pytest


pytestmark = pytest.mark.gpu
POINTS = [("small", 1, 512), ("small", 16, 512), ("shard8", 1, 2048), ("shard8", 16, 2048)]
# (preset, B, T, ctx): plans.BATCH_FULL, written out so that collecting needs no torch
BATCH_POINTS = [(p, b, t, c) for p, c in (("small", 512), ("shard8", 2048))
                for b, t in ((2, 1), (4, 1), (8, 1), (2, 8), (4, 4), (2, 16), (4, 16), (8, 16))]


def _case(preset, T, ctx, mode):
    from microbench.harness import Case, Prepared
    from microbench.results import Bound

    from megakernel.bench_baselines import step_context, weights_for
    from megakernel.measure import graph_of
    from megakernel.plans import REL_TOL, plan_for
    from megakernel.roofline import roofline
    from megakernel.runtime import Engine, check_close

    def prepare(h):
        sc = step_context(preset, T, ctx)
        w = weights_for(preset)
        eng = Engine(w, plan_for(preset, tokens=T), sc.cache0.clone(), backend="gpu")  # the build for T
        routes = [r.cuda() for r in sc.routes]
        out = eng.step(sc.tokens, sc.parents, ctx, mode=mode, routes=routes)
        check_close(out.logits, sc.ref_logits, f"{preset}/{mode}", rel=REL_TOL)
        g, per = graph_of(eng, mode)
        rf = roofline(w.cfg, T, ctx, sc.distinct)
        prepared = Prepared(launch=g.replay, bound=Bound("time", rf.seconds, "s", f"roofline of one step ({rf.source})"),
                            metrics={"steps_per_round": per, "roofline_s_per_step": rf.seconds})
        prepared._engine = eng  # keep the engine (and its buffers) alive while the graph is replayed
        return prepared

    return Case(f"megakernel/{preset}/T{T}/ctx{ctx}/{mode}", {"preset": preset, "T": T, "ctx": ctx, "mode": mode},
                prepare)


def _batch_case(preset, B, T, ctx, mode):
    from microbench.harness import Case, Prepared
    from microbench.results import Bound

    from megakernel.batch import batch_context, batch_series_name, engine_for
    from megakernel.bench_baselines import weights_for
    from megakernel.config import preset as get_preset
    from megakernel.measure import graph_of
    from megakernel.plans import REL_TOL, plan_for, rows_switches
    from megakernel.roofline import batch_roofline
    from megakernel.runtime import check_close

    def prepare(h):
        bc = batch_context(preset, B, T, ctx)
        w = weights_for(preset)
        # the build for B x T rows (past 16: row groups, a GroupEngine, their experts over the union)
        plan = plan_for(preset, **rows_switches(get_preset(preset), B * T))
        eng = engine_for(w, plan, [c.clone() for c in bc.caches0], backend="gpu")
        out = eng.step_batch(bc.requests, mode=mode, routes=bc.routes)
        for r in range(B):  # each request against the reference before anything is timed
            lo, hi = out.row0[r], out.row0[r + 1]
            check_close(out.request(r).logits, bc.ref_logits[lo:hi], f"{preset} B={B}/{mode} request {r}", rel=REL_TOL)
        g, per = graph_of(eng, mode)
        rf = batch_roofline(w.cfg, bc.shape, bc.distinct)
        prepared = Prepared(launch=g.replay, bound=Bound("time", rf.seconds, "s", f"roofline of one step of {B} "
                                                         f"requests: experts the union, dense once, each request's "
                                                         f"KV ({rf.source})"),
                            metrics={"steps_per_round": per, "roofline_s_per_step": rf.seconds,
                                     "tokens_per_step": B * T, "requests": B, "row_groups": plan.row_groups,
                                     "union_experts": int(plan.union_experts)})
        prepared._engine = eng  # keep the engine (and its buffers) alive while the graph is replayed
        return prepared

    return Case(f"megakernel/{batch_series_name(preset, B, T, ctx, mode)}",
                {"preset": preset, "B": B, "T": T, "ctx": ctx, "mode": mode}, prepare)


def _peer_batch_case(preset, B, T, ctx):
    from microbench.harness import Case, Prepared
    from microbench.results import Bound

    from megakernel.batch import batch_context, batch_series_name
    from megakernel.bench_baselines import weights_for
    from megakernel.peer import BatchPeerRunner, PeerModel, StepGraph, check_batch_step
    from megakernel.peer_bench import tuned_configs
    from megakernel.plans import REL_TOL
    from megakernel.roofline import batch_roofline

    def prepare(h):
        from megakernel import tiling

        tiling.clear()  # the megakernel cases' tiled weights are not the peer's: room for its largest batches
        bc = batch_context(preset, B, T, ctx, max_rows=B * T)
        w = weights_for(preset)
        up, down, src = tuned_configs(preset, B * T, gpu=h.info.name)
        caches = [c.clone() for c in bc.caches0]
        r = BatchPeerRunner(PeerModel(w, up, down), caches, [q.parents for q in bc.requests],
                            r_read=[q.ctx for q in bc.requests], forced=True, n_sm=h.info.sm_count)
        r.set_requests(bc.requests, bc.routes)
        # each request against the reference (logits and KV caches) before anything is timed
        check_batch_step(r, r.run(), caches, bc.ref_logits, bc.ref_caches, f"{preset} B={B}/peer", REL_TOL)
        g = StepGraph(r)
        rf = batch_roofline(w.cfg, bc.shape, bc.distinct)
        prepared = Prepared(launch=g.replay, bound=Bound("time", rf.seconds, "s", f"roofline of one step of {B} "
                                                         f"requests: experts the union, dense once, each request's "
                                                         f"KV ({rf.source})"),
                            metrics={"roofline_s_per_step": rf.seconds, "tokens_per_step": B * T, "requests": B,
                                     "moe_up_config": up.label(), "moe_down_config": down.label(),
                                     "moe_configs_from": src})
        prepared._graph = g  # keep the graph (and the runner's buffers) alive while it is replayed
        return prepared

    return Case(f"megakernel/{batch_series_name(preset, B, T, ctx, 'peer')}",
                {"preset": preset, "B": B, "T": T, "ctx": ctx, "mode": "peer"}, prepare)


@pytest.mark.parametrize("mode", ["chain", "mega"])
@pytest.mark.parametrize("preset,T,ctx", POINTS, ids=lambda v: str(v))
def test_megakernel_step(device_bench, preset, T, ctx, mode):
    device_bench(_case(preset, T, ctx, mode))


@pytest.mark.parametrize("mode", ["chain", "mega"])
@pytest.mark.parametrize("preset,B,T,ctx", BATCH_POINTS, ids=lambda v: str(v))
def test_megakernel_batched_step(device_bench, preset, B, T, ctx, mode):
    device_bench(_batch_case(preset, B, T, ctx, mode))


@pytest.mark.parametrize("preset,B,T,ctx", BATCH_POINTS, ids=lambda v: str(v))
def test_peer_batched_step(device_bench, preset, B, T, ctx):
    pytest.importorskip("triton")
    device_bench(_peer_batch_case(preset, B, T, ctx))

"""pytest-benchmark cases of the competent baselines (device time, CUDA-graph replays): the peer
(peer.py: Triton fused MoE over the routed experts, cuBLAS, flash-decoding tree attention, one
CUDA graph per step) and the megakernel's chain without PDL (the chain with PDL is
test_bench_megakernel's "chain"), on small and shard8 at T=1 and T=16, forced routing. Each case
checks against reference.step before timing. Skips without a GPU or triton. The peer runs its
default block sizes here (megakernel.peer_bench tunes them)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")
POINTS = [("small", 1, 512), ("small", 16, 512), ("shard8", 1, 2048), ("shard8", 16, 2048)]


@pytest.fixture(scope="module", autouse=True)
def _free_weights():
    yield
    from megakernel import bench_baselines as bb

    bb.release()


def _peer_case(preset, T, ctx):
    from microbench.harness import Case, Prepared
    from microbench.results import Bound

    from megakernel.bench_baselines import step_context, weights_for
    from megakernel.peer import PeerModel, PeerRunner, StepGraph, check_step
    from megakernel.plans import REL_TOL
    from megakernel.roofline import roofline

    def prepare(h):
        sc = step_context(preset, T, ctx)
        w = weights_for(preset)
        cache = sc.cache0.clone()
        r = PeerRunner(PeerModel(w), cache, sc.parents, r_read=ctx, forced=True, n_sm=h.info.sm_count)
        r.set_inputs(sc.tokens, ctx, sc.routes)
        check_step(r, r.run(), cache, sc.ref_logits, sc.ref_cache, f"{preset}/peer", REL_TOL)
        g = StepGraph(r)
        rf = roofline(w.cfg, T, ctx, sc.distinct)
        prepared = Prepared(launch=g.replay, bound=Bound("time", rf.seconds, "s", f"roofline ({rf.source})"),
                            metrics={"roofline_s_per_step": rf.seconds, "moe_up_config": r.model.up_cfg.label()})
        prepared._graph = g  # keep the graph (and the runner's buffers) alive while it is replayed
        return prepared

    return Case(f"peer/{preset}/T{T}/ctx{ctx}/peer", {"preset": preset, "T": T, "ctx": ctx, "impl": "peer"}, prepare)


@pytest.mark.parametrize("preset,T,ctx", POINTS, ids=lambda v: str(v))
def test_peer_step(device_bench, preset, T, ctx):
    device_bench(_peer_case(preset, T, ctx))


@pytest.mark.parametrize("preset,T,ctx", POINTS, ids=lambda v: str(v))
def test_chain_nopdl_step(device_bench, preset, T, ctx):
    from test_bench_megakernel import _case

    device_bench(_case(preset, T, ctx, "chain_nopdl"))

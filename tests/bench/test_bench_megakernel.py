"""pytest-benchmark cases of the megakernel step (device time): chain mode and mega mode on small
and shard8, T=1 and T=16. A launch is a CUDA-graph replay of 2 steps (the counters' parities
alternate); device_bench reports per step, so one round is one step (extra_info time_per)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
POINTS = [("small", 1, 512), ("small", 16, 512), ("shard8", 1, 2048), ("shard8", 16, 2048)]


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


@pytest.mark.parametrize("mode", ["chain", "mega"])
@pytest.mark.parametrize("preset,T,ctx", POINTS, ids=lambda v: str(v))
def test_megakernel_step(device_bench, preset, T, ctx, mode):
    device_bench(_case(preset, T, ctx, mode))

"""GPU checks of the model baselines (megakernel/baselines.py): the profiler counts kernels exactly
(also inside a CUDA graph); the eager baseline computes reference.step on the GPU past the sliding
window and a broken variant is caught; real top-k routing agrees; eager, CUDA graph and
torch.compile agree with each other and with the reference; the harness times a launcher too
long to queue behind its blocking kernel. Budget: < 60 s on the H200 (one small torch.compile)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def small():
    from megakernel import bench_baselines as bb

    w = bb.weights_for("small")
    yield w
    bb.release("small")


def _point(cfg, n_tokens, ctx, distinct, seed):
    import torch

    from megakernel import reference, routing, tree

    g = torch.Generator().manual_seed(seed)
    cache0 = reference.KVCache(cfg, device="cuda").fill_random(torch.Generator(device="cuda").manual_seed(seed))
    parents = tree.binary_ish(n_tokens) if n_tokens > 1 else [-1]
    tokens = torch.randint(0, cfg.vocab, (n_tokens,), generator=g)
    routes = routing.synthetic_routes(cfg, n_tokens, distinct, g) if distinct else None
    return cache0, parents, tokens, routes


def test_profiler_counts_kernels_exactly_also_inside_a_graph():
    import torch

    from megakernel.kernel_count import count_kernels

    x = torch.zeros(4096, device="cuda")

    def ten():
        for _ in range(10):
            x.add_(1.0)

    k = count_kernels(ten)
    assert (k.kernels, k.graph_launches) == (10, 0) and k.launch_calls >= 10, k
    assert count_kernels(ten, steps=3).kernels_per_step == 10
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ten()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ten()
    kg = count_kernels(g.replay)
    assert kg.graph_launches == 1 and kg.launch_calls == 0, kg
    assert kg.kernels in (10, 0), kg  # 0 would mean CUPTI hides graph kernels: bench falls back (and says so)
    if kg.kernels == 0:
        pytest.xfail("CUPTI reported no kernel activities inside a CUDA graph replay on this driver")


def test_eager_matches_reference_past_the_window_and_a_broken_variant_is_caught(small):
    import torch

    from megakernel import baselines as B
    from megakernel import reference
    from microbench.errors import CorrectnessError

    cfg = small.cfg
    ctx = cfg.window + 76  # 1100: sliding layers see W-1 rows; the tree's new rows wrap the 1040-slot ring
    cache0, parents, tokens, routes = _point(cfg, 16, ctx, 27, seed=1)
    rc, bc = cache0.clone(), cache0.clone()
    routes_d = [r.cuda() for r in routes]
    ref = reference.step(small, rc, tokens, parents, ctx, routes=routes_d)
    out = B.eager_step(small, bc, tokens, parents, ctx, routes=routes_d)
    ag = B.compare(out, ref, bc, rc, ctx, 16)
    print("small T=16 eager vs reference:", ag, "out_dtype path:", B.torch_model(small).out_dtype)
    assert ag.argmax_agree == 1.0
    # every layer routed to the next expert over: the 5%-of-row-RMS check must see it (positions off
    # by one were seen on the H200 to stay under it at small: the backbone dominates the logits)
    wrong = [(r + 1) % cfg.n_experts for r in routes_d]
    bad = B.eager_step(small, cache0.clone(), tokens, parents, ctx, routes=wrong)
    with pytest.raises(CorrectnessError, match="logits differ"):
        B.compare(bad, ref, what="experts shifted by one")
    del bc, rc
    torch.cuda.empty_cache()


def test_real_topk_routing_agrees_with_the_reference(small):
    """Real routing: a token whose routes (and its ancestors') match the reference's in every layer
    must match its logits; near-tie flips of top-k are legitimate and only counted."""
    from megakernel import baselines as B
    from megakernel import reference

    cfg = small.cfg
    cache0, parents, tokens, _ = _point(cfg, 16, 300, 0, seed=2)
    tr = reference.Trace()
    ref = reference.step(small, cache0.clone(), tokens, parents, 300, trace=tr)
    r = B.StepRunner(B.torch_model(small), cache0.clone(), parents, r_global=300, r_sliding=300, routed=False)
    r.set_inputs(tokens, 300)
    r.route_log = []
    out = r.run()
    ref_routes = [tr.tensors[f"L{l}.route"] for l in range(cfg.n_layers)]
    same = B.route_agreement(parents, r.route_log, ref_routes)
    print(f"routes agree for {int(same.sum())} of {len(same)} tokens")
    assert float(same.float().mean()) >= 0.5
    B.compare(out.cpu()[same], ref.cpu()[same], what="real routing, tokens whose routes agree")


def test_eager_graph_and_compile_agree():
    """tiny on the GPU, T=16 at ctx 12 (global and sliding layers read the same number of rows:
    one compiled layer shape). The graph replays the eager chain; compile must run under CUDA
    graphs without graph breaks or cudagraph skips."""
    import torch

    from megakernel import baselines as B
    from megakernel import config, reference
    from megakernel.weights import generate

    cfg = config.preset("tiny")
    w = generate(cfg, device="cuda")
    cache0, parents, tokens, routes = _point(cfg, 16, 12, 4, seed=3)
    routes = [r.cuda() for r in routes]
    rc = cache0.clone()
    ref = reference.step(w, rc, tokens, parents, 12, routes=routes)
    outs = {}
    for kind in B.BASELINES:
        c = cache0.clone()
        runner = B.make_runner(kind, w, c, parents, tokens, 12, routes=routes)
        outs[kind] = runner.run().clone()
        again = runner.run().clone()  # a replay changes nothing (the step is idempotent)
        assert torch.equal(outs[kind], again), kind
        B.compare(outs[kind], ref, c, rc, 12, 16, what=kind)
        if kind == "compile":
            st = B.compile_stats()
            print("compile:", st, f"first call {runner.compile_s:.1f} s")
            assert st["graph_breaks"] == 0 and st["cudagraph_skips"] == 0, st
            assert 1 <= st["unique_graphs"] <= 4, st
    print("graph bitwise equal to eager:", torch.equal(outs["graph"], outs["eager"]))
    B.compare(outs["graph"], outs["eager"], rel_tol=1e-3, what="graph vs eager")  # same kernels (cuBLAS may pick others under capture)


def test_harness_times_long_chains_without_holding_the_stream(harness):
    """3000 launches per call would overflow the launch queue behind the blocking kernel; with
    hold=False every sample starts on an idle device and includes the host's submission."""
    import torch

    from microbench.harness import quick_policy

    x = torch.zeros(1024, device="cuda")

    def chain():
        for _ in range(3000):
            x.add_(1.0)

    t = harness.time(chain, hold=False, policy=quick_policy(min_samples=3, max_samples=5, budget_s=0.01, chunk=2))
    assert 3 <= len(t.samples_s) <= 5 and not any("blocking kernel" in x for x in t.warnings)
    assert 3000 * 0.5e-6 < t.median_s < 3000 * 50e-6, t.median_s


def test_read_ceiling_is_a_measurement_for_this_gpu(harness):
    from megakernel.roofline import read_ceiling

    v, src = read_ceiling(gpu=harness.info.name)
    print("read ceiling:", v, src)
    assert not src.startswith("DEFAULT")

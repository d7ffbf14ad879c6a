"""The torch baselines' step (megakernel/baselines.py) on the CPU, the roofline, the series naming,
the profiler-event classifier and the bench's helpers. (The GPU runs are tests/gpu/test_model_gpu.py.)"""
from __future__ import annotations

import pytest
import torch

from megakernel import baselines as B
from megakernel import config, reference, roofline, routing, tree
from megakernel.config import ConfigError
from megakernel.fp4_layout import half_word_table
from megakernel.results_names import parse_step_series_name, step_params, step_series_name
from megakernel.weights import generate
from microbench.errors import CorrectnessError


@pytest.fixture(scope="module")
def model():
    cfg = config.preset("tiny")
    return cfg, generate(cfg)


def _point(cfg, n_tokens, ctx, routed, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache0 = reference.KVCache(cfg).fill_random(g)
    parents = tree.binary_ish(n_tokens) if n_tokens > 1 else [-1]
    tokens = torch.randint(0, cfg.vocab, (n_tokens,), generator=g)
    routes = routing.synthetic_routes(cfg, n_tokens, min(cfg.n_experts, n_tokens * cfg.top_k, 2 * cfg.top_k), g) \
        if routed else None
    return cache0, parents, tokens, routes


@pytest.mark.parametrize("n_tokens, ctx, routed", [(16, 40, False), (16, 40, True), (16, 3, True), (1, 0, False),
                                                    (1, 70, True), (5, 100, False)])
def test_eager_baseline_computes_the_reference_step(model, n_tokens, ctx, routed):
    """On the CPU the baseline's fp32 fallback matmuls are the reference's own ops: the logits and
    every cache slot agree to the last bit in practice; compare() is the contract (tight here)."""
    cfg, w = model
    cache0, parents, tokens, routes = _point(cfg, n_tokens, ctx, routed, seed=ctx)
    rc, bc = cache0.clone(), cache0.clone()
    ref = reference.step(w, rc, tokens, parents, ctx, routes=routes)
    out = B.eager_step(w, bc, tokens, parents, ctx, routes=routes)
    ag = B.compare(out, ref, bc, rc, ctx, n_tokens, rel_tol=1e-5)
    assert ag.argmax_agree == 1.0
    assert rc.equal(bc)  # nothing else in the cache was touched


def test_real_routing_matches_reference_trace(model):
    cfg, w = model
    cache0, parents, tokens, _ = _point(cfg, 16, 40, False, seed=5)
    tr = reference.Trace()
    reference.step(w, cache0.clone(), tokens, parents, 40, trace=tr)
    r = B.StepRunner(B.torch_model(w), cache0.clone(), parents, r_global=40, r_sliding=16, routed=False)
    r.set_inputs(tokens, 40)
    r.route_log = []
    r.run()
    ref_routes = [tr.tensors[f"L{l}.route"] for l in range(cfg.n_layers)]
    assert all(torch.equal(a, b) for a, b in zip(r.route_log, ref_routes))
    assert bool(B.route_agreement(parents, r.route_log, ref_routes).all())
    flipped = [x.clone() for x in ref_routes]
    flipped[1][3] = flipped[1][3].flip(0) + 0  # same set, other order: still agrees
    assert bool(B.route_agreement(parents, r.route_log, flipped).all())
    flipped[1][3, 0] = (set(range(cfg.n_experts)) - set(flipped[1][3].tolist())).pop()
    agree = B.route_agreement(parents, r.route_log, flipped)
    assert not agree[3] and not agree[5] and agree[4]  # node 3 and its descendant 5; 4 is a sibling branch


@pytest.mark.parametrize("broken", ["position", "routes", "kv_row"])
def test_the_reference_check_catches_broken_variants(model, broken):
    cfg, w = model
    cache0, parents, tokens, routes = _point(cfg, 16, 40, True, seed=9)
    rc, bc = cache0.clone(), cache0.clone()
    ref = reference.step(w, rc, tokens, parents, 40, routes=routes)
    if broken == "position":  # every position off by one
        out = B.eager_step(w, bc, tokens, parents, 41, routes=routes)
        match = "logits differ"
    elif broken == "routes":  # routing changed in every layer
        other = routing.synthetic_routes(cfg, 16, 4, torch.Generator().manual_seed(99))
        out = B.eager_step(w, bc, tokens, parents, 40, routes=other)
        match = "logits differ"
    else:  # one new K row of the last layer wrong (logits right)
        out = B.eager_step(w, bc, tokens, parents, 40, routes=routes)
        bc.k[2][:, bc.slot(2, 45)] += 0.5
        match = "new K of layer 2"
    with pytest.raises(CorrectnessError, match=match):
        B.compare(out, ref, bc, rc, 40, 16)


def test_dequant_tables_reproduce_nvfp4_exactly(model):
    cfg, w = model
    lw = w.layers[1]
    slots = torch.tensor([3, 0, 3])
    got = B._dequant(lw.w1.codes[slots], lw.w1.scales[slots], half_word_table("cpu", torch.bfloat16), B.e4m3_lut("cpu"))
    for i, e in enumerate(slots.tolist()):
        assert torch.equal(got[i].float(), lw.w1.expert(e).dequant_bf16_exact())


def test_runner_refuses_bad_inputs(model):
    cfg, w = model
    cache = reference.KVCache(cfg)
    r = B.StepRunner(B.torch_model(w), cache, tree.chain(4), r_global=20, r_sliding=10, routed=False)
    with pytest.raises(ConfigError, match="global read size 20"):
        r.set_inputs([1, 2, 3, 4], 21)
    with pytest.raises(ConfigError, match="needs 15 sliding rows"):
        r.set_inputs([1, 2, 3, 4], 20)
    with pytest.raises(ConfigError, match="3 tokens for a 4-token tree"):
        r.set_inputs([1, 2, 3], 5)
    with pytest.raises(ConfigError, match="token ids"):
        r.set_inputs([1, 2, 3, cfg.vocab], 5)
    with pytest.raises(ConfigError, match="routes given"):
        r.set_inputs([1, 2, 3, 4], 5, routes=[torch.zeros(4, 2, dtype=torch.long)] * 3)
    with pytest.raises(ConfigError, match="set_inputs"):
        r.run()
    with pytest.raises(ConfigError, match="float32 only"):
        B.eager_step(w, cache, [1], [-1], 0, acc=torch.float64)
    with pytest.raises(ConfigError, match="unknown baseline"):
        B.make_runner("jit", w, cache, [-1], [1], 0)


def test_expert_slot_accounting():
    s8, sm = config.preset("shard8"), config.preset("small")
    assert (B.expert_slots(s8, 16), B.expert_slots(s8, 1), B.expert_slots(sm, 16)) == (128, 8, 64)
    assert B.dequant_bytes_per_step(s8, 16) == 128 * 3 * 2048 * 1024 * 2 * 62


# ---------------------------------------------------------------------- roofline
def test_roofline_hand_computed_tiny():
    """tiny: d=128, 3 layers (layer 2 global), W=16, 4 q / 2 kv heads of 64, 8 experts (top-2),
    p=64, f=64, vocab 512. Every number below is worked out by hand from those dims."""
    cfg = config.preset("tiny")
    dense_params = 2 * 128 + (4 + 2 * 2) * 64 * 128 + 128 * 4 * 64 + 8 * 128 + 2 * 64 * 128  # = 115968
    assert dense_params == 115968
    expert_bytes = 3 * 64 * 64 // 2 + 3 * 64 * 64 // 16 + 8  # codes + E4M3 scales + 2 fp32 tensor scales
    assert expert_bytes == 6920
    row = 2 * 2 * 64 * 2  # K and V, 2 kv heads, 64 dims, bf16 = 512 B
    sb = roofline.step_bytes(cfg, 16, 40, 4)
    assert sb.dense == 3 * 2 * 115968 == 695808
    assert sb.experts == 3 * 4 * 6920 == 83040
    assert sb.kv_read == ((15 + 16) * 2 + (40 + 16)) * row == 60416  # sliding: min(40, W-1) + T; global ctx + T
    assert sb.kv_write == 3 * 16 * row == 24576
    assert sb.lm_head == 512 * 128 * 2 + 128 * 2 == 131328
    assert sb.embed == 16 * 128 * 2 == 4096
    assert sb.total == 999264
    t1 = roofline.step_bytes(cfg, 1, 5, [2, 2, 2])
    assert t1.kv_read == ((5 + 1) * 2 + (5 + 1)) * row and t1.experts == 3 * 2 * 6920
    rl = roofline.roofline(cfg, 16, 40, 4, ceiling=(1e12, "test"))
    assert rl.seconds == pytest.approx(999264 / 1e12) and rl.source == "test"


def test_roofline_refuses_impossible_inputs():
    cfg = config.preset("tiny")
    with pytest.raises(ConfigError, match="allow 2..2"):
        roofline.step_bytes(cfg, 1, 0, 3)
    with pytest.raises(ConfigError, match="for 2 layers"):
        roofline.step_bytes(cfg, 16, 0, [4, 4])
    with pytest.raises(ConfigError, match="exceeds the cache"):
        roofline.step_bytes(cfg, 16, 120, 4)
    with pytest.raises(ConfigError, match="must be positive"):
        roofline.roofline(cfg, 1, 0, 2, ceiling=(0.0, "x"))


def _result(bench, derived, gpu="NVIDIA H200", date="2026-11-29T10:00:00Z"):
    from microbench.results import Derived, Env, Result

    env = Env(gpu=gpu, gpu_uuid="x", cc="9.0", sm_count=132, l2_bytes=62914560, sm_clock_max_mhz=1980,
              mem_clock_max_mhz=3201, driver="580", nvrtc="13.0", cuda_core="1.2.0", torch="2.11", python="3.12",
              git_sha="abcdef0123", git_dirty=False, host="h", date=date)
    return Result(bench, env, (), {k: Derived(v, "B/s", "rule") for k, v in derived.items()})


def test_read_ceiling_prefers_the_weights_measurement_then_memcpy_then_default(tmp_path):
    assert roofline.read_ceiling(roots=[tmp_path])[1].startswith("DEFAULT")
    _result("basics.copy", {"memcpy_bandwidth": 4.2e12}).save(tmp_path)
    v, src = roofline.read_ceiling(gpu="NVIDIA H200", roots=[tmp_path])
    assert v == 4.2e12 and "basics.copy memcpy_bandwidth" in src and "proxy" in src
    assert roofline.read_ceiling(gpu="NVIDIA B200", roots=[tmp_path])[1].startswith("DEFAULT")  # never crosses GPUs
    _result("weights.read_ceiling", {"read_ceiling_bytes_per_s": 4.5e12}).save(tmp_path)
    v, src = roofline.read_ceiling(gpu="NVIDIA H200", roots=[tmp_path])
    assert v == 4.5e12 and src.startswith("weights.read_ceiling")


def test_committed_h200_results_give_a_measured_ceiling():
    """With the committed results the ceiling is the newest H200 weights.read_ceiling's, not the
    documented default (whatever value that run measured)."""
    from microbench.results import REPO_ROOT, latest

    committed = REPO_ROOT / "reports" / "results"
    r = latest("weights.read_ceiling", root=committed, gpu="NVIDIA H200")
    assert r is not None, "no committed weights.read_ceiling result of the H200"
    v, src = roofline.read_ceiling(gpu="NVIDIA H200", roots=[committed])
    assert v == r.derived["read_ceiling_bytes_per_s"].value and src.startswith("weights.read_ceiling ")
    assert r.env.date in src


# ---------------------------------------------------------------------- naming, counting, bench helpers
def test_step_series_names_round_trip_and_refuse_bad_parts():
    n = step_series_name("shard8", 16, 2048, "graph")
    assert n == "shard8/T16/ctx2048/graph" and parse_step_series_name(n) == ("shard8", 16, 2048, "graph")
    p = step_params("small", 1, 512, "torch_eager", 8, baseline="eager")
    assert p == {"preset": "small", "T": 1, "ctx": 512, "tokens": 1, "context": 512, "batch": 1,
                 "impl": "torch_eager", "distinct_experts": 8, "baseline": "eager"}
    for bad in (("a/b", 1, 0, "x"), ("a", 0, 0, "x"), ("a", 1, -1, "x"), ("a", 1, 0, "")):
        with pytest.raises(ValueError):
            step_series_name(*bad)
    with pytest.raises(ValueError, match="fixed key"):
        step_params("a", 1, 0, "x", 2, tokens=3)
    with pytest.raises(ValueError, match="not a step series"):
        parse_step_series_name("small/T1/512/eager")


class _Ev:
    def __init__(self, name, dev):
        self._n, self._d = name, dev

    def name(self):
        return self._n

    def device_type(self):
        return self._d


def test_kernel_event_classifier():
    from torch.autograd import DeviceType

    from megakernel.kernel_count import classify

    cuda, cpu = DeviceType.CUDA, DeviceType.CPU
    ev = ([_Ev("void gemv<...>", cuda)] * 3 + [_Ev("triton_poi_fused_0", cuda)] * 2
          + [_Ev("Memcpy HtoD (Pageable -> Device)", cuda), _Ev("Memset (Device)", cuda)]
          + [_Ev("cudaLaunchKernel", cpu)] * 4 + [_Ev("cuLaunchKernelEx", cpu), _Ev("cudaGraphLaunch", cpu)]
          + [_Ev("aten::mm", cpu), _Ev("cudaMemcpyAsync", cpu), _Ev("cudaStreamSynchronize", cpu)])
    k = classify(ev, steps=1)
    assert (k.kernels, k.memcpy, k.memset, k.launch_calls, k.graph_launches) == (5, 1, 1, 5, 1)
    assert k.top[0] == ("void gemv<...>", 3)
    assert classify(ev, steps=5).kernels_per_step == 1.0
    assert classify(ev[1:], steps=1).kernels == 4  # one kernel fewer is noticed
    with pytest.raises(ValueError):
        classify(ev, steps=0)


def test_bench_points_and_cases_are_well_formed():
    from megakernel import bench_baselines as bb

    s8, sm, ty = config.preset("shard8"), config.preset("small"), config.preset("tiny")
    assert bb.study_like_distinct(s8, 16) == 49  # the study's measured count at its own shape
    assert bb.study_like_distinct(s8, 1) == 8 and bb.study_like_distinct(sm, 1) == 8
    assert bb.study_like_distinct(sm, 16) == 27 and 2 <= bb.study_like_distinct(ty, 16) <= 8
    assert bb.QUICK_POINTS == {"small": [(1, 512), (16, 512)], "shard8": [(1, 2048), (16, 2048)]}
    for preset, pts in bb.FULL_POINTS.items():
        w = config.preset(preset).window
        assert any(c <= w for _, c in pts) and any(c > 2 * w for _, c in pts)  # short and past the window
    case = bb.baseline_case("shard8", 16, 2048, "compile")
    assert case.name == "shard8/T16/ctx2048/compile"
    assert case.params["impl"] == "naive_torch_compile" and case.params["distinct_experts"] == 49
    assert bb.BENCHMARKS == {"model.baselines": bb.run}
    with pytest.raises(ValueError, match="unknown baseline"):
        bb.baseline_case("small", 1, 512, "jit")

"""CPU dry run of megakernel.peer (peer_bench.run) on a small model: the peer's rows end to end
with Triton's interpreter for the kernels and host-timed stand-ins for what needs a GPU (the
harness, CUDA graphs, the CUPTI counts and kernel times), so the plumbing is checked: the sweep
and its records, the checks before timing (a broken step must show as FAILED), the typed series
(params, metrics, bound), the per-kernel series, mega's ratios, the table, the saved file."""
from __future__ import annotations

import dataclasses

import time

import numpy as np
import pytest

pytest.importorskip("triton")

from megakernel import config  # noqa: E402
from microbench.harness import Timing  # noqa: E402
from microbench.errors import CorrectnessError  # noqa: E402
from microbench.results import Series, find, load  # noqa: E402


class FakeInfo:
    name = "NVIDIA H200"
    sm_count = 4


class FakeHarness:
    device_index = 0

    def __init__(self):
        self.info = FakeInfo()
        self.timed = 0

    def time(self, launch, **_):
        self.timed += 1
        s = []
        for _ in range(1):
            t0 = time.perf_counter()
            launch()
            s.append(time.perf_counter() - t0)
        return Timing(np.asarray(s), 1, False, {"sm_mhz_after": 0})


def _micro():
    return config.preset("tiny").replace(name="micro", n_layers=2, global_layers=(1,), window=8, n_heads=2,
                                         n_kv_heads=1, n_experts=4, top_k=2, d_pool=128, d_expert=128, max_context=64)


@pytest.fixture
def dry(monkeypatch):
    from megakernel import bench_baselines as bb
    from megakernel import kernel_count, peer, peer_bench
    from megakernel import peer_kernels as K

    monkeypatch.setitem(config.PRESETS, "micro", _micro())
    monkeypatch.setattr(bb, "DEVICE", "cpu")
    monkeypatch.setattr(peer, "SWEEP", ((64, 128, 4, 3), (32, 128, 4, 4)))
    monkeypatch.setattr(peer_bench, "SWEEP", peer.SWEEP)
    monkeypatch.setattr(peer_bench, "GREEDY_STEPS", 2)
    monkeypatch.setattr(peer_bench, "GREEDY_PRESETS", ("micro",))
    fake = kernel_count.KernelCount(1, 31, 0, 0, 31, 0, (("k", 31),))
    monkeypatch.setattr(kernel_count, "count_kernels", lambda fn, steps=1: (fn(), fake)[1])
    monkeypatch.setattr(peer_bench, "count_kernels", kernel_count.count_kernels)  # imported at its top

    class Graph:  # replays the step un-graphed
        def __init__(self, runner):
            self.runner = runner
            self.replay()

        def replay(self):
            self.logits = self.runner.run()
            self.tokens = self.runner.out_tokens
            return self.logits

    monkeypatch.setattr(peer, "StepGraph", Graph)
    monkeypatch.setattr(peer_bench, "StepGraph", peer.StepGraph)
    def kernel_times(runner, steps=3, breakdown=None):  # one step run; fixed per-op times, one kernel each
        runner.run()
        if breakdown is not None:
            breakdown.update({op: {f"_{op}_kernel": 1e-6 * (i + 1)} for i, op in enumerate(peer.OPS)})
        return {op: [1e-6 * (i + 1)] * steps for i, op in enumerate(peer.OPS)}, "cupti"

    monkeypatch.setattr(peer, "kernel_times", kernel_times)
    monkeypatch.setattr(peer_bench, "kernel_times", peer.kernel_times)
    with K.interpreted():
        yield peer_bench
    bb.release()


@pytest.mark.slow
def test_peer_rows_end_to_end(dry):
    pb = dry
    h = FakeHarness()
    res = pb.run(points=(("micro", 4, 12),), mega=False, compile=False, h=h, log=lambda *_: None)
    assert not any("FAILED" in n for n in res.notes), res.notes
    steps = {s.name: s for s in res.series if "impl" in s.params}
    assert set(steps) == {"micro/T4/ctx12/peer", "micro/T4/ctx12/peer@real"}
    for s in steps.values():
        p, m = s.params, s.metrics
        assert p["impl"] == "peer" and p["tokens"] == 4 and p["context"] == 12 and p["preset"] == "micro"
        assert m["launches_per_step"] == 31 and m["bytes_per_step"] > 0 and s.bound.value == m["roofline_s"] > 0
        assert m["ref_rel_err"] < 1e-2 and m["moe_up_config"] in ("n64k128w4s3", "n32k128w4s4")
    assert steps["micro/T4/ctx12/peer@real"].params["routing"] == "real"
    tune = [s for s in res.series if s.params.get("kind") == "peer_tune"]
    assert len(tune) == 4 and sum(s.metrics["chosen"] for s in tune) == 2  # one chosen per kernel
    kern = {s.params["op"]: s for s in res.series if s.params.get("kind") == "peer_kernel"}
    from megakernel.peer import OPS

    assert set(kern) == set(OPS) and kern["moe_up"].timer == "cupti"
    assert kern["moe_up"].metrics["kernels"] == {"_moe_up_kernel": pytest.approx(kern["moe_up"].summary.median)}
    assert kern["moe_up"].metrics["read_fraction"] > 0 and abs(sum(s.metrics["share_of_kernel_time"]
                                                                   for s in kern.values()) - 1) < 1e-9
    assert any("greedy decoding over 2 steps" in n for n in res.notes)
    assert any("fused MoE (up + down)" in n for n in res.notes)
    back = load(find("megakernel.peer")[-1])
    assert {s.name for s in back.series} == {s.name for s in res.series}


@pytest.mark.slow
def test_a_wrong_peer_is_reported_failed_and_not_timed(dry, monkeypatch):
    from megakernel import peer

    pb = dry
    orig = peer.PeerRunner.set_inputs

    def broken(self, tokens, ctx, routes=None):
        orig(self, tokens, ctx, routes)
        self.anc_t.fill_(-1)  # every token sees every tree token

    monkeypatch.setattr(peer.PeerRunner, "set_inputs", broken)
    res = pb.run(points=(("micro", 4, 12),), mega=False, compile=False, h=FakeHarness(), log=lambda *_: None,
                 greedy_presets=(), save=False)
    assert any("peer rows: FAILED: CorrectnessError" in n for n in res.notes), res.notes
    assert not any(s.params.get("impl") == "peer" and s.params.get("routing") == "forced" for s in res.series)


def test_ratios_and_table():
    from megakernel.peer_bench import ratios, table
    from microbench.results import Env, Result

    def row(impl, routing, t):
        return Series.from_samples(f"{impl}/{routing}", [t], timer="cuda_event", unit="s",
                                   params={"preset": "shard8", "tokens": 16, "context": 2048, "impl": impl,
                                           "routing": routing}, metrics={"launches_per_step": 1})

    rows = [row("mega", "forced", 2.0), row("peer", "forced", 3.0), row("mega", "real", 4.0), row("peer", "real", 5.0),
            row("chain", "forced", 2.5)]
    d = ratios(rows[1:], measured=rows[:1])
    assert d["mega_speedup/shard8/T16/ctx2048/forced/vs_peer"].value == 1.5
    assert d["mega_speedup/shard8/T16/ctx2048/real/vs_peer"].value == 1.25
    assert d["mega_speedup/shard8/T16/ctx2048/forced/vs_chain"].value == 1.25
    assert not any("vs_mega" in k for k in d)
    res = Result("megakernel.peer", Env.capture(None), tuple(rows))
    text = table(res)
    assert "1.50x" in text and "1.25x" in text
    from megakernel.peer_bench import markdown

    md = markdown(res)
    line = next(x for x in md.splitlines() if "| peer |" in x and "| real |" in x)
    assert line.endswith("| 1.25x |") and "5 s" in line


def test_tuned_configs_from_the_newest_sweep(tmp_path):
    from megakernel.peer import default_moe_configs
    from megakernel.peer_bench import BENCHMARK, tuned_configs
    from microbench.results import Env, Result

    def tune(kernel, config, chosen, tokens=16):
        return Series.from_samples(f"shard8/T{tokens}/ctx2048/tune/{kernel}/{config}", [1e-4], timer="cuda_event",
                                   unit="s", params={"preset": "shard8", "tokens": tokens, "context": 2048,
                                                     "kernel": kernel, "config": config, "kind": "peer_tune"},
                                   metrics={"chosen": chosen})

    up, down, src = tuned_configs("shard8", 16, roots=[tmp_path])
    assert (up, down) == default_moe_configs() and "defaults" in src
    Result(BENCHMARK, dataclasses.replace(Env.capture(None), gpu="NVIDIA Test A"), (tune("moe_up", "n64k128w4s3", 0), tune("moe_up", "n128k256w8s3", 1),
                                          tune("moe_down", "n32k128w4s4", 1), tune("moe_up", "n64k256w8s3", 1, 1)),
           ).save(tmp_path)
    up, down, src = tuned_configs("shard8", 16, roots=[tmp_path])
    assert (up.label(), down.label()) == ("n128k256w8s3", "n32k128w4s4") and BENCHMARK in src
    assert tuned_configs("shard8", 1, roots=[tmp_path])[2].startswith("defaults")  # only moe_up chosen at T=1
    # another GPU model's sweep is not this one's: its block sizes were timed on other hardware
    assert tuned_configs("shard8", 16, roots=[tmp_path], gpu="NVIDIA Test A")[2] == src
    up, down, other = tuned_configs("shard8", 16, roots=[tmp_path], gpu="NVIDIA Other GPU")
    assert (up, down) == default_moe_configs() and "defaults" in other and "NVIDIA Other GPU" in other


def test_pipeline_peer_row_refuses_what_it_cannot_run(monkeypatch):
    from megakernel import peer, peer_bench
    from megakernel.peer_bench import peer_point

    monkeypatch.setattr(peer, "available", lambda: None)
    monkeypatch.setattr(peer_bench, "available", peer.available)
    with pytest.raises(RuntimeError, match="multiples of 128"):
        peer_point(FakeHarness(), "tiny", 16, 100, (4.6e12, "test"))
    monkeypatch.setattr(peer, "available", lambda: "triton is not installed (test)")
    monkeypatch.setattr(peer_bench, "available", peer.available)
    with pytest.raises(RuntimeError, match="triton is not installed"):
        peer_point(FakeHarness(), "small", 16, 512, (4.6e12, "test"))


def _batch_point(pb, monkeypatch):
    from megakernel import peer

    monkeypatch.setattr(peer, "available", lambda: None)  # the interpreter stands in for the GPU
    monkeypatch.setattr(pb, "available", peer.available)
    return pb.peer_batch_point(FakeHarness(), "micro", 2, 4, 12, (4.6e12, "test"), log=lambda *_: None)


def test_peer_batch_point_checks_every_request_then_times_one_graph(dry, monkeypatch):
    """The pipeline's batched peer row (megakernel.pipeline.BATCH_PEERS) end to end on the CPU:
    batch.batch_context's requests, the per-request check, the series' name, params, bound."""
    from megakernel.batch import batch_context, batch_series_name
    from megakernel.roofline import batch_roofline

    s = _batch_point(dry, monkeypatch)
    assert s.name == batch_series_name("micro", 2, 4, 12, "peer") == "micro/B2/T4/ctx12/peer"
    p, m = s.params, s.metrics
    assert (p["impl"], p["batch"], p["tokens"], p["context"], p["launch"]) == ("peer", 2, 4, 12, "cuda_graph")
    bc = batch_context("micro", 2, 4, 12)
    rf = batch_roofline(config.preset("micro"), bc.shape, bc.distinct, ceiling=(4.6e12, "test"))
    assert s.bound.value == m["roofline_s"] == rf.seconds and m["bytes_per_step"] == rf.bytes.total
    assert m["requests"] == 2 and m["tokens_per_step"] == 8 and m["launches_per_step"] == 31
    assert 0 < m["ref_rel_err"] < 1e-2 and m["ref_kv_rel_err"] < 1e-2 and m["moe_configs_from"]


def test_a_wrong_batched_peer_is_refused_before_timing(dry, monkeypatch):
    from megakernel import peer

    orig = peer.BatchPeerRunner.set_requests

    def swapped(self, requests, routes=None):  # requests 0 and 1 each on the other's KV cache
        orig(self, requests, routes)
        a, b = self.requests[0], self.requests[1]
        a.cache, b.cache = b.cache, a.cache

    monkeypatch.setattr(peer.BatchPeerRunner, "set_requests", swapped)
    with pytest.raises(CorrectnessError, match="micro/B2/T4/ctx12 peer request 0"):
        _batch_point(dry, monkeypatch)


def test_peer_batch_point_takes_rows_past_the_megakernels_16(dry, monkeypatch):
    """The peer at B = 2 T = 16 (32 rows, the megakernel's row groups) runs and is checked per
    request; the megakernel's mix refuses more rows than its row groups hold."""
    from megakernel import peer
    from megakernel.batch import mix

    monkeypatch.setattr(peer, "available", lambda: None)
    monkeypatch.setattr(dry, "available", peer.available)
    s = dry.peer_batch_point(FakeHarness(), "micro", 2, 16, 12, (4.6e12, "test"), log=lambda *_: None)
    assert s.metrics["tokens_per_step"] == 32 and s.params["batch"] == 2 and s.params["tokens"] == 16
    assert 0 < s.metrics["ref_rel_err"] < 1e-2
    cfg = config.preset("micro")
    with pytest.raises(config.ConfigError, match=f"at most {8 * cfg.max_tree}"):
        mix(cfg, 9, tokens=cfg.max_tree, ctx=12)


def test_batch_contexts_keep_only_the_newest(dry):
    """batch.batch_context caches the MAX_CONTEXTS most recently used points: a hit moves its point
    to the newest, a new point evicts the oldest first (each holds two KV caches per request on the
    GPU; a batch curve keeping every point's beside shard8's weights would outgrow an 80 GB card)."""
    from megakernel import batch
    from megakernel.batch import batch_context

    batch.release()
    assert batch.MAX_CONTEXTS == 2
    a = batch_context("micro", 2, 4, 12)
    b = batch_context("micro", 1, 4, 12)
    assert batch_context("micro", 2, 4, 12) is a  # a hit: a is now the newest, b the oldest
    c = batch_context("micro", 2, 2, 12)
    assert list(batch._CONTEXTS.values()) == [a, c]
    assert batch_context("micro", 1, 4, 12) is not b  # b was evicted: rebuilt, a evicted in turn
    assert len(batch._CONTEXTS) == 2 and batch_context("micro", 2, 2, 12) is c
    batch.release()

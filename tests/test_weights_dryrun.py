"""CPU dry run of the weights benchmarks: every run function end to end with the kernels
replaced by torch emulations of their outputs and the harness by one that returns modelled
timings. It checks the plumbing (launch arguments reach the right places, checks run, the
derivations produce every constant the table asks for), not the GPU: a kernel bug is the GPU
tests' business. An emulated kernel that breaks its contract must still be caught."""
from __future__ import annotations

import contextlib
import types
import weakref

import numpy as np
import pytest
import torch

from microbench.constants import SPECS
from microbench.errors import CorrectnessError
from microbench.results import Series

KiB, MiB = 1 << 10, 1 << 20
L2 = 8 * MiB  # a small L2 keeps the emulated buffers (3x L2 scrubs, expert pools) cheap on a CPU


class FakeInfo:
    name = "NVIDIA H200"
    sm_count = 132
    l2_bytes = L2
    persisting_l2_max_bytes = 39321600
    smem_per_block_optin = 232448
    smem_per_sm = 233472
    reserved_smem_per_block = 1024
    sm_clock_max_mhz = 1980
    arch = "sm_90a"


class FakeKernel:
    def __init__(self, name):
        self.name = name
        self.attributes = types.SimpleNamespace(shared_size_bytes=128, num_regs=32)


class FakeModule:
    def kernel(self, name):
        return FakeKernel(name)


class Memory:
    """Live tensors by address, so an emulated pointer chase can dereference what it loads."""

    def __init__(self):
        self.bufs = []

    def add(self, t):
        self.bufs = [r for r in self.bufs if r() is not None] + [weakref.ref(t)]
        return t

    def view64(self, addr):
        for r in self.bufs:
            t = r()
            if t is not None and t.data_ptr() <= addr < t.data_ptr() + t.numel() * t.element_size():
                return t.data_ptr(), t.view(torch.int64).numpy()
        raise AssertionError(f"emulated chase read unmapped address {addr:#x}")


def _i32(x):
    return ((x + 2**31) % 2**32 - 2**31).to(torch.int32)


def emulate(mem, broken=()):
    from microbench.weights import kernels as K

    def cached(t, key, fn):
        """Memoised on the tensor itself (addresses are reused after a free), keyed by its version."""
        memo = t.__dict__.setdefault("_dry_memo", {})
        key = (t._version, *key)
        if key not in memo:
            memo[key] = fn()
        return memo[key]

    def launch(kernel, spec, *a, persistent=False):
        n = kernel.name
        if n.startswith("mb_read_"):
            buf, n16, total, out = a[0], int(a[1]), int(a[2]), a[3]
            s = cached(buf, ("read", n16),
                       lambda: buf.view(-1, 4).sum(0, dtype=torch.int64)) * (total // n16)
            if n == "mb_read_broken" or "read" in broken:
                s[3] -= int(buf.view(-1, 4)[-1, 3])
            out.zero_()
            out.view(-1, 4)[0] = _i32(s)
        elif n.startswith("mb_ring_stream"):
            buf, nchunks, _, B = a[0], int(a[1]), int(a[2]), int(a[3])
            out = a[5] if n == "mb_ring_stream_pieces" else a[4]
            out.copy_(_i32(cached(buf, ("ring", B, nchunks),
                                  lambda: K.ring_reference(buf, B, out.numel(), nchunks))))
            if "ring" in broken:
                out[0] += 1
        elif n == "mb_ring_phases":
            pool, X, pf, npf, rd, nrd, pa, pa_chunks, busy, S, B, out, stamps = a[:13]
            X, nrd, pa_chunks, B = int(X), int(nrd), int(pa_chunks), int(B)
            g = out.numel() // 2
            sums = cached(pool, ("items", X, B), lambda: K.item_sums(pool, X, B))
            exp_b = K.phase_reference(sums, rd[:nrd].tolist(), g)
            exp_a = (cached(pa, ("ring", B, pa_chunks),
                            lambda: K.ring_reference(pa, B, g, pa_chunks)) if pa_chunks
                     else torch.zeros(g, dtype=torch.int64))
            out.view(-1, 2)[:, 0] = _i32(exp_b)
            out.view(-1, 2)[:, 1] = _i32(exp_a)
            st = stamps.view(-1, 3)
            st[:, 0] = 1000
            st[:, 1] = 1000 + int(busy) // 2
            st[:, 2] = st[:, 1] + 5000
        elif n == "mb_chase":
            start, steps, out, lat, n_lat = int(a[0]), int(a[1]), a[2], a[3], int(a[4])
            base, words = mem.view64(start)
            p = start
            for _ in range(n_lat + steps):
                p = int(words[(p - base) // 8])
            out.copy_(torch.tensor([p, 600 * steps, 300 * steps, 7], dtype=torch.int64))
            if n_lat:
                lat[:n_lat] = 600
        elif n == "mb_l2_priority_normal":
            pass
        else:
            raise AssertionError(f"no emulation for {n}")

    return launch


def model_time(name, params, work):
    """Plausible H200-like timings so every derivation branch has something to decide."""
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    noise = 1 + 0.003 * rng.standard_normal(60)
    if name.startswith("read_ceiling"):
        rate = {"nc_u4_maxx512": 3.95e12}.get(params["config"], 3.8e12)
        return work / rate * noise
    if name.startswith("ring_pieces/"):  # copies of >= 1 KiB stream like one per stage; 512 B lose 20%
        return work / (3.8e12 * (1.0 if params["copy_bytes"] >= 1024 else 0.8)) * noise
    if name.startswith("ring/"):
        ring = params["stages"] * params["stage_bytes"]
        rate = min(3.8e12, ring * 132 / 2.5e-6)
        return work / rate * noise
    if name.startswith("ring_blocks/"):  # Little's law: the bytes in flight of `grid` blocks over 2.5 us
        ring = params["stages"] * params["stage_bytes"]
        return work / min(3.8e12, ring * params["grid"] / 2.5e-6) * noise
    if name.startswith("l2_bandwidth"):
        ws = params["bytes"] / MiB
        rate = 10e12 if ws <= 5 else max(3.9e12, 10e12 - (ws - 5) * 2e12)  # usable 5 of 8 MiB
        return work / rate * noise
    if name.startswith("l2_hints"):
        t = {"hot": 3.0, "flushed": 7.0, "S_normal/H_normal": 6.8, "S_evict_first/H_normal": 3.6,
             "S_normal/H_evict_last": 3.4, "S_evict_first/H_evict_last": 3.2, "stream_normal": 70.0,
             "stream_evict_first": 70.2, "plain_S_then_H": 6.9, "persisting_window_S_then_H": 4.0}
        return t[name.split("/", 1)[1]] * 1e-6 * noise
    if name.startswith("prefetch/"):
        P, t, pf = params["prefetch_bytes"], params["overlap_us"] * 1e-6, params["prefetch"]
        dram = P / 3.8e12
        if not pf:
            return (t + dram) * noise
        fetched = min(P, t * 3.8e12, 0.75 * L2)
        return (t + (P - fetched) / 3.8e12 + fetched / 9e12) * noise
    if name.startswith("hot/"):
        X, m, k = params["expert_bytes"], params["m_read"], params["k_prefetch"]
        base = params["busy_us"] * 1e-6 + (m * X + params["phase_a_bytes"]) / 3.8e12
        if not params["prefetch"]:
            return base * noise
        f = params["overlap"]
        cost = 0.1e-6 if params["scenario"] == "slack" else k * X / 3.8e12
        return (base - f * k * X * (1 / 3.8e12 - 1 / 9e12) + cost) * noise
    raise AssertionError(f"no timing model for {name}")


class FakeHarness:
    device_index = 0

    def __init__(self):
        from microbench.harness import Policy

        self.info = FakeInfo()
        self.policy = Policy()

    def series(self, name, launch, *, params=None, bound=None, work=None, batch=1, cold=False, policy=None,
               before_each=None, metrics=None):
        for _ in range(2):
            if before_each:
                before_each()
            launch()
        p = dict(params or {})
        return Series.from_samples(name, model_time(name, p, work), timer="cuda_event", unit="s", params=p,
                                   bound=bound, work=work, metrics=metrics)


@pytest.fixture
def dry(monkeypatch, tmp_path):
    import microbench.launch as L
    from microbench.weights import bench as B
    from microbench.weights import kernels as K
    from microbench.weights import l2policy

    monkeypatch.setenv("MEGABENCH_RESULTS", str(tmp_path))
    # small buffers: this runs on CI machines' memory, not a GPU's
    monkeypatch.setattr(B, "CEILING_BYTES", 4 * MiB)
    monkeypatch.setattr(B, "RING_BYTES", 4 * MiB)
    monkeypatch.setattr(B, "STREAM_BYTES", 4 * L2)
    monkeypatch.setattr(B, "MEMBOUND_BYTES", 2 * MiB)
    monkeypatch.setattr(B, "STUDY_EXPERT_BYTES", 1536 * KiB)
    monkeypatch.setattr(B, "prefetch_grid", lambda quick: ((1 * MiB, 2 * MiB, 4 * MiB, 6 * MiB, 8 * MiB), (1.0, 5.0)))
    monkeypatch.setattr(B, "hot_grid", lambda quick: [(1536 * KiB, "slack", (0.0, 0.5, 1.0)),
                                                      (512 * KiB, "slack", (0.0, 1.0)),
                                                      (1536 * KiB, "membound", (0.0, 1.0))])
    from microbench.weights import plan

    monkeypatch.setattr(plan, "l2_sizes", lambda quick: tuple(m * MiB for m in (1, 2, 3, 4, 5, 6, 8, 12, 16)))
    monkeypatch.setattr(plan, "chase_sizes", lambda quick: tuple(m * MiB for m in (1, 4, 16)))
    mem = Memory()
    real_random = K.random_words
    monkeypatch.setattr(K, "DEVICE", "cpu")
    monkeypatch.setattr(K, "random_words", lambda n: mem.add(real_random(n)))
    monkeypatch.setattr(K, "module", lambda which, arch: FakeModule())
    monkeypatch.setattr(K, "max_resident_blocks", lambda k, spec: 4 * 132)
    state = {"broken": set()}
    fake_launch = emulate(mem, state["broken"])
    monkeypatch.setattr(K, "launch", fake_launch)
    monkeypatch.setattr(L, "launch", fake_launch)
    monkeypatch.setattr(B, "launch", fake_launch)  # the bench module imports launch at its top
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: types.SimpleNamespace(
        cuda_stream=0, wait_stream=lambda s: None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(
        cuda_stream=0, wait_stream=lambda s: None))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    @contextlib.contextmanager
    def window(stream, base, nbytes, set_aside, maxp, hit_ratio=1.0):
        assert 0 < set_aside <= maxp and nbytes > 0 and base > 0
        yield {"granted_limit": set_aside, "old_limit": 0, "set_aside": set_aside}

    monkeypatch.setattr(l2policy, "persisting_window", window)
    monkeypatch.setattr(B, "persisting_window", window)  # the bench module imports it at its top
    for d in (B._CEILING, B._RING, B._BUDGET):
        d.clear()
    yield types.SimpleNamespace(h=FakeHarness(), B=B, state=state)
    for d in (B._CEILING, B._RING, B._BUDGET):
        d.clear()


def test_every_weights_constant_is_derived_end_to_end(dry):
    B, h = dry.B, dry.h
    results = {name: fn(h, quick=True, save=True) for name, fn in B.BENCHMARKS.items()}
    for spec in SPECS:
        if spec.benchmark.startswith("weights."):
            d = results[spec.benchmark].derived.get(spec.derived_key)
            assert d is not None, f"{spec.benchmark} did not derive {spec.derived_key}"
            assert d.rule and np.isfinite(d.value), spec.name
            if spec.integer:
                assert float(d.value).is_integer(), (spec.name, d.value)
    r = results
    assert r["weights.read_ceiling"].derived["read_ceiling_bytes_per_s"].value == pytest.approx(3.95e12, rel=0.01)
    # the model saturates above 72 KiB: the cheapest candidate ring within 97% of that is 5 x 16 KiB (80 KiB)
    assert (r["weights.ring"].derived["ring_stages"].value, r["weights.ring"].derived["ring_stage_bytes"].value) \
        == (5, 16 * KiB)
    # the L2 series are judged against the L2's own ceiling, never above it
    l2s = [s for s in r["weights.l2"].series if s.name.startswith("l2_bandwidth/")]
    assert all(0 < s.fraction_of_bound <= 1.0 and "L2's own" in s.bound.source for s in l2s)
    # the model keeps copies of >= 1 KiB at full rate: the quick sweep (16 KiB, 1 KiB, 512 B) picks 1 KiB
    assert r["weights.ring"].derived["ring_min_copy_bytes"].value == 1024
    assert r["weights.ring"].derived["ring_copies_512B_fraction"].value == pytest.approx(0.8, rel=0.02)
    assert r["weights.l2"].derived["l2_usable_bytes"].value == 5 * MiB
    assert r["weights.l2"].derived["evict_first_pays"].value == 1
    assert r["weights.prefetch"].derived["l2_prefetch_budget_bytes"].value > 0
    assert 0.0 <= r["weights.hot_experts"].derived["hot_expert_break_even_overlap"].value < 1.0
    ring = r["weights.ring"]
    # how few blocks stream at the full grid's rate, per ring: the fewest grid whose modelled rate
    # (bytes in flight of the grid over 2.5 us, capped at 3.8 TB/s) is within 95% of 132 blocks'
    blocks = {k: d for k, d in ring.derived.items() if k.startswith("ring_blocks_at_full_rate_")}
    assert len(blocks) == 2 and len([s for s in ring.series if s.name.startswith("ring_blocks/")]) == 8
    for k, d in blocks.items():
        st, sb = k.rsplit("_", 1)[1][1:].split("xB")
        rb = int(st) * (int(sb[:-1]) * 1024 if sb.endswith("K") else int(sb))
        rate = {g: min(3.8e12, rb * g / 2.5e-6) for g in (132, 66, 44, 33)}
        assert d.value == min(g for g, v in rate.items() if v >= 0.95 * rate[132])
    assert all(s.bound is not None and s.bound.kind == "bandwidth" and "read_ceiling" in s.bound.source
               for s in ring.series)
    for res in results.values():
        assert res.to_json()["benchmark"] == res.benchmark


def test_dry_run_catches_a_kernel_that_breaks_its_contract(dry):
    dry.state["broken"].add("ring")
    with pytest.raises(CorrectnessError, match="blocks differ"):
        dry.B.run_ring(dry.h, quick=True, save=False)

"""The peer's batched step (peer.BatchPeerRunner: B requests, each its own tree, context and KV
cache) on the CPU through Triton's interpreter, on test_peer.py's micro model: each request's
logits and every layer's K / V cache against reference.step_batch (plans.REL_TOL), forced and real
routing (the near-tie rule per request), mixed tree sizes and contexts (one past the sliding
window); each request against the same peer run alone (B=1); mutations inside the runner (two
requests' contexts or caches swapped, a request's rows shifted) caught; bad input refused."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from megakernel import peer, reference, routing, tree  # noqa: E402
from megakernel import peer_kernels as K  # noqa: E402
from megakernel.config import ConfigError, preset  # noqa: E402
from megakernel.plans import REL_TOL  # noqa: E402
from megakernel.runtime import check_close  # noqa: E402
from megakernel.weights import generate  # noqa: E402
from microbench.errors import CorrectnessError  # noqa: E402
from tests.test_peer import micro  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return peer.PeerModel(generate(micro()))


def _batch(cfg, shape, seed):
    """Requests of (T_r, ctx_r), fresh random caches (one per request), forced routes per layer
    over the rows (each request's own synthetic routing)."""
    g = torch.Generator().manual_seed(seed)
    reqs = [reference.Request(torch.randint(0, cfg.vocab, (t,), generator=g), tree.binary_ish(t) if t > 1 else [-1],
                              c) for t, c in shape]
    caches0 = [reference.KVCache(cfg).fill_random(g) for _ in shape]
    per = [routing.synthetic_routes(cfg, t, min(cfg.n_experts, t * cfg.top_k), g) for t, _ in shape]
    routes = [torch.cat([p[l] for p in per]) for l in range(cfg.n_layers)]
    return reqs, caches0, routes


def _runner(model, reqs, caches, forced, r_read=None, small_ops="triton"):
    return peer.BatchPeerRunner(model, caches, [q.parents for q in reqs],
                                r_read=[q.ctx for q in reqs] if r_read is None else r_read, forced=forced,
                                small_ops=small_ops, n_sm=4)


def _run(r):
    with K.interpreted():
        return r.run()


# (T_r, ctx_r): the micro model's sliding layer has a window of 8 in a ring of 24 slots
SAME = ((4, 12), (4, 12))  # B = 2, one shape
MIXED = ((4, 12), (6, 30), (1, 9))  # B = 3: mixed trees and contexts, ctx 30 wrapped the ring, past the window


@pytest.mark.parametrize("shape,seed", [(SAME, 1), (MIXED, 2)])
def test_batched_peer_matches_the_reference_per_request_forced(model, shape, seed):
    cfg = model.cfg
    reqs, caches0, routes = _batch(cfg, shape, seed)
    ref_caches = [c.clone() for c in caches0]
    ref = reference.step_batch(model.w, ref_caches, reqs, routes=routes)
    caches = [c.clone() for c in caches0]
    r = _runner(model, reqs, caches, True, r_read=[q.ctx + 2 for q in reqs])  # read bounds past each ctx
    r.set_requests(reqs, routes)
    logits = _run(r)
    assert logits.shape == (sum(t for t, _ in shape), cfg.vocab)
    checks = peer.check_batch_step(r, logits, caches, ref, ref_caches, "micro batch forced", REL_TOL)
    assert len(checks) == len(shape) and all(c.rel_err < 5e-3 and c.kv_rel_err < 5e-3 for c in checks)
    assert torch.equal(r.routes.long(), torch.stack(routes)), "forced routing not used"
    assert torch.equal(r.out_tokens, reference.argmax(logits))
    # each request against the same peer run alone (B=1) on the same cache: within the bound (the
    # dense GEMMs run over other row counts, so bitwise equality is not claimed)
    for i, q in enumerate(reqs):
        c1 = caches0[i].clone()
        r1 = peer.PeerRunner(model, c1, q.parents, r_read=q.ctx, forced=True, n_sm=4)
        r1.set_inputs(q.tokens, q.ctx, [x[r.requests[i].rows] for x in routes])
        alone = _run(r1)
        check_close(r.request_logits(logits, i), alone, f"request {i}: batched vs alone (logits)", rel=REL_TOL)
        for l in range(cfg.n_layers):
            check_close(caches[i].k[l], c1.k[l], f"request {i}: batched vs alone (K of layer {l})", rel=REL_TOL)
            check_close(caches[i].v[l], c1.v[l], f"request {i}: batched vs alone (V of layer {l})", rel=REL_TOL)


@pytest.mark.parametrize("shape,seed", [(((3, 5), (3, 5)), 11), (((6, 30), (2, 4), (1, 40)), 12)])
def test_batched_peer_matches_the_reference_per_request_real_routing(model, shape, seed):
    cfg = model.cfg
    reqs, caches0, _ = _batch(cfg, shape, seed)
    ref_caches = [c.clone() for c in caches0]
    traces = [reference.Trace() for _ in reqs]
    ref = reference.step_batch(model.w, ref_caches, reqs, traces=traces)
    ref_routes = [torch.cat([tr.tensors[f"L{l}.route"] for tr in traces]) for l in range(cfg.n_layers)]
    caches = [c.clone() for c in caches0]
    r = _runner(model, reqs, caches, False)
    r.set_requests(reqs)
    logits = _run(r)
    checks = peer.check_batch_step(r, logits, caches, ref, ref_caches, "micro batch real", REL_TOL, ref_routes)
    assert all(c.routes_equal and c.rel_err < 5e-3 and c.kv_rel_err < 5e-3 for c in checks)


def test_the_torch_flavour_batches_too(model):
    cfg = model.cfg
    reqs, caches0, routes = _batch(cfg, MIXED, 3)
    ref_caches = [c.clone() for c in caches0]
    ref = reference.step_batch(model.w, ref_caches, reqs, routes=routes)
    caches = [c.clone() for c in caches0]
    r = _runner(model, reqs, caches, True, small_ops="torch")
    r.set_requests(reqs, routes)
    checks = peer.check_batch_step(r, _run(r), caches, ref, ref_caches, "micro batch torch", REL_TOL)
    assert all(c.rel_err < 5e-3 and c.kv_rel_err < 5e-3 for c in checks)


# ---------------------------------------------------------------------- mutations: the checks can fail
def _mutated(model, mutate, shape=MIXED, seed=4):
    cfg = model.cfg
    reqs, caches0, routes = _batch(cfg, shape, seed)
    ref_caches = [c.clone() for c in caches0]
    ref = reference.step_batch(model.w, ref_caches, reqs, routes=routes)
    caches = [c.clone() for c in caches0]
    r = _runner(model, reqs, caches, True, r_read=max(q.ctx for q in reqs))
    r.set_requests(reqs, routes)
    mutate(r)
    logits = _run(r)
    return r, logits, caches, ref, ref_caches


def test_the_unmutated_baseline_of_the_mutations_passes(model):
    r, logits, caches, ref, ref_caches = _mutated(model, lambda r: None)
    peer.check_batch_step(r, logits, caches, ref, ref_caches, "unmutated", REL_TOL)


def test_two_requests_contexts_swapped_is_caught(model):
    def swap(r):
        r.ctx_t.copy_(r.ctx_t[[1, 0, 2]])  # request 0 at request 1's context and back

    with pytest.raises(CorrectnessError, match="request 0"):
        peer.check_batch_step(*_mutated(model, swap), "ctx swapped", REL_TOL)


def test_two_requests_caches_swapped_is_caught(model):
    def swap(r):
        a, b = r.requests[0], r.requests[1]
        a.cache, b.cache = b.cache, a.cache  # each request reads and writes the other's cache

    with pytest.raises(CorrectnessError, match="request 0"):
        peer.check_batch_step(*_mutated(model, swap), "caches swapped", REL_TOL)


def test_attention_over_the_wrong_rows_is_caught(model):
    def shift(r):
        rq = r.requests[1]  # request 1's RoPE / KV write and attention one row early (into request 0's rows)
        rq.rows = slice(rq.rows.start - 1, rq.rows.stop - 1)

    with pytest.raises(CorrectnessError):
        peer.check_batch_step(*_mutated(model, shift), "rows shifted", REL_TOL)


def test_a_request_on_another_requests_tree_mask_is_caught(model):
    def mask(r):
        r.requests[1].anc_t.fill_((1 << 6) - 1)  # request 1 (6 tokens): every token sees every other

    with pytest.raises(CorrectnessError, match="request 1"):
        peer.check_batch_step(*_mutated(model, mask), "mask", REL_TOL)


# ---------------------------------------------------------------------- shapes and bad input
def test_one_runner_holds_eight_requests_of_sixteen_rows(model):
    """No 16-row tile limit: B = 8 at T = 16 is 128 rows (buffers, the routing kernel's chunks,
    up to 128 tokens on one expert), checked per request against the reference."""
    cfg = model.cfg
    reqs, caches0, routes = _batch(cfg, [(16, 20 + r) for r in range(8)], 5)
    ref_caches = [c.clone() for c in caches0]
    ref = reference.step_batch(model.w, ref_caches, reqs, routes=routes)
    caches = [c.clone() for c in caches0]
    r = _runner(model, reqs, caches, True)
    r.set_requests(reqs, routes)
    assert r.n_tokens == 128 and r.x.shape[0] == 128 and r.row0 == [16 * i for i in range(9)]
    assert r.sorted_ids.numel() == K.max_blocks(128 * cfg.top_k, cfg.n_experts, K.BLOCK_M, 128) * K.BLOCK_M
    assert r.ctx == tuple(20 + i for i in range(8))
    checks = peer.check_batch_step(r, _run(r), caches, ref, ref_caches, "micro B=8 T=16", REL_TOL)
    assert len(checks) == 8 and all(c.rel_err < 5e-3 and c.kv_rel_err < 5e-3 for c in checks)


def test_batch_one_is_the_single_request_runner(model):
    cfg = model.cfg
    reqs, caches0, routes = _batch(cfg, ((6, 30),), 6)
    c1, c2 = caches0[0].clone(), caches0[0].clone()
    rb = _runner(model, reqs, [c1], True)
    rb.set_requests(reqs, routes)
    rs = peer.PeerRunner(model, c2, reqs[0].parents, r_read=30, forced=True, n_sm=4)
    rs.set_inputs(reqs[0].tokens, 30, routes)
    assert torch.equal(_run(rb), _run(rs)) and c1.equal(c2)  # the same code path: bitwise


def test_batched_runner_refuses_bad_input(model):
    cfg = model.cfg
    reqs, caches, routes = _batch(cfg, MIXED, 7)
    par = [q.parents for q in reqs]
    with pytest.raises(ConfigError, match="one of each per request"):
        peer.BatchPeerRunner(model, caches[:2], par, r_read=40, forced=True)
    with pytest.raises(ConfigError, match="one of each per request"):
        peer.BatchPeerRunner(model, caches, par, r_read=[40, 40], forced=True)
    with pytest.raises(ConfigError, match="share one KV cache"):
        peer.BatchPeerRunner(model, [caches[0], caches[1], caches[0]], par, r_read=40, forced=True)
    other = reference.KVCache(cfg.replace(name="other", window=4))
    with pytest.raises(ConfigError, match="KV cache is for other.*request 1"):
        peer.BatchPeerRunner(model, [caches[0], other, caches[2]], par, r_read=40, forced=True)
    with pytest.raises(ConfigError, match="a list of lists"):
        peer.BatchPeerRunner(model, caches, [-1, 0, 0], r_read=40, forced=True)
    with pytest.raises(ConfigError, match="request 2: read bound 70"):
        peer.BatchPeerRunner(model, caches, par, r_read=[12, 30, 70], forced=True)
    r = _runner(model, reqs, caches, True)  # read bounds = the contexts
    with pytest.raises(ConfigError, match="request 1: ctx 31 exceeds this runner's read bound 30"):
        r.set_inputs([q.tokens for q in reqs], [12, 31, 9], routes)
    with pytest.raises(ConfigError, match="3 token lists and 2 contexts"):
        r.set_inputs([q.tokens for q in reqs], [12, 30], routes)
    with pytest.raises(ConfigError, match="request 0: 3 tokens for a 4-token tree"):
        r.set_inputs([q.tokens[:3] for q in reqs], [12, 30, 9], routes)
    with pytest.raises(ConfigError, match=r"\[11, 2\].*the batch's 11 rows"):
        r.set_inputs([q.tokens for q in reqs], [12, 30, 9], [x[:10] for x in routes])
    with pytest.raises(ConfigError, match="request 1: its tree"):
        r.set_requests([reqs[0], reference.Request(reqs[1].tokens, [-1, 0, 1, 2, 3, 4], 30), reqs[2]], routes)
    with pytest.raises(ConfigError, match="check_batch_step"):
        peer.check_step(r, torch.zeros(11, cfg.vocab), caches[0], torch.zeros(11, cfg.vocab), caches[0], "x", REL_TOL)
    with pytest.raises(ConfigError, match="BatchPeerRunner.set_inputs"):
        peer.PeerRunner.set_inputs(r, reqs[0].tokens, 12, routes)
    assert r.ctx is None  # nothing was set by the refused calls

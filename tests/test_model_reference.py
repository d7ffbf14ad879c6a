"""The reference decode step (megakernel/reference.py) on the CPU:
- tree verification == sequential decoding of every root-to-leaf path (float64 accumulation, so
  reduction order cannot matter), past the sliding window and across the ring's wrap-around;
- the sliding-window ring cache against a naive attention written here, which keeps the whole
  history by sequence position and applies the window and the tree mask by position alone;
- KVCache.compact moves accepted rows and refuses malformed paths."""
from __future__ import annotations

import pytest
import torch

from megakernel import config, reference, tree
from megakernel.config import ConfigError
from megakernel.weights import BF16, generate

F64 = torch.float64


@pytest.fixture(scope="module")
def model():
    cfg = config.preset("tiny")  # window 16, ring 32 slots, layer 2 global
    return cfg, generate(cfg)


def _sequential_path(w, cache0, tokens, path, ctx):
    """Logits of each node of `path` decoded one token per step from a copy of cache0."""
    c = cache0.clone()
    return torch.stack([reference.step(w, c, [int(tokens[n])], [-1], ctx + j, acc=F64)[0] for j, n in enumerate(path)])


def _check_path(w, cache0, tokens, path, ctx, tree_logits):
    seq = _sequential_path(w, cache0, tokens, path, ctx)
    tl = tree_logits[path]
    assert torch.equal(seq.argmax(-1), tl.argmax(-1)), f"argmax differs along path {path}"
    diff = float((seq - tl).abs().max())
    assert diff < 1e-9, f"path {path}: tree and sequential logits differ by {diff}"


@pytest.mark.parametrize("ctx", [5, 30])
def test_tree_verify_equals_sequential_decoding_of_every_path(model, ctx):
    """ctx=30: sliding layers see only part of the prefix, and the tree's 13 positions run over
    the ring's end (slots 30, 31, 0, 1, ...)."""
    cfg, w = model
    g = torch.Generator().manual_seed(ctx)
    cache0 = reference.KVCache(cfg).fill_random(g)
    parents = tree.binary_ish(16, 3)
    tokens = torch.randint(0, cfg.vocab, (16,), generator=g)
    tree_logits = reference.step(w, cache0.clone(), tokens, parents, ctx, acc=F64)
    for path in tree.paths(parents):
        _check_path(w, cache0, tokens, path, ctx, tree_logits)


def test_the_path_check_can_fail(model):
    cfg, w = model
    g = torch.Generator().manual_seed(1)
    cache0 = reference.KVCache(cfg).fill_random(g)
    parents = tree.binary_ish(4, 3)  # [-1, 0, 0, 1]
    tokens = torch.randint(0, cfg.vocab, (4,), generator=g)
    tree_logits = reference.step(w, cache0.clone(), tokens, parents, 20, acc=F64)
    _check_path(w, cache0, tokens, [0, 1, 3], 20, tree_logits)
    with pytest.raises(AssertionError):  # node 2 is not node 1's child: its logits do not follow 0 -> 2 -> ...
        _check_path(w, cache0, tokens, [0, 2, 3], 20, tree_logits)


# ---------------------------------------------------------------------- naive attention
def _naive_attention(cfg, layer, q, hist_k, hist_v, ctx, parents, new_k, new_v, window=None):
    """q [T, Hq, hd] bf16; hist_k/v: {seq: [Hkv, hd]} of every cached position; new_k/v [T, Hkv, hd].
    Token i at position ctx + depth(i) sees cached positions s with pos - W < s (all s for global
    layers) and its tree ancestors (itself included). float64 math, bf16 output."""
    w_ = cfg.window if window is None else window
    dep = tree.depths(parents)
    out = torch.zeros(q.shape[0], cfg.n_heads * cfg.head_dim, dtype=F64)
    for i in range(q.shape[0]):
        pos = ctx + dep[i]
        keys = [s for s in sorted(hist_k) if s < ctx and (cfg.is_global(layer) or s > pos - w_)]
        anc = []
        j = i
        while j >= 0:
            anc.append(j)
            j = parents[j]
        ks = [hist_k[s] for s in keys] + [new_k[j] for j in sorted(anc)]
        vs = [hist_v[s] for s in keys] + [new_v[j] for j in sorted(anc)]
        kk, vv = torch.stack(ks).double(), torch.stack(vs).double()  # [n, Hkv, hd]
        for h in range(cfg.n_heads):
            kv = h // cfg.group
            sc = (kk[:, kv, :] @ q[i, h].double()) / cfg.head_dim ** 0.5
            p = torch.softmax(sc, dim=0)
            out[i, h * cfg.head_dim:(h + 1) * cfg.head_dim] = p @ vv[:, kv, :]
    return out.to(BF16)


def _ring_run(cfg, w):
    """Chain chunks of 16 from an empty cache to position 60 (the 32-slot ring wraps), then a
    16-token tree at ctx 60, compaction of one accepted path, and a T=1 step. Returns per step
    (ctx, parents, trace) plus the full history {layer: ({seq: k}, {seq: v})} as it was then."""
    g = torch.Generator().manual_seed(7)
    cache = reference.KVCache(cfg)
    hist = {l: ({}, {}) for l in range(cfg.n_layers)}
    steps = []

    def run(tokens, parents, ctx):
        tr = reference.Trace()
        reference.step(w, cache, tokens, parents, ctx, trace=tr, acc=F64)
        steps.append((ctx, parents, tr, {l: (dict(hist[l][0]), dict(hist[l][1])) for l in hist}))
        return tr

    ctx = 0
    for n in (16, 16, 16, 12):
        tr = run(torch.randint(0, cfg.vocab, (n,), generator=g), tree.chain(n), ctx)
        for l in range(cfg.n_layers):
            for j in range(n):
                hist[l][0][ctx + j] = tr.tensors[f"L{l}.k"][j]
                hist[l][1][ctx + j] = tr.tensors[f"L{l}.v"][j]
        ctx += n
    parents = tree.binary_ish(16, 3)
    tr = run(torch.randint(0, cfg.vocab, (16,), generator=g), parents, ctx)
    accepted = [0, 1, 3, 6]
    cache.compact(ctx, accepted)
    for l in range(cfg.n_layers):
        for j, node in enumerate(accepted):
            hist[l][0][ctx + j] = tr.tensors[f"L{l}.k"][node]
            hist[l][1][ctx + j] = tr.tensors[f"L{l}.v"][node]
    ctx += len(accepted)
    run(torch.randint(0, cfg.vocab, (1,), generator=g), [-1], ctx)
    return steps


@pytest.fixture(scope="module")
def ring_run(model):
    cfg, w = model
    return _ring_run(cfg, w)


def _check_ring(cfg, steps, window=None):
    for ctx, parents, tr, hist in steps:
        for l in range(cfg.n_layers):
            t = tr.tensors
            naive = _naive_attention(cfg, l, t[f"L{l}.q"], hist[l][0], hist[l][1], ctx, parents,
                                     t[f"L{l}.k"], t[f"L{l}.v"], window)
            got = t[f"L{l}.attn"]
            diff = (naive.float() - got.float()).abs()
            ulp = got.float().abs().clamp_min(1e-3) * 2.0 ** -7
            assert bool((diff <= ulp).all()), (f"layer {l} at ctx {ctx}: ring-cache attention differs from the "
                                               f"naive full-history attention by {float(diff.max())}")


def test_sliding_window_ring_matches_naive_full_history_attention(model, ring_run):
    cfg, _ = model
    assert ring_run[-1][0] > 2 * cfg.ring_slots - 16  # positions went round the ring about twice
    _check_ring(cfg, ring_run)


def test_the_ring_check_can_fail(model, ring_run):
    cfg, _ = model
    with pytest.raises(AssertionError, match="differs"):  # a window one position too long must be noticed
        _check_ring(cfg, ring_run[-2:], window=cfg.window + 1)


def test_compact_moves_accepted_rows_and_refuses_bad_paths(model):
    cfg, _ = model
    c = reference.KVCache(cfg).fill_random(torch.Generator().manual_seed(3))
    before = c.clone()
    c.compact(40, [0, 2, 5])
    for l in range(cfg.n_layers):
        for j, node in enumerate([0, 2, 5]):
            assert torch.equal(c.k[l][:, c.slot(l, 40 + j)], before.k[l][:, before.slot(l, 40 + node)])
            assert torch.equal(c.v[l][:, c.slot(l, 40 + j)], before.v[l][:, before.slot(l, 40 + node)])
    with pytest.raises(ConfigError, match="start at the root"):
        c.compact(40, [1, 2])
    with pytest.raises(ConfigError, match="increase"):
        c.compact(40, [0, 3, 2])

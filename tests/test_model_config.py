"""Model config validation, tree validation and synthetic routing: impossible inputs are refused
with a message naming the problem; synthetic routing hits its distinct-expert count."""
from __future__ import annotations

import pytest
import torch

from megakernel import config, reference, routing, tree
from megakernel.config import ConfigError


@pytest.fixture(scope="module")
def tiny():
    return config.preset("tiny")


@pytest.mark.parametrize("name", sorted(config.PRESETS))
def test_presets_validate_and_state_their_assumptions(name):
    cfg = config.preset(name)
    assert cfg.validate() is cfg
    keys = [k for k, _ in cfg.assumptions]
    assert "size" in keys or "what it is" in keys
    assert name in cfg.describe()


def test_shard8_matches_the_study_where_it_is_stated():
    c = config.preset("shard8")
    assert (c.n_layers, len(c.global_layers), c.window, c.n_experts, c.top_k) == (62, 16, 2048, 256, 8)
    assert 49e6 < 14 * c.expert_bytes < 51e6  # the study's ~50 MB for 14 experts' slices per GPU


@pytest.mark.parametrize("change, message", [
    (dict(n_kv_heads=3), "not a multiple of n_kv_heads"),
    (dict(window=0), "window must be positive"),
    (dict(window=-4), "window must be positive"),
    (dict(top_k=9), "top_k=9 exceeds n_experts=8"),
    (dict(d_pool=96), "d_pool=96 must be a multiple of 64"),
    (dict(d_expert=72), "d_expert=72 must be a multiple of 64"),
    (dict(d_model=136), "d_model=136 must be a multiple of 64"),
    (dict(head_dim=32), "head_dim=32 must be a multiple of 64"),
    (dict(vocab=500), "vocab=500 must be a multiple of 64"),
    (dict(global_layers=(3,)), "outside 0..2"),
    (dict(global_layers=(1, 1)), "duplicates"),
    (dict(max_tree=17), "at most 16 tokens"),
    (dict(max_tree=200), "exceeds max_context"),
    (dict(n_experts=0), "n_experts must be positive"),
    (dict(rope_theta=1.0), "rope_theta"),
])
def test_bad_configs_are_refused_with_a_clear_message(tiny, change, message):
    with pytest.raises(ConfigError, match=message) as e:
        tiny.replace(**change)
    assert "tiny" in str(e.value)  # names the config


def test_the_refusal_checks_can_fail(tiny):
    """The same changes, made valid, pass: the messages above come from the checks, not from chance."""
    tiny.replace(n_kv_heads=1)
    tiny.replace(window=1)
    tiny.replace(top_k=8)
    tiny.replace(d_pool=128)


def test_unknown_preset_is_named():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        config.preset("huge")


def test_steps_that_do_not_fit_the_cache_are_refused(tiny):
    tiny.check_step(112, 16)  # exactly fills max_context=128
    with pytest.raises(ConfigError, match="exceeds the cache"):
        tiny.check_step(113, 16)
    with pytest.raises(ConfigError, match="verifies 1..16"):
        tiny.check_step(0, 17)
    with pytest.raises(ConfigError, match="verifies 1..16"):
        tiny.check_step(0, 0)
    with pytest.raises(ConfigError, match="negative context"):
        tiny.check_step(-1, 1)


def test_reference_step_refuses_bad_requests(tiny):
    from megakernel.weights import generate

    cfg = tiny.replace(n_layers=1, global_layers=())
    w = generate(cfg)
    cache = reference.KVCache(cfg)
    with pytest.raises(ConfigError, match="exceeds the cache"):
        reference.step(w, cache, [1] * 16, tree.chain(16), 120)
    with pytest.raises(ConfigError, match="2 tokens but 3 parents"):
        reference.step(w, cache, [1, 2], [-1, 0, 0], 0)
    with pytest.raises(ConfigError, match="must be the root"):
        reference.step(w, cache, [1, 2], [0, 0], 0)
    with pytest.raises(ConfigError, match="routes for 2 layers"):
        reference.step(w, cache, [1], [-1], 0, routes=[torch.zeros(1, 2, dtype=torch.long)] * 2)
    with pytest.raises(ConfigError, match=r"route shape \(1, 3\)"):
        reference.step(w, cache, [1], [-1], 0, routes=[torch.zeros(1, 3, dtype=torch.long)])


@pytest.mark.parametrize("parents, message", [
    ([], "at least one token"),
    ([0], "must be the root"),
    ([-1, 1], "token 1 has parent 1"),
    ([-1, 0, 3, 1], "token 2 has parent 3"),
    ([-1, -1], "token 1 has parent -1"),
])
def test_bad_parents_are_refused(parents, message):
    with pytest.raises(ConfigError, match=message):
        tree.validate(parents)


def test_tree_helpers():
    p = tree.binary_ish(16, 3)
    assert tree.depths(p)[-1] == 12 and len(p) == 16
    paths = tree.paths(p)
    assert all(q[0] == 0 for q in paths) and set(sum(paths, [])) == set(range(16))
    assert [q[-1] for q in paths] == [2, 4, 6, 15]
    m = tree.ancestor_mask([-1, 0, 0, 1])
    assert m.tolist() == [[True, False, False, False], [True, True, False, False],
                          [True, False, True, False], [True, True, False, True]]
    assert tree.chain(4) == [-1, 0, 1, 2]


def _assert_hits(cfg, routes, n_tokens, distinct):
    assert len(routes) == cfg.n_layers
    for r in routes:
        assert tuple(r.shape) == (n_tokens, cfg.top_k)
        assert int(r.min()) >= 0 and int(r.max()) < cfg.n_experts
        assert all(len(set(row)) == cfg.top_k for row in r.tolist()), "a token routed twice to one expert"
    assert routing.distinct_per_layer(routes) == [distinct] * cfg.n_layers


@pytest.mark.parametrize("name, n_tokens, distinct", [
    ("tiny", 16, 2), ("tiny", 16, 5), ("tiny", 16, 8), ("tiny", 1, 2), ("tiny", 3, 6),
    ("small", 16, 27), ("small", 16, 64), ("small", 1, 8), ("shard8", 16, 49), ("shard8", 16, 128),
])
def test_synthetic_routing_hits_its_distinct_count(name, n_tokens, distinct):
    cfg = config.preset(name)
    routes = routing.synthetic_routes(cfg, n_tokens, distinct, torch.Generator().manual_seed(distinct))
    _assert_hits(cfg, routes, n_tokens, distinct)


def test_the_distinct_check_can_fail():
    cfg = config.preset("tiny")
    routes = routing.synthetic_routes(cfg, 16, 5, torch.Generator().manual_seed(0))
    r0 = routes[0].clone()
    routes[0] = torch.where(r0 == r0[0, 0], r0[0, 1], r0)  # merge two experts of layer 0: 4 distinct
    with pytest.raises(AssertionError):
        _assert_hits(cfg, routes, 16, 5)


@pytest.mark.parametrize("n_tokens, distinct", [(16, 1), (16, 9), (1, 3), (3, 7), (2, 0)])
def test_impossible_distinct_counts_are_refused(n_tokens, distinct):
    cfg = config.preset("tiny")  # top-2 of 8 experts
    with pytest.raises(ConfigError, match="impossible"):
        routing.synthetic_routes(cfg, n_tokens, distinct, torch.Generator().manual_seed(0))

"""Speculative decoding (megakernel/speculative.py) with the drafter stand-in (megakernel/draft.py):
the emitted tokens equal plain greedy decoding token for token; acceptance is accounted exactly
(a scripted drafter makes every branch of the acceptance walk happen); the drafter proposes its
15 tokens in one pass; the verifier is pluggable."""
from __future__ import annotations

import pytest
import torch

from megakernel import config, draft, reference, speculative as sp, tree
from megakernel.config import ConfigError
from megakernel.weights import generate

F64 = torch.float64
N_NEW = 23


@pytest.fixture(scope="module")
def setup():
    # backbone 0.5: the target follows its successor backbone on ~80% of tokens, so drafts are
    # sometimes accepted and sometimes rejected (at the preset's 1.0 it always follows)
    cfg = config.preset("tiny").replace(backbone=0.5)
    w = generate(cfg)
    prompt = torch.randint(0, cfg.vocab, (4,), generator=torch.Generator().manual_seed(11)).tolist()
    greedy = reference.greedy(w, reference.KVCache(cfg), prompt, N_NEW, acc=F64)
    return cfg, w, prompt, greedy


def test_speculative_equals_greedy_with_the_drafter_stand_in(setup):
    cfg, w, prompt, greedy = setup
    dm = draft.DraftModel(w)
    r = sp.speculative_decode(w, reference.KVCache(cfg), prompt, N_NEW, dm, acc=F64)
    assert r.tokens == greedy
    lens = r.acceptance_lengths
    assert dm.passes == len(lens)  # one drafter pass per verify step
    assert max(lens) > 1 and min(lens) < max(lens)  # both accepted and rejected drafts happened
    assert sum(lens) >= N_NEW and sum(lens) - lens[-1] < N_NEW


class ScriptedDrafter:
    """Knows greedy's continuation and corrupts it on purpose, step by step:
    'ok' all right; ('top1', d) top-1 wrong at depth d, top-2 right; ('both', d) both wrong at d."""

    def __init__(self, prompt, greedy, script, vocab, strict=True):
        self.prompt, self.greedy, self.script, self.vocab = list(prompt), greedy, list(script), vocab
        self.calls, self.strict = 0, strict

    def propose(self, history, ctx):
        n = len(history) - len(self.prompt)
        if self.strict:
            assert history[-1] == ([self.prompt[-1]] + self.greedy)[n]
        fut = self.greedy[n:] + [0] * 16
        s = self.script[self.calls % len(self.script)]
        self.calls += 1
        p = torch.tensor([[fut[j], (fut[j] + 1) % self.vocab] for j in range(15)])  # top-2 wrong by default
        if s != "ok":
            kind, d = s
            if kind == "top1":
                p[d - 1] = torch.tensor([(fut[d - 1] + 2) % self.vocab, fut[d - 1]])
            else:
                p[d - 1] = torch.tensor([(fut[d - 1] + 2) % self.vocab, (fut[d - 1] + 3) % self.vocab])
        return p


def test_acceptance_is_accounted_exactly(setup):
    """binary_ish(16, 3): a 12-deep main chain with a top-2 sibling at depths 1, 2, 3.
    all right -> 12 accepted + bonus = 13; top-1 wrong at depth 3 but top-2 right -> the sibling is
    taken (a leaf): 2 + 1 + bonus = 4; both wrong at depth 1 -> bonus only = 1; top-1 wrong at
    depth 5 (no sibling there) -> 4 + bonus = 5. 13 + 4 + 1 + 5 = 23 tokens."""
    cfg, w, prompt, greedy = setup
    d = ScriptedDrafter(prompt, greedy, ["ok", ("top1", 3), ("both", 1), ("top1", 5)], cfg.vocab)
    r = sp.speculative_decode(w, reference.KVCache(cfg), prompt, N_NEW, d, acc=F64)
    assert r.acceptance_lengths == [13, 4, 1, 5]
    assert r.tokens == greedy
    assert r.steps[1].accepted == [0, 1, 3, 6]  # node 6 is the depth-3 sibling


def test_a_wrong_acceptance_rule_would_be_caught(setup):
    """Accepting a draft without checking it against the target's argmax breaks greedy equality."""
    cfg, w, prompt, greedy = setup
    d = ScriptedDrafter(prompt, greedy, [("both", 2)], cfg.vocab, strict=False)
    real = sp.accept
    try:
        sp.accept = lambda tokens, parents, logits: (tree.paths(parents)[-1][:3], int(logits[0].argmax()))
        r = sp.speculative_decode(w, reference.KVCache(cfg), prompt, 6, d, acc=F64)
    finally:
        sp.accept = real
    assert r.tokens != greedy[:6]


def test_build_tree_and_accept_on_hand_made_logits():
    props = torch.tensor([[10 + j, 50 + j] for j in range(15)])
    tokens, parents = sp.build_tree(7, props, 16, branch_depth=3)
    assert parents == tree.binary_ish(16, 3)
    assert tokens[:7] == [7, 10, 50, 11, 51, 12, 52] and tokens[-1] == 21
    logits = torch.zeros(16, 100)
    logits[0, 10] = 1  # root -> 10 (node 1)
    logits[1, 51] = 1  # node 1 -> 51: the depth-2 sibling, node 4 (a leaf)
    logits[4, 99] = 1  # bonus
    assert sp.accept(tokens, parents, logits) == ([0, 1, 4], 99)
    chain_tokens, chain_parents = sp.build_tree(7, props, 16, branch_depth=0)
    assert chain_parents == tree.chain(16) and chain_tokens[1:] == list(range(10, 25))
    with pytest.raises(ConfigError, match="proposed only 3 depths"):
        sp.build_tree(7, props[:3], 16, branch_depth=0)
    with pytest.raises(ConfigError, match="must hang off the main chain"):
        sp.tree_ranks([-1, 0, 0, 2, 1, 4])


def test_drafter_proposes_fifteen_tokens_in_one_pass(setup):
    cfg, w, prompt, _ = setup
    dm = draft.DraftModel(w)
    assert len(dm.layers) == draft.STUDY_DRAFT_LAYERS == 5
    p = dm.propose(prompt, 3)
    assert tuple(p.shape) == (15, 2) and dm.passes == 1
    assert bool((p[:, 0] != p[:, 1]).all())
    assert "5 layers" in draft.describe(dm)
    # with its layers switched off the stand-in is exactly the backbone chain (shared LM head)
    plain = draft.DraftModel(generate(config.preset("tiny")), draft.DraftConfig(mix=0.0))
    seeds = plain.seeds(prompt[-1])
    assert torch.equal(plain.propose(prompt, 3)[:, 0], plain.target.succ[seeds])
    with pytest.raises(ConfigError, match="mix"):
        draft.DraftConfig(mix=-1.0).validate()


def test_verifier_is_pluggable(setup):
    """The eager torch baseline as verifier gives the same tokens as reference.step (float32)."""
    from megakernel.baselines import eager_step

    cfg, w, prompt, _ = setup
    dm = draft.DraftModel(w)
    a = sp.speculative_decode(w, reference.KVCache(cfg), prompt, 12, dm)
    calls = []

    def counting(*args, **kw):
        calls.append(len(args[2]))
        return eager_step(*args, **kw)

    b = sp.speculative_decode(w, reference.KVCache(cfg), prompt, 12, dm, verifier=counting)
    assert a.tokens == b.tokens and a.acceptance_lengths == b.acceptance_lengths
    assert calls[0] == len(prompt) - 1 and all(c == 16 for c in calls[1:])  # prefill chunk, then trees


def test_measure_acceptance_summarises(setup):
    cfg, w, prompt, _ = setup
    rep = sp.measure_acceptance(w, [prompt, prompt[::-1]], 10, draft.DraftModel(w))
    assert rep.n_prompts == 2 and len(rep.lengths) >= 2
    assert rep.ci[0] <= rep.mean <= rep.ci[1]
    assert 0.0 <= rep.follow_rate <= 1.0


def test_bad_requests_are_refused(setup):
    cfg, w, prompt, _ = setup
    dm = draft.DraftModel(w)
    with pytest.raises(ConfigError, match="non-empty prompt"):
        sp.speculative_decode(w, reference.KVCache(cfg), [], 4, dm)
    with pytest.raises(ConfigError, match="tree of 17 tokens"):
        sp.speculative_decode(w, reference.KVCache(cfg), prompt, 4, dm, n_tree=17)

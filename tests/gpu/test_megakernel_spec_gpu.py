"""Speculative decoding on the device, on the GPU: the drafter's pass mega == chain bitwise, and
256 tokens on small and shard8 equal plain greedy decoding token for token with every committed KV
row the plain run's (megakernel.decode, the named 'study' agreement, the captured graphs). These are
the GPU runs the CPU emulation's tests (tests/test_megakernel_spec*.py) stand in for."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _pair(preset, mode_tokens=16):
    from megakernel import speculative
    from megakernel.bench_baselines import weights_for
    from megakernel.decode import SpecPair
    from megakernel.draft import DraftConfig, draft_model_config
    from megakernel.plans import plan_for
    from megakernel.reference import KVCache

    w = weights_for(preset)
    agree = speculative.agreement("study", preset)
    dcfg = draft_model_config(w.cfg, DraftConfig(agree=agree))
    return SpecPair(w, plan_for(preset, tokens=w.cfg.max_tree), plan_for(dcfg, tokens=dcfg.max_tree - 1),
                    [KVCache(w.cfg, device="cuda")], agree=agree, backend="gpu")


def test_draft_pass_mega_equals_chain_on_the_gpu():
    from megakernel import abi, draft

    pair = _pair("small")
    pair.state[:, abi.spec_offsets()["root"]] = 123
    got = {}
    for mode in ("chain", "mega", "mega"):
        pair.draft.launch_step(mode)
        torch.cuda.synchronize()
        pair.draft._check_watchdog(mode == "mega")
        logits, top2 = pair.draft.buf["logits"][:15].clone(), pair.top2[:15].long().clone()
        assert torch.equal(top2, draft.top2(logits).to(top2.device)), mode
        if mode in got:
            assert torch.equal(logits, got[mode][0])  # repeatable
        got.setdefault(mode, (logits, top2))
    assert torch.equal(got["chain"][0], got["mega"][0]) and torch.equal(got["chain"][1], got["mega"][1])


@pytest.mark.parametrize("preset", ["small", "shard8"])
def test_speculative_decoding_equals_plain_greedy_on_the_gpu(preset):
    from megakernel.decode import decode

    pair = _pair(preset)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, pair.cfg.vocab, (8,), generator=g).tolist()]
    out = decode(pair, prompts, 256, "mega", check=True, poison=True)
    assert out.check.ok, out.check.problems
    assert len(out.read.tokens[0]) == 256 and 1.0 <= out.report.mean <= 13.0
    assert out.stats.timer == "cuda_event" and all(s.draft > 0 and s.verify > 0 and s.accept > 0 for s in out.stats.steps)


def test_full_trees_decode_each_request_as_alone_on_the_gpu():
    """small, 4 requests of the whole 16-token tree, each in a row group of its own: plain greedy
    decoding's tokens and KV rows, and each request's tokens and acceptance histogram those of the
    same request decoded alone (B = 1, the same tree, the same drafter)."""
    from megakernel import speculative
    from megakernel.bench_baselines import weights_for
    from megakernel.decode import SpecPair, decode, prompts_for
    from megakernel.draft import DraftConfig, draft_model_config
    from megakernel.plans import plan_for
    from megakernel.reference import KVCache

    b, n = 4, 64
    w = weights_for("small")
    agree = speculative.agreement("study", "small")
    dcfg = draft_model_config(w.cfg, DraftConfig(agree=agree))
    prompts = prompts_for(w.cfg, b, 8, 0)
    pair = SpecPair(w, plan_for("small", tokens=w.cfg.max_tree, row_groups=b),
                    plan_for(dcfg, tokens=dcfg.max_tree - 1, row_groups=b),
                    [KVCache(w.cfg, device="cuda") for _ in range(b)], batch=b, agree=agree, backend="gpu")
    out = decode(pair, prompts, n, "mega", check=True, poison=True)
    assert out.check.ok, out.check.problems
    assert pair.T == 16 and out.stats.timer == "cuda_event"
    for r in range(b):
        alone = _pair("small")
        got = decode(alone, prompts[r:r + 1], n, "mega").read
        assert out.read.tokens[r] == got.tokens[0] and out.read.hist[r] == got.hist[0], r

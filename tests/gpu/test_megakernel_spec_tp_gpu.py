"""Speculative decoding with the verifier as 2 tensor-parallel ranks sharing one GPU's SMs in one
launch (megakernel/decode.py SpecPair(ranks=2), the drafter once, unsharded): 64 tokens on small
equal plain greedy decoding by the unsharded build (the TP build at R = 1, T=1 steps) token for
token, every committed KV row is that run's, and both ranks' speculative states are equal (the
captured graphs, from poisoned buffers). The GPU run the emulation's tests
(tests/test_megakernel_spec_tp.py) stand in for."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["mega", "chain"])
def test_two_ranks_sharing_one_gpu_decode_as_plain_greedy(mode):
    from megakernel import speculative
    from megakernel.bench_baselines import weights_for
    from megakernel.decode import KV_ROW_TOL, SpecPair, decode
    from megakernel.draft import DraftConfig, draft_model_config
    from megakernel.plans import plan_for
    from megakernel.reference import KVCache

    w = weights_for("small")
    cfg = w.cfg
    agree = speculative.agreement("study", "small")
    dcfg = draft_model_config(cfg, DraftConfig(agree=agree))
    plan = plan_for("small", tokens=cfg.max_tree, tp_ranks=2, launch_ranks=2)
    pair = SpecPair(w, plan, plan_for(dcfg, tokens=dcfg.max_tree - 1), [KVCache(cfg, device="cuda")], agree=agree,
                    backend="gpu", ranks=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab, (8,), generator=g).tolist()]
    out = decode(pair, prompts, 64, mode, check=True, poison=True)
    c = out.check
    assert c.ok, c.problems
    assert all(c.tokens_equal) and len(out.read.tokens[0]) == 64 and c.kv_rel_err <= KV_ROW_TOL
    assert torch.equal(pair.states[1], pair.states[0])
    assert len(out.stats.steps) > 1 and out.stats.timer == "cuda_event"

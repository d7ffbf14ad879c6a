"""The megakernel's runtime checks of its inputs: bad steps and bad weights are refused by name
before anything launches; canonical rewrites keep every value."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megakernel.config import ConfigError
from megakernel.nvfp4 import NVFP4Tensor
from megakernel.routing import synthetic_routes
from megakernel.runtime import Engine, check_close
from megakernel.weights import ExpertBank

from megakernel_cases import reference_logits, step_inputs, tiny


def test_bad_step_inputs_are_refused(tiny):
    cfg, w, base, plan = tiny
    eng = Engine(w, plan, base.clone(), backend="emu")
    with pytest.raises(ConfigError, match="verifies 1..16"):
        eng.enqueue(list(range(17)), [-1] + list(range(16)), 0)
    with pytest.raises(ConfigError, match="parent"):
        eng.enqueue([1, 2], [-1, 1], 0)
    with pytest.raises(ConfigError, match="token ids"):
        eng.enqueue([cfg.vocab], [-1], 0)
    with pytest.raises(ConfigError, match="exceeds the cache"):
        eng.enqueue([1], [-1], cfg.max_context)
    bad = synthetic_routes(cfg, 2, 2, torch.Generator().manual_seed(0))
    bad[0] = torch.tensor([[1, 1], [2, 3]])
    with pytest.raises(ConfigError, match="same expert twice"):
        eng.enqueue([1, 2], [-1, 0], 0, routes=bad)
    with pytest.raises(ValueError, match="mode"):
        eng.launches("fast")
    # bulk copies need 16-byte aligned sources: a weight view 2 bytes in is refused by name
    odd = dataclasses.replace(w, layers=list(w.layers))
    g = torch.cat([w.layers[0].ffn_norm, w.layers[0].ffn_norm[:1]])
    odd.layers[0] = dataclasses.replace(w.layers[0], ffn_norm=g[1:])
    with pytest.raises(ConfigError, match="16-byte aligned"):
        Engine(odd, plan, base.clone(), backend="emu")


def test_negative_and_zero_block_scales_are_canonical_and_raw_ones_refused(tiny):
    """Expert weights with negative and zero E4M3 block scales (a real quantiser writes zeros for
    all-zero blocks): ExpertBank.from_natural rewrites them without changing a value, so the
    emulated kernel still matches the reference; a bank that skipped it is refused."""
    cfg, w, base, plan = tiny
    lw = w.layers[1]
    experts = [lw.w1.expert(e) for e in range(cfg.n_experts)]
    for i, t in enumerate(experts):
        sc = t.scales.clone()
        sc[::3, 0] |= 0x80
        sc[1::5, 1] = 0x80 * (i % 2)
        experts[i] = NVFP4Tensor(t.codes, sc, t.tensor_scale, t.shape)
    odd = dataclasses.replace(w, layers=list(w.layers))
    odd.layers[1] = dataclasses.replace(lw, w1=ExpertBank.from_natural(experts, "cpu"))
    assert torch.equal(odd.layers[1].w1.expert(2).dequant_bf16_exact(), experts[2].dequant_bf16_exact())
    toks, par = step_inputs(cfg, 8, 4)
    ref_cache = base.clone()
    ref, routes = reference_logits(odd, ref_cache, toks, par, 40)
    out = Engine(odd, plan, base.clone(), backend="emu").step(toks, par, 40, mode="mega", routes=routes)
    check_close(out.logits, ref, "emulated megakernel vs reference (canonicalised scales)", rel=1e-2)
    raw = dataclasses.replace(odd, layers=list(odd.layers))
    bank = odd.layers[1].w1
    raw.layers[1] = dataclasses.replace(lw, w1=dataclasses.replace(bank, scales=bank.scales | 0x80))
    with pytest.raises(ConfigError, match="layer 1 w1: block scales must be positive"):
        Engine(raw, plan, base.clone(), backend="emu")

"""Shared cases of the megakernel's CPU tests (tests/test_megakernel_*.py): the tiny model and a
fusable variant of it, step inputs, the reference's logits and routing, and the emulated chain and
mega steps compared against each other and the reference."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from megakernel import speculative, tree
from megakernel.build import CSRC
from megakernel.config import preset
from megakernel.decode import SpecPair, decode, plain_run
from megakernel.draft import DraftConfig, draft_model_config
from megakernel.plan import make_plan
from megakernel.reference import KVCache, Trace, step
from megakernel.runtime import Engine, check_close
from megakernel.weights import generate


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset, its weights, a random KV cache and a plan for 4 blocks."""
    cfg = preset("tiny")
    w = generate(cfg)
    base = KVCache(cfg).fill_random(torch.Generator().manual_seed(3))
    return cfg, w, base, make_plan(cfg, 4, spin_bound_ns=3_000_000_000)


@pytest.fixture(scope="module")
def fusable():
    """tiny with d_pool and d_expert of 256: shapes the fused expert unit takes (plan.fuses_experts)."""
    cfg = dataclasses.replace(preset("tiny"), d_pool=256, d_expert=256)
    w = generate(cfg)
    base = KVCache(cfg).fill_random(torch.Generator().manual_seed(3))
    return cfg, w, base, make_plan(cfg, 4, spin_bound_ns=3_000_000_000, ring_stage_bytes=16384, fused_experts=True)


def tree_without(tmp_path, rel: str, line: str):
    """A copy of the kernel's source tree with `line` removed from csrc/`rel` (a variant for a test)."""
    tree_dir = tmp_path / "csrc"
    shutil.copytree(CSRC, tree_dir)
    f = tree_dir / rel
    assert line in f.read_text(), f"{rel} no longer has {line!r}"
    f.write_text(f.read_text().replace(line, ""))
    return tree_dir


def step_inputs(cfg, t, seed):
    """t random tokens (a binary-ish tree of them) from the seed."""
    g = torch.Generator().manual_seed(seed)
    par = tree.binary_ish(t) if t > 1 else [-1]
    return torch.randint(0, cfg.vocab, (t,), generator=g), par


def reference_logits(w, cache, toks, par, ctx):
    """Reference logits and the routing it chose (forcing that routing on the kernel side keeps
    a router near-tie, a legitimate fp32 difference, from flipping an expert in a comparison)."""
    tr = Trace()
    logits = step(w, cache, toks, par, ctx, trace=tr)
    return logits, [tr.tensors[f"L{l}.route"] for l in range(w.cfg.n_layers)]


def modes_match_reference(cfg, plan, cache_seed, t, input_seed, ctx, what):
    """Emulated chain and mega steps from poisoned buffers, reference routing forced: bitwise
    equal to each other and close to the reference. Returns the mega step's logits."""
    w = generate(cfg)
    base = KVCache(cfg).fill_random(torch.Generator().manual_seed(cache_seed))
    toks, par = step_inputs(cfg, t, input_seed)
    ref, routes = reference_logits(w, base.clone(), toks, par, ctx)
    outs = {}
    for m in ("chain", "mega"):
        eng = Engine(w, plan, base.clone(), backend="emu")
        eng.poison()
        outs[m] = eng.step(toks, par, ctx, mode=m, routes=routes)
    assert torch.equal(outs["chain"].logits, outs["mega"].logits)
    check_close(outs["mega"].logits, ref, what, rel=1e-2)
    return outs["mega"].logits


def spec_setup(n: int, *, prompt_seed: int, ranks: int = 1, bound_ns: int = 3_000_000_000):
    """tiny's weights, the verifier's plan (the TP plan of `ranks` ranks where ranks > 1), the
    drafter's plan at the 'study' agreement, a random prompt and the plain greedy run of n tokens
    from the pair's prefill (the unsharded build's at ranks > 1), shared by a module's runs."""
    cfg = preset("tiny")
    w = generate(cfg)
    tp = {"tp_ranks": ranks, "launch_ranks": ranks} if ranks > 1 else {}
    plan = make_plan(cfg, 4, spin_bound_ns=bound_ns, **tp)
    agree = speculative.agreement("study", "tiny")
    dplan = make_plan(draft_model_config(cfg, DraftConfig(agree=agree)), 4, spin_bound_ns=3_000_000_000)
    g = torch.Generator().manual_seed(prompt_seed)
    prompts = [torch.randint(0, cfg.vocab, (8,), generator=g).tolist()]
    pair = SpecPair(w, plan, dplan, [KVCache(cfg)], agree=agree, backend="emu", **({"ranks": ranks} if ranks > 1 else {}))
    pair.poison()
    ctx = pair.prefill(prompts)
    plain = plain_run(pair, prompts, n, ctx, [c.clone() for c in pair.caches])
    return cfg, w, plan, dplan, prompts, plain


def spec_decode(setup, mode: str, schedule: str, n: int, *, seed: int = 3, ranks: int = 1):
    """A fresh pair on spec_setup's plans decoding n tokens from poisoned buffers, checked against
    the setup's plain run. Returns (pair, outcome)."""
    cfg, w, plan, dplan, prompts, plain = setup
    pair = SpecPair(w, plan, dplan, [KVCache(cfg)], agree=speculative.agreement("study", "tiny"), backend="emu",
                    emu_schedule=schedule, emu_seed=seed, **({"ranks": ranks} if ranks > 1 else {}))
    return pair, decode(pair, prompts, n, mode, check=True, poison=True, plain=plain)


def mutated_csrc(tmp_path, rel: str, old: str, new: str):
    """A copy of the kernel's source tree with `old` replaced by `new` in csrc/`rel` (where it must
    stand exactly once): the kernel of a mutation test (ab.kernel_tree builds from it)."""
    d = tmp_path / "csrc"
    shutil.copytree(CSRC, d)
    f = d / rel
    assert f.read_text().count(old) == 1, f"{rel} no longer has {old!r} once"
    f.write_text(f.read_text().replace(old, new))
    return d

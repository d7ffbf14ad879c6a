"""pytest-benchmark cases of one whole speculative step on the device (megakernel.decode): the
drafter's pass, the target's verify at T=16 and the accept / compaction launch, mega and chain, on
small and shard8 at their headline contexts, with the named 'study' acceptance. A launch is a
CUDA-graph replay of 2 steps (the counters' parities alternate); device_bench reports per step.
Each replay advances the device's state as the steps it holds do (ctx, the emitted tokens): the
cache starts random at the context (a prefilled prompt's stand-in), and a request that has all it
asked for keeps verifying at its last context (its steps then emit and move nothing). Full trees
(decode --full-trees): B = 4 requests, each the whole 16-token tree in a row group of its own."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
SPEC_POINTS = [("small", 512), ("shard8", 2048)]


def _spec_case(preset, ctx, mode, batch=1):
    from microbench.errors import CorrectnessError
    from microbench.harness import Case, Prepared

    from megakernel import abi, speculative
    from megakernel.bench_baselines import weights_for
    from megakernel.decode import SpecPair, max_tokens
    from megakernel.draft import DraftConfig, draft_model_config
    from megakernel.plans import plan_for
    from megakernel.reference import KVCache

    def prepare(h):
        import torch

        w = weights_for(preset)
        cfg = w.cfg
        agree = speculative.agreement("study", preset)
        dcfg = draft_model_config(cfg, DraftConfig(agree=agree))
        gen = torch.Generator(device="cuda").manual_seed(1)
        caches = [KVCache(cfg, device="cuda").fill_random(gen) for _ in range(batch)]
        groups = {"row_groups": batch} if batch > 1 else {}  # full trees: a row group per request
        pair = SpecPair(w, plan_for(preset, tokens=cfg.max_tree, **groups),
                        plan_for(dcfg, tokens=dcfg.max_tree - 1, **groups), caches, batch=batch, agree=agree,
                        backend="gpu")
        g2 = torch.Generator().manual_seed(2)
        prompt = [[int(torch.randint(0, cfg.vocab, (1,), generator=g2))] for _ in range(batch)]
        want = max_tokens(cfg, batch, ctx + 1, pair.full)
        pair.start(prompt, want, ctx)
        pair.warm_up(mode)
        pair.start(prompt, want, ctx)
        roots = pair.state[:, abi.spec_offsets()["root"]].tolist()
        pair.launch_step(mode)  # one step checked against the host's acceptance rule before timing
        torch.cuda.synchronize()
        got = pair.read()
        for r in range(batch):  # request r: group r's engine with full trees
            e = pair.target.members[r] if pair.full else pair.target
            toks = e.tokens_t[:pair.T].tolist()
            path, bonus = speculative.accept(toks, pair.parents, e.buf["logits"][:pair.T])
            if toks[0] != roots[r] or got.emitted[r] != len(path) or got.tokens[r][-1] != bonus:
                raise CorrectnessError(f"{preset}/{mode} request {r}: the device accepted {got.emitted[r]} tokens, "
                                       f"the host's rule {len(path)} on the same logits")
        g = pair.step_graph(mode)
        prepared = Prepared(launch=g.replay, metrics={"steps_per_round": 2, "tree_tokens": pair.T,
                                                      "draft_slots": pair.T - 1, "agree": agree, "requests": batch},
                            after=lambda: pair._check_watchdogs(mode))
        prepared._pair = pair  # keep the engines (and their buffers) alive while the graph is replayed
        return prepared

    name = f"megakernel/spec/{preset}/ctx{ctx}/{mode}" + (f"/B{batch}/full" if batch > 1 else "")
    return Case(name, {"preset": preset, "ctx": ctx, "mode": mode, "acceptance": "study", "batch": batch}, prepare)


@pytest.mark.parametrize("mode", ["chain", "mega"])
@pytest.mark.parametrize("preset,ctx", SPEC_POINTS, ids=lambda v: str(v))
def test_megakernel_spec_step(device_bench, preset, ctx, mode):
    device_bench(_spec_case(preset, ctx, mode))


@pytest.mark.parametrize("preset,ctx", SPEC_POINTS, ids=lambda v: str(v))
def test_megakernel_spec_step_full_trees(device_bench, preset, ctx):
    device_bench(_spec_case(preset, ctx, "mega", batch=4))

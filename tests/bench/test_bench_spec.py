"""pytest-benchmark cases of one whole speculative step on the device (megakernel.decode): the
drafter's pass, the target's verify at T=16 and the accept / compaction launch, mega and chain, on
small and shard8 at their headline contexts, with the named 'study' acceptance. A launch is a
CUDA-graph replay of 2 steps (the counters' parities alternate); device_bench reports per step.
Each replay advances the device's state as the steps it holds do (ctx, the emitted tokens): the
cache starts random at the context (a prefilled prompt's stand-in), and a request that has all it
asked for keeps verifying at its last context (its steps then emit and move nothing)."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu
SPEC_POINTS = [("small", 512), ("shard8", 2048)]


def _spec_case(preset, ctx, mode):
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
        cache = KVCache(cfg, device="cuda").fill_random(torch.Generator(device="cuda").manual_seed(1))
        pair = SpecPair(w, plan_for(preset, tokens=cfg.max_tree), plan_for(dcfg, tokens=dcfg.max_tree - 1), [cache],
                        agree=agree, backend="gpu")
        prompt = [[int(torch.randint(0, cfg.vocab, (1,), generator=torch.Generator().manual_seed(2)))]]
        want = max_tokens(cfg, 1, ctx + 1)
        pair.start(prompt, want, ctx)
        pair.warm_up(mode)
        pair.start(prompt, want, ctx)
        roots = pair.state[:, abi.spec_offsets()["root"]].tolist()
        pair.launch_step(mode)  # one step checked against the host's acceptance rule before timing
        torch.cuda.synchronize()
        toks = pair.target.tokens_t[:pair.T].tolist()
        path, bonus = speculative.accept(toks, pair.parents, pair.target.buf["logits"][:pair.T])
        got = pair.read()
        if toks[0] != roots[0] or got.emitted[0] != len(path) or got.tokens[0][-1] != bonus:
            raise CorrectnessError(f"{preset}/{mode}: the device accepted {got.emitted[0]} tokens, the host's rule "
                                   f"{len(path)} on the same logits")
        g = pair.step_graph(mode)
        prepared = Prepared(launch=g.replay, metrics={"steps_per_round": 2, "tree_tokens": pair.T,
                                                      "draft_slots": pair.T - 1, "agree": agree},
                            after=lambda: pair._check_watchdogs(mode))
        prepared._pair = pair  # keep the engines (and their buffers) alive while the graph is replayed
        return prepared

    return Case(f"megakernel/spec/{preset}/ctx{ctx}/{mode}", {"preset": preset, "ctx": ctx, "mode": mode,
                                                                "acceptance": "study"}, prepare)


@pytest.mark.parametrize("mode", ["chain", "mega"])
@pytest.mark.parametrize("preset,ctx", SPEC_POINTS, ids=lambda v: str(v))
def test_megakernel_spec_step(device_bench, preset, ctx, mode):
    device_bench(_spec_case(preset, ctx, mode))

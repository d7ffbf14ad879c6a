"""A long decode on two twin engines, alternating mega and chain mode step by step: the check that
no schedule, parity or counter state left by one step corrupts a later one, and that no wait hangs.

Twins A and B hold the same weights and start from the same KV cache. At step i, A runs mega mode
and B chain mode when i is even, the other way round when i is odd; both take A's greedy token of
the step before (real routing: the kernel's own). Mega == chain is bitwise (the megakernel's
invariant), so every step's logits and token must match between the twins, and the two caches
must stay bitwise equal (compared every `kv_every` steps and at the end). A step whose watchdog
gives up counts as a hang; the run stops there (the engine's state past a hang is not trusted).

Danger this guards: the counters' two parity halves are reset by the step that does not use them;
a mode switch that skipped a reset, or a stale sentinel slot, shows only after many steps."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from microbench.errors import MegabenchError
from microbench.results import Derived, Env, Result, Series

from .config import ConfigError, ModelConfig
from .plan import Plan
from .reference import KVCache
from .runtime import Engine
from .weights import ModelWeights

BENCHMARK = "megakernel.stress"


@dataclass
class StressRun:
    preset: str
    steps: int  # steps both twins ran
    mismatches: list[str] = field(default_factory=list)  # "step i: what differed" (first 20 kept)
    n_mismatches: int = 0
    hangs: list[str] = field(default_factory=list)  # the watchdog's report of a wait that gave up
    kv_checks: int = 0
    seconds: float = 0.0
    backend: str = "gpu"

    @property
    def ok(self) -> bool:
        return self.n_mismatches == 0 and not self.hangs


def _kv_equal(a: KVCache, b: KVCache) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.k + a.v, b.k + b.v))


def stress(w: ModelWeights, plan: Plan, steps: int, *, backend: str = "gpu", prompt=(3, 14, 15, 92),
           kv_every: int = 100, corrupt_at: int | None = None, progress=None, **engine_kw) -> StressRun:
    """Run `steps` decode steps on twin engines, alternating modes (module docstring). corrupt_at:
    flip one bit of B's cache before that step (the mutation that proves the check can fail)."""
    cfg: ModelConfig = w.cfg
    if steps < 1:
        raise ConfigError(f"--steps {steps}: want at least 1")
    if len(prompt) + steps + 1 > cfg.max_context:
        raise ConfigError(f"{steps} steps after a prompt of {len(prompt)}: {cfg.name} holds {cfg.max_context} positions")
    dev = "cuda" if backend == "gpu" else "cpu"
    a = Engine(w, plan, KVCache(cfg, device=dev), backend=backend, **engine_kw)
    b = Engine(w, plan, KVCache(cfg, device=dev), backend=backend, **engine_kw)
    run = StressRun(cfg.name, 0, backend=backend)
    t0 = time.perf_counter()
    ctx, last = 0, None
    seq = list(prompt) + [None] * steps  # the prompt's tokens, then each step's greedy token
    for i, tok in enumerate(seq):
        tok = last if tok is None else tok
        if corrupt_at is not None and i == corrupt_at:
            b.cache.k[0].view(torch.int16).view(-1)[0] ^= 1  # one bit of layer 0's first K word
        ma, mb = ("mega", "chain") if i % 2 == 0 else ("chain", "mega")
        try:
            oa = a.step([tok], [-1], ctx, mode=ma)
            ob = b.step([tok], [-1], ctx, mode=mb)
        except MegabenchError as e:  # a bounded wait that gave up: it names the op, rank and slot
            run.hangs.append(f"step {i}: {e}")
            break
        bad = []
        if not torch.equal(oa.logits, ob.logits):
            bad.append(f"logits differ ({int((oa.logits != ob.logits).sum())} of {oa.logits.numel()})")
        if not torch.equal(oa.tokens, ob.tokens):
            bad.append(f"tokens {oa.tokens.tolist()} vs {ob.tokens.tolist()}")
        ctx += 1
        if (i + 1) % kv_every == 0 or i == len(seq) - 1:
            run.kv_checks += 1
            if not _kv_equal(a.cache, b.cache):
                bad.append("KV caches differ")
        if bad:
            run.n_mismatches += 1
            if len(run.mismatches) < 20:
                run.mismatches.append(f"step {i} ({ma} vs {mb}, ctx {ctx - 1}): " + "; ".join(bad))
        last = int(oa.tokens[0])
        if i >= len(prompt):
            run.steps += 1
        if progress and (i + 1) % 250 == 0:
            progress(f"step {i + 1}/{len(seq)}: {run.n_mismatches} mismatches, {len(run.hangs)} hangs")
    run.seconds = time.perf_counter() - t0
    return run


def to_result(run: StressRun, env: Env) -> Result:
    """`megakernel.stress`: the counts, with every step's pair as one sample of the run's wall time
    (the figure is a count, not a rate: the steps are synchronised and compared on the host)."""
    params = {"preset": run.preset, "steps": run.steps, "backend": run.backend, "modes": "alternating mega/chain twins"}
    metrics = {"mismatches": run.n_mismatches, "hangs": len(run.hangs), "kv_checks": run.kv_checks,
               "first_mismatches": run.mismatches, "hang_reports": run.hangs}
    s = Series.from_samples(f"{run.preset}/stress", [run.seconds], timer="host", unit="s", params=params,
                            metrics=metrics)
    derived = {"mismatches": Derived(float(run.n_mismatches), "steps", "steps whose twins differed (logits, token or "
                                     "KV cache)", inputs=(s.name,)),
               "hangs": Derived(float(len(run.hangs)), "steps", "steps whose watchdog gave up", inputs=(s.name,))}
    return Result(BENCHMARK, env, (s,), derived, quick=True,
                  notes=(f"{run.steps} decode steps, T=1, real routing, twins alternating mega and chain",))

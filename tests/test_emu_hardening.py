"""The host emulation runs under the hardening flags that common toolchains turn on by default.

The H200 machine's g++ (Ubuntu 24.04) fortifies at -O1 and above; CI's (Debian 12) does not. The
emulation's fiber switch used to be _setjmp/_longjmp onto another fiber's stack, which glibc's
fortified __longjmp_chk aborts ("longjmp causes uninitialized stack frame"), killing the test
interpreter on that machine only. These tests build the emulation with those flags on any
machine, so CI catches such a switch too. Each step runs in a child interpreter: an abort there
is a failing test with glibc's message, not a dead test run.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megakernel.build import HARDENED_CXXFLAGS

ROOT = Path(__file__).resolve().parents[1]

# One tiny step (T=4, tree-shaped) in chain and mega mode, and mega mode again with the
# reference's routing forced: mega == chain bitwise (logits and KV), and close to the reference.
STEP = textwrap.dedent("""
    import sys, torch
    from megakernel import build, tree
    from megakernel.config import preset
    from megakernel.plan import make_plan
    from megakernel.reference import KVCache, Trace, step
    from megakernel.runtime import Engine, check_close
    from megakernel.weights import generate
    flags = tuple(sys.argv[1:])
    orig = build.build_emu
    build.build_emu = lambda plan, opt="-O1", extra_flags=None: orig(plan, opt, flags)
    cfg = preset("tiny")
    w = generate(cfg)
    base = KVCache(cfg).fill_random(torch.Generator().manual_seed(11))
    plan = make_plan(cfg, 4, spin_bound_ns=3_000_000_000)
    toks = torch.randint(0, cfg.vocab, (4,), generator=torch.Generator().manual_seed(12))
    par = tree.binary_ish(4)
    outs = {}
    for mode in ("chain", "mega"):
        cache = base.clone()
        eng = Engine(w, plan, cache, backend="emu", emu_seed=13)
        eng.poison()
        outs[mode] = (eng.step(toks, par, 40, mode=mode), cache)
    (c, cc), (m, mc) = outs["chain"], outs["mega"]
    assert torch.equal(c.logits, m.logits) and torch.equal(c.tokens, m.tokens), "mega != chain"
    assert cc.equal(mc), "mega's KV != chain's"
    ref_cache = base.clone()
    tr = Trace()
    ref = step(w, ref_cache, toks, par, 40, trace=tr)
    routes = [tr.tensors[f"L{l}.route"] for l in range(cfg.n_layers)]
    forced = Engine(w, plan, base.clone(), backend="emu").step(toks, par, 40, mode="mega", routes=routes)
    check_close(forced.logits, ref, "emulated step vs reference", rel=1e-2)
    print("EMU-OK")
""")


def _run_step(flags: tuple[str, ...], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEGABENCH_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", STEP, *flags], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


@pytest.mark.parametrize("flags", [HARDENED_CXXFLAGS,  # the portable fallback is ~2x slower: CI runs it (-m slow)
                                   pytest.param(("-DEMU_UCONTEXT_SWITCH", *HARDENED_CXXFLAGS), marks=pytest.mark.slow)],
                         ids=["own-switch", "ucontext-switch"])
def test_emulated_step_runs_under_hardened_toolchain_flags(flags, tmp_path):
    r = _run_step(flags, tmp_path)
    assert r.returncode == 0 and "EMU-OK" in r.stdout, (
        f"emulated step under {' '.join(flags)} exited {r.returncode}:\n{r.stderr[-3000:]}")


def test_hardened_flags_name_what_the_gpu_machines_compiler_does():
    # Ubuntu 24.04's gcc defaults (the H200 machine): fortify level 3 and the stack protector
    # are the two that interact with a fiber switch; -O2 because fortify needs optimisation.
    assert "-D_FORTIFY_SOURCE=3" in HARDENED_CXXFLAGS
    assert "-fstack-protector-strong" in HARDENED_CXXFLAGS
    assert any(f.startswith("-O") and f != "-O0" for f in HARDENED_CXXFLAGS)

"""Mutations the megakernel's checks must catch: waits dropped from the program under the emulation's
adversarial schedules (a producer's last unit delayed until every other block is blocked), and the
emulator's own refusals of what the GPU faults on."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from megakernel.build import CSRC, source
from megakernel.runtime import EMU_SCHEDULES, Engine
from microbench.errors import SpinTimeoutError

from megakernel_cases import step_inputs, tiny


def _dropping(kind: str, producer: str):
    """A program builder (runtime.build_program's stand-in) whose `kind` ops skip their waits for
    `producer`: the kernel then never waits for it (the mutation the adversarial schedule must catch)."""
    from megakernel.program import build as real_build

    def build_without(plan, mode="layer"):
        prog = real_build(plan, mode)
        ops = tuple(dataclasses.replace(o, deps=tuple(d for d in o.deps if prog.ops[d.producer].kind != producer))
                    if o.kind == kind else o for o in prog.ops)
        assert ops != prog.ops, f"no {kind} <- {producer} dependency to drop"
        return dataclasses.replace(prog, ops=ops)
    return build_without


@pytest.mark.parametrize("ctx,t", [(0, 1), (40, 16)])
def test_adversarial_schedule_catches_gate_up_without_its_pool_wait(tiny, monkeypatch, ctx, t):
    """Gate/up (expert GEMM 1) that skips its wait for the pooler: under the schedule delaying each
    op's last unit, the pooler's last block runs only when every other block is blocked, so gate/up
    stages pooled rows it never wrote (NaN after poison) and mega differs from chain. The random
    schedule alone lets this mutation pass: its blocks finish the pooler before top-k lets gate/up
    start."""
    from megakernel import runtime

    cfg, w, base, plan = tiny
    toks, par = step_inputs(cfg, t, ctx)
    chain = Engine(w, plan, base.clone(), backend="emu").step(toks, par, ctx, mode="chain")
    monkeypatch.setattr(runtime, "build_program", _dropping("expert1", "pool"))
    eng = Engine(w, plan, base.clone(), backend="emu", emu_seed=ctx + 7, emu_schedule="last")
    eng.poison()
    out = eng.step(toks, par, ctx, mode="mega")
    assert not torch.equal(out.logits, chain.logits)


def test_emulation_refuses_an_unknown_schedule(tiny):
    cfg, w, base, plan = tiny
    with pytest.raises(ValueError, match="emu_schedule"):
        Engine(w, plan, base.clone(), backend="emu", emu_schedule="sometimes")
    eng = Engine(w, plan, base.clone(), backend="emu")
    assert eng.dll.emu_set_schedule(max(EMU_SCHEDULES.values()) + 1) == 1 and eng.dll.emu_set_schedule(0) == 0


# Dependencies whose loss the tiny build cannot show: expert GEMM 2's unit of a slot runs on the
# block that ran the slot's gate/up unit (one unit of each per slot, contiguous), and the MoE
# combine's wait for top-k is implied by its wait for expert GEMM 2
_UNOBSERVABLE = {("expert2", "expert1"), ("moe_combine", "topk")}


@pytest.mark.full
def test_adversarial_schedule_catches_every_observable_missing_wait(tiny, monkeypatch):
    """Every dependency of the program dropped in turn (the kernel then skips that wait): the
    schedule delaying each op's last unit makes mega differ from chain for each of them (the
    random schedule alone misses many)."""
    from megakernel import runtime
    from megakernel.program import build as real_build

    cfg, w, base, plan = tiny
    toks, par = step_inputs(cfg, 16, 40)
    chain = Engine(w, plan, base.clone(), backend="emu").step(toks, par, 40, mode="chain")
    prog = real_build(plan)
    edges = sorted({(o.kind, prog.ops[d.producer].kind) for o in prog.ops for d in o.deps} - _UNOBSERVABLE)
    missed = []
    for kind, producer in edges:
        monkeypatch.setattr(runtime, "build_program", _dropping(kind, producer))
        eng = Engine(w, plan, base.clone(), backend="emu", emu_seed=1, emu_schedule="last")
        eng.poison()
        try:
            out = eng.step(toks, par, 40, mode="mega")
            if torch.equal(out.logits, chain.logits) and torch.equal(out.tokens, chain.tokens):
                missed.append(f"{kind} <- {producer}")
        except (runtime.EmulationError, SpinTimeoutError):
            pass  # caught as a hang or an emulation check: also a failing test
    assert not missed, f"missing waits the adversarial schedule did not catch: {missed}"


def test_emulation_refuses_the_step_shape_read_by_the_loader_warp(tiny, tmp_path):
    """The loader warp streams weights before pdl_wait(): it must never read the step block, which
    a device loop's previous launch may still be writing (abi.STEP_FIELDS). The emulation poisons
    the shape there, so a loader that reads it fails the launch by name instead of racing."""
    import shutil

    from megakernel import ab
    from megakernel.runtime import EmulationError

    cfg, w, base, plan = tiny
    tree = tmp_path / "csrc"
    shutil.copytree(CSRC, tree)
    f = tree / "mk" / "program.cuh"
    line = "  int routed_layer = -1, routed_nslots = 0;"
    assert f.read_text().count(line) == 1
    f.write_text(f.read_text().replace(line, line + "\n  if (step_rows(b) == 12345) return;"))
    toks, par = step_inputs(cfg, 3, 2)
    with ab.kernel_tree(tree):
        eng = Engine(w, plan, base.clone(), backend="emu")
    with pytest.raises(EmulationError, match="step's shape read before load_step"):
        eng.step(toks, par, 10, mode="mega")


_ALIGN_PROBE = r"""
#define MK_HOST_EMU 1
#include "mk/default_config.cuh"
#include "mk/arch.cuh"
#include <stdio.h>
#include <stdlib.h>
alignas(16) static unsigned char buf[256];
static int which, offset;
static void body(void*) {  // one warp: a 16-byte global load, or an ldmatrix, `offset` bytes in
  uint32_t a[4] = {0, 0, 0, 0};
  if (which == 0 && mk::tid() == 0) a[0] = mk::ldg_cg4(buf + offset).x;
  if (which == 1) mk::ldsm_x4(a, buf + offset + 16 * (mk::lane() & 7));
  if (a[0] == 12345u) buf[0] = 1;
}
extern "C" int emu_launch(void (*)(void*), void*, int, int, int, unsigned long long, char*, int);
int main(int argc, char** argv) {
  which = atoi(argv[1]);
  offset = atoi(argv[2]);
  char err[512] = {0};
  const int rc = emu_launch(body, nullptr, 1, 32, 0, 1, err, sizeof err);
  printf("%d|%s\n", rc, err);
}
"""


def _emu_probe(tmp_path, source: str):
    """Compile a probe program against the emulator; returns run(*args) -> its stdout, stripped."""
    import subprocess

    from megakernel.build import CSRC, EMU, MB_INC

    src = tmp_path / "probe.cpp"
    src.write_text(source)
    exe = tmp_path / "probe"
    subprocess.run(["g++", "-std=c++17", "-O1", "-w", f"-I{EMU / 'shim'}", f"-I{CSRC}", f"-I{EMU}", f"-I{MB_INC}",
                    str(src), str(EMU / "emu.cpp"), "-o", str(exe)], check=True, capture_output=True, timeout=300)
    return lambda *args: subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True,
                                        timeout=60).stdout.strip()


def test_emulator_refuses_misaligned_vector_loads_like_the_gpu(tmp_path):
    """A 16-byte global load or an ldmatrix row at an address that is not 16-byte aligned faults
    on the GPU ("misaligned address"); the emulation stops with the reason instead of reading."""
    run = _emu_probe(tmp_path, _ALIGN_PROBE)
    assert run(0, 16) == "0|" and run(1, 32) == "0|"
    assert run(0, 4) == "1|block 0 thread 0: 16-byte global load not 16-byte aligned"
    assert run(1, 8).startswith("1|") and "ldmatrix row address not 16-byte aligned" in run(1, 8)


_BARRIER_PROBE = r"""
#define MK_HOST_EMU 1
#include "mk/default_config.cuh"
#include "mk/arch.cuh"
#include <stdio.h>
#include <stdlib.h>
static int which;
static void body(void*) {  // the compute warps meet at barrier 1 twice
  const bool low = mk::warp() < mk::WARPS / 2;
  if (which == 0) {  // one instruction each time
    mk::sync_compute();
    mk::sync_compute_or(low);
  } else if (which == 1) {  // half the warps at another bar.sync (an early return with its own barrier)
    if (low) mk::sync_compute();
    else mk::sync_compute();
  } else {  // half the warps at a bar.red.or where the others are at a bar.sync
    if (low) mk::sync_compute();
    else mk::sync_compute_or(true);
  }
}
extern "C" int emu_launch(void (*)(void*), void*, int, int, int, unsigned long long, char*, int);
int main(int argc, char** argv) {
  which = atoi(argv[1]);
  char err[600] = {0};
  const int rc = emu_launch(body, nullptr, 2, mk::COMPUTE_THREADS, 0, 3, err, sizeof err);
  printf("%d|%s\n", rc, err);
}
"""


def test_emulator_refuses_a_barrier_reached_at_two_instructions(tmp_path):
    """compute-sanitizer synccheck reports the threads of a block at different bar.sync (or
    bar.red) instructions of one barrier as divergent (as when warps without a tile leave a GEMM
    through a barrier of their own); the emulation stops there too, naming both source lines."""
    run = _emu_probe(tmp_path, _BARRIER_PROBE)
    assert run(0) == "0|"
    for which, kinds in ((1, ("", "")), (2, ("", "bar.red.or at "))):
        out = run(which)
        assert out.startswith("1|block ") and "threads of a block at different barrier instructions" in out, out
        sites = re.findall(r"(bar\.red\.or at )?\S*probe\.cpp:(\d+)", out)
        assert len(sites) == 2 and sites[0][1] != sites[1][1] and {k for k, _ in sites} == set(kinds), out

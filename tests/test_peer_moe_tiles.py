"""The fused MoE's block-size configurations agree: moe_up and moe_down of the peer
(peer_kernels) at n32k128 (the sweep's mma.sync config) and n64k128 (the default, wgmma) on the
CPU through Triton's interpreter, against each other and against a float64 torch reference of
the same maths; and, compiled for sm_90a here (Triton's own ptxas, no GPU), no mma.sync dot of
the sweep has a K smaller than its operand layout spans (4 lanes x kWidth). That last check is
the one the interpreter cannot make: n32k128w4s4's dots of K = 16 got kWidth 8 (32 k values) and
computed wrong outputs on the H200 (1.85 / 1.00 relative off the other configs, the sweep's own
check), while its interpreted outputs were right. Tiny shapes: ~10-15 s on 2 cores."""
from __future__ import annotations

import math
import re

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("triton.runtime.interpreter")

from megakernel import peer_kernels as K  # noqa: E402
from megakernel.nvfp4 import random_nvfp4  # noqa: E402
from megakernel.runtime import check_close  # noqa: E402
from megakernel.weights import BF16, ExpertBank  # noqa: E402

N32 = K.MoeConfig(32, 128, 4, 4)  # the sweep's n32k128w4s4 (peer.SWEEP)
N64 = K.MoeConfig(64, 128, 4, 3)  # the default (peer.default_moe_configs)


def _bank(e, n, k, g):
    return ExpertBank.from_natural([random_nvfp4(n, k, 1 / math.sqrt(k), g) for _ in range(e)], "cpu")


def _dequant(bank, ex):
    return bank.expert(ex).dequant_bf16_exact().double() * float(bank.tensor_scale[ex])


@pytest.fixture(scope="module")
def case():
    """3 tokens x top-2 of 3 experts, p = 256 (two K steps of 128 for moe_up), f = 128."""
    g = torch.Generator().manual_seed(49)
    t, k, e, f, p = 3, 2, 3, 128, 256
    w1, w2 = _bank(e, 2 * f, p, g), _bank(e, p, f, g)
    routes = torch.tensor([[0, 2], [2, 1], [0, 2]], dtype=torch.int32)  # expert 2 gets 3 pairs, 1 gets 1
    mb = K.max_blocks(t * k, e, K.BLOCK_M, t)
    s, b, n = K.align_reference(routes, e, K.BLOCK_M, mb)
    n = torch.tensor([n], dtype=torch.int32)
    pooled = torch.randn(t, p, generator=g)  # fp32, as the router/pool GEMM leaves it
    act_in = torch.randn(t * k, f, generator=g).to(BF16)  # moe_down's own input (natural k order)
    # the reference: the same maths in float64 on the dequantised weights
    xb = pooled.to(BF16).double()
    up = torch.zeros(t * k, f, dtype=torch.float64)
    down = torch.zeros(t * k, p, dtype=torch.float64)
    for pr, ex in enumerate(routes.reshape(-1).tolist()):
        gu = xb[pr // k] @ _dequant(w1, ex).T
        up[pr] = torch.nn.functional.silu(gu[:f]) * gu[f:]
        down[pr] = act_in[pr].double() @ _dequant(w2, ex).T
    return dict(t=t, k=k, f=f, p=p, w1=w1, w2=w2, s=s, b=b, n=n, x=K.to_planes(pooled),
                act_in=K.to_planes(act_in), up=up.to(BF16), down=down.to(BF16))


def _run(c, cfg):
    t, k, f, p = c["t"], c["k"], c["f"], c["p"]
    act = torch.full((t * k, f), float("nan"), dtype=BF16)
    y = torch.full((t * k, p), float("nan"), dtype=BF16)
    w1, w2 = c["w1"], c["w2"]
    with K.interpreted():
        K.moe_up(c["x"], p, 0, True, c["s"], c["b"], c["n"], w1.codes, w1.scales, w1.tensor_scale, act, t * k, k,
                 cfg)
        K.moe_down(c["act_in"], c["s"], c["b"], c["n"], w2.codes, w2.scales, w2.tensor_scale, y, t * k, cfg)
    return K.from_planes(act), y


@pytest.fixture(scope="module")
def outputs(case):
    return {cfg.label(): _run(case, cfg) for cfg in (N32, N64)}


@pytest.mark.parametrize("cfg", [N32, N64], ids=lambda c: c.label())
def test_moe_tiles_match_the_reference(case, outputs, cfg):
    up, down = outputs[cfg.label()]
    for got, ref, what in ((up, case["up"], "moe_up"), (down, case["down"], "moe_down")):
        assert (got == ref).float().mean() > 0.99, what  # bf16 outputs: at most rare one-ulp flips
        check_close(got, ref, f"{what} {cfg.label()}", rel=1e-3)


def test_moe_tiles_agree_with_each_other(outputs):
    (u32, d32), (u64, d64) = outputs[N32.label()], outputs[N64.label()]
    check_close(u32, u64, "moe_up n32k128 vs n64k128", rel=2e-3)  # the sweep's own tolerance (peer.tune_moe)
    check_close(d32, d64, "moe_down n32k128 vs n64k128", rel=2e-3)


# ---------------------------------------------------------------------- what only the GPU's compile shows
def _ttgir(kind: str, cfg: K.MoeConfig) -> str:
    try:  # the NVIDIA backend and its ptxas (triton's wheels carry both)
        from triton.backends.nvidia.compiler import get_ptxas

        get_ptxas(90)
    except Exception as e:
        pytest.skip(f"no sm_90a compiler in this triton: {e.__class__.__name__}: {str(e)[:200]}")
    fn, sig, ce, aligned = K.moe_compile_args(kind, cfg)
    return K.compile_sm90_ir(fn, sig, ce, cfg.num_warps, cfg.num_stages, aligned).asm["ttgir"]


def _mma_sync_dots(ttgir: str) -> list[tuple[int, int, int]]:
    """(M, K, kWidth) of the A operand of every mma.sync (nvidia_mma version 2) dot."""
    v2 = set(re.findall(r"^#(\w+) = #ttg\.nvidia_mma<\{versionMajor = 2\b", ttgir, re.M))
    out = []
    for m, k, parent, kw in re.findall(r"tt\.dot [^\n]*?: tensor<(\d+)x(\d+)x\w+, #ttg\.dot_op<\{opIdx = 0, "
                                       r"parent = #(\w+), kWidth = (\d+)\}>>", ttgir):
        if parent in v2:
            out.append((int(m), int(k), int(kw)))
    return out


@pytest.mark.parametrize("kind", ["up", "down"])
def test_mma_sync_dots_cover_their_operand_layout(kind):
    """A 16-bit mma.sync operand of kWidth w holds w consecutive k values per lane, 4 lanes a row:
    a dot of K < 4w wraps that layout and adds wrong products (Triton 3.6; the H200 showed it).
    The sweep's mma.sync config has such dots no more; the wgmma configs are left as they were."""
    dots = _mma_sync_dots(_ttgir(kind, N32))
    assert dots, "n32k128's dots are mma.sync (BLOCK_N 32 < a warpgroup's 64 rows)"
    assert all(k >= 4 * kw for _, k, kw in dots), f"moe_{kind} {N32.label()}: (M, K, kWidth) {sorted(set(dots))}"
    assert not N32.wgmma() and N64.wgmma()
    g64 = _ttgir(kind, N64)
    assert "warp_group_dot" in g64 and not _mma_sync_dots(g64)  # MoeConfig.wgmma's rule holds there

// Plan.shared_dense: the layer's dense bf16 ops (qkv, oproj, router, pool, unpool) through one
// copy of the GEMM, its operand staging, its ring waits and its loader code, the shape and the
// operand picked at run time from the op's kind; only each op's prologue and epilogue are its own.
// The per-op build inlines a copy into each op, and the critical path's cold-code column had each
// copy fetched from L2 once a layer. One copy, warm after the layer's first dense op, was to save
// that. Measured, it does not: 247 -> 205 KB of code, but shard8 T=16 4.2% slower, the control
// (Plan.shared_dense=2, the same runtime-shaped code one copy per op) 1.6% (in-run A/B, H200
// 2026-12-02 17:18Z). So it stays off, a switch for A/Bs. The same instructions in the same order
// compute every value, so the results are bitwise those of the per-op code
// (tests/test_megakernel_shared_dense.py).
#pragma once
#include "ops/oproj.cuh"
#include "ops/pool.cuh"
#include "ops/qkv_rope.cuh"
#include "ops/router.cuh"
#include "ops/unpool.cuh"

namespace mk {

static_assert(TILE_OPROJ_ROWS == TILE_UNPOOL_ROWS, "oproj and unpool share one residual epilogue (plan.residual_rows)");

// The kinds compared one by one (testing DENSE_KINDS' bits instead grew the shared build from 205
// to 290 KB at shard8 T=16, NVRTC 13.0), checked against the rendered plan.DENSE_OPS
MK_DEV bool is_dense(int kind) {
  return kind == OP_QKV || kind == OP_OPROJ || kind == OP_ROUTER || kind == OP_POOL || kind == OP_UNPOOL;
}
static_assert(DENSE_KINDS == ((1u << OP_QKV) | (1u << OP_OPROJ) | (1u << OP_ROUTER) | (1u << OP_POOL) | (1u << OP_UNPOOL)),
              "is_dense's kinds are plan.DENSE_OPS");

MK_DEV Bf16Shape dense_shape(int kind) {
  switch (kind) {
    case OP_QKV: return bf16_shape<TILE_QKV_ROWS, TILE_QKV_KC, D, NORM_KP>();
    case OP_OPROJ: return bf16_shape<TILE_OPROJ_ROWS, TILE_OPROJ_KC, ATT_W>();
    case OP_ROUTER: return bf16_shape<TILE_ROUTER_ROWS, TILE_ROUTER_KC, D, NORM_KP, true>();
    case OP_POOL: return bf16_shape<TILE_POOL_ROWS, TILE_POOL_KC, D, NORM_KP>();
    default: return bf16_shape<TILE_UNPOOL_ROWS, TILE_UNPOOL_KC, P>();
  }
}

// The compute warps' side: the op's prologue (loads that overlap the GEMM), the shared GEMM with
// the op's operand staged before each panel, then the op's epilogue.
MK_DEV void run_dense(Blk& b, int kind, int layer, int unit, uint32_t what) {
  constexpr int RR = TILE_OPROJ_ROWS;
  const Params& p = *b.p;
  QkvRope q{};
  Residual<RR> r{};
  if (kind == OP_QKV) q = qkv_begin(b, unit);
  if (kind == OP_OPROJ) r = residual_begin<RR>(b, unit, p.layers[layer].ffn_norm);
  if (kind == OP_UNPOOL) r = residual_begin<RR>(b, unit, unpool_gain(p, layer));
  auto stage = [&](int panel) {
    if (kind == OP_QKV) qkv_stage(b, layer, panel, what);
    else if (kind == OP_ROUTER || kind == OP_POOL) ffn_stage(b, layer, panel, what);
    else if (kind == OP_OPROJ) oproj_stage(b, layer);
    else unpool_stage(b, layer);
  };
  const Bf16Acc acc = gemm_bf16_at(b, dense_shape(kind), what, stage);
  switch (kind) {
    case OP_QKV: qkv_end(b, layer, q, acc); break;
    case OP_OPROJ: residual_end<RR>(b, r, unit, 1, acc); break;
    case OP_ROUTER: router_end(b, unit, acc); break;
    case OP_POOL: pool_end(b, unit, acc); break;
    default: residual_end<RR>(b, r, unit, 0, acc); break;
  }
}

// The loader's side: the unit's chunks of the op's weights, one copy of the loop for all five.
MK_DEV bool load_dense(const Blk& b, int kind, int layer, int unit, unsigned& c, uint32_t what) {
  const LayerPtrs& L = b.p->layers[layer];
  const Bf16Shape s = dense_shape(kind);
  const uint16_t* W = kind == OP_QKV ? L.wqkv : kind == OP_OPROJ ? L.wo : kind == OP_ROUTER ? L.router
                      : kind == OP_POOL ? L.pool : L.unpool;
  const int rows = s.r8 ? 8 : 16 << s.lt;
  return produce_bf16_at(b, W, unit, c, what, s.nch, static_cast<unsigned>(rows * (s.kc * 2 + ROW_PAD)),
                         dense_tile_elems(rows, s.kc), s.rev);
}

}  // namespace mk

// pool (the pooler): pooled = bf16(rmsnorm(x, ffn_norm) @ pool^T), d -> p (the norm factor applied to
// the fp32 result, gemm.cuh stage_normed). Unit = TILE_POOL_ROWS features.
// Shares its staged operand with the router (same tag) when a block runs both (only on grids too
// small for them to run side by side: plan.pool_rows, program.pool_rotation). Paneled, the router
// walks its chunks last-first and leaves panel 0 staged: pool restages only the later panels, with
// the norm factors the router kept (gemm.cuh stage_normed).
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"
#include "ops/router.cuh"  // ffn_stage

namespace mk {

MK_DEV bool load_pool(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  constexpr int R = TILE_POOL_ROWS;
  return produce_bf16<R, TILE_POOL_KC, D>(b, b.p->layers[layer].pool, unit, c, what);
}

MK_DEV void pool_end(Blk& b, int unit, const Bf16Acc& acc) {
  const Params& p = *b.p;
  constexpr int R = TILE_POOL_ROWS;
  gemm_stash<R>(b, acc);
MK_COLD_LOOP
  for (int i = tid(); i < 16 * R; i += COMPUTE_THREADS) {
    const int t = i / R, n = i % R;
    if (t < step_rows(b)) p.pooled[t * P + unit * R + n] = f2bf(gemm_sum<R>(b, t, n) * norm_factor(b, t));
  }
}

MK_DEV void run_pool(Blk& b, int layer, int unit, uint32_t what) {
  auto stage = [&](int panel) { ffn_stage(b, layer, panel, what); };  // before each panel's first chunk
  pool_end(b, unit, gemm_bf16<TILE_POOL_ROWS, TILE_POOL_KC, D, NORM_KP>(b, what, stage));
}

}  // namespace mk

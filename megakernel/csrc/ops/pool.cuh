// pool (the pooler): pooled = bf16(rmsnorm(x, ffn_norm) @ pool^T), d -> p (the norm factor applied to
// the fp32 result, gemm.cuh stage_normed). Unit = TILE_POOL_ROWS features.
// Shares its staged operand with the router (same tag) when a block runs both (only on grids too
// small for them to run side by side: plan.pool_rows, program.pool_rotation). Paneled, the router
// walks its chunks last-first and leaves panel 0 staged: pool restages only the later panels, with
// the norm factors the router kept (gemm.cuh stage_normed).
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV bool load_pool(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  constexpr int R = TILE_POOL_ROWS;
  return produce_bf16<R, TILE_POOL_KC, D>(b, b.p->layers[layer].pool, unit, c, what);
}

MK_DEV void run_pool(Blk& b, int layer, int unit, uint32_t what) {
  const Params& p = *b.p;
  auto stage = [&](int panel) {
    stage_normed(b, 1, ss_part(p, 1), tag_of(TAG_FFN_NORM, layer, 0), panel, what);
  };  // called by the GEMM before each panel's first chunk
  constexpr int R = TILE_POOL_ROWS;
  gemm_stash<R>(b, gemm_bf16<R, TILE_POOL_KC, D, NORM_KP>(b, what, stage));
MK_COLD_LOOP
  for (int i = tid(); i < 16 * R; i += COMPUTE_THREADS) {
    const int t = i / R, n = i % R;
    if (t < b.T) p.pooled[t * P + unit * R + n] = f2bf(gemm_sum<R>(b, t, n) * norm_factor(b, t));
  }
}

}  // namespace mk

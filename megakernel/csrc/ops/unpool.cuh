// unpool (the unpooler): x += z @ unpool^T, p -> d (fp32 residual add). Unit = 8 features of x.
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV bool load_unpool(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  return produce_bf16<8, TILE_UNPOOL_KC, P>(b, b.p->layers[layer].unpool, unit * 8, c, what);
}

MK_DEV void run_unpool(Blk& b, int layer, int unit, uint32_t what) {
  const Params& p = *b.p;
  stage_plain<P>(b, p.z, tag_of(TAG_Z, layer, 0));
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  gemm_bf16<8, TILE_UNPOOL_KC, P>(b, acc, what);
  gemm_stash<8>(b, acc);
  for (int i = tid(); i < 16 * 8; i += COMPUTE_THREADS) {
    const int t = i / 8, n = i % 8;
    if (t < b.T) p.x[t * D + unit * 8 + n] += gemm_sum<8>(b, t, n);
  }
}

}  // namespace mk

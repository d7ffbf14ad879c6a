// unpool (the unpooler): x += z @ unpool^T, p -> d (fp32 residual add), and the new x's sums of
// squares per 8 features for the next attention (or final) norm (gemm.cuh ss8). Unit =
// TILE_UNPOOL_ROWS features of x.
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV bool load_unpool(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  constexpr int R = TILE_UNPOOL_ROWS;
  return produce_bf16<R, TILE_UNPOOL_KC, P>(b, b.p->layers[layer].unpool, unit * R, c, what);
}

MK_DEV void run_unpool(Blk& b, int layer, int unit, uint32_t what) {
  constexpr int R = TILE_UNPOOL_ROWS;
  static_assert(R % 8 == 0 && (16 * R) % 32 == 0 && 16 * R <= COMPUTE_THREADS, "epilogue: a thread per output, whole warps");
  const Params& p = *b.p;
  stage_plain<P>(b, p.z, tag_of(TAG_Z, layer, 0));
  // the residual this unit adds to, loaded before the GEMM so that its L2 round trip overlaps it
  const int t = tid() / R, n = tid() % R;
  const float xo = (tid() < 16 * R && t < b.T) ? ldg_cgf(p.x + t * D + unit * R + n) : 0.f;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  gemm_bf16<R, TILE_UNPOOL_KC, P>(b, acc, what);
  gemm_stash<R>(b, acc);
  if (tid() < 16 * R) {  // whole warps: the sum of squares shuffles within 8 lanes
    const float xn = xo + gemm_sum<R>(b, t, n);
    if (t < b.T) p.x[t * D + unit * R + n] = xn;
    const float ss = ss8_lanes(xn);
    if (n % 8 == 0 && t < b.T) ss_part(p, 0)[t * (D / 8) + unit * (R / 8) + n / 8] = ss;
  }
}

}  // namespace mk

// moe_combine: z[t] = bf16(sum over ranks r, in order, of w[t][r] * y[slot(t,r)][row(t,r)]).
// Unit = 64 columns of p.
#pragma once
#include "mk/block.cuh"

namespace mk {

MK_DEV void run_moe_combine(Blk& b, int unit) {
  const Params& p = *b.p;
  for (int i = tid(); i < b.T * 64; i += COMPUTE_THREADS) {
    const int t = i / 64, col = unit * 64 + i % 64;
    float acc = 0.f;
    for (int r = 0; r < TOPK; ++r) {
      const float w = ldg_cgf(p.route_w + t * TOPK + r);
      const int s = ldg_cgi(p.route_slot + t * TOPK + r), pos = ldg_cgi(p.route_pos + t * TOPK + r);
      const uint32_t pair = ldg_cg(p.yexp + (s * 16 + pos) * P + (col & ~1));
      acc = acc + w * bf2f(static_cast<uint16_t>((col & 1) ? pair >> 16 : pair & 0xffffu));
    }
    p.z[t * P + col] = f2bf(acc);
  }
}

}  // namespace mk

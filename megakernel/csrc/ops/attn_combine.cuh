// attn_combine: merge the attention partials of one (q head, token) in fixed order. Unit = one
// q head x one token. o = sum_p exp(m_p - M) O_p / sum_p exp(m_p - M) l_p, parts with no visible
// key (l = 0) skipped; written as bf16 into att_out[t][head*HD + d].
#pragma once
#include "mk/layers.cuh"
#include "ops/attention.cuh"

namespace mk {

MK_DEV void run_attn_combine(Blk& b, int layer, int unit) {
  const Params& p = *b.p;
  const int h = unit / b.T, t = unit % b.T;
  const int kvh = h / G, j = h % G;
  const int nparts = attn_splits(layer, b.ctx) * ATT_KG;
  const size_t row0 = static_cast<size_t>(kvh) * PARTS * (G * 16) + j * 16 + t;
  float mmax = neg_inf();
  for (int q = 0; q < nparts; ++q) {
    const size_t row = row0 + static_cast<size_t>(q) * (G * 16);
    if (ldg_cgf(p.att_ml + row * 2 + 1) > 0.f) mmax = fmax_(mmax, ldg_cgf(p.att_ml + row * 2));
  }
  for (int d = tid(); d < HD; d += COMPUTE_THREADS) {
    float num = 0.f, den = 0.f;
    for (int q = 0; q < nparts; ++q) {
      const size_t row = row0 + static_cast<size_t>(q) * (G * 16);
      const float lq = ldg_cgf(p.att_ml + row * 2 + 1);
      if (lq > 0.f) {
        const float sc = fexp(ldg_cgf(p.att_ml + row * 2) - mmax);
        num += sc * ldg_cgf(p.att_o + row * HD + d);
        den += sc * lq;
      }
    }
    p.att_out[t * ATT_W + h * HD + d] = f2bf(num / den);
  }
}

}  // namespace mk

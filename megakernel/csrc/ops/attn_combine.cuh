// attn_combine: merge the attention partials of one (q head, token) in fixed order. Unit = one
// q head x one row of the step; the row's request's partials (its splits x ATT_PPS, numbered as
// when it runs alone). o = sum_p exp(m_p - M) O_p / sum_p exp(m_p - M) l_p, parts with no visible
// key (l = 0) skipped; written as bf16 into att_out[t][head*HD + d].
#pragma once
#include "mk/layers.cuh"
#include "ops/attention.cuh"

namespace mk {

MK_DEV void run_attn_combine(Blk& b, int layer, int unit) {
  const Params& p = *b.p;
  const int rows = step_rows(b), h = unit / rows, t = unit % rows;
  const int kvh = h / G, j = h % G, r = row_req(b, t);
  const int nparts = req_splits(b, layer, r) * ATT_PPS;
  const size_t row0 = static_cast<size_t>(kvh) * PARTS * (G * 16) + j * 16 + t;
  // All compute threads: NSL slices of the parts, each summed by HD threads (one per d), then the
  // slices added in slice order. A thread's first NB partial rows of O are loaded before anything
  // else: they do not depend on (m, l), so their L2 round trip overlaps the one for (m, l) (one
  // dependent round trip per unit instead of three). One round covers NSL * NB parts: at NB = 40
  // and head_dim 128, 80 (shard8: 80 splits of 32 keys, 2,560 keys; its 65 parts at ctx 2048 take
  // one round). A part past a round costs a whole second round trip; a larger NB holds more
  // unrolled loads (registers and code) for every unit.
  constexpr int NSL = COMPUTE_THREADS / HD, NB = 40;
  static_assert(COMPUTE_THREADS % HD == 0 && (3 * PARTS + NSL * HD) * 4 <= ABUF_BYTES, "combine scratch fits abuf");
  const int d = tid() % HD, sl = tid() / HD, per = cdiv(nparts, NSL);
  const int q_lo = imin(nparts, sl * per), q_hi = imin(nparts, q_lo + per);
  float o[NB];
  // part q's row of O is G * 16 rows after part q - 1's: one 64-bit base per round, constant
  // offsets after it (a 64-bit index per load is ~10 KB of cold code, fetched every layer)
  auto load_o = [&](int q0) {
    const float* base = p.att_o + (row0 + static_cast<size_t>(q0) * (G * 16)) * HD + d;
#pragma unroll
    for (int k = 0; k < NB; ++k) o[k] = k < q_hi - q0 ? ldg_cgf(base + k * (G * 16 * HD)) : 0.f;
  };
  load_o(q_lo);
  float* ml = reinterpret_cast<float*>(b.abuf);  // (m, l) of every part
  float* wt = ml + 2 * PARTS;                     // per part exp(m - M), 0 for a part with nothing visible
  if (tid() == 0) b.misc[MISC_TAG] = -1;          // abuf reused as scratch
MK_COLD_LOOP
  for (int q = tid(); q < nparts; q += COMPUTE_THREADS) {
    const size_t row = row0 + static_cast<size_t>(q) * (G * 16);
    ml[2 * q] = ldg_cgf(p.att_ml + row * 2);
    ml[2 * q + 1] = ldg_cgf(p.att_ml + row * 2 + 1);
  }
  sync_compute();
  // the max and the denominator over the parts, each warp for itself: lanes take every 32nd
  // part, then a butterfly (the max is exact in any order; the sum's order is fixed, so every
  // warp, and chain mode, gets the same bits). Walked by every thread in turn, they would be
  // nparts dependent shared-memory loads on the unit's critical path.
  float mmax = neg_inf();
MK_COLD_LOOP
  for (int q = lane(); q < nparts; q += 32)
    if (ml[2 * q + 1] > 0.f) mmax = fmax_(mmax, ml[2 * q]);
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) mmax = fmax_(mmax, shfl_xor(mmax, x));
MK_COLD_LOOP
  for (int q = tid(); q < nparts; q += COMPUTE_THREADS) wt[q] = ml[2 * q + 1] > 0.f ? fexp(ml[2 * q] - mmax) : 0.f;
  sync_compute();
  float den = 0.f;
MK_COLD_LOOP
  for (int q = lane(); q < nparts; q += 32) den += wt[q] * ml[2 * q + 1];
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) den += shfl_xor(den, x);
  float* part = wt + PARTS;  // [NSL][HD] slice numerators
  float num = 0.f;
  for (int q0 = q_lo; q0 < q_hi; q0 += NB) {
    if (q0 != q_lo) load_o(q0);  // rounds after the first (beyond 4K keys at 64 per split)
#pragma unroll
    for (int k = 0; k < NB; ++k)
      if (q0 + k < q_hi) num += wt[q0 + k] * o[k];
  }
  part[sl * HD + d] = num;
  sync_compute();
  if (tid() < HD) {
    float s = 0.f;
    for (int k = 0; k < NSL; ++k) s += part[k * HD + tid()];
    p.att_out[t * ATT_W + h * HD + tid()] = f2bf(s / den);
  }
}

}  // namespace mk

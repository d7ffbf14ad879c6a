// attn_combine: merge the attention partials of one (q head, token) in fixed order. Unit = one
// q head x COMBINE_ROWS consecutive rows of the step (Plan.combine_rows: 1, or NSL, the slices of
// the compute threads below); each row's partials are its request's (its splits x ATT_KG,
// numbered as when it runs alone). o = sum_p exp(m_p - M) O_p / sum_p exp(m_p - M) l_p, parts with
// no visible key (l = 0) skipped; written as bf16 into att_out[t][head*HD + d].
//
// Invariant: a row's bits do not depend on which unit, or how many rows beside it, merge it. The
// parts are cut into NSL chunks by the row's own part count (per = ceil(nparts / NSL)), each chunk
// summed in part order from 0, then the chunks added in order from 0; the max and the denominator
// by one warp's butterfly. A unit with one row gives each chunk to a slice of HD threads (one per
// d) at once; a unit of several rows gives each row to a slice, which walks the chunks in turn
// into accumulators of their own. Same adds, same order, same bits; the emulation checks it
// (combine_rows = 1 against NSL).
#pragma once
#include "mk/layers.cuh"
#include "ops/attention.cuh"

namespace mk {

MK_DEV void run_attn_combine(Blk& b, int layer, int unit) {
  const Params& p = *b.p;
  constexpr int NSL = COMPUTE_THREADS / HD, NB = 40;
  static_assert(COMPUTE_THREADS % HD == 0 && HD % 32 == 0, "a slice is whole warps");
  static_assert(COMBINE_ROWS == 1 || COMBINE_ROWS == NSL, "a unit's rows: one, or one per slice");
  static_assert((3 * PARTS * COMBINE_ROWS + NSL * HD) * 4 <= ABUF_BYTES, "combine scratch fits abuf");
  const int rows = step_rows(b), nu = cdiv(rows, COMBINE_ROWS);
  const int h = unit / nu, t0 = (unit % nu) * COMBINE_ROWS, nr = COMBINE_ROWS == 1 ? 1 : imin(COMBINE_ROWS, rows - t0);
  const int kvh = h / G, j = h % G;
  const int d = tid() % HD, sl = tid() / HD;
  // the thread's row (of the unit: ri; of the step: t) and the parts it sums: with one row, slice
  // sl's chunk; with several, every part of row sl (a slice past the unit's rows sums nothing)
  const int ri = nr == 1 ? 0 : sl, t = t0 + imin(ri, nr - 1);
  const int nparts = req_splits(b, layer, row_req(b, t)) * ATT_KG, per = cdiv(nparts, NSL);
  const bool live = ri < nr;
  const int q_lo = !live ? 0 : nr == 1 ? imin(nparts, sl * per) : 0;
  const int q_hi = !live ? 0 : nr == 1 ? imin(nparts, q_lo + per) : nparts;
  const size_t row0 = static_cast<size_t>(kvh) * PARTS * (G * 16) + j * 16 + t;
  // A thread's first NB partial rows of O are loaded before anything else: they do not depend on
  // (m, l), so their L2 round trip overlaps the one for (m, l) (one dependent round trip per unit
  // instead of three). One round covers NB of a thread's parts: at NB = 40 a one-row unit takes
  // 80 parts at head_dim 128 in one round (shard8's 65 at ctx 2048), a row of a two-row unit 40.
  // A part past a round costs a whole further round trip; a larger NB holds more unrolled loads
  // (registers and code) for every unit.
  float o[NB];
  // part q's row of O is G * 16 rows after part q - 1's: one 64-bit base per round, constant
  // offsets after it (a 64-bit index per load is ~10 KB of cold code, fetched every layer)
  auto load_o = [&](int q0) {
    const float* base = p.att_o + (row0 + static_cast<size_t>(q0) * (G * 16)) * HD + d;
#pragma unroll
    for (int k = 0; k < NB; ++k) o[k] = k < q_hi - q0 ? ldg_cgf(base + k * (G * 16 * HD)) : 0.f;
  };
  load_o(q_lo);
  float* ml = reinterpret_cast<float*>(b.abuf);      // [COMBINE_ROWS][PARTS] (m, l) of every part
  float* wt = ml + 2 * PARTS * COMBINE_ROWS;         // [COMBINE_ROWS][PARTS] exp(m - M), 0 where nothing visible
  float* part = wt + PARTS * COMBINE_ROWS;           // [NSL][HD] a one-row unit's chunk sums
  if (tid() == 0) b.misc[MISC_TAG] = -1;             // abuf reused as scratch
MK_COLD_LOOP
  for (int i = 0; i < nr; ++i) {
    const int ti = t0 + i, n = req_splits(b, layer, row_req(b, ti)) * ATT_KG;
    const size_t r0 = static_cast<size_t>(kvh) * PARTS * (G * 16) + j * 16 + ti;
MK_COLD_LOOP
    for (int q = tid(); q < n; q += COMPUTE_THREADS) {
      const size_t row = r0 + static_cast<size_t>(q) * (G * 16);
      ml[2 * (i * PARTS + q)] = ldg_cgf(p.att_ml + row * 2);
      ml[2 * (i * PARTS + q) + 1] = ldg_cgf(p.att_ml + row * 2 + 1);
    }
  }
  sync_compute();
  // the max and the denominator over the row's parts, each warp for itself: lanes take every 32nd
  // part, then a butterfly (the max is exact in any order; the sum's order is fixed, so every
  // warp, and chain mode, gets the same bits). Walked by every thread in turn, they would be
  // nparts dependent shared-memory loads on the unit's critical path.
  const float* mlr = ml + 2 * PARTS * ri;
  float* wtr = wt + PARTS * ri;
  float mmax = neg_inf();
MK_COLD_LOOP
  for (int q = lane(); live && q < nparts; q += 32)
    if (mlr[2 * q + 1] > 0.f) mmax = fmax_(mmax, mlr[2 * q]);
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) mmax = fmax_(mmax, shfl_xor(mmax, x));
  // a row's weights are written by the threads that share its max: every thread for one row, the
  // row's slice for several
  const int w0 = nr == 1 ? tid() : d, ws = nr == 1 ? COMPUTE_THREADS : HD;
MK_COLD_LOOP
  for (int q = w0; live && q < nparts; q += ws) wtr[q] = mlr[2 * q + 1] > 0.f ? fexp(mlr[2 * q] - mmax) : 0.f;
  sync_compute();
  float den = 0.f;
MK_COLD_LOOP
  for (int q = lane(); live && q < nparts; q += 32) den += wtr[q] * mlr[2 * q + 1];
#pragma unroll
  for (int x = 16; x > 0; x >>= 1) den += shfl_xor(den, x);
  // chunk c's sum; a one-row unit's thread sums only its own chunk, into acc[0] (a build of
  // one-row units has none of the several-row code)
  float acc[NSL];
#pragma unroll
  for (int c = 0; c < NSL; ++c) acc[c] = 0.f;
  for (int q0 = q_lo; q0 < q_hi; q0 += NB) {
    if (q0 != q_lo) load_o(q0);  // rounds after the first (past NB parts of a thread)
#pragma unroll
    for (int k = 0; k < NB; ++k) {
      const int q = q0 + k;
      if (q >= q_hi) continue;
      if (COMBINE_ROWS == 1 || nr == 1) {
        acc[0] += wtr[q] * o[k];
      } else {
#pragma unroll
        for (int c = 0; c < NSL; ++c)  // chunk c holds q (0 <= q < NSL * per): one compare at NSL = 2
          if ((c == 0 || q >= c * per) && (c == NSL - 1 || q < (c + 1) * per)) acc[c] += wtr[q] * o[k];
      }
    }
  }
  if (nr == 1) {
    part[sl * HD + d] = acc[0];
    sync_compute();
    if (tid() < HD) {
      float s = 0.f;
      for (int k = 0; k < NSL; ++k) s += part[k * HD + tid()];
      p.att_out[t * ATT_W + h * HD + tid()] = f2bf(s / den);
    }
  } else if (live) {
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < NSL; ++c) s += acc[c];
    p.att_out[t * ATT_W + h * HD + d] = f2bf(s / den);
  }
}

}  // namespace mk

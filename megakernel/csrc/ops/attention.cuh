// attention over the KV cache with the tree mask (flash-decoding split). Unit = (kv head, request,
// split): per kv head, each request's splits in request order (attn_unit).
//
// A split scores a contiguous run of its request's key sequence "cached prefix seen, then the T_r
// new tree keys" (already in the request's cache at sequence indices ctx_r..ctx_r+T_r-1); the runs
// have equal length. A request's splits depend on its ctx_r and T_r alone, never on the other
// requests, so its partials, and its bits, are those of the request run alone.
// Query rows are r = j*16 + t: q head kvh*G + j, row t of the step, so each m16 tile of rows is
// one q head over all rows; a unit scores its request's rows only (the others masked, and not
// written: att_o rows of different requests are disjoint).
// Warp w takes head j = w % G and key group kg = w / G (WARPS/G groups split each staged block of
// ATT_KB keys); each (split, key group) holds an unnormalised partial (O, running max m, sum l).
// ATT_PPS = ATT_KG: each is written, and attn_combine merges them in fixed order. ATT_PPS = 1
// (Plan.merge_key_groups): the block merges them first, in key-group order, and writes one per
// split. Masks: a cached key at sequence s is visible to token t in a sliding layer iff
// s >= ctx + depth(t) - W + 1 (global: always); new key i iff i is an ancestor of t or t itself. Scores and softmax in fp32 (scale 1/sqrt(hd)); P is rounded to bf16
// for the tensor-core P*V product (FlashAttention-2 practice).
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

// keys staged per round: ATT_KB (plan.attn_round_keys, 32 where that gives each key group 16)
constexpr int ATT_KG = WARPS / G;           // key groups per block
static_assert(ATT_PPS == 1 || ATT_PPS == ATT_KG, "a split writes one partial, or one per key group");
static_assert(PARTS == MAX_SPLITS * ATT_PPS, "PARTS (plan.attn_parts) counts the partials every split writes");
constexpr int ATT_KPW = ATT_KB / ATT_KG;    // keys per warp per round
constexpr int ATT_KSUB = ATT_KPW < 32 ? ATT_KPW : 32;  // keys per online-softmax update (register budget)
constexpr int ATT_QS = HD * 2 + ROW_PAD;    // smem row strides (bytes)
constexpr int ATT_KS = HD * 2 + ROW_PAD;
static_assert(HD % 16 == 0, "P*V loads two 8-wide d tiles per ldmatrix");
static_assert(ATT_KPW % 16 == 0 && ATT_KPW % ATT_KSUB == 0, "each warp scores whole k16 blocks of keys (G >= 2 with 8 warps)");
static_assert(G * 16 * ATT_QS + 2 * ATT_KB * ATT_KS <= ABUF_BYTES, "attention tiles fit abuf");

// The key groups' merge (ATT_PPS = 1) in abuf: every group's (m, l) of its G heads x 16 rows, then
// groups 1.. ATT_KG-1's scaled O, ATT_MCH 8-column tiles at a time (the most that fit: a chunk
// costs two barriers)
constexpr int ATT_ML_BYTES = ATT_KG * G * 16 * 2 * 4;
__host__ __device__ constexpr int att_merge_chunk() {
  int n = HD / 8;
  while (n > 1 && ATT_ML_BYTES + (ATT_KG - 1) * G * 16 * 8 * n * 4 > ABUF_BYTES) n /= 2;
  return n;
}
constexpr int ATT_MCH = att_merge_chunk();
static_assert(ATT_PPS == ATT_KG || ((HD / 8) % ATT_MCH == 0 &&
              ATT_ML_BYTES + (ATT_KG - 1) * G * 16 * 8 * ATT_MCH * 4 <= ABUF_BYTES), "the key groups' merge fits abuf");

// Unit -> (kv head, request, split): a kv head's units are the requests' splits in request order
// (attn_span; a request's splits are those of its own ctx and rows: req_splits).
struct AttnUnit {
  int kvh, req, split, nsplit;  // nsplit: the request's splits
};
MK_DEV AttnUnit attn_unit(const Blk& b, int layer, int unit) {
  const int span = attn_span(b, layer), last = step_nreq(b) - 1;
  AttnUnit a;
  a.kvh = unit / span;
  a.split = unit % span;
#pragma unroll 1
  for (a.req = 0;; ++a.req) {
    a.nsplit = req_splits(b, layer, a.req);
    if (a.split < a.nsplit || a.req >= last) break;
    a.split -= a.nsplit;
  }
  return a;
}

MK_DEV void run_attn(Blk& b, int layer, int unit) {
  const Params& p = *b.p;
  const AttnUnit au = attn_unit(b, layer, unit);
  const int kvh = au.kvh, split = au.split, nsplit = au.nsplit;
  // the request's rows [t0, t0 + nt) of the step, its cached positions and its caches
  const int ctx = req_ctx(b, au.req), t0 = req_row0(b, au.req), nt = req_rows(b, au.req);
  const uint16_t* k_cache = p.kv[(layer * B_MAX + au.req) * 2];
  const uint16_t* v_cache = p.kv[(layer * B_MAX + au.req) * 2 + 1];
  // this split's run [c0, c1) of the key sequence: the ncached keys seen, then the nt new ones
  const int ncached = cached_keys(layer, ctx), nall = ncached + nt;
  const int per = cdiv(nall, nsplit);
  const int c0 = imin(split * per, nall), c1 = imin(c0 + per, nall);
  const int s0 = ctx - ncached + imin(c0, ncached);                 // first cached sequence index
  const int ncache_keys = imin(c1, ncached) - imin(c0, ncached);  // cached keys in the run
  const int new0 = imax(c0, ncached) - ncached;                     // first new key in the run
  const int total = c1 - c0;
  const bool glob = is_global(layer);

  unsigned char* Qs = b.abuf;
  unsigned char* Ks = Qs + G * 16 * ATT_QS;
  unsigned char* Vs = Ks + ATT_KB * ATT_KS;  // V rows like K: P*V reads them transposed (ldmatrix .trans)
  if (tid() == 0) b.misc[MISC_TAG] = -1;  // abuf no longer holds a GEMM operand
  detail_stamp(b, MK_EV_ATTN_LOAD_BEGIN, 0);  // round 0's load phase includes the Q rows
  {  // Q rows, loads batched (static_assert below: whole rounds per thread)
    constexpr int NQ = G * 16 * (HD / 8) / COMPUTE_THREADS;
    static_assert((G * 16 * (HD / 8)) % COMPUTE_THREADS == 0, "Q staging rounds");
    uint4 v[NQ];
    // i = tid + n * COMPUTE_THREADS: row r = i / (HD / 8) is token tq of q head kvh * G + jq + n *
    // QH, the same token for every n, so one base and constant offsets (a 64-bit address per load
    // would be ~3 KB more code)
    constexpr int QR = COMPUTE_THREADS / (HD / 8), QH = QR / 16;  // rows, q heads per round
    static_assert(COMPUTE_THREADS % (HD / 8) == 0 && QR % 16 == 0, "a Q round is whole q heads of 16 tokens");
    const int tq = (tid() / (HD / 8)) % 16, jq = tid() / (HD / 8) / 16;
    // (a row of another request, or none, is zero: its address is clamped to a real row and not loaded)
    const bool qmine = tq >= t0 && tq < t0 + nt;
    const uint16_t* qb = p.q + (imin(imax(tq, t0), t0 + nt - 1) * HQ + kvh * G + jq) * HD + 8 * (tid() % (HD / 8));
#pragma unroll
    for (int n = 0; n < NQ; ++n) v[n] = qmine ? ldg_cg4(qb + n * QH * HD) : uint4{0, 0, 0, 0};
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
      const int i = tid() + n * COMPUTE_THREADS, r = i / (HD / 8), d8 = i % (HD / 8);
      *reinterpret_cast<uint4*>(Qs + r * ATT_QS + 16 * d8) = v[n];
    }
  }

  const int w = warp(), j = w % G, kg = w / G, g = lane() >> 2, t4 = lane() & 3;
  // the two token rows this thread holds: g and g + 8 (rows of this unit's request only; anc bits
  // count from the request's first row)
  int tok_ok[2], lim[2];
  uint32_t anc[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = g + 8 * h;
    tok_ok[h] = t >= t0 && t < t0 + nt;
    // at L2: a verify tree op writes them, in this launch in "step" programs
    anc[h] = tok_ok[h] ? ldg_cg(p.anc + t) : 0u;
    lim[h] = tok_ok[h] ? ctx + ldg_cgi(p.depth + t) - WINDOW + 1 : 0;  // first visible cached seq (sliding)
  }
  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
  float o[HD / 8][4];
#pragma unroll
  for (int dn = 0; dn < HD / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.f;

  for (int kb0 = 0; kb0 < total; kb0 += ATT_KB) {
    sync_compute();  // Q staged (first round) / everyone done with the previous K, V tiles
    if (kb0) detail_stamp(b, MK_EV_ATTN_LOAD_BEGIN, kb0 / ATT_KB);
    constexpr int NKV = ATT_KB * (HD / 8) / COMPUTE_THREADS;
    static_assert((ATT_KB * (HD / 8)) % COMPUTE_THREADS == 0, "K/V staging rounds");
    uint4 kv[NKV], vv[NKV];
#pragma unroll
    for (int n = 0; n < NKV; ++n) {  // all loads of the round in flight before any store
      const int i = tid() + n * COMPUTE_THREADS, key = i / (HD / 8), d8 = i % (HD / 8), kidx = kb0 + key;
      kv[n] = vv[n] = uint4{0, 0, 0, 0};
      if (kidx < total) {
        const int seq = kidx < ncache_keys ? s0 + kidx : ctx + new0 + (kidx - ncache_keys);
        const size_t off = (static_cast<size_t>(kvh) * cache_slots(layer) + cache_slot(layer, seq)) * HD + 8 * d8;
        kv[n] = ldg_cg4(k_cache + off);
        vv[n] = ldg_cg4(v_cache + off);
      }
    }
#pragma unroll
    for (int n = 0; n < NKV; ++n) {
      const int i = tid() + n * COMPUTE_THREADS, key = i / (HD / 8), d8 = i % (HD / 8);
      *reinterpret_cast<uint4*>(Ks + key * ATT_KS + 16 * d8) = kv[n];
      *reinterpret_cast<uint4*>(Vs + key * ATT_KS + 16 * d8) = vv[n];
    }
    sync_compute();
    detail_stamp(b, MK_EV_ATTN_LOAD_END, kb0 / ATT_KB);

    // rolled: the sub-blocks share one copy of the score / softmax / P*V code, fetched cold once
    // a layer. The k-loop of the scores inside stays unrolled: its mma chain is latency-bound,
    // so its code is short and a rolled copy saves next to no fetch.
MK_COLD_LOOP
    for (int sub = 0; sub < ATT_KPW / ATT_KSUB; ++sub) {
      const int kw0 = kg * ATT_KPW + sub * ATT_KSUB;
      // a sub-block past the split's run: every score masked, so alpha = 1 and p = 0, a no-op on
      // (m, l, o) bitwise; skipped, it is what makes 32-key splits pay (Plan.keys_per_split)
      if (kb0 + kw0 >= total) break;
      float s[ATT_KSUB / 8][4];
#pragma unroll
      for (int nt = 0; nt < ATT_KSUB / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < HD / 16; ++ks) {
        uint32_t a[4];
        const unsigned char* q0 = Qs + (j * 16 + g) * ATT_QS + (ks * 16 + 2 * t4) * 2;
        a[0] = *reinterpret_cast<const uint32_t*>(q0);
        a[1] = *reinterpret_cast<const uint32_t*>(q0 + 8 * ATT_QS);
        a[2] = *reinterpret_cast<const uint32_t*>(q0 + 16);
        a[3] = *reinterpret_cast<const uint32_t*>(q0 + 8 * ATT_QS + 16);
#pragma unroll
        for (int nt = 0; nt < ATT_KSUB / 8; ++nt) {
          const unsigned char* k0 = Ks + (kw0 + nt * 8 + g) * ATT_KS + (ks * 16 + 2 * t4) * 2;
          const uint32_t bb[2] = {*reinterpret_cast<const uint32_t*>(k0), *reinterpret_cast<const uint32_t*>(k0 + 16)};
          mma(s[nt], a, bb);
        }
      }
      // scale, mask, online softmax (rows g and g+8; a row's 8 keys of a tile live in one quad)
      float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int nt = 0; nt < ATT_KSUB / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          const int kidx = kb0 + kw0 + nt * 8 + 2 * t4 + (e & 1);
          bool vis = tok_ok[h] && kidx < total;
          if (vis) {
            if (kidx < ncache_keys) vis = glob || (s0 + kidx >= lim[h]);
            else vis = (anc[h] >> (new0 + kidx - ncache_keys)) & 1u;
          }
          s[nt][e] = vis ? s[nt][e] * ATT_SCALE : neg_inf();
          mx[h] = fmax_(mx[h], s[nt][e]);
        }
      float alpha[2], muse[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmax_(mx[h], shfl_xor(mx[h], 1));
        mx[h] = fmax_(mx[h], shfl_xor(mx[h], 2));
        const float mnew = fmax_(m[h], mx[h]);
        muse[h] = mnew == neg_inf() ? 0.f : mnew;  // nothing visible yet: keep p = 0, no NaN
        alpha[h] = fexp(m[h] - muse[h]);
        m[h] = mnew;
      }
      float rs[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < ATT_KSUB / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1;
          s[nt][e] = fexp(s[nt][e] - muse[h]);
          rs[h] += s[nt][e];
        }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        rs[h] += shfl_xor(rs[h], 1);
        rs[h] += shfl_xor(rs[h], 2);
        l[h] = l[h] * alpha[h] + rs[h];
      }
#pragma unroll
      for (int dn = 0; dn < HD / 8; ++dn) {
        o[dn][0] *= alpha[0];
        o[dn][1] *= alpha[0];
        o[dn][2] *= alpha[1];
        o[dn][3] *= alpha[1];
      }
#pragma unroll
      for (int kk = 0; kk < ATT_KSUB / 16; ++kk) {
        const uint32_t a[4] = {pack_bf2(s[2 * kk][0], s[2 * kk][1]), pack_bf2(s[2 * kk][2], s[2 * kk][3]),
                               pack_bf2(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_bf2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
        // B fragments of two 8-wide d tiles at once: matrix m of the x4 = keys +8*(m&1), d tile +(m>>1)
        const int vkey = kw0 + kk * 16 + 8 * ((lane() >> 3) & 1) + (lane() & 7);
        const SAddr vrow = saddr(Vs + vkey * ATT_KS + 16 * (lane() >> 4));
#pragma unroll
        for (int dn = 0; dn < HD / 8; dn += 2) {
          uint32_t v4[4];
          ldsm_x4_trans(v4, vrow + dn * 16);
          const uint32_t b0[2] = {v4[0], v4[1]}, b1[2] = {v4[2], v4[3]};
          mma(o[dn], a, b0);
          mma(o[dn + 1], a, b1);
        }
      }
    }  // sub-block
  }

  if constexpr (ATT_PPS == 1 && ATT_KG > 1) {
    // merge the key groups' partials of each (head j, row): M = max of their m, each scaled by
    // a_k = exp(m_k - M), O = ((a_0 O_0 + a_1 O_1) + a_2 O_2) + ..., l likewise, in key-group
    // order. Every warp computes the same (M, a_k, l) from the shared (m, l); group 0 sums the O
    // and writes. A group with nothing visible has m = -inf, l = 0 and O = 0: a_k = 0.
    float* msh = reinterpret_cast<float*>(b.abuf);            // [ATT_KG][G][16][2]
    float* osh = msh + ATT_KG * G * 16 * 2;                     // [ATT_KG - 1][G][16][ATT_MCH * 8]
    sync_compute();  // every warp is done with the Q, K and V tiles that abuf held
    if (t4 == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* e = msh + ((kg * G + j) * 16 + g + 8 * h) * 2;
        e[0] = m[h];
        e[1] = l[h];
      }
    }
    sync_compute();
    float a_mine[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float* e = msh + (j * 16 + g + 8 * h) * 2;  // key group k's entry: e + k * G * 32
      float mm = neg_inf();
#pragma unroll
      for (int k = 0; k < ATT_KG; ++k) mm = fmax_(mm, e[k * G * 32]);
      const float muse = mm == neg_inf() ? 0.f : mm;
      float ls = 0.f;
#pragma unroll
      for (int k = 0; k < ATT_KG; ++k) {
        const float a = fexp(e[k * G * 32] - muse);
        ls += e[k * G * 32 + 1] * a;
        if (k == kg) a_mine[h] = a;
      }
      m[h] = mm;
      l[h] = ls;
    }
    constexpr int CW = ATT_MCH * 8;  // columns of a chunk
#pragma unroll
    for (int c0 = 0; c0 < HD / 8; c0 += ATT_MCH) {
      if (kg > 0) {
#pragma unroll
        for (int dn = c0; dn < c0 + ATT_MCH; ++dn)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            *reinterpret_cast<float2*>(osh + (((kg - 1) * G + j) * 16 + g + 8 * h) * CW + (dn - c0) * 8 + 2 * t4) =
                float2{o[dn][2 * h] * a_mine[h], o[dn][2 * h + 1] * a_mine[h]};
      }
      sync_compute();
      if (kg == 0) {
#pragma unroll
        for (int dn = c0; dn < c0 + ATT_MCH; ++dn)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float s0 = o[dn][2 * h] * a_mine[h], s1 = o[dn][2 * h + 1] * a_mine[h];
#pragma unroll
            for (int k = 1; k < ATT_KG; ++k) {
              const float2 v = *reinterpret_cast<const float2*>(
                  osh + (((k - 1) * G + j) * 16 + g + 8 * h) * CW + (dn - c0) * 8 + 2 * t4);
              s0 += v.x;
              s1 += v.y;
            }
            o[dn][2 * h] = s0;
            o[dn][2 * h + 1] = s1;
          }
      }
      sync_compute();  // the chunk's scratch is read before the next chunk overwrites it
    }
    if (kg > 0) return;  // group 0 writes the split's one partial
  }

  // the partial of (split, key group), or of the split (merged): unnormalised O, running max, running sum
  const int part = ATT_PPS == ATT_KG ? split * ATT_KG + kg : split;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = g + 8 * h;
    if (!tok_ok[h]) continue;
    const size_t row = (static_cast<size_t>(kvh) * PARTS + part) * (G * 16) + j * 16 + t;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) {
      // one 8-byte store per pair: two 4-byte stores fill the LSU queue
      *reinterpret_cast<float2*>(p.att_o + row * HD + dn * 8 + 2 * t4) = float2{o[dn][2 * h], o[dn][2 * h + 1]};
    }
    if (t4 == 0) {
      p.att_ml[row * 2] = m[h];
      p.att_ml[row * 2 + 1] = l[h];
    }
  }
}

}  // namespace mk

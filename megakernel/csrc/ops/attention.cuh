// attention over the KV cache with the tree mask (flash-decoding split). Unit = (kv head, split).
//
// A split scores a contiguous run of the key sequence "cached prefix seen, then the T new tree
// keys" (already in the cache at sequence indices ctx..ctx+T-1); the runs have equal length.
// Query rows are r = j*16 + t: q head kvh*G + j, token t, so each m16 tile of rows is one q head
// over all tokens. Warp w takes head j = w % G and key group kg = w / G (WARPS/G groups split
// each staged block of ATT_KB keys); each (split, key group) writes an unnormalised partial (O, running max m, sum l) that
// attn_combine merges in fixed order. Masks: a cached key at sequence s is visible to token t
// in a sliding layer iff s >= ctx + depth(t) - W + 1 (global: always); new key i iff i is an
// ancestor of t or t itself. Scores and softmax in fp32 (scale 1/sqrt(hd)); P is rounded to bf16
// for the tensor-core P*V product (FlashAttention-2 practice).
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

// keys staged per round: ATT_KB (plan.attn_round_keys, 32 where that gives each key group 16)
constexpr int ATT_KG = WARPS / G;           // key groups per block
static_assert(PARTS == MAX_SPLITS * ATT_KG, "PARTS (plan.attn_parts) counts a partial per split and key group");
constexpr int ATT_KPW = ATT_KB / ATT_KG;    // keys per warp per round
constexpr int ATT_KSUB = ATT_KPW < 32 ? ATT_KPW : 32;  // keys per online-softmax update (register budget)
constexpr int ATT_QS = HD * 2 + ROW_PAD;    // smem row strides (bytes)
constexpr int ATT_KS = HD * 2 + ROW_PAD;
static_assert(HD % 16 == 0, "P*V loads two 8-wide d tiles per ldmatrix");
static_assert(ATT_KPW % 16 == 0 && ATT_KPW % ATT_KSUB == 0, "each warp scores whole k16 blocks of keys (G >= 2 with 8 warps)");
static_assert(G * 16 * ATT_QS + 2 * ATT_KB * ATT_KS <= ABUF_BYTES, "attention tiles fit abuf");

MK_DEV void run_attn(Blk& b, int layer, int unit) {
  const Params& p = *b.p;
  const LayerPtrs& L = p.layers[layer];
  const int nsplit = attn_splits(layer, b.ctx, b.T);
  const int kvh = unit / nsplit, split = unit % nsplit;
  // this split's run [c0, c1) of the key sequence: the ncached keys seen, then the T new ones
  const int ncached = cached_keys(layer, b.ctx), nall = ncached + b.T;
  const int per = cdiv(nall, nsplit);
  const int c0 = imin(split * per, nall), c1 = imin(c0 + per, nall);
  const int s0 = b.ctx - ncached + imin(c0, ncached);               // first cached sequence index
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
    // was 3 KB of code)
    constexpr int QR = COMPUTE_THREADS / (HD / 8), QH = QR / 16;  // rows, q heads per round
    static_assert(COMPUTE_THREADS % (HD / 8) == 0 && QR % 16 == 0, "a Q round is whole q heads of 16 tokens");
    const int tq = (tid() / (HD / 8)) % 16, jq = tid() / (HD / 8) / 16;
    // (an absent token's address is clamped to a real row and not loaded)
    const uint16_t* qb = p.q + (imin(tq, b.T - 1) * HQ + kvh * G + jq) * HD + 8 * (tid() % (HD / 8));
#pragma unroll
    for (int n = 0; n < NQ; ++n) v[n] = tq < b.T ? ldg_cg4(qb + n * QH * HD) : uint4{0, 0, 0, 0};
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
      const int i = tid() + n * COMPUTE_THREADS, r = i / (HD / 8), d8 = i % (HD / 8);
      *reinterpret_cast<uint4*>(Qs + r * ATT_QS + 16 * d8) = v[n];
    }
  }

  const int w = warp(), j = w % G, kg = w / G, g = lane() >> 2, t4 = lane() & 3;
  // the two token rows this thread holds: g and g + 8
  int tok_ok[2], lim[2];
  uint32_t anc[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = g + 8 * h;
    tok_ok[h] = t < b.T;
    anc[h] = tok_ok[h] ? p.anc[t] : 0u;
    lim[h] = tok_ok[h] ? b.ctx + p.depth[t] - WINDOW + 1 : 0;  // first visible cached seq (sliding)
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
        const int seq = kidx < ncache_keys ? s0 + kidx : b.ctx + new0 + (kidx - ncache_keys);
        const size_t off = (static_cast<size_t>(kvh) * cache_slots(layer) + cache_slot(layer, seq)) * HD + 8 * d8;
        kv[n] = ldg_cg4(L.k_cache + off);
        vv[n] = ldg_cg4(L.v_cache + off);
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
    // a layer (with the Q loads' constant offsets above: shard8 T=16 -0.43%, T=1 -0.82%, small
    // T=16 -0.30%, same bits, in-run A/B, H200 2026-11-30 10:19Z; rolling the k-loop of the
    // scores too gave +0.10 / -0.53 / -0.01%: its mma chain is latency-bound)
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

  // partial result of (split, key group): unnormalised O, running max, running sum
  const int part = split * ATT_KG + kg;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int t = g + 8 * h;
    if (t >= b.T) continue;
    const size_t row = (static_cast<size_t>(kvh) * PARTS + part) * (G * 16) + j * 16 + t;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) {
      // one 8-byte store per pair (two 4-byte stores filled the LSU queue: "lg" stalls, ncu)
      *reinterpret_cast<float2*>(p.att_o + row * HD + dn * 8 + 2 * t4) = float2{o[dn][2 * h], o[dn][2 * h + 1]};
    }
    if (t4 == 0) {
      p.att_ml[row * 2] = m[h];
      p.att_ml[row * 2 + 1] = l[h];
    }
  }
}

// ---------------------------------------------------------------- Plan.attn_heads
// Unit = (q head h, split s): the head's 16 token rows over one run of the key sequence (the runs
// are run_attn's, per q head: attn_splits). Each round stages ATTN_HEAD_KEYS keys (K and V) and
// every compute warp scores one n8 tile of them for all 16 rows. The round's row maxima and row
// sums go through shared memory and are combined in warp order, so every warp holds the same
// running (m, l); P goes to shared memory as bf16 and warp w multiplies it by its own HD / WARPS
// columns of V. No warp's output meets another's, so the unit's partial (unnormalised O, m, l)
// needs no merge inside the block. The next round's K/V loads are in flight while a round is
// computed. Then the unit takes a ticket on its head's counter (fence, relaxed add: a release
// pattern); the unit that takes the last one (fence after: an acquire pattern) merges the head's
// partials in split order, writes the head's att_out rows and resets the ticket for the next
// step (chain mode clears no counters). Its block's op-end release (program.cuh signal_op_end)
// covers att_out: oproj waits for every attention unit, so the attn_combine op and its hop go.
constexpr int AH_KB = ATTN_HEAD_KEYS;
static_assert(AH_KB == 8 * WARPS, "a round is one n8 tile of keys per compute warp");
constexpr int AH_DT = HD / 8 / WARPS;  // 8-wide d tiles of P*V per warp
static_assert(HD % (8 * WARPS) == 0 && (AH_DT == 1 || AH_DT == 2), "whole d tiles per warp, one ldmatrix a k16 step");
constexpr int AH_RS = HD * 2 + ROW_PAD;     // Q, K and V rows in shared memory (bytes)
constexpr int AH_PS = AH_KB * 2 + ROW_PAD;  // P rows (bf16)
constexpr int AH_NKV = AH_KB * (HD / 8) / COMPUTE_THREADS;  // 16-byte K (and V) pieces per thread a round
static_assert(AH_KB * (HD / 8) % COMPUTE_THREADS == 0 && 16 * (HD / 8) <= COMPUTE_THREADS, "staging rounds");
constexpr int AH_SMEM = 16 * AH_RS + 2 * AH_KB * AH_RS + 16 * AH_PS + 2 * WARPS * 16 * 4 + 16;
static_assert(!ATTN_HEADS || AH_SMEM <= ABUF_BYTES, "attention by q head fits abuf (plan.attn_smem_bytes)");
constexpr int AH_MB = 8;  // splits whose O rows the merge loads at a time

// Round r's K and V pieces of the unit's run (zeros past it): piece tid + n * COMPUTE_THREADS.
MK_DEV void ah_load(const LayerPtrs& L, int layer, int kvh, int ctx, int kb0, int total, int ncache_keys, int s0,
                    int new0, uint4 (&kv)[AH_NKV], uint4 (&vv)[AH_NKV]) {
#pragma unroll
  for (int n = 0; n < AH_NKV; ++n) {
    const int i = tid() + n * COMPUTE_THREADS, kidx = kb0 + i / (HD / 8), d8 = i % (HD / 8);
    kv[n] = vv[n] = uint4{0, 0, 0, 0};
    if (kidx < total) {
      const int seq = kidx < ncache_keys ? s0 + kidx : ctx + new0 + (kidx - ncache_keys);
      const size_t off = (static_cast<size_t>(kvh) * cache_slots(layer) + cache_slot(layer, seq)) * HD + 8 * d8;
      kv[n] = ldg_cg4(L.k_cache + off);
      vv[n] = ldg_cg4(L.v_cache + off);
    }
  }
}

// The last unit of head h: att_out[t][h * HD ..] = sum_s w_s O_s / sum_s w_s l_s, w_s = exp(m_s - M)
// over the splits with a visible key (l_s > 0), in split order. Thread (row, 8 columns).
MK_DEV void ah_merge(const Blk& b, int h, int nsplit) {
  const Params& p = *b.p;
  constexpr int NR = HD / 8;
  const int r = tid() / NR, d8 = tid() % NR;
  if (r >= b.T) return;  // rows past the step's tokens (and threads past 16 rows)
  const size_t row0 = static_cast<size_t>(h) * HEAD_SPLITS * 16 + r;  // split s: row0 + 16 s
  float mm[HEAD_SPLITS], ll[HEAD_SPLITS];
  float4 ov[AH_MB][2];
  auto load_o = [&](int s0) {
#pragma unroll
    for (int k = 0; k < AH_MB; ++k) {
      const float* src = p.att_o + (row0 + 16 * static_cast<size_t>(s0 + k)) * HD + 8 * d8;
      const bool in = s0 + k < nsplit;
      const uint4 a = in ? ldg_cg4(src) : uint4{0, 0, 0, 0}, c = in ? ldg_cg4(src + 4) : uint4{0, 0, 0, 0};
      ov[k][0] = float4{u2f(a.x), u2f(a.y), u2f(a.z), u2f(a.w)};
      ov[k][1] = float4{u2f(c.x), u2f(c.y), u2f(c.z), u2f(c.w)};
    }
  };
#pragma unroll
  for (int s = 0; s < HEAD_SPLITS; ++s) {
    mm[s] = s < nsplit ? ldg_cgf(p.att_ml + (row0 + 16 * s) * 2) : neg_inf();
    ll[s] = s < nsplit ? ldg_cgf(p.att_ml + (row0 + 16 * s) * 2 + 1) : 0.f;
  }
  load_o(0);  // independent of (m, l): in flight with them
  float mx = neg_inf();
#pragma unroll
  for (int s = 0; s < HEAD_SPLITS; ++s)
    if (ll[s] > 0.f) mx = fmax_(mx, mm[s]);
  float den = 0.f;
#pragma unroll
  for (int s = 0; s < HEAD_SPLITS; ++s) {
    mm[s] = ll[s] > 0.f ? fexp(mm[s] - mx) : 0.f;  // the split's weight
    den += mm[s] * ll[s];
  }
  float num[8] = {};
  for (int s0 = 0; s0 < nsplit; s0 += AH_MB) {
    if (s0) load_o(s0);
#pragma unroll
    for (int k = 0; k < AH_MB; ++k) {
      float ws = 0.f;
#pragma unroll
      for (int s = 0; s < HEAD_SPLITS; ++s)  // constant indices: mm stays in registers
        if (s == s0 + k) ws = mm[s];
      num[0] += ws * ov[k][0].x, num[1] += ws * ov[k][0].y, num[2] += ws * ov[k][0].z, num[3] += ws * ov[k][0].w;
      num[4] += ws * ov[k][1].x, num[5] += ws * ov[k][1].y, num[6] += ws * ov[k][1].z, num[7] += ws * ov[k][1].w;
    }
  }
  uint4 out;
  out.x = pack_bf2(num[0] / den, num[1] / den), out.y = pack_bf2(num[2] / den, num[3] / den);
  out.z = pack_bf2(num[4] / den, num[5] / den), out.w = pack_bf2(num[6] / den, num[7] / den);
  *reinterpret_cast<uint4*>(p.att_out + r * ATT_W + h * HD + 8 * d8) = out;
}

MK_DEV void run_attn_head(Blk& b, int layer, int unit, uint32_t* tickets) {
  const Params& p = *b.p;
  const LayerPtrs& L = p.layers[layer];
  const int nsplit = attn_splits(layer, b.ctx, b.T);
  const int h = unit / nsplit, split = unit % nsplit, kvh = h / G;
  const int ncached = cached_keys(layer, b.ctx), nall = ncached + b.T;
  const int per = cdiv(nall, nsplit);
  const int c0 = imin(split * per, nall), c1 = imin(c0 + per, nall);
  const int s0 = b.ctx - ncached + imin(c0, ncached);
  const int ncache_keys = imin(c1, ncached) - imin(c0, ncached);
  const int new0 = imax(c0, ncached) - ncached;
  const int total = c1 - c0, rounds = cdiv(total, AH_KB);
  const bool glob = is_global(layer);

  unsigned char* Qs = b.abuf;
  unsigned char* Ks = Qs + 16 * AH_RS;
  unsigned char* Vs = Ks + AH_KB * AH_RS;
  unsigned char* Ps = Vs + AH_KB * AH_RS;
  float* rmax = reinterpret_cast<float*>(Ps + 16 * AH_PS);  // [WARPS][16] a round's row maxima per warp
  float* rsum = rmax + WARPS * 16;                          // [WARPS][16] its row sums
  int* last = reinterpret_cast<int*>(rsum + WARPS * 16);
  if (tid() == 0) b.misc[MISC_TAG] = -1;  // abuf no longer holds a GEMM operand
  detail_stamp(b, MK_EV_ATTN_LOAD_BEGIN, 0);
  uint4 qv = uint4{0, 0, 0, 0};
  {
    const int t = tid() / (HD / 8);
    if (tid() < 16 * (HD / 8) && t < b.T) qv = ldg_cg4(p.q + (t * HQ + h) * HD + 8 * (tid() % (HD / 8)));
  }
  uint4 kv[AH_NKV], vv[AH_NKV];
  ah_load(L, layer, kvh, b.ctx, 0, total, ncache_keys, s0, new0, kv, vv);
  if (tid() < 16 * (HD / 8))
    *reinterpret_cast<uint4*>(Qs + (tid() / (HD / 8)) * AH_RS + 16 * (tid() % (HD / 8))) = qv;

  const int w = warp(), g = lane() >> 2, t4 = lane() & 3;
  int tok_ok[2], lim[2];
  uint32_t anc[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int t = g + 8 * hh;
    tok_ok[hh] = t < b.T;
    anc[hh] = tok_ok[hh] ? p.anc[t] : 0u;
    lim[hh] = tok_ok[hh] ? b.ctx + p.depth[t] - WINDOW + 1 : 0;
  }
  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};
  float o[AH_DT][4] = {};
  uint32_t qa[HD / 16][4];
  // this lane's ldmatrix rows: P (A, rows 0-15 at key 0, then at key 8) and V (B, transposed:
  // keys +8 (m & 1), d tile +(m >> 1) of the warp's own columns)
  const SAddr prow = saddr(Ps + (lane() & 15) * AH_PS + 16 * (lane() >> 4));
  const SAddr vrow = saddr(Vs + (8 * ((lane() >> 3) & 1) + (lane() & 7)) * AH_RS +
                           16 * (w * AH_DT + ((lane() >> 4) & (AH_DT - 1))));
MK_COLD_LOOP
  for (int r = 0; r < rounds; ++r) {
    const int kb0 = r * AH_KB;
    sync_compute();  // Q stored (first round) / every warp done with the last round's K, V, P and stats
#pragma unroll
    for (int n = 0; n < AH_NKV; ++n) {
      const int i = tid() + n * COMPUTE_THREADS, key = i / (HD / 8), d8 = i % (HD / 8);
      *reinterpret_cast<uint4*>(Ks + key * AH_RS + 16 * d8) = kv[n];
      *reinterpret_cast<uint4*>(Vs + key * AH_RS + 16 * d8) = vv[n];
    }
    if (r + 1 < rounds) ah_load(L, layer, kvh, b.ctx, kb0 + AH_KB, total, ncache_keys, s0, new0, kv, vv);
    sync_compute();
    if (r == 0) {
      detail_stamp(b, MK_EV_ATTN_LOAD_END, 0);
#pragma unroll
      for (int ks = 0; ks < HD / 16; ++ks) {
        const unsigned char* q0 = Qs + g * AH_RS + (ks * 16 + 2 * t4) * 2;
        qa[ks][0] = *reinterpret_cast<const uint32_t*>(q0);
        qa[ks][1] = *reinterpret_cast<const uint32_t*>(q0 + 8 * AH_RS);
        qa[ks][2] = *reinterpret_cast<const uint32_t*>(q0 + 16);
        qa[ks][3] = *reinterpret_cast<const uint32_t*>(q0 + 8 * AH_RS + 16);
      }
    }
    // scores of this warp's 8 keys (C fragment: rows g, g + 8 x keys 2 t4, 2 t4 + 1)
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < HD / 16; ++ks) {
      const unsigned char* k0 = Ks + (w * 8 + g) * AH_RS + (ks * 16 + 2 * t4) * 2;
      const uint32_t bb[2] = {*reinterpret_cast<const uint32_t*>(k0), *reinterpret_cast<const uint32_t*>(k0 + 16)};
      mma(s, qa[ks], bb);
    }
    float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int hh = e >> 1, kidx = kb0 + w * 8 + 2 * t4 + (e & 1);
      bool vis = tok_ok[hh] && kidx < total;
      if (vis) {
        if (kidx < ncache_keys) vis = glob || (s0 + kidx >= lim[hh]);
        else vis = (anc[hh] >> (new0 + kidx - ncache_keys)) & 1u;
      }
      s[e] = vis ? s[e] * ATT_SCALE : neg_inf();
      mx[hh] = fmax_(mx[hh], s[e]);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      mx[hh] = fmax_(mx[hh], shfl_xor(mx[hh], 1));
      mx[hh] = fmax_(mx[hh], shfl_xor(mx[hh], 2));
    }
    if (t4 == 0) rmax[w * 16 + g] = mx[0], rmax[w * 16 + g + 8] = mx[1];
    sync_compute();
    float alpha[2], muse[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float rm = neg_inf();
#pragma unroll
      for (int v = 0; v < WARPS; ++v) rm = fmax_(rm, rmax[v * 16 + g + 8 * hh]);
      const float mnew = fmax_(m[hh], rm);
      muse[hh] = mnew == neg_inf() ? 0.f : mnew;  // nothing visible yet: keep p = 0, no NaN
      alpha[hh] = fexp(m[hh] - muse[hh]);
      m[hh] = mnew;
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[e] = fexp(s[e] - muse[e >> 1]);
      rs[e >> 1] += s[e];
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      rs[hh] += shfl_xor(rs[hh], 1);
      rs[hh] += shfl_xor(rs[hh], 2);
    }
    if (t4 == 0) rsum[w * 16 + g] = rs[0], rsum[w * 16 + g + 8] = rs[1];
    *reinterpret_cast<uint32_t*>(Ps + g * AH_PS + (w * 8 + 2 * t4) * 2) = pack_bf2(s[0], s[1]);
    *reinterpret_cast<uint32_t*>(Ps + (g + 8) * AH_PS + (w * 8 + 2 * t4) * 2) = pack_bf2(s[2], s[3]);
    sync_compute();
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float sum = 0.f;
#pragma unroll
      for (int v = 0; v < WARPS; ++v) sum += rsum[v * 16 + g + 8 * hh];  // warp order: the same l in every warp
      l[hh] = l[hh] * alpha[hh] + sum;
    }
#pragma unroll
    for (int dt = 0; dt < AH_DT; ++dt) {
      o[dt][0] *= alpha[0], o[dt][1] *= alpha[0];
      o[dt][2] *= alpha[1], o[dt][3] *= alpha[1];
    }
#pragma unroll
    for (int kk = 0; kk < AH_KB / 16; ++kk) {
      uint32_t pa[4], v4[4];
      ldsm_x4(pa, prow + kk * 32);
      ldsm_x4_trans(v4, vrow + kk * 16 * AH_RS);
      const uint32_t b0[2] = {v4[0], v4[1]};
      mma(o[0], pa, b0);
      if constexpr (AH_DT == 2) {
        const uint32_t b1[2] = {v4[2], v4[3]};
        mma(o[AH_DT - 1], pa, b1);
      }
    }
  }

  // the unit's partial: rows (h * HEAD_SPLITS + split) * 16 + t of att_o / att_ml
  const size_t row0 = (static_cast<size_t>(h) * HEAD_SPLITS + split) * 16;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int t = g + 8 * hh;
    if (t >= b.T) continue;
#pragma unroll
    for (int dt = 0; dt < AH_DT; ++dt)
      *reinterpret_cast<float2*>(p.att_o + (row0 + t) * HD + (w * AH_DT + dt) * 8 + 2 * t4) =
          float2{o[dt][2 * hh], o[dt][2 * hh + 1]};
    if (w == 0 && t4 == 0) {
      p.att_ml[(row0 + t) * 2] = m[hh];
      p.att_ml[(row0 + t) * 2 + 1] = l[hh];
    }
  }
  sync_compute();  // every thread's partial stores, before thread 0's release pattern
  if (tid() == 0) {
    fence_release();
    const bool fin = atom_add_relaxed(tickets + h, 1u) + 1u == static_cast<uint32_t>(nsplit);
    if (fin) {  // every split of head h is published: reset the ticket, then acquire the partials
      st_relaxed(tickets + h, 0u);
      fence_release();
    }
    *last = fin;
  }
  sync_compute();
  if (*last) ah_merge(b, h, nsplit);
}

}  // namespace mk

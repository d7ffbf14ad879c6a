// The tensor-core GEMM machinery every projection shares: activation staging into `abuf`,
// weight chunks streamed through the ring (producer side for the loader warp, consumer side for
// the compute warps), and a fixed-order reduction of the warps' partial tiles.
//
// Shapes. A GEMM unit computes a [16 tokens x ROWS features] tile over all of K with
// mma.m16n8k16 (A = activations, 16 token rows; B = weights, 8 feature rows x 16 k). Warp w
// owns the 8-feature tile w % (ROWS/8) and every (WARPS/(ROWS/8))-th k-step of each chunk; the
// partial tiles are summed in warp order afterwards, so the result does not depend on timing
// (chain and mega modes are bitwise equal).
//
// NVFP4 (expert GEMMs). Thread t of a quad loads one u32 of codes = 8 consecutive E2M1 values
// k..k+7 (one 16-wide scale block) and feeds them to two mmas as the pairs (k+i, k+i+4): the
// k order inside each mma is permuted, which is harmless as long as A is permuted the same way,
// so the activation rows of the fp4 GEMMs are staged as [e0,e4,e1,e5,e2,e6,e3,e7] per 8 values.
// Dequantisation is exact: the 3 magnitude bits go to bf16 bits 8..6 (value * 2^-126, a
// subnormal when the exponent is 0), one bf16 multiply by 2^126 makes the true value, a second
// multiplies by the E4M3 block scale (the product has <= 6 significant bits: exact in bf16).
#pragma once
#include "mk/block.cuh"

namespace mk {

template <int K>
MK_DEV constexpr int a_stride() {
  return K * 2 + ROW_PAD;
}

// ---------------------------------------------------------------- activation staging
// bf16(x * rsqrt(mean(x^2) + eps) * g) for token rows < T; rows >= T are zero.
template <int K>
MK_DEV void stage_norm(Blk& b, const float* x, const uint16_t* gain, int tag) {
  static_assert(K % 128 == 0, "norm staging reads float4 per lane");
  if (b.misc[MISC_TAG] == tag) return;
  for (int t = warp(); t < 16; t += WARPS) {
    unsigned char* row = b.abuf + t * a_stride<K>();
    if (t < b.T) {
      const float* xr = x + t * D;
      float ss = 0.f;
      for (int k4 = lane(); k4 < K / 4; k4 += 32) {
        const uint4 v = ldg_cg4(xr + 4 * k4);
        const float a0 = u2f(v.x), a1 = u2f(v.y), a2 = u2f(v.z), a3 = u2f(v.w);
        ss += a0 * a0 + a1 * a1 + a2 * a2 + a3 * a3;
      }
      for (int m = 16; m >= 1; m >>= 1) ss += shfl_xor(ss, m);
      const float r = frsqrt(ss / static_cast<float>(K) + RMS_EPS);
      for (int k4 = lane(); k4 < K / 4; k4 += 32) {
        const uint4 v = ldg_cg4(xr + 4 * k4);
        const uint2 gg = *reinterpret_cast<const uint2*>(gain + 4 * k4);
        uint2 o;
        o.x = pack_bf2((u2f(v.x) * r) * bf2f(gg.x & 0xffff), (u2f(v.y) * r) * bf2f(gg.x >> 16));
        o.y = pack_bf2((u2f(v.z) * r) * bf2f(gg.y & 0xffff), (u2f(v.w) * r) * bf2f(gg.y >> 16));
        *reinterpret_cast<uint2*>(row + 8 * k4) = o;
      }
    } else {
      for (int k8 = lane(); k8 < K / 8; k8 += 32) *reinterpret_cast<uint4*>(row + 16 * k8) = uint4{0, 0, 0, 0};
    }
  }
  sync_compute();
  if (tid() == 0) b.misc[MISC_TAG] = tag;
}

// Plain copy of bf16 rows (another block's output: read at L2).
template <int K>
MK_DEV void stage_plain(Blk& b, const uint16_t* src, int tag) {
  if (b.misc[MISC_TAG] == tag) return;
  for (int i = tid(); i < 16 * (K / 8); i += COMPUTE_THREADS) {
    const int t = i / (K / 8), k8 = i % (K / 8);
    uint4 v = uint4{0, 0, 0, 0};
    if (t < b.T) v = ldg_cg4(src + t * K + 8 * k8);
    *reinterpret_cast<uint4*>(b.abuf + t * a_stride<K>() + 16 * k8) = v;
  }
  sync_compute();
  if (tid() == 0) b.misc[MISC_TAG] = tag;
}

// Expert operand: `nrows` rows gathered from src (row i = src + rowidx(i) * K), permuted in
// groups of 8 for the fp4 fragment order; rows >= nrows are zero.
template <int K, typename RowIdx>
MK_DEV void stage_gather_perm(Blk& b, const uint16_t* src, int nrows, RowIdx rowidx, int tag) {
  if (b.misc[MISC_TAG] == tag) return;
  for (int i = tid(); i < 16 * (K / 8); i += COMPUTE_THREADS) {
    const int r = i / (K / 8), k8 = i % (K / 8);
    uint4 o = uint4{0, 0, 0, 0};
    if (r < nrows) {
      const uint4 v = ldg_cg4(src + static_cast<size_t>(rowidx(r)) * K + 8 * k8);
      // v = (e0,e1)(e2,e3)(e4,e5)(e6,e7) -> (e0,e4)(e1,e5)(e2,e6)(e3,e7)
      o.x = (v.x & 0xffffu) | (v.z << 16);
      o.y = (v.x >> 16) | (v.z & 0xffff0000u);
      o.z = (v.y & 0xffffu) | (v.w << 16);
      o.w = (v.y >> 16) | (v.w & 0xffff0000u);
    }
    *reinterpret_cast<uint4*>(b.abuf + r * a_stride<K>() + 16 * k8) = o;
  }
  sync_compute();
  if (tid() == 0) b.misc[MISC_TAG] = tag;
}

// ---------------------------------------------------------------- consumer: bf16 weights
template <int ROWS, int KC, int K>
MK_DEV void gemm_bf16(Blk& b, float acc[4], uint32_t what) {
  constexpr int NT8 = ROWS / 8, WPT = WARPS / NT8, KSTEPS = KC / 16, RS = KC * 2 + ROW_PAD, AS = a_stride<K>();
  static_assert(WARPS % NT8 == 0 && K % KC == 0 && KC % 16 == 0, "bf16 tile shape");
  const int w = warp(), tile = w % NT8, ks = w / NT8, g = lane() >> 2, t = lane() & 3;
  const int n = tile * 8 + g;
  for (int c = 0; c < K / KC; ++c) {
    const unsigned char* st = ring_consume(b, what);
    for (int j = ks; j < KSTEPS; j += WPT) {
      const int k = c * KC + j * 16;
      uint32_t a[4], bb[2];
      a[0] = *reinterpret_cast<const uint32_t*>(b.abuf + g * AS + (k + 2 * t) * 2);
      a[1] = *reinterpret_cast<const uint32_t*>(b.abuf + (g + 8) * AS + (k + 2 * t) * 2);
      a[2] = *reinterpret_cast<const uint32_t*>(b.abuf + g * AS + (k + 2 * t + 8) * 2);
      a[3] = *reinterpret_cast<const uint32_t*>(b.abuf + (g + 8) * AS + (k + 2 * t + 8) * 2);
      bb[0] = *reinterpret_cast<const uint32_t*>(st + n * RS + (j * 16 + 2 * t) * 2);
      bb[1] = *reinterpret_cast<const uint32_t*>(st + n * RS + (j * 16 + 2 * t + 8) * 2);
      mma(acc, a, bb);
    }
    ring_release(b);
  }
}

// ---------------------------------------------------------------- consumer: NVFP4 weights
MK_DEV uint32_t e4m3_to_bf16(uint32_t s) {
  const uint32_t e = (s >> 3) & 15u, m = s & 7u, sign = (s & 0x80u) << 8;
  if (e) return sign | ((e + 120u) << 7) | (m << 4);
  return sign | f2bf(static_cast<float>(m) * 0.001953125f);  // subnormal: m * 2^-9
}

template <int ROWS, int KC, int K>
MK_DEV void gemm_fp4(Blk& b, float acc[4], uint32_t what) {
  constexpr int NT8 = ROWS / 8, WPT = WARPS / NT8, KS32 = KC / 32, CS = KC / 2 + ROW_PAD,
                SS = (KC == K) ? K / 16 : KC / 16 + ROW_PAD, AS = a_stride<K>();
  static_assert(WARPS % NT8 == 0 && K % KC == 0 && KC % 32 == 0, "fp4 tile shape");
  const int w = warp(), tile = w % NT8, ks = w / NT8, g = lane() >> 2, t = lane() & 3;
  const int n = tile * 8 + g;
  for (int c = 0; c < K / KC; ++c) {
    const unsigned char* st = ring_consume(b, what);
    const unsigned char* scales = st + ROWS * CS;
    for (int j = ks; j < KS32; j += WPT) {
      const uint32_t code = *reinterpret_cast<const uint32_t*>(st + n * CS + j * 16 + t * 4);
      const uint32_t sbf = e4m3_to_bf16(scales[n * SS + 2 * j + (t >> 1)]);
      const uint32_t s2 = sbf | (sbf << 16);
      uint32_t pr[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t y = code >> (4 * i);  // nibble i at bits 3..0, nibble i+4 at bits 19..16
        const uint32_t raw = ((y << 6) & 0x01C001C0u) | ((y << 12) & 0x80008000u);
        pr[i] = hmul2(hmul2(raw, 0x7E807E80u), s2);  // * 2^126 (exact), * block scale (exact)
      }
      const int kb = c * KC + j * 32 + t * 8;
      const uint4 ra = *reinterpret_cast<const uint4*>(b.abuf + g * AS + kb * 2);
      const uint4 rb = *reinterpret_cast<const uint4*>(b.abuf + (g + 8) * AS + kb * 2);
      const uint32_t a1[4] = {ra.x, rb.x, ra.y, rb.y}, b1[2] = {pr[0], pr[1]};
      mma(acc, a1, b1);
      const uint32_t a2[4] = {ra.z, rb.z, ra.w, rb.w}, b2[2] = {pr[2], pr[3]};
      mma(acc, a2, b2);
    }
    ring_release(b);
  }
}

// ---------------------------------------------------------------- fixed-order reduction
template <int ROWS>
MK_DEV void gemm_stash(Blk& b, const float acc[4]) {
  constexpr int NT8 = ROWS / 8;
  const int w = warp(), tile = w % NT8, g = lane() >> 2, t = lane() & 3;
  float* r = b.red + w * 16 * ROWS;
  r[g * ROWS + tile * 8 + 2 * t] = acc[0];
  r[g * ROWS + tile * 8 + 2 * t + 1] = acc[1];
  r[(g + 8) * ROWS + tile * 8 + 2 * t] = acc[2];
  r[(g + 8) * ROWS + tile * 8 + 2 * t + 1] = acc[3];
  sync_compute();
}

// Output (token t, feature n of the tile): the warps that share its 8-feature tile, in order.
template <int ROWS>
MK_DEV float gemm_sum(const Blk& b, int t, int n) {
  constexpr int NT8 = ROWS / 8, WPT = WARPS / NT8;
  const int tile = n / 8;
  float s = 0.f;
  for (int k = 0; k < WPT; ++k) s += b.red[(tile + k * NT8) * 16 * ROWS + t * ROWS + n];
  return s;
}

// ---------------------------------------------------------------- producer: the loader warp
template <int ROWS, int KC, int K>
MK_DEV bool produce_bf16(const Blk& b, const uint16_t* W, int row0, unsigned& c, uint32_t what) {
  constexpr int RS = KC * 2 + ROW_PAD;
  for (int ch = 0; ch < K / KC; ++ch, ++c) {
    if (!ring_produce_begin(b, c, ROWS * KC * 2, what)) return false;
    unsigned char* st = stage_of(b, c);
    for (int r = lane(); r < ROWS; r += 32)
      bulk_copy(st + r * RS, W + static_cast<size_t>(row0 + r) * K + ch * KC, KC * 2, &b.full[c % RING_STAGES]);
  }
  return true;
}

// `row(r)` maps tile row r to a weight row; rows come in runs of 16 consecutive weight rows.
template <int ROWS, int KC, int K, typename RowMap>
MK_DEV bool produce_fp4(const Blk& b, const uint8_t* codes, const uint8_t* scales, RowMap row, unsigned& c,
                        uint32_t what) {
  constexpr int CS = KC / 2 + ROW_PAD, SS = (KC == K) ? K / 16 : KC / 16 + ROW_PAD;
  static_assert(ROWS % 16 == 0, "scale copies move runs of 16 rows");
  for (int ch = 0; ch < K / KC; ++ch, ++c) {
    if (!ring_produce_begin(b, c, ROWS * (KC / 2 + KC / 16), what)) return false;
    unsigned char* st = stage_of(b, c);
    uint64_t* bar = &b.full[c % RING_STAGES];
    for (int r = lane(); r < ROWS; r += 32)
      bulk_copy(st + r * CS, codes + static_cast<size_t>(row(r)) * (K / 2) + ch * (KC / 2), KC / 2, bar);
    if (KC == K) {  // whole rows: one copy per run of 16 consecutive rows
      for (int r0 = 16 * lane(); r0 < ROWS; r0 += 16 * 32)
        bulk_copy(st + ROWS * CS + r0 * SS, scales + static_cast<size_t>(row(r0)) * (K / 16), 16 * (K / 16), bar);
    } else {
      for (int r = lane(); r < ROWS; r += 32)
        bulk_copy(st + ROWS * CS + r * SS, scales + static_cast<size_t>(row(r)) * (K / 16) + ch * (KC / 16), KC / 16,
                  bar);
    }
  }
  return true;
}

}  // namespace mk

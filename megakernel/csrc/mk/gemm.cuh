// The tensor-core GEMM machinery every projection shares: activation staging into `abuf`,
// weight chunks streamed through the ring (producer side for the loader warp, consumer side for
// the compute warps), and a fixed-order reduction of the warps' partial tiles.
//
// Shapes. A GEMM unit computes a [ROWS features x 16 tokens] tile over all of K with
// mma.m16n8k16: A = 16 weight rows x 16 k, B = 8 tokens x 16 k (one or two token tiles). In the
// bf16 GEMMs warps split the unit's row tiles and k-steps and their partial tiles are summed in
// warp order afterwards; in the fp4 GEMMs each warp owns whole row tiles over all of K. Either
// way the result does not depend on timing (chain and mega modes are bitwise equal).
//
// NVFP4 (expert GEMMs, gemm_fp4). Thread t of a quad
// decodes one u32 of codes = 8 consecutive E2M1 values k..k+7 (half of a 16-wide scale block) of
// each of its two rows and feeds them to two mmas as the pairs (k+i, k+i+4): the k order inside
// each mma is permuted, which is harmless as long as the activations are permuted the same way,
// so the activation rows of the fp4 GEMMs are staged in that order (stage_rows, PERM), 64 bytes
// per token per k32 step (the two mmas' 16 k each), read with ldmatrix as B fragments.
// Dequantisation is exact: a pair's 3 magnitude bits go to bf16 bits 8..6 of each half (value *
// 2^-126, a subnormal when the exponent is 0) and its sign to bit 15, then one multiply by the
// E4M3 block scale * 2^FP4_SCALE_EXP = 2^119 (exact: <= 6 significant bits, a normal bf16). The
// codes are stored in the kernel's word layout (fp4_layout.py, FP4_PAIRS), where a pair is one or
// two shifted copies of the word under a mask: 15 integer operations for the 4 pairs (20 from
// the natural nibble order). The missing 2^7 is on the activations, staged * 2^7 (exact;
// overflows only beyond 2^121), so every mma product equals activation * value * scale exactly,
// as an unscaled dequantisation would give.
#pragma once
#include "mk/block.cuh"

namespace mk {

template <int K>
MK_DEV constexpr int a_stride() {
  return K * 2 + ROW_PAD;
}

// ---------------------------------------------------------------- activation staging
// Every staging loop issues its loads in batches of STAGE_BATCH before using any of them: a
// loop that waits for each L2 load before issuing the next costs ~K/128 round trips per row.
// Fewer in flight wait more often; more hold more registers live across the batch.
constexpr int STAGE_BATCH = 8;

// Sum of squares of 8 consecutive features of x, in one fixed order: ((0+1)+(2+3))+((4+5)+(6+7)),
// products and sums rounded separately (no fma contraction). The producers of x (embed, oproj,
// unpool) write it per 8-feature group into ss_part, so a norm's consumers never read x itself
// (stage_normed); each producer must give these exact bits.
MK_DEV float ss8(const float (&v)[8]) {
  float s[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = fmul_rn(v[i], v[i]);
  return fadd_rn(fadd_rn(fadd_rn(s[0], s[1]), fadd_rn(s[2], s[3])), fadd_rn(fadd_rn(s[4], s[5]), fadd_rn(s[6], s[7])));
}
// The same sum when lanes 8j..8j+7 hold the 8 features (each lane gets it; the butterfly pairs
// exactly as ss8 does, and a + b == b + a bitwise). Every lane of the warp must call.
MK_DEV float ss8_lanes(float v) {
  float s = fmul_rn(v, v);
  s = fadd_rn(s, shfl_xor(s, 1));
  s = fadd_rn(s, shfl_xor(s, 2));
  return fadd_rn(s, shfl_xor(s, 4));
}
// ss_part[which][t][g]: which 0 = x as the attention and final norms read it (embed, unpool),
// 1 = as the ffn norm reads it (oproj). Two buffers so a producer never overwrites partials a
// slower block may still be summing.
MK_DEV float* ss_part(const Params& p, int which) { return p.ss_part + which * T_MAX * (D / 8); }
// bf16(x[t][k] * g[k]), g the gain of the norm that reads x next (which as for ss_part): written by
// x's producers beside x, so that a norm's consumers stage bf16 rows with no math and apply the
// norm factor to their fp32 result (stage_normed). Laid out as the consumers stage it, panel-major
// with abuf's padded rows, [2][D/NORM_KP][T_MAX][a_stride<NORM_KP> bytes], so that the rows < T of
// a panel are one contiguous bulk copy.
// XG_ROW (rendered from plan.xg_row) is abuf's row: a panel's copy, T rows of a_stride bytes from a
// row start, is then 16-byte sized and aligned
static_assert(2 * XG_ROW == a_stride<NORM_KP>(), "xg rows are abuf's padded rows (plan.xg_row)");
static_assert(a_stride<NORM_KP>() % 16 == 0 && NORM_KP % 8 == 0, "xg rows: 16-byte aligned, 8-feature groups");
MK_DEV uint16_t* xg_at(const Params& p, int which, int t, int k) {
  return p.xg + ((which * (D / NORM_KP) + k / NORM_KP) * T_MAX + t) * XG_ROW + k % NORM_KP;
}

// The normed operand of a d_model projection (qkv, router, pool, lm_head), columns panel * KP ..+KP
// of K = D: rows t < T of xg (its producers wrote bf16(x * g)), by one bulk copy straight into
// abuf's row layout (row stride a_stride<KP>); rows >= T zero. The norm factor r[t] =
// rsqrt(mean(x^2) + eps), the fixed-order sum of the producers' 8-feature partials `ssp` (lane l
// adds float4 l, l+32, ..., then a butterfly), goes to shared memory (norm_factor) once per
// operand; the consumer multiplies its fp32 result by it. The operand is rounded once, as
// bf16((x * r) * g) is, but at another point than the reference's (the error against it grows a
// little; a bf16(x) normalised after staging rounds twice and grows it more). The bytes staged are
// half of fp32 x's, with no math: every block of a norm's consumers reads the same operand from
// L2, bounded per SM by the bytes in flight, and bulk copies keep the most in flight; one copy per
// panel, not one per row, pays the per-copy cost once (xg's panel-major layout makes that possible).
// abuf holds one panel at a time: its tag is tag + panel.
MK_DEV void stage_normed(Blk& b, int which, const float* ssp, int tag, int panel, uint32_t what) {
  constexpr int K = D, KP = NORM_KP;  // the normed operand is d_model wide, in xg's panels
  static_assert(16 * a_stride<KP>() <= ABUF_BYTES, "a panel of 16 rows fits abuf");
  static_assert(16 * a_stride<KP>() < (1 << 20), "a panel's bytes fit the mbarrier's tx-count");
  static_assert(2 * WARPS == 16, "a warp computes the factors of token rows w and w + 8");
  constexpr int NG4 = K / 32;  // float4 of a row's K/8 partial sums
  constexpr int NS = (NG4 + 31) / 32;
  if (b.misc[MISC_TAG] == tag + panel) return;
  detail_stamp(b, MK_EV_STAGE_BEGIN, 0);
  if (tid() == 0) {
    // xg came from other blocks' generic stores (acquired by this thread's dependency wait), and
    // abuf was last read through the generic proxy (ordered by the barrier before this call):
    // both before the async-proxy copies
    fence_proxy_async();
    const unsigned bytes = static_cast<unsigned>(step_rows(b) * a_stride<KP>());
    mbar_expect_tx(b.xbar, bytes);
    bulk_copy_keep(b.abuf, xg_at(*b.p, which, 0, panel * KP), bytes, b.xbar);
  }
  for (int i = tid(); i < (16 - step_rows(b)) * (KP / 8); i += COMPUTE_THREADS) {  // rows the copies leave out
    const int r = step_rows(b) + i / (KP / 8), k8 = i % (KP / 8);
    *reinterpret_cast<uint4*>(b.abuf + r * a_stride<KP>() + 16 * k8) = uint4{0u, 0u, 0u, 0u};
  }
  if (b.misc[MISC_RTAG] != tag) {  // the norm factors, under the copies (an earlier panel kept them)
    float* rn = reinterpret_cast<float*>(b.misc + MISC_RNORM);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = warp() + WARPS * h;
      uint4 sv[NS];
#pragma unroll
      for (int i = 0; i < NS; ++i) {
        const int i4 = lane() + 32 * i;
        sv[i] = (t < step_rows(b) && i4 < NG4) ? ldg_cg4(ssp + t * (K / 8) + 4 * i4) : uint4{0, 0, 0, 0};
      }
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < NS; ++i) ss = (((ss + u2f(sv[i].x)) + u2f(sv[i].y)) + u2f(sv[i].z)) + u2f(sv[i].w);
      for (int m = 16; m >= 1; m >>= 1) ss += shfl_xor(ss, m);
      if (lane() == 0) rn[t] = frsqrt(ss / static_cast<float>(K) + RMS_EPS);
    }
  }
  // every reader of abuf observes the copies' completion itself (as ring_consume does)
  if (!wait_mbar(*b.p, b.xbar, b.xuse & 1u, (what & ~15u) | WHAT_NORM_ROWS)) b.failed = true;
  ++b.xuse;
  sync_compute();
  detail_stamp(b, MK_EV_STAGE_END, 0);
  if (tid() == 0) {
    b.misc[MISC_TAG] = tag + panel;
    b.misc[MISC_RTAG] = tag;
  }
}
// The staged norm's factor of token row t (stage_normed), for the consumer's fp32 result.
MK_DEV float norm_factor(const Blk& b, int t) { return reinterpret_cast<const float*>(b.misc + MISC_RNORM)[t]; }

// Rows of another block's bf16 output (read at L2): `src(r)` is row r's address, r < nrows; rows
// >= nrows are zero, except for PERM, where they are not written at all: they only feed token
// columns of the mma that no epilogue reads (an expert slot has ~3 of its 16 rows at shard8
// T=16, and zeroing the rest would be most of the staging's stores). PERM (fp4 operand): each 16-byte
// piece k8 = 4 * step + t holds the values e0..e7 of k = 8 * k8..; its u32 words w = (e0,e4),
// (e1,e5), (e2,e6), (e3,e7), times 2^7, go to word 4 * w + t of the step's 64 bytes: mma
// m = w / 2's A tile, column half w % 2, pair t.
// The block scales are converted * 2^FP4_SCALE_EXP and the staged activations carry the rest of
// the 2^126 that the E2M1 bit trick leaves out (gemm_fp4).
constexpr int FP4_SCALE_EXP = 119;
constexpr uint32_t FP4_ACT_SCALE_BF2 = ((127u + 126u - FP4_SCALE_EXP) << 7) * 0x10001u;  // bf16x2 (2^7, 2^7)
template <int K, bool PERM, typename RowPtr>
MK_DEV void stage_rows(Blk& b, int nrows, RowPtr src) {
  constexpr int PER = 16 * (K / 8);  // 16-byte pieces of the 16 rows
  constexpr int NT = (PER + COMPUTE_THREADS - 1) / COMPUTE_THREADS;
  constexpr int NB = NT < STAGE_BATCH ? NT : STAGE_BATCH;
  static_assert(NT % NB == 0, "batching");
  static_assert(!PERM || K % 32 == 0, "fp4 operand: whole k32 steps");
  // piece idx = tid + COMPUTE_THREADS * n is column k8 = tid % (K / 8) of row r0 + RPR * n: the
  // same column for every n, so each load's row is a constant step from the thread's first.
  // Dividing idx per piece costs ~2 KB of cold code per operand kind (oproj, unpool, both expert
  // GEMMs), fetched from L2 every layer.
  constexpr int RPR = COMPUTE_THREADS / (K / 8);  // rows per round of pieces
  static_assert(COMPUTE_THREADS % (K / 8) == 0, "whole rows per round");
  const int r0 = tid() / (K / 8), k8 = tid() % (K / 8);
  detail_stamp(b, MK_EV_STAGE_BEGIN, 1);
  const int live = PERM ? nrows * (K / 8) : PER;  // pieces written
  for (int i0 = 0; i0 < NT && COMPUTE_THREADS * i0 < live; i0 += NB) {
    uint4 v[NB];
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      const int r = r0 + RPR * (i0 + i);
      v[i] = r < nrows ? ldg_cg4(src(r) + 8 * k8) : uint4{0, 0, 0, 0};
    }
#pragma unroll
    for (int i = 0; i < NB; ++i) {
      const int r = r0 + RPR * (i0 + i);
      // PERM: rows past the slot's are not written; else r >= 16 only when 16 rows are < one round
      if (PERM ? r >= nrows : (PER % COMPUTE_THREADS != 0 && r >= 16)) continue;
      unsigned char* row = b.abuf + r * a_stride<K>();
      if (PERM) {  // (e0,e1)(e2,e3)(e4,e5)(e6,e7) -> (e0,e4)(e1,e5)(e2,e6)(e3,e7), scattered
        const uint32_t wd[4] = {(v[i].x & 0xffffu) | (v[i].z << 16), (v[i].x >> 16) | (v[i].z & 0xffff0000u),
                                (v[i].y & 0xffffu) | (v[i].w << 16), (v[i].y >> 16) | (v[i].w & 0xffff0000u)};
        uint32_t* blk = reinterpret_cast<uint32_t*>(row + 64 * (k8 / 4));
#pragma unroll
        for (int w = 0; w < 4; ++w) blk[4 * w + k8 % 4] = hmul2(wd[w], FP4_ACT_SCALE_BF2);
      } else {
        *reinterpret_cast<uint4*>(row + 16 * k8) = v[i];
      }
    }
  }
  sync_compute();
  detail_stamp(b, MK_EV_STAGE_END, 1);
}

template <int K>
MK_DEV void stage_plain(Blk& b, const uint16_t* src, int tag) {
  if (b.misc[MISC_TAG] == tag) return;
  stage_rows<K, false>(b, step_rows(b), [src](int r) { return src + r * K; });
  if (tid() == 0) b.misc[MISC_TAG] = tag;
}

// Expert operand: `nrows` rows gathered from src, row i at src + rows[i] * K with the row indices
// already in shared memory (MISC_ROWS: program.cuh slot_fetch reads them), fp4 order.
template <int K>
MK_DEV void stage_gather_rows(Blk& b, const uint16_t* src, int nrows, int tag) {
  if (b.misc[MISC_TAG] == tag) return;
  const int* rows = b.misc + MISC_ROWS;
  stage_rows<K, true>(b, nrows, [src, rows](int r) { return src + static_cast<size_t>(rows[r]) * K; });
  if (tid() == 0) b.misc[MISC_TAG] = tag;
}
// The same with rows[i] = rowidx(i), written to shared memory first (not once per 16-byte piece).
template <int K, typename RowIdx>
MK_DEV void stage_gather_perm(Blk& b, const uint16_t* src, int nrows, RowIdx rowidx, int tag) {
  if (b.misc[MISC_TAG] == tag) return;
  if (tid() < nrows) b.misc[MISC_ROWS + tid()] = rowidx(tid());
  sync_compute();
  stage_gather_rows<K>(b, src, nrows, tag);
}

// ---------------------------------------------------------------- consumer: bf16 weights
// Operands as in gemm_fp4: a 16-row weight tile is the mma's A (ldmatrix from the ring stage), the
// activations its B (8 tokens x 16 k, ldmatrix from abuf), and the second token tile (tokens
// 8..15) is loaded and multiplied only when the block has more than 8 tokens. Warp w owns the
// 16-row tile w % (ROWS/16) and every (WARPS/(ROWS/16))-th k-step of each chunk. Each weight byte
// is read from shared memory once and each activation once per 16-row tile, with one ldmatrix per
// operand per k-step: activations as A (every warp re-reading the 16-token tile for each 8 weight
// rows) read 96 KB per 32 KB chunk of a 32-row unit instead of 64 KB, in twice the instructions.
// ROWS = 8 (router units): rows 8..15 of the A tile are zero registers (ldmatrix .x2, rows 0..7).
// Two accumulators per token tile take alternate k-steps (summed in a fixed order at the end).
// `restage(n)` stages panel n of the operand before the panel's first chunk (the norm ops stage
// their operand this way; the others stage before and pass NoRestage). Paneled (KP < K): abuf
// holds one panel's columns (row stride a_stride<KP>), and the warps meet before each restage.
// REV: the chunks are walked last to first (the loader streams them in the same order,
// produce_bf16): the router does, so that it leaves panel 0 staged for a pool unit that follows it
// on the same block (on grids too small to keep them apart: plan.pool_rows).
struct NoRestage {
  MK_DEV void operator()(int) const {}
};
// A warp's result: c[n] is the C fragment of token tile n (rows g, g + 8 of its 16-row tile x
// tokens 8n + 2t, 8n + 2t + 1); tile 1 is zero when the block has <= 8 tokens.
struct Bf16Acc {
  float c[2][4];
};
template <int ROWS>
MK_DEV constexpr int bf16_row_tiles() {
  return ROWS < 16 ? 1 : ROWS / 16;
}
// A unit's shape as gemm_bf16_at takes it: log2 of its 16-row tiles (bf16_row_tiles), whether it has 8
// rows (router units: ldmatrix .x2, A rows 8..15 zero), its chunks of kc columns, nch of them,
// cpp a panel, abuf's row stride (a_stride of the panel) and the walk (rev: last chunk first).
// gemm_bf16 passes constants, which fold: each op inlines its own copy, shaped at compile time.
struct Bf16Shape {
  int lt;  // log2 of the 16-row tiles (1, 2, 4 or 8: they divide WARPS)
  bool r8;
  int kc, nch, cpp, as;
  bool rev;
};
template <int ROWS, int KC, int K, int KP = K, bool REV = false>
MK_DEV constexpr Bf16Shape bf16_shape() {
  constexpr int NT16 = bf16_row_tiles<ROWS>();
  static_assert((NT16 & (NT16 - 1)) == 0 && NT16 <= 8, "a power of two of 16-row tiles (they divide WARPS)");
  return Bf16Shape{NT16 >= 8 ? 3 : NT16 >= 4 ? 2 : NT16 >= 2 ? 1 : 0, ROWS < 16, KC, K / KC, KP / KC, a_stride<KP>(), REV};
}
template <typename Restage>
MK_DEV Bf16Acc gemm_bf16_at(Blk& b, const Bf16Shape s, uint32_t what, Restage restage) {
  // no division by a runtime shape: tiles by shifts, panels counted along the walk
  const int WPT = WARPS >> s.lt, KSTEPS = s.kc / 16, RS = s.kc * 2 + ROW_PAD;
  const int w = warp(), ks = w >> s.lt;
  // This lane's ldmatrix rows. A (.x4): lanes 0-15 address rows 0-15 at k 0, lanes 16-31 the same
  // rows at k 8, giving a0..a3 = (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15); .x2
  // (8 rows): lanes 0-7 rows 0-7 at k 0, lanes 8-15 at k 8 -> a0, a2. B (.x4): lanes 0-7 tokens 0-7
  // at k 0, lanes 8-15 at k 8, lanes 16-31 the same for tokens 8-15 -> b0, b1 of token tile 0, then
  // of tile 1 (.x2: tile 0 only).
  const int ar = s.r8 ? (lane() & 7) : (lane() & 15), ah = s.r8 ? ((lane() >> 3) & 1) : (lane() >> 4);
  const int aofs = ((w & ((1 << s.lt) - 1)) * 16 + ar) * RS + ah * 16;
  const SAddr brow = saddr(b.abuf + ((lane() & 7) + 8 * (lane() >> 4)) * s.as + ((lane() >> 3) & 1) * 16);
  const bool two = step_rows(b) > 8;
  float acc[2][2][4] = {};  // [k-step parity][token tile]
  auto steps = [&](const SAddr wa, const SAddr bb, const bool tw) {
    auto step = [&](int j, float (&d)[2][4]) {
      uint32_t a[4], bt[4];
      if (s.r8) {
        uint32_t a2[2];
        ldsm_x2(a2, wa + j * 32);
        a[0] = a2[0], a[1] = 0u, a[2] = a2[1], a[3] = 0u;
      } else {
        ldsm_x4(a, wa + j * 32);
      }
      if (tw) ldsm_x4(bt, bb + j * 32);
      else ldsm_x2(bt, bb + j * 32);
      const uint32_t b0[2] = {bt[0], bt[1]};
      mma(d[0], a, b0);
      if (tw) {
        const uint32_t b1[2] = {bt[2], bt[3]};
        mma(d[1], a, b1);
      }
    };
    // rolled, like the chunk loop below: a dense op runs about once per block and layer, so its
    // code is fetched cold from L2 each time and an unrolled copy buys no issue slot worth that
    // fetch (both loops rolled: 20 KB less code)
MK_COLD_LOOP
    for (int j = ks; j < KSTEPS; j += 2 * WPT) {
      step(j, acc[0]);
      if (KSTEPS % (2 * WPT) == 0 || j + WPT < KSTEPS) step(j + WPT, acc[1]);
    }
  };
  // chunk c = panel * cpp + pc: the walk's first chunk, then one step along it per chunk
  int pc = s.rev ? s.cpp - 1 : 0, panel = s.rev ? s.nch / s.cpp - 1 : 0;
MK_COLD_LOOP
  for (int i = 0; i < s.nch; ++i) {
    // one call site: `restage` (a whole norm staging) is inlined once. Unpaneled (cpp == nch) it
    // runs before the first chunk only
    if (pc == (s.rev ? s.cpp - 1 : 0)) {
      if (i > 0) sync_compute();  // every warp is done with the previous panel
      restage(panel);
    }
    const unsigned char* st = ring_consume(b, what);
    const SAddr bb = brow + pc * s.kc * 2;
    // two copies of the k-loop, with and without the second token tile (as in gemm_fp4)
    if (two) steps(saddr(st + aofs), bb, true);
    else steps(saddr(st + aofs), bb, false);
    ring_release(b);
    if (s.rev) {
      if (--pc < 0) pc = s.cpp - 1, --panel;
    } else if (++pc == s.cpp) {
      pc = 0, ++panel;
    }
  }
  Bf16Acc r;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) r.c[n][i] = acc[0][n][i] + acc[1][n][i];
  return r;
}
template <int ROWS, int KC, int K, int KP = K, bool REV = false, typename Restage = NoRestage>
MK_DEV Bf16Acc gemm_bf16(Blk& b, uint32_t what, Restage restage = {}) {
  static_assert((ROWS == 8 || ROWS % 16 == 0) && WARPS % bf16_row_tiles<ROWS>() == 0,
                "bf16 row tiles: 8 rows, or whole 16-row tiles");
  static_assert(K % KC == 0 && KC % 16 == 0, "bf16 tile shape");
  static_assert(K % KP == 0 && KP % KC == 0, "panels of whole chunks");
  return gemm_bf16_at(b, bf16_shape<ROWS, KC, K, KP, REV>(), what, restage);
}

// ---------------------------------------------------------------- consumer: NVFP4 weights
// Term I of pair E (T): the word rotated left by T.rot under T.mask. Where no masked bit wraps, a
// plain shift does it, which nvcc may issue as an IMAD on the FMA pipe: the k-loop's logic
// operations keep the (half-rate) ALU pipe busy, and a funnel shift would add to them.
template <int E, int I>
MK_DEV uint32_t fp4_term(uint32_t w) {
  constexpr Fp4Term T = FP4_PAIRS[E][I];
  constexpr uint32_t below = T.rot ? (1u << T.rot) - 1u : 0u;  // targets a left shift leaves empty
  if constexpr (T.mask == 0u) return 0u;
  else if constexpr (T.rot == 0 || (T.mask & below) == 0u) return (w << T.rot) & T.mask;
  else if constexpr ((T.mask & ~below) == 0u) return (w >> (32 - T.rot)) & T.mask;
  else return rotl(w, T.rot) & T.mask;
}
// Pair E of a code word, value * 2^-126 as bf16x2 (fp4_layout: the storage words' PAIRS, or with
// Plan.fp4_rotated the device words' ROT_PAIRS)
template <int E>
MK_DEV uint32_t fp4_pair(uint32_t w) {
  return fp4_term<E, 0>(w) | fp4_term<E, 1>(w);
}
// The 32-bit word of a scale plane holding steps 4G..4G+3 (SR == 2: the plane's one half-word).
template <int SR>
MK_DEV uint32_t plane_word(const unsigned char* plane, int G) {
  if constexpr (SR >= 4) return *reinterpret_cast<const uint32_t*>(plane + 4 * G);
  else return *reinterpret_cast<const uint16_t*>(plane);
}
// One k32 step of one 16-row tile (gemm_fp4, gemm_fp4_down): its two code words w0, w1 (rows g and
// g + 8), its rows' scale words sw0, sw1 and the step's activation fragments bt (and bu, the
// second token tile, when tw) into d[0] (and d[1]). S is the step in its group of four: bit 1
// picks the scale pair's half, bit 0 the step's half of it.
template <int S>
MK_DEV void fp4_tile_step(uint32_t w0, uint32_t w1, uint32_t sw0, uint32_t sw1, const uint32_t (&bt)[4],
                          const uint32_t (&bu)[4], bool tw, float (&d)[2][4]) {
  // the block scales * 2^FP4_SCALE_EXP of steps 2m (low half) and 2m+1 (high half) of the
  // group: one conversion for both, and each multiply takes its step's half by selector
  const uint32_t s0 = ue4m3x2_to_bf16x2_scaled<FP4_SCALE_EXP, (S & 2) ? 1 : 0>(sw0);
  const uint32_t s1 = ue4m3x2_to_bf16x2_scaled<FP4_SCALE_EXP, (S & 2) ? 1 : 0>(sw1);
  auto scaled = [](uint32_t pair, uint32_t sc) { return hmul2_bcast<(S & 1) ? 1 : 0>(pair, sc); };
  // A fragments: a0 = (row g, k 2t..), a1 = (row g+8, k 2t..), a2 = (row g, k 2t+8..), a3 = (row g+8, ...)
  const uint32_t am1[4] = {scaled(fp4_pair<0>(w0), s0), scaled(fp4_pair<0>(w1), s1),
                           scaled(fp4_pair<1>(w0), s0), scaled(fp4_pair<1>(w1), s1)};
  const uint32_t am2[4] = {scaled(fp4_pair<2>(w0), s0), scaled(fp4_pair<2>(w1), s1),
                           scaled(fp4_pair<3>(w0), s0), scaled(fp4_pair<3>(w1), s1)};
  const uint32_t b1[2] = {bt[0], bt[1]}, b2[2] = {bt[2], bt[3]};
  mma(d[0], am1, b1);
  mma(d[0], am2, b2);
  if (tw) {
    const uint32_t c1[2] = {bu[0], bu[1]}, c2[2] = {bu[2], bu[3]};
    mma(d[1], am1, c1);
    mma(d[1], am2, c2);
  }
}
// Calls fp4_tile_step<s> for a runtime step s < 4 of an unrolled loop (a constant after unrolling).
MK_DEV void fp4_tile_step_at(int s, uint32_t w0, uint32_t w1, uint32_t sw0, uint32_t sw1, const uint32_t (&bt)[4],
                             const uint32_t (&bu)[4], bool tw, float (&d)[2][4]) {
  switch (s & 3) {
    case 0: fp4_tile_step<0>(w0, w1, sw0, sw1, bt, bu, tw, d); break;
    case 1: fp4_tile_step<1>(w0, w1, sw0, sw1, bt, bu, tw, d); break;
    case 2: fp4_tile_step<2>(w0, w1, sw0, sw1, bt, bu, tw, d); break;
    default: fp4_tile_step<3>(w0, w1, sw0, sw1, bt, bu, tw, d); break;
  }
}

// One group of GS k32 steps of a chunk in stage st (gemm_fp4, gemm_fp4_down): the code words of
// the warp's RT 16-row tiles by ldmatrix (tile i's first row r0(i) of the chunk; cofs, gx and sofs
// the lane's offsets, as the callers compute them), their rows' scale words, then per step the
// activation fragments at bc (AS the operand's row stride; the second token tile when tw) and
// fp4_tile_step into the accumulators acc_of(i, s).
template <int RT, int SR, int GS, int KC, int SW, int AS, typename RowOf, typename AccOf>
MK_DEV void fp4_group(const unsigned char* st, SAddr cbase, SAddr bc, int G, int gx, const int (&cofs)[GS / 2],
                      int sofs, bool tw, RowOf r0, AccOf acc_of) {
  const int go = SW == 8 ? (64 * G) ^ gx : 64 * G;  // byte offset of group G's units in a row
  uint32_t cw[RT][2 * GS];  // cw[i][4p + 2h + r]: tile i, row g + 8r, step 2p + h of the group
  uint32_t sw[RT][2];       // scale words of tile i, rows g and g + 8
#pragma unroll
  for (int i = 0; i < RT; ++i) {
#pragma unroll
    for (int p = 0; p < GS / 2; ++p) ldsm_x4(cw[i] + 4 * p, cbase + (cofs[p] + go + r0(i) * (KC / 2)));
    const unsigned char* sp = st + sofs + r0(i) * (KC / 16);
    sw[i][0] = plane_word<SR>(sp, G);
    sw[i][1] = plane_word<SR>(sp + 8 * (KC / 16), G);
  }
#pragma unroll
  for (int s = 0; s < GS; ++s) {
    uint32_t bt[4], bu[4];
    ldsm_x4(bt, bc + (G * GS + s) * 64);
    if (tw) ldsm_x4(bu, bc + 8 * AS + (G * GS + s) * 64);
#pragma unroll
    for (int i = 0; i < RT; ++i) {
      const int wi = 4 * (s / 2) + 2 * (s & 1);  // words of rows g, g + 8 for step s
      fp4_tile_step_at(s, cw[i][wi], cw[i][wi + 1], sw[i][0], sw[i][1], bt, bu, tw, acc_of(i, s));
    }
  }
}

// A unit's results, [16 tokens][ROWS] fp32 in `red` (gemm_fp4; only the slot's token rows are
// written). Danger: the next unit's gemm_fp4 overwrites them; its epilogue is safe only because
// compute_loop puts a barrier between units.
template <int ROWS>
MK_DEV float fp4_out(const Blk& b, int t, int n) {
  return b.red[t * ROWS + n];
}
// Chunk c of a unit, as produce_fp4 lands it: the ROWS rows' KC/2 code bytes ([ROWS][KC/2], 16-byte
// unit u of row r at u ^ (r % SW)), then their KC/16 scale bytes ([ROWS][2][KC/32]: plane h holds
// k16 half h of each of the chunk's SR = KC/32 steps).
// Warp w owns the 16-row tiles w + NTW * i (i < RT) over all of K: its accumulators run through
// every chunk, so no warp's partial meets another's (a k-split across warps left [WARPS][16]
// partial tiles per chunk in shared memory, 64 KB for a 256-row gate/up unit, which took the
// ring's third stage at shard8). Per k32 step a warp loads the step's activation B fragment once
// and multiplies both its tiles by it. Warps w >= NTW (units of fewer than 16 * WARPS rows, tiny
// configs only) have no tile.
// The code words come by ldmatrix: a step's 16 code bytes of a row are one 8x8-b16 matrix row,
// and thread (g, t) receives word t of row g of each matrix, the word it decodes. Matrix m of an
// x4 is (row r0 + 8 (m & 1), step m >> 1), so one instruction brings two steps of both rows.
// Lane l addresses row (l & 7) + 8 ((l >> 3) & 1) of matrix l >> 3; the rows of a tile are
// multiples of 8 apart, so the swizzle of a lane's row, (l & 7) % SW, is a per-lane constant.
// Steps go in groups of GS (unrolled: constant offsets, one scale word per row) and the groups of
// a chunk in a rolled loop.
template <int ROWS, int KC, int K, int SW>
MK_DEV void gemm_fp4(Blk& b, int ntok, uint32_t what) {
  constexpr int NT16 = ROWS / 16, NTW = NT16 < WARPS ? NT16 : WARPS, RT = NT16 / NTW;
  constexpr int SR = KC / 32, NCH = K / KC, AS = a_stride<K>();
  constexpr int GS = SR < 4 ? SR : 4, NG = SR / GS;  // steps per group, groups per chunk
  static_assert(ROWS % 16 == 0 && NT16 % NTW == 0 && RT <= 2, "whole 16-row tiles, at most two per warp");
  static_assert(K % KC == 0 && SR >= 2 && (SR & (SR - 1)) == 0, "chunks of a power of two >= 2 of k32 steps");
  static_assert(SW == (SR < FP4_SWIZZLE_MAX ? SR : FP4_SWIZZLE_MAX), "code swizzle period min(8, KC/32) (plan._expert_tile)");
  static_assert(16 * ROWS * 4 <= RED_BYTES, "the unit's results fit red (plan.red_bytes)");
  const int w = warp(), g = lane() >> 2, t = lane() & 3;
  // a warp without a tile still passes each chunk (a stage is freed when every compute thread
  // arrived) and meets the others at the same barrier instruction (synccheck: a block's threads
  // at different bar.sync sites are divergent)
  const bool has_tile = NTW == WARPS || w < NTW;
  // this lane's code ldmatrix rows: tile row lr of tile w, steps 2p + ls; swizzle x = lr % SW
  const int lr = (lane() & 7) + 8 * ((lane() >> 3) & 1), ls = lane() >> 4, x = (lane() & 7) % SW;
  // lane offset of pair p < GS/2 of group 0 (the low two bits of the unit swizzle; with SW = 8 a
  // group G's 4 units lie at 4G ^ (x & 4): one XOR per group, gx below)
  int cofs[GS / 2];
#pragma unroll
  for (int p = 0; p < GS / 2; ++p) cofs[p] = (w * 16 + lr) * (KC / 2) + 16 * ((2 * p + ls) ^ (x & 3));
  const int gx = SW == 8 ? 16 * (x & 4) : 0;
  // this thread's rows of tile i: w * 16 + g (+ 8) + NTW * 16 * i; its scale plane: k16 half t >> 1
  const int sofs = ROWS * (KC / 2) + (w * 16 + g) * (KC / 16) + (t >> 1) * SR;
  // ldmatrix x4 of an 8-token B tile: matrix m = the step's 16-byte column block m of tokens 0..7
  const SAddr brow = saddr(b.abuf + (lane() & 7) * AS + (lane() >> 3) * 16);
  const bool two = ntok > 8;
  // acc[a][n]: tile a (RT == 2) or step parity a (RT == 1: two chains for ILP), token tile n
  float acc[2][2][4] = {};
  auto chunk = [&](const unsigned char* st, int c, const bool tw) {
    const SAddr cbase = saddr(st);
    const SAddr bc = brow + c * SR * 64;
MK_COLD_LOOP
    for (int G = 0; G < NG; ++G)
      fp4_group<RT, SR, GS, KC, SW, AS>(
          st, cbase, bc, G, gx, cofs, sofs, tw, [](int i) { return i * NTW * 16; },
          [&](int i, int s) -> float (&)[2][4] { return acc[RT == 2 ? i : (s & 1)]; });
  };
MK_COLD_LOOP
  for (int c = 0; c < NCH; ++c) {
    const unsigned char* st = ring_consume(b, what);
    // two copies of the k-loop, with and without the second token tile: most slots have <= 8
    // tokens (T=16 spreads 128 token-slots over ~50 experts), and a predicated second tile in one
    // shared copy costs its predicate in every step of the k-loop
    if (has_tile) {
      if (two) chunk(st, c, true);
      else chunk(st, c, false);
    }
    ring_release(b);
  }
  detail_stamp(b, MK_EV_FP4_TAIL_BEGIN, 0);
  // results of the slot's token rows: red[token][row] (C fragment: c0 = (row g, token 2t), c1 =
  // (row g, 2t+1), c2 = (row g+8, 2t), c3 = (row g+8, 2t+1)); RT == 1 sums its two chains in order
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    if (!has_tile) break;
    const int row = (w + NTW * i) * 16 + g;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] = RT == 2 ? acc[i][n][k] : acc[0][n][k] + acc[1][n][k];
      const int tok = 8 * n + 2 * t;
      if (tok < ntok) b.red[tok * ROWS + row] = v[0], b.red[tok * ROWS + row + 8] = v[2];
      if (tok + 1 < ntok) b.red[(tok + 1) * ROWS + row] = v[1], b.red[(tok + 1) * ROWS + row + 8] = v[3];
    }
  }
  sync_compute();
  detail_stamp(b, MK_EV_FP4_TAIL_END, 0);
}

// Plan.fused_experts' down projection (ops/expert_gemm2.cuh): chunk c holds rows c*CR.. of the
// output over the unit's whole K (KC columns, one gate/up unit's K-part), so each chunk's results
// are final. A chunk goes in passes of 256 rows (warp w owns 16-row tiles w and w + 8 of a pass,
// as gemm_fp4 does a 256-row unit; fp4_tile_step), and each thread stores its
// accumulators * ts straight to out(token)[row] (fp32, tokens < ntok): no shared-memory round
// trip and no barrier, the ring orders the stages (every compute thread releases a chunk after
// its last read of it).
template <int CR, int KC, int SW, int NCH, typename TokOut>
MK_DEV void gemm_fp4_down(Blk& b, const unsigned char* act, int ntok, float ts, TokOut out, uint32_t what) {
  constexpr int PR = 2 * 16 * WARPS, NPASS = CR / PR;  // rows of a pass, passes of a chunk
  constexpr int SR = KC / 32, GS = SR < 4 ? SR : 4, NG = SR / GS, AS = a_stride<KC>();
  static_assert(CR % PR == 0 && SR >= 2 && (SR & (SR - 1)) == 0, "whole 256-row passes; k32 steps a power of two >= 2");
  static_assert(SW == (SR < FP4_SWIZZLE_MAX ? SR : FP4_SWIZZLE_MAX), "code swizzle period min(8, KC/32) (plan)");
  const int w = warp(), g = lane() >> 2, t = lane() & 3;
  const int lr = (lane() & 7) + 8 * ((lane() >> 3) & 1), ls = lane() >> 4, x = (lane() & 7) % SW;
  int cofs[GS / 2];
#pragma unroll
  for (int p = 0; p < GS / 2; ++p) cofs[p] = (w * 16 + lr) * (KC / 2) + 16 * ((2 * p + ls) ^ (x & 3));
  const int gx = SW == 8 ? 16 * (x & 4) : 0;
  const int sofs = CR * (KC / 2) + (w * 16 + g) * (KC / 16) + (t >> 1) * SR;
  const SAddr bc = saddr(act + (lane() & 7) * AS + (lane() >> 3) * 16);  // the staged operand (abuf or kept)
  const bool two = ntok > 8;
  auto pass = [&](const unsigned char* st, int c, int h, const bool tw) {
    const SAddr cbase = saddr(st);
    float acc[2][2][4] = {};
MK_COLD_LOOP
    for (int G = 0; G < NG; ++G)  // tile i of this warp in the pass starts at row h * PR + i * WARPS * 16
      fp4_group<2, SR, GS, KC, SW, AS>(
          st, cbase, bc, G, gx, cofs, sofs, tw, [h](int i) { return h * PR + i * WARPS * 16; },
          [&](int i, int) -> float (&)[2][4] { return acc[i]; });
    // C fragment: c0 = (row g, token 2t), c1 = (row g, 2t+1), c2 = (row g+8, 2t), c3 = (row g+8, 2t+1)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = c * CR + h * PR + i * WARPS * 16 + w * 16 + g;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        if (n == 1 && !tw) break;
        const int tok = 8 * n + 2 * t;
        if (tok < ntok) out(tok)[row] = acc[i][n][0] * ts, out(tok)[row + 8] = acc[i][n][2] * ts;
        if (tok + 1 < ntok) out(tok + 1)[row] = acc[i][n][1] * ts, out(tok + 1)[row + 8] = acc[i][n][3] * ts;
      }
    }
  };
MK_COLD_LOOP
  for (int c = 0; c < NCH; ++c) {
    const unsigned char* st = ring_consume(b, what);
    for (int h = 0; h < NPASS; ++h) {
      if (two) pass(st, c, h, true);
      else pass(st, c, h, false);
    }
    ring_release(b);
  }
}

// ---------------------------------------------------------------- fixed-order reduction
// A warp's result into red[w][token][ROWS]; the compute warps meet after it.
template <int ROWS>
MK_DEV void gemm_stash(Blk& b, const Bf16Acc& acc) {
  constexpr int NT16 = bf16_row_tiles<ROWS>();
  const int w = warp(), f = (w % NT16) * 16 + (lane() >> 2), t = lane() & 3;
  float* r = b.red + w * 16 * ROWS;
#pragma unroll
  for (int n = 0; n < 2; ++n) {  // token tile 1 is zeros when not computed: every red word is written
    const int tok = 8 * n + 2 * t;
    r[tok * ROWS + f] = acc.c[n][0];
    r[(tok + 1) * ROWS + f] = acc.c[n][1];
    if constexpr (ROWS >= 16) {
      r[tok * ROWS + f + 8] = acc.c[n][2];
      r[(tok + 1) * ROWS + f + 8] = acc.c[n][3];
    }
  }
  sync_compute();
}

// Output (token t, feature n of the unit): the warps that share its 16-row tile, in order.
template <int ROWS>
MK_DEV float gemm_sum(const Blk& b, int t, int n) {
  constexpr int NT16 = bf16_row_tiles<ROWS>(), WPT = WARPS / NT16;
  const int tile = n / 16;
  float s = 0.f;
  for (int k = 0; k < WPT; ++k) s += b.red[(tile + k * NT16) * 16 * ROWS + t * ROWS + n];
  return s;
}

// ---------------------------------------------------------------- residual projections
// x[t][unit*R ..+R] += (the staged operand) @ W^T (oproj, unpool), and for the next norm (gain
// gnext) the new x's sums of squares per 8 features into ss_part(which) and bf16(x * gnext) into
// xg (xg_at). The residual and the gain are loaded before the GEMM so that their round trips
// overlap it.
// Output o = tid + COMPUTE_THREADS * j of the 16 x R is (token o / R, feature o % R): with R > 16
// (plan.residual_rows) a thread has NO = 16R / COMPUTE_THREADS outputs of one feature.
template <int R>
struct Residual {
  static constexpr int NO = (16 * R + COMPUTE_THREADS - 1) / COMPUTE_THREADS;
  float xo[NO];  // this thread's outputs' x before the add
  float g;       // the next norm's gain of its feature
};
template <int R>
MK_DEV Residual<R> residual_begin(const Blk& b, int unit, const uint16_t* gnext) {
  constexpr int NO = Residual<R>::NO;
  static_assert(R % 8 == 0 && (16 * R) % 32 == 0 && (NO == 1 || (16 * R) % COMPUTE_THREADS == 0),
                "epilogue: whole warps, and with several outputs a thread every one of them");
  static_assert(NO == 1 || COMPUTE_THREADS % R == 0, "a thread's outputs share its feature (one gain)");
  const Params& p = *b.p;
  const int n = tid() % R;
  Residual<R> r;
#pragma unroll
  for (int j = 0; j < NO; ++j) {
    const int o = tid() + COMPUTE_THREADS * j, t = o / R;
    r.xo[j] = (o < 16 * R && t < step_rows(b)) ? ldg_cgf(p.x + t * D + unit * R + n) : 0.f;
  }
  r.g = tid() < 16 * R ? bf2f(gnext[unit * R + n]) : 0.f;
  return r;
}
// The residual add's stores: x + add(j, t, n) for this thread's output j (token t, feature n = tid
// % R of the unit), then the next norm's sums of squares and bf16(x * gain) as above
template <int R, typename Add>
MK_DEV void residual_store(Blk& b, const Params& p, const Residual<R>& r, int unit, int which, int n, Add add) {
#pragma unroll
  for (int j = 0; j < Residual<R>::NO; ++j) {
    const int o = tid() + COMPUTE_THREADS * j, t = o / R;
    if (o < 16 * R) {  // whole warps: the sum of squares shuffles within 8 lanes
      const float xn = r.xo[j] + add(j, t, n);
      if (t < step_rows(b)) {
        p.x[t * D + unit * R + n] = xn;
        *xg_at(p, which, t, unit * R + n) = f2bf(xn * r.g);
      }
      const float ss = ss8_lanes(xn);
      if (n % 8 == 0 && t < step_rows(b)) ss_part(p, which)[t * (D / 8) + unit * (R / 8) + n / 8] = ss;
    }
  }
}
template <int R>
MK_DEV void residual_end(Blk& b, const Residual<R>& r, int unit, int which, const Bf16Acc& acc) {
  const Params& p = *b.p;
  const int n = tid() % R;
  gemm_stash<R>(b, acc);
  residual_store<R>(b, p, r, unit, which, n, [&b](int, int t, int n) { return gemm_sum<R>(b, t, n); });
}
template <int R, int KC, int K>
MK_DEV void gemm_residual_add(Blk& b, int unit, int which, const uint16_t* gnext, uint32_t what) {
  const Residual<R> r = residual_begin<R>(b, unit, gnext);
  residual_end<R>(b, r, unit, which, gemm_bf16<R, KC, K>(b, what));
}

// ---------------------------------------------------------------- producer: the loader warp
// W is tiled (megakernel/tiling.py): chunk ch of unit u is stored as the stage holds it, ROWS rows
// of KC bf16 and their ROW_PAD, so it is one copy: a copy per row would be copies of 1-2 KB,
// which stream slower than one copy per stage (weights.ring).
// bf16 elements of one stored chunk (rows of kc and their pad; tiling.tile_dense)
MK_DEV constexpr size_t dense_tile_elems(int rows, int kc) { return static_cast<size_t>(rows) * (kc + ROW_PAD / 2); }
// Chunks of `nch` of `bytes` each (rows x (kc + pad) bf16), unit `unit`'s from W, rev: last first.
MK_DEV bool produce_bf16_at(const Blk& b, const uint16_t* W, int unit, unsigned& c, uint32_t what, int nch,
                            unsigned bytes, size_t elems, bool rev) {
  for (int i = 0; i < nch; ++i, ++c) {
    const int ch = rev ? nch - 1 - i : i;
    if (!ring_produce_begin(b, c, bytes, what)) return false;
    if (lane() == 0)
      bulk_copy(stage_of(b, c), W + (static_cast<size_t>(unit) * nch + ch) * elems, bytes, &b.full[c % RING_STAGES]);
  }
  return true;
}
template <int ROWS, int KC, int K, bool REV = false>  // REV: chunks last to first (gemm_bf16)
MK_DEV bool produce_bf16(const Blk& b, const uint16_t* W, int unit, unsigned& c, uint32_t what) {
  constexpr unsigned BYTES = ROWS * (KC * 2 + ROW_PAD);
  static_assert(BYTES % 16 == 0, "bulk copies move multiples of 16 bytes");
  return produce_bf16_at(b, W, unit, c, what, K / KC, BYTES, dense_tile_elems(ROWS, KC), REV);
}

// One fp4 chunk, block ch of the kernel's copy of a [N, K] matrix, into stage `st`: run r (ROWS /
// RUNS rows from row run0(r)) as two bulk copies, its codes by lane r and its scales by lane
// RUNS + r, landing on `bar` as gemm_fp4 reads them: [ROWS][KC/2] codes, then [ROWS][KC/16] scales.
template <int ROWS, int KC, int N, int RUNS, typename Run0>
MK_DEV void copy_fp4_chunk(unsigned char* st, const uint8_t* codes, const uint8_t* scales, Run0 run0, int ch,
                           uint64_t* bar) {
  constexpr int RR = ROWS / RUNS;
  constexpr unsigned CB = RR * (KC / 2), SB = RR * (KC / 16);  // one run's bytes
  static_assert(ROWS % RUNS == 0 && CB % 16 == 0 && SB % 16 == 0, "bulk copies move multiples of 16 bytes");
  static_assert(2 * RUNS <= 32, "a lane per copy");
  const int l = lane() % RUNS;
  const size_t row = static_cast<size_t>(ch) * N + run0(l);  // the run's first row in block ch
  if (lane() < RUNS) bulk_copy(st + l * CB, codes + row * (KC / 2), CB, bar);
  else if (lane() < 2 * RUNS) bulk_copy(st + ROWS * (KC / 2) + l * SB, scales + row * (KC / 16), SB, bar);
}
template <int ROWS, int KC>
MK_DEV constexpr unsigned fp4_chunk_bytes() { return ROWS * (KC / 2) + ROWS * (KC / 16); }

// The chunks of an fp4 unit from the kernel's copy of its expert's [N, K] matrix
// (tiling.tile_fp4_*: blocks of KC columns of all N rows, [K/KC][N][KC/2] codes, [K/KC][N][KC/16]
// scales): the unit's rows are RUNS runs of ROWS/RUNS consecutive rows, run r from row run0(r)
// (a gate/up unit: its gate rows and the matching up rows), copied by copy_fp4_chunk.
template <int ROWS, int KC, int K, int N, int RUNS, typename Run0>
MK_DEV bool produce_fp4(const Blk& b, const uint8_t* codes, const uint8_t* scales, Run0 run0, unsigned& c,
                        uint32_t what) {
  for (int ch = 0; ch < K / KC; ++ch, ++c) {
    if (!ring_produce_begin(b, c, fp4_chunk_bytes<ROWS, KC>(), what)) return false;
    uint64_t* bar = &b.full[c % RING_STAGES];
    copy_fp4_chunk<ROWS, KC, N, RUNS>(stage_of(b, c), codes, scales, run0, ch, bar);
    if (c == b.pace && !warp_all(wait_mbar(*b.p, bar, (c / RING_STAGES) & 1u, (what & ~15u) | WHAT_LOADER_PACE)))
      return false;  // the wait is for this warp's own copy: the stage's next phase needs this warp
  }
  return true;
}

}  // namespace mk

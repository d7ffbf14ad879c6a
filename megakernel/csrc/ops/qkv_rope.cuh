// qkv projection with RoPE and the KV-cache write. Unit = TILE_QKV_ROWS output rows of wqkv (rows
// are q heads, then k heads, then v heads; the rows divide head_dim, so a unit never straddles heads).
// A = rmsnorm(x, attn_norm) (the norm factor applied to the fp32 result, gemm.cuh stage_normed);
// q, k get interleaved RoPE at position ctx_r + depth(t) from the shared cos/sin tables (r: row t's
// request); q -> p.q, k/v -> request r's cache of the layer at sequence index ctx_r + t - row0_r
// (ring slot in sliding layers). Rounding: fp32
// accumulate, RoPE in fp32 (each product and sum rounded), one rounding to bf16.
#pragma once
#include "mk/gemm.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV bool load_qkv(const Blk& b, int layer, int unit, unsigned& c, uint32_t what) {
  constexpr int R = TILE_QKV_ROWS;
  return produce_bf16<R, TILE_QKV_KC, D>(b, b.p->layers[layer].wqkv, unit, c, what);
}

// Thread i < 16 * R / 2: token t, output pair (n, n + 1), and the pair's rotation.
struct QkvRope {
  int t, n, d, head;
  bool mine;
  float cs, sn;
};
MK_DEV QkvRope qkv_begin(const Blk& b, int unit) {
  const Params& p = *b.p;
  constexpr int R = TILE_QKV_ROWS;
  static_assert(16 * (R / 2) <= COMPUTE_THREADS, "the epilogue: one output pair per thread");
  QkvRope q;
  const int row0 = unit * R;
  q.head = row0 / HD;
  // the rotation's cos and sin (behind depth[t]: two dependent L2 round trips) are loaded before
  // the GEMM, so that they overlap it instead of ending the layer (the next attention waits for
  // this op)
  q.t = tid() / (R / 2), q.n = 2 * (tid() % (R / 2));
  q.d = row0 % HD + q.n;  // even: the pair (d, d+1) rotates together
  q.mine = tid() < 16 * (R / 2) && q.t < step_rows(b);
  q.cs = 1.f, q.sn = 0.f;
  if (q.mine && q.head < HQ + HKV) {
    const int pos = req_ctx(b, row_req(b, q.t)) + ldg_cgi(p.depth + q.t);  // L2: a verify tree op may write it in this launch
    q.cs = p.rope_cos[pos * (HD / 2) + q.d / 2];
    q.sn = p.rope_sin[pos * (HD / 2) + q.d / 2];
  }
  return q;
}
MK_DEV void qkv_end(Blk& b, int layer, const QkvRope& q, const Bf16Acc& acc) {
  const Params& p = *b.p;
  constexpr int R = TILE_QKV_ROWS;
  gemm_stash<R>(b, acc);
  if (q.mine) {
    const int t = q.t, d = q.d, head = q.head;
    const float r = norm_factor(b, t);
    float a = gemm_sum<R>(b, t, q.n) * r, c = gemm_sum<R>(b, t, q.n + 1) * r;
    if (head < HQ + HKV) {
      // each product and the sum rounded on its own (as the fp32 reference does): with the
      // compiler free to fuse a multiply into the add, moving this code changed the bits
      const float ra = fadd_rn(fmul_rn(a, q.cs), -fmul_rn(c, q.sn));
      const float rc = fadd_rn(fmul_rn(a, q.sn), fmul_rn(c, q.cs));
      a = ra;
      c = rc;
    }
    const uint32_t packed = pack_bf2(a, c);
    if (head < HQ) {
      *reinterpret_cast<uint32_t*>(p.q + (t * HQ + head) * HD + d) = packed;
    } else {
      const bool is_k = head < HQ + HKV;
      const int kvh = is_k ? head - HQ : head - HQ - HKV;
      // (the request's fields from shared memory here, not held in registers across the GEMM)
      const int r = row_req(b, t), seq = req_ctx(b, r) + t - req_row0(b, r);
      uint16_t* cache = p.kv[(layer * B_MAX + r) * 2 + (is_k ? 0 : 1)];
      const size_t off = (static_cast<size_t>(kvh) * cache_slots(layer) + cache_slot(layer, seq)) * HD + d;
      *reinterpret_cast<uint32_t*>(cache + off) = packed;
    }
  }
}
// The normed operand's panel (called by the GEMM before each panel's first chunk)
MK_DEV void qkv_stage(Blk& b, int layer, int panel, uint32_t what) {
  stage_normed(b, 0, ss_part(*b.p, 0), tag_of(TAG_ATTN_NORM, layer, 0), panel, what);
}

MK_DEV void run_qkv(Blk& b, int layer, int unit, uint32_t what) {
  const QkvRope q = qkv_begin(b, unit);
  auto stage = [&](int panel) { qkv_stage(b, layer, panel, what); };
  qkv_end(b, layer, q, gemm_bf16<TILE_QKV_ROWS, TILE_QKV_KC, D, NORM_KP>(b, what, stage));
}

}  // namespace mk

// compact (the verifier's step, after accept): the accepted path's K/V move to consecutive sequence
// indices (reference.KVCache.compact's rule). Path node path[i] was written at ctx_r + path[i] by
// this step's qkv; it belongs at ctx_r + i. Unit = (layer, kv head, request), u = (layer * HKV + kv
// head) * requests + request: the path's K and V rows of that head, every word read into registers
// before any is written, since a source row can be a later destination (path[i] = j for a j > i).
// Rows already in place (path[i] = i) are not moved. ctx_r is the step block's (read at launch
// start; `advance` writes it only after every compact unit). An inactive request (len 0) moves
// nothing.
#pragma once
#include "mk/block.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV void run_compact(Blk& b, int u) {
  const Params& p = *b.p;
  const int nreq = step_nreq(b);
  const int r = u % nreq, kvh = (u / nreq) % HKV, layer = u / (nreq * HKV);
  const int32_t* st = p.spec + r * SPEC_INTS;
  const int len = ldg_cgi(st + SPEC_LEN), ctx = req_ctx(b, r);
  constexpr int WORDS = HD / 2;  // 32-bit words of a K or V row of one head
  // element e: path row i = 1 + e / (2 WORDS), its K (0) or V (1) row, word e % WORDS
  constexpr int PER = ((T_MAX - 1) * 2 * WORDS + COMPUTE_THREADS - 1) / COMPUTE_THREADS;
  uint32_t v[PER];
  uint32_t* at[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int e = tid() + k * COMPUTE_THREADS, i = 1 + e / (2 * WORDS), w = e % WORDS;
    at[k] = nullptr;
    if (i < len) {
      const int src = ldg_cgi(st + SPEC_PATH + i);
      const bool moved = src != i;
      uint16_t* cache = p.kv[(layer * B_MAX + r) * 2 + (e / WORDS) % 2];
      const size_t row = static_cast<size_t>(kvh) * cache_slots(layer);
      if (moved) {
        v[k] = ldg_cg(cache + (row + cache_slot(layer, ctx + src)) * HD + 2 * w);
        at[k] = reinterpret_cast<uint32_t*>(cache + (row + cache_slot(layer, ctx + i)) * HD + 2 * w);
      }
    }
  }
  sync_compute();  // every source word read before any destination is written
#pragma unroll
  for (int k = 0; k < PER; ++k)
    if (at[k] != nullptr) *at[k] = v[k];
}

}  // namespace mk

// compact (the verifier's step, after accept): the accepted path's K/V move to consecutive sequence
// indices (reference.KVCache.compact's rule). Path node path[i] was written at ctx_r + path[i] by
// this step's qkv; it belongs at ctx_r + i. Unit = (layer, kv head, request), u = (layer * HKV + kv
// head) * requests + request: the path's K and V rows of that head, every word read into shared
// memory before any is written, since a source row can be a later destination (path[i] = j for a
// j > i). Rows already in place (path[i] = i) are not moved. ctx_r is the step block's (read at
// launch start; `advance` writes it only after every compact unit). An inactive request (len 0)
// moves nothing. Staged in the GEMMs' reduction buffer (free between units), not registers: an
// array per thread raised the whole kernel's register count.
#pragma once
#include "mk/block.cuh"
#include "mk/layers.cuh"

namespace mk {

MK_DEV void run_compact(Blk& b, int u) {
  const Params& p = *b.p;
  const int nreq = step_nreq(b);
  const int r = u % nreq, kvh = (u / nreq) % HKV, layer = u / (nreq * HKV);
  const int32_t* st = p.spec + r * SPEC_INTS;
  constexpr int WORDS = HD / 2;  // 32-bit words of a K or V row of one head
  // [T_MAX] the path row each destination row takes (-1: none), then the moved words: element e is
  // destination row i = 1 + e / (2 WORDS), its K (0) or V (1) row, word e % WORDS
  int* from = reinterpret_cast<int*>(b.red);
  uint32_t* words = reinterpret_cast<uint32_t*>(b.red) + T_MAX;
  static_assert((T_MAX + (T_MAX - 1) * 2 * WORDS) * 4 <= RED_BYTES, "compact's staging fits the reduction buffer");
  const int len = ldg_cgi(st + SPEC_LEN), ctx = req_ctx(b, r);
  if (tid() < T_MAX) {
    const int i = tid();
    int src = -1;
    if (i >= 1 && i < len) {
      src = ldg_cgi(st + SPEC_PATH + i);
      const bool moved = src != i;
      if (!moved) src = -1;
    }
    from[i] = src;
  }
  sync_compute();
  const size_t head = static_cast<size_t>(kvh) * cache_slots(layer);
  const int n = (len > 1 ? len - 1 : 0) * 2 * WORDS;
MK_COLD_LOOP
  for (int e = tid(); e < n; e += COMPUTE_THREADS) {
    const int src = from[1 + e / (2 * WORDS)];
    const uint16_t* cache = p.kv[(layer * B_MAX + r) * 2 + (e / WORDS) % 2];
    if (src >= 0) words[e] = ldg_cg(cache + (head + cache_slot(layer, ctx + src)) * HD + 2 * (e % WORDS));
  }
  sync_compute();  // every source word read before any destination is written
MK_COLD_LOOP
  for (int e = tid(); e < n; e += COMPUTE_THREADS) {
    const int i = 1 + e / (2 * WORDS);
    uint16_t* cache = p.kv[(layer * B_MAX + r) * 2 + (e / WORDS) % 2];
    if (from[i] >= 0) *reinterpret_cast<uint32_t*>(cache + (head + cache_slot(layer, ctx + i)) * HD + 2 * (e % WORDS)) = words[e];
  }
}

}  // namespace mk

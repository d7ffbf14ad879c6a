// accept (the verifier's step, after argmax; the first op of the step's last launch): request r's
// greedy walk (speculative.accept's rule). From the root, while the target's greedy token after the
// current node (argmax's out_tokens) is the token of one of the node's children, move to that child
// (the lowest such row: siblings carry different tokens, so at most one matches); the greedy token
// after the last node is the bonus. The path (rows relative to the request's first row, root
// first), its length and the bonus go to the speculative state. An active request (n_out < want,
// and room for a whole tree's tokens in `out`) appends the path's drafts and the bonus to its
// emitted tokens at out[n_out..]; `advance` counts them. An inactive one records len 0: compact and
// advance leave it alone. Unit = one request: the rows' tokens, parents and greedy tokens are
// staged in shared memory (one round trip), then thread 0 walks at most T_MAX nodes.
#pragma once
#include "mk/block.cuh"

namespace mk {

MK_DEV void run_accept(Blk& b, int r) {
  const Params& p = *b.p;
  // scratch in the GEMMs' reduction buffer (free between units): tokens, parents, greedy tokens, path
  int* s = reinterpret_cast<int*>(b.red);
  static_assert(4 * 16 * 4 <= RED_BYTES, "accept's scratch fits the reduction buffer");
  const int n = req_rows(b, r), row0 = req_row0(b, r);
  int32_t* st = p.spec + r * SPEC_INTS;
  if (tid() < n) {
    s[tid()] = ldg_cgi(p.tokens + row0 + tid());
    s[16 + tid()] = ldg_cgi(p.spec_tree + (row0 + tid()) * TREE_INTS + TREE_PARENT);
    s[32 + tid()] = ldg_cgi(p.out_tokens + row0 + tid());
  }
  sync_compute();
  if (tid() == 0) {
    int node = 0, len = 1;
    s[48] = 0;
MK_COLD_LOOP
    for (;;) {
      const int want = s[32 + node];
      int next = -1;
MK_COLD_LOOP
      for (int c = node + 1; c < n && next < 0; ++c)
        if (s[16 + c] == node && s[c] == want) next = c;
      if (next < 0) break;
      s[48 + len++] = next;
      node = next;
    }
    const int bonus = s[32 + node];
    const int n_out = ldg_cgi(st + SPEC_N_OUT);
    const bool active = n_out < ldg_cgi(st + SPEC_WANT) && n_out + n <= MAX_OUT;
MK_COLD_LOOP
    for (int i = 0; i < len; ++i) st[SPEC_PATH + i] = s[48 + i];
    st[SPEC_LEN] = active ? len : 0;
    st[SPEC_BONUS] = bonus;
    if (active) {
MK_COLD_LOOP
      for (int i = 1; i < len; ++i) st[SPEC_OUT + n_out + i - 1] = s[s[48 + i]];
      st[SPEC_OUT + n_out + len - 1] = bonus;
    }
  }
}

}  // namespace mk

// A routed slot's expert, token count and tensor scale, read once per slot instead of once per
// unit: a block runs consecutive units of the same slot (contiguous assignment), and each of
// these reads is an L2 round trip (the routing is written by another block in this launch).
#pragma once
#include "mk/block.cuh"
#include "mk/layers.cuh"

namespace mk {

struct SlotInfo {
  int expert, ntok;
  float tscale;
};

// Compute warps. Cached in shared memory under the operand tag of the slot (the tag changes
// exactly when the staged operand does); on a miss thread 0 reads and one barrier publishes.
// W2: the down projection's tensor scale, else gate/up's; gate/up also reads the slot's token
// list into MISC_ROWS in the same round trip (its operand is gathered by token: stage_gather_rows).
template <bool W2>
MK_DEV SlotInfo slot_info(Blk& b, int layer, int s, int tag) {
  int* info = b.misc + MISC_SLOT;
  if (b.misc[MISC_TAG] != tag) {  // the same value for every thread: written before the last barrier
    const Params& p = *b.p;
    if (!W2 && tid() < 16) b.misc[MISC_ROWS + tid()] = ldg_cgi(p.slot_tok + s * 16 + tid());
    if (tid() == 0) {
      const int e = ldg_cgi(p.slot_expert + s);
      info[0] = e;
      info[1] = ldg_cgi(p.slot_ntok + s);
      info[2] = static_cast<int>(f2u(W2 ? p.layers[layer].w2_ts[e] : p.layers[layer].w1_ts[e]));
    }
    sync_compute();
  }
  return SlotInfo{info[0], info[1], u2f(static_cast<uint32_t>(info[2]))};
}

// Loader warp: the expert's weight base of the last slot it streamed, in registers.
struct LoaderSlot {
  int layer = -1, slot = -1, expert = 0;
};
MK_DEV int loader_expert(const Blk& b, LoaderSlot& ls, int layer, int s) {
  if (ls.layer != layer || ls.slot != s) {
    ls.layer = layer;
    ls.slot = s;
    ls.expert = ldg_cgi(b.p->slot_expert + s);
  }
  return ls.expert;
}

}  // namespace mk

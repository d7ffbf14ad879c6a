// A routed slot's expert and token count, read once per slot instead of once per unit: a block
// runs consecutive units of the same slot (contiguous assignment), and each of these reads is an
// L2 round trip (the routing is written by another block in this launch). The expert's tensor
// scale is not read here: it depends on the expert (a second round trip before the barrier, on
// the unit's critical path), and only the epilogue needs it, so the ops load it per thread
// before their GEMM and wait for it after.
#pragma once
#include "mk/block.cuh"
#include "mk/layers.cuh"

namespace mk {

struct SlotInfo {
  int expert, ntok;
};

// Compute warps. Cached in shared memory under the operand tag of the slot (the tag changes
// exactly when the staged operand does); on a miss thread 0 reads and one barrier publishes.
// Gate/up (!W2) also reads the slot's token list into MISC_ROWS in the same round trip (its
// operand is gathered by token: stage_gather_rows).
template <bool W2>
MK_DEV SlotInfo slot_info(Blk& b, int s, int tag) {
  int* info = b.misc + MISC_SLOT;
  if (b.misc[MISC_TAG] != tag) {  // the same value for every thread: written before the last barrier
    const Params& p = *b.p;
    if (!W2 && tid() < 16) b.misc[MISC_ROWS + tid()] = ldg_cgi(p.slot_tok + s * 16 + tid());
    if (tid() == 0) {
      info[0] = ldg_cgi(p.slot_expert + s);
      info[1] = ldg_cgi(p.slot_ntok + s);
    }
    sync_compute();
  }
  return SlotInfo{info[0], info[1]};
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

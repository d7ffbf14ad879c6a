// A routed slot's expert and token count, read once per slot instead of once per unit: a block
// runs consecutive units of the same slot (contiguous assignment), and each of these reads is an
// L2 round trip (the routing is written by another block in this launch). They are read while
// thread 0 waits for the unit's dependencies, not after (program.cuh slot_fetch). The expert's
// tensor scale is not read here: it depends on the expert (a second round trip before the
// barrier, on the unit's critical path), and only the epilogue needs it, so the ops load it per
// thread before their GEMM and wait for it after.
#pragma once
#include "mk/block.cuh"
#include "mk/layers.cuh"

namespace mk {

struct SlotInfo {
  int expert, ntok;
};

// Compute warps: the slot record of the current unit, which warp 1 fetched before the barrier that
// started the unit (program.cuh slot_fetch).
MK_DEV SlotInfo slot_info(const Blk& b) {
  const int* info = b.misc + MISC_SLOT;
  return SlotInfo{info[0], info[1]};
}

// The routed slot of a routed op's unit group k (units k * tiles ..): k itself, or with
// Plan.expert_parallel the rank's k-th own slot (top-k's rank_slots), and the count of them
// (chain mode; mega mode reads it from top-k's counter)
MK_DEV int unit_slot(const Params& p, int k) {
  if constexpr (EXPERT_PARALLEL) return ldg_cgi(p.rank_slots + 1 + k);
  else return k;
}
// Plan.union_experts: the union's count, in group 0's block whatever group the reader is in. The
// union's ops run in group 0, but every group's MoE combine waits for all of the union's down
// projection units (program.cuh all_target -> n_units) while in its own group. Danger: read from the
// reader's block, another group's count is never written (0), its combine waits for nothing, and
// reads partials the union has not written yet wherever a block runs that group's combine units but
// none of group 0's (more blocks than combine units).
MK_DEV const int32_t* routed_count(const Blk& b) {
  return UNION_EXPERTS ? b.p0->u_nslots : EXPERT_PARALLEL ? b.p->rank_slots : b.p->n_slots;
}

// Loader warp: the expert's weight base of the last slot it streamed, in registers.
struct LoaderSlot {
  int layer = -1, slot = -1, expert = 0;
};
MK_DEV int loader_expert(const Blk& b, LoaderSlot& ls, int layer, int s) {
  if (ls.layer != layer || ls.slot != s) {
    ls.layer = layer;
    ls.slot = s;
    ls.expert = ldg_cgi((UNION_EXPERTS ? b.p->u_expert : b.p->slot_expert) + s);
  }
  return ls.expert;
}

}  // namespace mk

// Facts about layers and steps that several ops need, in one place (program.py mirrors them).
#pragma once
#include "mk/arch.cuh"

namespace mk {

MK_DEV bool is_global(int layer) { return (GLOBAL_MASK >> layer) & 1ull; }
MK_DEV int cache_slots(int layer) { return is_global(layer) ? MAX_CTX : RING_SLOTS; }
MK_DEV int cache_slot(int layer, int seq) { return is_global(layer) ? seq : seq % RING_SLOTS; }
// Keys of the prefix a layer attends to: all of it (global) or the window's W - 1 older ones.
MK_DEV int cached_keys(int layer, int ctx) { return is_global(layer) ? ctx : imin(ctx, WINDOW - 1); }
// Attention splits per kv head over its cached keys followed by the T new ones (program.py splits),
// of a global layer or a sliding one.
MK_DEV int attn_splits_of(bool glob, int ctx, int T) {
  return imax(1, imin(MAX_SPLITS, cdiv((glob ? ctx : imin(ctx, WINDOW - 1)) + T, KEYS_PER_SPLIT)));
}
MK_DEV int attn_splits(int layer, int ctx, int T) { return attn_splits_of(is_global(layer), ctx, T); }

// What abuf holds (gemm.cuh staging functions skip re-staging the same operand).
enum TagKind : int { TAG_ATTN_NORM = 1, TAG_FFN_NORM, TAG_ATT_OUT, TAG_Z, TAG_FINAL_NORM, TAG_EXP1, TAG_EXP2 };
MK_DEV int tag_of(int kind, int layer, int slot) { return (kind << 24) | (layer << 12) | slot; }

}  // namespace mk

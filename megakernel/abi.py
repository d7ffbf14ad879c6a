"""The kernel's parameter block and its step block, defined once here: rendered into C++
(`render_structs`) and packed from Python (`pack`, `pack_step`), so the two sides cannot drift apart.

Every Params field is a pointer (8 bytes) or a 32-bit int; C++ sees the typed pointer written
below. The kernel reads the block through a pointer to device memory (the host emulation through a
host pointer), so the layout is the natural C layout of these fields in order.

The step block (`Params.step`, int32 words, STEP_FIELDS) is the shape of one step: its token rows,
its requests, each request's cached positions and first row. It lives in device memory, not in
launch parameters, so a CUDA graph replays any step of the same program and a device loop can
advance it (the speculative step's `advance` op writes each request's ctx). Per-row arrays (tokens,
depth, anc, row_req) stay Params pointers of their own.

The speculative step's state (`Params.spec`, int32 words, SPEC_FIELDS per request, SPEC_INTS apart)
is shared by the drafter's engine and the verifier's (megakernel/decode.py): each request's root,
how many tokens it wants, how many it has emitted and the emitted tokens themselves, the last
step's accepted path, and the counts of its acceptance lengths. Only device ops write it during a
run (`accept`, `advance`); the host writes it before and reads it after.
"""
from __future__ import annotations

import ctypes

LAYER_FIELDS = (
    ("attn_norm", "const uint16_t*"),  # [D] bf16
    ("wqkv", "const uint16_t*"),  # [QKV_ROWS][D], tiled (tiling.py) like the dense weights below
    ("wo", "const uint16_t*"),  # [D][ATT_W], tiled
    ("ffn_norm", "const uint16_t*"),  # [D]
    ("router", "const uint16_t*"),  # [E][D], tiled
    ("pool", "const uint16_t*"),  # [P][D], tiled
    ("unpool", "const uint16_t*"),  # [D][P], tiled
    ("w1_codes", "const uint8_t*"),  # [E][2F][P/2]
    ("w1_scales", "const uint8_t*"),  # [E][2F][P/16]
    ("w1_ts", "const float*"),  # [E]
    ("w2_codes", "const uint8_t*"),  # [E][P][F/2]
    ("w2_scales", "const uint8_t*"),  # [E][P][F/16]
    ("w2_ts", "const float*"),  # [E]
)

PARAM_FIELDS = (
    ("layers", "const LayerPtrs*"),
    ("embed", "const uint16_t*"),  # [V][D]
    ("final_norm", "const uint16_t*"),
    ("lm_head", "const uint16_t*"),  # [V][D], tiled
    ("rope_cos", "const float*"),  # [MAX_CTX][HD/2]
    ("rope_sin", "const float*"),
    ("program", "const int32_t*"),  # op instances, OPINST_INTS each
    ("step", "int32_t*"),  # [STEP_INTS] the step's shape (STEP_FIELDS); spec programs' `advance` writes ctx
    ("kv", "uint16_t* const*"),  # [L][B_MAX][2] request r's K (0) and V (1) cache of a layer, [HKV][slots][HD]
    ("tokens", "int32_t*"),  # [T_MAX] per row (spec programs: written by their seed / tree op)
    ("depth", "int32_t*"),  # [T_MAX] per row: depth in its request's tree
    ("anc", "uint32_t*"),  # [T_MAX] per row: bit j: row row0 + j of its request is an ancestor or itself
    ("row_req", "const int32_t*"),  # [T_MAX] per row: its request
    ("route_override", "const int32_t*"),  # [L][T_MAX][TOPK] or null
    ("x", "float*"),  # [T_MAX][D] residual stream
    ("ss_part", "float*"),  # [2][T_MAX][D/8] sums of squares of x per 8 features (gemm.cuh ss8)
    ("xg", "uint16_t*"),  # [2][D/NORM_KP][T_MAX][NORM_KP+8] bf16(x * the next norm's gain) (gemm.cuh xg_at)
    ("q", "uint16_t*"),  # [T_MAX][HQ][HD]
    ("att_o", "float*"),  # [HKV][PARTS][G*16][HD]
    ("att_ml", "float*"),  # [HKV][PARTS][G*16][2]
    ("att_out", "uint16_t*"),  # [T_MAX][ATT_W]
    ("router_logits", "float*"),  # [T_MAX][E]
    ("route_sel", "int32_t*"),  # [T_MAX][TOPK]
    ("route_w", "float*"),  # [T_MAX][TOPK]
    ("route_slot", "int32_t*"),  # [T_MAX][TOPK]
    ("route_pos", "int32_t*"),  # [T_MAX][TOPK]
    ("slot_expert", "int32_t*"),  # [MAX_SLOTS]
    ("slot_ntok", "int32_t*"),  # [MAX_SLOTS]
    ("slot_tok", "int32_t*"),  # [MAX_SLOTS][16]
    ("n_slots", "int32_t*"),  # [1]
    ("pooled", "uint16_t*"),  # [T_MAX][P]
    ("act", "uint16_t*"),  # [MAX_SLOTS][16][F]
    ("yexp", "uint16_t*"),  # [MAX_SLOTS][16][P]
    ("ypart", "float*"),  # Plan.fused_experts: [MAX_SLOTS][EXP2_TILES][16][P] down-projection partials
    ("z", "uint16_t*"),  # [T_MAX][P]
    ("logits", "float*"),  # [T_MAX][V]
    ("amax_val", "float*"),  # [V/16][T_MAX]
    ("amax_idx", "int32_t*"),  # [V/16][T_MAX]
    ("amax_val2", "float*"),  # [V/16][T_MAX] each LM-head unit's second best per row (the top-2)
    ("amax_idx2", "int32_t*"),  # [V/16][T_MAX]
    ("out_tokens", "int32_t*"),  # [T_MAX]
    ("top2", "int32_t*"),  # [T_MAX][2] the two best tokens per row by (logit desc, index asc)
    ("spec", "int32_t*"),  # [n_req][SPEC_INTS] the speculative step's state (SPEC_FIELDS), or null
    ("spec_top2", "const int32_t*"),  # verify: the drafter's top2 (its rows), the `tree` op's input
    ("spec_seed", "const int32_t*"),  # draft: [V][SEED_COLS] succ_d^j(v), the `seed` op's table
    ("spec_tree", "const int32_t*"),  # verify: [T_MAX][TREE_INTS] each row's node of its request's tree
    ("counters", "uint32_t*"),  # [2][n_counters]
    ("watchdog", "unsigned long long*"),  # [WD_FIELDS]
    ("n_counters", "int32_t"),
    # ranks (Plan.launch_ranks, tp_ranks): each rank has its own parameter block; a launch of several
    # ranks gets them in rank order and each block picks its rank's (megakernel.cu)
    ("rank", "int32_t"),  # this block's TP rank (0 without TP)
    ("recv", "unsigned char*"),  # TP: this rank's receive slots (Plan.recv_layout), in its own memory
    ("peers", "unsigned char* const*"),  # TP: [tp_ranks] every rank's receive slots as this rank addresses them
    ("rank_slots", "int32_t*"),  # TP expert_parallel: [1 + MAX_SLOTS] this rank's slot count, then its slots
    # Plan.union_experts (row groups): every group's top-k writes its expert_slot; the union tables
    # are group 0's (ops/topk.cuh union_build), and its pooled / yexp are every group's, stacked
    ("n_active", "int32_t"),  # the step's row groups (1 without groups)
    ("expert_slot", "int32_t*"),  # [E] this group's slot of each expert, -1: not routed
    ("u_nslots", "int32_t*"),  # [1] union slots
    ("u_expert", "int32_t*"),  # [MAX_USLOTS]
    ("u_ntok", "int32_t*"),  # [MAX_USLOTS] 1..16
    ("u_row", "int32_t*"),  # [MAX_USLOTS][16] g * T_MAX + row: its pooled row in the stacked pooled
    ("u_dst", "int32_t*"),  # [MAX_USLOTS][16] (g * MAX_SLOTS + s) * 16 + position: its row in the stacked yexp
)


# Requests of one step: at most one per token row (a request has >= 1 row, rows <= T_MAX <= 16).
B_MAX = 16
# The step block, in order: (name, int32 words). rows: token rows of the step (1..T_MAX), the
# requests' trees concatenated; n_req: requests (1..B_MAX); ctx[r]: request r's cached positions
# before this step; row0[r]: its first row (row0[n_req] = rows). Words past n_req are unused.
STEP_FIELDS = (("rows", 1), ("n_req", 1), ("ctx", B_MAX), ("row0", B_MAX + 1))


def step_offsets() -> dict[str, int]:
    """Word offset of each STEP_FIELDS entry."""
    out, at = {}, 0
    for name, n in STEP_FIELDS:
        out[name] = at
        at += n
    return out


STEP_INTS = sum(n for _, n in STEP_FIELDS)


def pack_step(ctx: list[int], n_rows: list[int]) -> list[int]:
    """The step block of requests with these cached positions and row counts (int32 words)."""
    if not 1 <= len(ctx) == len(n_rows) <= B_MAX:
        raise ValueError(f"{len(ctx)} requests with {len(n_rows)} row counts: want 1..{B_MAX} of each")
    o = step_offsets()
    w = [0] * STEP_INTS
    w[o["rows"]] = sum(n_rows)
    w[o["n_req"]] = len(ctx)
    at = 0
    for r, (c, n) in enumerate(zip(ctx, n_rows)):
        w[o["ctx"] + r] = int(c)
        w[o["row0"] + r] = at
        at += int(n)
    w[o["row0"] + len(ctx)] = at
    return w


# The speculative step's state of one request, in order: (name, int32 words). root: the last emitted
# token, the next tree's root (its K/V not cached yet); want: tokens the run asks for (the request
# is active while n_out < want: an inactive request's steps emit and move nothing); n_out: tokens
# emitted so far; len: the last step's accepted path length, root included (= tokens it emitted; 0
# when the request was inactive); bonus: the last step's bonus token; path: the accepted nodes
# (rows relative to the request's first row, root first); hist[a]: steps that emitted a tokens;
# out: the emitted tokens. Written by the host before a run and by `accept` / `advance` during it.
MAX_OUT = 2048  # emitted tokens a request holds: a run asks for at most MAX_OUT - T_MAX of them
SPEC_FIELDS = (("root", 1), ("want", 1), ("n_out", 1), ("len", 1), ("bonus", 1), ("path", 16), ("hist", 17),
               ("out", MAX_OUT))
SPEC_INTS = sum(n for _, n in SPEC_FIELDS)
# The verify tree's shape per row (Params.spec_tree), in order: the node's parent (a row relative
# to its request's first row; -1 for the root), depth, rank (0: the drafter's top-1 at that depth,
# 1: its top-2) and ancestor mask (bit j: row j of the request is an ancestor or itself)
TREE_FIELDS = (("parent", 1), ("depth", 1), ("rank", 1), ("anc", 1))
TREE_INTS = sum(n for _, n in TREE_FIELDS)
# The drafter's seed table (Params.spec_seed): row v holds succ_d^j(v) for j = 0..SEED_COLS-1, so a
# draft row's token is one load instead of the end of a chain of j dependent ones
SEED_COLS = 16


def spec_offsets() -> dict[str, int]:
    """Word offset of each SPEC_FIELDS entry within a request's state."""
    return _offsets(SPEC_FIELDS)


def tree_offsets() -> dict[str, int]:
    return _offsets(TREE_FIELDS)


def _offsets(fields) -> dict[str, int]:
    out, at = {}, 0
    for name, n in fields:
        out[name] = at
        at += n
    return out


def _ctype(c: str):
    return ctypes.c_int32 if c == "int32_t" else ctypes.c_uint64


class LayerPtrs(ctypes.Structure):
    _fields_ = [(n, _ctype(t)) for n, t in LAYER_FIELDS]


class Params(ctypes.Structure):
    _fields_ = [(n, _ctype(t)) for n, t in PARAM_FIELDS]


def render_structs() -> str:
    off = step_offsets()
    out = ["namespace mk {", f"constexpr int B_MAX = {B_MAX};  // requests of one step (abi.py)",
           "// the step block's words (abi.py STEP_FIELDS)"]
    out += [f"constexpr int STEP_{n.upper()} = {off[n]};" for n, _ in STEP_FIELDS]
    out += [f"constexpr int STEP_INTS = {STEP_INTS};", "// the speculative state's words per request (abi.py SPEC_FIELDS)"]
    out += [f"constexpr int SPEC_{n.upper()} = {o};" for n, o in spec_offsets().items()]
    out += [f"constexpr int SPEC_INTS = {SPEC_INTS}, MAX_OUT = {MAX_OUT};",
            "// a verify tree row's words (abi.py TREE_FIELDS) and the drafter's seed table's columns"]
    out += [f"constexpr int TREE_{n.upper()} = {o};" for n, o in tree_offsets().items()]
    out += [f"constexpr int TREE_INTS = {TREE_INTS}, SEED_COLS = {SEED_COLS};", "struct LayerPtrs {"]
    out += [f"  {t} {n};" for n, t in LAYER_FIELDS]
    out += ["};", f"static_assert(sizeof(LayerPtrs) == {ctypes.sizeof(LayerPtrs)}, \"abi.py LayerPtrs\");",
            "struct Params {"]
    out += [f"  {t} {n};" for n, t in PARAM_FIELDS]
    out += ["};", f"static_assert(sizeof(Params) == {ctypes.sizeof(Params)}, \"abi.py Params\");", "}  // namespace mk"]
    return "\n".join(out) + "\n"


def pack(struct: ctypes.Structure) -> bytes:
    return ctypes.string_at(ctypes.addressof(struct), ctypes.sizeof(struct))

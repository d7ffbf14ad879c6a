"""Build constants: the model config and the tuned constants turned into one frozen Plan, and
the Plan rendered into the kernel source as `constexpr` with `static_assert`s.

Everything the CUDA side knows about shapes, tiles, the ring and the op table comes from here
(`render()`); nothing is typed twice. The cache key of the compiled kernel covers the rendered
text, so a changed constant recompiles.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from . import fp4_layout
from .config import ModelConfig

# op kinds, in the order they run inside a layer (the C++ enum is rendered from this tuple)
OP_KINDS = ("embed", "qkv", "attn", "attn_combine", "oproj", "router", "pool", "topk", "expert1", "expert2",
            "moe_combine", "unpool", "lm_head", "argmax")
OP = {k: i for i, k in enumerate(OP_KINDS)}
WARPS = 8  # compute warps per block (one mma m16 row tile of tokens each)
LOADER_WARPS = 1  # the weight-streaming warp (ring producer)
THREADS = 32 * (WARPS + LOADER_WARPS)  # the default block; Plan.threads is the plan's
# Plan.compute_registers: setmaxnreg moves registers between whole warpgroups (4 warps), so a
# split block is three: the compute warps' two and the loader's (the loader and 3 warps that only
# give their registers back). 12 warps get the same 168 registers each as 9 at one block per SM
# (65,536 / 384, down to a multiple of 8).
BASE_REGISTERS = 168
SPLIT_THREADS = 32 * (WARPS + 4)
ROW_PAD = 16  # bytes of padding per staged row: spreads rows over banks for the fragment loads
PROF_OPS = 16  # block.cuh: the profiler's deferred op-stamp slots (in MISC; rendered)
MISC_SCRATCH = 58  # block.cuh: the first MISC int of top-k's scratch, past the fixed slots (rendered)
# Expert units: fewer, larger units pay the per-unit overhead (barriers, epilogue, signal) less
# often; the tail (a block's last unit) grows. shard8 T=16 step, H200 2026-11-29: gate/up 64 -> 128
# rows -2.4%, down 128 -> 256 rows -1.5%, each alone (both: 10.92 ms from 11.34); down 64 rows +2.4%.
# (16 + 16 gate/up rows spent ~15% of the op in per-unit barriers; 32-row down units a third.)
EXPERT1_ROWS = 128  # gate/up unit: 64 gate + the 64 matching up rows
EXPERT2_ROWS = 256  # down-projection unit
MOE_COMBINE_COLS = 16  # moe_combine unit: one output per thread (64 columns took 4 dependent L2 round trips)
DENSE_ROWS = 16  # qkv / oproj / pool / unpool unit rows: 8 spent ~2.5 us of per-unit overhead per 16 KB (oproj, 2026-11-29)
ROUTER_ROWS = 8  # the router stays at 8: top-k waits for it, and 32 units spread it over 32 blocks
# Plan.attn_heads: keys a block stages per round, one n8 tile of keys per compute warp
# (attention.cuh run_attn_head)
ATTN_HEAD_KEYS = 8 * WARPS
MIN_CHUNK_COLS = 64  # the narrowest bf16 weight chunk _tile accepts


def pool_rows(cfg: ModelConfig, n_sm: int, stage_budget: int) -> int:
    """Pooler unit rows: DENSE_ROWS, or twice that where only then the router's and the pooler's
    units fit the grid side by side (program.pool_rotation puts them on different blocks). Top-k
    waits for the router, expert GEMM 1 for top-k and the pooler: a block that runs a pool unit
    after its router unit delays every expert. shard8 on 132 SMs (32 router + 128 pool units), H200
    profile 2026-11-29: the pool units behind the router ended ~6 us after top-k, and expert GEMM 1
    started after them. The larger unit needs a stage of at least MIN_CHUNK_COLS of its columns."""
    r, big = cfg.n_experts // ROUTER_ROWS, 2 * DENSE_ROWS
    if r + cfg.d_pool // DENSE_ROWS > n_sm and r + cfg.d_pool // big <= n_sm and cfg.d_pool % big == 0 \
            and big * MIN_CHUNK_COLS * 2 <= stage_budget:
        return big
    return DENSE_ROWS


def residual_rows(cfg: ModelConfig, n_sm: int, stage_budget: int) -> int:
    """oproj / unpool unit rows (d_model outputs each): DENSE_ROWS, or twice that where the grid
    does not hold every DENSE_ROWS unit at once. A block's second unit costs a whole epilogue and
    unit boundary: shard8 on 132 SMs (256 units, 124 blocks with two), H200 detail trace 2026-11-30
    12:05Z, 3.1 us between oproj's two units' chunks against ~0.9 us between two chunks of one unit,
    2.5 us in unpool. 32 rows against 16 there, in-run A/B, H200 2026-11-30 13:25-13:27Z (two calls,
    each build twice): shard8 T=16 -1.1 to -1.6%, T=1 -2.9 to -3.3%, 9.6 KB more code. The larger
    unit needs a stage of at least MIN_CHUNK_COLS of its columns."""
    big = 2 * DENSE_ROWS
    if cfg.d_model // DENSE_ROWS > n_sm and cfg.d_model % big == 0 and big * MIN_CHUNK_COLS * 2 <= stage_budget:
        return big
    return DENSE_ROWS


def expert1_unit_rows(cfg: ModelConfig, n_sm: int, tokens: int) -> int:
    """Gate/up unit rows to try first (_expert_tile halves them while a chunk does not fit the stage):
    twice EXPERT1_ROWS where even then a step of `tokens` tree tokens, at most tokens x top_k distinct
    experts, has units for two rounds of the grid, else EXPERT1_ROWS. Half the units pay half the
    per-unit barriers, epilogues and signals. In-run A/B, H200 2026-11-30 13:31Z, same bits:
    256 rows shard8 T=16 -3.59%, small T=16 -2.04%, but shard8 T=1 +3.86% (64 units on 132 SMs
    where 128 rows give 128)."""
    big = 2 * EXPERT1_ROWS
    return big if cfg.max_distinct_experts(tokens) * (2 * cfg.d_expert // big) >= 2 * n_sm else EXPERT1_ROWS


def expert2_unit_rows(cfg: ModelConfig, n_sm: int, tokens: int) -> int:
    """Down-projection unit rows to try first: EXPERT2_ROWS, or half where a step of `tokens` tree
    tokens (at most tokens x top_k distinct experts) would not have a unit for every block at
    EXPERT2_ROWS (shard8 T=1: 64 units on 132 SMs). In-run A/B, H200 2026-11-30 13:36Z, same bits:
    128 rows against 256 at T=1, shard8 -2.6%, small -2.4% (its duplicate build -1.3%)."""
    fills = cfg.max_distinct_experts(tokens) * (cfg.d_pool // EXPERT2_ROWS) >= n_sm
    return EXPERT2_ROWS if fills else EXPERT2_ROWS // 2


EXPERT_MIN_ROWS = 32  # the smallest expert unit: 16 gate + 16 up rows (a row tile never mixes them)
EXPERT_MAX_ROWS = 2 * 16 * WARPS  # gemm_fp4: at most two 16-row tiles per compute warp
# An fp4 chunk's columns: the kernel's copy of the expert banks is stored in blocks of this many
# columns of all rows (tiling.tile_fp4_*), one copy per model that every build reads (T=1 and T=16
# builds alike: a second copy of shard8's ~54 GB of banks does not fit beside the first), so the
# chunk width is the model's, not the unit's: 256 columns (128-byte code rows, which the 8-row
# swizzle spreads over all banks) or the largest power of two dividing K below that.
FP4_KC = 256
FP4_MIN_KC = 64  # whole pairs of k32 steps (one code ldmatrix.x4 brings two)


def fp4_kc(k: int) -> int:
    """The chunk (and storage block) columns of an fp4 matrix of K columns."""
    kc = FP4_KC
    while k % kc:
        kc //= 2
    if kc < FP4_MIN_KC:
        raise ValueError(f"fp4 K={k}: no chunk of >= {FP4_MIN_KC} columns divides it")
    return kc


def _expert_tile(cap: int, k: int, budget: int, paired: bool) -> GemmTile:
    """The largest expert unit, from `cap` rows halving down to EXPERT_MIN_ROWS, whose chunk
    (fp4_kc(k) columns of all its rows) fits the stage budget; refused when even the smallest does
    not. paired: gate/up, half the rows gate rows (a 16-row tile is all gate or all up rows)."""
    kc = fp4_kc(k)

    def need(r: int) -> int:  # a chunk's bytes: codes and scales of r rows
        return GemmTile(r, kc, k, True).stage_bytes

    rows = min(cap, EXPERT_MAX_ROWS)
    while need(rows) > budget and rows // 2 >= EXPERT_MIN_ROWS:
        rows //= 2
    if need(rows) > budget:
        from microbench.errors import KernelDoesNotFitError

        raise KernelDoesNotFitError(
            f"expert unit of {rows} rows x {kc} columns of K={k}: a chunk needs {need(rows)} B, the ring "
            f"stage holds {budget} B of fp4 weights")
    if paired and (rows // 2) % 16:
        raise ValueError(f"gate/up unit of {rows} rows: {rows // 2} gate rows are not whole 16-row tiles")
    return GemmTile(rows, kc, k, True, min(fp4_layout.SWIZZLE_MAX, kc // 32))


FUSED_PASS_ROWS = 2 * 16 * WARPS  # gemm.cuh gemm_fp4_down: two 16-row tiles per compute warp per pass


def fuses_experts(cfg: ModelConfig) -> bool:
    """Whether the model's shapes allow the fused expert unit (Plan.fused_experts): d_pool in whole
    passes of gemm_fp4_down (make_plan also needs a gate/up unit's gate rows in whole k32 steps)."""
    return cfg.d_pool % FUSED_PASS_ROWS == 0 and cfg.d_expert % 32 == 0


def _fused_down_tile(c: ModelConfig, h1: int, budget: int) -> GemmTile:
    """Plan.fused_experts: the down projection's chunk, `rows` rows of d_pool over one gate/up
    unit's h1 columns of K = d_expert (the kernel's copy of W2 in blocks of h1 columns); the rows
    are the most, a multiple of 256 (two 16-row tiles per warp per pass, gemm_fp4_down) dividing
    d_pool, whose chunk fits `budget` (the largest of the other ops' chunks)."""
    if h1 % 32 or c.d_pool % FUSED_PASS_ROWS:
        raise ValueError(f"fused_experts: needs gate rows per unit ({h1}) a multiple of 32 and d_pool "
                         f"({c.d_pool}) a multiple of {FUSED_PASS_ROWS}")
    rows = FUSED_PASS_ROWS
    while c.d_pool % (2 * rows) == 0 and GemmTile(2 * rows, h1, c.d_expert, True).stage_bytes <= budget:
        rows *= 2
    t = GemmTile(rows, h1, c.d_expert, True, min(fp4_layout.SWIZZLE_MAX, h1 // 32))
    if t.stage_bytes > budget:
        from microbench.errors import KernelDoesNotFitError

        raise KernelDoesNotFitError(f"fused_experts: a down-projection chunk of {rows} rows x {h1} columns needs "
                                    f"{t.stage_bytes} B, the ring stage holds {budget} B of fp4 weights")
    return t


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


@dataclass(frozen=True)
class GemmTile:
    """One unit = `rows` output features over all of K, streamed in chunks of `kc` columns of all
    `rows` rows (one ring stage each).

    bf16 (dense): a chunk is rows of kc bf16, padded in smem against bank conflicts; the weights are
    stored tiled (tiling.tile_dense), so a chunk is one bulk copy.
    fp4 (expert): a chunk is the rows' kc/2 code bytes, then their kc/16 E4M3 scale bytes; the
    kernel's copy of the codes and scales is stored in blocks of kc columns of all rows
    (tiling.tile_fp4_*), so a run of consecutive rows is one bulk copy (a gate/up unit's chunk is
    two runs). kc is the model's (fp4_kc), the rows the build's. Each compute warp owns whole
    16-row tiles over all of K (gemm.cuh gemm_fp4), so no warp's partial sum meets another's.
    Code rows kc/2 bytes apart would put the 8 rows of a code ldmatrix on the same banks: they are
    stored swizzled, 16-byte unit u of row r at u ^ (r % swizzle) (fp4_layout.swizzle_units), and
    each row's scales in two planes, one per k16 half (fp4_layout.scale_planes), so a thread loads
    only the bytes of its half.
    """

    rows: int
    kc: int
    k: int
    fp4: bool
    swizzle: int = 0  # fp4: the code rows' 16-byte unit swizzle period (min(8, kc / 32))
    rotated: bool = False  # fp4: the kernel's codes are device words (fp4_layout.ROT_PAIRS; Plan.fp4_rotated)

    @property
    def chunks(self) -> int:
        return self.k // self.kc

    @property
    def row_stride(self) -> int:
        """smem bytes per staged row: kc bf16 and the pad (bf16), kc/2 code bytes (fp4)."""
        return self.kc // 2 if self.fp4 else self.kc * 2 + ROW_PAD

    @property
    def stage_bytes(self) -> int:
        return self.rows * (self.row_stride + (self.kc // 16 if self.fp4 else 0))


def _tile(rows: int, k: int, stage_budget: int) -> GemmTile:
    """bf16: the widest power-of-two chunk whose bytes fit the stage budget and divides K."""
    kc = min(_pow2_floor(int(stage_budget / (rows * 2.0))), k)
    while k % kc:
        kc //= 2
    if kc < MIN_CHUNK_COLS:
        raise ValueError(f"chunk of {kc} columns for K={k}: too narrow")
    return GemmTile(rows, kc, k, False)


@dataclass(frozen=True)
class Plan:
    cfg: ModelConfig
    n_sm: int
    ring_stages: int
    ring_stage_bytes: int  # budget per stage (tuned); actual stage size = max over tiles
    spin_bound_ns: int
    poll_backoff_ns: int
    # keys per attention split: 256 left 8 SMs doing a shard8 layer's attention (41 us, H200 profile);
    # 64 -> 48: shard8 T=16 -0.43%, T=1 -0.74%, small T=16 -0.08%; 32: +0.65% / -0.18% / +0.47%
    # (in-run A/B, H200 2026-11-30 05:53Z), because a split still scored a whole 64-key round.
    # 48 -> 32 with attention skipping the sub-blocks past a split's run: -0.35% / -2.36% / -0.50%
    # (24: +0.38 / -1.87 / -0.47%, 16: +2.39 / -1.47 / +2.88%; without the skip 32 was +0.63 /
    # -0.41 / +0.91%; a 1 KB layout placebo -0.04 / +0.18 / +0.68%; H200 2026-12-01 00:19Z)
    keys_per_split: int = 32
    profile: bool = False
    # performance techniques (issue: megakernel performance), each a build constant so its
    # contribution can be measured; every combination computes the same bits
    loader_ahead: bool = True  # the loader streams the next op's weights before this op ends
    pdl: bool = False  # programmatic dependent launch between the step's launches
    l2_prefetch_bytes: int = 0  # per block: next launch's weights pulled into L2 (0 = off)
    # the ring's weight copies carry an L2 evict-first hint (arch.cuh bulk_copy); plan_for takes it
    # from the tuned constant evict_first_pays (weights.l2). shard8 T=16 step -7.5% on the H200,
    # in-run A/B 2026-11-29 (10.63 -> 9.83 ms)
    stream_evict_first: bool = False
    # top-k reads the router logits as sentinel slots (empty = -0.0, mb/sentinel.cuh): no counter,
    # no release fence on the router blocks, no acquire on top-k's block; top-k resets them.
    # plan_for takes it from the tuned constant sentinel_pays (sync.publish)
    sentinel_route: bool = False
    # per block and layer: the weights of the expert units this block would run if the layer routed
    # as in the previous step, pulled into L2 as the loader enters the layer (0 = off)
    hot_prefetch_bytes: int = 0
    # the loader pulls into L2 the cached KV rows its block's units of the layer's attention read,
    # as it enters the layer (program.cuh kv_prefetch)
    kv_prefetch: bool = False
    # the step's launches also wait for their dependencies on earlier launches (program.build drops
    # them: stream order, and PDL's griddepcontrol.wait, have them done); for the A/B only
    launch_waits: bool = False
    # bytes of never-run code placed ahead of the kernel's body (megakernel.cu): a code-layout
    # placebo for A/Bs, the same work with every later instruction at another address
    layout_pad: int = 0
    # bytes of never-run code in the middle of the ops' code (program.cuh run_unit, expert GEMM
    # 1's case): a placebo that moves the code after it against the code before it, as an edit in
    # the middle of the kernel does (layout_pad moves all of it together)
    layout_gap: int = 0
    # the layer's dense bf16 ops (qkv, oproj, router, pool, unpool): 0 each its own GEMM code, shaped
    # at compile time; 1 through one copy of the GEMM, its staging, ring waits and loader code,
    # shaped at run time by the op's kind (ops/dense.cuh): one copy warm after the layer's first
    # dense op instead of five fetched cold; 2 (the A/B's control for 1) each op its own copy of
    # that runtime-shaped code (gemm.cuh gemm_bf16, produce_bf16; lm_head's too): 1's instructions
    # at 0's code footprint. Measured (H200 2026-12-02 17:18Z, shard8 T=16): 1 +4.2%, 2 +1.6%
    # slower than 0, so 0 stays (reports/results/megakernel/ab-shared-dense-20261202T1718Z-9dc5fb1.md)
    shared_dense: int = 0
    # attention by q head (issue 48: fewer dependent hops): a unit is one q head over one run of
    # the keys, and the last unit of a head to finish (a ticket counter) merges the head's
    # partials itself (attention.cuh run_attn_head), so the separate combine op and its hop go.
    # Splits per head: at most n_sm // n_heads (one round of units on the grid). False: units of
    # a kv head's G q heads, merged by the attn_combine op
    attn_heads: bool = False
    # a fused expert unit: the down projection's unit j of a slot is the K-part of gate/up unit j
    # (its H1 columns of W2, all d_pool rows, in chunks of tiles["expert2"].rows rows), run by the
    # block that ran gate/up unit j (program.DEP_LOCAL), writing fp32 partials the MoE combine
    # sums in a fixed order: no gate/up groups, no waits between the two GEMMs
    fused_experts: bool = False
    # fused: gate/up units whose activations a block keeps in shared memory, in the down
    # projection's staged layout, so that its unit of the same index stages nothing (make_plan:
    # as many as the spare shared memory holds, up to KEEP_MAX)
    keep_units: int = 0
    profile_cap: int = 64  # profiler records per block per launch
    # the profiler also stamps inside units (staging, ring waits: profile_events.DETAIL_PHASES);
    # several stamps per weight chunk, so more overhead than the op phases alone
    profile_detail: bool = False
    # the kernel's copy of the expert codes is in device words (fp4_layout.ROT_PAIRS: 9 SASS per
    # code word to decode instead of 10, fewer of them on the ALU pipe; GemmTile.rotated, the
    # engine keeps the copy: tiling.tile_fp4). Same values, same bits. In-run A/B (H200
    # 2026-11-30 11:49Z, 5 rounds): small T=16 -0.51%, T=1 -1.65%; shard8 without the swizzle
    # (two codes copies of shard8 do not fit beside its bank) T=16 -1.22%, T=1 -0.16%
    fp4_rotated: bool = True
    # The normed operand of the d_model-K projections (qkv, router, pool, lm_head) is staged in
    # panels of this many columns (0 = all of d_model at once), so that abuf need not hold 16 rows
    # of d_model and its bytes can go to the ring (make_plan fill_ring)
    norm_panel: int = 0
    # registers a thread may use (0: what the launch bounds give 9 warps, 168). A/Bs only: a lower
    # cap makes the same code spill (megakernel.cu MK_MAX_REGISTERS), so a spill's cost can be
    # measured without another source
    max_registers: int = 0
    # per-role register budgets (0 = off: 9 warps of 168). N: a 12-warp block whose compute warps
    # raise their budget to N registers (setmaxnreg.inc) with what the loader's warpgroup gives
    # back (setmaxnreg.dec to loader_registers); ptxas allocates each role's code to its budget
    compute_registers: int = 0
    # technique 1's "dedicated warps for receives": one of the loader warpgroup's spare warps
    # (needs compute_registers) waits, op by op and ahead of the compute warps, for each op's
    # "all" dependencies and counts the ops it passed in shared memory, which thread 0 waits on
    # instead of polling the counters in L2 itself (program.cuh receive_loop)
    receive_warp: bool = False
    # the loader bets that a layer routes as in the previous step (top-k's bitmap in hot_experts)
    # and, before it waits for this layer's routing, copies the first this-many chunks of the
    # gate/up units it would then run into its free ring stages (at most ring_stages), while the
    # front's dependent chain leaves HBM idle; the exact routing decides: a chunk that matches is
    # released to the compute warps as it is, one that does not is copied again (program.cuh
    # prestage_issue / prestage_settle). 0 = off
    prestage_experts: int = 0
    # A/Bs only: the bet is on the expert after each one the bitmap holds, so every prestaged chunk
    # misses (what a wrong bet costs; the same bits)
    prestage_miss: bool = False
    ring_fill: int = 0  # of ring_stages, those added from spare shared memory (make_plan fill_ring)
    # blocks in roles: each group of op kinds runs on its share of the grid only (program.cuh
    # my_units), the experts on every block, so that a block's layer code (its role's ops, the
    # experts, the schedule) fits the SM's instruction cache (critical_path.roles). () = off
    roles: tuple = ()
    tiles: dict = field(default_factory=dict, compare=False)

    @property
    def threads(self) -> int:
        """Threads per block: 9 warps, or 12 with per-role register budgets (compute_registers)."""
        return SPLIT_THREADS if self.compute_registers else THREADS

    @property
    def loader_registers(self) -> int:
        """The loader warpgroup's budget under compute_registers (0 when off): the 4 warps of the
        loader's group give back what the 8 compute warps take above 168 (the CTA's register pool
        must balance, or setmaxnreg.inc waits forever)."""
        n = self.compute_registers
        return BASE_REGISTERS - 2 * (n - BASE_REGISTERS) if n else 0

    @property
    def prestage(self) -> int:
        """Chunks the loader prestages (Plan.prestage_experts, at most the ring's stages)."""
        return min(self.prestage_experts, self.ring_stages)

    @property
    def fused_parts(self) -> int:
        """fused_experts: the K-parts of a slot's down projection, one per gate/up unit."""
        return self.cfg.d_expert // (self.tiles["expert1"].rows // 2)

    @property
    def max_slots(self) -> int:
        return self.cfg.max_distinct_experts(self.cfg.max_tree)

    @property
    def max_splits(self) -> int:
        c = self.cfg
        most_keys = max(c.max_context, c.window) + c.max_tree  # cached keys seen + the new tree keys
        return max(1, min(self.n_sm // c.n_kv_heads if self.n_sm >= c.n_kv_heads else 1,
                          math.ceil(most_keys / self.keys_per_split)))

    @property
    def head_splits(self) -> int:
        """Plan.attn_heads: the most splits of a q head's keys (HEAD_SPLITS): one unit per block
        for all heads, and no split shorter than a staging round where the keys allow."""
        c = self.cfg
        most_keys = max(c.max_context, c.window) + c.max_tree
        return max(1, min(self.n_sm // c.n_heads, math.ceil(most_keys / ATTN_HEAD_KEYS)))

    @property
    def attn_key_groups(self) -> int:
        """Warps of an attention block per q head (attention.cuh ATT_KG); each writes a partial."""
        return WARPS // self.cfg.group

    @property
    def attn_parts(self) -> int:
        """Attention partials per kv head (PARTS): splits x key groups."""
        return self.max_splits * self.attn_key_groups

    @property
    def stage_bytes(self) -> int:
        return max(t.stage_bytes for t in self.tiles.values())

    @property
    def norm_k(self) -> int:
        """Columns of the normed operand staged at a time (a panel; d_model when unpaneled)."""
        return self.norm_panel or self.cfg.d_model

    @property
    def xg_row(self) -> int:
        """bf16 per row of xg, the producers' bf16(x * g) in the consumers' staged layout: a panel
        of norm_k columns and abuf's pad (gemm.cuh XG_ROW, xg_at; runtime's xg buffer)."""
        return self.norm_k + ROW_PAD // 2

    @property
    def abuf_bytes(self) -> int:
        """Activation operand: 16 token rows x the widest K staged at once, padded (attention
        reuses it)."""
        c = self.cfg
        kmax = max(self.norm_k, c.attn_width, c.d_pool, c.d_expert)
        return max(16 * (kmax * 2 + ROW_PAD), self.attn_smem_bytes)

    @property
    def attn_round_keys(self) -> int:
        """Keys attention stages per round (attention.cuh ATT_KB): 32, the default split's run, or 16
        per key group where a block has more than two. 64 staged and zero-filled a 32-key split's
        second half: 32 against 64, in-run A/B, H200 2026-12-01 00:33Z, same bits at shard8:
        shard8 T=16 -0.32%, T=1 -0.50%, small T=16 -0.37% (a 1 KB layout placebo +0.36 / +0.05 /
        -0.26%), 2.3 KB less code."""
        return max(32, 16 * self.attn_key_groups)

    @property
    def attn_smem_bytes(self) -> int:
        c = self.cfg
        if self.attn_heads:  # attention.cuh run_attn_head: Q, one round's K and V, P, row stats, the ticket
            row = c.head_dim * 2 + ROW_PAD
            return 16 * row + 2 * ATTN_HEAD_KEYS * row + 16 * (ATTN_HEAD_KEYS * 2 + ROW_PAD) + 2 * WARPS * 16 * 4 + 16
        q = c.group * 16 * (c.head_dim * 2 + ROW_PAD)
        kv = 2 * self.attn_round_keys * (c.head_dim * 2 + ROW_PAD)  # K rows + V rows
        return q + kv + WARPS * 16 * 4 * 2  # + per-warp row stats for the intra-block merge

    @property
    def red_bytes(self) -> int:
        """Per-warp partial tiles of the bf16 GEMMs, [WARPS][16][rows] fp32, and the fp4 GEMMs'
        results, [16][rows] fp32 (gemm.cuh gemm_stash, gemm_fp4)."""
        dense = WARPS * 16 * max(t.rows for t in self.tiles.values() if not t.fp4) * 4
        # fused_experts: the down projection stores from registers (gemm.cuh gemm_fp4_down)
        fp4 = [n for n, t in self.tiles.items() if t.fp4 and not (n == "expert2" and self.fused_experts)]
        return max([dense] + [16 * self.tiles[n].rows * 4 for n in fp4])

    @property
    def keep_unit_bytes(self) -> int:
        """fused: one kept gate/up unit's activations, 16 token rows of its gate rows, padded."""
        return 16 * (self.tiles["expert1"].rows + ROW_PAD)

    @property
    def keep_bytes(self) -> int:
        return self.keep_units * self.keep_unit_bytes

    @property
    def misc_bytes(self) -> int:
        """The ring's mbarriers and block.cuh's MISC ints (top-k scratch, profiler slots, kept-unit
        tags), as block.cuh lays them out, in 16-byte units. Sized exactly (a fixed 4 KB left
        shard8 T=16 1.3 KB short of a 4th ring stage); block.cuh's static_assert fails the build
        if this differs from its layout."""
        c = self.cfg
        rtag = MISC_SCRATCH + c.max_tree * c.top_k + 2 * ((c.n_experts + 31) // 32) + c.n_experts  # MISC_RTAG
        pslot = (rtag + 1 + 16 + 1) & ~1  # MISC_PSLOT: past RTAG and RNORM[16], 8-byte aligned
        ints = pslot + 8 * PROF_OPS + 2 + 2 + KEEP_MAX  # PSLOT, PWIN, PWAIT, KEEP
        ints += 1 if self.receive_warp else 0  # MISC_RECV
        ints += self.ring_stages + 1 if self.prestage else 0  # MISC_SPEC: a bet per stage and their phases
        bars = 2 * self.ring_stages + 1 + (self.ring_stages if self.prestage else 0)  # + a spec barrier per stage
        return -(-(bars * 8 + 4 * ints) // 16) * 16

    @property
    def smem_bytes(self) -> int:
        return self.abuf_bytes + self.ring_stages * self.stage_bytes + self.red_bytes + self.keep_bytes + self.misc_bytes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cfg"] = self.cfg.name
        d["tiles"] = {k: asdict(v) for k, v in self.tiles.items()}
        return d


NORM_OPS = ("qkv", "router", "pool", "lm_head")  # the projections of a normed d_model operand
DENSE_OPS = ("oproj", "router", "pool", "unpool", "qkv")  # a layer's dense bf16 ops (Plan.shared_dense, ops/dense.cuh)
RING_FILL_MAX = 8  # fill_ring stops at this many stages
# ... or at this many bytes of ring. A 4th 36 KB stage (4 x 36,864 = 147,456 B, kept units 8 -> 0)
# made shard8 T=16 1.0% and small T=16 0.8% slower (in-run A/B, H200 2026-12-01 01:57Z, results
# note ab-ring-depth-20261201T0151Z-c5d3a16.md; at T=1 four 33 KB stages beat three by 0.9%): the
# expert phase's consumers, not the ring, set its pace; a deeper ring may only lengthen the phase's
# opening burst (every block's whole ring requested at once; not measured).
RING_FILL_BYTES = 136 * 1024
KEEP_MAX = 16  # fused_experts: at most this many kept gate/up units (rendered: block.cuh MISC_KEEP)


def _fill_ring(p: Plan, smem_limit: int, norm_panel: int | None, ring_max: int = RING_FILL_MAX) -> Plan:
    """More stages of the tuned size in the shared memory the plan leaves free, up to ring_max stages
    and RING_FILL_BYTES of ring. Where staging the
    normed operand in panels (d_model halved, whole chunks of every NORM_OPS tile) frees a whole
    stage more, the fewest panels that do. A panel costs a barrier and a staging pass inside the
    GEMM. shard8 on the H200, 2026-11-29, 3 stages and two 2048-column panels with the router's
    chunks walked last-first (gemm.cuh), in-run A/B: step 10.77 -> 10.72 ms (two runs); the
    expert GEMMs gain ~7 us a layer, the restaged panels cost most of it back."""
    if norm_panel is not None:
        cands = [norm_panel]
    else:
        kc = max(p.tiles[n].kc for n in NORM_OPS)
        cands, k = [0], p.cfg.d_model // 2
        while k >= kc and k % kc == 0 and p.cfg.d_model % k == 0:
            cands.append(k)
            k //= 2
    best = None
    for kp in cands:
        q = replace(p, norm_panel=kp)
        extra = 0  # a stage adds 16 bytes of mbarriers to misc_bytes too
        while q.ring_stages + extra < ring_max and (q.ring_stages + extra + 1) * q.stage_bytes <= RING_FILL_BYTES \
                and replace(q, ring_stages=q.ring_stages + extra + 1).smem_bytes <= smem_limit:
            extra += 1
        q = replace(q, ring_stages=q.ring_stages + extra, ring_fill=extra)
        if best is None or q.ring_stages > best.ring_stages:
            best = q
    return best


# Plan.roles' three roles (make_plan roles=3): critical_path.roles' first fit of the front and back
# ops, in chain order, into the instruction cache beside the code every block runs, from the code
# sizes of the shard8 build (megakernel.code of 2026-12-02; tests/test_megakernel_roles.py checks
# that the model still packs them so)
ROLE_GROUPS = (("attn", "attn_combine", "oproj", "moe_combine"), ("router", "pool", "topk"), ("unpool", "qkv"))
ROLE_FREE = ("expert1", "expert2")  # contiguous over every block (DEP_LOCAL, the routing): in no role
MAX_ROLES = 15  # 4 bits per op kind in ROLE_CODE, role + 1
assert len(OP_KINDS) <= 16, "ROLE_CODE: 4 bits per op kind in 64"


def parse_roles(roles, n_sm: int) -> tuple:
    """Plan.roles from 0 (off), 3 (ROLE_GROUPS), a sequence of groups of op kinds, or the A/B's text
    form "attn+oproj/router+pool/..." (groups split by '/', kinds by '+')."""
    if roles in (0, "", (), None, False):
        return ()
    if roles == 3 or roles == "3":
        groups = ROLE_GROUPS
    elif isinstance(roles, str):
        groups = tuple(tuple(k.strip() for k in g.split("+") if k.strip()) for g in roles.split("/"))
    elif isinstance(roles, (tuple, list)) and all(isinstance(g, (tuple, list)) for g in roles):
        groups = tuple(tuple(g) for g in roles)
    else:
        raise ValueError(f"roles {roles!r}: want 0 (off), 3 (the model's three roles) or groups of op kinds "
                         "such as 'attn+oproj/router+pool'")
    seen: set[str] = set()
    for g in groups:
        if not g:
            raise ValueError(f"roles {roles!r}: an empty role")
        for k in g:
            if k not in OP_KINDS:
                raise ValueError(f"roles {roles!r}: {k!r} is not an op kind ({', '.join(OP_KINDS)})")
            if k in ROLE_FREE:
                raise ValueError(f"roles {roles!r}: {k} runs on every block (contiguous units, routed)")
            if k in seen:
                raise ValueError(f"roles {roles!r}: {k} is in two roles")
            seen.add(k)
    if not 1 <= len(groups) <= MAX_ROLES:
        raise ValueError(f"roles {roles!r}: {len(groups)} roles, want 1..{MAX_ROLES}")
    if n_sm < len(groups):
        raise ValueError(f"roles {roles!r}: {len(groups)} roles need a grid of at least as many blocks, "
                         f"the plan has {n_sm}")
    return groups


def role_share(role: int, n_blocks: int, n_roles: int) -> range:
    """The blocks of role `role` when `n_roles` roles share a grid of `n_blocks` (program.cuh
    my_units computes the same split)."""
    return range(role * n_blocks // n_roles, (role + 1) * n_blocks // n_roles)


def role_of(plan: "Plan", kind: str) -> int:
    """The role a kind's op runs in, -1 for every block."""
    return next((i for i, g in enumerate(plan.roles) if kind in g), -1)


def role_code(plan: "Plan") -> int:
    """ROLE_CODE (program.cuh my_units): role + 1 in bits 4k..4k+3 of op kind k."""
    return sum((role_of(plan, k) + 1) << (4 * OP[k]) for k in OP_KINDS)


def make_plan(cfg: ModelConfig, n_sm: int, *, ring_stages: int = 4, ring_stage_bytes: int = 16384,
              spin_bound_ns: int = 2_000_000_000, poll_backoff_ns: int = 0, profile: bool = False,
              smem_limit: int = 232448, loader_ahead: bool = True, pdl: bool = False,
              l2_prefetch_bytes: int = 0, profile_cap: int = 64,
              stream_evict_first: bool = False, sentinel_route: bool = False, hot_prefetch_bytes: int = 0,
              kv_prefetch: bool = False, keys_per_split: int = 32, fp4_rotated: bool = True,
              fill_ring: bool = False, norm_panel: int | None = None, profile_detail: bool = False,
              residual_unit_rows: int | None = None, tokens: int | None = None,
              expert1_rows: int | None = None, expert2_rows: int | None = None,
              launch_waits: bool = False, layout_pad: int = 0, layout_gap: int = 0, fused_experts: bool = False,
              keep_max: int = KEEP_MAX, ring_max: int = RING_FILL_MAX, max_registers: int = 0,
              compute_registers: int = 0, receive_warp: bool = False, prestage_experts: int = 0,
              prestage_miss: bool = False, roles=0, shared_dense: int = 0, attn_heads: bool = False) -> Plan:
    """fill_ring: add ring stages of the tuned size in the shared memory left free (the tuned ring
    is the smallest that streams at full rate with nothing else to do; the megakernel's consumers
    also compute, so deeper helps), staging the normed operand in panels where that frees a
    stage. norm_panel: force that panel width (tests), 0 = unpaneled. residual_unit_rows: force the
    oproj / unpool unit rows (A/Bs, tests; default residual_rows). tokens: the tree size the build is
    for (default the config's max_tree; any step of up to max_tree tokens runs on it with the same
    bits: only the expert units follow it, expert1_unit_rows / expert2_unit_rows); expert1_rows /
    expert2_rows force those. layout_pad: a code-layout placebo (Plan.layout_pad), a multiple of 16
    bytes up to 64 KB; layout_gap: the same in the middle of the ops' code (Plan.layout_gap).
    keep_max: at most this many kept gate/up units (fused_experts; A/Bs, tests). ring_max:
    fill_ring stops at this many stages (A/Bs: ring depth against kept units). max_registers: Plan's
    (A/Bs: a cap below the launch bounds' 168; 0 = none). compute_registers: Plan's (0 = off, or a
    multiple of 8 from 176 to 232). receive_warp: Plan's (needs compute_registers). prestage_experts,
    prestage_miss: Plan's (chunks, 0 = off; the miss needs prestaging). roles: Plan's (parse_roles).
    shared_dense, attn_heads: Plan's."""
    cfg.validate()
    if not (isinstance(max_registers, int) and (max_registers == 0 or 64 <= max_registers <= 168)):
        raise ValueError(f"max_registers {max_registers!r}: want 0 (the launch bounds' 168) or a cap of 64..168 registers")
    if not (isinstance(compute_registers, int) and (compute_registers == 0 or (
            BASE_REGISTERS < compute_registers <= 232 and compute_registers % 8 == 0))):
        # 232: the loader's warpgroup keeps 40 (setmaxnreg takes multiples of 8 from 24 to 256)
        raise ValueError(f"compute_registers {compute_registers!r}: want 0 (off) or a multiple of 8 from 176 to 232")
    if receive_warp and not compute_registers:
        raise ValueError("receive_warp needs compute_registers: the receive warp is a spare warp of the loader's "
                         "warpgroup, which exists only with per-role register budgets")
    if not (isinstance(prestage_experts, int) and 0 <= prestage_experts <= RING_FILL_MAX):
        raise ValueError(f"prestage_experts {prestage_experts!r}: want 0 (off) or 1..{RING_FILL_MAX} chunks")
    if prestage_miss and not prestage_experts:
        raise ValueError("prestage_miss needs prestage_experts: it makes the prestaged chunks' bet wrong")
    if compute_registers and max_registers:
        raise ValueError("compute_registers and max_registers: a register cap and per-role budgets do not combine")
    if not (isinstance(ring_max, int) and 1 <= ring_max <= RING_FILL_MAX):
        raise ValueError(f"ring_max {ring_max!r}: want 1..{RING_FILL_MAX} ring stages")
    if not (isinstance(keep_max, int) and 0 <= keep_max <= KEEP_MAX):
        raise ValueError(f"keep_max {keep_max!r}: want 0..{KEEP_MAX} kept gate/up units")
    if shared_dense not in (0, 1, 2):
        raise ValueError(f"shared_dense {shared_dense!r}: want 0 (per-op code), 1 (one shared copy) or 2 "
                         "(a runtime-shaped copy per op, the A/B's control)")
    if attn_heads not in (0, 1, False, True):
        raise ValueError(f"attn_heads {attn_heads!r}: want 0 (kv-head units and the combine op) or 1 (q-head units, "
                         "merged by the last unit of each head)")
    for name, v in (("layout_pad", layout_pad), ("layout_gap", layout_gap)):
        if not (isinstance(v, int) and 0 <= v <= 65536 and v % 16 == 0):
            raise ValueError(f"{name} {v!r}: want a multiple of 16 bytes from 0 to 65536 (one 16-byte instruction each)")
    c = cfg
    budget = ring_stage_bytes
    rr = residual_unit_rows or residual_rows(c, n_sm, budget)
    if c.d_model % rr or rr % DENSE_ROWS or (32 * WARPS) % rr:  # gemm_residual_add: one feature per thread
        raise ValueError(f"residual_unit_rows {rr}: must be a multiple of {DENSE_ROWS} dividing d_model "
                         f"{c.d_model} and the {32 * WARPS} compute threads")
    tiles = {
        "qkv": _tile(DENSE_ROWS, c.d_model, budget),
        "oproj": _tile(rr, c.attn_width, budget),
        "router": _tile(ROUTER_ROWS, c.d_model, budget),
        "pool": _tile(pool_rows(c, n_sm, budget), c.d_model, budget),
        "unpool": _tile(rr, c.d_pool, budget),
        "lm_head": _tile(16, c.d_model, budget),
    }
    # fp4 chunks may exceed the budget by their scales (1/8 of the codes): 256 rows x 256 columns of
    # codes fill a 36 KB stage at a 32 KB budget
    e1 = expert1_rows or expert1_unit_rows(c, n_sm, tokens or c.max_tree)
    tiles["expert1"] = _expert_tile(min(e1, 2 * c.d_expert), c.d_pool, budget * 9 // 8, True)
    if fused_experts:  # chunks no larger than the other ops' (the ring's stage size stays theirs)
        tiles["expert2"] = _fused_down_tile(c, tiles["expert1"].rows // 2, max(t.stage_bytes for t in tiles.values()))
    else:
        e2 = expert2_rows or expert2_unit_rows(c, n_sm, tokens or c.max_tree)
        tiles["expert2"] = _expert_tile(min(e2, c.d_pool), c.d_expert, budget * 9 // 8, False)
    for op in ("expert1", "expert2"):
        tiles[op] = replace(tiles[op], rotated=fp4_rotated)
    if profile_detail and not profile:
        raise ValueError("profile_detail needs profile=True (the detail stamps are the profiler's)")
    p = Plan(cfg, n_sm, ring_stages, ring_stage_bytes, spin_bound_ns, poll_backoff_ns, profile=profile,
             loader_ahead=loader_ahead, pdl=pdl, l2_prefetch_bytes=l2_prefetch_bytes, profile_cap=profile_cap,
             stream_evict_first=stream_evict_first, sentinel_route=sentinel_route,
             hot_prefetch_bytes=hot_prefetch_bytes, kv_prefetch=kv_prefetch, keys_per_split=keys_per_split,
             profile_detail=profile_detail, fp4_rotated=fp4_rotated, tiles=tiles, launch_waits=launch_waits,
             layout_pad=layout_pad, layout_gap=layout_gap, fused_experts=fused_experts,
             max_registers=max_registers, compute_registers=compute_registers, receive_warp=bool(receive_warp),
             prestage_experts=prestage_experts, prestage_miss=bool(prestage_miss), roles=parse_roles(roles, n_sm),
             shared_dense=int(shared_dense), attn_heads=bool(attn_heads))
    if fill_ring or norm_panel is not None:
        if norm_panel and (c.d_model % norm_panel or any(norm_panel % tiles[n].kc for n in NORM_OPS)):
            raise ValueError(f"norm_panel {norm_panel}: must divide d_model {c.d_model} in whole chunks of "
                             f"{', '.join(f'{n} {tiles[n].kc}' for n in NORM_OPS)} columns")
        p = _fill_ring(p, smem_limit, norm_panel, ring_max) if fill_ring else replace(p, norm_panel=norm_panel)
    if fused_experts:  # what the ring left: kept gate/up activations (Plan.keep_units)
        p = replace(p, keep_units=min(keep_max, max(0, (smem_limit - p.smem_bytes) // p.keep_unit_bytes)))
    if p.smem_bytes > smem_limit:
        from microbench.errors import KernelDoesNotFitError

        raise KernelDoesNotFitError(
            f"megakernel for {cfg.name} needs {p.smem_bytes} B of shared memory per block (activations "
            f"{p.abuf_bytes}, ring {p.ring_stages} x {p.stage_bytes}, reduction {p.red_bytes}); the device "
            f"allows {smem_limit}. Use fewer/smaller ring stages.")
    for name, t in tiles.items():
        n = {"qkv": c.qkv_rows, "oproj": c.d_model, "router": c.n_experts, "pool": c.d_pool, "unpool": c.d_model,
             "lm_head": c.vocab, "expert1": 2 * c.d_expert, "expert2": c.d_pool}[name]
        if n % t.rows:
            raise ValueError(f"{name}: {n} output rows not a multiple of the {t.rows}-row tile")
    # run_attn_head's partials live in att_o, sized for the kv-head form's (runtime): HQ x head_splits
    # rows of 16 fit HKV x attn_parts rows of G * 16, as head_splits (n_sm // HQ, keys / 64) never
    # exceeds max_splits (n_sm // HKV, keys / 32)
    assert p.head_splits <= p.attn_parts, (p.head_splits, p.attn_parts)
    if c.head_dim % 8 or c.qkv_rows % 8:
        raise ValueError("head_dim must be a multiple of the 8-row qkv tile (tiles never straddle heads)")
    return p


def render(plan: Plan) -> str:
    """The C++ constants header (prepended to the kernel source)."""
    c = plan.cfg
    lines = [
        "// GENERATED by megakernel/plan.py:render() from the model config and tuned constants. Do not edit.",
        "#pragma once",
        f"#define MB_PROFILE {int(plan.profile)}",
        f"#define MK_MAX_REGISTERS {plan.max_registers}  // 0: the launch bounds' limit (Plan.max_registers)",
        '#include "mb/types.cuh"',
        "namespace mk {",
        f"// model {c.name}",
        f"constexpr int D = {c.d_model};",
        f"constexpr int V = {c.vocab};",
        f"constexpr int L = {c.n_layers};",
        f"constexpr int HQ = {c.n_heads};",
        f"constexpr int HKV = {c.n_kv_heads};",
        f"constexpr int HD = {c.head_dim};",
        f"constexpr int G = {c.group};",
        f"constexpr int QKV_ROWS = {c.qkv_rows};",
        f"constexpr int ATT_W = {c.attn_width};",
        f"constexpr int E = {c.n_experts};",
        f"constexpr int TOPK = {c.top_k};",
        f"constexpr int P = {c.d_pool};",
        f"constexpr int F = {c.d_expert};",
        f"constexpr int WINDOW = {c.window};",
        f"constexpr int RING_SLOTS = {c.ring_slots};",
        f"constexpr int MAX_CTX = {c.max_context};",
        f"constexpr int T_MAX = {c.max_tree};",
        f"constexpr float RMS_EPS = {c.rms_eps!r}f;",
        f"constexpr float ATT_SCALE = {c.head_dim ** -0.5!r}f;",
        f"constexpr int MAX_SLOTS = {plan.max_slots};",
        f"constexpr int MAX_SPLITS = {plan.max_splits};",
        f"constexpr int KEYS_PER_SPLIT = {plan.keys_per_split};",
        f"constexpr int ATT_KB = {plan.attn_round_keys};  // keys attention stages per round",
        f"constexpr bool ATTN_HEADS = {'true' if plan.attn_heads else 'false'};  // Plan.attn_heads",
        f"constexpr int HEAD_SPLITS = {plan.head_splits}, ATTN_HEAD_KEYS = {ATTN_HEAD_KEYS};  "
        "// Plan.attn_heads: splits a q head, keys a round",
        f"constexpr int MOE_COMBINE_COLS = {MOE_COMBINE_COLS};",
        "// launch shape",
        f"constexpr int WARPS = {WARPS};",
        f"constexpr int THREADS = {plan.threads};",
        f"constexpr int COMPUTE_REGS = {plan.compute_registers};  // per-role budgets (Plan.compute_registers; 0 = off)",
        f"constexpr int LOADER_REGS = {plan.loader_registers};",
        f"constexpr int RECEIVE_WARP = {int(plan.receive_warp)};  // Plan.receive_warp",
        f"constexpr int PRESTAGE = {plan.prestage};  // Plan.prestage_experts (chunks, at most RING_STAGES)",
        f"constexpr bool PRESTAGE_MISS = {'true' if plan.prestage_miss else 'false'};  // Plan.prestage_miss",
        f"constexpr int ROLES = {len(plan.roles)};  // Plan.roles: {' / '.join('+'.join(g) for g in plan.roles) or 'off'}",
        f"constexpr unsigned long long ROLE_CODE = {role_code(plan):#x}ull;  // role + 1, 4 bits per op kind",
        f"constexpr int COMPUTE_THREADS = {32 * WARPS};",
        f"constexpr int ROW_PAD = {ROW_PAD};",
        "// ring (tuned constants: weights.ring) and smem carve-up",
        f"constexpr int RING_STAGES = {plan.ring_stages};",
        f"constexpr int STAGE_BYTES = {plan.stage_bytes};",
        f"constexpr int ABUF_BYTES = {plan.abuf_bytes};",
        f"constexpr int NORM_KP = {plan.norm_k};  // columns of a normed operand staged at a time",
        f"constexpr int XG_ROW = {plan.xg_row};  // bf16 per row of xg (gemm.cuh xg_at), the pad included",
        f"constexpr int RED_BYTES = {plan.red_bytes};",
        f"constexpr int SMEM_BYTES = {plan.smem_bytes};",
        "// synchronisation (tuned constants: sync.flags)",
        f"constexpr unsigned long long SPIN_BOUND_NS = {plan.spin_bound_ns}ull;",
        f"constexpr unsigned POLL_BACKOFF_NS = {plan.poll_backoff_ns}u;",
        "// op kinds",
        "enum OpKind : int { " + ", ".join(f"OP_{k.upper()} = {i}" for i, k in enumerate(OP_KINDS)) + " };",
        f"constexpr int OP_KINDS = {len(OP_KINDS)};",
        "// GEMM tiles: rows per unit, K chunk, K",
    ]
    for name, t in plan.tiles.items():
        u = name.upper()
        lines += [f"constexpr int TILE_{u}_ROWS = {t.rows};", f"constexpr int TILE_{u}_KC = {t.kc};",
                  f"constexpr int TILE_{u}_K = {t.k};", f"constexpr int TILE_{u}_SW = {t.swizzle};"]
    lines += [
        "static_assert(HQ % HKV == 0, \"GQA group\");",
        "static_assert(HD % 16 == 0 && HD % TILE_QKV_ROWS == 0, \"qkv tiles never straddle heads\");",
        "static_assert(T_MAX <= 16, \"one m16 tile of tokens\");",
        "static_assert(D % 64 == 0 && P % 64 == 0 && F % 64 == 0, \"k-steps\");",
        "static_assert(STAGE_BYTES % 16 == 0 && ABUF_BYTES % 16 == 0, \"bulk-copy alignment\");",
        "static_assert(G <= WARPS && WARPS % G == 0, \"attention: one warp group per q head\");",
        f"static_assert(TILE_QKV_ROWS == {DENSE_ROWS} && TILE_OPROJ_ROWS % {DENSE_ROWS} == 0 && TILE_ROUTER_ROWS == "
        f"{ROUTER_ROWS} && TILE_POOL_ROWS % {DENSE_ROWS} == 0 && TILE_UNPOOL_ROWS % {DENSE_ROWS} == 0 && "
        "TILE_LM_HEAD_ROWS == 16, "
        "\"unit rows match program.py's unit counts\");",
        f"static_assert(SMEM_BYTES <= 232448, \"fits the opt-in shared memory of sm_90\");",
        f"constexpr int PROFILE = {int(plan.profile)};",
        f"constexpr int PROFILE_DETAIL = {int(plan.profile and plan.profile_detail)};",
        f"constexpr int LOADER_AHEAD = {int(plan.loader_ahead)};",
        f"constexpr int PDL = {int(plan.pdl)};",
        f"constexpr long long L2_PREFETCH_BYTES = {int(plan.l2_prefetch_bytes)}ll;",
        f"constexpr bool STREAM_EVICT_FIRST = {'true' if plan.stream_evict_first else 'false'};",
        f"constexpr bool SENTINEL_ROUTE = {'true' if plan.sentinel_route else 'false'};",
        f"constexpr long long HOT_PREFETCH_BYTES = {int(plan.hot_prefetch_bytes)}ll;",
        f"constexpr bool KV_PREFETCH = {'true' if plan.kv_prefetch else 'false'};",
        f"constexpr int LAYOUT_PAD = {plan.layout_pad};  // never-run bytes ahead of the kernel's body",
        f"constexpr int LAYOUT_GAP = {plan.layout_gap};  // never-run bytes in the middle of the ops' code",
        f"constexpr bool FUSED_EXPERTS = {'true' if plan.fused_experts else 'false'};",
        f"constexpr int SHARED_DENSE = {plan.shared_dense};  // ops/dense.cuh",
        f"constexpr unsigned DENSE_KINDS = {sum(1 << OP[k] for k in DENSE_OPS):#x}u;  // bit k: op kind k is dense (plan.DENSE_OPS)",
        f"constexpr int KEEP_UNITS = {plan.keep_units}, KEEP_BYTES = {plan.keep_bytes}, KEEP_MAX = {KEEP_MAX};  // fused: kept gate/up units",
        f"constexpr int MISC_BYTES = {plan.misc_bytes};  // mbarriers + MISC ints (Plan.misc_bytes)",
        f"constexpr int PROF_OPS = {PROF_OPS}, MISC_SCRATCH = {MISC_SCRATCH};  // block.cuh's MISC layout",
        f"constexpr unsigned long long GLOBAL_MASK = {sum(1 << g for g in c.global_layers)}ull;  // bit l: layer l is global",
        f"constexpr int PARTS = {plan.attn_parts};  // attention partials per kv head (MAX_SPLITS x WARPS / G)",
        "}  // namespace mk",
    ]
    return "\n".join(lines) + "\n"

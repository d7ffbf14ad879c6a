// The megakernel's view of the machine: every instruction it needs, behind one small API.
// On the GPU these are the PTX wrappers of microbench/cuda/mb/ptx.cuh and a few mma/bf16
// instructions; under MK_HOST_EMU (CI, no GPU) megakernel/emu/emu.h implements the same API
// with one fiber per CUDA thread, so the same op code runs on the CPU.
#pragma once
#include "mb/types.cuh"

// Loops that run once or twice per unit (epilogues, top-k bookkeeping) stay rolled: an op's code
// is fetched cold from L2 every layer (the kernel is several times the instruction cache), so an
// unrolled copy costs fetch time and saves no issue slot worth having.
#define MK_COLD_LOOP _Pragma("unroll 1")

#if defined(MK_HOST_EMU)
#include "emu.h"
#else
#include "mb/ptx.cuh"
#define MK_DEV __device__ __forceinline__

namespace mk {

// %tid.x read where used (volatile: never hoisted). Danger: derived from threadIdx.x, every op's
// per-thread addresses are computed once at kernel entry and held, or spilled, through the op loop
MK_DEV int tid() {
  int r;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(r));
  return r;
}
MK_DEV int warp() { return threadIdx.x >> 5; }
MK_DEV int lane() { return threadIdx.x & 31; }
// Ranks of a launch (Plan.launch_ranks): block b of a grid of n blocks is rank b * RANKS_PER_LAUNCH
// / n, and bid() / nblocks() are its index and count among its rank's blocks, so every unit
// assignment and rotation is a rank's own (the host launches a multiple of RANKS_PER_LAUNCH
// blocks). With one rank per launch these are blockIdx.x and gridDim.x: the code of a build
// without ranks.
MK_DEV int launch_rank() {
  if constexpr (RANKS_PER_LAUNCH == 1) return 0;
  else return static_cast<int>(blockIdx.x / (gridDim.x / RANKS_PER_LAUNCH));
}
MK_DEV int launch_block() { return blockIdx.x; }  // the block in the whole launch (watchdog records)
MK_DEV int nblocks() { return static_cast<int>(gridDim.x) / RANKS_PER_LAUNCH; }
MK_DEV int bid() { return static_cast<int>(blockIdx.x) - launch_rank() * nblocks(); }
// %nctaid.x the same way, for a loop stride that must not become a register live across the loop
MK_DEV int nblocks_here() {
  int r;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(r));
  return r / RANKS_PER_LAUNCH;
}

extern __shared__ __align__(128) unsigned char mk_smem_[];
MK_DEV unsigned char* smem() { return mk_smem_; }

// Named barrier 1 over the compute warps only: the loader warp never joins it, so it can run
// ahead (or exit) without stalling the consumers.
MK_DEV void sync_compute() { asm volatile("bar.sync 1, %0;" :: "n"(COMPUTE_THREADS) : "memory"); }
// Same barrier, returning the OR of every compute thread's `v`: how a failed bounded wait by
// one thread becomes everyone's decision to stop, without divergent control flow.
MK_DEV bool sync_compute_or(bool v) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 q, %1, 0;\n bar.red.or.pred p, 1, %2, q;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(r) : "r"(static_cast<uint32_t>(v)), "n"(COMPUTE_THREADS) : "memory");
  return r != 0;
}
MK_DEV void sync_block() { __syncthreads(); }
MK_DEV void syncwarp() { __syncwarp(); }
// Per-role register budgets (Plan.compute_registers): every warp of a warpgroup executes the same
// one. ptxas allocates the code after it to N registers. Danger: .inc blocks until the CTA's pool
// holds the registers, so the .dec side must give back at least as many, or the compute warps
// never start (plan.py loader_registers balances them).
template <int N>
MK_DEV void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N)); }
template <int N>
MK_DEV void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N)); }
MK_DEV float shfl_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
MK_DEV int shfl_xor_i(int v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
MK_DEV int bcast_i(int v) { return __shfl_sync(0xffffffffu, v, 0); }  // lane 0's value
MK_DEV float shfl_f(float v, int src) { return __shfl_sync(0xffffffffu, v, src); }
MK_DEV int shfl_i(int v, int src) { return __shfl_sync(0xffffffffu, v, src); }
MK_DEV bool warp_all(bool v) { return __all_sync(0xffffffffu, v) != 0; }
// One redux.sync each (sm_80+): a warp-wide max / min in one instruction instead of 5 shuffle rounds
MK_DEV uint32_t warp_max_u32(uint32_t v) { return __reduce_max_sync(0xffffffffu, v); }
MK_DEV uint32_t warp_min_u32(uint32_t v) { return __reduce_min_sync(0xffffffffu, v); }

// bf16 as raw uint16_t bits: the kernels never depend on cuda_bf16.h
MK_DEV uint16_t f2bf(float f) {
  uint16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
MK_DEV float bf2f(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
MK_DEV uint32_t pack_bf2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));  // first source -> upper half
  return r;
}
MK_DEV uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// a * (half H of b in both halves): ptxas folds the broadcast into HMUL2's operand selector
// (.H0_H0 / .H1_H1), where a prmt before the multiply would be one more ALU instruction
template <int H>
MK_DEV uint32_t hmul2_bcast(uint32_t a, uint32_t b) {
  static_assert(H == 0 || H == 1, "half 0 (low) or 1 (high)");
  uint32_t r;
  if constexpr (H == 0)
    asm("{.reg .b16 l, h;\n\t.reg .b32 t;\n\tmov.b32 {l, h}, %2;\n\tmov.b32 t, {l, l};\n\tmul.rn.bf16x2 %0, %1, t;\n\t}"
        : "=r"(r) : "r"(a), "r"(b));
  else
    asm("{.reg .b16 l, h;\n\t.reg .b32 t;\n\tmov.b32 {l, h}, %2;\n\tmov.b32 t, {h, h};\n\tmul.rn.bf16x2 %0, %1, t;\n\t}"
        : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// A shared-memory address as ldmatrix takes it, converted from the generic pointer once: byte
// offsets added to it (not to the pointer before each conversion) are folded by ptxas into the
// instruction's immediate, where each converted pointer cost an IADD3 and often a VIADD.
struct SAddr {
  uint32_t a;
  MK_DEV SAddr operator+(int off) const { return SAddr{a + static_cast<uint32_t>(off)}; }
};
MK_DEV SAddr saddr(const void* p) { return SAddr{static_cast<uint32_t>(__cvta_generic_to_shared(p))}; }
// The mma A fragment of a row-major 16x16 bf16 tile in shared memory (ldmatrix .x4). `row` is
// this lane's row address (saddr): tile + (lane % 16) * stride + (lane / 16) * 16 bytes (16-byte aligned).
MK_DEV void ldsm_x4(uint32_t a[4], SAddr row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(row.a));
}
// Matrices 0 and 1 only (.x2): lanes 0..15 address their rows (the others' addresses are ignored).
MK_DEV void ldsm_x2(uint32_t a[2], SAddr row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(a[0]), "=r"(a[1]) : "r"(row.a));
}
// Transposed: matrix m's rows (addressed by lanes 8m..8m+7) are the k index; thread (g, t) gets
// elements [2t][g] and [2t+1][g] of each matrix (an mma B fragment from row-major [k][n] tiles).
MK_DEV void ldsm_x4_trans(uint32_t a[4], SAddr row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(row.a));
}
// Two E4M3 block scales (bytes 0 and 1 of v), positive and nonzero (fp4_layout.canonical_scales)
// -> bf16x2 (low, high) of value * 2^X, exactly: every such E4M3 is a normal f16 with its 3
// mantissa bits at 9..7, so f16 bits >> 3 (no bit crosses the halves) + (112 + X) << 7 are the bf16
// bits of value * 2^X. X <= 119 keeps 448 * 2^X below bf16's max; X >= -117 keeps 2^-9 normal.
// Danger: a zero or negative scale gives a wrong value, not an error (the runtime refuses them).
// H = 1: the two scales are bytes 2 and 3 (the conversion reads the high half-word for free: F2FP .H1).
template <int X, int H = 0>
MK_DEV uint32_t ue4m3x2_to_bf16x2_scaled(uint32_t v) {
  static_assert(X >= -117 && X <= 119, "value * 2^X must stay a normal bf16 for every positive E4M3");
  static_assert(H == 0 || H == 1, "half-word 0 or 1");
  uint32_t h;
  if constexpr (H == 0)
    asm("{.reg .b16 t;\n\tcvt.u16.u32 t, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, t;\n\t}" : "=r"(h) : "r"(v));
  else
    asm("{.reg .b16 l, t;\n\tmov.b32 {l, t}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, t;\n\t}" : "=r"(h) : "r"(v));
  return (h >> 3) + (static_cast<uint32_t>(112 + X) << 7) * 0x10001u;
}
// Byte permute: result byte i = byte (sel nibble i) of {b:a} (a = bytes 0-3, b = bytes 4-7).
MK_DEV uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) { return __byte_perm(a, b, sel); }
// x rotated left by r (0 < r < 32): one funnel shift (ALU pipe)
MK_DEV uint32_t rotl(uint32_t x, int r) { return __funnelshift_l(x, x, r); }
// D = A(16x16, row) * B(16x8, col) + C, bf16 in, fp32 accumulate (PTX fragment layouts)
// Not volatile: registers only, so the compiler may interleave it with the next step's loads.
MK_DEV void mma(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Data other blocks of this launch wrote: read at L2 (.cg), never from a possibly stale L1 line.
MK_DEV uint4 ldg_cg4(const void* p) { return mb::ld_cg_v4(p); }
MK_DEV uint32_t ldg_cg(const void* p) { return mb::ld_cg_u32(static_cast<const uint32_t*>(p)); }
MK_DEV float ldg_cgf(const float* p) { return __uint_as_float(ldg_cg(p)); }
MK_DEV int ldg_cgi(const int32_t* p) { return static_cast<int>(ldg_cg(p)); }
// Immutable data (weights, tables): read-only path.
MK_DEV uint4 ldg_nc4(const void* p) { return mb::ld_nc_v4(p); }

// Sentinel slots (mb/sentinel.cuh): strong relaxed accesses, so a poll racing its writer is a
// defined read of the old or the new word, never a data race.
MK_DEV uint32_t ld_relaxed(const void* p) { return mb::ld_relaxed_gpu(static_cast<const uint32_t*>(p)); }
MK_DEV void st_relaxed(void* p, uint32_t v) { mb::st_relaxed_gpu(static_cast<uint32_t*>(p), v); }
// The same between GPUs (tensor parallelism with one process per GPU: peer memory, mk/tp.cuh)
MK_DEV uint32_t ld_relaxed_sys(const void* p) { return mb::ld_relaxed_sys(static_cast<const uint32_t*>(p)); }
MK_DEV void st_relaxed_sys(void* p, uint32_t v) { mb::st_relaxed_sys(static_cast<uint32_t*>(p), v); }
MK_DEV void fence_acq_rel_sys() { mb::fence_acq_rel_sys(); }
MK_DEV uint32_t ld_acquire(const uint32_t* p) { return mb::ld_acquire_gpu(p); }
MK_DEV void red_release(uint32_t* p, uint32_t v) { mb::red_add_release_gpu(p, v); }
// A release of several counters: one fence, then relaxed adds (each a release pattern with the
// fence, PTX memory model), instead of a fence per red.release.
MK_DEV void fence_release() { mb::fence_acq_rel_gpu(); }
MK_DEV void red_relaxed(uint32_t* p, uint32_t v) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
MK_DEV unsigned long long atomic_cas64(unsigned long long* p, unsigned long long cmp, unsigned long long v) {
  return atomicCAS(p, cmp, v);
}
// A ticket: the old value, acquiring what earlier takers released (each takes it after a release
// fence) and releasing with the same fence pattern
MK_DEV uint32_t atom_add_acq_rel(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
MK_DEV void threadfence() { __threadfence(); }
MK_DEV void atomic_or_smem(int* p, uint32_t v) { atomicOr(reinterpret_cast<unsigned*>(p), v); }
MK_DEV uint64_t now_ns() { return mb::globaltimer(); }
MK_DEV void backoff(unsigned ns) {
  if (ns) mb::nanosleep(ns);
}

MK_DEV void mbar_init(uint64_t* b, unsigned count) { mb::mbar_init(b, count); }
MK_DEV void fence_mbar_init() { mb::fence_mbar_init(); }
MK_DEV void mbar_expect_tx(uint64_t* b, unsigned bytes) { mb::mbar_arrive_expect_tx(b, bytes); }
MK_DEV void mbar_arrive(uint64_t* b) { mb::mbar_arrive(b); }
MK_DEV bool mbar_test(uint64_t* b, unsigned parity) { return mb::mbar_try_wait(b, parity); }
// STREAM_EVICT_FIRST: the streamed weights (read once per step; ~200 MB a shard8 layer, several
// times the L2) go in as evict-first, so that they do not push the kernel's code, the activations
// and the KV rows out of L2 (createpolicy is one instruction per copy).
// A copy of data this launch wrote and other blocks read again (the normed operand): no hint.
MK_DEV void bulk_copy_keep(void* dst_smem, const void* src, unsigned bytes, uint64_t* bar) {
  mb::bulk_g2s_cta(dst_smem, src, bytes, bar);
}
MK_DEV void bulk_copy(void* dst_smem, const void* src, unsigned bytes, uint64_t* bar) {
  if constexpr (STREAM_EVICT_FIRST) mb::bulk_g2s_cta_hint(dst_smem, src, bytes, bar, mb::policy_evict_first());
  else bulk_copy_keep(dst_smem, src, bytes, bar);
}
// Orders this thread's generic-proxy accesses (global and shared), and what it acquired from other
// threads, before its next async-proxy ones (bulk copies).
MK_DEV void fence_proxy_async() { mb::fence_proxy_async(); }
// Orders this thread's view of shared memory (generic proxy) before its next bulk copies (async proxy).
MK_DEV void fence_proxy_async_smem() { mb::fence_proxy_async_smem(); }
// The host emulation's adversarial scheduler learns from this which unit a block starts
// (megakernel/emu/emu.cpp BlockSched); on the GPU it is nothing at all.
MK_DEV void sched_unit(int, int, int) {}
// Programmatic dependent launch: let the next launch start scheduling / wait for the previous one.
MK_DEV void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
MK_DEV void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

MK_DEV float fexp(float x) { return expf(x); }
MK_DEV float frsqrt(float x) { return rsqrtf(x); }
// rounded separately: never contracted into an fma (sums that several ops must reproduce bitwise)
MK_DEV float fmul_rn(float a, float b) { return __fmul_rn(a, b); }
MK_DEV float fadd_rn(float a, float b) { return __fadd_rn(a, b); }
MK_DEV float fmax_(float a, float b) { return fmaxf(a, b); }
MK_DEV int popc(uint32_t x) { return __popc(x); }
MK_DEV float u2f(uint32_t u) { return __uint_as_float(u); }
MK_DEV uint32_t f2u(float f) { return __float_as_uint(f); }

}  // namespace mk
#endif

namespace mk {
MK_DEV float neg_inf() { return u2f(0xff800000u); }
MK_DEV int imin(int a, int b) { return a < b ? a : b; }
MK_DEV int imax(int a, int b) { return a > b ? a : b; }
MK_DEV int cdiv(int a, int b) { return (a + b - 1) / b; }
}  // namespace mk

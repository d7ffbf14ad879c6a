// The mk:: machine API (csrc/mk/arch.cuh) implemented on the fiber runtime of emu_rt.h.
#pragma once
#include "emu_rt.h"

namespace mk {

MK_DEV int tid() { return emu::cur_thread(); }
MK_DEV int warp() { return emu::cur_thread() >> 5; }
MK_DEV int lane() { return emu::cur_thread() & 31; }
// ranks of a launch as arch.cuh has them: block b of n is rank b * RANKS_PER_LAUNCH / n
MK_DEV int nblocks() { return emu::grid_dim() / RANKS_PER_LAUNCH; }
MK_DEV int launch_rank() { return emu::cur_block() / nblocks(); }
MK_DEV int launch_block() { return emu::cur_block(); }
MK_DEV int bid() { return emu::cur_block() - launch_rank() * nblocks(); }
MK_DEV int nblocks_here() { return nblocks(); }
MK_DEV unsigned char* smem() { return emu::cur_smem(); }
// the caller's file:line (GCC/Clang builtins as default arguments) names the barrier instruction
MK_DEV void sync_compute(const char* f = __builtin_FILE(), int l = __builtin_LINE()) {
  emu::block_barrier(1, COMPUTE_THREADS, {f, l});
}
MK_DEV bool sync_compute_or(bool v, const char* f = __builtin_FILE(), int l = __builtin_LINE()) {
  return emu::block_barrier_or(1, COMPUTE_THREADS, v, {f, l});
}
MK_DEV void sync_block(const char* f = __builtin_FILE(), int l = __builtin_LINE()) { emu::block_barrier(0, 0, {f, l}); }
MK_DEV void syncwarp() { emu::warp_barrier(); }
// register budgets are the GPU's business: the emulation has no register file
template <int N>
MK_DEV void setmaxnreg_inc() {}
template <int N>
MK_DEV void setmaxnreg_dec() {}

template <typename T>
inline T shfl_xor_t(T v, int m) {
  T all[32];
  emu::warp_exchange(&v, sizeof(T), all);
  return all[(tid() & 31) ^ m];
}
MK_DEV float shfl_xor(float v, int m) { return shfl_xor_t(v, m); }
MK_DEV int shfl_xor_i(int v, int m) { return shfl_xor_t(v, m); }
MK_DEV float shfl_f(float v, int src) {
  float all[32];
  emu::warp_exchange(&v, sizeof(float), all);
  return all[src & 31];
}
MK_DEV int shfl_i(int v, int src) {
  int all[32];
  emu::warp_exchange(&v, sizeof(int), all);
  return all[src & 31];
}
MK_DEV int bcast_i(int v) {
  int all[32];
  emu::warp_exchange(&v, sizeof(int), all);
  return all[0];
}
template <bool MAX>
inline uint32_t warp_reduce_u32(uint32_t v) {
  uint32_t all[32];
  emu::warp_exchange(&v, sizeof(v), all);
  uint32_t r = all[0];
  for (uint32_t x : all) r = MAX ? (x > r ? x : r) : (x < r ? x : r);
  return r;
}
MK_DEV uint32_t warp_max_u32(uint32_t v) { return warp_reduce_u32<true>(v); }
MK_DEV uint32_t warp_min_u32(uint32_t v) { return warp_reduce_u32<false>(v); }
MK_DEV bool warp_all(bool v) {
  int mine = v ? 1 : 0, all[32];
  emu::warp_exchange(&mine, sizeof(int), all);
  for (int x : all)
    if (!x) return false;
  return true;
}

MK_DEV float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
MK_DEV uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
MK_DEV uint16_t f2bf(float f) {  // round to nearest even, as cvt.rn.bf16.f32
  uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN (the GPU's canonical bf16 NaN)
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
MK_DEV float bf2f(uint16_t b) { return u2f(static_cast<uint32_t>(b) << 16); }
MK_DEV uint32_t pack_bf2(float lo, float hi) { return f2bf(lo) | (static_cast<uint32_t>(f2bf(hi)) << 16); }
MK_DEV uint32_t hmul2(uint32_t a, uint32_t b) {
  const float lo = bf2f(a & 0xffff) * bf2f(b & 0xffff);
  const float hi = bf2f(a >> 16) * bf2f(b >> 16);
  return pack_bf2(lo, hi);
}
template <int H>
MK_DEV uint32_t hmul2_bcast(uint32_t a, uint32_t b) {
  const uint32_t h = H ? b >> 16 : b & 0xffffu;
  return hmul2(a, h | (h << 16));
}
// The hardware's alignment rules for the accesses the kernel makes through these helpers: a
// misaligned address faults on the GPU ("misaligned address"), so the emulation refuses it too.
MK_DEV void need_align(const void* p, unsigned n, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % n) emu::fail(what);
}
struct SAddr {  // the GPU's 32-bit shared address, here the pointer itself
  const unsigned char* p;
  MK_DEV SAddr operator+(int off) const { return SAddr{p + off}; }
};
MK_DEV SAddr saddr(const void* p) { return SAddr{static_cast<const unsigned char*>(p)}; }
MK_DEV void ldsm_x4(uint32_t a[4], const unsigned char* row) {  // lanes 8m..8m+7 address matrix m's rows
  need_align(row, 16, "ldmatrix row address not 16-byte aligned");
  const unsigned char* all[32];
  emu::warp_exchange(&row, sizeof(row), all);
  const int g = lane() >> 2, t = lane() & 3;
  for (int m = 0; m < 4; ++m) memcpy(&a[m], all[8 * m + g] + 4 * t, 4);
}
MK_DEV void ldsm_x2(uint32_t a[2], const unsigned char* row) {  // lanes 0..15 address matrices 0, 1
  if (lane() < 16) need_align(row, 16, "ldmatrix row address not 16-byte aligned");
  const unsigned char* all[32];
  emu::warp_exchange(&row, sizeof(row), all);
  const int g = lane() >> 2, t = lane() & 3;
  for (int m = 0; m < 2; ++m) memcpy(&a[m], all[8 * m + g] + 4 * t, 4);
}
MK_DEV void ldsm_x4_trans(uint32_t a[4], const unsigned char* row) {
  need_align(row, 16, "ldmatrix row address not 16-byte aligned");
  const unsigned char* all[32];
  emu::warp_exchange(&row, sizeof(row), all);
  const int g = lane() >> 2, t = lane() & 3;
  for (int m = 0; m < 4; ++m) {
    uint16_t lo, hi;
    memcpy(&lo, all[8 * m + 2 * t] + 2 * g, 2);
    memcpy(&hi, all[8 * m + 2 * t + 1] + 2 * g, 2);
    a[m] = lo | (static_cast<uint32_t>(hi) << 16);
  }
}
MK_DEV void ldsm_x4(uint32_t a[4], SAddr row) { ldsm_x4(a, row.p); }
MK_DEV void ldsm_x2(uint32_t a[2], SAddr row) { ldsm_x2(a, row.p); }
MK_DEV void ldsm_x4_trans(uint32_t a[4], SAddr row) { ldsm_x4_trans(a, row.p); }
template <int X, int H = 0>
MK_DEV uint32_t ue4m3x2_to_bf16x2_scaled(uint32_t v) {  // the GPU's integer steps, on exact f16 bits
  v >>= 16 * H;
  auto f16 = [](uint32_t x) -> uint32_t {  // cvt.rn.f16.e4m3 (exact; NaN -> 0x7fff)
    const uint32_t s = (x & 0x80u) << 8, e = (x >> 3) & 15u, m = x & 7u;
    if (e == 15u && m == 7u) return 0x7fffu;
    if (e) return s | ((e + 8u) << 10) | (m << 7);
    if (!m) return s;
    const uint32_t p = m >= 4u ? 2u : (m >= 2u ? 1u : 0u);  // subnormal m * 2^-9: normal in f16
    return s | ((p + 6u) << 10) | ((m << (10u - p)) & 0x3ffu);
  };
  const uint32_t h = f16(v & 0xffu) | (f16((v >> 8) & 0xffu) << 16);
  return (h >> 3) + (static_cast<uint32_t>(112 + X) << 7) * 0x10001u;
}
MK_DEV uint32_t rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }  // 0 < r < 32, as arch.cuh
MK_DEV uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  const uint64_t x = a | (static_cast<uint64_t>(b) << 32);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t s = (sel >> (4 * i)) & 15u;
    uint32_t byte = static_cast<uint32_t>(x >> (8 * (s & 7u))) & 0xffu;
    if (s & 8u) byte = (byte & 0x80u) ? 0xffu : 0u;  // sign-replicate mode
    r |= byte << (8 * i);
  }
  return r;
}
MK_DEV void mma(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  struct Frag { uint32_t a[4]; uint32_t b[2]; } mine{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}}, all[32];
  emu::warp_exchange(&mine, sizeof(Frag), all);
  auto A = [&](int r, int k) {  // element (row r, col k) of the 16x16 A tile
    const int ln = (r & 7) * 4 + (k & 7) / 2;
    const int reg = (k >= 8 ? 2 : 0) + (r >= 8 ? 1 : 0);
    const uint32_t w = all[ln].a[reg];
    return bf2f((k & 1) ? (w >> 16) : (w & 0xffff));
  };
  auto B = [&](int k, int n) {  // element (row k, col n) of the 16x8 B tile
    const int ln = n * 4 + (k & 7) / 2;
    const uint32_t w = all[ln].b[k >= 8 ? 1 : 0];
    return bf2f((k & 1) ? (w >> 16) : (w & 0xffff));
  };
  const int g = lane() >> 2, t = lane() & 3;
  for (int i = 0; i < 4; ++i) {
    const int r = g + (i >= 2 ? 8 : 0), n = 2 * t + (i & 1);
    double s = c[i];
    for (int k = 0; k < 16; ++k) s += static_cast<double>(A(r, k)) * B(k, n);
    c[i] = static_cast<float>(s);
  }
}

MK_DEV uint4 ldg_cg4(const void* p) {
  need_align(p, 16, "16-byte global load not 16-byte aligned");
  uint4 v;
  memcpy(&v, p, 16);
  return v;
}
MK_DEV uint32_t ldg_cg(const void* p) {
  need_align(p, 4, "4-byte global load not 4-byte aligned");
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
MK_DEV float ldg_cgf(const float* p) { return *p; }
MK_DEV int ldg_cgi(const int32_t* p) { return *p; }
MK_DEV uint4 ldg_nc4(const void* p) {
  need_align(p, 16, "16-byte global load not 16-byte aligned");
  uint4 v;
  memcpy(&v, p, 16);
  return v;
}
MK_DEV uint32_t ld_relaxed(const void* p) {  // a poll: lets the writer's fiber run
  need_align(p, 4, "4-byte relaxed load not 4-byte aligned");
  emu::yield();
  return *reinterpret_cast<const volatile uint32_t*>(p);
}
MK_DEV void st_relaxed(void* p, uint32_t v) {
  need_align(p, 4, "4-byte relaxed store not 4-byte aligned");
  *reinterpret_cast<volatile uint32_t*>(p) = v;
  emu::note_sync_write(true);
}
MK_DEV uint32_t ld_relaxed_sys(const void* p) { return ld_relaxed(p); }  // one memory: scopes are the GPU's business
MK_DEV void st_relaxed_sys(void* p, uint32_t v) { st_relaxed(p, v); }
MK_DEV void fence_acq_rel_sys() {}
MK_DEV uint32_t ld_acquire(const uint32_t* p) { emu::yield(); return *reinterpret_cast<const volatile uint32_t*>(p); }
MK_DEV void red_release(uint32_t* p, uint32_t v) { *p += v; emu::note_sync_write(true); }
MK_DEV void fence_release() {}
MK_DEV void red_relaxed(uint32_t* p, uint32_t v) { *p += v; emu::note_sync_write(true); }
MK_DEV unsigned long long atomic_cas64(unsigned long long* p, unsigned long long cmp, unsigned long long v) {
  const unsigned long long old = *p;
  if (old == cmp) *p = v;
  emu::note_sync_write(true);
  return old;
}
MK_DEV uint32_t atom_add_acq_rel(uint32_t* p, uint32_t v) {
  emu::yield();  // another block may take its ticket first
  const uint32_t old = *p;
  *p = old + v;
  emu::note_sync_write(true);
  return old;
}
MK_DEV void threadfence() {}
MK_DEV void atomic_or_smem(int* p, uint32_t v) {
  *p = static_cast<int>(static_cast<uint32_t>(*p) | v);
  emu::note_sync_write(false);
}
MK_DEV uint64_t now_ns() { return emu::now_ns(); }
MK_DEV void backoff(unsigned) { emu::yield(); }
MK_DEV void mbar_init(uint64_t* b, unsigned count) { emu::mbar_init(b, count); }
MK_DEV void fence_mbar_init() {}
MK_DEV void mbar_expect_tx(uint64_t* b, unsigned bytes) { emu::mbar_expect_tx(b, bytes); }
MK_DEV void mbar_arrive(uint64_t* b) { emu::mbar_arrive(b); }
MK_DEV bool mbar_test(uint64_t* b, unsigned parity) { return emu::mbar_test(b, parity); }
MK_DEV void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  // the hardware's rules for cp.async.bulk: 16-byte aligned addresses, size a multiple of 16
  if ((bytes & 15u) || (reinterpret_cast<uintptr_t>(dst) & 15u) || (reinterpret_cast<uintptr_t>(src) & 15u)) {
    emu::fail("bulk copy with an address or size that is not a multiple of 16 bytes");
  }
  emu::bulk_copy_async(dst, src, bytes, bar);
}
MK_DEV void bulk_copy_keep(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  bulk_copy(dst, src, bytes, bar);
}
MK_DEV void fence_proxy_async() {}
MK_DEV void fence_proxy_async_smem() {}
// the adversarial schedule's hint (emu.cpp BlockSched): this block's compute threads start unit
// `unit` of op instance `op`, which has `total` units
MK_DEV void sched_unit(int op, int unit, int total) { emu::unit_hint(op, unit, total); }
MK_DEV void pdl_launch_dependents() {}
MK_DEV void pdl_wait() {}
MK_DEV float fexp(float x) { return expf(x); }
MK_DEV float frsqrt(float x) { return 1.0f / sqrtf(x); }
MK_DEV float fmul_rn(float a, float b) { return a * b; }
MK_DEV float fadd_rn(float a, float b) { return a + b; }
MK_DEV float fmax_(float a, float b) { return fmaxf(a, b); }
MK_DEV int popc(uint32_t x) { return __builtin_popcount(x); }

}  // namespace mk

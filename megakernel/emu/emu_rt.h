// Host emulation runtime interface (implemented in emu.cpp); emu.h builds the mk:: API on it.
// Host emulation of the CUDA features the megakernel uses, so its op code runs on a CPU (CI).
//
// Every CUDA thread is a fiber (its own stack; emu.cpp switches them) on one OS thread. Fibers switch only at
// synchronisation points: barriers, warp collectives (shuffles, mma), acquire loads and
// back-offs in spin loops, mbarrier probes. The scheduler picks the next fiber at random from a
// seed, so repeated runs explore different interleavings of blocks and warps. What it checks:
// indexing, fragment layouts, numerics, the schedule's dependencies (a missing wait reads
// unwritten data), barrier discipline (a barrier that can never complete is reported as a
// deadlock with where every fiber waits), and the ring protocol. What it cannot check: the GPU
// memory model (everything here is sequentially consistent) and performance.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __maxnreg__(...)
#define __grid_constant__
#define __restrict__ __restrict
#define MK_DEV inline

struct uint4 { uint32_t x, y, z, w; };
struct uint2 { uint32_t x, y; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };

namespace emu {
struct Dim3 { unsigned x, y, z; };
int cur_thread();
int cur_block();
int grid_dim();
int block_dim();
unsigned char* cur_smem();
void yield();
// `site` names the barrier instruction (its file:line in the kernel source): every arrival of
// one generation must come from the same one, as compute-sanitizer synccheck wants on the GPU
// (threads of a block at different bar.sync instructions for one barrier are "divergent")
struct Site { const char* file; int line; };
void block_barrier(int id, int count, Site site);  // count 0: every thread of the block
bool block_barrier_or(int id, int count, bool v, Site site);  // bar.red.or
void warp_barrier();
void warp_exchange(const void* mine, int bytes, void* all);  // all = 32 * bytes, lane order
void mbar_init(uint64_t* b, unsigned count);
void mbar_expect_tx(uint64_t* b, unsigned bytes);
void mbar_arrive(uint64_t* b);
bool mbar_test(uint64_t* b, unsigned parity);
void mbar_complete_tx(uint64_t* b, unsigned bytes);
// cp.async.bulk: the copy lands (its bytes written, then complete_tx on `b`) only when a thread
// next tests `b`, not at issue, so a reader that does not wait for the barrier sees the old bytes
void bulk_copy_async(void* dst, const void* src, unsigned bytes, uint64_t* b);
uint64_t now_ns();
// the adversarial schedule (emu.cpp): a synchronisation write other fibers may poll (global: any
// block's; else the writer's block's shared memory), and the unit a block's compute threads start
void note_sync_write(bool global);
void unit_hint(int op, int unit, int total);
[[noreturn]] void fail(const char* what);
}  // namespace emu

#define threadIdx (::emu::Dim3{(unsigned)::emu::cur_thread(), 0u, 0u})
#define blockIdx (::emu::Dim3{(unsigned)::emu::cur_block(), 0u, 0u})
#define blockDim (::emu::Dim3{(unsigned)::emu::block_dim(), 1u, 1u})
#define gridDim (::emu::Dim3{(unsigned)::emu::grid_dim(), 1u, 1u})


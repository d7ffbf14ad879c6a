// Kernels that prove the runtime's safety nets fire: a wait that can never be satisfied must
// end in a watchdog report (SpinTimeoutError on the host), not a hung GPU.
#include "mb/types.cuh"
#include "mb/spin.cuh"

extern "C" __global__ void mb_spin_never(const uint32_t* flag, uint32_t target, unsigned long long* wd_rec,
                                         unsigned long long bound_ns, uint32_t* done) {
  mb::Watchdog w{wd_rec, bound_ns};
  const bool ok = mb::spin_geq(w, flag, target, /*what=*/42u);
  if (threadIdx.x == 0) done[blockIdx.x] = ok ? 1u : 2u;
}

// Dynamic shared memory above 48 KB: every byte written then read back reversed.
extern "C" __global__ void mb_big_smem(const uint32_t* in, uint32_t* out, uint32_t nwords) {
  extern __shared__ uint32_t s[];
  for (uint32_t i = threadIdx.x; i < nwords; i += blockDim.x) s[i] = in[blockIdx.x * nwords + i];
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < nwords; i += blockDim.x) out[blockIdx.x * nwords + i] = s[nwords - 1 - i];
}

// Clusters: each block reports its rank in the cluster and reads rank 0's smem over DSMEM.
extern "C" __global__ void mb_cluster_probe(uint32_t* out) {
  __shared__ uint32_t mine;
  uint32_t rank, nrank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(nrank));
  if (threadIdx.x == 0) mine = 1000u + blockIdx.x;
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (threadIdx.x == 0) {
    uint32_t local = mb::smem_addr(&mine), remote, v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(0u));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote) : "memory");
    out[blockIdx.x * 3 + 0] = rank;
    out[blockIdx.x * 3 + 1] = nrank;
    out[blockIdx.x * 3 + 2] = v;
  }
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Bulk copy global->shared completing on an mbarrier, then the block copies smem back out.
extern "C" __global__ void mb_bulk_probe(const uint4* in, uint4* out, uint32_t bytes, unsigned long long* wd_rec) {
  extern __shared__ __align__(128) unsigned char buf[];
  __shared__ __align__(8) uint64_t bar;
  mb::Watchdog w{wd_rec, 100000000ull};
  if (threadIdx.x == 0) {
    mb::mbar_init(&bar, 1);
    mb::fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mb::mbar_arrive_expect_tx(&bar, bytes);
    mb::bulk_g2s(buf, reinterpret_cast<const unsigned char*>(in) + (size_t)blockIdx.x * bytes, bytes, &bar);
  }
  if (!mb::mbar_wait(w, &bar, 0, 7u)) return;
  const uint4* s = reinterpret_cast<const uint4*>(buf);
  for (uint32_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) out[(size_t)blockIdx.x * (bytes / 16) + i] = s[i];
}

// Programmatic dependent launch: the secondary waits (griddepcontrol.wait) for the primary's
// memory before reading it; the primary signals early with launch_dependents.
extern "C" __global__ void mb_pdl_primary(uint32_t* buf, uint32_t n) {
  asm volatile("griddepcontrol.launch_dependents;");
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) buf[i] = i * 3u + 1u;
}
extern "C" __global__ void mb_pdl_secondary(const uint32_t* buf, uint32_t* out, uint32_t n) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = buf[i] + 1u;
}

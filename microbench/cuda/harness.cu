// Kernels the timing harness itself launches (microbench/harness.py). Not benchmarks.
#include "mb/types.cuh"
#include "mb/ptx.cuh"

// Holds the stream until the host has queued every launch of a sample batch, so the first
// timing event is not recorded while the host is still submitting (nvbench's "blocking
// kernel"). Bounded: gives up after `timeout_ns` and says so in *status, because a host that
// blocks on a full launch queue would otherwise deadlock with it.
extern "C" __global__ void mb_block_stream(const volatile int* host_flag, unsigned long long timeout_ns,
                                           int* status) {
  const unsigned long long t0 = mb::globaltimer();
  while (*host_flag == 0) {
    if (mb::globaltimer() - t0 > timeout_ns) { *status = 1; return; }
    mb::nanosleep(1000);
  }
}

// Evicts the L2: read-modify-write of a buffer >= 2x L2 (a 1x pass leaves part of the previous
// working set resident). Touches every 16-byte word once.
extern "C" __global__ void mb_flush_l2(uint4* buf, unsigned long long n16) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n16;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    uint4 v = buf[i];
    v.x ^= 1u;
    buf[i] = v;
  }
}

// The launch-overhead probe: does nothing, so its device time is the launch's own cost.
extern "C" __global__ void mb_empty() {}

// Host-emulation stand-in for microbench/cuda/mb/ptx.cuh, found first on the emulation build's
// include path so that shared device headers (mb/profile.cuh) compile on the CPU. Only what
// those headers use is here; the megakernel itself goes through mk:: (csrc/mk/arch.cuh).
#pragma once
#include "mb/types.cuh"
#include "emu_rt.h"

namespace mb {
inline uint64_t globaltimer() { return emu::now_ns(); }
inline uint64_t clock64() { return emu::now_ns(); }
inline uint32_t smid() { return static_cast<uint32_t>(emu::cur_block()); }
inline void st_cs_v4(void* vp, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  uint32_t* p = static_cast<uint32_t*>(vp);
  p[0] = a;
  p[1] = b;
  p[2] = c;
  p[3] = d;
}
}  // namespace mb

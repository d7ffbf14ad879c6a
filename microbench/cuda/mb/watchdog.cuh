// The watchdog record shared by every bounded spin-wait (mb/spin.cuh, the megakernel's waits).
// No inline asm and no CUDA intrinsics here: host emulation includes it too.
// microbench/watchdog.py parses the WD_* enum: this is the only copy of the layout.
#pragma once
#include "mb/types.cuh"

namespace mb {

enum WatchdogField : int {
  WD_TRIPPED = 0,   // 0 = fine, 1 = a wait gave up
  WD_BLOCK = 1,     // blockIdx.x of the first waiter that gave up
  WD_THREAD = 2,    // threadIdx.x of it
  WD_WHAT = 3,      // caller-defined id of what was awaited (an op/flag id)
  WD_ADDR = 4,      // address polled
  WD_EXPECTED = 5,  // value it waited for (>= for counters, != sentinel for data)
  WD_SEEN = 6,      // last value it saw
  WD_ELAPSED_NS = 7,// how long it waited
  WD_FIELDS = 8
};

struct Watchdog {
  unsigned long long* rec;  // WD_FIELDS u64 in global memory, zeroed by the host
  uint64_t bound_ns;        // give up after this long (from the tuned spin bound)
};

}  // namespace mb

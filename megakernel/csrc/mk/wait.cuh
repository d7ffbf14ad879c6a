// Bounded waits of the megakernel. Nothing here can hang the GPU: every wait gives up after
// SPIN_BOUND_NS (tuned: sync.flags), records what it waited for in the watchdog record (first
// tripper wins, layout in mb/watchdog.cuh), and returns false. A wait also gives up as soon as
// any other wait in the grid has tripped, so one broken dependency ends the launch quickly.
//
// `what` encodes the waiter for the host's message: op_index * 16 + code, code 0..2 = the op's
// dependency number, WHAT_* (megakernel/program.py, rendered into the generated header) = a ring
// stage or the loader. megakernel/runtime.py decodes it.
//
// Same loop as mb/spin.cuh's spin_geq/mbar_wait, written over mk/arch.cuh's primitives instead:
// mb/spin.cuh uses CUDA builtins (atomicCAS, blockIdx, __threadfence) that the host emulation
// (megakernel/emu) does not provide, and CI runs this file there. The record layout stays shared.
#pragma once
#include "mb/watchdog.cuh"
#include "mk/arch.cuh"

namespace mk {

MK_DEV bool tripped(const Params& p) {
  return *reinterpret_cast<volatile unsigned long long*>(&p.watchdog[mb::WD_TRIPPED]) != 0ull;
}

MK_DEV void report(const Params& p, uint32_t what, const void* addr, uint64_t expected, uint64_t seen,
                   uint64_t elapsed) {
  if (atomic_cas64(&p.watchdog[mb::WD_TRIPPED], 0ull, 1ull) == 0ull) {
    p.watchdog[mb::WD_BLOCK] = launch_block();  // the launch's: with several ranks a launch, it names the rank
    // with ranks, the waiter's rank above bit 16 (every rank of a launch writes one record)
    if constexpr (RANKS_PER_LAUNCH > 1 || TP > 1) p.watchdog[mb::WD_THREAD] = tid() | (p.rank << 16);
    else p.watchdog[mb::WD_THREAD] = tid();
    p.watchdog[mb::WD_WHAT] = what;
    p.watchdog[mb::WD_ADDR] = reinterpret_cast<uintptr_t>(addr);
    p.watchdog[mb::WD_EXPECTED] = expected;
    p.watchdog[mb::WD_SEEN] = seen;
    p.watchdog[mb::WD_ELAPSED_NS] = elapsed;
    threadfence();
  }
}

// Wait until a monotonically increasing counter (reset between steps) reaches `target`.
// Acquire: data the producers released before bumping it is visible afterwards. Returns the value
// that satisfied the wait (top-k's carries its slot count), and ok = false when it gave up.
struct Seen {
  bool ok;
  uint32_t v;
};
MK_DEV Seen wait_counter_seen(const Params& p, const uint32_t* ctr, uint32_t target, uint32_t what) {
  uint32_t v = ld_acquire(ctr);
  if (v >= target) return Seen{true, v};
  const uint64_t t0 = now_ns();
  for (uint32_t i = 1;; ++i) {
    backoff(POLL_BACKOFF_NS);
    v = ld_acquire(ctr);
    if (v >= target) return Seen{true, v};
    if ((i & 63u) == 0u) {
      const uint64_t dt = now_ns() - t0;
      if (dt > SPIN_BOUND_NS) {
        report(p, what, ctr, target, v, dt);
        return Seen{false, v};
      }
      if (tripped(p)) return Seen{false, v};
    }
  }
}

// Wait for the completion of the mbarrier phase with the given parity; `bound`: SPIN_BOUND_NS, or
// more for a wait that is the consequence of another bounded wait (ring_produce_begin).
MK_DEV bool wait_mbar(const Params& p, uint64_t* bar, uint32_t parity, uint32_t what,
                      uint64_t bound = SPIN_BOUND_NS) {
  if (mbar_test(bar, parity)) return true;
  const uint64_t t0 = now_ns();
  for (uint32_t i = 1;; ++i) {
    if (mbar_test(bar, parity)) return true;
    if ((i & 63u) == 0u) {
      const uint64_t dt = now_ns() - t0;
      if (dt > bound) {
        report(p, what, bar, parity, 0xFFFFFFFFull, dt);
        return false;
      }
      if (tripped(p)) return false;
    }
  }
}

}  // namespace mk

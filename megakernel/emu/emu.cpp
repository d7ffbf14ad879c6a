// Fiber runtime behind emu.h: one fiber per CUDA thread, random scheduling from a seed, or an
// adversarial schedule that starves chosen producers (emu_set_schedule below).
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <ucontext.h>

#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "emu_rt.h"

namespace emu {
namespace {
constexpr int kStack = 256 * 1024;
constexpr int kMaxBarriers = 16;

struct Barrier {
  int arrived = 0;
  int expected = 0;
  unsigned gen = 0;
  bool acc = false, result = false;  // bar.red.or of the generation in progress / last completed
  Site site{nullptr, 0};              // the barrier instruction of the generation in progress
  bool reduce = false;                // ... and whether it is bar.red.or
};
struct Warp {
  Barrier bar;
  std::vector<unsigned char> slots;
};
struct Block {
  std::vector<unsigned char> smem;
  Barrier bars[kMaxBarriers];
  std::vector<Warp> warps;
};
// Switching fibers. On x86-64 a switch is a dozen instructions of our own (ctx_switch below):
// it saves the callee-saved registers, the SSE and x87 control words and the stack pointer,
// and loads another fiber's. It used to be _setjmp/_longjmp onto the other fiber's stack, which
// hardened toolchains refuse: with _FORTIFY_SOURCE (on by default in Ubuntu's gcc at -O1 and
// above) _longjmp becomes __longjmp_chk, which aborts ("longjmp causes uninitialized stack
// frame") when the target frame is on another stack. Elsewhere, and with EMU_UCONTEXT_SWITCH
// defined, every switch is swapcontext: portable and correct, ~20x slower (it saves the signal
// mask with a syscall), and switches are what the emulation spends its time on.
#if defined(__x86_64__) && !defined(EMU_UCONTEXT_SWITCH)
#define EMU_ASM_SWITCH 1
// ctx_switch(&save_sp, load_sp): push the callee-saved state on the current stack, store the
// stack pointer in *save_sp, switch to load_sp and pop the state saved there (a fiber's first
// entry pops the frame new_stack_frame laid out and returns into fiber_entry).
extern "C" void emu_ctx_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .globl emu_ctx_switch
  .hidden emu_ctx_switch
  .type emu_ctx_switch,@function
emu_ctx_switch:
  .cfi_startproc
  endbr64
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size emu_ctx_switch,.-emu_ctx_switch
)");
#endif

struct Fiber {
#ifdef EMU_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  int block = 0, thread = 0;
  bool done = false;
  char* stack = nullptr;
  const char* where = "running";
  // adversarial schedule: the block epoch of this fiber's last return to the scheduler, how many
  // returns in a row came in that epoch, and its index in its block's live list
  unsigned long long ret_ep = ~0ull;
  int streak = 0, slot = 0;
};
struct MBar {
  int count = 0, pending = 0;
  long long tx = 0;
  unsigned phases = 0;
};

std::vector<Fiber*> g_fibers, g_live;
std::vector<Block> g_blocks;

// The adversarial schedule (emu_set_schedule). The random scheduler rarely starves a block, so a
// consumer that skips a wait usually still finds its producer done (gate/up without its wait for
// the pooler passed every emulated mega == chain test). This one delays chosen producers: a block
// running a chosen unit (unit_hint, called by the compute threads before each unit) is "delayed",
// and gets the processor only when every other block is blocked. A fiber is blocked when it
// returned to the scheduler BLOCKED_RETURNS times in a row with nothing changed in its block: its
// poll read the same memory again (every return is from a poll or a barrier wait, and among any
// three consecutive returns of a poll loop at least one follows a read). What changes a block:
// a barrier or warp-collective arrival, an mbarrier operation, a shared-memory atomic or release
// store, a fiber's exit (the block's epoch), and any global synchronisation write (a counter
// add, a relaxed store, a CAS: every block's epoch, as any block may poll it). Among delayed
// blocks that can run, the one at the latest op goes first, so the earliest producer is starved
// longest. When every block is blocked, any live fiber runs (the deadlock check still applies).
// Danger: a poll loop that made a block-changing event every iteration would keep its block
// "unblocked" forever and starve the delayed one until the kernel's bounded wait trips; the
// kernel's poll loops do not (wait.cuh, topk.cuh, program.cuh).
constexpr int BLOCKED_RETURNS = 3;
// SCHED_RANK: every block of one rank of the launch (Plan.launch_ranks; drawn from the launch's
// seed) is delayed for the whole launch: a rank that runs only when every other rank waits for it
enum Schedule { SCHED_RANDOM = 0, SCHED_LAST_UNIT = 1, SCHED_BLOCK_PER_OP = 2, SCHED_RANK = 3 };
struct BlockSched {
  unsigned long long ep = 0, count_ep = ~0ull;
  int blocked = 0;  // fibers of this block blocked in epoch count_ep
  std::vector<Fiber*> live;
  bool delayed = false;
  int op = -1, unit = -1;
};
int g_schedule = SCHED_RANDOM;
int g_ranks = 1;  // ranks per launch (emu_set_launch_ranks): block b of g_grid is rank b * g_ranks / g_grid
unsigned long long g_seed = 0;
std::vector<BlockSched> g_bsched;
std::unordered_map<uint64_t*, MBar> g_mbar;
Fiber* g_cur = nullptr;
#ifdef EMU_ASM_SWITCH
void* g_sched_sp = nullptr;
#else
ucontext_t g_sched;
#endif
int g_grid = 0, g_block = 0;
unsigned long long g_progress = 0;
std::string g_error;
bool g_abort = false;
void (*g_body)(void*) = nullptr;
void* g_arg = nullptr;

void to_scheduler() {
#ifdef EMU_ASM_SWITCH
  emu_ctx_switch(&g_cur->sp, g_sched_sp);
#else
  swapcontext(&g_cur->ctx, &g_sched);
#endif
}

// Where every fiber starts; it never returns (the scheduler never resumes a finished fiber).
void fiber_entry() {
  g_body(g_arg);
  g_cur->done = true;
  g_cur->where = "exited";
  to_scheduler();
  abort();
}

void resume(Fiber* f) {
#ifdef EMU_ASM_SWITCH
  emu_ctx_switch(&g_sched_sp, f->sp);
#else
  swapcontext(&g_sched, &f->ctx);
#endif
}

void new_stack_frame(Fiber* f) {
  f->stack = static_cast<char*>(malloc(kStack));
  if (!f->stack) {
    fprintf(stderr, "emu: out of memory for a %d-byte fiber stack\n", kStack);
    abort();
  }
#ifdef EMU_ASM_SWITCH
  // The frame emu_ctx_switch pops, from the top of the stack down: a null return address for
  // fiber_entry (it never returns; it keeps the ABI's 16-byte alignment at its entry), the
  // address it returns into (fiber_entry), rbp rbx r12-r15 (zero), then the control words.
  uintptr_t top = (reinterpret_cast<uintptr_t>(f->stack) + kStack) & ~uintptr_t(15);
  void** s = reinterpret_cast<void**>(top);
  *--s = nullptr;
  *--s = reinterpret_cast<void*>(&fiber_entry);
  for (int i = 0; i < 6; ++i) *--s = nullptr;
  --s;
  unsigned mxcsr;
  unsigned short fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  memcpy(reinterpret_cast<char*>(s), &mxcsr, 4);
  memcpy(reinterpret_cast<char*>(s) + 4, &fpucw, 2);
  f->sp = s;
#else
  getcontext(&f->ctx);
  f->ctx.uc_stack.ss_sp = f->stack;
  f->ctx.uc_stack.ss_size = kStack;
  f->ctx.uc_link = nullptr;
  makecontext(&f->ctx, fiber_entry, 0);
#endif
}
}  // namespace

int cur_thread() { return g_cur->thread; }
int cur_block() { return g_cur->block; }
int grid_dim() { return g_grid; }
int block_dim() { return g_block; }
unsigned char* cur_smem() { return g_blocks[g_cur->block].smem.data(); }

void yield() {
  ++g_progress;
  to_scheduler();
}

// adversarial schedule bookkeeping (above): something changed in the current block / anywhere
static inline void changed_here() {
  if (g_cur && g_schedule) ++g_bsched[g_cur->block].ep;
}
void changed_everywhere() {
  if (!g_schedule) return;
  for (BlockSched& s : g_bsched) ++s.ep;
}
void note_sync_write(bool global) {
  if (global) {
    changed_everywhere();
  } else {
    changed_here();
  }
}

static unsigned long long mix64(unsigned long long x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void unit_hint(int op, int unit, int total) {
  if (!g_schedule) return;
  BlockSched& s = g_bsched[g_cur->block];
  if (s.op == op && s.unit == unit) return;  // every compute thread calls; the first decides
  s.op = op;
  s.unit = unit;
  if (g_schedule == SCHED_RANK) {  // fixed for the launch (emu_launch)
  } else if (g_schedule == SCHED_LAST_UNIT) {
    s.delayed = unit == total - 1;
  } else {  // SCHED_BLOCK_PER_OP: one block per op instance, drawn from the launch's seed
    s.delayed = static_cast<int>(mix64(g_seed * 0x9e3779b97f4a7c15ull + static_cast<unsigned long long>(op)) %
                                 static_cast<unsigned long long>(g_grid)) == g_cur->block;
  }
  ++s.ep;
}

static void wait_gen(Barrier& b, unsigned gen, const char* where) {
  g_cur->where = where;
  while (b.gen == gen) to_scheduler();  // no progress credit: deadlock detection
  g_cur->where = "running";
}

void fail(const char* what) {
  char buf[512];
  snprintf(buf, sizeof buf, "block %d thread %d: %s", g_cur ? g_cur->block : -1, g_cur ? g_cur->thread : -1, what);
  if (g_error.empty()) g_error = buf;
  g_abort = true;
  for (;;) to_scheduler();  // never resumes
}

static void arrive_at(Barrier& b, int expected, Site site, bool reduce) {
  if (b.arrived == 0) {
    b.expected = expected, b.site = site, b.reduce = reduce;
    return;
  }
  if (b.expected != expected) fail("named barrier used with different thread counts");
  if (b.reduce != reduce || b.site.line != site.line || strcmp(b.site.file, site.file) != 0) {
    char buf[600];
    snprintf(buf, sizeof buf,
             "threads of a block at different barrier instructions for one barrier: %s%s:%d and %s%s:%d "
             "(compute-sanitizer synccheck reports this as divergent threads)",
             b.reduce ? "bar.red.or at " : "", b.site.file, b.site.line, reduce ? "bar.red.or at " : "", site.file,
             site.line);
    fail(buf);
  }
}

static void barrier_wait(Barrier& b, int id) {
  changed_here();
  const unsigned gen = b.gen;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    b.result = b.acc;
    b.acc = false;
    ++b.gen;
    ++g_progress;
    return;
  }
  wait_gen(b, gen, id == 0 ? "__syncthreads" : "named barrier");
}

bool block_barrier_or(int id, int count, bool v, Site site) {
  Barrier& b = g_blocks[g_cur->block].bars[id];
  arrive_at(b, count ? count : g_block, site, true);
  if (b.arrived == 0) b.acc = false;
  b.acc = b.acc || v;
  barrier_wait(b, id);
  return b.result;
}

void block_barrier(int id, int count, Site site) {
  Barrier& b = g_blocks[g_cur->block].bars[id];
  arrive_at(b, count ? count : g_block, site, false);
  barrier_wait(b, id);
}

void warp_barrier() {
  Warp& w = g_blocks[g_cur->block].warps[g_cur->thread / 32];
  Barrier& b = w.bar;
  const unsigned gen = b.gen;
  changed_here();
  if (++b.arrived == 32) {
    b.arrived = 0;
    ++b.gen;
    ++g_progress;
    return;
  }
  wait_gen(b, gen, "warp collective");
}

void warp_exchange(const void* mine, int bytes, void* all) {
  Warp& w = g_blocks[g_cur->block].warps[g_cur->thread / 32];
  if (w.slots.size() < static_cast<size_t>(32 * bytes)) w.slots.resize(32 * bytes);
  memcpy(w.slots.data() + (g_cur->thread & 31) * bytes, mine, bytes);
  warp_barrier();
  memcpy(all, w.slots.data(), 32 * bytes);
  warp_barrier();
}

static void mbar_check(MBar& m) {
  changed_here();
  if (m.pending < 0) fail("mbarrier received more arrivals than its count");
  if (m.pending == 0 && m.tx == 0) {
    ++m.phases;
    m.pending = m.count;
    ++g_progress;
  }
}
void mbar_init(uint64_t* b, unsigned count) {
  changed_here();
  g_mbar[b] = MBar{static_cast<int>(count), static_cast<int>(count), 0, 0};
}
static MBar& mb(uint64_t* b) {
  auto it = g_mbar.find(b);
  if (it == g_mbar.end()) fail("mbarrier used before init");
  return it->second;
}
void mbar_expect_tx(uint64_t* b, unsigned bytes) {
  MBar& m = mb(b);
  m.tx += bytes;
  --m.pending;
  mbar_check(m);
}
void mbar_arrive(uint64_t* b) {
  MBar& m = mb(b);
  --m.pending;
  mbar_check(m);
}
void mbar_complete_tx(uint64_t* b, unsigned bytes) {
  MBar& m = mb(b);
  m.tx -= bytes;
  mbar_check(m);
}
// Bulk copies in flight: each lands when its mbarrier is next tested (in issue order), as late as
// the hardware could land it for a thread that waits on that barrier, so that a thread reading
// the destination without the wait reads what was there before (the source is read at landing
// too: a source written after the copy's issue shows up as well).
struct InFlight {
  void* dst;
  const void* src;
  unsigned bytes;
  uint64_t* bar;
};
static std::vector<InFlight> g_inflight;
void bulk_copy_async(void* dst, const void* src, unsigned bytes, uint64_t* b) {
  mb(b);  // an uninitialised barrier fails at issue, as before
  g_inflight.push_back(InFlight{dst, src, bytes, b});
}
static void land_copies(uint64_t* b) {
  size_t keep = 0;
  for (size_t i = 0; i < g_inflight.size(); ++i) {
    const InFlight x = g_inflight[i];
    if (x.bar != b) {
      g_inflight[keep++] = x;
      continue;
    }
    memcpy(x.dst, x.src, x.bytes);
    mbar_complete_tx(x.bar, x.bytes);
  }
  g_inflight.resize(keep);
}
bool mbar_test(uint64_t* b, unsigned parity) {
  yield();
  land_copies(b);
  return (mb(b).phases & 1u) != (parity & 1u);
}
// The emulated GPU's clock (%globaltimer in the kernel): the CPU time of the one OS thread that
// runs every fiber, not wall time. The kernel's spin bounds (SPIN_BOUND_NS) then measure the
// emulation's own work: on a machine shared with other processes (a CI runner, parallel test
// workers) a descheduled emulation does not see its waits time out, and a wait that can never
// complete still trips after that much emulated work. The kernel reads it once every 64 polls.
uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// Adversarial schedule: the block whose fiber runs next (see BlockSched above).
static int pick_block(std::mt19937_64& rng) {
  const int n = static_cast<int>(g_bsched.size());
  auto can_run = [](const BlockSched& s) {
    const int blocked = s.count_ep == s.ep ? s.blocked : 0;
    return !s.live.empty() && blocked < static_cast<int>(s.live.size());
  };
  size_t total = 0;
  for (const BlockSched& s : g_bsched)
    if (!s.delayed && can_run(s)) total += s.live.size();
  if (total) {  // a block that is not delayed, chosen in proportion to its live fibers
    size_t r = rng() % total;
    for (int b = 0; b < n; ++b) {
      const BlockSched& s = g_bsched[b];
      if (s.delayed || !can_run(s)) continue;
      if (r < s.live.size()) return b;
      r -= s.live.size();
    }
  }
  int best = -1;  // every other block is blocked: the delayed one at the latest op
  for (int b = 0; b < n; ++b)
    if (g_bsched[b].delayed && can_run(g_bsched[b]) && (best < 0 || g_bsched[b].op > g_bsched[best].op)) best = b;
  if (best >= 0) return best;
  total = 0;  // everything is blocked: any live fiber
  for (const BlockSched& s : g_bsched) total += s.live.size();
  size_t r = rng() % total;
  for (int b = 0; b < n; ++b) {
    if (r < g_bsched[b].live.size()) return b;
    r -= g_bsched[b].live.size();
  }
  return n - 1;
}

// After fiber f returned to the scheduler without finishing: one more blocked return, or the
// first of a new epoch.
static void note_return(Fiber* f) {
  BlockSched& s = g_bsched[f->block];
  if (f->ret_ep == s.ep) {
    ++f->streak;
  } else {
    f->ret_ep = s.ep;
    f->streak = 1;
  }
  if (f->streak == BLOCKED_RETURNS) {
    if (s.count_ep != s.ep) {
      s.count_ep = s.ep;
      s.blocked = 0;
    }
    ++s.blocked;
  }
}

static void drop_live(Fiber* f) {
  BlockSched& s = g_bsched[f->block];
  Fiber* last = s.live.back();
  s.live[f->slot] = last;
  last->slot = f->slot;
  s.live.pop_back();
  ++s.ep;
}

}  // namespace emu

// The schedule of the following launches: 0 random (the seed's; round-robin without one), 1
// adversarial, delaying the block that runs the last unit of each op instance, 2 adversarial,
// delaying one block per op instance (drawn from the launch's seed) while it runs that op's units
// (emu.cpp BlockSched). Returns 0, or 1 for an unknown schedule.
extern "C" int emu_set_schedule(int schedule) {
  if (schedule < emu::SCHED_RANDOM || schedule > emu::SCHED_RANK) return 1;
  emu::g_schedule = schedule;
  return 0;
}

// The ranks of the following launches (Plan.launch_ranks; the kernel's RANKS_PER_LAUNCH): the
// schedule SCHED_RANK delays one of them. Returns 0, or 1 when fewer than one.
extern "C" int emu_set_launch_ranks(int ranks) {
  if (ranks < 1) return 1;
  emu::g_ranks = ranks;
  return 0;
}

// Run `body(arg)` as a grid of `grid` blocks x `block` threads. Returns 0, or 1 with `err` set
// (deadlock: where every live fiber waits; or a failed emulation check).
extern "C" int emu_launch(void (*body)(void*), void* arg, int grid, int block, int smem_bytes,
                          unsigned long long seed, char* err, int errlen) {
  using namespace emu;
  g_body = body;
  g_arg = arg;
  g_grid = grid;
  g_block = block;
  g_error.clear();
  g_abort = false;
  g_mbar.clear();
  g_inflight.clear();
  g_blocks.assign(grid, Block{});
  for (auto& b : g_blocks) {
    b.smem.assign(smem_bytes, 0xA5);  // poison: reading smem nobody wrote shows up as garbage
    b.warps.resize((block + 31) / 32);
  }
  g_fibers.clear();
  g_live.clear();
  g_seed = seed;
  g_bsched.assign(grid, BlockSched{});
  if (g_schedule == SCHED_RANK) {
    const int starved = static_cast<int>(mix64(seed) % static_cast<unsigned long long>(g_ranks));
    for (int bi = 0; bi < grid; ++bi) g_bsched[bi].delayed = bi * g_ranks / grid == starved;
  }
  const bool adversarial = g_schedule != SCHED_RANDOM;
  for (int bi = 0; bi < grid; ++bi)
    for (int t = 0; t < block; ++t) {
      Fiber* f = new Fiber();
      f->block = bi;
      f->thread = t;
      new_stack_frame(f);
      g_fibers.push_back(f);
      g_live.push_back(f);
      f->slot = static_cast<int>(g_bsched[bi].live.size());
      g_bsched[bi].live.push_back(f);
    }
  std::mt19937_64 rng(seed);
  unsigned long long idle_picks = 0, last_progress = g_progress;
  int rc = 0;
  size_t live = g_live.size();
  while (live) {
    size_t i = 0;
    Fiber* f;
    if (adversarial) {
      const std::vector<Fiber*>& in = g_bsched[pick_block(rng)].live;
      f = in[rng() % in.size()];
    } else {
      i = seed ? rng() % g_live.size() : 0;
      f = g_live[i];
    }
    g_cur = f;
    resume(f);
    g_cur = nullptr;
    if (g_abort) { rc = 1; break; }
    if (f->done) {
      if (adversarial) {
        drop_live(f);
      } else {
        g_live[i] = g_live.back();
        g_live.pop_back();
      }
      --live;
      ++g_progress;
    } else if (adversarial) {
      note_return(f);
    } else if (!seed) {  // round-robin when unseeded
      g_live.erase(g_live.begin() + i);
      g_live.push_back(f);
    }
    if (g_progress != last_progress) {
      last_progress = g_progress;
      idle_picks = 0;
    } else if (++idle_picks > 64 * live + 1024) {
      std::string msg = "deadlock: every live thread waits at a barrier that cannot complete:";
      int shown = 0;
      for (Fiber* l : g_fibers) {
        if (l->done) continue;
        if (shown++ < 12) msg += " [b" + std::to_string(l->block) + " t" + std::to_string(l->thread) + ": " + l->where + "]";
      }
      msg += " (" + std::to_string(live) + " live)";
      g_error = msg;
      rc = 1;
      break;
    }
  }
  if (!rc && !g_inflight.empty()) {  // the kernel ended with copies nobody waited for
    g_error = "a bulk copy into shared memory was still in flight when the kernel ended (" +
              std::to_string(g_inflight.size()) + " copies whose mbarrier no thread waited for)";
    rc = 1;
  }
  g_inflight.clear();
  for (Fiber* f : g_fibers) {
    free(f->stack);
    delete f;
  }
  g_fibers.clear();
  g_live.clear();
  g_bsched.clear();
  if (rc && err && errlen > 0) snprintf(err, errlen, "%s", g_error.c_str());
  return rc;
}

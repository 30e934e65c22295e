// The CUDA emulation's runtime: grids, blocks, fibers, barriers and shuffles. ATen-free.
//
// [note: CUDA emulation]
// A launch runs its blocks one after another (in index order, or in an order drawn from the
// schedule seed). A block's threads are fibers (ucontext) of one OS thread, each with a stack of
// its own; they run cooperatively: a thread runs until it reaches __syncthreads, a warp shuffle,
// a fault or its end, and then the next ready thread runs. When every thread of the block is
// blocked:
//  - a warp whose lanes named in a shuffle's mask all wait at a shuffle (of the same kind, mask and
//    width) exchanges its values and goes on;
//  - when every live thread waits at __syncthreads the barrier opens, unless a thread of the block
//    has returned while the others wait at it (reported: on a GPU a hang or undefined behaviour);
//  - anything else can never go on (a lane named in a mask has returned or waits at a barrier):
//    reported as a deadlock, naming the threads.
// A fault (a report above, a misaligned 16-byte access, a bad shuffle) stops the grid; the launch
// fails with cudaErrorLaunchFailure or cudaErrorMisalignedAddress and cudaGetErrorString gives the
// block, the thread and what happened. Nothing is run concurrently, so results depend on the
// schedule only where the kernel has a race: a seeded schedule, and ThreadSanitizer, find those.
//
// Under ThreadSanitizer (FUSEDOFF_EMULATION_TSAN; this file is then compiled without
// instrumentation, the kernels with it) every fiber is a TSan fiber switched to without
// synchronisation, so TSan orders two threads of a block only through what the emulated hardware
// orders: a barrier or a shuffle (release on arrival, acquire on leaving); a thread that starts
// after another of its block has ended is not ordered after it. Blocks are ordered one after
// another for TSan (the scheduler acquires what every thread of a block released at its end and
// releases it, with what the host did before the launch, to every thread of the blocks after it;
// the host comes after the grid): blocks reuse one another's `__shared__` variables and fiber stacks here,
// as TSan fibers are too costly to make afresh per block, so a race between two blocks of a grid
// does not show under TSan. The seeded block order shows one that changes a result.
// Under AddressSanitizer the fiber switches are announced to ASan and each stack is unpoisoned
// before it is used again.
#include "cuda_emulation.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FUSEDOFF_EMULATION_ASAN 1
#endif
#if defined(FUSEDOFF_EMULATION_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

thread_local uint3 threadIdx{0, 0, 0};
thread_local uint3 blockIdx{0, 0, 0};
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace {

thread_local cudaError_t last_error = cudaSuccess;
thread_local cudaError_t message_error = cudaSuccess;  // the error `message` describes
thread_local std::string message;

}  // namespace

namespace fusedoff {
namespace emulation {
namespace {

// The runtime's own text for each error.
const char* standard_error_string(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

#if defined(FUSEDOFF_EMULATION_ASAN) || defined(FUSEDOFF_EMULATION_TSAN)
constexpr std::size_t kStackBytes = 512 * 1024;  // sanitized frames are larger
#else
constexpr std::size_t kStackBytes = 128 * 1024;
#endif

// Limits a launch is checked against, as the driver checks them (compute capability 8.0 and 9.0).
constexpr unsigned int kMaxThreadsPerBlock = 1024;
constexpr unsigned int kMaxBlockDim[3] = {1024, 1024, 64};
constexpr unsigned int kMaxGridDim[3] = {2147483647u, 65535, 65535};
constexpr std::size_t kMaxParamBytes = 4096;  // the classic limit the kernels are written for

std::atomic<std::uint64_t> schedule_seed{0};
std::atomic<std::uint64_t> launches{0};

void set_error(cudaError_t error, std::string text) {
  last_error = error;
  message_error = error;
  message = std::string("fusedoff CUDA emulation: ") + standard_error_string(error) + ": " + std::move(text);
}

// A fiber stack: mapped with an inaccessible guard page below it, so an overflow faults.
class Stack {
 public:
  Stack() : page_(static_cast<std::size_t>(sysconf(_SC_PAGESIZE))) {
    mapping_ = mmap(nullptr, kStackBytes + page_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK,
                    -1, 0);
    if (mapping_ == MAP_FAILED) throw std::bad_alloc();
    mprotect(mapping_, page_, PROT_NONE);
  }
  ~Stack() { munmap(mapping_, kStackBytes + page_); }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  void* base() const { return static_cast<char*>(mapping_) + page_; }

 private:
  std::size_t page_;
  void* mapping_;
};

enum class ThreadState { Ready, AtBarrier, AtShuffle, Exited, Faulted };

struct PendingShuffle {
  ShuffleKind kind;
  unsigned int mask;
  int operand;
  int width;
  std::uint64_t bits;
  std::uint64_t result;
};

struct Fiber {
  ucontext_t context;
  ThreadState state;
  bool started;  // has run: its stack holds a kernel's frames
  uint3 index;
  int linear;
  PendingShuffle shuffle;
  void* tsan_fiber;
};

// One block being run on this OS thread.
struct BlockRun {
  void (*body)(void*);
  void* body_context;
  uint3 block_index;
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = -1;  // the fiber running, or -1 in the scheduler
  bool aborting = false;  // a fault stopped the block: waiting threads, when resumed, end at once
  std::string fault;
  cudaError_t fault_error = cudaSuccess;
  char* grid_token;  // TSan: the host's work before the launch and every earlier block's threads
  std::unique_ptr<char[]> sync_tokens;  // TSan: [kBarrierToken], [kDoneToken] (this block's ended threads), warps
  void* scheduler_tsan_fiber = nullptr;
  const void* scheduler_stack_bottom = nullptr;  // ASan
  std::size_t scheduler_stack_size = 0;
  void* scheduler_fake_stack = nullptr;
};

thread_local BlockRun* active = nullptr;

constexpr int kBarrierToken = 0;
constexpr int kDoneToken = 1;
constexpr int kFirstWarpToken = 2;
thread_local std::vector<std::unique_ptr<Stack>> stack_pool;
#if defined(FUSEDOFF_EMULATION_TSAN)
thread_local std::vector<void*> tsan_fiber_pool;  // fiber t of every block: one TSan fiber each
#endif

void tsan_release(void* token) {
#if defined(FUSEDOFF_EMULATION_TSAN)
  __tsan_release(token);
#else
  (void)token;
#endif
}

void tsan_acquire(void* token) {
#if defined(FUSEDOFF_EMULATION_TSAN)
  __tsan_acquire(token);
#else
  (void)token;
#endif
}

std::string hex(unsigned int v) {
  char text[16];
  std::snprintf(text, sizeof(text), "0x%08x", v);
  return text;
}

std::string describe(const uint3& v) {
  return "(" + std::to_string(v.x) + "," + std::to_string(v.y) + "," + std::to_string(v.z) + ")";
}

void switch_to_fiber(BlockRun& run, Fiber& fiber) {
  run.current = fiber.linear;
  threadIdx = fiber.index;
#if defined(FUSEDOFF_EMULATION_ASAN)
  __sanitizer_start_switch_fiber(&run.scheduler_fake_stack, stack_pool[fiber.linear]->base(), kStackBytes);
#endif
#if defined(FUSEDOFF_EMULATION_TSAN)
  __tsan_switch_to_fiber(fiber.tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
  swapcontext(&run.scheduler, &fiber.context);
#if defined(FUSEDOFF_EMULATION_ASAN)
  __sanitizer_finish_switch_fiber(run.scheduler_fake_stack, nullptr, nullptr);
#endif
  run.current = -1;
}

// From the running fiber back to the scheduler; `final`: the fiber is never resumed.
void switch_to_scheduler(BlockRun& run, Fiber& fiber, bool final) {
#if defined(FUSEDOFF_EMULATION_ASAN)
  void* fake_stack = nullptr;
  __sanitizer_start_switch_fiber(final ? nullptr : &fake_stack, run.scheduler_stack_bottom, run.scheduler_stack_size);
#else
  (void)final;
#endif
#if defined(FUSEDOFF_EMULATION_TSAN)
  __tsan_switch_to_fiber(run.scheduler_tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
  swapcontext(&fiber.context, &run.scheduler);
#if defined(FUSEDOFF_EMULATION_ASAN)
  __sanitizer_finish_switch_fiber(fake_stack, &run.scheduler_stack_bottom, &run.scheduler_stack_size);
#endif
}

BlockRun& running_block(const char* what) {
  BlockRun* run = active;
  if (run == nullptr || run->current < 0) {
    std::fprintf(stderr, "fusedoff CUDA emulation: %s called outside a kernel\n", what);
    std::abort();
  }
  return *run;
}

// Stops the calling thread for good: the grid fails with `error` and `text`.
[[noreturn]] void fault(cudaError_t error, const std::string& text) {
  BlockRun& run = running_block("a fault");
  Fiber& fiber = run.fibers[run.current];
  run.fault = "block " + describe(run.block_index) + ", thread " + describe(fiber.index) + ": " + text;
  run.fault_error = error;
  fiber.state = ThreadState::Faulted;
  tsan_release(&run.sync_tokens[kDoneToken]);  // its accesses are done: later blocks come after them
  switch_to_scheduler(run, fiber, true);
  __builtin_unreachable();
}

// A thread resumed at a barrier or a shuffle of a block that a fault stopped: it ends here.
void end_if_aborting(BlockRun& run, Fiber& fiber) {
  if (!run.aborting) return;
  tsan_release(&run.sync_tokens[kDoneToken]);
  fiber.state = ThreadState::Exited;
  switch_to_scheduler(run, fiber, true);
  __builtin_unreachable();
}

void fiber_main() {
  BlockRun& run = *active;
  Fiber& fiber = run.fibers[run.current];
  fiber.started = true;
#if defined(FUSEDOFF_EMULATION_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &run.scheduler_stack_bottom, &run.scheduler_stack_size);
#endif
  tsan_acquire(run.grid_token);
  run.body(run.body_context);
  tsan_release(&run.sync_tokens[kDoneToken]);
  fiber.state = ThreadState::Exited;
  switch_to_scheduler(run, fiber, true);
  __builtin_unreachable();
}

// The source lane of `lane` in a shuffle, or `lane` itself where the source lies outside its
// width segment (CUDA returns the caller's own value there).
int shuffle_source(const PendingShuffle& s, int lane) {
  const int segment = lane & ~(s.width - 1);
  int source = lane;
  switch (s.kind) {
    case ShuffleKind::Index: source = segment + (s.operand & (s.width - 1)); break;
    case ShuffleKind::Xor: source = lane ^ s.operand; break;
    case ShuffleKind::Down: source = lane + s.operand; break;
    case ShuffleKind::Up: source = lane - s.operand; break;
  }
  if (s.kind == ShuffleKind::Up) return source < segment ? lane : source;
  return source >= segment + s.width || source < 0 || source >= 32 ? lane : source;
}

// Completes warp `warp`'s shuffle if every lane its mask names waits at it: returns whether it did.
bool complete_shuffle(BlockRun& run, int warp, int block_threads) {
  const int first = warp * 32;
  const int lanes = std::min(32, block_threads - first);
  const Fiber* leader = nullptr;
  for (int lane = 0; lane < lanes && leader == nullptr; ++lane)
    if (run.fibers[first + lane].state == ThreadState::AtShuffle) leader = &run.fibers[first + lane];
  if (leader == nullptr) return false;
  const PendingShuffle& s = leader->shuffle;
  for (int lane = 0; lane < 32; ++lane) {
    if (((s.mask >> lane) & 1u) == 0) continue;
    if (lane >= lanes) {
      run.fault = "block " + describe(run.block_index) + ", warp " + std::to_string(warp) + ": a shuffle's mask " +
                  hex(s.mask) + " names lane " + std::to_string(lane) + ", which does not exist (the block has " +
                  std::to_string(block_threads) + " threads)";
      run.fault_error = cudaErrorLaunchFailure;
      return false;
    }
    const Fiber& f = run.fibers[first + lane];
    if (f.state != ThreadState::AtShuffle) return false;  // not there (yet)
    if (f.shuffle.kind != s.kind || f.shuffle.mask != s.mask || f.shuffle.width != s.width) {
      run.fault = "block " + describe(run.block_index) + ", warp " + std::to_string(warp) + ": lanes " +
                  std::to_string(leader->linear - first) + " and " + std::to_string(lane) +
                  " wait at different shuffles (their kind, mask or width differ)";
      run.fault_error = cudaErrorLaunchFailure;
      return false;
    }
  }
  for (int lane = 0; lane < lanes; ++lane) {
    if (((s.mask >> lane) & 1u) == 0) continue;
    Fiber& f = run.fibers[first + lane];
    const int source = shuffle_source(f.shuffle, lane);
    if (((s.mask >> source) & 1u) == 0) {
      run.fault = "block " + describe(run.block_index) + ", warp " + std::to_string(warp) + ": lane " +
                  std::to_string(lane) + " reads lane " + std::to_string(source) +
                  ", which the shuffle's mask does not name (undefined on a GPU)";
      run.fault_error = cudaErrorLaunchFailure;
      return false;
    }
    f.shuffle.result = run.fibers[first + source].shuffle.bits;
  }
  for (int lane = 0; lane < lanes; ++lane)
    if ((s.mask >> lane) & 1u) run.fibers[first + lane].state = ThreadState::Ready;
  return true;
}

const char* state_name(ThreadState state) {
  switch (state) {
    case ThreadState::Ready: return "is ready";
    case ThreadState::AtBarrier: return "waits at __syncthreads";
    case ThreadState::AtShuffle: return "waits at a shuffle";
    case ThreadState::Exited: return "has returned";
    case ThreadState::Faulted: return "has faulted";
  }
  return "?";
}

// Why the block can never go on: a lane waiting at a shuffle and a lane its mask names that is
// elsewhere.
std::string deadlock_report(const BlockRun& run, int block_threads) {
  for (int t = 0; t < block_threads; ++t) {
    const Fiber& f = run.fibers[t];
    if (f.state != ThreadState::AtShuffle) continue;
    const int first = t - t % 32;
    for (int lane = 0; lane < 32 && first + lane < block_threads; ++lane) {
      const Fiber& other = run.fibers[first + lane];
      if (((f.shuffle.mask >> lane) & 1u) && other.state != ThreadState::AtShuffle)
        return "block " + describe(run.block_index) + " can never go on: thread " + std::to_string(t) +
               " waits at a shuffle whose mask names thread " + std::to_string(first + lane) + ", which " +
               state_name(other.state) + " (on a GPU: a hang or undefined behaviour)";
    }
  }
  return "block " + describe(run.block_index) + " can never go on (on a GPU: a hang or undefined behaviour)";
}

void run_block(BlockRun& run, int block_threads, std::mt19937_64* rng) {
  const dim3 block = blockDim;
  while (static_cast<int>(stack_pool.size()) < block_threads) stack_pool.push_back(std::make_unique<Stack>());
#if defined(FUSEDOFF_EMULATION_TSAN)
  while (static_cast<int>(tsan_fiber_pool.size()) < block_threads) tsan_fiber_pool.push_back(__tsan_create_fiber(0));
#endif
  run.fibers.assign(static_cast<std::size_t>(block_threads), Fiber{});
  const int warps = (block_threads + 31) / 32;
  run.sync_tokens.reset(new char[kFirstWarpToken + warps]);
  for (int t = 0; t < block_threads; ++t) {
    Fiber& f = run.fibers[t];
    f.linear = t;
    f.state = ThreadState::Ready;
    f.started = false;
    f.index = uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
    void* stack = stack_pool[t]->base();
#if defined(FUSEDOFF_EMULATION_ASAN)
    __asan_unpoison_memory_region(stack, kStackBytes);  // what a fiber that never returned left poisoned
#endif
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_main, 0);
#if defined(FUSEDOFF_EMULATION_TSAN)
    f.tsan_fiber = tsan_fiber_pool[t];
#endif
  }
  std::vector<int> order(static_cast<std::size_t>(block_threads));
  std::iota(order.begin(), order.end(), 0);
  while (run.fault.empty()) {
    if (rng != nullptr) std::shuffle(order.begin(), order.end(), *rng);
    for (const int t : order) {
      if (run.fibers[t].state != ThreadState::Ready) continue;
      switch_to_fiber(run, run.fibers[t]);
      if (!run.fault.empty()) break;
    }
    if (!run.fault.empty()) break;
    bool released = false;
    for (int w = 0; w < warps && run.fault.empty(); ++w) released = complete_shuffle(run, w, block_threads) || released;
    if (!run.fault.empty()) break;
    if (released) continue;
    int exited = 0;
    int at_barrier = 0;
    int first_exited = -1;
    for (const Fiber& f : run.fibers) {
      if (f.state == ThreadState::Exited && exited++ == 0) first_exited = f.linear;
      at_barrier += f.state == ThreadState::AtBarrier;
    }
    if (exited == block_threads) break;  // the block is done
    if (at_barrier + exited == block_threads) {
      if (exited > 0) {
        run.fault = "block " + describe(run.block_index) + ": thread " + std::to_string(first_exited) +
                    (exited > 1 ? " (and " + std::to_string(exited - 1) + " more)" : std::string()) +
                    " returned while " + std::to_string(at_barrier) +
                    " threads wait at __syncthreads (on a GPU: a hang or undefined behaviour)";
        run.fault_error = cudaErrorLaunchFailure;
        break;
      }
      for (Fiber& f : run.fibers) f.state = ThreadState::Ready;
      continue;
    }
    run.fault = deadlock_report(run, block_threads);
    run.fault_error = cudaErrorLaunchFailure;
  }
  if (run.fault.empty()) return;
  // Let every thread still inside the kernel end, so that (for TSan) its accesses come before the
  // host's next launch; none of them runs any more of the kernel.
  run.aborting = true;
  for (Fiber& f : run.fibers)
    if (f.started && f.state != ThreadState::Exited && f.state != ThreadState::Faulted) switch_to_fiber(run, f);
}

// Runs one block on the calling OS thread; returns its fault, if any.
void run_block_here(BlockRun& run, uint3 block_index, int block_threads, std::mt19937_64* rng) {
  BlockRun* const outer = active;
  active = &run;
  run.block_index = block_index;
  blockIdx = block_index;
#if defined(FUSEDOFF_EMULATION_TSAN)
  run.scheduler_tsan_fiber = __tsan_get_current_fiber();
#endif
  run_block(run, block_threads, rng);
  active = outer;
}

}  // namespace

void set_schedule_seed(std::uint64_t seed) { schedule_seed.store(seed); }

std::uint64_t launch_count() { return launches.load(); }

void run_grid(const LaunchShape& shape, void (*thread_body)(void*), void* context) {
  launches.fetch_add(1);
  const unsigned int block_dims[3] = {shape.block.x, shape.block.y, shape.block.z};
  const unsigned int grid_dims[3] = {shape.grid.x, shape.grid.y, shape.grid.z};
  const std::uint64_t threads = static_cast<std::uint64_t>(shape.block.x) * shape.block.y * shape.block.z;
  for (int d = 0; d < 3; ++d) {
    if (block_dims[d] == 0 || block_dims[d] > kMaxBlockDim[d] || grid_dims[d] == 0 || grid_dims[d] > kMaxGridDim[d]) {
      set_error(cudaErrorInvalidConfiguration, "launch of grid " + describe({grid_dims[0], grid_dims[1], grid_dims[2]}) +
                                                   " x block " + describe({block_dims[0], block_dims[1], block_dims[2]}) +
                                                   ": a dimension is 0 or past the device's limit");
      return;
    }
  }
  if (threads > kMaxThreadsPerBlock) {
    set_error(cudaErrorInvalidConfiguration,
              "a block of " + std::to_string(threads) + " threads (at most " + std::to_string(kMaxThreadsPerBlock) + ")");
    return;
  }
  if (shape.param_bytes > kMaxParamBytes) {
    set_error(cudaErrorInvalidValue, "kernel parameters of " + std::to_string(shape.param_bytes) +
                                         " bytes, past the " + std::to_string(kMaxParamBytes) + "-byte limit");
    return;
  }
  const std::uint64_t blocks = static_cast<std::uint64_t>(shape.grid.x) * shape.grid.y * shape.grid.z;
  const std::uint64_t seed = schedule_seed.load();
  std::unique_ptr<std::mt19937_64> rng = seed != 0 ? std::make_unique<std::mt19937_64>(seed) : nullptr;
  // A seeded run permutes the blocks of grids small enough to list; larger grids start at a drawn block.
  std::vector<std::uint64_t> order;
  std::uint64_t rotation = 0;
  if (rng && blocks <= (1u << 20)) {
    order.resize(blocks);
    std::iota(order.begin(), order.end(), std::uint64_t{0});
    std::shuffle(order.begin(), order.end(), *rng);
  } else if (rng) {
    rotation = (*rng)() % blocks;
  }
  char grid_token = 0;
  tsan_release(&grid_token);
  const dim3 caller_grid = gridDim;
  const dim3 caller_block = blockDim;
  for (std::uint64_t i = 0; i < blocks; ++i) {
    const std::uint64_t b = order.empty() ? (i + rotation) % blocks : order[i];
    const uint3 block_index{static_cast<unsigned int>(b % shape.grid.x),
                            static_cast<unsigned int>((b / shape.grid.x) % shape.grid.y),
                            static_cast<unsigned int>(b / (static_cast<std::uint64_t>(shape.grid.x) * shape.grid.y))};
    BlockRun run;
    run.body = thread_body;
    run.body_context = context;
    run.grid_token = &grid_token;
    gridDim = shape.grid;
    blockDim = shape.block;
    run_block_here(run, block_index, static_cast<int>(threads), rng.get());
    // The next block's threads (and the host, after the grid) come after this block's.
    tsan_acquire(&run.sync_tokens[kDoneToken]);
    tsan_release(&grid_token);
    if (!run.fault.empty()) {
      set_error(run.fault_error, run.fault);
      break;
    }
  }
  gridDim = caller_grid;
  blockDim = caller_block;
}

void sync_threads() {
  BlockRun& run = running_block("__syncthreads");
  Fiber& fiber = run.fibers[run.current];
  tsan_release(&run.sync_tokens[kBarrierToken]);
  fiber.state = ThreadState::AtBarrier;
  switch_to_scheduler(run, fiber, false);
  end_if_aborting(run, fiber);
  tsan_acquire(&run.sync_tokens[kBarrierToken]);
}

std::uint64_t warp_shuffle(ShuffleKind kind, unsigned int mask, std::uint64_t bits, int operand, int width) {
  BlockRun& run = running_block("a warp shuffle");
  Fiber& fiber = run.fibers[run.current];
  const int lane = fiber.linear % 32;
  if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
    fault(cudaErrorLaunchFailure, "a shuffle of width " + std::to_string(width) + " (a power of 2 up to 32)");
  if (((mask >> lane) & 1u) == 0)
    fault(cudaErrorLaunchFailure, "lane " + std::to_string(lane) + " calls a shuffle whose mask " + hex(mask) +
                                      " does not name it (undefined on a GPU)");
  fiber.shuffle = PendingShuffle{kind, mask, operand, width, bits, 0};
  char* const token = &run.sync_tokens[kFirstWarpToken + fiber.linear / 32];
  tsan_release(token);
  fiber.state = ThreadState::AtShuffle;
  switch_to_scheduler(run, fiber, false);
  end_if_aborting(run, fiber);
  tsan_acquire(token);
  return fiber.shuffle.result;
}

void check_vector_access(const void* address, int bytes) {
  if (reinterpret_cast<std::uintptr_t>(address) % static_cast<std::uintptr_t>(bytes) == 0) return;
  char text[96];
  std::snprintf(text, sizeof(text), "a %d-byte access at %p, which is not %d-byte aligned", bytes, address, bytes);
  fault(cudaErrorMisalignedAddress, text);
}

}  // namespace emulation
}  // namespace fusedoff

cudaError_t cudaGetLastError() {
  const cudaError_t error = last_error;
  last_error = cudaSuccess;
  return error;
}

cudaError_t cudaPeekAtLastError() { return last_error; }

const char* cudaGetErrorString(cudaError_t error) {
  if (error != cudaSuccess && error == message_error) return message.c_str();
  return fusedoff::emulation::standard_error_string(error);
}

// mbarrier wrappers (sm_90): the shared-memory barriers that TMA loads complete on and that
// consumers and producers use to hand pipeline stages to each other.
//
// An mbarrier is a 64-bit object in shared memory. It holds an expected arrival count, the
// arrivals still pending in the current phase, a transaction count (bytes still expected from
// asynchronous copies) and the parity of the current phase. A phase completes when both its
// pending arrivals and its transaction count reach zero; the barrier then flips its phase bit and
// reloads the arrival count. Waiting is by parity: try_wait.parity(p) succeeds once the phase
// with parity p has completed, so a waiter that has already seen u completions of a barrier waits
// with parity u & 1. The phase before the first (parity 1) counts as completed: a wait on parity 1
// of a fresh barrier returns at once.
#pragma once
#include "common/smem.cuh"
#include "common/types.cuh"

namespace cuflash {
namespace sm90 {

typedef unsigned long long u64;

// One thread initialises each barrier, before any thread uses it; `count` arrivals (each arrive
// and each arrive_expect_tx counts one) complete a phase, together with the transaction bytes.
__device__ __forceinline__ void mbarrier_init(u64* bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// After the initialising thread's mbarrier_init calls, and before the CTA barrier that publishes
// them: fence.mbarrier_init orders the init writes before later arrivals (it is the light-weight
// release made for exactly this), and the proxy fence makes the initialised barrier visible to
// the async proxy, whose TMA copies complete transactions on it (the CUDA programming guide's
// TMA example fences here for that reason).
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Orders this thread's earlier generic-proxy shared-memory writes (ordinary stores, stmatrix)
// before later async-proxy accesses (TMA stores, wgmma operand reads) that a barrier hands them
// to; each writing thread fences before that barrier.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// One arrival (release semantics at CTA scope: this thread's earlier memory accesses, the reads
// of a stage being handed back included, happen before the phase completes).
__device__ __forceinline__ void mbarrier_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One arrival that also raises the transaction count by `bytes`: the producer's announcement of
// the TMA copies it is about to issue on this barrier. The phase cannot complete before those
// copies have delivered every byte, whichever of arrival and completion comes first.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Whether the phase with parity `parity` has completed. try_wait (not test_wait) may suspend the
// thread for a while in hardware before answering no, which spares issue slots while spinning.
// Acquire semantics: after a yes, the data the completing copies or arrivals released is visible.
// The "memory" clobber keeps the compiler from hoisting shared-memory loads above the wait.
__device__ __forceinline__ bool mbarrier_try_wait(u64* bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Blocks until the phase with parity `parity` has completed. The loop is in C++ rather than a
// PTX branch so that no label is duplicated when this is inlined many times.
__device__ __forceinline__ void mbarrier_wait(u64* bar, u32 parity) {
  while (!mbarrier_try_wait(bar, parity)) {
  }
}

// Named CTA barrier (bar.sync with an id and a thread count): a barrier among a subset of warps,
// such as one warpgroup. Id 0 is __syncthreads'; the count is a multiple of 32. It waits until
// `threads` threads have arrived at `id` and orders their shared-memory accesses as
// __syncthreads does.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Counts this warp towards named barrier `id` of `threads` threads without waiting for it: the
// signalling half of a producer/consumer pair of warps on one named barrier.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace sm90
}  // namespace cuflash
